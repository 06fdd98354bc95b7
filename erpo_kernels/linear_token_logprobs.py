"""linear_token_logprobs: log-probs and entropy straight from hidden states and the
lm_head weight, never materialising [N, V].

Kernels, then the autograd Function, then the public function.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import reference
from ._triton import tl, triton
from ._utils import check_rows, check_targets, check_tensor, resolve_backend, row_inv_temperature

# TRITON KERNELS GO HERE (issue 3)


def _linear_token_logprobs_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    inv_t: torch.Tensor,
    ignore_index: int,
    return_entropy: bool,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    raise NotImplementedError("triton path of linear_token_logprobs is being written")


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    inv_temperature: Union[None, float, torch.Tensor] = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    backend: str = "auto",
):
    """Log-probability of each row's target under softmax((hidden @ weight.T + bias) * inv_T).

    Args:
        hidden: [N, D] fp16, bf16 or fp32 (fp64 on the torch backend).
        weight: [V, D], the lm_head weight, same dtype as hidden.
        targets: [N] int32/int64 in [0, V) or ignore_index. Ignored rows are skipped
            (they cost nothing), return 0 and get zero gradient.
        bias: optional [V], same dtype as hidden.
        inv_temperature: None, a float, or a [N] tensor (runtime value).
        return_entropy: also return the full-vocabulary entropy of each row.
        backend: "auto" (Triton on CUDA, the reference elsewhere), "triton" or "torch".
    Returns:
        logp [N] fp32 (fp64 for fp64 inputs), and entropy [N] when return_entropy.
        Gradients flow to hidden, weight and bias.
    """
    check_tensor("hidden", hidden, ndim=2, dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64))
    check_tensor("weight", weight, ndim=2, dtypes=(hidden.dtype,), device=hidden.device)
    n, d = hidden.shape
    vocab = weight.shape[0]
    if weight.shape[1] != d:
        raise ValueError(f"weight has D = {weight.shape[1]} columns but hidden has D = {d}")
    if vocab < 1:
        raise ValueError("weight must have at least one row (V >= 1)")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(hidden.dtype,), device=hidden.device)
        check_rows("bias", bias, vocab)
    check_targets(targets, n, vocab, ignore_index, hidden.device)
    inv_t = row_inv_temperature(inv_temperature, n, hidden.device)
    which = resolve_backend(backend, hidden)
    if which == "triton" and hidden.dtype == torch.float64:
        if backend == "triton":
            raise ValueError("hidden: the triton backend takes fp16, bf16 or fp32; use backend='torch' for fp64")
        which = "torch"
    if which == "torch":
        return reference.linear_token_logprobs(
            hidden,
            weight,
            targets,
            bias=bias,
            inv_temperature=inv_t,
            ignore_index=ignore_index,
            return_entropy=return_entropy,
        )
    logp, entropy = _linear_token_logprobs_triton(hidden, weight, bias, targets, inv_t, ignore_index, return_entropy)
    return (logp, entropy) if return_entropy else logp
