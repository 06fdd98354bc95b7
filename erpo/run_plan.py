"""What a start of `erpo train` does to its run directory."""
from __future__ import annotations

import os
from typing import List

from . import checkpoint as ckpt
from .config import TrainConfig
from .errors import ErpoError
from .plot import CURVES_FILE, METRICS_FILE


def earlier_run_files(run_dir: str) -> List[str]:
    """What an earlier run left in ``run_dir`` that a new run would replace."""
    names = (METRICS_FILE, ckpt.CHECKPOINTS, CURVES_FILE, "eval")
    return [os.path.join(run_dir, n) for n in names if os.path.exists(os.path.join(run_dir, n))]


def check_run_dir(cfg: TrainConfig) -> List[str]:
    """What an earlier run left in run_dir (replaced only with overwrite=true; ErpoError
    without it); [] when resuming in place (a fork into another run_dir is checked too)."""
    in_place = bool(cfg.resume) and ckpt.resume_point(cfg.resume)[0] == os.path.normpath(cfg.run_dir)
    earlier = [] if in_place else earlier_run_files(cfg.run_dir)
    if earlier and not cfg.overwrite:
        last = ckpt.latest_checkpoint(cfg.run_dir)
        go_on = f"continue it with: erpo train resume={cfg.run_dir}, " if last else ""
        raise ErpoError(
            f"run_dir={cfg.run_dir} holds an earlier run "
            f"({f'checkpoint {os.path.basename(last)}' if last else 'one that wrote no checkpoint'}); "
            f"{go_on}start over with overwrite=true (deletes it), or choose another run_dir="
        )
    return earlier
