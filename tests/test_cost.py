"""bench.cost: the counter, checked on toy kernels and a toy torch function whose costs are known
by hand. The toy kernels are interpreted Triton functions on CPU tensors whatever the machine."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as interp

from bench import cost


def _interpreted(fn):
    return interp.InterpretedFunction(fn)


def _copy(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y + offs, tl.load(x + offs, mask=m), mask=m)


def _matmul(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WIDEN: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(a + rm[:, None] * K + rk[None, :])
        y = tl.load(b + rk[:, None] * N + rn[None, :])
        if WIDEN:
            x = x.to(tl.float32)
            y = y.to(tl.float32)
        acc = tl.dot(x, y, acc)
    tl.store(c + rm[:, None] * N + rn[None, :], acc)


def _row_sum(x, out, total, C, BLOCK: tl.constexpr):
    """out[r] = sum of row r (a masked loop over columns); total += out[r] with an atomic."""
    r = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.float32)
    for c0 in range(0, C, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        acc += tl.load(x + r * C + cols, mask=cols < C, other=0.0)
    s = tl.sum(acc, axis=0)
    tl.store(out + r, s)
    tl.atomic_add(total, s)


COPY, MATMUL, ROW_SUM = (_interpreted(f) for f in (_copy, _matmul, _row_sum))


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_masked_copy_counts_active_lanes_only():
    x = torch.randn(1000)
    y = torch.empty_like(x)
    (rec,) = cost.count_launches(lambda: COPY[(triton.cdiv(1000, 128),)](x, y, 1000, BLOCK=128), torch_ops=False)
    assert torch.equal(x, y)
    assert (rec.name, rec.kind, rec.grid, rec.programs) == ("_copy", "triton", (8, 1, 1), 8)
    # 8 x 128 lanes, 1000 active: 4000 bytes each way, not 4096
    assert (rec.loaded, rec.stored, rec.distinct_loaded, rec.distinct_stored, rec.distinct) == (4000, 4000, 4000,
                                                                                               4000, 8000)
    assert rec.flops == {} and rec.atomics == 0
    assert rec.args["x"].loaded == 4000 and rec.args["x"].stored == 0 and rec.args["x"].private
    assert rec.args["y"].stored == 4000 and rec.args["y"].private


@pytest.mark.parametrize("dtype,widen,key", [(torch.float32, False, "fp32"), (torch.bfloat16, False, "bf16"),
                                             (torch.bfloat16, True, "bf16>fp32")])
def test_tiled_matmul_bytes_reuse_and_flops(dtype, widen, key):
    M, N, K, B = 64, 32, 48, 16
    a, b = torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype)
    c = torch.empty(M, N)
    (rec,) = cost.count_launches(
        lambda: MATMUL[(M // B, N // B)](a, b, c, M, N, K, BM=B, BN=B, BK=B, WIDEN=widen), torch_ops=False
    )
    e = a.element_size()
    assert rec.programs == (M // B) * (N // B)
    assert rec.flops == {key: 2 * M * N * K}
    # each of the N / B column tiles reads all of a; each of the M / B row tiles reads all of b
    assert rec.args["a"].loaded == (N // B) * M * K * e and rec.args["a"].distinct == M * K * e
    assert rec.args["b"].loaded == (M // B) * K * N * e and rec.args["b"].distinct == K * N * e
    assert not rec.args["a"].private and rec.args["a"].program_distinct == rec.args["a"].loaded
    assert rec.args["c"].stored == rec.args["c"].distinct == M * N * 4 and rec.args["c"].private
    assert rec.distinct == (M * K + K * N) * e + M * N * 4
    # counting computes a bf16 dot from the values (the plain interpreter multiplies the bit patterns)
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-5, atol=1e-4)


def test_reduction_loop_and_atomics():
    R, C = 5, 100
    x = torch.randn(R, C)
    out, total = torch.empty(R), torch.zeros(1)
    (rec,) = cost.count_launches(lambda: ROW_SUM[(R,)](x, out, total, C, BLOCK=32), torch_ops=False)
    torch.testing.assert_close(out, x.sum(1))
    assert rec.programs == R and rec.atomics == R
    assert rec.args["x"].loaded == R * C * 4 and rec.args["x"].private  # 4 masked tiles of 32: 100 active
    assert rec.args["out"].stored == R * 4
    # the atomic reads and writes the one float: 5 times each, 4 distinct bytes, touched by every program
    t = rec.args["total"]
    assert (t.loaded, t.stored, t.distinct, t.program_distinct) == (R * 4, R * 4, 4, R * 4)


def test_torch_ops_counted_outside_kernels():
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    recs = cost.count_launches(lambda: (x @ w.t().t()).relu().sum())
    by = {r.name: r for r in cost.merge_by_name(recs)}
    assert by["aten.mm"].flops == {"fp32": 2 * 8 * 16 * 4}
    assert (by["aten.mm"].loaded, by["aten.mm"].stored) == ((8 * 16 + 16 * 4) * 4, 8 * 4 * 4)
    assert by["aten.t"].loaded == by["aten.t"].stored == 0  # views move nothing
    assert (by["aten.relu"].loaded, by["aten.relu"].stored) == (128, 128)
    assert (by["aten.sum"].loaded, by["aten.sum"].stored) == (128, 4)
    assert all(r.kind == "torch" for r in recs)


def test_torch_ops_inside_a_launch_are_not_counted_and_hooks_are_restored():
    x = torch.randn(300)
    y = torch.empty_like(x)
    before = dict(interp.interpreter_builder.__dict__)
    call = interp.GridExecutor.__call__
    with cost.counting(phase="forward") as recs:
        COPY[(3,)](x, y, 300, BLOCK=128)
    assert [(r.name, r.phase) for r in recs] == [("_copy", "forward")]
    assert interp.interpreter_builder.__dict__.keys() == before.keys()
    assert interp.GridExecutor.__call__ is call
    assert cost.count_launches(lambda: COPY[(3,)](x, y, 300, BLOCK=128), torch_ops=False)[0].loaded == 1200


def test_refuses_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        cost.count_launches(lambda: None)


def test_distinct_bytes_of_overlapping_programs():
    """Two programs copying overlapping windows: loads 2 x 64 floats, 96 distinct."""
    x = torch.randn(128)
    y = torch.empty(64)

    def window(x, y, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(y + offs, tl.load(x + tl.program_id(0) * 32 + offs))

    (rec,) = cost.count_launches(lambda: _interpreted(window)[(2,)](x, y, BLOCK=64), torch_ops=False)
    assert rec.args["x"].loaded == 2 * 64 * 4 and rec.args["x"].distinct == 96 * 4
    assert rec.args["x"].program_distinct == 2 * 64 * 4 and not rec.args["x"].private
    assert rec.args["y"].stored == 2 * 64 * 4 and rec.args["y"].distinct == 64 * 4
    np.testing.assert_array_equal(y.numpy(), x[32:96].numpy())
