"""Checkpoints: <run_dir>/checkpoints/step-NNNNNN/, each a loadable Hugging Face model
directory (config, safetensors weights, tokenizer) plus optimizer.pt (optimizer and
scheduler state) and trainer_state.json (step, fingerprints, world size). A run under
torchrun (FSDP2) writes the same consolidated weights, the scheduler in optimizer.pt and
the sharded optimizer state in optimizer/ (torch.distributed.checkpoint, one file per
rank): it resumes on the same number of ranks.

A checkpoint is written into a temp directory beside the others and renamed into
place, so an interrupted run never leaves a half-written checkpoint: every
step-NNNNNN directory is complete, and the newest one is where `resume=` continues.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Dict, List, Optional, Tuple

import torch

from .atomic import umask_modes

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
OPTIM_FILE = "optimizer.pt"
OPTIM_DIR = "optimizer"  # a sharded (torchrun) run's optimizer state: torch.distributed.checkpoint, one file per rank
_NAME = re.compile(r"^step-(\d+)$")


def checkpoint_dirs(run_dir: str) -> List[Tuple[int, str]]:
    """[(step, path)] of the complete checkpoints of a run, oldest first."""
    root = os.path.join(run_dir, CHECKPOINTS)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _NAME.match(name)
        path = os.path.join(root, name)
        if match and os.path.isfile(os.path.join(path, STATE_FILE)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: str) -> Optional[str]:
    found = checkpoint_dirs(run_dir)
    return found[-1][1] if found else None


def resume_point(path: str) -> Tuple[str, Optional[str]]:
    """(run directory, checkpoint) of resume=PATH: a run and its latest checkpoint (None when
    it has none), or a checkpoint RUN/checkpoints/step-N and its run."""
    norm = os.path.normpath(path)
    if _NAME.match(os.path.basename(norm)) and os.path.basename(os.path.dirname(norm)) == CHECKPOINTS:
        complete = os.path.isfile(os.path.join(norm, STATE_FILE))
        return os.path.dirname(os.path.dirname(norm)) or ".", norm if complete else None
    return norm, latest_checkpoint(norm)


def link_tree(src: str, dst: str) -> None:
    """Copy the directory ``src`` to ``dst`` (absent) through a temp directory and a rename,
    hard-linking the files where the file system allows (checkpoint files are never
    modified in place, so the two runs cannot change each other's)."""

    def link_or_copy(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    tmp = f"{dst}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, copy_function=link_or_copy)
    os.replace(tmp, dst)


def save_checkpoint(
    run_dir: str,
    step: int,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: Dict[str, Any],
    keep: int = 0,
) -> str:
    """Write checkpoint `step` atomically; then drop all but the newest `keep` (0 = keep all)."""
    root = os.path.join(run_dir, CHECKPOINTS)
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"step-{step:06d}")
    tmp = os.path.join(root, f".tmp-step-{step:06d}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                   os.path.join(tmp, OPTIM_FILE))
    except OSError:  # e.g. a full disk: the part written is freed, the complete checkpoints stay
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(run_dir, tmp, final, step, state, keep)
    return final


def _publish(run_dir: str, tmp: str, final: str, step: int, state: Dict[str, Any], keep: int) -> None:
    """Write trainer_state.json into the complete temp directory, rename it to `final`,
    then drop all but the newest `keep` checkpoints (0 = keep all)."""
    with open(os.path.join(tmp, STATE_FILE), "w", encoding="utf-8") as f:
        json.dump(dict(state, step=step), f, indent=1, sort_keys=True)
    umask_modes(tmp)  # model.safetensors is written 0600: every file the umask's mode
    if os.path.exists(final):  # a rerun of the same step: move the old one out of the way first
        old = os.path.join(os.path.dirname(final), f".old-step-{step:06d}-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    if keep > 0:
        for _, path in checkpoint_dirs(run_dir)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)


def save_sharded_checkpoint(
    run_dir: str,
    step: int,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: Dict[str, Any],
    keep: int = 0,
) -> str:
    """save_checkpoint for an FSDP2 model under torchrun; every rank calls it. Rank 0
    writes the consolidated Hugging Face weights, the tokenizer and the scheduler, every
    rank its optimizer shard, all into one temp directory renamed into place by rank 0
    once every rank is done (trainer_state.json last: it marks a checkpoint complete)."""
    from . import distributed

    root = os.path.join(run_dir, CHECKPOINTS)
    final = os.path.join(root, f"step-{step:06d}")
    tmp = os.path.join(root, f".tmp-step-{step:06d}-{distributed.broadcast_object(os.getpid())}")
    weights = distributed.full_state_dict(model)  # collective; whole on rank 0, {} elsewhere
    if distributed.is_main():
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        torch.save({"scheduler": scheduler.state_dict()}, os.path.join(tmp, OPTIM_FILE))
    distributed.barrier()
    distributed.save_optimizer(model, optimizer, os.path.join(tmp, OPTIM_DIR))  # collective
    distributed.barrier()
    if distributed.is_main():
        _publish(run_dir, tmp, final, step, state, keep)
    distributed.barrier()
    return final


def read_state(path: str) -> Dict[str, Any]:
    with open(os.path.join(path, STATE_FILE), encoding="utf-8") as f:
        return json.load(f)


def load_optimizer_state(path: str) -> Dict[str, Any]:
    return torch.load(os.path.join(path, OPTIM_FILE), map_location="cpu", weights_only=True)


def clean_stale_temps(run_dir: str) -> None:
    """Remove what an interrupted save left behind: temp directories (never complete), and
    restore a replaced checkpoint whose swap was cut short."""
    root = os.path.join(run_dir, CHECKPOINTS)
    if not os.path.isdir(root):
        return
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        match = re.match(r"^\.old-(step-\d+)-\d+$", name)
        if match and not os.path.exists(os.path.join(root, match.group(1))):
            os.replace(path, os.path.join(root, match.group(1)))  # interrupted mid-swap: the old one is the copy
        elif name.startswith((".tmp-step-", ".old-step-")):
            shutil.rmtree(path, ignore_errors=True)
