"""erpo: a lean GRPO/ERPO trainer whose loss path is the erpo_kernels ops.

    from erpo import TrainConfig, Trainer
    Trainer(TrainConfig(steps=20)).train()

or from the shell: `erpo train [config.yaml] key=value ...` (see `erpo train --help`).
Importing erpo is cheap; the trainer's heavy dependencies load on first use.
"""
from .config import ConfigError, TrainConfig, load_config
from .errors import ErpoError

__version__ = "0.1.0"
__all__ = ["ConfigError", "ErpoError", "TrainConfig", "Trainer", "load_config"]


def __getattr__(name: str):
    if name == "Trainer":
        from .trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'erpo' has no attribute {name!r}")
