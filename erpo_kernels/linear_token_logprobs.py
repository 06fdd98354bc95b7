"""linear_token_logprobs: log-probs and entropy straight from hidden states and the
lm_head weight, never materialising [N, V].

Kernels, then the autograd Function, then the public function.

Per row, with z = hidden @ weight.T + bias and s = z * inv_T (inv_T a per-row runtime
fp32 value), the kernels compute the same quantities as `reference.py`:
    lse = log sum_j exp(s_j),   logp = s_target - lse,   H = lse - sum_j p_j s_j.
The log-sum-exp is kept as two fp32 numbers, the row max m and log l with
l = sum_j exp(s_j - m), and log-probs are formed as (s_j - m) - log l: a single fp32
lse = m + log l is rounded at the magnitude of the logits (1.5e-5 at |s| ~ 400), an
error every p_j inherits (measured here: 10x larger d_weight / d_hidden errors at
|s| ~ 400 with a single lse).
Logits live only in [BLOCK_N, BLOCK_V] register tiles, made by `tl.dot` over D with
fp32 accumulation; nothing of size N x V is written to memory, in either direction.

Work plan (rows whose target is ignore_index are compacted away before any launch):
    forward   one program per (row tile, vocabulary split): an online log-sum-exp
              and entropy over its part of V; the per-split statistics (a few floats
              per row) are merged in PyTorch.
    backward  `_ltl_bwd_dhidden_kernel`: one program per (row tile, vocabulary
              split), looping over V and recomputing the logits -> d_hidden.
              `_ltl_bwd_dweight_kernel`: one program per vocabulary tile, looping
              over the rows and recomputing the logits -> d_weight and d_bias.
Each output element is owned by one program and accumulated in a fixed order in an
fp32 buffer, so gradients are deterministic (no atomics).

Precision: fp32 operands use `input_precision="ieee"` (no TF32) so fp32 inputs keep
fp32 accuracy; bf16/fp16 operands use tensor cores with fp32 accumulation, and the
softmax gradient is rounded to the input dtype before its two matmuls (as PyTorch's
own backward in that dtype does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import torch

from . import reference
from ._triton import interpreting, round_to, soft_cap, tl, triton
from ._utils import (
    FLOAT_DTYPES,
    autocast_dtype,
    check_targets,
    check_tensor,
    no_autocast,
    optional_positive_float,
    resolve_kernel_backend,
    row_inv_temperature,
)


@triton.jit
def _mm(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 accumulation.

    IEEE: fp32 operands, full fp32 products (no TF32). UPCAST: bf16 operands under the
    interpreter, whose bf16 dot is wrong; the values are exact in fp32, so the result
    equals the GPU's bf16 tensor-core dot with fp32 accumulation.
    """
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        acc = tl.dot(a, b, acc=acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc=acc)
    return acc


@triton.jit
def _load_rows(ptr, rows64, row_mask, stride_r, offs_d, d_mask, stride_d):
    """ptr[rows, offs_d] as a [len(rows), BLOCK_D] tile (hidden or weight rows), 0 where masked."""
    return tl.load(
        ptr + rows64[:, None] * stride_r + offs_d[None, :] * stride_d,
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )


@triton.jit
def _add_mm_over_d(
    acc_ptr, acc_rows, acc_mask, a, b_ptr, b_rows64, b_mask, stride_br, stride_bd, D,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """acc[r, :] += (a @ b_ptr[b_rows, :])[r, :] for the rows r of an fp32 buffer with row
    stride D (acc_rows = r * D, int64), BLOCK_D columns at a time. A read-modify-write
    by the one program that owns those rows: no races, a fixed order."""
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        b = _load_rows(b_ptr, b_rows64, b_mask, stride_br, offs_d, d_mask, stride_bd)  # [K, BLOCK_D]
        ptrs = acc_ptr + acc_rows[:, None] + offs_d[None, :]
        mask = acc_mask[:, None] & d_mask[None, :]
        acc = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, _mm(a, b, acc, IEEE, UPCAST), mask=mask)


@triton.jit
def _scaled_logits(
    h_ptr, w_ptr, b_ptr,
    rows, row_mask, cols, col_mask, inv_t, D,
    stride_hn, stride_hd, stride_wv, stride_wd, stride_b,
    softcap, softcap_pre,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """(s, cap_slope) for a [BLOCK_N, BLOCK_V] tile, fp32, -inf in padded columns:
    r = hidden[rows] @ weight[cols].T + bias[cols], then with HAS_SOFTCAP
    z = softcap tanh(r * softcap_pre) (softcap_pre = logit_scale / softcap) and
    cap_slope = 1 - tanh^2 (else z = r and cap_slope an unread stand-in), and
    s = z * inv_t[:, None]."""
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        h = _load_rows(h_ptr, rows64, row_mask, stride_hn, offs_d, d_mask, stride_hd)  # [BLOCK_N, BLOCK_D]
        wt = tl.load(
            w_ptr + cols64[None, :] * stride_wv + offs_d[:, None] * stride_wd,
            mask=col_mask[None, :] & d_mask[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_V], weight tile transposed
        acc = _mm(h, wt, acc, IEEE, UPCAST)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols64 * stride_b, mask=col_mask, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    if HAS_SOFTCAP:
        acc, cap_slope = soft_cap(acc, softcap, softcap_pre)
    else:
        cap_slope = acc
    s = acc * inv_t[:, None]
    return tl.where(col_mask[None, :], s, float("-inf")), cap_slope


@triton.jit
def _row_tile_and_split(n_rows, BLOCK_N: tl.constexpr):
    """(rows, row_mask, split) of program pid in a (row tile, vocabulary split) launch:
    row tile pid % n_tiles of split pid // n_tiles, so that neighbouring programs share
    a split and stream the same weight tiles (L2)."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(n_rows, BLOCK_N)
    tile = pid % n_tiles
    split = pid // n_tiles
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, rows < n_rows, split


@triton.jit
def _ltl_fwd_kernel(
    h_ptr,  # [n_rows, D] compacted hidden states (fp16/bf16/fp32)
    w_ptr,  # [V, D] weight, hidden's dtype
    b_ptr,  # [V] bias (unused when HAS_BIAS is False)
    tgt_ptr,  # [n_rows] int32 targets, all in [0, V)
    inv_t_ptr,  # [n_rows] fp32 inverse temperature (times logit_scale without a soft cap)
    max_ptr,  # [splits, n_rows] fp32 out: running max m of s over the split
    sum_ptr,  # [splits, n_rows] fp32 out: l = sum_j exp(s_j - m)
    entropy_ptr,  # [splits, n_rows] fp32 out: a = sum_j exp(s_j - m) (s_j - m)  (WANT_ENTROPY)
    tgt_logit_ptr,  # [splits, n_rows] fp32 out: s_target if the target is in the split, else 0
    n_rows, V, D, v_per_split,
    stride_hn, stride_hd, stride_wv, stride_wd, stride_b,
    softcap, softcap_pre,  # fp32 runtime values (read with HAS_SOFTCAP)
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, WANT_ENTROPY: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per (row tile, vocabulary split). Online update per vocabulary tile,
    # with m' = max(m, max_j s_j):
    #     l' = l e^(m - m') + sum_j e^(s_j - m')
    #     a' = e^(m - m') (a + (m - m') l) + sum_j e^(s_j - m') (s_j - m')
    # (a is kept relative to m, so H = log l - a / l has no cancellation at large |s|).
    rows, row_mask, split = _row_tile_and_split(n_rows, BLOCK_N)
    tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=-1)
    inv_t = tl.load(inv_t_ptr + rows, mask=row_mask, other=1.0)
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    v_start = split * v_per_split
    v_end = tl.minimum(V, v_start + v_per_split)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < v_end
        s, _ = _scaled_logits(
            h_ptr, w_ptr, b_ptr, rows, row_mask, cols, col_mask, inv_t, D,
            stride_hn, stride_hd, stride_wv, stride_wd, stride_b, softcap, softcap_pre,
            HAS_BIAS, HAS_SOFTCAP, IEEE, UPCAST, BLOCK_N, BLOCK_V, BLOCK_D,
        )
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # a row whose logits so far are all -inf keeps l = 0: shift by 0, not by -inf
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_use)
        p = tl.exp(s - m_use[:, None])
        if WANT_ENTROPY:
            # where() before the product: no 0 * -inf (NaN) even in discarded lanes
            shifted = tl.where(l > 0, m - m_use, 0.0) * l
            ps = p * tl.where(p > 0, s - m_use[:, None], 0.0)
            a = alpha * (a + shifted) + tl.sum(ps, axis=1)
        l = alpha * l + tl.sum(p, axis=1)
        m = m_new
        t += tl.sum(tl.where(cols[None, :] == tgt[:, None], s, 0.0), axis=1)
    out = split.to(tl.int64) * n_rows + rows
    tl.store(max_ptr + out, m, mask=row_mask)
    tl.store(sum_ptr + out, l, mask=row_mask)
    tl.store(tgt_logit_ptr + out, t, mask=row_mask)
    if WANT_ENTROPY:
        tl.store(entropy_ptr + out, a, mask=row_mask)


@triton.jit
def _load_row_stats(
    rows, row_mask, tgt_ptr, inv_t_ptr, shift_ptr, log_l_ptr, entropy_ptr, g_logp_ptr, g_entropy_ptr,
    HAS_ENTROPY_GRAD: tl.constexpr,
):
    """What the backward needs per row: target, inv_T, the forward's m and log l, the
    entropy and the upstream gradients (neutral values in padded rows; without
    HAS_ENTROPY_GRAD, entropy and g_entropy are stand-ins that _softmax_grad never reads)."""
    tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=-1)
    inv_t = tl.load(inv_t_ptr + rows, mask=row_mask, other=1.0)
    shift = tl.load(shift_ptr + rows, mask=row_mask, other=0.0)
    log_l = tl.load(log_l_ptr + rows, mask=row_mask, other=0.0)
    g_logp = tl.load(g_logp_ptr + rows, mask=row_mask, other=0.0)
    if HAS_ENTROPY_GRAD:
        entropy = tl.load(entropy_ptr + rows, mask=row_mask, other=0.0)
        g_entropy = tl.load(g_entropy_ptr + rows, mask=row_mask, other=0.0)
    else:
        entropy = log_l
        g_entropy = g_logp
    return tgt, inv_t, shift, log_l, entropy, g_logp, g_entropy


@triton.jit
def _softmax_grad(
    s, cap_slope, row_mask, cols, tgt, shift, log_l, entropy, g_logp, g_entropy, inv_t, logit_scale,
    HAS_ENTROPY_GRAD: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    """dL/dr for a [BLOCK_N, BLOCK_V] tile of scaled logits s (formula above the kernels)
    with respect to the raw logits r = hidden @ weight.T + bias; lse = shift + log_l,
    applied in two steps (see the module docstring)."""
    logp = (s - shift[:, None]) - log_l[:, None]
    p = tl.exp(logp)  # 0 in padded (-inf) columns
    coef = -g_logp[:, None] * p
    if HAS_ENTROPY_GRAD:
        # p log p = 0 where p = 0, even when s = -inf
        coef -= g_entropy[:, None] * (p * tl.where(p > 0, logp + entropy[:, None], 0.0))
    coef += tl.where(cols[None, :] == tgt[:, None], g_logp[:, None], 0.0)
    dz = coef * inv_t[:, None]
    if HAS_SOFTCAP:
        dz = dz * (cap_slope * logit_scale)
    # Padded rows are exactly 0: the d_weight kernel sums dz over them, and their
    # p = exp(bias) (h = 0, shift = log_l = 0) can overflow, so 0 * inf would be NaN.
    return tl.where(row_mask[:, None], dz, 0.0)


# Backward, per valid row with p = softmax(s), s = inv_T z, and upstream g_logp, g_H:
#     dlogp/ds_j = onehot_j - p_j,     dH/ds_j = -p_j (s_j - lse + H)
#     dz_j       = inv_T (g_logp (onehot_j - p_j) - g_H p_j (s_j - lse + H))
# with z the logits before the temperature. With a soft cap, z = softcap tanh(a r)
# of the raw logits r = hidden @ weight.T + bias (a = logit_scale / softcap), and
#     dr_j       = dz_j logit_scale (1 - tanh^2(a r_j))
# (without one, a logit scale is folded into inv_T and dr = dz). Then
#     d_hidden   = dr @ weight                   (this kernel: [n_rows, D])
#     d_weight   = dr.T @ hidden,  d_bias = sum over rows of dr   (next kernel)
# This kernel: program pid owns row tile pid % n_tiles and vocabulary split
# pid // n_tiles. For each vocabulary tile it recomputes s from hidden and weight,
# forms dz (fp32), rounds it to the input dtype and adds dz @ weight[tile] into its own
# rows of the fp32 buffer dh[split] (read-modify-write by that program alone: no
# races, a fixed order, deterministic). The splits are summed afterwards.
@triton.jit
def _ltl_bwd_dhidden_kernel(
    h_ptr, w_ptr, b_ptr,  # as in the forward kernel
    tgt_ptr, inv_t_ptr,  # [n_rows] int32, fp32
    shift_ptr, log_l_ptr,  # [n_rows] fp32 row max m and log l from the forward (lse = m + log l)
    entropy_ptr,  # [n_rows] fp32 entropy from the forward (when HAS_ENTROPY_GRAD)
    g_logp_ptr, g_entropy_ptr,  # [n_rows] fp32 upstream gradients (g_entropy when HAS_ENTROPY_GRAD)
    dh_ptr,  # [splits, n_rows, D] fp32, zero-initialised, contiguous
    n_rows, V, D, v_per_split,
    stride_hn, stride_hd, stride_wv, stride_wd, stride_b,
    softcap, softcap_pre, logit_scale,  # fp32 runtime values (read with HAS_SOFTCAP)
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows, row_mask, split = _row_tile_and_split(n_rows, BLOCK_N)
    tgt, inv_t, shift, log_l, entropy, g_logp, g_entropy = _load_row_stats(
        rows, row_mask, tgt_ptr, inv_t_ptr, shift_ptr, log_l_ptr, entropy_ptr, g_logp_ptr, g_entropy_ptr,
        HAS_ENTROPY_GRAD,
    )
    dh_rows = (split.to(tl.int64) * n_rows + rows.to(tl.int64)) * D
    v_start = split * v_per_split
    v_end = tl.minimum(V, v_start + v_per_split)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < v_end
        s, cap_slope = _scaled_logits(
            h_ptr, w_ptr, b_ptr, rows, row_mask, cols, col_mask, inv_t, D,
            stride_hn, stride_hd, stride_wv, stride_wd, stride_b, softcap, softcap_pre,
            HAS_BIAS, HAS_SOFTCAP, IEEE, UPCAST, BLOCK_N, BLOCK_V, BLOCK_D,
        )
        dz = _softmax_grad(
            s, cap_slope, row_mask, cols, tgt, shift, log_l, entropy, g_logp, g_entropy, inv_t, logit_scale,
            HAS_ENTROPY_GRAD, HAS_SOFTCAP,
        )
        # [BLOCK_N, BLOCK_V] in the input dtype; UPCAST (bf16 under the interpreter) is
        # exactly when round_to must round by hand to match the GPU
        dz = round_to(dz, w_ptr.dtype.element_ty, UPCAST)
        _add_mm_over_d(
            dh_ptr, dh_rows, row_mask, dz, w_ptr, cols.to(tl.int64), col_mask, stride_wv, stride_wd, D,
            IEEE, UPCAST, BLOCK_D,
        )  # dh[rows] += dz @ weight[cols]


# Same gradient as above; this kernel makes d_weight = dz.T @ hidden and
# d_bias = sum over rows of dz. Program pid owns vocabulary tile pid and loops over all
# row tiles in order, recomputing s and dz, adding dz.T @ hidden[rows] into its own rows
# of the fp32 buffer dw (read-modify-write by that program alone: deterministic) and
# summing dz over rows in registers for d_bias.
@triton.jit
def _ltl_bwd_dweight_kernel(
    h_ptr, w_ptr, b_ptr,
    tgt_ptr, inv_t_ptr, shift_ptr, log_l_ptr, entropy_ptr, g_logp_ptr, g_entropy_ptr,
    dw_ptr,  # [V, D] fp32, zero-initialised, contiguous (when WANT_DW)
    db_ptr,  # [V] fp32 (when WANT_DB)
    n_rows, V, D,
    stride_hn, stride_hd, stride_wv, stride_wd, stride_b,
    softcap, softcap_pre, logit_scale,  # fp32 runtime values (read with HAS_SOFTCAP)
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr,
    WANT_DW: tl.constexpr, WANT_DB: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = pid * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    cols64 = cols.to(tl.int64)
    dw_rows = cols64 * D
    db = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for n0 in range(0, n_rows, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        row_mask = rows < n_rows
        tgt, inv_t, shift, log_l, entropy, g_logp, g_entropy = _load_row_stats(
            rows, row_mask, tgt_ptr, inv_t_ptr, shift_ptr, log_l_ptr, entropy_ptr, g_logp_ptr, g_entropy_ptr,
            HAS_ENTROPY_GRAD,
        )
        s, cap_slope = _scaled_logits(
            h_ptr, w_ptr, b_ptr, rows, row_mask, cols, col_mask, inv_t, D,
            stride_hn, stride_hd, stride_wv, stride_wd, stride_b, softcap, softcap_pre,
            HAS_BIAS, HAS_SOFTCAP, IEEE, UPCAST, BLOCK_N, BLOCK_V, BLOCK_D,
        )
        dz = _softmax_grad(
            s, cap_slope, row_mask, cols, tgt, shift, log_l, entropy, g_logp, g_entropy, inv_t, logit_scale,
            HAS_ENTROPY_GRAD, HAS_SOFTCAP,
        )
        if WANT_DB:
            db += tl.sum(dz, axis=0)
        if WANT_DW:
            dzt = tl.trans(round_to(dz, h_ptr.dtype.element_ty, UPCAST))  # [BLOCK_V, BLOCK_N]
            _add_mm_over_d(
                dw_ptr, dw_rows, col_mask, dzt, h_ptr, rows.to(tl.int64), row_mask, stride_hn, stride_hd, D,
                IEEE, UPCAST, BLOCK_D,
            )  # dw[cols] += dz.T @ hidden[rows]
    if WANT_DB:
        tl.store(db_ptr + cols64, db, mask=col_mask)


@dataclass(frozen=True)
class Tiles:
    """Launch configuration shared by the three kernels (GPU-sized defaults).

    One configuration for all three on purpose: the backward recomputes each
    [block_n, block_v] logit tile, and it must reproduce the forward's values bit for
    bit. A tile computed with another shape can differ by an ulp of the logit, and near
    p = 1 the gradient g (onehot - p) is a difference of nearly equal numbers: an ulp
    at |s| ~ 400 (3e-5) then becomes a 3e-5 gradient error where the true value is ~0.
    Block sizes are powers of two >= 16 (tl.dot). `v_splits` (None = automatic) splits
    the vocabulary of the forward and d_hidden launches across programs when there are
    too few row tiles to fill the GPU.
    """

    block_n: int = 64
    block_v: int = 128
    block_d: int = 32
    num_warps: int = 8
    v_splits: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("block_n", "block_v", "block_d"):
            b = getattr(self, name)
            if isinstance(b, bool) or not isinstance(b, int) or b < 16 or b & (b - 1):
                raise ValueError(f"Tiles.{name} must be a power of two >= 16 (tl.dot), got {b!r}")
        w = self.num_warps
        if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= 32 or w & (w - 1):
            raise ValueError(f"Tiles.num_warps must be a power of two in [1, 32], got {w!r}")
        if self.v_splits is not None and (isinstance(self.v_splits, bool) or not isinstance(self.v_splits, int)
                                          or self.v_splits < 1):
            raise ValueError(f"Tiles.v_splits must be None or an int >= 1, got {self.v_splits!r}")


# Defaults per input dtype, chosen without a GPU from ptxas's register report for sm_90
# (triton 3.9, ahead-of-time compile): bf16/fp16 at 64 x 128 x 32 use wgmma and spill
# nothing in the forward and d_hidden kernels (16 bytes in d_weight), where BLOCK_D = 64
# spilled 200-500 bytes in the backward; fp32 (FMA dots, IEEE) at 64 x 64 x 32 spills
# 8-40 bytes, at 64 x 128 x 32 over 600. With triton 3.6 (the GPU machine's) the
# defaults compile the same way: bf16/fp16 spill nothing, fp32 12-40 bytes in the
# backward.
DEFAULT_TILES = {
    torch.float16: Tiles(),
    torch.bfloat16: Tiles(),
    torch.float32: Tiles(block_v=64),
}
# Set to a Tiles to override the defaults for every dtype (the tests use tiny tiles).
TILES: Optional[Tiles] = None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split_vocab(
    n_rows: int, vocab: int, cfg: Tiles, device: torch.device, max_splits: Optional[int] = None
) -> Tuple[int, int]:
    """(splits, columns per split): enough programs to fill the GPU, >= 4 vocab tiles each,
    at most max_splits. Splits start at multiples of block_v, so every split sees the
    same logit tiles."""
    block_v = cfg.block_v
    n_tiles = _cdiv(n_rows, cfg.block_n)
    if cfg.v_splits is not None:
        want = max(1, int(cfg.v_splits))
    elif device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        want = max(1, min(_cdiv(2 * sms, n_tiles), _cdiv(vocab, 4 * block_v)))
    else:
        want = 1
    if max_splits is not None:
        want = min(want, max_splits)
    per_split = _cdiv(_cdiv(vocab, want), block_v) * block_v  # whole vocabulary tiles
    return _cdiv(vocab, per_split), per_split


def _launch_args(
    h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], cfg: Tiles, softcap: Optional[float]
) -> Tuple[torch.Tensor, Tuple[int, ...], Dict[str, object]]:
    """What the three kernels share: the bias pointer (weight as an unread stand-in),
    the strides of hidden, weight and bias, and the meta-parameters (IEEE and UPCAST
    for tl.dot: see `_mm`)."""
    b_arg, stride_b = (bias, bias.stride(0)) if bias is not None else (weight, 0)
    strides = (h.stride(0), h.stride(1), weight.stride(0), weight.stride(1), stride_b)
    meta = dict(
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap is not None,
        IEEE=h.dtype == torch.float32,
        UPCAST=h.dtype == torch.bfloat16 and interpreting(),
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, num_warps=cfg.num_warps,
    )
    return b_arg, strides, meta


# The kernels form column offsets as offs_d * stride_d in int32 (row offsets are int64).
INT32_OFFSET_LIMIT = 2**31


def _int32_safe_columns(t: torch.Tensor) -> torch.Tensor:
    """t [rows, D], copied to unit column stride when (D - 1) * stride(1) would overflow
    int32 (a transposed view of a [D, V] matrix with D * V >= 2**31, say); else t itself."""
    if t.shape[1] > 1 and (t.shape[1] - 1) * t.stride(1) >= INT32_OFFSET_LIMIT:
        return t.contiguous()
    return t


def _softcap_args(softcap: Optional[float], logit_scale: Optional[float]) -> Tuple[float, float, float]:
    """(softcap, logit_scale / softcap, logit_scale) as runtime kernel arguments (1.0 stand-ins when unused)."""
    scale = logit_scale or 1.0
    return (softcap, scale / softcap, scale) if softcap is not None else (1.0, 1.0, 1.0)


def _forward_stats(
    h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], tgt: torch.Tensor,
    inv_t: torch.Tensor, want_entropy: bool, cfg: Tiles, softcap: Optional[float], logit_scale: Optional[float],
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """h [n, D] (n >= 1), tgt [n] int32 valid, inv_t [n] fp32 ->
    lse_parts [2, n] (row max m, log l), logp [n], entropy [n] or None; all fp32."""
    n, d = h.shape
    vocab = weight.shape[0]
    splits, per_split = _split_vocab(n, vocab, cfg, h.device)
    stats = torch.empty(4, splits, n, dtype=torch.float32, device=h.device)
    m, l, a, t = stats.unbind(0)
    b_arg, strides, meta = _launch_args(h, weight, bias, cfg, softcap)
    grid = (_cdiv(n, cfg.block_n) * splits,)
    _ltl_fwd_kernel[grid](
        h, weight, b_arg, tgt, inv_t, m, l, a, t, n, vocab, d, per_split, *strides,
        *_softcap_args(softcap, logit_scale)[:2],
        WANT_ENTROPY=want_entropy, **meta,
    )
    # Merge the splits ([splits, n] -> [n]); one split is the common case.
    m_all = m.max(dim=0).values
    m_use = torch.where(torch.isneginf(m_all), torch.zeros_like(m_all), m_all)
    scale = torch.exp(m - m_use)  # [splits, n]
    total = (scale * l).sum(dim=0)
    log_l = torch.log(total)
    logp = (t.sum(dim=0) - m_use) - log_l
    entropy = None
    if want_entropy:
        shifted = torch.where(l > 0, m - m_use, torch.zeros_like(l)) * l
        a_all = (scale * (a + shifted)).sum(dim=0)
        entropy = log_l - a_all / total
    return torch.stack([m_use, log_l]), logp, entropy


class _LinearTokenLogprobs(torch.autograd.Function):
    """Saves hidden, weight, bias and per-row statistics (m, log l, entropy); never [N, V]."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inv_t, ignore_index, return_entropy, softcap, logit_scale):
        with no_autocast(hidden.device):
            return _LinearTokenLogprobs._forward(
                ctx, hidden, weight, bias, targets, inv_t, ignore_index, return_entropy, softcap, logit_scale
            )

    @staticmethod
    def _forward(ctx, hidden, weight, bias, targets, inv_t, ignore_index, return_entropy, softcap, logit_scale):
        n = hidden.shape[0]
        cfg = TILES or DEFAULT_TILES[hidden.dtype]  # the backward reuses these (see Tiles)
        rows = (targets != ignore_index).nonzero().squeeze(1)  # [n_valid]
        compact = rows.numel() != n
        logp = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(n, dtype=torch.float32, device=hidden.device) if return_entropy else None
        tgt = (targets[rows] if compact else targets).to(torch.int32).contiguous()
        it = (inv_t[rows] if compact else inv_t).contiguous()
        hidden, weight = _int32_safe_columns(hidden), _int32_safe_columns(weight)
        lse_parts = ent = None
        if rows.numel() > 0:
            h = hidden.index_select(0, rows) if compact else hidden
            lse_parts, lp, ent = _forward_stats(h, weight, bias, tgt, it, return_entropy, cfg, softcap, logit_scale)
            logp.index_copy_(0, rows, lp)
            if return_entropy:
                entropy.index_copy_(0, rows, ent)
        ctx.save_for_backward(hidden, weight, bias, rows, tgt, it, lse_parts, ent)
        ctx.compact = compact
        ctx.cfg = cfg
        ctx.softcap, ctx.logit_scale = softcap, logit_scale
        ctx.set_materialize_grads(False)  # an unused output costs nothing in backward
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        with no_autocast(ctx.saved_tensors[0].device):
            return _LinearTokenLogprobs._backward(ctx, g_logp, g_entropy)

    @staticmethod
    def _backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, rows, tgt, inv_t, lse_parts, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n_valid = rows.numel()
        if n_valid == 0 or g_logp is None and g_entropy is None:
            return (
                torch.zeros_like(hidden) if need_h else None,
                torch.zeros_like(weight) if need_w else None,
                torch.zeros_like(bias) if need_b else None,
                None, None, None, None, None, None,
            )
        d_hidden = d_weight = d_bias = None
        h = hidden.index_select(0, rows) if ctx.compact else hidden
        if g_logp is None:
            g = torch.zeros(n_valid, dtype=torch.float32, device=hidden.device)
        else:
            g = (g_logp[rows] if ctx.compact else g_logp).to(torch.float32).contiguous()
        has_gent = g_entropy is not None and ent is not None
        if has_gent:
            g_ent = (g_entropy[rows] if ctx.compact else g_entropy).to(torch.float32).contiguous()
        else:
            ent, g_ent = g, g  # placeholders, unread
        d = h.shape[1]
        vocab = weight.shape[0]
        cfg = ctx.cfg
        b_arg, strides, meta = _launch_args(h, weight, bias, cfg, ctx.softcap)
        cap_args = _softcap_args(ctx.softcap, ctx.logit_scale)
        if need_h:
            # each split holds an fp32 [n_valid, D] partial d_hidden: at most 4 of them
            splits, per_split = _split_vocab(n_valid, vocab, cfg, h.device, max_splits=4)
            dh = torch.zeros(splits, n_valid, d, dtype=torch.float32, device=h.device)
            grid = (_cdiv(n_valid, cfg.block_n) * splits,)
            _ltl_bwd_dhidden_kernel[grid](
                h, weight, b_arg, tgt, inv_t, lse_parts[0], lse_parts[1], ent, g, g_ent, dh,
                n_valid, vocab, d, per_split, *strides, *cap_args,
                HAS_ENTROPY_GRAD=has_gent, **meta,
            )
            dh = dh[0] if splits == 1 else dh.sum(dim=0)
            if ctx.compact:
                d_hidden = torch.zeros_like(hidden).index_copy_(0, rows, dh.to(hidden.dtype))
            else:
                d_hidden = dh.to(hidden.dtype)
        if need_w or need_b:
            dw = torch.zeros(vocab, d, dtype=torch.float32, device=h.device) if need_w else g
            db = torch.zeros(vocab, dtype=torch.float32, device=h.device) if need_b else g
            grid = (_cdiv(vocab, cfg.block_v),)
            _ltl_bwd_dweight_kernel[grid](
                h, weight, b_arg, tgt, inv_t, lse_parts[0], lse_parts[1], ent, g, g_ent, dw, db,
                n_valid, vocab, d, *strides, *cap_args,
                HAS_ENTROPY_GRAD=has_gent, WANT_DW=need_w, WANT_DB=need_b, **meta,
            )
            if need_w:
                d_weight = dw.to(weight.dtype)
            if need_b:
                d_bias = db.to(bias.dtype)
        return d_hidden, d_weight, d_bias, None, None, None, None, None, None


def _linear_token_logprobs_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    inv_t: torch.Tensor,
    ignore_index: int,
    return_entropy: bool,
    softcap: Optional[float],
    logit_scale: Optional[float],
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    return _LinearTokenLogprobs.apply(
        hidden, weight, bias, targets, inv_t, ignore_index, return_entropy, softcap, logit_scale
    )


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    inv_temperature: Union[None, float, torch.Tensor] = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    softcap: Optional[float] = None,
    logit_scale: Optional[float] = None,
    backend: str = "auto",
    validate: bool = True,
):
    """Log-probability of each row's target under softmax(z * inv_T), where
    z = softcap * tanh(logit_scale * (hidden @ weight.T + bias) / softcap) (each step only when given).

    Args:
        hidden: [N, D] fp16, bf16 or fp32 (fp64 on the torch backend).
        weight: [V, D], the lm_head weight, same dtype as hidden.
        targets: [N] int32/int64 in [0, V) or ignore_index. Ignored rows are skipped
            (they cost nothing), return 0 and get zero gradient.
        bias: optional [V], same dtype as hidden.
        inv_temperature: None, a float, or a [N] tensor (runtime value).
        return_entropy: also return the full-vocabulary entropy of each row.
        softcap: None, or the Gemma-2 final soft cap c > 0: z = c tanh(x / c) of the
            (scaled) logits x, before the temperature. A runtime value.
        logit_scale: None, or a multiplier s > 0 on the logits (bias included),
            applied first. A runtime value.
        backend: "auto" (Triton on CUDA, the reference elsewhere), "triton" or "torch".
        validate: check the values of targets (in range) and of a tensor
            inv_temperature (positive, finite). These checks read the tensors on the
            host (a device sync); pass False in a hot loop once the batch has been
            validated. Shapes, dtypes and devices are always checked.
    Returns:
        logp [N] fp32 (fp64 for fp64 inputs), and entropy [N] when return_entropy.
        Gradients flow to hidden, weight and bias.

    Under autocast (enabled for hidden's device type) the op treats the product
    hidden @ weight.T as autocast treats a linear layer: fp16/bf16/fp32 hidden, weight
    and bias are cast to the autocast dtype first (so fp32 parameters with bf16 hidden
    states work), and the softmax side stays fp32. Gradients reach the uncast tensors
    in their own dtypes.
    """
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES, device=hidden.device)
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES, device=hidden.device)
    amp = autocast_dtype(hidden.device)
    if amp is not None:  # as autocast casts a linear layer's operands (fp64 is left alone)
        hidden, weight, bias = (
            t.to(amp) if t is not None and t.dtype != torch.float64 else t for t in (hidden, weight, bias)
        )
    check_tensor("weight", weight, dtypes=(hidden.dtype,))
    n, d = hidden.shape
    vocab = weight.shape[0]
    if weight.shape[1] != d:
        raise ValueError(f"weight has D = {weight.shape[1]} columns but hidden has D = {d}")
    if vocab < 1:
        raise ValueError("weight must have at least one row (V >= 1)")
    if bias is not None:
        check_tensor("bias", bias, dtypes=(hidden.dtype,))
        if bias.shape[0] != vocab:
            raise ValueError(
                f"bias has {bias.shape[0]} entries, expected {vocab} (one per vocabulary row of weight)"
            )
    check_targets(targets, n, vocab, ignore_index, hidden.device, validate=validate)
    inv_t = row_inv_temperature(inv_temperature, n, hidden.device, validate=validate)
    softcap = optional_positive_float("softcap", softcap)
    logit_scale = optional_positive_float("logit_scale", logit_scale)
    if logit_scale is not None and softcap is None:
        # a plain scale is a factor on the temperature (one rounding, no extra pass)
        inv_t, logit_scale = inv_t * logit_scale, None
    if resolve_kernel_backend(backend, {"hidden": hidden}) == "torch":
        return reference.linear_token_logprobs(
            hidden,
            weight,
            targets,
            bias=bias,
            inv_temperature=inv_t,
            ignore_index=ignore_index,
            return_entropy=return_entropy,
            softcap=softcap,
            logit_scale=logit_scale,
            validate=False,  # inv_t was checked above
        )
    logp, entropy = _linear_token_logprobs_triton(
        hidden, weight, bias, targets, inv_t, ignore_index, return_entropy, softcap, logit_scale
    )
    return (logp, entropy) if return_entropy else logp
