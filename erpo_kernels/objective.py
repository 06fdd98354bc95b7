"""The ERPO and GRPO objectives of docs/method.md sections 2-5 as single calls.

One packed batch of B = sum_q G_q sequences (`prompt_b | response_b`, N rows in all)
goes in; a scalar loss and python-float metrics come out:

    erpo_loss(hidden, weight, batch, config)   hidden states + lm_head weight
    erpo_loss_from_logp(logp, batch, config)   per-row log-probs already computed

    erpo:  L = L_PG(w_B) + alpha R_query,   R_query = weighted_k3(query_logp, ref_query_logp, query_weights)
    grpo:  L = L_PG(w = 1) + beta * KL,   KL = k3(ref_logp - logp) per response token,
           aggregated with the same loss_agg as L_PG (DeepSeekMath eq. 3: token-mean, or
           (1/m) sum_q (1/G_q) sum_i (1/L_i) sum_t k3 under seq-mean-token-mean)

The pieces are the public ops (segment_sum, weighted_k3, linear_token_logprobs,
policy_loss), run with the caller's `backend`. Row layout: see PackedLossBatch.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, fields
from typing import Dict, Optional, Tuple

import torch

from ._utils import FLOAT_DTYPES, INDEX_DTYPES, check_cu_seqlens, check_rows, check_tensor, compute_dtype
from .linear_token_logprobs import linear_token_logprobs
from .policy_loss import _policy_loss, aggregation_coef, check_clip_args, check_loss_agg
from .segment_sum import segment_sum
from .weighted_k3 import MAX_GUARD, weighted_k3

ALGORITHMS = ("erpo", "grpo")


@dataclass
class PackedLossBatch:
    """The packed batch's metadata (one row = one position of one sequence).

    Sequence b is `prompt_b | response_b` at rows [r, r + T + L); row t scores token
    t + 1 of its own sequence. Its prompt span is rows [r, r + T - 1) (temperature 1;
    ignore_index on every copy but the one that scores the query's prompt, usually the
    first of its group), its response span rows [r + T - 1, r + T + L) (1 / tau; the
    last row, and any padding, ignore_index).

    Fields:
        targets: [N] int, next token of each row, or ignore_index.
        inv_temperature: [N] float, 1 on prompt rows, 1 / tau on response rows.
        span_cu_seqlens: [2B + 1] int, boundaries of prompt_0, response_0, prompt_1,
            ..., starting at 0 and ending at N.
        group_index: [B] int in [0, m), the query of each sequence; every query has one.
        advantages: [B] float, group-normalised advantage of each sequence.
        ref_query_logp: [m] float, l_0(q) from the reference cache.
        query_weights: [m] float >= 0, w_B(q) (ones when weighting is off; grpo ignores it).
        old_logp: [N] float or None (None = the detached current logp).
        ref_logp: [N] float or None, reference-model per-token log-probs (grpo's beta
            term and the policy_kl metric).
        ignore_index: the target value of rows that score nothing.
    """

    targets: torch.Tensor
    inv_temperature: torch.Tensor
    span_cu_seqlens: torch.Tensor
    group_index: torch.Tensor
    advantages: torch.Tensor
    ref_query_logp: torch.Tensor
    query_weights: torch.Tensor
    old_logp: Optional[torch.Tensor] = None
    ref_logp: Optional[torch.Tensor] = None
    ignore_index: int = -100

    @property
    def num_sequences(self) -> int:
        """B."""
        return int(self.group_index.shape[0])

    @property
    def num_queries(self) -> int:
        """m."""
        return int(self.query_weights.shape[0])

    def to(self, device: torch.device | str) -> "PackedLossBatch":
        """A copy with every tensor moved to `device`."""
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            moved[f.name] = v.to(device) if isinstance(v, torch.Tensor) else v
        return PackedLossBatch(**moved)


@dataclass
class LossConfig:
    """Hyper-parameters of the objective (docs/method.md sections 2, 4, 5).

    algorithm: "erpo" (L_PG(w_B) + alpha R_query) or "grpo" (L_PG(w = 1) + beta KL,
        KL the per-token k3 on response tokens aggregated with loss_agg). alpha:
        Query-KL coefficient (erpo).
    beta: per-token KL coefficient (grpo); 0 drops the term and needs no ref_logp.
    loss_agg: "token-mean" or "seq-mean-token-mean". eps_low, eps_high, dual_clip: the
        clip range and the dual-clip constant c. kl_guard: the linear guard c of the K3
        estimator (also applied to grpo's per-token k3; it changes nothing for
        |ref_logp - logp| <= kl_guard).
    """

    algorithm: str = "erpo"
    alpha: float = 0.01
    beta: float = 0.01
    loss_agg: str = "token-mean"
    eps_low: float = 0.2
    eps_high: float = 0.3
    dual_clip: float = 3.0
    kl_guard: float = 10.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError naming the field that is out of range."""
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        check_loss_agg(self.loss_agg)
        for name in ("alpha", "beta"):
            v = float(getattr(self, name))
            if not (0.0 <= v < float("inf")):
                raise ValueError(f"{name} must be finite and >= 0, got {v}")
        check_clip_args(self.eps_low, self.eps_high, self.dual_clip)
        if not (0.0 < float(self.kl_guard) <= MAX_GUARD):
            raise ValueError(
                f"kl_guard must lie in (0, {MAX_GUARD:g}] (exp(kl_guard) must fit in fp32), got {self.kl_guard}"
            )


def check_batch(batch: PackedLossBatch, n_rows: int, device: torch.device) -> None:
    """ValueError naming the first field of `batch` that does not fit N = n_rows rows."""
    if not isinstance(batch, PackedLossBatch):
        raise ValueError(f"batch must be a PackedLossBatch, got {type(batch).__name__}")
    if isinstance(batch.ignore_index, bool) or not isinstance(batch.ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {batch.ignore_index!r}")
    check_tensor("targets", batch.targets, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_rows("targets", batch.targets, n_rows)
    check_tensor("inv_temperature", batch.inv_temperature, ndim=1, dtypes=FLOAT_DTYPES, device=device)
    check_rows("inv_temperature", batch.inv_temperature, n_rows)
    check_tensor("group_index", batch.group_index, ndim=1, dtypes=INDEX_DTYPES, device=device)
    n_seq = batch.group_index.shape[0]
    if n_seq < 1:
        raise ValueError("group_index must hold at least one sequence (B >= 1)")
    cu = check_cu_seqlens(batch.span_cu_seqlens, n_rows, device, name="span_cu_seqlens")
    if cu.shape[0] != 2 * n_seq + 1:
        raise ValueError(
            f"span_cu_seqlens must hold 2B + 1 = {2 * n_seq + 1} offsets (B = {n_seq} sequences), got {cu.shape[0]}"
        )
    if int(cu[0]) != 0 or int(cu[-1]) != n_rows:
        raise ValueError(f"span_cu_seqlens must start at 0 and end at N = {n_rows}")
    check_tensor("advantages", batch.advantages, ndim=1, dtypes=FLOAT_DTYPES, device=device)
    check_rows("advantages", batch.advantages, n_seq)
    if not bool(torch.isfinite(batch.advantages).all()):
        raise ValueError("advantages must be finite")
    check_tensor("query_weights", batch.query_weights, ndim=1, dtypes=FLOAT_DTYPES, device=device)
    m = batch.query_weights.shape[0]
    check_tensor("ref_query_logp", batch.ref_query_logp, ndim=1, dtypes=FLOAT_DTYPES, device=device)
    if batch.ref_query_logp.shape[0] != m:
        raise ValueError(f"ref_query_logp has {batch.ref_query_logp.shape[0]} entries but query_weights has m = {m}")
    if not bool(torch.isfinite(batch.ref_query_logp).all()):
        raise ValueError("ref_query_logp must be finite")
    w = batch.query_weights
    if not bool((torch.isfinite(w) & (w >= 0)).all()) or not float(w.sum()) > 0:
        raise ValueError("query_weights must be finite, >= 0, with a positive sum")
    gi = batch.group_index
    if int(gi.min()) < 0 or int(gi.max()) >= m:
        raise ValueError(f"group_index must lie in [0, m) with m = {m} (the length of query_weights)")
    if bool((torch.bincount(gi.long(), minlength=m) == 0).any()):
        raise ValueError("group_index must give every query in [0, m) at least one sequence")
    for name in ("old_logp", "ref_logp"):
        t = getattr(batch, name)
        if t is not None:
            check_tensor(name, t, ndim=1, dtypes=FLOAT_DTYPES, device=device)
            check_rows(name, t, n_rows)


class _Layout:
    """Row bookkeeping of a checked batch (integer work only, no gradients).

    span_id [N] (2b = prompt of b, 2b + 1 = response of b), valid [N] (row scores a
    token), counts [2B] (scored rows per span), resp_rows [T] (indices of the scored
    response rows, in order), resp_len [B] (L_b).
    """

    def __init__(self, batch: PackedLossBatch, n_rows: int) -> None:
        dev = batch.targets.device
        cu = batch.span_cu_seqlens.long()
        n_spans = cu.shape[0] - 1
        self.span_id = torch.repeat_interleave(torch.arange(n_spans, device=dev), cu[1:] - cu[:-1], output_size=n_rows)
        self.valid = batch.targets != batch.ignore_index
        self.counts = torch.zeros(n_spans, dtype=torch.long, device=dev).index_add_(0, self.span_id, self.valid.long())
        self.prompt_scored = self.counts[0::2] > 0  # [B]
        self.resp_len = self.counts[1::2]  # [B]
        self.resp_rows = ((self.span_id % 2 == 1) & self.valid).nonzero().squeeze(1)  # [T]


def _query_logp(
    logp: torch.Tensor, batch: PackedLossBatch, layout: _Layout, backend: str
) -> torch.Tensor:
    """[m] l_theta(q): segment_sum over the spans, prompt sums averaged per query over
    the copies that scored the prompt (so once per group == every copy)."""
    span_sums = segment_sum(logp, batch.span_cu_seqlens, backend=backend)  # [2B]
    prompt_sums = span_sums[0::2]  # [B]
    m = batch.num_queries
    gi = batch.group_index.long()
    scored = layout.prompt_scored.to(prompt_sums.dtype)  # [B]
    total = torch.zeros(m, dtype=prompt_sums.dtype, device=logp.device).index_add(0, gi, prompt_sums * scored)
    copies = torch.zeros(m, dtype=prompt_sums.dtype, device=logp.device).index_add_(0, gi, scored)
    return total / copies.clamp(min=1)


def query_logp_from_logp(logp: torch.Tensor, batch: PackedLossBatch, *, backend: str = "auto") -> torch.Tensor:
    """query_logp l_theta(q) [m] from per-row log-probs.

    logp [N] float (differentiable). Each sequence's prompt span is summed
    (segment_sum); a query's value is the mean over its copies whose prompt span
    scores at least one token. When the prompt is scored once per group this is that
    copy's sum; when every copy scores it, the mean of G equal sums. A query no copy
    scores (a one-token prompt without BOS) gets 0. Response rows get zero gradient.
    """
    check_tensor("logp", logp, ndim=1, dtypes=FLOAT_DTYPES)
    check_batch(batch, logp.shape[0], logp.device)
    layout = _Layout(batch, logp.shape[0])
    lp = torch.where(layout.valid, logp, torch.zeros_like(logp))
    return _query_logp(lp, batch, layout, backend)


def _check_inputs(batch: PackedLossBatch, config: LossConfig, n_rows: int, device: torch.device) -> None:
    """Every check of the objective's inputs, before any kernel runs."""
    if not isinstance(config, LossConfig):
        raise ValueError(f"config must be a LossConfig, got {type(config).__name__}")
    config.validate()
    check_batch(batch, n_rows, device)
    if config.algorithm == "grpo" and config.beta > 0 and batch.ref_logp is None:
        raise ValueError("ref_logp is required for algorithm='grpo' with beta > 0 (set beta = 0 to drop the KL term)")


def _weights_metrics(w: torch.Tensor) -> Dict[str, torch.Tensor]:
    """weights/ess = (sum w)^2 / (m sum w^2), weights/min, weights/max."""
    return {
        "weights/ess": w.sum() ** 2 / (w.numel() * (w * w).sum()),
        "weights/min": w.min(),
        "weights/max": w.max(),
    }


def erpo_loss_from_logp(
    logp: torch.Tensor,
    batch: PackedLossBatch,
    config: LossConfig = LossConfig(),
    *,
    entropy: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The ERPO (or GRPO) loss of a packed batch from its per-row log-probs.

    Args:
        logp: [N] float, log pi(target) of each row (prompt rows at temperature 1,
            response rows at 1 / tau); differentiable. Rows whose target is
            ignore_index are ignored (their value does not matter, their gradient is 0).
        batch: the packed batch (PackedLossBatch).
        config: LossConfig.
        entropy: [N] float or None, per-row entropy for the "entropy/mean" metric only.
        backend: "auto", "triton" or "torch", for segment_sum and weighted_k3.
    Returns:
        (scalar loss, metrics): "loss", "pg/loss", "pg/clipfrac", "pg/dual_clipfrac",
        "pg/ratio_mean", "qkl/value" (unweighted mean k3), "qkl/delta_mean",
        "qkl/guarded_frac", "qkl/loss" (R_query with the algorithm's weights: w_B for
        erpo, ones for grpo where it is monitored, not optimised), "weights/ess",
        "weights/min", "weights/max" (of the weights L_PG uses), "response_length/mean",
        "entropy/mean" (response tokens, when entropy is given), "policy_kl" (k3 on response
        tokens aggregated with loss_agg at w = 1, grpo's KL term; when ref_logp is given), "query_logp/mean".
    """
    check_tensor("logp", logp, ndim=1, dtypes=FLOAT_DTYPES)
    _check_inputs(batch, config, logp.shape[0], logp.device)
    return _loss_from_logp(logp, batch, config, entropy, backend)


def _loss_from_logp(
    logp: torch.Tensor,
    batch: PackedLossBatch,
    config: LossConfig,
    entropy: Optional[torch.Tensor],
    backend: str,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """erpo_loss_from_logp on a batch already checked against logp."""
    n_rows = logp.shape[0]
    dev = logp.device
    if entropy is not None:
        check_tensor("entropy", entropy, ndim=1, dtypes=FLOAT_DTYPES, device=dev)
        check_rows("entropy", entropy, n_rows)
    is_erpo = config.algorithm == "erpo"

    cdt = compute_dtype(logp.dtype)
    layout = _Layout(batch, n_rows)
    lp = torch.where(layout.valid, logp, torch.zeros_like(logp)).to(cdt)  # [N]
    guard = float(config.kl_guard)
    ref_q = batch.ref_query_logp.detach().to(cdt)  # [m]
    m = batch.num_queries
    if is_erpo:
        weights = batch.query_weights.detach().to(cdt)  # [m] w_B
    else:
        weights = torch.ones(m, dtype=cdt, device=dev)

    # Query-KL (section 2): only the prompt spans reach it.
    query_logp = _query_logp(lp, batch, layout, backend)  # [m]
    with nullcontext() if (is_erpo and config.alpha > 0) else torch.no_grad():
        r_query = weighted_k3(query_logp, ref_q, weights, guard=guard, backend=backend)  # scalar

    # Policy gradient (section 4): only the scored response rows reach it.
    rows = layout.resp_rows  # [T]
    resp_logp = lp[rows]  # [T]
    old = batch.old_logp.detach().to(cdt)[rows] if batch.old_logp is not None else resp_logp.detach()
    pg_loss, metrics = _policy_loss(
        resp_logp, old, batch.advantages, layout.resp_len, batch.group_index, weights,
        config.loss_agg, float(config.eps_low), float(config.eps_high), float(config.dual_clip),
    )

    loss = pg_loss
    if is_erpo and config.alpha > 0:
        loss = loss + config.alpha * r_query
    n_tok = rows.shape[0]
    if batch.ref_logp is not None and n_tok > 0:
        ref_resp = batch.ref_logp.detach().to(cdt)[rows]  # [T]
        use_kl = (not is_erpo) and config.beta > 0
        # KL = sum_t c_t k3_t with the policy loss's aggregation at w = 1 (section 5):
        # token-mean c_t = 1 / T, seq-mean-token-mean c_t = 1 / (m G_q L_i).
        coef = aggregation_coef(layout.resp_len, batch.group_index, torch.ones(m, dtype=cdt, device=dev),
                                config.loss_agg)  # [T]
        coef_mass = coef.sum()  # 1 unless some response is empty (seq-mean-token-mean)
        with nullcontext() if use_kl else torch.no_grad():
            policy_kl = coef_mass * weighted_k3(resp_logp, ref_resp, coef, guard=guard, backend=backend)
        if use_kl:
            loss = loss + config.beta * policy_kl
        metrics["policy_kl"] = policy_kl.detach()
    elif batch.ref_logp is not None:
        metrics["policy_kl"] = torch.zeros((), dtype=cdt, device=dev)

    with torch.no_grad():
        delta = ref_q - query_logp.detach()  # [m]
        metrics["qkl/value"] = weighted_k3(query_logp.detach(), ref_q, None, guard=guard, backend=backend)
        metrics["qkl/delta_mean"] = delta.mean()
        metrics["qkl/guarded_frac"] = (delta > guard).to(cdt).mean()
        metrics["qkl/loss"] = r_query.detach()
        metrics["query_logp/mean"] = query_logp.detach().mean()
        metrics.update(_weights_metrics(weights))
        metrics["response_length/mean"] = layout.resp_len.to(cdt).mean()
        if entropy is not None:
            ent = entropy.detach().to(cdt)[rows]
            metrics["entropy/mean"] = ent.mean() if n_tok else torch.zeros((), dtype=cdt, device=dev)
        metrics["loss"] = loss.detach()
    values = torch.stack([v.to(cdt) for v in metrics.values()]).tolist()  # one host sync
    return loss, dict(zip(metrics.keys(), values))


def erpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    batch: PackedLossBatch,
    config: LossConfig = LossConfig(),
    *,
    bias: Optional[torch.Tensor] = None,
    backend: str = "auto",
    with_entropy: bool = True,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The ERPO (or GRPO) loss straight from final hidden states and the lm_head weight.

    hidden [N, D] (the packed rows), weight [V, D], bias [V] or None. Runs
    linear_token_logprobs (per-row inverse temperature from the batch, never
    materialising [N, V]; with the entropy for the "entropy/mean" metric unless
    with_entropy is False) and then erpo_loss_from_logp. Gradients flow to hidden,
    weight and bias. Returns (scalar loss, metrics) as erpo_loss_from_logp.
    """
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    _check_inputs(batch, config, hidden.shape[0], hidden.device)
    out = linear_token_logprobs(
        hidden, weight, batch.targets, bias=bias, inv_temperature=batch.inv_temperature,
        ignore_index=batch.ignore_index, return_entropy=with_entropy, backend=backend,
    )
    logp, entropy = out if with_entropy else (out, None)
    return _loss_from_logp(logp, batch, config, entropy, backend)
