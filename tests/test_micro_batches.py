"""Micro-batches of a mini-batch (erpo_kernels: LossNormalizers, split_batch,
combine_metrics): k micro-batches with the mini-batch's normalisers give the one-batch
loss, gradients and metrics, for both algorithms and both aggregations, with groups
split across micro-batches and a query's scoring prompt copy away from its other copies.
"""
from dataclasses import replace

import pytest
import torch

from erpo_kernels import (
    LossConfig,
    LossNormalizers,
    erpo_loss,
    erpo_loss_from_logp,
    combine_metrics,
    metrics_to_floats,
    plan_micro_batches,
    split_batch,
)
from test_objective import IGN, PROMPT_LENS, SEQS, _tiny_qwen, build, fl, make_point

# Sequences 0, 2, 5 answer query 0 (0 scores its prompt), 1, 4 query 1, 3, 6, 7 query 2.
PLANS = {
    "contiguous": [[0, 1, 2], [3, 4], [5, 6, 7]],  # every group spans two micro-batches
    # reordered: query 0's copies 5 and 2 sit apart from its scoring copy 0; query 2's
    # scoring copy 3 with 7, its copy 6 elsewhere; a micro-batch without any scoring copy
    "shuffled": [[5, 1], [7, 0, 3], [2, 4, 6]],
    "singletons": [[b] for b in range(len(SEQS))],
}
CASES = [(alg, agg) for alg in ("erpo", "grpo") for agg in ("token-mean", "seq-mean-token-mean")]


def _config(algorithm, loss_agg, rollout_is="none"):
    return LossConfig(algorithm=algorithm, alpha=0.3, beta=0.2, loss_agg=loss_agg, rollout_is=rollout_is,
                      rollout_is_cap=1.5)


def _point(rollout=True):
    batch, desc, logp, entropy = make_point("softmax", with_ref_logp=True)  # non-unit query weights
    if rollout:
        g = torch.Generator().manual_seed(7)
        batch.rollout_logp = batch.old_logp + (torch.rand(logp.shape[0], generator=g, dtype=torch.float64) - 0.5) * 0.6
    return batch, desc, logp, entropy


def _assert_metrics_equal(parts, whole, tol=1e-10):
    combined = metrics_to_floats(combine_metrics(parts))
    assert combined.keys() == whole.keys()
    for key, value in whole.items():
        assert abs(combined[key] - value) <= tol * (1 + abs(value)), (key, combined[key], value)


@pytest.mark.parametrize("plan_name", sorted(PLANS))
@pytest.mark.parametrize("algorithm,loss_agg", CASES)
def test_micro_batches_equal_one_batch_from_logp(algorithm, loss_agg, plan_name):
    batch, desc, logp, entropy = _point()
    cfg = _config(algorithm, loss_agg, rollout_is="token")
    x = logp.clone().requires_grad_(True)
    loss, metrics = erpo_loss_from_logp(x, batch, cfg, entropy=entropy, backend="torch")
    (grad,) = torch.autograd.grad(loss, x)

    norm = LossNormalizers.of(batch)
    micro = split_batch(batch, PLANS[plan_name])
    y = logp.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    parts = []
    for mb in micro:
        assert mb.batch.num_queries == batch.num_queries  # the mini-batch's query indexing
        part_loss, part_metrics = erpo_loss_from_logp(
            y[mb.rows], mb.batch, cfg, entropy=entropy[mb.rows], backend="torch", normalizers=norm,
        )
        total = total + part_loss
        parts.append(part_metrics)
    (grad_micro,) = torch.autograd.grad(total, y)
    assert abs(fl(total) - fl(loss)) <= 1e-10 * (1 + abs(fl(loss)))
    assert torch.allclose(grad_micro, grad, rtol=1e-10, atol=1e-12), (grad_micro - grad).abs().max()
    _assert_metrics_equal(parts, metrics)
    # the shared normalisers matter: each micro-batch normalised by itself sums to another loss
    own = sum(fl(erpo_loss_from_logp(logp[mb.rows], mb.batch, cfg, backend="torch",
                                     normalizers=LossNormalizers.of(mb.batch))[0]) for mb in micro)
    assert abs(own - fl(loss)) > 1e-4 * (1 + abs(fl(loss)))


def _model_loss_and_grads(model, seq_tokens, pieces, cfg, norm):
    """Sum of erpo_loss over (batch, sequences) pieces, each forwarded on its own; grads accumulated."""
    model.zero_grad(set_to_none=True)
    total, parts = 0.0, []
    for b, seqs in pieces:
        hidden = torch.cat([model.model(input_ids=torch.tensor([seq_tokens[s]])).last_hidden_state[0] for s in seqs])
        loss, metrics = erpo_loss(hidden, model.lm_head.weight, b, cfg, backend="torch", normalizers=norm,
                                  sync_metrics=False)
        loss.backward()
        total += fl(loss)
        parts.append(metrics)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return total, metrics_to_floats(combine_metrics(parts)), grads


@pytest.mark.parametrize("algorithm,loss_agg", CASES)
def test_micro_batches_equal_one_batch_real_model(algorithm, loss_agg):
    """float64 tiny Qwen2: gradients of every parameter, accumulated over micro-batches."""
    model = _tiny_qwen()
    batch, desc, seq_tokens = build(PROMPT_LENS, SEQS)
    _, _, logp, _ = make_point("softmax")
    n = batch.targets.numel()
    g = torch.Generator().manual_seed(5)
    batch.advantages = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.8, -0.3, 1.0, -1.1], dtype=torch.float64)
    batch.ref_query_logp = torch.tensor([-14.0, -20.0, -6.0], dtype=torch.float64)
    batch.query_weights = torch.tensor([1.5, 0.4, 1.1], dtype=torch.float64)
    # old/ref/rollout log-probs near the model's own (so clipping and the KL are realistic)
    with torch.no_grad():
        hidden = torch.cat([model.model(input_ids=torch.tensor([t])).last_hidden_state[0] for t in seq_tokens])
        logits = model.lm_head(hidden) * batch.inv_temperature[:, None]
        cur = torch.log_softmax(logits, -1).gather(1, batch.targets.clamp(min=0)[:, None]).squeeze(1)
    batch.old_logp = cur + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 0.8
    batch.ref_logp = cur + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5)
    batch.rollout_logp = batch.old_logp + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 0.4
    cfg = _config(algorithm, loss_agg, rollout_is="sequence")
    norm = LossNormalizers.of(batch)

    one_loss, one_metrics, one_grads = _model_loss_and_grads(
        model, seq_tokens, [(batch, list(range(len(SEQS))))], cfg, None)
    for plan in (PLANS["contiguous"], PLANS["shuffled"]):
        micro = split_batch(batch, plan)
        loss, metrics, grads = _model_loss_and_grads(
            model, seq_tokens, [(mb.batch, mb.sequences) for mb in micro], cfg, norm)
        assert abs(loss - one_loss) <= 1e-10 * (1 + abs(one_loss))
        assert grads.keys() == one_grads.keys() and len(grads) == len(list(model.parameters()))
        for name, g1 in one_grads.items():
            err = fl((grads[name] - g1).abs().max())
            assert err <= 1e-10 * (1 + fl(g1.abs().max())), (name, err)
        _assert_metrics_equal([metrics], one_metrics)
    assert one_metrics["pg/clipfrac"] > 0 and one_metrics["qkl/value"] > 0 and one_metrics["policy_kl"] > 0


def test_plan_micro_batches_greedy_budget():
    batch, _, _ = build(PROMPT_LENS, SEQS)
    cu = batch.span_cu_seqlens.tolist()
    lengths = [cu[2 * b + 2] - cu[2 * b] for b in range(len(SEQS))]
    budget = 12
    plan = plan_micro_batches(batch, budget)
    assert [b for part in plan for b in part] == list(range(len(SEQS)))
    assert all(sum(lengths[b] for b in part) <= budget for part in plan)
    # greedy: the next sequence would not have fitted in the previous micro-batch
    for prev, nxt in zip(plan, plan[1:]):
        assert sum(lengths[b] for b in prev) + lengths[nxt[0]] > budget
    assert plan_micro_batches(batch, 0) == [list(range(len(SEQS)))]
    with pytest.raises(ValueError, match="max_rows"):
        plan_micro_batches(batch, max(lengths) - 1)
    # rows of the split are the sequences' own rows, in order
    micro = split_batch(batch, plan)
    assert torch.equal(torch.cat([mb.rows for mb in micro]), torch.arange(batch.targets.numel()))
    for mb in micro:
        assert torch.equal(mb.batch.targets, batch.targets[mb.rows])
        mb.batch.validate(normalizers=LossNormalizers.of(batch))


def test_split_batch_bad_plan():
    batch, _, _ = build(PROMPT_LENS, SEQS)
    for plan in ([[0, 1], [2, 3, 4, 5, 6]], [[0, 1, 1], [2, 3, 4, 5, 6, 7]], [[], list(range(8))]):
        with pytest.raises(ValueError, match="plan"):
            split_batch(batch, plan)


def test_whole_batch_must_cover_every_query_but_micro_batch_need_not():
    batch, _, logp, _ = _point(rollout=False)
    micro = split_batch(batch, [[0, 1, 2, 4], [3, 5, 6, 7]])[0]  # no sequence of query 2
    with pytest.raises(ValueError, match="every query"):
        erpo_loss_from_logp(logp[micro.rows], micro.batch, backend="torch")
    loss, _ = erpo_loss_from_logp(logp[micro.rows], micro.batch, backend="torch",
                                  normalizers=LossNormalizers.of(batch))
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="normalizers.group_sizes"):
        bad = replace(LossNormalizers.of(batch), group_sizes=torch.ones(2, dtype=torch.long))
        erpo_loss_from_logp(logp[micro.rows], micro.batch, backend="torch", normalizers=bad)


@pytest.mark.parametrize("form", ["bitmask", "threshold"])
def test_split_batch_carries_the_support_and_validate_checks_it(form):
    """PackedLossBatch.support is a row field: split_batch gathers it with the rows; its
    structure (an int32 bitmask [N, W] or a float threshold [N]) and a NaN threshold are
    ValueErrors naming it."""
    batch, _, _ = build(PROMPT_LENS, SEQS)
    n = batch.num_rows
    g = torch.Generator().manual_seed(0)
    if form == "bitmask":
        batch.support = torch.randint(-2**31, 2**31 - 1, (n, 3), generator=g, dtype=torch.int32)
    else:
        batch.support = torch.where(torch.rand(n, generator=g) < 0.5, -torch.inf, torch.randn(n, generator=g))
    batch.validate()
    for mb in split_batch(batch, PLANS["shuffled"]):
        assert torch.equal(mb.batch.support, batch.support[mb.rows])
    for bad in (batch.support[:-1], batch.support.to(torch.int64), batch.support[:, None] if form == "threshold"
                else batch.support.float()):
        with pytest.raises(ValueError, match="support"):
            replace(batch, support=bad).validate()
    if form == "threshold":
        with pytest.raises(ValueError, match="support's thresholds must not be NaN"):
            replace(batch, support=torch.full((n,), torch.nan)).validate()
