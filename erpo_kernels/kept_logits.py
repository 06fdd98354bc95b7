"""Token log-probs for a peer whose loss runs after the forward (verl's actor, TRL's
loss types behind its fused LM head): the backward reuses the forward's logits, so the
lm_head does 3 GEMMs of work where linear_token_logprobs' forward + backward does 4.

erpo_loss's fused path (erpo_kernels/objective/fused.py) forms the loss's gradient during
the forward, a chunk at a time, because erpo_loss knows the loss there. A peer that
calls its own loss on the forward's log-probs (verl: FSDPEngineWithLMHead.forward_step
runs the model, then loss_function, then backward; TRL: its _compute_loss on the fused
head's log-probs) gives the per-row coefficients only in
the backward. What still saves the recompute is to keep the call's logits until then:
`kept_linear_token_logprobs` runs erpo_kernels.fused_linear_loss.LinearLogprobsChunks as
one chunk of every row (the forward kernel storing the logits it softmaxes: fp32 for fp32
operands, fp16 relative to their part's running max for bf16 / fp16, fused_linear_loss.py),
and its backward forms the softmax gradient from them and does the two products. The kept
logits are N x V values (4 or 2 bytes) between the forward and its backward, so this
applies only when they fit `fused_budget` bytes; else, and wherever erpo_loss's fused path would not run (no
gradient wanted, torch.compile, a DTensor weight, the torch backend), the call is
linear_token_logprobs (4 GEMMs). The log-probs and entropy equal linear_token_logprobs'
(the same forward), and so do the gradients for fp32 operands (the kept logits are the
forward's fp32 values bit for bit); for bf16 / fp16 the gradients differ from its
recompute by the fp16 rounding of s - m (within the dtype's gradient tolerance against
float64; tests/test_kept_logits.py).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from ._utils import check_targets
from .fused_linear_loss import LinearLogprobsChunks, kept_dtype, kept_logits_refusal
from .linear_token_logprobs import linear_token_logprobs, operand_dtype
from .logit_transform import LogitTransform

KEPT_PATH = "kept logits (3 GEMMs)"
COMPOSED_PATH = "linear_token_logprobs (4 GEMMs)"


def kept_logits_reason(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], backend: str,
                       fused_budget: int) -> Optional[str]:
    """None when kept_linear_token_logprobs keeps the logits for these arguments, else why
    it calls linear_token_logprobs (module docstring). Reads no tensor value."""
    reason = kept_logits_refusal(hidden, weight, bias, backend, fused_budget)
    if reason is not None:
        return reason
    kept = kept_dtype(operand_dtype(hidden)).itemsize * hidden.shape[0] * weight.shape[0]
    if kept > fused_budget:
        return f"the call's {hidden.shape[0]} rows keep {kept >> 20} MiB of logits, over the {fused_budget >> 20} MiB budget"
    return None


class _KeptLogits(torch.autograd.Function):
    """(logp [N], entropy [N]) with the logits kept from the forward for the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inv_temperature, softcap, logit_scale, ignore_index):  # type: ignore[override]
        need = tuple(bool(x) for x in ctx.needs_input_grad[:3])
        op = LinearLogprobsChunks(hidden, weight, bias, max_rows=hidden.shape[0], n_chunks=1, need=need,
                                  softcap=softcap, logit_scale=logit_scale, ignore_index=ignore_index)  # fmt: skip
        logp, entropy = op.forward(0, hidden.shape[0], targets, inv_temperature, True)
        ctx.op = op
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):  # type: ignore[override]
        op, ctx.op = ctx.op, None  # the kept logits go with it
        if g_logp is None:
            g_logp = torch.zeros(op.hidden.shape[0], dtype=torch.float32, device=op.hidden.device)
        op.backward(g_logp, g_entropy)
        d_hidden, d_weight, d_bias = op.gradients()
        return d_hidden, d_weight, d_bias, None, None, None, None, None


def kept_linear_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
    inv_temperature: Union[float, torch.Tensor, None] = None, ignore_index: int = -100, backend: str = "auto",
    softcap: Optional[float] = None, logit_scale: Optional[float] = None, fused_budget: int = 1 << 30,
) -> Tuple[torch.Tensor, torch.Tensor, str]:
    """linear_token_logprobs(..., return_entropy=True) whose backward reuses the forward's
    logits when they fit fused_budget bytes (module docstring).

    hidden [N, D], weight [V, D], bias [V] or None, targets [N] (ignore_index: no token),
    inv_temperature a float or [N]; softcap, logit_scale as linear_token_logprobs'.
    Returns (logp [N] fp32, entropy [N] fp32, the path: KEPT_PATH, or COMPOSED_PATH with
    the reason in parentheses).
    """
    reason = kept_logits_reason(hidden, weight, bias, backend, fused_budget)
    if reason is not None:
        logp, entropy = linear_token_logprobs(
            hidden, weight, targets, bias=bias, inv_temperature=inv_temperature, ignore_index=ignore_index,
            return_entropy=True, backend=backend, softcap=softcap, logit_scale=logit_scale,
        )
        return logp, entropy, f"{COMPOSED_PATH} ({reason})"
    check_targets(targets, hidden.shape[0], weight.shape[0], ignore_index, hidden.device)
    LogitTransform.build(inv_temperature, hidden.shape[0], hidden.device, softcap=softcap, logit_scale=logit_scale)
    logp, entropy = _KeptLogits.apply(hidden, weight, bias, targets, inv_temperature, softcap, logit_scale,
                                      ignore_index)  # fmt: skip
    return logp, entropy, KEPT_PATH


__all__: Any = ["COMPOSED_PATH", "KEPT_PATH", "kept_linear_token_logprobs", "kept_logits_reason"]
