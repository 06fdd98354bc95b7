"""LossConfig: the objective's hyper-parameters, each checked where it is defined."""
from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Optional, Tuple, Union

from .._utils import check_number
from ..weighted_k3 import MAX_GUARD
from .registry import check_policy_loss

ALGORITHMS = ("erpo", "grpo")
ROLLOUT_IS = ("none", "token", "sequence")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")
# verl 0.9.1's rejection-sampling statistics of log(pi / pi_rollout) (rollout_rs): per token, or
# the sum / mean / max over a sequence's response tokens of k1, k2 or k3
ROLLOUT_RS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def rollout_rs_bounds(rollout_rs: str, threshold: Union[str, float, None]) -> Tuple[Tuple[str, Optional[float], float], ...]:
    """The rejection tests of rollout_rs (comma-separated options of ROLLOUT_RS, "none" for
    none) with rollout_rs_threshold (one threshold for all, or one per option, comma-
    separated): (option, lower, upper) each, a token kept where every option's statistic
    lies in [lower, upper] (lower None: no lower bound). k1 options: ratio bounds
    "lower_upper" (one number u: [1/u, u]), compared in log space; k2 / k3: an upper bound.
    ValueError naming rollout_rs or rollout_rs_threshold."""
    if rollout_rs == "none":
        if threshold is not None:
            raise ValueError(f"rollout_rs_threshold applies with rollout_rs only, got {threshold!r} with rollout_rs='none'")
        return ()
    options = [o.strip() for o in str(rollout_rs).split(",") if o.strip()]
    options = list(dict.fromkeys(options))  # each once, in order
    if not options or any(o not in ROLLOUT_RS for o in options):
        raise ValueError(f"rollout_rs must be 'none' or comma-separated options of {ROLLOUT_RS}, got {rollout_rs!r}")
    if threshold is None or isinstance(threshold, bool) or not isinstance(threshold, (str, int, float)):
        raise ValueError(f"rollout_rs_threshold is required with rollout_rs={rollout_rs!r} (e.g. '0.5_2.0' for k1, "
                         f"a number for k2 / k3)")
    specs = [p.strip() for p in str(threshold).split(",") if p.strip()]
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ValueError(f"rollout_rs_threshold needs one threshold, or one per rollout_rs option ({len(options)}), "
                         f"got {threshold!r}")
    bounds = []
    for option, spec in zip(options, specs):
        parts = spec.split("_")
        try:
            numbers = [float(x) for x in parts]
        except ValueError:
            raise ValueError(f"rollout_rs_threshold for {option} must be numbers, got {spec!r}") from None
        if option.endswith("k1"):
            if len(numbers) == 1:
                numbers = [1.0 / numbers[0] if numbers[0] > 0 else -1.0, numbers[0]]
            ok = len(numbers) == 2 and 0 < numbers[0] <= numbers[1] < math.inf
            if not ok:
                raise ValueError(f"rollout_rs_threshold for {option} must be 'lower_upper' ratio bounds with "
                                 f"0 < lower <= upper (or one upper bound u: [1/u, u]), got {spec!r}")
            bounds.append((option, math.log(numbers[0]), math.log(numbers[1])))
        else:
            if len(numbers) != 1 or not (0 < numbers[0] < math.inf):
                raise ValueError(f"rollout_rs_threshold for {option} must be one finite number > 0, got {spec!r}")
            bounds.append((option, None, numbers[0]))
    return tuple(bounds)


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
    dppo_tv, dppo_kl read eps_low / eps_high as their trust-region thresholds and
        dual_clip as the truncation of their ratio (verl's clip_ratio_low / _high / _c).
    dro_beta: dro's quadratic log-ratio coefficient (> 0), required with policy_loss="dro"
        (verl's policy_loss.dro_beta, no default); None otherwise.
    bypass_loss_type: bypass_mode's loss, "ppo_clip" (vanilla on pi_theta / pi_rollout,
        no importance weight: rollout_is must be "none") or "reinforce" (-A logp times
        rollout_is's weight of pi_theta / pi_rollout); verl's rollout_correction.loss_type.
    rollout_rs, rollout_rs_threshold: rejection of the response tokens whose divergence
        between the trainer's policy (pi_old; pi_theta with bypass_mode) and the rollout's
        (needs batch.rollout_logp, or old_logp with bypass_mode) passes a threshold: "none",
        or comma-separated options of ROLLOUT_RS (rollout_rs_bounds); a rejected token counts
        with loss 0, the denominators of loss_agg unchanged but seq-mean-token-mean's, each
        sequence's kept tokens (verl's). verl's names.
    vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: vespo's gamma weight
        phi(w) = exp(lambda + k log w - lambda w) for A >= 0 and A < 0 (TRL's names).
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
    dro_beta: Optional[float] = None
    bypass_loss_type: str = "ppo_clip"
    rollout_rs: str = "none"
    rollout_rs_threshold: Optional[Union[str, float]] = None
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

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
        self._validate_peer_losses()

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

    def _validate_peer_losses(self) -> None:
        """dro_beta, bypass_loss_type, rollout_rs / rollout_rs_threshold and vespo's constants."""
        if self.dro_beta is not None and not (0.0 < check_number("dro_beta", self.dro_beta) < float("inf")):
            raise ValueError(f"dro_beta must be finite and > 0, got {self.dro_beta}")
        if self.policy_loss == "dro" and self.dro_beta is None:
            raise ValueError("dro_beta is required with policy_loss='dro' (> 0, e.g. 0.1)")
        if self.bypass_loss_type not in BYPASS_LOSS_TYPES:
            raise ValueError(f"bypass_loss_type must be one of {BYPASS_LOSS_TYPES}, got {self.bypass_loss_type!r}")
        if self.policy_loss == "bypass_mode" and self.bypass_loss_type == "ppo_clip" and self.rollout_is != "none":
            raise ValueError(f"rollout_is={self.rollout_is!r} does not apply with policy_loss='bypass_mode' and "
                             "bypass_loss_type='ppo_clip' (its ratio pi_theta / pi_rollout is the correction): set "
                             "rollout_is='none', or bypass_loss_type='reinforce'")
        rollout_rs_bounds(self.rollout_rs, self.rollout_rs_threshold)
        for name in ("vespo_k_pos", "vespo_k_neg"):
            if not (0.0 <= check_number(name, getattr(self, name)) < float("inf")):
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")
        for name in ("vespo_lambda_pos", "vespo_lambda_neg"):
            if not (0.0 < check_number(name, getattr(self, name)) < float("inf")):
                raise ValueError(f"{name} must be finite and > 0, got {getattr(self, name)}")
