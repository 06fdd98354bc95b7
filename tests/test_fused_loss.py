"""erpo_loss's fused path (objective/fused.py): the loss and its gradients formed in the
forward pass, a chunk of whole sequences at a time, equal the 4-GEMM composition
(linear_token_logprobs + erpo_loss_from_logp + autograd: erpo_loss(fused_budget=0)) in
fp32 within 1e-5, with one chunk and several, for the chunk-local policy losses, the
Query-KL, grpo's KL and the entropy bonus; micro-batches with normalizers; bf16 against
float64; determinism; and its GEMM count (3 GEMMs of work; clip_cov keeps 4)."""
from dataclasses import fields, replace

import pytest
import torch

from erpo_kernels import LossConfig, LossNormalizers, erpo_loss, split_batch
from erpo_kernels.objective.fused import fused_path_reason
from test_linear_token_logprobs import SMALL_TILES
from test_objective import make_point

D = 24
V = 50  # test_objective's VOCAB
ROW_BYTES = 4 * V  # one row of kept fp32 logits (fp32 operands)
ROW_BYTES_16 = 2 * V  # one row of kept fp16 logits (bf16 / fp16 operands, autocast to them included)


def _row_bytes(dtype):
    return ROW_BYTES if dtype == torch.float32 else ROW_BYTES_16


def _batch(dtype=torch.float32):
    batch, _, logp, _ = make_point("softmax", with_ref_logp=True)
    float_fields = {f.name: getattr(batch, f.name).to(dtype) for f in fields(batch)
                    if isinstance(getattr(batch, f.name), torch.Tensor) and getattr(batch, f.name).is_floating_point()}
    return replace(batch, **float_fields)


def _operands(n, dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, D, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.5).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_() if bias else None
    return hidden, weight, b


CONFIGS = {
    "vanilla": LossConfig(algorithm="erpo", alpha=0.3),
    "cispo": LossConfig(algorithm="erpo", alpha=0.3, policy_loss="cispo"),
    "gspo-qkl": LossConfig(algorithm="erpo", alpha=0.5, policy_loss="gspo", loss_agg="seq-mean-token-mean"),
    "grpo-kl-entropy": LossConfig(algorithm="grpo", beta=0.2, entropy_coeff=0.05),
}


@pytest.fixture
def chunks(monkeypatch):
    """The row counts of the fused path's chunks, call after call (empty: it did not run)."""
    from erpo_kernels.fused_linear_loss import LinearLogprobsChunks

    seen = []
    forward = LinearLogprobsChunks.forward

    def spy(self, r0, r1, *args):
        seen.append(r1 - r0)
        return forward(self, r0, r1, *args)

    monkeypatch.setattr(LinearLogprobsChunks, "forward", spy)
    return seen


def _run(cfg, batch, operands, **kw):
    hidden, weight, bias = (None if t is None else t.detach().requires_grad_() for t in operands)
    loss, metrics = erpo_loss(hidden, weight, batch, cfg, bias=bias, backend="triton", tiles=SMALL_TILES, **kw)
    loss.backward()
    return loss.detach(), metrics, hidden.grad, weight.grad, None if bias is None else bias.grad


def _assert_same(ours, ref, tol=1e-5):
    assert ours[1].keys() == ref[1].keys()
    for key in ref[1]:
        assert abs(ours[1][key] - ref[1][key]) <= tol * (1 + abs(ref[1][key])), key
    for name, o, r in zip(("loss", None, "d_hidden", "d_weight", "d_bias"), ours, ref):
        if name is not None and r is not None:  # within tol of the gradient's scale (sums in another order)
            assert o.dtype == r.dtype and o.shape == r.shape, name
            assert float((o - r).abs().max()) <= tol * (1 + float(r.abs().max())), name


# several chunks (the longest sequence: 11 rows) for each loss, and one
@pytest.mark.parametrize("name,budget_rows", [(name, 12) for name in sorted(CONFIGS)] + [("gspo-qkl", 1000)])
def test_fp32_equals_the_four_gemm_composition(name, budget_rows, chunks):
    batch = _batch()
    operands = _operands(batch.num_rows)
    cfg = CONFIGS[name]
    assert fused_path_reason(*operands, cfg, None, "triton", budget_rows * ROW_BYTES) is None
    ours = _run(cfg, batch, operands, fused_budget=budget_rows * ROW_BYTES)
    assert sum(chunks) == batch.num_rows and max(chunks) <= budget_rows
    assert len(chunks) == (1 if budget_rows >= batch.num_rows else 7)
    _assert_same(ours, _run(cfg, batch, operands, fused_budget=0))
    assert len(chunks) == (1 if budget_rows >= batch.num_rows else 7)  # fused_budget=0: not fused


def test_a_sequence_longer_than_a_chunk_takes_the_four_gemm_path(chunks):
    batch = _batch()
    operands = _operands(batch.num_rows)
    ours = _run(CONFIGS["vanilla"], batch, operands, fused_budget=10 * ROW_BYTES)
    assert chunks == []
    _assert_same(ours, _run(CONFIGS["vanilla"], batch, operands, fused_budget=0), tol=0)


def test_soft_cap_logit_scale_no_bias_and_determinism(chunks):
    batch = _batch()
    operands = _operands(batch.num_rows, bias=False)
    cfg = CONFIGS["vanilla"]
    kw = dict(softcap=2.5, logit_scale=1.3)
    ours = _run(cfg, batch, operands, fused_budget=13 * ROW_BYTES, **kw)
    assert len(chunks) > 1
    _assert_same(ours, _run(cfg, batch, operands, fused_budget=0, **kw))
    again = _run(cfg, batch, operands, fused_budget=13 * ROW_BYTES, **kw)
    assert all(torch.equal(a, b) for a, b in zip(ours[2:4], again[2:4])) and torch.equal(ours[0], again[0])


def test_micro_batches_with_normalizers(chunks):
    """Each micro-batch fused (in chunks) with the mini-batch's normalizers: the sum of the
    losses and the accumulated gradients equal the one-batch composition."""
    batch = _batch()
    operands = _operands(batch.num_rows)
    cfg = CONFIGS["gspo-qkl"]
    ref = _run(cfg, batch, operands, fused_budget=0)
    norm = LossNormalizers.of(batch)
    hidden, weight, bias = (t.detach().requires_grad_() for t in operands)
    total = 0.0
    for micro in split_batch(batch, [[5, 1], [7, 0, 3], [2, 4, 6]]):
        loss, _ = erpo_loss(hidden[micro.rows], weight, micro.batch, cfg, bias=bias, backend="triton",
                            tiles=SMALL_TILES, normalizers=norm, fused_budget=12 * ROW_BYTES)
        loss.backward()
        total += float(loss.detach())
    assert len(chunks) > 3
    _assert_same((torch.tensor(total, dtype=ref[0].dtype), ref[1], hidden.grad, weight.grad, bias.grad), ref)


def test_bf16_close_to_float64(chunks):
    """bf16 operands: the fused path's gradients as close to float64 as the composition's
    (dr from the kept fp16 s - m instead of the recompute's fp32 s, rounded to bf16 before
    the products)."""
    batch = _batch()
    operands = _operands(batch.num_rows, dtype=torch.bfloat16)
    cfg = CONFIGS["grpo-kl-entropy"]
    ours = _run(cfg, batch, operands, fused_budget=12 * ROW_BYTES_16)
    assert len(chunks) == 7
    comp = _run(cfg, batch, operands, fused_budget=0)
    truth = erpo_loss(*(t.detach().double().requires_grad_() for t in operands[:2]), _batch(torch.float64), cfg,
                      bias=operands[2].detach().double().requires_grad_(), backend="torch")
    for o, c in zip(ours[2:], comp[2:]):
        # dr within bf16's rounding of the composition's (fp16 x = s - m moves p by |x| 2^-11),
        # and the products differ by the row chunks' order of sums
        err = (o.double() - c.double()).abs().max()
        assert err <= 2 * c.double().abs().max() * 2**-8, err
    want = float(truth[0].detach())
    assert abs(float(ours[0]) - want) <= 1e-2 * (1 + abs(want))


@pytest.mark.parametrize("case", ["no-grad", "batch-wide", "quantile", "torch-backend"])
def test_what_takes_the_four_gemm_path(case):
    operands = _operands(3)
    cfg, normalizers, backend = CONFIGS["vanilla"], None, "triton"
    if case == "batch-wide":
        cfg = LossConfig(policy_loss="clip_cov")
    if case == "quantile":
        cfg = LossConfig(top_entropy_quantile=0.5)
    if case == "torch-backend":
        backend = "torch"
    if case == "no-grad":
        with torch.no_grad():
            assert fused_path_reason(*operands, cfg, normalizers, backend, 1 << 30) is not None
        return
    assert fused_path_reason(*operands, cfg, normalizers, backend, 1 << 30) is not None
    if case == "quantile":  # a threshold from the normalizers makes the selection chunk-local
        norm = LossNormalizers.of(_batch())
        norm.entropy_threshold = torch.tensor(0.5)
        assert fused_path_reason(*operands, cfg, norm, backend, 1 << 30) is None


GEMM_CASES = {**{k: (v, 3.1) for k, v in CONFIGS.items()},
              "clip_cov": (LossConfig(algorithm="grpo", beta=0.0, policy_loss="clip_cov", clip_cov_ratio=0.1), 4.25)}


@pytest.mark.parametrize("name,engine", [(name, 0) for name in sorted(GEMM_CASES)] + [("gspo-qkl", 1)])
def test_gemm_count(name, engine):
    """Issue 33's GEMM count, counted in the interpreter (bench.cost): erpo_loss's default
    forward + backward against one GEMM = linear_token_logprobs' forward alone on the same
    rows; with our products (engine 0) and torch's (1, their matmuls counted as ATen ops)."""
    from bench.cost import count_launches
    from erpo_kernels import linear_token_logprobs

    cfg, bound = GEMM_CASES[name]
    batch = _batch()
    hidden, weight, bias = _operands(batch.num_rows)
    tiles = replace(SMALL_TILES, gemm_engine=engine)
    gemm = sum(r.total_flops for r in count_launches(
        lambda: linear_token_logprobs(hidden.detach(), weight.detach(), batch.targets, bias=bias.detach(),
                                      inv_temperature=batch.inv_temperature, tiles=tiles, backend="triton")))  # fmt: skip
    assert gemm > 0

    def fwd_bwd():
        loss, _ = erpo_loss(hidden, weight, batch, cfg, bias=bias, backend="triton", tiles=tiles)
        loss.backward()

    work = sum(r.total_flops for r in count_launches(fwd_bwd)) / gemm
    assert work <= bound, work
    # every product counted (torch's matmuls count the rows as they are, our kernels whole tiles of them)
    assert work >= (bound - 0.25 if engine == 0 else bound - 1), work


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_erpo_train_takes_the_fused_path(tmp_path, chunks):
    """erpo train's update (Trainer._update -> erpo_loss) runs the fused path on the Triton
    backend, and its gradients equal those of the same step on the 4-GEMM composition."""
    from test_trainer import fixed_trainer

    cache_dir = tmp_path / "cache"
    runs = []
    for budget in (1024, 0):  # fused_budget_mb: the default, and the 4-GEMM path
        trainer = fixed_trainer(tmp_path, cache_dir, f"run{budget}", kernel_backend="triton", mini_batches=1,
                                ppo_epochs=1, micro_batch_tokens=64, fused_budget_mb=budget)  # fmt: skip
        grads = {}
        step = trainer.optimizer.step

        def record(*args, _step=step, _grads=grads, _model=trainer.model, **kwargs):
            _grads.update((n, p.grad.clone()) for n, p in _model.named_parameters() if p.grad is not None)
            return _step(*args, **kwargs)

        trainer.optimizer.step = record
        trainer.step(1)
        runs.append((grads, len(chunks)))
    (fused_grads, n_fused), (plain_grads, n_plain) = runs
    assert n_fused > 1 and n_plain == n_fused  # several chunks; the composition ran none
    assert fused_grads.keys() == plain_grads.keys() and "lm_head.weight" in fused_grads
    for name, g in fused_grads.items():
        assert float((g - plain_grads[name]).abs().max()) <= 1e-5 * (1 + float(g.abs().max())), name


def test_autocast_gives_the_uncast_dtypes(chunks):
    """fp32 operands under bf16 autocast: cast as a linear layer's, gradients returned in
    fp32 (not rounded to bf16), within bf16's rounding of the composition's."""
    batch = _batch()
    operands = _operands(batch.num_rows)
    out = []
    for budget in (12 * ROW_BYTES_16, 0):  # cast to bf16: 16-bit kept logits
        h, w, b = (t.detach().requires_grad_() for t in operands)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = erpo_loss(h, w, batch, CONFIGS["vanilla"], bias=b, backend="triton", tiles=SMALL_TILES,
                                fused_budget=budget)  # fmt: skip
        loss.backward()
        out.append((h.grad, w.grad, b.grad))
    assert len(chunks) == 7
    for fused_grad, plain_grad in zip(*out):
        assert fused_grad.dtype == plain_grad.dtype == torch.float32
        assert float((fused_grad - plain_grad).abs().max()) <= 2**-7 * float(plain_grad.abs().max())


@pytest.mark.parametrize("form", ["bitmask", "threshold"])
def test_a_support_takes_the_fused_path_and_equals_the_composition(form, chunks):
    """A batch with each response row's kept set (PackedLossBatch.support): the chunks score
    over it as linear_token_logprobs(support=) does, within 1e-5 of the composition, and both
    log support/kept_mass."""
    from erpo_kernels import pack_support

    batch = _batch()
    g = torch.Generator().manual_seed(3)
    if form == "bitmask":
        kept = torch.rand(batch.num_rows, V, generator=g) < 0.6
        support = pack_support(kept)
    else:
        support = torch.where(torch.rand(batch.num_rows, generator=g) < 0.3, -torch.inf,
                              torch.randn(batch.num_rows, generator=g))
    batch = replace(batch, support=support)
    operands = _operands(batch.num_rows)
    cfg = CONFIGS["vanilla"]
    ours = _run(cfg, batch, operands, fused_budget=12 * ROW_BYTES)
    assert len(chunks) == 7
    ref = _run(cfg, batch, operands, fused_budget=0)
    _assert_same(ours, ref)
    assert 0 < ref[1]["support/kept_mass"] < 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_upstream_gradient_retain_graph_and_the_d_weight_pass(dtype, chunks):
    """Several chunks, a non-1 upstream gradient (loss * 3) and a graph kept for a second
    backward: the same gradients twice, as the composition's (fp32 within 1e-5; bf16 within
    its rounding). A bf16 d_weight of several chunks stays the fp32 accumulator until the
    backward, which writes it in bf16 in one pass (one mul: 4 V D bytes read, 2 V D written;
    no cast of [V, D]); one chunk saves it in bf16."""
    from bench.cost import count_launches

    batch = _batch()
    operands = _operands(batch.num_rows, dtype=dtype)
    cfg = CONFIGS["grpo-kl-entropy"]
    saved = []

    def grads(budget, times):
        h, w, b = (t.detach().requires_grad_() for t in operands)
        loss, _ = erpo_loss(h, w, batch, cfg, bias=b, backend="triton", tiles=SMALL_TILES, fused_budget=budget)
        if budget:
            saved.append([None if t is None else t.dtype for t in loss.grad_fn.saved_tensors])
        scaled = loss * 3
        return [torch.autograd.grad(scaled, (h, w, b), retain_graph=True) for _ in range(times)]

    first, second = grads(12 * _row_bytes(dtype), 2)
    assert len(chunks) == 7
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    (comp,) = grads(0, 1)
    for name, o, c in zip(("d_hidden", "d_weight", "d_bias"), first, comp):
        assert o.dtype == c.dtype == dtype and o.shape == c.shape, name
        err, scale = float((o.double() - c.double()).abs().max()), float(c.double().abs().max())
        assert err <= (1e-5 * (1 + scale) if dtype == torch.float32 else 2 * scale * 2**-8), (name, err)
    grads(1000 * _row_bytes(dtype), 1)  # one chunk
    low = dtype != torch.float32
    assert saved == [[dtype, torch.float32 if low else dtype, torch.float32], [dtype, dtype, torch.float32]]
    if low:  # counted: the backward's pass over the fp32 d_weight, and no [V, D] cast in the forward
        h, w, b = (t.detach().requires_grad_() for t in operands)
        vd = V * D
        ops = count_launches(lambda: erpo_loss(h, w, batch, cfg, bias=b, backend="triton", tiles=SMALL_TILES,
                                               fused_budget=12 * _row_bytes(dtype))[0].backward())  # fmt: skip
        big = [(r.name, r.loaded, r.stored) for r in ops if r.kind == "torch" and r.stored >= 2 * vd]
        assert ("aten.mul", 4 * vd + 4, 2 * vd) in big and not [x for x in big if x[0] == "aten._to_copy"], big
