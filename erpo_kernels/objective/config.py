"""LossConfig: the objective's hyper-parameters, each checked where it is defined."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .._utils import check_number
from ..weighted_k3 import MAX_GUARD
from .registry import check_policy_loss

ALGORITHMS = ("erpo", "grpo")
ROLLOUT_IS = ("none", "token", "sequence")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def check_clip_args(eps_low: float, eps_high: float, dual_clip: float) -> None:
    """ValueError unless 0 <= eps_low < 1, eps_high >= 0 and dual_clip > 1 (all finite numbers)."""
    if not (0.0 <= check_number("eps_low", eps_low) < 1.0):
        raise ValueError(f"eps_low must lie in [0, 1), got {eps_low}")
    if not (0.0 <= check_number("eps_high", eps_high) < float("inf")):
        raise ValueError(f"eps_high must be finite and >= 0, got {eps_high}")
    if not (1.0 < check_number("dual_clip", dual_clip) < float("inf")):
        raise ValueError(f"dual_clip must be finite and > 1, got {dual_clip}")


def check_loss_agg(loss_agg: str) -> None:
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")


@dataclass
class LossConfig:
    """Hyper-parameters of the objective (docs/method.md sections 2, 4, 5, 11).

    algorithm: "erpo" (L_PG(w_B) + alpha R_query) or "grpo" (L_PG(w = 1) + beta KL,
        KL the per-token k3 on response tokens aggregated with loss_agg). alpha:
        Query-KL coefficient (erpo).
    beta: per-token KL coefficient (grpo); 0 drops the term and needs no ref_logp.
    loss_agg: the aggregation of the per-token policy losses (verl's names): "token-mean",
        "seq-mean-token-mean", "seq-mean-token-sum" or "seq-mean-token-sum-norm" (the
        token sums divided by the constant loss_scale_factor: Dr. GRPO). eps_low, eps_high,
        dual_clip: the clip range and the dual-clip constant c (dual_clip: vanilla only). kl_guard: the linear guard c of the K3
        estimator (also applied to grpo's per-token k3; it changes nothing for
        |ref_logp - logp| <= kl_guard).
    rollout_is: truncated importance sampling against the rollout engine (needs
        batch.rollout_logp): "none", "token" (each token's policy loss times
        min(pi_old / pi_rollout, C)) or "sequence" (times min(prod_t pi_old / pi_rollout, C)
        over the sequence's response tokens); the weight is a constant under backprop.
    rollout_is_cap: C > 0, the truncation of the importance weight.
    entropy_coeff: >= 0, the entropy bonus's coefficient: L -= entropy_coeff * the mean
        response-token entropy, aggregated with loss_agg at w = 1 (verl's entropy_coeff);
        needs the entropy (objective/entropy.py).
    top_entropy_quantile: rho in [0, 1]: the policy loss trains on the response tokens
        whose entropy reaches the mini-batch's (1 - rho)-quantile only (TRL's
        top_entropy_quantile; the bonus too); 1 = every token.
    policy_loss: the per-token policy loss, a name of POLICY_LOSSES (docs/objective.md):
        vanilla (the clipped surrogate with dual clip), gspo, sapo, gpg, clip_cov, kl_cov,
        geo_mean, cispo; verl 0.9.1's names, parameters and defaults.
    loss_scale_factor: the constant of seq-mean-token-sum-norm (> 0; e.g. the longest
        response allowed); None with any other loss_agg.
    tau_pos, tau_neg: sapo's gate temperatures for positive and non-positive advantages.
    clip_cov_ratio, clip_cov_lb, clip_cov_ub: clip_cov's fraction of tokens whose gradient
        is dropped, drawn among those with lb < covariance < ub.
    kl_cov_ratio, ppo_kl_coef: kl_cov's fraction of tokens (largest covariance) that get
        the |log ratio| penalty, and its coefficient.
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
    entropy_coeff: float = 0.0
    top_entropy_quantile: float = 1.0
    policy_loss: str = "vanilla"
    loss_scale_factor: Optional[float] = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError naming the field that is out of range."""
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        check_loss_agg(self.loss_agg)
        for name in ("alpha", "beta", "eps_low", "eps_high", "dual_clip", "kl_guard", "rollout_is_cap"):
            check_number(name, getattr(self, name))
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
        self._validate_entropy()
        self._validate_policy_loss()

    @property
    def needs_entropy(self) -> bool:
        """The loss reads the response tokens' entropy (entropy_coeff > 0 or top_entropy_quantile < 1)."""
        return float(self.entropy_coeff) > 0 or float(self.top_entropy_quantile) < 1

    def _validate_entropy(self) -> None:
        """entropy_coeff finite and >= 0; top_entropy_quantile in [0, 1]."""
        if not (0.0 <= check_number("entropy_coeff", self.entropy_coeff) < float("inf")):
            raise ValueError(f"entropy_coeff must be finite and >= 0, got {self.entropy_coeff}")
        if not (0.0 <= check_number("top_entropy_quantile", self.top_entropy_quantile) <= 1.0):
            raise ValueError(f"top_entropy_quantile must lie in [0, 1] (1 = every token), got {self.top_entropy_quantile}")

    def _validate_policy_loss(self) -> None:
        """The policy loss's name and parameters, and loss_scale_factor with loss_agg."""
        check_policy_loss(self.policy_loss)
        for name in ("tau_pos", "tau_neg", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef"):
            check_number(name, getattr(self, name))
        for name in ("tau_pos", "tau_neg"):
            if not (0.0 < float(getattr(self, name)) < float("inf")):
                raise ValueError(f"{name} must be finite and > 0, got {getattr(self, name)}")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if not (0.0 < float(getattr(self, name)) <= 1.0):
                raise ValueError(f"{name} must lie in (0, 1] (a fraction of the response tokens), got {getattr(self, name)}")
        if not (float(self.clip_cov_lb) < float(self.clip_cov_ub) < float("inf")):
            raise ValueError(f"clip_cov_lb must be < clip_cov_ub (finite), got {self.clip_cov_lb} and {self.clip_cov_ub}")
        if not (0.0 <= float(self.ppo_kl_coef) < float("inf")):
            raise ValueError(f"ppo_kl_coef must be finite and >= 0, got {self.ppo_kl_coef}")
        norm = self.loss_agg == "seq-mean-token-sum-norm"
        if self.loss_scale_factor is None:
            if norm:
                raise ValueError("loss_scale_factor is required with loss_agg='seq-mean-token-sum-norm' "
                                 "(a constant, e.g. the longest response allowed)")
        elif not norm:
            raise ValueError(f"loss_scale_factor applies to loss_agg='seq-mean-token-sum-norm' only, "
                             f"got it with loss_agg={self.loss_agg!r}: leave it unset, or use that loss_agg")
        elif not (0.0 < check_number("loss_scale_factor", self.loss_scale_factor) < float("inf")):
            raise ValueError(f"loss_scale_factor must be finite and > 0, got {self.loss_scale_factor}")
