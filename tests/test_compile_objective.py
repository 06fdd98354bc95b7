"""torch.compile(fullgraph=True) traces segment_sum, weighted_k3 and the objective with
no graph break (fullgraph raises on one), on the Triton path (custom ops, run by the
interpreter here) and on the reference path, and gives the eager values and gradients.
"""
import pytest
import torch

from erpo_kernels import LossConfig, erpo_loss_from_logp, segment_sum, weighted_k3
from test_objective import make_point


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
        sums = segment_sum(v, cu, backend=backend, validate=False)  # [4]
        return weighted_k3(sums, ref, wt, guard=5.0, backend=backend, validate=False) + (sums * sums).sum()

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
