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
    # shared memory: each program's (BM x BK + BK x BN) operand tiles, staged once and read once, per K step
    assert rec.smem == 2 * (M // B) * (N // B) * (K // B) * (B * B + B * B) * 2 if widen or dtype != torch.float32 \
        else rec.smem == 2 * (M // B) * (N // B) * (K // B) * (B * B + B * B) * 4
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


# ----------------------------------------------------------------------------- fits and the time model

from bench import cost_model as cm  # noqa: E402


def _masked_matmul(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(a + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        y = tl.load(b + rk[:, None] * N + rn[None, :], mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(x, y, acc)
    tl.store(c + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


MASKED_MATMUL = _interpreted(_masked_matmul)


def _matmul_counts(shape):
    """[n, d] @ [d, v] with 16 x 16 x 16 tiles, grouped as bench cost groups a run."""
    n, d, v = shape
    a, b, c = torch.randn(n, d), torch.randn(d, v), torch.empty(n, v)
    recs = cost.count_launches(
        lambda: MASKED_MATMUL[(triton.cdiv(n, 16), triton.cdiv(v, 16))](a, b, c, n, v, d, BM=16, BN=16, BK=16),
        phase="forward", torch_ops=False)
    torch.testing.assert_close(c, a @ b, rtol=1e-4, atol=1e-4)
    return cm.flatten(recs, shape)


def test_fit_is_exact_on_held_out_shapes_and_bounded_off_the_lattice():
    fit = cm.fit_exact({s: _matmul_counts(s) for s in cm.grid((16, 32), (16, 32), (16, 32))})
    assert fit.fit_exact
    held = (48, 32, 64)
    assert fit.check(held, _matmul_counts(held))["exact"], fit.checks
    q = fit.at(held)["forward/_masked_matmul"]
    assert q["flops:fp32"] == 2 * 48 * 32 * 64 and q["programs"] == 3 * 4
    assert q["arg:a:loaded"] == (64 // 16) * 48 * 32 * 4  # each column tile reads all of a
    # off the lattice (masks): every count lies between the fit at the lattice shapes around it
    odd = (40, 24, 40)
    lo, hi = fit.at((32, 16, 32))["forward/_masked_matmul"], fit.at((48, 32, 48))["forward/_masked_matmul"]
    got = _matmul_counts(odd)["forward/_masked_matmul"]
    assert all(lo[k] <= got[k] <= hi[k] for k in got), {k: (lo[k], got[k], hi[k]) for k in got}
    assert not cm.fit_exact({s: _matmul_counts(s) for s in cm.grid((16, 40), (16, 32), (16, 32))}).check(
        held, _matmul_counts(held))["exact"]  # a grid off the residue class does not extrapolate


def test_residue_values():
    assert cm.residue_values(151936, 4096, 1) == (384, 4480)
    assert cm.residue_values(8192, 256, 1) == (256, 512)
    assert cm.residue_values(8192, 110, 100) == (162, 272)


def _group(**arg):
    """One Triton group with one argument 'x' (loaded, stored, distinct..., program_distinct)."""
    q = {"programs": arg.pop("programs"), "launches": 1, "flops:bf16": arg.pop("flops", 0)}
    q.update({f"arg:x:{k}": v for k, v in arg.items()})
    return q


def test_time_model_bytes_rule():
    hw = cm.HARDWARE["H200"]
    slab = 2 << 20  # each of 1000 programs re-reads and rewrites its own 2 MB slab 10 times
    private = dict(programs=1000, loaded=10 * 1000 * slab, stored=10 * 1000 * slab, distinct_loaded=1000 * slab,
                   distinct_stored=1000 * slab, distinct=1000 * slab, program_distinct=1000 * slab)
    b, why = cm.group_bytes(_group(**private), hw)
    assert b == 20 * 1000 * slab and "> L2" in why  # 132 resident x 2 MB > 50 MB: every re-read goes to HBM
    small = {k: v // 64 for k, v in private.items()}
    small["programs"] = 1000
    b, why = cm.group_bytes(_group(**small), hw)
    assert b == small["distinct_loaded"] + small["distinct_stored"] and "fit L2" in why
    shared = dict(private, program_distinct=10 * private["distinct"])  # programs overlap: L2 hits, compulsory
    assert cm.group_bytes(_group(**shared), hw)[0] == 2 * 1000 * slab
    assert cm.group_bytes({"loaded": 5, "stored": 7}, hw, torch_group=True)[0] == 12
    (g,) = cm.model_times({"forward/k": _group(**dict(private, flops=10**12))}, hw)
    assert g.flop_s == pytest.approx(10**12 / 989.4e12) and g.byte_s == pytest.approx(g.hbm_bytes / 4.32e12)
    assert g.seconds == max(g.flop_s, g.byte_s) and g.dominant == "bytes"
    assert cm.gemm_floor_s((8192, 4096, 151936), 4, hw) * 1e3 == pytest.approx(41.2, abs=0.1)


def test_time_model_charges_the_l2_and_shared_memory():
    # issue 26: every byte a program loads or stores crosses the L2 (9 TB/s on an H200), the dots'
    # operands cross shared memory; a cuBLAS GEMM is charged at its tile intensity (85.3 FLOP/B bf16)
    hw = cm.HARDWARE["H200"]
    assert hw.l2_bytes_per_s == pytest.approx(8.99e12, rel=1e-3) and hw.smem_bytes_per_s == pytest.approx(29.65e12,
                                                                                                           rel=1e-3)
    assert "ASSUMED" in cm.HARDWARE["B200"].l2_source  # no published figure: said so
    tile = _group(programs=100, loaded=9 * 10**11, stored=10**9, distinct_loaded=10**9, distinct_stored=10**9,
                  distinct=2 * 10**9, program_distinct=9 * 10**11, flops=10**13)  # shared: re-reads hit the L2
    tile.update(loaded=9 * 10**11, stored=10**9, smem=10**12)
    (g,) = cm.model_times({"forward/k": tile}, hw)
    assert g.l2_bytes == 9.01e11 and g.l2_s == pytest.approx(9.01e11 / hw.l2_bytes_per_s)
    assert g.smem_s == pytest.approx(10**12 / hw.smem_bytes_per_s)
    assert g.seconds == g.l2_s > g.flop_s and g.dominant == "L2"
    gemm = {"launches": 1, "loaded": 10**9, "stored": 10**9, "flops:bf16": 10**14}
    (t,) = cm.model_times({"torch/backward/aten.mm[VD]": gemm}, hw)
    assert t.l2_bytes == pytest.approx(10**14 / 85.3) and t.smem_bytes == pytest.approx(2 * 10**14 / 85.3)
    assert t.seconds == pytest.approx(max(t.flop_s, t.l2_s)) and t.l2_s > t.flop_s  # 85 FLOP/B < 110 at the peak
    (e,) = cm.model_times({"torch/forward/aten.exp": {"launches": 1, "loaded": 10**9, "stored": 10**9}}, hw)
    assert e.l2_bytes == 2 * 10**9 and e.smem_bytes == 0


def test_cuda_only_addmm_out_dtype_is_emulated_and_counted():
    acc, a, b = torch.randn(4, 3), torch.randn(4, 5).bfloat16(), torch.randn(5, 3).bfloat16()
    want = acc + a.float() @ b.float()
    recs = [r for r in cost.count_launches(lambda: torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc))]
    torch.testing.assert_close(acc, want)
    (r,) = [r for r in recs if r.flops]
    assert r.name == "aten.addmm" and r.flops == {"bf16": 2 * 4 * 5 * 3}
    assert (r.loaded, r.stored) == (4 * 3 * 4 + (4 * 5 + 5 * 3) * 2, 4 * 3 * 4)  # acc is read and written
    acc.fill_(float("nan"))  # beta = 0 (erpo_loss's first cuBLAS product of a chunk): acc is not read
    recs = cost.count_launches(lambda: torch.addmm(acc, a, b, beta=0, out_dtype=torch.float32, out=acc))
    torch.testing.assert_close(acc, a.float() @ b.float())
    (r,) = [r for r in recs if r.flops]
    assert (r.loaded, r.stored) == ((4 * 5 + 5 * 3) * 2, 4 * 3 * 4)


def test_liger_weight_grad_rewrite_to_its_cuda_addmm():
    from bench.cost_subjects import _liger_gpu_weight_grad

    g, x = torch.randn(8, 6).bfloat16(), torch.randn(8, 4).bfloat16()
    gw = torch.zeros(6, 4).bfloat16()
    with cost.counting("backward") as recs:
        gw += torch.mm(g.t(), x).float()  # Liger's CPU branch
    (r,) = [r for r in _liger_gpu_weight_grad(recs) if r.flops]
    assert r.name == "aten.addmm" and r.flops == {"bf16": 2 * 6 * 8 * 4}
    assert (r.loaded, r.stored) == ((8 * 6 + 8 * 4 + 6 * 4) * 2, 6 * 4 * 2)
    assert not any(x.name in ("aten._to_copy", "aten.add_") for x in _liger_gpu_weight_grad(recs))


# ----------------------------------------------------------------------------- the commands


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts erpo_kernels in Triton's interpreter: a CUDA device "
                    "is present, so bench/gpu_check.sh's tests compile them")
def test_bench_cost_command_and_its_generated_section(tmp_path):
    """`python -m bench cost` on our token op at a small target: an exact fit, the model's times,
    a results file, and the generated tables between the doc's markers."""
    from bench import report
    from bench.__main__ import main

    assert main(["cost", "--subjects", "erpo", "--ops", "token_logprobs", "--targets", "64x1x4480",
                 "--out-dir", str(tmp_path), "--jobs", "1"]) == 0
    (run,) = report.cost_runs(tmp_path)
    (s,) = run["subjects"]
    assert (s["name"], s["status"], s["exact"]) == ("erpo", "ok", True)
    (r,) = s["results"]
    g = {x["group"]: x for x in r["groups"]}
    fwd = g["forward/_token_logprobs_fwd_kernel"]
    assert fwd["programs"] == 64 and fwd["loaded"] >= 64 * 4480 * 2  # one program per row, reads each logit
    assert r["passes"]["both"]["H200"]["ms"] == pytest.approx(sum(x["model"]["H200"]["ms"] for x in g.values()))
    assert r["passes"]["forward"]["H100"]["ms"] == pytest.approx(
        sum(x["model"]["H100"]["ms"] for k, x in g.items() if "forward/" in k))
    assert run["commit"] and run["versions"]["triton"]
    doc = tmp_path / "doc.md"
    doc.write_text(f"# t\n{report.COST_START}\nold\n{report.COST_END}\nend\n")
    assert report.write_between(doc, report.COST_START, report.COST_END, report.cost_markdown(tmp_path))
    text = doc.read_text()
    assert "Model, not a measurement" in text and "| `erpo` | " in text and "old" not in text
    assert text.endswith(f"{report.COST_END}\nend\n")
    # what a worker process of --jobs N runs: the same counts (the PyTorch reference: no kernel, any machine)
    from bench import cost_subjects as cs

    sub = next(x for x in cs.SUBJECTS if x.name == "erpo-reference" and x.op == "token_logprobs")
    plan = sub.fit_plan((64, 1, 4480))
    job = cs._count_job("erpo-reference", "token_logprobs", (64, 1, 4480), plan.fit[0])
    assert job == cs.count(sub, plan.fit[0], plan) and any("softmax" in g and q["loaded"] for g, q in job.items())
    with pytest.raises(SystemExit, match="NxDxV"):
        main(["cost", "--targets", "64x1", "--out-dir", str(tmp_path)])


def test_bench_calibrate_records_times_beside_the_model(tmp_path):
    from bench import calibrate, report
    from bench.__main__ import main

    assert main(["calibrate", "--device", "cpu", "--targets", "16x8x40", "--subjects", "erpo-reference",
                 "--repeats", "1", "--out-dir", str(tmp_path), "--machine", "smoke", "--no-report"]) == 0
    data = report.load(tmp_path / "smoke.json")
    (run,) = data["runs"]
    got = {(r["case"], r["pass"]) for r in run["results"] if r["status"] == "ok"}
    assert got == {("gemm-fwd", "forward"), ("gemm-bwd", "backward"), ("erpo-reference", "forward"),
                   ("erpo-reference", "both")}
    assert report.calibration_table(data)[0].startswith("Cost-model calibration")
    assert calibrate.hardware_of("NVIDIA H200") == "H200" and calibrate.hardware_of("Tesla T4") is None
    cost_run = {"subjects": [{"name": "erpo", "op": "linear_token_logprobs", "status": "ok", "results": [
        {"shape": {"N": 16, "D": 8, "V": 40}, "passes": {p: {"H200": {"ms": 2.0}} for p in ("forward", "both")}}]}]}
    assert calibrate.model_predictions(cost_run, "H200") == {("erpo", 16, 8, 40, "forward"): 2.0,
                                                             ("erpo", 16, 8, 40, "both"): 2.0}
    hw = calibrate.HARDWARE["H200"]
    n, d, v = 8192, 4096, 151936
    assert calibrate.gemm_model_ms((n, d, v), "gemm-fwd", hw) == pytest.approx(
        max(2 * n * d * v / hw.peaks["bf16"], 2 * (n * d + v * d + n * v) / hw.hbm_bytes_per_s) * 1e3)


def test_bench_calibrate_puts_the_model_beside_each_measurement(tmp_path, monkeypatch):
    """Each calibrate record carries the newest `bench cost` run's prediction for its case (the
    GEMMs: their own rule) and measured / model; the report's table shows both. On CPU the model
    is off (no GPU to compare with): here the device is taken for an H200."""
    from bench import calibrate, report
    from bench.__main__ import main

    shape = {"N": 16, "D": 8, "V": 40}
    old = {"commit": "0ld", "subjects": [{"name": "erpo-reference", "op": "linear_token_logprobs", "status": "ok",
                                          "results": [{"shape": shape, "passes": {p: {"H200": {"ms": 9.0}}
                                                                                  for p in ("forward", "both")}}]}]}
    new = {"commit": "c0ffee", "subjects": [dict(old["subjects"][0], results=[
        {"shape": shape, "passes": {"forward": {"H200": {"ms": 2.0}}, "both": {"H200": {"ms": 5.0}}}}])]}
    report.append_cost_run(old, tmp_path)
    report.append_cost_run(new, tmp_path)
    monkeypatch.setattr(calibrate, "model_hardware", lambda device, name: "H200")
    assert main(["calibrate", "--device", "cpu", "--targets", "16x8x40", "--subjects", "erpo-reference",
                 "--repeats", "1", "--out-dir", str(tmp_path), "--machine", "smoke", "--no-report"]) == 0
    data = report.load(tmp_path / "smoke.json")
    (run,) = data["runs"]
    assert (run["hardware_model"], run["model_commit"]) == ("H200", "c0ffee")  # the newest cost run
    recs = {(r["case"], r["pass"]): r for r in run["results"]}
    hw = calibrate.HARDWARE["H200"]
    want = {("erpo-reference", "forward"): 2.0, ("erpo-reference", "both"): 5.0,
            ("gemm-fwd", "forward"): calibrate.gemm_model_ms((16, 8, 40), "gemm-fwd", hw),
            ("gemm-bwd", "backward"): calibrate.gemm_model_ms((16, 8, 40), "gemm-bwd", hw)}
    assert {k: r["model_ms"] for k, r in recs.items()} == want
    for r in recs.values():
        assert r["status"] == "ok" and r["measured_over_model"] == pytest.approx(r["median_ms"] / r["model_ms"])
    table = "\n".join(report.calibration_table(data))
    assert "commit c0ffee" in table and "| erpo-reference | " in table
    r = recs[("erpo-reference", "both")]
    assert f"| {r['median_ms']:.2f} | 5.00 | {r['measured_over_model']:.2f}x |" in table
    monkeypatch.undo()
    assert calibrate.model_hardware("cpu", "NVIDIA H200") is None
    assert calibrate.model_hardware("cuda", "NVIDIA H100 80GB HBM3") == "H100"


@torch.library.custom_op("erpo_cost_test::copy", mutates_args=())
def _copy_op(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    COPY[(triton.cdiv(x.numel(), 128),)](x, y, x.numel(), BLOCK=128)
    return y * 2


@torch.library.custom_op("erpo_cost_test::matmul", mutates_args=())
def _matmul_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a.to(torch.float64), b.to(torch.float64))


def test_a_custom_op_is_counted_by_what_it_runs():
    x = torch.randn(300)
    recs = cost.count_launches(lambda: _copy_op(x))
    assert [r.name for r in recs if r.loaded or r.stored] == ["_copy", "aten.mul"]  # not the op itself on top
    torch.testing.assert_close(_copy_op(x), 2 * x)
    # composite ops inside a custom op (matmul, to) reach the counter undecomposed: counted as what they
    # decompose into, with their FLOPs, as outside one (the reference linear op lost its FLOPs before)
    a, b = torch.randn(5, 3), torch.randn(3, 4)
    inside = cost.count_launches(lambda: _matmul_op(a, b))
    outside = cost.count_launches(lambda: torch.matmul(a.to(torch.float64), b.to(torch.float64)))
    assert [(r.name, r.flops, r.loaded, r.stored) for r in inside] == \
        [(r.name, r.flops, r.loaded, r.stored) for r in outside]
    assert [r.name for r in inside] == ["aten._to_copy", "aten._to_copy", "aten.mm"]
    assert inside[-1].flops == {"fp64": 2 * 5 * 3 * 4}


def test_bench_cost_writes_the_untracked_results_unless_recorded(monkeypatch):
    # issue 29: like bench kernels, a run goes to bench/results/local (untracked) unless --record
    from bench import cost_subjects as cs
    from bench import report
    from bench.__main__ import LOCAL_RESULTS_DIR, main
    from bench.measure import RESULTS_DIR

    saved = []
    monkeypatch.setattr(cs, "run", lambda subjects, targets, jobs=1: {"subjects": []})
    monkeypatch.setattr(report, "cost_tables", lambda run: [])
    monkeypatch.setattr(report, "append_cost_run", lambda run, out_dir: saved.append(str(out_dir)) or out_dir)
    args = ["cost", "--subjects", "erpo-reference", "--ops", "token_logprobs", "--targets", "64x1x4480"]
    assert main(args) == 0 and main(args + ["--record"]) == 0
    assert saved == [str(LOCAL_RESULTS_DIR), str(RESULTS_DIR)]


# ----------------------------------------------------------------------------- the fused losses (bench.cost_losses)


def test_loss_layout_and_our_batch():
    from bench import cost_losses as cl

    layout = cl.LossLayout(seq_rows=8, prompt_rows=3, group=2)
    batch = cl.loss_batch(32, layout, 50)  # 4 sequences of 8 rows, 2 queries
    batch.validate()
    assert (batch.num_rows, batch.num_sequences, batch.num_queries) == (32, 4, 2)
    assert batch.span_cu_seqlens.tolist() == [0, 2, 8, 10, 16, 18, 24, 26, 32]  # prompt spans of T - 1 rows
    assert torch.all(batch.targets == 0)  # every row scored, token 0 (cost_subjects.TARGETS_NOTE, cost_losses.LAYOUT)
    with pytest.raises(ValueError, match="whole queries"):
        layout.sequences(24)  # 3 sequences: not whole queries of 2
    assert cl.LAYOUT.sequences(8192) == 16 and cl.LAYOUT.group == 1


def test_the_peers_loss_subjects_compute_their_grpo_loss():
    """liger-grpo and trl-grpo run the peers' own loss code: on-policy (ratio 1) with loss_type
    dapo and beta 0 the loss is -sum_t A_b(t) / N and its gradient that of -A_b(t) / N logp_t,
    checked against a float64 log_softmax."""
    from bench import cost_losses as cl

    layout = cl.LossLayout(seq_rows=3, prompt_rows=1, group=2)
    n, d, v = 12, 8, 40
    g = torch.Generator().manual_seed(3)
    h0, w0 = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g) / 3
    adv = cl._advantages(n // 3, n).repeat_interleave(3)  # A_b of each row's sequence
    logp = torch.log_softmax(h0.double() @ w0.double().t(), dim=-1)[:, 0]  # every target is token 0
    want = -(adv.double() * logp).sum() / n
    gh, gw = torch.autograd.functional.vjp(
        lambda h, w: -(adv.double() * torch.log_softmax(h @ w.t(), dim=-1)[:, 0]).sum() / n,
        (h0.double(), w0.double()))[1]
    for call in (cl._liger_grpo, cl._trl_grpo):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = call(h, w, layout)
        loss.backward()
        assert float(loss.detach()) == pytest.approx(-float(adv.sum()) / n, abs=1e-6) and float(want.detach()) != 0
        torch.testing.assert_close(h.grad.double(), gh, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(w.grad.double(), gw, rtol=1e-4, atol=1e-6)


def test_liger_grpo_fits_exactly_on_held_out_shapes():
    """Counted with a 16-column vocabulary chunk and a layout per shape (B apart from N), the
    fit reproduces both held-out shapes exactly; at the target its real 4096-column chunks and
    B = N / 512 one-sequence chunks are what is evaluated."""
    from bench import cost_subjects as cs

    sub = next(s for s in cs.SUBJECTS if s.name == "liger-grpo")
    fit = cs.fit_subject(sub, cs.TARGETS[0], {}, log=lambda *a: None)
    assert fit.fit_exact and fit.exact and len(fit.checks) == 2, fit.checks
    r = cs.evaluate(fit, cs.TARGETS[0])
    flops = {}
    for grp in r["groups"]:
        for k, x in grp["flops"].items():
            flops[k] = flops.get(k, 0) + x
    n, d, v = cs.TARGETS[0]
    # its forward runs 4 GEMMs of work: the logits twice in bf16, the two gradient GEMMs in fp32
    assert flops == {"bf16": 2 * 2 * n * d * v, "fp32": 2 * 2 * n * d * v}
    assert r["passes"]["backward"]["H200"]["ms"] < 1e-3  # its backward returns what the forward formed


def test_cost_view_keeps_the_subjects_a_restricted_run_did_not_count():
    """`bench cost --record --subjects a,b` appends a run with only those: the docs show them
    beside the other subjects' newest records of the same model, each with its own commit."""
    from bench import report

    def run(commit, names, hw=1.0, ms=1.0):
        return {"commit": commit, "hardware": {"H200": {"x": hw}}, "bytes_rule": "b", "l2_rule": "l",
                "targets": [{"N": 1, "D": 1, "V": 1}],
                "subjects": [{"name": n, "op": "loss", "status": "ok", "ms": ms} for n in names]}

    runs = [run("a0", ["erpo", "liger"], ms=1.0), run("b1", ["erpo"], hw=2.0), run("c2", ["erpo", "trl"], ms=3.0)]
    view = report.current_cost_run(runs)
    got = {s["name"]: (s["commit"], s["ms"]) for s in view["subjects"]}
    assert got == {"erpo": ("c2", 3.0), "trl": ("c2", 3.0), "liger": ("a0", 1.0)}  # b1: another model, not used
    assert view["commit"] == "c2" and report.current_cost_run([]) is None


def _loss_run(names_ms):
    from bench.cost_model import HARDWARE, gemm_floor_s

    n, d, v = 8192, 4096, 151936
    floors = {hw: {f"{k}-GEMM": gemm_floor_s((n, d, v), k, h) * 1e3 for k in (1, 2, 3, 4)} for hw, h in HARDWARE.items()}
    subs = [{"name": name, "op": "loss", "label": name, "status": "ok", "exact": True, "version": None,
             "results": [{"shape": {"N": n, "D": d, "V": v}, "floors_ms": floors, "groups": [],
                          "passes": {p: {"H200": {"ms": ms}} for p in ("forward", "backward", "both")}}]}
            for name, ms in names_ms]
    return {"commit": "c0ffee", "hardware": {k: vars(h) for k, h in HARDWARE.items()}, "bytes_rule": "rule",
            "l2_rule": "l2", "targets_note": "note", "layout_note": "B = N / 512", "subjects": subs}


def test_cost_tables_and_readme_line_show_the_fused_losses_against_the_3_gemm_floor():
    from bench import report

    run = _loss_run([("trl-grpo", 56.5), ("erpo-loss", 40.0), ("liger-grpo", 433.7)])
    text = "\n".join(report.cost_tables(run))
    assert "| fused loss (hidden, weight -> scalar) |" in text and "| 3-GEMM floor | 30.9 ms |" in text
    assert "| `erpo-loss` | 40.0 ms (1.29x 3-GEMM floor, " in text and "B = N / 512" in text
    assert text.index("`erpo-loss`") < text.index("`liger-grpo`") < text.index("`trl-grpo`")
    line = report.cost_summary_line(run)
    assert "fused loss fwd+bwd at N=8192 D=4096 V=151936 (3-GEMM floor 30.9 ms): `erpo-loss` 40.0 ms (1.29x)" in line


def test_erpo_loss_plan_determines_every_term_and_counts_the_ops_own_chunks():
    """erpo-loss is counted at sm_90's residue grid with layouts whose chunks are whole row tiles;
    the fit's terms (N, K, B, K B, [K = 1] times 1, D, V, DV) are all determined by the counted shapes, and
    K at a target is erpo_loss's own plan: row_chunks of rows_for_budget(1 GiB, V) rows."""
    import numpy as np

    from bench import cost_losses as cl
    from bench import cost_subjects as cs
    from erpo_kernels.fused_linear_loss import DEFAULT_FUSED_BUDGET, rows_for_budget

    plan = cl._erpo_loss_plan(cs.TARGETS[0])
    terms = list(plan.features(plan.fit[0]))
    a = np.array([[float(plan.features(s)[t]) for t in terms] for s in plan.fit])
    assert np.linalg.matrix_rank(a) == len(terms) == len(plan.fit)
    assert {"B", "K", "KDV", "KB", "K1.1", "K1.NDV"} <= set(terms)
    tiles = cl.erpo_loss_tiles(0)
    assert all(s[0] % tiles.block_n == 0 for s in plan.fit + plan.check)
    for n, d, v in cs.TARGETS:
        per_chunk = rows_for_budget(DEFAULT_FUSED_BUDGET, v, cs.DTYPE) // cl.LAYOUT.seq_rows  # whole sequences
        want = -(-cl.LAYOUT.sequences(n) // per_chunk)
        assert cl.erpo_chunks(n, v, cl.LAYOUT) == want and plan.target_features((n, d, v))["K"] == want
    # bf16: 16-bit kept logits (2 bytes a logit), 3 chunks at 8192 rows
    assert cl.erpo_chunks(8192, 151936, cl.LAYOUT) == 3
    # 2048 rows are one chunk (no fp32 d_weight accumulator): its own terms, counted at K = 1 and checked there
    assert cl.erpo_chunks(2048, 151936, cl.LAYOUT) == 1 and plan.target_features((2048, 4096, 151936))["K1.NDV"] == \
        2048 * 4096 * 151936 and plan.target_features((8192, 4096, 151936))["K1.1"] == 0
    assert any(plan.features(s)["K1.1"] == 1 for s in plan.check) and sum(plan.features(s)["K1.1"] for s in plan.fit) == 8
    assert cl.budget_for_rows(256, 4480) == 256 * 2 * 4480 and rows_for_budget(cl.budget_for_rows(256, 4480) - 1,
                                                                                4480, cs.DTYPE) == 255


def test_support_costs_line_is_each_forms_counted_difference():
    from bench import report

    def sub(name, op, ms, hbm):
        return {"name": name, "op": op, "status": "ok", "results": [
            {"shape": {"N": 8192, "D": 4096, "V": 151936}, "passes": {"both": {"H200": {"ms": ms}}},
             "groups": [{"model": {"H200": {"hbm_bytes": hbm}}}]}]}

    run = {"subjects": [sub("erpo", "token_logprobs", 1.5, 7e9), sub("erpo-support-bitmask", "token_logprobs", 1.75,
                                                                       7.3e9)]}
    (line, _) = report.support_lines(run)
    assert "token_logprobs with a bitmask (ceil(V / 32) int32 words per row): N=8192 V=151936: +0.250 ms, +300 MB HBM" \
        in line and "threshold" not in line
    assert report.support_lines({"subjects": run["subjects"][:1]}) == []


@pytest.mark.parametrize("name", ["erpo-loss", "erpo-loss-triton", "erpo"])
def test_our_subjects_count_their_products_engine_as_on_cuda(name):
    """erpo-loss and erpo (linear_token_logprobs) are counted on the sm_90 default tiles and their
    products engine (cuBLAS since 87f5527: bf16-operand matmuls accumulating in fp32, counted as on
    CUDA through the plan's patch: no fp32 GEMM, no upcast operands), erpo-loss-triton on our
    Triton products (no torch GEMM)."""
    from bench import cost_losses as cl
    from bench import cost_subjects as cs

    subject = next(s for s in cs.SUBJECTS if s.name == name and s.op in (cl.LOSS, cs.LINEAR))
    n, d, v = 64, 64, 300
    plan = subject.fit_plan(cs.TARGETS[0])
    engine = 0 if name == "erpo-loss-triton" else cl.erpo_loss_tiles().gemm_engine
    with cl._with_layout(cl.LossLayout(32, 8, 1)), cs.counted_tiles(), plan.patch((n, d, v)) if name == "erpo" \
            else cl.cuda_products():  # fmt: skip
        forward, backward = subject.closures((n, d, v))
        recs = cost.count_launches(lambda: backward(forward()))
    gemms = [r for r in recs if r.kind == "torch" and r.flops]
    triton_flops = sum(r.total_flops for r in recs if r.kind == "triton")
    assert all(set(r.flops) == {"bf16"} for r in gemms), [(r.name, r.flops) for r in gemms]
    full = 2 * n * d * v  # one GEMM's work
    assert (sum(r.total_flops for r in gemms) >= 2 * full) == (engine == 1)  # the two products
    assert triton_flops >= (3 if engine == 0 else 1) * full


def test_our_torch_products_are_one_group_whatever_a_chunk_of_rows_is_long():
    """Our subjects' only torch GEMMs are the products: d_hidden's [rows, D] and d_weight's [C, D]
    are one group, also at a counting shape whose chunk has D rows (a [D, D] output; by output
    pattern that group would exist at no target and the fit would extrapolate two wrong groups)."""
    from bench import cost_subjects as cs
    from bench.cost_model import flatten

    shape = (768, 256, 4480)
    recs = [cost.Launch(name="aten.addmm", kind="torch", phase="forward", flops={"bf16": 1}, loaded=1, out_shape=out)
            for out in ((256, 256), (512, 256), (4096, 256))]
    for s in cs.SUBJECTS:
        if s.name.startswith("erpo") and s.op in (cs.LINEAR, cs.LOSS) and "reference" not in s.name:
            assert list(flatten(recs, shape, s.gemm_roles)) == ["torch/forward/aten.addmm"], s.name
