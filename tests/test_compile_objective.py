"""torch.compile(fullgraph=True) traces segment_sum, weighted_k3, the objective
(erpo_loss_from_logp) and erpo_loss on a tiny model's hidden states with no graph break
(fullgraph raises on one), on the Triton path (custom ops, run by the interpreter here)
and on the reference path, and gives the eager values and gradients.
"""
import pytest
import torch

from erpo_kernels import LossConfig, erpo_loss, erpo_loss_from_logp, segment_sum, weighted_k3
from test_objective import PROMPT_LENS, SEQS, _tiny_qwen, build, make_point


def _compiled(fn):
    torch._dynamo.reset()
    # aot_eager: dynamo capture plus AOT autograd over the fake implementations, without
    # generating code (what a graph break would interrupt)
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_segment_sum_and_weighted_k3_compile_fullgraph(backend):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(13, generator=g)
    cu = torch.tensor([0, 3, 3, 9, 13])
    ref = torch.randn(4, generator=g)
    w = torch.rand(4, generator=g) + 0.1

    def fn(v, wt):
        sums = segment_sum(v, cu, backend=backend)  # [4]; defaults: value checks skipped while compiling
        return weighted_k3(sums, ref, wt, guard=5.0, backend=backend) + (sums * sums).sum()

    grads = []
    for f in (fn, _compiled(fn)):
        v = values.clone().requires_grad_(True)
        wt = w.clone().requires_grad_(True)
        out = f(v, wt)
        grads.append((out.detach(), *torch.autograd.grad(out, (v, wt))))
    for eager, compiled in zip(*grads):
        assert torch.allclose(compiled, eager, rtol=1e-6, atol=1e-6)
    assert grads[0][1].abs().sum() > 0 and grads[0][2].abs().sum() > 0


@pytest.mark.parametrize("backend,algorithm", [("triton", "erpo"), ("torch", "grpo")])
def test_objective_compiles_fullgraph(backend, algorithm):
    batch, _, logp, entropy = make_point("softmax", with_ref_logp=True)
    batch.rollout_logp = batch.old_logp + 0.1
    fields = ("inv_temperature", "advantages", "ref_query_logp", "query_weights", "old_logp", "ref_logp",
              "rollout_logp")
    for f in fields:
        setattr(batch, f, getattr(batch, f).float())
    cfg = LossConfig(algorithm=algorithm, alpha=0.3, beta=0.1, loss_agg="seq-mean-token-mean", rollout_is="sequence")

    def fn(x):
        return erpo_loss_from_logp(x, batch, cfg, entropy=entropy.float(), backend=backend, validate=False,
                                   sync_metrics=False)

    results = []
    for f in (fn, _compiled(fn)):
        x = logp.float().requires_grad_(True)
        loss, metrics = f(x)
        (grad,) = torch.autograd.grad(loss, x)
        results.append((loss.detach(), grad, metrics))
    (l0, g0, m0), (l1, g1, m1) = results
    assert torch.allclose(l1, l0, rtol=1e-6, atol=1e-7)
    assert torch.allclose(g1, g0, rtol=1e-5, atol=1e-8)
    assert m1.keys() == m0.keys()
    for key in m0:
        assert torch.allclose(m1[key], m0[key], rtol=1e-5, atol=1e-7), key


@pytest.mark.parametrize("backend,loss_agg", [("triton", "seq-mean-token-mean"), ("torch", "token-mean")])
def test_erpo_loss_on_tiny_model_hidden_states_compiles_fullgraph(backend, loss_agg):
    """The whole loss path (linear_token_logprobs, segment_sum, weighted_k3, the policy
    loss, TIS) from a tiny Qwen2's final hidden states, gradients to hidden and lm_head."""
    model = _tiny_qwen().float()
    batch, _, seq_tokens = build(PROMPT_LENS, SEQS, dtype=torch.float32)
    n = batch.targets.numel()
    g = torch.Generator().manual_seed(2)
    batch.ref_query_logp = torch.tensor([-14.0, -20.0, -6.0])
    batch.query_weights = torch.tensor([1.5, 0.4, 1.1])
    batch.old_logp = -torch.rand(n, generator=g) * 3
    batch.ref_logp = batch.old_logp + torch.rand(n, generator=g) - 0.5
    batch.rollout_logp = batch.old_logp + (torch.rand(n, generator=g) - 0.5) * 0.2
    with torch.no_grad():
        hidden = torch.cat([model.model(input_ids=torch.tensor([t])).last_hidden_state[0] for t in seq_tokens])
    cfg = LossConfig(algorithm="erpo", alpha=0.3, loss_agg=loss_agg, rollout_is="token")
    batch.validate(vocab_size=model.lm_head.weight.shape[0])

    def fn(h, w):
        return erpo_loss(h, w, batch, cfg, backend=backend, validate=False, sync_metrics=False)

    results = []
    for f in (fn, _compiled(fn)):
        h = hidden.clone().requires_grad_(True)
        w = model.lm_head.weight.detach().clone().requires_grad_(True)
        loss, metrics = f(h, w)
        results.append((loss.detach(), *torch.autograd.grad(loss, (h, w)), metrics))
    (l0, gh0, gw0, m0), (l1, gh1, gw1, m1) = results
    assert torch.allclose(l1, l0, rtol=1e-6, atol=1e-7)
    # the ops' gradients are eager's bit for bit (the entropy metric's zero gradient adds an exact 0)
    assert torch.equal(gh1, gh0) and gh0.abs().sum() > 0
    assert torch.equal(gw1, gw0) and gw0.abs().sum() > 0
    for key in m0:
        assert torch.allclose(m1[key], m0[key], rtol=1e-5, atol=1e-7), key


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_erpo_loss_with_default_arguments_compiles_fullgraph(backend):
    """erpo_loss(hidden, weight, batch, config) with every default (validate=None,
    sync_metrics=True): while compiling nothing is read back (no check, metrics stay
    0-d tensors), so there is no graph break; values equal the eager call's floats."""
    batch, _, _, _ = make_point("softmax", with_ref_logp=True)
    for f in ("inv_temperature", "advantages", "ref_query_logp", "query_weights", "old_logp", "ref_logp"):
        setattr(batch, f, getattr(batch, f).float())
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(batch.targets.numel(), 8, generator=g)
    weight = torch.randn(50, 8, generator=g)
    cfg = LossConfig(algorithm="erpo", alpha=0.3)

    def fn(h, w):
        return erpo_loss(h, w, batch, cfg, backend=backend)

    eager_loss, eager_metrics = fn(hidden, weight)
    loss, metrics = _compiled(fn)(hidden, weight)
    assert all(isinstance(v, float) for v in eager_metrics.values())
    assert all(isinstance(v, torch.Tensor) for v in metrics.values())
    assert torch.allclose(loss, eager_loss, rtol=1e-6, atol=1e-7)
    for key, value in eager_metrics.items():
        assert float(metrics[key]) == pytest.approx(value, rel=1e-5, abs=1e-7), key
