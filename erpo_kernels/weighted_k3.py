"""weighted_k3: the weighted, guarded K3 estimate of the Query-KL (erpo-method.md s.2).

Kernels, then the autograd Function, then the public function.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import reference
from ._triton import tl, triton
from ._utils import FLOAT_DTYPES, check_rows, check_tensor, resolve_backend

# TRITON KERNELS GO HERE (issue 2)


def _weighted_k3_triton(
    logp: torch.Tensor, ref_logp: torch.Tensor, weight: Optional[torch.Tensor], guard: float
) -> torch.Tensor:
    raise NotImplementedError("triton path of weighted_k3 is being written")


def weighted_k3(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    *,
    guard: float = 10.0,
    backend: str = "auto",
) -> torch.Tensor:
    """R = sum_q w(q) k3(ref_logp(q) - logp(q)) / sum_q w(q), a scalar.

    k3(d) = exp(d) - d - 1, continued linearly for d > guard (convex, C1, bounded
    gradient). Args: logp [M] (e.g. query_logp), ref_logp [M] (ref_query_logp),
    weight [M] or None (all ones), float tensors on one device. Gradients flow to all
    three.
    """
    check_tensor("logp", logp, ndim=1, dtypes=FLOAT_DTYPES)
    check_tensor("ref_logp", ref_logp, ndim=1, dtypes=FLOAT_DTYPES, device=logp.device)
    check_rows("ref_logp", ref_logp, logp.shape[0])
    if weight is not None:
        check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=logp.device)
        check_rows("weight", weight, logp.shape[0])
    guard = float(guard)
    if not guard > 0 or guard == float("inf"):
        raise ValueError(f"guard must be positive and finite, got {guard}")
    if resolve_backend(backend, logp) == "torch":
        return reference.weighted_k3(logp, ref_logp, weight, guard=guard)
    return _weighted_k3_triton(logp, ref_logp, weight, guard)
