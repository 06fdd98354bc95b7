"""Batch invariance (issue 13.4): a row's log-prob, entropy and its own gradient row
(d_logits for token_logprobs, d_hidden for linear_token_logprobs) are bit-identical
whatever else is in the batch: the number of rows, the other rows, ignored rows
around it, and its position (inside a row tile and across tiles). Triton backend,
compiled on a GPU (bench/gpu_check.sh runs this file there) and in the interpreter
here; docs/batch-invariance.md says what holds where.

In the interpreter `tl.dot` is numpy's matmul, and BLAS may round a row of a product
differently by its position in the tile (OpenBLAS's Haswell kernels do: issue 19.1),
which compiled tensor-core and FMA dots never do. So here the interpreter's dot is
replaced, for this file only, by a product that sums every element in the same k order
wherever its row sits (`_row_independent_dot`): the test then checks the kernels' own
order of work (vocabulary chunks, merges, accumulation over V) whatever BLAS numpy
uses, and a split that depended on the batch would still show.

d_weight and d_bias sum over the batch's rows and are outside the guarantee. The
forward's vocabulary chunks depend on V and the tiles only, so "the number of
vocabulary splits" cannot change with the batch.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from erpo_kernels import linear_token_logprobs, token_logprobs
from erpo_kernels._triton import interpreting

ltl = importlib.import_module("erpo_kernels.linear_token_logprobs")
tlp = importlib.import_module("erpo_kernels.token_logprobs")

IGNORE = -100
SMALL_TILES = ltl.Tiles(
    block_n=16, block_v=32, block_d=16, num_warps=4, split_tiles=2, gemm_n=16, gemm_v=16, gemm_d=16, gemm_warps=4,
    gemm_k=16,
)
D, V = 24, 211
# (N, position of the row, rows ignored around it)
PLACEMENTS = [(1, 0, ()), (5, 3, (2, 4)), (37, 17, (15, 16, 18)), (70, 69, (0, 68)), (70, 40, ())]


def _row_independent_dot(self, a, b, acc, input_precision, max_num_imprecise_acc):
    """The interpreter's tl.dot (acc + a @ b) without BLAS: out[i, j] = acc[i, j] +
    a[i, 0] b[0, j] + a[i, 1] b[1, j] + ..., left to right in the accumulator's dtype,
    so an element's rounding depends on row i of a and column j of b only."""
    from triton.runtime.interpreter import TensorHandle

    x, y = a.data.astype(acc.data.dtype), b.data.astype(acc.data.dtype)
    assert x.ndim == 2 and y.ndim == 2, "2-D dots only"
    out = acc.data.copy()
    for k in range(x.shape[1]):
        out += x[:, k : k + 1] * y[k : k + 1, :]
    return TensorHandle(out, acc.dtype.scalar)


@pytest.fixture(autouse=True)
def _dots_independent_of_row_position(monkeypatch):
    """Under the interpreter, tl.dot rounds each element independently of its row's
    position in the tile, as compiled dots do (see the module docstring)."""
    if interpreting():
        from triton.runtime.interpreter import InterpreterBuilder

        monkeypatch.setattr(InterpreterBuilder, "create_dot", _row_independent_dot)


def _batch(n, pos, ignored, row, make_row, make_target, device):
    """A batch of n fresh random rows with `row` at `pos`, and targets (ignored where asked)."""
    rows = torch.stack([make_row() for _ in range(n)])
    rows[pos] = row
    targets = torch.tensor([make_target() for _ in range(n)])
    targets[list(ignored)] = IGNORE
    return rows.to(device), targets.to(device)


def _check_same(results):
    first = results[0]
    for other in results[1:]:
        for name, a, b in zip(("logp", "entropy", "gradient row"), first, other):
            assert torch.equal(a, b), f"{name} differs: {a} vs {b}"


@pytest.mark.parametrize(
    "dtype,tiles,softcap",
    [
        (torch.float32, "small", None),
        (torch.bfloat16, "small", 3.0),
        (torch.bfloat16, "default", None),
        (torch.float32, "default", 3.0),
    ],
    ids=["float32-small", "bfloat16-small-softcap", "bfloat16-default", "float32-default-softcap"],
)
def test_linear_token_logprobs_row_is_batch_invariant(device, dtype, tiles, softcap):
    cfg = SMALL_TILES if tiles == "small" else None
    weight = (torch.randn(V, D) * 0.5).to(dtype).to(device)
    bias = torch.randn(V).to(dtype).to(device)
    row = torch.randn(D).to(dtype)
    target, inv_t_row, g_row, ge_row = 7, 0.8, 0.6, -1.3
    results = []
    for n, pos, ignored in PLACEMENTS:
        hidden, targets = _batch(n, pos, ignored, row, lambda: torch.randn(D).to(dtype),
                                 lambda: int(torch.randint(0, V, ())), device)  # fmt: skip
        targets[pos] = target
        inv_t = (torch.rand(n) + 0.5).to(device)
        inv_t[pos] = inv_t_row
        g_logp, g_ent = torch.randn(n, device=device), torch.randn(n, device=device)
        g_logp[pos], g_ent[pos] = g_row, ge_row
        h = hidden.clone().requires_grad_()
        logp, ent = linear_token_logprobs(
            h, weight, targets, bias=bias, inv_temperature=inv_t, return_entropy=True, softcap=softcap,
            backend="triton", tiles=cfg,
        )
        (d_h,) = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), h)
        results.append((logp[pos], ent[pos], d_h[pos]))
    _check_same(results)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_token_logprobs_row_is_batch_invariant(device, dtype):
    tiles = tlp.RowTiles(fwd_max_block_v=64, bwd_max_block_v=128)  # several blocks per row
    row = (torch.randn(V) * 4).to(dtype)
    target = 11
    results = []
    for n, pos, ignored in PLACEMENTS:
        logits, targets = _batch(n, pos, ignored, row, lambda: (torch.randn(V) * 4).to(dtype),
                                 lambda: int(torch.randint(0, V, ())), device)  # fmt: skip
        targets[pos] = target
        inv_t = (torch.rand(n) + 0.5).to(device)
        inv_t[pos] = 1.3
        g_logp, g_ent = torch.randn(n, device=device), torch.randn(n, device=device)
        g_logp[pos], g_ent[pos] = -0.4, 2.0
        z = logits.clone().requires_grad_()
        logp, ent = token_logprobs(
            z, targets, inv_temperature=inv_t, return_entropy=True, softcap=20.0, backend="triton", tiles=tiles
        )
        (d_z,) = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), z)
        results.append((logp[pos], ent[pos], d_z[pos]))
    _check_same(results)


def test_fused_chunks_row_is_batch_invariant(device):
    """erpo_loss's fused path (fused_linear_loss.LinearLogprobsChunks, our products): a
    row's logp, entropy and d_hidden row are the same bits whatever the rest of its chunk
    and whichever chunk holds it."""
    from erpo_kernels.fused_linear_loss import LinearLogprobsChunks

    dtype, softcap = torch.bfloat16, 3.0
    weight = (torch.randn(V, D) * 0.5).to(dtype).to(device)
    bias = torch.randn(V).to(dtype).to(device)
    row = torch.randn(D).to(dtype)
    results = []
    for n, pos, ignored in PLACEMENTS[:3]:
        hidden, targets = _batch(n, pos, ignored, row, lambda: torch.randn(D).to(dtype),
                                 lambda: int(torch.randint(0, V, ())), device)  # fmt: skip
        targets[pos] = 7
        inv_t = (torch.rand(n) + 0.5).to(device)
        inv_t[pos] = 0.8
        g_logp, g_ent = torch.randn(n, device=device), torch.randn(n, device=device)
        g_logp[pos], g_ent[pos] = 0.6, -1.3
        cut = [0, pos, n] if 0 < pos < n - 1 else [0, n]  # the row opens a chunk, or the batch is one
        op = LinearLogprobsChunks(hidden, weight, bias, max_rows=n, n_chunks=len(cut) - 1, need=(True, False, False),
                                  softcap=softcap, tiles=SMALL_TILES, ignore_index=IGNORE)  # fmt: skip
        out = []
        for a, b in zip(cut[:-1], cut[1:]):
            logp, ent = op.forward(a, b, targets[a:b], inv_t[a:b], True)
            op.backward(g_logp[a:b], g_ent[a:b])
            out.append((a, logp, ent))
        a, logp, ent = next(o for o in out if o[0] <= pos < o[0] + o[1].shape[0])
        results.append((logp[pos - a], ent[pos - a], op.gradients()[0][pos]))
    _check_same(results)
