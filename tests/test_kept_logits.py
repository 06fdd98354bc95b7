"""erpo_kernels.kept_logits (verl's impl_backend=erpo forward): log-probs whose
backward reuses the forward's logits equal linear_token_logprobs' (forward and every
gradient, fp32 within 1e-5), with a per-row temperature, bias, soft cap and logit scale;
the lm_head work counted in the interpreter is one GEMM less; the calls it does not
serve are linear_token_logprobs and say why."""
import pytest
import torch

from erpo_kernels.kept_logits import COMPOSED_PATH, KEPT_PATH, kept_linear_token_logprobs
from erpo_kernels import linear_token_logprobs

N, D, V = 37, 24, 50


def _operands(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.5).requires_grad_()
    bias = torch.randn(V, generator=g).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::5] = -100
    inv_t = torch.where(torch.arange(N) < 9, 1.0, 1 / 0.7)  # prompt rows at 1, the rest at 1 / 0.7
    c1, c2 = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return (hidden, weight, bias), targets, inv_t, c1, c2


def _fwd_bwd(fn, operands, targets, inv_t, c1, c2, with_entropy, **kw):
    h, w, b = (t.detach().requires_grad_() for t in operands)
    out = fn(h, w, targets, bias=b, inv_temperature=inv_t, backend="triton", **kw)
    logp, entropy = out[0], out[1]
    loss = (c1 * logp).sum() + ((c2 * entropy).sum() if with_entropy else 0.0)
    loss.backward()
    return (logp.detach(), entropy.detach(), h.grad, w.grad, b.grad), (out[2] if len(out) > 2 else None)


@pytest.mark.parametrize("transform", [{}, {"softcap": 0.9, "logit_scale": 2.5}], ids=["plain", "softcap-scale"])
@pytest.mark.parametrize("with_entropy", [True, False], ids=["logp-entropy", "logp"])
def test_equals_linear_token_logprobs(transform, with_entropy):
    operands, targets, inv_t, c1, c2 = _operands()
    ours, path = _fwd_bwd(kept_linear_token_logprobs, operands, targets, inv_t, c1, c2, with_entropy, **transform)
    ref, _ = _fwd_bwd(lambda *a, **k: linear_token_logprobs(*a, return_entropy=True, **k), operands, targets, inv_t,
                      c1, c2, with_entropy, **transform)
    assert path == KEPT_PATH
    for name, o, r in zip(("logp", "entropy", "d_hidden", "d_weight", "d_bias"), ours, ref):
        assert o.dtype == r.dtype and o.shape == r.shape, name
        assert float((o - r).abs().max()) <= 1e-5 * (1 + float(r.abs().max())), name
    assert float(ref[2].abs().max()) > 0


def test_one_gemm_less():
    """Counted in the interpreter (bench.cost): the kept path's tl.dot work is
    linear_token_logprobs' forward + backward less exactly its logits' recompute."""
    from bench.cost import count_launches

    operands, targets, inv_t, c1, c2 = _operands()

    def flops(step):
        return sum(r.total_flops for r in count_launches(step, torch_ops=False))

    one = flops(lambda: linear_token_logprobs(*(t.detach() for t in operands[:2]), targets, bias=operands[2].detach(),
                                              inv_temperature=inv_t, backend="triton"))
    kept = flops(lambda: _fwd_bwd(kept_linear_token_logprobs, operands, targets, inv_t, c1, c2, True))
    full = flops(lambda: _fwd_bwd(lambda *a, **k: linear_token_logprobs(*a, return_entropy=True, **k), operands,
                                  targets, inv_t, c1, c2, True))
    assert one > 0 and full - kept == one, (one, kept, full)


def test_what_takes_linear_token_logprobs():
    operands, targets, inv_t, c1, c2 = _operands()
    budget = 4 * N * V
    _, path = _fwd_bwd(kept_linear_token_logprobs, operands, targets, inv_t, c1, c2, True, fused_budget=budget)
    assert path == KEPT_PATH  # the call's logits fit the budget exactly
    _, path = _fwd_bwd(kept_linear_token_logprobs, operands, targets, inv_t, c1, c2, True, fused_budget=budget - 1)
    assert path.startswith(f"{COMPOSED_PATH} (the call's {N} rows keep")
    h, w, b = operands
    with torch.no_grad():
        assert kept_linear_token_logprobs(h, w, targets, bias=b, backend="triton")[2] == \
            f"{COMPOSED_PATH} (no gradient wanted (the forward alone: 1 GEMM))"
    assert kept_linear_token_logprobs(h, w, targets, bias=b, backend="torch")[2] == f"{COMPOSED_PATH} (the torch backend)"
    with pytest.raises(ValueError, match=r"targets\[1\] = 50 is outside \[0, 50\)"):
        kept_linear_token_logprobs(h, w, torch.tensor([0, V] + [1] * (N - 2)), backend="triton")
