"""Every registered policy loss that verl 0.9.1 also registers (erpo_kernels.POLICY_LOSSES
but TRL's luspo and vespo) under every aggregation against verl's own function of the same
name (get_policy_loss_fn), loss and gradient, in float64, on one packed batch: three
queries of two sequences each, responses of 1 to 6 tokens, ratios spread enough that the
clips bind. bypass_mode is compared under its rollout-correction settings (loss type,
importance weights, rejection) with verl's training-time denominators (global_batch_info:
the mini-batch's tokens and sequences, before rejection).

verl fixes two aggregations itself: sapo always aggregates seq-mean-token-mean and
geo_mean averages its per-sequence losses. For the other modes those two are compared
with verl's function inside verl's own agg_loss at that mode (sapo: agg_loss's mode
replaced; geo_mean: verl's loss of each sequence alone, aggregated by agg_loss)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from erpo_kernels import LOSS_AGGS, POLICY_LOSSES, LossConfig, PackedLossBatch, erpo_loss_from_logp

PROMPT_LENS = [4, 3, 5]  # per query
RESPONSE_LENS = [3, 5, 2, 4, 1, 6]  # two sequences per query
HORIZON = max(RESPONSE_LENS)
PARAMS = dict(eps_low=0.2, eps_high=0.28, dual_clip=3.0, tau_pos=1.0, tau_neg=1.05,
              clip_cov_ratio=0.1, clip_cov_lb=0.1, clip_cov_ub=5.0, kl_cov_ratio=0.2, ppo_kl_coef=0.1, dro_beta=0.1)
# DPPO's thresholds are on pi - pi_old (TV) or the binary KL: at pi ~ e^-2 these bind on some
# tokens; a truncation of 1.5 binds on some ratios
DPPO = dict(eps_low=0.02, eps_high=0.03, dual_clip=1.5)
OVERRIDES = {"dppo_tv": DPPO, "dppo_kl": dict(DPPO, eps_low=0.004, eps_high=0.006)}
REL = 1e-7
VERL_LOSSES = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro",
               "cispo", "bypass_mode")  # verl 0.9.1's registry, in its order
# bypass_mode's rollout corrections (ours; verl's rollout_correction takes the same names, with
# rollout_is_cap as rollout_is_threshold); the rejections make some tokens and sequences drop
BYPASS = {
    "ppo_clip": dict(bypass_loss_type="ppo_clip"),
    "reinforce": dict(bypass_loss_type="reinforce"),
    "reinforce-token-is": dict(bypass_loss_type="reinforce", rollout_is="token", rollout_is_cap=1.3),
    "reinforce-seq-is": dict(bypass_loss_type="reinforce", rollout_is="sequence", rollout_is_cap=1.5),
    "reinforce-token-rs": dict(bypass_loss_type="reinforce", rollout_is="token", rollout_is_cap=1.3,
                               rollout_rs="token_k1,token_k3", rollout_rs_threshold="0.7_1.4,0.05"),
    "ppo_clip-seq-rs": dict(bypass_loss_type="ppo_clip", rollout_rs="seq_mean_k3,seq_max_k2,seq_sum_k1",
                            rollout_rs_threshold="0.08,0.3,0.4_3.0"),
}


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


def _params(name):
    return dict(PARAMS, **OVERRIDES.get(name, {}))


def _verl_config(name, agg, bypass=None):
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    correction = RolloutCorrectionConfig()
    if bypass is not None:
        is_level = bypass.get("rollout_is", "none")
        rs = bypass.get("rollout_rs", "none")
        correction = RolloutCorrectionConfig(
            bypass_mode=True, loss_type=bypass["bypass_loss_type"], rollout_is=None if is_level == "none" else is_level,
            rollout_is_threshold=bypass.get("rollout_is_cap", 2.0), rollout_rs=None if rs == "none" else rs,
            rollout_rs_threshold=bypass.get("rollout_rs_threshold"))
    params = _params(name)
    policy = PolicyLossConfig(loss_mode=name, clip_cov_ratio=params["clip_cov_ratio"], clip_cov_lb=params["clip_cov_lb"],
                              clip_cov_ub=params["clip_cov_ub"], kl_cov_ratio=params["kl_cov_ratio"],
                              ppo_kl_coef=params["ppo_kl_coef"], dro_beta=params["dro_beta"],
                              rollout_correction=correction)
    return FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=len(RESPONSE_LENS),
                           ppo_micro_batch_size_per_gpu=len(RESPONSE_LENS), use_dynamic_bsz=False, rollout_n=2,
                           clip_ratio_low=params["eps_low"], clip_ratio_high=params["eps_high"],
                           clip_ratio_c=params["dual_clip"], tau_pos=params["tau_pos"], tau_neg=params["tau_neg"],
                           loss_agg_mode=agg, policy_loss=policy)


def _verl_loss(name, agg, logp, old, adv, mask, monkeypatch, bypass=None):
    """verl's loss of `name` at `agg` (module docstring for sapo, geo_mean and bypass_mode:
    bypass's old_log_prob is the rollout's)."""
    from verl.trainer.ppo import core_algos

    fn = core_algos.get_policy_loss_fn(name)
    config = _verl_config(name, agg, bypass)
    if bypass is not None:  # verl's training-time denominators (workers/utils/losses.py): the mini-batch's
        config.global_batch_info.update(dp_size=1, batch_num_tokens=mask.sum(), global_batch_size=mask.shape[0],
                                        loss_scale_factor=None)
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


def _ours(name, agg, logp, old, adv, mask, bypass=None):
    """Our loss; bypass_mode: `old` is the rollout's log-probs (batch.rollout_logp), and
    batch.old_logp something else, which bypass_mode must ignore."""
    logp_rows, batch = _packed(logp, old, adv, mask)
    if bypass is not None:
        batch = dataclasses.replace(batch, rollout_logp=batch.old_logp, old_logp=batch.old_logp + 0.5)
    scale = float(HORIZON) if agg == "seq-mean-token-sum-norm" else None  # verl's default: the padded length
    cfg = LossConfig(algorithm="grpo", beta=0.0, policy_loss=name, loss_agg=agg, loss_scale_factor=scale,
                     **_params(name), **(bypass or {}))
    return erpo_loss_from_logp(logp_rows, batch, cfg, backend="torch")


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _compare(name, agg, monkeypatch, seed=7, bypass=None):
    """(our loss, verl's, our gradient, verl's, our metrics) on the batch, clip_cov drawing
    with the same seed on both sides."""
    logp, old, adv, mask = _padded()
    torch.manual_seed(seed)  # clip_cov's random subset: the same draw for both
    ours, metrics = _ours(name, agg, logp, old, adv, mask, bypass)
    (grad_ours,) = torch.autograd.grad(ours, logp)
    torch.manual_seed(seed)
    theirs = _verl_loss(name, agg, logp, old, adv, mask, monkeypatch, bypass)
    (grad_theirs,) = torch.autograd.grad(theirs, logp)
    return ours.detach(), theirs.detach(), grad_ours, grad_theirs, metrics


def test_verl_registers_the_same_losses():
    from verl.trainer.ppo import core_algos

    from erpo.integrations.verl import ERPO_ONLY_LOSSES

    ours = ("erpo",) + ERPO_ONLY_LOSSES  # what our plugin registers
    assert tuple(n for n in core_algos.POLICY_LOSS_REGISTRY if n not in ours) == VERL_LOSSES
    assert set(VERL_LOSSES) <= set(POLICY_LOSSES)


@pytest.mark.parametrize("agg", LOSS_AGGS)
@pytest.mark.parametrize("name", [n for n in VERL_LOSSES if n != "bypass_mode"])
def test_policy_loss_equals_verls(name, agg, monkeypatch):
    ours, theirs, grad_ours, grad_theirs, metrics = _compare(name, agg, monkeypatch)
    assert float(ours) == pytest.approx(float(theirs), rel=REL)
    assert _rel(grad_ours, grad_theirs) <= REL, _rel(grad_ours, grad_theirs)
    assert float(grad_theirs.abs().max()) > 1e-3  # a gradient that could differ
    if name in ("vanilla", "gspo", "clip_cov", "kl_cov", "geo_mean", "cispo", "dppo_tv", "dppo_kl"):
        assert 0 < metrics["pg/clipfrac"] < 1  # the clip (or selection) binds on some tokens, not all


@pytest.mark.parametrize("agg", LOSS_AGGS)
@pytest.mark.parametrize("case", list(BYPASS))
def test_bypass_mode_equals_verls(case, agg, monkeypatch):
    ours, theirs, grad_ours, grad_theirs, metrics = _compare("bypass_mode", agg, monkeypatch, bypass=BYPASS[case])
    assert float(ours) == pytest.approx(float(theirs), rel=REL)
    assert _rel(grad_ours, grad_theirs) <= REL, _rel(grad_ours, grad_theirs)
    assert float(grad_theirs.abs().max()) > 1e-3
    if BYPASS[case].get("rollout_rs", "none") != "none":
        assert 0 < metrics["mismatch/rejected_frac"] < 1  # the rejection acts on some tokens, not all
    if "is" in case:
        assert metrics["mismatch/is_weight_mean"] < 1.3  # the truncation binds
    if case == "ppo_clip":
        assert 0 < metrics["pg/clipfrac"] < 1


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
    cases = [(n, n, None) for n in VERL_LOSSES if n != "bypass_mode"]
    cases += [(f"bypass_mode[{c}]", "bypass_mode", BYPASS[c]) for c in BYPASS]
    for label, name, bypass in cases:
        for agg in LOSS_AGGS:
            ours, theirs, grad_ours, grad_theirs, _ = _compare(name, agg, monkeypatch, bypass=bypass)
            rows.append((label, agg, _rel(ours, theirs), _rel(grad_ours, grad_theirs)))
    with capsys.disabled():
        for name, agg, loss_rel, grad_rel in rows:
            print(f"\n{name:32s} {agg:24s} loss {loss_rel:.1e} grad {grad_rel:.1e}", end="")
    assert max(max(r[2], r[3]) for r in rows) <= REL
