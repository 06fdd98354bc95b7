"""torch.compile (issue 13.1): token_logprobs and linear_token_logprobs are torch.library
custom ops under compile (a shape-only fake for each, autograd registered, Triton or
the reference behind the same op), so `torch.compile(fullgraph=True)` of a function
calling them traces with no graph break and gives the eager values and gradients,
bit for bit. fullgraph=True fails on any graph break. The `aot_eager` backend runs
dynamo and AOT autograd (the fakes, the registered backward) without spending a
C++ compile per case on this 2-core machine. Ops are called with their defaults
(validate=True): value checks read tensors on the host, which a graph cannot do, so
they are skipped while compiling (issue 19.4; validate where the batch is built).
"""
from __future__ import annotations

import pytest
import torch

from erpo_kernels import linear_token_logprobs, token_logprobs


def _compare(fn, leaves):
    eager = [t.clone().requires_grad_() for t in leaves]
    compiled = [t.clone().requires_grad_() for t in leaves]
    out_e = fn(*eager)
    out_e.backward()
    torch._dynamo.reset()
    out_c = torch.compile(fn, fullgraph=True, backend="aot_eager")(*compiled)
    out_c.backward()
    assert torch.equal(out_e, out_c)
    for a, b in zip(eager, compiled):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_token_logprobs_compiles_without_graph_break(device, backend, softcap):
    targets = torch.tensor([1, -100, 3, 36, 0], device=device)
    inv_t = torch.tensor([1.0, 1.0, 0.8, 0.8, 1.2], device=device)

    def loss(z):
        logp, ent = token_logprobs(
            z * 1.5, targets, inv_temperature=inv_t, return_entropy=True, softcap=softcap, backend=backend,
        )
        return (logp * torch.arange(5, device=device)).sum() + ent.sum()

    _compare(loss, [torch.randn(5, 37, device=device)])


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_token_logprobs_compiles_without_graph_break(device, backend, with_bias):
    targets = torch.tensor([1, -100, 3, 52, 0, -100, 9], device=device)

    def loss(h, w, *b):
        logp, ent = linear_token_logprobs(
            torch.tanh(h), w, targets, bias=b[0] if b else None, inv_temperature=0.8, return_entropy=True,
            logit_scale=0.5, backend=backend,
        )
        return (logp * 2).sum() + ent.sum()

    leaves = [torch.randn(7, 16, device=device), torch.randn(53, 16, device=device) * 0.5]
    if with_bias:
        leaves.append(torch.randn(53, device=device))
    _compare(loss, leaves)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_an_entropy_returned_beside_a_loss_of_the_logp_alone_keeps_the_eager_gradient(device, backend):
    """The trainer's pattern (issue 29.6): the entropy is an output (a metric) and only the
    log-prob feeds the loss. Compiled, AOT autograd hands the op a zero gradient for the
    entropy where eager hands it none; the op's gradient is the eager one bit for bit."""
    targets = torch.tensor([1, -100, 3, 36, 0, 7, 2, 9, 11, 30, 5], device=device)
    weights = torch.rand(11, device=device)

    def token(z):
        logp, ent = token_logprobs(z, targets, inv_temperature=0.9, return_entropy=True, backend=backend,
                                   validate=False)
        return (logp * weights).sum(), ent.detach().mean(), ent

    def linear(h, w):
        logp, ent = linear_token_logprobs(h, w, targets, return_entropy=True, backend=backend, validate=False)
        return (logp * weights).sum(), ent

    cases = [(token, [3 * torch.randn(11, 37, device=device)]),
             (linear, [torch.randn(11, 16, device=device), 0.5 * torch.randn(37, 16, device=device)])]
    for fn, leaves in cases:
        grads = []
        for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
            torch._dynamo.reset()
            inputs = [t.clone().requires_grad_() for t in leaves]
            outputs = f(*inputs)
            outputs[0].backward()
            grads.append([outputs[0].detach(), outputs[-1].detach()] + [t.grad for t in inputs])
        for eager, compiled in zip(*grads):
            assert torch.equal(eager, compiled), (fn.__name__, (eager - compiled).abs().max())


def test_token_logprobs_has_one_autograd_path():
    """Eager and compile run the same custom op: the module defines no autograd.Function
    (a second path that could drift), and an eager call dispatches to the op."""
    import importlib

    tlp = importlib.import_module("erpo_kernels.token_logprobs")
    functions = [k for k, v in vars(tlp).items() if isinstance(v, type) and issubclass(v, torch.autograd.Function)]
    assert functions == []
    logp = token_logprobs(torch.randn(3, 9, requires_grad=True), torch.tensor([1, 2, 3]), backend="torch")
    assert "erpo_kernels_token_logprobs_default" in logp.grad_fn.name()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_token_logprobs_inplace_backward_compiles(device, backend):
    targets = torch.tensor([1, -100, 3, 36, 0], device=device)

    def loss(z):
        logp, ent = token_logprobs(
            z * 1.5, targets, inv_temperature=0.9, return_entropy=True, inplace_backward=True, backend=backend,
            validate=False,
        )
        return (logp * torch.arange(5, device=device)).sum() + ent.sum()

    _compare(loss, [torch.randn(5, 37, device=device)])
