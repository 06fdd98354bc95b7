"""Every registered policy loss (erpo_kernels.POLICY_LOSSES) under every aggregation
against verl 0.9.1's own function of the same name (get_policy_loss_fn), loss and
gradient, in float64, on one packed batch: three queries of two sequences each,
responses of 1 to 6 tokens, ratios spread enough that the clips bind.

verl fixes two aggregations itself: sapo always aggregates seq-mean-token-mean and
geo_mean averages its per-sequence losses. For the other modes those two are compared
with verl's function inside verl's own agg_loss at that mode (sapo: agg_loss's mode
replaced; geo_mean: verl's loss of each sequence alone, aggregated by agg_loss)."""
from __future__ import annotations

import pytest
import torch

from erpo_kernels import LOSS_AGGS, POLICY_LOSSES, LossConfig, PackedLossBatch, erpo_loss_from_logp

PROMPT_LENS = [4, 3, 5]  # per query
RESPONSE_LENS = [3, 5, 2, 4, 1, 6]  # two sequences per query
HORIZON = max(RESPONSE_LENS)
PARAMS = dict(eps_low=0.2, eps_high=0.28, dual_clip=3.0, tau_pos=1.0, tau_neg=1.05,
              clip_cov_ratio=0.1, clip_cov_lb=0.1, clip_cov_ub=5.0, kl_cov_ratio=0.2, ppo_kl_coef=0.1)
REL = 1e-7


def _padded(seed=0):
    """verl's [B, T] tensors: log_prob (a leaf), old_log_prob, advantages, response_mask."""
    g = torch.Generator().manual_seed(seed)
    b = len(RESPONSE_LENS)
    mask = torch.zeros(b, HORIZON, dtype=torch.float64)
    for i, n in enumerate(RESPONSE_LENS):
        mask[i, :n] = 1
    logp = (-2.0 + torch.randn(b, HORIZON, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = logp.detach() + 0.35 * torch.randn(b, HORIZON, generator=g, dtype=torch.float64)
    adv = 1.5 * torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, HORIZON).contiguous()
    return logp, old, adv, mask


def _packed(logp, old, adv, mask):
    """The same batch as erpo's packed rows: (logp rows [N] differentiable in logp, batch)."""
    targets, spans, resp_rows, r = [], [0], [], 0
    for i, n in enumerate(RESPONSE_LENS):
        q = i // 2
        prompt = PROMPT_LENS[q] - 1
        targets += [3 if i % 2 == 0 else -100] * prompt + [5] * n + [-100]
        resp_rows += list(range(r + prompt, r + prompt + n))
        r += prompt + n + 1
        spans += [spans[-1] + prompt, r]
    n_rows = len(targets)
    rows = torch.tensor(resp_rows)
    sel = mask.bool()
    logp_rows = torch.full((n_rows,), -1.0, dtype=torch.float64).index_put((rows,), logp[sel])
    old_rows = torch.zeros(n_rows, dtype=torch.float64).index_put((rows,), old[sel])
    batch = PackedLossBatch(
        targets=torch.tensor(targets), inv_temperature=torch.ones(n_rows, dtype=torch.float64),
        span_cu_seqlens=torch.tensor(spans), group_index=torch.arange(len(RESPONSE_LENS)) // 2,
        advantages=adv[:, 0].clone(), ref_query_logp=torch.tensor([-3.0, -2.5, -4.0], dtype=torch.float64),
        query_weights=torch.ones(len(PROMPT_LENS), dtype=torch.float64), old_logp=old_rows,
    )
    return logp_rows, batch


def _verl_config(name, agg):
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    policy = PolicyLossConfig(loss_mode=name, clip_cov_ratio=PARAMS["clip_cov_ratio"], clip_cov_lb=PARAMS["clip_cov_lb"],
                              clip_cov_ub=PARAMS["clip_cov_ub"], kl_cov_ratio=PARAMS["kl_cov_ratio"],
                              ppo_kl_coef=PARAMS["ppo_kl_coef"])
    return FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=len(RESPONSE_LENS),
                           ppo_micro_batch_size_per_gpu=len(RESPONSE_LENS), use_dynamic_bsz=False, rollout_n=2,
                           clip_ratio_low=PARAMS["eps_low"], clip_ratio_high=PARAMS["eps_high"],
                           clip_ratio_c=PARAMS["dual_clip"], tau_pos=PARAMS["tau_pos"], tau_neg=PARAMS["tau_neg"],
                           loss_agg_mode=agg, policy_loss=policy)


def _verl_loss(name, agg, logp, old, adv, mask, monkeypatch):
    """verl's loss of `name` at `agg` (module docstring for sapo and geo_mean)."""
    from verl.trainer.ppo import core_algos

    fn = core_algos.get_policy_loss_fn(name)
    config = _verl_config(name, agg)
    if name == "geo_mean" and agg != "seq-mean-token-mean":
        per_seq = torch.stack([fn(old_log_prob=old[i:i + 1], log_prob=logp[i:i + 1], advantages=adv[i:i + 1],
                                  response_mask=mask[i:i + 1], loss_agg_mode=agg, config=config)[0]
                               for i in range(len(RESPONSE_LENS))])  # [B], each sequence's own loss
        return core_algos.agg_loss(per_seq[:, None].expand_as(mask), mask, agg)
    if name == "sapo" and agg != "seq-mean-token-mean":
        original = core_algos.agg_loss
        monkeypatch.setattr(core_algos, "agg_loss", lambda loss_mat, loss_mask, loss_agg_mode, **kw:
                            original(loss_mat, loss_mask, agg, **kw))
    loss, _ = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask, loss_agg_mode=agg, config=config)
    monkeypatch.undo()
    return loss


def _ours(name, agg, logp, old, adv, mask):
    logp_rows, batch = _packed(logp, old, adv, mask)
    scale = float(HORIZON) if agg == "seq-mean-token-sum-norm" else None  # verl's default: the padded length
    cfg = LossConfig(algorithm="grpo", beta=0.0, policy_loss=name, loss_agg=agg, loss_scale_factor=scale, **PARAMS)
    return erpo_loss_from_logp(logp_rows, batch, cfg, backend="torch")


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _compare(name, agg, monkeypatch, seed=7):
    """(our loss, verl's, our gradient, verl's, our metrics) on the batch, clip_cov drawing
    with the same seed on both sides."""
    logp, old, adv, mask = _padded()
    torch.manual_seed(seed)  # clip_cov's random subset: the same draw for both
    ours, metrics = _ours(name, agg, logp, old, adv, mask)
    (grad_ours,) = torch.autograd.grad(ours, logp)
    torch.manual_seed(seed)
    theirs = _verl_loss(name, agg, logp, old, adv, mask, monkeypatch)
    (grad_theirs,) = torch.autograd.grad(theirs, logp)
    return ours.detach(), theirs.detach(), grad_ours, grad_theirs, metrics


@pytest.mark.parametrize("agg", LOSS_AGGS)
@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_policy_loss_equals_verls(name, agg, monkeypatch):
    ours, theirs, grad_ours, grad_theirs, metrics = _compare(name, agg, monkeypatch)
    assert float(ours) == pytest.approx(float(theirs), rel=REL)
    assert _rel(grad_ours, grad_theirs) <= REL, _rel(grad_ours, grad_theirs)
    assert float(grad_theirs.abs().max()) > 1e-3  # a gradient that could differ
    if name in ("vanilla", "gspo", "clip_cov", "kl_cov", "geo_mean", "cispo"):
        assert 0 < metrics["pg/clipfrac"] < 1  # the clip (or selection) binds on some tokens, not all


def test_clip_cov_draws_the_same_subset_as_verl(monkeypatch):
    """Seeds whose draws differ (test_the_clips_and_draws_are_exercised): equal to verl at each."""
    losses = []
    for seed in (7, 10):
        ours, theirs, grad_ours, grad_theirs, _ = _compare("clip_cov", "token-mean", monkeypatch, seed)
        assert float(ours) == pytest.approx(float(theirs), rel=REL) and _rel(grad_ours, grad_theirs) <= REL
        losses.append(float(ours))
    assert losses[0] != losses[1]


def test_the_clips_and_draws_are_exercised():
    """The batch makes every clip and selection act: clip_cov zeroes several tokens, and a
    different seed draws a different subset (so the seeded equality above is a real check)."""
    logp, old, adv, mask = _padded()
    drawn = []
    for seed in (7, 8, 9, 10):
        torch.manual_seed(seed)
        ours, metrics = _ours("clip_cov", "token-mean", logp, old, adv, mask)
        drawn.append(float(ours.detach()))
        assert metrics["pg/clipfrac"] > 0
    assert len(set(drawn)) > 1


def test_report_measured(capsys, monkeypatch):
    """The largest relative differences (loss, gradient) of every variant and aggregation,
    printed as a table (pytest -s shows it), all within REL."""
    rows = []
    for name in POLICY_LOSSES:
        for agg in LOSS_AGGS:
            ours, theirs, grad_ours, grad_theirs, _ = _compare(name, agg, monkeypatch)
            rows.append((name, agg, _rel(ours, theirs), _rel(grad_ours, grad_theirs)))
    with capsys.disabled():
        for name, agg, loss_rel, grad_rel in rows:
            print(f"\n{name:9s} {agg:24s} loss {loss_rel:.1e} grad {grad_rel:.1e}", end="")
    assert max(max(r[2], r[3]) for r in rows) <= REL
