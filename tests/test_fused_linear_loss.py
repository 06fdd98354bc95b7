"""fused_linear_loss.LinearLogprobsChunks (erpo_loss's fused path, op side): log-probs and
gradients of chunks of rows from logits computed once, against linear_token_logprobs'
forward + backward (fp32: within 1e-5) and a float64 reference (bf16: the same criterion
as linear_token_logprobs' tests), with both product engines (Tiles.gemm_engine)."""
from dataclasses import replace

import pytest
import torch

from _compare import assert_close_to_ref
from erpo_kernels import linear_token_logprobs
from erpo_kernels.fused_linear_loss import LinearLogprobsChunks, rows_for_budget
from test_linear_token_logprobs import IGNORE, SMALL_TILES, V, _inputs, _ours, _truth, _torch_same_dtype

CHUNKS = {"one": [(0, 37)], "three": [(0, 11), (11, 30), (30, 37)]}


def _fused(hidden, weight, bias, targets, inv_t, g_logp, g_ent, *, chunks, tiles, want_entropy=True, **options):
    op = LinearLogprobsChunks(hidden, weight, bias, max_rows=max(b - a for a, b in chunks), n_chunks=len(chunks),
                              need=(True, True, bias is not None), tiles=tiles, ignore_index=IGNORE, **options)
    logps, ents = [], []
    for a, b in chunks:
        logp, ent = op.forward(a, b, targets[a:b], inv_t[a:b], want_entropy)
        op.backward(g_logp[a:b], g_ent[a:b] if want_entropy else None)
        logps.append(logp)
        ents.append(ent)
    grads = op.gradients()
    return (torch.cat(logps), torch.cat(ents) if want_entropy else None, *grads)


SOFTCAP = dict(softcap=3.0, logit_scale=1.7)


@pytest.mark.parametrize("engine,chunks,options", [(0, "three", {}), (0, "one", SOFTCAP), (1, "three", SOFTCAP)])
def test_fp32_equals_the_four_gemm_op(device, engine, chunks, options):
    args = _inputs(torch.float32, device)
    tiles = replace(SMALL_TILES, gemm_engine=engine)
    ours = _fused(*args, chunks=CHUNKS[chunks], tiles=tiles, **options)
    ref = _ours(*args, backend="triton", tiles=SMALL_TILES, **options)
    for name, o, r in zip(("logp", "entropy", "d_hidden", "d_weight", "d_bias"), ours, ref):
        assert o.dtype == r.dtype, name
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5, msg=name)
    assert torch.all(ours[2][args[3] == IGNORE] == 0)


@pytest.mark.parametrize("engine", [0, 1])
def test_bf16_matches_float64(device, engine):
    dtype = torch.bfloat16
    args = _inputs(dtype, device)
    ours = _fused(*args, chunks=CHUNKS["three"], tiles=replace(SMALL_TILES, gemm_engine=engine))
    truth, same = _truth(*args), _torch_same_dtype(*args, dtype=dtype)
    for name, o, t, s in zip(("logp", "entropy", "d_hidden", "d_weight", "d_bias"), ours, truth, same):
        assert o.dtype == (torch.float32 if name in ("logp", "entropy") else dtype), name
        assert_close_to_ref(o.cpu(), t.cpu(), s.cpu(), input_dtype=dtype, name=name)


def test_no_entropy_no_bias_and_deterministic(device):
    hidden, weight, _, targets, inv_t, g_logp, g_ent = _inputs(torch.float32, device)
    args = (hidden, weight, None, targets, inv_t, g_logp, g_ent)
    first = _fused(*args, chunks=CHUNKS["three"], tiles=SMALL_TILES, want_entropy=False)
    again = _fused(*args, chunks=CHUNKS["three"], tiles=SMALL_TILES, want_entropy=False)
    ref = _ours(*args, backend="triton", tiles=SMALL_TILES, return_entropy=False)
    for o, a, r in zip(first, again, ref):
        if r is None:
            assert o is None and a is None
            continue
        assert torch.equal(o, a)
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)


def test_rows_for_budget():
    assert rows_for_budget(1 << 30, 151_936) == 1766
    assert rows_for_budget(10, V) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_backward_on_torch_products(device, dtype):
    """linear_token_logprobs' own backward with Tiles.gemm_engine = 1 (torch matmuls for its
    products): fp32 equal to our products within 1e-5, bf16 as close to float64 as PyTorch."""
    args = _inputs(dtype, device)
    ours = _ours(*args, backend="triton", tiles=replace(SMALL_TILES, gemm_engine=1))
    if dtype == torch.float32:
        ref = _ours(*args, backend="triton", tiles=SMALL_TILES)
        for name, o, r in zip(("logp", "entropy", "d_hidden", "d_weight", "d_bias"), ours, ref):
            assert o.dtype == r.dtype, name
            torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5, msg=name)
    else:
        truth, same = _truth(*args), _torch_same_dtype(*args, dtype=dtype)
        for name, o, t, s in zip(("logp", "entropy", "d_hidden", "d_weight", "d_bias"), ours, truth, same):
            assert_close_to_ref(o.cpu(), t.cpu(), s.cpu(), input_dtype=dtype, name=name)
    assert torch.all(ours[2][args[3] == IGNORE] == 0)
