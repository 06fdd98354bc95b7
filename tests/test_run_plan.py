"""The run directory's plan (erpo/run_plan.py) on run directories made by hand: what a new
run, a resume in place and a fork read, delete, keep and copy, decided before anything is
changed, and done by apply_plan only. (The trainer's own resume and fork, end to end, are in
tests/test_trainer.py and tests/test_cli.py.)"""
import json
import os

import pytest

from erpo import checkpoint as ckpt
from erpo.config import TrainConfig
from erpo.errors import ErpoError
from erpo.run_plan import apply_plan, plan_run

DATA = "data-fingerprint"


def fake_run(root, name="run", steps=(2, 4), cache=True, data=DATA):
    """A run directory with checkpoints at `steps` (a state file and one weight file each),
    metrics for every step up to the last, and (when `cache`) its reference cache."""
    run = root / name
    for s in steps:
        path = run / ckpt.CHECKPOINTS / f"step-{s:06d}"
        path.mkdir(parents=True)
        (path / ckpt.STATE_FILE).write_text(json.dumps({"step": s, "data_fingerprint": data}))
        (path / "model.safetensors").write_bytes(b"weights %d" % s)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n"
                                               for s in range(1, max(steps) + 1)))
    (run / "curves.png").write_bytes(b"png")
    if cache:
        (run / "ref_cache.safetensors").write_bytes(b"the cache")
    return run


def steps_of(run):
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def listing(path):
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def test_a_new_run_in_an_empty_directory(tmp_path):
    plan = plan_run(TrainConfig(run_dir=str(tmp_path / "new")), DATA)
    assert (plan.start_step, plan.checkpoint, plan.fork, plan.resuming, plan.in_place) == (0, None, False, False, False)
    assert plan.earlier_run == () and not plan.cache_exists and not plan.copies_cache
    assert not (tmp_path / "new").exists()  # planning changes nothing
    apply_plan(plan, TrainConfig(run_dir=str(tmp_path / "new"), overwrite=True), None, print)
    assert listing(tmp_path / "new") == ["config.yaml"]
    assert "overwrite: false" in (tmp_path / "new" / "config.yaml").read_text()  # an instruction, not a setting


def test_an_earlier_run_is_refused_then_replaced_with_overwrite(tmp_path):
    run = fake_run(tmp_path)
    with pytest.raises(ErpoError, match="holds an earlier run .checkpoint step-000004.; continue it with"):
        plan_run(TrainConfig(run_dir=str(run)), DATA)
    plan = plan_run(TrainConfig(run_dir=str(run), overwrite=True), DATA)
    assert {os.path.basename(p) for p in plan.earlier_run} == {"metrics.jsonl", "checkpoints", "curves.png"}
    assert plan.cache_exists  # the cache of the same data is kept (the trainer validates it)
    lines = []
    apply_plan(plan, TrainConfig(run_dir=str(run), overwrite=True), None, lines.append)
    assert listing(run) == ["config.yaml", "ref_cache.safetensors"]
    assert lines == [f"erpo: overwrite=true: deleting the earlier run in {run} and starting over"]


def test_resume_in_place_from_the_latest_checkpoint(tmp_path):
    run = fake_run(tmp_path)
    plan = plan_run(TrainConfig(run_dir=str(run), resume=str(run)), DATA)
    assert (plan.start_step, plan.in_place, plan.fork, plan.later_checkpoints) == (4, True, False, ())
    assert plan.checkpoint == str(run / "checkpoints" / "step-000004") and plan.saved_state["step"] == 4
    assert plan.cache_source == plan.cache_path == str(run / "ref_cache.safetensors")


def test_resume_in_place_from_an_older_checkpoint_deletes_the_later_ones_only_with_overwrite(tmp_path):
    run = fake_run(tmp_path)
    older = str(run / "checkpoints" / "step-000002")
    with pytest.raises(ErpoError, match="has later checkpoints .step-000004. that continuing there would replace"):
        plan_run(TrainConfig(run_dir=str(run), resume=older), DATA)
    cfg = TrainConfig(run_dir=str(run), resume=older, overwrite=True)
    plan = plan_run(cfg, DATA)
    assert plan.start_step == 2 and plan.later_checkpoints == (str(run / "checkpoints" / "step-000004"),)
    assert steps_of(run) == [1, 2, 3, 4]  # nothing changed yet
    apply_plan(plan, cfg, None, lambda _line: None)
    assert [s for s, _ in ckpt.checkpoint_dirs(str(run))] == [2] and steps_of(run) == [1, 2]


def test_a_fork_copies_history_checkpoint_and_cache_and_leaves_the_source_alone(tmp_path):
    source = fake_run(tmp_path, "source")
    before = {p: (source / p).read_bytes() for p in listing(source)}
    older = str(source / "checkpoints" / "step-000002")
    cfg = TrainConfig(run_dir=str(tmp_path / "fork"), resume=older)
    plan = plan_run(cfg, DATA)
    assert (plan.start_step, plan.fork, plan.in_place, plan.later_checkpoints) == (2, True, False, ())
    assert plan.source_run == str(source) and plan.cache_source == str(source / "ref_cache.safetensors")
    assert plan.copies_cache
    lines = []
    apply_plan(plan, cfg, None, lines.append)
    fork = tmp_path / "fork"
    assert listing(fork) == ["checkpoints/step-000002/model.safetensors", "checkpoints/step-000002/trainer_state.json",
                             "config.yaml", "metrics.jsonl", "ref_cache.safetensors"]
    assert steps_of(fork) == [1, 2] and (fork / "ref_cache.safetensors").read_bytes() == b"the cache"
    assert {p: (source / p).read_bytes() for p in listing(source)} == before
    assert lines == [f"erpo: {fork} continues from {older} (step 2); {source} is left as it is"]


def test_a_fork_without_a_cache_anywhere_builds_one(tmp_path, monkeypatch):
    import erpo.ref_cache

    source = fake_run(tmp_path, "source", cache=False)
    cfg = TrainConfig(run_dir=str(tmp_path / "fork"), resume=str(source))
    plan = plan_run(cfg, DATA)
    assert plan.cache_source == plan.cache_path and not plan.cache_exists and not plan.copies_cache
    written = []
    monkeypatch.setattr(erpo.ref_cache, "save_ref_cache", lambda cache, path: written.append((cache, path)))
    new_cache = object()  # the RefCache the trainer built
    apply_plan(plan, cfg, new_cache, lambda _line: None)
    assert written == [(new_cache, plan.cache_path)]


def test_resume_refuses_a_run_without_checkpoint_or_on_other_data(tmp_path):
    run = fake_run(tmp_path)
    with pytest.raises(ErpoError, match="the training data differs from the run's"):
        plan_run(TrainConfig(run_dir=str(run), resume=str(run)), "other data")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ErpoError, match="no checkpoint there yet"):
        plan_run(TrainConfig(run_dir=str(empty), resume=str(empty)), DATA)
