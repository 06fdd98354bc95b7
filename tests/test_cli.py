"""The `erpo` command (erpo/cli.py): every bad input is one line `erpo: error: ...`,
exit status 2, no traceback, and nothing of an earlier run is lost; the subcommands
ref-cache, plot and eval do their job."""
import json
import os
import shlex
import subprocess
import sys
import tempfile

import pytest
import torch

import erpo.tiny as tiny_module
from erpo.cli import main
from erpo.config import FIELDS, SECTIONS, TrainConfig, field_choices, help_text, load_config, parse_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_args(run_dir, cache_dir, **extra):
    values = dict(run_dir=run_dir, cache_dir=cache_dir, tiny_hidden_size=32, tiny_layers=1, warmstart_steps=100,
                  warmstart_batch_size=16, warmstart_unboxed=0.0, task_max_operand=4, task_train_size=20,
                  task_eval_size=5, group_size=4, queries_per_step=4, max_new_tokens=6, steps=2, save_every=0,
                  progress="false")
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
    """A finished two-step run of the shrunk default."""
    root = tmp_path_factory.mktemp("cli")
    run, cache = str(root / "run"), str(root / "cache")
    threads = torch.get_num_threads()
    assert main(["train", *tiny_args(run, cache)]) == 0
    torch.set_num_threads(threads)
    return root, run, cache


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The trainer sets torch's thread count for the demo model; give other tests theirs back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def one_line_error(capsys, argv, *needles):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("erpo: error: ") and "\n" not in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def table_rows(text):
    """The markdown tables in `text`: first cell -> the other cells (first occurrence wins)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|-"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            out.setdefault(cells[0], cells[1:])
    return out


def snapshot(run):
    out = {}
    for dirpath, _, files in os.walk(run):
        for f in files:
            path = os.path.join(dirpath, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, run)] = fh.read()
    return out


def test_every_config_key_has_help_and_a_section_and_help_prints_them_by_section(capsys):
    names = [section.name for section in SECTIONS]
    for key, f in FIELDS.items():
        assert f.metadata["help"], key
        assert f.metadata["section"] in names, key
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert help_text() in out
    # each key under its own section's title, sections in order
    starts = [out.index(f"\n{section.title}:\n") for section in SECTIONS]
    assert starts == sorted(starts)
    for key, f in FIELDS.items():
        at = out.index(f"\n  {key} ")
        section = names.index(f.metadata["section"])
        assert starts[section] < at < (starts[section + 1] if section + 1 < len(starts) else len(out)), key


def test_choice_lists_come_from_the_code_that_implements_them(capsys):
    from erpo_kernels import ALGORITHMS, BACKENDS, LOSS_AGGS
    from erpo.query_weights import SCHEMES

    for key, allowed in (("algorithm", ALGORITHMS), ("loss_agg", LOSS_AGGS), ("kernel_backend", BACKENDS),
                         ("query_weighting", SCHEMES)):
        assert field_choices(key) == tuple(allowed)
        assert "{" + ", ".join(allowed) + "}" in " ".join(help_text().split())
    one_line_error(capsys, ["train", "loss_agg=seq-mean"], "loss_agg='seq-mean' is not one of token-mean, seq-mean-token-mean")


def test_loss_config_and_weighter_are_built_from_the_config():
    import torch
    from erpo_kernels import LossConfig
    from erpo.query_weights import QueryWeighter

    cfg = TrainConfig(algorithm="grpo", alpha=0.2, beta=0.05, loss_agg="seq-mean-token-mean", eps_low=0.1,
                      eps_high=0.25, dual_clip=2.5, kl_guard=5.0, query_weighting="softmax", bins=3, gamma=0.5,
                      weight_temperature=0.7, w_min=0.2, w_max=4.0)
    assert cfg.loss_config() == LossConfig(algorithm="grpo", alpha=0.2, beta=0.05, loss_agg="seq-mean-token-mean",
                                           eps_low=0.1, eps_high=0.25, dual_clip=2.5, kl_guard=5.0)
    scores = torch.tensor([-3.0, -1.0, -2.0, -0.5, -2.5])
    by_hand = QueryWeighter(scores, scheme="softmax", bins=3, gamma=0.5, temperature=0.7, w_min=0.2, w_max=4.0)
    built = QueryWeighter.from_config(cfg, scores)
    assert torch.equal(built.batch_weights(scores[:3]), by_hand.batch_weights(scores[:3]))
    assert (built.scheme, built.bins, built.gamma, built.temperature, built.w_min, built.w_max) == (
        "softmax", 3, 0.5, 0.7, 0.2, 4.0)


def test_a_config_yaml_written_before_the_sections_still_loads(tmp_path):
    path = tmp_path / "config.yaml"  # the flat key: value format runs have always saved
    path.write_text("algorithm: grpo\nalpha: 0.01\nloss_agg: seq-mean-token-mean\ngroup_size: 4\n"
                    "eval_temperatures:\n- 0.5\n- 1.0\neval_k_values: []\noverwrite: false\n")
    cfg, _ = load_config(str(path))
    assert (cfg.algorithm, cfg.loss_agg, cfg.group_size, cfg.eval.temperatures) == (
        "grpo", "seq-mean-token-mean", 4, [0.5, 1.0])


def test_a_config_yaml_written_before_the_sub_configs_loads_resumes_and_is_written_alike(tmp_path, monkeypatch):
    """tests/data/config-before-subconfigs.yaml was written by save_config at 4201556, when the
    demo and eval keys were TrainConfig fields (cache_dir made relative): it loads into the
    sub-configs, validates, merges for a resume, and this version writes the same file back
    (same keys, same order, same values), so a run's config.yaml reads the same both ways."""
    import yaml

    from erpo.config import PATH_KEYS, ConfigError, merge_for_resume, read_yaml, resolved_path, save_config

    old = os.path.join(ROOT, "tests", "data", "config-before-subconfigs.yaml")
    monkeypatch.chdir(tmp_path)
    cfg, _ = load_config(old)
    cfg.validate()
    assert (cfg.demo.tiny_layers, cfg.demo.task, cfg.steps, cfg.run_dir) == (1, "mixed", 3, "runs/old")
    assert (cfg.eval.n_samples, cfg.eval.temperatures, cfg.eval.save_samples) == (2, [0.5], True)
    assert cfg == TrainConfig(tiny_layers=1, task="mixed", eval_n_samples=2, eval_temperatures=[0.5],
                              eval_save_samples=True, steps=3, run_dir="runs/old", cache_dir=".cache/erpo")
    resumed = merge_for_resume(read_yaml(old), {"steps": 5, "eval_n_samples": 4})
    assert (resumed.steps, resumed.eval.n_samples, resumed.demo.tiny_layers) == (5, 4, 1)
    with pytest.raises(ConfigError, match="tiny_layers cannot change when resuming"):
        merge_for_resume(read_yaml(old), {"tiny_layers": 2})
    save_config(cfg, "config.yaml")
    before = yaml.safe_load(open(old, encoding="utf-8"))
    before.update({key: resolved_path(key, before[key]) for key in PATH_KEYS})
    after = yaml.safe_load(open("config.yaml", encoding="utf-8"))
    added = {k: v for k, v in after.items() if k not in before}  # keys erpo gained since: their defaults
    assert added == {k: TrainConfig().get(k) for k in added}
    assert [(k, v) for k, v in after.items() if k in before] == list(before.items())


def test_demo_and_eval_keys_are_sub_configs_and_keep_their_flat_keys(tmp_path):
    """cfg.demo and cfg.eval hold the embedded demo's and `erpo eval`'s keys and validate
    themselves; the flat keys stay the config's interface: the constructor, dataclasses.replace,
    cfg.get, key=value and config.yaml (written flat, read back equal)."""
    import dataclasses

    import yaml

    from erpo.config import EVAL_KEYS, KEYS, ConfigError, DemoConfig, EvalConfig, save_config
    from erpo.evaluate import evaluate_sampler

    cfg = TrainConfig(tiny_layers=3, eval_n_samples=4, steps=7, cache_dir=str(tmp_path / "cache"))
    assert (cfg.demo.tiny_layers, cfg.eval.n_samples, cfg.steps) == (3, 4, 7)
    assert isinstance(cfg.demo, DemoConfig) and isinstance(cfg.eval, EvalConfig)
    assert cfg.get("tiny_layers") == 3 and cfg.get("eval_n_samples") == 4 and cfg.get("steps") == 7
    other = dataclasses.replace(cfg, eval_limit=5)
    assert (other.eval.limit, other.eval.n_samples, cfg.eval.limit) == (5, 4, 0)  # a copy, not shared
    other.eval.temperatures.append(2.0)
    assert 2.0 not in cfg.eval.temperatures
    assert parse_overrides(["tiny_layers=1", "eval_limit=2"]) == {"tiny_layers": 1, "eval_limit": 2}
    path = tmp_path / "config.yaml"
    save_config(cfg, str(path))
    saved = yaml.safe_load(path.read_text())
    assert list(saved) == list(KEYS) and "demo" not in saved and "eval" not in saved
    assert saved["tiny_layers"] == 3 and saved["eval_n_samples"] == 4
    assert load_config(str(path))[0] == cfg
    with pytest.raises(TypeError, match="no key 'tiny_layer'"):
        TrainConfig(tiny_layer=1)
    # each validates itself and names its keys as the user does
    with pytest.raises(ConfigError, match="tiny_hidden_size=30 must be a multiple of 4"):
        TrainConfig(tiny_hidden_size=30).validate()
    with pytest.raises(ConfigError, match="^warmstart_unboxed=1.0 must lie in"):
        DemoConfig(warmstart_unboxed=1.0).validate()
    with pytest.raises(ConfigError, match="^eval_n_samples=0 must be an integer >= 1$"):
        EvalConfig(n_samples=0).validate()
    short = EvalConfig(n_samples=2, k_values=[3])
    short.name_keys(EVAL_KEYS)
    with pytest.raises(ConfigError, match=r"^k=\[3\]: each k of Pass@k must lie in \[1, n=2\]"):
        short.validate()
    with pytest.raises(ValueError, match="^n_samples=0 must be an integer >= 1$"):  # evaluate's own check is the same
        evaluate_sampler(lambda problems, t: ["x"] * len(problems), ["a"], reward_fn=lambda c, a: 0.0, n_samples=0)


def test_every_shipped_config_loads_and_validates():
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    # study-*.yaml are `erpo study` configs (study: and train: mappings): tests/test_study.py loads them
    paths = sorted(os.path.join(root, name) for name in os.listdir(root)
                   if name.endswith(".yaml") and not name.startswith("study-"))
    assert [os.path.basename(p) for p in paths] == [
        "demo-vllm.yaml", "demo.yaml", "qwen2.5-math-1.5b-1gpu.yaml", "qwen2.5-math-7b-8gpu.yaml"]
    for path in paths:
        cfg, given = load_config(path)
        cfg.validate()
        with open(path, encoding="utf-8") as f:
            assert "Memory" in f.read()  # each states its (measured or estimated) memory per GPU
    demo, _ = load_config(os.path.join(root, "demo.yaml"))
    assert demo == TrainConfig(mini_batches=2)  # the embedded default, two updates per rollout batch
    demo_vllm, _ = load_config(os.path.join(root, "demo-vllm.yaml"))  # the same with vLLM, head_dim 32
    assert demo_vllm == TrainConfig(mini_batches=2, rollout_backend="vllm", tiny_hidden_size=128,
                                    warmstart_lr=1.5e-3, lr=1e-4, run_dir="runs/demo-vllm")


def test_the_demos_run_dir_response_length_and_lr_are_the_demos_only():
    """run_dir, max_new_tokens and lr default to auto: the demo's values (runs/demo, 8, 3e-4) for
    the embedded demo alone; a model and data of one's own get their own run_dir and values for
    a real model, stored in config.yaml as numbers (issue 19.9)."""
    from erpo.cli import resolve_config
    from erpo.config import DEMO_LR, DEMO_MAX_NEW_TOKENS, LR, MAX_NEW_TOKENS

    demo = resolve_config([])
    assert (demo.run_dir, demo.max_new_tokens, demo.lr) == (os.path.join("runs", "demo"), 8, 3e-4)
    assert (DEMO_MAX_NEW_TOKENS, DEMO_LR) == (8, 3e-4)  # `make demo`'s numbers, as before
    own = resolve_config(["model=/models/Qwen2.5-Math-1.5B", "dataset=data/math_train.jsonl"])
    assert (own.run_dir, own.max_new_tokens, own.lr) == (
        os.path.join("runs", "Qwen2.5-Math-1.5B-math_train"), MAX_NEW_TOKENS, LR)
    ckpt_run = resolve_config(["model=runs/a/checkpoints/step-000100", "dataset=arithmetic"])
    assert (ckpt_run.run_dir, ckpt_run.max_new_tokens, ckpt_run.lr) == (
        os.path.join("runs", "a-step-000100-arithmetic"), DEMO_MAX_NEW_TOKENS, LR)
    given = resolve_config(["model=/m", "run_dir=r", "max_new_tokens=5", "lr=0.1"])
    assert (given.run_dir, given.max_new_tokens, given.lr) == ("r", 5, 0.1)
    outside = resolve_config(["model=/models/Qwen2.5", "data=/data/math.jsonl"], "eval")
    assert outside.eval_max_tokens == MAX_NEW_TOKENS
    assert resolve_config(["model=tiny", "data=arithmetic"], "eval").eval_max_tokens == DEMO_MAX_NEW_TOKENS


def test_mini_batches_must_divide_the_queries(capsys):
    one_line_error(capsys, ["train", "mini_batches=3"], "mini_batches=3 does not divide queries_per_step=16",
                   "use one of 1, 2, 4, 8, 16")
    one_line_error(capsys, ["train", "mini_batches=0"], "mini_batches=0 must be finite and >= 1")
    one_line_error(capsys, ["train", "ppo_epochs=0"], "ppo_epochs=0 must be finite and >= 1")


def test_unknown_key_names_the_closest(capsys):
    one_line_error(capsys, ["train", "alpah=0.1"], "unknown config key 'alpah'", "did you mean alpha?")
    one_line_error(capsys, ["train", "grop_size=4"], "did you mean group_size?")
    one_line_error(capsys, ["train", "steps=many"], "steps='many' is not an integer")
    one_line_error(capsys, ["train", "query_weighting=prevalance"], "did you mean prevalence?")


def test_config_file_errors(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("alpha: 0.05\nlearning_rate: 1e-4\n")
    one_line_error(capsys, ["train", str(path)], "unknown config key 'learning_rate' in", "did you mean lr?")
    path.write_text("alpha: 0.05\nzzz: 1\n")
    one_line_error(capsys, ["train", str(path)], "unknown config key 'zzz' in", "`erpo train --help` lists the keys")
    one_line_error(capsys, ["train", str(tmp_path / "missing.yaml")], "does not exist")


def test_group_size_one(capsys):
    err = one_line_error(capsys, ["train", "group_size=1"], "group_size=1 with adv_norm=std", "set group_size=2")
    assert "unbiased std" in err
    one_line_error(capsys, ["train", "group_size=1", "adv_norm=none"], "group_size=1 with adv_norm=none")


def test_missing_model_and_dataset(capsys, tmp_path):
    one_line_error(capsys, ["train", f"model={tmp_path}/no-such-model", f"run_dir={tmp_path}/r"],
                   "no-such-model' does not exist", "model=tiny")
    (tmp_path / "empty-model").mkdir()
    one_line_error(capsys, ["train", f"model={tmp_path}/empty-model", f"run_dir={tmp_path}/r"], "has no config.json")
    one_line_error(capsys, ["train", f"dataset={tmp_path}/nope.jsonl", f"run_dir={tmp_path}/r"],
                   "nope.jsonl' does not exist")
    one_line_error(capsys, ["train", f"dataset={tmp_path}/data.csv", f"run_dir={tmp_path}/r"], "does not exist")
    (tmp_path / "data.csv").write_text("a,b\n")
    one_line_error(capsys, ["train", f"dataset={tmp_path}/data.csv", f"run_dir={tmp_path}/r"],
                   "unsupported file type .csv")
    assert not os.path.exists(tmp_path / "r")  # nothing was created


def test_unusable_paths_backend_and_values(capsys, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    one_line_error(capsys, ["train", f"run_dir={tmp_path}/file"], "run_dir=", "is a file, not a directory")
    (tmp_path / "dir").mkdir()
    one_line_error(capsys, ["train", f"run_dir={tmp_path}/r", f"ref_cache={tmp_path}/dir"], "is a directory")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels cannot run on CPU tensors now
    one_line_error(capsys, ["train", "kernel_backend=triton", "device=cpu", f"run_dir={tmp_path}/r"],
                   "kernel_backend=triton: backend='triton' needs CUDA tensors")
    one_line_error(capsys, ["train", "steps=", f"run_dir={tmp_path}/r"], "steps is empty")
    one_line_error(capsys, ["train", "eval_temperatures=hot", f"run_dir={tmp_path}/r"], "is not a list of numbers")
    one_line_error(capsys, ["plot"], "plot needs at least one run directory")
    assert not os.path.exists(tmp_path / "r")  # nothing was created


def test_dataset_without_fields(capsys, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"q": "1+1=", "solution": "2"}) + "\n")
    one_line_error(capsys, ["train", f"dataset={data}", f"run_dir={tmp_path}/r"],
                   "record 0 has no 'prompt' field (its fields: q, solution)", "set prompt_field=NAME")
    # a MATH-style record's answer is the \boxed{} of its solution; this one has none
    one_line_error(capsys, ["train", f"dataset={data}", "prompt_field=q", f"run_dir={tmp_path}/r"],
                   "has no 'answer' field and its 'solution' holds no \\boxed{} answer", "answer_field=NAME")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n')
    one_line_error(capsys, ["train", f"dataset={bad}", f"run_dir={tmp_path}/r"], "line 2 is not valid JSON")


def test_stale_cache_loses_nothing(capsys, done_run):
    root, run, cache = done_run
    before = snapshot(run)
    assert "metrics.jsonl" in before and any(k.startswith("checkpoints") for k in before)
    # a new run into the directory of a finished one is refused, naming the three ways on
    err = one_line_error(capsys, ["train", *tiny_args(run, cache)],
                         f"run_dir={run} holds an earlier run (checkpoint step-000002)", f"resume={run}",
                         "overwrite=true")
    assert snapshot(run) == before
    # a different warm start = different reference weights than the cache beside the run
    err = one_line_error(capsys, ["train", *tiny_args(run, cache, warmstart_steps=101), "overwrite=true"],
                         "ref_cache.safetensors is stale: built for model weights", "rebuild it with: erpo ref-cache")
    assert "warmstart_steps=101" in err and f"run_dir={run}" in err
    assert snapshot(run) == before
    one_line_error(capsys, ["train", f"resume={root}/nowhere"], "no such run directory")
    one_line_error(capsys, ["train", f"resume={run}", "lr=0.5"], "lr cannot change when resuming")
    assert snapshot(run) == before


def test_missing_query_then_ref_cache_rebuilds(capsys, done_run, tmp_path):
    root, run, cache = done_run
    model_dir = os.path.join(run, "checkpoints", "step-000002")
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(8)]
    small.write_text("".join(json.dumps(r) + "\n" for r in rows[:5]))
    large.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [f"model={model_dir}", "template=plain", "reward=exact_match", "group_size=2", "queries_per_step=2",
            "max_new_tokens=6", "steps=1", "progress=false", f"run_dir={tmp_path}/run"]
    assert main(["train", f"dataset={small}", *args]) == 0
    capsys.readouterr()
    err = one_line_error(capsys, ["train", f"dataset={large}", *args, "overwrite=true"],
                         "has no entry for training query 5 ('5+1=')", "(and 2 more)")
    assert err.endswith(f"rebuild it with: erpo ref-cache model={model_dir} dataset={large} template=plain "
                        f"run_dir={tmp_path}/run overwrite=true")   # the run's own cache: replaced
    one_line_error(capsys, ["ref-cache", f"dataset={large}", *args], "exists", "overwrite=true")
    command = shlex.split(err.split("rebuild it with: ")[1])
    assert command[:2] == ["erpo", "ref-cache"] and main(command[1:]) == 0   # pasted as suggested
    assert "wrote" in capsys.readouterr().out
    assert main(["train", f"dataset={large}", *args, "overwrite=true"]) == 0
    with open(f"{tmp_path}/run/config.yaml") as f:
        assert "overwrite: false" in f.read()   # not kept: a copy of this config cannot delete the run


def test_plot_and_eval(capsys, done_run, tmp_path):
    root, run, cache = done_run
    other = str(root / "run-b")
    assert main(["train", *tiny_args(other, cache, algorithm="grpo", beta=0.0)]) == 0
    out = str(tmp_path / "both.png")
    assert main(["plot", run, other, "--out", out]) == 0
    with open(out, "rb") as f:
        assert f.read(4) == b"\x89PNG"
    one_line_error(capsys, ["plot", str(tmp_path)], "has no metrics.jsonl")

    capsys.readouterr()
    # the long form: run_dir= and the eval_ keys of the config
    assert main(["eval", f"run_dir={run}", "eval_temperatures=0.5,1.0", "eval_n_samples=2", "eval_k_values=1,2",
                 "eval_limit=3", "progress=false"]) == 0
    report = os.path.join(run, "eval", "run-step-000002")
    with open(os.path.join(report, "eval.json")) as f:
        result = json.load(f)
    assert result["n_problems"] == 3 and [r["temperature"] for r in result["rows"]] == [0.5, 1.0]
    assert os.path.isfile(os.path.join(report, "eval.md")) and os.path.isfile(os.path.join(report, "eval.png"))
    assert "Greedy Pass@1" in capsys.readouterr().out
    one_line_error(capsys, ["eval", f"run_dir={run}", "eval_checkpoints=/no/such/dir"], "does not exist")


def test_eval_short_keys_end_to_end(capsys, done_run, tmp_path):
    """`erpo eval model=RUN n= temperatures= limit=` on a tiny checkpoint: every k <= n, a
    table on the terminal whose numbers are eval.json's, reports in RUN/eval/NAME."""
    root, run, cache = done_run
    capsys.readouterr()
    assert main(["eval", f"model={run}", "n=3", "temperatures=0.5,1.5", "limit=4", "progress=false",
                 "overwrite=true"]) == 0   # test_plot_and_eval's report there has other settings
    out = capsys.readouterr().out
    report = os.path.join(run, "eval", "run-step-000002")
    with open(os.path.join(report, "eval.json")) as f:
        result = json.load(f)
    assert result["n_problems"] == 4 and result["n_samples"] == 3 and result["k_values"] == [1, 2, 3]
    assert result["settings"]["reward"] == "exact_match" and result["settings"]["template"] == "plain"
    assert result["settings"]["model"] == os.path.join(run, "checkpoints", "step-000002")
    table = table_rows(out)
    assert table["temperature"] == ["Avg@3", "Pass@1", "Pass@2", "Pass@3"]
    row = result["rows"][1]
    assert table["1.5"] == [f"{row['avg_at_n']:.4f}"] + [f"{row['pass_at_k'][k]:.4f}" for k in "123"]
    assert f"Greedy Pass@1: {result['greedy_pass_at_1']:.4f}" in out
    # responses cut by max_new_tokens are counted, and a warning says how to fix it; save_samples
    # writes every completion with its question, gold answer and grade
    assert main(["eval", f"model={run}", "n=2", "temperatures=1.0", "limit=2", "max_new_tokens=1",
                 "save_samples=true", f"out={tmp_path}/cut", "progress=false"]) == 0
    out = capsys.readouterr().out
    assert "warning: 100% of run-step-000002's responses reached max_new_tokens=1" in out
    assert "eval.json, eval.md, eval.png, samples.jsonl" in out
    report = os.path.join(tmp_path, "cut", "run-step-000002")
    with open(os.path.join(report, "eval.json")) as f:
        cut = json.load(f)
    assert cut["settings"]["truncated_fraction"] == 1.0
    with open(os.path.join(report, "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    assert len(samples) == 2 * (1 + 2)
    assert {s["question"] for s in samples} == {s["question"] for s in samples if s["temperature"] == 0.0}
    # with the prompt the model saw, its template applied (issue 19.9)
    assert main(["eval", f"model={run}", "n=1", "temperatures=1.0", "limit=2", "template=Q: {prompt} A:",
                 "save_samples=true", f"out={tmp_path}/tpl", "progress=false", "overwrite=true"]) == 0
    with open(os.path.join(tmp_path, "tpl", "run-step-000002", "samples.jsonl")) as f:
        templated = [json.loads(line) for line in f]
    assert templated and all(s["prompt"] == f"Q: {s['question']} A:" for s in templated), templated
    assert sum(s["correct"] for s in samples if s["temperature"] == 1.0) == sum(cut["rows"][0]["n_correct"])
    for r in result["rows"]:   # the per-problem counts agree with the summary numbers
        assert len(r["n_correct"]) == 4 and all(0 <= c <= 3 for c in r["n_correct"])
        assert r["avg_at_n"] == pytest.approx(sum(r["n_correct"]) / 12)


def test_eval_compares_runs_on_one_plot(capsys, done_run, tmp_path):
    """Two models (a checkpoint and a run, here the same weights) in one call: a report
    each and compare.{md,png,json} in out=; the same weights and seed score the same."""
    root, run, cache = done_run
    other = str(root / "run-b")   # trained by test_plot_and_eval; train it here when run alone
    if not os.path.isdir(os.path.join(other, "checkpoints")):
        assert main(["train", *tiny_args(other, cache, algorithm="grpo", beta=0.0)]) == 0
    out = str(tmp_path / "cmp")
    ckpt = os.path.join(run, "checkpoints", "step-000002")
    capsys.readouterr()
    assert main(["eval", f"model={ckpt},{run},{other}", "n=2", "temperatures=1.0", "limit=3", f"out={out}",
                 "progress=false"]) == 0
    text = capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["compare.json", "compare.md", "compare.png", "run-b-step-000002",
                                       "run-step-000002"]   # the checkpoint and its run: evaluated once
    with open(os.path.join(out, "compare.json")) as f:
        both = json.load(f)
    assert set(both) == {"run-step-000002", "run-b-step-000002"}
    with open(os.path.join(out, "compare.png"), "rb") as f:
        assert f.read(4) == b"\x89PNG"
    with open(os.path.join(out, "compare.md")) as f:
        compared = f.read()
    assert table_rows(compared)["temperature"] == ["run-step-000002 Avg@2", "run-b-step-000002 Avg@2"]
    assert compared.split("![")[0].strip().splitlines()[-1] in text   # the comparison is printed too
    # reports of the same checkpoint with the same seed are the same numbers
    with open(os.path.join(out, "run-step-000002", "eval.json")) as f:
        again = json.load(f)
    assert again["rows"] == both["run-step-000002"]["rows"]


def test_eval_math_style_jsonl(capsys, done_run, tmp_path):
    """data= a local MATH-style JSONL: read as it is; with template=r1 reward=math_verify
    (the run's own are plain and exact_match) graded by math-verify."""
    root, run, cache = done_run
    data = tmp_path / "math.jsonl"
    rows = [{"problem": f"What is {a}+1?", "solution": f"It is $\\boxed{{{a + 1}}}$.", "type": "Algebra"}
            for a in range(3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "ev")
    capsys.readouterr()
    assert main(["eval", f"model={run}", f"data={data}", "n=1", "temperatures=1.0", "max_new_tokens=4",
                 f"out={out}", "progress=false", "template=r1", "reward=math_verify"]) == 0
    with open(os.path.join(out, "run-step-000002-math", "eval.json")) as f:   # named after model and data
        result = json.load(f)
    assert result["n_problems"] == 3 and result["k_values"] == [1]
    assert result["settings"]["reward"] == "math_verify" and result["settings"]["template"] == "r1"
    assert result["settings"]["data"] == str(data) and result["settings"]["max_new_tokens"] == 4


def test_eval_config_resolution(done_run, tmp_path):
    """Which saved config `erpo eval` starts from and where its reports go."""
    from erpo.cli import resolve_config

    root, run, cache = done_run
    ckpt = os.path.join(run, "checkpoints", "step-000002")
    # a quoted glob: every match, in order, and the run they belong to
    cfg = resolve_config([f"model={run}/checkpoints/step-*"], "eval")
    assert cfg.eval.checkpoints == [ckpt] and cfg.run_dir == run
    for entry in (run, ckpt):   # a run, or a checkpoint of it: that run's config and eval/
        cfg = resolve_config([f"model={entry}"], "eval")
        assert cfg.run_dir == run and cfg.demo.task_eval_size == 5 and cfg.eval.checkpoints == [entry]
        assert cfg.eval.out == ""   # = <run>/eval
    # the long form: run_dir= names the base config, the entries may lie elsewhere
    cfg = resolve_config([f"run_dir={run}", f"eval_checkpoints={tmp_path}"], "eval")
    assert cfg.demo.task_eval_size == 5 and cfg.eval.out == ""
    # a model directory outside any run: defaults, and reports in runs/eval, not in the demo's run
    outside = tmp_path / "hf-model"
    outside.mkdir()
    cfg = resolve_config([f"model={outside}"], "eval")
    assert cfg.demo.task_eval_size == 200 and cfg.eval.out == os.path.join("runs", "eval")
    # several runs: reports beside them, not inside the first
    sibling = tmp_path / "runs" / "b"
    (sibling / "checkpoints").mkdir(parents=True)
    (sibling / "config.yaml").write_text("steps: 2\n")
    cfg = resolve_config([f"model={run},{sibling}"], "eval")
    assert cfg.run_dir == run and cfg.eval.out == os.path.commonpath([str(root), str(tmp_path)]) + "/eval"
    # n= alone: Pass@k for every k <= n, whatever k the saved config held
    saved = TrainConfig(**{**__import__("yaml").safe_load(open(os.path.join(run, "config.yaml"))),
                           "eval_k_values": [1, 4, 8]})
    other = tmp_path / "old-run"
    (other / "checkpoints").mkdir(parents=True)
    from erpo.config import save_config
    save_config(saved, str(other / "config.yaml"))
    assert resolve_config([f"model={other}"], "eval").eval.k_values == [1, 4, 8]
    assert resolve_config([f"model={other}", "n=2"], "eval").eval.k_values == []
    assert resolve_config([f"model={other}", "n=8", "k=2"], "eval").eval.k_values == [2]


def test_eval_bad_input(capsys, done_run, tmp_path):
    root, run, cache = done_run
    base = [f"model={run}", "limit=2", "progress=false"]
    one_line_error(capsys, ["eval", "model=/no/such/dir", "progress=false"], "model '/no/such/dir' does not exist")
    empty_run = tmp_path / "fresh"
    (empty_run / "checkpoints").mkdir(parents=True)
    (empty_run / "config.yaml").write_text("steps: 3\n")
    one_line_error(capsys, ["eval", f"model={empty_run}"], "has no checkpoint yet")
    one_line_error(capsys, ["eval", f"run_dir={tmp_path}/nothing"], "holds no checkpoint to evaluate",
                   "make demo", "model=tiny")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    one_line_error(capsys, ["eval", *base, f"data={empty}"], "holds no records")
    # messages name the keys as typed: n=, k=, not the config fields eval_n_samples, eval_k_values
    one_line_error(capsys, ["eval", *base, "n=2", "k=1,3"], "k=[1, 3]: each k of Pass@k must lie in [1, n=2]",
                   "raise n= or lower the k")
    one_line_error(capsys, ["eval", *base, "temperatures=0,1.0"], "temperatures > 0", "greedy")
    one_line_error(capsys, ["eval", *base, "temperatures=-0.5"], "temperatures > 0")
    one_line_error(capsys, ["eval", *base, "n=0"], "n=0 must be an integer >= 1")
    one_line_error(capsys, ["eval", *base, "temperatures=0.5,1.0,0.5"], "a temperature is listed twice")
    one_line_error(capsys, ["eval", *base, "temps=1"], "unknown key 'temps'", "did you mean temperatures?")
    one_line_error(capsys, ["eval", f"model={run}/checkpoints/nope-*"], "matches no directory")
    one_line_error(capsys, ["eval", *base, "temperature=0.5"], "did you mean temperatures=?")
    one_line_error(capsys, ["eval", f"model={run}/config.yaml"], "is a file, not a directory")
    one_line_error(capsys, ["eval", f"model={run}/checkpoints"], "is the checkpoints folder", "checkpoints/*")
    one_line_error(capsys, ["eval", *base, f"data={tmp_path}/none.jsonl"], "or data=arithmetic")
    one_line_error(capsys, ["eval", *base, f"out={run}/config.yaml"], "config.yaml is a file; give a directory")
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    one_line_error(capsys, ["eval", *base, f"out={blocked}/sub"], "reports cannot be written there")
    with pytest.raises(SystemExit) as exit_:   # argparse errors are one line too
        main(["eval", "--n", "4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("erpo: error: unrecognized arguments: --n") and "\n" not in err and "n=4" in err
    assert not os.path.exists(os.path.join(run, "eval", "run-step-000002", "eval.json.tmp"))


def test_resume_rules_and_eval_of_a_resumed_run(capsys, done_run, tmp_path):
    """steps cannot change under a decaying learning rate; a resumed run (its config.yaml
    records resume=) evaluates with any override; resume= belongs to train only."""
    root, run, cache = done_run
    lin = str(tmp_path / "lin")
    assert main(["train", *tiny_args(lin, cache, steps=1, lr_schedule="linear")]) == 0
    one_line_error(capsys, ["train", f"resume={lin}", "steps=2"],
                   "steps cannot change when resuming a run with lr_schedule=linear")
    assert main(["train", f"resume={lin}"]) == 0  # at its last step already: nothing to train
    assert f"resume: {lin}" in open(os.path.join(lin, "config.yaml")).read()
    one_line_error(capsys, ["eval", f"resume={lin}"], "use it with `erpo train`")
    capsys.readouterr()
    assert main(["eval", f"run_dir={lin}", "device=cpu", "eval_temperatures=1.0", "eval_n_samples=1",
                 "eval_k_values=1", "eval_limit=2", "progress=false"]) == 0
    assert os.path.join(lin, "eval", "lin-step-000001", "eval.json") in capsys.readouterr().out
    assert main(["eval", os.path.join(lin, "config.yaml"), "eval_temperatures=1.0", "eval_n_samples=1",
                 "eval_k_values=1", "eval_limit=2", "progress=false"]) == 0  # its own config file, resume= and all


def test_console_entry_point_exit_status():
    """`python -m erpo` (what the `erpo` script runs): a bad key is exit 2 and one line on stderr."""
    proc = subprocess.run([sys.executable, "-m", "erpo", "train", "alpah=1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "erpo: error: unknown config key 'alpah'; did you mean alpha?"


def test_env_prints_versions_and_the_backend_of_each_op(capsys):
    """`erpo env`: device, torch, CUDA, triton, and per op the backend auto picks, run once."""
    from erpo.env import op_backends

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    expected = "triton" if torch.cuda.is_available() else "torch"
    for needle in ("device:", f"torch:   {torch.__version__}", "CUDA:", "triton:"):
        assert needle in out, out
    auto = out.split('backend="triton" on this device')[0]  # the interpreter's rows follow under TRITON_INTERPRET=1
    for op in ("token_logprobs", "linear_token_logprobs", "segment_sum", "weighted_k3"):
        row = [line for line in auto.splitlines() if line.split()[:1] == [op]]
        assert len(row) == 1 and row[0].split()[1] == expected and "ran;" in row[0], out
    # the tiles each op launches with on this device (default_tiles; conservative without CUDA)
    from erpo_kernels import default_tiles
    from erpo_kernels.tiles import device_capability

    cap = device_capability(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    assert f"linear_token_logprobs[bfloat16]: {default_tiles('linear_token_logprobs', torch.bfloat16, cap)}" in out
    assert f"token_logprobs[any dtype]: {default_tiles('token_logprobs', torch.bfloat16, cap)}" in out
    # the same check with the kernels forced (the CPU interpreter here): they run and match
    for op, chosen, check in op_backends(torch.device("cpu"), backend="triton"):
        assert chosen == "triton" and check.startswith("ran;") and "MISMATCH" not in check, (op, check)


def _eval_json(path):
    with open(os.path.join(path, "eval.json")) as f:
        return json.load(f)


def test_eval_uses_the_runs_own_template_and_reward(capsys, done_run, tmp_path):
    """data=FILE on a run trained with the plain template (the demo task): the run's template
    and reward, whatever the file; others only when asked; auto for a model outside any run."""
    import shutil

    root, run, cache = done_run
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(3)))
    common = [f"data={data}", "n=1", "temperatures=1.0", "progress=false"]
    capsys.readouterr()
    assert main(["eval", f"model={run}", *common, f"out={tmp_path}/own"]) == 0
    assert "template plain, reward exact_match" in capsys.readouterr().out
    settings = _eval_json(tmp_path / "own" / "run-step-000002-sums")["settings"]
    assert (settings["template"], settings["reward"]) == ("plain", "exact_match")
    assert main(["eval", f"model={run}", *common, "template=r1", f"out={tmp_path}/asked"]) == 0
    settings = _eval_json(tmp_path / "asked" / "run-step-000002-sums")["settings"]
    assert (settings["template"], settings["reward"]) == ("r1", "exact_match")
    outside = tmp_path / "hf-model"   # the same weights as a plain Hugging Face directory
    shutil.copytree(os.path.join(run, "checkpoints", "step-000002"), outside)
    # max_new_tokens: the auto 1024 + an r1 prompt would not fit the demo model's 1024 positions
    assert main(["eval", f"model={outside}", *common, "max_new_tokens=8", f"out={tmp_path}/outside"]) == 0
    settings = _eval_json(tmp_path / "outside" / "hf-model-sums")["settings"]
    assert (settings["template"], settings["reward"]) == ("r1", "math_verify")


def test_eval_never_silently_replaces_reports(capsys, done_run, tmp_path):
    """A report (and compare.md) made with other n, limit, temperatures or models is refused in
    one line naming overwrite=true, before any generation; the same command replaces its own."""
    import shutil

    root, run, cache = done_run
    out = tmp_path / "rep"
    base = ["eval", f"model={run}", "n=2", "temperatures=1.0", "limit=2", f"out={out}", "progress=false"]
    assert main(base) == 0
    report = out / "run-step-000002"
    before = (report / "eval.json").read_bytes()
    first = json.loads(before)
    assert main(base) == 0   # same settings: replaced by the same numbers
    again = _eval_json(report)
    del again["settings"]["seconds"], first["settings"]["seconds"]
    assert again == first
    before = (report / "eval.json").read_bytes()
    for change, was, now in (("n=3", "n=2", "n=3"), ("limit=3", "problems=2", "problems=3"),
                             ("temperatures=0.5", "temperatures=1", "temperatures=0.5")):
        err = one_line_error(capsys, [*base, change], str(report), was, now, "overwrite=true", "out=")
        assert "this one" in err and (report / "eval.json").read_bytes() == before
    assert main([*base, "n=3", "overwrite=true"]) == 0
    assert _eval_json(report)["n_samples"] == 3

    cmp_out = tmp_path / "cmp"
    two = ["eval", "n=2", "temperatures=1.0", "limit=2", f"out={cmp_out}", "progress=false"]
    assert main([*two, f"model={run},tiny"]) == 0
    compared = (cmp_out / "compare.json").read_bytes()
    outside = tmp_path / "hf-model"
    shutil.copytree(os.path.join(run, "checkpoints", "step-000002"), outside)
    one_line_error(capsys, [*two, f"model={run},{outside}"], "compare.md compares", "overwrite=true")
    assert (cmp_out / "compare.json").read_bytes() == compared and not (cmp_out / "hf-model").exists()


def test_model_can_be_a_run_or_a_checkpoint(capsys, done_run, tmp_path):
    """model=RUN (its latest checkpoint) and model=RUN/checkpoints/step-N start a run or build
    a reference cache; a run without a checkpoint is one line."""
    from erpo.config import read_yaml

    root, run, cache = done_run
    latest = os.path.join(run, "checkpoints", "step-000002")
    for model, name in ((run, "from-run"), (latest, "from-ckpt")):
        new = str(tmp_path / name)
        assert main(["train", *tiny_args(new, cache, steps=1), f"model={model}"]) == 0
        assert read_yaml(os.path.join(new, "config.yaml"))["model"] == latest
        assert os.path.isdir(os.path.join(new, "checkpoints", "step-000001"))
    assert main(["ref-cache", *tiny_args(str(tmp_path / "rc"), cache), f"model={run}"]) == 0
    assert os.path.isfile(tmp_path / "rc" / "ref_cache.safetensors")
    empty = tmp_path / "empty-run"
    empty.mkdir()
    (empty / "config.yaml").write_text("steps: 1\n")
    one_line_error(capsys, ["train", *tiny_args(str(tmp_path / "x"), cache), f"model={empty}"],
                   "is a run without a checkpoint yet")


def _metrics(run):
    """metrics.jsonl without the timings (everything else is deterministic)."""
    with open(os.path.join(run, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]


def _tree(run):
    return sorted(os.path.relpath(os.path.join(d, f), run) for d, _, fs in os.walk(run) for f in fs)


def test_resume_from_a_checkpoint_and_into_another_run_dir(capsys, done_run, tmp_path):
    """resume=RUN/checkpoints/step-N continues from that checkpoint; resume= with another run_dir
    forks (the source run, its checkpoints and metrics untouched, keep_checkpoints prunes only
    the fork) and gives the numbers the source run got; continuing in place from an older
    checkpoint, or forking into an earlier run, is refused in one line."""
    root, run, cache = done_run
    src = str(tmp_path / "src")
    assert main(["train", *tiny_args(src, cache, steps=3, save_every=1, keep_checkpoints=2)]) == 0
    tree, metrics = _tree(src), _metrics(src)
    assert [p for p in tree if p.endswith("trainer_state.json")] == [
        "checkpoints/step-000002/trainer_state.json", "checkpoints/step-000003/trainer_state.json"]
    step2 = os.path.join(src, "checkpoints", "step-000002")

    fork = str(tmp_path / "fork")
    assert main(["train", f"resume={step2}", f"run_dir={fork}", "keep_checkpoints=1"]) == 0
    assert _tree(src) == tree and _metrics(src) == metrics   # the source run is untouched
    assert _metrics(fork) == metrics   # steps 1-2 copied, step 3 recomputed from the checkpoint: the same
    assert sorted(os.listdir(os.path.join(fork, "checkpoints"))) == ["step-000003"]
    assert os.path.isfile(os.path.join(fork, "ref_cache.safetensors"))
    fork2 = str(tmp_path / "fork2")   # the case: resume=RUN run_dir=OTHER with more steps
    assert main(["train", f"resume={src}", f"run_dir={fork2}", "steps=4", "keep_checkpoints=1"]) == 0
    assert _tree(src) == tree and _metrics(fork2)[:3] == metrics and len(_metrics(fork2)) == 4
    assert main(["train", f"resume={fork2}", "steps=5"]) == 0   # the fork is a run of its own
    assert len(_metrics(fork2)) == 5

    one_line_error(capsys, ["train", f"resume={step2}"], "later checkpoints (step-000003)", "run_dir=NEW",
                   "overwrite=true")
    one_line_error(capsys, ["train", f"resume={step2}", f"run_dir={fork}"], "holds an earlier run")
    one_line_error(capsys, ["train", f"resume={os.path.join(src, 'checkpoints', 'step-000009')}"],
                   "no such run directory or checkpoint")
    assert _tree(src) == tree
    assert main(["train", f"resume={step2}", "overwrite=true"]) == 0   # in place: step 3 again, the same
    assert _metrics(src) == metrics


def test_stale_cache_fails_before_the_warm_start_and_ref_cache_keeps_other_runs_caches(capsys, done_run, tmp_path):
    """A run pointed at another run's cache with another template: stale, found before the demo's
    warm start is trained; the suggested command is shell-quoted and, pasted, rebuilds the cache
    ref_cache= names (overwrite=true: issue 19.5), after which the run trains; without
    overwrite=true `erpo ref-cache` refuses to replace a cache; a path of its own is built."""
    import shutil

    from erpo.ref_cache import read_ref_cache

    root, run, cache = done_run
    theirs = str(tmp_path / "theirs.safetensors")
    shutil.copy(os.path.join(run, "ref_cache.safetensors"), theirs)
    before, warm_starts = open(theirs, "rb").read(), sorted(os.listdir(cache))
    capsys.readouterr()
    args = [*tiny_args(str(tmp_path / "b"), cache), "template=Q: {prompt}"]
    err = one_line_error(capsys, ["train", *args, f"ref_cache={theirs}"], "is stale", "rebuild it with: erpo ref-cache")
    assert sorted(os.listdir(cache)) == warm_starts   # no warm start was trained
    assert "warm start" not in capsys.readouterr().out
    command = shlex.split(err.split("rebuild it with: ")[1])
    assert "template=Q: {prompt}" in command and f"ref_cache={theirs}" in command and command[-1] == "overwrite=true"
    one_line_error(capsys, command[1:-1], f"ref_cache {theirs} exists", "overwrite=true", "ref_cache=PATH")
    assert open(theirs, "rb").read() == before
    mine = str(tmp_path / "mine.safetensors")
    assert main([a if not a.startswith("ref_cache=") else f"ref_cache={mine}" for a in command[1:-1]]) == 0
    assert read_ref_cache(mine).meta["template"] == "Q: {prompt}"
    assert main(["train", *args, f"ref_cache={mine}"]) == 0
    assert main(command[1:]) == 0   # pasted as suggested: replaced, and the run it was suggested to trains
    assert read_ref_cache(theirs).meta["template"] == "Q: {prompt}"
    assert main(["train", *args, f"ref_cache={theirs}", "run_dir=" + str(tmp_path / "c")]) == 0


def test_a_stale_template_is_quoted_whole_words(capsys, done_run, tmp_path):
    """The stale-cache message quotes a long template cut at a word, never mid-word (issue 19.5)."""
    from erpo.data import R1_TEMPLATE

    root, run, cache = done_run
    model_dir = os.path.join(run, "checkpoints", "step-000002")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(4)))
    args = [f"model={model_dir}", f"dataset={data}", "reward=exact_match", "group_size=2", "queries_per_step=2",
            "max_new_tokens=4", "steps=1", "progress=false", f"run_dir={tmp_path}/run"]
    assert main(["train", *args, "template=plain"]) == 0
    err = one_line_error(capsys, ["train", *args, "template=r1", "overwrite=true"], "built for prompt template 'plain'")
    quoted = err.split("this run uses ")[1].split("; rebuild it with")[0]
    assert quoted.endswith(' ..."') and " ".join(R1_TEMPLATE.split()).startswith(quoted[1:-5]), quoted
    assert R1_TEMPLATE.split()[len(quoted[1:-5].split()) - 1] == quoted[1:-5].split()[-1], quoted   # a whole word
    command = shlex.split(err.split("rebuild it with: ")[1])
    assert main(command[1:]) == 0 and main(["train", *args, "template=r1", "overwrite=true"]) == 0


def test_env_piped_into_a_reader_that_stops_early_prints_no_traceback():
    # `erpo env | head -c 10`: the reader closes the pipe before the report is written
    proc = subprocess.run(
        ["sh", "-c", f"'{sys.executable}' -m erpo env | head -c 10 >/dev/null"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


BAD_OBJECTIVE_AND_WEIGHT_KEYS = [("eps_low", 1.0), ("eps_high", -0.1), ("dual_clip", 1.0), ("kl_guard", 100.0),
                                 ("alpha", -1.0), ("w_min", 2.0), ("w_max", 0.5), ("weight_temperature", 0.0),
                                 ("gamma", -1.0), ("bins", 0)]


@pytest.mark.parametrize("key,bad", BAD_OBJECTIVE_AND_WEIGHT_KEYS)
def test_objective_and_weight_keys_are_checked_by_their_objects(capsys, key, bad):
    """One check per key: the CLI's message is the one LossConfig or QueryWeighter gives for
    the same value, naming the key."""
    from erpo_kernels import LossConfig
    from erpo.query_weights import QueryWeighter

    cfg = TrainConfig(**{key: bad})
    with pytest.raises(ValueError) as own:
        if key in LossConfig.__dataclass_fields__:
            LossConfig(**{key: bad})
        else:
            QueryWeighter.check_config(cfg)
    assert key in str(own.value)
    one_line_error(capsys, ["train", f"{key}={bad}"], str(own.value))


def test_a_run_resumes_from_another_working_directory(capsys, done_run, tmp_path, monkeypatch):
    """config.yaml stores absolute paths, so resume= works from anywhere; the same file under
    another spelling is accepted; a run saved with relative paths (before) says how to name
    them, and takes them anew only when they hold the run's data and weights (issue 19.8)."""
    import shutil

    import yaml

    root, run, cache = done_run
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(os.path.join(run, "checkpoints", "step-000002"), work / "m")
    (work / "d.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n"
                                          for a in range(4)))
    args = ["template=plain", "reward=exact_match", "group_size=2", "queries_per_step=2", "max_new_tokens=4",
            "progress=false", "algorithm=grpo", "beta=0.1"]   # grpo: the starting model is loaded again
    monkeypatch.chdir(work)
    assert main(["train", "model=m", "dataset=d.jsonl", "run_dir=r", "steps=1", *args]) == 0
    with open(work / "r" / "config.yaml") as f:
        saved = yaml.safe_load(f)
    assert (saved["model"], saved["dataset"]) == (str(work / "m"), str(work / "d.jsonl"))
    assert main(["train", "resume=r", "steps=2", "dataset=./d.jsonl", "model=../work/m"]) == 0   # other spellings
    monkeypatch.chdir(tmp_path)
    assert main(["train", f"resume={work}/r", "steps=3"]) == 0   # from another directory
    assert len(_metrics(str(work / "r"))) == 3

    saved.update(model="m", dataset="d.jsonl")   # a run whose config.yaml holds the paths as typed
    with open(work / "r" / "config.yaml", "w") as f:
        yaml.safe_dump(saved, f)
    capsys.readouterr()
    one_line_error(capsys, ["train", f"resume={work}/r", "steps=4"], "the run's model 'm' does not exist from here",
                   "give its path with model=PATH")
    one_line_error(capsys, ["train", f"resume={work}/r", "steps=4", f"model={work}/m"],
                   "the run's dataset 'd.jsonl' does not exist from here", "dataset=PATH")
    (tmp_path / "other.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+2=", "answer": str(a + 2)}) + "\n"
                                                  for a in range(4)))
    one_line_error(capsys, ["train", f"resume={work}/r", "steps=4", f"model={work}/m", "dataset=other.jsonl"],
                   "the training data differs from the run's")
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(work / "m")
    with torch.no_grad():
        next(other.parameters()).add_(0.5)
    other.save_pretrained(tmp_path / "not-the-start")
    one_line_error(capsys, ["train", f"resume={work}/r", "steps=4", f"model={tmp_path}/not-the-start",
                            f"dataset={work}/d.jsonl"], "does not hold the run's starting weights")
    assert main(["train", f"resume={work}/r", "steps=4", f"model={work}/m", f"dataset={work}/d.jsonl"]) == 0
    assert len(_metrics(str(work / "r"))) == 4


def _erpo_on_a_read_only_file_system(tmp_path, *args):
    """`erpo ARGS` in a process that sees `tmp_path/ro` as a read-only file system (a tmpfs
    mounted read-only in a user and mount namespace: refused to root too); (status, stderr)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "erpo", *args])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(["unshare", "--map-root-user", "--mount", "sh", "-c",
                           f"mount -t tmpfs -o ro tmpfs {shlex.quote(str(ro))} && exec {command}"],
                          capture_output=True, text=True, env=env, timeout=600)
    return proc.returncode, proc.stderr.strip()


def test_a_run_dir_that_cannot_be_written_is_refused_before_anything_is_computed(capsys, tmp_path):
    """run_dir under a file, or on a read-only file system: one line, before the demo's warm
    start or the reference cache is computed (issue 19.6)."""
    (tmp_path / "file").write_text("")
    cache = tmp_path / "cache"
    one_line_error(capsys, ["train", *tiny_args(f"{tmp_path}/file/run", str(cache))],
                   f"run_dir={tmp_path}/file/run is under {tmp_path}/file, a file, not a directory",
                   "choose another run_dir=")
    one_line_error(capsys, ["ref-cache", *tiny_args(str(tmp_path / "r"), str(cache)), f"ref_cache={tmp_path}/file/c"],
                   "ref_cache=", "a file, not a directory")
    assert not cache.exists()
    code, err = _erpo_on_a_read_only_file_system(tmp_path, "train", *tiny_args(f"{tmp_path}/ro/run", str(cache)))
    assert code == 2 and err.startswith("erpo: error: ") and "\n" not in err, err
    assert f"run_dir={tmp_path}/ro/run: {tmp_path}/ro cannot be written (Read-only file system)" in err, err
    assert not cache.exists()   # refused before the warm start


def test_a_full_disk_during_a_checkpoint_keeps_the_last_one_and_says_so(capsys, tmp_path, monkeypatch):
    import errno

    from erpo import checkpoint as ckpt

    run = str(tmp_path / "run")
    args = tiny_args(run, str(tmp_path / "cache"), steps=3, save_every=1)
    real_save = torch.save

    def full_disk(obj, path, *a, **k):
        if ".tmp-step-000003" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    err = one_line_error(capsys, ["train", *args], "step 3: writing to", "failed (No space left on device)",
                         f"the last complete checkpoint, {run}/checkpoints/step-000002, is intact",
                         f"free some space, then continue with: erpo train resume={run}")
    monkeypatch.undo()
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["step-000001", "step-000002"]  # no part left
    command = shlex.split(err.split("continue with: ")[1])
    assert main(command[1:]) == 0 and len(_metrics(run)) == 3
    assert ckpt.latest_checkpoint(run).endswith("step-000003")


def test_sigterm_stops_as_ctrl_c_does(tmp_path):
    """SIGTERM (what a scheduler sends) during training: the clean stop of Ctrl-C, one line
    naming the last checkpoint and how to continue, exit status 143; continuing works (issue 19.9)."""
    import signal
    import time

    run = str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "erpo", "train",
                             *tiny_args(run, str(tmp_path / "cache"), steps=200, save_every=1)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    from erpo import checkpoint as ckpt

    # any complete checkpoint: keep_checkpoints=2 prunes step-000001 once step 3 is saved, and a
    # loaded machine may not look in between (the run then finished all 200 steps)
    deadline = time.time() + 600
    while ckpt.latest_checkpoint(run) is None and time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=300)[1].strip()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and err.splitlines()[-1].startswith("erpo: terminated (SIGTERM); the last "
                                                                      "checkpoint is "), err
    assert err.splitlines()[-1].endswith(f"continue with: erpo train resume={run}"), err
    done = ckpt.read_state(ckpt.latest_checkpoint(run))["step"]
    assert main(["train", f"resume={run}", f"steps={done + 1}"]) == 0
    assert ckpt.read_state(ckpt.latest_checkpoint(run))["step"] == done + 1


def test_a_model_without_its_tokenizer_is_one_line(capsys, done_run, tmp_path):
    """A model directory without tokenizer files (transformers 5 builds an empty tokenizer from
    config.json alone), and a tokenizer with more tokens than the model's embedding: one line
    for erpo train and erpo eval; the fix the first names works (issue 19.6)."""
    import shutil

    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    root, run, cache = done_run
    source = os.path.join(run, "checkpoints", "step-000002")
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in os.listdir(source):
        if name.startswith(("config", "generation", "model")):
            shutil.copy(os.path.join(source, name), bare / name)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(4)))
    train = ["train", f"dataset={data}", "template=plain", "reward=exact_match", "group_size=2", "queries_per_step=2",
             "max_new_tokens=4", "steps=1", "progress=false"]
    evaluate = ["eval", f"data={data}", "n=1", "temperatures=1.0", "limit=2", f"out={tmp_path}/eval"]
    for argv in ([*train, f"model={bare}", f"run_dir={tmp_path}/r"], [*evaluate, f"model={bare}"]):
        err = one_line_error(capsys, argv, f"model '{bare}' has no tokenizer files", "save_pretrained")
    assert not os.path.exists(tmp_path / "r")
    AutoTokenizer.from_pretrained(source).save_pretrained(str(bare))   # the fix, as the message writes it
    assert "AutoTokenizer.from_pretrained(SOURCE).save_pretrained(" in err
    assert main([*train, f"model={bare}", f"run_dir={tmp_path}/r"]) == 0

    small = tmp_path / "small-vocab"
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = Qwen2Config(vocab_size=len(tokenizer) - 10, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=tokenizer.eos_token_id)
    Qwen2ForCausalLM(config).save_pretrained(str(small))
    tokenizer.save_pretrained(str(small))
    for argv in ([*train, f"model={small}", f"run_dir={tmp_path}/r2"], [*evaluate, f"model={small}"]):
        one_line_error(capsys, argv, f"its tokenizer has {len(tokenizer)} tokens, the model's embedding "
                                     f"{len(tokenizer) - 10} rows", "use the tokenizer the model was trained with")


def test_a_model_shorter_than_prompt_plus_max_new_tokens_is_one_line_before_anything_is_written(capsys, tmp_path):
    """A GPT-2-style model (learned positions, n_positions) or one whose max_position_embeddings
    cannot hold the longest prompt + max_new_tokens: one line naming both numbers and the fix,
    from erpo train before the run directory exists and from erpo eval before any report
    (issue 29.2: it was an IndexError inside generate at step 1, after config.yaml and the cache)."""
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    from erpo.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    gpt2, qwen = tmp_path / "gpt2", tmp_path / "qwen"
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=16, n_embd=16, n_layer=1, n_head=2,
                               bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id)).save_pretrained(str(gpt2))
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                 eos_token_id=tokenizer.eos_token_id)).save_pretrained(str(qwen))
    for d in (gpt2, qwen):
        tokenizer.save_pretrained(str(d))
    capsys.readouterr()
    data = tmp_path / "d.jsonl"   # "<bos>12+1=": 6 prompt tokens at most
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(8, 12)))
    for model in (gpt2, qwen):
        train = ["train", f"model={model}", f"dataset={data}", "template=plain", "reward=exact_match", "group_size=2",
                 "queries_per_step=2", "max_new_tokens=12", "steps=1", "progress=false", f"run_dir={tmp_path}/r"]
        one_line_error(capsys, train, f"model '{model}' has a context of 16 positions",
                       "the longest prompt (6 tokens) + max_new_tokens=12 needs 18", "set max_new_tokens=10 or less")
        assert not os.path.exists(tmp_path / "r")
        evaluate = ["eval", f"model={model}", f"data={data}", "template=plain", "reward=exact_match", "n=1",
                    "temperatures=1.0", "max_new_tokens=11",
                    f"out={tmp_path}/eval"]
        one_line_error(capsys, evaluate, "+ max_new_tokens=11 needs 17", "set max_new_tokens=10 or less")
        assert not os.listdir(tmp_path / "eval")
    # a YaRN rope scaling stretches the context by its factor (as vLLM counts it): 16 x 4 holds 18
    from erpo.models import check_context_length, context_length

    stretched = tmp_path / "yarn"
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                 rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 16})).save_pretrained(str(stretched))
    assert (context_length(str(gpt2)), context_length(str(qwen)), context_length(str(stretched))) == (16, 16, 64)
    check_context_length(str(stretched), 6, 12)


@pytest.mark.parametrize("threads, expect", [(0, 1), (2, 2)])
def test_eval_of_tiny_applies_cpu_threads_before_its_warm_start_and_says_it_trains(capsys, tmp_path, threads, expect):
    """`erpo eval model=tiny` without a cached warm start trains one: on the threads erpo train
    would use (cpu_threads, else 1 for the demo model), announced before it starts (issue 29.4:
    it ran on torch's default threads, silent, for minutes)."""
    seen = []
    real = tiny_module.warm_start

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    torch.set_num_threads(3)
    argv = ["eval", "model=tiny", f"cpu_threads={threads}", f"cache_dir={tmp_path}/cache", f"out={tmp_path}/eval",
            "tiny_hidden_size=16", "tiny_layers=1", "warmstart_steps=2", "task_eval_size=2", "n=1",
            "temperatures=1.0", "max_new_tokens=2", "progress=false"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny_module, "warm_start", recording)
        assert main(argv) == 0
    out = capsys.readouterr().out
    assert seen == [expect]
    start = out.index("erpo: training the demo model's warm start (2 supervised steps")
    assert start < out.index("erpo: warm start of the demo model: 2 steps in")


def test_cache_dir_defaults_to_the_user_cache_whatever_the_working_directory(tmp_path, monkeypatch):
    """cache_dir=auto: $XDG_CACHE_HOME/erpo, else ~/.cache/erpo, the same from every working
    directory (issue 29.5: it was .cache/erpo under each one); cache_dir= overrides it, and
    config.yaml keeps auto (each machine's own user cache). The suite's own user cache is a
    temporary directory (tests/conftest.py), never the user's."""
    from erpo.config import read_yaml, save_config

    assert TrainConfig().cache_dir == "auto"
    assert os.environ["XDG_CACHE_HOME"].startswith(tempfile.gettempdir())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for cwd in (tmp_path, ROOT):
        monkeypatch.chdir(cwd)
        assert TrainConfig().resolved_cache_dir == str(tmp_path / "xdg" / "erpo")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert TrainConfig().resolved_cache_dir == str(tmp_path / "home" / ".cache" / "erpo")
    assert TrainConfig(cache_dir="mine").resolved_cache_dir == "mine"
    save_config(TrainConfig(), str(tmp_path / "config.yaml"))
    assert read_yaml(str(tmp_path / "config.yaml"))["cache_dir"] == "auto"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only report (a CUDA device is present)")
def test_env_under_the_interpreter_does_not_contradict_itself(capsys, monkeypatch):
    """TRITON_INTERPRET=1 erpo env said the kernels run in the interpreter, then that they run
    only on CUDA tensors (issue 29.7): it now says backend="triton" runs them in the interpreter
    and runs each there once; without the interpreter, where else they run."""
    import erpo.env as env

    assert env.interpreting()  # tests/conftest.py, no GPU
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "only on CUDA" not in out, out
    forced = out[out.index('backend="triton" on this device (TRITON_INTERPRET=1'):].splitlines()[1:5]
    assert [line.split()[:2] for line in forced] == [[op, "triton"] for op in
                                                      ("token_logprobs", "linear_token_logprobs", "segment_sum",
                                                       "weighted_k3")], out
    assert all("ran;" in line and "MISMATCH" not in line for line in forced), out
    assert 'backend="auto" runs the PyTorch reference on CPU tensors' in out
    monkeypatch.setattr(env, "interpreting", lambda: False)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "interpreter)" not in out and 'backend="triton" on this device' not in out
    assert "here only in Triton's CPU interpreter, with TRITON_INTERPRET=1" in out


def test_the_docs_say_what_eval_and_config_yaml_do(tmp_path, monkeypatch):
    """docs/evaluation.md's response length for a model outside any run, and docs/training.md's
    account of config.yaml's paths, are what the code does (issue 29.6: 8 tokens, 'every path
    absolute')."""
    from erpo.cli import resolve_config
    from erpo.config import DEMO_MAX_NEW_TOKENS, MAX_NEW_TOKENS, read_yaml, save_config

    text = " ".join(open(os.path.join(ROOT, "docs", "evaluation.md"), encoding="utf-8").read().split())
    assert (f"for a model outside any run {MAX_NEW_TOKENS} on a file and {DEMO_MAX_NEW_TOKENS} on the embedded "
            f"task") in text
    (tmp_path / "m").mkdir()
    (tmp_path / "d.jsonl").write_text("")
    assert resolve_config([f"model={tmp_path}/m", f"data={tmp_path}/d.jsonl"], "eval").eval_max_tokens == MAX_NEW_TOKENS
    assert resolve_config(["model=tiny", "data=arithmetic"], "eval").eval_max_tokens == DEMO_MAX_NEW_TOKENS
    monkeypatch.chdir(tmp_path)
    save_config(TrainConfig(run_dir="runs/r", resume="runs/q", dataset="d.jsonl"), "config.yaml")
    saved = read_yaml("config.yaml")
    assert (saved["run_dir"], saved["resume"], saved["dataset"]) == ("runs/r", "runs/q", str(tmp_path / "d.jsonl"))
    training = " ".join(open(os.path.join(ROOT, "docs", "training.md"), encoding="utf-8").read().split())
    assert "config.yaml stores every path absolute" not in training
    assert "(`run_dir` and `resume` are stored as given" in training
