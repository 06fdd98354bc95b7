"""support= (issue 34): both ops renormalised over each row's kept set, as a threshold [N]
and as a packed bitmask [N, ceil(V / 32)], on the kernels (Triton's interpreter) and on the
reference, against a float64 masked log_softmax written here with autograd: forward,
entropy and every gradient (d_logits; d_hidden, d_weight, d_bias).

Tiny odd shapes (V = 75: three bitmask words, the last one partial; tiles of 16 / 32
columns, so every row spans several tiles and a word straddles none of their edges in
the same place). Each batch holds an ignored row, an unrestricted row (a prompt row),
a row whose target is outside its support (the target is kept: the documented outcome)
and a row whose support keeps nothing (so only the target: logp = 0, entropy 0, zero
gradient); the others keep a few tokens with the target among them.
Accuracy: tests/_compare (fp32 within 1e-5 of float64; bf16 no worse than PyTorch in the
same dtype plus the margin, as every kernel test).
"""
from __future__ import annotations

import importlib

import pytest
import torch

from _compare import assert_close_to_ref
from _host_reads import HostRead, no_host_reads
from erpo_kernels import linear_token_logprobs, token_logprobs
from erpo_kernels.support import check_support, pack_support, support_from_token_ids, support_words, unpack_support

tlp = importlib.import_module("erpo_kernels.token_logprobs")
ltl = importlib.import_module("erpo_kernels.linear_token_logprobs")

IGNORE = -100
N, D, V = 9, 16, 75
ROW_IGNORED, ROW_FREE, ROW_OUTSIDE, ROW_EMPTY = 0, 1, 2, 3
TOKEN_TILES = tlp.RowTiles(fwd_max_block_v=16, bwd_max_block_v=32)
LINEAR_TILES = ltl.Tiles(block_n=16, block_v=16, block_d=16, num_warps=4, split_tiles=2, gemm_n=16, gemm_v=16,
                         gemm_d=16, gemm_warps=4, gemm_k=16)  # fmt: skip
NAMES = ("logp", "entropy", "d_input", "d_weight", "d_bias")


def _inputs(op: str, dtype: torch.dtype, device: str):
    """(tensors, targets, inv_t, g_logp, g_ent): tensors = (logits,) or (hidden, weight, bias)."""
    if op == "token":
        tensors = ((torch.randn(N, V) * 3).to(dtype).to(device),)
    else:
        tensors = tuple(t.to(dtype).to(device) for t in (torch.randn(N, D), torch.randn(V, D) * 0.7, torch.randn(V)))
    targets = torch.randint(0, V, (N,))
    targets[ROW_IGNORED] = IGNORE
    inv_t = torch.where(torch.arange(N) == ROW_FREE, 1.0, 0.5 + torch.rand(N))  # a prompt row at 1
    return tensors, targets.to(device), inv_t.to(device), torch.randn(N).to(device), torch.randn(N).to(device)


def _scaled(leaves, inv_t, dtype, softcap=None, logit_scale=None):
    """s = z * inv_T from the leaves (the matmul in the leaves' dtype), the transform and the
    temperature in `dtype`."""
    if len(leaves) == 1:
        z = leaves[0].to(dtype)
    else:
        h, w, b = leaves
        z = (h @ w.T + b).to(dtype)
    if logit_scale is not None:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z * inv_t.to(dtype)[:, None]


def _plain(tensors, targets, inv_t, g_logp, g_ent, kept, *, matmul_dtype, softmax_dtype, **transform):
    """Plain autograd over the kept set: logits (a matmul in matmul_dtype for the linear op),
    the transform and the masked log_softmax in softmax_dtype; kept [N, V] bool (the target
    included). Returns logp, entropy, d_input, d_weight, d_bias (None for the token op)."""
    leaves = [t.detach().cpu().to(matmul_dtype).requires_grad_() for t in tensors]
    s = _scaled(leaves, inv_t.cpu(), softmax_dtype, **transform)
    valid = targets.cpu() != IGNORE
    # Ignored rows are zeros first: nothing of theirs reaches the result or its gradient.
    s = torch.where(valid[:, None] & kept, s, torch.where(valid[:, None], float("-inf"), 0.0))
    logq = torch.log_softmax(s, dim=-1)
    tgt = targets.cpu().clamp(min=0)
    logp = torch.where(valid, logq.gather(1, tgt[:, None]).squeeze(1), 0.0)
    p = logq.exp()
    ent = torch.where(valid, -(p * torch.where(p > 0, logq, 0.0)).sum(-1), 0.0)
    loss = (logp * g_logp.cpu().to(softmax_dtype)).sum() + (ent * g_ent.cpu().to(softmax_dtype)).sum()
    grads = torch.autograd.grad(loss, leaves)
    return (logp.detach(), ent.detach(), *grads) + (None,) * (3 - len(grads))


def _supports(tensors, targets, inv_t, **transform):
    """(threshold [N] fp32, bitmask [N, W] int32, kept_threshold, kept_bitmask [N, V] bool with
    the target): the rows' cases (module docstring). Thresholds sit mid-way across the widest
    gap among the 3rd to 12th largest scaled logits, far from any logit at every precision."""
    s = _scaled([t.detach().cpu().double() for t in tensors], inv_t.cpu(), torch.float64, **transform)
    desc = s.sort(dim=1, descending=True).values
    gaps = desc[:, 2:12] - desc[:, 3:13]
    k = 2 + gaps.argmax(dim=1)
    threshold = (desc.gather(1, k[:, None]) + desc.gather(1, k[:, None] + 1)).squeeze(1) / 2
    bits = torch.rand(N, V) < 0.3
    rows = torch.arange(N)
    tgt = targets.cpu().clamp(min=0)
    bits[rows, tgt] = True
    # the target outside: a threshold above its logit / its bit cleared
    outside = s[ROW_OUTSIDE, tgt[ROW_OUTSIDE]]
    threshold[ROW_OUTSIDE] = (outside + desc[ROW_OUTSIDE][desc[ROW_OUTSIDE] > outside].min()) / 2 \
        if (desc[ROW_OUTSIDE] > outside).any() else outside + 1  # fmt: skip
    bits[ROW_OUTSIDE, tgt[ROW_OUTSIDE]] = False
    threshold[ROW_EMPTY] = desc[ROW_EMPTY, 0] + 1.0
    bits[ROW_EMPTY] = False
    threshold[ROW_FREE] = float("-inf")
    bits[ROW_FREE] = True
    onehot = torch.zeros(N, V, dtype=torch.bool)
    onehot[rows, tgt] = True
    kept_threshold = (s >= threshold[:, None]) | onehot
    device = tensors[0].device
    return (threshold.float().to(device), pack_support(bits).to(device), kept_threshold, bits | onehot)


def _ours(op, tensors, targets, inv_t, g_logp, g_ent, *, support, backend, **options):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    if op == "token":
        logp, ent = token_logprobs(leaves[0], targets, inv_temperature=inv_t, return_entropy=True, support=support,
                                   backend=backend, tiles=TOKEN_TILES if backend == "triton" else None, **options)
    else:
        h, w, b = leaves
        logp, ent = linear_token_logprobs(h, w, targets, bias=b, inv_temperature=inv_t, return_entropy=True,
                                          support=support, backend=backend,
                                          tiles=LINEAR_TILES if backend == "triton" else None, **options)
    grads = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), leaves)
    return (logp.detach(), ent.detach(), *grads) + (None,) * (3 - len(grads))


TRANSFORMS = {"plain": {}, "softcap_scale": dict(softcap=4.0, logit_scale=0.8)}


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("form", ["threshold", "bitmask"])
@pytest.mark.parametrize("dtype, transform", [(torch.float32, "plain"), (torch.bfloat16, "plain"),
                                              (torch.float32, "softcap_scale")], ids=["fp32", "bf16", "fp32-softcap"])
@pytest.mark.parametrize("op", ["token", "linear"])
def test_support_matches_float64_masked_log_softmax(device, op, dtype, transform, form, backend):
    tensors, targets, inv_t, g_logp, g_ent = _inputs(op, dtype, device)
    options = TRANSFORMS[transform]
    threshold, bitmask, kept_threshold, kept_bitmask = _supports(tensors, targets, inv_t, **options)
    support, kept = (threshold, kept_threshold) if form == "threshold" else (bitmask, kept_bitmask)
    assert kept[ROW_FREE].all() and not kept[4:].all(dim=1).any()  # the cases are what they say
    ours = _ours(op, tensors, targets, inv_t, g_logp, g_ent, support=support, backend=backend, **options)
    truth = _plain(tensors, targets, inv_t, g_logp, g_ent, kept, matmul_dtype=torch.float64,
                   softmax_dtype=torch.float64, **options)  # fmt: skip
    same = _plain(tensors, targets, inv_t, g_logp, g_ent, kept, matmul_dtype=dtype if op == "linear" else torch.float32,
                  softmax_dtype=torch.float32, **options)  # fmt: skip
    for name, o, t, s in zip(NAMES, ours, truth, same):
        if t is None:
            continue
        assert o.dtype == (torch.float32 if name in ("logp", "entropy") else dtype), name
        assert_close_to_ref(o.cpu(), t, s.to(o.dtype) if name.startswith("d_") else s, input_dtype=dtype, name=name)
    logp, ent = ours[0].cpu(), ours[1].cpu()
    assert logp[ROW_EMPTY] == 0 and ent[ROW_EMPTY] == 0  # only the target left: certain
    assert torch.isfinite(logp).all() and logp[ROW_OUTSIDE] < 0  # the outside target is kept, finite
    if op == "token":  # tokens out of the kept set get exactly zero gradient
        grad = ours[2].cpu()
        assert (grad[~kept] == 0).all() and (grad[ROW_EMPTY] == 0).all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("op", ["token", "linear"])
def test_unrestricted_rows_are_unchanged_bit_for_bit(device, op, backend):
    """-inf thresholds and all-ones words (prompt rows) give exactly support=None's results,
    with a NaN logit in a row too (a dropped token is only one the test drops)."""
    tensors, targets, inv_t, g_logp, g_ent = _inputs(op, torch.float32, device)
    if op == "token":
        tensors[0][5, 7] = float("nan")
    want = _ours(op, tensors, targets, inv_t, g_logp, g_ent, support=None, backend=backend)
    free = (torch.full((N,), float("-inf"), device=device), torch.full((N, support_words(V)), -1, dtype=torch.int32,
                                                                       device=device))  # fmt: skip
    for support in free:
        got = _ours(op, tensors, targets, inv_t, g_logp, g_ent, support=support, backend=backend)
        for name, a, b in zip(NAMES, got, want):
            assert (a is None and b is None) or torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), name
        if op == "token":
            assert torch.isnan(got[0][5])


def test_inplace_backward_with_support(device):
    tensors, targets, inv_t, g_logp, g_ent = _inputs("token", torch.float32, device)
    _, bitmask, _, _ = _supports(tensors, targets, inv_t)
    want = _ours("token", tensors, targets, inv_t, g_logp, g_ent, support=bitmask, backend="triton")
    z = tensors[0].clone().requires_grad_()
    x = z * 1.0  # an intermediate, as the lm_head's output
    logp, ent = token_logprobs(x, targets, inv_temperature=inv_t, return_entropy=True, support=bitmask,
                               inplace_backward=True, backend="triton", tiles=TOKEN_TILES)  # fmt: skip
    (grad,) = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), z)
    assert torch.equal(logp, want[0]) and torch.equal(ent, want[1]) and torch.equal(grad, want[2])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_validate_false_reads_no_values_with_a_support(device, backend):
    tensors, targets, inv_t, g_logp, g_ent = _inputs("linear", torch.float32, device)
    threshold, bitmask, _, _ = _supports(tensors, targets, inv_t)
    for support in (threshold, bitmask):
        want = _ours("linear", tensors, targets, inv_t, g_logp, g_ent, support=support, backend=backend)
        with no_host_reads():
            got = _ours("linear", tensors, targets, inv_t, g_logp, g_ent, support=support, backend=backend,
                        validate=False)  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    with no_host_reads():
        check_support(threshold, N, V, threshold.device, validate=False)
        with pytest.raises(HostRead):  # validate=True reads the threshold (its NaN check)
            check_support(threshold, N, V, threshold.device)


def _bad_supports(device):
    f32 = dict(dtype=torch.float32, device=device)
    words = support_words(V)
    nan = torch.zeros(N, **f32)
    nan[4] = float("nan")
    return [
        ([1.0] * N, "support must be None or a torch.Tensor"),
        (torch.zeros(N + 1, **f32), "support has 10 rows"),
        (torch.zeros(N, 1, **f32), "support must have 1 dimension"),
        (torch.zeros(N, words, dtype=torch.int64, device=device), "support must be a floating"),
        (torch.zeros(N, V, dtype=torch.bool, device=device), "pack_support"),
        (torch.zeros(N, words + 1, dtype=torch.int32, device=device), r"\[9, 3\]"),
        (torch.zeros(N, dtype=torch.int32, device=device), "support must have 2 dimension"),
        (torch.zeros(N, device="meta"), "support is on meta"),
        (nan, r"support\[4\] is NaN"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_supports("cpu"))))
def test_bad_support_raises_value_error_naming_it(device, case):
    support, match = _bad_supports(device)[case]
    tensors, targets, *_ = _inputs("linear", torch.float32, device)
    logits = torch.randn(N, V, device=device)
    with pytest.raises(ValueError, match=match):
        token_logprobs(logits, targets, support=support, backend="torch")
    with pytest.raises(ValueError, match=match):
        linear_token_logprobs(tensors[0], tensors[1], targets, support=support, backend="triton")


def test_packing_helpers_round_trip():
    kept = torch.rand(5, 70) < 0.5
    kept[:, 31] = True  # bit 31: the sign bit of a word
    bits = pack_support(kept)
    assert bits.dtype == torch.int32 and bits.shape == (5, 3)
    assert torch.equal(unpack_support(bits, 70), kept)
    rows, cols = kept.nonzero(as_tuple=True)
    twice = (torch.cat([rows, rows[:3]]), torch.cat([cols, cols[:3]]))  # repeated pairs count once
    assert torch.equal(support_from_token_ids(*twice, 5, 70), bits)
    assert torch.equal(pack_support(torch.ones(2, 64, dtype=torch.bool)), torch.full((2, 2), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="token_ids"):
        support_from_token_ids(rows, cols + 70, 5, 70)


@pytest.mark.parametrize("op", ["token", "linear"])
def test_support_compiles_without_graph_break(device, op):
    """support is a tensor input of each custom op: torch.compile(fullgraph=True) (aot_eager,
    as tests/test_torch_compile.py) gives eager's values and gradients bit for bit."""
    tensors, targets, inv_t, g_logp, g_ent = _inputs(op, torch.float32, device)
    threshold, bitmask, _, _ = _supports(tensors, targets, inv_t)
    support = bitmask if op == "token" else threshold

    def loss(*leaves):
        if op == "token":
            logp, ent = token_logprobs(leaves[0], targets, inv_temperature=inv_t, return_entropy=True,
                                       support=support, backend="triton")  # fmt: skip
        else:
            logp, ent = linear_token_logprobs(leaves[0], leaves[1], targets, bias=leaves[2], inv_temperature=inv_t,
                                              return_entropy=True, support=support, backend="triton")  # fmt: skip
        return (logp * g_logp).sum() + (ent * g_ent).sum()

    eager = [t.clone().requires_grad_() for t in tensors]
    compiled = [t.clone().requires_grad_() for t in tensors]
    out_e = loss(*eager)
    out_e.backward()
    torch._dynamo.reset()
    out_c = torch.compile(loss, fullgraph=True, backend="aot_eager")(*compiled)
    out_c.backward()
    assert torch.equal(out_e, out_c)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager, compiled))


@pytest.mark.parametrize("form", ["threshold", "bitmask"])
def test_fused_path_takes_the_support(device, form):
    """erpo_loss's fused path (LinearLogprobsChunks: logits kept once per chunk of rows, -inf
    outside the support, dr formed from them) equals linear_token_logprobs with the same
    support, fp32 within 1e-5, soft cap on (its slope is recovered from the kept logits)."""
    from erpo_kernels.fused_linear_loss import LinearLogprobsChunks

    tensors, targets, inv_t, g_logp, g_ent = _inputs("linear", torch.float32, device)
    options = TRANSFORMS["softcap_scale"]
    threshold, bitmask, _, _ = _supports(tensors, targets, inv_t, **options)
    support = threshold if form == "threshold" else bitmask
    want = _ours("linear", tensors, targets, inv_t, g_logp, g_ent, support=support, backend="triton", **options)
    op = LinearLogprobsChunks(*tensors, max_rows=5, n_chunks=2, need=(True, True, True), tiles=LINEAR_TILES,
                              ignore_index=IGNORE, **options)  # fmt: skip
    logps, ents = [], []
    for a, b in [(0, 4), (4, N)]:
        logp, ent = op.forward(a, b, targets[a:b], inv_t[a:b], True, support=support[a:b])
        op.backward(g_logp[a:b], g_ent[a:b])
        logps.append(logp)
        ents.append(ent)
    got = (torch.cat(logps), torch.cat(ents), *op.gradients())
    for name, o, w in zip(NAMES, got, want):
        assert torch.isfinite(o).all(), name
        torch.testing.assert_close(o, w, atol=1e-5, rtol=1e-5, msg=name)
