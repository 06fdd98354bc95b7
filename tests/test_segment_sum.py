"""segment_sum: Triton forward (per-segment sums) and backward (a gather) against a
float64 reference written here, plus the torch backend and input validation."""
import pytest
import torch

from erpo_kernels import segment_sum
from erpo_kernels.segment_sum import BLOCK

from _compare import assert_close_to_ref
from _host_reads import HostRead, no_host_reads

LOW_PRECISION = (torch.bfloat16, torch.float16)

# (N, cu_seqlens), always from 0 to N: empty segments inside, empty first and last
# segments, no segment at all, every segment empty, and segments longer than BLOCK.
LAYOUTS = {
    "covers_all": (40, [0, 5, 5, 12, 13, 40]),
    "empty_ends": (37, [0, 0, 10, 11, 37, 37]),
    "no_segment": (0, [0]),
    "all_empty": (0, [0, 0, 0]),
    "long": (2 * BLOCK + 301, [0, 4, BLOCK + 5, 2 * BLOCK + 290, 2 * BLOCK + 301]),
}


def _spans(cu):
    return list(zip(cu[:-1], cu[1:]))


def _per_segment_sum(values: torch.Tensor, cu) -> torch.Tensor:
    """Plain torch, in values' dtype: one .sum() per segment (empty sums are 0)."""
    sums = [values[a:b].sum() for a, b in _spans(cu)]
    return torch.stack(sums) if sums else values[:0] * 0


def _check(values, cu, backend, g=None):
    """Forward and backward of segment_sum against float64 and (low precision) PyTorch."""
    dtype = values.dtype
    cu_t = torch.tensor(cu, dtype=torch.int64, device=values.device)
    x = values.detach().clone().requires_grad_()
    out = segment_sum(x, cu_t, backend=backend)
    assert out.dtype == dtype and out.shape == (len(cu) - 1,)
    if g is None:
        g = torch.randn(out.shape, device=values.device).to(dtype)
    out.backward(g)

    x64 = values.detach().double().requires_grad_()
    ref = _per_segment_sum(x64, cu)
    ref.backward(g.double())

    xs = values.detach().clone().requires_grad_()
    same = _per_segment_sum(xs, cu)
    same.backward(g)

    assert_close_to_ref(out.detach(), ref.detach(), same.detach(), input_dtype=dtype, name="segment sums")
    assert x.grad.dtype == dtype
    assert_close_to_ref(x.grad, x64.grad, xs.grad, input_dtype=dtype, name="d values")
    return x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_triton_matches_float64(device, dtype, layout):
    n, cu = LAYOUTS[layout]
    values = (torch.randn(n, device=device) * 3).to(dtype)
    _check(values, cu, "triton")


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_cu_seqlens_int32_and_int64_agree(device, index_dtype):
    n, cu = LAYOUTS["empty_ends"]
    values = torch.randn(n, device=device, requires_grad=True)
    out = segment_sum(values, torch.tensor(cu, dtype=index_dtype, device=device), backend="triton")
    expected = _per_segment_sum(values.detach().double(), cu)
    assert_close_to_ref(out.detach(), expected, name="sums")


def test_non_contiguous_values(device):
    base = torch.randn(2 * 41, device=device, requires_grad=True)
    values = base[::2]  # stride 2
    cu = [0, 9, 9, 41]
    out = segment_sum(values, torch.tensor(cu, device=device), backend="triton")
    g = torch.randn(3, device=device)
    out.backward(g)
    ref = _per_segment_sum(values.detach().double(), cu)
    assert_close_to_ref(out.detach(), ref, name="sums")
    expected = torch.zeros(82, dtype=torch.float64, device=device)
    for s, (a, b) in enumerate(_spans(cu)):
        expected[2 * a : 2 * b : 2] = g[s].double()
    assert torch.equal(base.grad.double(), expected)


def test_empty_values(device):
    values = torch.zeros(0, device=device, requires_grad=True)
    out = segment_sum(values, torch.zeros(3, dtype=torch.int64, device=device), backend="triton")
    assert out.shape == (2,) and bool((out == 0).all())
    out.sum().backward()
    assert values.grad.shape == (0,)


def test_fp64_first_and_second_derivatives(device):
    """fp64 runs in the kernel (fp64 accumulation); the backward is itself differentiable."""
    cu = torch.tensor([0, 4, 4, 11], device=device)
    values = torch.randn(11, dtype=torch.float64, device=device, requires_grad=True)
    out = segment_sum(values, cu, backend="triton")
    assert out.dtype == torch.float64
    assert_close_to_ref(out.detach(), _per_segment_sum(values.detach(), cu.tolist()), name="fp64 sums")
    f = lambda v: segment_sum(v, cu, backend="triton")  # noqa: E731
    assert torch.autograd.gradcheck(f, (values,))
    assert torch.autograd.gradgradcheck(f, (values,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_torch_backend_matches_float64(device, dtype, layout):
    n, cu = LAYOUTS[layout]
    _check((torch.randn(n, device=device) * 3).to(dtype), cu, "torch")


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_torch_backend_low_precision_long_segment(device, dtype):
    n, cu = LAYOUTS["long"]
    _check((torch.randn(n, device=device) * 3).to(dtype), cu, "torch")


BAD_CU = {
    "non_monotone": [0, 5, 3, 10],
    "above_n": [0, 4, 11],
    "negative": [-1, 4, 10],
    "not_starting_at_0": [2, 4, 10],  # would drop values[:2]
    "not_ending_at_n": [0, 4, 8],  # would drop values[8:]
    "empty": [],
}


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", list(BAD_CU))
def test_bad_cu_seqlens_values(device, case, backend):
    values = torch.randn(10, device=device)
    with pytest.raises(ValueError, match="cu_seqlens"):
        segment_sum(values, torch.tensor(BAD_CU[case], dtype=torch.int64, device=device), backend=backend)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_validate_false_reads_no_values(device, backend):
    # validate=False: no check reads cu_seqlens on the host (what would sync a GPU),
    # and valid input gives the same sums as with validation.
    n, cu = LAYOUTS["covers_all"]
    values = torch.randn(n, device=device, requires_grad=True)
    cu_t = torch.tensor(cu, device=device)
    with no_host_reads():
        out = segment_sum(values, cu_t, backend=backend, validate=False)
        out.sum().backward()
    assert torch.equal(out, segment_sum(values, cu_t, backend=backend))
    with no_host_reads(), pytest.raises(HostRead):  # the detector sees validation's reads
        segment_sum(values, cu_t, backend=backend)
    # and the value checks are really skipped: a cu_seqlens ending early is not refused
    segment_sum(values, torch.tensor([0, 4, 8], device=device), backend=backend, validate=False)


def test_bad_cu_seqlens_dtype_and_rank(device):
    values = torch.randn(10, device=device)
    with pytest.raises(ValueError, match="cu_seqlens"):
        segment_sum(values, torch.tensor([0.0, 4.0, 10.0], device=device), backend="triton")
    with pytest.raises(ValueError, match="cu_seqlens"):
        segment_sum(values, torch.tensor([[0, 4], [4, 10]], device=device), backend="triton")
    with pytest.raises(ValueError, match="cu_seqlens"):
        segment_sum(values, [0, 4, 10], backend="triton")


def test_bad_values(device):
    cu = torch.tensor([0, 2, 4], device=device)
    with pytest.raises(ValueError, match="values"):
        segment_sum(torch.randn(2, 2, device=device), cu, backend="triton")
    with pytest.raises(ValueError, match="values"):
        segment_sum(torch.arange(4, device=device), cu, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        segment_sum(torch.randn(4, device=device), cu, backend="cuda")


def test_a_backend_name_is_checked_in_one_place(device):
    """Every op, TrainConfig, TRL and verl name their backend setting through
    erpo_kernels.check_backend (BACKENDS); an op's own argument is `backend`."""
    from erpo_kernels import BACKENDS, check_backend

    cu = torch.tensor([0, 2, 4], device=device)
    with pytest.raises(ValueError, match="^backend must be one of auto, triton, torch, got 'fast'$"):
        segment_sum(torch.randn(4, device=device), cu, backend="fast")
    with pytest.raises(ValueError, match="^policy_loss.kernel_backend must be one of auto, triton, torch, got 'cuda'$"):
        check_backend("cuda", "policy_loss.kernel_backend")
    for backend in BACKENDS:
        check_backend(backend)
