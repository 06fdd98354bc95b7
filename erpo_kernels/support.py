"""The sampler's support: the per-row kept set that both fused ops renormalise over.

Rollouts sampled with top-k, top-p or min-p draw each token from a truncated
vocabulary K (the row's support); scoring the same token under the full softmax biases
every ratio built on it. `token_logprobs(..., support=)` and
`linear_token_logprobs(..., support=)` take K in one of two forms (one home for both:
the check, the packing helpers, the torch mask and the Triton mask live here):

    threshold  a floating tensor [N]: token j is kept iff s_j >= threshold[row], with
               s_j = z_j * inv_T the row's scaled logits (z after the op's logit scale
               and soft cap, the bias included): the value top-k / top-p / min-p cut
               at. -inf: the row is unrestricted (prompt rows).
    bitmask    an int32 tensor [N, ceil(V / 32)]: bit j of word k (`(word >> j) & 1`)
               keeps token 32 k + j; bits past V are ignored; a row of -1 words is
               unrestricted. V is the whole vocabulary (with a sharded lm_head too).

The target is always kept: K = support + {target}. A sampled token is in the
sampler's kept set by construction, so this changes nothing for a consistent record;
it decides what happens to a target outside the support (docs/kernels.md says why).
A token is dropped only when the test says so (s_j < threshold, a 0 bit): a NaN logit
stays, and keeps its row NaN, as without a support; an unrestricted row is computed
bit for bit as without one.

Cost per pass that forms a row's logits: the threshold is one fp32 per row, the bitmask
ceil(V / 32) int32 words per row (V / 8 bytes, 1/16 of the row's bf16 logits).
"""
from __future__ import annotations

from typing import Optional

import torch

from ._triton import tl, triton
from ._utils import FLOAT_DTYPES, check_rows, check_tensor, checking_values

# The kernels' SUPPORT flag.
NO_SUPPORT = 0
THRESHOLD = 1
BITMASK = 2
WORD_BITS = 32


def support_words(vocab: int) -> int:
    """Words per row of a bitmask over `vocab` tokens: ceil(V / 32)."""
    return -(-int(vocab) // WORD_BITS)


def support_kind(support: Optional[torch.Tensor]) -> int:
    """NO_SUPPORT, THRESHOLD (a floating tensor) or BITMASK (an int32 tensor)."""
    if support is None:
        return NO_SUPPORT
    return THRESHOLD if support.dtype.is_floating_point else BITMASK


def check_support(
    support: object, n: int, vocab: int, device: torch.device, *, validate: bool = True
) -> Optional[torch.Tensor]:
    """The op's `support=` as the kernels read it: None, a contiguous fp32 threshold [n]
    or a contiguous int32 bitmask [n, ceil(vocab / 32)] on `device`; ValueError naming
    `support` otherwise. A NaN threshold is refused only when `validate` (it syncs)."""
    if support is None:
        return None
    if not isinstance(support, torch.Tensor):
        raise ValueError(f"support must be None or a torch.Tensor (a [N] threshold or an int32 [N, ceil(V/32)] "
                         f"bitmask), got {type(support).__name__}")  # fmt: skip
    if support.dtype in FLOAT_DTYPES:
        check_tensor("support", support, ndim=1, device=device)
        check_rows("support", support, n, "one threshold per row")
        threshold = support.detach().to(torch.float32).contiguous()
        if checking_values(validate) and n > 0 and bool(torch.isnan(threshold).any()):
            i = int(torch.isnan(threshold).nonzero()[0, 0])
            raise ValueError(f"support[{i}] is NaN: a threshold must be a number, -inf for an unrestricted row")
        return threshold
    if support.dtype == torch.int32:
        words = support_words(vocab)
        check_tensor("support", support, ndim=2, device=device)
        if tuple(support.shape) != (n, words):
            raise ValueError(f"support (a bitmask) must have shape [N, ceil(V / 32)] = [{n}, {words}], "
                             f"got {list(support.shape)}")  # fmt: skip
        return support.detach().contiguous()
    raise ValueError(f"support must be a floating [N] threshold or an int32 [N, ceil(V/32)] bitmask, got dtype "
                     f"{str(support.dtype).replace('torch.', '')} (pack a bool [N, V] mask with pack_support)")


# ------------------------------------------------------------------ building a support


def _wrap_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) -> the int32 with the same 32 bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_support(kept: torch.Tensor) -> torch.Tensor:
    """kept [N, V] bool (True = the token is in the row's support) -> the int32 bitmask
    [N, ceil(V / 32)] the ops take."""
    check_tensor("kept", kept, ndim=2, dtypes=(torch.bool,))
    n, vocab = kept.shape
    words = support_words(vocab)
    padded = torch.zeros(n, words * WORD_BITS, dtype=torch.int64, device=kept.device)
    padded[:, :vocab] = kept.to(torch.int64)
    weights = torch.ones(WORD_BITS, dtype=torch.int64, device=kept.device) << torch.arange(WORD_BITS, device=kept.device)
    return _wrap_int32((padded.view(n, words, WORD_BITS) * weights).sum(-1))


def support_from_token_ids(rows: torch.Tensor, token_ids: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    """The bitmask [n, ceil(vocab / 32)] keeping token token_ids[i] in row rows[i] (both
    [K] integer tensors, e.g. a CSR list of kept ids per row with rows =
    repeat_interleave of the row lengths); no [n, vocab] tensor. Repeated pairs count once."""
    check_tensor("rows", rows, ndim=1)
    check_tensor("token_ids", token_ids, ndim=1, device=rows.device)
    if rows.numel() != token_ids.numel():
        raise ValueError(f"rows has {rows.numel()} entries but token_ids has {token_ids.numel()}")
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
        raise ValueError(f"rows must lie in [0, {n})")
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab):
        raise ValueError(f"token_ids must lie in [0, {vocab})")
    words = support_words(vocab)
    # each (row, token) pair once, so that summing the bits of a word is their OR
    flat = torch.unique(rows.long() * (words * WORD_BITS) + token_ids.long())
    out = torch.zeros(n * words, dtype=torch.int64, device=rows.device)
    out.index_add_(0, flat // WORD_BITS, torch.ones_like(flat) << (flat % WORD_BITS))
    return _wrap_int32(out.view(n, words))


def unpack_support(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The bitmask [N, ceil(V / 32)] -> bool [N, V] (tests and debugging: it is [N, V])."""
    cols = torch.arange(vocab, device=bits.device)
    return ((bits[:, cols // WORD_BITS] >> (cols % WORD_BITS)) & 1).bool()


# ------------------------------------------------------------------ the torch mask


def reference_mask(
    z: torch.Tensor, s: torch.Tensor, support: Optional[torch.Tensor], rows, tgt: torch.Tensor, col_offset: int = 0,
) -> torch.Tensor:
    """z [c, V_chunk] with -inf where the token is outside the row's support (and not
    the row's target): the reference's one mask, out of place (z may be a view of the
    caller's logits). s: the scaled logits z * inv_T the threshold is compared with
    (z itself at temperature 1); rows: the chunk's rows of `support`; tgt [c]: each
    row's target column in z (negative: none); column j of z is token col_offset + j."""
    if support is None:
        return z
    cols = torch.arange(z.shape[1], device=z.device)
    if support.dtype.is_floating_point:
        drop = s < support[rows].to(s.dtype)[:, None]
    else:
        tokens = cols + col_offset
        words = support[rows][:, tokens // WORD_BITS]
        drop = ((words >> (tokens % WORD_BITS).to(torch.int32)) & 1) == 0
    drop &= cols[None, :] != tgt[:, None]
    return torch.where(drop, torch.full_like(z, float("-inf")), z)


# ------------------------------------------------------------------ the Triton mask


@triton.jit
def apply_support(
    x, s, row_index, cols, col_mask, tgt, support_ptr, stride_support, support_offset, SUPPORT: tl.constexpr,
):
    """x with -inf where the token is outside the row's support and not its target: the
    kernels' one mask (SUPPORT = 0: x itself, no code). Every argument broadcasts to x's
    shape ([BLOCK_N, 1] rows, [1, BLOCK_V] columns, or scalars and [BLOCK_V]):
    s the scaled logits z * inv_T the threshold is compared with; row_index the rows
    of the support (int64, in bounds for every row); cols the columns (compared with
    tgt), token support_offset + col (a shard's offset into the vocabulary: any value,
    not only a multiple of 32); col_mask the columns that exist."""
    if SUPPORT == 1:
        threshold = tl.load(support_ptr + row_index * stride_support)  # one float per row
        x = _drop_below(x, s, threshold, cols != tgt)
    if SUPPORT == 2:
        token = (cols + support_offset).to(tl.int32)
        word = tl.load(support_ptr + row_index * stride_support + (token >> 5), mask=col_mask, other=-1)
        x = _drop_clear_bits(x, word, token & 31, cols != tgt)
    return x


@triton.jit
def _drop_below(x, s, threshold, droppable):
    """x with -inf where s < threshold and `droppable` (not the target): the threshold's test."""
    return tl.where((s < threshold) & droppable, float("-inf"), x)


@triton.jit
def row_thresholds(support_ptr, rows64, row_mask, stride_support, stand_in, SUPPORT: tl.constexpr):
    """A threshold support's value per row of a tile ([rows] fp32, -inf in masked rows), read
    once per program for `apply_support_tile`; `stand_in` (any [rows] tensor, unread) without
    one."""
    if SUPPORT == 1:
        return tl.load(support_ptr + rows64 * stride_support, mask=row_mask, other=float("-inf")).to(tl.float32)
    return stand_in


@triton.jit
def _drop_clear_bits(x, word, bit, droppable):
    """x with -inf where bit `bit` of `word` is 0 and `droppable` (not the target): the bitmask's test."""
    return tl.where((((word >> bit) & 1) == 0) & droppable, float("-inf"), x)


@triton.jit
def apply_support_tile(
    x, s, rows64, local, limit, tgt, support_ptr, stride_support, token0, thresholds, SUPPORT: tl.constexpr,
    COLS: tl.constexpr,
):
    """apply_support for a [rows, COLS] tile (the linear op's logit tiles): column j is
    token token0 + local[j] (local = arange(COLS), those at local < limit real), rows64
    [rows] the support's rows (int64, in bounds), tgt [rows] the targets counted from
    token0's column (always kept). The same mask; a threshold's values come in as
    `thresholds` [rows] (`row_thresholds`: read once per program, not once per part of a
    tile, which on sm_100 also kept ptxas from spilling predicates); a bitmask's words are read as
    ceil(COLS / 32) + 1 loads per row (the words the tile's columns can straddle,
    aligned with the tile's columns), not one load per element: no [rows, COLS] tile of
    addresses."""
    if SUPPORT == 1:
        x = _drop_below(x, s, thresholds[:, None], local[None, :] != tgt[:, None])
    if SUPPORT == 2:
        # the words holding the tile's bits: NW loads per row, shifted by m = token0 mod 32 into
        # COLS / 32 words aligned with the tile (word k: columns 32 k ... 32 k + 31)
        first = token0 >> 5
        last = (token0 + limit - 1) >> 5  # the last word holding a real column
        m = token0 & 31
        row_words = support_ptr + rows64 * stride_support + first
        at = rows64 * 0 + first  # the word index, per row (a tensor mask)
        lo = tl.load(row_words, mask=at <= last, other=-1).to(tl.uint32, bitcast=True)
        word = tl.zeros(x.shape, tl.uint32)
        for k in tl.static_range(0, (COLS + 31) // 32):
            hi = tl.load(row_words + (k + 1), mask=at + (k + 1) <= last, other=-1)
            hi = hi.to(tl.uint32, bitcast=True)
            aligned = tl.where(m == 0, lo, (lo >> m) | (hi << (32 - m)))  # m = 0: no shift by 32
            word = tl.where(((local >> 5) == k)[None, :], aligned[:, None], word)
            lo = hi
        x = _drop_clear_bits(x, word, (local & 31)[None, :], local[None, :] != tgt[:, None])
    return x


def kernel_args(support: Optional[torch.Tensor], stand_in: torch.Tensor, offset: int = 0) -> dict:
    """The kernels' support arguments: support_ptr (stand_in, unread, without one), its
    row stride, the vocabulary offset of column 0 and the SUPPORT flag."""
    return dict(
        support_ptr=support if support is not None else stand_in,
        stride_support=support.stride(0) if support is not None else 0,
        support_offset=int(offset),
        SUPPORT=support_kind(support),
    )
