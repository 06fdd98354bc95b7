"""LossRows: the per-call row view every term of the loss reads (docs/method.md
sections 2-5), built from the batch's RowLayout. Row space throughout: no gather of the
response rows, which would need their count on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._utils import compute_dtype
from .batch import LossNormalizers, PackedLossBatch, RowLayout


@dataclass
class LossRows:
    """What every term of the loss reads, built once per call in the compute dtype
    (fp32, fp64 for fp64 log-probs).

    logp [N]: the log-probs, 0 on ignored rows. response [N] bool and response_mask [N]
    (1.0 / 0.0): the scored response rows; zeros [N]. group_index [B] and query_of_row
    [N]: the query of each sequence and row. n_tokens (T, at least 1), n_queries (m),
    weights [m] (w_B(q) for erpo, 1 for grpo) with weight_mass (sum w) and
    weight_sq_mass (sum w^2): the mini-batch's, from `normalizers`.
    """

    dtype: torch.dtype
    layout: RowLayout
    normalizers: LossNormalizers
    logp: torch.Tensor
    response: torch.Tensor
    response_mask: torch.Tensor
    zeros: torch.Tensor
    group_index: torch.Tensor
    query_of_row: torch.Tensor
    n_tokens: torch.Tensor
    n_queries: torch.Tensor
    weights: torch.Tensor
    weight_mass: torch.Tensor
    weight_sq_mass: torch.Tensor

    @staticmethod
    def build(
        logp: torch.Tensor, batch: PackedLossBatch, normalizers: LossNormalizers, query_weighted: bool
    ) -> "LossRows":
        """The rows of `batch` for per-row log-probs `logp` [N]; query_weighted: use the
        batch's query_weights (erpo) or ones (grpo)."""
        dtype = compute_dtype(logp.dtype)
        layout = RowLayout(batch)
        response_mask = layout.response.to(dtype)
        zeros = torch.zeros_like(response_mask)
        group_index = batch.group_index.long()
        n_queries = normalizers.n_queries.to(dtype)
        if query_weighted:
            weights = batch.query_weights.detach().to(dtype)  # [m] w_B
            weight_mass, weight_sq_mass = normalizers.weight_mass.to(dtype), normalizers.weight_sq_mass.to(dtype)
        else:
            weights = torch.ones(batch.num_queries, dtype=dtype, device=logp.device)
            weight_mass, weight_sq_mass = n_queries, n_queries
        return LossRows(
            dtype=dtype, layout=layout, normalizers=normalizers,
            logp=torch.where(layout.scored, logp.to(dtype), zeros),
            response=layout.response, response_mask=response_mask, zeros=zeros,
            group_index=group_index, query_of_row=group_index[layout.sequence],
            n_tokens=normalizers.n_tokens.to(dtype).clamp(min=1), n_queries=n_queries,
            weights=weights, weight_mass=weight_mass, weight_sq_mass=weight_sq_mass,
        )  # fmt: skip

    def response_mean(self, values: torch.Tensor) -> torch.Tensor:
        """sum over scored response rows of values [N] / T (the token mean)."""
        return (values * self.response_mask).sum() / self.n_tokens

    def response_fraction(self, flags: torch.Tensor) -> torch.Tensor:
        """The fraction of the T scored response rows where flags [N] bool holds."""
        return (flags & self.response).to(self.dtype).sum() / self.n_tokens
