"""Every op under autocast (issue 11: `erpo train dtype=bfloat16` on CPU crashed inside
the reference linear_token_logprobs with "Index put requires the source and
destination dtypes match").

Contract (each op's docstring): linear_token_logprobs treats hidden @ weight.T as
autocast treats a linear layer (fp16/bf16/fp32 operands cast to the autocast dtype,
the softmax side in fp32); the other ops run on their inputs as given. So under
`torch.autocast("cpu", torch.bfloat16)` each op must give exactly what it gives
outside autocast on the inputs autocast would hand it, and values and gradients must
be accurate against float64. Both backends (Triton in the interpreter on CPU).
"""
from __future__ import annotations

import pytest
import torch

from _compare import assert_close_to_ref
from erpo_kernels import linear_token_logprobs, segment_sum, token_logprobs, weighted_k3

AMP = torch.bfloat16
BACKENDS = ["triton", "torch"]


def _autocast(device):
    return torch.autocast(torch.device(device).type, dtype=AMP)


def _leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


def _grads(out, leaves, upstream):
    loss = sum((o * g).sum() for o, g in zip(out, upstream))
    return torch.autograd.grad(loss, [x for x in leaves if x is not None])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_token_logprobs(device, backend, with_bias):
    n, d, v = 13, 24, 77
    hidden, weight = torch.randn(n, d, device=device), torch.randn(v, d, device=device) * 0.5
    bias = torch.randn(v, device=device) if with_bias else None
    targets = torch.randint(0, v, (n,), device=device)
    targets[[0, 5]] = -100
    inv_t = (torch.rand(n) + 0.5).to(device)
    up = (torch.randn(n, device=device), torch.randn(n, device=device))

    def run(h, w, b):
        return linear_token_logprobs(
            h, w, targets, bias=b, inv_temperature=inv_t, return_entropy=True, backend=backend
        )

    leaves = _leaves(hidden, weight, bias)
    with _autocast(device):
        out = run(*leaves)  # fp32 hidden and parameters, as in a model under autocast
        grads = _grads(out, leaves, up)
    for o in out:
        assert o.dtype == torch.float32
    for g, x in zip(grads, [x for x in leaves if x is not None]):
        assert g.dtype == x.dtype == torch.float32
    # exactly what the op gives outside autocast on the operands cast as autocast casts them
    cast = _leaves(*(None if t is None else t.to(AMP) for t in (hidden, weight, bias)))
    want = run(*cast)
    want_grads = _grads(want, cast, up)
    for a, b in zip(list(out) + list(grads), list(want) + list(want_grads)):
        assert torch.equal(a, b.to(a.dtype))
    # and accurate: float64 from the same bf16 operands; the bf16 gradients no worse
    # than plain PyTorch's (a bf16 matmul, then log_softmax in fp32) plus the margin
    def plain(dtype, softmax_dtype):
        x = _leaves(*(None if t is None else t.to(AMP).to(dtype) for t in (hidden, weight, bias)))
        z = x[0] @ x[1].T + (x[2] if with_bias else 0)
        ls = torch.log_softmax(z.to(softmax_dtype) * inv_t.to(softmax_dtype)[:, None], -1)
        valid = targets != -100
        logp = torch.where(valid, ls.gather(1, targets.clamp(min=0)[:, None]).squeeze(1), 0.0)
        ent = torch.where(valid, -(ls.exp() * ls).sum(-1), 0.0)
        return logp.detach(), ent.detach(), _grads((logp, ent), x, [u.to(softmax_dtype) for u in up])

    logp, ent, truth_grads = plain(torch.float64, torch.float64)
    _, _, same_grads = plain(AMP, torch.float32)
    assert_close_to_ref(out[0].detach(), logp, name="logp")
    assert_close_to_ref(out[1].detach(), ent, name="entropy")
    for name, g, t, s in zip(("d_hidden", "d_weight", "d_bias"), want_grads, truth_grads, same_grads):
        assert_close_to_ref(g.float(), t, s.float(), input_dtype=AMP, name=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs(device, backend, dtype):
    n, v = 9, 61
    logits = (torch.randn(n, v) * 3).to(dtype).to(device)
    targets = torch.randint(0, v, (n,), device=device)
    targets[2] = -100
    up = (torch.randn(n, device=device), torch.randn(n, device=device))

    def run(z):
        return token_logprobs(z, targets, inv_temperature=0.8, return_entropy=True, backend=backend)

    (z,) = _leaves(logits)
    with _autocast(device):
        out = run(z)
        (grad,) = _grads(out, [z], up)
    (z0,) = _leaves(logits)
    want = run(z0)
    (want_grad,) = _grads(want, [z0], up)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]) and torch.equal(grad, want_grad)
    (z64,) = _leaves(logits.double())
    ls = torch.log_softmax(z64 * 0.8, -1)
    valid = targets != -100
    logp = torch.where(valid, ls.gather(1, targets.clamp(min=0)[:, None]).squeeze(1), 0.0)
    ent = torch.where(valid, -(ls.exp() * ls).sum(-1), 0.0)
    (truth,) = _grads((logp, ent), [z64], [u.double() for u in up])
    assert_close_to_ref(out[0].detach(), logp.detach(), name="logp")
    assert_close_to_ref(out[1].detach(), ent.detach(), name="entropy")
    assert_close_to_ref(grad, truth, truth.to(dtype), input_dtype=dtype, name="grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_segment_sum(device, backend):
    values = torch.randn(23, device=device)
    cu = torch.tensor([0, 4, 4, 15, 23], device=device)
    g = torch.randn(4, device=device)
    (x,) = _leaves(values)
    with _autocast(device):
        out = segment_sum(x, cu, backend=backend)
        (grad,) = torch.autograd.grad((out * g).sum(), x)
    assert out.dtype == grad.dtype == torch.float32
    (x64,) = _leaves(values.double())
    truth = torch.stack([x64[a:b].sum() for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    (truth_grad,) = torch.autograd.grad((truth * g.double()).sum(), x64)
    assert_close_to_ref(out.detach(), truth.detach(), name="sums")
    assert torch.equal(grad.double(), truth_grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_weighted_k3(device, backend):
    m = 17
    logp, ref = torch.randn(m, device=device) - 2, torch.randn(m, device=device) - 2
    w = torch.rand(m, device=device)
    leaves = _leaves(logp, ref, w)
    with _autocast(device):
        r = weighted_k3(*leaves, backend=backend)
        grads = torch.autograd.grad(r, leaves)
    assert r.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    l64 = _leaves(logp.double(), ref.double(), w.double())
    d = l64[1] - l64[0]
    truth = (l64[2] * (torch.exp(d) - d - 1)).sum() / l64[2].sum()
    truth_grads = torch.autograd.grad(truth, l64)
    assert_close_to_ref(r.detach(), truth.detach(), name="R")
    for name, g, t in zip(("d_logp", "d_ref_logp", "d_weight"), grads, truth_grads):
        assert_close_to_ref(g, t, name=name)
