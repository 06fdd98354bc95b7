"""`python -m bench replay` (bench/replay.py): `erpo train` at top_p = 0.8 with the sampler's
support replayed and without, its record and docs/training.md's table. Run end to end here on a
shrunk demo: this is the check that a truncating sampler's kept mass is logged below 1 and that
replaying the support takes pi_old / pi_rollout back into [0.9, 1.1]."""
from __future__ import annotations

import json

import pytest

from bench import replay

TINY = ["steps=2", "warmstart_steps=2", "warmstart_batch_size=4", "task_train_size=8", "task_eval_size=2",
        "queries_per_step=2", "group_size=2", "max_new_tokens=4", "tiny_layers=1", "save_every=0"]


def test_run_stats_reads_the_runs_metrics():
    rows = [{"step": i + 1, "reward/mean": 0.1 * i, "time/step_s": 0.5, "support/kept_mass": 0.8 + 0.1 * i,
             "mismatch/ratio_out_frac": 0.5, "mismatch/ratio_mean": 0.9, "mismatch/ratio_sq_mean": 0.9 * 0.9 + 0.04,
             "mismatch/logp_diff_mean": 0.1} for i in range(3)]
    stats = replay.run_stats(rows)
    assert stats["steps"] == 3 and stats["kept_mass"] == pytest.approx(0.9) and stats["ratio_out_frac"] == 0.5
    assert stats["ratio_mean"] == pytest.approx(0.9) and stats["ratio_spread"] == pytest.approx(0.2)
    assert (stats["reward_first"], stats["reward_last"]) == (0.0, pytest.approx(0.2))
    plain = replay.run_stats([{k: v for k, v in r.items() if k != "support/kept_mass"} for r in rows])
    assert plain["kept_mass"] is None  # not replayed: no kept sets, no kept mass


def test_bench_replay_trains_both_and_writes_its_table(tmp_path, monkeypatch):
    """Both runs of `erpo train configs/demo.yaml top_p=0.8` on a tiny setting: with the support
    replayed the kept mass is logged (below 1: the sampler cuts) and pi_old / pi_rollout is 1 to
    rounding; without it every ratio is the kept mass and mismatch/ratio_out_frac is larger. The
    doc's section is rewritten from the record (and nothing else of the doc)."""
    doc = tmp_path / "training.md"
    doc.write_text(f"before\n{replay.BEGIN}\nold\n{replay.END}\nafter\n")
    monkeypatch.setattr(replay, "DOC", doc)
    record = replay.run(str(tmp_path / "out"), TINY, machine="t", write_doc=True)
    assert json.loads((tmp_path / "out" / "replay-t.json").read_text()) == record
    on, off = record["trainings"]
    assert (on["replay"], off["replay"], on["steps"], off["steps"]) == (True, False, 2, 2)
    assert 0 < on["kept_mass"] < 1 and off["kept_mass"] is None
    assert on["ratio_out_frac"] < off["ratio_out_frac"]
    assert on["ratio_out_frac"] == 0.0 and on["logp_diff_mean"] < 1e-5 and on["ratio_mean"] == pytest.approx(1, abs=1e-5)
    assert off["ratio_mean"] < 1 - 1e-3  # the full softmax's ratio: pi_old / pi_rollout = the kept mass
    text = doc.read_text()
    assert text.startswith(f"before\n{replay.BEGIN}\n| replay_support | kept mass |")
    assert text.endswith(f"{replay.END}\nafter\n") and "\nold\n" not in text
    assert f"| true | {on['kept_mass']:.4f} | {on['ratio_out_frac']:.4f} |" in text
    assert "`erpo train configs/demo.yaml top_p=0.8 replay_support=false steps=2" in text
