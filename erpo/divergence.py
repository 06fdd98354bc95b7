"""Divergence warnings of a training run: one line each, with what to try.

`DivergenceMonitor.check(metrics)` looks at one step's metrics (trainer.step) and
returns the warnings it raises, and whether the step is fatal: a non-finite loss or
gradient norm has already reached (or would reach) the weights, so the run stops before
that step's checkpoint is written; the last checkpoint is still a good one.

Warned about (once per episode, again only after the metric came back):
- loss, Query-KL or gradient norm non-finite (fatal);
- |loss| above LOSS_LIMIT, Query-KL above QKL_LIMIT, gradient norm (before clipping)
  above GRAD_NORM_LIMIT, or above both GRAD_NORM_JUMP times the median of the last steps
  and GRAD_NORM_FLOOR;
- every reward exactly 0 for ZERO_REWARD_STEPS steps in a row (no learning signal).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

LOSS_LIMIT = 100.0  # |loss|: the clipped policy loss of std-normalised advantages is O(1)
QKL_LIMIT = 1.0  # Query-KL (k3 of the prompt log-likelihood, nats): the demo stays below 0.2
GRAD_NORM_LIMIT = 1e3  # gradient norm before clipping
GRAD_NORM_JUMP = 100.0  # ... or this many times the median of the last GRAD_NORM_WINDOW steps,
GRAD_NORM_FLOOR = 1.0  # when above this too (the default clip): a norm of 5e-5 after norms of 0 is no explosion
GRAD_NORM_WINDOW = 20
ZERO_REWARD_STEPS = 10  # all rewards 0 for this many steps in a row

TRY_STABLE = "try a lower lr= (now {lr:.3g}), a smaller max_grad_norm=, or (erpo) a larger alpha="


@dataclass
class DivergenceMonitor:
    """Per-run state: recent gradient norms, the zero-reward streak, what is being warned about."""

    grad_norms: List[float] = field(default_factory=list)
    zero_reward_streak: int = 0
    active: Dict[str, bool] = field(default_factory=dict)

    def check(self, metrics: Dict[str, float]) -> Tuple[List[str], bool]:
        """(one-line warnings for this step, fatal) from trainer metrics: "step", "loss",
        "qkl/value", "grad_norm", "reward/mean", "reward/std", "lr"."""
        step = int(metrics["step"])
        loss = float(metrics.get("loss", 0.0))
        qkl = float(metrics.get("qkl/value", 0.0))
        grad = float(metrics.get("grad_norm", 0.0))
        out: List[str] = []
        try_stable = TRY_STABLE.format(lr=float(metrics.get("lr", math.nan)))

        bad = [name for name, v in (("loss", loss), ("Query-KL", qkl), ("grad norm", grad)) if not math.isfinite(v)]
        if bad:
            values = ", ".join(f"{n} {v:.3g}" for n, v in (("loss", loss), ("Query-KL", qkl), ("grad norm", grad)))
            out.append(f"step {step}: {' and '.join(bad)} not finite ({values}); stopped before this step's "
                       f"checkpoint, the last one is intact; {try_stable}, or dtype=float32")
            return out, True

        window = self.grad_norms[-GRAD_NORM_WINDOW:]
        median = statistics.median(window) if window else math.nan
        jump = len(window) >= 5 and grad > max(GRAD_NORM_JUMP * median, GRAD_NORM_FLOOR)
        self._flag(out, "loss", abs(loss) > LOSS_LIMIT,
                   f"step {step}: loss {loss:.3g} (|loss| above {LOSS_LIMIT:g}): the update is diverging; {try_stable}")
        self._flag(out, "qkl", qkl > QKL_LIMIT,
                   f"step {step}: Query-KL {qkl:.3g} (above {QKL_LIMIT:g}): the model's likelihood of the training "
                   f"prompts has moved far from the starting model's; {try_stable}")
        self._flag(out, "grad", grad > GRAD_NORM_LIMIT or jump,
                   f"step {step}: grad norm {grad:.3g} before clipping (above {GRAD_NORM_LIMIT:g}, or above "
                   f"{GRAD_NORM_FLOOR:g} and {GRAD_NORM_JUMP:g}x the recent median {median:.3g}): exploding "
                   f"gradients; {try_stable}")
        self.grad_norms.append(grad)

        zero = float(metrics.get("reward/mean", 1.0)) == 0.0 and float(metrics.get("reward/std", 1.0)) == 0.0
        self.zero_reward_streak = self.zero_reward_streak + 1 if zero else 0
        self._flag(out, "reward", self.zero_reward_streak >= ZERO_REWARD_STEPS,
                   f"step {step}: every reward has been 0 for {self.zero_reward_streak} steps: no learning signal; "
                   f"check that the template asks for the answer format the reward reads (template=, reward=), "
                   f"that max_new_tokens= leaves room for it, and the answers of a few samples "
                   f"(erpo eval save_samples=true)")
        return out, False

    @property
    def warning_tag(self) -> str:
        """What is being warned about now, for the progress bar ("" when nothing)."""
        return ",".join(k for k, on in self.active.items() if on)

    def _flag(self, out: List[str], key: str, on: bool, message: str) -> None:
        """Warn when `key` turns on; stay quiet while it stays on."""
        if on and not self.active.get(key):
            out.append(message)
        self.active[key] = on
