"""NaN in, NaN out (issue 19.3): a NaN in a data tensor (a logit, a hidden value, a
weight row, a bias entry, a log-prob, a value to sum) gives NaN in every output that
depends on it, and leaves every other output exactly as it is without the NaN; on both
backends (Triton in the interpreter, and the torch reference). Data tensors are never
checked for NaN (that would read [N, V] back to the host): validate=True checks the
small parameter tensors (targets, temperatures, offsets, weights), where NaN and
infinite values are a ValueError; with validate=False they too give NaN, never a
finite result that hides them. docs/kernels.md states the rule.
"""
from __future__ import annotations

import math

import pytest
import torch

from erpo_kernels import LossConfig, erpo_loss, linear_token_logprobs, segment_sum, token_logprobs, weighted_k3
from test_objective import VOCAB, make_point

NAN = float("nan")
BACKENDS = ["triton", "torch"]
IGNORE = -100


def _grad(outputs, leaves):
    """Gradients of sum(g_k * output_k) with fixed random g (NaN-free upstream)."""
    g = torch.Generator().manual_seed(5)
    total = sum((out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum() for out in outputs)
    return torch.autograd.grad(total, leaves)


def _assert_nan_where(x: torch.Tensor, where: torch.Tensor, clean: torch.Tensor, name: str) -> None:
    """x is NaN exactly at `where` (a bool mask) and equals `clean` elsewhere (to the
    last bits: a CPU vector math routine may round a lane differently when another
    lane of its vector holds a NaN)."""
    assert torch.isnan(x[where]).all(), f"{name}: a finite value where a NaN input was used"
    assert torch.allclose(x[~where], clean[~where], rtol=1e-6, atol=1e-9), f"{name}: a value changed that does not depend on the NaN"


def _token_outputs(logits, targets, backend, **options):
    z = logits.clone().requires_grad_()
    logp, ent = token_logprobs(z, targets, return_entropy=True, backend=backend, **options)
    (grad,) = _grad((logp, ent), [z])
    return logp.detach(), ent.detach(), grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("options", [{}, dict(inv_temperature=0.7), dict(softcap=5.0, logit_scale=0.5)],
                         ids=["plain", "temperature", "softcap"])
def test_token_logprobs_nan_logit(device, backend, dtype, options):
    n, vocab = 6, 70
    logits = torch.randn(n, vocab, device=device).to(dtype)
    targets = torch.tensor([3, 10, IGNORE, 69, 0, 5], device=device)
    clean = _token_outputs(logits, targets, backend, tiles=None, **options)
    bad = logits.clone()
    bad[1, 40] = NAN  # off the target, in a later block
    bad[3, 69] = NAN  # the target itself, in the last (partial) block
    bad[2, 0] = NAN  # an ignored row: still 0, zero gradient
    bad[4, 7] = NAN  # one NaN in the first block of another row
    rows = torch.tensor([False, True, False, True, True, False], device=device)
    logp, ent, grad = _token_outputs(bad, targets, backend, **options)
    _assert_nan_where(logp, rows, clean[0], "logp")
    _assert_nan_where(ent, rows, clean[1], "entropy")
    _assert_nan_where(grad, rows[:, None].expand(n, vocab), clean[2], "d logits")


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_nan_temperature_unvalidated(device, backend):
    logits = torch.randn(4, 33, device=device)
    targets = torch.tensor([1, 2, 3, 4], device=device)
    inv_t = torch.tensor([1.0, NAN, 0.5, 1.0], device=device)
    with pytest.raises(ValueError, match="inv_temperature"):
        token_logprobs(logits, targets, inv_temperature=inv_t, backend=backend)
    clean = _token_outputs(logits, targets, backend, inv_temperature=inv_t.nan_to_num(1.0), validate=False)
    out = _token_outputs(logits, targets, backend, inv_temperature=inv_t, validate=False)
    rows = torch.tensor([False, True, False, False], device=device)
    for name, x, c in zip(("logp", "entropy", "d logits"), out, clean):
        _assert_nan_where(x, rows if x.dim() == 1 else rows[:, None].expand_as(x), c, name)


def _linear_outputs(hidden, weight, bias, targets, backend, **options):
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    logp, ent = linear_token_logprobs(leaves[0], leaves[1], targets, bias=leaves[2], return_entropy=True,
                                      backend=backend, **options)  # fmt: skip
    return (logp.detach(), ent.detach(), *_grad((logp, ent), leaves))


def _linear_inputs(device, dtype):
    n, d, vocab = 7, 16, 45
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, d, generator=g).to(dtype).to(device)
    weight = (0.3 * torch.randn(vocab, d, generator=g)).to(dtype).to(device)
    bias = (0.1 * torch.randn(vocab, generator=g)).to(dtype).to(device)
    targets = torch.tensor([1, IGNORE, 44, 3, 0, IGNORE, 9], device=device)
    return hidden, weight, bias, targets


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("options", [{}, dict(softcap=4.0, inv_temperature=0.8)], ids=["plain", "softcap"])
def test_linear_token_logprobs_nan_hidden_row(device, backend, dtype, options):
    hidden, weight, bias, targets = _linear_inputs(device, dtype)
    clean = _linear_outputs(hidden, weight, bias, targets, backend, **options)
    bad = hidden.clone()
    bad[2, 5] = NAN  # a scored row
    bad[5, 0] = NAN  # an ignored row: it scores nothing, so nothing depends on it
    logp, ent, d_hidden, d_weight, d_bias = _linear_outputs(bad, weight, bias, targets, backend, **options)
    rows = torch.zeros(hidden.shape[0], dtype=torch.bool, device=device)
    rows[2] = True
    _assert_nan_where(logp, rows, clean[0], "logp")
    _assert_nan_where(ent, rows, clean[1], "entropy")
    _assert_nan_where(d_hidden, rows[:, None].expand_as(d_hidden), clean[2], "d_hidden")
    # d_weight and d_bias sum over every scored row, the NaN one included
    assert torch.isnan(d_weight).all() and torch.isnan(d_bias).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["weight", "bias"])
def test_linear_token_logprobs_nan_weight_row(device, backend, where):
    hidden, weight, bias, targets = _linear_inputs(device, torch.float32)
    clean = _linear_outputs(hidden, weight, bias, targets, backend)
    if where == "weight":
        weight = weight.clone()
        weight[30, 7] = NAN  # vocabulary row 30: a logit of every row
    else:
        bias = bias.clone()
        bias[30] = NAN
    logp, ent, d_hidden, d_weight, d_bias = _linear_outputs(hidden, weight, bias, targets, backend)
    scored = targets != IGNORE
    _assert_nan_where(logp, scored, clean[0], "logp")
    _assert_nan_where(ent, scored, clean[1], "entropy")
    _assert_nan_where(d_hidden, scored[:, None].expand_as(d_hidden), clean[2], "d_hidden")
    assert torch.isnan(d_weight).all() and torch.isnan(d_bias).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_segment_sum_nan_value(device, backend):
    values = torch.randn(11, device=device)
    cu = torch.tensor([0, 3, 3, 8, 11], device=device)
    clean = segment_sum(values, cu, backend=backend)
    bad = values.clone()
    bad[5] = NAN  # in segment 2
    _assert_nan_where(segment_sum(bad, cu, backend=backend), torch.tensor([False, False, True, False]), clean, "sum")


def _k3_outputs(logp, ref, w, backend, **options):
    leaves = [t.clone().requires_grad_() for t in (logp, ref, w)]
    r = weighted_k3(*leaves, guard=3.0, backend=backend, **options)
    return (r.detach(), *torch.autograd.grad(r, leaves))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["logp", "ref_logp"])
def test_weighted_k3_nan_log_prob(device, backend, where):
    g = torch.Generator().manual_seed(2)
    logp, ref = -3 * torch.rand(5, generator=g), -3 * torch.rand(5, generator=g)
    w = torch.rand(5, generator=g) + 0.5
    logp[4] = ref[4] + 5.0  # delta = -5: below the guard
    ref[3] = logp[3] + 4.0  # delta = 4 > guard: the linear branch
    clean = _k3_outputs(logp, ref, w, backend)
    for q in (1, 3):  # a query below the guard, and one above it
        bad_logp, bad_ref = logp.clone(), ref.clone()
        (bad_logp if where == "logp" else bad_ref)[q] = NAN
        r, d_logp, d_ref, d_w = _k3_outputs(bad_logp, bad_ref, w, backend)
        assert torch.isnan(r)
        only_q = torch.arange(5) == q
        # dR/dlogp_i = -w_i k3'(delta_i) / W: NaN for q only; dR/dw_i = (k3_i - R) / W: NaN for all
        _assert_nan_where(d_logp, only_q, clean[1], "d logp")
        _assert_nan_where(d_ref, only_q, clean[2], "d ref_logp")
        assert torch.isnan(d_w).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [NAN, math.inf], ids=["nan", "inf"])
def test_weighted_k3_non_finite_weight(device, backend, bad):
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    w = torch.tensor([1.0, bad, 0.5])
    with pytest.raises(ValueError, match="weight"):
        weighted_k3(logp, ref, w, backend=backend)
    r, d_logp, d_ref, d_w = _k3_outputs(logp, ref, w, backend, validate=False)
    assert torch.isnan(r) and torch.isnan(d_w).all()


def _loss_outputs(hidden, weight, batch, cfg, backend, **options):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, metrics = erpo_loss(h, w, batch, cfg, backend=backend, sync_metrics=False, **options)
    d_hidden, d_weight = torch.autograd.grad(loss, (h, w))
    return loss.detach(), metrics, d_hidden, d_weight


def _loss_inputs(backend="torch"):
    """A float64 batch, hidden states and lm_head weight (float32 for the Triton backend)."""
    batch, _, _, _ = make_point("softmax", with_ref_logp=True)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(batch.targets.numel(), 8, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, 8, generator=g, dtype=torch.float64)
    if backend == "triton":
        hidden, weight = hidden.float(), weight.float()
        for field in ("inv_temperature", "advantages", "ref_query_logp", "query_weights", "old_logp", "ref_logp"):
            setattr(batch, field, getattr(batch, field).float())
    return batch, hidden, weight


# Metrics that average values over the scored rows (the fractions count comparisons,
# which a NaN never satisfies, and the weights' metrics do not read the rows).
ROW_VALUE_METRICS = ("loss", "pg/loss", "pg/ratio_mean", "entropy/mean")
QUERY_VALUE_METRICS = ("loss", "qkl/value", "qkl/delta_mean", "qkl/loss", "query_logp/mean")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("row", ["response", "prompt", "ignored"])
def test_erpo_loss_nan_hidden(backend, row):
    batch, hidden, weight = _loss_inputs(backend)
    cfg = LossConfig(algorithm="erpo", alpha=0.2)
    clean = _loss_outputs(hidden, weight, batch, cfg, backend)
    cu = batch.span_cu_seqlens.tolist()
    valid = (batch.targets != batch.ignore_index).tolist()
    prompt_rows = [r for r in range(cu[0], cu[1]) if valid[r]]
    response_rows = [r for r in range(cu[1], cu[2]) if valid[r]]
    ignored = [r for r in range(len(valid)) if not valid[r]]
    r = {"response": response_rows[0], "prompt": prompt_rows[0], "ignored": ignored[0]}[row]
    bad = hidden.clone()
    bad[r, 3] = NAN
    loss, metrics, d_hidden, d_weight = _loss_outputs(bad, weight, batch, cfg, backend)
    if row == "ignored":
        assert torch.equal(loss, clean[0]) and torch.equal(d_weight, clean[3])
        return
    assert torch.isnan(loss) and torch.isnan(d_weight).all() and torch.isnan(d_hidden[r]).all()
    for key in ROW_VALUE_METRICS if row == "response" else QUERY_VALUE_METRICS:
        assert torch.isnan(metrics[key]), key


@pytest.mark.parametrize("backend", BACKENDS)
def test_erpo_loss_nan_weight_row(backend):
    batch, hidden, weight = _loss_inputs(backend)
    weight = weight.clone()
    weight[2, 0] = NAN
    loss, metrics, d_hidden, d_weight = _loss_outputs(hidden, weight, batch, LossConfig(), backend)
    assert torch.isnan(loss) and all(torch.isnan(metrics[k]) for k in ROW_VALUE_METRICS + QUERY_VALUE_METRICS)


@pytest.mark.parametrize("field", ["query_weights", "advantages", "ref_query_logp"])
@pytest.mark.parametrize("bad", [NAN, math.inf], ids=["nan", "inf"])
def test_erpo_loss_non_finite_batch_values(field, bad):
    batch, hidden, weight = _loss_inputs()
    values = getattr(batch, field).clone()
    values[1] = bad
    setattr(batch, field, values)
    with pytest.raises(ValueError, match=field):
        erpo_loss(hidden, weight, batch, backend="torch", validate=True)
    loss, metrics, _, _ = _loss_outputs(hidden, weight, batch, LossConfig(alpha=0.2), "torch", validate=False)
    assert not torch.isfinite(loss), f"a non-finite {field} gave a finite loss"
