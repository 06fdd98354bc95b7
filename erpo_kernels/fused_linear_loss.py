"""The fused path of erpo_loss: log-probs and the loss's gradient of a chunk of rows from
logits computed once (3 GEMMs of work where linear_token_logprobs' forward + backward
does 4).

`LinearLogprobsChunks` scores the rows of a batch a chunk at a time. Per chunk of rows
[r0, r1) (whole sequences, chosen by the caller):

    forward(r0, r1, ...)   linear_token_logprobs' forward kernel and merge at the
                           tiles' kept_forward() (Tiles.kept_block_v: a logit width of
                           its own, 256 on Hopper, as nothing recomputes these logits), the
                           kernel also storing the chunk's scaled logits s [rows, V]
                           in a kept buffer (fp32 operands: s itself, exactly what the
                           softmax saw; bf16 / fp16: x = s - m in fp16, m the row's
                           running max after the part of the tile, fp32 per row and part)
                           -> logp [rows], entropy [rows] (fp32)
    backward(g_logp, g_H)  the per-row upstream coefficients of the loss (the caller gets
                           them by autograd over the [rows] vectors); per vocabulary chunk
                           of C = split_tiles * block_v columns, `_fused_dr_kernel` forms
                           the softmax gradient dr [rows, C] from the kept logits (no
                           recompute), then the two products: d_hidden[r0:r1] = dr @ W
                           (summed over the vocabulary chunks) and d_weight (+)= dr.T @ h,
                           d_bias (+)= sum of dr over the rows, added over the row chunks.
    gradients()            d_hidden [N, D], d_weight [V, D], d_bias [V] in the operands'
                           (uncast) dtypes.

With a support (forward's `support=`, linear_token_logprobs' argument, erpo_kernels/support.py)
the kept logits are -inf outside each row's kept set (the forward kernel's `_scaled_logits`
masks them), so dr is 0 there: p = 0, p log p taken as 0, and the soft cap's slope, which
is recovered from s, is not formed from an -inf.

Work: 2 N D V FLOPs for the logits and 4 N D V for the products: 3 GEMMs of 2 N D V.
Memory: the kept buffer holds max_rows x V values, fp32 or fp16 (rows_for_budget: the
caller's budget in bytes, so 16-bit operands get twice the rows; their fp32 maxima add
max_rows x cdiv(V, part) values, part >= 64 columns at the default tiles), the dr
workspace max_rows x C in the input dtype (as linear_token_logprobs' backward), d_bias an
fp32 [V]; d_weight is written directly when the weight's gradient is fp32 (it accumulates
in place) or when there is one row chunk; bf16 / fp16 weights over several row chunks
accumulate in one fp32 [V, D] buffer for the whole call (never one per chunk), which
`gradients()` casts once at the end, or hands over uncast with `gradients(cast=False)`:
erpo_loss's fused path then keeps it until its backward, which rounds it to the weight's
dtype in the same pass that scales it by the upstream gradient (objective/fused.py:
`_ScaledGradients`). Nothing of size N x V for the whole batch.

Precision and order. For fp32 operands the kept logits are the forward's fp32 values bit
for bit, so at the op's own logit width (kept_block_v 0, every fp32 default) dr is the one
linear_token_logprobs' backward forms from its recompute (the soft cap's slope 1 - tanh^2 is recovered from s: tanh = s / (inv_T c), an absolute error
of a few fp32 ulps). For bf16 / fp16, x = s - m <= 0 rounded to fp16 moves p by a
relative |x| 2^-11 at most, whatever the logits' magnitude (`_fused_dr_kernel`'s comment;
s itself in 16 bits would not do at |s| ~ 100-400): dr agrees with the recompute's within
the dtype's gradient tolerance against float64, not bit for bit. dr is rounded to the
input dtype before the products, as there. The products
(Tiles.gemm_engine): 0 = `_ltl_bwd_gemm_kernel` (our Triton products, fixed order, no
atomics); 1 = torch matmuls (cuBLAS on a GPU: the input dtype's operands with fp32
accumulation into an fp32 output where the output is fp32; on a CPU the operands are
upcast first). A row's logp, entropy and d_hidden row depend on the row, the weights, the
options and the tiles only (batch invariant, as linear_token_logprobs): d_hidden sums
over the vocabulary chunks in order; d_weight and d_bias over the rows of a chunk in
order, then the chunks in order, so they are deterministic for a fixed chunking.
"""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch

from ._triton import interpreting, tl, triton
from ._utils import device_guard, is_dtensor, no_autocast, resolve_kernel_backend
from .linear_token_logprobs import (
    _cdiv,
    _checked_operands,
    _chunk_products,
    _forward,
    _Launch,
    _load_row_stats,
    _rows_of,
    _softmax_grad,
    _split_vocab,
    _store_dr,
    _tiles_of,
    _torch_chunk_products,
    logit_part,
)
from .logit_transform import LogitTransform
from .support import check_support
from .tiles import Tiles

# The default bound on what one chunk keeps: 1 GiB of kept logits (rows_for_budget: 3533 rows
# of 16-bit logits at V = 151,936, 1766 of fp32).
DEFAULT_FUSED_BUDGET = 1 << 30


# `_fused_dr_kernel`'s tile: the logit tiles' rows (the d_bias partial sums are per row tile
# of block_n rows, as `_ltl_bwd_dr_kernel`'s), DR_TILE values in all, on DR_WARPS warps (16
# values per thread: it is elementwise, and the logit tiles' 128 x 256 would spill).
DR_TILE = 4096
DR_WARPS = 8


def dr_block_v(tiles: Tiles) -> int:
    """The vocabulary width of `_fused_dr_kernel`'s tile for these tiles (a power of two
    dividing the chunk): DR_TILE // block_n columns, within [16, one part of a logit tile]
    (a tile then lies in one part: one kept_max per row)."""
    return max(16, min(logit_part(tiles.block_v), DR_TILE // tiles.block_n))


def kept_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the kept logits for operands of `dtype` (as the kernels see them:
    linear_token_logprobs.operand_dtype): fp16 (s minus its part's running max, module
    docstring) for bf16 / fp16, else fp32 (s itself)."""
    return torch.float16 if dtype in (torch.bfloat16, torch.float16) else torch.float32


def kept_logits_refusal(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], backend: str,
                        fused_budget: int) -> Optional[str]:
    """None when LinearLogprobsChunks can serve these arguments (the gradient from kept
    logits), else why not: no budget, torch.compile, no gradient wanted, a DTensor, the
    torch backend. Its callers (erpo_loss's fused path, kept_logits) add their own
    conditions. Reads no tensor value."""
    if fused_budget <= 0:
        return "fused_budget=0"
    if torch.compiler.is_compiling():
        return "torch.compile"
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        return "no gradient wanted (the forward alone: 1 GEMM)"
    if is_dtensor(weight) or is_dtensor(bias) or is_dtensor(hidden):
        return "a DTensor (vocabulary-parallel) weight"
    if resolve_kernel_backend(backend, {"hidden": hidden, "weight": weight}) != "triton":
        return "the torch backend"
    return None


def rows_for_budget(budget: int, vocab: int, dtype: torch.dtype) -> int:
    """Rows per chunk whose kept logits fit in `budget` bytes for operands of `dtype`:
    budget // (4 V) for fp32, budget // (2 V) for bf16 / fp16 (kept_dtype), at least 1.
    The budget counts the kept logits; the fp32 per-part maxima of 16-bit ones add 4 bytes
    per row and part of >= 64 columns (<= 1/32 of the logits' bytes at the default tiles)."""
    return max(1, int(budget) // (kept_dtype(dtype).itemsize * int(vocab)))


# The softmax gradient from the kept logits, per valid row with p = softmax(s) and the
# upstream coefficients g_logp, g_H (linear_token_logprobs' backward comment has the
# derivation; `_softmax_grad` is the one implementation):
#     dz_j = inv_T (g_logp (onehot_j - p_j) - g_H p_j (s_j - lse + H)),
#     dr_j = dz_j logit_scale (1 - tanh^2)   with a soft cap c, tanh = s_j / (inv_T c),
# else dr = dz (a logit scale without a cap is folded into inv_T). With lse = M + log l
# (the merge's two floats), KEPT_FP16 reads x_j = s_j - m_k (fp16) and m_k (fp32, the
# forward's running max after part k, the tile's part) and forms
#     s_j - lse = x_j - (M - m_k) - log l,   p_j = exp(x_j - (M - m_k) - log l),
# M - m_k >= 0 taken first (two fp32 values: no cancellation at large |s|), and
# s_j = x_j + m_k for the cap's slope only. m_k <= M, so 0 <= -x_j <= M - s_j: fp16 (11
# significant bits) rounds x_j by at most |x_j| 2^-11, so p_j is off by a relative
# |x_j| 2^-11 <= (M - s_j) 2^-11 (0.05% at p_j = e^-1 p_max, 1% at e^-20, where p_j is
# negligible beside the row's larger terms), whatever the logits' magnitude: s_j itself in
# 16 bits would put |s_j| 2^-11 (fp16) or 2^-8 (bf16) into every exponent, 0.2 or 1.6 at
# |s| = 400. dr is rounded to the input dtype after. p log p is 0 where
# p = 0 (masked columns, s = -inf). Rows past the valid count (ignored targets) get
# dr = 0 when ZERO_PAD (the torch products read every row of the workspace), else are
# left alone (the Triton products stop at the valid count). One program per
# [BLOCK_N, BLOCK_V] tile of the vocabulary chunk [v0, v0 + chunk_cols); program pid makes
# vocabulary tile pid % n_vt of row tile pid // n_vt. With WANT_DB it also writes each
# row tile's column sums of dr (before rounding) for d_bias, as `_ltl_bwd_dr_kernel` does.
@triton.jit
def _fused_dr_kernel(
    kept_ptr,  # [N, V] at compact positions (row stride V): the forward's s (fp32) or, KEPT_FP16, s - m (fp16)
    kept_max_ptr,  # [N, n_parts] fp32 (KEPT_FP16): m per row and part of PART columns (`_fwd_part`)
    targets_ptr, inv_t_ptr, order_ptr, n_valid_ptr,  # as in linear_token_logprobs' forward kernel
    shift_ptr, log_l_ptr,  # [N] fp32 M and log l from the merge (lse = M + log l)
    entropy_ptr,  # [N] fp32 entropy (HAS_ENTROPY_GRAD)
    g_logp_ptr, g_entropy_ptr,  # [N] fp32 upstream coefficients (g_entropy with HAS_ENTROPY_GRAD)
    dr_ptr,  # [N, C] out, the input dtype, compact positions (row stride stride_dr)
    db_part_ptr,  # [cdiv(N, BLOCK_N), C] fp32 out (WANT_DB)
    n_rows, V, v0, chunk_cols, stride_dr, n_parts,
    softcap, logit_scale,  # fp32 runtime values (read with HAS_SOFTCAP)
    HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, WANT_DB: tl.constexpr, ZERO_PAD: tl.constexpr,
    UPCAST: tl.constexpr, KEPT_FP16: tl.constexpr, PART: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,  # BLOCK_V <= PART: a tile lies in one part (v0 is a multiple of PART)
):
    pid = tl.program_id(0)
    n_vt = tl.cdiv(chunk_cols, BLOCK_V)
    rows = (pid // n_vt) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = (pid % n_vt) * BLOCK_V  # the tile's first column in the chunk
    local = tl.arange(0, BLOCK_V)
    row_mask, row_index, n_valid = _rows_of(rows, order_ptr, n_valid_ptr)
    if ZERO_PAD or tl.min(rows, axis=0) < n_valid:  # a tile of ignored rows: no work unless zeroed
        col_mask = local < chunk_cols - start
        tgt, inv_t, shift, log_l, entropy, g_logp, g_entropy = _load_row_stats(
            row_index, row_mask, targets_ptr, inv_t_ptr, shift_ptr, log_l_ptr, entropy_ptr, g_logp_ptr,
            g_entropy_ptr, HAS_ENTROPY_GRAD,
        )
        in_tile = row_mask[:, None] & col_mask[None, :]
        s = tl.load(kept_ptr + (rows.to(tl.int64) * V + (v0 + start))[:, None] + local[None, :], mask=in_tile,
                    other=float("-inf")).to(tl.float32)  # fmt: skip
        if KEPT_FP16:  # s holds x = s - m_k: the softmax reads x against lse - m_k = (M - m_k) + log l
            m_k = tl.load(kept_max_ptr + rows.to(tl.int64) * n_parts + (v0 + start) // PART, mask=row_mask, other=0.0)
            shift = shift - m_k
            x = s
            s = x + m_k[:, None]  # the cap's slope only
        else:
            x = s
        if HAS_SOFTCAP:  # s = -inf only outside a support (|z| < softcap): there p = 0 and the slope is unread
            t = tl.where(in_tile & (s > float("-inf")), s / (inv_t[:, None] * softcap), 0.0)
            cap_slope = 1.0 - t * t
        else:
            cap_slope = s  # unread
        dr = _softmax_grad(
            x, cap_slope, row_mask, local, tgt - (v0 + start), shift, log_l, entropy, g_logp, g_entropy, inv_t,
            logit_scale, HAS_ENTROPY_GRAD, HAS_SOFTCAP,
        )
        dr = tl.where(in_tile, dr, 0.0)
        _store_dr(dr, rows, start, local, col_mask, row_mask, n_rows, dr_ptr, stride_dr, db_part_ptr, pid // n_vt,
                  WANT_DB, ZERO_PAD, UPCAST)  # fmt: skip


class LinearLogprobsChunks:
    """linear_token_logprobs' log-probs and their gradients, one chunk of rows at a time,
    from logits computed once per chunk (module docstring). Triton backend only.

    hidden [N, D], weight [V, D], bias [V] or None (fp16 / bf16 / fp32, checked and cast
    as linear_token_logprobs casts them under autocast); max_rows: the most rows a chunk
    will have (the kept buffer holds max_rows x V values of kept_dtype); n_chunks: how many chunks
    the call makes (1: d_weight is written directly); need: (d_hidden, d_weight, d_bias)
    wanted. Call forward / backward chunk after chunk, in row order, then gradients().
    """

    def __init__(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], *, max_rows: int,
        n_chunks: int, need: Tuple[bool, bool, bool], softcap: Optional[float] = None,
        logit_scale: Optional[float] = None, ignore_index: int = -100, tiles: Optional[Tiles] = None,
    ) -> None:
        self.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        hidden, weight, bias = (None if t is None else t.detach() for t in _checked_operands(hidden, weight, bias))
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.softcap, self.logit_scale, self.ignore_index = softcap, logit_scale, ignore_index
        # the kept-logit forward's tiles (Tiles.kept_forward: possibly wider than the op's), which
        # also set the kept maxima's parts and the gradient's dr tiles; the products' are the op's
        self.tiles = (tiles if tiles is not None else _tiles_of([], hidden, weight)).kept_forward()
        need = (bool(need[0]), bool(need[1]), bool(need[2]) and bias is not None)
        self.need = need
        n, d = hidden.shape
        vocab = weight.shape[0]
        dev = hidden.device
        f32 = dict(dtype=torch.float32, device=dev)
        rows = max(1, min(int(max_rows), n))
        _, self.chunk = _split_vocab(vocab, self.tiles)
        self.width = min(self.chunk, vocab)
        # the chunk's logits, reused chunk after chunk (kept_dtype), and for 16-bit ones their per-part maxima
        self.kept = torch.empty(rows * vocab, dtype=kept_dtype(hidden.dtype), device=dev)
        self.n_parts = _cdiv(vocab, logit_part(self.tiles.block_v))
        self.kept_max = torch.empty(rows * self.n_parts if self.kept.dtype == torch.float16 else 0, **f32)
        self.dr = torch.empty(rows, self.width, dtype=hidden.dtype, device=dev)  # the workspace
        self.db_part = torch.empty(_cdiv(rows, self.tiles.block_n) if need[2] else 0, self.width, **f32)
        self.torch_products = self.tiles.gemm_engine == 1
        # the running d_hidden of a chunk over the vocabulary chunks (fp32): the torch products
        # always, the Triton ones for low-precision d_hidden over more than one vocabulary chunk
        self.dh_acc = None
        if need[0] and (self.torch_products or (self.dtypes[0] != torch.float32 and vocab > self.chunk)):
            self.dh_acc = torch.empty(rows, d, **f32)
        self.d_hidden = torch.zeros(n, d, dtype=self.dtypes[0], device=dev) if need[0] else None
        self.d_weight = None
        if need[1]:  # fp32 gradients accumulate in place; one chunk writes the gradient directly
            direct = self.dtypes[1] == torch.float32 or n_chunks == 1
            self.d_weight = torch.empty(vocab, d, dtype=self.dtypes[1] if direct else torch.float32, device=dev)
        self.d_bias = torch.empty(vocab, **f32) if need[2] else None
        self.started = False  # a chunk's products were added (later chunks accumulate)
        self._state: Optional[tuple] = None

    def forward(
        self, r0: int, r1: int, targets: torch.Tensor, inv_temperature: Union[None, float, torch.Tensor],
        want_entropy: bool, support: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """logp [r1 - r0] fp32 and entropy (or None) of rows [r0, r1); targets,
        inv_temperature and support (linear_token_logprobs' support=, None: the whole
        vocabulary) are those rows' (already validated). Keeps the chunk's logits for
        `backward` (-inf outside the support)."""
        h = self.hidden[r0:r1]
        n = h.shape[0]
        transform = LogitTransform.build(inv_temperature, n, h.device, softcap=self.softcap,
                                         logit_scale=self.logit_scale, validate=False)  # fmt: skip
        support = check_support(support, n, self.weight.shape[0], h.device, validate=False)
        with no_autocast(h.device), device_guard(h.device):
            launch = _Launch.build(h, self.weight, self.bias, targets, transform, self.ignore_index, self.tiles,
                                   support)  # fmt: skip
            kept = self.kept[: n * self.weight.shape[0]]
            kept_max = self.kept_max[: n * self.n_parts] if self.kept.dtype == torch.float16 else None
            logp, entropy, lse_parts = _forward(launch, want_entropy, kept if n > 0 else None, kept_max)
        self._state = (r0, launch, lse_parts, entropy, kept, kept_max)
        return logp, entropy

    def backward(self, g_logp: torch.Tensor, g_entropy: Optional[torch.Tensor]) -> None:
        """Add the last forward chunk's gradients, given the loss's coefficients g_logp
        [rows] and g_entropy [rows] (None: the loss does not read the entropy)."""
        r0, launch, lse_parts, entropy, kept, kept_max = self._state
        self._state = None
        n = launch.n
        if n == 0 or not any(self.need):
            return
        vocab = self.weight.shape[0]
        g = g_logp.detach().to(torch.float32).contiguous()
        ge = g_entropy.detach().to(torch.float32).contiguous() if g_entropy is not None else None
        has_eg = ge is not None and entropy is not None
        cfg = self.tiles
        dr, db_part = self.dr[:n], self.db_part[: _cdiv(n, cfg.block_n)] if self.need[2] else self.db_part
        d_hidden = self.d_hidden[r0 : r0 + n] if self.need[0] else None
        out = [d_hidden, self.d_weight, self.d_bias]
        dh_acc = self.dh_acc[:n] if self.dh_acc is not None else d_hidden
        transform = launch.transform.kernel_args()
        h_c = None
        if self.torch_products and (self.need[1]):
            h_c = launch.hidden.index_select(0, launch.order)  # [n, D] the rows in compact order
        with no_autocast(self.hidden.device), device_guard(self.hidden.device):
            for v0 in range(0, vocab, self.chunk):
                cols = min(self.chunk, vocab - v0)
                block_v = dr_block_v(cfg)
                grid = (_cdiv(n, cfg.block_n) * _cdiv(cols, block_v),)
                _fused_dr_kernel[grid](
                    kept_ptr=kept, kept_max_ptr=kept_max if kept_max is not None else g,
                    targets_ptr=launch.targets, inv_t_ptr=launch.transform.inv_t,
                    order_ptr=launch.order, n_valid_ptr=launch.n_valid, shift_ptr=lse_parts[0],
                    log_l_ptr=lse_parts[1], entropy_ptr=entropy if has_eg else g, g_logp_ptr=g,
                    g_entropy_ptr=ge if has_eg else g, dr_ptr=dr, db_part_ptr=db_part if self.need[2] else dr,
                    n_rows=n, V=vocab, v0=v0, chunk_cols=cols, stride_dr=self.width, n_parts=self.n_parts,
                    softcap=transform["softcap"], logit_scale=transform["logit_scale"],
                    HAS_SOFTCAP=transform["HAS_SOFTCAP"], HAS_ENTROPY_GRAD=has_eg, WANT_DB=self.need[2],
                    ZERO_PAD=self.torch_products, UPCAST=self.hidden.dtype == torch.bfloat16 and interpreting(),
                    KEPT_FP16=kept_max is not None, PART=logit_part(cfg.block_v), BLOCK_N=cfg.block_n,
                    BLOCK_V=block_v, num_warps=DR_WARPS,
                )
                if self.torch_products:
                    _torch_chunk_products(launch, dr, db_part, h_c, v0, cols, out, self.dh_acc,
                                          accumulate=self.started)  # fmt: skip
                else:
                    _chunk_products(launch, dr, db_part, v0, cols, out, dh_acc, accumulate=self.started)
            if self.torch_products and self.need[0]:
                d_hidden.index_copy_(0, launch.order, self.dh_acc[:n].to(d_hidden.dtype))
        self.started = True

    def gradients(self, cast: bool = True) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor],
                                                    Optional[torch.Tensor]]:
        """(d_hidden [N, D], d_weight [V, D], d_bias [V]) in the uncast operands' dtypes,
        None where not wanted (or no chunk ran: zeros). cast=False: a gradient accumulated
        in fp32 for a lower-precision operand (d_weight over several row chunks, d_bias) is
        returned as that fp32 accumulator, for the caller to round (`self.dtypes` says to what)."""
        out: List[Optional[torch.Tensor]] = []
        for t, want, dtype, like in zip((self.d_hidden, self.d_weight, self.d_bias), self.need, self.dtypes,
                                        (self.hidden, self.weight, self.bias)):  # fmt: skip
            if not want:
                out.append(None)
            elif not self.started and t is not self.d_hidden:
                out.append(torch.zeros(like.shape, dtype=dtype, device=like.device))
            else:
                out.append(t if t.dtype == dtype or not cast else t.to(dtype))
        return tuple(out)  # type: ignore[return-value]


__all__ = ["DEFAULT_FUSED_BUDGET", "LinearLogprobsChunks", "kept_dtype", "kept_logits_refusal", "rows_for_budget"]
