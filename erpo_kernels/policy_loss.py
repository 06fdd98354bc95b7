"""policy_loss: the clipped policy-gradient surrogate of GRPO and its per-query
aggregation (docs/method.md section 4).

Plain PyTorch: every step is O(tokens) elementwise work plus a few gathers, so there
is nothing to fuse until a measurement says otherwise.

Per response token t of sequence i answering query q, with advantage A = A_i:
    rho  = exp(clamp(logp - old_logp, -20, 20))
    loss = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)
    loss = min(loss, -c A)                 (dual clip, only where A < 0)
Aggregation with per-query weights w(q):
    token-mean:           L = sum_q w(q) sum_i sum_t loss / sum_q sum_i L_i
    seq-mean-token-mean:  L = (1/m) sum_q w(q) (1/G_q) sum_i (1/L_i) sum_t loss
where L_i is the number of tokens of response i and G_q the number of sequences of
query q in the batch (a response with no token adds 0 but still counts in G_q).
Both are a weighted token sum sum_t coef_t loss_t, which is how they are computed.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ._utils import FLOAT_DTYPES, INDEX_DTYPES, check_rows, check_tensor, compute_dtype

LOSS_AGGS = ("token-mean", "seq-mean-token-mean")
LOG_RATIO_CLAMP = 20.0


def check_clip_args(eps_low: float, eps_high: float, dual_clip: float) -> None:
    """ValueError unless 0 <= eps_low < 1, eps_high >= 0 and dual_clip > 1 (all finite)."""
    if not (0.0 <= float(eps_low) < 1.0):
        raise ValueError(f"eps_low must lie in [0, 1), got {eps_low}")
    if not (0.0 <= float(eps_high) < float("inf")):
        raise ValueError(f"eps_high must be finite and >= 0, got {eps_high}")
    if not (1.0 < float(dual_clip) < float("inf")):
        raise ValueError(f"dual_clip must be finite and > 1, got {dual_clip}")


def check_loss_agg(loss_agg: str) -> None:
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")


def token_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped, dual-clipped surrogate loss (module docstring), elementwise.

    logp [T] (differentiable), old_logp [T], advantages [T] (one per token), same dtype.
    Returns (loss [T], clipped [T] bool: a clip binds, dual [T] bool: the dual clip
    binds, ratio [T] detached). No reduction, no host sync.
    """
    adv = advantages.detach()
    log_ratio = torch.clamp(logp - old_logp.detach(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = torch.maximum(unclipped, clipped)  # -min(rho A, clip(rho) A)
    dual_bound = -dual_clip * adv
    dual_active = (adv < 0) & (loss > dual_bound)
    loss = torch.where(dual_active, dual_bound, loss)
    return loss, (clipped > unclipped) | dual_active, dual_active, ratio.detach()


def aggregation_coef(
    lengths: torch.Tensor,
    group_index: torch.Tensor,
    query_weights: torch.Tensor,
    loss_agg: str,
    *,
    seq: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """[T] coefficient c_t of each response token, so that an aggregate is sum_t c_t x_t.

    lengths [B] int64 (L_i, sum = T); group_index [B]; query_weights [m] (w(q)).
        token-mean:           c_t = w(q) / T
        seq-mean-token-mean:  c_t = w(q) / (m G_q L_i)
    seq: [T] sequence of each token (recomputed from lengths when None).
    """
    n_tok = int(lengths.sum()) if seq is None else seq.shape[0]
    if seq is None:
        seq = torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), lengths, output_size=n_tok)
    gi = group_index.long()
    w = query_weights
    if loss_agg == "token-mean":
        return w[gi[seq]] / max(n_tok, 1)
    m = w.shape[0]
    g_count = torch.zeros(m, dtype=w.dtype, device=w.device).index_add_(0, gi, torch.ones_like(gi, dtype=w.dtype))
    per_seq = w[gi] / (m * g_count[gi] * lengths.clamp(min=1).to(w.dtype))  # [B]
    return per_seq[seq]


def _policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    lengths: torch.Tensor,
    group_index: torch.Tensor,
    query_weights: torch.Tensor,
    loss_agg: str,
    eps_low: float,
    eps_high: float,
    dual_clip: float,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The surrogate on checked inputs; metrics stay tensors (one host sync later).

    logp, old_logp [T]; advantages [B]; lengths [B] int64 (sum = T); group_index [B];
    query_weights [m]. Returns the scalar loss in the compute dtype and 0-d metrics.
    """
    cdt = compute_dtype(logp.dtype)
    n_tok = logp.shape[0]
    n_seq = lengths.shape[0]
    dev = logp.device
    seq = torch.repeat_interleave(torch.arange(n_seq, device=dev), lengths, output_size=n_tok)  # [T]
    adv = advantages.detach().to(cdt)[seq]  # [T]
    w = query_weights.detach().to(cdt)  # [m]

    tok_loss, clipped_tok, dual_active, ratio = token_surrogate(
        logp.to(cdt), old_logp.to(cdt), adv, eps_low, eps_high, dual_clip
    )  # [T] each
    coef = aggregation_coef(lengths, group_index, w, loss_agg, seq=seq)  # [T]
    loss = (coef * tok_loss).sum()

    zero = torch.zeros((), dtype=cdt, device=dev)
    metrics = {
        "pg/loss": loss.detach(),
        "pg/clipfrac": clipped_tok.to(cdt).mean() if n_tok else zero,
        "pg/dual_clipfrac": dual_active.to(cdt).mean() if n_tok else zero,
        "pg/ratio_mean": ratio.detach().mean() if n_tok else zero,
    }
    return loss, metrics


def policy_loss(
    logp: torch.Tensor,
    old_logp: Optional[torch.Tensor],
    advantages: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group_index: torch.Tensor,
    query_weights: torch.Tensor,
    *,
    loss_agg: str = "token-mean",
    eps_low: float = 0.2,
    eps_high: float = 0.3,
    dual_clip: float = 3.0,
    validate: bool = True,
    sync_metrics: bool = True,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Clipped (and dual-clipped) surrogate, aggregated per query with weights w(q).

    Args:
        logp: [T] float, log-probs of the response tokens only, contiguous per response.
        old_logp: [T] float, rollout-policy log-probs of the same tokens; None means the
            detached logp (one update per rollout batch: rho = 1).
        advantages: [B] float, one per response.
        cu_seqlens: [B + 1] int, response i owns tokens [cu[i], cu[i + 1]); cu[0] = 0, cu[B] = T.
        group_index: [B] int in [0, m), the query each response answers.
        query_weights: [m] float, w(q) (ones for plain GRPO).
        loss_agg: "token-mean" or "seq-mean-token-mean" (module docstring).
        eps_low, eps_high: the asymmetric clip range [1 - eps_low, 1 + eps_high].
        dual_clip: c, the bound -c A on the loss of tokens with A < 0.
        validate: check the values of cu_seqlens (0 to T, non-decreasing) and
            group_index (in [0, m)): one host read (a device sync). Shapes, dtypes and
            devices are always checked.
        sync_metrics: python-float metrics (one transfer), or 0-d tensors (none).
    Returns:
        (scalar loss in logp's compute dtype, metrics) with metrics "pg/loss",
        "pg/clipfrac" (fraction of tokens where a clip binds), "pg/dual_clipfrac",
        "pg/ratio_mean". The gradient flows to logp only.
    """
    check_tensor("logp", logp, ndim=1, dtypes=FLOAT_DTYPES)
    n_tok = logp.shape[0]
    dev = logp.device
    if old_logp is None:
        old_logp = logp.detach()
    check_tensor("old_logp", old_logp, ndim=1, dtypes=FLOAT_DTYPES, device=dev)
    check_rows("old_logp", old_logp, n_tok)
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    n_seq = cu_seqlens.shape[0] - 1
    if n_seq < 0:
        raise ValueError("cu_seqlens must hold B + 1 offsets")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    check_tensor("advantages", advantages, ndim=1, dtypes=FLOAT_DTYPES, device=dev)
    check_rows("advantages", advantages, n_seq)
    check_tensor("group_index", group_index, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    check_rows("group_index", group_index, n_seq)
    check_tensor("query_weights", query_weights, ndim=1, dtypes=FLOAT_DTYPES, device=dev)
    m = query_weights.shape[0]
    if validate:  # every value check in one transfer
        gi = group_index.long()
        ok = torch.stack([
            (cu_seqlens[0] == 0) & (cu_seqlens[-1] == n_tok),
            (lengths >= 0).all(),
            ((gi >= 0) & (gi < m)).all(),
        ]).tolist()
        if not ok[0]:
            raise ValueError(f"cu_seqlens must start at 0 and end at T = {n_tok} (the length of logp)")
        if not ok[1]:
            raise ValueError("cu_seqlens must be non-decreasing")
        if not ok[2]:
            raise ValueError(f"group_index must lie in [0, m) with m = {m} (the length of query_weights)")
    check_loss_agg(loss_agg)
    check_clip_args(eps_low, eps_high, dual_clip)
    loss, metrics = _policy_loss(
        logp, old_logp, advantages, lengths, group_index, query_weights,
        loss_agg, float(eps_low), float(eps_high), float(dual_clip),
    )
    if not sync_metrics:
        return loss, metrics
    values = torch.stack(list(metrics.values())).tolist()  # the one transfer
    return loss, dict(zip(metrics.keys(), values))
