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
    dppo_tv   -A * sg(min(r, dual_clip)) * logp on the tokens inside the binary trust region
              pi - pi_old <= eps_high (A > 0) / >= -eps_low (A <= 0), 0 outside (DPPO)
    dppo_kl   the same with the binary KL of (pi_old, pi) as the divergence (DPPO)
    dro       -(A logp - dro_beta / 2 * lr^2) (DRO)
    bypass_mode  old_logp = the rollout's log-probs: vanilla (bypass_loss_type="ppo_clip") or
              -A logp (bypass_loss_type="reinforce", times rollout_is's weight against
              pi_theta); policy_term supplies the rollout's log-probs (verl's bypass mode)
    luspo     gspo's clipped surrogate on the sequence ratio, log s clamped at 20 (LUSPO:
              its length weighting is loss_agg="seq-mean-token-sum")
    vespo     -sg(phi(w)) * A * logp, w = exp(sum_i lr) the sequence ratio, phi(w) =
              exp(lambda + k log w - lambda w), (k, lambda) by the sign of A (VESPO)

clip_cov and kl_cov rank the tokens of the call (a micro-batch, as verl's do), which reads
their count on the host; clip_cov draws its subset with torch's global generator
(torch.randperm), as verl does, so a seeded run repeats.
"""
from __future__ import annotations

import math
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


def _sequence_surrogate(rows: LossRows, old_logp: torch.Tensor, advantages: torch.Tensor, config: LossConfig,
                        log_cap: float) -> TokenLoss:
    """The clip (no dual clip) on s_t = sg(s) pi_t / sg(pi_t), s = exp(mean_i lr) the
    sequence's ratio, log s_t clamped at log_cap: every token's value is the sequence's,
    d loss_t / d logp_t = s * d loss / d s (gspo, luspo)."""
    seq_log_ratio = _sequence_mean(rows, rows.logp - old_logp).detach()  # [B]
    log_s = rows.logp - rows.logp.detach() + seq_log_ratio[rows.layout.sequence]  # [N], value: the sequence's
    s = torch.exp(torch.clamp(log_s, max=log_cap))
    loss, clipped = _clipped_surrogate(s, advantages, config)
    return TokenLoss(loss, clipped, _none(rows), s.detach())


@register_policy_loss("gspo")
def gspo(rows: LossRows, old_logp: torch.Tensor, advantages: torch.Tensor, config: LossConfig) -> TokenLoss:
    return _sequence_surrogate(rows, old_logp, advantages, config, 10.0)  # verl caps log s at 10


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


def _binary_trust_region(rows: LossRows, old_logp: torch.Tensor, advantages: torch.Tensor, config: LossConfig,
                         inside: torch.Tensor) -> TokenLoss:
    """DPPO's loss given inside [N] bool (the token lies in its binary trust region):
    -A sg(min(r, dual_clip)) logp inside, 0 outside; clipped = outside, dual = the
    truncation binds inside."""
    ratio = _ratio(rows.logp.detach(), old_logp)
    cap = float(config.dual_clip)
    loss = torch.where(inside, -advantages * torch.clamp(ratio, max=cap) * rows.logp, rows.zeros)
    return TokenLoss(loss, ~inside, inside & (ratio > cap), ratio)


@register_policy_loss("dppo_tv")
def dppo_tv(rows: LossRows, old_logp: torch.Tensor, advantages: torch.Tensor, config: LossConfig) -> TokenLoss:
    shift = torch.exp(rows.logp.detach()) - torch.exp(old_logp)  # [N] pi - pi_old
    inside = torch.where(advantages > 0, shift <= float(config.eps_high), shift >= -float(config.eps_low))
    return _binary_trust_region(rows, old_logp, advantages, config, inside)


@register_policy_loss("dppo_kl")
def dppo_kl(rows: LossRows, old_logp: torch.Tensor, advantages: torch.Tensor, config: LossConfig) -> TokenLoss:
    logp = rows.logp.detach()
    prob, old_prob = torch.exp(logp), torch.exp(old_logp)
    binary_kl = old_prob * (old_logp - logp) + (1 - old_prob) * torch.log((1 - old_prob + 1e-8) / (1 - prob + 1e-8))
    inside = torch.where(advantages > 0, (binary_kl <= float(config.eps_high)) | (prob <= old_prob),
                         (binary_kl <= float(config.eps_low)) | (prob >= old_prob))
    return _binary_trust_region(rows, old_logp, advantages, config, inside)


@register_policy_loss("dro")
def dro(rows: LossRows, old_logp: torch.Tensor, advantages: torch.Tensor, config: LossConfig) -> TokenLoss:
    log_ratio = rows.logp - old_logp
    loss = -(rows.logp * advantages - 0.5 * float(config.dro_beta) * log_ratio.square())
    return TokenLoss(loss, _none(rows), _none(rows), _ratio(rows.logp.detach(), old_logp))


@register_policy_loss("bypass_mode")
def bypass_mode(rows: LossRows, old_logp: torch.Tensor, advantages: torch.Tensor, config: LossConfig) -> TokenLoss:
    """old_logp: the rollout's log-probs here (policy_term passes them, bypass_rollout_logp)."""
    if config.bypass_loss_type == "ppo_clip":
        return vanilla(rows, old_logp, advantages, config)
    ratio = _ratio(rows.logp.detach(), old_logp)
    return TokenLoss(-advantages * rows.logp, _none(rows), _none(rows), ratio)


@register_policy_loss("luspo")
def luspo(rows: LossRows, old_logp: torch.Tensor, advantages: torch.Tensor, config: LossConfig) -> TokenLoss:
    return _sequence_surrogate(rows, old_logp, advantages, config, LOG_RATIO_CLAMP)


VESPO_LOG_W_MIN = math.log(1e-8)  # TRL's lower clamp of log w


@register_policy_loss("vespo")
def vespo(rows: LossRows, old_logp: torch.Tensor, advantages: torch.Tensor, config: LossConfig) -> TokenLoss:
    log_ratio = torch.clamp(rows.logp.detach() - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N]
    n_seq = rows.layout.response_length.shape[0]
    seq_log_w = torch.zeros(n_seq, dtype=log_ratio.dtype, device=log_ratio.device).index_add(
        0, rows.layout.sequence, torch.where(rows.response, log_ratio, rows.zeros))  # [B] sum_i lr
    log_w = torch.clamp(seq_log_w, VESPO_LOG_W_MIN, LOG_RATIO_CLAMP)[rows.layout.sequence]  # [N]
    nonneg = advantages >= 0
    k = torch.where(nonneg, torch.full_like(log_w, float(config.vespo_k_pos)),
                    torch.full_like(log_w, float(config.vespo_k_neg)))
    lam = torch.where(nonneg, torch.full_like(log_w, float(config.vespo_lambda_pos)),
                      torch.full_like(log_w, float(config.vespo_lambda_neg))).clamp(min=1e-4)  # TRL's floor
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return TokenLoss(-phi * advantages * rows.logp, _none(rows), _none(rows), torch.exp(log_w))
