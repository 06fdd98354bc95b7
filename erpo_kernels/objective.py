"""The ERPO and GRPO objectives of docs/method.md sections 2-5 as single calls, with
micro-batches (section 10) and rollout importance sampling (section 11).

One packed batch of B = sum_q G_q sequences (`prompt_b | response_b`, N rows in all)
goes in; a scalar loss and metrics come out:

    erpo_loss(hidden, weight, batch, config)   hidden states + lm_head weight
    erpo_loss_from_logp(logp, batch, config)   per-row log-probs already computed

    erpo:  L = L_PG(w_B) + alpha R_query,   R_query = sum_q w(q) k3(l_0(q) - l_theta(q)) / sum_q w(q)
    grpo:  L = L_PG(w = 1) + beta * KL,   KL = k3(ref_logp - logp) per response token,
           aggregated with the same loss_agg as L_PG (DeepSeekMath eq. 3: token-mean, or
           (1/m) sum_q (1/G_q) sum_i (1/L_i) sum_t k3 under seq-mean-token-mean)

Micro-batches. A mini-batch (one optimizer step) may be split into k micro-batches of
whole sequences (a group may span micro-batches). Every normaliser of the loss is a
mini-batch quantity, held by `LossNormalizers` (computed once, `LossNormalizers.of(mini)`)
and passed to every micro-batch's call:

    norm = LossNormalizers.of(mini)                  # T, B, m, G_q, prompt copies, sum w, sum w^2
    for micro in split_batch(mini, plan_micro_batches(mini, max_rows)):
        hidden = forward(rows micro.rows of the mini-batch)          # [n_k, D]
        loss, metrics = erpo_loss(hidden, weight, micro.batch, config, normalizers=norm)
        loss.backward()                               # gradients accumulate
        parts.append(metrics)
    metrics = combine_metrics(parts)                   # the mini-batch's metrics

The k losses sum to the one-batch loss, and their gradients to its gradient, because
every term is linear in its micro-batch's tokens and queries once the denominators are
fixed: the loss is sum_t c_t loss_t + alpha sum_q a_q k3_q with c_t and a_q built from
the normalisers only. Without `normalizers` a call normalises by its own batch
(`LossNormalizers.of(batch)`): the one-batch case.

Host syncs. Shapes, dtypes and devices are checked on every call (free). Values
(targets in range, offsets monotone, finite advantages, ...) are checked by
`PackedLossBatch.validate()` in one transfer, once: where the batch is built (on the
CPU, then `validate=False`), or by the loss. With the defaults a call reads the device
once: the metrics' transfer, which carries the value checks too; `validate=True` checks
in a transfer of its own before any kernel, and `sync_metrics=False` keeps the metrics
on the device. Under torch.compile nothing is read back.

The pieces are the public ops (segment_sum, weighted_k3, linear_token_logprobs) and the
policy surrogate (policy_loss.token_surrogate), run with the caller's `backend`.
Row layout: see PackedLossBatch.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ._utils import FLOAT_DTYPES, INDEX_DTYPES, check_rows, check_tensor, checking_values, compute_dtype
from .linear_token_logprobs import linear_token_logprobs
from .policy_loss import check_clip_args, check_loss_agg, token_surrogate
from .segment_sum import segment_sum
from .weighted_k3 import MAX_GUARD, weighted_k3

ALGORITHMS = ("erpo", "grpo")
ROLLOUT_IS = ("none", "token", "sequence")
# The rollout/trainer mismatch metric counts tokens whose pi_old / pi_rollout lies outside this band.
MISMATCH_BAND = (0.9, 1.1)


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
        group_index: [B] int in [0, m), the query of each sequence. In a whole batch
            every query has a sequence; in a micro-batch (with LossNormalizers) the
            indices are the mini-batch's and a query may have none here.
        advantages: [B] float, group-normalised advantage of each sequence.
        ref_query_logp: [m] float, l_0(q) from the reference cache.
        query_weights: [m] float >= 0, w_B(q) (ones when weighting is off; grpo ignores it).
        old_logp: [N] float or None (None = the detached current logp).
        ref_logp: [N] float or None, reference-model per-token log-probs (grpo's beta
            term and the policy_kl metric).
        rollout_logp: [N] float or None, the rollout engine's log-prob of each response
            token at the sampling temperature (read on scored response rows only):
            the mismatch metrics, and the truncated importance weights of
            LossConfig.rollout_is.
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
    rollout_logp: Optional[torch.Tensor] = None

    @property
    def num_rows(self) -> int:
        """N."""
        return int(self.targets.shape[0])

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

    def check_structure(self, n_rows: Optional[int] = None, device: Optional[torch.device] = None) -> None:
        """Shapes, dtypes and devices of every field (tensor metadata only: no host sync).

        ValueError naming the first field that does not fit N = n_rows rows (default:
        len(targets)) on `device` (default: targets' device).
        """
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise ValueError(f"ignore_index must be an int, got {self.ignore_index!r}")
        if device is None:
            device = check_tensor("targets", self.targets, ndim=1, dtypes=INDEX_DTYPES).device
        n_rows = self.num_rows if n_rows is None else n_rows
        check_tensor("targets", self.targets, ndim=1, dtypes=INDEX_DTYPES, device=device)
        check_rows("targets", self.targets, n_rows)
        check_tensor("inv_temperature", self.inv_temperature, ndim=1, dtypes=FLOAT_DTYPES, device=device)
        check_rows("inv_temperature", self.inv_temperature, n_rows)
        check_tensor("group_index", self.group_index, ndim=1, dtypes=INDEX_DTYPES, device=device)
        n_seq = self.group_index.shape[0]
        if n_seq < 1:
            raise ValueError("group_index must hold at least one sequence (B >= 1)")
        check_tensor("span_cu_seqlens", self.span_cu_seqlens, ndim=1, dtypes=INDEX_DTYPES, device=device)
        if self.span_cu_seqlens.shape[0] != 2 * n_seq + 1:
            raise ValueError(
                f"span_cu_seqlens must hold 2B + 1 = {2 * n_seq + 1} offsets (B = {n_seq} sequences), "
                f"got {self.span_cu_seqlens.shape[0]}"
            )
        check_tensor("advantages", self.advantages, ndim=1, dtypes=FLOAT_DTYPES, device=device)
        check_rows("advantages", self.advantages, n_seq)
        check_tensor("query_weights", self.query_weights, ndim=1, dtypes=FLOAT_DTYPES, device=device)
        m = self.query_weights.shape[0]
        if m < 1:
            raise ValueError("query_weights must hold at least one query (m >= 1)")
        check_tensor("ref_query_logp", self.ref_query_logp, ndim=1, dtypes=FLOAT_DTYPES, device=device)
        if self.ref_query_logp.shape[0] != m:
            raise ValueError(f"ref_query_logp has {self.ref_query_logp.shape[0]} entries but query_weights has m = {m}")
        for name in ("old_logp", "ref_logp", "rollout_logp"):
            t = getattr(self, name)
            if t is not None:
                check_tensor(name, t, ndim=1, dtypes=FLOAT_DTYPES, device=device)
                check_rows(name, t, n_rows)

    def validate(
        self, vocab_size: Optional[int] = None, normalizers: Optional["LossNormalizers"] = None
    ) -> "PackedLossBatch":
        """Every check of the batch, values included, with one device-to-host transfer.

        Call it where the batch is built (on the CPU it costs nothing), then pass
        `validate=False` to the loss. vocab_size: V, to check targets < V (erpo_loss
        passes the lm_head's). normalizers: the LossNormalizers the batch will be used
        with; None = a whole batch, where every query must have a sequence. Raises
        ValueError naming the first bad field; returns self.
        """
        self.check_structure()
        if normalizers is not None:
            normalizers.check_structure(self.num_queries, self.targets.device)
        checks = self.value_checks(vocab_size, normalizers)
        raise_failed_check(checks, torch.stack([c.reshape(()) for _, c in checks]).tolist())  # the one transfer
        return self

    def value_checks(
        self, vocab_size: Optional[int] = None, normalizers: Optional["LossNormalizers"] = None
    ) -> List[Tuple[str, torch.Tensor]]:
        """validate()'s checks as (message, 0-d bool tensor) pairs on the batch's device,
        read nothing (structure already checked)."""
        n = self.num_rows
        m = self.num_queries
        cu = self.span_cu_seqlens.long()
        gi = self.group_index.long()
        w = self.query_weights
        t = self.targets
        checks: List[Tuple[str, torch.Tensor]] = []
        valid_t = t >= 0 if vocab_size is None else (t >= 0) & (t < int(vocab_size))
        what = "[0, V)" if vocab_size is None else f"[0, {int(vocab_size)})"
        checks.append((f"targets must lie in {what} or equal ignore_index={self.ignore_index}",
                       (valid_t | (t == self.ignore_index)).all()))
        checks.append(("inv_temperature must be positive and finite in every row",
                       ((self.inv_temperature > 0) & torch.isfinite(self.inv_temperature)).all()))
        checks.append((f"span_cu_seqlens must start at 0 and end at N = {n}", (cu[0] == 0) & (cu[-1] == n)))
        checks.append(("span_cu_seqlens must be non-decreasing", (cu[1:] >= cu[:-1]).all()))
        checks.append(("advantages must be finite", torch.isfinite(self.advantages).all()))
        checks.append(("ref_query_logp must be finite", torch.isfinite(self.ref_query_logp).all()))
        checks.append(("query_weights must be finite, >= 0, with a positive sum",
                       (torch.isfinite(w) & (w >= 0)).all() & (w.sum() > 0)))
        in_range = ((gi >= 0) & (gi < m)).all()
        checks.append((f"group_index must lie in [0, m) with m = {m} (the length of query_weights)", in_range))
        if normalizers is None:
            has_seq = torch.zeros(m, dtype=torch.long, device=gi.device).index_add_(
                0, gi.clamp(0, m - 1), torch.ones_like(gi)) > 0
            checks.append(("group_index must give every query in [0, m) at least one sequence",
                           has_seq.all() | ~in_range))
        else:
            checks.append(("normalizers must be those of a mini-batch holding this batch "
                           "(n_sequences >= 1, n_queries >= 1, weight_mass > 0, group_sizes >= 0)",
                           (normalizers.n_sequences >= 1) & (normalizers.n_queries >= 1)
                           & (normalizers.weight_mass > 0) & (normalizers.group_sizes >= 0).all()))
        if self.rollout_logp is not None:
            # response rows: odd spans (searchsorted is safe even when cu is not)
            span = torch.searchsorted(cu, torch.arange(n, device=cu.device), right=True) - 1
            resp = (span % 2 == 1) & (t != self.ignore_index)
            checks.append(("rollout_logp must be finite on every scored response row",
                           (torch.isfinite(self.rollout_logp) | ~resp).all()))
        return checks

    def made_safe(self, vocab_size: Optional[int] = None) -> "PackedLossBatch":
        """A copy whose indices cannot point outside their arrays, whatever their values:
        targets outside [0, vocab_size) become ignore_index, group_index is clamped to
        [0, m), span_cu_seqlens is made non-decreasing from 0 to N. The loss runs on it
        when the value checks travel with the metrics' transfer (erpo_loss's default):
        a bad batch then computes harmlessly and raises after, never indexes out of
        bounds on the device. Equal to the batch (the same values) when it is valid.
        No host read."""
        t, n, m = self.targets, self.num_rows, self.num_queries
        if vocab_size is not None:
            t = torch.where(((t >= 0) & (t < int(vocab_size))) | (t == self.ignore_index), t, self.ignore_index)
        cu = self.span_cu_seqlens
        inner = torch.cummax(cu[1:-1].clamp(0, n), dim=0).values
        ends = cu.new_tensor([0, n])
        return replace(
            self, targets=t, group_index=self.group_index.clamp(0, m - 1),
            span_cu_seqlens=torch.cat([ends[:1], inner, ends[1:]]),
        )


def raise_failed_check(checks: Sequence[Tuple[str, torch.Tensor]], ok: Sequence[bool]) -> None:
    """ValueError with the message of the first check whose read-back value is False."""
    for (message, _), good in zip(checks, ok):
        if not good:
            raise ValueError(message)


@dataclass
class LossNormalizers:
    """The mini-batch-wide denominators of the loss, shared by all its micro-batches.

    Every field is a tensor on the loss's device (int64 counts, float64 masses), so a
    call reads no value on the host. Build with `LossNormalizers.of(mini_batch)` (no
    host sync), from the whole mini-batch before it is split; pass the same object as
    `normalizers=` to erpo_loss / erpo_loss_from_logp for each micro-batch.

    Fields (the mini-batch's, with its query indexing: micro-batches keep group_index,
    ref_query_logp and query_weights of the mini-batch, see split_batch):
        n_tokens: 0-d int64, T = scored response tokens (token-mean's denominator).
        n_sequences: 0-d int64, B (response_length/mean).
        n_queries: 0-d int64, m (seq-mean-token-mean's 1/m, query metric means).
        group_sizes: [m] int64, G_q = sequences of query q (seq-mean-token-mean).
        prompt_copies: [m] int64, copies of q whose prompt span scores a token (1 when
            the prompt is scored once per group; R_query counts each query once).
        weight_mass: 0-d float64, sum_q w(q) (R_query's denominator; grpo uses m).
        weight_sq_mass: 0-d float64, sum_q w(q)^2 (the weights/ess metric).
    Data parallel: sum n_tokens, n_sequences, n_queries, weight_mass, weight_sq_mass over
    ranks (all_reduce); group_sizes and prompt_copies stay per rank (groups never span
    ranks).
    """

    n_tokens: torch.Tensor
    n_sequences: torch.Tensor
    n_queries: torch.Tensor
    group_sizes: torch.Tensor
    prompt_copies: torch.Tensor
    weight_mass: torch.Tensor
    weight_sq_mass: torch.Tensor

    @staticmethod
    def of(batch: PackedLossBatch) -> "LossNormalizers":
        """The normalisers of a whole (mini-)batch, on its device, without a host sync."""
        batch.check_structure()
        lay = _Layout(batch)
        m = batch.num_queries
        gi = batch.group_index.long()
        dev = gi.device
        w = batch.query_weights.detach().to(torch.float64)
        return LossNormalizers(
            n_tokens=lay.resp_len.sum(),
            n_sequences=torch.full((), batch.num_sequences, dtype=torch.long, device=dev),  # a fill, not a copy
            n_queries=torch.full((), m, dtype=torch.long, device=dev),
            group_sizes=torch.zeros(m, dtype=torch.long, device=dev).index_add_(0, gi, torch.ones_like(gi)),
            prompt_copies=torch.zeros(m, dtype=torch.long, device=dev).index_add_(0, gi, lay.prompt_scored.long()),
            weight_mass=w.sum(),
            weight_sq_mass=(w * w).sum(),
        )

    def to(self, device: torch.device | str) -> "LossNormalizers":
        """A copy with every tensor on `device`."""
        return LossNormalizers(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def check_structure(self, m: int, device: torch.device) -> None:
        """ValueError naming the field that is not a tensor of the documented shape on `device`."""
        for f in fields(self):
            v = getattr(self, f.name)
            per_query = f.name in ("group_sizes", "prompt_copies")
            check_tensor(f"normalizers.{f.name}", v, ndim=1 if per_query else 0, device=device)
            if per_query and v.shape[0] != m:
                raise ValueError(f"normalizers.{f.name} has {v.shape[0]} entries, expected m = {m} (one per query)")


@dataclass
class LossConfig:
    """Hyper-parameters of the objective (docs/method.md sections 2, 4, 5, 11).

    algorithm: "erpo" (L_PG(w_B) + alpha R_query) or "grpo" (L_PG(w = 1) + beta KL,
        KL the per-token k3 on response tokens aggregated with loss_agg). alpha:
        Query-KL coefficient (erpo).
    beta: per-token KL coefficient (grpo); 0 drops the term and needs no ref_logp.
    loss_agg: "token-mean" or "seq-mean-token-mean". eps_low, eps_high, dual_clip: the
        clip range and the dual-clip constant c. kl_guard: the linear guard c of the K3
        estimator (also applied to grpo's per-token k3; it changes nothing for
        |ref_logp - logp| <= kl_guard).
    rollout_is: truncated importance sampling against the rollout engine (needs
        batch.rollout_logp): "none", "token" (each token's policy loss times
        min(pi_old / pi_rollout, C)) or "sequence" (times min(prod_t pi_old / pi_rollout, C)
        over the sequence's response tokens); the weight is a constant under backprop.
    rollout_is_cap: C > 0, the truncation of the importance weight.
    """

    algorithm: str = "erpo"
    alpha: float = 0.01
    beta: float = 0.01
    loss_agg: str = "token-mean"
    eps_low: float = 0.2
    eps_high: float = 0.3
    dual_clip: float = 3.0
    kl_guard: float = 10.0
    rollout_is: str = "none"
    rollout_is_cap: float = 2.0

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
        if self.rollout_is not in ROLLOUT_IS:
            raise ValueError(f"rollout_is must be one of {ROLLOUT_IS}, got {self.rollout_is!r}")
        if not (0.0 < float(self.rollout_is_cap) < float("inf")):
            raise ValueError(f"rollout_is_cap must be finite and > 0, got {self.rollout_is_cap}")


class _Layout:
    """Row bookkeeping of a batch (integer work on the device, no host sync, no gradients).

    span_id [N] (2b = prompt of b, 2b + 1 = response of b), seq [N] (b), valid [N] (row
    scores a token), resp [N] (scored response row), prompt_scored [B] (sequence b's
    prompt span scores a token), resp_len [B] (L_b).
    """

    def __init__(self, batch: PackedLossBatch) -> None:
        dev = batch.targets.device
        n_rows = batch.num_rows
        cu = batch.span_cu_seqlens.long()
        n_spans = cu.shape[0] - 1
        self.span_id = torch.repeat_interleave(torch.arange(n_spans, device=dev), cu[1:] - cu[:-1], output_size=n_rows)
        self.seq = self.span_id // 2
        self.valid = batch.targets != batch.ignore_index
        self.resp = self.valid & (self.span_id % 2 == 1)
        counts = torch.zeros(n_spans, dtype=torch.long, device=dev).index_add_(0, self.span_id, self.valid.long())
        self.prompt_scored = counts[0::2] > 0  # [B]
        self.resp_len = counts[1::2]  # [B]


def _query_logp(logp: torch.Tensor, batch: PackedLossBatch, layout: _Layout, backend: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """([m] l_theta(q), [m] local scoring copies): segment_sum over the spans, prompt sums
    averaged per query over this batch's copies that score the prompt (0 when none)."""
    span_sums = segment_sum(logp, batch.span_cu_seqlens, backend=backend, validate=False)  # [2B] (checked once)
    prompt_sums = span_sums[0::2]  # [B]
    m = batch.num_queries
    gi = batch.group_index.long()
    scored = layout.prompt_scored.to(prompt_sums.dtype)  # [B]
    total = torch.zeros(m, dtype=prompt_sums.dtype, device=logp.device).index_add(0, gi, prompt_sums * scored)
    copies = torch.zeros(m, dtype=prompt_sums.dtype, device=logp.device).index_add_(0, gi, scored)
    return total / copies.clamp(min=1), copies


def query_logp_from_logp(
    logp: torch.Tensor, batch: PackedLossBatch, *, backend: str = "auto", validate: bool = True
) -> torch.Tensor:
    """query_logp l_theta(q) [m] from per-row log-probs.

    logp [N] float (differentiable). Each sequence's prompt span is summed
    (segment_sum); a query's value is the mean over its copies whose prompt span
    scores at least one token. When the prompt is scored once per group this is that
    copy's sum; when every copy scores it, the mean of G equal sums. A query no copy
    scores (a one-token prompt without BOS) gets 0. Response rows get zero gradient.
    validate: check the batch's values (one host sync).
    """
    check_tensor("logp", logp, ndim=1, dtypes=FLOAT_DTYPES)
    batch.check_structure(logp.shape[0], logp.device)
    if checking_values(validate):
        batch.validate()
    layout = _Layout(batch)
    lp = torch.where(layout.valid, logp, torch.zeros_like(logp))
    return _query_logp(lp, batch, layout, backend)[0]


def _check_inputs(
    batch: PackedLossBatch,
    config: LossConfig,
    n_rows: int,
    device: torch.device,
    normalizers: Optional[LossNormalizers],
    validate: Optional[bool],
    sync_metrics: bool,
    vocab_size: Optional[int] = None,
) -> Tuple[PackedLossBatch, Optional[List[Tuple[str, torch.Tensor]]]]:
    """Every check of the objective's inputs: structure always, before any kernel;
    values as `validate` and `sync_metrics` say (erpo_loss_from_logp's docstring):
    validate=True (or None without sync_metrics): now, in their own transfer; None with
    sync_metrics: returned as device flags for the metrics' transfer, with the batch
    made safe to compute on meanwhile (PackedLossBatch.made_safe); False, or while
    torch.compile traces: not at all. Returns (the batch to compute on, the flags or None)."""
    if validate is not None and not isinstance(validate, bool):
        raise ValueError(f"validate must be None, True or False, got {validate!r}")
    if not isinstance(config, LossConfig):
        raise ValueError(f"config must be a LossConfig, got {type(config).__name__}")
    config.validate()
    if not isinstance(batch, PackedLossBatch):
        raise ValueError(f"batch must be a PackedLossBatch, got {type(batch).__name__}")
    batch.check_structure(n_rows, device)
    if normalizers is not None:
        if not isinstance(normalizers, LossNormalizers):
            raise ValueError(f"normalizers must be a LossNormalizers or None, got {type(normalizers).__name__}")
        normalizers.check_structure(batch.num_queries, device)
    if config.algorithm == "grpo" and config.beta > 0 and batch.ref_logp is None:
        raise ValueError("ref_logp is required for algorithm='grpo' with beta > 0 (set beta = 0 to drop the KL term)")
    if config.rollout_is != "none" and batch.rollout_logp is None:
        raise ValueError(f"rollout_logp is required for rollout_is={config.rollout_is!r} (or set rollout_is='none')")
    if not checking_values(validate is not False):
        return batch, None
    if validate is None and sync_metrics:
        return batch.made_safe(vocab_size), batch.value_checks(vocab_size, normalizers)
    batch.validate(vocab_size, normalizers)
    return batch, None


def _metrics_out(
    metrics: Dict[str, torch.Tensor], checks: Optional[List[Tuple[str, torch.Tensor]]], sync_metrics: bool
) -> Dict[str, Union[float, torch.Tensor]]:
    """The metrics as python floats in one transfer that also carries the value checks'
    flags (raising the first failed check's ValueError), or as 0-d tensors without
    sync_metrics and while torch.compile traces (a graph hands no floats to Python)."""
    if not sync_metrics or torch.compiler.is_compiling():
        return metrics
    if not checks:
        return metrics_to_floats(metrics)
    values = list(metrics.values()) + [c.to(next(iter(metrics.values())).dtype) for _, c in checks]
    host = torch.stack([v.reshape(()) for v in values]).tolist()  # the one transfer
    raise_failed_check(checks, host[len(metrics):])
    return dict(zip(metrics.keys(), host[: len(metrics)]))


def erpo_loss_from_logp(
    logp: torch.Tensor,
    batch: PackedLossBatch,
    config: LossConfig = LossConfig(),
    *,
    entropy: Optional[torch.Tensor] = None,
    backend: str = "auto",
    normalizers: Optional[LossNormalizers] = None,
    validate: Optional[bool] = None,
    sync_metrics: bool = True,
) -> Tuple[torch.Tensor, Dict[str, Union[float, torch.Tensor]]]:
    """The ERPO (or GRPO) loss of a packed batch from its per-row log-probs.

    Args:
        logp: [N] float, log pi(target) of each row (prompt rows at temperature 1,
            response rows at 1 / tau); differentiable. Rows whose target is
            ignore_index are ignored (their value does not matter, their gradient is 0).
        batch: the packed batch (PackedLossBatch): a whole mini-batch, or one
            micro-batch of it (split_batch) together with `normalizers`.
        config: LossConfig.
        entropy: [N] float or None, per-row entropy for the "entropy/mean" metric only.
        backend: "auto", "triton" or "torch", for segment_sum and weighted_k3.
        normalizers: the mini-batch's LossNormalizers when `batch` is one of its
            micro-batches; None = LossNormalizers.of(batch). With the mini-batch's
            normalisers the micro-batches' losses (and gradients) sum to the mini-batch's.
        validate: the batch's value checks (PackedLossBatch.validate: targets, offsets,
            temperatures, weights, finite advantages, ...), a ValueError naming the
            first that fails. None (the default): with sync_metrics they travel in the
            metrics' one transfer (the loss is computed on PackedLossBatch.made_safe
            meanwhile, and the error raised before anything is returned), else in their
            own transfer first: one host read per call either way. True: in their own
            transfer before any kernel (one more read). False: none; pass it when the
            batch was validated where it was built (batch.validate()).
        sync_metrics: True: metrics are python floats (one host transfer for all).
            False: 0-d detached tensors on the device (no transfer; combine_metrics
            then metrics_to_floats transfer once for all micro-batches).
        Under torch.compile nothing is read back: the value checks are skipped and the
        metrics stay 0-d tensors, so a compiled call with the defaults has no graph break.
    Returns:
        (scalar loss, metrics). Every metric is this batch's share of the mini-batch's
        value (the whole value without normalizers): keys ending in "max" or "min"
        combine across micro-batches by max / min, every other key by sum
        (combine_metrics). Keys: "loss", "pg/loss", "pg/clipfrac", "pg/dual_clipfrac",
        "pg/ratio_mean" (token fractions / means), "qkl/value" (unweighted mean k3 over
        queries), "qkl/delta_mean", "qkl/guarded_frac", "qkl/loss" (R_query with the
        algorithm's weights: w_B for erpo, ones for grpo where it is monitored, not
        optimised), "query_logp/mean", "weights/ess", "weights/min", "weights/max" (of
        the weights L_PG uses), "response_length/mean", "entropy/mean" (response
        tokens, when entropy is given), "policy_kl" (k3 on response tokens aggregated
        with loss_agg at w = 1, grpo's KL term; when ref_logp is given), and when
        rollout_logp is given: "mismatch/logp_diff_mean", "mismatch/logp_diff_max"
        (|rollout_logp - old_logp| over response tokens), "mismatch/ratio_out_frac"
        (tokens with pi_old / pi_rollout outside [0.9, 1.1]), "mismatch/is_weight_mean"
        (the truncated importance weight, 1 with rollout_is="none").
    """
    check_tensor("logp", logp, ndim=1, dtypes=FLOAT_DTYPES)
    batch, checks = _check_inputs(batch, config, logp.shape[0], logp.device, normalizers, validate, sync_metrics)
    if entropy is not None:
        check_tensor("entropy", entropy, ndim=1, dtypes=FLOAT_DTYPES, device=logp.device)
        check_rows("entropy", entropy, logp.shape[0])
    loss, metrics = _loss_from_logp(logp, batch, config, entropy, backend, normalizers)
    return loss, _metrics_out(metrics, checks, sync_metrics)


def _loss_from_logp(
    logp: torch.Tensor,
    batch: PackedLossBatch,
    config: LossConfig,
    entropy: Optional[torch.Tensor],
    backend: str,
    normalizers: Optional[LossNormalizers],
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """erpo_loss_from_logp on a batch already checked against logp. Row space throughout
    (no gather of the response rows: that would need their count on the host)."""
    dev = logp.device
    is_erpo = config.algorithm == "erpo"
    cdt = compute_dtype(logp.dtype)
    norm = normalizers if normalizers is not None else LossNormalizers.of(batch)
    lay = _Layout(batch)
    resp = lay.resp  # [N] bool
    respf = resp.to(cdt)  # [N]
    zero_rows = torch.zeros_like(respf)
    lp = torch.where(lay.valid, logp.to(cdt), zero_rows)  # [N], 0 on ignored rows
    guard = float(config.kl_guard)
    m = batch.num_queries
    gi = batch.group_index.long()  # [B]
    q_row = gi[lay.seq]  # [N] query of each row
    n_tok = norm.n_tokens.to(cdt).clamp(min=1)
    n_q = norm.n_queries.to(cdt)
    if is_erpo:
        weights = batch.query_weights.detach().to(cdt)  # [m] w_B
        w_mass, w_sq_mass = norm.weight_mass.to(cdt), norm.weight_sq_mass.to(cdt)
    else:
        weights = torch.ones(m, dtype=cdt, device=dev)
        w_mass, w_sq_mass = n_q, n_q
    metrics: Dict[str, torch.Tensor] = {}

    # Query-KL (section 2): only the prompt spans reach it. This batch holds the share
    # (local scoring copies / all scoring copies) of each query: 1 for the micro-batch
    # with the scoring copy, 0 elsewhere, so R_query is counted once per query.
    ref_q = batch.ref_query_logp.detach().to(cdt)  # [m]
    query_logp, local_copies = _query_logp(lp, batch, lay, backend)  # [m], [m]
    share = local_copies / norm.prompt_copies.to(cdt).clamp(min=1)  # [m]
    wq = weights * share  # [m]
    with nullcontext() if (is_erpo and config.alpha > 0) else torch.no_grad():
        # sum_q w share k3 / W = (sum_q w share / W) * weighted_k3(., w share)
        r_query = (wq.sum() / w_mass) * weighted_k3(query_logp, ref_q, wq, guard=guard, backend=backend, validate=False)

    # Policy gradient (section 4): only the scored response rows reach it.
    if batch.old_logp is not None:
        old = torch.where(resp, batch.old_logp.detach().to(cdt), lp.detach())  # [N]
    else:
        old = lp.detach()
    adv = batch.advantages.detach().to(cdt)[lay.seq]  # [N]
    tok_loss, clipped, dual, ratio = token_surrogate(
        lp, old, adv, float(config.eps_low), float(config.eps_high), float(config.dual_clip)
    )  # [N] each
    # Aggregation coefficient of each row (0 off the scored response rows), w = 1 for the KL:
    #   token-mean c = w(q) / T;  seq-mean-token-mean c = w(q) / (m G_q L_i)
    if config.loss_agg == "token-mean":
        unit = respf / n_tok  # [N]
    else:
        per_seq = 1.0 / (n_q * norm.group_sizes.to(cdt)[gi].clamp(min=1) * lay.resp_len.to(cdt).clamp(min=1))  # [B]
        unit = respf * per_seq[lay.seq]  # [N]
    coef = unit * weights[q_row]  # [N]

    # Truncated importance sampling against the rollout engine (constant weights).
    if batch.rollout_logp is not None:
        roll = torch.where(resp, batch.rollout_logp.detach().to(cdt), old)  # [N]
        log_w = old - roll  # [N] log pi_old / pi_rollout, 0 off response rows
        log_cap = math.log(float(config.rollout_is_cap))
        if config.rollout_is == "token":
            is_weight = torch.exp(torch.clamp(log_w, max=log_cap))  # [N]
        elif config.rollout_is == "sequence":
            seq_log_w = torch.zeros(batch.num_sequences, dtype=cdt, device=dev).index_add_(0, lay.seq, log_w)  # [B]
            is_weight = torch.exp(torch.clamp(seq_log_w, max=log_cap))[lay.seq]  # [N]
        else:
            is_weight = torch.ones_like(log_w)
        coef = coef * is_weight
        with torch.no_grad():
            diff = log_w.abs()  # [N]
            tok_ratio = torch.exp(log_w)
            out_band = (tok_ratio < MISMATCH_BAND[0]) | (tok_ratio > MISMATCH_BAND[1])
            metrics["mismatch/logp_diff_mean"] = (diff * respf).sum() / n_tok
            metrics["mismatch/logp_diff_max"] = torch.where(resp, diff, zero_rows).max()
            metrics["mismatch/ratio_out_frac"] = (out_band & resp).to(cdt).sum() / n_tok
            metrics["mismatch/is_weight_mean"] = (is_weight * respf).sum() / n_tok

    pg_loss = (coef * torch.where(resp, tok_loss, zero_rows)).sum()
    loss = pg_loss
    if is_erpo and config.alpha > 0:
        loss = loss + config.alpha * r_query

    # grpo's KL (section 5): sum_t unit_t k3_t = (sum unit) * weighted_k3(., unit).
    if batch.ref_logp is not None:
        ref_rows = torch.where(resp, batch.ref_logp.detach().to(cdt), zero_rows)  # [N]
        kl_lp = torch.where(resp, lp, zero_rows)  # [N]
        use_kl = (not is_erpo) and config.beta > 0
        with nullcontext() if use_kl else torch.no_grad():
            policy_kl = unit.sum() * weighted_k3(kl_lp, ref_rows, unit, guard=guard, backend=backend, validate=False)
        if use_kl:
            loss = loss + config.beta * policy_kl
        metrics["policy_kl"] = policy_kl.detach()

    with torch.no_grad():
        metrics["pg/loss"] = pg_loss.detach()
        metrics["pg/clipfrac"] = (clipped & resp).to(cdt).sum() / n_tok
        metrics["pg/dual_clipfrac"] = (dual & resp).to(cdt).sum() / n_tok
        metrics["pg/ratio_mean"] = (ratio * respf).sum() / n_tok
        q_logp = query_logp.detach()
        delta = ref_q - q_logp  # [m]
        k3_q = _k3(delta, guard)  # [m]
        metrics["qkl/value"] = (share * k3_q).sum() / n_q
        metrics["qkl/delta_mean"] = (share * delta).sum() / n_q
        metrics["qkl/guarded_frac"] = (share * (delta > guard).to(cdt)).sum() / n_q
        metrics["qkl/loss"] = r_query.detach()
        metrics["query_logp/mean"] = (share * q_logp).sum() / n_q
        n_seq = norm.n_sequences.to(cdt)
        local_seq = torch.full((), batch.num_sequences, dtype=cdt, device=dev)
        # ess of the mini-batch, split over its micro-batches in proportion to their sequences
        metrics["weights/ess"] = w_mass * w_mass / (n_q * w_sq_mass) * (local_seq / n_seq)
        present = torch.zeros(m, dtype=torch.bool, device=dev).index_fill_(0, gi, True)  # [m] has a sequence here
        metrics["weights/min"] = torch.where(present, weights, torch.full_like(weights, math.inf)).min()
        metrics["weights/max"] = torch.where(present, weights, torch.full_like(weights, -math.inf)).max()
        metrics["response_length/mean"] = lay.resp_len.to(cdt).sum() / n_seq
        if entropy is not None:
            metrics["entropy/mean"] = (torch.where(resp, entropy.detach().to(cdt), zero_rows)).sum() / n_tok
        metrics["loss"] = loss.detach()
    return loss, {k: v.to(cdt) for k, v in metrics.items()}


def _k3(delta: torch.Tensor, guard: float) -> torch.Tensor:
    """Elementwise guarded k3 (the formula weighted_k3 reduces), for the unweighted metric."""
    below = torch.clamp(delta, max=guard)
    k3 = torch.exp(below) - below - 1
    ec = math.exp(guard)
    return torch.where(delta > guard, (ec - guard - 1) + (ec - 1) * (delta - guard), k3)


def erpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    batch: PackedLossBatch,
    config: LossConfig = LossConfig(),
    *,
    bias: Optional[torch.Tensor] = None,
    backend: str = "auto",
    with_entropy: bool = True,
    normalizers: Optional[LossNormalizers] = None,
    validate: Optional[bool] = None,
    sync_metrics: bool = True,
    logit_scale: Optional[float] = None,
    softcap: Optional[float] = None,
) -> Tuple[torch.Tensor, Dict[str, Union[float, torch.Tensor]]]:
    """The ERPO (or GRPO) loss straight from final hidden states and the lm_head weight.

    hidden [N, D] (the packed rows of `batch`), weight [V, D], bias [V] or None. Runs
    linear_token_logprobs (per-row inverse temperature from the batch, never
    materialising [N, V]; with the entropy for the "entropy/mean" metric unless
    with_entropy is False) and then erpo_loss_from_logp. Gradients flow to hidden,
    weight and bias. normalizers, validate (targets also checked against V),
    sync_metrics: as erpo_loss_from_logp. Returns (scalar loss, metrics) as
    erpo_loss_from_logp.

    Micro-batches: split the mini-batch with split_batch, forward each micro-batch's
    rows, and call erpo_loss(hidden_k, weight, micro.batch, config,
    normalizers=LossNormalizers.of(mini_batch)); backward each loss (gradients
    accumulate to the mini-batch's) and combine_metrics the k metric dicts.
    """
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES, device=hidden.device)
    batch, checks = _check_inputs(batch, config, hidden.shape[0], hidden.device, normalizers, validate, sync_metrics,
                                  vocab_size=weight.shape[0])  # fmt: skip
    out = linear_token_logprobs(
        hidden, weight, batch.targets, bias=bias, inv_temperature=batch.inv_temperature,
        ignore_index=batch.ignore_index, return_entropy=with_entropy, backend=backend,
        validate=False,  # targets (< V) and inv_temperature: checked once by _check_inputs / batch.validate
        logit_scale=logit_scale, softcap=softcap,  # the model's own logit transform, if any
    )
    logp, entropy = out if with_entropy else (out, None)
    loss, metrics = _loss_from_logp(logp, batch, config, entropy, backend, normalizers)
    return loss, _metrics_out(metrics, checks, sync_metrics)


# ---------------------------------------------------------------- metrics across micro-batches


def combine_metrics(parts: Iterable[Mapping[str, Union[float, torch.Tensor]]]) -> Dict[str, Union[float, torch.Tensor]]:
    """The mini-batch's metrics from its micro-batches' (erpo_loss with the mini-batch's
    normalizers): keys ending in "max" by max, "min" by min, every other key by sum.
    Works on python floats and on 0-d tensors (no host sync for tensors). A key missing
    from some parts is combined over the parts that have it."""
    out: Dict[str, Union[float, torch.Tensor]] = {}
    for part in parts:
        for key, value in part.items():
            if key not in out:
                out[key] = value
            elif key.endswith("max"):
                out[key] = torch.maximum(out[key], value) if isinstance(value, torch.Tensor) else max(out[key], value)
            elif key.endswith("min"):
                out[key] = torch.minimum(out[key], value) if isinstance(value, torch.Tensor) else min(out[key], value)
            else:
                out[key] = out[key] + value
    return out


def metrics_to_floats(metrics: Mapping[str, Union[float, torch.Tensor]]) -> Dict[str, float]:
    """Python floats from 0-d tensor metrics in one device-to-host transfer."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    if keys:
        dtype = torch.float64 if any(metrics[k].dtype == torch.float64 for k in keys) else torch.float32
        values = torch.stack([metrics[k].detach().to(dtype).reshape(()) for k in keys]).tolist()  # the one transfer
        out.update(zip(keys, values))
    return {k: out[k] for k in metrics}


# ---------------------------------------------------------------- splitting a mini-batch


@dataclass
class MicroBatch:
    """One micro-batch of a mini-batch: `batch` (its rows, the mini-batch's query
    arrays), `rows` [n_k] int64 (its rows' indices in the mini-batch's row space, in
    order: index input_ids / position_ids / hidden states with it) and `sequences` (the
    mini-batch's sequence indices it holds, in order)."""

    batch: PackedLossBatch
    rows: torch.Tensor
    sequences: List[int]


def plan_micro_batches(batch: PackedLossBatch, max_rows: int) -> List[List[int]]:
    """Sequence indices of each micro-batch: whole sequences in order, packed greedily so
    that each micro-batch holds at most `max_rows` rows (0 = everything in one). A
    sequence longer than max_rows is a ValueError. Reads span_cu_seqlens on the host:
    call it where the batch is built."""
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0:
        raise ValueError(f"max_rows must be an int >= 0, got {max_rows!r}")
    cu = batch.span_cu_seqlens.tolist()
    lengths = [cu[2 * b + 2] - cu[2 * b] for b in range(batch.num_sequences)]
    if max_rows == 0:
        return [list(range(len(lengths)))]
    plan: List[List[int]] = []
    used = 0
    for b, n in enumerate(lengths):
        if n > max_rows:
            raise ValueError(f"max_rows = {max_rows} is smaller than sequence {b} ({n} rows); raise the budget")
        if plan and used + n <= max_rows:
            plan[-1].append(b)
            used += n
        else:
            plan.append([b])
            used = n
    return plan


def split_batch(batch: PackedLossBatch, plan: Sequence[Sequence[int]]) -> List[MicroBatch]:
    """Split a mini-batch into micro-batches of whole sequences.

    plan: the sequence indices of each micro-batch (e.g. plan_micro_batches); every
    sequence in exactly one. Each MicroBatch.batch keeps the mini-batch's query indexing
    (group_index values, ref_query_logp and query_weights [m] unchanged), so a group may
    span micro-batches and a query's prompt stays scored once: by the micro-batch that
    holds its scoring copy. Row fields (targets, inv_temperature, old_logp, ref_logp,
    rollout_logp) are gathered, sequence fields (group_index, advantages) selected,
    span_cu_seqlens rebuilt. Use with normalizers=LossNormalizers.of(batch). Host-side
    work: call it where the batch is built.
    """
    batch.check_structure()
    n_seq = batch.num_sequences
    flat = [int(b) for part in plan for b in part]
    if sorted(flat) != list(range(n_seq)) or any(len(part) == 0 for part in plan):
        raise ValueError(f"plan must hold every sequence 0..{n_seq - 1} exactly once, in non-empty micro-batches")
    cu = batch.span_cu_seqlens.long().cpu()
    dev = batch.targets.device
    out: List[MicroBatch] = []
    for part in plan:
        seqs = [int(b) for b in part]
        row_parts, spans = [], [0]
        for b in seqs:
            p0, p1, r1 = int(cu[2 * b]), int(cu[2 * b + 1]), int(cu[2 * b + 2])
            row_parts.append(torch.arange(p0, r1))
            spans += [spans[-1] + p1 - p0, spans[-1] + r1 - p0]
        rows = torch.cat(row_parts).to(dev)
        sel = torch.tensor(seqs, dtype=torch.long, device=dev)

        def take(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t[rows]

        micro = replace(
            batch,
            targets=batch.targets[rows],
            inv_temperature=batch.inv_temperature[rows],
            span_cu_seqlens=torch.tensor(spans, dtype=batch.span_cu_seqlens.dtype, device=dev),
            group_index=batch.group_index[sel],
            advantages=batch.advantages[sel],
            old_logp=take(batch.old_logp),
            ref_logp=take(batch.ref_logp),
            rollout_logp=take(batch.rollout_logp),
        )
        out.append(MicroBatch(batch=micro, rows=rows, sequences=seqs))
    return out
