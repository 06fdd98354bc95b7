"""PackedLossBatch: the packed batch the objective scores, its validation, its row
layout (RowLayout) and the mini-batch-wide denominators of the loss (LossNormalizers,
docs/method.md section 10).

The row layout it describes is PackedLossBatch's docstring; `check_structure` reads
tensor metadata only (free), `validate` reads every value check back in one transfer,
`value_checks` gives the same checks as device flags (for a transfer that also carries
the metrics), and `made_safe` a copy whose indices stay in their arrays whatever their
values. LossNormalizers are computed from a (mini-)batch and checked with it, so the
three live in one module (no import circle).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import List, Optional, Sequence, Tuple

import torch

from .._utils import FLOAT_DTYPES, INDEX_DTYPES, check_rows, check_tensor


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
        support: None, or each row's kept set as linear_token_logprobs' `support=`
            (erpo_kernels.support): a threshold [N] float (-inf = unrestricted) or a
            packed bitmask [N, ceil(V / 32)] int32 (a row of -1 = unrestricted). The
            sampler's support of each response row (top-k / top-p / min-p replayed);
            prompt rows unrestricted. Every log-prob of the loss (logp, and the
            old_logp / ref_logp / rollout_logp it is compared with) is then the one
            renormalised over it.
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
    support: Optional[torch.Tensor] = None

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
        check_tensor("targets", self.targets, ndim=1, dtypes=INDEX_DTYPES, device=device)
        device = self.targets.device if device is None else device
        n_rows = self.num_rows if n_rows is None else n_rows
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
        if self.support is not None:
            if self.support.dtype == torch.int32:
                check_tensor("support", self.support, ndim=2, dtypes=(torch.int32,), device=device)
            else:
                check_tensor("support", self.support, ndim=1, dtypes=FLOAT_DTYPES, device=device)
            check_rows("support", self.support, n_rows)

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
        group_index = self.group_index.long()
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
        in_range = ((group_index >= 0) & (group_index < m)).all()
        checks.append((f"group_index must lie in [0, m) with m = {m} (the length of query_weights)", in_range))
        if normalizers is None:
            has_seq = torch.zeros(m, dtype=torch.long, device=group_index.device).index_add_(
                0, group_index.clamp(0, m - 1), torch.ones_like(group_index)) > 0
            checks.append(("group_index must give every query in [0, m) at least one sequence",
                           has_seq.all() | ~in_range))
        else:
            checks.append(("normalizers must be those of a mini-batch holding this batch "
                           "(n_sequences >= 1, n_queries >= 1, weight_mass > 0, group_sizes >= 0)",
                           (normalizers.n_sequences >= 1) & (normalizers.n_queries >= 1)
                           & (normalizers.weight_mass > 0) & (normalizers.group_sizes >= 0).all()))
        if self.support is not None and self.support.dtype != torch.int32:  # a bitmask's width: the op checks it
            checks.append(("support's thresholds must not be NaN (-inf = unrestricted)",
                           ~torch.isnan(self.support).any()))
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


class RowLayout:
    """Row bookkeeping of a batch (integer work on the device, no host sync, no gradients).

    span_id [N] (2b = prompt of sequence b, 2b + 1 = its response), sequence [N] (b),
    scored [N] (the row scores a token), response [N] (a scored response row),
    prompt_scored [B] (sequence b's prompt span scores a token), response_length [B] (L_b).
    """

    def __init__(self, batch: PackedLossBatch) -> None:
        dev = batch.targets.device
        cu = batch.span_cu_seqlens.long()
        n_spans = cu.shape[0] - 1
        self.span_id = torch.repeat_interleave(
            torch.arange(n_spans, device=dev), cu[1:] - cu[:-1], output_size=batch.num_rows
        )
        self.sequence = self.span_id // 2
        self.scored = batch.targets != batch.ignore_index
        self.response = self.scored & (self.span_id % 2 == 1)
        counts = torch.zeros(n_spans, dtype=torch.long, device=dev).index_add_(0, self.span_id, self.scored.long())
        self.prompt_scored = counts[0::2] > 0  # [B]
        self.response_length = counts[1::2]  # [B]


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
        entropy_threshold: 0-d float (fp32, fp64 for fp64 entropies) or None:
            top_entropy_quantile's threshold over
            the whole mini-batch (objective/entropy.py's entropy_threshold of every
            micro-batch's and rank's response entropies); None: each call takes its own
            rows' (exact for one call on one rank). Not built by `of`: it needs the
            entropies of the current weights.
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
    entropy_threshold: Optional[torch.Tensor] = None

    @staticmethod
    def of(batch: PackedLossBatch) -> "LossNormalizers":
        """The normalisers of a whole (mini-)batch, on its device, without a host sync."""
        batch.check_structure()
        layout = RowLayout(batch)
        m = batch.num_queries
        group_index = batch.group_index.long()
        dev = group_index.device
        w = batch.query_weights.detach().to(torch.float64)
        return LossNormalizers(
            n_tokens=layout.response_length.sum(),
            n_sequences=torch.full((), batch.num_sequences, dtype=torch.long, device=dev),  # a fill, not a copy
            n_queries=torch.full((), m, dtype=torch.long, device=dev),
            group_sizes=torch.zeros(m, dtype=torch.long, device=dev).index_add_(0, group_index, torch.ones_like(group_index)),
            prompt_copies=torch.zeros(m, dtype=torch.long, device=dev).index_add_(0, group_index, layout.prompt_scored.long()),
            weight_mass=w.sum(),
            weight_sq_mass=(w * w).sum(),
        )

    def to(self, device: torch.device | str) -> "LossNormalizers":
        """A copy with every tensor on `device`."""
        return LossNormalizers(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                                  for f in fields(self)})

    def check_structure(self, m: int, device: torch.device) -> None:
        """ValueError naming the field that is not a tensor of the documented shape on `device`."""
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None and f.name == "entropy_threshold":
                continue
            per_query = f.name in ("group_sizes", "prompt_copies")
            check_tensor(f"normalizers.{f.name}", v, ndim=1 if per_query else 0, device=device)
            if per_query and v.shape[0] != m:
                raise ValueError(f"normalizers.{f.name} has {v.shape[0]} entries, expected m = {m} (one per query)")
