"""What a start of `erpo train` does to its run directory, decided once, as a value.

    plan = plan_run(cfg, data_fingerprint)   # reads the file system, changes nothing; ErpoError on a conflict
    ...                                      # every other check, the model, the reference cache
    apply_plan(plan, cfg, new_cache, log)    # the only writes before the first step

A start is one of three (docs/training.md, "Resume and fork"):

- a new run: step 0; an earlier run in run_dir is deleted with overwrite=true, refused without;
- a resume in place (resume=RUN, run_dir=RUN): the checkpoint's step; the checkpoints after it
  are deleted with overwrite=true (refused without), and the metrics logged after it dropped;
- a fork (resume=RUN, another run_dir): the new run gets RUN's metrics up to the checkpoint, a
  link-copy of the checkpoint and of RUN's reference cache; RUN is left as it is.

The reference cache is read from ``cache_source``: the run's own file, or on a fork the forked
run's, which is then copied in; when neither exists the trainer builds a new one.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

from . import checkpoint as ckpt
from .atomic import atomic_write
from .config import TrainConfig, save_config
from .errors import ErpoError
from .plot import CURVES_FILE, METRICS_FILE, read_metrics


@dataclass(frozen=True)
class RunPlan:
    """The run directory's plan for one start (see the module docstring)."""

    run_dir: str
    start_step: int = 0                    # the last step already trained (0: a new run)
    checkpoint: Optional[str] = None       # the checkpoint this start continues from (None: a new run)
    source_run: Optional[str] = None       # the run that checkpoint belongs to
    fork: bool = False                     # source_run is not run_dir: it is left as it is
    saved_state: Dict[str, Any] = field(default_factory=dict)  # the checkpoint's trainer state
    earlier_run: Tuple[str, ...] = ()      # a new run: what an earlier run left, deleted (overwrite=true)
    later_checkpoints: Tuple[str, ...] = ()  # in place: the checkpoints after the one continued from, deleted
    cache_path: str = ""                   # the run's reference cache
    cache_source: str = ""                 # where it is read from: cache_path, or the forked run's cache

    @property
    def resuming(self) -> bool:
        return self.checkpoint is not None

    @property
    def in_place(self) -> bool:
        """Continuing run_dir itself from one of its checkpoints."""
        return self.resuming and not self.fork

    @property
    def cache_exists(self) -> bool:
        """False: the trainer builds the cache (and apply_plan writes it to cache_path)."""
        return os.path.isfile(self.cache_source)

    @property
    def copies_cache(self) -> bool:
        """A fork that reads the forked run's cache, copied into cache_path."""
        return self.cache_source != self.cache_path and self.cache_exists


def earlier_run_files(run_dir: str) -> Tuple[str, ...]:
    """What an earlier run left in ``run_dir`` that a new run would replace."""
    names = (METRICS_FILE, ckpt.CHECKPOINTS, CURVES_FILE, "eval")
    return tuple(os.path.join(run_dir, n) for n in names if os.path.exists(os.path.join(run_dir, n)))


def check_run_dir(cfg: TrainConfig) -> Tuple[str, ...]:
    """What an earlier run left in run_dir (replaced only with overwrite=true; ErpoError
    without it); () when resuming in place (a fork into another run_dir is checked too)."""
    in_place = bool(cfg.resume) and ckpt.resume_point(cfg.resume)[0] == os.path.normpath(cfg.run_dir)
    earlier = () if in_place else earlier_run_files(cfg.run_dir)
    if earlier and not cfg.overwrite:
        last = ckpt.latest_checkpoint(cfg.run_dir)
        go_on = f"continue it with: erpo train resume={cfg.run_dir}, " if last else ""
        raise ErpoError(
            f"run_dir={cfg.run_dir} holds an earlier run "
            f"({f'checkpoint {os.path.basename(last)}' if last else 'one that wrote no checkpoint'}); "
            f"{go_on}start over with overwrite=true (deletes it), or choose another run_dir="
        )
    return earlier


def _resume_point(cfg: TrainConfig, data_fingerprint: str) -> Tuple[str, str, Dict[str, Any]]:
    """(the resumed run, its checkpoint, the checkpoint's state) of resume=, checked: the
    checkpoint exists and was trained on the same data."""
    source_run, checkpoint = ckpt.resume_point(cfg.resume)
    if checkpoint is None:
        raise ErpoError(
            f"resume={cfg.resume}: no checkpoint there yet (expected {cfg.resume}/checkpoints/step-N); "
            f"start it over with: erpo train run_dir={cfg.resume} overwrite=true"
        )
    saved = ckpt.read_state(checkpoint)
    if saved.get("data_fingerprint") != data_fingerprint:
        raise ErpoError(
            f"resume={cfg.resume}: the training data differs from the run's (fingerprint "
            f"{saved.get('data_fingerprint')} -> {data_fingerprint}); restore it or start a new run"
        )
    return source_run, checkpoint, saved


def _later_checkpoints(cfg: TrainConfig, start_step: int) -> Tuple[str, ...]:
    """The checkpoints of run_dir after ``start_step`` that continuing there would replace
    (ErpoError unless overwrite=true)."""
    later = tuple(p for s, p in ckpt.checkpoint_dirs(cfg.run_dir) if s > start_step)
    if later and not cfg.overwrite:
        raise ErpoError(
            f"resume={cfg.resume}: {cfg.run_dir} has later checkpoints "
            f"({', '.join(os.path.basename(p) for p in later)}) that continuing there would "
            f"replace; continue in a new run with run_dir=NEW (this one is kept), or delete them with overwrite=true"
        )
    return later


def plan_run(cfg: TrainConfig, data_fingerprint: str) -> RunPlan:
    """The plan of this start of cfg.run_dir (nothing is changed); ErpoError when it
    conflicts with what the directory holds: an earlier run without overwrite=true,
    resume= without a checkpoint or on other data, later checkpoints in place."""
    earlier = check_run_dir(cfg)
    cache_path = cfg.ref_cache_path
    if not cfg.resume:
        return RunPlan(run_dir=cfg.run_dir, earlier_run=earlier, cache_path=cache_path, cache_source=cache_path)
    source_run, checkpoint, saved = _resume_point(cfg, data_fingerprint)
    fork = source_run != os.path.normpath(cfg.run_dir)
    start_step = int(saved["step"])
    later = () if fork else _later_checkpoints(cfg, start_step)
    cache_source = cache_path
    if fork and not cfg.ref_cache and not os.path.isfile(cache_path):  # the forked run's own cache
        theirs = os.path.join(source_run, os.path.basename(cache_path))
        cache_source = theirs if os.path.isfile(theirs) else cache_path
    return RunPlan(run_dir=cfg.run_dir, start_step=start_step, checkpoint=checkpoint, source_run=source_run,
                   fork=fork, saved_state=saved, earlier_run=earlier, later_checkpoints=later,
                   cache_path=cache_path, cache_source=cache_source)


def _keep_metrics(src_run: str, dst: str, last_step: int) -> None:
    """Write to ``dst`` the metrics.jsonl rows of ``src_run`` up to ``last_step`` (none when it has none)."""
    rows = read_metrics(src_run) if os.path.isfile(os.path.join(src_run, METRICS_FILE)) else []
    keep = [row for row in rows if row["step"] <= last_step]
    atomic_write(dst, "".join(json.dumps(row) + "\n" for row in keep).encode("utf-8"))


def apply_plan(plan: RunPlan, cfg: TrainConfig, new_cache: Any, log: Callable[[str], None]) -> None:
    """Make run_dir what the plan says, after every check of the start has passed: delete
    what it replaces, keep or copy the metrics and the checkpoint, write the reference cache
    (``new_cache``, a RefCache, when the plan has none to read; else None) and config.yaml."""
    from .ref_cache import save_ref_cache

    run = plan.run_dir
    os.makedirs(run, exist_ok=True)
    metrics = os.path.join(run, METRICS_FILE)
    if plan.in_place:
        ckpt.clean_stale_temps(run)
        for p in plan.later_checkpoints:  # overwrite=true, checked in plan_run
            log(f"erpo: overwrite=true: deleting {p} (after the checkpoint this run continues from)")
            shutil.rmtree(p)
        if os.path.isfile(metrics):  # drop what was logged after the checkpoint
            _keep_metrics(run, metrics, plan.start_step)
    else:
        if plan.earlier_run:  # overwrite=true, checked in plan_run
            log(f"erpo: overwrite=true: deleting the earlier run in {run} and starting over")
            for p in plan.earlier_run:
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
        if plan.fork:  # the new run holds its history up to the checkpoint, and the checkpoint
            _keep_metrics(plan.source_run, metrics, plan.start_step)
            os.makedirs(os.path.join(run, ckpt.CHECKPOINTS), exist_ok=True)
            ckpt.link_tree(plan.checkpoint, os.path.join(run, ckpt.CHECKPOINTS, os.path.basename(plan.checkpoint)))
            log(f"erpo: {run} continues from {plan.checkpoint} (step {plan.start_step}); {plan.source_run} is "
                f"left as it is")
    if new_cache is not None:
        save_ref_cache(new_cache, plan.cache_path)
    elif plan.copies_cache:
        with open(plan.cache_source, "rb") as f:
            atomic_write(plan.cache_path, f.read())
    # overwrite is an instruction for this start, not a setting of the run: a config
    # file copied from the run must not delete it
    save_config(dataclasses.replace(cfg, overwrite=False), os.path.join(run, "config.yaml"))
