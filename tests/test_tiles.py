"""Tiles per GPU architecture (erpo_kernels.tiles, issue 26): default_tiles for every op and
architecture, the op launching with its device's tiles, and every kernel of both ops
compiled ahead of time for sm_80, 86, 89, 90, 100 and 120 at those tiles (bench/aot.py, no
GPU needed): within the architecture's shared memory per block, no spills, dots on its
tensor cores (HMMA / HGMMA / UTCHMMA), fp32 dots without TF32.
"""
import importlib

import pytest
import torch

from erpo_kernels import RowTiles, Tiles, default_tiles, linear_token_logprobs, token_logprobs
from erpo_kernels.tiles import ARCHITECTURES, SHARED_MEMORY_PER_BLOCK, TENSOR_CORE_INSTRUCTION

tiles_module = importlib.import_module("erpo_kernels.tiles")
ltl = importlib.import_module("erpo_kernels.linear_token_logprobs")
tlp = importlib.import_module("erpo_kernels.token_logprobs")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def test_default_tiles_for_every_op_and_architecture():
    assert ARCHITECTURES == ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0))
    conservative = default_tiles("linear_token_logprobs", torch.bfloat16, (8, 6))
    for dtype in DTYPES:
        for cap in ARCHITECTURES:
            assert isinstance(default_tiles("linear_token_logprobs", dtype, cap), Tiles)
            assert isinstance(default_tiles("token_logprobs", dtype, cap), RowTiles)
        # an architecture not in the table (older, newer, a minor not listed) or no GPU: the
        # conservative tiles, never an error
        for cap in ((7, 5), (8, 7), (11, 0), (13, 0), None):
            want = default_tiles("linear_token_logprobs", dtype, (8, 6))
            assert default_tiles("linear_token_logprobs", dtype, cap) == want
            assert isinstance(default_tiles("token_logprobs", dtype, cap), RowTiles)
    assert default_tiles("linear_token_logprobs", torch.bfloat16, None) == conservative
    # Hopper / Blackwell: tiles of at least 128 x 128 for the logits and the products (64 FLOP
    # per L2 byte), Blackwell's products 128 x 256 (85): what spills nowhere (the sweep below)
    for cap in ((9, 0), (10, 0)):
        t = default_tiles("linear_token_logprobs", torch.bfloat16, cap)
        assert min(t.block_n, t.block_v) >= 128, t
        assert min(t.gemm_v, t.gemm_d) >= 128 and min(t.gemm_n, t.gemm_d) >= 128, t
    t = default_tiles("linear_token_logprobs", torch.bfloat16, (10, 0))
    assert t.gemm_v * t.gemm_d >= 128 * 256 and t.gemm_n * t.gemm_d >= 128 * 256, t
    # erpo_loss's kept-logit forward (never recomputed): its own 128 x 256 tiles on Hopper (85 FLOP
    # per L2 byte) over the op's 4096-column chunks; elsewhere the op's own
    hopper = default_tiles("linear_token_logprobs", torch.bfloat16, (9, 0))
    assert (hopper.kept_block_v, hopper.kept_forward().block_v, hopper.kept_forward().split_tiles) == (256, 256, 16)
    assert hopper.kept_forward().split_tiles * 256 == hopper.split_tiles * hopper.block_v
    for dtype in DTYPES:
        for cap in ARCHITECTURES:
            t = default_tiles("linear_token_logprobs", dtype, cap)
            assert t.kept_block_v == (256 if cap == (9, 0) and dtype != torch.float32 else 0), (cap, dtype)
            assert t.kept_forward() is t or cap == (9, 0)
    with pytest.raises(ValueError, match="op must be one of"):
        default_tiles("segment_sum", torch.bfloat16, (9, 0))
    assert SHARED_MEMORY_PER_BLOCK[(8, 9)] == 101_376 and TENSOR_CORE_INSTRUCTION[(10, 0)] == "UTCHMMA"


def test_sm90_products_on_cublas_in_the_op_backward_and_the_fused_path(device):
    """Issue 33 plan item 1: sm_90's low-precision default runs the products on torch matmuls
    (gemm_engine 1; fp32 and sm_100 keep ours). At those tiles (three stages cut to two, to
    launch on any GPU; stages change no result), bf16 through the op's own backward and
    through erpo_loss's fused path over three row chunks: as close to float64 as PyTorch."""
    from dataclasses import replace

    from _compare import assert_close_to_ref
    from test_fused_linear_loss import CHUNKS, _fused
    from test_linear_token_logprobs import _inputs, _ours, _torch_same_dtype, _truth

    tiles = default_tiles("linear_token_logprobs", torch.bfloat16, (9, 0))
    assert tiles.gemm_engine == 1 and default_tiles("linear_token_logprobs", torch.float16, (9, 0)).gemm_engine == 1
    assert default_tiles("linear_token_logprobs", torch.float32, (9, 0)).gemm_engine == 0
    assert default_tiles("linear_token_logprobs", torch.bfloat16, (10, 0)).gemm_engine == 0
    tiles = replace(tiles, num_stages=2, gemm_stages=2)
    args = _inputs(torch.bfloat16, device)
    truth, same = _truth(*args), _torch_same_dtype(*args, dtype=torch.bfloat16)
    for path, ours in (("op", _ours(*args, backend="triton", tiles=tiles)),
                       ("fused", _fused(*args, chunks=CHUNKS["three"], tiles=tiles))):  # fmt: skip
        for name, o, t, s in zip(("logp", "entropy", "d_hidden", "d_weight", "d_bias"), ours, truth, same):
            assert_close_to_ref(o.cpu(), t.cpu(), s.cpu(), input_dtype=torch.bfloat16, name=f"{path} {name}")


def test_logit_tiles_in_parts_match_one_part(device):
    """The logit kernels form a tile of block_v >= 128 columns as parts of 64 or more from one
    loop over D and run the epilogue (transform, support, online softmax, kept store; the
    recompute's dr) part after part: in fp32, tiles of 256 columns (four parts of 64, the
    last partly past V = 211) and of 128 (two parts) give what tiles of 32 (one part) give within 1e-5,
    with a bias, a soft cap and a bitmask support, through the op's forward and backward and
    through erpo_loss's fused path (which stores and reads the kept logits)."""
    from dataclasses import replace

    from erpo_kernels.support import pack_support
    from test_fused_linear_loss import CHUNKS, _fused
    from test_linear_token_logprobs import N, V, _inputs, _ours

    one = Tiles(block_n=16, block_v=32, block_d=16, num_warps=4, split_tiles=8, gemm_n=16, gemm_v=16, gemm_d=16,
                gemm_warps=4, gemm_k=16)
    args = _inputs(torch.float32, device)
    support = pack_support(torch.rand(N, V) < 0.7).to(device)
    options = dict(softcap=3.0, logit_scale=1.7)
    names = ("logp", "entropy", "d_hidden", "d_weight", "d_bias")
    ref = _ours(*args, backend="triton", tiles=one, support=support, **options)
    ref_fused = _fused(*args, chunks=CHUNKS["three"], tiles=one, **options)
    for tiles in (replace(one, block_v=256, split_tiles=1), replace(one, block_v=128, split_tiles=2)):
        got = _ours(*args, backend="triton", tiles=tiles, support=support, **options)
        fused = _fused(*args, chunks=CHUNKS["three"], tiles=tiles, **options)
        for name, o, r, f, rf in zip(names, got, ref, fused, ref_fused):
            torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5, msg=f"{tiles.block_v} {name}")
            torch.testing.assert_close(f, rf, atol=1e-5, rtol=1e-5, msg=f"{tiles.block_v} fused {name}")


@pytest.fixture
def fake_gpu(monkeypatch):
    """CPU tensors looked up as if on a GPU of the capability set in the returned dict."""
    gpu = {"cap": (9, 0), "name": "NVIDIA H200"}
    monkeypatch.setattr(tiles_module, "device_capability", lambda device: gpu["cap"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu["name"])
    tiles_module._device_tiles.cache_clear()
    yield gpu
    tiles_module._device_tiles.cache_clear()


def test_each_op_launches_with_its_devices_tiles_and_tiles_overrides(fake_gpu, monkeypatch):
    seen = []
    real = ltl._forward
    monkeypatch.setattr(ltl, "_forward", lambda launch, *a: (seen.append(launch.tiles), real(launch, *a))[1])
    h, w = torch.randn(5, 16), torch.randn(40, 16)
    t = torch.randint(0, 40, (5,))
    for cap in ((9, 0), (8, 9), (7, 0)):
        fake_gpu["cap"] = cap
        tiles_module._device_tiles.cache_clear()
        linear_token_logprobs(h, w, t, backend="triton")
        assert seen[-1] == default_tiles("linear_token_logprobs", torch.float32, cap)
    mine = Tiles(block_n=16, block_v=16, block_d=16, split_tiles=1, gemm_n=16, gemm_v=16, gemm_d=16, gemm_k=16)
    linear_token_logprobs(h, w, t, backend="triton", tiles=mine)
    assert seen[-1] == mine
    got = []
    real_cfg = tlp._launch_config
    monkeypatch.setattr(tlp, "_launch_config", lambda v, b, p: (got.append(b), real_cfg(v, b, p))[1])
    token_logprobs(torch.randn(3, 40), torch.randint(0, 40, (3,)), backend="triton")
    assert got[-1] == default_tiles("token_logprobs", torch.float32, (7, 0)).fwd_max_block_v


_AOT = r"""
import json
from bench.aot import compile_all, jobs
todo = jobs([80, 86, 89, 90, 100, 120], ["linear_token_logprobs", "token_logprobs"], ["bf16", "fp16", "fp32"])
print(json.dumps(compile_all(todo)))
"""


def test_every_kernel_compiles_for_every_architecture_within_its_limits():
    # No GPU needed (issue 26): each kernel of both ops, in each dtype and with every optional
    # feature on and off, at the default tiles of sm_80, 86, 89, 90, 100 and 120, compiled in
    # parallel subprocesses (a fresh Triton cache each: nothing of an earlier run is reused).
    from _aot import run_aot

    rows = run_aot(_AOT, timeout=1500)  # 276 compiles, ~220 CPU-s: ~115 s on an idle 2-core machine
    kernels = {"_ltl_fwd_kernel", "_ltl_bwd_dr_kernel", "_ltl_bwd_gemm_kernel", "_ltl_merge_kernel",
               "_fused_dr_kernel", "_token_logprobs_fwd_kernel", "_token_logprobs_bwd_kernel"}
    for arch in (80, 86, 89, 90, 100, 120):
        for dtype in ("bf16", "fp16", "fp32"):
            got = {r["kernel"] for r in rows if r["arch"] == arch and r["dtype"] == dtype}
            assert got | {"_ltl_merge_kernel"} == kernels, (arch, dtype, got)  # the merge: fp32 statistics only
        assert any(r["kernel"] == "_ltl_merge_kernel" for r in rows if r["arch"] == arch)
    # Every kernel within the rules, STACK 0 included (a spill): erpo_loss's kept-logit forward
    # ("kept+" variants), the bitmask support ("support+") and the threshold ("threshold+": the forward's
    # and the recompute's) too, on every architecture
    assert any(r["variant"].startswith("kept+support+") for r in rows)
    assert any(r["variant"].startswith("support+") for r in rows)
    assert {r["kernel"] for r in rows if r["variant"].startswith("threshold+")} == {"_ltl_fwd_kernel",
                                                                                  "_ltl_bwd_dr_kernel"}
    assert {r["problems"] and (r["kernel"], r["variant"], r["dtype"], r["arch"], *r["problems"]) or None
            for r in rows} == {None}
    # what the checks rest on: bf16 dots on each architecture's instruction, fp32 on FMA
    for r in rows:
        if r["has_dots"] and r["dtype"] == "bf16":
            assert TENSOR_CORE_INSTRUCTION[(r["arch"] // 10, r["arch"] % 10)] in r["tensor_core"], r
        if r["has_dots"] and r["dtype"] == "fp32":
            assert r["ffma"] and not r["tf32"], r
    # the backward launches on an L40S (sm_89): its kernels fit 99 KB per block
    bwd89 = [r for r in rows if r["arch"] == 89 and r["kernel"] in ("_ltl_bwd_dr_kernel", "_ltl_bwd_gemm_kernel")]
    assert bwd89 and max(r["shared"] for r in bwd89) <= 101_376 and min(r["ctas_per_sm"] for r in bwd89) >= 1


# ----------------------------------------------------------------------------- tuning (bench tune)


def _entry(d, v, tiles, gpu="NVIDIA H200", dtype="float32"):
    from dataclasses import asdict

    return {"gpu": gpu, "capability": [9, 0], "op": "linear_token_logprobs", "dtype": dtype, "D": d, "V": v,
            "tiles": asdict(tiles), "ms": 1.0}


def test_tuning_file_is_read_by_gpu_dtype_d_and_v_never_n(tmp_path, monkeypatch, fake_gpu):
    from bench.tune import write_entries
    from erpo_kernels import tuning

    path = tmp_path / "tiles.json"
    monkeypatch.setenv(tuning.ENV, str(path))
    tuned = Tiles(block_n=16, block_v=32, block_d=16, num_warps=4, split_tiles=2, gemm_n=16, gemm_v=16, gemm_d=16,
                  gemm_k=16)
    write_entries([_entry(16, 40, tuned), _entry(16, 41, tuned, gpu="NVIDIA B200")], path)
    write_entries([_entry(16, 40, tuned)], path)  # the same key again: replaced, not duplicated
    data = __import__("json").loads(path.read_text())
    assert data["format"] == tuning.FORMAT and len(data["entries"]) == 2
    assert all(len(k) == 5 and "N" not in e for k, e in zip(tuning.parse(data), data["entries"]))
    seen = []
    real = ltl._forward
    monkeypatch.setattr(ltl, "_forward", lambda launch, *a: (seen.append(launch.tiles), real(launch, *a))[1])
    tiles_module._device_tiles.cache_clear()
    w = torch.randn(40, 16)
    for n in (3, 9, 70):  # whatever the batch: the entry of (GPU, dtype, D, V)
        linear_token_logprobs(torch.randn(n, 16), w, torch.randint(0, 40, (n,)), backend="triton")
        assert seen[-1] == tuned
    linear_token_logprobs(torch.randn(3, 16), torch.randn(41, 16), torch.randint(0, 41, (3,)), backend="triton")
    assert seen[-1] == default_tiles("linear_token_logprobs", torch.float32, (9, 0))  # another V; B200's entry
    fake_gpu["name"] = "NVIDIA B200"
    tiles_module._device_tiles.cache_clear()
    linear_token_logprobs(torch.randn(3, 16), torch.randn(41, 16), torch.randint(0, 41, (3,)), backend="triton")
    assert seen[-1] == tuned


def test_a_bad_tuning_file_warns_and_the_defaults_apply(tmp_path, monkeypatch, fake_gpu):
    from erpo_kernels import tuning

    path = tmp_path / "tiles.json"
    monkeypatch.setenv(tuning.ENV, str(path))
    for text in ("{not json", '{"format": "other", "entries": []}',
                 '{"format": "erpo-tiles/1", "entries": [{"gpu": "NVIDIA H200", "op": "linear_token_logprobs", '
                 '"dtype": "float32", "D": 16, "V": 40, "tiles": {"block_n": 3}}]}'):
        path.write_text(text)
        tuning.clear_cache()
        tiles_module._device_tiles.cache_clear()
        with pytest.warns(UserWarning, match="ignoring the tuning"):
            got = tiles_module.launch_tiles("linear_token_logprobs", torch.empty(1, 16), 16, 40)
        assert got == default_tiles("linear_token_logprobs", torch.float32, (9, 0))
    tuning.clear_cache()


def test_tune_candidates_check_and_choice():
    from bench import tune

    for cap in ARCHITECTURES + ((7, 5),):
        for dtype in DTYPES:
            cands = tune.candidates(cap, dtype)
            assert cands[0] == default_tiles("linear_token_logprobs", dtype, cap) and len(set(cands)) == len(cands)
    cap, dtype = (9, 0), torch.bfloat16
    cands = tune.candidates(cap, dtype)
    # only what passes the compile check is timed; an architecture the check does not know keeps all
    ok = tune.passing(cap, dtype, cands, check=lambda c, d, t: t.block_n == 128)
    assert ok == [t for t in cands if t.block_n == 128] and tune.passing((7, 5), dtype, cands, check=None) == cands
    times = {t: 5.0 - i for i, t in enumerate(ok)}
    times[ok[1]] = 0.5
    log = []
    entry = tune.tune_one("NVIDIA H200", cap, dtype, 4096, 151936, deadline=float("inf"), log=log.append,
                          timer=lambda t, *a: times[t], check=lambda c, d, t: t.block_n == 128)
    assert entry["tiles"] == __import__("dataclasses").asdict(ok[1]) and entry["ms"] == 0.5
    assert len(entry["timed"]) == len(ok) and (entry["D"], entry["V"], entry["dtype"]) == (4096, 151936, "bfloat16")


def test_tune_records_the_faster_products_engine_and_the_fused_path_reads_it(tmp_path, monkeypatch, fake_gpu):
    """Issue 33 item 2: bench tune times erpo_loss's fused path with the fastest tiles on both
    products engines (Tiles.gemm_engine: 0 Triton, 1 cuBLAS) and records the faster in the
    tuning file; an engine that fails is left out; the op's lookup returns the choice and the
    fused path runs its products on it."""
    from dataclasses import asdict, replace

    from bench import tune
    from bench.cost_losses import LossLayout, loss_batch
    from erpo_kernels import LossConfig, erpo_loss, fused_linear_loss, tuning

    cap, dtype = (9, 0), torch.float32
    cands = tune.candidates(cap, dtype)
    engine_ms = {0: 3.0, 1: 2.0}
    common = dict(deadline=float("inf"), log=[].append, timer=lambda t, *a: 1.0 + cands.index(t),
                  check=lambda *a: True)
    entry = tune.tune_one("NVIDIA H200", cap, dtype, 16, 40, engine_timer=lambda t, *a: engine_ms[t.gemm_engine],
                          **common)
    assert (entry["engine"], entry["engine_ms"]) == ("cublas", {"triton": 3.0, "cublas": 2.0})
    assert entry["tiles"] == asdict(replace(cands[0], gemm_engine=1)) and entry["ms"] == 1.0  # the fastest tiles

    def cublas_fails(t, *a):
        if t.gemm_engine:
            raise RuntimeError("out of resources")
        return 3.0

    kept = tune.tune_one("NVIDIA H200", cap, dtype, 16, 40, engine_timer=cublas_fails, **common)
    assert (kept["engine"], kept["engine_ms"], kept["tiles"]["gemm_engine"]) == ("triton", {"triton": 3.0}, 0)
    path = tmp_path / "tiles.json"
    monkeypatch.setenv(tuning.ENV, str(path))
    tune.write_entries([entry], path)
    got = tuning.tuned_tiles("linear_token_logprobs", "NVIDIA H200", dtype, 16, 40, Tiles)
    assert got == replace(cands[0], gemm_engine=1)
    engines = []
    real = fused_linear_loss.LinearLogprobsChunks.backward
    monkeypatch.setattr(fused_linear_loss.LinearLogprobsChunks, "backward",
                        lambda self, *a: (engines.append(self.tiles.gemm_engine), real(self, *a))[1])
    tiles_module._device_tiles.cache_clear()
    h, w = torch.randn(8, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    erpo_loss(h, w, loss_batch(8, LossLayout(4, 1, 1), 40), LossConfig(), backend="triton")[0].backward()
    assert engines == [1] and h.grad is not None and torch.isfinite(w.grad).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a CUDA device")
def test_bench_tune_stops_without_a_gpu():
    from bench.__main__ import main

    with pytest.raises(SystemExit, match="no CUDA device"):
        main(["tune", "--device", "cuda", "--shapes", "16x40"])
    with pytest.raises(SystemExit, match="DxV"):
        main(["tune", "--shapes", "16"])


def test_bench_aot_is_a_subcommand_with_one_line_errors(capsys):
    # issue 35.1: `python -m bench aot` exists, its help names the accepted values, and a bad
    # value is argparse's usage line and one error line (exit status 2), not a traceback
    from bench.__main__ import main

    with pytest.raises(SystemExit) as done:
        main(["aot", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "usage: python -m bench aot" in out
    for word in ("80 (A100)", "90 (H100/H200)", "120", "bf16, fp16, fp32", "linear_token_logprobs, token_logprobs"):
        assert word in " ".join(out.split()), word
    for args, message in ((["--dtypes", "bfloat16"], "argument --dtypes: 'bfloat16' is not a dtype"),
                          (["--archs", "91"], "argument --archs: '91' is not an architecture"),
                          (["--archs", "sm_90,x"], "argument --archs: 'x' is not an architecture"),
                          (["--ops", "foo"], "argument --ops: 'foo' is not an op"),
                          (["--tiles", "{"], "argument --tiles:"),
                          (["--tiles", '{"block_q": 1}'], "argument --tiles: ['block_q'] are not all fields"),
                          (["--workers", "0"], "argument --workers: must be >= 1"),
                          (["--kernels", "_ltl_fwd"], "argument --kernels: '_ltl_fwd' is not a kernel"),
                          (["--ops", "token_logprobs", "--kernels", "_ltl_fwd_kernel"],
                           "argument --kernels: _ltl_fwd_kernel is not a kernel of token_logprobs"),
                          (["--archs", "90", "--dtypes", "bf16", "--kernels", "_ltl_merge_kernel", "--variants",
                            "kept"], "argument --variants: no variant of _ltl_merge_kernel starts with 'kept'; "
                                     "the variants: entropy"),
                          (["--archs", "90", "--dtypes", "bf16", "--kernels", "_ltl_merge_kernel", "--variants",
                            "kept, "], "argument --variants: no variant of _ltl_merge_kernel starts with 'kept';")):
        with pytest.raises(SystemExit) as done:
            main(["aot", *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert done.value.code == 2 and err[-1].startswith("python -m bench aot: error: " + message), (args, err)
        assert not any("Traceback" in line for line in err), err


def test_bench_aot_every_option_lists_each_logit_kernel_in_all_24_combinations():
    """`python -m bench aot --every-option`: besides each kernel with every option and with none, the
    op's forward, the kept-logit forward and the recompute in each combination of bias, soft cap,
    entropy and support (none / threshold / bitmask), a threshold through an fp32 pointer (as
    launched); nothing compiled here (the sweep is minutes: run it by hand when tiles change)."""
    from bench import aot

    tiles = default_tiles("linear_token_logprobs", torch.bfloat16, (9, 0))
    listed = aot.kernel_variants("linear_token_logprobs", "bf16", tiles)
    every = aot.kernel_variants("linear_token_logprobs", "bf16", tiles, every=True)
    assert every[: len(listed)] == listed and aot.kernel_variants("token_logprobs", "bf16", default_tiles(
        "token_logprobs", torch.bfloat16, (9, 0)), every=True) == aot.kernel_variants("token_logprobs", "bf16",
        default_tiles("token_logprobs", torch.bfloat16, (9, 0)))  # fmt: skip
    options = ("HAS_BIAS", "HAS_SOFTCAP", "SUPPORT")
    for kernel, kept, entropy in (("_ltl_fwd_kernel", 0, "WANT_ENTROPY"), ("_ltl_fwd_kernel", 1, "WANT_ENTROPY"),
                                  ("_ltl_bwd_dr_kernel", 0, "HAS_ENTROPY_GRAD")):  # fmt: skip
        mine = [v for v in every if v.fn.__name__ == kernel and bool(v.consts.get("KEEP_LOGITS", 0)) == bool(kept)]
        combos = {tuple(v.consts[k] for k in (*options, entropy)) for v in mine}
        assert len(combos) == 24, (kernel, kept, len(combos))
        assert all(v.types["support_ptr"] == ("*fp32" if v.consts["SUPPORT"] == 1 else "*i32") for v in mine)
    import argparse

    parser = argparse.ArgumentParser()
    aot.add_arguments(parser)
    assert parser.parse_args(["--every-option"]).every_option and not parser.parse_args([]).every_option


def test_bench_aot_kernels_and_variants_choose_what_is_compiled():
    """`--kernels` and `--variants` narrow the compiles (a tile search on one kernel: erpo_loss's
    kept-logit forward in its 24 combinations, of the 81 compiles of `--every-option` for sm_90 in
    bf16); KERNELS is every kernel the ops' variants name (nothing compiled here)."""
    from bench import aot

    every = {v.fn.__name__ for op in aot.OPS for a in aot.ARCH_NAMES for dt in aot.DTYPES
             for v in aot.kernel_variants(op, dt, aot._tiles(op, a, dt), every=True)}  # fmt: skip
    assert every == set(aot.KERNELS)
    todo = aot.jobs([90], aot.OPS, ["bf16"], every=True)
    kept, names = aot.select(todo, ["_ltl_fwd_kernel"], ["kept", "each:kept"], every=True)
    got = [aot.job_variant(job, every=True) for job in kept]
    assert len(got) == 24 and all(v.fn.__name__ == "_ltl_fwd_kernel" and v.consts["KEEP_LOGITS"] for v in got)
    assert "plain" in names and "kept+plain" in names and len(todo) > 3 * len(kept)
    both, _ = aot.select(todo, ["_ltl_merge_kernel", "_fused_dr_kernel"], [""], every=True)
    assert len(both) == 3  # the merge once, the softmax-gradient kernel with every option and with none


def test_aot_reads_each_tensor_core_instruction_as_its_sass_family():
    """bench.aot reads a kernel's instructions in its PTX (no disassembly): each tensor-core
    instruction as the SASS family ptxas lowers it to, one of another kind as itself."""
    from bench.aot import tensor_core_of_ptx

    ptx = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {a}, {b}, {c}, {d};\n"
           "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {a}, {b}, {c}, {d};\n")
    assert tensor_core_of_ptx(ptx) == ["HMMA"]
    assert tensor_core_of_ptx("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {a}, b, c;") == ["HGMMA"]
    assert tensor_core_of_ptx("tcgen05.mma.cta_group::1.kind::f16 [t], a, b, c;") == ["UTCHMMA"]
    assert tensor_core_of_ptx("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {a}, {b}, {c}, {d};") == ["IMMA"]
    fp8 = "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3"
    assert tensor_core_of_ptx(f"{fp8} {{a}}, b, c;") == [fp8]  # not a family the rules name: it breaks them
    assert tensor_core_of_ptx("wgmma.fence.sync.aligned;\nfma.rn.f32 a, b, c, d;") == []


def test_aot_rules_read_each_kernel_where_its_facts_are():
    """bench.aot.problems: what breaks a rule (no compile), a tensor-core instruction in a kernel
    listed without dots too."""
    from bench.aot import Facts, problems

    ok = dict(op="linear_token_logprobs", kernel="k", variant="plain", dtype="bf16", arch=90, shared=1024,
              registers=128, stack=0, local=0, threads=256, ctas_per_sm=1, tma=False, tf32=False)
    assert problems(Facts(**ok, tensor_core=["HGMMA"], ffma=True, tensor_dots=True, has_dots=True), 232_448,
                    "HGMMA") == []
    assert problems(Facts(**ok, tensor_core=[], ffma=False, tensor_dots=False, has_dots=False), 232_448, "HGMMA") == []
    assert problems(Facts(**ok, tensor_core=["HMMA"], ffma=False, tensor_dots=False, has_dots=False), 232_448,
                    "HGMMA") == ["tensor-core instructions (HMMA) in a kernel listed without dots"]
    assert problems(Facts(**dict(ok, stack=8), tensor_core=["HMMA"], ffma=True, tensor_dots=True, has_dots=True),
                    232_448, "HGMMA") == ["8 B of stack frame (register spills)", "dots not on HGMMA (found ['HMMA'])"]
