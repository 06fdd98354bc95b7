"""The objective's entropy terms: the entropy bonus (entropy_coeff, verl's) and the
training on the highest-entropy tokens only (top_entropy_quantile, TRL 1.16's
semantics of "Beyond the 80/20 Rule", Wang et al. 2025). Both read H_t, the entropy of
the policy's distribution at each response row (linear_token_logprobs(...,
return_entropy=True), differentiable, at the row's temperature).

Selection with rho = top_entropy_quantile < 1:
    h     = quantile_{1 - rho}({H_t : t a scored response row of the mini-batch})
            (linear interpolation, as torch.quantile and TRL, in the entropies' dtype:
            fp32, or fp64 for fp64 entropies, where TRL would round to fp32 first)
    s_t   = H_t >= h                       (rho = 0: only the largest entropy)
    L_PG  = sum_t c_t w(q_t) s_t loss_t    (the denominators of loss_agg unchanged:
                                            the tokens left out count, with loss 0)
Bonus with beta_H = entropy_coeff > 0:
    L    -= beta_H * sum_t u_t s_t H_t     (u_t: loss_agg's coefficients at w = 1, the
                                            policy loss's aggregation; s_t = 1 without
                                            the selection)
Its gradient is beta_H u_t s_t dH_t/dz through the entropy's backward; s_t is a constant.
The threshold is a mini-batch quantity: a micro-batch (or a rank) takes it from the
caller (LossNormalizers.entropy_threshold), computed by `entropy_threshold` over the
`response_entropies` of every row of the mini-batch (a no-grad pass at the current
weights), so the micro-batches' losses still add up to the mini-batch's.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .batch import PackedLossBatch, RowLayout
from .rows import LossRows


def _exact(entropy: torch.Tensor) -> torch.Tensor:
    """entropy detached, in fp64 when it is fp64, else fp32."""
    return entropy.detach().to(torch.float64 if entropy.dtype == torch.float64 else torch.float32)


def response_entropies(entropy: torch.Tensor, batch: PackedLossBatch) -> torch.Tensor:
    """[N] fp32 (fp64 for fp64 entropy; detached): entropy [N] on the scored response rows of `batch`, +inf on
    every other row: what entropy_threshold reads. The vectors of several calls (the
    micro-batches of a mini-batch, the ranks, padded with +inf) may be concatenated."""
    return torch.where(RowLayout(batch).response, _exact(entropy), math.inf)


def entropy_threshold(values: torch.Tensor, top_entropy_quantile: float) -> torch.Tensor:
    """0-d, values' dtype (fp32 or fp64): the (1 - top_entropy_quantile)-quantile of the
    finite entries of values [n] (response_entropies: +inf on the rows that do not
    count), computed as torch.quantile computes it (linear interpolation at the rank
    q (T - 1), in that dtype) without reading their count T on the host; +inf when
    T = 0 (no row is selected)."""
    ordered = _exact(values).sort().values  # [n]: the T finite values first, ascending
    q = torch.tensor(1.0 - float(top_entropy_quantile), dtype=ordered.dtype, device=values.device)
    last = (torch.isfinite(ordered).sum() - 1).clamp(min=0)  # T - 1
    ranks = q * last.to(ordered.dtype)  # torch.quantile's ranks
    below = ranks.to(torch.long).reshape(1)
    above = ranks.ceil().to(torch.long).reshape(1)
    low, high = ordered.gather(0, below)[0], ordered.gather(0, above)[0]  # a gather: no index read on the host
    return torch.where(torch.isinf(high), high, torch.lerp(low, high, ranks - below[0]))


def selected_tokens(rows: LossRows, entropy: torch.Tensor, top_entropy_quantile: float,
                    threshold: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[N] bool: the scored response rows whose entropy reaches the threshold (module
    docstring); `threshold` 0-d (the mini-batch's) or None (this call's rows')."""
    if threshold is None:
        values = torch.where(rows.response, _exact(entropy), math.inf)  # [N]
        threshold = entropy_threshold(values, top_entropy_quantile)
    return (entropy.detach() >= threshold.to(entropy.device)) & rows.response


def entropy_bonus(rows: LossRows, entropy: torch.Tensor, unit: torch.Tensor,
                  selected: Optional[torch.Tensor]) -> torch.Tensor:
    """0-d: sum_t u_t s_t H_t over the scored response rows (differentiable in entropy [N]);
    unit [N]: loss_agg's coefficients at w = 1; selected [N] bool or None (every row)."""
    keep = rows.response if selected is None else selected
    return (unit * torch.where(keep, entropy.to(rows.dtype), rows.zeros)).sum()
