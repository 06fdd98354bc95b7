"""linear_token_logprobs: Triton kernels (and the reference backend) against a float64
log_softmax((hidden @ weight.T + bias) * inv_T) written here, forward and backward.

Shapes are not multiples of any block size (N=37, D=24, V=211). Each case runs twice:
with the device's default tiles (CPU: the conservative ones) and with tiny tiles (chunks of 2 tiles),
so every loop (rows, vocabulary tiles, D tiles, chunks) takes several masked steps.
"""
import dataclasses
import importlib

import pytest
import torch

from _compare import assert_close_to_ref
from _host_reads import HostRead, no_host_reads
from erpo_kernels import interpreting, linear_token_logprobs
from erpo_kernels.tiles import ARCHITECTURES, default_tiles

ltl_module = importlib.import_module("erpo_kernels.linear_token_logprobs")

N, D, V = 37, 24, 211
IGNORE = -100
SMALL_TILES = ltl_module.Tiles(
    block_n=16, block_v=32, block_d=16, num_warps=4, split_tiles=2, gemm_n=16, gemm_v=16, gemm_d=16, gemm_warps=4,
    gemm_k=16,
)


@pytest.fixture(params=["default_tiles", "small_tiles"])
def tiles(request):
    """The `tiles=` argument of a test's calls: None (the defaults) or SMALL_TILES."""
    return SMALL_TILES if request.param == "small_tiles" else None


def _inputs(dtype, device, *, bias=True, ignored=(0, 5, 6, 17, 36), scale=1.0):
    hidden = (torch.randn(N, D) * scale).to(dtype).to(device)
    weight = (torch.randn(V, D) * 0.5).to(dtype).to(device)
    b = torch.randn(V).to(dtype).to(device) if bias else None
    targets = torch.randint(0, V, (N,))
    targets[list(ignored)] = IGNORE
    inv_t = (torch.rand(N) + 0.5).to(device)  # per-row temperature in [2/3, 2]
    g_logp = torch.randn(N).to(device)
    g_ent = torch.randn(N).to(device)
    return hidden, weight, b, targets.to(device), inv_t, g_logp, g_ent


def _leaves(*tensors, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]


def _plain(
    hidden, weight, bias, targets, inv_t, g_logp, g_ent, *, matmul_dtype, softmax_dtype, softcap=None, logit_scale=None
):
    """Plain PyTorch autograd: logits as one [N, V] matmul in matmul_dtype, then the
    logit scale, soft cap and log_softmax in softmax_dtype. Returns logp, entropy,
    d_hidden, d_weight, d_bias."""
    h, w, b = _leaves(hidden, weight, bias, dtype=matmul_dtype)
    z = h @ w.T
    if b is not None:
        z = z + b
    z = z.to(softmax_dtype)
    if logit_scale is not None:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    s = z * inv_t.to(softmax_dtype)[:, None]
    ls = torch.log_softmax(s, dim=-1)
    valid = targets != IGNORE
    logp = torch.where(valid, ls.gather(1, targets.clamp(min=0)[:, None]).squeeze(1), 0.0)
    p = ls.exp()
    # p log p = 0 where a logit is -inf (masked vocabulary entries)
    ent = torch.where(valid, -(p * torch.where(torch.isfinite(ls), ls, 0.0)).sum(-1), 0.0)
    loss = (logp * g_logp.to(softmax_dtype)).sum() + (ent * g_ent.to(softmax_dtype)).sum()
    wrt = [t for t in (h, w, b) if t is not None]
    grads = list(torch.autograd.grad(loss, wrt)) + ([None] if b is None else [])
    return (logp.detach(), ent.detach(), *grads)


def _truth(*args, **options):
    """The float64 reference."""
    return _plain(*args, matmul_dtype=torch.float64, softmax_dtype=torch.float64, **options)


def _torch_same_dtype(*args, dtype, **options):
    """The "PyTorch in the same dtype" side of the low-precision criterion: the matmul
    (and its backward) in the input dtype, as a model's lm_head runs, then log_softmax
    in fp32 on the upcast logits (as TRL-style log-prob code does)."""
    return _plain(*args, matmul_dtype=dtype, softmax_dtype=torch.float32, **options)


def _ours(hidden, weight, bias, targets, inv_t, g_logp, g_ent, *, backend, return_entropy=True, **options):
    h, w, b = _leaves(hidden, weight, bias)
    out = linear_token_logprobs(
        h, w, targets, bias=b, inv_temperature=inv_t, return_entropy=return_entropy, backend=backend, **options
    )
    logp, ent = out if return_entropy else (out, None)
    loss = (logp * g_logp).sum() + ((ent * g_ent).sum() if ent is not None else 0.0)
    wrt = [t for t in (h, w, b) if t is not None]
    grads = list(torch.autograd.grad(loss, wrt)) + ([None] if b is None else [])
    return (logp.detach(), None if ent is None else ent.detach(), *grads)


NAMES = ("logp", "entropy", "d_hidden", "d_weight", "d_bias")


def _check_all(ours, truth, same_dtype, dtype):
    for name, o, t, s in zip(NAMES, ours, truth, same_dtype if same_dtype is not None else [None] * 5):
        if t is None or o is None:
            continue
        assert o.dtype == (torch.float32 if name in ("logp", "entropy") else dtype), name
        assert_close_to_ref(o.cpu(), t.cpu(), None if s is None else s.cpu(), input_dtype=dtype, name=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_matches_float64(device, tiles, dtype):
    args = _inputs(dtype, device)
    ours = _ours(*args, backend="triton", tiles=tiles)
    truth = _truth(*args)
    same = _torch_same_dtype(*args, dtype=dtype) if dtype != torch.float32 else None
    _check_all(ours, truth, same, dtype)
    valid = args[3] != IGNORE
    # ignored rows: exactly 0 out, exactly 0 gradient into their hidden state
    assert torch.all(ours[0][~valid] == 0) and torch.all(ours[1][~valid] == 0)
    assert torch.all(ours[2][~valid] == 0)
    assert bool((ours[0][valid] < 0).all())


_ARCH_TILES = sorted({(dt, default_tiles("linear_token_logprobs", dt, cap)) for dt in (torch.bfloat16, torch.float32)
                      for cap in ARCHITECTURES}, key=str)  # fmt: skip


@pytest.mark.parametrize("dtype, arch_tiles", _ARCH_TILES, ids=lambda x: str(x).replace("torch.", "")[:40])
def test_each_architectures_default_tiles_match_float64(device, dtype, arch_tiles):
    # the tiles each GPU launches with (in the interpreter here): over two vocabulary chunks
    # and partial tiles everywhere, with bias, entropy and a per-row temperature. Chunks of one
    # tile: split_tiles is a host-side count (a runtime chunk width, never a kernel constant), so
    # the kernels are the architecture's own and the shape 10x smaller (V = block_v + 211, not
    # split_tiles x block_v + 211: 4,307 columns at 16 x 256)
    arch_tiles = dataclasses.replace(arch_tiles, split_tiles=1)
    v = arch_tiles.split_tiles * arch_tiles.block_v + 211
    hidden = torch.randn(N, D).to(dtype).to(device)
    weight = (torch.randn(v, D) * 0.5).to(dtype).to(device)
    bias = torch.randn(v).to(dtype).to(device)
    targets = torch.randint(0, v, (N,))
    targets[[0, 5]] = IGNORE
    args = (hidden, weight, bias, targets.to(device), (torch.rand(N) + 0.5).to(device), torch.randn(N).to(device),
            torch.randn(N).to(device))
    ours = _ours(*args, backend="triton", tiles=arch_tiles)
    same = _torch_same_dtype(*args, dtype=dtype) if dtype != torch.float32 else None
    _check_all(ours, _truth(*args), same, dtype)


def test_triton_peaked_logits_and_masked_vocab(device, tiles):
    # Large logits (|s| in the hundreds: the online log-sum-exp and the entropy must
    # not cancel) and -inf bias entries (masked vocabulary: p = 0, zero gradient).
    args = list(_inputs(torch.float32, device, scale=30.0))
    bias = args[2].clone()
    masked = torch.tensor([1, 40, 41, 100, 210], device=device)
    targets = args[3]
    targets[torch.isin(targets, masked)] = 2
    bias[masked] = float("-inf")
    args[2] = bias
    ours = _ours(*args, backend="triton", tiles=tiles)
    truth = _truth(*args)
    assert torch.isfinite(ours[0]).all() and torch.isfinite(ours[1]).all()
    _check_all(ours, truth, None, torch.float32)
    assert torch.all(ours[3][masked] == 0) and torch.all(ours[4][masked] == 0)


def test_triton_no_bias_no_entropy_strided_inputs(device, tiles):
    # no ignored row; hidden and weight reach the kernels as given (no copy)
    hidden, weight, _, targets, _, g_logp, _ = _inputs(torch.float32, device, bias=False, ignored=())
    # hidden a column slice of a wider buffer, weight a transposed view: strided loads
    hidden = torch.cat([hidden, torch.randn(N, 5, device=device)], dim=1)[:, :D]
    weight = weight.T.contiguous().T
    assert not hidden.is_contiguous() and not weight.is_contiguous()
    inv_t = torch.full((N,), 1 / 0.7, device=device)
    h, w = _leaves(hidden, weight)
    logp = linear_token_logprobs(h, w, targets, inv_temperature=1 / 0.7, backend="triton", tiles=tiles)
    assert isinstance(logp, torch.Tensor) and logp.shape == (N,)
    d_h, d_w = torch.autograd.grad((logp * g_logp).sum(), (h, w))
    truth = _truth(hidden, weight, None, targets, inv_t, g_logp, torch.zeros_like(g_logp))
    _check_all((logp.detach(), None, d_h, d_w, None), truth, None, torch.float32)


@pytest.mark.parametrize("which", ["hidden", "weight", "bias"])
def test_triton_gradient_to_one_input(device, which):
    # Only one input requires a gradient: each backward kernel is skipped or run alone.
    hidden, weight, bias, targets, inv_t, g_logp, g_ent = _inputs(torch.float32, device)
    leaves = {"hidden": hidden, "weight": weight, "bias": bias}
    leaves[which] = leaves[which].clone().requires_grad_()
    logp, ent = linear_token_logprobs(
        leaves["hidden"], leaves["weight"], targets, bias=leaves["bias"], inv_temperature=inv_t,
        return_entropy=True, backend="triton",
    )
    (grad,) = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), leaves[which])
    truth = _truth(hidden, weight, bias, targets, inv_t, g_logp, g_ent)
    ref = truth[2 + ["hidden", "weight", "bias"].index(which)]
    assert_close_to_ref(grad.cpu(), ref.cpu(), input_dtype=torch.float32, name=f"d_{which}")


@pytest.mark.parametrize("used", ["logp", "entropy"])
def test_triton_one_output_unused(device, used):
    # The other output gets no gradient at all (None upstream): each term alone is right.
    hidden, weight, bias, targets, inv_t, g_logp, g_ent = _inputs(torch.float32, device)
    if used == "logp":
        g_ent = torch.zeros_like(g_ent)
    else:
        g_logp = torch.zeros_like(g_logp)
    h, w, b = _leaves(hidden, weight, bias)
    logp, ent = linear_token_logprobs(
        h, w, targets, bias=b, inv_temperature=inv_t, return_entropy=True, backend="triton"
    )
    loss = (logp * g_logp).sum() if used == "logp" else (ent * g_ent).sum()
    grads = torch.autograd.grad(loss, (h, w, b))
    truth = _truth(hidden, weight, bias, targets, inv_t, g_logp, g_ent)
    for name, g, t in zip(NAMES[2:], grads, truth[2:]):
        assert_close_to_ref(g.cpu(), t.cpu(), input_dtype=torch.float32, name=name)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_all_rows_ignored(device, backend):
    hidden, weight, bias, _, inv_t, g_logp, g_ent = _inputs(torch.float32, device)
    targets = torch.full((N,), IGNORE, device=device)
    h, w, b = _leaves(hidden, weight, bias)
    logp, ent = linear_token_logprobs(
        h, w, targets, bias=b, inv_temperature=inv_t, return_entropy=True, backend=backend
    )
    assert torch.all(logp == 0) and torch.all(ent == 0)
    grads = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), (h, w, b), allow_unused=True)
    for g in grads:
        assert g is None or torch.all(g == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_backend_matches_float64(device, dtype):
    args = _inputs(dtype, device)
    ours = _ours(*args, backend="torch")
    truth = _truth(*args)
    same = _torch_same_dtype(*args, dtype=dtype) if dtype != torch.float32 else None
    _check_all(ours, truth, same, dtype)


def _masked_vocab_inputs(device, scale):
    args = list(_inputs(torch.float32, device, scale=scale))
    masked = torch.tensor([1, 40, 100], device=device)
    args[3][torch.isin(args[3], masked)] = 2
    args[2] = args[2].clone()
    args[2][masked] = float("-inf")
    return args


def test_reference_backend_masked_vocab(device):
    args = _masked_vocab_inputs(device, scale=1.0)
    _check_all(_ours(*args, backend="torch"), _truth(*args), None, torch.float32)


def test_reference_backend_peaked_logits(device):
    # |s| in the hundreds: the reference must shift by the row max (no cancellation)
    args = _masked_vocab_inputs(device, scale=30.0)
    _check_all(_ours(*args, backend="torch"), _truth(*args), None, torch.float32)


def test_triton_int32_column_offsets_get_unit_stride(device, monkeypatch):
    # A weight whose column offsets (D - 1) * stride(1) would overflow int32 reaches the
    # kernels with unit column stride (the limit is lowered so a tiny shape triggers it).
    monkeypatch.setattr(ltl_module, "INT32_OFFSET_LIMIT", V)
    seen = []
    real = ltl_module._forward

    def spy(launch, *args):
        seen.append((launch.hidden.stride(1), launch.weight.stride(1)))
        return real(launch, *args)

    monkeypatch.setattr(ltl_module, "_forward", spy)
    hidden, weight, bias, targets, inv_t, g_logp, g_ent = _inputs(torch.float32, device)
    weight = weight.T.contiguous().T  # stride(1) = V: (D - 1) * V passes the lowered limit
    ours = _ours(hidden, weight, bias, targets, inv_t, g_logp, g_ent, backend="triton")
    assert seen == [(1, 1)]
    _check_all(ours, _truth(hidden, weight, bias, targets, inv_t, g_logp, g_ent), None, torch.float32)


@pytest.mark.parametrize(
    "kwargs", [dict(block_n=8), dict(block_v=48), dict(block_d=True), dict(num_warps=3), dict(split_tiles=0),
               dict(kept_block_v=8), dict(kept_block_v=96)],
)
def test_tiles_reject_what_tl_dot_cannot_take(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ltl_module.Tiles(**kwargs)


def test_triton_backward_is_deterministic(device):
    args = _inputs(torch.bfloat16, device)
    first = _ours(*args, backend="triton", tiles=SMALL_TILES)
    second = _ours(*args, backend="triton", tiles=SMALL_TILES)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


@pytest.mark.skipif(not interpreting(), reason="counts Triton's interpreter: a CUDA device is present")
def test_triton_work_is_the_four_gemm_floor():
    # Issue 18: forward, one recompute, d_hidden and d_weight: 8 N D V dot FLOPs in all (the
    # old backward recomputed the logits twice: 10), each d_weight / d_bias element stored once
    # (not once per row tile), no atomics. Whole tiles of SMALL_TILES, two vocabulary chunks.
    from bench.cost import count_launches

    n, d, v = 32, 32, 128
    hidden, weight, bias = _leaves(torch.randn(n, d), torch.randn(v, d) * 0.5, torch.randn(v))
    targets = torch.randint(0, v, (n,))

    def fwd_bwd():
        logp, ent = linear_token_logprobs(hidden, weight, targets, bias=bias, return_entropy=True,
                                          backend="triton", tiles=SMALL_TILES)
        (logp + ent).sum().backward()

    recs = [r for r in count_launches(fwd_bwd, torch_ops=False)]
    assert sum(r.total_flops for r in recs) == 8 * n * d * v
    assert sum(r.atomics for r in recs) == 0
    gemm = [r for r in recs if r.name == "_ltl_bwd_gemm_kernel"]
    assert len(gemm) == 2
    assert sum(r.args["dw_ptr"].stored for r in gemm) == v * d * 4 == weight.grad.numel() * 4
    assert sum(r.args["db_ptr"].stored for r in gemm) == v * 4


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """(shape, bytes) of every tensor a factory op (empty, zeros, ...) makes while active, inside
    our custom ops too (their Python bodies run under the mode)."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "erpo_kernels":
            from torch._library.custom_ops import _maybe_get_opdef

            with self:
                return _maybe_get_opdef(func)._init_fn(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("empty", "empty_strided", "zeros", "new_empty", "new_zeros", "empty_like"):
            self.made.append((tuple(out.shape), out.numel() * out.element_size()))
        return out


@pytest.mark.skipif(not interpreting(), reason="CPU tensors through Triton's interpreter: a CUDA device is present")
@pytest.mark.parametrize("n, v", [(40, 211), (23, 150)])
def test_triton_backward_workspace(n, v):
    # Issue 18: besides gradient-sized buffers ([N, D] / [V, D] / [V]) the backward allocates one
    # vocabulary chunk's dr [N, C] in the input dtype and, with a bias, fp32 column sums per row
    # tile: at N = 8192, D = 4096, V = 151,936 bf16 (C = 4096) that is 67 MB (+2 MB with a bias),
    # under 3% of a bf16 [N, V] (75 MB). (The forward's per-chunk statistics, 16 bytes per row
    # per chunk, are freed before it.)
    d = 24
    hidden, weight, bias = _leaves(*(torch.randn(*s).to(torch.bfloat16) for s in ((n, d), (v, d), (v,))))
    logp = linear_token_logprobs(hidden, weight, torch.randint(0, v, (n,)), bias=bias, backend="triton",
                                 tiles=SMALL_TILES)
    with _Allocations() as alloc:
        logp.sum().backward()
    gradient_sized = {(n, d), (v, d), (v,)}
    workspace = sum(b for shape, b in alloc.made if shape not in gradient_sized)

    def expected(n, chunk, tiles, itemsize=2):
        return n * chunk * itemsize + -(-n // tiles.block_n) * chunk * 4

    small_chunk = SMALL_TILES.split_tiles * SMALL_TILES.block_v
    assert workspace == expected(n, small_chunk, SMALL_TILES)
    n_t, v_t = 8192, 151_936
    for cap in ARCHITECTURES + (None,):
        cfg = default_tiles("linear_token_logprobs", torch.bfloat16, cap)
        assert expected(n_t, cfg.split_tiles * cfg.block_v, cfg) <= 0.03 * n_t * v_t * 2, cap


def _bad_input_cases(device):
    h = torch.randn(N, D, device=device)
    w = torch.randn(V, D, device=device)
    t = torch.randint(0, V, (N,), device=device)
    out_of_range = t.clone()
    out_of_range[3] = V
    return [
        ("weight", dict(hidden=h, weight=torch.randn(V, D + 1, device=device), targets=t)),
        ("weight", dict(hidden=h, weight=w.to(torch.bfloat16), targets=t)),
        ("bias has 210 entries, expected 211 .one per vocabulary row of weight.",
         dict(hidden=h, weight=w, targets=t, bias=torch.randn(V - 1, device=device))),
        ("bias", dict(hidden=h, weight=w, targets=t, bias=torch.randn(V, device=device).half())),
        ("targets", dict(hidden=h, weight=w, targets=out_of_range)),
        ("targets", dict(hidden=h, weight=w, targets=t.float())),
        ("inv_temperature", dict(hidden=h, weight=w, targets=t, inv_temperature=torch.ones(N - 1, device=device))),
        ("inv_temperature", dict(hidden=h, weight=w, targets=t, inv_temperature=-1.0)),
        ("hidden", dict(hidden=h.to(torch.int32), weight=w, targets=t)),
        ("hidden", dict(hidden=h.double(), weight=w.double(), targets=t)),  # fp64 has no kernel
        ("ignore_index", dict(hidden=h, weight=w, targets=t, ignore_index=-100.0)),
        ("softcap", dict(hidden=h, weight=w, targets=t, softcap=0.0)),
        ("softcap", dict(hidden=h, weight=w, targets=t, softcap=float("nan"))),
        ("logit_scale", dict(hidden=h, weight=w, targets=t, logit_scale=-2.0)),
        ("logit_scale", dict(hidden=h, weight=w, targets=t, logit_scale="1")),
    ]


@pytest.mark.parametrize("case", range(len(_bad_input_cases("cpu"))))
def test_bad_inputs_raise_value_error_naming_the_argument(device, case):
    name, kwargs = _bad_input_cases(device)[case]
    hidden, weight, targets = kwargs.pop("hidden"), kwargs.pop("weight"), kwargs.pop("targets")
    with pytest.raises(ValueError, match=name):
        linear_token_logprobs(hidden, weight, targets, backend="triton", **kwargs)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "options", [dict(softcap=4.0), dict(logit_scale=0.43), dict(softcap=3.0, logit_scale=2.2)], ids=lambda o: "+".join(o)
)
def test_softcap_and_logit_scale_match_float64(device, tiles, dtype, backend, options):
    # scale first, then the Gemma-2 cap softcap * tanh(z / softcap), then 1/T; with a bias
    # (inside the scaled logits) and logits large enough to reach tanh's saturation
    args = _inputs(dtype, device, scale=3.0)
    ours = _ours(*args, backend=backend, tiles=tiles, **options)
    truth = _truth(*args, **options)
    same = _torch_same_dtype(*args, dtype=dtype, **options) if dtype != torch.float32 else None
    _check_all(ours, truth, same, dtype)
    valid = args[3] != IGNORE
    assert torch.all(ours[0][~valid] == 0) and torch.all(ours[2][~valid] == 0)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_validate_false_reads_no_values(device, backend):
    # validate=False: no check reads targets or inv_temperature on the host (a GPU sync),
    # forward or backward; valid input gives exactly the validated result.
    hidden, weight, bias, targets, inv_t, g_logp, g_ent = _inputs(torch.float32, device)
    h, w, b = _leaves(hidden, weight, bias)
    with no_host_reads():
        logp, ent = linear_token_logprobs(
            h, w, targets, bias=b, inv_temperature=inv_t, return_entropy=True, backend=backend, validate=False
        )
        grads = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), (h, w, b))
    want = _ours(hidden, weight, bias, targets, inv_t, g_logp, g_ent, backend=backend)
    for a, b_ in zip((logp, ent, *grads), want):
        assert torch.equal(a, b_)
    with no_host_reads(), pytest.raises(HostRead):  # the detector sees validation's reads
        linear_token_logprobs(hidden, weight, targets, inv_temperature=inv_t, backend=backend)
    with pytest.raises(ValueError, match="targets"):  # structure is still checked
        linear_token_logprobs(hidden, weight, targets[:-1], backend=backend, validate=False)
