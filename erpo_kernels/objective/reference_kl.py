"""The KL to a reference model: grpo's beta term (docs/method.md section 5) and, for
either algorithm, the policy_kl metric whenever per-token reference log-probs are given.

    KL = sum_t c_t k3(ref_logp_t - logp_t)      over the scored response rows,

with c_t the policy term's aggregation coefficients at w = 1 (token-mean, or
seq-mean-token-mean as DeepSeekMath eq. 3), computed as (sum_t c_t) * weighted_k3(., c).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from ..weighted_k3 import weighted_k3
from .rows import LossRows


def reference_kl_term(
    rows: LossRows, ref_logp: torch.Tensor, unit: torch.Tensor, guard: float, backend: str, optimised: bool
) -> torch.Tensor:
    """The KL (0-d) from ref_logp [N] and the coefficients unit [N]; `optimised`: its
    gradient is wanted (grpo with beta > 0), else it is a metric only."""
    ref_rows = torch.where(rows.response, ref_logp.detach().to(rows.dtype), rows.zeros)  # [N]
    logp_rows = torch.where(rows.response, rows.logp, rows.zeros)  # [N]
    with nullcontext() if optimised else torch.no_grad():
        return unit.sum() * weighted_k3(logp_rows, ref_rows, unit, guard=guard, backend=backend, validate=False)
