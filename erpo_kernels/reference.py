"""Plain-PyTorch versions of every op: the spec the tests compare against (run in
float64) and the path `backend="auto"` takes where Triton cannot compile.

Each op's forward and backward are separate functions without autograd: the op's
custom op (token_logprobs.py, linear_token_logprobs.py) runs them behind the same
autograd registration as its kernels. They are memory-bounded: work is done in row
chunks, only the inputs and the per-row entropy are saved, and each chunk's softmax
is recomputed in backward with the same fused PyTorch op as the forward. Peak extra memory is a few chunk x V
buffers plus the gradient itself, never a second [N, V] fp32 copy.

Math shared with the kernels, per row with s = inv_T * z (z the logits):
    lse = log sum_j exp(s_j),  p_j = exp(s_j - lse)
    logp = s_target - lse,     H = -sum_j p_j log p_j
    dlogp/ds_j = onehot_j - p_j
    dH/ds_j    = -p_j (log p_j + H) = -p_j (s_j - lse + H)
    dL/dz_j    = inv_T * (g_logp (onehot_j - p_j) - g_H p_j (s_j - lse + H))
With a support (support.py) the sums run over the row's kept set K only: z_j = -inf
for j outside K (`_supported`), so p_j = 0 there and the formulas hold as written.
Optional logit transform of the raw logits r, before the temperature:
    z = logit_scale r                               (no soft cap: folded into inv_T)
    z = softcap tanh(logit_scale r / softcap)       (soft cap)
    dL/dr_j = dL/dz_j logit_scale (1 - tanh^2)
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._utils import compute_dtype, no_autocast
from .logit_transform import LogitTransform
from .support import reference_mask

# Elements of one chunk's [rows, V] fp32 work buffer (~16 MB). The reference keeps
# about four such buffers alive at once.
CHUNK_ELEMENTS = 1 << 22
# linear_token_logprobs adds each chunk's share into d_weight [V, D], a full read and
# write of it per chunk: its chunks are 4x larger (~64 MB) so that traffic stays small
# next to the matmuls.
LINEAR_CHUNK_ELEMENTS = 1 << 24


def chunk_rows_for(vocab: int, elements: Optional[int] = None) -> int:
    """Rows per chunk so that a [rows, vocab] buffer holds about `elements` values
    (CHUNK_ELEMENTS when None)."""
    return max(1, (elements or CHUNK_ELEMENTS) // max(1, vocab))


def _scaled(z: torch.Tensor, inv_t: Optional[torch.Tensor]) -> torch.Tensor:
    """The scaled logits of a chunk, (z - M) * inv_T with M the row max, subtracted
    before scaling so logits of magnitude 1e4 keep full accuracy; z itself when inv_t is
    None (temperature 1, known on the host from the caller's argument: log_softmax
    shifts by the max exactly, and three passes over [c, V] are saved). A tensor
    inv_t is never inspected for ones: reading its values would sync the device."""
    if inv_t is None:
        return z
    row_max = z.max(dim=-1, keepdim=True).values
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))  # a row of -inf stays nan-free
    return (z - row_max).mul_(inv_t)


def _supported(z: torch.Tensor, inv_t: Optional[torch.Tensor], support: Optional[torch.Tensor], rows,
               tgt: torch.Tensor, col_offset: int = 0) -> torch.Tensor:
    """The chunk's logits z [c, V] with -inf outside each row's support (support.py),
    compared at s = z * inv_T (z at temperature 1); z itself without a support."""
    if support is None:
        return z
    return reference_mask(z, z if inv_t is None else z * inv_t, support, rows, tgt, col_offset)


def _rows_of(inv_t: Optional[torch.Tensor], rows, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """inv_t [N] -> the chunk's [c, 1] in `dtype`; None (temperature 1) stays None."""
    return None if inv_t is None else inv_t[rows, None].to(dtype)


def _gather_index(targets: torch.Tensor, vocab: int) -> torch.Tensor:
    """targets as gather / scatter indices (int64): in [0, vocab), else 0. Ignored rows
    read column 0, as do targets outside [0, vocab) that validate=False lets through
    (the op turns their log-prob into NaN: _utils.nan_where_out_of_range)."""
    inside = (targets >= 0) & (targets < vocab)
    return torch.where(inside, targets, torch.zeros_like(targets)).long()


def _rows_forward(
    z: torch.Tensor, inv_t: torch.Tensor, tgt: torch.Tensor, valid: torch.Tensor, want_entropy: bool
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """z [c, V] logits (compute dtype, read only), inv_t [c, 1] inverse temperatures ->
    logp [c], entropy [c] or None.

    The entropy is -sum p log p, a sum of non-negative terms. Rows with valid == False
    get logp = 0 and entropy = 0.
    """
    log_p = torch.log_softmax(_scaled(z, inv_t), dim=-1)  # [c, V]
    logp = log_p.gather(1, tgt[:, None]).squeeze(1)
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    entropy = None
    if want_entropy:
        # -p log p is 0 * -inf = nan where a logit is -inf: those terms are 0 (and only
        # those: a NaN logit keeps its row's entropy NaN).
        plogp = torch.exp(log_p).mul_(log_p).masked_fill_(log_p == float("-inf"), 0.0)
        entropy = -plogp.sum(dim=-1)
        entropy = torch.where(valid, entropy, torch.zeros_like(entropy))
        del plogp
    return logp, entropy


def _rows_grad(
    z: torch.Tensor,
    inv_t: Optional[torch.Tensor],
    tgt: torch.Tensor,
    valid: Optional[torch.Tensor],
    entropy: Optional[torch.Tensor],
    g_logp: torch.Tensor,
    g_entropy: Optional[torch.Tensor],
    slope: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """dL/dz [c, V] of one chunk (z read only), recomputing the softmax exactly as the
    forward did; times `slope` (dz/draw of the soft cap, [c, V]) when given, so that the
    result is dL/draw (ignored rows stay 0 even where the slope is NaN).

    g_logp and g_entropy are already zero on ignored rows, whose gradient is 0 (also
    when all their logits are -inf). valid None: every row scores and has finite
    logits (the linear path), so no row needs masking. inv_t None: temperature 1.
    """
    s = _scaled(z, inv_t)
    p = torch.softmax(s, dim=-1)  # [c, V]
    if g_entropy is not None:
        # -g_logp p - g_H p (log p + H), the entropy's term apart, with p log p = 0 where p = 0:
        # g_H = 0 (compile's zero gradient of an entropy output the loss does not use) adds
        # an exact 0, so the gradient is the one without it, bit for bit
        term = torch.log_softmax(s, dim=-1).add_(entropy[:, None]).mul_(p).masked_fill_(p == 0, 0.0)
        grad = p.mul_(-g_logp[:, None]).sub_(term.mul_(g_entropy[:, None]))
        del term
    else:
        grad = p.mul_(-g_logp[:, None])  # -g_logp * p
    grad.scatter_add_(1, tgt[:, None], g_logp[:, None])
    if inv_t is not None:
        grad.mul_(inv_t)
    if slope is not None:
        grad.mul_(slope)
    if valid is not None:  # None: every row scores (the linear path compacts ignored rows away)
        grad.masked_fill_(~valid[:, None], 0.0)  # last: a NaN in an ignored row stays out
    return grad


def token_logprobs_forward(
    logits: torch.Tensor, targets: torch.Tensor, transform: LogitTransform, ignore_index: int, return_entropy: bool,
    support: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """logits [N, V] -> logp [N], entropy [N] or None (no autograd: the backward is
    token_logprobs_backward), over each row's support when given (support.py)."""
    with no_autocast(logits.device):
        n, vocab = logits.shape
        work_dtype = compute_dtype(logits.dtype)
        logp = torch.empty(n, dtype=work_dtype, device=logits.device)
        entropy = torch.empty(n, dtype=work_dtype, device=logits.device) if return_entropy else None
        valid = targets != ignore_index
        tgt = _gather_index(targets, vocab)
        inv_t = transform.reference_inv_t()
        step = chunk_rows_for(vocab)
        for a in range(0, n, step):
            b = min(n, a + step)
            z, _ = transform.cap(logits[a:b].to(work_dtype))  # [c, V]
            inv_t_rows = _rows_of(inv_t, slice(a, b), work_dtype)
            z = _supported(z, inv_t_rows, support, slice(a, b), tgt[a:b])
            logp[a:b], entropy_rows = _rows_forward(z, inv_t_rows, tgt[a:b], valid[a:b], return_entropy)
            if return_entropy:
                entropy[a:b] = entropy_rows
            del z
    return logp, entropy


def token_logprobs_backward(
    logits: torch.Tensor, targets: torch.Tensor, transform: LogitTransform, ignore_index: int,
    entropy: Optional[torch.Tensor], g_logp: Optional[torch.Tensor], g_entropy: Optional[torch.Tensor],
    out: Optional[torch.Tensor] = None, support: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """d(sum g_logp logp + g_entropy entropy) / d logits [N, V] in the logits' dtype,
    written into `out` when given (it may be the logits themselves: each chunk is
    computed in full before it is written). entropy and g_entropy: both or neither."""
    with no_autocast(logits.device):
        n, vocab = logits.shape
        work_dtype = compute_dtype(logits.dtype)
        valid = targets != ignore_index
        tgt = _gather_index(targets, vocab)
        zeros = torch.zeros(n, dtype=work_dtype, device=logits.device)
        g_logp = zeros if g_logp is None else torch.where(valid, g_logp.to(work_dtype), zeros)
        if g_entropy is not None:
            g_entropy = torch.where(valid, g_entropy.to(work_dtype), zeros)
        grad = torch.empty_like(logits) if out is None else out
        inv_t = transform.reference_inv_t()
        step = chunk_rows_for(vocab)
        for a in range(0, n, step):
            b = min(n, a + step)
            inv_t_rows = _rows_of(inv_t, slice(a, b), work_dtype)
            g_entropy_rows = g_entropy[a:b] if g_entropy is not None else None
            entropy_rows = entropy[a:b] if g_entropy is not None else None
            z, slope = transform.cap(logits[a:b].to(work_dtype))
            z = _supported(z, inv_t_rows, support, slice(a, b), tgt[a:b])
            g = _rows_grad(z, inv_t_rows, tgt[a:b], valid[a:b], entropy_rows, g_logp[a:b], g_entropy_rows, slope)
            grad[a:b] = g
            del z, g, slope
    return grad


def linear_token_logprobs_forward(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
    transform: LogitTransform, ignore_index: int, return_entropy: bool, support: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """hidden [N, D], weight [V, D] -> logp [N], entropy [N] or None (no autograd: the
    backward is linear_token_logprobs_backward), over each row's support when given
    (support.py). Ignored rows are skipped and return 0."""
    with no_autocast(hidden.device):
        n = hidden.shape[0]
        vocab = weight.shape[0]
        work_dtype = compute_dtype(hidden.dtype)
        logp = torch.zeros(n, dtype=work_dtype, device=hidden.device)
        entropy = torch.zeros(n, dtype=work_dtype, device=hidden.device) if return_entropy else None
        # Ignored rows are compacted away: they cost nothing.
        rows = (targets != ignore_index).nonzero().squeeze(1)
        tgt = _gather_index(targets[rows], vocab)
        inv_t = transform.reference_inv_t()
        step = chunk_rows_for(vocab, LINEAR_CHUNK_ELEMENTS)  # module globals, read per call
        w = weight.to(work_dtype)
        bias_work = bias.to(work_dtype) if bias is not None else None
        for a in range(0, rows.numel(), step):
            r = rows[a : a + step]
            raw = hidden[r].to(work_dtype) @ w.T  # [c, V]
            if bias_work is not None:
                raw += bias_work
            z, _ = transform.cap(raw)
            ones = torch.ones(r.numel(), dtype=torch.bool, device=hidden.device)
            inv_t_rows = _rows_of(inv_t, r, work_dtype)
            z = _supported(z, inv_t_rows, support, r, tgt[a : a + step])
            logp[r], entropy_rows = _rows_forward(z, inv_t_rows, tgt[a : a + step], ones, return_entropy)
            if return_entropy:
                entropy[r] = entropy_rows
            del z, raw
    return logp, entropy


def linear_token_logprobs_backward(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
    transform: LogitTransform, ignore_index: int, entropy: Optional[torch.Tensor], g_logp: Optional[torch.Tensor],
    g_entropy: Optional[torch.Tensor], support: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(d_hidden, d_weight, d_bias or None) of sum g_logp logp + g_entropy entropy, in the
    inputs' dtypes, over each row's support when given. entropy and g_entropy: both or neither."""
    with no_autocast(hidden.device):
        vocab = weight.shape[0]
        work_dtype = compute_dtype(hidden.dtype)
        rows = (targets != ignore_index).nonzero().squeeze(1)
        tgt = _gather_index(targets[rows], vocab)
        inv_t = transform.reference_inv_t()
        step = chunk_rows_for(vocab, LINEAR_CHUNK_ELEMENTS)
        w = weight.to(work_dtype)
        bias_work = bias.to(work_dtype) if bias is not None else None
        d_hidden = torch.zeros_like(hidden)
        d_weight = torch.zeros_like(w)
        d_bias = torch.zeros(vocab, dtype=work_dtype, device=weight.device) if bias is not None else None
        if g_logp is None:
            g_logp = torch.zeros(hidden.shape[0], dtype=work_dtype, device=hidden.device)
        for a in range(0, rows.numel(), step):
            r = rows[a : a + step]
            x = hidden[r].to(work_dtype)
            raw = x @ w.T
            if bias_work is not None:
                raw += bias_work
            z, slope = transform.cap(raw)
            inv_t_rows = _rows_of(inv_t, r, work_dtype)
            z = _supported(z, inv_t_rows, support, r, tgt[a : a + step])
            g_entropy_rows = g_entropy[r].to(work_dtype) if g_entropy is not None else None
            entropy_rows = entropy[r] if g_entropy is not None else None
            g = _rows_grad(z, inv_t_rows, tgt[a : a + step], None, entropy_rows, g_logp[r].to(work_dtype),
                           g_entropy_rows, slope)  # dL/draw [c, V]
            d_hidden[r] = (g @ w).to(hidden.dtype)
            d_weight.addmm_(g.T, x)
            if d_bias is not None:
                d_bias += g.sum(0)
            del z, raw, g, slope
    return d_hidden, d_weight.to(weight.dtype), d_bias.to(bias.dtype) if d_bias is not None else None


def segment_sum(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """values [N], cu_seqlens [S + 1] -> [S], out[s] = sum(values[cu[s]:cu[s+1]]).

    Accumulates in fp32 (fp64 for fp64 values) and casts once to values' dtype. Empty
    segments give 0; values outside every segment are left out. No value is read on
    the host (no device sync). Differentiable; the backward is a gather.
    """
    with no_autocast(values.device):
        n_seg = cu_seqlens.numel() - 1
        idx = torch.arange(values.shape[0], dtype=cu_seqlens.dtype, device=values.device)
        # seg[i] = the first s with cu[s + 1] > i; i is in segment s when also cu[0] <= i.
        seg = torch.searchsorted(cu_seqlens[1:].contiguous(), idx, right=True)
        inside = (idx >= cu_seqlens[0]) & (seg < n_seg)
        seg = torch.where(inside, seg, torch.full_like(seg, n_seg))  # outside -> a bucket dropped below
        out = torch.zeros(n_seg + 1, dtype=compute_dtype(values.dtype), device=values.device)
        out = out.index_add(0, seg, values.to(out.dtype))
        return out[:n_seg].to(values.dtype)


# k3(d) = exp(d) - d - 1 loses its digits to cancellation at small |d| (k3 ~ d^2 / 2): below
# K3_SERIES_BOUND it is summed as a series, d^2 / 2 (1 + d/3 (1 + d/4 (... (1 + d/n)))), with
# n terms enough for the dtype (the first term left out is under its rounding at |d| = 2);
# above it, exp(d) - 1 - d cancels by a factor of 2.5 at most. The Triton kernel
# (weighted_k3.py: _k3) evaluates the same fp32 form.
K3_SERIES_BOUND = 2.0
K3_SERIES_TERMS = {torch.float32: 15, torch.float64: 24}


def k3(delta: torch.Tensor) -> torch.Tensor:
    """k3(delta) = exp(delta) - delta - 1, accurate to the rounding of delta's dtype (fp32 or
    fp64) at every delta, small |delta| included; differentiable (d k3 / d delta = expm1)."""
    small = delta.abs() < K3_SERIES_BOUND
    d = torch.where(small, delta, torch.zeros_like(delta))  # the series only where it is taken (finite gradients)
    q = torch.ones_like(d)
    for k in range(K3_SERIES_TERMS.get(delta.dtype, 15), 2, -1):
        q = 1.0 + q * (d * (1.0 / k))
    series = 0.5 * d * d * q
    far = torch.where(small, torch.zeros_like(delta), delta)
    return torch.where(small, series, (torch.exp(far) - 1.0) - far)


def k3_guarded(delta: torch.Tensor, guard: float = 10.0) -> torch.Tensor:
    """k3(delta) (accurate at every delta, see k3), continued linearly above `guard`.

    For delta > c: k3(c) + (exp(c) - 1) (delta - c): convex, C1, gradient bounded by
    exp(c) - 1, and never a zero-gradient clamp.
    """
    c = float(guard)
    # keeps exp finite in the branch that is not taken; a where, not a clamp, so that a
    # NaN delta keeps a NaN gradient (a clamp's gradient is 0 there)
    below = torch.where(delta > c, torch.full_like(delta, c), delta)
    at_c = torch.tensor(c, dtype=delta.dtype, device=delta.device)
    linear = k3(at_c) + torch.expm1(at_c) * (delta - c)
    return torch.where(delta > c, linear, k3(below))


def weighted_k3(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    *,
    guard: float = 10.0,
) -> torch.Tensor:
    """sum_q w(q) k3(ref_logp - logp) / sum_q w(q), a scalar; w = 1 when weight is None.

    Computed in fp32 (fp64 for fp64 inputs) and returned in that dtype. An empty batch,
    or weights summing to 0, gives 0 with zero gradients (never 0/0).
    """
    with no_autocast(logp.device):
        work_dtype = compute_dtype(logp.dtype)
        k3 = k3_guarded(ref_logp.to(work_dtype) - logp.to(work_dtype), guard)
        w = torch.ones_like(k3) if weight is None else weight.to(work_dtype)
        total = w.sum()
        safe = torch.where(total == 0, torch.ones_like(total), total)
        return torch.where(total == 0, torch.zeros_like(total), (w * k3).sum() / safe)
