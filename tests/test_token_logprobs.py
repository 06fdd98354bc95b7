"""token_logprobs: the Triton kernels (backend="triton") and the reference (backend="torch")
against a float64 truth written here with torch.log_softmax and autograd.

Accuracy criterion: tests/_compare.assert_close_to_ref. "PyTorch in the same dtype" is, for
every output, the eager computation a user writes from the *same* fp16/bf16 logits:
    s = logits.float() * inv_T;  logq = torch.log_softmax(s, -1)
    logp = logq[target];  entropy = -(softmax(s) * logq).sum(-1)
Its logp and entropy are fp32, like ours (so the bar on them is fp32 arithmetic on
low-precision inputs, not bf16 arithmetic); its gradient with respect to the logits comes
back through the .float() cast, i.e. computed in fp32 and rounded once to the logits'
dtype, which is exactly what our backward writes. The float64 truth starts from the same
low-precision logits (upcast exactly), so input rounding is not counted as error.
"""
from __future__ import annotations

import importlib
from typing import Tuple

import pytest
import torch

from erpo_kernels import token_logprobs
from _compare import assert_close_to_ref
from _host_reads import HostRead, no_host_reads

# The module, not the function of the same name that erpo_kernels re-exports.
tlp = importlib.import_module("erpo_kernels.token_logprobs")

IGNORE = -100
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

Outputs = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


# Blocks of 16 (forward) and 32 (backward) columns: tiny rows span several blocks and
# end in a partial one. Most tests run with them; DEFAULT is the GPU launch shape.
SMALL = tlp.RowTiles(fwd_max_block_v=16, bwd_max_block_v=32)
DEFAULT = None


def _row_inv_t(inv_temperature, n: int) -> torch.Tensor:
    """The fp32 per-row inverse temperature the op is specified to use."""
    if inv_temperature is None:
        return torch.ones(n, dtype=torch.float32)
    if isinstance(inv_temperature, float):
        return torch.full((n,), inv_temperature, dtype=torch.float32)
    return inv_temperature.detach().float().cpu()


def _loss_terms(s: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """scaled logits [N, V] -> (logp [N], entropy [N]), 0 on ignored rows, NaN-free at -inf."""
    valid = targets != IGNORE
    # Ignored rows are replaced by zeros first: a row of -inf there must not put NaN into
    # log_softmax's backward.
    logq = torch.log_softmax(torch.where(valid[:, None], s, torch.zeros_like(s)), dim=-1)
    tgt = torch.where(valid, targets, torch.zeros_like(targets)).long()
    logp = torch.where(valid, logq.gather(1, tgt[:, None]).squeeze(1), torch.zeros_like(logq[:, 0]))
    p = logq.exp()
    # p log p = 0 where p = 0; the inner where keeps -inf out of the product (and its gradient).
    ent = -(p * torch.where(p > 0, logq, torch.zeros_like(logq))).sum(-1)
    ent = torch.where(valid, ent, torch.zeros_like(ent))
    return logp, ent


def _truth64(logits, targets, inv_temperature, g_logp, g_ent) -> Outputs:
    """float64 logp, entropy and d(sum g_logp logp + g_ent entropy)/d logits."""
    z = logits.detach().cpu().double().requires_grad_()
    s = z * _row_inv_t(inv_temperature, z.shape[0]).double()[:, None]
    logp, ent = _loss_terms(s, targets.cpu())
    loss = (logp * g_logp.cpu().double()).sum() + (ent * g_ent.cpu().double()).sum()
    (grad,) = torch.autograd.grad(loss, z)
    return logp.detach(), ent.detach(), grad


def _torch_same_dtype(logits, targets, inv_temperature, g_logp, g_ent) -> Outputs:
    """PyTorch eager from the same logits (see the module docstring): fp32 outputs, grad in logits' dtype."""
    z = logits.detach().cpu().clone().requires_grad_()
    s = z.float() * _row_inv_t(inv_temperature, z.shape[0])[:, None]
    logp, ent = _loss_terms(s, targets.cpu())
    loss = (logp * g_logp.cpu()).sum() + (ent * g_ent.cpu()).sum()
    (grad,) = torch.autograd.grad(loss, z)
    return logp.detach(), ent.detach(), grad


def _ours(
    logits, targets, inv_temperature, g_logp, g_ent, *, backend="triton", inplace=False, tiles=SMALL, **options
) -> Outputs:
    z = logits.detach().clone().requires_grad_()
    logp, ent = token_logprobs(
        z, targets, inv_temperature=inv_temperature, return_entropy=True, inplace_backward=inplace, backend=backend,
        tiles=tiles, **options,
    )
    assert logp.dtype == ent.dtype == torch.float32
    (grad,) = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), z)
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    return logp.detach().cpu(), ent.detach().cpu(), grad.cpu()


def _check_all(ours: Outputs, logits, targets, inv_temperature, g_logp, g_ent) -> None:
    """ours against the float64 truth with the shared criterion, plus the invariants.

    logp and entropy are fp32 results computed in fp32 from exactly representable inputs,
    so besides the low-precision criterion they must also meet the fp32 one (1e-5), in
    every input dtype. The same holds for both backends.
    """
    truth = _truth64(logits, targets, inv_temperature, g_logp, g_ent)
    same = _torch_same_dtype(logits, targets, inv_temperature, g_logp, g_ent)
    for name, x, ref, pt in zip(("logp", "entropy", "grad"), ours, truth, same):
        assert torch.isfinite(x).all(), f"{name}: non-finite values"
        if name != "grad":
            assert_close_to_ref(x, ref, name=f"{name} (fp32 criterion)")
        assert_close_to_ref(x, ref, pt, input_dtype=logits.dtype, name=name)
    logp, ent, grad = ours
    assert (logp <= 0).all(), "logp must never be positive"
    assert (ent >= 0).all(), "entropy must never be negative"
    ignored = (targets == IGNORE).cpu()
    assert (logp[ignored] == 0).all() and (ent[ignored] == 0).all(), "ignored rows must return 0"
    assert (grad[ignored] == 0).all(), "ignored rows must get a zero gradient"


def _inputs(n: int, vocab: int, dtype: torch.dtype, device: str, scale: float = 3.0):
    logits = (torch.randn(n, vocab) * scale).to(dtype).to(device)
    targets = torch.randint(0, vocab, (n,))
    targets[torch.rand(n) < 0.3] = IGNORE
    targets[0] = IGNORE
    return logits, targets.to(device), torch.randn(n, device=device), torch.randn(n, device=device)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("temperature", ["tensor", "float"])
def test_forward_backward_match_float64(device, dtype, temperature):
    # V = 173: forward 10 blocks of 16 plus a partial one (backward 5 of 32 plus one); some rows ignored.
    n, vocab = 11, 173
    logits, targets, g_logp, g_ent = _inputs(n, vocab, dtype, device)
    if temperature == "tensor":  # prompt rows at 1, response rows at 1 / tau, in one launch
        inv_t = torch.where(torch.arange(n) < 4, 1.0, 1.0 / torch.linspace(0.3, 1.5, n)).to(device)
    else:
        inv_t = 1.0 / 0.7
    for backend in ("triton", "torch"):
        ours = _ours(logits, targets, inv_t, g_logp, g_ent, backend=backend)
        _check_all(ours, logits, targets, inv_t, g_logp, g_ent)


def test_single_block_default_config(device):
    # Without the small-block fixture: one block of next_power_of_2(V) = 512 columns.
    logits, targets, g_logp, g_ent = _inputs(7, 301, torch.bfloat16, device)
    targets = targets.int()  # int32 targets work as well as int64
    ours = _ours(logits, targets, None, g_logp, g_ent, tiles=DEFAULT)
    _check_all(ours, logits, targets, None, g_logp, g_ent)


def test_one_upstream_gradient_at_a_time(device):
    n, vocab = 9, 50
    logits, targets, g_logp, g_ent = _inputs(n, vocab, torch.float32, device)
    zeros = torch.zeros(n, device=device)
    # return_entropy=False: only logp exists.
    z = logits.clone().requires_grad_()
    logp = token_logprobs(z, targets, inv_temperature=0.8, backend="triton", tiles=SMALL)
    assert isinstance(logp, torch.Tensor) and logp.shape == (n,)
    (grad,) = torch.autograd.grad((logp * g_logp).sum(), z)
    want_logp, _, want = _truth64(logits, targets, 0.8, g_logp, zeros)
    assert_close_to_ref(logp.detach().cpu(), want_logp, name="logp (no entropy)")
    assert_close_to_ref(grad.cpu(), want, name="grad (logp only)")
    # Entropy returned, but only one of the two outputs used: the other gradient is None.
    for use in ("logp", "entropy"):
        z = logits.clone().requires_grad_()
        logp, ent = token_logprobs(
            z, targets, inv_temperature=0.8, return_entropy=True, backend="triton", tiles=SMALL
        )
        out = (logp * g_logp).sum() if use == "logp" else (ent * g_ent).sum()
        (grad,) = torch.autograd.grad(out, z)
        gl, ge = (g_logp, zeros) if use == "logp" else (zeros, g_ent)
        _, _, want = _truth64(logits, targets, 0.8, gl, ge)
        assert_close_to_ref(grad.cpu(), want, name=f"grad ({use} only)")


@pytest.mark.parametrize("n,vocab", [(5, 1), (0, 37), (1, 16), (3, 33)])
def test_odd_shapes(device, n, vocab):
    logits = torch.randn(n, vocab, device=device)
    targets = torch.randint(0, vocab, (n,), device=device)
    g_logp, g_ent = torch.randn(n, device=device), torch.randn(n, device=device)
    ours = _ours(logits, targets, 1.3, g_logp, g_ent)
    assert ours[0].shape == ours[1].shape == (n,)
    _check_all(ours, logits, targets, 1.3, g_logp, g_ent)
    if vocab == 1:  # a single class: certain, so logp = 0, entropy = 0, zero gradient
        assert (ours[0] == 0).all() and (ours[1] == 0).all() and (ours[2] == 0).all()


def test_empty_rows_launch_nothing(device, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched for N = 0")

    monkeypatch.setattr(tlp._token_logprobs_fwd_kernel, "run", no_launch)
    monkeypatch.setattr(tlp._token_logprobs_bwd_kernel, "run", no_launch)
    z = torch.randn(0, 40, device=device, requires_grad=True)
    no_targets = torch.zeros(0, dtype=torch.long, device=device)
    logp, ent = token_logprobs(z, no_targets, return_entropy=True, backend="triton")
    assert logp.shape == ent.shape == (0,)
    (grad,) = torch.autograd.grad(logp.sum() + ent.sum(), z)
    assert grad.shape == (0, 40)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_minus_inf_logits(device, dtype, backend):
    n, vocab = 6, 45
    logits, targets, g_logp, g_ent = _inputs(n, vocab, dtype, device)
    targets[1] = 30
    logits[1] = float("-inf")  # a row of -inf except the target: certain
    logits[1, 30] = 2.0
    logits[2, ::3] = float("-inf")  # scattered -inf, target finite
    targets[2] = 4
    logits[3, :40] = float("-inf")  # whole leading blocks of -inf
    targets[3] = 41
    logits[0] = float("-inf")  # ignored row of -inf: still 0 and a zero gradient
    inv_t = torch.tensor([1.0, 0.5, 2.0, 1.0, 1.0, 1.0], device=device)
    ours = _ours(logits, targets, inv_t, g_logp, g_ent, backend=backend)
    _check_all(ours, logits, targets, inv_t, g_logp, g_ent)
    logp, ent, grad = ours
    assert logp[1] == 0 and ent[1] == 0
    assert (grad[1] == 0).all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_large_logits(device, dtype, backend):
    n, vocab = 6, 70
    g_logp, g_ent = torch.randn(n, device=device), torch.randn(n, device=device)
    targets = torch.randint(0, vocab, (n,), device=device)
    inv_t = torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0, 0.9], device=device)
    # A large common offset (exp would overflow without the max) and a large spread.
    offset = (1e4 + 4 * torch.randn(n, vocab)).to(dtype).to(device)
    offset[:, 7] = 1e4  # several logits near the top share the mass
    spread = (1e4 * torch.randn(n, vocab)).to(dtype).to(device)
    for logits in (offset, spread, -offset):
        ours = _ours(logits, targets, inv_t, g_logp, g_ent, backend=backend)
        _check_all(ours, logits, targets, inv_t, g_logp, g_ent)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_inplace_backward_writes_into_logits(device, dtype):
    logits, targets, g_logp, g_ent = _inputs(8, 90, dtype, device)
    _, _, want = _ours(logits, targets, 0.9, g_logp, g_ent)  # out of place
    leaf = logits.clone().requires_grad_()
    z = leaf * 1  # the non-leaf whose storage backward overwrites
    logp, ent = token_logprobs(
        z, targets, inv_temperature=0.9, return_entropy=True, inplace_backward=True, backend="triton", tiles=SMALL
    )
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    assert torch.equal(leaf.grad.cpu(), want), "inplace gradient differs from the out-of-place one"
    assert torch.equal(z.detach().cpu(), want), "the gradient was not written into the logits' storage"


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_inplace_backward_refuses_logits_their_producer_saved(device, backend):
    # tanh saves its output: overwriting that output with the gradient must fail loudly,
    # as any in-place op would, never hand tanh's backward a gradient as its output.
    x = torch.randn(4, 40, device=device, requires_grad=True)
    targets = torch.randint(0, 40, (4,), device=device)
    logp = token_logprobs(torch.tanh(x), targets, inplace_backward=True, backend=backend)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        logp.sum().backward()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_inplace_backward_refuses_a_leaf_that_requires_grad(device, backend):
    # issue 29.3: backward wrote the gradient into the caller's leaf, losing its values,
    # with .grad sharing its storage. A leaf (or a view of one) is refused; a leaf that
    # needs no gradient is never written (no backward reaches it).
    x = torch.randn(4, 40, device=device)
    targets = torch.randint(0, 40, (4,), device=device)
    leaf = x.clone().requires_grad_()
    for logits in (leaf, leaf.view(2, 2, 40).view(4, 40), leaf[1:]):
        with pytest.raises(ValueError, match="leaf tensor that requires grad"):
            token_logprobs(logits, targets[: logits.shape[0]], inplace_backward=True, backend=backend)
    assert torch.equal(leaf.detach(), x) and leaf.grad is None
    plain = x.clone()
    token_logprobs(plain, targets, inplace_backward=True, backend=backend)
    assert torch.equal(plain, x)


def test_non_contiguous_logits(device):
    n, vocab = 5, 40
    logits, targets, g_logp, g_ent = _inputs(n, vocab, torch.float32, device)
    _, _, want = _truth64(logits, targets, 1.1, g_logp, g_ent)
    wide = torch.randn(n, vocab + 7, device=device)
    wide[:, :vocab] = logits
    transposed = logits.t().contiguous().t()
    for view in (wide[:, :vocab], transposed):  # row-strided, and column-strided (copied)
        assert not view.is_contiguous()
        ours = _ours(view, targets, 1.1, g_logp, g_ent)
        _check_all(ours, logits, targets, 1.1, g_logp, g_ent)
        assert_close_to_ref(ours[2], want, name="grad")
        with pytest.raises(ValueError, match="inplace_backward"):
            token_logprobs(view, targets, inplace_backward=True, backend="triton")


def _bad_cases(device):
    n, v = 4, 10
    lg = torch.randn(n, v, device=device)
    tg = torch.randint(0, v, (n,), device=device)
    cases = [
        ("logits", dict(logits=lg[None])),
        ("logits", dict(logits=torch.ones(n, v, dtype=torch.int64, device=device))),
        ("logits", dict(logits=torch.randn(n, 0, device=device))),
        ("logits", dict(logits=lg.double())),  # fp64 is for the torch backend only
        ("logits", dict(logits=[[0.0] * v] * n)),
        ("targets", dict(targets=tg[:-1])),
        ("targets", dict(targets=tg.float())),
        ("targets", dict(targets=tg[:, None])),
        ("targets", dict(targets=torch.tensor([0, 1, v, 2], device=device))),
        ("targets", dict(targets=torch.tensor([0, -1, 2, 3], device=device))),
        ("targets", dict(targets=torch.zeros(n, dtype=torch.long, device="meta"))),  # device mismatch
        ("inv_temperature", dict(inv_temperature=torch.ones(n + 1, device=device))),
        ("inv_temperature", dict(inv_temperature=torch.tensor([1.0, 0.0, 1.0, 1.0], device=device))),
        ("inv_temperature", dict(inv_temperature=torch.tensor([1.0, -2.0, 1.0, 1.0], device=device))),
        ("inv_temperature", dict(inv_temperature=torch.tensor([1.0, float("nan"), 1.0, 1.0], device=device))),
        ("inv_temperature", dict(inv_temperature=-1.0)),
        ("inv_temperature", dict(inv_temperature="hot")),
        ("inv_temperature", dict(inv_temperature=torch.ones(n, device="meta"))),  # device mismatch
        ("ignore_index", dict(ignore_index=1.5)),
        ("backend", dict(backend="cuda")),
    ]
    if device == "cuda":
        cases.append(("targets", dict(targets=tg.cpu())))
        cases.append(("inv_temperature", dict(inv_temperature=torch.ones(n))))
    return lg, tg, cases


def test_bad_inputs_raise_value_error_naming_the_argument(device, monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("bad input reached the op")

    monkeypatch.setattr(tlp, "_token_logprobs_op", no_kernel)
    lg, tg, cases = _bad_cases(device)
    for name, bad in cases:
        kwargs = dict(logits=lg, targets=tg, backend="triton")
        kwargs.update(bad)
        with pytest.raises(ValueError, match=rf"\b{name}\b"):
            token_logprobs(kwargs.pop("logits"), kwargs.pop("targets"), **kwargs)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_validate_false_reads_no_values(device, backend):
    # validate=False: no check reads targets or inv_temperature on the host (a GPU sync),
    # forward or backward, and valid input gives exactly the validated result.
    logits, targets, g_logp, g_ent = _inputs(7, 40, torch.float32, device)
    inv_t = torch.rand(7, device=device) + 0.5
    z = logits.clone().requires_grad_()
    with no_host_reads():
        logp, ent = token_logprobs(
            z, targets, inv_temperature=inv_t, return_entropy=True, backend=backend, validate=False, tiles=SMALL
        )
        (grad,) = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), z)
    want = _ours(logits, targets, inv_t, g_logp, g_ent, backend=backend)
    assert torch.equal(logp.cpu(), want[0]) and torch.equal(ent.cpu(), want[1]) and torch.equal(grad.cpu(), want[2])
    with no_host_reads(), pytest.raises(HostRead):  # the detector sees validation's reads
        token_logprobs(logits, targets, inv_temperature=inv_t, backend=backend)
    # structure is still checked with validate=False
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(logits, targets[:-1], backend=backend, validate=False)


def _transformed(z: torch.Tensor, softcap, logit_scale) -> torch.Tensor:
    """The logits the op is specified to see: logit_scale first, then the soft cap."""
    if logit_scale is not None:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


TRANSFORMS = [
    dict(softcap=10.0),  # Gemma-2 style: most logits here reach the saturated part of tanh
    dict(logit_scale=0.37),  # Cohere style: a plain multiplier
    dict(softcap=6.0, logit_scale=1.7),  # both: scale first, then cap
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("options", TRANSFORMS, ids=lambda o: "+".join(o))
def test_softcap_and_logit_scale_match_float64(device, dtype, backend, options):
    # Values and gradients against float64 of the transformed logits; "PyTorch in the
    # same dtype" applies the transform in fp32 to the same low-precision logits.
    n, vocab = 9, 83
    logits, targets, g_logp, g_ent = _inputs(n, vocab, dtype, device, scale=8.0)
    logits[1, 5] = float("-inf")  # a masked logit: the cap maps it to -softcap, as torch.tanh does
    inv_t = torch.linspace(0.6, 1.6, n).to(device)
    ours = _ours(logits, targets, inv_t, g_logp, g_ent, backend=backend, **options)
    results = []
    for dt in (torch.float64, torch.float32):
        z = logits.detach().cpu().clone().requires_grad_()
        s = _transformed(z.to(dt), **{k: options.get(k) for k in ("softcap", "logit_scale")})
        logp, ent = _loss_terms(s * inv_t.cpu().to(dt)[:, None], targets.cpu())
        (grad,) = torch.autograd.grad((logp * g_logp.cpu().to(dt)).sum() + (ent * g_ent.cpu().to(dt)).sum(), z)
        results.append((logp.detach(), ent.detach(), grad))
    truth, same = results
    for name, x, ref, pt in zip(("logp", "entropy", "grad"), ours, truth, same):
        assert torch.isfinite(x).all(), f"{name}: non-finite values"
        if name != "grad":
            assert_close_to_ref(x, ref, name=f"{name} (fp32 criterion)")
        assert_close_to_ref(x, ref, pt, input_dtype=dtype, name=name)


def test_softcap_and_logit_scale_bad_values(device):
    logits = torch.randn(3, 10, device=device)
    targets = torch.randint(0, 10, (3,), device=device)
    for name in ("softcap", "logit_scale"):
        for bad in (0.0, -1.0, float("inf"), float("nan"), "30", True, torch.tensor(2.0)):
            with pytest.raises(ValueError, match=name):
                token_logprobs(logits, targets, backend="triton", **{name: bad})


def test_blocks_is_the_older_name_of_tiles(device):
    logits, targets, g_logp, g_ent = _inputs(5, 70, torch.float32, device)
    want = token_logprobs(logits, targets, return_entropy=True, backend="triton", tiles=SMALL)
    with pytest.warns(DeprecationWarning, match="tiles="):
        old = token_logprobs(logits, targets, return_entropy=True, backend="triton", blocks=tlp.RowBlocks(16, 32))
    assert all(torch.equal(a, b) for a, b in zip(want, old))
    with pytest.raises(ValueError, match="tiles="):
        token_logprobs(logits, targets, backend="triton", tiles=SMALL, blocks=SMALL)
    with pytest.raises(ValueError, match="tiles"):
        token_logprobs(logits, targets, backend="triton", tiles=(16, 32))


def test_numpy_scalars_are_numbers_where_a_float_is_meant(device):
    """inv_temperature=np.float32(2) (and numpy ints, softcap, logit_scale, weighted_k3's guard)
    is the number it holds, as in PyTorch (issue 29.7: refused as "not a float"); a bool, a
    numpy bool or a string is still refused."""
    import numpy as np

    from erpo_kernels import linear_token_logprobs, weighted_k3

    logits = torch.randn(5, 33, device=device)
    hidden, weight = torch.randn(5, 8, device=device), torch.randn(33, 8, device=device)
    targets = torch.randint(0, 33, (5,), device=device)
    want = token_logprobs(logits, targets, inv_temperature=2.0, softcap=30.0, logit_scale=0.5, backend="triton")
    want_linear = linear_token_logprobs(hidden, weight, targets, inv_temperature=2.0, backend="triton")
    for two in (np.float32(2), np.float64(2), np.int64(2), np.float16(2)):
        got = token_logprobs(logits, targets, inv_temperature=two, softcap=np.float32(30), logit_scale=np.float64(0.5),
                             backend="triton")
        assert torch.equal(got, want), type(two)
        assert torch.equal(linear_token_logprobs(hidden, weight, targets, inv_temperature=two, backend="triton"),
                           want_linear), type(two)
    logp, ref = -torch.rand(4, device=device), -torch.rand(4, device=device)
    assert torch.equal(weighted_k3(logp, ref, guard=np.float32(5), backend="triton"),
                       weighted_k3(logp, ref, guard=5.0, backend="triton"))
    for bad in (True, np.bool_(True), "2"):
        with pytest.raises(ValueError, match="inv_temperature"):
            token_logprobs(logits, targets, inv_temperature=bad)
