"""token_logprobs: fused log-softmax + gather (+ entropy) over logits [N, V].

The launch configuration (RowTiles), the kernels, the custom op (one torch.library op for
eager and torch.compile, either backend behind it), then the public function.

Per row, with z the logits (after the optional logit scale and soft cap, below),
inv_T the row's inverse temperature and M = max_j z_j:
    u_j = (z_j - M) * inv_T            (scaled logits shifted by their maximum, <= 0)
    D   = sum_j exp(u_j),  log_norm = log D,  p_j = exp(u_j - log_norm)
    logp    = u_target - log_norm      (= s_target - lse with s = inv_T z)
    entropy = log_norm - sum_j p_j u_j (= lse - sum_j p_j s_j)
The maximum is taken in logit units and subtracted *before* scaling: z_j - M is exact
for the logits that carry the probability mass, so logits of magnitude 1e4 keep full
fp32 accuracy (scaling first would cost ~1e-3 absolute there). Forward saves M and
log_norm per row (lse = inv_T M + log_norm); backward recomputes p blockwise.

Logit scale and soft cap, applied to the raw logits r in this order:
    scale only:   z = logit_scale r, folded into the temperature (inv_T' = inv_T logit_scale),
                  so the max is still subtracted before any scaling.
    soft cap:     z = softcap tanh(logit_scale r / softcap)   (Gemma-2; |z| < softcap),
                  computed in the kernels (`_triton.soft_cap`); dz/dr = logit_scale (1 - tanh^2).

Support (`support=`, support.py): z_j = -inf for each token j outside the row's kept set
(`apply_support`, where each block of z is formed, in both kernels), so every sum above
runs over the kept set and p_j = 0 outside it; the target is always kept.
"""
from __future__ import annotations

import warnings
from typing import List, Optional, Tuple, Union

import torch
from . import reference
from ._triton import interpreting, round_to, soft_cap, tl, triton
from ._utils import (FLOAT_DTYPES, check_targets, check_tensor, compute_dtype, device_guard, nan_where_out_of_range,
                     no_autocast, resolve_kernel_backend)
from .logit_transform import LogitTransform
from .support import apply_support, check_support
from .support import kernel_args as support_kernel_args
from .tiles import RowTiles, launch_tiles

DEFAULT_TILES = RowTiles()  # what default_tiles gives on every architecture
# The names before the launch configuration was called `tiles=` on both ops.
RowBlocks = RowTiles
DEFAULT_BLOCKS = DEFAULT_TILES


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
    softcap,  # fp32 cap (read when HAS_SOFTCAP)
    softcap_pre,  # fp32 logit_scale / softcap (read when HAS_SOFTCAP)
    logit_scale,  # fp32 (the backward's; unread here: LogitTransform.kernel_args serves both kernels)
    support_ptr,  # [N] fp32 threshold or [N, W] int32 bitmask (read when SUPPORT, see support.py)
    stride_support,
    support_offset,
    RETURN_ENTROPY: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SUPPORT: tl.constexpr,
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
            if HAS_SOFTCAP:
                z, _ = soft_cap(z, softcap, softcap_pre)
                z = tl.where(offs < vocab, z, float("-inf"))  # padding stays out of the sums
            if SUPPORT != 0:  # tokens outside the row's support stay out of the sums too
                z = apply_support(z, z * inv_t, row, offs, offs < vocab, target, support_ptr, stride_support,
                                  support_offset, SUPPORT)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # finite even while all is -inf
            u = (z - m_ref) * inv_t2
            if RETURN_ENTROPY:
                # -inf logits give u = -3e38 (not -inf): 2^u u = 0, never 0 * -inf. A where,
                # not tl.maximum, which would turn a NaN logit into -3e38 (a finite result).
                u = tl.where(u < -3.0e38, -3.0e38, u)
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
        # a target outside [0, V) (only with validate=False) reads nothing: NaN (docs/kernels.md)
        z_t = tl.load(row_ptr + target, mask=(target >= 0) & (target < vocab), other=float("nan")).to(tl.float32)
        if HAS_SOFTCAP:
            z_t, _ = soft_cap(z_t, softcap, softcap_pre)
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
# With the soft cap, z = softcap tanh(logit_scale r / softcap) of the raw logits r
# (recomputed), and the chain rule adds one factor:
#   d L / d r_j    = d L / d z_j * logit_scale (1 - tanh^2)
# (without it the logit scale is folded into inv_T: d L / d r_j = d L / d z_j as above).
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
    softcap,  # fp32 (read when HAS_SOFTCAP)
    softcap_pre,  # fp32 logit_scale / softcap (read when HAS_SOFTCAP)
    logit_scale,  # fp32 (read when HAS_SOFTCAP)
    support_ptr,  # as in the forward (read when SUPPORT)
    stride_support,
    support_offset,
    HAS_LOGP_GRAD: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SUPPORT: tl.constexpr,
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
        g_entropy = 0.0
        entropy = 0.0
        if HAS_ENTROPY_GRAD:
            g_entropy = tl.load(g_entropy_ptr + row)
            entropy = tl.load(entropy_ptr + row)
        for start in range(0, vocab, BLOCK_V):
            offs = start + cols
            mask = offs < vocab
            z = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
            if HAS_SOFTCAP:
                z, cap_slope = soft_cap(z, softcap, softcap_pre)
                z = tl.where(mask, z, float("-inf"))
            if SUPPORT != 0:  # the forward's mask: p = 0 outside the support
                z = apply_support(z, z * inv_t, row, offs, mask, target, support_ptr, stride_support, support_offset,
                                  SUPPORT)
            # -inf logits give log_p = -3e38 (not -inf): p = 0 and p (log_p + H) = 0, no NaN
            # (a where: tl.maximum would drop a NaN logit's NaN).
            log_p = (z - row_max) * inv_t - log_norm
            log_p = tl.where(log_p < -3.0e38, -3.0e38, log_p)
            p = tl.exp(log_p)
            grad = tl.zeros([BLOCK_V], dtype=tl.float32)
            if HAS_LOGP_GRAD:
                grad = tl.where(offs == target, g_logp, 0.0) - g_logp * p
            if HAS_ENTROPY_GRAD:
                grad = grad - g_entropy * p * (log_p + entropy)
            grad = grad * inv_t
            if HAS_SOFTCAP:
                grad = grad * (cap_slope * logit_scale)
            tl.store(grad_row + offs, round_to(grad, grad_ptr.dtype.element_ty, INTERPRET), mask=mask)


def _row_tiles(tiles: List[int], logits: torch.Tensor) -> RowTiles:
    """The op's `tiles` option: the caller's RowTiles as a list, or [] for the device's
    (erpo_kernels.tiles.launch_tiles)."""
    return RowTiles(*tiles) if tiles else launch_tiles("token_logprobs", logits, 0, logits.shape[1])


def _launch_config(vocab: int, max_block: int, values_per_thread: int) -> Tuple[int, int]:
    """(BLOCK_V, num_warps) for a row of `vocab` columns."""
    block = min(max_block, max(16, triton.next_power_of_2(vocab)))
    num_warps = min(8, max(1, block // (32 * values_per_thread)))
    return block, num_warps


def _column_major_safe(logits: torch.Tensor) -> torch.Tensor:
    """The logits as the kernels read them: unit column stride (any row stride works
    without a copy)."""
    return logits if logits.stride(1) == 1 else logits.contiguous()


def _triton_forward(
    logits: torch.Tensor, targets: torch.Tensor, transform: LogitTransform, ignore_index: int, return_entropy: bool,
    tiles: RowTiles, support: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """-> logp [N], entropy [N] or None, M [N] and log_norm [N], all fp32."""
    x = _column_major_safe(logits)
    n, vocab = x.shape
    f32 = dict(dtype=torch.float32, device=x.device)
    logp = torch.empty(n, **f32)
    entropy = torch.empty(n, **f32) if return_entropy else None
    row_max = torch.empty(n, **f32)
    log_norm = torch.empty(n, **f32)
    block, num_warps = _launch_config(vocab, tiles.fwd_max_block_v, tiles.fwd_values_per_thread)
    if n > 0:
        _token_logprobs_fwd_kernel[(n,)](
            logits_ptr=x, targets_ptr=targets, inv_t_ptr=transform.inv_t, logp_ptr=logp,
            entropy_ptr=entropy if return_entropy else logp,  # an unwritten stand-in without entropy
            row_max_ptr=row_max, log_norm_ptr=log_norm,
            vocab=vocab, stride_row=x.stride(0), ignore_index=ignore_index,
            **transform.kernel_args(), **support_kernel_args(support, transform.inv_t),
            RETURN_ENTROPY=return_entropy, BLOCK_V=block, num_warps=num_warps,
        )  # fmt: skip
    return logp, entropy, row_max, log_norm


def _triton_backward(
    x: torch.Tensor, grad: torch.Tensor, targets: torch.Tensor, transform: LogitTransform, row_max: torch.Tensor,
    log_norm: torch.Tensor, entropy: Optional[torch.Tensor], g_logp: Optional[torch.Tensor],
    g_entropy: Optional[torch.Tensor], ignore_index: int, tiles: RowTiles, support: Optional[torch.Tensor] = None,
) -> None:
    """Writes d logits into `grad` ([N, V], unit column stride; it may be x itself).
    entropy and g_entropy: both or neither; g_logp may be None."""
    n, vocab = x.shape
    if n == 0:
        return
    g_logp = g_logp.float().contiguous() if g_logp is not None else None
    g_entropy = g_entropy.float().contiguous() if g_entropy is not None else None
    block, num_warps = _launch_config(vocab, tiles.bwd_max_block_v, tiles.bwd_values_per_thread)
    _token_logprobs_bwd_kernel[(n,)](
        logits_ptr=x, grad_ptr=grad, targets_ptr=targets, inv_t_ptr=transform.inv_t,
        row_max_ptr=row_max, log_norm_ptr=log_norm, entropy_ptr=entropy if entropy is not None else log_norm,
        # unread stand-ins where an upstream gradient is None
        g_logp_ptr=g_logp if g_logp is not None else log_norm,
        g_entropy_ptr=g_entropy if g_entropy is not None else log_norm,
        vocab=vocab, stride_row=x.stride(0), stride_grad_row=grad.stride(0), ignore_index=ignore_index,
        **transform.kernel_args(), **support_kernel_args(support, transform.inv_t),
        HAS_LOGP_GRAD=g_logp is not None, HAS_ENTROPY_GRAD=g_entropy is not None,
        INTERPRET=interpreting(),
        BLOCK_V=block, num_warps=num_warps,
    )  # fmt: skip


# ---------------------------------------------------------------------------------
# The op: one torch.library custom op serves eager and torch.compile alike (a
# shape-only fake for compile, autograd registered), with the kernels or the reference
# behind it (`use_triton`). Tensors are positional, options keyword-only: the backward
# returns one gradient per tensor input. The backward is a second custom op, out of
# place or (inplace_backward) writing into the logits; a mutating custom op bumps the
# logits' version counter, so an op that saved them fails loudly in its own backward.


@torch.library.custom_op("erpo_kernels::token_logprobs", mutates_args=())
def _token_logprobs_op(
    logits: torch.Tensor, targets: torch.Tensor, inv_t: torch.Tensor, support: Optional[torch.Tensor], *,
    softcap: Optional[float],
    logit_scale: Optional[float], unit: bool, ignore_index: int, return_entropy: bool, inplace_backward: bool,
    use_triton: bool, tiles: List[int],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> logp [N], entropy [N] (or [0]), and what the Triton backward needs: M [N] and
    log_norm [N] (each [0] on the reference)."""
    transform = LogitTransform(inv_t, softcap, logit_scale, unit)
    with no_autocast(logits.device), device_guard(logits.device):
        if use_triton:
            logp, entropy, row_max, log_norm = _triton_forward(
                logits, targets, transform, ignore_index, return_entropy, _row_tiles(tiles, logits), support
            )
        else:
            logp, entropy = reference.token_logprobs_forward(
                logits, targets, transform, ignore_index, return_entropy, support
            )
            row_max, log_norm = logp.new_empty(0), logp.new_empty(0)
    return logp, entropy if entropy is not None else logp.new_empty(0), row_max, log_norm


@_token_logprobs_op.register_fake
def _token_logprobs_fake(logits, targets, inv_t, support, *, use_triton, return_entropy, **options):
    n = logits.shape[0]
    logp = logits.new_empty(n, dtype=torch.float32 if use_triton else compute_dtype(logits.dtype))
    stats = n if use_triton else 0
    return logp, logp.new_empty(n if return_entropy else 0), logp.new_empty(stats), logp.new_empty(stats)


def _backward_into(
    grad: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, transform: LogitTransform, row_max: torch.Tensor,
    log_norm: torch.Tensor, entropy: torch.Tensor, g_logp: Optional[torch.Tensor], g_entropy: Optional[torch.Tensor],
    ignore_index: int, use_triton: bool, tiles: List[int], support: Optional[torch.Tensor],
) -> None:
    """Writes d(sum g_logp logp + g_entropy entropy) / d logits into `grad` (it may be the
    logits themselves). g_entropy None: the entropy's gradient is not wanted."""
    entropy = entropy if g_entropy is not None else None
    with no_autocast(logits.device), device_guard(logits.device):
        if use_triton:
            _triton_backward(
                logits, grad, targets, transform, row_max, log_norm, entropy, g_logp, g_entropy, ignore_index,
                _row_tiles(tiles, logits), support,
            )
        else:
            reference.token_logprobs_backward(
                logits, targets, transform, ignore_index, entropy, g_logp, g_entropy, out=grad, support=support
            )


@torch.library.custom_op("erpo_kernels::token_logprobs_backward", mutates_args=())
def _backward_op(
    logits: torch.Tensor, targets: torch.Tensor, inv_t: torch.Tensor, support: Optional[torch.Tensor],
    row_max: torch.Tensor, log_norm: torch.Tensor, entropy: torch.Tensor, g_logp: Optional[torch.Tensor],
    g_entropy: Optional[torch.Tensor], *,
    softcap: Optional[float], logit_scale: Optional[float], unit: bool, ignore_index: int, use_triton: bool,
    tiles: List[int],
) -> torch.Tensor:
    """-> d logits [N, V] in the logits' dtype (unit column stride)."""
    x = _column_major_safe(logits) if use_triton else logits
    grad = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    transform = LogitTransform(inv_t, softcap, logit_scale, unit)
    _backward_into(grad, x, targets, transform, row_max, log_norm, entropy, g_logp, g_entropy, ignore_index,
                   use_triton, tiles, support)  # fmt: skip
    return grad


@_backward_op.register_fake
def _backward_fake(logits, *args, **options):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.custom_op("erpo_kernels::token_logprobs_backward_", mutates_args=("logits",))
def _backward_inplace_op(
    logits: torch.Tensor, targets: torch.Tensor, inv_t: torch.Tensor, support: Optional[torch.Tensor],
    row_max: torch.Tensor, log_norm: torch.Tensor, entropy: torch.Tensor, g_logp: Optional[torch.Tensor],
    g_entropy: Optional[torch.Tensor], *,
    softcap: Optional[float], logit_scale: Optional[float], unit: bool, ignore_index: int, use_triton: bool,
    tiles: List[int],
) -> None:
    """Overwrites the (contiguous) logits with d logits: each element is read before it
    is written, by the same program (Triton) or chunk (reference)."""
    transform = LogitTransform(inv_t, softcap, logit_scale, unit)
    _backward_into(logits, logits, targets, transform, row_max, log_norm, entropy, g_logp, g_entropy, ignore_index,
                   use_triton, tiles, support)  # fmt: skip


@_backward_inplace_op.register_fake
def _backward_inplace_fake(logits, *args, **options) -> None:
    return None


def _setup_context(ctx, inputs, keyword_only_inputs, output) -> None:
    logits, targets, inv_t, support = inputs
    _, entropy, row_max, log_norm = output
    ctx.save_for_backward(logits, targets, inv_t, support, row_max, log_norm, entropy)
    ctx.options = dict(keyword_only_inputs)
    ctx.set_materialize_grads(False)  # an unused output costs nothing in backward


def _backward(ctx, g_logp, g_entropy, _g_row_max, _g_log_norm):
    logits, targets, inv_t, support, row_max, log_norm, entropy = ctx.saved_tensors
    options = dict(ctx.options)
    if not options.pop("return_entropy"):
        g_entropy = None
    if g_logp is None and g_entropy is None:
        return None, None, None, None
    if options.pop("inplace_backward"):
        _backward_inplace_op(logits, targets, inv_t, support, row_max, log_norm, entropy, g_logp, g_entropy, **options)
        return logits, None, None, None
    grad = _backward_op(logits, targets, inv_t, support, row_max, log_norm, entropy, g_logp, g_entropy, **options)
    return grad, None, None, None


_token_logprobs_op.register_autograd(_backward, setup_context=_setup_context)


def _launch_tiles(tiles: Optional[RowTiles], blocks: Optional[RowTiles]) -> Optional[RowTiles]:
    """The launch configuration from `tiles=` (or the older name `blocks=`)."""
    if blocks is not None:
        if tiles is not None:
            raise ValueError("pass the launch configuration once, as tiles= (blocks= is its older name)")
        warnings.warn("token_logprobs(blocks=) is now token_logprobs(tiles=); blocks= will be removed",
                      DeprecationWarning, stacklevel=3)  # fmt: skip
        tiles = blocks
    if tiles is not None and not isinstance(tiles, RowTiles):
        raise ValueError(f"tiles must be None or a RowTiles, got {type(tiles).__name__}")
    return tiles


def _check_inplace_logits(logits: torch.Tensor) -> None:
    """ValueError unless backward may overwrite `logits` with their gradient: they must be
    contiguous, and neither a leaf that requires grad nor a view of one (its values, which
    the caller holds, would be lost and its .grad would share their storage)."""
    if not logits.is_contiguous():
        raise ValueError(
            "inplace_backward=True needs contiguous logits (the gradient is written into their storage); "
            "pass logits.contiguous() or inplace_backward=False"
        )
    base = logits if logits._base is None else logits._base
    if base.is_leaf and base.requires_grad:
        raise ValueError(
            "inplace_backward=True would overwrite logits, a leaf tensor that requires grad (or a view of one), "
            "with their gradient: their values would be lost and .grad would share their storage; pass "
            "inplace_backward=False, or logits computed in the graph (e.g. the lm_head's output)"
        )


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    inv_temperature: Union[None, float, torch.Tensor] = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    inplace_backward: bool = False,
    softcap: Optional[float] = None,
    logit_scale: Optional[float] = None,
    backend: str = "auto",
    validate: bool = True,
    tiles: Optional[RowTiles] = None,
    blocks: Optional[RowTiles] = None,
    support: Optional[torch.Tensor] = None,
):
    """Log-probability of each row's target under softmax(z * inv_temperature), where
    z = softcap * tanh(logit_scale * logits / softcap) (each step only when given).

    Args:
        logits: [N, V] fp16, bf16 or fp32 (fp64 on the torch backend).
        targets: [N] int32/int64 in [0, V), or ignore_index (that row returns 0 and
            gets a zero gradient).
        inv_temperature: None (1), a float, or a [N] tensor: prompt rows at 1 and
            response rows at 1/tau in one launch. A runtime value, never recompiles.
        return_entropy: also return the full-vocabulary entropy of each row.
        inplace_backward: write the gradient into the logits' storage instead of a new
            [N, V] buffer (the logits must be contiguous and must not be needed after
            backward; an op that saved them for its own backward raises there). A leaf
            that requires grad, or a view of one, is refused (ValueError): its values
            would be lost and its .grad would alias them.
        softcap: None, or the Gemma-2 final soft cap c > 0: z = c tanh(x / c) of the
            (scaled) logits x, before the temperature. A runtime value.
        logit_scale: None, or a multiplier s > 0 on the logits, applied first
            (z = s * logits). A runtime value.
        backend: "auto" (Triton on CUDA, the reference elsewhere), "triton" or "torch".
        validate: check the values of targets (in range) and of a tensor
            inv_temperature (positive, finite), and that a threshold support has no
            NaN. These checks read the tensors on the host (a device sync); pass False
            in a hot loop once the batch has been validated. Shapes, dtypes and devices
            are always checked. A target outside [0, V) that is not ignore_index then
            gives that row a NaN log-prob (and no gradient through it), never a read
            outside the row (docs/kernels.md).
        tiles: the Triton launch configuration, a RowTiles (None: the device's,
            erpo_kernels.default_tiles);
            results depend on it. `blocks=` is its older name (deprecated).
        support: None, or each row's kept set (the sampler's support), the softmax
            renormalised over it (log-probs, entropies, gradients): a floating [N]
            threshold (keep token j iff z_j * inv_T >= threshold, z after the
            logit scale and soft cap; -inf: the whole row) or an int32 bitmask
            [N, ceil(V / 32)] (bit j of word k keeps token 32 k + j; -1 words: the
            whole row). The target is always kept. erpo_kernels.support;
            docs/kernels.md.
    Returns:
        logp [N] fp32 (fp64 for fp64 logits), and entropy [N] when return_entropy.
        Each row's values and its row of the gradient depend on that row, V, the dtype
        and the options only, never on the other rows (batch invariant, Triton backend).
        Autocast does not change the computation: it runs on the logits as given,
        accumulating in fp32, as autocast itself runs a softmax.
    """
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    n, vocab = logits.shape
    if vocab < 1:
        raise ValueError("logits must have at least one column (V >= 1)")
    check_targets(targets, n, vocab, ignore_index, logits.device, validate=validate)
    transform = LogitTransform.build(
        inv_temperature, n, logits.device, softcap=softcap, logit_scale=logit_scale, validate=validate
    )
    support = check_support(support, n, vocab, logits.device, validate=validate)
    tiles = _launch_tiles(tiles, blocks)
    if inplace_backward:
        _check_inplace_logits(logits)
    use_triton = resolve_kernel_backend(backend, {"logits": logits}) == "triton"
    inv_t, softcap, logit_scale, unit = transform.op_args()
    logp, entropy, _, _ = _token_logprobs_op(
        logits, targets.contiguous(), inv_t, support, softcap=softcap, logit_scale=logit_scale, unit=unit,
        ignore_index=ignore_index, return_entropy=bool(return_entropy), inplace_backward=bool(inplace_backward),
        use_triton=use_triton, tiles=tiles.as_list() if tiles is not None else [],
    )
    logp = nan_where_out_of_range(logp, targets, vocab, ignore_index, validate)
    return (logp, entropy) if return_entropy else logp
