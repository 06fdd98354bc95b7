"""weighted_k3: the weighted, guarded K3 estimate of the Query-KL (docs/method.md s.2).

Kernels, then the custom ops (torch.library, autograd registered), then the public function.

    delta_q = ref_logp_q - logp_q
    k3(d)   = exp(d) - d - 1                      for d <= c   (a series at small |d|: reference.k3)
            = k3(c) + (exp(c) - 1) (d - c)        for d >  c   (convex, C1, slope <= exp(c) - 1)
    R       = sum_q w_q k3(delta_q) / W,   W = sum_q w_q   (w = 1 when weight is None)

M (queries in a batch) is small, so one program walks the whole batch in blocks.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import reference
from ._triton import interpreting, round_to, tl, triton
from ._utils import (FLOAT_DTYPES, check_rows, check_tensor, checking_values, device_guard, is_number, no_autocast,
                     resolve_kernel_backend)

BLOCK = 1024
K3_SERIES_BOUND = tl.constexpr(reference.K3_SERIES_BOUND)
K3_FP32_TERMS = tl.constexpr(reference.K3_SERIES_TERMS[torch.float32])
# exp(guard) must stay far from fp32 overflow (3.4e38 = exp(88.7)).
MAX_GUARD = 80.0


@triton.jit
def _k3(d, SERIES_TERMS: tl.constexpr):
    """k3(d) = exp(d) - d - 1 and its slope expm1(d) in fp32, accurate at every d: below
    K3_SERIES_BOUND the series d^2/2 (1 + d/3 (1 + d/4 (... (1 + d/n)))) (exp(d) - d - 1
    cancels to nothing at small |d|) and expm1 = d + k3, above it exp(d) - 1 - d and
    exp(d) - 1: the form of reference.k3, term for term."""
    small = tl.abs(d) < K3_SERIES_BOUND
    x = tl.where(small, d, 0.0)
    q = tl.full(d.shape, 1.0, tl.float32)
    for i in tl.static_range(SERIES_TERMS - 2):
        q = 1.0 + q * (x * (1.0 / (SERIES_TERMS - i)))
    series = 0.5 * x * x * q
    e = tl.exp(tl.where(small, 0.0, d))
    return tl.where(small, series, (e - 1.0) - d), tl.where(small, x + series, e - 1.0)


@triton.jit
def _k3_guarded(d, c, ec1, k3c):
    """k3(d) and its slope k3'(d) in fp32; c the guard, ec1 = exp(c) - 1, k3c = k3(c)."""
    above = d > c
    # the branch not taken stays finite; a where, since tl.minimum drops a NaN (and would
    # give a NaN delta a finite slope)
    k3, slope = _k3(tl.where(above, c, d), K3_FP32_TERMS)
    return tl.where(above, k3c + ec1 * (d - c), k3), tl.where(above, ec1, slope)


@triton.jit
def _load_k3(logp_ptr, ref_ptr, w_ptr, idx, mask, c, ec1, k3c, HAS_WEIGHT: tl.constexpr):
    """k3(delta), k3'(delta) and w (0 in masked lanes) for the queries idx, in fp32.
    M is a batch of queries: int32 offsets suffice."""
    lp = tl.load(logp_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    rf = tl.load(ref_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    k3, slope = _k3_guarded(rf - lp, c, ec1, k3c)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.where(mask, 1.0, 0.0)
    return k3, slope, w


@triton.jit
def _weighted_k3_fwd_kernel(
    logp_ptr,  # [M] float, contiguous
    ref_ptr,  # [M] float, contiguous
    w_ptr,  # [M] float, contiguous (unused when HAS_WEIGHT is False)
    stats_ptr,  # [2] fp32 out: R, W
    m,  # M
    c,  # guard (runtime float)
    ec1,  # exp(c) - 1
    k3c,  # k3(c) = exp(c) - c - 1
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # A single program: R = sum_q w_q k3(delta_q) / sum_q w_q, accumulated in fp32.
    lanes = tl.arange(0, BLOCK)
    acc_s = tl.zeros([BLOCK], dtype=tl.float32)
    acc_w = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, m, BLOCK):
        idx = off + lanes
        k3, _, w = _load_k3(logp_ptr, ref_ptr, w_ptr, idx, idx < m, c, ec1, k3c, HAS_WEIGHT)
        acc_s += w * k3  # masked lanes: w = 0 and k3(0) = 0
        acc_w += w
    total = tl.sum(acc_s, axis=0)
    w_sum = tl.sum(acc_w, axis=0)
    # No weight mass (M = 0, or all weights 0): R is defined as 0.
    r = tl.where(w_sum != 0.0, total / tl.where(w_sum != 0.0, w_sum, 1.0), 0.0)
    tl.store(stats_ptr, r)
    tl.store(stats_ptr + 1, w_sum)


# Backward, with g the upstream gradient of R, W = sum_q w_q and d_q = ref_q - logp_q:
#     k3'(d)     = exp(min(d, c)) - 1        (exp(d) - 1 below the guard, the constant
#                                             slope exp(c) - 1 above it: bounded, never 0;
#                                             d + k3(d) at |d| < 2, see _k3)
#     dR/dlogp_q = -g w_q k3'(d_q) / W        (d d_q / d logp_q = -1)
#     dR/dref_q  = +g w_q k3'(d_q) / W
#     dR/dw_q    =  g (k3(d_q) - R) / W       (quotient rule: k3_q / W - S / W^2)
# When W = 0, R was defined as 0 and every gradient is 0.
@triton.jit
def _weighted_k3_bwd_kernel(
    logp_ptr,
    ref_ptr,
    w_ptr,
    stats_ptr,  # [2] fp32: R, W from the forward
    grad_ptr,  # [] upstream gradient of R
    dlogp_ptr,  # [M] logp's dtype
    dref_ptr,  # [M] ref_logp's dtype
    dw_ptr,  # [M] weight's dtype (unused when HAS_WEIGHT is False)
    m,
    c,
    ec1,
    k3c,
    HAS_WEIGHT: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.load(stats_ptr)
    w_sum = tl.load(stats_ptr + 1)
    g = tl.load(grad_ptr).to(tl.float32)
    scale = tl.where(w_sum != 0.0, g / tl.where(w_sum != 0.0, w_sum, 1.0), 0.0)  # g / W
    lanes = tl.arange(0, BLOCK)
    for off in range(0, m, BLOCK):
        idx = off + lanes
        mask = idx < m
        k3, slope, w = _load_k3(logp_ptr, ref_ptr, w_ptr, idx, mask, c, ec1, k3c, HAS_WEIGHT)
        if HAS_WEIGHT:
            dw = (k3 - r) * scale
            tl.store(dw_ptr + idx, round_to(dw, dw_ptr.dtype.element_ty, INTERPRET), mask=mask)
        d_ref = w * slope * scale
        tl.store(dref_ptr + idx, round_to(d_ref, dref_ptr.dtype.element_ty, INTERPRET), mask=mask)
        tl.store(dlogp_ptr + idx, round_to(-d_ref, dlogp_ptr.dtype.element_ty, INTERPRET), mask=mask)


def _guard_constants(guard: float):
    """(c, exp(c) - 1, k3(c)) computed in float64 on the host, passed as runtime floats
    (expm1(c) - c: its relative error 4e-16 / c is far below fp32's for any guard >= 1e-7)."""
    ec1 = math.expm1(guard)
    return guard, ec1, ec1 - guard


def _weighted_k3_stats(logp: torch.Tensor, ref_logp: torch.Tensor, weight: Optional[torch.Tensor], guard: float):
    """[2] fp32 (R, W) from the forward kernel; inputs contiguous."""
    m = logp.shape[0]
    stats = torch.zeros(2, dtype=torch.float32, device=logp.device)
    if m > 0:
        _weighted_k3_fwd_kernel[(1,)](
            logp,
            ref_logp,
            weight if weight is not None else logp,
            stats,
            m,
            *_guard_constants(guard),
            HAS_WEIGHT=weight is not None,
            BLOCK=BLOCK,
            num_warps=4,
        )
    return stats


# The Triton path as torch.library custom ops (fake implementations for shapes,
# autograd registered): torch.compile(fullgraph=True) traces a call without a graph
# break. The forward returns (R, stats) and the backward reads stats = (R, W).
@torch.library.custom_op("erpo_kernels::weighted_k3", mutates_args=())
def _weighted_k3_op(
    logp: torch.Tensor, ref_logp: torch.Tensor, weight: Optional[torch.Tensor], guard: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(R 0-d fp32, stats [2] fp32 = (R, W)) (Triton)."""
    weight = weight.contiguous() if weight is not None else None
    with device_guard(logp.device):
        stats = _weighted_k3_stats(logp.contiguous(), ref_logp.contiguous(), weight, guard)
    return stats[0].clone(), stats


@_weighted_k3_op.register_fake
def _weighted_k3_fake(logp, ref_logp, weight, guard):
    return logp.new_empty((), dtype=torch.float32), logp.new_empty(2, dtype=torch.float32)


@torch.library.custom_op("erpo_kernels::weighted_k3_backward", mutates_args=())
def _weighted_k3_backward_op(
    grad_r: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    weight: Optional[torch.Tensor],
    stats: torch.Tensor,
    guard: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d logp [M], d ref_logp [M], d weight [M], or [0] without weight) (Triton)."""
    logp, ref_logp = logp.contiguous(), ref_logp.contiguous()
    weight = weight.contiguous() if weight is not None else None
    m = logp.shape[0]
    d_logp = torch.empty_like(logp)
    d_ref = torch.empty_like(ref_logp)
    d_weight = torch.empty_like(weight) if weight is not None else logp.new_empty(0)
    if m > 0:
        with device_guard(logp.device):
            _weighted_k3_bwd_kernel[(1,)](
                logp,
                ref_logp,
                weight if weight is not None else logp,
                stats.contiguous(),
                grad_r.contiguous(),
                d_logp,
                d_ref,
                d_weight if weight is not None else d_logp,
                m,
                *_guard_constants(guard),
                HAS_WEIGHT=weight is not None,
                INTERPRET=interpreting(),
                BLOCK=BLOCK,
                num_warps=4,
            )
    return d_logp, d_ref, d_weight


@_weighted_k3_backward_op.register_fake
def _weighted_k3_backward_fake(grad_r, logp, ref_logp, weight, stats, guard):
    return (
        torch.empty_like(logp),
        torch.empty_like(ref_logp),
        torch.empty_like(weight) if weight is not None else logp.new_empty(0),
    )


def _weighted_k3_setup(ctx, inputs, output) -> None:
    logp, ref_logp, weight, guard = inputs
    ctx.save_for_backward(logp, ref_logp, weight, output[1])
    ctx.guard = guard


def _weighted_k3_backward(ctx, grad_r: torch.Tensor, grad_stats: Optional[torch.Tensor]):
    # (once differentiable: the backward op has no autograd of its own)
    logp, ref_logp, weight, stats = ctx.saved_tensors
    d_logp, d_ref, d_weight = _weighted_k3_backward_op(grad_r, logp, ref_logp, weight, stats, ctx.guard)
    return d_logp, d_ref, (d_weight if weight is not None else None), None


_weighted_k3_op.register_autograd(_weighted_k3_backward, setup_context=_weighted_k3_setup)


def _weighted_k3_triton(
    logp: torch.Tensor, ref_logp: torch.Tensor, weight: Optional[torch.Tensor], guard: float
) -> torch.Tensor:
    return _weighted_k3_op(logp, ref_logp, weight, guard)[0]


def weighted_k3(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    *,
    guard: float = 10.0,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """R = sum_q w(q) k3(ref_logp(q) - logp(q)) / sum_q w(q), a scalar.

    k3(d) = exp(d) - d - 1, continued linearly for d > guard: k3(c) + (exp(c) - 1)(d - c)
    (convex, C1, gradient bounded by exp(c) - 1 and never clamped to 0).

    Args:
        logp: [M] float (e.g. query_logp), the policy's log-probability of each query.
        ref_logp: [M] float (ref_query_logp), on logp's device.
        weight: [M] float (query_weights), each >= 0, or None (all ones).
        guard: c, in (0, 80]; a runtime value, never recompiles.
        backend: "auto", "triton" or "torch".
        validate: check that every weight is finite and >= 0 (NaN rejected too). The check
            reads them on the host (a device sync); pass False in a hot loop once the
            weights have been validated. Shapes, dtypes and devices are always checked.
    Returns:
        A 0-d tensor: fp32 on the Triton backend (fp16/bf16/fp32 inputs, computed in
        fp32); fp64 inputs go to the reference. Gradients flow to all three inputs.
        Autocast does not change the computation.

    Zero total weight: when the weights sum to 0 (all zero, or M = 0) the weighted mean
    has no mass to average over. R is then defined as 0, and every gradient (to logp,
    ref_logp and weight) is exactly 0: never 0/0, never NaN.
    """
    check_tensor("logp", logp, ndim=1, dtypes=FLOAT_DTYPES)
    check_tensor("ref_logp", ref_logp, ndim=1, dtypes=FLOAT_DTYPES, device=logp.device)
    check_rows("ref_logp", ref_logp, logp.shape[0])
    if weight is not None:
        check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=logp.device)
        check_rows("weight", weight, logp.shape[0])
        if checking_values(validate) and weight.numel() > 0:
            bad = ~((weight >= 0) & torch.isfinite(weight))  # NaN is caught by >= 0 failing
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise ValueError(f"weight must be finite and >= 0 everywhere, got weight[{i}] = {float(weight[i])}")
    if not is_number(guard):
        raise ValueError(f"guard must be a float, got {type(guard).__name__}")
    guard = float(guard)
    if not 0 < guard <= MAX_GUARD:
        raise ValueError(f"guard must be in (0, {MAX_GUARD:g}] (exp(guard) must fit in fp32), got {guard}")
    if resolve_kernel_backend(backend, {"logp": logp, "ref_logp": ref_logp, "weight": weight}) == "torch":
        return reference.weighted_k3(logp, ref_logp, weight, guard=guard)
    with no_autocast(logp.device):
        return _weighted_k3_triton(logp, ref_logp, weight, guard)
