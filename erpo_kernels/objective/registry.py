"""POLICY_LOSSES: the registry of row-space policy terms, one signature for all.

A policy loss turns the scored rows into one loss value per row; the objective then
aggregates those values (LossConfig.loss_agg), weights them per query (w_B for erpo)
and adds the Query-KL. Registering a variant is one function and one decorator line:

    @register_policy_loss("name")
    def name(rows: LossRows, old_logp: Tensor, advantages: Tensor, config: LossConfig) -> TokenLoss

rows.logp [N] is pi_theta's log-prob of each row (differentiable, 0 on ignored rows),
old_logp [N] pi_old's (detached), advantages [N] each row's sequence advantage (detached);
only the scored response rows (rows.response) are read. The variants are in
policy_losses.py, their formulas in docs/objective.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Set

import torch


@dataclass
class TokenLoss:
    """What a policy loss returns, per row [N] (values off the scored response rows do not
    matter): loss (differentiable), clipped (bool: a clip or a selection acted, the
    pg/clipfrac metric), dual (bool: the dual clip bound, pg/dual_clipfrac), ratio
    (detached pi_theta / pi_old, or the variant's own ratio, pg/ratio_mean)."""

    loss: torch.Tensor
    clipped: torch.Tensor
    dual: torch.Tensor
    ratio: torch.Tensor


PolicyLoss = Callable[..., TokenLoss]
POLICY_LOSSES: Dict[str, PolicyLoss] = {}
# The registered losses whose value on a row depends on rows of other sequences (a ranking
# or a mean over every scored token of the call, as clip_cov's and kl_cov's covariance
# selections): erpo_loss cannot score them a chunk of sequences at a time, so it runs them
# on the 4-GEMM path (docs/objective.md). Every other loss is chunk-local: its value on a
# row reads that row's sequence only (and the LossNormalizers).
BATCH_WIDE: Set[str] = set()


def register_policy_loss(name: str, *, batch_wide: bool = False) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: POLICY_LOSSES[name] = the function (a name registered twice is a ValueError).

    batch_wide: the loss reads rows of other sequences of the call (a selection over the
    whole batch); False (the default): it reads each row's own sequence only, so erpo_loss
    may score it a chunk of whole sequences at a time (its 3-GEMM path)."""

    def register(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        if batch_wide:
            BATCH_WIDE.add(name)
        return fn

    return register


def is_batch_wide(name: str) -> bool:
    """Whether the registered policy loss `name` was registered with batch_wide=True."""
    return name in BATCH_WIDE


def check_policy_loss(name: str) -> None:
    """ValueError unless `name` is a registered policy loss."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"policy_loss must be one of {tuple(POLICY_LOSSES)}, got {name!r}")
