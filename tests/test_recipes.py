"""The recipes' pieces of `erpo train` (issue 27 item 3): DAPO's dynamic sampling
(filter_groups) and overlong reward shaping (overlong_buffer, overlong_penalty), each
checked against a hand-written reference and in a tiny trainer run with erpo and grpo."""
import os

import pytest
import torch

from erpo.cli import main
from erpo.data import step_indices
from erpo.dynamic_sampling import SampledGroups, refill_indices, uniform_groups
from erpo.rewards import overlong_penalty
from erpo.rollout import Rollout
from erpo.trainer import Trainer, group_advantages

from test_trainer import _keep_torch_threads, cache_dir, quiet, read_metrics, tiny, untimed  # noqa: F401 (fixtures)


# ---------------------------------------------------------------------- overlong reward shaping


def test_overlong_penalty_is_dapos_linear_ramp_over_the_buffer():
    """DAPO eq. 13 written out: L_max = 20, L_cache = 4, so the ramp starts after 16 tokens."""
    for length in range(1, 21):
        expected = 0.0 if length <= 16 else (16 - length) / 4  # ((L_max - L_cache) - |y|) / L_cache
        assert overlong_penalty(length, 20, 4, 1.0) == pytest.approx(expected, abs=1e-15)
    assert overlong_penalty(20, 20, 4, 0.5) == -0.5  # the penalty factor scales the ramp
    assert overlong_penalty(17, 20, 4, 2.0) == -0.5
    assert overlong_penalty(20, 20, 0, 1.0) == 0.0  # buffer 0: off
    assert overlong_penalty(3, 8, 8, 1.0) == pytest.approx(-3 / 8)  # a buffer of the whole length


@pytest.mark.parametrize("buffer, penalty, max_new, match", [
    (-1, 1.0, 8, "overlong_buffer=-1 must be an integer >= 0"),
    (9, 1.0, 8, "overlong_buffer=9 exceeds max_new_tokens=8"),
    (2, -0.5, 8, "overlong_penalty=-0.5 must be a finite number >= 0"),
    (2, float("inf"), 8, "overlong_penalty=inf"),
])
def test_overlong_penalty_refuses_bad_settings(buffer, penalty, max_new, match):
    with pytest.raises(ValueError, match=match):
        overlong_penalty(1, max_new, buffer, penalty)


def _one_line_error(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("erpo: error:") and len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


def test_recipe_keys_are_checked_with_a_one_line_error_naming_the_key(capsys):
    _one_line_error(capsys, ["train", "overlong_buffer=20"], "overlong_buffer=20 exceeds max_new_tokens=8")
    _one_line_error(capsys, ["train", "overlong_penalty=-1"], "overlong_penalty=-1.0")
    _one_line_error(capsys, ["train", "filter_groups_max_batches=-2"], "filter_groups_max_batches=-2")
    _one_line_error(capsys, ["train", "filter_groups=maybe"], "filter_groups='maybe' is not true or false")
    _one_line_error(capsys, ["train", "max_num_gen_batches=3"], "did you mean filter_groups_max_batches?")


def test_recipe_keys_are_in_the_help(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for key in ("filter_groups", "filter_groups_max_batches", "overlong_buffer", "overlong_penalty"):
        assert f"  {key} " in out, key


# ---------------------------------------------------------------------- dynamic sampling's pieces


def test_uniform_groups_are_those_whose_advantages_are_all_zero():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.25, 0.25, 0.25], [0.0, 0.0, 1e-9]])
    uniform = uniform_groups(r)
    assert uniform.tolist() == [True, False, True, False]
    a = group_advantages(r)
    assert a[uniform].eq(0).all() and a[~uniform].ne(0).any(dim=1).all()


def test_refill_batches_are_new_disjoint_and_reproducible():
    own = step_indices(30, 4, 3, seed=7)
    batches = [refill_indices(30, 4, 3, 7, d, own) for d in (1, 2, 3, 4, 5, 6)]
    assert all(len(b) == 4 for b in batches)  # 26 other queries: 6 whole batches of 4
    flat = [i for b in batches for i in b]
    assert len(set(flat)) == 24 and not set(flat) & set(own)
    assert refill_indices(30, 4, 3, 7, 7, own) == []  # 2 left: no whole batch
    assert batches[0] == refill_indices(30, 4, 3, 7, 1, own)  # the same on every start
    assert refill_indices(30, 4, 4, 7, 1, own) != batches[0]  # another step, other queries
    with pytest.raises(ValueError, match="draw must be >= 1"):
        refill_indices(30, 4, 3, 7, 0, own)


def test_sampled_groups_take_and_concat_keep_every_field_together():
    def groups(offset):
        idx = [offset, offset + 1, offset + 2]
        responses = [[[i] * (j + 1) for j in range(2)] for i in idx]
        logprobs = [[[-0.1 * i] * (j + 1) for j in range(2)] for i in idx]
        rewards = torch.tensor([[float(i), float(i) + 0.5] for i in idx])
        return SampledGroups(idx, [[i] for i in idx], responses, logprobs, rewards, torch.zeros(3, 2))

    both = SampledGroups.concat([groups(0), groups(10)])
    picked = both.take([4, 0])
    assert picked.idx == [11, 0] and picked.prompts == [[11], [0]]
    assert picked.responses == [[[11], [11, 11]], [[0], [0, 0]]]
    assert picked.logprobs[0] == [[-1.1], [-1.1, -1.1]]
    assert picked.rewards.tolist() == [[11.0, 11.5], [0.0, 0.5]] and picked.truncated.shape == (2, 2)
    assert picked.lengths().tolist() == [[1.0, 2.0], [1.0, 2.0]]
    no_logprobs = groups(20)
    no_logprobs.logprobs = None
    assert SampledGroups.concat([groups(0), no_logprobs]).logprobs is None


# ---------------------------------------------------------------------- in the trainer


class ScriptedRollout:
    """Answers every query with G responses written out: all correct for the queries
    `solved(i)` holds for (their rewards are all equal), half correct for the others;
    `filler`: x-es before the answer of response j (to exercise the overlong shaping)."""

    def __init__(self, trainer, solved, filler=()):
        self.tokenizer, self.examples, self.prompt_ids = trainer.tokenizer, trainer.examples, trainer.prompt_ids
        self.solved, self.filler, self.calls = solved, filler, []

    def generate(self, prompt_ids, n, temperature, max_new_tokens):
        idx = [self.prompt_ids.index(list(p)) for p in prompt_ids]
        self.calls.append(idx)
        out = []
        for i in idx:
            answer = self.examples[i].answer
            group = []
            for j in range(n):
                pad = "x" * (self.filler[j] if j < len(self.filler) else 0)
                text = pad + "\\boxed{" + (answer if self.solved(i) or j < n // 2 else answer + "1") + "}"
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                group.append((ids + [self.tokenizer.eos_token_id])[:max_new_tokens])
            out.append(group)
        return Rollout(out)

    def sync_weights(self, model):
        pass


def scripted_trainer(tmp_path, cache_dir, name, solved, filler=(), **overrides):
    cfg = tiny(tmp_path, cache_dir, name, max_new_tokens=12, **overrides)
    trainer = Trainer(cfg, log=quiet)
    trainer.engine = ScriptedRollout(trainer, solved, filler)
    seen = []
    updates = trainer._updates

    def recording(idx, prompts, responses, advantages, logprobs=None, support=None):
        seen.append((list(idx), advantages.clone()))
        return updates(idx, prompts, responses, advantages, logprobs, support)

    trainer._updates = recording
    return trainer, seen


@pytest.mark.parametrize("algorithm", ["erpo", "grpo"])
def test_filter_groups_trains_only_on_groups_with_signal_refilled_from_new_queries(tmp_path, cache_dir, algorithm):
    solved = lambda i: i % 3 != 0  # two thirds of the queries: every response right, no signal
    trainer, seen = scripted_trainer(tmp_path, cache_dir, f"fg-{algorithm}", solved, algorithm=algorithm,
                                     filter_groups=True, filter_groups_max_batches=0)
    cfg = trainer.cfg
    metrics = trainer.step(1)
    own = step_indices(len(trainer.examples), cfg.queries_per_step, 1, cfg.seed)
    drawn = [own] + [refill_indices(len(trainer.examples), cfg.queries_per_step, 1, cfg.seed, d, own)
                     for d in range(1, len(trainer.engine.calls))]
    assert trainer.engine.calls == drawn  # the step's queries, then whole batches of new ones
    expected = [i for batch in drawn for i in batch if not solved(i)][:cfg.queries_per_step]
    (idx, advantages), = seen
    assert idx == expected and len(idx) == cfg.queries_per_step
    assert advantages.ne(0).any(dim=1).all()  # every trained group carries a policy gradient
    assert metrics["filter_groups/batches"] == len(drawn) > 1
    assert metrics["filter_groups/dropped_frac"] == pytest.approx(sum(map(solved, sum(drawn, []))) / (4 * len(drawn)))
    assert metrics["filter_groups/filled_frac"] == 0.0
    own_rewards_equal = sum(map(solved, own)) / len(own)
    assert metrics["reward/zero_std_frac"] == pytest.approx(own_rewards_equal)  # the step's own queries


def test_filter_groups_at_the_limit_fills_up_with_dropped_groups_and_warns(tmp_path, cache_dir, capsys):
    trainer, seen = scripted_trainer(tmp_path, cache_dir, "fg-limit", lambda i: True, filter_groups=True,
                                     filter_groups_max_batches=3, steps=2)
    trainer.log = print
    trainer.train(plot=False)
    rows = read_metrics(trainer.cfg.run_dir)
    assert [r["filter_groups/batches"] for r in rows] == [3.0, 3.0]
    assert [r["filter_groups/filled_frac"] for r in rows] == [1.0, 1.0]
    own = step_indices(len(trainer.examples), 4, 1, trainer.cfg.seed)
    assert seen[0][0] == own and seen[0][1].eq(0).all()  # filled with the step's own groups first
    warned = [line for line in capsys.readouterr().out.splitlines() if "filter_groups found fewer" in line]
    assert len(warned) == 1 and "filter_groups_max_batches=3" in warned[0]  # once a run


def test_overlong_shaping_enters_the_advantages_and_is_logged(tmp_path, cache_dir):
    filler = (0, 0, 4, 7)  # responses 2 and 3 (4 or 5 tokens and these) reach the last 6 before max_new_tokens=12
    trainer, seen = scripted_trainer(tmp_path, cache_dir, "overlong", lambda i: i % 2 == 0, filler=filler,
                                     overlong_buffer=6, overlong_penalty=0.5)
    metrics = trainer.step(1)
    (idx, advantages), = seen
    responses = trainer.engine.generate([trainer.prompt_ids[i] for i in idx], 4, 1.0, 12).responses
    task = torch.tensor([[trainer.reward_fn(trainer.tokenizer.decode(r, skip_special_tokens=True),
                                            trainer.examples[i].answer) for r in group]
                         for i, group in zip(idx, responses)])
    ramp = torch.tensor([[min(-(len(r) - 6) / 6 * 0.5, 0.0) for r in group] for group in responses])
    assert (ramp < 0).any() and (ramp == 0).any() and task.eq(1).any()
    torch.testing.assert_close(advantages, group_advantages(task + ramp), rtol=0, atol=0)
    assert metrics["reward/overlong_frac"] == pytest.approx(float((ramp < 0).float().mean()))
    assert metrics["reward/overlong_penalty"] == pytest.approx(float(ramp.mean()))
    assert metrics["reward/mean"] == pytest.approx(float(task.mean()))  # the task's reward, unshaped


@pytest.mark.parametrize("algorithm", ["erpo", "grpo"])
def test_a_tiny_run_trains_with_filter_groups_and_overlong_shaping(tmp_path, cache_dir, algorithm):
    cfg = tiny(tmp_path, cache_dir, f"dapo-{algorithm}", algorithm=algorithm, steps=2, filter_groups=True,
               filter_groups_max_batches=2, overlong_buffer=2)
    summary = Trainer(cfg, log=quiet).train(plot=False)
    rows = read_metrics(cfg.run_dir)
    assert summary["steps"] == 2 and len(rows) == 2
    for row in rows:
        assert 1 <= row["filter_groups/batches"] <= 2 and 0 <= row["filter_groups/dropped_frac"] <= 1
        assert -1 <= row["reward/overlong_penalty"] <= 0 and all(v == v for v in row.values())
    assert os.path.isdir(os.path.join(cfg.run_dir, "checkpoints"))


# ---------------------------------------------------------------------- entropy bonus and top-entropy tokens

from types import SimpleNamespace  # noqa: E402

from erpo_kernels import (LossConfig, LossNormalizers, combine_metrics, entropy_threshold, erpo_loss,  # noqa: E402
                          erpo_loss_from_logp, metrics_to_floats, response_entropies, split_batch)
from test_micro_batches import PLANS  # noqa: E402
from test_objective import fl, make_point, objective_formula, token_loss_formula  # noqa: E402


def trl_high_entropy_mask(entropies, mask, top_entropy_quantile):
    """TRL 1.16's own GRPOTrainer.get_high_entropy_mask on [B, L] tensors, one process."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    one_process = SimpleNamespace(accelerator=SimpleNamespace(pad_across_processes=lambda t, dim, pad_index: t,
                                                              gather=lambda t: t))
    return GRPOTrainer.get_high_entropy_mask(one_process, entropies, mask, 1 - top_entropy_quantile)


def padded(desc, values):
    """Row-space values [N] -> ([B, L_max] per response token, [B, L_max] mask), the layout TRL reads."""
    width = max(len(rr) for _, _, rr in desc)
    out = torch.zeros(len(desc), width, dtype=values.dtype)
    mask = torch.zeros(len(desc), width)
    for i, (_, _, rr) in enumerate(desc):
        out[i, :len(rr)] = values[list(rr)]
        mask[i, :len(rr)] = 1
    return out, mask


def selected_rows(desc, entropy, rho):
    """The response rows TRL's mask keeps, by row index."""
    pad, mask = padded(desc, entropy)
    keep = trl_high_entropy_mask(pad, mask, rho)
    return {r for i, (_, _, rr) in enumerate(desc) for t, r in enumerate(rr) if keep[i, t]}


@pytest.mark.parametrize("rho", [0.0, 0.2, 0.5, 0.77, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_entropy_selection_is_trls_get_high_entropy_mask(rho, dtype):
    """TRL computes its quantile in fp32; ours is in the entropies' dtype: the same bits
    for fp32, and for fp64 entropies (here fp32-representable, so TRL's rounding cannot
    move its selection) the same tokens, the threshold torch.quantile's in fp64."""
    batch, desc, _, entropy = make_point()
    entropy = entropy.float().to(dtype)
    entropy[list(desc[1][2])[:2]] = float(entropy[desc[0][2][0]])  # ties at some value
    values = response_entropies(entropy, batch)  # +inf off the response rows
    threshold = entropy_threshold(values, rho)
    ours = {int(r) for r in torch.nonzero((entropy >= threshold) & torch.isfinite(values)).flatten()}
    theirs = selected_rows(desc, entropy, rho)
    assert ours == theirs and len(theirs) >= 1
    if rho == 0.0:
        assert len(theirs) == 1  # the largest entropy alone
    pad, mask = padded(desc, entropy)
    assert threshold.dtype == dtype and threshold == torch.quantile(pad[mask.bool()], 1 - rho)  # bit for bit
    assert torch.isinf(entropy_threshold(torch.full((5,), float("inf")), rho))  # no response token: none selected


def entropy_formula(logp, entropy, desc, batch, cfg):
    """The loss with entropy_coeff and top_entropy_quantile, by loops: the plain objective's
    (objective_formula, at entropy_coeff 0 and every token), its policy loss replaced by the
    one over TRL's selected tokens (the denominators unchanged), minus entropy_coeff times
    the selected tokens' entropy aggregated with loss_agg at w = 1."""
    plain = LossConfig(**{**cfg.__dict__, "entropy_coeff": 0.0, "top_entropy_quantile": 1.0})
    total, metrics = objective_formula(logp, desc, batch, plain, entropy.detach())
    keep = selected_rows(desc, entropy.detach(), cfg.top_entropy_quantile)
    m = batch.ref_query_logp.numel()
    w = batch.query_weights.tolist() if cfg.algorithm == "erpo" else [1.0] * m
    adv = batch.advantages.tolist()
    old = batch.old_logp if batch.old_logp is not None else logp.detach()
    n_total = sum(len(rr) for _, _, rr in desc)
    g_count = [sum(1 for qq, _, _ in desc if qq == q) for q in range(m)]
    pg_all = pg_kept = bonus = torch.zeros((), dtype=torch.float64)
    for i, (q, _, rr) in enumerate(desc):
        c = 1.0 / n_total if cfg.loss_agg == "token-mean" else (1.0 / (m * g_count[q] * len(rr)) if rr else 0.0)
        for r in rr:
            loss = token_loss_formula(logp[r], old[r], adv[i], cfg)[0]
            pg_all = pg_all + c * w[q] * loss
            if r in keep:
                pg_kept = pg_kept + c * w[q] * loss
                bonus = bonus + c * entropy[r]
    assert abs(fl(pg_all) - metrics["pg/loss"]) < 1e-12  # the same policy loss over every token
    total = total - pg_all + pg_kept - cfg.entropy_coeff * bonus
    return total, {"entropy/bonus": fl(bonus), "entropy/selected_frac": len(keep) / n_total, "loss": fl(total)}


ENTROPY_CASES = [("erpo", agg, rho, coeff) for agg in ("token-mean", "seq-mean-token-mean")
                 for rho, coeff in ((0.2, 0.05), (1.0, 0.3), (0.5, 0.0))]
ENTROPY_CASES += [("grpo", "token-mean", 0.2, 0.05), ("grpo", "seq-mean-token-mean", 0.35, 0.1)]


@pytest.mark.parametrize("algorithm,loss_agg,rho,coeff", ENTROPY_CASES)
def test_entropy_bonus_and_top_entropy_tokens_match_the_formula_float64(algorithm, loss_agg, rho, coeff):
    batch, desc, logp, entropy = make_point("softmax", with_ref_logp=True)  # non-unit query weights, a reference
    cfg = LossConfig(algorithm=algorithm, alpha=0.3, beta=0.05, loss_agg=loss_agg, entropy_coeff=coeff,
                     top_entropy_quantile=rho)
    x, h = logp.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    loss, metrics = erpo_loss_from_logp(x, batch, cfg, entropy=h, backend="torch")
    grad_x, grad_h = torch.autograd.grad(loss, (x, h), allow_unused=True)
    grad_h = torch.zeros_like(h) if grad_h is None else grad_h  # entropy_coeff 0: the entropy only selects
    y, e = logp.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    ref, ref_metrics = entropy_formula(y, e, desc, batch, cfg)
    ref_x, ref_h = torch.autograd.grad(ref, (y, e), allow_unused=True)
    ref_h = torch.zeros_like(e) if ref_h is None else ref_h

    assert abs(fl(loss) - fl(ref)) <= 1e-12 * (1 + abs(fl(ref)))
    assert torch.allclose(grad_x, ref_x, rtol=1e-11, atol=1e-13), (grad_x - ref_x).abs().max()
    assert torch.allclose(grad_h, ref_h, rtol=1e-11, atol=1e-13), (grad_h - ref_h).abs().max()
    assert grad_h.abs().sum() > 0 if coeff > 0 else grad_h.eq(0).all()
    assert abs(metrics["entropy/bonus"] - ref_metrics["entropy/bonus"]) <= 1e-12
    assert ("entropy/selected_frac" in metrics) == (rho < 1)
    if rho < 1:
        assert metrics["entropy/selected_frac"] == pytest.approx(ref_metrics["entropy/selected_frac"], abs=1e-15)
        assert 0 < metrics["entropy/selected_frac"] < 1


@pytest.mark.parametrize("plan_name", ["shuffled", "singletons"])
def test_micro_batches_with_the_mini_batchs_threshold_add_up_to_the_mini_batch(plan_name):
    batch, desc, logp, entropy = make_point("softmax", with_ref_logp=True)
    cfg = LossConfig(algorithm="erpo", alpha=0.3, loss_agg="seq-mean-token-mean", entropy_coeff=0.1,
                     top_entropy_quantile=0.3)
    x, h = logp.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    loss, metrics = erpo_loss_from_logp(x, batch, cfg, entropy=h, backend="torch")
    grads = torch.autograd.grad(loss, (x, h))

    micro = split_batch(batch, PLANS[plan_name])
    norm = LossNormalizers.of(batch)
    norm.entropy_threshold = entropy_threshold(torch.cat([response_entropies(entropy[mb.rows], mb.batch)
                                                          for mb in micro]), 0.3)
    y, e = logp.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    total, parts = torch.zeros((), dtype=torch.float64), []
    for mb in micro:
        part, part_metrics = erpo_loss_from_logp(y[mb.rows], mb.batch, cfg, entropy=e[mb.rows], backend="torch",
                                                 normalizers=norm)
        total, parts = total + part, parts + [part_metrics]
    micro_grads = torch.autograd.grad(total, (y, e))
    assert abs(fl(total) - fl(loss)) <= 1e-12 * (1 + abs(fl(loss)))
    for g, mg in zip(grads, micro_grads):
        assert torch.allclose(mg, g, rtol=1e-11, atol=1e-13)
    combined = metrics_to_floats(combine_metrics(parts))
    for key in ("entropy/bonus", "entropy/selected_frac", "pg/loss", "loss"):
        assert combined[key] == pytest.approx(metrics[key], rel=1e-11, abs=1e-13), key
    # each micro-batch's own quantile selects other tokens: the shared threshold matters
    own = sum(erpo_loss_from_logp(logp[mb.rows], mb.batch, cfg, entropy=entropy[mb.rows], backend="torch",
                                  normalizers=LossNormalizers.of(batch))[1]["entropy/selected_frac"] for mb in micro)
    assert abs(own - metrics["entropy/selected_frac"]) > 1e-3


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_entropy_bonus_differentiates_through_the_fused_kernel(backend):
    """erpo_loss(hidden, weight) with entropy_coeff: its gradient in hidden and weight is
    that of the float64 loss built from explicit logits (softmax entropy at each row's temperature)."""
    batch, desc, _, _ = make_point()
    n, d, v = batch.targets.shape[0], 8, 50
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64) * 0.5
    cfg = LossConfig(algorithm="grpo", beta=0.0, entropy_coeff=0.7, top_entropy_quantile=0.6)
    batch.old_logp = None
    dt = torch.float32 if backend == "triton" else torch.float64
    hx, wx = hidden.to(dt).requires_grad_(True), weight.to(dt).requires_grad_(True)
    loss, _ = erpo_loss(hx, wx, batch, cfg, backend=backend)
    grads = torch.autograd.grad(loss, (hx, wx))

    hy, wy = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logits = (hy @ wy.T) * batch.inv_temperature.float().double()[:, None]  # the op takes 1 / tau in fp32
    logprobs = torch.log_softmax(logits, dim=-1)
    ent = -(logprobs.exp() * logprobs).sum(-1)  # [N]
    target = batch.targets.clamp(min=0)
    lp = logprobs.gather(1, target[:, None])[:, 0]
    ref, _ = entropy_formula(lp, ent, desc, batch, cfg)
    ref_grads = torch.autograd.grad(ref, (hy, wy))
    tol = dict(rtol=1e-10, atol=1e-12) if dt == torch.float64 else dict(rtol=2e-4, atol=2e-6)
    assert abs(fl(loss) - fl(ref)) <= tol["rtol"] * 10 * (1 + abs(fl(ref)))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, **tol)


def test_a_loss_that_reads_the_entropy_refuses_a_call_without_it():
    batch, _, logp, _ = make_point()
    cfg = LossConfig(entropy_coeff=0.1)
    with pytest.raises(ValueError, match="the entropy is required for entropy_coeff=0.1"):
        erpo_loss_from_logp(logp, batch, cfg, backend="torch")
    with pytest.raises(ValueError, match="with_entropy=True"):
        erpo_loss(torch.zeros(batch.targets.shape[0], 4, dtype=torch.float64), torch.zeros(50, 4, dtype=torch.float64),
                  batch, LossConfig(top_entropy_quantile=0.5), with_entropy=False, backend="torch")


@pytest.mark.parametrize("kwargs, match", [
    (dict(entropy_coeff=-0.1), "entropy_coeff must be finite and >= 0"),
    (dict(entropy_coeff=float("nan")), "entropy_coeff must be finite and >= 0"),
    (dict(top_entropy_quantile=1.5), r"top_entropy_quantile must lie in \[0, 1\]"),
    (dict(top_entropy_quantile="0.2"), "top_entropy_quantile must be a number"),
])
def test_bad_entropy_settings_raise_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs)


def test_entropy_keys_in_erpo_train(capsys):
    _one_line_error(capsys, ["train", "entropy_coeff=-1"], "entropy_coeff must be finite and >= 0")
    _one_line_error(capsys, ["train", "top_entropy_quantile=2"], "top_entropy_quantile must lie in [0, 1]")
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "  entropy_coeff " in out and "  top_entropy_quantile " in out


@pytest.mark.parametrize("algorithm", ["erpo", "grpo"])
def test_micro_batches_give_the_top_entropy_update_of_one_pass(tmp_path, cache_dir, algorithm):
    """The trainer's no-grad entropy pass sets the mini-batch's threshold: split into
    micro-batches, the step's gradient is the one-pass gradient (float64)."""
    from test_trainer import _float64_gradient, fixed_trainer

    keys = dict(algorithm=algorithm, beta=0.05, max_grad_norm=0.0, entropy_coeff=0.05, top_entropy_quantile=0.3,
                loss_agg="seq-mean-token-mean")
    whole = fixed_trainer(tmp_path, cache_dir, f"ent-whole-{algorithm}", **keys)
    longest = max(len(p) for p in whole.prompt_ids) + whole.cfg.max_new_tokens
    split = fixed_trainer(tmp_path, cache_dir, f"ent-split-{algorithm}", micro_batch_tokens=longest + 3, **keys)
    (g_whole,), m_whole = _float64_gradient(whole)
    (g_split,), m_split = _float64_gradient(split)
    assert len(split.last_mini_batches[0].plan) > 2
    for a, b in zip(g_whole, g_split):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    for key in ("loss", "pg/loss", "entropy/bonus", "entropy/selected_frac"):
        assert m_split[key] == pytest.approx(m_whole[key], rel=1e-9, abs=1e-12), key
    assert 0 < m_whole["entropy/selected_frac"] < 0.5


@pytest.mark.parametrize("algorithm", ["erpo", "grpo"])
def test_a_tiny_run_trains_with_the_entropy_bonus_on_the_top_entropy_tokens(tmp_path, cache_dir, algorithm):
    cfg = tiny(tmp_path, cache_dir, f"ent-{algorithm}", algorithm=algorithm, steps=2, entropy_coeff=0.01,
               top_entropy_quantile=0.2)
    Trainer(cfg, log=quiet).train(plot=False)
    rows = read_metrics(cfg.run_dir)
    assert len(rows) == 2
    for row in rows:
        assert 0 < row["entropy/selected_frac"] <= 0.5 and row["entropy/bonus"] > 0
        assert row["entropy/bonus"] <= row["entropy/mean"]  # the selected tokens' share of the mean
        assert all(v == v for v in row.values())


def test_every_recipe_on_two_ranks(tmp_path):
    """`torchrun --nproc-per-node 2 -m erpo train` with every recipe on (gloo, FSDP2): the
    dynamic sampling's loop and the entropy threshold's pass keep the ranks in step
    (micro-batches whose number differs by rank), and the run logs each recipe's metrics;
    the policy loss is verl's bypass_mode with its weights and rejections (pi_old = the
    rollout's log-probs: no pi_old pass for the second mini-batch)."""
    import torch.distributed as dist

    from test_distributed import TINY, overrides, torchrun

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    keys = dict(TINY, steps=2, save_every=0, run_dir=tmp_path / "run", cache_dir=tmp_path / "cache",
                filter_groups="true", filter_groups_max_batches=3, overlong_buffer=2, entropy_coeff=0.01,
                top_entropy_quantile=0.2, policy_loss="bypass_mode", bypass_loss_type="reinforce",
                rollout_is="sequence", rollout_rs="seq_mean_k3,token_k1", rollout_rs_threshold="1.0,0.5_2.0")
    proc = torchrun(["-m", "erpo", "train", *overrides(**keys)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert 1 <= row["filter_groups/batches"] <= 3 and 0 < row["entropy/selected_frac"] <= 0.5
        assert "reward/overlong_penalty" in row and row["entropy/bonus"] > 0
        assert 0 <= row["mismatch/rejected_frac"] < 1 and row["mismatch/is_weight_mean"] > 0
        assert all(v == v for v in row.values())


def test_filter_groups_refills_with_the_vllm_engine_asleep_between_batches(tmp_path):
    """vLLM's engine (the fake, CUDA's protocol) drops its weights at sleep after each
    generate: every refill batch wakes it with the same weights first."""
    import _fake_vllm as fake
    from test_rollout import make_vllm_engine

    trainer = Trainer(tiny(tmp_path, tmp_path / "cache", steps=1, filter_groups=True, filter_groups_max_batches=3),
                      log=quiet)
    fake.LLM.hf_model = trainer.model
    try:
        trainer.engine = make_vllm_engine(max_model_len=64)
        trainer.train(plot=False)
        kinds = [c[0] for c in trainer.engine.llm.calls if c[0] != "load_weight"]
    finally:
        fake.LLM.hf_model = None
    batches = int(read_metrics(trainer.cfg.run_dir)[0]["filter_groups/batches"])
    assert batches > 1  # the tiny policy's groups are mostly all wrong: refills were needed
    refill = ["wake_up", "apply_model", "wake_up", "generate", "sleep"]
    assert kinds == ["generate", "sleep"] + refill * (batches - 1) + ["wake_up", "apply_model"]


def test_resume_with_every_recipe_is_bit_exact(tmp_path, cache_dir):
    """2 steps, resume, 1 step == 3 steps: the refill batches are drawn per step (seeded by
    seed and step), so a resumed run samples and trains on the same groups."""
    from erpo.cli import resolve_config

    keys = dict(filter_groups=True, filter_groups_max_batches=3, overlong_buffer=2, entropy_coeff=0.01,
                top_entropy_quantile=0.3, micro_batch_tokens=40)
    full = Trainer(tiny(tmp_path, cache_dir, "rec-full", steps=3, **keys), log=quiet)
    full.train(plot=False)
    first = Trainer(tiny(tmp_path, cache_dir, "rec-split", steps=2, **keys), log=quiet)
    first.train(plot=False)
    second = Trainer(resolve_config([f"resume={first.cfg.run_dir}", "steps=3"]), log=quiet)
    second.train(plot=False)
    a, b = read_metrics(full.cfg.run_dir), read_metrics(first.cfg.run_dir)
    assert any(r["filter_groups/batches"] > 1 for r in a)  # refills were drawn
    assert untimed(a) == untimed(b)
    for p, q in zip(full.model.parameters(), second.model.parameters()):
        assert torch.equal(p, q)


def test_the_entropy_terms_read_nothing_on_the_host():
    """The top-entropy threshold (a sort and a gather at the rank q (T - 1)) and the bonus
    add no host read: validate=False, sync_metrics=False reads nothing, forward and backward."""
    from test_objective_host_reads import count_host_reads

    batch, _, logp, entropy = make_point("softmax")
    x, h = logp.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    cfg = LossConfig(entropy_coeff=0.1, top_entropy_quantile=0.2)
    with count_host_reads() as counts:
        loss, metrics = erpo_loss_from_logp(x, batch, cfg, entropy=h, backend="torch", validate=False,
                                            sync_metrics=False)
        loss.backward()
    assert sum(counts.values()) == 0, dict(counts)
    assert "entropy/selected_frac" in metrics and h.grad.abs().sum() > 0


def test_the_entropy_terms_compile_fullgraph():
    """torch.compile(fullgraph=True) (aot_eager) traces the threshold, the selection and the
    bonus with no graph break and gives the eager loss, gradients and metrics."""
    from test_compile_objective import _compiled

    batch, _, logp, entropy = make_point("softmax")
    for f in ("inv_temperature", "advantages", "ref_query_logp", "query_weights", "old_logp"):
        setattr(batch, f, getattr(batch, f).float())
    cfg = LossConfig(algorithm="erpo", alpha=0.3, loss_agg="seq-mean-token-mean", entropy_coeff=0.2,
                     top_entropy_quantile=0.25)

    def fn(x, h):
        return erpo_loss_from_logp(x, batch, cfg, entropy=h, backend="torch", validate=False, sync_metrics=False)

    results = []
    for f in (fn, _compiled(fn)):
        x, h = logp.float().requires_grad_(True), entropy.float().requires_grad_(True)
        loss, metrics = f(x, h)
        results.append((loss.detach(), *torch.autograd.grad(loss, (x, h)), metrics))
    (l0, gx0, gh0, m0), (l1, gx1, gh1, m1) = results
    assert torch.allclose(l1, l0, rtol=1e-6, atol=1e-7)
    assert torch.allclose(gx1, gx0, rtol=1e-5, atol=1e-8) and torch.allclose(gh1, gh0, rtol=1e-5, atol=1e-8)
    assert m1.keys() == m0.keys() and "entropy/selected_frac" in m0
    for key in m0:
        assert torch.allclose(m1[key], m0[key], rtol=1e-5, atol=1e-7), key


@pytest.mark.parametrize("policy_loss", ["gspo", "cispo", "geo_mean"])
def test_the_issues_recipe_command_trains(tmp_path, cache_dir, policy_loss, capsys):
    """issue 27's `erpo train algorithm=erpo policy_loss=gspo loss_agg=seq-mean-token-mean
    entropy_coeff=0.01 top_entropy_quantile=0.2 filter_groups=true` (and cispo, geo_mean),
    on the embedded demo shrunk to 2 steps."""
    small = dict(tiny_hidden_size=32, tiny_layers=1, warmstart_steps=100, warmstart_batch_size=16,
                 warmstart_unboxed=0.0, task_max_operand=4, task_train_size=20, task_eval_size=5, group_size=4,
                 queries_per_step=4, max_new_tokens=6, steps=2, save_every=0, progress="false", lr=1e-3,
                 warmup_steps=1, run_dir=tmp_path / "run", cache_dir=cache_dir)
    recipe = ["algorithm=erpo", f"policy_loss={policy_loss}", "loss_agg=seq-mean-token-mean", "entropy_coeff=0.01",
              "top_entropy_quantile=0.2", "filter_groups=true"]
    assert main(["train", *recipe, *(f"{k}={v}" for k, v in small.items())]) == 0
    assert "erpo: erpo finished step 2/2" in capsys.readouterr().out
    for row in read_metrics(str(tmp_path / "run")):
        assert row["filter_groups/batches"] >= 1 and 0 < row["entropy/selected_frac"] <= 0.5
        assert all(v == v for v in row.values())


# ---------------------------------------------------------------------- issue 36's policy losses

# each with the keys it needs or exercises (bypass_mode: REINFORCE with sequence weights and
# a rejection, on the rollout's log-probs that hf generate returns)
PEER_LOSSES = {
    "dppo_tv": [], "dppo_kl": [], "dro": ["dro_beta=0.1"],
    "bypass_mode": ["bypass_loss_type=reinforce", "rollout_is=sequence", "rollout_rs=seq_mean_k3,token_k1",
                    "rollout_rs_threshold=1.0,0.5_2.0"],
    "luspo": ["loss_agg=seq-mean-token-sum"], "vespo": [],
}


@pytest.mark.parametrize("policy_loss", list(PEER_LOSSES))
def test_the_peer_losses_train_with_erpo_and_grpo(tmp_path, cache_dir, policy_loss, capsys, monkeypatch):
    """`erpo train policy_loss=NAME algorithm=erpo` trains 3 steps of the shrunk demo, each
    step 2 mini-batches (the second off-policy) in micro-batches; then 1 step of grpo for the
    three that read sequence statistics or the rollout's log-probs (the objective's grpo for
    all six: test_policy_losses.py; 2 ranks: bypass_mode in test_every_recipe_on_two_ranks)."""
    small = dict(tiny_hidden_size=32, tiny_layers=1, warmstart_steps=100, warmstart_batch_size=16,
                 warmstart_unboxed=0.0, task_max_operand=4, task_train_size=20, task_eval_size=5, group_size=4,
                 queries_per_step=4, max_new_tokens=6, save_every=0, progress="false", lr=1e-3, warmup_steps=1,
                 mini_batches=2, micro_batch_tokens=19, cache_dir=cache_dir)
    runs = [("erpo", 3)] + ([("grpo", 1)] if policy_loss in ("bypass_mode", "luspo", "vespo") else [])
    passes = []  # the trained model's no-grad pi_old passes (bypass_mode: none, the rollout's log-probs are pi_old)
    row_logp = Trainer._row_logp
    monkeypatch.setattr(Trainer, "_row_logp", lambda self, model, *a, **k: (
        passes.append(model is self.model), row_logp(self, model, *a, **k))[1])
    for algorithm, steps in runs:
        run = tmp_path / algorithm
        argv = ["train", f"algorithm={algorithm}", f"policy_loss={policy_loss}", *PEER_LOSSES[policy_loss],
                f"steps={steps}", f"run_dir={run}", *(f"{k}={v}" for k, v in small.items())]
        assert main(argv) == 0
        assert f"erpo: {algorithm} finished step {steps}/{steps}" in capsys.readouterr().out
        rows = read_metrics(str(run))
        assert [r["step"] for r in rows] == list(range(1, steps + 1))
        assert any(row["pg/loss"] != 0 for row in rows)  # some group had a signal
        for row in rows:
            assert all(v == v for v in row.values())
            if policy_loss == "bypass_mode":
                assert 0 <= row["mismatch/rejected_frac"] < 1 and row["mismatch/is_weight_mean"] > 0
    assert (sum(passes) == 0) == (policy_loss == "bypass_mode"), passes  # 2 mini-batches: a pass each otherwise
