"""erpo inside TRL (erpo.integrations.trl) against the real trl==1.16.0, on CPU.

A tiny Qwen2 built from a config and saved to a temp directory, the demo's locally built
tokenizer, a local datasets.Dataset, HF_HUB_OFFLINE=1: nothing comes from a hub.
"""
import os
import re
import subprocess
import sys
import textwrap

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import datasets  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import trl  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.kernels import ChunkedLogProbFunction  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from erpo_kernels.kept_logits import COMPOSED_PATH, KEPT_PATH  # noqa: E402
from erpo.integrations.trl import ERPOConfig, ERPOTrainer, _PromptPlan, use_erpo_kernels  # noqa: E402
from erpo.packing import forward_hidden, lm_head_of, pack  # noqa: E402
from erpo.tiny import build_tokenizer  # noqa: E402
from erpo_kernels import LossConfig, PackedLossBatch, erpo_loss  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["1+2=", "13+4=", "7+18=", "100+5=", "3+3=", "21+21=", "9+90=", "45+6="]


def tiny_model(tokenizer, seed=0, **extra):
    cfg = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        **extra,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    path = str(tmp_path_factory.mktemp("tiny-qwen2"))
    tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dataset():
    return datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS])


def reward_digits(completions, **kwargs):
    """Fraction of digits in the completion: varies within a group for a random model."""
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]


def train_args(cls, tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        max_steps=3, per_device_train_batch_size=8, num_generations=2, max_completion_length=6,
        logging_steps=1, seed=0, disable_tqdm=True, num_iterations=2, optim="sgd", learning_rate=0.1,
    )
    base.update(kw)
    return cls(**base)


def run_trainer(cls, args, model_dir, tokenizer, dataset, erpo_kernels=False):
    trainer = cls(model=model_dir, reward_funcs=reward_digits, args=args, train_dataset=dataset, processing_class=tokenizer)
    head = use_erpo_kernels(trainer, verbose=False) if erpo_kernels else None
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return trainer, head, logs


# ----------------------------------------------------------------------------- the fused head


def _fused_outputs(model, ids, mask, labels, c1, c2):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    ((out.log_probs * c1).sum() + (out.entropy * c2).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.log_probs.detach(), out.entropy.detach(), grads


# A soft cap that bends these small logits (|z| ~ 0.3 after the scale), and a logit scale.
CAPPED = {"final_logit_softcapping": 0.5, "logit_scale": 2.5}


@pytest.mark.parametrize("extra", [{}, CAPPED], ids=["plain", "softcap-logit_scale"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_head_matches_trl(tokenizer, backend, extra):
    """Log-probs, entropies and every parameter's gradient through TRL's fused head: our
    kernel vs TRL's ChunkedLogProbFunction, fp32, left padding, right padding and a prompt;
    with and without the model's softcap and logit scale (which TRL reads from its config);
    on the Triton backend with the logits kept for the backward (3 GEMMs)."""
    model = tiny_model(tokenizer, **extra)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, len(tokenizer), (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, -2:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :4] = -100
    c1, c2 = torch.randn(3, 10, generator=g), torch.randn(3, 10, generator=g)

    calls = []
    original = ChunkedLogProbFunction.apply
    ChunkedLogProbFunction.apply = lambda *a: calls.append(1) or original(*a)  # count TRL's kernel calls
    try:
        logp_trl, ent_trl, grad_trl = _fused_outputs(model, ids, mask, labels, c1, c2)
        head = use_erpo_kernels(model, backend=backend, verbose=False)
        logp, ent, grad = _fused_outputs(model, ids, mask, labels, c1, c2)
    finally:
        ChunkedLogProbFunction.apply = original
    assert len(calls) == 1 and head.calls == 1 and model.erpo_kernels is head
    # a training call on the Triton backend keeps its logits for the backward (3 GEMMs)
    assert head.forward_path == (KEPT_PATH if backend == "triton" else f"{COMPOSED_PATH} (the torch backend)")
    valid = labels[:, 1:] != -100
    assert valid.sum() > 0 and torch.all(logp[~valid] == 0)
    assert torch.allclose(logp, logp_trl, rtol=0, atol=1e-5), (logp - logp_trl).abs().max()
    assert torch.allclose(ent, ent_trl, rtol=0, atol=1e-5), (ent - ent_trl).abs().max()
    assert grad.keys() == grad_trl.keys() and "lm_head.weight" in grad
    for name in grad:
        scale = grad_trl[name].abs().max().clamp(min=1e-12)
        assert (grad[name] - grad_trl[name]).abs().max() / scale < 1e-5, name


def test_other_models_keep_trls_kernel(tokenizer):
    """Only the models given to use_erpo_kernels switch; another fused head stays TRL's."""
    ours, theirs = tiny_model(tokenizer), tiny_model(tokenizer)
    for m in (ours, theirs):
        add_fused_lm_head(m, outputs=("log_probs", "entropy"))
    head = use_erpo_kernels(ours, verbose=False)
    ids = torch.randint(4, len(tokenizer), (2, 7))
    theirs(input_ids=ids, labels=ids, fused_lm_head=True)
    assert head.calls == 0
    ours(input_ids=ids, labels=ids, fused_lm_head=True)
    ours.generate(input_ids=ids[:, :3], max_new_tokens=2, do_sample=False)  # generation: the plain forward
    assert head.calls == 1


def test_refuses_what_it_does_not_compute(tokenizer):
    model = tiny_model(tokenizer)
    add_fused_lm_head(model, outputs=("log_probs", "is_top1"))
    use_erpo_kernels(model, verbose=False)
    ids = torch.randint(4, len(tokenizer), (2, 7))
    with pytest.raises(ValueError, match="is_top1"):
        model(input_ids=ids, labels=ids, fused_lm_head=True)
    with pytest.raises(ValueError, match="backend"):
        use_erpo_kernels(model, backend="cuda")


# ----------------------------------------------------------------------------- GRPOTrainer

# Logged values of two 3-step runs, TRL's kernel vs ours (both fp32 on CPU). The runs use
# SGD: Adam turns the ~1e-7 noise of near-zero gradient components into +-lr updates,
# so after one Adam step two fp32 runs differ by ~1e-3 whatever the kernel. With SGD the
# measured differences are ~1e-7 relative; the tolerance is 1e-5 relative (plus 1e-7
# absolute for losses near 0).
LOSS_TOL = dict(rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("loss_type,beta", [("grpo", 0.0), ("dapo", 0.1)])
def test_grpo_trainer_same_loss(tmp_path, model_dir, tokenizer, dataset, loss_type, beta):
    runs = []
    for ours in (False, True):
        args = train_args(GRPOConfig, tmp_path, loss_type=loss_type, beta=beta)
        runs.append(run_trainer(GRPOTrainer, args, model_dir, tokenizer, dataset, erpo_kernels=ours))
    (_, _, base), (trainer, head, logs) = runs
    assert len(base) == len(logs) == 3
    assert head.calls >= 3 and (beta == 0 or trainer.ref_model.erpo_kernels.calls >= 2)  # once per generation
    for a, b in zip(base, logs):
        assert b["loss"] == pytest.approx(a["loss"], **LOSS_TOL)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["entropy"] == pytest.approx(a["entropy"], rel=1e-5)
        if beta:
            assert b["kl"] == pytest.approx(a["kl"], rel=1e-5, abs=1e-8)
    assert any(abs(a["loss"]) > 1e-3 for a in base)  # the losses compared are not all ~0


# ----------------------------------------------------------------------------- ERPOTrainer


def test_erpo_alpha0_uniform_is_grpo(tmp_path, model_dir, tokenizer, dataset):
    """alpha = 0 and query_weighting = none: TRL's GRPO loss, step by step (beta = 0)."""
    _, _, grpo = run_trainer(GRPOTrainer, train_args(GRPOConfig, tmp_path, loss_type="grpo"), model_dir, tokenizer, dataset)
    args = train_args(ERPOConfig, tmp_path, loss_type="grpo", alpha=0.0, query_weighting="none")
    trainer, _, erpo = run_trainer(ERPOTrainer, args, model_dir, tokenizer, dataset)
    assert trainer.erpo_head.calls >= 3
    for a, b in zip(grpo, erpo):
        assert b["loss"] == pytest.approx(a["loss"], **LOSS_TOL)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert "query_kl" in b  # monitored even at alpha = 0
    generated = [b for b in erpo if "weights/min" in b]  # steps that sampled (num_iterations = 2)
    assert len(generated) == 2 and all(b["weights/min"] == b["weights/max"] == 1.0 for b in generated)


@pytest.mark.parametrize("loss_type,loss_agg,accumulation", [("grpo", "seq-mean-token-mean", 1),
                                                            ("dapo", "token-mean", 2)])
def test_erpo_policy_loss_vanilla_is_trls(tmp_path, model_dir, tokenizer, dataset, loss_type, loss_agg, accumulation):
    """ERPOConfig(policy_loss=vanilla, loss_agg=...), alpha = 0, no weighting: erpo's
    objective in place of TRL's loss type gives TRL's grpo (dapo) loss, step by step, also
    with the generation batch split over two accumulation steps (the ratios stay below
    vanilla's dual clip, which TRL does not have)."""
    extra = dict(gradient_accumulation_steps=accumulation, per_device_train_batch_size=8 // accumulation)
    _, _, grpo = run_trainer(GRPOTrainer, train_args(GRPOConfig, tmp_path, loss_type=loss_type, **extra), model_dir,
                             tokenizer, dataset)
    args = train_args(ERPOConfig, tmp_path, loss_type=loss_type, alpha=0.0, query_weighting="none",
                      policy_loss="vanilla", loss_agg=loss_agg, **extra)
    trainer, _, erpo = run_trainer(ERPOTrainer, args, model_dir, tokenizer, dataset)
    assert len(grpo) == len(erpo) == 3
    for a, b in zip(grpo, erpo):
        assert b["loss"] == pytest.approx(a["loss"], **LOSS_TOL)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert "pg/clipfrac" in b
    assert any(abs(a["loss"]) > 1e-3 for a in grpo)


def test_erpo_with_a_policy_loss_trl_lacks_trains(tmp_path, model_dir, tokenizer, dataset):
    """geo_mean (GMPO, not a TRL loss type) with the Query-KL and the prevalence weights:
    3 steps, finite losses, the Query-KL logged; TRL-only terms are refused."""
    args = train_args(ERPOConfig, tmp_path, alpha=0.05, policy_loss="geo_mean", loss_agg="seq-mean-token-mean")
    _, _, logs = run_trainer(ERPOTrainer, args, model_dir, tokenizer, dataset)
    assert len(logs) == 3 and all(torch.isfinite(torch.tensor(h["loss"])) and "query_kl" in h for h in logs)
    with pytest.raises(ValueError, match="^policy_loss must be one of"):
        train_args(ERPOConfig, tmp_path, policy_loss="ppo")
    with pytest.raises(ValueError, match="set beta=0"):
        train_args(ERPOConfig, tmp_path, policy_loss="gspo", beta=0.1)


def test_erpo_config_takes_the_peer_losses(tmp_path):
    """ERPOConfig(policy_loss=) accepts issue 36's six; vespo takes TRL's own vespo_* keys,
    dro its dro_beta (required), each checked by LossConfig."""
    for name in ("dppo_tv", "dppo_kl", "bypass_mode", "luspo"):
        assert train_args(ERPOConfig, tmp_path, policy_loss=name).erpo_loss_config().policy_loss == name
    cfg = train_args(ERPOConfig, tmp_path, policy_loss="vespo", vespo_k_pos=1.5, vespo_lambda_neg=2.5)
    loss = cfg.erpo_loss_config()
    assert (loss.vespo_k_pos, loss.vespo_lambda_pos, loss.vespo_k_neg, loss.vespo_lambda_neg) == (1.5, 3.0, 3.0, 2.5)
    assert train_args(ERPOConfig, tmp_path, policy_loss="dro", dro_beta=0.1).erpo_loss_config().dro_beta == 0.1
    with pytest.raises(ValueError, match="^dro_beta is required with policy_loss='dro'"):
        train_args(ERPOConfig, tmp_path, policy_loss="dro")


def _erpo_loss_on_same_batch(trainer, inputs, alpha):
    """erpo_loss (advantages 0, so the loss is alpha * R_query) on the micro-batch
    `inputs`, repacked: one row per token, positions from 0, the prompt scored once per query."""
    model = trainer.model
    pids, pmask = inputs["prompt_ids"], inputs["prompt_mask"]
    cids, cmask = inputs["completion_ids"], inputs["completion_mask"]
    scored = inputs["query_scored"].tolist()
    # one group per scoring copy; its other copies are left out: their prompt rows score nothing
    prompts = [pids[b][pmask[b].bool()].tolist() for b in range(len(scored)) if scored[b]]
    responses = [[cids[b][cmask[b].bool()].tolist()] for b in range(len(scored)) if scored[b]]
    packed = pack(prompts, responses, trainer.temperature)
    rows = torch.tensor([b for b in range(len(scored)) if scored[b]])
    batch = PackedLossBatch(
        targets=packed.targets, inv_temperature=packed.inv_temperature, span_cu_seqlens=packed.span_cu_seqlens,
        group_index=packed.group_index, advantages=torch.zeros(len(prompts)),
        ref_query_logp=inputs["ref_query_logp"][rows], query_weights=inputs["query_weights"][rows],
    )
    hidden = forward_hidden(model, packed.input_ids, packed.position_ids)  # packed: positions from 0
    weight, bias = lm_head_of(model)
    cfg = LossConfig(algorithm="erpo", alpha=alpha, loss_agg="seq-mean-token-mean", kl_guard=trainer.args.kl_guard)
    return erpo_loss(hidden, weight, batch, cfg, bias=bias, backend="torch")


def test_erpo_query_kl_equals_erpo_loss(tmp_path, model_dir, tokenizer, dataset):
    """On one generation batch: R_query from the trainer's fused forward (prompt rows at
    temperature 1 in the completions' call) equals erpo_loss's, in value and gradient,
    and _compute_loss adds alpha * R_query (the batch is one micro-batch: share 1)."""
    alpha = 0.5
    args = train_args(ERPOConfig, tmp_path, loss_type="grpo", alpha=alpha, query_weighting="prevalence", bins=3)
    trainer = ERPOTrainer(model=model_dir, reward_funcs=reward_digits, args=args, train_dataset=dataset,
                          processing_class=tokenizer)
    trainer.model.train()
    with torch.no_grad():  # a policy that has moved away from the reference (l_theta != l_0)
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    inputs = trainer._generate_and_score_completions([dict(dataset[i]) for i in (0, 0, 1, 1, 2, 2, 3, 3)])
    assert inputs["query_scored"].sum() == 4 and float(inputs["query_weight_total"]) == pytest.approx(4.0)
    weights = inputs["query_weights"][inputs["query_scored"]]
    assert weights.max() > weights.min()  # prevalence weights that differ

    # the trainer's R_query and its gradient
    model = trainer.model
    plan = _PromptPlan(prompt_len=inputs["prompt_ids"].shape[1], scored=inputs["query_scored"])
    trainer.erpo_head.plan = plan
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, inputs["completion_ids"].shape[1])
    trainer.erpo_head.plan = None
    r_query, share, metrics = trainer.query_kl_term(plan.log_probs, plan.prompt_len, inputs)
    assert share == pytest.approx(1.0)
    model.zero_grad(set_to_none=True)
    (alpha * r_query).backward()
    grad_trainer = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    # erpo_loss on the same batch, repacked
    model.zero_grad(set_to_none=True)
    loss, ref_metrics = _erpo_loss_on_same_batch(trainer, inputs, alpha)
    loss.backward()
    assert ref_metrics["qkl/loss"] > 1e-3
    assert metrics["query_kl"] == pytest.approx(ref_metrics["qkl/loss"], rel=1e-5)
    assert metrics["qkl/value"] == pytest.approx(ref_metrics["qkl/value"], rel=1e-5)
    assert float(loss.detach()) == pytest.approx(alpha * float(r_query.detach()), rel=1e-5)
    for name, g in grad_trainer.items():
        ref = model.get_parameter(name).grad
        assert (g - ref).abs().max() / ref.abs().max().clamp(min=1e-12) < 1e-4, name

    # _compute_loss: TRL's loss + alpha * R_query
    trainer.current_gradient_accumulation_steps = 1  # set by TRL's training loop
    with torch.no_grad():
        with_qkl = trainer._compute_loss(model, inputs)
        trainer.args.alpha = 0.0
        without = trainer._compute_loss(model, inputs)
        trainer.args.alpha = alpha
    assert float(with_qkl - without) == pytest.approx(alpha * float(r_query.detach()), rel=1e-5)


def test_erpo_query_kl_adds_up_over_micro_batches(tmp_path, model_dir, tokenizer, dataset):
    """A generation batch of 8 split into 2 accumulated micro-batches (shuffled, as TRL
    does): the Query-KL terms _compute_loss adds sum to alpha * R_query of the whole batch."""
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

    alpha = 0.5
    args = train_args(ERPOConfig, tmp_path, loss_type="grpo", alpha=alpha, query_weighting="prevalence", bins=3,
                      per_device_train_batch_size=4, gradient_accumulation_steps=2)
    trainer = ERPOTrainer(model=model_dir, reward_funcs=reward_digits, args=args, train_dataset=dataset,
                          processing_class=tokenizer)
    assert trainer.args.steps_per_generation == 2
    trainer.model.train()
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    inputs = trainer._generate_and_score_completions([dict(dataset[i]) for i in (0, 0, 1, 1, 2, 2, 3, 3)])
    model = trainer.model

    def qkl_added(batch, accumulation):
        trainer.current_gradient_accumulation_steps = accumulation
        with torch.no_grad():
            with_qkl = trainer._compute_loss(model, batch)
            trainer.args.alpha = 0.0
            without = trainer._compute_loss(model, batch)
            trainer.args.alpha = alpha
        return float(with_qkl - without)

    torch.manual_seed(3)
    parts = split_tensor_dict(shuffle_sequence_dict(inputs), 2)
    assert all(0 < int(part["query_scored"].sum()) < 4 for part in parts)  # the scoring copies are split
    # the whole generation batch at once, with accumulation = steps_per_generation: share 1, alpha * R_query
    whole = qkl_added(dict(inputs), trainer.args.steps_per_generation)
    assert whole > 1e-3
    assert sum(qkl_added(part, 2) for part in parts) == pytest.approx(whole, rel=1e-5)


def _policy_loss_step(trainer, inputs, fused_budget_mb):
    """trainer._compute_loss + backward on one micro-batch (2 accumulated per generation
    batch) with ERPOConfig.fused_budget_mb: (loss, {parameter: grad}, {metric: values},
    the head's loss_path)."""
    model = trainer.model
    trainer.args.fused_budget_mb = fused_budget_mb
    trainer.current_gradient_accumulation_steps = 2
    trainer._metrics["train"].clear()
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, dict(trainer._metrics["train"]), trainer.erpo_head.loss_path


@pytest.mark.parametrize("rows", ["every-position", "labelled-only"])
def test_erpo_policy_loss_fused_equals_the_composition(tmp_path, model_dir, tokenizer, dataset, monkeypatch, rows):
    """ERPOConfig(policy_loss=vanilla, alpha > 0, prevalence weights) on the Triton backend:
    the policy forward forms erpo_loss on TRL's hidden rows and lm_head weight (its fused
    path, 3 GEMMs); loss, every parameter's gradient and the logged metrics equal the 4-GEMM
    path's (fused_budget_mb=0: linear_token_logprobs + erpo_loss_from_logp + the Query-KL)
    in fp32 within 1e-5, on both micro-batches of a generation batch whose scoring copies
    they split; with TRL handing over every position (CPU) or only the labelled rows (Triton
    devices). Counted in the interpreter, the fused step's lm_head work is the
    composition's less one GEMM (the logits' recompute): 3 GEMMs, not 4."""
    from bench.cost import count_launches
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict
    from erpo.integrations.trl import FUSED_PATH

    if rows == "labelled-only":  # TRL's layout on a Triton device: hidden_states[mask]
        monkeypatch.setattr(trl.trainer.utils, "_use_triton", lambda device: True)
    args = train_args(ERPOConfig, tmp_path, alpha=0.5, query_weighting="prevalence", bins=3, policy_loss="vanilla",
                      loss_agg="seq-mean-token-mean", erpo_backend="triton", per_device_train_batch_size=4,
                      gradient_accumulation_steps=2)
    trainer = ERPOTrainer(model=model_dir, reward_funcs=reward_digits, args=args, train_dataset=dataset,
                          processing_class=tokenizer)
    trainer.model.train()
    inputs = trainer._generate_and_score_completions([dict(dataset[i]) for i in (0, 0, 1, 1, 2, 2, 3, 3)])
    assert inputs.get("old_per_token_logps") is not None  # num_iterations = 2
    with torch.no_grad():  # a policy away from the rollout's (ratios != 1) and from l_0
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    torch.manual_seed(3)
    parts = split_tensor_dict(shuffle_sequence_dict(inputs), 2)
    assert all(0 < int(part["query_scored"].sum()) < 4 for part in parts)
    for part in parts:
        fused, composed = (_policy_loss_step(trainer, part, budget) for budget in (1024, 0))
        assert fused[3] == FUSED_PATH
        assert composed[3] == f"erpo_loss_from_logp (fused_budget=0) on {COMPOSED_PATH} (fused_budget=0)"
        assert fused[0] == pytest.approx(composed[0], rel=1e-5, abs=1e-7) and abs(composed[0]) > 1e-3
        assert fused[1].keys() == composed[1].keys() and "lm_head.weight" in fused[1]
        for name, g in composed[1].items():
            assert float((fused[1][name] - g).abs().max()) <= 1e-5 * (1 + float(g.abs().max())), name
        assert fused[2].keys() == composed[2].keys() >= {"pg/loss", "pg/clipfrac", "query_kl", "qkl/value"}
        for key, values in composed[2].items():
            assert fused[2][key] == pytest.approx(values, rel=1e-5, abs=1e-7), key

    if rows == "labelled-only":
        return  # the count once (every-position): the same kernels on fewer rows

    def dot_flops(step):  # the erpo kernels' tl.dot work (the backbone's matmuls are torch ops, not counted)
        return sum(r.total_flops for r in count_launches(step, torch_ops=False))

    def forward_only():
        with torch.no_grad():
            trainer._compute_loss(trainer.model, parts[0])

    one_gemm = dot_flops(forward_only)  # the log-probs' forward alone on the same rows
    fused, composed = (dot_flops(lambda b=budget: _policy_loss_step(trainer, parts[0], b)) for budget in (1024, 0))
    # the composition's 4th GEMM is its backward's recompute of the logits, which the fused path does not do
    assert one_gemm > 0 and composed - fused == one_gemm, (one_gemm, fused, composed)


def test_erpo_trains_logs_and_caches(tmp_path, model_dir, tokenizer, dataset):
    """3 steps with alpha > 0 and prevalence weights: TRL's log carries query_kl and the
    weights' ESS, min and max; the reference cache is written and then loaded."""
    cache = tmp_path / "ref.safetensors"
    args = train_args(ERPOConfig, tmp_path, alpha=0.1, query_weighting="prevalence", bins=3, ref_cache=str(cache),
                      num_iterations=1)
    trainer, _, logs = run_trainer(ERPOTrainer, args, model_dir, tokenizer, dataset)
    assert cache.is_file() and len(trainer.ref_cache) == len(PROMPTS)
    assert len(logs) == 3
    for log in logs:
        assert log["query_kl"] >= 0 and 0 < log["weights/ess"] <= 1 + 1e-6
        assert log["weights/min"] <= 1.0 <= log["weights/max"]
    assert logs[-1]["query_kl"] > 0  # the policy moved away from l_0
    mtime = cache.stat().st_mtime_ns
    again = ERPOTrainer(model=model_dir, reward_funcs=reward_digits, args=args, train_dataset=dataset,
                        processing_class=tokenizer)
    assert cache.stat().st_mtime_ns == mtime  # loaded, not rebuilt
    assert torch.equal(again.ref_cache.ref_query_logp, trainer.ref_cache.ref_query_logp)
    from erpo.ref_cache import RefCacheError

    cache.write_bytes(b"\x00garbage")  # unreadable: the error says how ERPOTrainer rebuilds its cache
    fix = re.escape(f"; rebuild it with: delete {cache} (ERPOTrainer rebuilds a missing cache from the train dataset)")
    with pytest.raises(RefCacheError, match=f"^reference cache {re.escape(str(cache))} is unreadable .*{fix}$"):
        ERPOTrainer(model=model_dir, reward_funcs=reward_digits, args=args, train_dataset=dataset,
                    processing_class=tokenizer)


def test_erpo_config_names_bad_fields(tmp_path):
    with pytest.raises(ValueError, match="query_weighting"):
        ERPOConfig(output_dir=str(tmp_path), use_cpu=True, query_weighting="uniform")
    with pytest.raises(ValueError, match="w_min"):
        ERPOConfig(output_dir=str(tmp_path), use_cpu=True, w_min=2.0)
    with pytest.raises(ValueError, match="erpo_backend must be one of auto, triton, torch"):
        ERPOConfig(output_dir=str(tmp_path), use_cpu=True, erpo_backend="cuda")


@pytest.mark.parametrize("key,bad", [("alpha", -1.0), ("kl_guard", 100.0), ("w_min", 2.0), ("w_max", 0.5),
                                     ("weight_temperature", 0.0), ("gamma", -1.0), ("bins", 0),
                                     ("query_weighting", "rank")])
def test_erpo_config_checks_are_the_objects_own(tmp_path, key, bad):
    """ERPOConfig refuses what erpo's TrainConfig refuses, with the message of the object the
    key configures (LossConfig, QueryWeighter): one implementation of each check."""
    from erpo.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError) as ours:
        TrainConfig(**{key: bad}).validate()
    with pytest.raises(ValueError) as trl_side:
        ERPOConfig(output_dir=str(tmp_path), use_cpu=True, **{key: bad})
    assert key in str(trl_side.value)
    if key != "query_weighting":  # erpo train names the choices its own way (one line per key, all keys)
        assert str(trl_side.value) == str(ours.value)


# ----------------------------------------------------------------------------- without trl


def test_import_without_trl():
    code = textwrap.dedent(
        """
        import sys
        class BlockTRL:
            def find_spec(self, name, path=None, target=None):
                if name == "trl" or name.startswith("trl."):
                    raise ImportError("No module named 'trl'")
        sys.meta_path.insert(0, BlockTRL())
        import erpo, erpo.integrations
        try:
            import erpo.integrations.trl
        except ImportError as exc:
            print("MESSAGE:" + str(exc))
        """
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    message = out.stdout.split("MESSAGE:", 1)[1].strip()
    assert "\n" not in message and "pip install erpo[trl]" in message


# ----------------------------------------------------------------------------- docs/trl.md


def test_docs_snippets(tmp_path, model_dir, monkeypatch, capsys):
    """The code blocks of docs/trl.md ("Using erpo from TRL"), run as a new user would (on
    the tiny model instead of the hub id, from a fresh directory)."""
    text = open(os.path.join(ROOT, "docs", "trl.md"), encoding="utf-8").read()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert len(blocks) == 3
    code = "\n".join(blocks)
    assert 'MODEL = "Qwen/Qwen2.5-0.5B-Instruct"' in code
    code = code.replace('MODEL = "Qwen/Qwen2.5-0.5B-Instruct"', f"MODEL = {model_dir!r}")
    assert code.count("report_to=[]") == 2
    code = code.replace("report_to=[]", "report_to=[], use_cpu=True, bf16=False")  # as docs/trl.md says for CPU
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(code, "docs/trl.md", "exec"), scope)
    err = capsys.readouterr().err
    assert "runs erpo_kernels.linear_token_logprobs" in err
    grpo_head = scope["use_erpo_kernels"]  # the snippet's trainers: GRPO with our kernel, then ERPO
    assert grpo_head is not None
    erpo_trainer = scope["trainer"]
    assert erpo_trainer.erpo_head.calls >= 3
    logs = [h for h in erpo_trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all("query_kl" in h and "weights/ess" in h for h in logs)
    assert (tmp_path / "runs" / "trl-erpo" / "ref_cache.safetensors").is_file()
