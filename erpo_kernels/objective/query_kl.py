"""The Query-KL term of ERPO (docs/method.md section 2) and the query log-likelihood it
reads:

    l_theta(q) = sum of the log-probs of q's prompt span (segment_sum), averaged over the
                 copies of q in the batch whose prompt span scores a token
    R_query    = sum_q w(q) k3(l_0(q) - l_theta(q)) / sum_q w(q)       (weighted_k3)

In a micro-batch each query counts with its share (local scoring copies / all of the
mini-batch's): 1 in the micro-batch holding its scoring copy, 0 elsewhere, so the
micro-batches' R_query add up to the mini-batch's.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Dict, Tuple, Union

import torch

from .._utils import FLOAT_DTYPES, check_tensor, checking_values
from ..reference import k3_guarded
from ..segment_sum import segment_sum
from ..weighted_k3 import weighted_k3
from .batch import PackedLossBatch, RowLayout
from .rows import LossRows


def prompt_logp_sums(
    logp: torch.Tensor, span_cu_seqlens: torch.Tensor, *, backend: str = "auto", validate: bool = True
) -> torch.Tensor:
    """[B] the sum of each sequence's prompt span of logp [N] (differentiable), with
    span_cu_seqlens [2B + 1] the boundaries of prompt_0, rest_0, prompt_1, ... (segment_sum;
    validate: its offset checks). The objective, TRL's ERPOTrainer and verl's loss_mode=erpo
    all read l_theta(q) through it."""
    return segment_sum(logp, span_cu_seqlens, backend=backend, validate=validate)[0::2]


def query_kl_value(
    query_logp: torch.Tensor,
    ref_query_logp: torch.Tensor,
    weights: torch.Tensor,
    weight_mass: Union[torch.Tensor, float],
    *,
    guard: float,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """sum_q w(q) k3(l_0(q) - l_theta(q)) / weight_mass (0-d): R_query (docs/method.md
    section 2) when weight_mass = sum_q w(q), or these queries' part of a batch whose
    weights sum to weight_mass (parts over micro-batches add up to the batch's R_query).

    query_logp [k] l_theta (differentiable), ref_query_logp [k] l_0, weights [k] >= 0;
    guard: the K3 guard c; validate: weighted_k3's check of the weights. The one
    implementation of the term: the objective, TRL's ERPOTrainer and verl's loss_mode=erpo
    call it."""
    # sum_q w k3 / W = (sum_q w / W) * weighted_k3(., w)
    scale = weights.sum() / weight_mass
    return scale * weighted_k3(query_logp, ref_query_logp, weights, guard=guard, backend=backend, validate=validate)


def prompt_logp(
    logp: torch.Tensor, batch: PackedLossBatch, layout: RowLayout, backend: str
) -> Tuple[torch.Tensor, torch.Tensor]:
    """([m] l_theta(q), [m] local scoring copies) from logp [N] (0 on ignored rows):
    segment_sum over the spans, prompt sums averaged per query over this batch's copies
    that score the prompt (0 when none)."""
    prompt_sums = prompt_logp_sums(logp, batch.span_cu_seqlens, backend=backend, validate=False)  # [B] (checked once)
    m = batch.num_queries
    group_index = batch.group_index.long()
    scored = layout.prompt_scored.to(prompt_sums.dtype)  # [B]
    total = torch.zeros(m, dtype=prompt_sums.dtype, device=logp.device).index_add(0, group_index, prompt_sums * scored)
    copies = torch.zeros(m, dtype=prompt_sums.dtype, device=logp.device).index_add_(0, group_index, scored)
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
    validate: check the batch's values (one host sync; skipped while compiling).
    """
    check_tensor("logp", logp, ndim=1, dtypes=FLOAT_DTYPES)
    batch.check_structure(logp.shape[0], logp.device)
    if checking_values(validate):
        batch.validate()
    layout = RowLayout(batch)
    lp = torch.where(layout.scored, logp, torch.zeros_like(logp))
    return prompt_logp(lp, batch, layout, backend)[0]


@dataclass
class QueryKL:
    """The term and what its metrics read: value (R_query of this batch's share, 0-d),
    query_logp [m] l_theta(q), ref_query_logp [m] l_0(q), share [m]."""

    value: torch.Tensor
    query_logp: torch.Tensor
    ref_query_logp: torch.Tensor
    share: torch.Tensor


def query_kl_term(rows: LossRows, batch: PackedLossBatch, guard: float, backend: str, optimised: bool) -> QueryKL:
    """R_query with the rows' weights (w_B for erpo, ones for grpo); `optimised`: its
    gradient is wanted (erpo with alpha > 0), else it is computed as a metric only."""
    ref_query_logp = batch.ref_query_logp.detach().to(rows.dtype)  # [m]
    query_logp, local_copies = prompt_logp(rows.logp, batch, rows.layout, backend)  # [m], [m]
    share = local_copies / rows.normalizers.prompt_copies.to(rows.dtype).clamp(min=1)  # [m]
    shared_weights = rows.weights * share  # [m]
    with nullcontext() if optimised else torch.no_grad():
        value = query_kl_value(query_logp, ref_query_logp, shared_weights, rows.weight_mass, guard=guard,
                               backend=backend, validate=False)  # fmt: skip
    return QueryKL(value, query_logp, ref_query_logp, share)


def query_kl_metrics(term: QueryKL, guard: float, n_queries: torch.Tensor) -> Dict[str, torch.Tensor]:
    """qkl/value (the unweighted mean k3), qkl/delta_mean, qkl/guarded_frac, qkl/loss
    (R_query) and query_logp/mean, each this batch's share of the mini-batch's."""
    share = term.share
    query_logp = term.query_logp.detach()
    delta = term.ref_query_logp - query_logp  # [m]
    return {
        "qkl/value": (share * k3_guarded(delta, guard)).sum() / n_queries,
        "qkl/delta_mean": (share * delta).sum() / n_queries,
        "qkl/guarded_frac": (share * (delta > guard).to(share.dtype)).sum() / n_queries,
        "qkl/loss": term.value.detach(),
        "query_logp/mean": (share * query_logp).sum() / n_queries,
    }
