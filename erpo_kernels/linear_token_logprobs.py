"""linear_token_logprobs: log-probs and entropy straight from hidden states and the
lm_head weight, never materialising [N, V].

Kernels, then the autograd Function, then the public function.

Per row, with z = hidden @ weight.T + bias (then the optional logit scale and soft
cap, see the backward's comment) and s = z * inv_T (inv_T a per-row runtime fp32
value), the kernels compute the same quantities as `reference.py`:
    lse = log sum_j exp(s_j),   logp = s_target - lse,   H = lse - sum_j p_j s_j.
The log-sum-exp is kept as two fp32 numbers, the row max m and log l with
l = sum_j exp(s_j - m), and log-probs are formed as (s_j - m) - log l: a single fp32
lse = m + log l is rounded at the magnitude of the logits (1.5e-5 at |s| ~ 400), an
error every p_j inherits (measured here: 10x larger d_weight / d_hidden errors at
|s| ~ 400 with a single lse).
Logits live only in [BLOCK_N, BLOCK_V] register tiles, made by `tl.dot` over D with
fp32 accumulation; nothing of size N x V is written to memory, in either direction.

Work plan. Rows whose target is ignore_index are skipped without a host sync: a
stable sort puts the valid rows first (`order`), their count stays on the device, and
every kernel reads rows through `order` (tiles past the count do no work).
    forward   `_ltl_fwd_kernel`: one program per (row tile, vocabulary chunk): an
              online log-sum-exp and entropy over its chunk; `_ltl_merge_kernel`
              merges the chunks' statistics (a few floats per row) in chunk order.
    backward  `_ltl_bwd_dhidden_kernel`: one program per row tile, looping over V
              and recomputing the logits -> d_hidden.
              `_ltl_bwd_dweight_kernel`: one program per vocabulary tile, looping
              over the rows and recomputing the logits -> d_weight and d_bias.
Each output element is owned by one program and accumulated in a fixed order in an
fp32 buffer, so gradients are deterministic (no atomics).

Batch invariance: the vocabulary chunks depend on V and the tiles only; a row's
logits come from tl.dot tiles whose per-element sums do not depend on the other rows
of the tile; every per-row reduction (online softmax, merge, d_hidden) runs in a fixed
order over the vocabulary. So a row's logp, entropy and d_hidden are bit-identical
whatever else is in the batch (tests/test_batch_invariance.py).

Precision: fp32 operands use `input_precision="ieee"` (no TF32) so fp32 inputs keep
fp32 accuracy; bf16/fp16 operands use tensor cores with fp32 accumulation, and the
softmax gradient is rounded to the input dtype before its two matmuls (as PyTorch's
own backward in that dtype does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch

from . import reference
from ._triton import interpreting, round_to, soft_cap, tl, triton
from ._utils import (
    FLOAT_DTYPES,
    autocast_dtype,
    check_targets,
    check_tensor,
    compute_dtype,
    no_autocast,
    optional_positive_float,
    resolve_kernel_backend,
    row_inv_temperature,
)
from .logit_transform import LogitTransform, is_unit_scale


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
    """(rows, split) of program pid in a (row tile, vocabulary split) launch: row tile
    pid % n_tiles of split pid // n_tiles, so that neighbouring programs share a split
    and stream the same weight tiles (L2). `rows` are compact positions (see `_rows_of`)."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(n_rows, BLOCK_N)
    tile = pid % n_tiles
    split = pid // n_tiles
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, split


@triton.jit
def _rows_of(rows, order_ptr, n_valid_ptr):
    """Compact positions -> (row_mask, row_index, n_valid). Position p < n_valid holds the
    p-th row whose target is not ignore_index; order[p] is its index in the caller's
    [N] tensors (hidden, targets, outputs). n_valid is read from device memory, so the
    launch never waits for the host to count the valid rows."""
    n_valid = tl.load(n_valid_ptr)
    row_mask = rows < n_valid
    row_index = tl.load(order_ptr + rows, mask=row_mask, other=0)
    return row_mask, row_index.to(tl.int64), n_valid


@triton.jit
def _ltl_fwd_kernel(
    h_ptr,  # [N, D] hidden states (fp16/bf16/fp32), rows read through order
    w_ptr,  # [V, D] weight, hidden's dtype
    b_ptr,  # [V] bias (unused when HAS_BIAS is False)
    targets_ptr,  # [N] int32/int64 targets
    inv_t_ptr,  # [N] fp32 inverse temperature (times logit_scale without a soft cap)
    order_ptr,  # [N] int64: valid rows first (see _rows_of)
    n_valid_ptr,  # [1] int64: the number of valid rows
    max_ptr,  # [splits, N] fp32 out: running max m of s over the split (compact positions)
    sum_ptr,  # [splits, N] fp32 out: l = sum_j exp(s_j - m)
    entropy_ptr,  # [splits, N] fp32 out: a = sum_j exp(s_j - m) (s_j - m)  (WANT_ENTROPY)
    target_logit_ptr,  # [splits, N] fp32 out: s_target if the target is in the split, else 0
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
    rows, split = _row_tile_and_split(n_rows, BLOCK_N)
    row_mask, row_index, n_valid = _rows_of(rows, order_ptr, n_valid_ptr)
    tgt = tl.load(targets_ptr + row_index, mask=row_mask, other=-1).to(tl.int32)
    inv_t = tl.load(inv_t_ptr + row_index, mask=row_mask, other=1.0)
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    v_start = split * v_per_split
    v_end = tl.minimum(V, v_start + v_per_split)
    v_end = tl.where(tl.min(rows, axis=0) < n_valid, v_end, v_start)  # a tile of ignored rows: no work
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < v_end
        s, _ = _scaled_logits(
            h_ptr, w_ptr, b_ptr, row_index, row_mask, cols, col_mask, inv_t, D,
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
    tl.store(target_logit_ptr + out, t, mask=row_mask)
    if WANT_ENTROPY:
        tl.store(entropy_ptr + out, a, mask=row_mask)


# Merge of the forward's per-split statistics (m_k, l_k, a_k, t_k of split k), per row:
#     M = max_k m_k,  L = sum_k e^(m_k - M) l_k,  log l = log L
#     logp = (sum_k t_k - M) - log l
#     A = sum_k e^(m_k - M) (a_k + (m_k - M) l_k),  H = log l - A / L
# One program per block of compact positions; the splits are visited in order 0, 1, ...
# so a row's result depends on its own statistics only (batch invariance).
@triton.jit
def _ltl_merge_kernel(
    max_ptr, sum_ptr, entropy_part_ptr, target_logit_ptr,  # [splits, N] fp32 from the forward
    order_ptr, n_valid_ptr,  # as in the forward
    logp_ptr,  # [N] fp32 out, at the caller's row index (ignored rows untouched)
    entropy_ptr,  # [N] fp32 out (WANT_ENTROPY)
    shift_ptr, log_l_ptr,  # [N] fp32 out: M and log l, saved for the backward (lse = M + log l)
    n_rows, splits,
    WANT_ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row_mask, row_index, _ = _rows_of(rows, order_ptr, n_valid_ptr)
    m_all = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for k in range(0, splits):
        m_all = tl.maximum(m_all, tl.load(max_ptr + k * n_rows + rows, mask=row_mask, other=float("-inf")))
    m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    a_all = tl.zeros((BLOCK,), dtype=tl.float32)
    t_all = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, splits):
        at = k * n_rows + rows
        m_k = tl.load(max_ptr + at, mask=row_mask, other=float("-inf"))
        l_k = tl.load(sum_ptr + at, mask=row_mask, other=0.0)
        scale = tl.exp(m_k - m_use)
        total += scale * l_k
        t_all += tl.load(target_logit_ptr + at, mask=row_mask, other=0.0)
        if WANT_ENTROPY:
            a_k = tl.load(entropy_part_ptr + at, mask=row_mask, other=0.0)
            shifted = tl.where(l_k > 0, m_k - m_use, 0.0) * l_k
            a_all += scale * (a_k + shifted)
    total = tl.where(row_mask, total, 1.0)
    log_l = tl.log(total)
    tl.store(logp_ptr + row_index, (t_all - m_use) - log_l, mask=row_mask)
    tl.store(shift_ptr + row_index, m_use, mask=row_mask)
    tl.store(log_l_ptr + row_index, log_l, mask=row_mask)
    if WANT_ENTROPY:
        tl.store(entropy_ptr + row_index, log_l - a_all / total, mask=row_mask)


@triton.jit
def _load_row_stats(
    row_index, row_mask, targets_ptr, inv_t_ptr, shift_ptr, log_l_ptr, entropy_ptr, g_logp_ptr, g_entropy_ptr,
    HAS_ENTROPY_GRAD: tl.constexpr,
):
    """What the backward needs per row (at the caller's row index): target, inv_T, the
    forward's M and log l, the entropy and the upstream gradients (neutral values in
    padded rows; without HAS_ENTROPY_GRAD, entropy and g_entropy are stand-ins that
    _softmax_grad never reads)."""
    tgt = tl.load(targets_ptr + row_index, mask=row_mask, other=-1).to(tl.int32)
    inv_t = tl.load(inv_t_ptr + row_index, mask=row_mask, other=1.0)
    shift = tl.load(shift_ptr + row_index, mask=row_mask, other=0.0)
    log_l = tl.load(log_l_ptr + row_index, mask=row_mask, other=0.0)
    g_logp = tl.load(g_logp_ptr + row_index, mask=row_mask, other=0.0)
    if HAS_ENTROPY_GRAD:
        entropy = tl.load(entropy_ptr + row_index, mask=row_mask, other=0.0)
        g_entropy = tl.load(g_entropy_ptr + row_index, mask=row_mask, other=0.0)
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
#     d_hidden   = dr @ weight                   (this kernel: [N, D])
#     d_weight   = dr.T @ hidden,  d_bias = sum over rows of dr   (next kernel)
# This kernel: one program per row tile, looping over the whole vocabulary in order.
# For each vocabulary tile it recomputes s from hidden and weight, forms dr (fp32),
# rounds it to the input dtype and adds dr @ weight[tile] into its own rows of the fp32
# buffer dh (read-modify-write by that program alone: no races, a fixed order,
# deterministic, and a row's sum never depends on the other rows: batch invariant).
@triton.jit
def _ltl_bwd_dhidden_kernel(
    h_ptr, w_ptr, b_ptr,  # as in the forward kernel
    targets_ptr, inv_t_ptr, order_ptr, n_valid_ptr,  # as in the forward kernel
    shift_ptr, log_l_ptr,  # [N] fp32 M and log l from the forward (lse = M + log l)
    entropy_ptr,  # [N] fp32 entropy from the forward (when HAS_ENTROPY_GRAD)
    g_logp_ptr, g_entropy_ptr,  # [N] fp32 upstream gradients (g_entropy when HAS_ENTROPY_GRAD)
    dh_ptr,  # [N, D] fp32, zero-initialised, contiguous: rows of ignored targets stay 0
    n_rows, V, D,
    stride_hn, stride_hd, stride_wv, stride_wd, stride_b,
    softcap, softcap_pre, logit_scale,  # fp32 runtime values (read with HAS_SOFTCAP)
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows, _ = _row_tile_and_split(n_rows, BLOCK_N)
    row_mask, row_index, n_valid = _rows_of(rows, order_ptr, n_valid_ptr)
    tgt, inv_t, shift, log_l, entropy, g_logp, g_entropy = _load_row_stats(
        row_index, row_mask, targets_ptr, inv_t_ptr, shift_ptr, log_l_ptr, entropy_ptr, g_logp_ptr, g_entropy_ptr,
        HAS_ENTROPY_GRAD,
    )
    dh_rows = row_index * D
    v_end = tl.where(tl.min(rows, axis=0) < n_valid, V, 0)  # a tile of ignored rows: no work
    for v0 in range(0, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < V
        s, cap_slope = _scaled_logits(
            h_ptr, w_ptr, b_ptr, row_index, row_mask, cols, col_mask, inv_t, D,
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


# Same gradient as above; this kernel makes d_weight = dr.T @ hidden and
# d_bias = sum over rows of dr. Program pid owns vocabulary tile pid and loops over all
# row tiles in order, recomputing s and dr, adding dr.T @ hidden[rows] into its own rows
# of the fp32 buffer dw (read-modify-write by that program alone: deterministic) and
# summing dr over rows in registers for d_bias. (These sums run over the batch's rows:
# d_weight and d_bias are outside the batch-invariance guarantee.)
@triton.jit
def _ltl_bwd_dweight_kernel(
    h_ptr, w_ptr, b_ptr,
    targets_ptr, inv_t_ptr, order_ptr, n_valid_ptr, shift_ptr, log_l_ptr, entropy_ptr, g_logp_ptr, g_entropy_ptr,
    dw_ptr,  # [V, D] fp32, zero-initialised, contiguous (when WANT_DW)
    db_ptr,  # [V] fp32 (when WANT_DB)
    V, D,
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
    n_valid = tl.load(n_valid_ptr)
    for n0 in range(0, n_valid, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        row_mask, row_index, _ = _rows_of(rows, order_ptr, n_valid_ptr)
        tgt, inv_t, shift, log_l, entropy, g_logp, g_entropy = _load_row_stats(
            row_index, row_mask, targets_ptr, inv_t_ptr, shift_ptr, log_l_ptr, entropy_ptr, g_logp_ptr,
            g_entropy_ptr, HAS_ENTROPY_GRAD,
        )
        s, cap_slope = _scaled_logits(
            h_ptr, w_ptr, b_ptr, row_index, row_mask, cols, col_mask, inv_t, D,
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
                dw_ptr, dw_rows, col_mask, dzt, h_ptr, row_index, row_mask, stride_hn, stride_hd, D,
                IEEE, UPCAST, BLOCK_D,
            )  # dw[cols] += dz.T @ hidden[rows]
    if WANT_DB:
        tl.store(db_ptr + cols64, db, mask=col_mask)


@dataclass(frozen=True)
class Tiles:
    """Launch configuration shared by the kernels (GPU-sized defaults per dtype in
    DEFAULT_TILES; pass one as `tiles=` to choose another).

    One configuration for all kernels on purpose: the backward recomputes each
    [block_n, block_v] logit tile, and it must reproduce the forward's values bit for
    bit. A tile computed with another shape can differ by an ulp of the logit, and near
    p = 1 the gradient g (onehot - p) is a difference of nearly equal numbers: an ulp
    at |s| ~ 400 (3e-5) then becomes a 3e-5 gradient error where the true value is ~0.
    Block sizes are powers of two >= 16 (tl.dot). The forward splits the vocabulary
    into chunks of `split_tiles` vocabulary tiles, one program per (row tile, chunk):
    the split depends on V and this configuration only, never on the batch, so that a
    row's results do not either (batch invariance).
    """

    block_n: int = 64
    block_v: int = 128
    block_d: int = 32
    num_warps: int = 8
    split_tiles: int = 32

    def __post_init__(self) -> None:
        for name in ("block_n", "block_v", "block_d"):
            b = getattr(self, name)
            if isinstance(b, bool) or not isinstance(b, int) or b < 16 or b & (b - 1):
                raise ValueError(f"Tiles.{name} must be a power of two >= 16 (tl.dot), got {b!r}")
        w = self.num_warps
        if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= 32 or w & (w - 1):
            raise ValueError(f"Tiles.num_warps must be a power of two in [1, 32], got {w!r}")
        k = self.split_tiles
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"Tiles.split_tiles must be an int >= 1, got {k!r}")


# Defaults per input dtype, chosen without a GPU from ptxas's register report for sm_90
# (triton 3.9, ahead-of-time compile): bf16/fp16 at 64 x 128 x 32 use wgmma and spill
# nothing in the forward and d_hidden kernels (16 bytes in d_weight), where BLOCK_D = 64
# spilled 200-500 bytes in the backward; fp32 (FMA dots, IEEE) at 64 x 64 x 32 spills
# 8-40 bytes, at 64 x 128 x 32 over 600. With triton 3.6 (the GPU machine's) the
# defaults compile the same way: bf16/fp16 spill nothing, fp32 12-40 bytes in the
# backward. The forward chunk is 32 vocabulary tiles (4096 columns in bf16/fp16, 2048
# in fp32): V = 151,936 makes 38 (75) chunks per row tile, enough programs to fill a
# GPU from a single row tile.
DEFAULT_TILES: Dict[torch.dtype, Tiles] = {
    torch.float16: Tiles(),
    torch.bfloat16: Tiles(),
    torch.float32: Tiles(block_v=64),
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split_vocab(vocab: int, tiles: Tiles) -> Tuple[int, int]:
    """(splits, columns per split) of the forward: whole chunks of tiles.split_tiles
    vocabulary tiles, a function of V and the tiles only."""
    per_split = tiles.split_tiles * tiles.block_v
    return _cdiv(vocab, per_split), per_split


# The kernels form column offsets as offs_d * stride_d in int32 (row offsets are int64).
INT32_OFFSET_LIMIT = 2**31


def _int32_safe_columns(t: torch.Tensor) -> torch.Tensor:
    """t [rows, D], copied to unit column stride when (D - 1) * stride(1) would overflow
    int32 (a transposed view of a [D, V] matrix with D * V >= 2**31, say); else t itself."""
    if t.shape[1] > 1 and (t.shape[1] - 1) * t.stride(1) >= INT32_OFFSET_LIMIT:
        return t.contiguous()
    return t


@dataclass(frozen=True)
class _Launch:
    """Everything the kernels share, derived once per call: the operands, their strides,
    the valid-row order, the soft-cap values and every compile-time flag."""

    hidden: torch.Tensor  # [N, D]
    weight: torch.Tensor  # [V, D]
    bias: Optional[torch.Tensor]  # [V]
    targets: torch.Tensor  # [N] int32/int64, contiguous
    inv_t: torch.Tensor  # [N] fp32, contiguous (times logit_scale when there is no soft cap)
    order: torch.Tensor  # [N] int64: rows whose target is not ignore_index first, in order
    n_valid: torch.Tensor  # [1] int64 on the device: how many there are (never read on the host)
    softcap: Optional[float]
    logit_scale: Optional[float]
    tiles: Tiles

    @staticmethod
    def build(hidden, weight, bias, targets, inv_t, ignore_index, softcap, logit_scale, tiles) -> "_Launch":
        ignored = targets == ignore_index
        # a stable sort of a 0/1 key: the valid rows first, without a host sync
        order = torch.sort(ignored.to(torch.uint8), stable=True).indices
        n_valid = (~ignored).sum().reshape(1)
        return _Launch(
            _int32_safe_columns(hidden), _int32_safe_columns(weight), bias, targets.contiguous(),
            inv_t.contiguous(), order, n_valid, softcap, logit_scale, tiles,
        )

    @property
    def n(self) -> int:
        return self.hidden.shape[0]

    def grid_rows(self, splits: int = 1) -> Tuple[int]:
        return (_cdiv(self.n, self.tiles.block_n) * splits,)

    def common(self) -> Dict[str, object]:
        """Keyword arguments every matmul kernel takes, flags included."""
        h, w, b, cfg = self.hidden, self.weight, self.bias, self.tiles
        cap = self.softcap
        return dict(
            h_ptr=h, w_ptr=w, b_ptr=b if b is not None else w,  # weight: an unread stand-in
            targets_ptr=self.targets, inv_t_ptr=self.inv_t, order_ptr=self.order, n_valid_ptr=self.n_valid,
            V=w.shape[0], D=h.shape[1],
            stride_hn=h.stride(0), stride_hd=h.stride(1), stride_wv=w.stride(0), stride_wd=w.stride(1),
            stride_b=b.stride(0) if b is not None else 0,
            softcap=cap if cap is not None else 1.0,
            softcap_pre=(self.logit_scale or 1.0) / cap if cap is not None else 1.0,
            HAS_BIAS=b is not None,
            HAS_SOFTCAP=cap is not None,
            IEEE=h.dtype == torch.float32,  # fp32 operands: no TF32 (see _mm)
            UPCAST=h.dtype == torch.bfloat16 and interpreting(),  # the interpreter's bf16 dot (see _mm)
            BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, num_warps=cfg.num_warps,
        )


# Rows per program of the merge kernel.
MERGE_BLOCK = 256


def _forward(launch: _Launch, want_entropy: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """logp [N], entropy [N] or None, and lse_parts [2, N] (M, log l) saved for the
    backward; all fp32, 0 in ignored rows."""
    n = launch.n
    vocab = launch.weight.shape[0]
    f32 = dict(dtype=torch.float32, device=launch.hidden.device)
    logp = torch.zeros(n, **f32)
    entropy = torch.zeros(n, **f32) if want_entropy else None
    lse_parts = torch.zeros(2, n, **f32)
    if n == 0:
        return logp, entropy, lse_parts
    splits, per_split = _split_vocab(vocab, launch.tiles)
    stats = torch.empty(4, splits, n, **f32)
    m, l, a, t = stats.unbind(0)
    common = launch.common()
    _ltl_fwd_kernel[launch.grid_rows(splits)](
        max_ptr=m, sum_ptr=l, entropy_ptr=a, target_logit_ptr=t,
        n_rows=n, v_per_split=per_split, WANT_ENTROPY=want_entropy, **common,
    )
    _ltl_merge_kernel[(_cdiv(n, MERGE_BLOCK),)](
        max_ptr=m, sum_ptr=l, entropy_part_ptr=a, target_logit_ptr=t,
        order_ptr=launch.order, n_valid_ptr=launch.n_valid,
        logp_ptr=logp, entropy_ptr=entropy if want_entropy else logp,  # logp: an unwritten stand-in
        shift_ptr=lse_parts[0], log_l_ptr=lse_parts[1],
        n_rows=n, splits=splits, WANT_ENTROPY=want_entropy, BLOCK=MERGE_BLOCK, num_warps=4,
    )
    return logp, entropy, lse_parts


def _backward(
    launch: _Launch, lse_parts: torch.Tensor, entropy: Optional[torch.Tensor], g_logp: torch.Tensor,
    g_entropy: Optional[torch.Tensor], need: Tuple[bool, bool, bool],
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(d_hidden, d_weight, d_bias), each None unless `need` says so."""
    hidden, weight, bias = launch.hidden, launch.weight, launch.bias
    n, d = hidden.shape
    vocab = weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    has_entropy_grad = g_entropy is not None
    rows = dict(
        shift_ptr=lse_parts[0], log_l_ptr=lse_parts[1],
        entropy_ptr=entropy if has_entropy_grad else g_logp,  # unread stand-ins without entropy
        g_logp_ptr=g_logp, g_entropy_ptr=g_entropy if has_entropy_grad else g_logp,
        logit_scale=launch.logit_scale or 1.0,
        HAS_ENTROPY_GRAD=has_entropy_grad,
    )
    common = launch.common()
    d_hidden = d_weight = d_bias = None
    if need[0]:
        dh = torch.zeros(n, d, **f32)
        if n > 0:
            _ltl_bwd_dhidden_kernel[launch.grid_rows()](dh_ptr=dh, n_rows=n, **rows, **common)
        d_hidden = dh.to(hidden.dtype)
    if need[1] or need[2]:
        dw = torch.zeros(vocab, d, **f32) if need[1] else g_logp  # stand-ins when unwanted
        db = torch.zeros(vocab, **f32) if need[2] else g_logp
        if n > 0:
            _ltl_bwd_dweight_kernel[(_cdiv(vocab, launch.tiles.block_v),)](
                dw_ptr=dw, db_ptr=db, WANT_DW=need[1], WANT_DB=need[2], **rows, **common
            )
        d_weight = dw.to(weight.dtype) if need[1] else None
        d_bias = db.to(bias.dtype) if need[2] else None
    return d_hidden, d_weight, d_bias


class _LinearTokenLogprobs(torch.autograd.Function):
    """Saves hidden, weight, bias and per-row statistics (M, log l, entropy); never [N, V]."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inv_t, ignore_index, return_entropy, softcap, logit_scale, tiles):
        with no_autocast(hidden.device):
            launch = _Launch.build(hidden, weight, bias, targets, inv_t, ignore_index, softcap, logit_scale, tiles)
            logp, entropy, lse_parts = _forward(launch, return_entropy)
        ctx.save_for_backward(
            launch.hidden, launch.weight, bias, launch.targets, launch.inv_t, launch.order, launch.n_valid,
            lse_parts, entropy,
        )
        ctx.launch_options = (softcap, logit_scale, tiles)
        ctx.set_materialize_grads(False)  # an unused output costs nothing in backward
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, targets, inv_t, order, n_valid, lse_parts, entropy = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3])
        with no_autocast(hidden.device):
            launch = _Launch(hidden, weight, bias, targets, inv_t, order, n_valid, *ctx.launch_options)
            if g_logp is None and g_entropy is None:
                d_hidden, d_weight, d_bias = (torch.zeros_like(t) if want else None
                                              for t, want in zip((hidden, weight, bias), need))  # fmt: skip
            else:
                f32 = dict(dtype=torch.float32, device=hidden.device)
                g_logp = g_logp.to(torch.float32).contiguous() if g_logp is not None else torch.zeros(hidden.shape[0], **f32)
                if entropy is None:
                    g_entropy = None
                elif g_entropy is not None:
                    g_entropy = g_entropy.to(torch.float32).contiguous()
                d_hidden, d_weight, d_bias = _backward(launch, lse_parts, entropy, g_logp, g_entropy, need)
        return d_hidden, d_weight, d_bias, None, None, None, None, None, None, None


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
    tiles: Tiles,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    return _LinearTokenLogprobs.apply(
        hidden, weight, bias, targets, inv_t, ignore_index, return_entropy, softcap, logit_scale, tiles
    )


# ---------------------------------------------------------------------------------
# The same op for torch.compile: a torch.library custom op (forward and backward each
# one opaque op with a shape-only fake), so a compiled graph calls it without a break.
# `use_triton` selects the kernels or the reference behind the one op;
# linear_token_logprobs takes this path while torch.compile traces it.


def _empty(like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return like.new_empty(0, dtype=dtype)


@torch.library.custom_op("erpo_kernels::linear_token_logprobs_fwd", mutates_args=())
def _fwd_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
    inv_t: torch.Tensor, ignore_index: int, return_entropy: bool, softcap: Optional[float],
    logit_scale: Optional[float], use_triton: bool, tiles: List[int],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> logp [N], entropy [N] (or [0]), and what the Triton backward needs: lse_parts
    [2, N], order [N], n_valid [1] (each [0] on the reference)."""
    if use_triton:
        launch = _Launch.build(hidden, weight, bias, targets, inv_t, ignore_index, softcap, logit_scale, Tiles(*tiles))
        with no_autocast(hidden.device):
            logp, entropy, lse_parts = _forward(launch, return_entropy)
        order, n_valid = launch.order, launch.n_valid
    else:
        logp, entropy = reference.linear_token_logprobs_forward(
            hidden, weight, bias, targets, LogitTransform(inv_t, softcap, logit_scale), ignore_index, return_entropy
        )
        lse_parts, order, n_valid = _empty(logp), _empty(logp, torch.int64), _empty(logp, torch.int64)
    return logp, entropy if entropy is not None else _empty(logp), lse_parts, order, n_valid


@_fwd_op.register_fake
def _fwd_fake(hidden, weight, bias, targets, inv_t, ignore_index, return_entropy, softcap, logit_scale, use_triton,
              tiles):  # fmt: skip
    n = hidden.shape[0]
    logp = hidden.new_empty(n, dtype=torch.float32 if use_triton else compute_dtype(hidden.dtype))
    entropy = logp.new_empty(n if return_entropy else 0)
    if use_triton:
        return logp, entropy, logp.new_empty(2, n), logp.new_empty(n, dtype=torch.int64), logp.new_empty(
            1, dtype=torch.int64
        )
    return logp, entropy, logp.new_empty(0), logp.new_empty(0, dtype=torch.int64), logp.new_empty(0, dtype=torch.int64)


@torch.library.custom_op("erpo_kernels::linear_token_logprobs_bwd", mutates_args=())
def _bwd_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
    inv_t: torch.Tensor, lse_parts: torch.Tensor, order: torch.Tensor, n_valid: torch.Tensor, entropy: torch.Tensor,
    g_logp: Optional[torch.Tensor], g_entropy: Optional[torch.Tensor], ignore_index: int, softcap: Optional[float],
    logit_scale: Optional[float], use_triton: bool, tiles: List[int],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> d_hidden, d_weight, d_bias ([0] without a bias)."""
    has_entropy_grad = g_entropy is not None and entropy.numel() > 0
    if use_triton:
        f32 = dict(dtype=torch.float32, device=hidden.device)
        launch = _Launch(_int32_safe_columns(hidden), _int32_safe_columns(weight), bias, targets.contiguous(),
                         inv_t.contiguous(), order, n_valid, softcap, logit_scale, Tiles(*tiles))  # fmt: skip
        g = g_logp.to(torch.float32).contiguous() if g_logp is not None else torch.zeros(hidden.shape[0], **f32)
        ge = g_entropy.to(torch.float32).contiguous() if has_entropy_grad else None
        with no_autocast(hidden.device):
            d_hidden, d_weight, d_bias = _backward(
                launch, lse_parts, entropy if has_entropy_grad else None, g, ge, (True, True, bias is not None)
            )
    else:
        d_hidden, d_weight, d_bias = reference.linear_token_logprobs_backward(
            hidden, weight, bias, targets, LogitTransform(inv_t, softcap, logit_scale), ignore_index,
            entropy if has_entropy_grad else None, g_logp, g_entropy if has_entropy_grad else None,
        )
    return d_hidden, d_weight, d_bias if d_bias is not None else _empty(weight)


@_bwd_op.register_fake
def _bwd_fake(hidden, weight, bias, *args):
    d_bias = torch.empty_like(bias) if bias is not None else weight.new_empty(0)
    return torch.empty_like(hidden), torch.empty_like(weight), d_bias


def _op_setup(ctx, inputs, output):
    hidden, weight, bias, targets, inv_t, ignore_index, return_entropy = inputs[:7]
    _, entropy, lse_parts, order, n_valid = output
    ctx.save_for_backward(hidden, weight, bias, targets, inv_t, lse_parts, order, n_valid, entropy)
    ctx.options = (ignore_index, return_entropy, *inputs[7:])


def _op_backward(ctx, g_logp, g_entropy, *_unused):
    hidden, weight, bias, targets, inv_t, lse_parts, order, n_valid, entropy = ctx.saved_tensors
    ignore_index, return_entropy, softcap, logit_scale, use_triton, tiles = ctx.options
    d_hidden, d_weight, d_bias = _bwd_op(
        hidden, weight, bias, targets, inv_t, lse_parts, order, n_valid, entropy, g_logp,
        g_entropy if return_entropy else None, ignore_index, softcap, logit_scale, use_triton, tiles,
    )
    return (d_hidden, d_weight, d_bias if bias is not None else None) + (None,) * 8


torch.library.register_autograd("erpo_kernels::linear_token_logprobs_fwd", _op_backward, setup_context=_op_setup)


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
    tiles: Optional[Tiles] = None,
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
        tiles: the Triton launch configuration (None: DEFAULT_TILES for the dtype).
    Returns:
        logp [N] fp32 (fp64 for fp64 inputs), and entropy [N] when return_entropy.
        Gradients flow to hidden, weight and bias. On the Triton backend, a row's
        logp, entropy and d_hidden row are bit-identical whatever else is in the batch
        (N, the other rows, ignored rows, the row's position): they depend on the
        row, weight, bias, the options, the dtype and the tiles only.

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
    unit = is_unit_scale(inv_temperature, logit_scale)  # temperature 1, no scale: known without reading a tensor
    softcap = optional_positive_float("softcap", softcap)
    logit_scale = optional_positive_float("logit_scale", logit_scale)
    if logit_scale is not None and softcap is None:
        # a plain scale is a factor on the temperature (one rounding, no extra pass)
        inv_t, logit_scale = inv_t * logit_scale, None
    if tiles is not None and not isinstance(tiles, Tiles):
        raise ValueError(f"tiles must be None or a Tiles, got {type(tiles).__name__}")
    which = resolve_kernel_backend(backend, {"hidden": hidden})
    if torch.compiler.is_compiling():
        cfg = tiles or DEFAULT_TILES.get(hidden.dtype, Tiles())
        logp, entropy, _, _, _ = _fwd_op(
            hidden, weight, bias, targets, inv_t, ignore_index, return_entropy, softcap, logit_scale,
            which == "triton", [cfg.block_n, cfg.block_v, cfg.block_d, cfg.num_warps, cfg.split_tiles],
        )
        return (logp, entropy) if return_entropy else logp
    if which == "torch":
        return reference.linear_token_logprobs(
            hidden,
            weight,
            targets,
            bias=bias,
            inv_temperature=None if unit else inv_t,  # None: the reference skips the shift and scale
            ignore_index=ignore_index,
            return_entropy=return_entropy,
            softcap=softcap,
            logit_scale=logit_scale,
            validate=False,  # inv_t was checked above
        )
    logp, entropy = _linear_token_logprobs_triton(
        hidden, weight, bias, targets, inv_t, ignore_index, return_entropy, softcap, logit_scale,
        tiles or DEFAULT_TILES[hidden.dtype],
    )
    return (logp, entropy) if return_entropy else logp
