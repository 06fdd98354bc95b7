"""`erpo study` (erpo/study.py, erpo/study_report.py): the study config's checks; the tiny study
of configs/study-tiny.yaml end to end (in this process; part of it two processes at a time,
with the same numbers); a study killed halfway
that resumes without redoing what was finished and ends with the same numbers; a rerun
with other settings refused; the findings' rule on made-up curves."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from erpo.cli import main
from erpo.study import load_study, units_of
from erpo.study_report import declines, trend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "study-tiny.yaml")
LONG = os.path.join(ROOT, "configs", "study-long.yaml")
EPOCHS = os.path.join(ROOT, "configs", "study-epochs.yaml")


# ---------------------------------------------------------------------- the study config


def test_study_configs_load_and_hold_what_the_issue_asks():
    long = load_study(LONG)
    assert long.seeds == [0, 1, 2] and set(long.variants) == {"grpo", "erpo", "erpo-qkl-only", "erpo-weights-only"}
    units = units_of(long)
    runs = [u for u in units if u.kind == "run"]
    assert len(runs) == 12 and all(u.cfg.steps >= 1000 for u in runs)
    cfg = runs[0].cfg
    assert cfg.demo.task == "mixed" and cfg.steps * cfg.queries_per_step > 2 * cfg.demo.task_train_size  # several epochs
    assert all(u.cfg.monitor_policy_kl for u in runs)  # Policy-KL of every algorithm
    by = {u.variant: u.cfg for u in runs if u.seed == 0}
    assert by["grpo"].algorithm == "grpo" and by["erpo-qkl-only"].query_weighting == "none"
    assert by["erpo-weights-only"].alpha == 0.0 and by["erpo"].algorithm == "erpo"
    tiny = load_study(TINY, ["variants=grpo,erpo", "seeds=3", "steps=6", "jobs=2"])
    assert list(tiny.variants) == ["grpo", "erpo"] and tiny.seeds == [3] and tiny.jobs == 2
    assert [u.eval_steps for u in units_of(tiny) if u.kind == "run"] == [[2, 4, 6], [2, 4, 6]]


def test_epochs_study_is_the_long_one_on_few_prompts_from_the_same_start():
    """configs/study-epochs.yaml: the long study's grid and evaluation plus grpo-nokl, 264 RL
    prompts (44 per level) passed over about 60 times, drawn from the long study's training
    problems; its warm start is the long study's (same cache key), its held-out split too."""
    from erpo.data import difficulty_of, load_examples
    from erpo.study import starting_model

    epochs, long = load_study(EPOCHS), load_study(LONG)
    assert list(epochs.variants) == list(long.variants) + ["grpo-nokl"] and epochs.seeds == long.seeds
    assert epochs.variants["grpo-nokl"] == {"algorithm": "grpo", "beta": 0.0}
    assert epochs.eval_every == long.eval_every and epochs.temperature_groups == long.temperature_groups
    assert epochs.label and epochs.doc == long.doc and epochs.out != long.out
    assert {k: v for k, v in epochs.train.items() if k != "task_rl_size"} == long.train
    for e, lng in zip([u for u in units_of(epochs) if u.kind == "start"], [u for u in units_of(long) if u.kind == "start"]):
        rl, pool = load_examples(e.cfg, "train"), load_examples(e.cfg, "warmstart")
        assert pool == load_examples(lng.cfg, "train") and set(rl) < set(pool) and len(rl) == 264
        assert sorted(map(difficulty_of, (x.prompt for x in rl))).count("2*1") == 44
        assert load_examples(e.cfg, "eval") == load_examples(lng.cfg, "eval")
        assert starting_model(e.cfg) == starting_model(lng.cfg)  # the long study's cached warm start serves
    cfg = units_of(epochs)[1].cfg
    assert 55 <= cfg.steps / (264 // cfg.queries_per_step) <= 65  # the paper's ~60 passes by step 1000


@pytest.mark.parametrize("args, message", [
    (["seedz=1"], "unknown key 'seedz': neither a study key nor an erpo train key; did you mean seeds?"),
    (["lrr=1"], "unknown key 'lrr': .*; did you mean lr?"),
    (["variants=grpo,ppo"], "variants=grpo,ppo: .* has the variants grpo, erpo"),
    (["eval_every=0"], "eval_every=0 must be >= 1"),
    (["run_dir=x"], "train: sets run_dir, which the study sets for every run"),
    (["jobs=two"], "jobs='two' is not an integer"),
    (["eval_temperatures=0.5,1.0"], "temperature_groups: high = \\[1.5\\] needs temperatures of eval_temperatures"),
    (["task_rl_size=21"], "task_rl_size=21 exceeds task_train_size=20"),
    (["label=a b"], "label='a b': use letters, digits"),
])
def test_bad_study_input_is_one_line(args, message, capsys):
    assert main(["study", TINY, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("erpo: error: ")
    assert __import__("re").search(message, err), err


def test_a_variant_may_not_change_the_shared_start(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text("study:\n  variants:\n    big: {tiny_hidden_size: 128}\ntrain: {}\n")
    assert main(["study", str(path)]) == 2
    assert "variant big sets tiny_hidden_size, which decides the starting model" in capsys.readouterr().err
    path.write_text("study: {}\ntrain: {lr: 1}\nextra: {}\n")
    assert main(["study", str(path)]) == 2
    assert "must hold the mappings study: and train: (not extra:)" in capsys.readouterr().err
    assert main(["study"]) == 2
    assert "erpo study needs a study config first" in capsys.readouterr().err


# ---------------------------------------------------------------------- the tiny study, end to end


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """A study run in this process sets torch's thread count for the demo model; give other tests theirs back."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("study-warmstart"))


@pytest.fixture(scope="module")
def whole(tmp_path_factory, cache_dir):
    """The tiny study run once without interruption, one unit at a time in this process (jobs=1:
    each unit in a process of its own costs an interpreter start and torch's import, ~5 CPU-s;
    test_two_units_at_a_time_in_their_own_processes_give_the_same_numbers runs jobs=2)."""
    import torch

    out = str(tmp_path_factory.mktemp("study") / "whole")
    threads = torch.get_num_threads()  # the study sets the demo model's; module-scoped, so restored here
    try:
        assert main(["study", TINY, f"out={out}", f"cache_dir={cache_dir}", "jobs=1"]) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def _results(out):
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


def test_tiny_study_end_to_end(whole, tmp_path):
    r = _results(whole)
    assert r["missing"] == [] and r["steps"] == [0, 2, 4] and r["seeds"] == [0, 1]
    for variant in ("grpo", "erpo", "erpo-qkl-only", "erpo-weights-only"):
        for seed in ("0", "1"):
            points = r["eval"][variant][seed]
            assert sorted(points, key=int) == ["0", "2", "4"]
            assert all(len(p["avg"]) == 2 and 0 <= p["greedy"] <= 1 for p in points.values())
            curve = r["train"][variant][seed]
            assert curve["step"] == [1, 2, 3, 4] and all(v is not None for v in curve["policy_kl"])
    # step 0 is the same starting model for every variant of a seed
    assert r["eval"]["grpo"]["1"]["0"] == r["eval"]["erpo"]["1"]["0"]
    assert r["eval"]["grpo"]["0"]["4"] != r["eval"]["erpo"]["0"]["4"] or \
        r["train"]["grpo"]["0"]["query_kl"] != r["train"]["erpo"]["0"]["query_kl"]
    assert max(r["train"]["grpo"]["0"]["reward"]) > 0  # the runs learn something to compare
    assert r["time"]["erpo-seed0"]["train_steps"] == 4 and r["time"]["erpo-seed0"]["evals"] == 2
    with open(os.path.join(whole, "report.md")) as f:
        report = f.read()
    for section in ("status", "setup", "findings", "accuracy", "pass", "temperatures", "kl", "entropy", "time"):
        assert f"<!-- study:{section} -->" in report
    assert "Complete: every run and evaluation" in report and "Does GRPO's high-temperature accuracy" in report
    for png in ("accuracy.png", "training.png"):
        with open(os.path.join(whole, png), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_two_units_at_a_time_in_their_own_processes_give_the_same_numbers(whole, tmp_path, cache_dir, capsys):
    """jobs=2 (each unit in a process of its own, two at a time: seed 0's starting model, then
    its grpo and erpo runs side by side) on a part of the tiny study's grid: every unit done,
    each with its log, and every evaluation and training curve equal to the in-process study's."""
    out = str(tmp_path / "two")
    assert main(["study", TINY, f"out={out}", f"cache_dir={cache_dir}", "jobs=2", "variants=grpo,erpo",
                 "seeds=0"]) == 0
    said = capsys.readouterr().out
    assert "3 of 3 units to do, 2 at a time" in said and said.count("done in") == 3, said
    r, done = _results(out), _results(whole)
    assert r["missing"] == [] and sorted(r["eval"]) == ["erpo", "grpo"] and r["seeds"] == [0]
    for variant in ("grpo", "erpo"):
        assert r["eval"][variant]["0"] == done["eval"][variant]["0"], variant
        assert r["train"][variant]["0"] == done["train"][variant]["0"], variant
    for unit in ("start-seed0", "grpo-seed0", "erpo-seed0"):
        assert os.path.getsize(os.path.join(out, "logs", f"{unit}.log")) > 0, unit


def test_report_refreshes_a_doc_page(whole, tmp_path, cache_dir):
    doc = tmp_path / "page.md"
    doc.write_text("# mine\n\nprose stays\n<!-- study:findings -->\nold\n<!-- /study:findings -->\nend\n")
    assert main(["study", TINY, f"out={whole}", f"cache_dir={cache_dir}", f"doc={doc}", "report_only=true"]) == 0
    text = doc.read_text()
    assert text.startswith("# mine\n\nprose stays\n<!-- study:findings -->\n- Does GRPO") and text.endswith("end\n")
    assert "old" not in text and (tmp_path / "page-accuracy.png").is_file()


def test_epochs_study_machinery_on_the_tiny_model(whole, tmp_path, cache_dir):
    """configs/study-epochs.yaml's grid (its five variants, its label) on the tiny study's
    model and task with a subset of RL prompts: every variant runs and is evaluated, the RL
    prompts are the subset (8 of the 20 problems) while the starting model is the tiny study's
    (its warm start learns from all 20: the same step-0 evaluation), and the report rewrites
    this study's sections of a page that holds another study's too, leaving those alone."""
    import yaml

    from erpo.ref_cache import read_ref_cache

    epochs, tiny = (yaml.safe_load(open(p, encoding="utf-8")) for p in (EPOCHS, TINY))
    study = {k: epochs["study"][k] for k in ("variants", "label")}
    study.update(seeds=[0], eval_every=2, temperature_groups=tiny["study"]["temperature_groups"])
    config = tmp_path / "epochs-tiny.yaml"
    config.write_text(yaml.safe_dump({"study": study, "train": dict(tiny["train"], task_rl_size=8)}))
    out = str(tmp_path / "out")
    doc = tmp_path / "page.md"
    doc.write_text("<!-- study:findings -->\nthe first study's\n<!-- /study:findings -->\n"
                   f"<!-- study-{study['label']}:findings -->\nold\n<!-- /study-{study['label']}:findings -->\n")
    assert main(["study", str(config), f"out={out}", f"cache_dir={cache_dir}", f"doc={doc}"]) == 0
    r = _results(out)
    assert r["missing"] == [] and sorted(r["eval"]) == sorted(epochs["study"]["variants"])
    assert all(v is not None for v in r["train"]["grpo-nokl"]["0"]["policy_kl"])  # monitored without its KL term
    assert len(read_ref_cache(os.path.join(out, "runs", "grpo-nokl-seed0", "ref_cache.safetensors"))) == 8
    assert r["eval"]["erpo"]["0"]["0"] == _results(whole)["eval"]["erpo"]["0"]["0"]  # the same starting model
    text = doc.read_text()
    assert text.startswith("<!-- study:findings -->\nthe first study's\n") and "old" not in text
    assert f"<!-- study-{study['label']}:findings -->\n- Does GRPO" in text
    assert (tmp_path / f"page-{study['label']}-accuracy.png").is_file() and not (tmp_path / "page-accuracy.png").exists()


def test_rerun_with_other_settings_is_refused(whole, cache_dir, capsys, monkeypatch):
    before = os.path.getmtime(os.path.join(whole, "results.json"))
    assert main(["study", TINY, f"out={whole}", f"cache_dir={cache_dir}", "lr=0.002"]) == 2
    err = capsys.readouterr().err
    assert "runs/grpo-seed0 was made with lr=0.001 (this study: lr=0.002); give another out=DIR" in err
    assert "overwrite=true" in err and os.path.getmtime(os.path.join(whole, "results.json")) == before
    # what changes no result (jobs) is not a difference: everything is done, only the report is written
    assert main(["study", TINY, f"out={whole}", f"cache_dir={cache_dir}", "jobs=2"]) == 0
    assert "0 of 10 units to do" in capsys.readouterr().out
    # code that would train another warm start: refused for running, fine for reading
    import erpo.study

    monkeypatch.setattr(erpo.study, "starting_model", lambda cfg: "warmstart-other")
    assert main(["study", TINY, f"out={whole}", f"cache_dir={cache_dir}"]) == 2
    err = capsys.readouterr().err
    assert "start-seed0 was made with starting_model=warmstart-" in err and "warm start changed" in err
    assert main(["study", TINY, f"out={whole}", f"cache_dir={cache_dir}", "report_only=true"]) == 0
    assert "starting_model=warmstart-other" in capsys.readouterr().out  # a note: the report shows what was made


def test_study_killed_halfway_resumes_where_it_stopped(whole, tmp_path, cache_dir):
    """A study killed (SIGKILL) during its second run continues: the first run's files are
    not touched again, the second resumes from its checkpoint, and every number equals the
    uninterrupted study's."""
    out = str(tmp_path / "killed")
    cmd = [sys.executable, "-m", "erpo", "study", TINY, f"out={out}", f"cache_dir={cache_dir}", "jobs=1"]
    first = os.path.join(out, "eval", "grpo-seed0", "grpo-seed0-step-000004", "eval.json")
    second = os.path.join(out, "runs", "erpo-seed0", "checkpoints", "step-000002", "trainer_state.json")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 600
        while not os.path.isfile(second) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert os.path.isfile(first) and not os.path.isfile(os.path.join(out, "results.json"))
    kept = {p: os.stat(p).st_mtime_ns for p in (first, os.path.join(out, "runs", "grpo-seed0", "metrics.jsonl"))}
    assert main(["study", TINY, f"out={out}", "report_only=true", f"cache_dir={cache_dir}"]) == 0
    assert _results(out)["missing"]  # a report of what is there, saying what is not
    assert main(["study", TINY, f"out={out}", f"cache_dir={cache_dir}"]) == 0
    assert {p: os.stat(p).st_mtime_ns for p in kept} == kept  # the finished run was not redone
    with open(os.path.join(out, "times.jsonl")) as f:
        trained = [json.loads(line)["steps"] for line in f if '"erpo-seed0", "what": "train"' in line]
    assert trained[-1] == [3, 4] and [1, 2] not in trained[1:]  # resumed after step 2, not started over
    with open(os.path.join(out, "runs", "erpo-seed0", "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4]
    done, resumed = _results(whole), _results(out)
    assert resumed["missing"] == [] and resumed["eval"] == done["eval"]
    strip = lambda r: {v: {s: {k: c[k] for k in c if k != "step"} for s, c in seeds.items()}  # noqa: E731
                       for v, seeds in r["train"].items()}
    assert strip(resumed) == strip(done)


def test_ctrl_c_in_a_unit_process_is_one_line_in_its_log_not_a_traceback(tmp_path, monkeypatch, capfd):
    """Ctrl-C reaches every process of the terminal: a unit's process (jobs > 1) exits 130
    with one line in its log, and prints nothing where the parent prints its own message."""
    import erpo.study as study

    unit = units_of(load_study(TINY, [f"out={tmp_path}"]))[1]

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(study, "run_unit", interrupted)
    with pytest.raises(SystemExit) as exit_:
        study._unit_process(str(tmp_path), unit)
    assert exit_.value.code == 130
    assert capfd.readouterr() == ("", "")
    with open(tmp_path / "logs" / f"{unit.name}.log") as f:
        assert f.read().strip() == "erpo: interrupted; the study's rerun continues this unit where it stopped"


def test_starting_models_are_started_before_runs(tmp_path):
    """jobs > 1: every seed's starting model (its warm start) goes first, so no core waits
    for the last seed's warm start while the other trains it; a run waits for its own."""
    from erpo.study import _ready

    queue = units_of(load_study(TINY, [f"out={tmp_path}"]))  # start-seed0, its 4 runs, start-seed1, ...
    assert _ready(queue, set()).name == "start-seed0"
    rest = [u for u in queue if u.name != "start-seed0"]
    assert _ready(rest, set()).name == "start-seed1"  # not grpo-seed0: its warm start is not done
    assert _ready(rest, {"start-seed0"}).name == "start-seed1"  # grpo-seed0 could start, seed 1's warm start first
    runs = [u for u in rest if u.kind == "run"]
    assert _ready(runs, set()) is None
    assert _ready(runs, {"start-seed1"}).name == "grpo-seed1"


def test_progress_lines_are_flushed_as_they_are_printed(monkeypatch):
    """A redirected `erpo study > log` (block-buffered stdout) shows each line when it is said."""
    import erpo.study as study

    flushed = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: flushed.append(k.get("flush")))
    study.say("erpo: study: a line")
    assert flushed == [True]
    assert study.study_command.__defaults__ == (study.say,)


# ---------------------------------------------------------------------- the findings' rule


def _made_up(curves):
    """results.json-shaped data: one temperature group 'high' at T=1.5, the given curves per seed."""
    steps = sorted(int(s) for s in next(iter(curves.values())))
    return {"variants": {"grpo": {}}, "seeds": list(range(len(curves))), "steps": steps, "temperatures": [1.5],
            "groups": {"high": [1.5]}, "n_samples": 4, "levels": [],
            "eval": {"grpo": {str(i): {str(s): {"avg": [v], "pass": [v], "greedy": v} for s, v in c.items()}
                              for i, c in enumerate(curves.values())}}}


def test_findings_rule_calls_a_decline_only_when_most_seeds_fall():
    falling = _made_up({0: {0: 0.5, 100: 0.7, 200: 0.6}, 1: {0: 0.5, 100: 0.72, 200: 0.62}, 2: {0: 0.5, 100: 0.7, 200: 0.69}})
    t = trend(falling, "grpo", "high")
    assert t["best_step"] == 100 and t["declining_seeds"] == 2 and declines(t)
    assert t["first_below"] == 200 and t["change"][0] == pytest.approx(-0.07, abs=1e-9)
    rising = _made_up({0: {0: 0.5, 100: 0.6, 200: 0.7}, 1: {0: 0.5, 100: 0.62, 200: 0.6}, 2: {0: 0.5, 100: 0.6, 200: 0.65}})
    assert not declines(trend(rising, "grpo", "high"))
    never_better = _made_up({0: {0: 0.4, 100: 0.25, 200: 0.3}, 1: {0: 0.4, 100: 0.3, 200: 0.3},
                             2: {0: 0.4, 100: 0.35, 200: 0.35}})
    t = trend(never_better, "grpo", "high")  # the starting model is the best checkpoint: falling from it declines
    assert t["best_step"] == 0 and t["first_below"] == 100 and t["declining_seeds"] == 3 and declines(t)
    one_seed = _made_up({0: {0: 0.5, 100: 0.9, 200: 0.5}, 1: {0: 0.5, 100: 0.6, 200: 0.61}, 2: {0: 0.5, 100: 0.6, 200: 0.6}})
    assert not declines(trend(one_seed, "grpo", "high"))  # the mean falls, but one seed is not most


def test_figures_of_a_study_with_nothing_evaluated_yet():
    """report_only=true right after a study starts (no evaluation written yet) draws empty figures."""
    from erpo.study_report import accuracy_figure, training_figure

    empty = dict(_made_up({0: {0: 0.5}}), eval={}, train={})
    assert accuracy_figure(empty)[:4] == training_figure(empty)[:4] == b"\x89PNG"
