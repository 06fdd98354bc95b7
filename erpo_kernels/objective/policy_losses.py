"""The registered policy losses (POLICY_LOSSES), by verl 0.9.1's names, parameters and
defaults; each maps the scored rows to one loss per row (registry.py's signature), the
objective aggregates them. Per response token t of sequence i, with A = A_i, the token
log-ratio lr = logp - old_logp and r = exp(lr) (docs/objective.md has each formula with
its paper):

    vanilla   PPO's clipped surrogate with clip-higher and dual clip (token_surrogate)
    gspo      the same clip on s = exp(mean_i lr) * pi / sg(pi), the sequence ratio (GSPO)
    sapo      -A * 4/tau * sigmoid(tau (r - 1)), tau = tau_pos if A > 0 else tau_neg (SAPO)
    gpg       -A * logp, no ratio (GPG)
    clip_cov  vanilla without dual clip, a random clip_cov_ratio of the tokens whose
              covariance (A - mean A)(logp - mean logp) lies in (lb, ub) dropped (Clip-Cov)
    kl_cov    -A r, plus ppo_kl_coef |lr| on the kl_cov_ratio of tokens of largest
              covariance (KL-Cov)
    geo_mean  -A * exp(mean_i of lr clipped to [-eps_low, eps_high] on A's side), one value
              per sequence, on each of its tokens (GMPO)
    cispo     -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp (CISPO)

clip_cov and kl_cov rank the tokens of the call (a micro-batch, as verl's do), which reads
their count on the host; clip_cov draws its subset with torch's global generator
(torch.randperm), as verl does, so a seeded run repeats.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .config import LossConfig
from .registry import POLICY_LOSSES, TokenLoss, register_policy_loss
from .rows import LossRows

__all__ = ["POLICY_LOSSES", "token_surrogate"]
LOG_RATIO_CLAMP = 20.0


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


def _sequence_mean(rows: LossRows, values: torch.Tensor) -> torch.Tensor:
    """[B] mean of values [N] over each sequence's scored response rows (0 for none)."""
    n_seq = rows.layout.response_length.shape[0]
    sums = torch.zeros(n_seq, dtype=values.dtype, device=values.device).index_add(
        0, rows.layout.sequence, torch.where(rows.response, values, torch.zeros_like(values))
    )
    return sums / rows.layout.response_length.to(values.dtype).clamp(min=1)


def _none(rows: LossRows) -> torch.Tensor:
    return torch.zeros_like(rows.response)


def _ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """[N] exp(clamp(logp - old_logp, +-20)), the token ratio."""
    return torch.exp(torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


@register_policy_loss("vanilla")
def vanilla(rows: LossRows, old_logp: torch.Tensor, advantages: torch.Tensor, config: LossConfig) -> TokenLoss:
    loss, clipped, dual, ratio = token_surrogate(
        rows.logp, old_logp, advantages, float(config.eps_low), float(config.eps_high), float(config.dual_clip)
    )
    return TokenLoss(loss, clipped, dual, ratio)


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, config: LossConfig):
    """(-min(ratio A, clip(ratio) A) [N], the clip binds [N]) without dual clip."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - float(config.eps_low), 1.0 + float(config.eps_high))
    return torch.maximum(unclipped, clipped), clipped > unclipped


@register_policy_loss("gspo")
def gspo(rows: LossRows, old_logp: torch.Tensor, advantages: torch.Tensor, config: LossConfig) -> TokenLoss:
    seq_log_ratio = _sequence_mean(rows, rows.logp - old_logp).detach()  # [B]
    log_s = rows.logp - rows.logp.detach() + seq_log_ratio[rows.layout.sequence]  # [N], value: the sequence's
    s = torch.exp(torch.clamp(log_s, max=10.0))
    loss, clipped = _clipped_surrogate(s, advantages, config)
    return TokenLoss(loss, clipped, _none(rows), s.detach())


@register_policy_loss("sapo")
def sapo(rows: LossRows, old_logp: torch.Tensor, advantages: torch.Tensor, config: LossConfig) -> TokenLoss:
    ratio = _ratio(rows.logp, old_logp)
    tau_pos = torch.full_like(ratio, float(config.tau_pos))
    tau = torch.where(advantages > 0, tau_pos, torch.full_like(ratio, float(config.tau_neg)))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return TokenLoss(-gate * advantages, _none(rows), _none(rows), ratio.detach())


@register_policy_loss("gpg")
def gpg(rows: LossRows, old_logp: torch.Tensor, advantages: torch.Tensor, config: LossConfig) -> TokenLoss:
    ratio = _ratio(rows.logp.detach(), old_logp)
    return TokenLoss(-rows.logp * advantages, _none(rows), _none(rows), ratio)


def _covariance(rows: LossRows, advantages: torch.Tensor) -> torch.Tensor:
    """[N] (A - mean A)(logp - mean logp), the means over the scored response rows (detached)."""
    mask = rows.response_mask
    count = mask.sum()
    logp = rows.logp.detach()
    mean_adv = (advantages * mask).sum() / count
    mean_logp = (logp * mask).sum() / count
    return (advantages - mean_adv) * (logp - mean_logp)


@register_policy_loss("clip_cov", batch_wide=True)
def clip_cov(rows: LossRows, old_logp: torch.Tensor, advantages: torch.Tensor, config: LossConfig) -> TokenLoss:
    ratio = torch.exp(rows.logp - old_logp)
    loss, clip_by_origin = _clipped_surrogate(ratio, advantages, config)
    cov = _covariance(rows, advantages)
    lb, ub = float(config.clip_cov_lb), float(config.clip_cov_ub)
    candidates = rows.response & ~clip_by_origin & (cov > lb) & (cov < ub)
    n_clip = max(int(float(config.clip_cov_ratio) * int(rows.response.sum())), 1)  # host read (as verl)
    idx = torch.nonzero(candidates).reshape(-1)  # rows, in order
    keep = torch.ones_like(ratio)
    if idx.numel() > 0:
        chosen = idx[torch.randperm(idx.numel())[:n_clip].to(idx.device)]
        keep = keep.index_fill(0, chosen, 0.0)
    return TokenLoss(loss * keep, keep == 0, _none(rows), ratio.detach())


@register_policy_loss("kl_cov", batch_wide=True)
def kl_cov(rows: LossRows, old_logp: torch.Tensor, advantages: torch.Tensor, config: LossConfig) -> TokenLoss:
    log_ratio = rows.logp - old_logp
    ratio = torch.exp(log_ratio)
    loss = -advantages * ratio
    idx = torch.nonzero(rows.response).reshape(-1)  # rows, in order (host read, as verl)
    penalised = _none(rows)
    if idx.numel() > 0:
        adv, logp = advantages[idx], rows.logp.detach()[idx]
        cov = (adv - adv.mean()) * (logp - logp.mean())
        k = max(1, int(idx.numel() * float(config.kl_cov_ratio)))
        penalised = penalised.index_fill(0, idx[torch.topk(cov, k, largest=True).indices], True)
    loss = torch.where(penalised, loss + float(config.ppo_kl_coef) * log_ratio.abs(), loss)
    return TokenLoss(loss, penalised, _none(rows), ratio.detach())


@register_policy_loss("geo_mean")
def geo_mean(rows: LossRows, old_logp: torch.Tensor, advantages: torch.Tensor, config: LossConfig) -> TokenLoss:
    log_ratio = rows.logp - old_logp
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -float(config.eps_low), float(config.eps_high))
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)  # [N]
    seq_ratio = torch.exp(_sequence_mean(rows, pessimistic))[rows.layout.sequence]  # [N], one per sequence
    clipped = (log_ratio != clamped) & (advantages != 0)
    return TokenLoss(-advantages * seq_ratio, clipped, _none(rows), seq_ratio.detach())


@register_policy_loss("cispo")
def cispo(rows: LossRows, old_logp: torch.Tensor, advantages: torch.Tensor, config: LossConfig) -> TokenLoss:
    ratio = _ratio(rows.logp.detach(), old_logp)
    weight = torch.clamp(ratio, 1.0 - float(config.eps_low), 1.0 + float(config.eps_high))
    return TokenLoss(-weight * advantages * rows.logp, ratio != weight, _none(rows), ratio)
