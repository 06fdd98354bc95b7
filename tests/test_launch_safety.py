"""What a GPU launch gets right that the interpreter at small shapes cannot show (issue 35):
64-bit offsets past 2**31 elements, out-of-range targets under validate=False, strided
weights over the int32 column guard, and the device every launch runs on.

Cheap by design: the offset check runs one merge program with its memory accesses
recorded instead of performed (no 8 GiB buffer), the rest at tiny shapes.
"""
import importlib

import numpy as np
import pytest
import torch

ltl = importlib.import_module("erpo_kernels.linear_token_logprobs")


# ------------------------------------------------------------------ 64-bit split offsets


@pytest.fixture
def recorded_loads(monkeypatch):
    """Every load address the interpreter forms (all lanes, masked or not), with no memory
    touched: each load returns its `other` (or zeros). Under the interpreter, integer
    arithmetic has the compiled kernel's widths (an i32 product wraps as on the GPU)."""
    if not ltl.interpreting():
        pytest.skip("records the Triton interpreter's loads: runs where the kernels are interpreted (no GPU)")
    from triton.runtime import interpreter

    seen = []

    def load(self, ptrs, mask, other, cache_policy, is_volatile):
        seen.append(np.array(ptrs.data, dtype=np.uint64).ravel())
        dtype_np = interpreter._get_np_dtype(ptrs.get_element_ty())
        data = np.zeros_like(ptrs.data, dtype=dtype_np) if other is None else np.broadcast_to(other.data,
                                                                                            ptrs.data.shape)
        return interpreter.TensorHandle(np.array(data, dtype=dtype_np), ptrs.get_element_ty())

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", load)
    return seen


def test_merge_kernel_forms_split_offsets_in_64_bits(recorded_loads):
    # The merge reads split k of row p at k * n_rows + p. With 3 splits and n_rows = 2**30 + 3
    # (legal: 262,144-column vocabularies reach splits x N >= 2**31 at N >= 131,072 with small
    # tiles), split 2 starts past 2**31 elements: an int32 product wraps to a negative offset.
    n_rows, splits, block = 2**30 + 3, 3, 16
    stats = [torch.zeros(1) for _ in range(4)]  # addresses only: nothing is read from them
    index = torch.zeros(1, dtype=torch.int64)
    out = [torch.zeros(1) for _ in range(4)]
    ltl._ltl_merge_kernel[(1,)](
        *stats, index, index, *out, n_rows, splits, WANT_ENTROPY=True, BLOCK=block, num_warps=1,
    )
    rows = np.arange(block, dtype=np.uint64)
    got = {a.tobytes() for a in recorded_loads}
    for name, t in zip(("max", "sum", "entropy", "target_logit"), stats):
        for k in range(splits):
            want = np.uint64(t.data_ptr()) + np.uint64(4) * (np.uint64(k * n_rows) + rows)
            formed = want.tobytes() in got
            assert formed, f"{name} of split {k}: the offset {k} * n_rows + row is not formed in 64 bits"


# ------------------------------------------------------------ strided views: one copy per call


def test_strided_weight_over_the_int32_column_guard_is_copied_once(monkeypatch):
    # A transposed view whose column offsets (D - 1) * stride(1) pass int32 is copied to unit
    # stride: once per call (the copy autograd saves for the backward), not again in the
    # backward. The limit is lowered so that tiny shapes reach it.
    from erpo_kernels import linear_token_logprobs

    n, d, v = 5, 16, 40
    monkeypatch.setattr(ltl, "INT32_OFFSET_LIMIT", v)
    copies = []
    real = ltl._int32_safe_columns

    def spy(t):
        out = real(t)
        if out is not t:
            copies.append(tuple(t.shape))
        return out

    monkeypatch.setattr(ltl, "_int32_safe_columns", spy)
    hidden = torch.randn(d, n).T.requires_grad_()  # stride(1) = n: (D - 1) * n passes the lowered limit too
    weight = torch.randn(d, v).T.requires_grad_()  # [V, D], stride(1) = V
    targets = torch.randint(0, v, (n,))
    logp = linear_token_logprobs(hidden, weight, targets, backend="triton")
    g_hidden, g_weight = torch.autograd.grad(logp.sum(), (hidden, weight))
    assert sorted(copies) == [(n, d), (v, d)], copies  # each operand once, forward and backward together
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    want = torch.log_softmax(h64 @ w64.T, dim=-1).gather(1, targets[:, None]).squeeze(1)
    want_h, want_w = torch.autograd.grad(want.sum(), (h64, w64))
    for got, ref in ((logp, want), (g_hidden, want_h), (g_weight, want_w)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


# --------------------------------------------------- validate=False with an out-of-range target


def _logprobs(op, x, w, targets, backend):
    from erpo_kernels import linear_token_logprobs, token_logprobs

    if op == "token_logprobs":
        return token_logprobs(x, targets, return_entropy=True, backend=backend, validate=False)
    return linear_token_logprobs(x, w, targets, return_entropy=True, backend=backend, validate=False)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("op", ["token_logprobs", "linear_token_logprobs"])
def test_out_of_range_target_without_validation_is_a_nan_log_prob_with_no_gradient(op, backend):
    # validate=False lets a target outside [0, V) through. Both ops, on both backends: that row's
    # log-prob is NaN (never a finite value, never a read outside the row), it passes no
    # gradient back, and its entropy (which needs no target) is the row's own. Rows 1 and 2
    # hold V + 3 and -5 (past the row's end, and before its start: the previous row's values).
    n, d, v = 5, 16, 40
    x = torch.randn(n, d) if op == "linear_token_logprobs" else torch.randn(n, v) * 3
    w = torch.randn(v, d) * 0.5
    targets = torch.tensor([7, v + 3, -5, -100, 39])
    bad = torch.tensor([False, True, True, False, False])
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    logp, entropy = _logprobs(op, leaves[0], leaves[1], targets, backend)
    assert torch.isnan(logp[bad]).all() and torch.isfinite(logp[~bad]).all(), logp
    loss = torch.where(torch.isnan(logp), 0.0, logp).sum() + entropy.sum()  # the usual masking of bad rows
    grads = torch.autograd.grad(loss, leaves[:1] if op == "token_logprobs" else leaves)
    # the same rows with an in-range target that gets no gradient: the bad rows' entropy and
    # gradients are exactly theirs
    same = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    want_logp, want_entropy = _logprobs(op, same[0], same[1], torch.where(bad, 0, targets), backend)
    want_loss = torch.where(bad, 0.0, want_logp).sum() + want_entropy.sum()
    want = torch.autograd.grad(want_loss, same[:1] if op == "token_logprobs" else same)
    torch.testing.assert_close(logp[~bad], want_logp[~bad], rtol=0, atol=0)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=0)
    for got, ref in zip(grads, want):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- the device of every launch


def _kernels():
    """{name: kernel} of every @triton.jit kernel of the package (a `*_kernel` launched by an op)."""
    import sys

    import erpo_kernels  # noqa: F401  (loads every op module)

    found = {}
    for name, mod in list(sys.modules.items()):
        if name.startswith("erpo_kernels"):
            for attr, value in vars(mod).items():
                if attr.endswith("_kernel") and hasattr(value, "run") and hasattr(value, "fn"):
                    found[attr] = value
    return found


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch, recorded as (kernel, the device of the innermost device_guard
    entered at that moment or None, the devices of its tensor arguments)."""
    import contextlib
    import sys

    from erpo_kernels import _utils

    guards, seen = [], []
    real_guard = getattr(_utils, "device_guard", None)

    @contextlib.contextmanager
    def recording_guard(device):
        guards.append(torch.device(device))
        try:
            with real_guard(device):
                yield
        finally:
            guards.pop()

    for name, mod in list(sys.modules.items()):
        if name.startswith("erpo_kernels") and real_guard and getattr(mod, "device_guard", None) is real_guard:
            monkeypatch.setattr(mod, "device_guard", recording_guard)
    for cls in {type(k) for k in _kernels().values()}:  # the interpreter's (here) or the JIT's
        real_run = cls.run

        def run(self, *args, _real=real_run, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            seen.append((self.__name__, guards[-1] if guards else None, {t.device for t in tensors}))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "run", run)
    return seen


def _every_op(device, backend="triton"):
    """Forward and backward of every op on `device` (each launch path: token_logprobs out of
    place and in place, linear_token_logprobs with a bias, segment_sum twice differentiated,
    weighted_k3 with weights) -> [outputs and gradients]."""
    from erpo_kernels import linear_token_logprobs, segment_sum, token_logprobs, weighted_k3

    n, d, v = 37, 24, 211
    kw = dict(device=device)
    out = []
    targets = torch.randint(0, v, (n,), **kw)
    targets[3] = -100
    logits = torch.randn(n, v, **kw, requires_grad=True)
    logp, ent = token_logprobs(logits, targets, return_entropy=True, backend=backend)
    out += [logp, ent, *torch.autograd.grad(logp.sum() + 0.5 * ent.sum(), logits)]
    x = logits * 1.0  # an intermediate: inplace_backward writes its gradient over it
    logp = token_logprobs(x, targets, inplace_backward=True, backend=backend)
    out += [logp, *torch.autograd.grad(logp.sum(), logits)]
    hidden = torch.randn(n, d, **kw, requires_grad=True)
    weight = (0.5 * torch.randn(v, d, **kw)).requires_grad_()
    bias = torch.randn(v, **kw, requires_grad=True)
    logp, ent = linear_token_logprobs(hidden, weight, targets, bias=bias, return_entropy=True, backend=backend)
    out += [logp, ent, *torch.autograd.grad(logp.sum() - ent.sum(), (hidden, weight, bias))]
    from erpo_kernels.fused_linear_loss import LinearLogprobsChunks  # erpo_loss's fused path

    chunks = LinearLogprobsChunks(hidden, weight, bias, max_rows=n, n_chunks=1, need=(True, True, True))
    logp_f, ent_f = chunks.forward(0, n, targets, None, True)
    chunks.backward(torch.ones_like(logp_f), -torch.ones_like(ent_f))
    out += [logp_f, ent_f, *chunks.gradients()]
    values = torch.randn(n, **kw, requires_grad=True)
    cu = torch.tensor([0, 5, 5, 20, n], **kw)
    (g,) = torch.autograd.grad(segment_sum(values, cu, backend=backend).pow(2).sum(), values, create_graph=True)
    out += [g, *torch.autograd.grad(g.sum(), values)]  # the gather's backward: a second segment_sum
    ref = torch.randn(n, **kw, requires_grad=True)
    w = torch.rand(n, **kw, requires_grad=True)
    r = weighted_k3(logp.detach().requires_grad_(), ref, w, backend=backend)
    out += [r, *torch.autograd.grad(r, (ref, w))]
    return out


def test_every_launch_runs_under_a_guard_of_its_tensors_device(launches):
    # Triton launches on the current CUDA device, whatever the tensors' (issue 35 item 11):
    # each op enters device_guard(its tensors' device) around its launches. Here on CPU
    # tensors (the guard itself a no-op): every kernel of the package is launched, each launch
    # inside a guard of exactly its tensors' device.
    _every_op(torch.device("cpu"))
    unguarded = sorted({name for name, guard, devices in launches if guard is None or devices != {guard}})
    assert not unguarded, f"launched outside a guard of their tensors' device: {unguarded}"
    assert {name for name, _, _ in launches} == set(_kernels()), set(_kernels()) - {n for n, _, _ in launches}


@pytest.fixture
def one_rank_mesh():
    """A 1-D device mesh of this process alone (gloo, an in-memory store: no launcher)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_the_sharded_lm_head_launches_under_the_guard_and_nans_an_out_of_range_target(launches, one_rank_mesh):
    # The vocabulary-parallel path launches the forward kernels itself (vocab_parallel.py), the
    # backward through the op's; and validate=False with a target outside [0, V) gives NaN there
    # too (the multi-rank merge is checked by tests/test_vocab_parallel.py).
    from torch.distributed.tensor import Shard, distribute_tensor

    from erpo_kernels import linear_token_logprobs

    n, d, v = 6, 16, 40
    hidden = torch.randn(n, d, requires_grad=True)
    weight = distribute_tensor(torch.randn(v, d), one_rank_mesh, [Shard(0)]).requires_grad_()
    targets = torch.tensor([3, v, 39, -100, 0, -7])
    logp = linear_token_logprobs(hidden, weight, targets, backend="triton", validate=False)
    torch.autograd.grad(torch.where(logp.isnan(), 0.0, logp).sum(), (hidden, weight))
    assert logp.isnan().tolist() == [False, True, False, False, False, True]
    assert {"_ltl_fwd_kernel", "_ltl_bwd_dr_kernel", "_ltl_bwd_gemm_kernel"} <= {name for name, _, _ in launches}
    assert all(guard == torch.device("cpu") and devices == {guard} for _, guard, devices in launches), launches


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices (tensors on cuda:1 while cuda:0 is current)")
def test_every_op_runs_on_its_tensors_gpu_while_another_is_current():
    # Model parallel in one process (device_map="auto"): the tensors on cuda:1, cuda:0 current.
    # Without the guard the kernels launch on cuda:0 and read cuda:1's memory from there.
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    got = _every_op(torch.device("cuda:1"))
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0  # the guard restores the caller's device
    torch.manual_seed(0)
    want = _every_op(torch.device("cuda:1"), backend="torch")
    for a, b in zip(got, want):
        assert a.device == torch.device("cuda:1")
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-5)
