"""The trainer (erpo/trainer.py): advantages, exact resume (2 + resume + 2 == 4, bit for
bit), an interrupted save, a short end-to-end run of the embedded default, the GRPO
path, and docs/objective.md's hand-written-loop example."""
import copy
import dataclasses
import json
import os
import shutil

import pytest
import torch

from erpo import checkpoint as ckpt
from erpo.cli import resolve_config
from erpo.config import ConfigError, TrainConfig
from erpo.errors import ErpoError
from erpo.rollout import Rollout
from erpo.start import rebuild_command
from erpo.trainer import METRIC_KEYS, Trainer, group_advantages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TIMING = ("time/", "throughput/")


def tiny(tmp_path, cache_dir, name="run", **overrides):
    """The embedded default shrunk to a few seconds."""
    values = dict(
        run_dir=str(tmp_path / name), cache_dir=str(cache_dir), tiny_hidden_size=32, tiny_layers=1,
        warmstart_steps=100, warmstart_batch_size=16, warmstart_unboxed=0.0, task_max_operand=4,
        task_train_size=20, task_eval_size=5,
        group_size=4, queries_per_step=4, max_new_tokens=6, steps=4, save_every=0, progress=False, lr=1e-3,
        warmup_steps=1,
    )
    values.update(overrides)
    return TrainConfig(**values)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("warmstart-cache")


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The trainer sets torch's thread count for the demo model; give other tests theirs back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def quiet(_msg):
    pass


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def untimed(rows):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def assert_same_params(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


# ---------------------------------------------------------------------- advantages


def test_group_advantages():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.3, 0.3, 0.3, 0.3], [2.0, 0.0, 1.0, 1.0]])
    a = group_advantages(r, "std")
    assert torch.equal(a[1], torch.zeros(4))  # identical rewards: exactly 0
    expected = (r[0] - 0.5) / (r[0].std(unbiased=True) + 1e-6)
    torch.testing.assert_close(a[0], expected)
    torch.testing.assert_close(a[2], (r[2] - 1.0) / (r[2].std(unbiased=True) + 1e-6))
    d = group_advantages(r, "none")  # Dr.GRPO: no std
    torch.testing.assert_close(d[0], r[0] - 0.5)
    assert torch.equal(d[1], torch.zeros(4))
    with pytest.raises(ValueError, match="2 responses"):
        group_advantages(torch.ones(3, 1), "std")


# ---------------------------------------------------------------------- mini-batch updates


class FixedRollout:
    """A rollout engine that answers every query with the same G responses: the gold
    answer in \\boxed{} for the first half of the group, a wrong one for the rest."""

    def __init__(self, trainer):
        self.tokenizer, self.examples, self.prompt_ids = trainer.tokenizer, trainer.examples, trainer.prompt_ids

    def generate(self, prompt_ids, n, temperature, max_new_tokens):
        out = []
        for ids in prompt_ids:
            answer = self.examples[self.prompt_ids.index(list(ids))].answer
            texts = ["\\boxed{" + (answer if j < n // 2 else answer + "1") + "}" for j in range(n)]
            out.append([self.tokenizer(t, add_special_tokens=False)["input_ids"][:max_new_tokens]
                        + [self.tokenizer.eos_token_id] for t in texts])
        return Rollout(out)  # no log-probs: written, not sampled

    def sync_weights(self, model):
        pass


def fixed_trainer(tmp_path, cache_dir, name, **overrides):
    cfg = tiny(tmp_path, cache_dir, name, max_new_tokens=8, **overrides)
    trainer = Trainer(cfg, log=quiet)
    trainer.engine = FixedRollout(trainer)
    return trainer


def test_one_mini_batch_is_the_plain_update_bit_for_bit(tmp_path, cache_dir):
    """mini_batches=1, ppo_epochs=1: one step equals the update written out by hand."""
    from erpo.data import step_indices
    from erpo.packing import forward_hidden, pack, prompt_lengths
    from erpo_kernels import erpo_loss

    trainer = fixed_trainer(tmp_path, cache_dir, "plain", mini_batches=1, ppo_epochs=1)
    cfg = trainer.cfg
    model = copy.deepcopy(trainer.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)  # warmup_steps=1: the full lr at step 1
    idx = step_indices(len(trainer.examples), cfg.queries_per_step, 1, cfg.seed)
    prompts = [trainer.prompt_ids[i] for i in idx]
    responses = trainer.engine.generate(prompts, cfg.group_size, cfg.temperature, cfg.max_new_tokens).responses
    rewards = torch.tensor([[trainer.reward_fn(trainer.tokenizer.decode(r, skip_special_tokens=True),
                                               trainer.examples[i].answer) for r in group]
                            for i, group in zip(idx, responses)])
    assert rewards[:, 0].eq(1).all() and rewards[:, -1].eq(0).all()
    packed = pack(prompts, responses, cfg.temperature)
    rows = trainer.cache_rows[idx]
    batch = packed.loss_batch(group_advantages(rewards).reshape(-1), trainer.cache.ref_query_logp[rows],
                              trainer.weighter.batch_weights(trainer.cache.score[rows]))
    hidden = forward_hidden(model, packed.input_ids, packed.position_ids, prompt_lengths(packed.span_cu_seqlens))
    loss, _ = erpo_loss(hidden, model.lm_head.weight, batch, cfg.loss_config())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    optimizer.step()

    metrics = trainer.step(1)
    assert len(trainer.last_updates) == 1 and metrics["pg/ratio_mean"] == 1.0 and metrics["pg/clipfrac"] == 0.0
    assert_same_params(model, trainer.model)


def test_two_mini_batches_make_the_second_update_off_policy(tmp_path, cache_dir):
    trainer = fixed_trainer(tmp_path, cache_dir, "mb2", mini_batches=2, lr=0.05)
    metrics = trainer.step(1)
    first, second = trainer.last_updates
    assert first["pg/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # old_logp: the weights that sampled
    assert first["pg/clipfrac"] == 0.0
    assert abs(second["pg/ratio_mean"] - 1.0) > 1e-3  # the first update moved the policy
    assert second["pg/clipfrac"] > 0
    for key in ("loss", "pg/clipfrac", "pg/ratio_mean", "grad_norm", "qkl/value", "weights/ess"):
        assert metrics[key] == pytest.approx((first[key] + second[key]) / 2, rel=1e-12, abs=1e-15)
    # each mini-batch holds half the queries (whole groups); their weights are normalised per mini-batch
    assert first["weights/ess"] <= 1.0 and second["weights/ess"] <= 1.0


def test_ppo_epochs_pass_over_the_batch_again(tmp_path, cache_dir):
    trainer = fixed_trainer(tmp_path, cache_dir, "ep2", mini_batches=2, ppo_epochs=2, lr=0.05)
    trainer.step(1)
    assert len(trainer.last_updates) == 4
    # epoch 2 sees mini-batch 1 again, now after two updates: further off-policy than at epoch 1
    assert trainer.last_updates[2]["pg/ratio_mean"] != trainer.last_updates[0]["pg/ratio_mean"]


def test_gradient_checkpointing_recomputes_layers_and_gives_the_same_update(tmp_path, cache_dir):
    plain = fixed_trainer(tmp_path, cache_dir, "gc-off", mini_batches=2)
    ckpt_run = fixed_trainer(tmp_path, cache_dir, "gc-on", mini_batches=2, gradient_checkpointing=True)
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in ckpt_run.model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert layers and not ckpt_run.model.training  # eval mode kept: no dropout anywhere
    assert not any(sub.training for layer in layers for sub in layer.modules() if sub is not layer)
    calls = []
    for layer in layers:
        inner = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, _inner=inner, **k: calls.append(1) or _inner(*a, **k)
    a, b = plain.step(1), ckpt_run.step(1)
    assert len(calls) == 2 * len(layers)  # every layer checkpointed in both updates (not in no-grad passes)
    assert untimed([a]) == untimed([b])
    assert_same_params(plain.model, ckpt_run.model)


def _float64_gradient(trainer):
    """The step's gradient (float64 model), recorded instead of taking the optimizer step."""
    trainer.model.double()
    trainer.compute_dtype = torch.float64
    if trainer.ref_model is not None:
        trainer.ref_model.double()
    grads = []
    trainer.optimizer.step = lambda *a, **k: grads.append([p.grad.clone() for p in trainer.model.parameters()])
    metrics = trainer.step(1)
    return grads, metrics


@pytest.mark.parametrize("algorithm", ["erpo", "grpo"])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_accumulate_the_mini_batch_gradient(tmp_path, cache_dir, algorithm, loss_agg):
    keys = dict(algorithm=algorithm, loss_agg=loss_agg, beta=0.05, max_grad_norm=0.0)
    whole = fixed_trainer(tmp_path, cache_dir, "mb-whole", **keys)
    longest = max(len(p) for p in whole.prompt_ids) + whole.cfg.max_new_tokens
    split = fixed_trainer(tmp_path, cache_dir, "mb-split", micro_batch_tokens=longest + 3, **keys)
    (g_whole,), m_whole = _float64_gradient(whole)
    (g_split,), m_split = _float64_gradient(split)
    plan = split.last_mini_batches[0].plan
    group = split.last_mini_batches[0].batch.group_index.tolist()
    parts_of_group = {}
    for k, part in enumerate(plan):
        for b in part:
            parts_of_group.setdefault(group[b], set()).add(k)
    assert len(plan) > 2 and any(len(parts) > 1 for parts in parts_of_group.values())  # a group split
    for a, b in zip(g_whole, g_split):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    for key in ("loss", "pg/loss", "pg/clipfrac", "entropy/mean", "response_length/mean"):
        assert m_split[key] == pytest.approx(m_whole[key], rel=1e-9, abs=1e-12), key


def test_micro_batch_budget_below_the_longest_sequence_is_refused(tmp_path, cache_dir):
    with pytest.raises(ConfigError, match=r"micro_batch_tokens=3 is smaller than the longest sequence a step can "
                                          r"hold \(\d+ tokens"):
        Trainer(tiny(tmp_path, cache_dir, "budget", micro_batch_tokens=3), log=quiet)


# ---------------------------------------------------------------------- resume


@pytest.mark.parametrize("updates", [{}, dict(mini_batches=2, ppo_epochs=2, micro_batch_tokens=24)],
                         ids=["one-update", "mini-and-micro-batches"])
def test_resume_is_bit_exact(tmp_path, cache_dir, updates):
    full = Trainer(tiny(tmp_path, cache_dir, "full", warmup_steps=3, **updates), log=quiet)
    full.train(plot=False)

    first = Trainer(tiny(tmp_path, cache_dir, "split", steps=2, warmup_steps=3, **updates), log=quiet)
    first.train(plot=False)
    assert ckpt.latest_checkpoint(first.cfg.run_dir).endswith("step-000002")
    cfg = resolve_config([f"resume={first.cfg.run_dir}", "steps=4"])
    assert cfg.run_dir == first.cfg.run_dir and cfg.steps == 4 and cfg.lr == first.cfg.lr
    second = Trainer(cfg, log=quiet)
    assert second.plan.start_step == 2
    second.train(plot=False)

    assert_same_params(full.model, second.model)
    a, b = read_metrics(full.cfg.run_dir), read_metrics(first.cfg.run_dir)
    # not vacuous: the policy learned something (rewards differ within groups, weights moved)
    assert any(r["reward/zero_std_frac"] < 1 for r in a[2:]) and all(r["grad_norm"] > 0 for r in a)
    initial = Trainer(tiny(tmp_path, cache_dir, "initial", steps=1), log=quiet).model
    assert any(not torch.equal(p, q) for p, q in zip(initial.parameters(), full.model.parameters()))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert untimed(a) == untimed(b)
    # the optimizer state carried over exactly too
    sa = full.optimizer.state_dict()["state"]
    sb = second.optimizer.state_dict()["state"]
    for k in sa:
        assert torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"])


def test_interrupted_save_leaves_the_last_checkpoint_intact(tmp_path, cache_dir, monkeypatch):
    reference = Trainer(tiny(tmp_path, cache_dir, "ref", steps=3), log=quiet)
    reference.train(plot=False)

    cfg = tiny(tmp_path, cache_dir, "cut", steps=3, save_every=1)
    real_save = torch.save

    def dying_save(obj, path, *args, **kwargs):
        if ".tmp-step-000003" in str(path):
            raise KeyboardInterrupt  # killed while writing checkpoint 3
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, log=quiet).train(plot=False)
    monkeypatch.undo()
    root = os.path.join(cfg.run_dir, "checkpoints")
    assert sorted(os.listdir(root))[0].startswith(".tmp-step-000003")  # the half-written one
    assert ckpt.latest_checkpoint(cfg.run_dir).endswith("step-000002")
    assert ckpt.read_state(ckpt.latest_checkpoint(cfg.run_dir))["step"] == 2
    assert len(read_metrics(cfg.run_dir)) == 3  # step 3 was logged before the save died

    resumed = Trainer(resolve_config([f"resume={cfg.run_dir}"]), log=quiet)
    assert resumed.plan.start_step == 2
    assert len(read_metrics(cfg.run_dir)) == 2  # what followed the checkpoint is dropped
    assert not any(n.startswith(".tmp") for n in os.listdir(root))
    resumed.train(plot=False)
    assert_same_params(reference.model, resumed.model)
    assert untimed(read_metrics(cfg.run_dir)) == untimed(read_metrics(reference.cfg.run_dir))


def test_resume_rebuilds_a_deleted_cache_only_from_the_same_start(tmp_path, cache_dir):
    """Resuming without the reference cache rebuilds it from the starting model, unless
    that model's weights changed since (then the cache would describe another model)."""
    warm = Trainer(tiny(tmp_path, cache_dir, "warm0", steps=1), log=quiet)
    model_dir = str(tmp_path / "start-model")
    shutil.copytree(warm.model_dir, model_dir)
    run = Trainer(tiny(tmp_path, cache_dir, "gone", steps=1, model=model_dir), log=quiet)
    run.train(plot=False)
    built = run.cache.ref_query_logp.clone()
    os.remove(run.plan.cache_path)
    again = Trainer(resolve_config([f"resume={run.cfg.run_dir}", "steps=2"]), log=quiet)
    assert torch.equal(again.cache.ref_query_logp, built) and os.path.isfile(run.plan.cache_path)

    os.remove(run.plan.cache_path)
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        other.model.norm.weight.add_(0.5)
    other.save_pretrained(model_dir)
    with pytest.raises(ErpoError, match="no longer holds the run's starting weights"):
        Trainer(resolve_config([f"resume={run.cfg.run_dir}", "steps=2"]), log=quiet)


def test_rebuild_command_names_every_key_of_the_demo_cache():
    """A stale demo cache's rebuild command must reproduce the run's warm start: every key
    that changes the warm-start model or the task appears in it."""
    from erpo.data import load_examples
    from erpo.tiny import warmstart_key

    def key(cfg):
        return warmstart_key(cfg, load_examples(cfg, "warmstart"), cfg.resolved_template)

    base = TrainConfig(run_dir="runs/x")
    changed = dict(seed=1, tiny_hidden_size=32, tiny_layers=1, warmstart_steps=7, warmstart_lr=1e-3,
                   warmstart_batch_size=8, warmstart_unboxed=0.5, task_max_operand=60, task_train_size=100,
                   task_eval_size=10)
    for name, value in changed.items():
        cfg = dataclasses.replace(base, **{name: value})
        assert key(cfg) != key(base), name
        assert f" {name}={value} " in rebuild_command(cfg), name
    # the RL prompts: another cache, the same warm start (it learns from every training problem)
    subset = dataclasses.replace(base, task_rl_size=30)
    assert " task_rl_size=30 " in rebuild_command(subset) and key(subset) == key(base)
    assert rebuild_command(base) == "erpo ref-cache run_dir=runs/x"


# ---------------------------------------------------------------------- end to end


def test_end_to_end_default_run(tmp_path, cache_dir):
    cfg = tiny(tmp_path, cache_dir, "e2e", steps=3, save_every=2, keep_checkpoints=0)
    lines = []
    summary = Trainer(cfg, log=lines.append).train()
    run = cfg.run_dir
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        missing = [k for k in METRIC_KEYS if k not in r]
        assert not missing, missing
        assert "policy_kl" not in r  # no reference model is monitored
        assert all(v == v for v in r.values()), r  # no NaN
        assert 0.0 <= r["reward/accuracy"] <= 1.0 and r["weights/min"] >= 0.1 - 1e-6
        assert r["response_length/mean"] > 0 and r["throughput/tokens_per_s"] > 0
    assert [s for s, _ in ckpt.checkpoint_dirs(run)] == [2, 3]
    with open(os.path.join(run, "curves.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.isfile(os.path.join(run, "config.yaml"))
    assert os.path.isfile(os.path.join(run, "ref_cache.safetensors"))
    assert summary["plot"] == os.path.join(run, "curves.png")
    assert lines[-1].startswith("erpo: erpo finished step 3/3") and "\n" not in lines[-1]
    # a checkpoint is a plain Hugging Face model directory
    from transformers import AutoModelForCausalLM

    last = ckpt.latest_checkpoint(run)
    reloaded = AutoModelForCausalLM.from_pretrained(last)
    trainer_model = Trainer(resolve_config([f"resume={run}"]), log=quiet).model
    assert_same_params(reloaded, trainer_model)


def test_grpo_with_reference_model_and_local_files(tmp_path, cache_dir):
    """GRPO with beta > 0 forwards a frozen reference each step (policy_kl logged); the
    model is a local HF directory and the data a local JSONL file."""
    warm = Trainer(tiny(tmp_path, cache_dir, "warm", steps=1), log=quiet)
    data = tmp_path / "data.jsonl"
    with open(data, "w") as f:
        for a in range(12):
            f.write(json.dumps({"question": f"{a}+{a}=", "solution": str(2 * a)}) + "\n")
    cfg = tiny(tmp_path, cache_dir, "grpo", steps=2, algorithm="grpo", beta=0.05, model=warm.model_dir,
               dataset=str(data), prompt_field="question", answer_field="solution", template="plain",
               reward="exact_match")
    t = Trainer(cfg, log=quiet)
    assert t.ref_model is not None
    t.train(plot=False)
    rows = read_metrics(cfg.run_dir)
    assert all("policy_kl" in r and r["policy_kl"] >= 0 for r in rows)
    assert rows[0]["policy_kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert all(r["weights/ess"] == 1.0 for r in rows)  # GRPO weights every query 1


# ------------------------------------------------------------ docs/objective.md's example


def test_hand_written_loop(tmp_path, cache_dir):
    warm = Trainer(tiny(tmp_path, cache_dir, "warm2", steps=1), log=quiet)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(warm.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(warm.model_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    # docs/objective.md's example, run as it is written there
    text = open(os.path.join(ROOT, "docs", "objective.md"), encoding="utf-8").read()
    (code,) = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    scope = {"model": model, "tokenizer": tokenizer}
    exec(compile(code, "docs/objective.md", "exec"), scope)
    loss, metrics = scope["loss"], scope["metrics"]

    assert torch.isfinite(loss)
    for key in ("loss", "pg/loss", "qkl/value", "weights/ess", "entropy/mean", "response_length/mean"):
        assert key in metrics
    assert metrics["qkl/value"] > 0  # l_theta(q) is not the made-up l_0(q)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize("overrides", [
    dict(query_weighting="none"),  # ablation: Query-KL only
    dict(alpha=0.0),  # ablation: weights only
    dict(query_weighting="softmax", loss_agg="seq-mean-token-mean", adv_norm="none", monitor_policy_kl=True),
])
def test_ablations_and_options_run(tmp_path, cache_dir, overrides):
    cfg = tiny(tmp_path, cache_dir, "abl", steps=2, **overrides)
    Trainer(cfg, log=quiet).train(plot=False)
    rows = read_metrics(cfg.run_dir)
    assert len(rows) == 2 and all(k in rows[-1] for k in METRIC_KEYS)
    if overrides.get("query_weighting") == "none":
        assert all(r["weights/ess"] == 1.0 and r["weights/min"] == 1.0 for r in rows)
    else:
        assert any(r["weights/ess"] < 1.0 for r in rows)  # reference-derived weights are not flat
    if overrides.get("alpha") == 0.0:
        assert all(r["loss"] == pytest.approx(r["pg/loss"], abs=1e-7) for r in rows)  # no Query-KL term
    assert ("policy_kl" in rows[-1]) == bool(overrides.get("monitor_policy_kl"))


# ---------------------------------------------------------------------- issue 19: dtypes, attention, the cache


@pytest.mark.parametrize("attn", ["auto", "flash_attention_2", "flex_attention", "sdpa_varlen", "sdpa", "eager"])
def test_every_attention_and_dtype_trains_on_cpu_or_is_refused(tmp_path, cache_dir, attn):
    """Every attn_implementation x dtype `erpo train` accepts on CPU trains a step (bf16 and fp16
    crashed in sdpa_varlen, issue 19.2); those CPU cannot train with are one ConfigError line
    naming attn_implementation=auto, before anything is built (19.6)."""
    from erpo.config import field_choices

    assert attn in field_choices("attn_implementation") and len(field_choices("attn_implementation")) == 6
    for dtype in field_choices("dtype"):
        cfg = tiny(tmp_path, cache_dir, f"{attn}-{dtype}", steps=1, attn_implementation=attn, dtype=dtype)
        if attn in ("flash_attention_2", "flex_attention"):
            with pytest.raises(ConfigError, match=f"attn_implementation={attn} .*CUDA only.*attn_implementation=auto"):
                Trainer(cfg, log=quiet)
            assert not os.path.exists(cfg.run_dir)
            continue
        trainer = Trainer(cfg, log=quiet)
        trainer.train(plot=False)
        (row,) = read_metrics(cfg.run_dir)
        assert all(v == v for v in row.values()), (dtype, row)   # no NaN
        assert trainer.cache.meta["compute_dtype"] == str(trainer.compute_dtype).replace("torch.", "")
        assert trainer.cache.meta["attn_implementation"] == ("sdpa_varlen" if attn == "auto" else attn)


def _unrewarded_run(tmp_path, cache_dir, name, **overrides):
    """The demo model on prompts of 40-odd tokens whose answers it never gives: every reward 0."""
    warm = Trainer(tiny(tmp_path, cache_dir, "warm-zero", steps=1), log=quiet)
    data = tmp_path / "zero.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} plus {a + 5}, counted in letters? {a}+{a + 5}=",
                                        "answer": "never"}) + "\n" for a in range(8)))
    return tiny(tmp_path, cache_dir, name, model=warm.model_dir, dataset=str(data), template="plain",
                reward="exact_match", lr=1e-3, warmup_steps=0, **overrides)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_at_the_starting_weights_the_query_kl_and_its_gradient_are_zero(tmp_path, cache_dir, dtype):
    """The cache's l_0(q) is computed by the forward that trains (the run's dtype, attention and
    kernel, each prompt's rows as the prompt alone), so at the starting weights l(q) equals it
    bit for bit: with every reward 0 the Query-KL, its gradient and the update are exactly 0,
    and AdamW has no rounding mismatch to blow up into full-size steps (issue 19.7; before, a
    1e-5-nat mismatch moved the weights by lr per step)."""
    cfg = _unrewarded_run(tmp_path, cache_dir, f"zero-{dtype}", steps=2, dtype=dtype)
    trainer = Trainer(cfg, log=quiet)
    start = copy.deepcopy(trainer.model)
    trainer.train(plot=False)
    rows = read_metrics(cfg.run_dir)
    assert all(r["reward/mean"] == 0.0 for r in rows)
    for r in rows:
        assert (r["qkl/delta_mean"], r["qkl/value"], r["loss"], r["grad_norm"]) == (0.0, 0.0, 0.0, 0.0), r
    assert_same_params(start, trainer.model)


def test_a_cache_scored_otherwise_is_not_reused(tmp_path, cache_dir):
    """The cache records how it was scored: a bf16 cache is refused by an fp32 run (and an old
    cache that records nothing), naming the command that rebuilds it (issue 19.7)."""
    from erpo.ref_cache import RefCacheError, read_ref_cache, save_ref_cache

    cfg = _unrewarded_run(tmp_path, cache_dir, "bf16", steps=1, dtype="bfloat16")
    Trainer(cfg, log=quiet).train(plot=False)
    path = os.path.join(cfg.run_dir, "ref_cache.safetensors")
    fp32 = _unrewarded_run(tmp_path, cache_dir, "fp32", steps=1, dtype="float32", ref_cache=path)
    with pytest.raises(RefCacheError, match="built for compute dtype .* 'bfloat16', this run uses 'float32'; "
                                            "rebuild it with: erpo ref-cache .*dtype=float32.*overwrite=true"):
        Trainer(fp32, log=quiet)
    old = read_ref_cache(path)
    for key in ("compute_dtype", "attn_implementation", "kernel_backend"):
        del old.meta[key]
    save_ref_cache(old, path)
    with pytest.raises(RefCacheError, match="does not record its compute dtype .*rebuild it with"):
        Trainer(_unrewarded_run(tmp_path, cache_dir, "bf16-again", steps=1, dtype="bfloat16", ref_cache=path),
                log=quiet)


def test_training_warns_once_when_every_response_is_cut_off(tmp_path, cache_dir):
    """max_new_tokens=1: every response is cut before its EOS; one warning line, once (issue 19.7)."""
    lines = []
    Trainer(tiny(tmp_path, cache_dir, "cut", steps=3, max_new_tokens=1), log=lines.append).train(plot=False)
    warned = [line for line in lines if "max_new_tokens" in line]
    assert len(warned) == 1 and "\n" not in warned[0], lines
    assert warned[0].startswith("erpo: warning: step 1: every response reached max_new_tokens=1 without ending")
    rows = read_metrics(str(tmp_path / "cut"))
    assert rows[0]["response_length/truncated_frac"] == 1.0
    assert all(0.0 <= r["response_length/truncated_frac"] <= 1.0 for r in rows)


def test_the_summary_of_a_resumed_run_covers_the_whole_run(tmp_path, cache_dir):
    """After a resume the closing line's rewards are those of steps 1..N, not only the resumed ones (issue 19.9)."""
    first = Trainer(tiny(tmp_path, cache_dir, "whole", steps=2, save_every=1), log=quiet)
    first.train(plot=False)
    lines = []
    Trainer(resolve_config([f"resume={first.cfg.run_dir}", "steps=4"]), log=lines.append).train(plot=False)
    rows = read_metrics(first.cfg.run_dir)
    assert lines[-1].startswith("erpo: erpo finished step 4/4") and "(steps 3-4 in this start)" in lines[-1]
    assert f"reward {rows[0]['reward/mean']:.3f} -> {rows[-1]['reward/mean']:.3f} (step 1 -> step 4)" in lines[-1], \
        lines[-1]


def test_the_closing_line_names_one_step_as_one_step():
    """No "first/last 1 steps" or "(steps 3-3 in this start)" (issue 29.7): one step is "step N",
    a mean over several is named as one."""
    from types import SimpleNamespace

    rows = [{"step": i, "reward/mean": i / 100, "qkl/value": 0.0} for i in range(1, 31)]
    me = SimpleNamespace(cfg=SimpleNamespace(algorithm="erpo", steps=30, run_dir="runs/x"), start_step=0)

    def line(history, run_rows):
        return Trainer._summary(me, history, run_rows, 1.0, None, None)["line"]

    assert "(step 3 in this start): reward 0.010 -> 0.030 (step 1 -> step 3)" in line(rows[2:3], rows[:3])
    assert "(steps 2-3 in this start)" in line(rows[1:3], rows[:3])
    assert "in 1s: reward 0.010 -> 0.010 (step 1)," in line(rows[:1], rows[:1])
    assert "reward 0.020 -> 0.290 (means of the run's first and last 3 steps)" in line(rows, rows)


@pytest.mark.parametrize("algorithm", ["erpo", "grpo"])
def test_monitor_policy_kl_changes_no_update(tmp_path, cache_dir, algorithm):
    """monitor_policy_kl=true only adds a no-grad reference forward and the policy_kl metric:
    the weights after 3 steps (2 updates each, the second off-policy) are bit-identical to
    those of the same run without it, and so is every other logged metric. grpo with beta=0
    (no KL term, hence no reference model of its own) is monitored the same way."""
    extra = {"beta": 0.0} if algorithm == "grpo" else {}
    runs = {}
    for monitor in (False, True):
        cfg = tiny(tmp_path, cache_dir, f"{algorithm}-monitor-{monitor}", steps=3, mini_batches=2,
                   algorithm=algorithm, monitor_policy_kl=monitor, **extra)
        trainer = Trainer(cfg, log=quiet)
        assert (trainer.ref_model is not None) == monitor
        trainer.train(plot=False)
        runs[monitor] = (trainer.model, untimed(read_metrics(cfg.run_dir)))
    assert_same_params(runs[False][0], runs[True][0])
    plain, monitored = runs[False][1], runs[True][1]
    assert all("policy_kl" not in r for r in plain) and all(r["policy_kl"] >= 0 for r in monitored)
    assert monitored[-1]["policy_kl"] > 0  # the policy moved away from the reference
    assert [{k: v for k, v in r.items() if k != "policy_kl"} for r in monitored] == plain


def test_train_until_step_then_train_continues(tmp_path, cache_dir):
    """train(until_step=2) and then train() on the same Trainer are the 4-step run of one
    train(): the second call starts at step 3 (weights and every metric bit-identical);
    plot=False draws no curves.png."""
    whole = Trainer(tiny(tmp_path, cache_dir, "whole", steps=4), log=quiet)
    whole.train()
    split = Trainer(tiny(tmp_path, cache_dir, "split", steps=4), log=quiet)
    assert split.train(until_step=2, plot=False)["plot"] is None
    assert not os.path.exists(os.path.join(split.cfg.run_dir, "curves.png"))  # plot=False: none drawn
    assert split.train()["steps"] == 2
    assert [r["step"] for r in read_metrics(split.cfg.run_dir)] == [1, 2, 3, 4]
    assert untimed(read_metrics(split.cfg.run_dir)) == untimed(read_metrics(whole.cfg.run_dir))
    assert_same_params(whole.model, split.model)
