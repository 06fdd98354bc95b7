"""Real vocabulary sizes (issue 13.3): a few rows at V = 151,936 (Qwen2) and
V = 262,144 (Gemma-3) through both log-prob ops, forward and backward, fp32 and bf16,
against float64. Odd N, few rows: the interpreter is slow.

token_logprobs runs its default (GPU) launch shape: 19 / 32 forward and 38 / 64
backward block steps per row. linear_token_logprobs runs wide vocabulary tiles
(LARGE_V_TILES: 75 / 128 tiles of 2048 columns in chunks of 8, a partial last tile
and chunk at 151,936; the backward's products in tiles of 2048 vocabulary columns, 8 to a
chunk, the last one partial, 128 deep: 1024 deep made the interpreter mask 1024 x 1024 tiles of
3 rows; 1024 wide took 11 s a case where 2048 takes 6.5):
the default 128-column tiles take minutes per case in the interpreter; the loops
over V, the chunks and their merge are the same code. LARGE_V_TILES are for the
interpreter only: on a GPU they would not launch (a 2048 x 16 fp32 weight tile is 128 KB per
pipeline stage, and the products' 2048 x 128 operand tiles 1 MB), so on a CUDA
device the test runs the device's default tiles, which tests/test_tiles.py compiles and
checks for every architecture.
"""
from __future__ import annotations

import pytest
import torch

from _compare import assert_close_to_ref
from erpo_kernels import linear_token_logprobs, token_logprobs
from erpo_kernels.linear_token_logprobs import Tiles

VOCABS = [151_936, 262_144]
LARGE_V_TILES = Tiles(  # the interpreter's only (see above)
    block_n=16, block_v=2048, block_d=16, num_warps=4, split_tiles=8, gemm_n=16, gemm_v=2048, gemm_d=16, gemm_warps=4,
    gemm_k=128,  # d_weight's K (the 2 scored rows) in one step, d_hidden's (a chunk's 16,384 columns) in 128
)
DTYPES = [torch.float32, torch.bfloat16]


def _terms(s: torch.Tensor, targets: torch.Tensor):
    ls = torch.log_softmax(s, -1)
    valid = targets != -100
    logp = torch.where(valid, ls.gather(1, targets.clamp(min=0)[:, None]).squeeze(1), 0.0)
    ent = torch.where(valid, -(ls.exp() * ls).sum(-1), 0.0)
    return logp, ent


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_token_logprobs(device, vocab, dtype):
    n = 3
    logits = (torch.randn(n, vocab) * 2).to(dtype).to(device)
    targets = torch.tensor([5, -100, vocab - 1], device=device)
    inv_t = torch.tensor([1.0, 1.0, 1 / 0.7], device=device)
    g_logp, g_ent = torch.randn(n, device=device), torch.randn(n, device=device)
    z = logits.clone().requires_grad_()
    logp, ent = token_logprobs(z, targets, inv_temperature=inv_t, return_entropy=True, backend="triton")
    (grad,) = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), z)
    outs = []
    for dt in (torch.float64, torch.float32):  # the truth, and PyTorch from the same logits
        x = logits.cpu().clone().requires_grad_()
        lp, en = _terms(x.to(dt) * inv_t.cpu().to(dt)[:, None], targets.cpu())
        (g,) = torch.autograd.grad((lp * g_logp.cpu().to(dt)).sum() + (en * g_ent.cpu().to(dt)).sum(), x)
        outs.append((lp.detach(), en.detach(), g))
    (lp64, en64, g64), (_, _, g_same) = outs
    assert_close_to_ref(logp.detach().cpu(), lp64, name="logp")
    assert_close_to_ref(ent.detach().cpu(), en64, name="entropy")
    assert_close_to_ref(grad.cpu(), g64, g_same, input_dtype=dtype, name="grad")


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_linear_token_logprobs(device, vocab, dtype):
    n, d = 3, 16
    hidden = torch.randn(n, d).to(dtype).to(device)
    weight = (torch.randn(vocab, d) * 0.5).to(dtype).to(device)
    targets = torch.tensor([vocab - 1, -100, 12345], device=device)
    inv_t = torch.tensor([1.0, 1.0, 1 / 0.7], device=device)
    g_logp, g_ent = torch.randn(n, device=device), torch.randn(n, device=device)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = linear_token_logprobs(
        h, w, targets, inv_temperature=inv_t, return_entropy=True, backend="triton",
        tiles=LARGE_V_TILES if torch.device(device).type == "cpu" else None,  # see the module docstring
    )
    d_h, d_w = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), (h, w))
    outs = []
    for mm_dt, sm_dt in ((torch.float64, torch.float64), (dtype, torch.float32)):  # truth; PyTorch in the dtype
        x, y = hidden.cpu().to(mm_dt).requires_grad_(), weight.cpu().to(mm_dt).requires_grad_()
        lp, en = _terms((x @ y.T).to(sm_dt) * inv_t.cpu().to(sm_dt)[:, None], targets.cpu())
        gx, gy = torch.autograd.grad((lp * g_logp.cpu().to(sm_dt)).sum() + (en * g_ent.cpu().to(sm_dt)).sum(), (x, y))
        outs.append((lp.detach(), en.detach(), gx, gy))
    (lp64, en64, gx64, gy64), (_, _, gx_same, gy_same) = outs
    assert_close_to_ref(logp.detach().cpu(), lp64, name="logp")
    assert_close_to_ref(ent.detach().cpu(), en64, name="entropy")
    assert_close_to_ref(d_h.cpu(), gx64, gx_same, input_dtype=dtype, name="d_hidden")
    assert_close_to_ref(d_w.cpu(), gy64, gy_same, input_dtype=dtype, name="d_weight")
