"""`python -m bench demo-vllm` (bench/demo_vllm.py): the demo-sized run per rollout backend, its
record and docs/vllm.md's table. The HF backend runs here end to end on a tiny setting; the vLLM
backend runs in the live venv (docs/vllm.md's table is its record)."""
from __future__ import annotations

import json

import pytest

from bench import demo_vllm

TINY = ["steps=2", "warmstart_steps=2", "warmstart_batch_size=4", "task_train_size=8", "task_eval_size=2",
        "queries_per_step=2", "group_size=2", "max_new_tokens=4", "tiny_layers=1", "save_every=0"]


def rows(rewards, qkls, mismatch=1e-6):
    return [{"step": i + 1, "reward/mean": r, "qkl/value": q, "mismatch/logp_diff_max": mismatch * (i + 1),
             "time/step_s": 0.5} for i, (r, q) in enumerate(zip(rewards, qkls))]


def test_run_stats_reads_the_runs_metrics():
    stats = demo_vllm.run_stats(rows([0.1] * 10 + [0.2] * 80 + [0.9] * 10, [0.01] * 41 + [3.0] + [0.02] * 58))
    assert stats["steps"] == 100 and stats["reward_first"] == pytest.approx(0.1)
    assert stats["reward_last"] == pytest.approx(0.9)
    assert (stats["qkl_max"], stats["qkl_max_step"], stats["qkl_last"]) == (3.0, 42, 0.02)
    assert stats["mismatch_max"] == pytest.approx(1e-4) and stats["train_s"] == pytest.approx(50.0)
    short = demo_vllm.run_stats(rows([0.0, 1.0], [0.0, 0.0]))  # fewer than 20 steps: the first and last one
    assert (short["reward_first"], short["reward_last"]) == (0.0, 1.0)


def test_a_new_run_replaces_the_one_of_its_label_and_backend():
    old = {"command": "demo-vllm", "trainings": [
        {"label": "shipped", "backend": "hf", "n": 1}, {"label": "shipped", "backend": "vllm", "n": 1},
        {"label": "lrs", "backend": "hf", "n": 1}]}
    new = demo_vllm.merge(old, [{"label": "shipped", "backend": "vllm", "n": 2}])
    assert [(r["label"], r["backend"], r["n"]) for r in new["trainings"]] == [
        ("shipped", "hf", 1), ("lrs", "hf", 1), ("shipped", "vllm", 2)]


def test_bench_demo_vllm_trains_the_config_and_writes_its_table(tmp_path, monkeypatch):
    """The HF backend on a tiny setting: the record holds the run's own numbers, the doc's
    section is rewritten from it (and nothing else of the doc)."""
    doc = tmp_path / "vllm.md"
    doc.write_text(f"before\n{demo_vllm.BEGIN}\nold\n{demo_vllm.END}\nafter\n")
    monkeypatch.setattr(demo_vllm, "DOC", doc)
    (run,) = demo_vllm.run(str(tmp_path / "out"), "tiny", ["hf"], TINY, machine="t", write_doc=True)
    record = json.loads((tmp_path / "out" / "demo-vllm-t.json").read_text())
    assert record == {"command": "demo-vllm", "trainings": [run]} and run["backend"] == "hf" and run["steps"] == 2
    from bench.report import all_results

    assert all_results(tmp_path / "out") == {}  # not a machine's kernel / step results for `bench report`
    assert run["mismatch_max"] < 1e-4 and run["cpu_s"] > 0 and run["max_rss_mb"] > 0 and run["wall_s"] > 0
    assert run["summary"].startswith("erpo: erpo finished step 2/2") and run["engine_line"] is None
    text = doc.read_text()
    assert text.startswith(f"before\n{demo_vllm.BEGIN}\n| run | backend |")
    assert text.endswith(f"{demo_vllm.END}\nafter\n")
    assert f"| tiny | hf | {run['reward_first']:.3f} -> {run['reward_last']:.3f} |" in text and "old" not in text
    assert f"`configs/demo-vllm.yaml` {' '.join(TINY)}, 2 steps, at commit {run['commit'][:10]}" in text
