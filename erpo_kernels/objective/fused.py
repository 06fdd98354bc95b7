"""erpo_loss's fused path (3 GEMMs of work): the loss's gradient formed during the forward
pass, a chunk of whole sequences at a time, from logits computed once per chunk
(erpo_kernels/fused_linear_loss.py); the backward only scales what the forward formed.

Per chunk of rows [r0, r1) (micro_batches.row_chunks: whole sequences, at most
rows_for_budget(fused_budget, V, dtype) rows: budget // (2 V) for bf16 / fp16 operands,
budget // (4 V) for fp32; the whole batch when it fits, with no host read):
    1. the kernels: logp_k, entropy_k [rows] (the chunk's logits kept: fp16 relative to
       their part's running max for bf16 / fp16 operands, fp32 for fp32);
    2. the chunk's loss from detached leaves logp_k, entropy_k, normalised by the whole
       batch's LossNormalizers (the caller's, or LossNormalizers.of(batch)): the chunks'
       losses then add up to the batch's exactly (docs/method.md section 10, the same
       argument as for micro-batches);
    3. g_logp, g_entropy [rows] = d loss_k / d (logp_k, entropy_k) by autograd over the
       [rows] vectors;
    4. d_hidden[r0:r1], and d_weight, d_bias added over the chunks, from the kept logits.
The returned loss is the chunks' sum through `_ScaledGradients`, whose backward returns
the saved gradients times the upstream gradient (no host read). Metrics combine as micro-batches'
(combine_metrics).

A bf16 / fp16 d_weight of several row chunks is accumulated in fp32 [V, D]; it is kept so
until the backward, whose scaling writes the weight's dtype from it in one pass (reads 4 V D
bytes, writes 2 V D) instead of a cast at the end of the forward and a scaling of the cast
copy (6 + 4 V D bytes), and rounds once (the upstream gradient applied in fp32). The trade:
between the forward and the backward the graph holds 4 V D bytes for d_weight instead of
2 V D (2.5 GB instead of 1.25 at V = 151,936, D = 4096). The peak is not higher on a GPU
while the chunk's kept logits (rows x V x 2 bytes in bf16, up to the budget: 1 GiB by
default) outweigh d_hidden (N x D x 2), as at every shape of the cost table (about 1 GB
against 64 MB at 8192 x 4096): the cast held the
fp32 buffer, its copy and the kept logits at once, the backward holds the buffer, its
output and two d_hidden (on a CPU, PyTorch's mixed-dtype out= adds an fp32 temporary).
One chunk writes d_weight in its own dtype.

Which calls take it (`fused_path_reason`, docs/objective.md): a gradient is wanted
(grad mode on, hidden / weight / bias requiring grad); eager (not while torch.compile
traces); a plain weight (not a DTensor); the Triton backend; a chunk-local policy loss
(not registered batch_wide: clip_cov's and kl_cov's rankings read every token of the
call); top_entropy_quantile = 1, or a threshold given by the normalizers
(LossNormalizers.entropy_threshold; else the selection ranks every token of the call);
fused_budget != 0. Every other call, and one whose sequences are longer than a chunk,
runs linear_token_logprobs + erpo_loss_from_logp + autograd (4 GEMMs).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..fused_linear_loss import DEFAULT_FUSED_BUDGET, LinearLogprobsChunks, kept_logits_refusal, rows_for_budget
from ..linear_token_logprobs import operand_dtype
from ..tiles import Tiles
from .batch import LossNormalizers, PackedLossBatch
from .config import LossConfig
from .metrics import combine_metrics
from .micro_batches import row_chunks
from .registry import is_batch_wide

LossFn = Callable[..., Tuple[torch.Tensor, Dict[str, torch.Tensor]]]


def check_fused_budget(fused_budget: Optional[int]) -> int:
    """The budget in bytes (None: DEFAULT_FUSED_BUDGET); ValueError unless an int >= 0."""
    if fused_budget is None:
        return DEFAULT_FUSED_BUDGET
    if isinstance(fused_budget, bool) or not isinstance(fused_budget, int) or fused_budget < 0:
        raise ValueError(f"fused_budget must be None or an int >= 0 (bytes; 0: the 4-GEMM path), got {fused_budget!r}")
    return fused_budget


def fused_path_reason(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], config: LossConfig,
    normalizers: Optional[LossNormalizers], backend: str, fused_budget: int,
) -> Optional[str]:
    """None when erpo_loss takes the fused path for these arguments, else why it does not
    (module docstring). Reads no tensor value."""
    reason = kept_logits_refusal(hidden, weight, bias, backend, fused_budget)
    if reason is not None:
        return reason
    if is_batch_wide(config.policy_loss):
        return f"policy_loss={config.policy_loss!r} is batch-wide"
    if config.top_entropy_quantile < 1 and (normalizers is None or normalizers.entropy_threshold is None):
        return "top_entropy_quantile < 1 without normalizers.entropy_threshold"
    return None


def _scaled(g: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """g times the 0-d upstream gradient, in `dtype`: out of place; an fp32 accumulator of a
    lower-precision gradient is scaled in fp32 and rounded to `dtype` in the same pass."""
    if g.dtype == dtype:
        return g * grad.to(dtype)
    if grad.requires_grad:  # create_graph=True: out= ops are not differentiable
        return (g * grad.to(g.dtype)).to(dtype)
    return torch.mul(g, grad.to(g.dtype), out=torch.empty(g.shape, dtype=dtype, device=g.device))


class _ScaledGradients(torch.autograd.Function):
    """loss -> loss, with the gradients formed in the forward pass (d_weight and d_bias may
    be fp32 accumulators of lower-precision operands; dtypes: the operands' (hidden, weight,
    bias) dtypes): backward returns them times the upstream gradient in those dtypes (a 0-d
    tensor on the device: no host read; out of place, so a graph kept with retain_graph=True
    gives the same gradients again)."""

    @staticmethod
    def forward(ctx, loss, dtypes, hidden, weight, bias, d_hidden, d_weight, d_bias):  # type: ignore[override]
        ctx.save_for_backward(d_hidden, d_weight, d_bias)
        ctx.dtypes = dtypes
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out = [None if g is None else _scaled(g, grad, dtype) for g, dtype in zip(ctx.saved_tensors, ctx.dtypes)]
        return (None, None, *out, None, None, None)


def fused_erpo_loss(
    loss_fn: LossFn, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
    batch: PackedLossBatch, config: LossConfig, *, backend: str, with_entropy: bool,
    normalizers: Optional[LossNormalizers], softcap: Optional[float], logit_scale: Optional[float],
    fused_budget: int, tiles: Optional[Tiles],
) -> Optional[Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
    """(loss, metrics as 0-d tensors) by the fused path, or None when a sequence is longer
    than a chunk (the caller then takes the 4-GEMM path). loss_fn: erpo_loss_from_logp's
    body (_loss_from_logp) on a checked batch."""
    chunks = row_chunks(batch, rows_for_budget(fused_budget, weight.shape[0], operand_dtype(hidden)))
    if chunks is None:
        return None
    norm = normalizers if normalizers is not None else LossNormalizers.of(batch)
    need = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    op = LinearLogprobsChunks(
        hidden, weight, bias, max_rows=max(r1 - r0 for r0, r1, _ in chunks), n_chunks=len(chunks), need=need,
        softcap=softcap, logit_scale=logit_scale, ignore_index=batch.ignore_index, tiles=tiles,
    )
    total: Optional[torch.Tensor] = None
    parts: List[Dict[str, torch.Tensor]] = []
    for r0, r1, chunk in chunks:
        with torch.no_grad():
            logp, entropy = op.forward(r0, r1, chunk.targets, chunk.inv_temperature, with_entropy, chunk.support)
        with torch.enable_grad():
            logp = logp.requires_grad_()
            if entropy is not None:
                entropy = entropy.requires_grad_()
            loss, metrics = loss_fn(logp, chunk, config, entropy, backend, norm)
            leaves = [logp] + ([entropy] if entropy is not None else [])
            grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else [None] * len(leaves)
        g_logp = grads[0] if grads[0] is not None else torch.zeros_like(logp)
        op.backward(g_logp, grads[1] if len(grads) > 1 else None)
        total = loss.detach() if total is None else total + loss.detach()
        parts.append(metrics)
    metrics = combine_metrics(parts)  # "loss": the chunks' sum, as `total`
    d_hidden, d_weight, d_bias = op.gradients(cast=False)  # rounded in the backward's scaling pass
    return _ScaledGradients.apply(total, op.dtypes, hidden, weight, bias, d_hidden, d_weight, d_bias), metrics
