"""ERPOSettings: ERPO's own settings (docs/method.md sections 2, 3), declared once with
their defaults and checked in one place.

`erpo train` (TrainConfig), TRL's ERPOConfig and verl's ERPOPolicyLossConfig carry these
keys under the same names; each builds its settings by name (`ERPOSettings.of(config)`,
no hand-written copy of the values) and checks them with `validate()`, which hands each
key to the object it configures: the query weights' keys to QueryWeighter, alpha and
kl_guard to erpo_kernels.LossConfig. tests/test_erpo_settings.py (and
tests/verl_live/test_plugin.py for verl) check that the three declare every field with
this default. Imports no torch until validate() (`erpo --help` stays light).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ERPOSettings:
    """alpha: the Query-KL coefficient (0 = the weights-only ablation). query_weighting:
    prevalence, softmax or none; bins (K), gamma, weight_temperature (T_w), w_min, w_max:
    the query weights w_B(q) (erpo.query_weights). kl_guard: c of the K3 guard."""

    alpha: float = 0.01
    query_weighting: str = "prevalence"
    bins: int = 20
    gamma: float = 1.0
    weight_temperature: float = 1.0
    w_min: float = 0.1
    w_max: float = 10.0
    kl_guard: float = 10.0

    @classmethod
    def of(cls, config: Any) -> "ERPOSettings":
        """The settings of a config object holding these keys under the same names."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})

    def validate(self) -> "ERPOSettings":
        """ValueError naming the first bad key; returns self."""
        from erpo_kernels import LossConfig

        from .query_weights import QueryWeighter

        QueryWeighter.check_config(self)
        LossConfig(alpha=self.alpha, kl_guard=self.kl_guard)
        return self


SETTINGS_KEYS = tuple(f.name for f in fields(ERPOSettings))
