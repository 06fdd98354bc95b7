"""linear_token_logprobs: log-probs and entropy straight from hidden states and the
lm_head weight, never materialising [N, V].

Kernels, then the launch code, then the op (one torch.library custom op for eager and
torch.compile alike, the reference behind the same op) and the public function.

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
every kernel reads rows through `order` (tiles past the count do no work). The
vocabulary is processed in chunks of split_tiles x block_v columns (`Tiles`).
    forward   `_ltl_fwd_kernel`: one program per (row tile, chunk): an online
              log-sum-exp and entropy over its chunk, and s_target where the
              target is in it (bf16 / fp16: one dot per row after the chunk's tiles,
              `_target_logits`; fp32: gathered from its tile); `_ltl_merge_kernel` merges
              the chunks' statistics (a few floats per row) in chunk order.
    backward  per chunk, `_ltl_bwd_dr_kernel` recomputes the chunk's logits and
              writes the softmax gradient dr [N, chunk] to a workspace, then
              `_ltl_bwd_gemm_kernel` forms d_weight and d_bias of the chunk's
              vocabulary rows (written once) and adds the chunk's share of d_hidden.
Work: 8 N D V FLOPs in all (forward, recompute, two products), the floor for an op
that never stores [N, V]. Each output tile is one program's accumulator, summed in
a fixed order, so gradients are deterministic (no atomics).

Batch invariance: the chunks depend on V and the tiles only; a row's logits come
from tl.dot tiles whose per-element sums do not depend on the other rows of the
tile; every per-row reduction (online softmax, merge, d_hidden over the chunks) runs
in a fixed order over the vocabulary. So a row's logp, entropy and d_hidden are
bit-identical whatever else is in the batch (compiled kernels; what holds in the
interpreter: docs/batch-invariance.md, checked by tests/test_batch_invariance.py).

Support (`support=`, support.py): `_scaled_logits`, where every logit tile is formed,
sets s_j = -inf for the tokens outside the row's kept set (the target always kept), so
each kernel's sums run over the kept set and p_j = 0 outside it, forward and backward.

Precision: fp32 operands use `input_precision="ieee"` (no TF32) so fp32 inputs keep
fp32 accuracy; bf16/fp16 operands use tensor cores with fp32 accumulation, and the
softmax gradient is rounded to the input dtype before its two matmuls (as PyTorch's
own backward in that dtype does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from . import reference
from ._triton import interpreting, round_to, soft_cap, tl, triton
from ._utils import (
    FLOAT_DTYPES,
    autocast_dtype,
    check_targets,
    check_tensor,
    compute_dtype,
    device_guard,
    is_dtensor,
    nan_where_out_of_range,
    no_autocast,
    resolve_kernel_backend,
)
from .logit_transform import LogitTransform
from .support import apply_support_tile, check_support, row_thresholds
from .support import kernel_args as support_kernel_args
from .tiles import Tiles, launch_tiles


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
def _logit_dots(
    h_ptr, w_ptr, rows64, row_mask, c0, local, limit, D, stride_hn, stride_hd, stride_wv, stride_wd,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, PART: tl.constexpr, BLOCK_D: tl.constexpr,
    PARTS: tl.constexpr,
):
    """(acc0, acc1, acc2, acc3): hidden[rows] @ weight[cols].T of a logit tile's PARTS
    (1, 2 or 4) column parts, part k the columns c0 + k PART + local (local = arange(PART);
    those at local < limit - k PART real; the accumulators past PARTS unread stand-ins),
    fp32, [BLOCK_N, PART] each, from one loop over D that loads each hidden tile once for
    all the parts: the L2 traffic of one [BLOCK_N, PARTS x PART] tile, whose epilogue then
    holds one part's temporaries at a time. Four parts are one dot split afterwards (below),
    two are two dots."""
    if PARTS == 4:
        # four parts: one [BLOCK_N, 4 PART] dot (wgmma n = 256 on sm_90: the hidden tile read from
        # shared memory once per D step, not once per part), its accumulator then split into the
        # parts (column 64 p + j of the tile is part p's column j): registers only, no shared memory
        wide = tl.arange(0, 4 * PART)
        acc = tl.zeros((BLOCK_N, 4 * PART), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_mask = offs_d < D
            h = _load_rows(h_ptr, rows64, row_mask, stride_hn, offs_d, d_mask, stride_hd)  # [BLOCK_N, BLOCK_D]
            acc = _mm(h, _load_weight_t(w_ptr, c0, wide, limit, stride_wv, offs_d, d_mask, stride_wd), acc, IEEE,
                      UPCAST)  # fmt: skip
        # [BLOCK_N, 4 PART] -> [BLOCK_N, PART, 4] (part last) -> [BLOCK_N, PART, 2, 2]: part 2 i + k at [..., i, k]
        quad = tl.reshape(tl.permute(tl.reshape(acc, (BLOCK_N, 4, PART)), (0, 2, 1)), (BLOCK_N, PART, 2, 2))
        even, odd = tl.split(quad)  # k = 0: parts 0, 2; k = 1: parts 1, 3
        acc0, acc2 = tl.split(even)
        acc1, acc3 = tl.split(odd)
        return acc0, acc1, acc2, acc3
    acc0 = tl.zeros((BLOCK_N, PART), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, PART), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, PART), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, PART), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        h = _load_rows(h_ptr, rows64, row_mask, stride_hn, offs_d, d_mask, stride_hd)  # [BLOCK_N, BLOCK_D]
        acc0 = _mm(h, _load_weight_t(w_ptr, c0, local, limit, stride_wv, offs_d, d_mask, stride_wd), acc0, IEEE,
                   UPCAST)  # fmt: skip
        if PARTS >= 2:
            wt = _load_weight_t(w_ptr, c0 + PART, local, limit - PART, stride_wv, offs_d, d_mask, stride_wd)
            acc1 = _mm(h, wt, acc1, IEEE, UPCAST)
        if PARTS >= 4:
            wt = _load_weight_t(w_ptr, c0 + 2 * PART, local, limit - 2 * PART, stride_wv, offs_d, d_mask, stride_wd)
            acc2 = _mm(h, wt, acc2, IEEE, UPCAST)
            wt = _load_weight_t(w_ptr, c0 + 3 * PART, local, limit - 3 * PART, stride_wv, offs_d, d_mask, stride_wd)
            acc3 = _mm(h, wt, acc3, IEEE, UPCAST)
    return acc0, acc1, acc2, acc3


@triton.jit
def _load_weight_t(w_ptr, c0, local, limit, stride_wv, offs_d, d_mask, stride_wd):
    """weight[c0 + local, offs_d] transposed, a [BLOCK_D, len(local)] tile, 0 where masked
    (local >= limit)."""
    return tl.load(
        w_ptr + (c0 + local).to(tl.int64)[None, :] * stride_wv + offs_d[:, None] * stride_wd,
        mask=(local < limit)[None, :] & d_mask[:, None],
        other=0.0,
    )


@triton.jit
def _transformed(r, inv_t, softcap, softcap_pre, HAS_SOFTCAP: tl.constexpr):
    """(s, cap_slope) from r = acc + bias: with HAS_SOFTCAP z = softcap tanh(r * softcap_pre)
    and cap_slope = 1 - tanh^2 (else z = r and cap_slope an unread stand-in), s = z * inv_t
    (inv_t broadcast to r's shape). `_scaled_logits` (a tile) and `_target_logits` (a row's
    target) both form s here."""
    if HAS_SOFTCAP:
        r, cap_slope = soft_cap(r, softcap, softcap_pre)
    else:
        cap_slope = r
    return r * inv_t, cap_slope


# For 16-bit operands, the target logit of each row whose target lies in a program's
# vocabulary split, formed after the split's tiles (their accumulators are dead by then) as
# a per-row dot
#     s_target = T(hidden[row] . weight[target] + bias[target]) * inv_t
# with the elementwise products summed in fp32 BLOCK_D at a time, instead of a column
# compare-and-select on every logit tile of the epilogue (30+ registers a thread on sm_90
# at 128 x 256). Its traffic is one hidden row and one weight row per valid row: N D
# elements of each over the whole launch, against the tiles' V / BLOCK_V + N / BLOCK_N
# weight and hidden passes. It differs from the tile's s_target by the order of the D
# sums only (fp32 rounding: a few ulps of the dot); the target is always in a support.
# fp32 operands (FMA dots on small tiles, where the gather costs few registers and the
# dot's loop spilled 8 B in more combinations) gather s_target from the tile (`_fwd_part`).
@triton.jit
def _target_logits(
    h_ptr, w_ptr, b_ptr, rows64, in_split, tgt, inv_t, D, stride_hn, stride_hd, stride_wv, stride_wd, stride_b,
    softcap, softcap_pre, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """s_target [BLOCK_N] fp32 of the rows at in_split (their targets tgt in this program's
    split), 0 elsewhere."""
    tgt64 = tl.where(in_split, tgt, 0).to(tl.int64)
    dot = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        h = _load_rows(h_ptr, rows64, in_split, stride_hn, offs_d, d_mask, stride_hd).to(tl.float32)
        w = _load_rows(w_ptr, tgt64, in_split, stride_wv, offs_d, d_mask, stride_wd).to(tl.float32)
        dot += tl.sum(h * w, axis=1)
    if HAS_BIAS:
        dot += tl.load(b_ptr + tgt64 * stride_b, mask=in_split, other=0.0).to(tl.float32)
    s, _ = _transformed(dot, inv_t, softcap, softcap_pre, HAS_SOFTCAP)
    return tl.where(in_split, s, 0.0)


@triton.jit
def _scaled_logits(
    acc, b_ptr, rows64, c0, local, limit, inv_t, stride_b, softcap, softcap_pre,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    tgt, support_ptr, stride_support, support_offset, thresholds, SUPPORT: tl.constexpr,
):
    """(s, cap_slope) for a part of a logit tile, its rows and columns c0 + local (those at
    local < limit real), fp32, -inf in padded columns, from acc = hidden[rows] @
    weight[cols].T (`_logit_dots`): r = acc + bias[cols], then with HAS_SOFTCAP
    z = softcap tanh(r * softcap_pre) (softcap_pre = logit_scale / softcap) and
    cap_slope = 1 - tanh^2 (else z = r and cap_slope an unread stand-in), and
    s = z * inv_t[:, None]; with SUPPORT, s = -inf outside each row's support
    (support.py: tgt the rows' target columns, always kept; column j is token
    support_offset + j; a threshold's values per row in `thresholds`, read once per
    program by support.row_thresholds). The forward and the backward's recompute both form their logits
    here, from the same tiles: bit for bit the same s. Every per-column quantity is formed
    from `local` and a per-part offset (one arange for all the parts of all the tiles,
    not a set of column registers per part)."""
    col_mask = local < limit
    if HAS_BIAS:
        bias = tl.load(b_ptr + (c0 + local).to(tl.int64) * stride_b, mask=col_mask, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    s, cap_slope = _transformed(acc, inv_t[:, None], softcap, softcap_pre, HAS_SOFTCAP)
    if SUPPORT != 0:
        s = apply_support_tile(s, s, rows64, local, limit, tgt - c0, support_ptr, stride_support, support_offset + c0,
                               thresholds, SUPPORT, local.shape[0])  # fmt: skip
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
def _fwd_part(
    acc, c0, local, v_end, m, l, a, t, rows, row_mask, row_index, tgt, inv_t, b_ptr, kept_ptr, kept_max_ptr, V,
    n_parts, stride_b, softcap, softcap_pre, support_ptr, stride_support, support_offset, thresholds,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, WANT_ENTROPY: tl.constexpr, KEEP_LOGITS: tl.constexpr,
    SUPPORT: tl.constexpr, PART: tl.constexpr, IEEE: tl.constexpr,
):
    """The forward's online update (m, l, a, and for fp32 operands t) by one part of a logit tile (columns
    c0 + local, those < v_end real; acc from `_logit_dots`), and with KEEP_LOGITS the
    part's logits stored: KEEP_FP32 s itself; KEEP_FP16 x = s - m' in fp16 with m' (the
    running max after this part's update, 0 while the row's logits are all -inf) in
    kept_max [N, n_parts] at part c0 // PART."""
    limit = v_end - c0
    s, _ = _scaled_logits(acc, b_ptr, row_index, c0, local, limit, inv_t, stride_b, softcap, softcap_pre, HAS_BIAS,
                          HAS_SOFTCAP, tgt, support_ptr, stride_support, support_offset, thresholds,
                          SUPPORT)  # fmt: skip
    # tl.max / tl.maximum may drop a NaN logit (fmax); its NaN still reaches l via p below
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
    if IEEE:  # fp32 operands (FMA dots, small tiles): the target logit gathered from the tile, bit for bit s_target
        t += tl.sum(tl.where(local[None, :] == (tgt - c0)[:, None], s, 0.0), axis=1)
    # the chunk's logits, kept for the fused loss's gradient (no recompute); stored after their last
    # use here, so that the store's copy of s in its own layout is not live beside s
    if KEEP_LOGITS == 1:  # KEEP_FP32
        tl.store(kept_ptr + (rows.to(tl.int64) * V + c0)[:, None] + local[None, :], s,
                 mask=row_mask[:, None] & (local < limit)[None, :])  # fmt: skip
    if KEEP_LOGITS == 2:  # KEEP_FP16: x = s - m' <= 0 (-inf stays -inf; m' = 0 for a row all -inf so far: no NaN)
        tl.store(kept_ptr + (rows.to(tl.int64) * V + c0)[:, None] + local[None, :],
                 (s - m_use[:, None]).to(tl.float16), mask=row_mask[:, None] & (local < limit)[None, :])  # fmt: skip
        if limit > 0:  # a part past v_end (the split's or V) is another program's, or none
            tl.store(kept_max_ptr + rows.to(tl.int64) * n_parts + c0 // PART, m_use, mask=row_mask)
    return m_new, l, a, t


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
    kept_ptr,  # [N, V] out (KEEP_LOGITS) at compact positions p < n_valid (fused_linear_loss.py):
    # KEEP_FP32: s itself (fp32); KEEP_FP16: s - m' (fp16), m' the running max after the part's update
    kept_max_ptr,  # [N, n_parts] fp32 out (KEEP_FP16): that m' per row and part of PART columns
    n_rows, V, D, v_per_split, n_parts,  # n_parts: cdiv(V, PART) (the kept_max row stride)
    stride_hn, stride_hd, stride_wv, stride_wd, stride_b,
    softcap, softcap_pre, logit_scale,  # fp32 runtime values (softcap, softcap_pre read with HAS_SOFTCAP)
    support_ptr, stride_support, support_offset,  # the rows' support (read with SUPPORT, see support.py)
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, WANT_ENTROPY: tl.constexpr,
    KEEP_LOGITS: tl.constexpr,  # KEEP_NONE, KEEP_FP32 or KEEP_FP16 (below the kernel)
    IEEE: tl.constexpr, UPCAST: tl.constexpr, SUPPORT: tl.constexpr,
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
    thresholds = row_thresholds(support_ptr, row_index, row_mask, stride_support, inv_t, SUPPORT)
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a = tl.zeros((BLOCK_N,), dtype=tl.float32)
    v_start = split * v_per_split
    v_end = tl.minimum(V, v_start + v_per_split)
    v_end = tl.where(tl.min(rows, axis=0) < n_valid, v_end, v_start)  # a tile of ignored rows: no work
    t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # A tile is PARTS column parts of PART (`_logit_dots`: one loop over D for all), whose
    # epilogue runs one part after the other: the online update per part.
    PARTS: tl.constexpr = 4 if BLOCK_V >= 256 else (2 if BLOCK_V >= 128 else 1)  # parts of >= 64 columns
    PART: tl.constexpr = BLOCK_V // PARTS
    local = tl.arange(0, PART)
    for v0 in range(v_start, v_end, BLOCK_V):
        acc0, acc1, acc2, acc3 = _logit_dots(
            h_ptr, w_ptr, row_index, row_mask, v0, local, v_end - v0, D,
            stride_hn, stride_hd, stride_wv, stride_wd, IEEE, UPCAST, BLOCK_N, PART, BLOCK_D, PARTS,
        )
        m, l, a, t = _fwd_part(
            acc0, v0, local, v_end, m, l, a, t, rows, row_mask, row_index, tgt, inv_t, b_ptr, kept_ptr, kept_max_ptr,
            V, n_parts, stride_b, softcap, softcap_pre, support_ptr, stride_support, support_offset, thresholds,
            HAS_BIAS, HAS_SOFTCAP, WANT_ENTROPY, KEEP_LOGITS, SUPPORT, PART, IEEE,
        )
        if PARTS >= 2:
            m, l, a, t = _fwd_part(
                acc1, v0 + PART, local, v_end, m, l, a, t, rows, row_mask, row_index, tgt, inv_t, b_ptr, kept_ptr,
                kept_max_ptr, V, n_parts, stride_b, softcap, softcap_pre, support_ptr, stride_support, support_offset,
                thresholds, HAS_BIAS, HAS_SOFTCAP, WANT_ENTROPY, KEEP_LOGITS, SUPPORT, PART, IEEE,
            )
        if PARTS >= 4:
            m, l, a, t = _fwd_part(
                acc2, v0 + 2 * PART, local, v_end, m, l, a, t, rows, row_mask, row_index, tgt, inv_t, b_ptr, kept_ptr,
                kept_max_ptr, V, n_parts, stride_b, softcap, softcap_pre, support_ptr, stride_support, support_offset,
                thresholds, HAS_BIAS, HAS_SOFTCAP, WANT_ENTROPY, KEEP_LOGITS, SUPPORT, PART, IEEE,
            )
            m, l, a, t = _fwd_part(
                acc3, v0 + 3 * PART, local, v_end, m, l, a, t, rows, row_mask, row_index, tgt, inv_t, b_ptr, kept_ptr,
                kept_max_ptr, V, n_parts, stride_b, softcap, softcap_pre, support_ptr, stride_support, support_offset,
                thresholds, HAS_BIAS, HAS_SOFTCAP, WANT_ENTROPY, KEEP_LOGITS, SUPPORT, PART, IEEE,
            )
    if not IEEE:  # 16-bit operands: the target logit as a per-row dot (`_target_logits`), after the tiles
        in_split = row_mask & (tgt >= v_start) & (tgt < v_end)
        t = _target_logits(h_ptr, w_ptr, b_ptr, row_index, in_split, tgt, inv_t, D, stride_hn, stride_hd, stride_wv,
                           stride_wd, stride_b, softcap, softcap_pre, HAS_BIAS, HAS_SOFTCAP, BLOCK_N, BLOCK_D)  # fmt: skip
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
    for k in range(0, splits):  # a split's NaN m_k may be dropped here: its l_k is NaN too
        at = tl.cast(k, tl.int64) * n_rows + rows  # int64 as in the forward: splits x N passes 2**31
        m_all = tl.maximum(m_all, tl.load(max_ptr + at, mask=row_mask, other=float("-inf")))
    m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    a_all = tl.zeros((BLOCK,), dtype=tl.float32)
    t_all = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, splits):
        at = tl.cast(k, tl.int64) * n_rows + rows
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
    applied in two steps (see the module docstring). cols [BLOCK_V] and tgt [BLOCK_N]: the
    tile's columns and the rows' targets, counted from any common origin (the callers
    pass offsets from the tile's first column)."""
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
    # Padded rows are exactly 0: the d_bias partial sums run over them, and their
    # p = exp(bias) (h = 0, shift = log_l = 0) can overflow, so 0 * inf would be NaN.
    return tl.where(row_mask[:, None], dz, 0.0)


# Backward, per valid row with p = softmax(s), s = inv_T z, and upstream g_logp, g_H:
#     dlogp/ds_j = onehot_j - p_j,     dH/ds_j = -p_j (s_j - lse + H)
#     dz_j       = inv_T (g_logp (onehot_j - p_j) - g_H p_j (s_j - lse + H))
# with z the logits before the temperature. With a soft cap, z = softcap tanh(a r)
# of the raw logits r = hidden @ weight.T + bias (a = logit_scale / softcap), and
#     dr_j       = dz_j logit_scale (1 - tanh^2(a r_j))
# (without one, a logit scale is folded into inv_T and dr = dz). Then
#     d_hidden = dr @ weight,   d_weight = dr.T @ hidden,   d_bias = sum over rows of dr.
# The vocabulary is processed in the forward's chunks of C = split_tiles * block_v
# columns (fixed by V and the tiles, never by the batch). Per chunk [v0, v0 + C):
#   1. this kernel recomputes the chunk's logits tile by tile (the forward's tiles, so
#      s is the forward's bit for bit), forms dr and writes it, rounded to the input
#      dtype as PyTorch's own backward in that dtype rounds it, to a workspace [N, C];
#   2. `_ltl_bwd_gemm_kernel` runs the two products on it, accumulators in registers:
#      d_weight[chunk] = dr.T @ hidden (written once) and d_hidden += dr @ weight[chunk]
#      (fp32, chunk after chunk in order: a fixed order per row, batch invariant).
# Work: the recompute and the two products are 2 N D V FLOPs each, so with the forward
# the op does 8 N D V, the floor for an op that never stores [N, V]; each d_weight and
# d_bias element is written once, each d_hidden element once per chunk.
# This kernel: program pid makes vocabulary tile pid % n_vt of the chunk for row tile
# pid // n_vt (neighbours share a row tile and sweep the chunk's weight rows: L2).
@triton.jit
def _ltl_bwd_dr_kernel(
    h_ptr, w_ptr, b_ptr,  # as in the forward kernel
    targets_ptr, inv_t_ptr, order_ptr, n_valid_ptr,  # as in the forward kernel
    shift_ptr, log_l_ptr,  # [N] fp32 M and log l from the forward (lse = M + log l)
    entropy_ptr,  # [N] fp32 entropy from the forward (when HAS_ENTROPY_GRAD)
    g_logp_ptr, g_entropy_ptr,  # [N] fp32 upstream gradients (g_entropy when HAS_ENTROPY_GRAD)
    dr_ptr,  # [N, C] out (row stride stride_dr), the input dtype: dr[p, j - v0] of compact position p < n_valid
    db_part_ptr,  # [cdiv(N, BLOCK_N), C] fp32 out (WANT_DB): per row tile, the column sums of dr before rounding
    n_rows, V, D, v0, chunk_cols, stride_dr,  # the chunk is columns [v0, v0 + chunk_cols)
    stride_hn, stride_hd, stride_wv, stride_wd, stride_b,
    softcap, softcap_pre, logit_scale,  # fp32 runtime values (read with HAS_SOFTCAP)
    support_ptr, stride_support, support_offset,  # as in the forward kernel (read with SUPPORT)
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, WANT_DB: tl.constexpr,
    ZERO_PAD: tl.constexpr,  # rows past the valid count get dr = 0 (the torch products read every row)
    IEEE: tl.constexpr, UPCAST: tl.constexpr, SUPPORT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    n_vt = tl.cdiv(chunk_cols, BLOCK_V)
    rows = (pid // n_vt) * BLOCK_N + tl.arange(0, BLOCK_N)
    # the forward's tiles and parts (see _ltl_fwd_kernel): dr formed and stored one part at a time
    PARTS: tl.constexpr = 4 if BLOCK_V >= 256 else (2 if BLOCK_V >= 128 else 1)
    PART: tl.constexpr = BLOCK_V // PARTS
    start = (pid % n_vt) * BLOCK_V  # the tile's first column in the chunk
    local = tl.arange(0, PART)
    row_mask, row_index, n_valid = _rows_of(rows, order_ptr, n_valid_ptr)
    if ZERO_PAD or tl.min(rows, axis=0) < n_valid:  # a tile of ignored rows: no work (unless zeroed)
        tgt, inv_t, shift, log_l, entropy, g_logp, g_entropy = _load_row_stats(
            row_index, row_mask, targets_ptr, inv_t_ptr, shift_ptr, log_l_ptr, entropy_ptr, g_logp_ptr,
            g_entropy_ptr, HAS_ENTROPY_GRAD,
        )
        thresholds = row_thresholds(support_ptr, row_index, row_mask, stride_support, inv_t, SUPPORT)
        acc0, acc1, acc2, acc3 = _logit_dots(
            h_ptr, w_ptr, row_index, row_mask, v0 + start, local, chunk_cols - start, D,
            stride_hn, stride_hd, stride_wv, stride_wd, IEEE, UPCAST, BLOCK_N, PART, BLOCK_D, PARTS,
        )
        _dr_part(
            acc0, v0, start, local, chunk_cols, rows, row_mask, row_index, n_rows, tgt, inv_t, shift, log_l, entropy,
            g_logp, g_entropy, b_ptr, stride_b, softcap, softcap_pre, logit_scale, support_ptr, stride_support,
            support_offset, thresholds, dr_ptr, stride_dr, db_part_ptr, pid // n_vt,
            HAS_BIAS, HAS_SOFTCAP, HAS_ENTROPY_GRAD, WANT_DB, ZERO_PAD, UPCAST, SUPPORT,
        )
        # a barrier between parts: the next part's loads (bias, support words) are not hoisted into
        # this one's epilogue (sm_90's fp16 recompute with bias, soft cap and a bitmask spilled 8 B
        # at 255 registers without it; with it, 251 and none)
        if PARTS >= 2:
            tl.debug_barrier()
            _dr_part(
                acc1, v0, start + PART, local, chunk_cols, rows, row_mask, row_index, n_rows, tgt, inv_t, shift,
                log_l, entropy, g_logp, g_entropy, b_ptr, stride_b, softcap, softcap_pre, logit_scale, support_ptr,
                stride_support, support_offset, thresholds, dr_ptr, stride_dr, db_part_ptr, pid // n_vt,
                HAS_BIAS, HAS_SOFTCAP, HAS_ENTROPY_GRAD, WANT_DB, ZERO_PAD, UPCAST, SUPPORT,
            )
        if PARTS >= 4:
            tl.debug_barrier()
            _dr_part(
                acc2, v0, start + 2 * PART, local, chunk_cols, rows, row_mask, row_index, n_rows, tgt, inv_t, shift,
                log_l, entropy, g_logp, g_entropy, b_ptr, stride_b, softcap, softcap_pre, logit_scale, support_ptr,
                stride_support, support_offset, thresholds, dr_ptr, stride_dr, db_part_ptr, pid // n_vt,
                HAS_BIAS, HAS_SOFTCAP, HAS_ENTROPY_GRAD, WANT_DB, ZERO_PAD, UPCAST, SUPPORT,
            )
            tl.debug_barrier()
            _dr_part(
                acc3, v0, start + 3 * PART, local, chunk_cols, rows, row_mask, row_index, n_rows, tgt, inv_t, shift,
                log_l, entropy, g_logp, g_entropy, b_ptr, stride_b, softcap, softcap_pre, logit_scale, support_ptr,
                stride_support, support_offset, thresholds, dr_ptr, stride_dr, db_part_ptr, pid // n_vt,
                HAS_BIAS, HAS_SOFTCAP, HAS_ENTROPY_GRAD, WANT_DB, ZERO_PAD, UPCAST, SUPPORT,
            )


@triton.jit
def _dr_part(
    acc, v0, start, local, chunk_cols, rows, row_mask, row_index, n_rows, tgt, inv_t, shift, log_l, entropy, g_logp,
    g_entropy, b_ptr, stride_b, softcap, softcap_pre, logit_scale, support_ptr, stride_support, support_offset,
    thresholds, dr_ptr, stride_dr, db_part_ptr, row_tile,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, WANT_DB: tl.constexpr,
    ZERO_PAD: tl.constexpr, UPCAST: tl.constexpr, SUPPORT: tl.constexpr,
):
    """The recompute's dr of one part of a logit tile: chunk columns start + local (those
    < chunk_cols real), acc from `_logit_dots`, the rows' values from `_load_row_stats`;
    stored by `_store_dr`."""
    limit = chunk_cols - start
    s, cap_slope = _scaled_logits(acc, b_ptr, row_index, v0 + start, local, limit, inv_t, stride_b, softcap,
                                  softcap_pre, HAS_BIAS, HAS_SOFTCAP, tgt, support_ptr, stride_support,
                                  support_offset, thresholds, SUPPORT)  # fmt: skip
    dr = _softmax_grad(
        s, cap_slope, row_mask, local, tgt - (v0 + start), shift, log_l, entropy, g_logp, g_entropy, inv_t,
        logit_scale, HAS_ENTROPY_GRAD, HAS_SOFTCAP,
    )
    _store_dr(dr, rows, start, local, local < limit, row_mask, n_rows, dr_ptr, stride_dr, db_part_ptr, row_tile,
              WANT_DB, ZERO_PAD, UPCAST)  # fmt: skip


@triton.jit
def _store_dr(
    dr, rows, start, local, col_mask, row_mask, n_rows, dr_ptr, stride_dr, db_part_ptr, row_tile,
    WANT_DB: tl.constexpr, ZERO_PAD: tl.constexpr, UPCAST: tl.constexpr,
):
    """dr of workspace columns start + local (0 in padded rows and columns; col_mask: the
    real ones) into the workspace, rounded to its dtype (rows < n_rows with ZERO_PAD, the
    valid ones otherwise), and with WANT_DB its column sums before rounding into row tile
    `row_tile` of db_part. The one tail of both dr kernels (this file's recompute and
    fused_linear_loss.py's, from the kept logits)."""
    # UPCAST (bf16 under the interpreter) is exactly when round_to must round by hand
    store_rows = (rows < n_rows) if ZERO_PAD else row_mask
    tl.store(
        dr_ptr + (rows.to(tl.int64) * stride_dr + start)[:, None] + local[None, :],
        round_to(dr, dr_ptr.dtype.element_ty, UPCAST),
        mask=store_rows[:, None] & col_mask[None, :],
    )
    if WANT_DB:  # padded rows hold dr = 0
        tl.store(db_part_ptr + (row_tile.to(tl.int64) * stride_dr + start) + local, tl.sum(dr, axis=0), mask=col_mask)


@triton.jit
def _grouped_tile(t, n_m, n_n, GROUP: tl.constexpr):
    """(tile_m, tile_n) of the t-th program over an n_m x n_n grid of output tiles, in
    bands of GROUP tile rows walked column by column (GROUP = 1: tile_n fastest), so
    that the programs running at once share their operand slabs in L2."""
    per_band = GROUP * n_n
    first_m = (t // per_band) * GROUP
    size_m = tl.minimum(n_m - first_m, GROUP)
    return first_m + (t % per_band) % size_m, (t % per_band) // size_m


@triton.jit
def _dweight_tile(
    t, dr_ptr, h_ptr, order_ptr, dw_ptr, n_valid, v0, chunk_cols, D, stride_dr, stride_hn, stride_hd, accumulate,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, GEMM_V: tl.constexpr, GEMM_D: tl.constexpr, GEMM_K: tl.constexpr,
):
    """d_weight[v0 + i, d] = sum_p dr[p, i] hidden[order[p], d] for one [GEMM_V, GEMM_D]
    tile (K = the valid rows, GEMM_K at a time, in order), written once in dw's dtype, or
    with `accumulate` (runtime 0 / 1) added to what dw holds (the fused loss's row chunks)."""
    tm, tn = _grouped_tile(t, tl.cdiv(chunk_cols, GEMM_V), tl.cdiv(D, GEMM_D), 8)
    local = tm * GEMM_V + tl.arange(0, GEMM_V)
    v_mask = local < chunk_cols
    offs_d = tn * GEMM_D + tl.arange(0, GEMM_D)
    d_mask = offs_d < D
    acc = tl.zeros((GEMM_V, GEMM_D), dtype=tl.float32)
    for p0 in range(0, n_valid, GEMM_K):
        p = p0 + tl.arange(0, GEMM_K)
        p_mask = p < n_valid
        drt = tl.load(
            dr_ptr + p.to(tl.int64)[None, :] * stride_dr + local[:, None], mask=v_mask[:, None] & p_mask[None, :],
            other=0.0,
        )  # [GEMM_V, GEMM_K]: dr transposed
        row_index = tl.load(order_ptr + p, mask=p_mask, other=0).to(tl.int64)
        h = _load_rows(h_ptr, row_index, p_mask, stride_hn, offs_d, d_mask, stride_hd)  # [GEMM_K, GEMM_D]
        acc = _mm(drt, h, acc, IEEE, UPCAST)
    cols64 = (v0 + local).to(tl.int64)
    out = dw_ptr + cols64[:, None] * D + offs_d[None, :]
    if accumulate != 0:
        acc += tl.load(out, mask=v_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    tl.store(out, round_to(acc, dw_ptr.dtype.element_ty, UPCAST), mask=v_mask[:, None] & d_mask[None, :])


@triton.jit
def _dbias_tile(
    tm, db_part_ptr, db_ptr, n_valid, part_rows, v0, chunk_cols, stride_dr, accumulate, UPCAST: tl.constexpr,
    GEMM_V: tl.constexpr,
):
    """d_bias[v0 + i] for one GEMM_V tile of the chunk: the dr kernel's fp32 partial
    sums, row tile after row tile (part_rows rows each), written once in db's dtype (with
    `accumulate`: added to what db holds)."""
    local = tm * GEMM_V + tl.arange(0, GEMM_V)
    v_mask = local < chunk_cols
    db = tl.zeros((GEMM_V,), dtype=tl.float32)
    for r in range(0, tl.cdiv(n_valid, part_rows)):
        db += tl.load(db_part_ptr + r * stride_dr + local, mask=v_mask, other=0.0)
    out = db_ptr + (v0 + local).to(tl.int64)
    if accumulate != 0:
        db += tl.load(out, mask=v_mask, other=0.0).to(tl.float32)
    tl.store(out, round_to(db, db_ptr.dtype.element_ty, UPCAST), mask=v_mask)


@triton.jit
def _dhidden_tile(
    t, dr_ptr, w_ptr, order_ptr, acc_ptr, dh_ptr, n_rows, n_valid, v0, chunk_cols, D, stride_dr, stride_wv, stride_wd,
    first, last, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    GEMM_N: tl.constexpr, GEMM_D: tl.constexpr, GEMM_K: tl.constexpr,
):
    """d_hidden[order[p], d] += sum_i dr[p, i] weight[v0 + i, d] for one [GEMM_N, GEMM_D]
    tile: the chunk's sum (K = its columns, GEMM_K at a time, in order) is added to the
    running sum read from acc (fp32) unless `first`, and written back to acc, or with
    `last` to dh in its dtype (first, last: runtime 0 / 1, one compiled kernel for all chunks).

    A tile of GEMM_D >= 32 columns is summed in two column halves, one accumulator each,
    from the same dr loads (the same L2 traffic as one [GEMM_N, GEMM_D] accumulator): the
    read-add-write of the running sum then holds half a tile of addends at a time, which
    keeps a 128 x 256 tile within sm_100's registers (a whole tile of sums and of addends
    spilled; bench/aot.py reads the stack frame)."""
    tm, tn = _grouped_tile(t, tl.cdiv(n_rows, GEMM_N), tl.cdiv(D, GEMM_D), 1)
    p = tm * GEMM_N + tl.arange(0, GEMM_N)
    if tm * GEMM_N < n_valid:  # a tile of ignored rows: no work
        p_mask = p < n_valid
        TWO: tl.constexpr = GEMM_D >= 32  # tl.dot takes blocks of >= 16
        PART: tl.constexpr = GEMM_D // 2 if GEMM_D >= 32 else GEMM_D
        offs_a = tn * GEMM_D + tl.arange(0, PART)
        offs_b = offs_a + PART
        part_a = tl.zeros((GEMM_N, PART), dtype=tl.float32)
        part_b = tl.zeros((GEMM_N, PART), dtype=tl.float32)
        for k0 in range(0, chunk_cols, GEMM_K):
            k = k0 + tl.arange(0, GEMM_K)
            k_mask = k < chunk_cols
            dr = tl.load(
                dr_ptr + p.to(tl.int64)[:, None] * stride_dr + k[None, :], mask=p_mask[:, None] & k_mask[None, :],
                other=0.0,
            )  # [GEMM_N, GEMM_K]
            rows_w = (v0 + k).to(tl.int64)
            w = _load_rows(w_ptr, rows_w, k_mask, stride_wv, offs_a, offs_a < D, stride_wd)  # [GEMM_K, PART]
            part_a = _mm(dr, w, part_a, IEEE, UPCAST)
            if TWO:
                w = _load_rows(w_ptr, rows_w, k_mask, stride_wv, offs_b, offs_b < D, stride_wd)
                part_b = _mm(dr, w, part_b, IEEE, UPCAST)
        # the output offsets only now: kept out of the loop's live registers
        row_index = tl.load(order_ptr + p, mask=p_mask, other=0).to(tl.int64)
        _dhidden_out(part_a, row_index, p_mask, offs_a, acc_ptr, dh_ptr, D, first, last, UPCAST)
        if TWO:
            _dhidden_out(part_b, row_index, p_mask, offs_b, acc_ptr, dh_ptr, D, first, last, UPCAST)


@triton.jit
def _dhidden_out(part, row_index, p_mask, offs_d, acc_ptr, dh_ptr, D, first, last, UPCAST: tl.constexpr):
    """d_hidden's running sum for `part`, columns offs_d of a tile: part + acc (unless
    `first`) written to acc, or with `last` to dh in its dtype."""
    out = row_index[:, None] * D + offs_d[None, :]
    out_mask = p_mask[:, None] & (offs_d < D)[None, :]
    if first == 0:
        part += tl.load(acc_ptr + out, mask=out_mask, other=0.0)
    if last != 0:
        tl.store(dh_ptr + out, round_to(part, dh_ptr.dtype.element_ty, UPCAST), mask=out_mask)
    else:
        tl.store(acc_ptr + out, part, mask=out_mask)


# Step 2 of the backward (see `_ltl_bwd_dr_kernel`): one launch per chunk holds every
# product on it: the d_bias tiles (programs [0, n_db)), the d_weight tiles
# ([n_db, n_db + n_dw)) and the d_hidden tiles (the rest), so that all read the chunk's
# dr while it is in L2 and small batches still fill the GPU. Each output tile is one
# program's register accumulator: no atomics, a fixed order.
@triton.jit(do_not_specialize=["first", "last", "accumulate"])
def _ltl_bwd_gemm_kernel(
    dr_ptr,  # [N, C] from _ltl_bwd_dr_kernel (compact positions), row stride stride_dr
    db_part_ptr,  # [cdiv(N, part_rows), C] fp32 from _ltl_bwd_dr_kernel (when n_db > 0)
    h_ptr, w_ptr, order_ptr, n_valid_ptr,  # as in the forward kernel
    db_ptr, dw_ptr,  # [V] and [V, D] out in bias's and weight's dtypes (when n_db, n_dw > 0)
    acc_ptr,  # [N, D] fp32 running d_hidden at the caller's row index: read unless first, written unless last
    dh_ptr,  # [N, D] out, hidden's dtype (last): rows of ignored targets untouched
    n_db, n_dw, n_rows, part_rows, v0, chunk_cols, D, stride_dr,
    stride_hn, stride_hd, stride_wv, stride_wd,
    first, last,  # 1 in the vocabulary's first / last chunk, else 0 (runtime: never specialized)
    accumulate,  # 1: d_weight and d_bias are added to what db / dw hold (fused_linear_loss.py's row chunks), else 0
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
    GEMM_N: tl.constexpr, GEMM_V: tl.constexpr, GEMM_D: tl.constexpr, GEMM_K: tl.constexpr,
):
    pid = tl.program_id(0)
    n_valid = tl.load(n_valid_ptr)
    if pid < n_db:
        _dbias_tile(pid, db_part_ptr, db_ptr, n_valid, part_rows, v0, chunk_cols, stride_dr, accumulate, UPCAST,
                    GEMM_V)  # fmt: skip
    elif pid < n_db + n_dw:
        _dweight_tile(
            pid - n_db, dr_ptr, h_ptr, order_ptr, dw_ptr, n_valid, v0, chunk_cols, D, stride_dr, stride_hn,
            stride_hd, accumulate, IEEE, UPCAST, GEMM_V, GEMM_D, GEMM_K,
        )
    else:
        _dhidden_tile(
            pid - n_db - n_dw, dr_ptr, w_ptr, order_ptr, acc_ptr, dh_ptr, n_rows, n_valid, v0, chunk_cols, D,
            stride_dr, stride_wv, stride_wd, first, last, IEEE, UPCAST, GEMM_N, GEMM_D, GEMM_K,
        )


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
    int32 (a transposed view of a [D, V] matrix with D * V >= 2**31, say); else t itself.
    `linear_token_logprobs` applies it before the op, so autograd saves the copy for the
    backward (one copy per call, not one per pass); the launches apply it again for the
    op's direct callers (vocab_parallel.py), a no-op on a copy."""
    if t.shape[1] > 1 and (t.shape[1] - 1) * t.stride(1) >= INT32_OFFSET_LIMIT:
        return t.contiguous()
    return t


@dataclass(frozen=True)
class _Launch:
    """Everything the kernels share, derived once per call: the operands, their strides,
    the valid-row order, the logit transform and every compile-time flag."""

    hidden: torch.Tensor  # [N, D]
    weight: torch.Tensor  # [V, D]
    bias: Optional[torch.Tensor]  # [V]
    targets: torch.Tensor  # [N] int32/int64, contiguous
    transform: LogitTransform  # inv_t [N] fp32, the soft cap and logit scale
    order: torch.Tensor  # [N] int64: rows whose target is not ignore_index first, in order
    n_valid: torch.Tensor  # [1] int64 on the device: how many there are (never read on the host)
    tiles: Tiles
    support: Optional[torch.Tensor] = None  # [N] fp32 threshold or [N, W] int32 bitmask (support.py)
    support_offset: int = 0  # the vocabulary index of weight's row 0 (a shard's offset)

    @staticmethod
    def build(hidden, weight, bias, targets, transform, ignore_index, tiles, support=None,
              support_offset=0) -> "_Launch":
        ignored = targets == ignore_index
        # a stable sort of a 0/1 key: the valid rows first, without a host sync
        order = torch.sort(ignored.to(torch.uint8), stable=True).indices
        n_valid = (~ignored).sum().reshape(1)
        return _Launch(
            _int32_safe_columns(hidden), _int32_safe_columns(weight), bias, targets.contiguous(), transform, order,
            n_valid, tiles, support, support_offset,
        )

    @property
    def n(self) -> int:
        return self.hidden.shape[0]

    def grid_rows(self, splits: int = 1) -> Tuple[int]:
        return (_cdiv(self.n, self.tiles.block_n) * splits,)

    def common(self) -> Dict[str, object]:
        """Keyword arguments every logit-tile kernel takes, flags included."""
        h, w, b, cfg = self.hidden, self.weight, self.bias, self.tiles
        return dict(
            h_ptr=h, w_ptr=w, b_ptr=b if b is not None else w,  # weight: an unread stand-in
            targets_ptr=self.targets, inv_t_ptr=self.transform.inv_t, order_ptr=self.order, n_valid_ptr=self.n_valid,
            V=w.shape[0], D=h.shape[1],
            stride_hn=h.stride(0), stride_hd=h.stride(1), stride_wv=w.stride(0), stride_wd=w.stride(1),
            stride_b=b.stride(0) if b is not None else 0,
            HAS_BIAS=b is not None,
            IEEE=h.dtype == torch.float32,  # fp32 operands: no TF32 (see _mm)
            UPCAST=h.dtype == torch.bfloat16 and interpreting(),  # the interpreter's bf16 dot (see _mm)
            BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **self.transform.kernel_args(),
            **support_kernel_args(self.support, self.transform.inv_t, self.support_offset),
        )


# Rows per program of the merge kernel.
MERGE_BLOCK = 256

# The forward kernel's KEEP_LOGITS: no kept logits; s itself in fp32 (fp32 operands); s - m'
# in fp16 with the per-part running max m' in fp32 (bf16 / fp16 operands: half the bytes).
KEEP_NONE, KEEP_FP32, KEEP_FP16 = 0, 1, 2


def logit_part(block_v: int) -> int:
    """The columns of one part of a logit tile of block_v columns (the kernels' PART: four
    parts from 256 columns, two from 128, else one), the kept_max granularity."""
    return block_v // (4 if block_v >= 256 else (2 if block_v >= 128 else 1))


def _forward_splits(
    launch: _Launch, want_entropy: bool, kept: Optional[torch.Tensor] = None, kept_max: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The forward kernel's statistics [4, splits, N] fp32: m, l, a, t of each vocabulary
    split (see `_ltl_fwd_kernel`) at compact positions, only the first n_valid written.
    `_forward` merges them; the vocabulary-parallel op (vocab_parallel.py) merges them
    over the ranks' shards. N >= 1. kept: None, or a buffer of at least N x V values
    (contiguous) that receives the chunk's logits at compact positions (fused_linear_loss.py):
    fp32: s itself; fp16: s - m' with m' in kept_max (fp32, at least N x
    cdiv(V, logit_part(block_v)) values), `_fwd_part`."""
    n = launch.n
    vocab = launch.weight.shape[0]
    splits, per_split = _split_vocab(vocab, launch.tiles)
    stats = torch.empty(4, splits, n, dtype=torch.float32, device=launch.hidden.device)
    m, l, a, t = stats.unbind(0)
    keep = KEEP_NONE if kept is None else (KEEP_FP16 if kept.dtype == torch.float16 else KEEP_FP32)
    if keep == KEEP_FP16 and kept_max is None:
        raise ValueError("kept_max: fp16 kept logits need their per-part maxima")
    _ltl_fwd_kernel[launch.grid_rows(splits)](
        max_ptr=m, sum_ptr=l, entropy_ptr=a, target_logit_ptr=t, kept_ptr=kept if kept is not None else m,
        kept_max_ptr=kept_max if keep == KEEP_FP16 else m, n_rows=n, v_per_split=per_split,
        n_parts=_cdiv(vocab, logit_part(launch.tiles.block_v)), WANT_ENTROPY=want_entropy, KEEP_LOGITS=keep,
        **launch.common(),
    )
    return stats


def _forward(
    launch: _Launch, want_entropy: bool, kept: Optional[torch.Tensor] = None, kept_max: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """logp [N], entropy [N] or None, and lse_parts [2, N] (M, log l) saved for the
    backward; all fp32, 0 in ignored rows. kept, kept_max: as `_forward_splits`."""
    n = launch.n
    f32 = dict(dtype=torch.float32, device=launch.hidden.device)
    logp = torch.zeros(n, **f32)
    entropy = torch.zeros(n, **f32) if want_entropy else None
    lse_parts = torch.zeros(2, n, **f32)
    if n == 0:
        return logp, entropy, lse_parts
    m, l, a, t = _forward_splits(launch, want_entropy, kept, kept_max).unbind(0)
    splits = m.shape[0]
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
    """(d_hidden, d_weight, d_bias), each None unless `need` says so: per vocabulary
    chunk, dr into a workspace, then the two products on it (see `_ltl_bwd_dr_kernel`)."""
    hidden, weight, bias = launch.hidden, launch.weight, launch.bias
    n, d = hidden.shape
    vocab = weight.shape[0]
    # d_hidden starts at 0 (ignored rows stay 0); the kernels write every d_weight and d_bias element
    out = [(torch.zeros if i == 0 or n == 0 else torch.empty)(t.shape, dtype=t.dtype, device=t.device)
           if want else None for i, (t, want) in enumerate(zip((hidden, weight, bias), need))]  # fmt: skip
    if n == 0:
        return tuple(out)
    has_entropy_grad = g_entropy is not None
    stats = dict(
        shift_ptr=lse_parts[0], log_l_ptr=lse_parts[1],
        entropy_ptr=entropy if has_entropy_grad else g_logp,  # unread stand-ins without entropy
        g_logp_ptr=g_logp, g_entropy_ptr=g_entropy if has_entropy_grad else g_logp,
        HAS_ENTROPY_GRAD=has_entropy_grad, n_rows=n,
        **launch.common(),
    )
    _, chunk = _split_vocab(vocab, launch.tiles)
    width = min(chunk, vocab)
    dr = torch.empty(n, width, dtype=hidden.dtype, device=hidden.device)  # the workspace
    db_part = torch.empty(_cdiv(n, launch.tiles.block_n) if need[2] else 0, width, dtype=torch.float32,
                          device=hidden.device)  # fmt: skip
    engine = launch.tiles.gemm_engine  # 0: _ltl_bwd_gemm_kernel, 1: torch matmuls (_torch_chunk_products)
    acc = out[0]  # the running d_hidden in fp32: d_hidden itself for fp32 inputs, unused for one chunk
    if acc is not None and (engine == 1 or (hidden.dtype != torch.float32 and vocab > chunk)):
        acc = torch.empty(n, d, dtype=torch.float32, device=hidden.device)  # (compact positions for torch's)
    h_c = hidden.index_select(0, launch.order) if engine == 1 and need[1] else None
    for v0 in range(0, vocab, chunk):
        cols = min(chunk, vocab - v0)
        grid = (_cdiv(n, launch.tiles.block_n) * _cdiv(cols, launch.tiles.block_v),)
        _ltl_bwd_dr_kernel[grid](
            dr_ptr=dr, db_part_ptr=db_part if need[2] else dr, v0=v0, chunk_cols=cols, stride_dr=width,
            WANT_DB=need[2], ZERO_PAD=engine == 1, **stats,
        )
        if engine == 1:
            _torch_chunk_products(launch, dr, db_part, h_c, v0, cols, out, acc)
        else:
            _chunk_products(launch, dr, db_part, v0, cols, out, acc)
    if engine == 1 and need[0]:
        out[0].index_copy_(0, launch.order, acc.to(out[0].dtype))
    return tuple(out)


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """out (+)= a @ b for the torch products: a, b in the input dtype; out in their dtype
    (one cuBLAS GEMM, fp32 accumulation inside) or fp32 (on CUDA one GEMM of the input
    dtype's operands with an fp32 output, addmm(out_dtype=float32); on a CPU the operands
    are upcast first)."""
    if out.dtype == a.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif out.is_cuda:
        torch.addmm(out, a, b, beta=1 if accumulate else 0, out_dtype=out.dtype, out=out)
    elif accumulate:
        out.addmm_(a.to(out.dtype), b.to(out.dtype))
    else:
        torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)


def _torch_chunk_products(
    launch: _Launch, dr: torch.Tensor, db_part: torch.Tensor, h_c: Optional[torch.Tensor], v0: int, cols: int,
    out: List[Optional[torch.Tensor]], acc: Optional[torch.Tensor], accumulate: bool = False,
) -> None:
    """`_chunk_products` by torch matmuls (Tiles.gemm_engine = 1), on dr [n, C] whose rows
    past the valid count are 0 (ZERO_PAD) and h_c = hidden[order]: the chunk's share of
    d_hidden into acc [n, D] fp32 at compact positions (the first chunk writes it), its
    rows of d_weight and d_bias into out[1], out[2] (added to them with `accumulate`)."""
    d_hidden, d_weight, d_bias = out
    n = launch.n
    dr = dr[:n, :cols]
    if d_hidden is not None:
        _mm_into(acc[:n], dr, launch.weight[v0 : v0 + cols], accumulate=v0 > 0)
    if d_weight is not None:
        _mm_into(d_weight[v0 : v0 + cols], dr.t(), h_c, accumulate)
    if d_bias is not None:  # every row tile's partial sums (ZERO_PAD writes them all)
        part = db_part[: _cdiv(n, launch.tiles.block_n), :cols].sum(0)
        target = d_bias[v0 : v0 + cols]
        target.add_(part) if accumulate else target.copy_(part)


def _chunk_products(
    launch: _Launch, dr: torch.Tensor, db_part: torch.Tensor, v0: int, cols: int, out: List[Optional[torch.Tensor]],
    acc: Optional[torch.Tensor], accumulate: bool = False,
) -> None:
    """One `_ltl_bwd_gemm_kernel` launch for the chunk [v0, v0 + cols): its rows of
    d_weight and d_bias into out[1], out[2] (added to them with `accumulate`), and its
    share of d_hidden into acc / out[0]."""
    d_hidden, d_weight, d_bias = out
    h, w, cfg = launch.hidden, launch.weight, launch.tiles
    n, d = h.shape
    n_db = _cdiv(cols, cfg.gemm_v) if d_bias is not None else 0
    n_dw = _cdiv(cols, cfg.gemm_v) * _cdiv(d, cfg.gemm_d) if d_weight is not None else 0
    n_dh = _cdiv(n, cfg.gemm_n) * _cdiv(d, cfg.gemm_d) if d_hidden is not None else 0
    _ltl_bwd_gemm_kernel[(n_db + n_dw + n_dh,)](
        dr_ptr=dr, db_part_ptr=db_part, h_ptr=h, w_ptr=w, order_ptr=launch.order, n_valid_ptr=launch.n_valid,
        # dr: an unread, unwritten stand-in for the outputs not wanted
        db_ptr=d_bias if d_bias is not None else dr, dw_ptr=d_weight if d_weight is not None else dr,
        acc_ptr=acc if acc is not None else dr, dh_ptr=d_hidden if d_hidden is not None else dr,
        n_db=n_db, n_dw=n_dw, n_rows=n, part_rows=cfg.block_n, v0=v0, chunk_cols=cols, D=d, stride_dr=dr.stride(0),
        stride_hn=h.stride(0), stride_hd=h.stride(1), stride_wv=w.stride(0), stride_wd=w.stride(1),
        first=int(v0 == 0), last=int(v0 + cols == w.shape[0]), accumulate=int(accumulate),
        IEEE=h.dtype == torch.float32, UPCAST=h.dtype == torch.bfloat16 and interpreting(),
        GEMM_N=cfg.gemm_n, GEMM_V=cfg.gemm_v, GEMM_D=cfg.gemm_d, GEMM_K=cfg.gemm_k, num_warps=cfg.gemm_warps,
        num_stages=cfg.gemm_stages,
    )


# ---------------------------------------------------------------------------------
# The op: one torch.library custom op serves eager and torch.compile alike (a
# shape-only fake for compile, autograd registered), with the kernels or the reference
# behind it (`use_triton`). Tensors are positional, options keyword-only: the backward
# returns one gradient per tensor input. The backward is a second custom op.


def _tiles_of(tiles: List[int], hidden: torch.Tensor, weight: torch.Tensor) -> Tiles:
    """The op's `tiles` option: the caller's Tiles as a list, or [] for the device's
    (erpo_kernels.tiles.launch_tiles: a tuning file's entry for this GPU, dtype, D and V,
    else default_tiles; never a function of N)."""
    if tiles:
        return Tiles(*tiles)
    return launch_tiles("linear_token_logprobs", hidden, hidden.shape[1], weight.shape[0])


def _placeholder(like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A [0] tensor standing for an output the path does not produce."""
    return like.new_empty(0, dtype=dtype)


@torch.library.custom_op("erpo_kernels::linear_token_logprobs", mutates_args=())
def _linear_token_logprobs_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
    inv_t: torch.Tensor, support: Optional[torch.Tensor], *, softcap: Optional[float], logit_scale: Optional[float], unit: bool, ignore_index: int,
    return_entropy: bool, use_triton: bool, tiles: List[int],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> logp [N], entropy [N] (or [0]), and what the Triton backward needs: lse_parts
    [2, N] (M, log l), order [N], n_valid [1] (each [0] on the reference)."""
    transform = LogitTransform(inv_t, softcap, logit_scale, unit)
    with no_autocast(hidden.device), device_guard(hidden.device):
        if use_triton:
            launch = _Launch.build(hidden, weight, bias, targets, transform, ignore_index,
                                   _tiles_of(tiles, hidden, weight), support)  # fmt: skip
            logp, entropy, lse_parts = _forward(launch, return_entropy)
            order, n_valid = launch.order, launch.n_valid
        else:
            logp, entropy = reference.linear_token_logprobs_forward(
                hidden, weight, bias, targets, transform, ignore_index, return_entropy, support
            )
            lse_parts = _placeholder(logp)
            order, n_valid = _placeholder(logp, torch.int64), _placeholder(logp, torch.int64)
    return logp, entropy if entropy is not None else _placeholder(logp), lse_parts, order, n_valid


@_linear_token_logprobs_op.register_fake
def _linear_token_logprobs_fake(hidden, weight, bias, targets, inv_t, support, *, use_triton, return_entropy, **options):
    n = hidden.shape[0]
    logp = hidden.new_empty(n, dtype=torch.float32 if use_triton else compute_dtype(hidden.dtype))
    rows = n if use_triton else 0
    index = dict(dtype=torch.int64)
    return (logp, logp.new_empty(n if return_entropy else 0), logp.new_empty(2, rows), logp.new_empty(rows, **index),
            logp.new_empty(1 if use_triton else 0, **index))  # fmt: skip


@torch.library.custom_op("erpo_kernels::linear_token_logprobs_backward", mutates_args=())
def _backward_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
    inv_t: torch.Tensor, support: Optional[torch.Tensor], lse_parts: torch.Tensor, order: torch.Tensor,
    n_valid: torch.Tensor, entropy: torch.Tensor, g_logp: Optional[torch.Tensor], g_entropy: Optional[torch.Tensor], *,
    softcap: Optional[float],
    logit_scale: Optional[float], unit: bool, ignore_index: int, use_triton: bool, tiles: List[int], need: List[bool],
    support_offset: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> d_hidden [N, D], d_weight [V, D], d_bias [V] in the inputs' dtypes (contiguous;
    [0] where `need` (hidden, weight, bias) says not wanted). g_entropy None: the
    entropy's gradient is not wanted."""
    transform = LogitTransform(inv_t, softcap, logit_scale, unit)
    entropy = entropy if g_entropy is not None else None
    with no_autocast(hidden.device), device_guard(hidden.device):
        if use_triton:
            launch = _Launch(_int32_safe_columns(hidden), _int32_safe_columns(weight), bias, targets.contiguous(),
                             transform, order, n_valid, _tiles_of(tiles, hidden, weight), support,
                             support_offset)  # fmt: skip
            f32 = dict(dtype=torch.float32, device=hidden.device)
            g = g_logp.to(torch.float32).contiguous() if g_logp is not None else torch.zeros(hidden.shape[0], **f32)
            ge = g_entropy.to(torch.float32).contiguous() if g_entropy is not None else None
            grads = _backward(launch, lse_parts, entropy, g, ge, tuple(need))
        else:
            grads = reference.linear_token_logprobs_backward(
                hidden, weight, bias, targets, transform, ignore_index, entropy, g_logp, g_entropy, support
            )
    return tuple(g.contiguous() if g is not None and want else _placeholder(t)
                 for g, t, want in zip(grads, (hidden, weight, weight), need))  # fmt: skip


@_backward_op.register_fake
def _backward_fake(hidden, weight, bias, *args, need, **options):
    return tuple(t.new_empty(t.shape if want else 0) if t is not None else weight.new_empty(0)
                 for t, want in zip((hidden, weight, bias), need))  # fmt: skip


def _setup_context(ctx, inputs, keyword_only_inputs, output) -> None:
    _, entropy, lse_parts, order, n_valid = output
    ctx.save_for_backward(*inputs, lse_parts, order, n_valid, entropy)
    ctx.options = dict(keyword_only_inputs)
    ctx.set_materialize_grads(False)  # an unused output costs nothing in backward


def _backward_autograd(ctx, g_logp, g_entropy, *_unused):
    hidden, weight, bias = ctx.saved_tensors[:3]
    options = dict(ctx.options)
    if not options.pop("return_entropy"):
        g_entropy = None
    need = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]]
    if (g_logp is None and g_entropy is None) or not any(need):
        return None, None, None, None, None, None
    grads = _backward_op(*ctx.saved_tensors, g_logp, g_entropy, need=need, **options)
    return tuple(g if want else None for g, want in zip(grads, need)) + (None, None, None)


_linear_token_logprobs_op.register_autograd(_backward_autograd, setup_context=_setup_context)


def operand_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype `_checked_operands` casts an operand (hidden, weight, bias) to: the autocast
    dtype where autocast is on (fp64 is left alone), else its own."""
    amp = autocast_dtype(t.device)
    return amp if amp is not None and t.dtype != torch.float64 else t.dtype


def _checked_operands(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """hidden [N, D], weight [V, D], bias [V] or None, checked (ValueError naming the
    argument) and cast to the autocast dtype as autocast casts a linear layer's operands."""
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES, device=hidden.device)
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES, device=hidden.device)
    hidden, weight, bias = (t.to(operand_dtype(t)) if t is not None else t for t in (hidden, weight, bias))
    check_tensor("weight", weight, dtypes=(hidden.dtype,))
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight has D = {weight.shape[1]} columns but hidden has D = {hidden.shape[1]}")
    if weight.shape[0] < 1:
        raise ValueError("weight must have at least one row (V >= 1)")
    if bias is not None:
        check_tensor("bias", bias, dtypes=(hidden.dtype,))
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(
                f"bias has {bias.shape[0]} entries, expected {weight.shape[0]} (one per vocabulary row of weight)"
            )
    return hidden, weight, bias


# linear_token_logprobs of a weight sharded on the vocabulary (a DTensor): vocab_parallel.py
# builds on this module, so it registers its function here when the package loads.
_VOCAB_PARALLEL: List[Callable[..., Any]] = []


def register_vocab_parallel(fn: Callable[..., Any]) -> None:
    """The function linear_token_logprobs hands a DTensor weight to (vocab_parallel.py's)."""
    _VOCAB_PARALLEL[:] = [fn]


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
    support: Optional[torch.Tensor] = None,
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
            inv_temperature (positive, finite), and that a threshold support has no
            NaN. These checks read the tensors on the host (a device sync); pass False
            in a hot loop once the batch has been validated. Shapes, dtypes and devices
            are always checked. A target outside [0, V) that is not ignore_index then
            gives that row a NaN log-prob (and no gradient through it), never a finite
            value (docs/kernels.md).
        tiles: the Triton launch configuration, a Tiles (None: the device's, see
            erpo_kernels.default_tiles and `python -m bench tune`); results depend on it,
            never on N.
        support: None, or each row's kept set (the sampler's support), the softmax
            renormalised over it (log-probs, entropies, gradients): a floating [N]
            threshold (keep token j iff z_j * inv_T >= threshold, z after the bias,
            logit scale and soft cap; -inf: the whole row) or an int32 bitmask
            [N, ceil(V / 32)] (bit j of word k keeps token 32 k + j; -1 words: the
            whole row; the whole vocabulary's V with a sharded weight too). The
            target is always kept. erpo_kernels.support; docs/kernels.md.
    weight (and bias) may be DTensors sharded Shard(0) on a 1-D mesh (the lm_head
    vocabulary-parallel over a tensor-parallel group, hidden and targets the same on
    every rank): each rank works on its rows only and the ranks combine per-row
    statistics (erpo_kernels/vocab_parallel.py, docs/distributed.md).
    Returns:
        logp [N] fp32 (fp64 for fp64 inputs), and entropy [N] when return_entropy.
        Gradients flow to hidden, weight and bias (deterministic on the Triton
        backend: no atomics). On the Triton backend, a row's logp, entropy and
        d_hidden row are bit-identical whatever else is in the batch (N, the other
        rows, ignored rows, the row's position): they depend on the row, weight,
        bias, the options, the dtype and the tiles only (docs/batch-invariance.md).

    The Triton backward needs a workspace of N x split_tiles x block_v values in the
    input dtype (4096 columns by default: 2.7% of an [N, V] bf16 tensor at V = 151,936)
    and, for bf16 / fp16 inputs over more than one chunk, an fp32 [N, D] running d_hidden.

    Under autocast (enabled for hidden's device type) the op treats the product
    hidden @ weight.T as autocast treats a linear layer: fp16/bf16/fp32 hidden, weight
    and bias are cast to the autocast dtype first (so fp32 parameters with bf16 hidden
    states work), and the softmax side stays fp32. Gradients reach the uncast tensors
    in their own dtypes.
    """
    if is_dtensor(weight) or is_dtensor(bias):  # the lm_head sharded on the vocabulary (tensor parallel)
        return _VOCAB_PARALLEL[0](
            hidden, weight, targets, bias=bias, inv_temperature=inv_temperature, ignore_index=ignore_index,
            return_entropy=return_entropy, softcap=softcap, logit_scale=logit_scale, backend=backend,
            validate=validate, tiles=tiles, support=support,
        )
    hidden, weight, bias = _checked_operands(hidden, weight, bias)
    n = hidden.shape[0]
    check_targets(targets, n, weight.shape[0], ignore_index, hidden.device, validate=validate)
    transform = LogitTransform.build(
        inv_temperature, n, hidden.device, softcap=softcap, logit_scale=logit_scale, validate=validate
    )
    support = check_support(support, n, weight.shape[0], hidden.device, validate=validate)
    if tiles is not None and not isinstance(tiles, Tiles):
        raise ValueError(f"tiles must be None or a Tiles, got {type(tiles).__name__}")
    use_triton = resolve_kernel_backend(backend, {"hidden": hidden}) == "triton"
    if use_triton:  # the one copy of a strided view, saved for the backward (see _int32_safe_columns)
        hidden, weight = _int32_safe_columns(hidden), _int32_safe_columns(weight)
    inv_t, softcap, logit_scale, unit = transform.op_args()
    logp, entropy, _, _, _ = _linear_token_logprobs_op(
        hidden, weight, bias, targets.contiguous(), inv_t, support, softcap=softcap, logit_scale=logit_scale, unit=unit,
        ignore_index=ignore_index, return_entropy=bool(return_entropy), use_triton=use_triton,
        tiles=tiles.as_list() if tiles is not None else [],
    )
    logp = nan_where_out_of_range(logp, targets, weight.shape[0], ignore_index, validate)
    return (logp, entropy) if return_entropy else logp
