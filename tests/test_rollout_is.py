"""Truncated importance sampling against the rollout engine (LossConfig.rollout_is,
rollout_is_cap, PackedLossBatch.rollout_logp) and the mismatch metrics, against float64
loops written here."""
import math

import pytest
import torch

from erpo_kernels import LossConfig, erpo_loss_from_logp
from test_objective import fl, make_point, token_loss_formula

# log(pi_old / pi_rollout) offsets: inside the band, outside it both ways, above log C
# (truncated), a huge one (exp overflows fp32 without the clamp).
ROLL_OFFSETS = [0.02, -0.3, 0.5, 0.9, -0.05, 0.15, 60.0, -1.2, 0.08]


def _point():
    batch, desc, logp, entropy = make_point("softmax")
    n = logp.shape[0]
    offs = torch.tensor([ROLL_OFFSETS[i % len(ROLL_OFFSETS)] for i in range(n)], dtype=torch.float64)
    batch.rollout_logp = batch.old_logp - offs
    resp = torch.zeros(n, dtype=torch.bool)
    for _, _, rr in desc:
        resp[rr] = True
    batch.rollout_logp[~resp] = float("nan")  # read on the scored response rows only
    return batch, desc, logp


def is_pg_formula(logp, desc, batch, cfg):
    """L_PG with each token's loss times its truncated importance weight, plus the mismatch
    metrics, from loops over queries, responses and tokens."""
    m = batch.num_queries
    w = batch.query_weights.tolist() if cfg.algorithm == "erpo" else [1.0] * m
    adv = batch.advantages.tolist()
    old, roll = batch.old_logp, batch.rollout_logp
    cap = cfg.rollout_is_cap
    n_total = sum(len(rr) for _, _, rr in desc)
    g_count = [sum(1 for q, _, _ in desc if q == qq) for qq in range(m)]
    pg = torch.zeros((), dtype=torch.float64)
    diffs, outside, weights, ratios = [], 0, [], []
    for i, (q, _, rr) in enumerate(desc):
        seq_log = sum(float(old[r] - roll[r]) for r in rr)
        for r in rr:
            log_w = float(old[r] - roll[r])
            if cfg.rollout_is == "token":
                iw = min(math.exp(min(log_w, 700.0)), cap)
            elif cfg.rollout_is == "sequence":
                iw = min(math.exp(min(seq_log, 700.0)), cap)
            else:
                iw = 1.0
            weights.append(iw)
            diffs.append(abs(float(roll[r] - old[r])))
            ratio = math.exp(min(log_w, 700.0))
            outside += not (0.9 <= ratio <= 1.1)
            ratios.append(ratio)
            loss, _, _ = token_loss_formula(logp[r], old[r], adv[i], cfg)
            if cfg.loss_agg == "token-mean":
                pg = pg + w[q] * iw * loss / n_total
            else:
                pg = pg + w[q] * iw * loss / (m * g_count[q] * len(rr))
    metrics = {
        "mismatch/logp_diff_mean": sum(diffs) / n_total,
        "mismatch/logp_diff_max": max(diffs),
        "mismatch/ratio_out_frac": outside / n_total,
        "mismatch/ratio_mean": sum(ratios) / n_total,
        "mismatch/ratio_sq_mean": sum(r * r for r in ratios) / n_total,
        "mismatch/is_weight_mean": sum(weights) / n_total,
    }
    return pg, metrics


@pytest.mark.parametrize("rollout_is", ["none", "token", "sequence"])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("algorithm", ["erpo", "grpo"])
def test_truncated_is_matches_formula(algorithm, loss_agg, rollout_is):
    batch, desc, logp = _point()
    cfg = LossConfig(algorithm=algorithm, alpha=0.0, beta=0.0, loss_agg=loss_agg, rollout_is=rollout_is,
                     rollout_is_cap=1.8)
    x = logp.clone().requires_grad_(True)
    loss, metrics = erpo_loss_from_logp(x, batch, cfg, backend="torch")
    (grad,) = torch.autograd.grad(loss, x)
    y = logp.clone().requires_grad_(True)
    ref, ref_metrics = is_pg_formula(y, desc, batch, cfg)
    (ref_grad,) = torch.autograd.grad(ref, y)
    assert abs(fl(loss) - fl(ref)) <= 1e-12 * (1 + abs(fl(ref)))
    assert torch.allclose(grad, ref_grad, rtol=1e-11, atol=1e-13), (grad - ref_grad).abs().max()
    for key, value in ref_metrics.items():  # reported whenever rollout_logp is given
        assert abs(metrics[key] - value) <= 1e-12 * (1 + abs(value)), (key, metrics[key], value)
    if rollout_is == "none":
        assert metrics["mismatch/is_weight_mean"] == 1.0
        plain, _ = erpo_loss_from_logp(logp, batch.__class__(**{**batch.__dict__, "rollout_logp": None}), cfg,
                                       backend="torch")
        assert fl(plain) == fl(loss)
    else:  # the weights are truncated somewhere and below 1 elsewhere: they change the loss
        assert 0 < ref_metrics["mismatch/is_weight_mean"] != 1.0
    assert 0 < ref_metrics["mismatch/ratio_out_frac"] < 1


def test_rollout_is_needs_rollout_logp_and_a_valid_cap():
    batch, _, logp = _point()
    batch.rollout_logp = None
    with pytest.raises(ValueError, match="rollout_logp"):
        erpo_loss_from_logp(logp, batch, LossConfig(rollout_is="token"), backend="torch")
    _, metrics = erpo_loss_from_logp(logp, batch, LossConfig(), backend="torch")
    assert not any(k.startswith("mismatch/") for k in metrics)
    for kwargs in ({"rollout_is": "seq"}, {"rollout_is_cap": 0.0}, {"rollout_is_cap": float("inf")}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            LossConfig(**kwargs)
    batch, desc, logp = _point()
    batch.rollout_logp[desc[1][2][0]] = float("nan")  # a scored response row
    with pytest.raises(ValueError, match="rollout_logp"):
        erpo_loss_from_logp(logp, batch, LossConfig(rollout_is="token"), backend="torch")
