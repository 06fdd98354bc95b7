"""token_logprobs: fused log-softmax + gather (+ entropy) over logits [N, V].

Kernels, then the autograd Function, then the public function.

Per row, with z the logits, inv_T the row's inverse temperature and M = max_j z_j:
    u_j = (z_j - M) * inv_T            (scaled logits shifted by their maximum, <= 0)
    D   = sum_j exp(u_j),  log_norm = log D,  p_j = exp(u_j - log_norm)
    logp    = u_target - log_norm      (= s_target - lse with s = inv_T z)
    entropy = log_norm - sum_j p_j u_j (= lse - sum_j p_j s_j)
The maximum is taken in logit units and subtracted *before* scaling: z_j - M is exact
for the logits that carry the probability mass, so logits of magnitude 1e4 keep full
fp32 accuracy (scaling first would cost ~1e-3 absolute there). Forward saves M and
log_norm per row (lse = inv_T M + log_norm); backward recomputes p blockwise.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch.autograd.function import once_differentiable

from . import reference
from ._triton import interpreting, round_to, tl, triton
from ._utils import (
    FLOAT_DTYPES,
    check_targets,
    check_tensor,
    no_autocast,
    resolve_kernel_backend,
    row_inv_temperature,
)

# Launch shape, one program per row. Large vocabularies stream the row in blocks:
# forward 8192 columns with 8 warps (32 values per thread: the three block reductions
# per step cost less per value than at 16: ~13 sm_90 SASS instructions per bf16 logit
# with the entropy and ~10 without, against ~15.5 and ~12 at 16 per thread); backward
# 4096 columns with 8 warps (16 per thread: it has no reductions, and fewer registers
# keep more rows in flight).
# V = 151,936 takes 19 forward and 38 backward steps. Small vocabularies use one block
# of next_power_of_2(V). Tests lower the caps to run several blocks on tiny rows.
FWD_MAX_BLOCK_V = 8192
BWD_MAX_BLOCK_V = 4096
FWD_VALUES_PER_THREAD = 32
BWD_VALUES_PER_THREAD = 16


@triton.jit
def _token_logprobs_fwd_kernel(
    logits_ptr,  # [N, V] fp16/bf16/fp32, unit column stride
    targets_ptr,  # [N] int32/int64
    inv_t_ptr,  # [N] fp32
    logp_ptr,  # [N] fp32 out
    entropy_ptr,  # [N] fp32 out (unused unless RETURN_ENTROPY)
    row_max_ptr,  # [N] fp32 out: M, the row's max logit (saved for backward)
    log_norm_ptr,  # [N] fp32 out: log sum_j exp((z_j - M) inv_T) (saved for backward)
    vocab,
    stride_row,
    ignore_index,
    RETURN_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row).to(tl.int64)
    if target == ignore_index:
        tl.store(logp_ptr + row, 0.0)
        tl.store(row_max_ptr + row, 0.0)
        tl.store(log_norm_ptr + row, 0.0)
        if RETURN_ENTROPY:
            tl.store(entropy_ptr + row, 0.0)
    else:
        inv_t = tl.load(inv_t_ptr + row)
        inv_t2 = inv_t * 1.4426950408889634  # inv_T / ln 2: exponents in base 2 (exp2 saves a multiply)
        row_ptr = logits_ptr + row * stride_row
        cols = tl.arange(0, BLOCK_V)
        # Online softmax over blocks, in base 2 relative to the running max m (logit units):
        #   d = sum_j 2^(u_j),  t = sum_j 2^(u_j) u_j,  u_j = (z_j - m) inv_T / ln 2 <= 0.
        m = float("-inf")
        d = 0.0
        t = 0.0
        for start in range(0, vocab, BLOCK_V):
            offs = start + cols
            z = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # finite even while all is -inf
            u = (z - m_ref) * inv_t2
            if RETURN_ENTROPY:
                # -inf logits give u = -3e38 (not -inf): 2^u u = 0, never 0 * -inf.
                u = tl.maximum(u, -3.0e38)
            e = tl.exp2(u)
            # Rescale what was summed relative to m: 2^(u + shift), shift = (m - m_ref) inv_T / ln 2.
            shift = tl.where(m > float("-inf"), (m - m_ref) * inv_t2, 0.0)
            alpha = tl.where(m > float("-inf"), tl.exp2(shift), 0.0)
            if RETURN_ENTROPY:
                t = alpha * (t + d * shift) + tl.sum(e * u, axis=0)
            d = d * alpha + tl.sum(e, axis=0)
            m = m_ref
        # d >= 1 (the max term is 2^0), so log_norm >= 0 and logp <= 0, entropy >= 0 exactly.
        log_norm = tl.log(d)
        z_t = tl.load(row_ptr + target).to(tl.float32)
        tl.store(logp_ptr + row, (z_t - m) * inv_t - log_norm)
        tl.store(row_max_ptr + row, m)
        tl.store(log_norm_ptr + row, log_norm)
        if RETURN_ENTROPY:
            # sum_j p_j u_j (natural units) = ln 2 * t / d <= 0
            tl.store(entropy_ptr + row, log_norm - 0.6931471805599453 * (t / d))


# Gradient, per row (s = inv_T z, p = softmax(s), H the entropy, g_logp and g_H the
# upstream gradients of logp and entropy; both are 0 on ignored rows):
#   d logp / d s_j = onehot_j - p_j
#   d H / d s_j    = -p_j (log p_j + H)          (0 where p_j = 0, e.g. z_j = -inf)
#   d L / d z_j    = inv_T * (g_logp (onehot_j - p_j) - g_H p_j (log p_j + H))
# with log p_j = (z_j - M) inv_T - log_norm recomputed from the saved M and log_norm.
# The result is written in the logits' dtype, into grad_ptr (which is logits_ptr for
# inplace_backward: each element is read before it is overwritten, by the same program).
@triton.jit
def _token_logprobs_bwd_kernel(
    logits_ptr,  # [N, V] fp16/bf16/fp32, unit column stride
    grad_ptr,  # [N, V] out, logits' dtype, unit column stride
    targets_ptr,  # [N] int32/int64
    inv_t_ptr,  # [N] fp32
    row_max_ptr,  # [N] fp32
    log_norm_ptr,  # [N] fp32
    entropy_ptr,  # [N] fp32 (unused unless HAS_ENTROPY_GRAD)
    g_logp_ptr,  # [N] fp32 (unused unless HAS_LOGP_GRAD)
    g_entropy_ptr,  # [N] fp32 (unused unless HAS_ENTROPY_GRAD)
    vocab,
    stride_row,
    stride_grad_row,
    ignore_index,
    HAS_LOGP_GRAD: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    INTERPRET: tl.constexpr,  # Triton's CPU interpreter: round bf16 by hand (see round_to)
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    grad_row = grad_ptr + row * stride_grad_row
    if target == ignore_index:
        zero = tl.zeros([BLOCK_V], dtype=tl.float32).to(grad_ptr.dtype.element_ty)
        for start in range(0, vocab, BLOCK_V):
            offs = start + cols
            tl.store(grad_row + offs, zero, mask=offs < vocab)
    else:
        row_ptr = logits_ptr + row * stride_row
        inv_t = tl.load(inv_t_ptr + row)
        row_max = tl.load(row_max_ptr + row)
        log_norm = tl.load(log_norm_ptr + row)
        g_logp = 0.0
        if HAS_LOGP_GRAD:
            g_logp = tl.load(g_logp_ptr + row)
        g_h = 0.0
        h = 0.0
        if HAS_ENTROPY_GRAD:
            g_h = tl.load(g_entropy_ptr + row)
            h = tl.load(entropy_ptr + row)
        for start in range(0, vocab, BLOCK_V):
            offs = start + cols
            mask = offs < vocab
            z = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
            # -inf logits give log_p = -3e38 (not -inf): p = 0 and p (log_p + H) = 0, no NaN.
            log_p = tl.maximum((z - row_max) * inv_t - log_norm, -3.0e38)
            p = tl.exp(log_p)
            grad = tl.zeros([BLOCK_V], dtype=tl.float32)
            if HAS_LOGP_GRAD:
                grad = tl.where(offs == target, g_logp, 0.0) - g_logp * p
            if HAS_ENTROPY_GRAD:
                grad = grad - g_h * p * (log_p + h)
            grad = grad * inv_t
            tl.store(grad_row + offs, round_to(grad, grad_ptr.dtype.element_ty, INTERPRET), mask=mask)


def _launch_config(vocab: int, max_block: int, values_per_thread: int) -> Tuple[int, int]:
    """(BLOCK_V, num_warps) for a row of `vocab` columns."""
    block = min(max_block, max(16, triton.next_power_of_2(vocab)))
    num_warps = min(8, max(1, block // (32 * values_per_thread)))
    return block, num_warps


class _TokenLogprobsFunction(torch.autograd.Function):
    """logits [N, V] -> (logp [N] fp32, entropy [N] fp32 or None); saves M and log_norm per row."""

    @staticmethod
    def forward(ctx, logits, targets, inv_t, ignore_index, return_entropy, inplace_backward):
        with no_autocast(logits.device):
            return _TokenLogprobsFunction._forward(
                ctx, logits, targets, inv_t, ignore_index, return_entropy, inplace_backward
            )

    @staticmethod
    def _forward(ctx, logits, targets, inv_t, ignore_index, return_entropy, inplace_backward):
        # The kernels need a unit column stride; any row stride works without a copy.
        x = logits if logits.stride(1) == 1 else logits.contiguous()
        n, vocab = x.shape
        f32 = dict(dtype=torch.float32, device=x.device)
        logp = torch.empty(n, **f32)
        entropy = torch.empty(n, **f32) if return_entropy else None
        row_max = torch.empty(n, **f32)
        log_norm = torch.empty(n, **f32)
        block, num_warps = _launch_config(vocab, FWD_MAX_BLOCK_V, FWD_VALUES_PER_THREAD)
        if n > 0:
            _token_logprobs_fwd_kernel[(n,)](
                x, targets, inv_t, logp, entropy if return_entropy else logp, row_max, log_norm,
                vocab, x.stride(0), ignore_index,
                RETURN_ENTROPY=return_entropy, BLOCK_V=block, num_warps=num_warps,
            )  # fmt: skip
        ctx.save_for_backward(x, targets, inv_t, row_max, log_norm, entropy if return_entropy else log_norm)
        ctx.ignore_index = ignore_index
        ctx.return_entropy = return_entropy
        ctx.inplace_backward = inplace_backward
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logp, g_entropy):
        with no_autocast(ctx.saved_tensors[0].device):
            return _TokenLogprobsFunction._backward(ctx, g_logp, g_entropy)

    @staticmethod
    def _backward(ctx, g_logp, g_entropy):
        x, targets, inv_t, row_max, log_norm, entropy = ctx.saved_tensors
        if not ctx.return_entropy:
            g_entropy = None
        if g_logp is None and g_entropy is None:
            return (None,) * 6
        n, vocab = x.shape
        grad = x if ctx.inplace_backward else torch.empty((n, vocab), dtype=x.dtype, device=x.device)
        if n > 0:
            g_logp = g_logp.float().contiguous() if g_logp is not None else None
            g_entropy = g_entropy.float().contiguous() if g_entropy is not None else None
            block, num_warps = _launch_config(vocab, BWD_MAX_BLOCK_V, BWD_VALUES_PER_THREAD)
            _token_logprobs_bwd_kernel[(n,)](
                x, grad, targets, inv_t, row_max, log_norm, entropy,
                g_logp if g_logp is not None else log_norm,
                g_entropy if g_entropy is not None else log_norm,
                vocab, x.stride(0), grad.stride(0), ctx.ignore_index,
                HAS_LOGP_GRAD=g_logp is not None, HAS_ENTROPY_GRAD=g_entropy is not None,
                INTERPRET=interpreting(),
                BLOCK_V=block, num_warps=num_warps,
            )  # fmt: skip
            if ctx.inplace_backward:
                # The kernel overwrote the logits behind autograd's back. Bump their version
                # as an in-place op would: an op that saved them (a tanh soft-cap, say) then
                # fails loudly in its backward instead of reading gradients as logits.
                torch.autograd.graph.increment_version(x)
        return grad, None, None, None, None, None


def _token_logprobs_triton(
    logits: torch.Tensor,
    targets: torch.Tensor,
    inv_t: torch.Tensor,
    ignore_index: int,
    return_entropy: bool,
    inplace_backward: bool,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Validated inputs -> (logp [N] fp32, entropy [N] fp32 or None), differentiable in logits."""
    return _TokenLogprobsFunction.apply(
        logits, targets.contiguous(), inv_t, int(ignore_index), bool(return_entropy), bool(inplace_backward)
    )


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    inv_temperature: Union[None, float, torch.Tensor] = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    inplace_backward: bool = False,
    backend: str = "auto",
    validate: bool = True,
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
            [N, V] buffer (the logits must be contiguous and must not be needed after
            backward; an op that saved them for its own backward raises there).
        backend: "auto" (Triton on CUDA, the reference elsewhere), "triton" or "torch".
        validate: check the values of targets (in range) and of a tensor
            inv_temperature (positive, finite). These checks read the tensors on the
            host (a device sync); pass False in a hot loop once the batch has been
            validated. Shapes, dtypes and devices are always checked.
    Returns:
        logp [N] fp32 (fp64 for fp64 logits), and entropy [N] when return_entropy.
        Autocast does not change the computation: it runs on the logits as given,
        accumulating in fp32, as autocast itself runs a softmax.
    """
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    n, vocab = logits.shape
    if vocab < 1:
        raise ValueError("logits must have at least one column (V >= 1)")
    check_targets(targets, n, vocab, ignore_index, logits.device, validate=validate)
    inv_t = row_inv_temperature(inv_temperature, n, logits.device, validate=validate)
    if inplace_backward and not logits.is_contiguous():
        raise ValueError(
            "inplace_backward=True needs contiguous logits (the gradient is written into their storage); "
            "pass logits.contiguous() or inplace_backward=False"
        )
    if resolve_kernel_backend(backend, {"logits": logits}) == "torch":
        return reference.token_logprobs(
            logits,
            targets,
            inv_temperature=inv_t,
            ignore_index=ignore_index,
            return_entropy=return_entropy,
            inplace_backward=inplace_backward,
            validate=False,  # inv_t was checked above
        )
    logp, entropy = _token_logprobs_triton(logits, targets, inv_t, ignore_index, return_entropy, inplace_backward)
    return (logp, entropy) if return_entropy else logp
