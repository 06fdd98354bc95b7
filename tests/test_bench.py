"""Smoke test of the benchmark suite: the CLI at tiny shapes, the results file's structure,
the generated README section and the merge. No timing is asserted (numbers belong in bench/).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import report

REPO = Path(__file__).resolve().parent.parent
RUN_KEYS = {"command", "machine", "device", "device_name", "versions", "commit", "timestamp", "definitions", "results"}
RECORD_KEYS = {"op", "peer", "shape", "dtype", "pass", "median_ms", "peak_extra_mb", "status",
               "ratio_time_vs_eager", "ratio_mem_vs_eager"}


def _bench(args, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the CPU suite measures the PyTorch paths
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "bench", *args, "--out-dir", str(tmp_path), "--machine", "smoke"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


@pytest.fixture(scope="module")
def kernels_run(tmp_path_factory):
    """One tiny `bench kernels` run on CPU: both ops, ours and eager, two passes, liger asked for."""
    out = tmp_path_factory.mktemp("bench")
    _bench(["kernels", "--device", "cpu", "--n", "19", "--v", "301", "--d", "24", "--peers", "erpo,eager,liger",
            "--passes", "forward,both", "--warmup", "0", "--repeats", "1", "--no-report"], out)
    return out, json.loads((out / "smoke.json").read_text())


def test_kernels_results_file(kernels_run):
    _, data = kernels_run
    assert data["machine"] == "smoke" and len(data["runs"]) == 1
    run = data["runs"][0]
    assert RUN_KEYS <= set(run)
    assert run["device"] == "cpu" and run["versions"]["torch"] == torch.__version__
    assert "triton" in run["versions"] and "peers" in run["versions"]
    # liger needs CUDA: listed as absent with the reason, never measured
    assert [a["peer"] for a in run["absent_peers"]] == ["liger"]
    assert run["absent_peers"][0]["reason"]
    recs = run["results"]
    keys = {(r["op"], r["peer"], r["pass"]) for r in recs}
    assert keys == {(op, peer, p) for op in ("token_logprobs", "linear_token_logprobs")
                    for peer in ("erpo", "eager") for p in ("forward", "both")}
    for r in recs:
        assert RECORD_KEYS <= set(r), r
        assert r["status"] == "ok", r
        assert r["median_ms"] > 0 and r["peak_extra_mb"] >= 0
        assert r["shape"]["N"] == 19 and r["shape"]["V"] == 301 and r["dtype"] == "fp32"
        assert ("D" in r["shape"]) == (r["op"] == "linear_token_logprobs")
        if r["peer"] == "eager":
            assert r["ratio_time_vs_eager"] == 1.0
        if r["pass"] == "forward":  # the op's output matches the float64 reference of the same inputs
            assert r["max_abs_err"] < 1e-4, r


def test_report_and_merge(kernels_run, tmp_path):
    out, data = kernels_run
    text = report.markdown(report.all_results(out))
    assert "### smoke" in text
    table = [line for line in text.splitlines() if line.startswith("| token_logprobs") or
             line.startswith("| linear_token_logprobs")]
    assert len(table) == 2
    assert all("absent" in line for line in table)  # the liger column
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n{report.START}\nold table\n{report.END}\ntail\n")
    assert report.write_readme(text, readme)
    body = readme.read_text()
    assert body.startswith("# title\n") and body.endswith(f"{report.END}\ntail\n")
    assert "old table" not in body and "### smoke" in body
    no_markers = tmp_path / "OTHER.md"
    no_markers.write_text("nothing\n")
    assert not report.write_readme(text, no_markers) and no_markers.read_text() == "nothing\n"
    merged = tmp_path / "merged"
    report.merge(out / "smoke.json", merged)
    report.merge(out / "smoke.json", merged)  # the same run twice is kept once
    assert len(json.loads((merged / "smoke.json").read_text())["runs"]) == 1
    assert report.plot("smoke", data, merged).exists()


def test_cpu_memory_measure_sees_allocations():
    """The CPU memory definition (peak RSS minus RSS before) sees what the region allocates: one
    64 MiB buffer; four 8 MiB buffers after a warm-up that made and freed the same (the size
    glibc serves from its heap). In a subprocess: the measurement reconfigures its allocator."""
    code = (
        "import json, torch\n"
        "from bench.measure import measure\n"
        "def chunks(_):\n"
        "    keep = [torch.ones(1 << 21) for _ in range(4)]\n"
        "    return keep\n"
        "big = measure(lambda: None, lambda _: torch.ones(1 << 24), device='cpu', warmup=1, repeats=1)\n"
        "small = measure(lambda: None, chunks, device='cpu', warmup=1, repeats=1)\n"
        "print(json.dumps([big.peak_extra_mb, small.peak_extra_mb]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    big, small = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 60 <= big <= 200, big
    assert 28 <= small <= 100, small


def test_step_tiny(tmp_path):
    """One `bench step` run of four variants: the fused and the stock loss path, and the packed step
    beside its micro-batched copy (--micro-batch-tokens adds erpo-micro-12)."""
    pytest.importorskip("transformers")
    _bench(["step", "--device", "cpu", "--model", "tiny", "--queries", "2", "--group", "2", "--prompt-len", "6",
            "--response-len", "5", "--variants", "erpo-fused,erpo-stock,erpo-packed", "--micro-batch-tokens", "12",
            "--warmup", "1", "--repeats", "1", "--no-report"], tmp_path)
    run = json.loads((tmp_path / "smoke.json").read_text())["runs"][0]
    assert run["command"] == "step" and RUN_KEYS <= set(run)
    recs = {r["variant"]: r for r in run["results"]}
    assert set(recs) == {"erpo-fused", "erpo-stock", "erpo-packed", "erpo-micro-12"}
    for r in recs.values():
        assert r["status"] == "ok" and r["finite"], r
        assert r["median_ms"] > 0
    for name in ("erpo-fused", "erpo-stock"):
        assert recs[name]["tokens"] == 2 * 2 * (6 + 5)
    # the micro-batched step accumulates the same update as the packed one
    assert recs["erpo-micro-12"]["loss"] == pytest.approx(recs["erpo-packed"]["loss"], rel=1e-5, abs=1e-6)
    # the fused path and the stock path compute the same loss from the same weights and batch
    assert recs["erpo-fused"]["loss"] == pytest.approx(recs["erpo-stock"]["loss"], rel=1e-4, abs=1e-6)
    # which path erpo_loss took is recorded (on a GPU: its fused 3-GEMM path; here the interpreter's or torch's)
    assert recs["erpo-fused"]["loss_path"].startswith(("fused (3 GEMMs)", "4-GEMM: ")) and "loss_path" not in \
        recs["erpo-stock"]


def test_step_padded_vs_packed_tiny():
    """The padding-free variant measures the same step as the padded one (in-process, one
    step each): same real tokens, same loss (the packed forward equals the padded one)."""
    pytest.importorskip("transformers")
    from bench.step import StepCase, case_tokens, make_step, skewed_lengths

    lengths = skewed_lengths(16, 12)
    assert min(lengths) >= 1 and max(lengths) == 12 and sum(lengths) < 16 * 12 / 2  # skewed: mostly short
    case = StepCase("tiny", None, 2, 3, 5, 9, 1.0, "fp32")
    losses = {}
    for variant in ("erpo-padded", "erpo-packed"):
        _, _, step, n, peaks = make_step(case, variant, "cpu")
        assert n == case_tokens(case, variant) == 2 * 3 * 5 + sum(skewed_lengths(6, 9)) < case.tokens
        losses[variant] = step()["loss"]
        assert len(peaks) == 1
    assert losses["erpo-packed"] == pytest.approx(losses["erpo-padded"], rel=1e-5, abs=1e-6)


def test_step_micro_batches_tiny():
    """erpo-micro-K accumulates the same step as erpo-packed (same loss), in several
    micro-batches; bad budgets are refused."""
    pytest.importorskip("transformers")
    from bench.step import StepCase, make_step, micro_budget

    case = StepCase("tiny", None, 2, 3, 5, 9, 1.0, "fp32")
    _, _, packed_step, n, _ = make_step(case, "erpo-packed", "cpu")
    _, _, micro_step, n_micro, peaks = make_step(case, "erpo-micro-16", "cpu")
    assert n_micro == n and len(peaks) == 0
    assert micro_step()["loss"] == pytest.approx(packed_step()["loss"], rel=1e-5, abs=1e-6)
    assert len(peaks) == 1 and micro_budget("erpo-packed") is None
    with pytest.raises(SystemExit, match="positive integer"):
        micro_budget("erpo-micro-x")
    with pytest.raises(ValueError, match="smaller than sequence"):
        make_step(case, "erpo-micro-4", "cpu")  # a budget below the longest sequence
    # the CLI's --micro-batch-tokens: test_step_tiny's run


def test_report_of_a_gpu_run_with_roofline(tmp_path):
    """The parts of the report only a CUDA run produces (ceilings, roofline), from a synthetic run:
    bytes / FLOPs models and their rendering are checked without a GPU."""
    from bench import kernels

    ceilings = {"copy_gbps": 4000.0, "bf16_matmul_tflops": 800.0}
    tok = kernels.case_for("token_logprobs", "qwen2.5-1.5b", 4096, "bf16")
    lin = kernels.case_for("linear_token_logprobs", "qwen2.5-1.5b", 4096, "bf16")
    rf_tok = kernels.roofline(tok, "both", 1.0, ceilings)  # 3 N V b bytes in 1 ms
    rf_lin = kernels.roofline(lin, "forward", 1.0, ceilings)  # 2 N D V FLOPs in 1 ms
    assert rf_tok["model_bytes"] == 3 * 4096 * 151936 * 2
    assert rf_tok["fraction_of_copy_bw"] == pytest.approx(rf_tok["model_bytes"] / 1e-3 / 1e9 / 4000, abs=1e-3)
    assert rf_lin["model_flops"] == 2 * 4096 * 1536 * 151936 and "fraction_of_bf16_matmul" in rf_lin

    def rec(case, peer, p, ms, rf=None):
        r = {"op": case.op, "peer": peer, "shape": case.shape(), "dtype": "bf16", "pass": p, "status": "ok",
             "median_ms": ms, "peak_extra_mb": 100.0, "before_mb": 0.0}
        return {**r, "roofline": rf} if rf else r

    results = [rec(tok, "eager", "both", 2.0), rec(tok, "erpo", "both", 1.0, rf_tok),
               rec(lin, "erpo", "forward", 1.0, rf_lin)]
    kernels._ratios(results)
    run = {"command": "kernels", "device": "cuda", "device_name": "a GPU", "versions": {}, "ceilings": ceilings,
           "models": {"roofline_bytes": "bytes model", "roofline_flops": "flops model"}, "peers": {},
           "absent_peers": [{"peer": "liger", "reason": "not installed"}], "results": results}
    text = report.markdown({"gpu": {"machine": "gpu", "runs": [run]}})
    assert "Roofline of erpo (measured ceilings: copy 4000 GB/s" in text
    rows = [line for line in text.splitlines() if line.startswith("| token_logprobs") and "GB/s" in line]
    assert len(rows) == 1 and f"{rf_tok['fraction_of_copy_bw']:.0%}" in rows[0]
    assert any(line.startswith("| linear_token_logprobs") and "TFLOP/s" in line for line in text.splitlines())
    table = [line for line in text.splitlines() if line.startswith("| token_logprobs | qwen")]
    assert table and "0.50x / 1.00x" in table[0] and "absent" in table[0]  # vs eager; liger absent
    assert report.plot("gpu", {"machine": "gpu", "runs": [run]}, tmp_path).exists()


def test_spent_budget_skips_and_still_writes_the_run(tmp_path):
    """A budget already spent (as at the end of bench/gpu_check.sh's time) starts no case: the run
    is still written, with every skipped (case, peer) and the reason."""
    from bench import kernels
    from bench.measure import RunOptions

    cases = kernels.custom_cases(["token_logprobs"], ["qwen2.5-1.5b"], [8], ["fp32"], None, 50)
    opts = RunOptions(device="cpu", warmup=0, repeats=1, out_dir=str(tmp_path), machine="budget", budget_s=0.0,
                      make_report=False)
    kernels.run(cases, ["erpo", "eager"], ["forward"], opts)
    run = json.loads((tmp_path / "budget.json").read_text())["runs"][0]
    assert run["results"] == [] and "elapsed_s" in run
    assert [s["peer"] for s in run["skipped_cases"]] == ["erpo", "eager"]
    assert all("budget" in s["reason"] for s in run["skipped_cases"])


def test_measuring_never_writes_the_readme(tmp_path, monkeypatch):
    """`bench kernels` / `bench step` (here: a run whose budget is spent, with the report on, into
    bench/results) write results and plots only; the README table is `python -m bench report`'s."""
    from bench import kernels
    from bench.__main__ import main
    from bench.measure import RunOptions

    written = []
    monkeypatch.setattr(report, "write_readme", lambda text, readme=None: written.append(readme) or True)
    monkeypatch.setattr(report, "RESULTS_DIR", tmp_path)
    cases = kernels.custom_cases(["token_logprobs"], ["qwen2.5-1.5b"], [8], ["fp32"], None, 50)
    opts = RunOptions(device="cpu", warmup=0, repeats=1, out_dir=str(tmp_path), machine="noreadme", budget_s=0.0)
    kernels.run(cases, ["erpo"], ["forward"], opts)
    assert (tmp_path / "noreadme.json").exists() and written == []
    assert main(["merge", str(tmp_path / "noreadme.json"), "--out-dir", str(tmp_path)]) == 0
    assert written == []
    assert main(["report", "--out-dir", str(tmp_path)]) == 0
    assert written == [report.README]


def test_a_measurement_goes_to_an_untracked_file_unless_recorded(tmp_path, monkeypatch, capsys):
    """`python -m bench kernels` (and step) write into bench/results/local/ (gitignored), never the
    tracked bench/results/ files, and say how to record the run; --record (or --out-dir) chooses
    the tracked record; the printed merge command folds the run in (issue 19.9)."""
    import argparse
    import hashlib
    import shlex

    import bench.__main__ as cli
    from bench.measure import RESULTS_DIR

    def tracked():
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in RESULTS_DIR.iterdir() if p.is_file()}

    assert cli.LOCAL_RESULTS_DIR == RESULTS_DIR / "local"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(RESULTS_DIR / "local" / "x.json")], cwd=REPO)
    assert ignored.returncode == 0   # git ignores it
    before = tracked()
    monkeypatch.setattr(cli, "LOCAL_RESULTS_DIR", tmp_path / "local")
    assert cli.main(["kernels", "--device", "cpu", "--n", "8", "--v", "50", "--d", "8", "--peers", "erpo",
                     "--passes", "forward", "--warmup", "0", "--repeats", "1", "--budget-s", "0",
                     "--machine", "mine", "--no-report"]) == 0
    assert tracked() == before and (tmp_path / "local" / "mine.json").exists()
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"[bench] results in {tmp_path}/local/mine.json (untracked); record them with: "), line
    merge = shlex.split(line.split("record them with: ")[1])
    assert merge[:4] == ["python", "-m", "bench", "merge"]
    assert cli.main([*merge[3:], "--out-dir", str(tmp_path / "record")]) == 0
    assert json.loads((tmp_path / "record" / "mine.json").read_text())["runs"]
    args = argparse.Namespace(out_dir=None, record=True)
    assert cli._out_dir(args) == str(RESULTS_DIR)
    assert cli._out_dir(argparse.Namespace(out_dir="x", record=False)) == "x"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the script's stop on a machine without a CUDA device")
def test_gpu_check_script_parses_and_stops_without_a_gpu(tmp_path):
    """bench/gpu_check.sh is valid bash, and without a CUDA device it stops in its first phase with
    exit 2 and a summary.txt saying why (nothing measured, no results file written)."""
    script = REPO / "bench" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, T_TOTAL="60")
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.txt"]
    assert "no CUDA device visible" in (tmp_path / "summary.txt").read_text()
