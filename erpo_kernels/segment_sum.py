"""segment_sum: per-segment sums over packed sequences (cu_seqlens), backward a gather.

Kernels, then the autograd Function, then the public function.
"""
from __future__ import annotations

import torch

from . import reference
from ._triton import tl, triton
from ._utils import FLOAT_DTYPES, check_cu_seqlens, check_tensor, resolve_backend

# TRITON KERNELS GO HERE (issue 2)


def _segment_sum_triton(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError("triton path of segment_sum is being written")


def segment_sum(values: torch.Tensor, cu_seqlens: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Sum `values` over each segment [cu_seqlens[s], cu_seqlens[s + 1]).

    Args:
        values: [N] float (fp16/bf16/fp32/fp64).
        cu_seqlens: [S + 1] int32/int64, non-decreasing, within [0, N].
        backend: "auto", "triton" or "torch".
    Returns:
        [S] in values' dtype; empty segments give 0. The gradient of each value is the
        upstream gradient of its segment (0 outside every segment).
    """
    check_tensor("values", values, ndim=1, dtypes=FLOAT_DTYPES)
    check_cu_seqlens(cu_seqlens, values.shape[0], values.device)
    if resolve_backend(backend, values) == "torch":
        return reference.segment_sum(values, cu_seqlens)
    return _segment_sum_triton(values, cu_seqlens)
