"""The policy term: the per-token policy loss (POLICY_LOSSES[config.policy_loss]; the
default, vanilla, is GRPO's clipped surrogate below), its per-query aggregation
(docs/method.md section 4) and the truncated importance weights against the rollout
engine (section 11).

Plain PyTorch: every step is O(rows) elementwise work plus a few gathers, so there is
nothing to fuse until a measurement says otherwise.

vanilla, per response token t of sequence i answering query q, with advantage A = A_i:
    rho  = exp(clamp(logp - old_logp, -20, 20))
    loss = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)
    loss = min(loss, -c A)                 (dual clip, only where A < 0)
Aggregation with per-query weights w(q) (verl's names):
    token-mean:               L = sum_q w(q) sum_i sum_t loss / sum_q sum_i L_i
    seq-mean-token-mean:      L = (1/m) sum_q w(q) (1/G_q) sum_i (1/L_i) sum_t loss
    seq-mean-token-sum:       L = (1/m) sum_q w(q) (1/G_q) sum_i sum_t loss
    seq-mean-token-sum-norm:  the same divided by loss_scale_factor (Dr. GRPO's constant)
where L_i is the number of tokens of response i and G_q the number of sequences of
query q in the mini-batch (a response with no token adds 0 but still counts in G_q).
Each is a weighted token sum sum_t c_t loss_t, which is how they are computed.
Truncated importance sampling (a constant under backprop), with C = rollout_is_cap:
    token:     c_t *= min(pi_old / pi_rollout, C)               per token
    sequence:  c_t *= min(prod_t' pi_old / pi_rollout, C)        over the sequence's tokens
Rejection (rollout_rs): c_t = 0 where the divergence of pi_old from pi_rollout passes
rollout_rs_threshold, per token or per sequence (rollout_rejection); the denominators
stay, but seq-mean-token-mean's L_i, which counts the sequence's kept tokens (verl's). bypass_mode (verl's bypass mode, one mechanism with the above): pi_old is the
rollout's policy (batch.rollout_logp, or old_logp standing for it), so the loss sees
old_logp = rollout_logp, and the weights and rejections compare pi_theta (detached) with
pi_rollout in place of pi_old.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .batch import PackedLossBatch
from .config import LossConfig, rollout_rs_bounds
from .policy_losses import POLICY_LOSSES
from .rows import LossRows

# The rollout/trainer mismatch metric counts tokens whose pi_old / pi_rollout lies outside this band.
MISMATCH_BAND = (0.9, 1.1)


def aggregation_coef(rows: LossRows, config: LossConfig) -> torch.Tensor:
    """[N] coefficient of each row at w = 1 (0 off the scored response rows), so that an
    aggregate with weights w is sum_t c_t w(q_t) x_t (config.loss_agg):
        token-mean:               c_t = 1 / T
        seq-mean-token-mean:      c_t = 1 / (m G_q L_i)
        seq-mean-token-sum:       c_t = 1 / (m G_q)
        seq-mean-token-sum-norm:  c_t = 1 / (m G_q loss_scale_factor)
    with the mini-batch's T, m and G_q (rows.normalizers)."""
    loss_agg = config.loss_agg
    if loss_agg == "token-mean":
        return rows.response_mask / rows.n_tokens  # [N]
    group_sizes = rows.normalizers.group_sizes.to(rows.dtype)[rows.group_index].clamp(min=1)  # [B]
    if loss_agg == "seq-mean-token-mean":
        lengths = rows.layout.response_length.to(rows.dtype).clamp(min=1)  # [B]
    elif loss_agg == "seq-mean-token-sum":
        lengths = torch.ones_like(group_sizes)
    else:  # seq-mean-token-sum-norm
        lengths = torch.full_like(group_sizes, float(config.loss_scale_factor))
    per_sequence = 1.0 / (rows.n_queries * group_sizes * lengths)  # [B]
    return rows.response_mask * per_sequence[rows.layout.sequence]  # [N]


def rollout_importance_weights(
    rows: LossRows, trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, config: LossConfig
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(is_weight [N], log_w [N]): the truncated importance weight of each row
    (module docstring; 1 with rollout_is="none") and log_w = log pi_trainer / pi_rollout,
    trainer_logp [N] being pi_old's (pi_theta's, detached, with bypass_mode) and
    rollout_logp [N] the rollout's (equal to trainer_logp off the scored response rows)."""
    log_w = trainer_logp - rollout_logp  # [N]
    log_cap = math.log(float(config.rollout_is_cap))
    if config.rollout_is == "token":
        is_weight = torch.exp(torch.clamp(log_w, max=log_cap))  # [N]
    elif config.rollout_is == "sequence":
        sequence = rows.layout.sequence
        seq_log_w = torch.zeros(rows.layout.response_length.shape[0], dtype=rows.dtype,
                                device=log_w.device).index_add_(0, sequence, log_w)  # [B]
        is_weight = torch.exp(torch.clamp(seq_log_w, max=log_cap))[sequence]  # [N]
    else:
        is_weight = torch.ones_like(log_w)
    return is_weight, log_w


def _per_sequence(rows: LossRows, values: torch.Tensor, how: str) -> torch.Tensor:
    """[N]: the sum, mean or max of values [N] over each row's sequence's scored response
    rows (0 for a sequence with none), on each of its rows."""
    sequence = rows.layout.sequence
    n_seq = rows.layout.response_length.shape[0]
    if how == "max":
        init = torch.full((n_seq,), -math.inf, dtype=values.dtype, device=values.device)
        out = init.scatter_reduce(0, sequence, torch.where(rows.response, values, -math.inf), "amax")
        out = torch.where(torch.isinf(out), torch.zeros_like(out), out)
    else:
        out = torch.zeros(n_seq, dtype=values.dtype, device=values.device).index_add(
            0, sequence, torch.where(rows.response, values, rows.zeros))
        if how == "mean":
            out = out / rows.layout.response_length.to(values.dtype).clamp(min=1)
    return out[sequence]


def _kept_length_factor(rows: LossRows, kept: torch.Tensor) -> torch.Tensor:
    """[N] L_i / (kept tokens of sequence i), at least 1 in the denominator: seq-mean-token-mean
    with a rejection divides each sequence's sum by its kept tokens (verl's agg_loss on the
    rejection mask); the other aggregations keep their denominators."""
    n_seq = rows.layout.response_length.shape[0]
    n_kept = torch.zeros(n_seq, dtype=rows.dtype, device=kept.device).index_add(
        0, rows.layout.sequence, (kept & rows.response).to(rows.dtype))  # [B]
    lengths = rows.layout.response_length.to(rows.dtype)
    return (lengths / n_kept.clamp(min=1))[rows.layout.sequence]


def rollout_rejection(rows: LossRows, log_w: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """[N] bool: the rows rollout_rs keeps (every row with rollout_rs="none"). With
    lr = clamp(log_w, +-20): k1 = -lr, k2 = lr^2 / 2, k3 = e^lr - 1 - lr per token; a
    token_* option tests the token's, seq_sum / seq_mean / seq_max the sum, mean or max
    over its sequence's response rows (every token of a sequence kept or rejected
    together); k1 against [log lower, log upper], k2 / k3 against upper
    (config.rollout_rs_bounds)."""
    keep = torch.ones_like(rows.response)
    bounds = rollout_rs_bounds(config.rollout_rs, config.rollout_rs_threshold)
    if not bounds:
        return keep
    lr = torch.clamp(log_w, -20.0, 20.0)
    token_stat = {"k1": -lr, "k2": 0.5 * lr * lr, "k3": torch.exp(lr) - 1.0 - lr}
    for option, lower, upper in bounds:
        level, kind = option.rsplit("_", 1)
        stat = token_stat[kind] if level == "token" else _per_sequence(rows, token_stat[kind], level[len("seq_"):])
        ok = stat <= upper if lower is None else (stat >= lower) & (stat <= upper)
        keep = keep & ok
    return keep


def mismatch_metrics(rows: LossRows, log_w: torch.Tensor, is_weight: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The rollout/trainer mismatch over the scored response rows: mean and max of
    |log pi_old - log pi_rollout| (pi_theta's with bypass_mode), the fraction of tokens with
    that ratio outside MISMATCH_BAND, the ratio's mean and mean square (its spread: the
    square root of their difference, sqrt(E r^2 - (E r)^2)), and the mean truncated
    importance weight."""
    with torch.no_grad():
        diff = log_w.abs()  # [N]
        ratio = torch.exp(log_w)
        out_band = (ratio < MISMATCH_BAND[0]) | (ratio > MISMATCH_BAND[1])
        return {
            "mismatch/logp_diff_mean": rows.response_mean(diff),
            "mismatch/logp_diff_max": torch.where(rows.response, diff, rows.zeros).max(),
            "mismatch/ratio_out_frac": rows.response_fraction(out_band),
            "mismatch/ratio_mean": rows.response_mean(ratio),
            "mismatch/ratio_sq_mean": rows.response_mean(ratio * ratio),
            "mismatch/is_weight_mean": rows.response_mean(is_weight),
        }


@dataclass
class PolicyTerm:
    """value: L_PG (0-d); unit [N]: the aggregation coefficients at w = 1 (the KL to a
    reference aggregates with them); metrics: pg/* (and mismatch/* with rollout_logp)."""

    value: torch.Tensor
    unit: torch.Tensor
    metrics: Dict[str, torch.Tensor]


def _old_logp(rows: LossRows, old_logp: Optional[torch.Tensor]) -> torch.Tensor:
    """[N] pi_old's log-probs on the scored response rows, the current (detached) ones elsewhere."""
    if old_logp is None:
        return rows.logp.detach()
    return torch.where(rows.response, old_logp.detach().to(rows.dtype), rows.logp.detach())


def _rollout_logp(rows: LossRows, batch: PackedLossBatch, old: torch.Tensor, bypass: bool) -> Optional[torch.Tensor]:
    """[N] the rollout's log-probs on the scored response rows (old elsewhere): batch.rollout_logp;
    with bypass_mode and no rollout_logp, old_logp stands for them (verl passes the rollout's
    as old_log_prob); None without either."""
    if batch.rollout_logp is not None:
        return torch.where(rows.response, batch.rollout_logp.detach().to(rows.dtype), old)
    return old if bypass else None


def policy_term(rows: LossRows, batch: PackedLossBatch, config: LossConfig,
                selected: Optional[torch.Tensor] = None) -> PolicyTerm:
    """L_PG of the scored response rows (module docstring), weighted by rows.weights: the
    per-token losses of POLICY_LOSSES[config.policy_loss], aggregated by config.loss_agg;
    selected [N] bool: only these rows' losses count (top_entropy_quantile, the
    denominators unchanged), None: every scored response row's."""
    old = _old_logp(rows, batch.old_logp)  # [N]
    bypass = config.policy_loss == "bypass_mode"
    rollout = _rollout_logp(rows, batch, old, bypass)  # [N] or None
    trainer = rows.logp.detach() if bypass else old  # the policy rollout_is / rollout_rs compare with the rollout's
    advantages = batch.advantages.detach().to(rows.dtype)[rows.layout.sequence]  # [N]
    token = POLICY_LOSSES[config.policy_loss](rows, rollout if bypass else old, advantages, config)  # [N] each
    token_loss, clipped, dual, ratio = token.loss, token.clipped, token.dual, token.ratio
    unit = aggregation_coef(rows, config)  # [N]
    coef = unit * rows.weights[rows.query_of_row]  # [N]
    keep = rows.response if selected is None else selected  # [N]
    metrics: Dict[str, torch.Tensor] = {}
    if rollout is not None:
        is_weight, log_w = rollout_importance_weights(rows, trainer, rollout, config)
        kept = rollout_rejection(rows, log_w, config)
        coef = coef * is_weight
        keep = keep & kept
        if config.rollout_rs != "none" and config.loss_agg == "seq-mean-token-mean":
            coef = coef * _kept_length_factor(rows, kept)  # each sequence's mean over its kept tokens, as verl
        if batch.rollout_logp is not None:
            metrics.update(mismatch_metrics(rows, log_w, is_weight))
        if config.rollout_rs != "none":
            metrics["mismatch/rejected_frac"] = rows.response_fraction(~kept).detach()
    value = (coef * torch.where(keep, token_loss, rows.zeros)).sum()
    with torch.no_grad():
        metrics["pg/loss"] = value.detach()
        metrics["pg/clipfrac"] = rows.response_fraction(clipped)
        metrics["pg/dual_clipfrac"] = rows.response_fraction(dual)
        metrics["pg/ratio_mean"] = rows.response_mean(ratio)
    return PolicyTerm(value, unit, metrics)
