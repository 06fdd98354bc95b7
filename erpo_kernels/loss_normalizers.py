"""LossNormalizers: the mini-batch-wide denominators of the loss (docs/method.md section
10), computed once per mini-batch and shared by its micro-batches."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ._utils import check_tensor
from .loss_batch import PackedLossBatch
from .row_layout import RowLayout


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
        return LossNormalizers(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def check_structure(self, m: int, device: torch.device) -> None:
        """ValueError naming the field that is not a tensor of the documented shape on `device`."""
        for f in fields(self):
            v = getattr(self, f.name)
            per_query = f.name in ("group_sizes", "prompt_copies")
            check_tensor(f"normalizers.{f.name}", v, ndim=1 if per_query else 0, device=device)
            if per_query and v.shape[0] != m:
                raise ValueError(f"normalizers.{f.name} has {v.shape[0]} entries, expected m = {m} (one per query)")
