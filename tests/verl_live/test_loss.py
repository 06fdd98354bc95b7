"""loss_mode=erpo inside verl's actor loss, against verl's own vanilla loss and against
erpo_kernels.erpo_loss on the same batch, in float64."""
from __future__ import annotations

import pytest
import torch

from _setup import PROMPTS, RESPONSES, Rows, make_batch, packed_batch, to_engine

TAU = 0.7
D, V = 12, 64


def _actor_config(policy_loss, loss_agg_mode="token-mean"):
    from verl.workers.config import FSDPActorConfig

    return FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=len(PROMPTS), ppo_micro_batch_size_per_gpu=2,
                           use_dynamic_bsz=False, rollout_n=2, policy_loss=policy_loss, loss_agg_mode=loss_agg_mode,
                           clip_ratio_low=0.2, clip_ratio_high=0.28)


def _cache(tmp_path, ref_values):
    """A reference cache over the three distinct prompts (l_0 given, scores l_0 / n)."""
    from erpo.query_weights import query_scores
    from erpo.ref_cache import RefCache, query_id, save_ref_cache

    distinct = list(dict.fromkeys(tuple(p) for p in PROMPTS))
    n_tokens = torch.tensor([len(p) - 1 for p in distinct])
    ref = torch.tensor(ref_values, dtype=torch.float32)
    cache = RefCache(query_id=torch.tensor([query_id(list(p)) for p in distinct]), n_tokens=n_tokens,
                     ref_query_logp=ref, score=query_scores(ref, n_tokens), meta={"format": "erpo-ref-cache/1"})
    path = str(tmp_path / "ref_cache.safetensors")
    save_ref_cache(cache, path)
    return cache, path, distinct


def _hidden(rows, seed=0):
    """[N, D] float64 hidden states; the prompt rows of copies of one prompt are equal (as a
    causal LM's are), so every copy scores the same l_theta(q)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows.n, D, generator=g, dtype=torch.float64)
    first = {}
    for b, p in enumerate(PROMPTS):
        first.setdefault(tuple(p), b)
    for b, p in enumerate(PROMPTS):
        src, dst = int(rows.offsets[first[tuple(p)]]), int(rows.offsets[b])
        h[dst:dst + len(p)] = h[src:src + len(p)]
    return h


def _verl_data():
    from verl.utils import tensordict_utils as tu

    data = to_engine(make_batch(PROMPTS, RESPONSES, seed=3, old_shift=0.5), TAU)
    n_tokens = sum(len(r) for r in RESPONSES)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=n_tokens, erpo_prompt_rows_at_t1=True)
    return data


def _verl_logp(hidden, weight, rows):
    from erpo_kernels import linear_token_logprobs

    inv_t = torch.where(rows.prompt_row, 1.0, 1.0 / TAU).double()
    logp = linear_token_logprobs(hidden, weight, rows.verl_targets, inv_temperature=inv_t, backend="torch")
    return torch.nested.nested_tensor_from_jagged(logp, rows.offsets)


def _floats(metrics):
    """verl's metrics (Metric objects or numbers) as plain floats."""
    out = {}
    for k, v in metrics.items():
        values = v.values if hasattr(v, "values") and not isinstance(v, dict) else [v]
        out[k] = [float(x) for x in values]
    return out


def test_alpha_zero_without_weighting_is_verls_vanilla_loss():
    from verl.workers.config import PolicyLossConfig
    from verl.workers.utils import losses

    from erpo.integrations import verl as ev

    rows = Rows(_verl_data())
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64)
    for agg in ("token-mean", "seq-mean-token-mean"):
        out = {}
        for name, pl in (("vanilla", PolicyLossConfig(loss_mode="vanilla")),
                         ("erpo", ev.ERPOPolicyLossConfig(alpha=0.0, query_weighting="none"))):
            hidden = _hidden(rows).requires_grad_()
            loss, metrics = losses.ppo_loss(_actor_config(pl, agg), {"log_probs": _verl_logp(hidden, weight, rows)},
                                            _verl_data())
            loss.backward()
            out[name] = (loss.detach(), hidden.grad, _floats(metrics))
        assert torch.equal(out["erpo"][0], out["vanilla"][0])
        assert torch.equal(out["erpo"][1], out["vanilla"][1])
        assert out["erpo"][2] == out["vanilla"][2]
        assert out["vanilla"][1].abs().sum() > 0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_erpo_loss_and_gradients_equal_erpo_loss(tmp_path, agg):
    """loss_mode=erpo in verl's ppo_loss (weights on the token losses, alpha * R_query from the
    prompt rows and the cached l_0) = erpo_kernels.erpo_loss on the same packed batch."""
    _erpo_in_verl_equals_erpo_loss(tmp_path, agg, "vanilla")


# verl's geo_mean takes the geometric mean of the weights with 1e-10 inside its log: ~1e-9 relative
INNER_REL = {"geo_mean": 1e-8}


@pytest.mark.parametrize("inner", ["gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "dppo_tv",
                                   "dppo_kl", "dro", "bypass_mode", "luspo", "vespo"])
def test_erpo_with_any_inner_policy_loss_equals_erpo_loss(tmp_path, inner):
    """policy_loss.inner_loss_mode=NAME: ERPO's weights and Query-KL on verl's policy loss
    NAME = erpo_loss with policy_loss=NAME (seq-mean-token-mean, the aggregation verl's sapo
    and geo_mean use whatever loss_agg_mode says); luspo and vespo are ours in verl's
    registry (verl_policy_loss); bypass_mode takes old_log_probs as the rollout's, with verl's
    default rollout correction (PPO-clip: no weights) and none here."""
    _erpo_in_verl_equals_erpo_loss(tmp_path, "seq-mean-token-mean", inner, rel=INNER_REL.get(inner, 1e-12))


def _erpo_in_verl_equals_erpo_loss(tmp_path, agg, inner, rel=1e-12):
    from erpo_kernels import LossConfig, erpo_loss
    from verl.workers.utils import losses

    from erpo.integrations import verl as ev
    from erpo.query_weights import QueryWeighter

    cache, path, distinct = _cache(tmp_path, [-9.0, -5.5, -8.0])
    group = torch.tensor([distinct.index(tuple(p)) for p in PROMPTS])  # [B] query of each sequence
    weighter = QueryWeighter(cache.score.double(), scheme="softmax", temperature=0.5, w_min=0.1, w_max=10.0)
    w_q = weighter.batch_weights(cache.score.double())  # [m] float64, mean 1
    assert not torch.allclose(w_q, torch.ones_like(w_q))
    alpha = 0.3
    settings = ev.ERPOPolicyLossConfig(alpha=alpha, ref_cache=path, query_weighting="softmax", weight_temperature=0.5,
                                       kernel_backend="torch", inner_loss_mode=inner, dro_beta=0.1,
                                       vespo_k_pos=1.5, vespo_lambda_neg=2.5)
    data = _verl_data()
    ev.add_mini_batch_fields(data, settings)  # what the engine's train_batch does with a mini-batch
    torch.testing.assert_close(data["erpo_query_weights"], w_q[group], rtol=0, atol=0)
    rows = Rows(data)
    g = torch.Generator().manual_seed(2)
    weight0 = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.7

    # verl: the actor loss with loss_mode=erpo
    hidden = _hidden(rows).requires_grad_()
    weight = weight0.clone().requires_grad_()
    config = _actor_config(settings, agg)
    torch.manual_seed(5)  # clip_cov's draw
    loss_v, metrics = losses.ppo_loss(config, {"log_probs": _verl_logp(hidden, weight, rows)}, data)
    loss_v.backward()

    # erpo: erpo_loss on the packed batch (every copy scores its prompt, the last row of each sequence nothing)
    adv = make_batch(PROMPTS, RESPONSES, seed=3, old_shift=0.5)["advantages"][:, 0].double()
    batch = packed_batch(data, rows, TAU, adv, cache.ref_query_logp.double(), w_q, group, torch.float64)
    hidden_e = _hidden(rows).requires_grad_()
    weight_e = weight0.clone().requires_grad_()
    cfg = LossConfig(algorithm="erpo", alpha=alpha, loss_agg=agg, eps_low=0.2, eps_high=0.28, dual_clip=3.0,
                     policy_loss=inner, dro_beta=0.1, vespo_k_pos=1.5, vespo_lambda_neg=2.5)
    torch.manual_seed(5)
    loss_e, metrics_e = erpo_loss(hidden_e, weight_e, batch, cfg, backend="torch")
    loss_e.backward()

    assert metrics_e["qkl/loss"] > 1e-3  # both terms are live
    if inner in ("vanilla", "gspo", "cispo", "clip_cov", "kl_cov", "geo_mean", "bypass_mode", "luspo"):
        assert metrics_e["pg/clipfrac"] > 0  # and the clip (or the covariance selection)
    torch.testing.assert_close(loss_v.detach(), loss_e.detach(), rtol=rel, atol=rel)
    for ours, theirs in ((hidden.grad, hidden_e.grad), (weight.grad, weight_e.grad)):
        scale = float(theirs.abs().max())
        assert scale > 0
        print(f"max |grad difference| {float((ours - theirs).abs().max()):.3g} (largest gradient {scale:.3g})")
        assert float((ours - theirs).abs().max()) <= rel * scale  # float64 rounding
    assert _floats(metrics)["actor/erpo_query_kl"] == [pytest.approx(metrics_e["qkl/loss"], rel=1e-9)]


def test_loss_refuses_what_it_cannot_compute(tmp_path):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import PolicyLossConfig
    from verl.workers.utils import losses

    from erpo.integrations import verl as ev

    _, path, _ = _cache(tmp_path, [-9.0, -5.5, -8.0])
    data = _verl_data()
    rows = Rows(data)
    logp = {"log_probs": _verl_logp(_hidden(rows), torch.ones(V, D, dtype=torch.float64), rows)}
    # weighting on, but the batch has no weights (the engine's train_batch was not wrapped)
    with pytest.raises(ValueError, match="add_mini_batch_fields"):
        losses.ppo_loss(_actor_config(ev.ERPOPolicyLossConfig(alpha=0.1, ref_cache=path)), logp, data)
    # prompt rows scored at the rollout temperature (no erpo forward)
    ev.add_mini_batch_fields(data, ev.ERPOPolicyLossConfig(alpha=0.1, ref_cache=path, query_weighting="none"))
    tu.assign_non_tensor(data, erpo_prompt_rows_at_t1=False)
    with pytest.raises(ValueError, match="impl_backend=erpo"):
        losses.ppo_loss(_actor_config(ev.ERPOPolicyLossConfig(alpha=0.1, ref_cache=path, query_weighting="none")),
                        logp, data)
    # loss_mode=erpo with verl's own PolicyLossConfig: no ERPO keys
    with pytest.raises(ValueError, match="ERPOPolicyLossConfig"):
        losses.ppo_loss(_actor_config(PolicyLossConfig(loss_mode="erpo")), logp, data)
    # the registered policy loss outside erpo's actor loss
    x = torch.zeros(2, 3)
    with pytest.raises(RuntimeError, match="erpo_ppo_loss"):
        get_policy_loss_fn("erpo")(old_log_prob=x, log_prob=x, advantages=x, response_mask=x.bool())


def test_mini_batch_fields_sum_to_r_query_however_groups_are_split(tmp_path):
    """A mini-batch holding 2, 1 and 3 copies of three queries: each query's coefficients
    sum to w_B(q) / m, and the weights have mean 1 over the distinct queries."""
    from erpo.integrations import verl as ev
    from erpo.ref_cache import query_id

    cache, path, distinct = _cache(tmp_path, [-9.0, -5.5, -8.0])
    qids = [query_id(list(distinct[i])) for i in (0, 0, 1, 2, 2, 2)]
    settings = ev.ERPOPolicyLossConfig(alpha=0.1, ref_cache=path, query_weighting="prevalence", bins=2)
    fields = ev.query_fields(qids, cache, settings)
    w, coef, ref = fields[ev.WEIGHTS_KEY], fields[ev.COEF_KEY], fields[ev.REF_KEY]
    w_q = torch.stack([w[0], w[2], w[3]])
    assert float(w_q.mean()) == pytest.approx(1.0, abs=1e-12) and not torch.allclose(w_q, torch.ones(3).double())
    per_query = torch.stack([coef[:2].sum(), coef[2:3].sum(), coef[3:].sum()])
    torch.testing.assert_close(per_query, w_q / 3, rtol=1e-15, atol=0)
    torch.testing.assert_close(ref, cache.ref_query_logp.double()[[0, 0, 1, 2, 2, 2]])
