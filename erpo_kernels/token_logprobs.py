"""token_logprobs: fused log-softmax + gather (+ entropy) over logits [N, V].

Kernels, then the autograd Function, then the public function.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import reference
from ._triton import tl, triton
from ._utils import FLOAT_DTYPES, check_targets, check_tensor, resolve_backend, row_inv_temperature

# TRITON KERNELS GO HERE (issue 2)


def _token_logprobs_triton(
    logits: torch.Tensor,
    targets: torch.Tensor,
    inv_t: torch.Tensor,
    ignore_index: int,
    return_entropy: bool,
    inplace_backward: bool,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    raise NotImplementedError("triton path of token_logprobs is being written")


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    inv_temperature: Union[None, float, torch.Tensor] = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    inplace_backward: bool = False,
    backend: str = "auto",
):
    """Log-probability of each row's target under softmax(logits * inv_temperature).

    Args:
        logits: [N, V] fp16, bf16 or fp32 (fp64 on the torch backend).
        targets: [N] int32/int64 in [0, V), or ignore_index (that row returns 0 and
            gets a zero gradient).
        inv_temperature: None (1), a float, or a [N] tensor: prompt rows at 1 and
            response rows at 1/tau in one launch. A runtime value, never recompiles.
        return_entropy: also return the full-vocabulary entropy of each row.
        inplace_backward: write the gradient into the logits' storage instead of a new
            [N, V] buffer (the logits must not be needed after backward).
        backend: "auto" (Triton on CUDA, the reference elsewhere), "triton" or "torch".
    Returns:
        logp [N] fp32 (fp64 for fp64 logits), and entropy [N] when return_entropy.
    """
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    n, vocab = logits.shape
    if vocab < 1:
        raise ValueError("logits must have at least one column (V >= 1)")
    check_targets(targets, n, vocab, ignore_index, logits.device)
    inv_t = row_inv_temperature(inv_temperature, n, logits.device)
    which = resolve_backend(backend, logits)
    if which == "triton" and logits.dtype == torch.float64:
        if backend == "triton":
            raise ValueError("logits: the triton backend takes fp16, bf16 or fp32; use backend='torch' for fp64")
        which = "torch"
    if which == "torch":
        return reference.token_logprobs(
            logits,
            targets,
            inv_temperature=inv_t,
            ignore_index=ignore_index,
            return_entropy=return_entropy,
            inplace_backward=inplace_backward,
        )
    logp, entropy = _token_logprobs_triton(logits, targets, inv_t, ignore_index, return_entropy, inplace_backward)
    return (logp, entropy) if return_entropy else logp
