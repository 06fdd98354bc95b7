"""LogitTransform: what both log-prob ops do to the raw logits before the softmax.

Per row, with r the raw logits (`logits`, or `hidden @ weight.T + bias`):
    z = softcap tanh(logit_scale r / softcap)    with a soft cap (Gemma 2), in the kernels
    z = logit_scale r                            without one: folded into the temperature
    s = z inv_T                                  inv_T per row, a runtime value
The public ops build it once per call (`LogitTransform.build`: every check of the three
arguments, and the folding); their custom op receives its fields as plain arguments
(`op_args`, a custom op takes tensors and floats, not objects) and rebuilds it
(`LogitTransform(*args)`); the Triton launches take `kernel_args()`, the reference
`reference_inv_t()` and `cap()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from ._utils import optional_positive_float, row_inv_temperature


def is_unit_scale(inv_temperature: Union[None, float, torch.Tensor], logit_scale: Optional[float]) -> bool:
    """Whether the logits are used unscaled, decided from the arguments alone (no tensor
    is read): no temperature (or the number 1) and no logit scale."""
    plain = inv_temperature is None or (not isinstance(inv_temperature, torch.Tensor) and float(inv_temperature) == 1.0)
    return plain and logit_scale is None


@dataclass(frozen=True)
class LogitTransform:
    """The per-call logit transform (module docstring), validated.

    inv_t: [N] fp32, contiguous; times logit_scale when there is no soft cap.
    softcap: the cap c > 0, or None.
    logit_scale: the scale inside the cap (None without a cap: it is folded into inv_t).
    unit: temperature 1 and no scale, known from the caller's arguments without reading
        a tensor; the reference then skips the per-chunk shift and scale.
    """

    inv_t: torch.Tensor
    softcap: Optional[float] = None
    logit_scale: Optional[float] = None
    unit: bool = False

    @staticmethod
    def build(
        inv_temperature: Union[None, float, torch.Tensor],
        n: int,
        device: torch.device,
        *,
        softcap: object = None,
        logit_scale: object = None,
        validate: bool = True,
    ) -> "LogitTransform":
        """Check the three arguments (ValueError naming the bad one; a tensor
        inv_temperature's values only when `validate`: it syncs) and fold a plain scale
        into the temperature (one rounding, no extra pass over the logits)."""
        inv_t = row_inv_temperature(inv_temperature, n, device, validate=validate)
        softcap = optional_positive_float("softcap", softcap)
        logit_scale = optional_positive_float("logit_scale", logit_scale)
        unit = is_unit_scale(inv_temperature, logit_scale)
        if logit_scale is not None and softcap is None:
            inv_t, logit_scale = inv_t * logit_scale, None
        return LogitTransform(inv_t.contiguous(), softcap, logit_scale, unit)

    def op_args(self) -> Tuple[torch.Tensor, Optional[float], Optional[float], bool]:
        """(inv_t, softcap, logit_scale, unit): the fields as a custom op's arguments."""
        return self.inv_t, self.softcap, self.logit_scale, self.unit

    def kernel_args(self) -> dict:
        """The Triton kernels' runtime arguments and flag (placeholders without a cap):
        softcap c, softcap_pre = logit_scale / c (the argument of tanh per raw logit),
        logit_scale (the backward's slope factor) and HAS_SOFTCAP."""
        cap = self.softcap
        scale = self.logit_scale or 1.0
        return dict(
            softcap=cap or 1.0,
            softcap_pre=scale / cap if cap else 1.0,
            logit_scale=scale,
            HAS_SOFTCAP=cap is not None,
        )

    def reference_inv_t(self) -> Optional[torch.Tensor]:
        """inv_t for the reference's chunks: None when `unit` (no shift, no scale)."""
        return None if self.unit else self.inv_t

    def cap(self, raw: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(z, dz/draw) for a chunk of raw logits in the reference: z = c tanh(logit_scale
        raw / c) and its slope logit_scale (1 - tanh^2); (raw, None) without a cap."""
        if self.softcap is None:
            return raw, None
        scale = self.logit_scale or 1.0
        t = torch.tanh(raw * (scale / self.softcap))
        return t * self.softcap, (1 - t * t).mul_(scale)
