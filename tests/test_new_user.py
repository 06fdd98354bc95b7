"""What a new user meets first (issue 35, items 2-10): one-line errors for the inputs that
were tracebacks or wrong, the tiny model on the user's own data failing before its warm
start (and the warm start saying how far it is), a partial study's report not replacing a
more complete page, the installed wheel's bench command and configs, file modes of the run
directory. Each check is unit-level or one small CLI call."""
import json
import os
import stat

import pytest
import yaml

from erpo.cli import main, resolve_config
from erpo.config import save_config

from test_cli import one_line_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_STUDY = os.path.join(ROOT, "configs", "study-tiny.yaml")


# ---------------------------------------------------------------------- item 4: one-line errors


def test_loss_scale_factor_names_its_auto_value_and_config_yaml_stores_the_resolved_one(capsys, tmp_path):
    one_line_error(capsys, ["train", "loss_agg=seq-mean-token-sum-norm", "loss_scale_factor=-5"],
                   "loss_scale_factor=-5.0 must be finite and > 0, or 0 (auto: max_new_tokens")
    cfg = resolve_config(["loss_agg=seq-mean-token-sum-norm", "max_new_tokens=96", f"run_dir={tmp_path}/r"])
    assert cfg.loss_scale_factor == 96.0 and cfg.loss_config().loss_scale_factor == 96.0
    save_config(cfg, str(tmp_path / "config.yaml"))
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["loss_scale_factor"] == 96.0 and saved["max_new_tokens"] == 96
    # without its loss_agg the key stays unset (0), as LossConfig wants it
    assert resolve_config([f"run_dir={tmp_path}/r"]).loss_scale_factor == 0.0


def test_a_prefix_of_a_choice_suggests_that_choice(capsys):
    one_line_error(capsys, ["train", "loss_agg=seq-mean"], "did you mean seq-mean-token-mean?")


def test_bad_yaml_names_the_line(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("steps: 3\nlr: [1\n")
    one_line_error(capsys, ["train", str(path)], "is not valid YAML: line 3, column 1:", "begun at line 2")
    path.write_text("steps: 3\nlr: 1: 2\n")
    one_line_error(capsys, ["train", str(path)], "line 2, column 6: mapping values are not allowed here")


def test_a_directory_given_as_the_config_file(capsys, tmp_path):
    one_line_error(capsys, ["train", str(tmp_path)], f"config file '{tmp_path}' is a directory; give a YAML file")
    (tmp_path / "config.yaml").write_text("steps: 1\n")
    one_line_error(capsys, ["train", str(tmp_path)], f"continue it with resume={tmp_path}",
                   os.path.join(str(tmp_path), "config.yaml"))


def test_study_out_under_a_file_and_negative_seeds_are_one_line(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    one_line_error(capsys, ["study", TINY_STUDY, f"out={blocker}/x"], f"out={blocker}/x is under {blocker}, a file")
    assert not (tmp_path / "file" / "x").exists()
    one_line_error(capsys, ["study", TINY_STUDY, f"out={tmp_path}/s", "seeds=-1"], "seeds=-1: seeds are integers >= 0")
    assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------------- item 3: a partial study's report


def test_a_partial_report_leaves_a_more_complete_page_alone_unless_forced(tmp_path):
    """report_only=true on a study with nothing evaluated yet: the page that holds a complete
    report keeps it (sections and figures); the report goes to out= and the log says where."""
    from erpo.study import load_study, units_of
    from erpo.study_report import write_study_report

    page = tmp_path / "page.md"
    held = ("# page\n<!-- study:status -->\nComplete: every run and evaluation of the study is in.\n"
            "<!-- /study:status -->\n<!-- study:findings -->\nthe published findings\n<!-- /study:findings -->\n")
    page.write_text(held)
    spec = load_study(TINY_STUDY, [f"out={tmp_path}/study", f"doc={page}", "report_only=true"])
    said = []
    paths = write_study_report(spec, units_of(spec), said.append)
    assert page.read_text() == held and not (tmp_path / "page-accuracy.png").exists()
    assert "doc" not in paths and os.path.isfile(paths["report"])
    note = next(line for line in said if "left as it is" in line)
    assert str(page) in note and paths["report"] in note and "force_doc=true" in note
    status = open(paths["report"]).read()
    assert "Incomplete: " in status and "; 0 in." in status
    # forced, the page takes the partial report
    spec = load_study(TINY_STUDY, [f"out={tmp_path}/study", f"doc={page}", "report_only=true", "force_doc=true"])
    write_study_report(spec, units_of(spec), said.append)
    assert "the published findings" not in page.read_text() and (tmp_path / "page-accuracy.png").is_file()
    # the page now says how many evaluations it holds (0): a report of as many replaces it unforced
    spec = load_study(TINY_STUDY, [f"out={tmp_path}/study", f"doc={page}", "report_only=true"])
    assert "doc" in write_study_report(spec, units_of(spec), said.append)


def test_held_status_reads_the_old_and_new_status_lines(tmp_path):
    from erpo.study_report import held_status, less_than_held

    def page(status, label=""):
        tag = f"study-{label}" if label else "study"
        (tmp_path / "p.md").write_text(f"<!-- {tag}:status -->\n{status}\n<!-- /{tag}:status -->\n")
        return str(tmp_path / "p.md")

    assert held_status(page("Complete: every run and evaluation of the study is in.")) == (True, 0, None)
    assert held_status(page("Complete: every run and evaluation of the study is in (216 evaluations).")) == (True, 0, 216)
    assert held_status(page("Incomplete: 148 evaluations missing (a step 0, b step 100 ...).")) == (False, 148, None)
    assert held_status(page("Incomplete: 3 evaluations missing (a step 0); 213 in.", "epochs"), "epochs") == \
        (False, 3, 213)
    assert held_status(page("Complete: every run ...", "epochs")) is None  # another label's sections
    assert less_than_held(page("Incomplete: 148 evaluations missing (x)."), "", 10, 0) is None
    assert less_than_held(page("Incomplete: 148 evaluations missing (x)."), "", 149, 0)
    assert less_than_held(page("Complete: ... (216 evaluations)."), "", 0, 72)  # a complete subset of seeds


# ---------------------------------------------------------------------- item 2: the tiny model on one's own data


def _own_data(tmp_path, n=16, length=100):
    path = tmp_path / "own.jsonl"
    path.write_text("".join(json.dumps({"prompt": "What is " + "x" * length + f" {i}?", "answer": str(i)}) + "\n"
                            for i in range(n)))
    return str(path)


def test_tiny_on_own_data_fails_before_its_warm_start_and_its_auto_length_fits(capsys, tmp_path, monkeypatch):
    import erpo.tiny as tiny_module
    from erpo.config import TINY_CONTEXT, TINY_MAX_NEW_TOKENS
    from erpo.start import check_demo_prompts, setup_data

    def trained(*args, **kwargs):
        raise AssertionError("the warm start was trained before the context check")

    monkeypatch.setattr(tiny_module, "warm_start", trained)
    data = _own_data(tmp_path)
    common = ["train", f"dataset={data}", "steps=1", f"run_dir={tmp_path}/run", f"cache_dir={tmp_path}/cache",
              "progress=false"]
    one_line_error(capsys, [*common, "max_new_tokens=1000"], f"has a context of {TINY_CONTEXT} positions",
                   "+ max_new_tokens=1000 needs", "set max_new_tokens=")
    assert not os.path.exists(tmp_path / "cache")
    one_line_error(capsys, [*common, "micro_batch_tokens=100"], "micro_batch_tokens=100 is smaller")
    # the automatic response length of model=tiny on other data fits its context with these prompts
    cfg = resolve_config([f"dataset={data}", f"run_dir={tmp_path}/run"])
    assert cfg.max_new_tokens == TINY_MAX_NEW_TOKENS < TINY_CONTEXT
    check_demo_prompts(cfg, setup_data(cfg)[0])
    long_prompts = resolve_config([f"dataset={_own_data(tmp_path, length=700)}", f"run_dir={tmp_path}/run"])
    with pytest.raises(Exception, match="set max_new_tokens=1"):
        check_demo_prompts(long_prompts, setup_data(long_prompts)[0])


def test_the_warm_start_says_how_far_it_is(tmp_path):
    from erpo.config import TrainConfig
    from erpo.data import load_examples
    from erpo.tiny import warm_start

    import torch

    threads = torch.get_num_threads()
    cfg = TrainConfig(cache_dir=str(tmp_path), tiny_hidden_size=16, tiny_layers=1, warmstart_steps=10,
                      warmstart_batch_size=2, task_train_size=20, task_eval_size=2, task_max_operand=4)
    said = []
    warm_start(cfg, load_examples(cfg, "warmstart"), cfg.resolved_template, log=said.append)
    torch.set_num_threads(threads)
    steps = [line for line in said if line.startswith("erpo: warm start: step ")]
    assert [line.split()[4].rstrip(",") for line in steps] == [f"{k}/10" for k in range(1, 10)], said
    assert all("s left" in line and "loss " in line for line in steps)


# ---------------------------------------------------------------------- item 10: file modes


@pytest.fixture
def umask():
    """Set the process umask for one test, and restore it."""
    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_run_directory_files_have_the_umasks_mode(tmp_path, umask, mask):
    """The reference cache and a checkpoint's model.safetensors (safetensors writes 0600) get
    the mode of every other file of the run: 0666 & ~umask."""
    import torch

    from erpo.checkpoint import save_checkpoint
    from erpo.config import TrainConfig
    from erpo.ref_cache import RefCache, save_ref_cache
    from erpo.tiny import build_model, build_tokenizer

    umask(mask)
    want = 0o666 & ~mask
    cache = RefCache(meta={"model": "m"}, query_id=torch.zeros(1, dtype=torch.int64),
                     n_tokens=torch.ones(1, dtype=torch.int64), ref_query_logp=torch.zeros(1),
                     score=torch.zeros(1))
    save_ref_cache(cache, str(tmp_path / "ref_cache.safetensors"))
    assert _mode(tmp_path / "ref_cache.safetensors") == want
    tokenizer = build_tokenizer()
    model = build_model(TrainConfig(tiny_hidden_size=8, tiny_layers=1), tokenizer)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    ckpt = save_checkpoint(str(tmp_path), 1, model, tokenizer, opt, sched, {"world_size": 1})
    modes = {name: _mode(os.path.join(ckpt, name)) for name in os.listdir(ckpt)}
    assert "model.safetensors" in modes and set(modes.values()) == {want}, {k: oct(v) for k, v in modes.items()}


# ---------------------------------------------------------------------- item 8: verl beside erpo


def test_docs_verl_install_is_the_makefiles_verl_venv():
    """docs/verl.md installs verl as the Makefile's live-suite venv does (verl --no-deps, then
    VERL_IMPORTS, then erpo --no-deps): the same packages, no wandb or tensorboard."""
    import re
    import shlex

    make = open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read()
    listed = re.search(r"^VERL_IMPORTS := (.*?)\n(?=\S)", make, re.S | re.M).group(1).replace("\\\n", " ")
    want = shlex.split(listed)
    doc = open(os.path.join(ROOT, "docs", "verl.md"), encoding="utf-8").read()
    block = doc[doc.index("## Installing it beside verl"):doc.index("## The config lines")]
    lines = block.replace("\\\n", " ").splitlines()
    imports = next(line for line in lines if "pip install omegaconf" in line)
    got = shlex.split(imports.split("pip install", 1)[1])
    assert got == want
    assert any("--no-deps verl==0.9.1" in line for line in lines) and any("--no-deps -e ." in line for line in lines)
    assert not {"wandb", "tensorboard", "ray[default]"} & set(got)
    assert "pip install erpo[verl]" not in doc.replace("`pip install erpo[verl]` in the environment", "")


# ---------------------------------------------------------------------- item 4: verl's command without verl


def test_the_verl_command_without_verl_is_its_help_or_one_line(tmp_path):
    """`python -m erpo.integrations.verl ref-cache --help` where verl cannot be imported (a
    verl package that raises ImportError stands first on the path): the usage and a note,
    exit 0; anything else one `erpo: error:` line, exit 2; no traceback either way."""
    import subprocess
    import sys

    (tmp_path / "verl").mkdir()
    (tmp_path / "verl" / "__init__.py").write_text("raise ImportError('no verl here')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    run = lambda *args: subprocess.run([sys.executable, "-m", "erpo.integrations.verl", *args], cwd=ROOT, env=env,
                                       capture_output=True, text=True, timeout=120)
    helped = run("ref-cache", "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: python -m erpo.integrations.verl ref-cache")
    assert "verl cannot be imported here (no verl here)" in helped.stdout and "Traceback" not in helped.stderr, helped.stderr
    failed = run("ref-cache", "data.train_files=x")
    assert failed.returncode == 2 and failed.stdout == "", failed.stdout
    assert failed.stderr.startswith("erpo: error: ") and failed.stderr.count("\n") == 1, failed.stderr


# ---------------------------------------------------------------------- item 9: make install


def test_make_install_says_it_is_quiet_and_how_long_and_the_readme_names_it(tmp_path):
    """pip -q prints nothing for minutes: make says so before, and that it is done after (a fake
    venv python that only logs its arguments stands in for pip)."""
    import subprocess

    from test_makefile import ENV, _fake_python

    venv = tmp_path / "venv"
    _fake_python(venv, tmp_path / "calls.log", 'case "$*" in *"import torch"*) exit 1;; esac\n')
    proc = subprocess.run(["make", "-s", "-C", ROOT, f"VENV={venv}", "install"], capture_output=True, text=True,
                          timeout=60, env=ENV)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "pip -q prints nothing until it is done: about two minutes" in lines[0], lines
    assert lines[-1].startswith("make install: done"), lines
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    quick = readme[readme.index("## Quick start"):readme.index("### On a GPU machine")]
    assert "make install" in quick and "about two minutes" in quick


# ---------------------------------------------------------------------- item 6: configs by name


def test_shipped_configs_by_name_from_another_directory(tmp_path, monkeypatch, capsys):
    from erpo.named_configs import config_path
    from erpo.study import STUDY_FILE, STUDY_VERSION

    monkeypatch.chdir(tmp_path)
    demo = os.path.join(ROOT, "configs", "demo.yaml")
    assert config_path("demo") == config_path("demo.yaml") == config_path("configs/demo.yaml") == demo
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "demo.yaml").write_text("steps: 1\n")
    assert config_path("configs/demo.yaml") == "configs/demo.yaml"  # a file that is here is the one used
    assert resolve_config(["demo", f"run_dir={tmp_path}/r"]).mini_batches == 2  # the shipped demo's setting
    # a shipped study's doc= page outside a clone: a note at the start, the report in out= only
    out = tmp_path / "study"
    out.mkdir()
    (out / STUDY_FILE).write_text(json.dumps({"version": STUDY_VERSION, "units": {}}))
    capsys.readouterr()
    assert main(["study", "study-tiny", f"out={out}", "doc=docs/stability.md", "report_only=true"]) == 0
    said = capsys.readouterr().out
    assert f"doc=docs/stability.md does not exist here; the report goes to {out} only" in said, said
    assert (out / "report.md").is_file()


def test_bench_report_into_a_readme_without_markers_is_an_error(tmp_path, monkeypatch, capsys):
    """`bench report` where the README lacks the table's markers: the section is printed, and
    the exit status is 1 with an `erpo: error:` line (it was 0: a success that wrote nothing)."""
    from bench import kernels, report
    from bench.__main__ import main
    from bench.measure import RunOptions

    cases = kernels.custom_cases(["token_logprobs"], ["qwen2.5-1.5b"], [8], ["fp32"], None, 50)
    kernels.run(cases, ["erpo"], ["forward"], RunOptions(device="cpu", warmup=0, repeats=1, out_dir=str(tmp_path),
                                                         machine="m", budget_s=0.0))
    readme = tmp_path / "README.md"
    readme.write_text("# no markers here\n")
    monkeypatch.setattr(report, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(report, "README", readme)
    capsys.readouterr()
    assert main(["report", "--out-dir", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("erpo: error: ") and err.count("\n") == 1 and str(readme) in err, err
    assert "nothing written" in out and readme.read_text() == "# no markers here\n"
    assert main(["report", "--out-dir", str(tmp_path / "empty")]) == 1
    assert "no bench results in" in capsys.readouterr().err


# ---------------------------------------------------------------------- item 5: bench cost's progress


def test_bench_cost_says_how_far_it_is_per_subject_and_shape(capsys):
    """A line per counted shape (how many of how many, seconds so far, about how many left),
    printed as it goes; --help names the default shapes."""
    from bench import cost_subjects as cs
    from bench.__main__ import main

    sub = next(x for x in cs.SUBJECTS if x.name == "erpo-reference" and x.op == "token_logprobs")
    said = []
    cs.fit_subject(sub, (64, 1, 4480), {}, log=said.append)
    shapes = [line for line in said if " shapes counted (" in line]
    assert said[0].startswith("  erpo-reference token_logprobs: counting ") and "64x1x4480" in said[0]
    n = len(shapes)
    assert n >= 2 and [line.split(": ")[1].split()[0] for line in shapes] == [f"{i}/{n}" for i in range(1, n + 1)]
    assert all("s so far, about " in line and line.endswith(" s left") for line in shapes)
    with pytest.raises(SystemExit):
        main(["cost", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 8192x4096x151936,2048x4096x151936,16384x1536x151936)" in text and "issue 18" not in text


# ---------------------------------------------------------------------- item 7: torchrun


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of this one process (world size 1), destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_2d_mesh_reduces_in_one_collective_and_gathers_quietly(one_rank_group, caplog):
    """The ("dp", "tp") mesh is also flattened, so a Partial over both dimensions (the
    gradient norm) is one all_reduce, not two with DTensor's "inconsistent results between
    ranks" warning; the checkpoint's gather over both (exact whatever the order) says nothing."""
    import logging

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from erpo.distributed import _quiet_gathers, two_d_mesh

    caplog.set_level(logging.WARNING, logger="torch.distributed.tensor._redistribute")
    mesh = two_d_mesh(init_device_mesh, "cpu", 1, 1)
    norm = DTensor.from_local(torch.ones(3), mesh, [Partial(), Partial()]).redistribute(mesh, [Replicate(), Replicate()])
    with _quiet_gathers():
        whole = DTensor.from_local(torch.arange(4.0), mesh, [Shard(0), Shard(0)]).full_tensor()
    assert norm.to_local().tolist() == [1.0, 1.0, 1.0] and whole.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert not [r for r in caplog.records if "sequential" in r.getMessage()], [r.getMessage() for r in caplog.records]


def test_a_tied_model_under_tp_says_to_use_tp_size_1(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from erpo.distributed import parallelize_decoder
    from erpo.errors import ErpoError

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True))
    with pytest.raises(ErpoError, match="tie_word_embeddings=true .* train it with tp_size=1"):
        parallelize_decoder(model, init_device_mesh("cpu", (1,)))


def test_a_refused_start_under_torchrun_is_one_line_from_rank_0_and_exit_status_2(tmp_path, monkeypatch, capsys):
    """What docs/distributed.md says a user sees: every rank refuses with status 2, rank 0
    alone prints the line (torchrun then reports the failed ranks and exits 1 itself)."""
    doc = open(os.path.join(ROOT, "docs", "distributed.md"), encoding="utf-8").read()
    assert "ChildFailedError" in doc and "exit status 2" in doc and "torchrun's own exit status is 1" in doc
    for rank, lines in (("0", 1), ("1", 0)):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", rank)
        monkeypatch.setenv("RANK", rank)
        assert main(["train", "tp_size=3", f"run_dir={tmp_path}/r"]) == 2
        err = capsys.readouterr().err
        assert err.count("erpo: error: tp_size=3 does not divide the 2 rank(s)") == lines, err
    assert not (tmp_path / "r").exists()


def test_eval_of_tiny_on_own_data_checks_its_context_before_the_warm_start(capsys, tmp_path, monkeypatch):
    import erpo.tiny as tiny_module
    from erpo.config import TINY_MAX_NEW_TOKENS

    def trained(*args, **kwargs):
        raise AssertionError("the warm start was trained before the context check")

    monkeypatch.setattr(tiny_module, "warm_start", trained)
    data = _own_data(tmp_path)
    assert resolve_config(["model=tiny", f"data={data}"], "eval").eval_max_tokens == TINY_MAX_NEW_TOKENS
    one_line_error(capsys, ["eval", "model=tiny", f"data={data}", "max_new_tokens=1000", f"out={tmp_path}/e",
                            f"cache_dir={tmp_path}/cache", "progress=false"],
                   "has a context of 1024 positions", "+ max_new_tokens=1000 needs")
