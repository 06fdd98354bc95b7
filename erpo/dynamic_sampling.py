"""The groups one step samples, and the pieces of DAPO's dynamic sampling (filter_groups).

A group is one query's G responses with their rewards. A group whose rewards are all
equal has advantage 0 for every response (docs/method.md section 4): it adds nothing
to the policy gradient. DAPO (Yu et al. 2025, "Dynamic Sampling") drops such groups and
samples new queries until the batch is full again; the trainer's loop
(Trainer._dynamic_sampling) does that with these pieces:

    uniform_groups(rewards)        which groups carry no learning signal
    refill_indices(...)            the new queries of each further rollout batch
    SampledGroups.take / .concat   select and join groups across rollout batches
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from .data import derived_seed


def uniform_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[m] bool from rewards [m, G]: True where every response of the group has the same
    reward (exactly: their group advantages are 0)."""
    return rewards.max(dim=1).values == rewards.min(dim=1).values


def refill_indices(num_examples: int, queries_per_step: int, step: int, seed: int, draw: int,
                   exclude: Sequence[int]) -> List[int]:
    """The dataset indices of further rollout batch `draw` (1, 2, ...) of step `step`: a
    permutation seeded by (seed, step) of the dataset without `exclude` (the step's own
    queries), cut into batches of queries_per_step; [] once the dataset has no whole
    batch left. A step's refills are the same on every start of a run (resume is exact)."""
    if draw < 1:
        raise ValueError(f"draw must be >= 1, got {draw}")
    g = torch.Generator().manual_seed(derived_seed(seed, "refill", step))
    left = set(exclude)
    order = [i for i in torch.randperm(num_examples, generator=g).tolist() if i not in left]
    batch = order[(draw - 1) * queries_per_step:draw * queries_per_step]
    return batch if len(batch) == queries_per_step else []


@dataclass
class SampledGroups:
    """m groups as sampled and scored: idx [m] dataset indices, prompts [m] token lists,
    responses [m][G] token lists (each up to and including its EOS), logprobs [m][G][L]
    (the engine's log-probs of the response tokens) or None, rewards [m, G] (the task's
    reward), truncated [m, G] (1.0: cut off at max_new_tokens without an EOS), support
    [m][G] of [L, ceil(V / 32)] int32 (each response token's kept set, Rollout.support) or None."""

    idx: List[int]
    prompts: List[List[int]]
    responses: List[List[List[int]]]
    logprobs: Optional[List[List[List[float]]]]
    rewards: torch.Tensor
    truncated: torch.Tensor
    support: Optional[List[List[torch.Tensor]]] = None

    def __len__(self) -> int:
        return len(self.idx)

    def lengths(self) -> torch.Tensor:
        """[m, G] float: the number of tokens of each response (its EOS included)."""
        return torch.tensor([[float(len(r)) for r in group] for group in self.responses]).reshape(self.rewards.shape)

    def take(self, rows: Sequence[int]) -> "SampledGroups":
        """The groups at positions `rows`, in that order."""
        rows = [int(r) for r in rows]
        pick = torch.tensor(rows, dtype=torch.long)
        return SampledGroups(
            [self.idx[r] for r in rows], [self.prompts[r] for r in rows], [self.responses[r] for r in rows],
            None if self.logprobs is None else [self.logprobs[r] for r in rows],
            self.rewards[pick].reshape(len(rows), self.rewards.shape[1]),
            self.truncated[pick].reshape(len(rows), self.truncated.shape[1]),
            None if self.support is None else [self.support[r] for r in rows],
        )

    @staticmethod
    def concat(parts: Sequence["SampledGroups"]) -> "SampledGroups":
        """The groups of `parts` one after another (at least one part; logprobs None
        unless every part has them)."""
        if not parts:
            raise ValueError("concat needs at least one SampledGroups")
        logprobs = None if any(p.logprobs is None for p in parts) else [lp for p in parts for lp in p.logprobs]
        support = None if any(p.support is None for p in parts) else [s for p in parts for s in p.support]
        return SampledGroups(
            [i for p in parts for i in p.idx], [q for p in parts for q in p.prompts],
            [g for p in parts for g in p.responses], logprobs,
            torch.cat([p.rewards for p in parts]), torch.cat([p.truncated for p in parts]), support,
        )
