"""fused_linear_loss.LinearLogprobsChunks (erpo_loss's fused path, op side): log-probs and
gradients of chunks of rows from logits computed once, against linear_token_logprobs'
forward + backward (fp32: within 1e-5) and a float64 reference (bf16: the same criterion
as linear_token_logprobs' tests), with both product engines (Tiles.gemm_engine); bf16 /
fp16 keep fp16 logits relative to their part's running max (half the bytes), as accurate
as the op's recompute at logits of magnitude 100-500."""
from dataclasses import replace

import pytest
import torch

from _compare import MARGIN, assert_close_to_ref, max_err
from erpo_kernels import fused_linear_loss as fll
from erpo_kernels import linear_token_logprobs, pack_support
from erpo_kernels.tiles import default_tiles
from erpo_kernels.fused_linear_loss import LinearLogprobsChunks, rows_for_budget
from test_linear_token_logprobs import IGNORE, N, SMALL_TILES, V, _inputs, _ours, _truth, _torch_same_dtype

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


def test_kept_forward_runs_its_own_logit_width(device):
    """Tiles.kept_block_v: the kept-logit forward (and the gradient from its kept logits)
    launches with 64-column tiles where the op's are 32 (one part each: the kept maxima per
    64 columns), over the same 64-column chunks; the results still equal the 4-GEMM op's
    (fp32 within 1e-5) and bf16 stays as close to float64 as the op."""
    tiles = replace(SMALL_TILES, kept_block_v=64)
    args = _inputs(torch.float32, device)
    op = LinearLogprobsChunks(*args[:3], max_rows=N, n_chunks=1, need=(True, True, True), tiles=tiles,
                              ignore_index=IGNORE)  # fmt: skip
    assert (op.tiles.block_v, op.tiles.split_tiles, op.chunk) == (64, 1, 64) and op.n_parts == -(-V // 64)
    seen = []
    real = fll._forward
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fll, "_forward", lambda launch, *a: (seen.append(launch.tiles.block_v), real(launch, *a))[1])
        ours = _fused(*args, chunks=CHUNKS["three"], tiles=tiles, **SOFTCAP)
    assert seen == [64, 64, 64]
    ref = _ours(*args, backend="triton", tiles=SMALL_TILES, **SOFTCAP)
    for name, o, r in zip(("logp", "entropy", "d_hidden", "d_weight", "d_bias"), ours, ref):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5, msg=name)
    args = _inputs(torch.bfloat16, device)
    ours = _fused(*args, chunks=CHUNKS["three"], tiles=tiles)
    truth, same = _truth(*args), _torch_same_dtype(*args, dtype=torch.bfloat16)
    for name, o, t, s in zip(("logp", "entropy", "d_hidden", "d_weight", "d_bias"), ours, truth, same):
        assert_close_to_ref(o.cpu(), t.cpu(), s.cpu(), input_dtype=torch.bfloat16, name=name)


def test_hopper_default_kept_forward_matches_float64(device):
    """sm_90's default tiles in the interpreter: the kept-logit forward at 128 x 256 (four parts)
    beside the op's 128 x 128, bf16 with bias, soft cap, entropy and a per-row temperature,
    against float64; one chunk of tiles (split_tiles 1: a 256-column kept chunk) and partial tiles."""
    tiles = replace(default_tiles("linear_token_logprobs", torch.bfloat16, (9, 0)), split_tiles=1)
    assert tiles.kept_forward().block_v == 256 and tiles.block_v == 128
    v = 256 + 211
    dtype = torch.bfloat16
    hidden = torch.randn(N, 24).to(dtype).to(device)
    weight = (torch.randn(v, 24) * 0.5).to(dtype).to(device)
    bias = torch.randn(v).to(dtype).to(device)
    targets = torch.randint(0, v, (N,))
    targets[[0, 5]] = IGNORE
    args = (hidden, weight, bias, targets.to(device), (torch.rand(N) + 0.5).to(device), torch.randn(N).to(device),
            torch.randn(N).to(device))
    ours = _fused(*args, chunks=CHUNKS["three"], tiles=tiles, **SOFTCAP)
    truth = _truth(*args, **SOFTCAP)
    same = _torch_same_dtype(*args, dtype=dtype, **SOFTCAP)
    for name, o, t, s in zip(("logp", "entropy", "d_hidden", "d_weight", "d_bias"), ours, truth, same):
        assert_close_to_ref(o.cpu(), t.cpu(), s.cpu(), input_dtype=dtype, name=name)


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
    """The budget is bytes of kept logits: 4 a logit for fp32 operands, 2 for bf16 / fp16."""
    assert rows_for_budget(1 << 30, 151_936, torch.float32) == 1766
    assert rows_for_budget(1 << 30, 151_936, torch.bfloat16) == rows_for_budget(1 << 30, 151_936, torch.float16) == 3533
    assert rows_for_budget(10, V, torch.float32) == rows_for_budget(10, V, torch.bfloat16) == 1


@pytest.mark.parametrize("block_v", [32, 128], ids=["one-part", "two-parts"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_keeps_fp16_logits_relative_to_the_part_max(device, dtype, block_v):
    """bf16 / fp16 operands: the kept buffer is N x V fp16 values x = s - m (m the forward's
    running max after each part, fp32 per row and part), and at logits of magnitude ~160-510
    (a bias of ~250 times inv_T in [2/3, 2]: s itself in 16 bits would be off by 0.1-2) the
    gradients are as close to float64 as linear_token_logprobs' own (its recompute: fp32
    logits) within MARGIN, and no worse than PyTorch in the dtype."""
    tiles = replace(SMALL_TILES, block_v=block_v, split_tiles=2 if block_v == 32 else 1)
    part = 64 if block_v == 128 else 32
    hidden, weight, _, targets, inv_t, g_logp, g_ent = _inputs(dtype, device)
    bias = (250 + 2 * torch.randn(V)).to(dtype).to(device)
    args = (hidden, weight, bias, targets, inv_t, g_logp, g_ent)
    op = LinearLogprobsChunks(hidden, weight, bias, max_rows=N, n_chunks=1, need=(True, True, True), tiles=tiles,
                              ignore_index=IGNORE)  # fmt: skip
    assert op.kept.dtype == torch.float16 and op.kept.numel() == N * V
    assert op.kept_max.dtype == torch.float32 and op.kept_max.numel() == N * -(-V // part)
    op.forward(0, N, targets, inv_t, True)
    # the kept values against float64's s, row by row at compact positions (valid rows first)
    order = torch.sort((targets == IGNORE).to(torch.uint8), stable=True).indices
    valid = int((targets != IGNORE).sum())
    s64 = (hidden.double() @ weight.double().T + bias.double()) * inv_t.double()[:, None]
    s64 = s64[order[:valid]].cpu()
    x = op.kept[: N * V].view(N, V)[:valid].double().cpu()
    m = op.kept_max[: N * -(-V // part)].view(N, -1)[:valid].double().cpu().repeat_interleave(part, 1)[:, :V]
    assert float(s64.abs().min()) > 100 and bool((x <= 0).all())
    # fp16 rounds x by |x| 2^-11 at most; s in fp32 is a few ulps of |s| from float64 (2^-20 |s|: 16 ulps)
    assert bool(((x + m - s64).abs() <= x.abs() * 2**-11 + s64.abs() * 2**-20).all())
    op.backward(g_logp, g_ent)
    ours = op.gradients()
    op_own = _ours(*args, backend="triton", tiles=tiles)[2:]
    truth, same = _truth(*args)[2:], _torch_same_dtype(*args, dtype=dtype)[2:]
    for name, o, r, t, s in zip(("d_hidden", "d_weight", "d_bias"), ours, op_own, truth, same):
        assert o.dtype == dtype, name
        scale = 1 + float(t.abs().max())
        assert max_err(o.cpu(), t.cpu()) <= MARGIN * max_err(r.cpu(), t.cpu()) + 1e-6 * scale, name
        assert_close_to_ref(o.cpu(), t.cpu(), s.cpu(), input_dtype=dtype, name=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_support_whose_first_parts_are_masked(device, dtype):
    """A bitmask support that keeps only the last columns (and the target) of some rows: their
    first parts are all -inf, kept as -inf with a max of 0 (no NaN), and the gradients equal
    linear_token_logprobs(support=)'s (fp32 within 1e-5, bf16 within its rounding)."""
    hidden, weight, bias, targets, inv_t, g_logp, g_ent = _inputs(dtype, device)
    keep = torch.rand(N, V) < 0.5
    keep[::2, : V - 40] = False  # every other row: nothing before column V - 40 but its target
    targets = torch.where(torch.arange(N) % 2 == 0, torch.randint(V - 40, V, (N,)), targets.cpu()).to(device)
    targets[[0, 5]] = IGNORE
    support = pack_support(keep).to(device)
    tiles = SMALL_TILES
    op = LinearLogprobsChunks(hidden, weight, bias, max_rows=N, n_chunks=1, need=(True, True, True), tiles=tiles,
                              ignore_index=IGNORE)  # fmt: skip
    logp, ent = op.forward(0, N, targets, inv_t, True, support)
    op.backward(g_logp, g_ent)
    ours = (logp, ent, *op.gradients())
    h, w, b = (t.detach().requires_grad_() for t in (hidden, weight, bias))
    ref_logp, ref_ent = linear_token_logprobs(h, w, targets, bias=b, inv_temperature=inv_t, return_entropy=True,
                                              backend="triton", tiles=tiles, support=support)  # fmt: skip
    ((ref_logp * g_logp).sum() + (ref_ent * g_ent).sum()).backward()
    for name, o, r in zip(("logp", "entropy", "d_hidden", "d_weight", "d_bias"), ours,
                          (ref_logp.detach(), ref_ent.detach(), h.grad, w.grad, b.grad)):  # fmt: skip
        assert not torch.isnan(o).any(), name
        tol = 1e-5 if dtype == torch.float32 or name in ("logp", "entropy") else 2 * 2**-8
        assert max_err(o, r) <= tol * (1 + float(r.abs().max())), name
    if dtype != torch.float32:
        valid = int((targets != IGNORE).sum())
        x = op.kept[: N * V].view(N, V)[:valid]
        assert bool(torch.isneginf(x).any()) and not bool(torch.isnan(x).any())
        assert bool(torch.isfinite(op.kept_max[: valid * op.n_parts]).all())


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
