"""The policy-loss registry (erpo_kernels.POLICY_LOSSES) and the four aggregations in the
main suite: LossConfig's checks, a new variant as one registered function, every variant
combined with ERPO's Query-KL and split into micro-batches, and the variants TRL 1.16 also
has against TRL's own GRPOTrainer._compute_loss (its model forward replaced by the same
log-probs; everything after it is TRL's code). Equality with verl 0.9.1 is
tests/verl_live/test_policy_losses.py."""
from __future__ import annotations

import collections
import dataclasses
import types

import pytest
import torch

from erpo_kernels import (LOSS_AGGS, POLICY_LOSSES, LossConfig, LossNormalizers, PackedLossBatch, TokenLoss,
                          erpo_loss_from_logp, plan_micro_batches, register_policy_loss, split_batch)

PROMPT_LENS = [4, 3, 5]  # per query
RESPONSE_LENS = [3, 5, 2, 4, 1, 6]  # two sequences per query
HORIZON = max(RESPONSE_LENS)


def padded(seed=0):
    """[B, T] log_prob (a leaf), old_log_prob, advantages [B], response mask."""
    g = torch.Generator().manual_seed(seed)
    b = len(RESPONSE_LENS)
    mask = torch.zeros(b, HORIZON, dtype=torch.float64)
    for i, n in enumerate(RESPONSE_LENS):
        mask[i, :n] = 1
    logp = (-2.0 + torch.randn(b, HORIZON, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = logp.detach() + 0.35 * torch.randn(b, HORIZON, generator=g, dtype=torch.float64)
    adv = 1.5 * torch.randn(b, generator=g, dtype=torch.float64)
    return logp, old, adv, mask


def packed(logp, old, adv, mask, weights=None):
    """The batch as erpo's packed rows: (logp rows [N], differentiable in logp, the batch)."""
    targets, spans, resp_rows, prompt_rows, r = [], [0], [], [], 0
    for i, n in enumerate(RESPONSE_LENS):
        prompt = PROMPT_LENS[i // 2] - 1
        targets += [3 if i % 2 == 0 else -100] * prompt + [5] * n + [-100]
        prompt_rows += list(range(r, r + prompt))
        resp_rows += list(range(r + prompt, r + prompt + n))
        r += prompt + n + 1
        spans += [spans[-1] + prompt, r]
    n_rows = len(targets)
    rows = torch.tensor(resp_rows)
    logp_rows = torch.zeros(n_rows, dtype=torch.float64).index_put((rows,), logp[mask.bool()])
    logp_rows = logp_rows + torch.zeros(n_rows, dtype=torch.float64).index_fill(0, torch.tensor(prompt_rows), -1.5)
    old_rows = torch.zeros(n_rows, dtype=torch.float64).index_put((rows,), old[mask.bool()])
    m = len(PROMPT_LENS)
    batch = PackedLossBatch(
        targets=torch.tensor(targets), inv_temperature=torch.ones(n_rows, dtype=torch.float64),
        span_cu_seqlens=torch.tensor(spans), group_index=torch.arange(len(RESPONSE_LENS)) // 2,
        advantages=adv.clone(), ref_query_logp=torch.tensor([-3.0, -2.5, -4.0], dtype=torch.float64),
        query_weights=torch.ones(m, dtype=torch.float64) if weights is None else weights, old_logp=old_rows,
    )
    return logp_rows, batch


def config(name="vanilla", agg="token-mean", **kw):
    scale = float(HORIZON) if agg == "seq-mean-token-sum-norm" else None
    base = dict(algorithm="grpo", beta=0.0, policy_loss=name, loss_agg=agg, loss_scale_factor=scale,
                clip_cov_ratio=0.1, clip_cov_lb=0.1, kl_cov_ratio=0.2, dro_beta=0.1)
    base.update(kw)
    return LossConfig(**base)


# ----------------------------------------------------------------------------- the registry


def test_registry_names_and_aggregations():
    assert list(POLICY_LOSSES) == ["vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo",
                                   "dppo_tv", "dppo_kl", "dro", "bypass_mode", "luspo", "vespo"]
    assert LOSS_AGGS == ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
    assert LossConfig().policy_loss == "vanilla" and LossConfig().loss_agg == "token-mean"


def test_the_registry_marks_the_batch_wide_losses():
    """clip_cov and kl_cov rank every token of the call (batch-wide: erpo_loss's 4-GEMM
    path); the others read a row's own sequence only; a new loss is chunk-local unless
    registered with batch_wide=True."""
    from erpo_kernels.objective.registry import is_batch_wide

    assert [n for n in POLICY_LOSSES if is_batch_wide(n)] == ["clip_cov", "kl_cov"]

    @register_policy_loss("test-wide", batch_wide=True)
    def wide(rows, old_logp, advantages, cfg):
        raise AssertionError("not called")

    try:
        assert is_batch_wide("test-wide") and not is_batch_wide("vanilla")
    finally:
        del POLICY_LOSSES["test-wide"]
        from erpo_kernels.objective.registry import BATCH_WIDE
        BATCH_WIDE.discard("test-wide")


@pytest.mark.parametrize("kw,message", [
    (dict(policy_loss="ppo"), r"^policy_loss must be one of \('vanilla', 'gspo'"),
    (dict(loss_agg="token-sum"), "^loss_agg must be one of"),
    (dict(loss_agg="seq-mean-token-sum-norm"), "^loss_scale_factor is required with loss_agg='seq-mean-token-sum-norm'"),
    (dict(loss_scale_factor=512.0), "^loss_scale_factor applies to loss_agg='seq-mean-token-sum-norm' only"),
    (dict(loss_agg="seq-mean-token-sum-norm", loss_scale_factor=0.0), "^loss_scale_factor must be finite and > 0"),
    (dict(tau_pos=0.0), "^tau_pos must be finite and > 0"),
    (dict(tau_neg="1"), "^tau_neg must be a number"),
    (dict(clip_cov_ratio=0.0), r"^clip_cov_ratio must lie in \(0, 1\]"),
    (dict(kl_cov_ratio=1.5), r"^kl_cov_ratio must lie in \(0, 1\]"),
    (dict(clip_cov_lb=5.0, clip_cov_ub=1.0), "^clip_cov_lb must be < clip_cov_ub"),
    (dict(ppo_kl_coef=-0.1), "^ppo_kl_coef must be finite and >= 0"),
    (dict(policy_loss="dro"), r"^dro_beta is required with policy_loss='dro'"),
    (dict(dro_beta=0.0), "^dro_beta must be finite and > 0"),
    (dict(bypass_loss_type="pg"), r"^bypass_loss_type must be one of \('ppo_clip', 'reinforce'\)"),
    (dict(policy_loss="bypass_mode", rollout_is="token"), "^rollout_is='token' does not apply with "
                                                          "policy_loss='bypass_mode' and bypass_loss_type='ppo_clip'"),
    (dict(rollout_rs="token_k4", rollout_rs_threshold=2.0), "^rollout_rs must be 'none' or comma-separated options"),
    (dict(rollout_rs="token_k1"), "^rollout_rs_threshold is required with rollout_rs='token_k1'"),
    (dict(rollout_rs_threshold=2.0), "^rollout_rs_threshold applies with rollout_rs only"),
    (dict(rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold="2,3,4"), "^rollout_rs_threshold needs one threshold"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="2_1"), "^rollout_rs_threshold for token_k1 must be 'lower_upper'"),
    (dict(rollout_rs="seq_sum_k3", rollout_rs_threshold="0.1_2"), "^rollout_rs_threshold for seq_sum_k3 must be one"),
    (dict(vespo_k_pos=-1.0), "^vespo_k_pos must be finite and >= 0"),
    (dict(vespo_lambda_neg=0.0), "^vespo_lambda_neg must be finite and > 0"),
])
def test_loss_config_checks_the_policy_loss(kw, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**kw)


def test_a_new_variant_is_one_registered_function():
    """A variant registered from outside is selected by name and used: here a plain
    REINFORCE term -A logp, which must equal gpg's."""

    @register_policy_loss("test-reinforce")
    def reinforce(rows, old_logp, advantages, cfg):
        none = torch.zeros_like(rows.response)
        return TokenLoss(-advantages * rows.logp, none, none, torch.ones_like(rows.logp))

    try:
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("test-reinforce")(reinforce)
        logp, old, adv, mask = padded()
        ours = erpo_loss_from_logp(*packed(logp, old, adv, mask), config("test-reinforce"))[0]
        gpg = erpo_loss_from_logp(*packed(logp, old, adv, mask), config("gpg"))[0]
        assert float(ours) == float(gpg) and float(gpg) != 0
    finally:
        del POLICY_LOSSES["test-reinforce"]


def test_the_docs_variant_example_runs():
    """docs/objective.md's new-variant block, run as written: it registers "reinforce",
    which equals gpg (both -A logp)."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "docs", "objective.md"), encoding="utf-8").read()
    (code,) = [b.split("```", 1)[0] for b in text.split("```py\n")[1:]]
    try:
        exec(compile(code, "docs/objective.md", "exec"), {})
        logp, old, adv, mask = padded()
        ours = erpo_loss_from_logp(*packed(logp, old, adv, mask), config("reinforce"))[0]
        gpg = erpo_loss_from_logp(*packed(logp, old, adv, mask), config("gpg"))[0]
        assert float(ours) == float(gpg) and float(gpg) != 0
    finally:
        POLICY_LOSSES.pop("reinforce", None)


def test_vanilla_is_the_default_bit_for_bit():
    logp, old, adv, mask = padded()
    for agg in ("token-mean", "seq-mean-token-mean"):
        a = erpo_loss_from_logp(*packed(logp, old, adv, mask), LossConfig(loss_agg=agg))
        b = erpo_loss_from_logp(*packed(logp, old, adv, mask), LossConfig(loss_agg=agg, policy_loss="vanilla"))
        assert a[1] == b[1]


# ----------------------------------------------------------------------------- combined with ERPO


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_every_variant_takes_the_query_kl_and_the_weights(name):
    """algorithm=erpo: loss = L_PG(w_B) + alpha R_query for every variant; the Query-KL's
    gradient is the same whatever the variant; with w = 1 and alpha = 0 it is grpo's L_PG;
    w scales each query's share of L_PG."""
    logp, old, adv, mask = padded()
    w = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
    alpha = 0.3

    def run(policy, algorithm, alpha, weights, agg="seq-mean-token-mean"):
        torch.manual_seed(0)
        loss, metrics = erpo_loss_from_logp(*packed(logp, old, adv, mask, weights),
                                            config(policy, agg, algorithm=algorithm, alpha=alpha))
        return loss, metrics, torch.autograd.grad(loss, logp)[0]

    loss, metrics, grad = run(name, "erpo", alpha, w)
    assert metrics["loss"] == pytest.approx(metrics["pg/loss"] + alpha * metrics["qkl/loss"], rel=1e-12)
    _, _, grad0 = run(name, "erpo", 0.0, w)
    qkl_grad = grad - grad0
    _, _, v_grad = run("vanilla", "erpo", alpha, w)
    _, _, v_grad0 = run("vanilla", "erpo", 0.0, w)
    torch.testing.assert_close(qkl_grad, v_grad - v_grad0, rtol=0, atol=1e-14)
    assert float(metrics["qkl/loss"]) > 0
    grpo = run(name, "grpo", 0.0, None)[0]
    erpo_uniform = run(name, "erpo", 0.0, None)[0]
    assert float(erpo_uniform) == pytest.approx(float(grpo), rel=1e-13)
    if name not in ("clip_cov", "kl_cov"):  # their selection depends on the batch, not per query
        per_query = [run(name, "erpo", 0.0, torch.eye(3, dtype=torch.float64)[q])[0] for q in range(3)]
        weighted = sum(float(w[q]) * float(per_query[q]) for q in range(3))  # L_PG is linear in w
        assert float(run(name, "erpo", 0.0, w)[0]) == pytest.approx(weighted, rel=1e-12)


@pytest.mark.parametrize("agg", LOSS_AGGS)
@pytest.mark.parametrize("name", [n for n in POLICY_LOSSES if n not in ("clip_cov", "kl_cov")])
def test_micro_batches_add_up(name, agg):
    """Micro-batches of whole sequences with the mini-batch's normalisers: their losses and
    gradients sum to the one-batch loss (clip_cov and kl_cov rank the tokens of each call,
    as verl's do per micro-batch, so they are left out)."""
    logp, old, adv, mask = padded(1)
    logp_rows, batch = packed(logp, old, adv, mask)
    cfg = config(name, agg, algorithm="erpo", alpha=0.2)
    whole, _ = erpo_loss_from_logp(logp_rows, batch, cfg)
    (g_whole,) = torch.autograd.grad(whole, logp)
    norm = LossNormalizers.of(batch)
    logp_rows, _ = packed(logp, old, adv, mask)  # a new graph for the parts
    total = 0.0
    for micro in split_batch(batch, plan_micro_batches(batch, 14)):
        total = total + erpo_loss_from_logp(logp_rows[micro.rows], micro.batch, cfg, normalizers=norm)[0]
    (g_parts,) = torch.autograd.grad(total, logp)
    assert len(plan_micro_batches(batch, 14)) > 2
    assert float(total) == pytest.approx(float(whole), rel=1e-12)
    torch.testing.assert_close(g_parts, g_whole, rtol=1e-12, atol=1e-15)


def with_rollout(batch, shift=0.2, seed=3):
    """The batch with rollout_logp = old_logp + noise on its response rows."""
    g = torch.Generator().manual_seed(seed)
    return dataclasses.replace(batch, rollout_logp=batch.old_logp + shift * torch.randn(
        batch.num_rows, generator=g, dtype=torch.float64))


# bypass_mode and the rollout corrections: the settings the tests below run
ROLLOUT_CASES = {
    "bypass-ppo_clip-rs": dict(policy_loss="bypass_mode", rollout_rs="seq_mean_k3,token_k1",
                               rollout_rs_threshold="0.05,0.7_1.4"),
    "bypass-reinforce-seq-is": dict(policy_loss="bypass_mode", bypass_loss_type="reinforce", rollout_is="sequence",
                                    rollout_rs="seq_max_k2", rollout_rs_threshold=0.1),
    "decoupled-vespo-token-is-rs": dict(policy_loss="vespo", rollout_is="token", rollout_rs="token_k3",
                                        rollout_rs_threshold=0.02),
}


@pytest.mark.parametrize("agg", ["seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("case", list(ROLLOUT_CASES))
def test_rollout_corrections_add_up_over_micro_batches(case, agg):
    """The importance weights and rejections (per token and per sequence; seq-mean-token-mean
    dividing by the kept tokens) are chunk-local: micro-batches of whole sequences with the
    mini-batch's normalisers add up, and the rejection drops some tokens, not all."""
    logp, old, adv, mask = padded(2)
    logp_rows, batch = packed(logp, old, adv, mask)
    batch = with_rollout(batch)
    cfg = config(agg=agg, algorithm="erpo", alpha=0.2, **ROLLOUT_CASES[case])
    whole, metrics = erpo_loss_from_logp(logp_rows, batch, cfg)
    (g_whole,) = torch.autograd.grad(whole, logp)
    assert 0 < metrics["mismatch/rejected_frac"] < 1
    norm = LossNormalizers.of(batch)
    logp_rows, _ = packed(logp, old, adv, mask)
    total = sum(erpo_loss_from_logp(logp_rows[m.rows], m.batch, cfg, normalizers=norm)[0]
                for m in split_batch(batch, plan_micro_batches(batch, 14)))
    (g_parts,) = torch.autograd.grad(total, logp)
    assert float(total) == pytest.approx(float(whole), rel=1e-12)
    torch.testing.assert_close(g_parts, g_whole, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_bypass_mode_is_vanilla_or_reinforce_on_the_rollouts_log_probs(agg):
    """bypass_mode reads the rollout's log-probs as pi_old: rollout_logp when given (old_logp
    is then ignored), else old_logp; ppo_clip is vanilla on them, reinforce without weights
    gpg; reinforce's token weight is min(pi_theta / pi_rollout, C), a constant."""
    logp, old, adv, mask = padded(3)

    def run(batch_of, **kw):
        logp_rows, batch = packed(logp, old, adv, mask)
        loss = erpo_loss_from_logp(logp_rows, batch_of(batch), config(agg=agg, **kw))[0]
        return float(loss), torch.autograd.grad(loss, logp)[0]

    as_rollout = lambda b: dataclasses.replace(b, rollout_logp=b.old_logp, old_logp=b.old_logp - 0.4)  # noqa: E731
    same = lambda b: b  # noqa: E731
    for a, b in [(run(as_rollout, policy_loss="bypass_mode"), run(same, policy_loss="vanilla")),
                 (run(same, policy_loss="bypass_mode"), run(same, policy_loss="vanilla")),
                 (run(as_rollout, policy_loss="bypass_mode", bypass_loss_type="reinforce"), run(same, policy_loss="gpg"))]:
        assert a[0] == pytest.approx(b[0], rel=1e-13)
        torch.testing.assert_close(a[1], b[1], rtol=1e-13, atol=1e-15)
    weighted = run(as_rollout, policy_loss="bypass_mode", bypass_loss_type="reinforce", rollout_is="token",
                   rollout_is_cap=1.2)
    w = torch.exp(logp.detach() - old).clamp(max=1.2)  # [B, T] pi_theta / pi_rollout, truncated
    expected = -(adv[:, None] * w * logp * mask)
    expected = expected.sum() / mask.sum() if agg == "token-mean" else \
        ((expected.sum(1) / mask.sum(1)).reshape(3, 2).mean(1)).mean()
    assert weighted[0] == pytest.approx(float(expected), rel=1e-12)
    torch.testing.assert_close(weighted[1], torch.autograd.grad(expected, logp)[0], rtol=1e-12, atol=1e-15)
    assert float(w.max()) == pytest.approx(1.2) and float(w.min()) < 1  # the truncation binds


# ----------------------------------------------------------------------------- TRL 1.16


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(loss_type, logp, old, adv, mask, *, level="token", eps_low=0.2, eps_high=0.28, tau=(1.0, 1.05),
             vespo=(2.0, 3.0, 3.0, 2.0)):
    """TRL 1.16's GRPOTrainer._compute_loss on the batch (beta = 0, one process, no
    accumulation), its per-token log-probs being `logp` (TRL's model forward is the stub)."""
    from trl import GRPOTrainer

    b, t = mask.shape
    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=0.0, loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high,
        args=types.SimpleNamespace(delta=None, sapo_temperature_pos=tau[0], sapo_temperature_neg=tau[1],
                                   use_bias_correction_kl=False, vespo_k_pos=vespo[0], vespo_lambda_pos=vespo[1],
                                   vespo_k_neg=vespo[2], vespo_lambda_neg=vespo[3]),
        use_vllm=False, vllm_importance_sampling_correction=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=t, accelerator=_Accelerator(),
        get_gamma_weights=GRPOTrainer.get_gamma_weights,  # TRL's own (a staticmethod)
        _entropy_bonus_enabled=False, _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
    )
    trainer.args.steps_per_generation = 1
    inputs = {
        "prompt_ids": torch.ones(b, 2, dtype=torch.long), "prompt_mask": torch.ones(b, 2, dtype=torch.long),
        "completion_ids": torch.ones(b, t, dtype=torch.long), "completion_mask": mask.long(),
        "advantages": adv, "old_per_token_logps": old, "num_items_in_batch": mask.sum(),
    }
    return GRPOTrainer._compute_loss(trainer, None, inputs)


# TRL loss_type (+ importance_sampling_level) -> our policy_loss, loss_agg and clip settings
TRL_SAME = {
    "grpo": dict(policy_loss="vanilla", loss_agg="seq-mean-token-mean"),
    "bnpo": dict(policy_loss="vanilla", loss_agg="token-mean"),
    "dr_grpo": dict(policy_loss="vanilla", loss_agg="seq-mean-token-sum-norm"),
    "dapo": dict(policy_loss="vanilla", loss_agg="token-mean"),
    # TRL builds its temperatures in float32 (torch.where of two floats): taus exact in float32
    "sapo": dict(policy_loss="sapo", loss_agg="seq-mean-token-mean", tau_neg=1.25, trl=dict(tau=(1.0, 1.25))),
    # TRL's cispo caps the ratio at epsilon_high with no lower bound: ours at 1 + eps_high, 1 - eps_low below every ratio
    "cispo": dict(policy_loss="cispo", loss_agg="token-mean", eps_low=0.95, trl=dict(eps_high=1.28)),
    # sequence-level importance sampling (GSPO): TRL's grpo with importance_sampling_level="sequence"
    "grpo-sequence": dict(policy_loss="gspo", loss_agg="seq-mean-token-mean", trl=dict(level="sequence")),
    # LUSPO: the sequence ratio's clip times the sequence's length, averaged over sequences (TRL's
    # mean over the batch = ours over queries of equal group sizes)
    "luspo": dict(policy_loss="luspo", loss_agg="seq-mean-token-sum", trl=dict(level="sequence")),
    # VESPO: TRL builds k and lambda in float32 (torch.where of two floats): constants exact in float32
    "vespo": dict(policy_loss="vespo", loss_agg="token-mean", vespo_k_pos=1.5, vespo_lambda_pos=2.5,
                  vespo_k_neg=3.0, vespo_lambda_neg=1.75, trl=dict(vespo=(1.5, 2.5, 3.0, 1.75))),
    "vespo-defaults": dict(policy_loss="vespo", loss_agg="token-mean"),
}


@pytest.mark.parametrize("case", list(TRL_SAME))
def test_same_loss_as_trl(case):
    """Loss and gradient equal TRL's (float64, relative 1e-10); the ratios (e^(+-0.35 sigma))
    make the clips bind but stay below vanilla's dual clip (3), which TRL does not have."""
    spec = dict(TRL_SAME[case])
    trl_kw = spec.pop("trl", {})
    logp, old, adv, mask = padded()
    scale = float(HORIZON) if spec["loss_agg"] == "seq-mean-token-sum-norm" else None
    cfg = LossConfig(algorithm="grpo", beta=0.0, eps_high=0.28, loss_scale_factor=scale, **spec)
    ours, metrics = erpo_loss_from_logp(*packed(logp, old, adv, mask), cfg)
    (g_ours,) = torch.autograd.grad(ours, logp)
    theirs = trl_loss(case.split("-")[0], logp, old, adv, mask, **trl_kw)
    (g_theirs,) = torch.autograd.grad(theirs, logp)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-10)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-10, atol=1e-13)
    assert float(g_theirs.abs().max()) > 1e-3
    if cfg.policy_loss in ("vanilla", "gspo", "cispo", "luspo"):
        assert 0 < metrics["pg/clipfrac"] < 1 and metrics["pg/dual_clipfrac"] == 0


# ----------------------------------------------------------------------------- erpo_loss's fused path

# issue 36's six are chunk-local (registered without batch_wide): on erpo_loss's 3-GEMM path
# (chunks of whole sequences) they equal the 4-GEMM composition, with the rollout corrections.
# Three cases (the interpreter is slow): a per-token mask (as dppo_tv's and dro's), the
# sequence-level weights and rejections of bypass_mode, vespo's sequence sum (luspo's
# sequence mean is gspo's, tests/test_fused_loss.py)
FUSED_CASES = {
    "dppo_kl": dict(policy_loss="dppo_kl", eps_low=1e-6, eps_high=1e-6, dual_clip=1.2),  # the rows' pi are small
    "bypass_mode": dict(policy_loss="bypass_mode", bypass_loss_type="reinforce", rollout_is="sequence",
                        rollout_rs="seq_mean_k3,token_k1", rollout_rs_threshold="0.05,0.8_1.25"),
    "vespo": dict(policy_loss="vespo", loss_agg="seq-mean-token-mean", rollout_is="token", rollout_rs="token_k3",
                  rollout_rs_threshold=0.02),
}


@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_the_peer_losses_on_the_fused_path(name, monkeypatch):
    from erpo_kernels.fused_linear_loss import LinearLogprobsChunks
    from erpo_kernels.objective.fused import fused_path_reason
    from test_fused_loss import ROW_BYTES, _assert_same, _batch, _operands, _run

    seen = []
    forward = LinearLogprobsChunks.forward
    monkeypatch.setattr(LinearLogprobsChunks, "forward", lambda self, r0, r1, *a: seen.append(r1 - r0) or
                        forward(self, r0, r1, *a))
    from erpo_kernels import linear_token_logprobs

    batch = _batch()
    operands = _operands(batch.num_rows)
    with torch.no_grad():  # pi_old and pi_rollout near the current policy (ratios of e^(+-0.3 sigma))
        current = linear_token_logprobs(operands[0], operands[1], batch.targets, bias=operands[2],
                                        inv_temperature=batch.inv_temperature, backend="torch")
    g = torch.Generator().manual_seed(4)
    old, rollout = (current + 0.3 * torch.randn(current.shape, generator=g) for _ in range(2))
    batch = dataclasses.replace(batch, old_logp=old, rollout_logp=rollout)
    cfg = LossConfig(algorithm="erpo", alpha=0.3, **FUSED_CASES[name])
    assert fused_path_reason(*operands, cfg, None, "triton", 12 * ROW_BYTES) is None
    ours = _run(cfg, batch, operands, fused_budget=12 * ROW_BYTES)
    assert len(seen) > 1  # several chunks
    ref = _run(cfg, batch, operands, fused_budget=0)
    _assert_same(ours, ref)
    if cfg.rollout_rs != "none":
        assert 0 < ref[1]["mismatch/rejected_frac"] < 1
    else:
        assert 0 < ref[1]["pg/clipfrac"] < 1 and ref[1]["pg/dual_clipfrac"] > 0  # the region and the truncation bind
