"""`python -m bench replay`: the demo under a truncating sampler, with the support replayed and without.

configs/demo.yaml trained by `erpo train` twice with the same seed and warm start (built first,
outside the runs, in a cache both share), at top_p = 0.8 (the overrides change it): once with
replay_support=true (the rollout records each response token's kept set, the trainer renormalises
every response log-prob over it) and once with replay_support=false (the trainer scores the full
softmax while the sampler drew from the truncated one). What each run's own metrics.jsonl says,
over all its steps, each step weighted equally: the kept mass (support/kept_mass, replay only),
mismatch/ratio_out_frac (tokens with pi_old / pi_rollout outside [0.9, 1.1]), the ratio's mean
and spread (sqrt(E r^2 - (E r)^2) from mismatch/ratio_mean and mismatch/ratio_sq_mean), the
reward of the first and last 10 steps.

    python -m bench replay                    # -> bench/results/local/replay-<machine>.json
    python -m bench replay --record           # -> bench/results/, docs/training.md's section
    python -m bench replay steps=20           # any key=value on top of configs/demo.yaml top_p=0.8
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from .measure import REPO, commit_hash, device_name, machine_name, versions
from .rollout import publish_record

CONFIG = REPO / "configs" / "demo.yaml"
DOC = REPO / "docs" / "training.md"
BEGIN, END = "<!-- bench replay: begin (python -m bench replay --record) -->", "<!-- bench replay: end -->"
SETTINGS = ("top_p=0.8",)  # the truncation both runs sample with (overrides come after it)
REPLAY = (True, False)


def run_stats(rows: Sequence[Dict[str, float]]) -> Dict[str, Any]:
    """What a run's metrics.jsonl rows say (module docstring): means over the steps."""
    k = max(1, min(10, len(rows) // 10))

    def mean(key: str) -> Optional[float]:
        values = [r[key] for r in rows if key in r]
        return sum(values) / len(values) if values else None

    ratio, square = mean("mismatch/ratio_mean"), mean("mismatch/ratio_sq_mean")  # the engine's log-probs: always
    return {
        "steps": len(rows),
        "kept_mass": mean("support/kept_mass"),  # None without replay: no kept sets
        "ratio_out_frac": mean("mismatch/ratio_out_frac"),
        "ratio_mean": ratio,
        "ratio_spread": math.sqrt(max(square - ratio * ratio, 0.0)),
        "logp_diff_mean": mean("mismatch/logp_diff_mean"),
        "reward_first": sum(r["reward/mean"] for r in rows[:k]) / k,
        "reward_last": sum(r["reward/mean"] for r in rows[-k:]) / k,
        "train_s": sum(r["time/step_s"] for r in rows),
    }


def train(replay: bool, run_dir: str, cache_dir: str, overrides: Sequence[str], config: Path = CONFIG
          ) -> Dict[str, Any]:
    """One `erpo train` of the config at SETTINGS with replay_support=`replay`: its stats."""
    command = [sys.executable, "-m", "erpo", "train", str(config), *SETTINGS, f"replay_support={str(replay).lower()}",
               f"run_dir={run_dir}", f"cache_dir={cache_dir}", "progress=false", *overrides]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user runs it
    t0 = time.perf_counter()
    proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"bench replay: {' '.join(command)} failed ({proc.returncode}):\n"
                         + "\n".join(proc.stdout.splitlines()[-30:]))
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return dict(run_stats(rows), replay=replay, wall_s=time.perf_counter() - t0,
                command=" ".join(["erpo", "train", os.path.relpath(config, REPO), *SETTINGS,
                                  f"replay_support={str(replay).lower()}", *overrides]))


def run(out_dir: str, overrides: Sequence[str], machine: Any = None, write_doc: bool = False,
        config: Path = CONFIG) -> Dict[str, Any]:
    """Both runs; out_dir/replay-<machine>.json (and with write_doc, docs/training.md's section)."""
    record: Dict[str, Any] = {"command": "replay", "settings": list(SETTINGS), "overrides": list(overrides),
                              "commit": commit_hash(), "versions": versions(), "device_name": device_name("cpu")}
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
        cache = os.path.join(tmp, "cache")
        record["trainings"] = []
        for replay in REPLAY:
            print(f"[bench] replay: erpo train {config.name} {' '.join(SETTINGS)} replay_support={replay}", flush=True)
            record["trainings"].append(train(replay, os.path.join(tmp, f"replay-{replay}"), cache, overrides, config))
    path = Path(out_dir) / f"replay-{machine_name('cpu', machine)}.json"
    publish_record(path, record, markdown_table(record), DOC if write_doc else None, BEGIN, END)
    return record


def markdown_table(record: Dict[str, Any]) -> str:
    """The doc section: one row per run, then the commands, commit and machine."""
    lines = [
        "| replay_support | kept mass | mismatch/ratio_out_frac | ratio pi_old / pi_rollout: mean | its spread | "
        "mean abs log-ratio | reward, first -> last 10 steps |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in record["trainings"]:
        mass = "not recorded" if r["kept_mass"] is None else f"{r['kept_mass']:.4f}"
        lines.append(f"| {str(r['replay']).lower()} | {mass} | {r['ratio_out_frac']:.4f} | {r['ratio_mean']:.4f} | "
                     f"{r['ratio_spread']:.4f} | {r['logp_diff_mean']:.2e} | "
                     f"{r['reward_first']:.3f} -> {r['reward_last']:.3f} |")
    lines.append("")
    v = record["versions"]
    steps = record["trainings"][0]["steps"]
    lines.append(f"Means over the {steps} steps of each run, each step weighted equally (`python -m bench replay --record"
                 f"{''.join(' ' + o for o in record['overrides'])}`: "
                 + "; ".join(f"`{r['command']}`" for r in record["trainings"])
                 + f"), at commit {record['commit'][:10]} on {record['device_name']}, torch {v.get('torch')}, "
                   f"transformers {v.get('transformers')}.")
    return "\n".join(lines)
