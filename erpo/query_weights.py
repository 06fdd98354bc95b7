"""Reference-derived per-query weights w_B(q) (docs/method.md section 3, the paper's Eq. 9).

    s(q) = l_0(q) / n(q)            dataset-static score (mean reference log-prob per prompt token)
    u(q):  prevalence  p(q)^gamma   p = fraction of training queries in q's bin of a K-bin
                                    equal-width histogram of the training scores
           softmax     exp(s / T_w)
           none        1
    w_B(q) = m u(q) / sum_B u, clipped to [w_min, w_max] and renormalised to mean 1.

Clip-then-renormalise, done naively, can push weights back out of the bounds. Here the
final weights are w = clip(c u, w_min, w_max) with the scale c chosen by bisection so
that mean(w) = 1: then both promises hold exactly (up to float64 rounding). mean(clip(c u))
is continuous and non-decreasing in c, so the root is unique up to flat stretches,
which all give the same w. When no clip binds, c = m / sum u and w is w_B unchanged.
"""
from __future__ import annotations

import math
import sys
from typing import Any

import torch

SCHEMES = ("prevalence", "softmax", "none")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_vector(name: str, t: object, *, allow_empty: bool = True) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype not in _FLOATS:
        raise ValueError(f"{name} must be a float tensor, got {t.dtype}")
    if not allow_empty and t.numel() == 0:
        raise ValueError(f"{name} must not be empty")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} must be finite")
    return t


def _out_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def query_scores(ref_query_logp: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
    """s(q) = l_0(q) / n(q): ref_query_logp [M] float, n_tokens [M] (> 0) -> [M] (fp32, fp64 for fp64 input)."""
    _check_vector("ref_query_logp", ref_query_logp)
    if not isinstance(n_tokens, torch.Tensor) or n_tokens.dim() != 1:
        raise ValueError("n_tokens must be a 1-D tensor")
    if n_tokens.shape[0] != ref_query_logp.shape[0]:
        raise ValueError(f"n_tokens has {n_tokens.shape[0]} entries but ref_query_logp has {ref_query_logp.shape[0]}")
    if n_tokens.numel() and not bool((n_tokens > 0).all()):
        raise ValueError("n_tokens must be positive (a query with no scored prompt token has no score)")
    out = _out_dtype(ref_query_logp)
    return (ref_query_logp.to(torch.float64) / n_tokens.to(torch.float64)).to(out)


def effective_sample_size(w: torch.Tensor) -> float:
    """(sum w)^2 / (m sum w^2) in (0, 1]: 1 for equal weights. w [m] >= 0, not all zero."""
    _check_vector("w", w, allow_empty=False)
    w = w.detach().to(torch.float64)
    if bool((w < 0).any()) or not float(w.sum()) > 0:
        raise ValueError("w must be >= 0 with a positive sum")
    return float(w.sum() ** 2 / (w.numel() * (w * w).sum()))


# The config key (TrainConfig, ERPOConfig) of each QueryWeighter argument that is named otherwise.
CONFIG_KEYS = {"scheme": "query_weighting", "temperature": "weight_temperature"}


def check_weighting(scheme: str, bins: int, gamma: float, temperature: float, w_min: float, w_max: float, *,
                    keys: dict[str, str] | None = None) -> None:
    """ValueError naming the argument (its name in ``keys`` when given) unless scheme is
    one of SCHEMES, bins an int >= 1, gamma finite >= 0, temperature finite > 0 and
    0 <= w_min <= 1 <= w_max < inf (weights of mean 1 must fit between the bounds)."""
    name = (keys or {}).get
    if scheme not in SCHEMES:
        raise ValueError(f"{name('scheme', 'scheme')} must be one of {SCHEMES}, got {scheme!r}")
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be an int >= 1, got {bins!r}")
    if not (0.0 <= float(gamma) < math.inf):
        raise ValueError(f"gamma must be finite and >= 0, got {gamma}")
    if not (0.0 < float(temperature) < math.inf):
        raise ValueError(f"{name('temperature', 'temperature')} must be positive and finite, got {temperature}")
    _check_bounds(w_min, w_max)


def _check_bounds(w_min: float, w_max: float) -> None:
    if not (0.0 <= float(w_min) <= 1.0):
        raise ValueError(f"w_min must lie in [0, 1] (mean-1 weights need w_min <= 1), got {w_min}")
    if not (1.0 <= float(w_max) < math.inf):
        raise ValueError(f"w_max must be finite and >= 1 (mean-1 weights need w_max >= 1), got {w_max}")


def _finite_scale(x: torch.Tensor, w_max: float) -> torch.Tensor:
    """x (float64, >= 0, finite) itself when its sum and w_max / (its smallest positive
    entry) are finite, as they are for any sane weights; else x / max(x) with the entries
    that no finite scale can lift to w_max set to 0 (they are below 1e-308 of the
    largest). Without it a sum that overflows, or a denormal entry, turns the scale c
    into inf or 0 and the weights into NaN, negative values or a mean far from 1."""
    positive = x > 0
    if not bool(positive.any()):
        return x
    if math.isfinite(float(x.sum())) and math.isfinite(w_max / float(x[positive].min())):
        return x
    x = x / x.max()
    return torch.where(x * sys.float_info.max >= 2 * w_max, x, torch.zeros_like(x))


def normalise_batch_weights(u: torch.Tensor, w_min: float = 0.1, w_max: float = 10.0) -> torch.Tensor:
    """w_B [m] from raw weights u [m] >= 0: mean exactly 1 and every entry in [w_min, w_max].

    w = clip(c u, w_min, w_max) with c found by bisection so that mean(w) = 1 (module
    docstring). If no c reaches mean 1 (only possible when some u are 0 and w_max is
    small), the positive-u queries sit at w_max and the zero-u queries share the rest
    equally, which lies in [w_min, 1]; all u = 0 gives ones. Returned in fp32 (fp64
    for fp64 input), on u's device.
    """
    _check_vector("u", u)
    _check_bounds(w_min, w_max)
    if bool((u < 0).any()):
        raise ValueError("u must be >= 0")
    m = u.numel()
    out = _out_dtype(u)
    if m == 0:
        return torch.empty(0, dtype=out, device=u.device)
    x = _finite_scale(u.detach().to(device="cpu", dtype=torch.float64), float(w_max))
    lo_b, hi_b = float(w_min), float(w_max)

    def mean_w(c: float) -> float:
        return float((x * c).clamp(lo_b, hi_b).mean())

    positive = x > 0
    if bool(positive.any()):
        c0 = m / float(x.sum())  # w_B = c0 u before clipping
        c_top = hi_b / float(x[positive].min())  # every positive u at w_max from here on
        w0 = x * c0
        if bool(((w0 >= lo_b) & (w0 <= hi_b)).all()):
            c = c0  # no clip binds: w_B as is
        elif mean_w(c_top) >= 1.0:
            lo, hi = 0.0, c_top  # mean_w(0) = w_min <= 1 <= mean_w(c_top)
            for _ in range(1100):  # halves until lo and hi are adjacent floats
                mid = 0.5 * (lo + hi)
                if mid <= lo or mid >= hi:
                    break
                if mean_w(mid) < 1.0:
                    lo = mid
                else:
                    hi = mid
            # hi has mean >= 1, lo mean <= 1: take the closer one.
            c = hi if abs(mean_w(hi) - 1.0) <= abs(mean_w(lo) - 1.0) else lo
        else:
            c = None
    else:
        c = None
    if c is not None:
        w = (x * c).clamp(lo_b, hi_b)
    else:
        k = int(positive.sum())
        rest = (m - k * hi_b) / (m - k)  # in [w_min, 1] when no c reaches mean 1
        w = torch.where(positive, torch.full_like(x, hi_b), torch.full_like(x, rest))
    return w.to(device=u.device, dtype=out)


class QueryWeighter:
    """Raw and batch-normalised query weights from the training set's scores.

    Args:
        train_scores: [M] float, s(q) of every training query (the histogram's data).
        scheme: "prevalence", "softmax" or "none".
        bins: K, the number of equal-width bins over [min, max] of train_scores.
        gamma: u = p^gamma (prevalence), >= 0.
        temperature: T_w of the softmax scheme, > 0.
        w_min, w_max: the clip bounds of the batch weights, w_min <= 1 <= w_max.
    """

    def __init__(
        self,
        train_scores: torch.Tensor,
        scheme: str = "prevalence",
        bins: int = 20,
        gamma: float = 1.0,
        temperature: float = 1.0,
        w_min: float = 0.1,
        w_max: float = 10.0,
    ) -> None:
        check_weighting(scheme, bins, gamma, temperature, w_min, w_max)
        _check_vector("train_scores", train_scores, allow_empty=False)
        self.scheme = scheme
        self.bins = bins
        self.gamma = float(gamma)
        self.temperature = float(temperature)
        self.w_min = float(w_min)
        self.w_max = float(w_max)
        train = train_scores.detach().to(device="cpu", dtype=torch.float64)
        lo, hi = float(train.min()), float(train.max())
        # K equal-width bins over [lo, hi]; bin k = [edge_k, edge_{k+1}), the last one closed.
        self.edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)  # [K + 1]
        counts = torch.bincount(self.bin_of(train), minlength=bins).to(torch.float64)  # [K]
        self.bin_fraction = counts / train.numel()  # [K] p of each bin

    @staticmethod
    def check_config(cfg: Any) -> None:
        """ValueError naming the key, for the weighting keys of a TrainConfig or an
        ERPOConfig (query_weighting, bins, gamma, weight_temperature, w_min, w_max): the
        checks of the weighter's own arguments, so both configs refuse what it refuses."""
        check_weighting(cfg.query_weighting, cfg.bins, cfg.gamma, cfg.weight_temperature, cfg.w_min, cfg.w_max,
                        keys=CONFIG_KEYS)

    @classmethod
    def from_config(cls, cfg: Any, train_scores: torch.Tensor) -> "QueryWeighter":
        """The weighter of a run: scheme, bins, gamma, temperature and bounds from a
        TrainConfig or ERPOConfig `cfg` (query_weighting, bins, gamma, weight_temperature,
        w_min, w_max)."""
        return cls(train_scores, scheme=cfg.query_weighting, bins=cfg.bins, gamma=cfg.gamma,
                   temperature=cfg.weight_temperature, w_min=cfg.w_min, w_max=cfg.w_max)

    def bin_of(self, scores: torch.Tensor) -> torch.Tensor:
        """[m] int64 bin of each score; a score below (above) the training range falls
        into the first (last) bin. All training scores equal: one populated bin."""
        s = scores.detach().to(device="cpu", dtype=torch.float64)
        if float(self.edges[-1]) == float(self.edges[0]):
            return torch.full(s.shape, self.bins - 1, dtype=torch.long)
        # number of interior edges <= s: 0 .. K-1, so out-of-range scores clamp to the edge bins
        return torch.bucketize(s, self.edges[1:-1], right=True)

    def raw(self, scores: torch.Tensor) -> torch.Tensor:
        """u(q) [m] for a batch of scores [m] (fp32, fp64 for fp64 scores; on scores' device).

        softmax is computed as exp((s - max_B s) / T_w): u up to one factor for the
        whole batch, which the batch normalisation removes.
        """
        _check_vector("scores", scores)
        out = _out_dtype(scores)
        s = scores.detach().to(device="cpu", dtype=torch.float64)
        if self.scheme == "none" or s.numel() == 0:
            u = torch.ones_like(s)
        elif self.scheme == "prevalence":
            u = self.bin_fraction[self.bin_of(s)] ** self.gamma
        else:
            z = s / self.temperature
            u = torch.exp(z - z.max())
        return u.to(device=scores.device, dtype=out)

    def batch_weights(self, scores: torch.Tensor) -> torch.Tensor:
        """w_B(q) [m]: mean 1, within [w_min, w_max] (normalise_batch_weights of raw)."""
        return normalise_batch_weights(self.raw(scores), self.w_min, self.w_max)
