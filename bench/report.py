"""Results files, the README table and the plots: all generated from bench/results/*.json.

A results file is bench/results/<machine>.json = {"machine": name, "runs": [run, ...]}; every
`bench kernels` / `bench step` run appends one run (metadata + records). The README table and
the plots use, for each (op, peer, shape, dtype, pass) or (model, tokens, variant), the
newest record of each machine. Nothing in them is typed by hand: `python -m bench report`, and
only it, rewrites the README between the markers below (measuring never edits documentation).
The cost model's runs (`bench cost`) are bench/results/cost.json; their tables go into
docs/benchmarks.md between the cost markers, and one summary line into the README section.
"""
from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from erpo.atomic import atomic_write

from .measure import REPO, RESULTS_DIR, RunOptions

README = REPO / "README.md"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
# the cost model (`bench cost`): its runs, and the tables it generates into docs/benchmarks.md
COST_FILE = "cost.json"  # bench/results/cost.json: {"command": "cost", "runs": [run, ...]}
BENCH_DOC = REPO / "docs" / "benchmarks.md"
COST_START, COST_END = "<!-- cost:start -->", "<!-- cost:end -->"
COST_ORDER = ("erpo", "erpo-support-threshold", "erpo-support-bitmask", "erpo-reference", "liger", "cce",
              "trl-chunked", "erpo-loss", "erpo-loss-triton", "liger-grpo", "trl-grpo")
LOSS_OP = "loss"  # bench.cost_losses.LOSS: the fused losses, forward + backward from hidden states to a scalar
PEER_ORDER = ("eager", "eager-ce", "compile", "trl", "trl-chunked", "trl-triton", "liger", "cce", "flash-attn", "erpo-inplace")
PASS_LABEL = {"forward": "fwd", "backward": "bwd", "both": "fwd+bwd"}
# The CPU target of the benchmark issue (measured, never asserted).
CPU_TARGET = {"op": "token_logprobs", "N": 4096, "V": 151936, "dtype": "fp32", "mem": 0.35, "time": 1.0}


# ----------------------------------------------------------------------------- files


def results_path(out_dir: str | os.PathLike, machine: str) -> Path:
    return Path(out_dir) / f"{machine}.json"


def load(path: str | os.PathLike) -> Dict[str, Any]:
    p = Path(path)
    if not p.exists():
        return {"machine": p.stem, "runs": []}
    data = json.loads(p.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise ValueError(f"{p}: not a bench results file (expected an object with a 'runs' list)")
    return data


def _write(path: Path, data: Dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(str(path), (json.dumps(data, indent=1) + "\n").encode())


def append_run(out_dir: str | os.PathLike, machine: str, run: Dict[str, Any], replace_last: bool = False) -> Path:
    """Append `run` to <out_dir>/<machine>.json (or update it in place when it is already there)."""
    path = results_path(out_dir, machine)
    data = load(path)
    data["machine"] = machine
    run.setdefault("run_id", uuid.uuid4().hex[:12])
    runs = [r for r in data["runs"] if r.get("run_id") != run["run_id"]] if replace_last else data["runs"]
    runs.append(run)
    data["runs"] = runs
    _write(path, data)
    return path


class RunWriter:
    """One `bench kernels` / `bench step` run in <out_dir>/<machine>.json, rewritten after every
    record, so that a run stopped from outside (a time limit, a crash) keeps what it measured."""

    def __init__(self, header: Dict[str, Any], opts: RunOptions, t_start: Optional[float] = None):
        self.opts = opts
        self.t_start = time.monotonic() if t_start is None else t_start
        self.run: Dict[str, Any] = {**header, "results": [], "skipped_cases": []}
        self.path = append_run(opts.out_dir, header["machine"], self.run)

    def spent(self) -> bool:
        """Whether the time budget (opts.budget_s) is used up: no new case starts after that."""
        return self.opts.budget_s is not None and time.monotonic() - self.t_start > self.opts.budget_s

    def skip(self, what: Dict[str, Any]) -> None:
        self.run["skipped_cases"].append({**what, "reason": f"time budget {self.opts.budget_s:.0f} s spent"})

    def add(self, rec: Dict[str, Any]) -> None:
        self.run["results"].append(rec)
        self._save()

    def finish(self, summary: Callable[[Dict[str, Any]], str]) -> Dict[str, Any]:
        """Record the elapsed time, print `summary(run)`, regenerate the report when asked."""
        self.run["elapsed_s"] = round(time.monotonic() - self.t_start, 1)
        self._save()
        print(summary(self.run))
        if self.opts.make_report:
            regenerate(self.opts.out_dir)
            print("plots regenerated; `python -m bench report` puts these results into the README table")
        return self.run

    def _save(self) -> None:
        append_run(self.opts.out_dir, self.run["machine"], self.run, replace_last=True)


def merge(src: str | os.PathLike, out_dir: str | os.PathLike = RESULTS_DIR) -> Path:
    """Fold the runs of a results file (e.g. one written on a GPU machine under $OUT) into out_dir."""
    data = load(src)
    if not data["runs"]:
        raise SystemExit(f"{src}: no runs to merge")
    path = results_path(out_dir, data["machine"])
    have = load(path)
    have["machine"] = data["machine"]
    ids = {r.get("run_id") for r in have["runs"]}
    added = [r for r in data["runs"] if r.get("run_id") not in ids]
    have["runs"].extend(added)
    _write(path, have)
    print(f"merged {len(added)} run(s) into {path}")
    return path


def all_results(out_dir: str | os.PathLike = RESULTS_DIR) -> Dict[str, Dict[str, Any]]:
    out = {}
    for p in sorted(Path(out_dir).glob("*.json")):
        if p.name == COST_FILE:  # the cost model's runs (cost_markdown)
            continue
        try:
            data = load(p)
        except (ValueError, json.JSONDecodeError) as e:
            print(f"skipping {p}: {e}")
            continue
        if data["runs"]:
            out[data.get("machine") or p.stem] = data
    return out


# ----------------------------------------------------------------------------- newest records


def _shape_key(shape: Dict[str, Any]) -> Tuple:
    return (shape.get("model"), shape.get("N"), shape.get("D"), shape.get("V"))


def _latest(data: Dict[str, Any], command: str, key: Callable[[Dict[str, Any]], Tuple]):
    """Newest record per key among the runs of one command, and the newest such run (for metadata)."""
    recs: Dict[Tuple, Dict[str, Any]] = {}
    last_run: Dict[str, Any] = {}
    for run in data["runs"]:
        if run.get("command") != command:
            continue
        last_run = run
        for r in run.get("results", []):
            recs[key(r)] = {**r, "_run": run}
    return recs, last_run


def latest_kernel_records(data: Dict[str, Any]) -> Tuple[Dict[Tuple, Dict[str, Any]], Dict[str, Any]]:
    """Newest record per (op, peer, shape, dtype, pass), and the newest kernels run."""
    return _latest(data, "kernels", lambda r: (r["op"], r["peer"], _shape_key(r["shape"]), r["dtype"], r["pass"]))


def latest_step_records(data: Dict[str, Any]) -> Tuple[Dict[Tuple, Dict[str, Any]], Dict[str, Any]]:
    """Newest record per (model, tokens, variant), and the newest step run."""
    return _latest(data, "step", lambda r: (r["model"], r["tokens"], r["variant"]))


def _absent(data: Dict[str, Any]) -> Dict[str, str]:
    """Peers absent in the newest kernels run, with the reason."""
    _, run = latest_kernel_records(data)
    return {a["peer"]: a["reason"] for a in run.get("absent_peers", [])}


# ----------------------------------------------------------------------------- tables


def _fmt_shape(shape: Dict[str, Any]) -> str:
    dims = [f"N={shape['N']}"]
    if shape.get("D") is not None:
        dims.append(f"D={shape['D']}")
    dims.append(f"V={shape['V']}")
    return f"{shape.get('model', '')} " + " ".join(dims)


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    if a is None or b is None or b == 0:
        return "?"
    return f"{a / b:.2f}x"


OURS = ("erpo", "erpo-inplace")  # our variants: rows of the kernel table; every other peer is a column


def kernel_table(data: Dict[str, Any], pass_name: str = "both") -> List[str]:
    """One row per (op, shape, dtype, our variant): our time and memory, then ours / each peer's."""
    recs, _ = latest_kernel_records(data)
    if not recs:
        return []
    absent = _absent(data)
    peers_seen = {k[1] for k in recs}
    peers = [p for p in PEER_ORDER if p not in OURS and (p in peers_seen or p in absent)]
    cases = []
    for (op, peer, shape, dtype, p), r in recs.items():
        if p == pass_name and (op, shape, dtype) not in [c[:3] for c in cases]:
            cases.append((op, shape, dtype, r["shape"]))
    lines = [
        "| op | shape | dtype | ours | ms | MiB | " + " | ".join(f"vs {p}" for p in peers) + " |",
        "|" + "---|" * (6 + len(peers)),
    ]
    for op, shape_key, dtype, shape in cases:
        for variant in OURS:
            ours = recs.get((op, variant, shape_key, dtype, pass_name))
            if ours is None:
                continue
            ok = ours.get("status") == "ok"
            row = [op, _fmt_shape(shape), dtype, variant,
                   f"{ours['median_ms']:.2f}" if ok else ours.get("status", "?"),
                   f"{ours['peak_extra_mb']:.0f}" if ok else "-"]
            for p in peers:
                r = recs.get((op, p, shape_key, dtype, pass_name))
                if r is None:
                    row.append("absent" if p in absent else "-")
                elif r.get("status") != "ok":
                    row.append(r.get("status", "?"))
                elif not ok:
                    row.append("-")
                else:
                    row.append(f"{_ratio(ours['median_ms'], r['median_ms'])} / "
                               f"{_ratio(ours['peak_extra_mb'], r['peak_extra_mb'])}")
            lines.append("| " + " | ".join(row) + " |")
    return lines


def target_lines(data: Dict[str, Any]) -> List[str]:
    """The CPU target (token_logprobs, N = 4096, V = 151936, fp32, forward + backward, vs eager)."""
    recs, run = latest_kernel_records(data)
    if run.get("device") != "cpu":
        return []
    t = CPU_TARGET
    out = []
    for variant in OURS:
        parts = []
        for p in ("both", "forward", "backward"):
            for (op, peer, shape, dtype, ps), r in recs.items():
                if (op, peer, dtype, ps, shape[1], shape[3]) != (t["op"], variant, t["dtype"], p, t["N"], t["V"]):
                    continue
                rm, rt = r.get("ratio_mem_vs_eager"), r.get("ratio_time_vs_eager")
                if rm is None or rt is None:
                    continue
                if p == "both":
                    parts.append(f"peak extra memory {_r(rm)} of eager's (target <= {t['mem']}x: "
                                 f"**{'met' if rm <= t['mem'] else 'missed'}**), time {_r(rt)} of eager's "
                                 f"(target <= {t['time']}x: **{'met' if rt <= t['time'] else 'missed'}**)")
                else:
                    parts.append(f"{PASS_LABEL[p]} alone: memory {_r(rm)}, time {_r(rt)}")
        if parts:
            out.append(f"- CPU target, token_logprobs N=4096 V=151936 fp32, forward + backward, {variant}: "
                       + "; ".join(parts) + ".")
    return out


def roofline_lines(data: Dict[str, Any]) -> List[str]:
    recs, run = latest_kernel_records(data)
    ceil = run.get("ceilings")
    if not ceil:
        return []
    out = [f"Roofline of erpo (measured ceilings: copy {ceil['copy_gbps']:.0f} GB/s, dense bf16 matmul "
           f"{ceil['bf16_matmul_tflops']:.0f} TFLOP/s; {run['models']['roofline_bytes']}; "
           f"{run['models']['roofline_flops']}):", "",
           "| op | shape | dtype | pass | achieved | fraction of ceiling |", "|---|---|---|---|---|---|"]
    for (op, peer, shape, dtype, p), r in recs.items():
        rf = r.get("roofline")
        if peer != "erpo" or not rf:
            continue
        if "achieved_gbps" in rf:
            ach, frac = f"{rf['achieved_gbps']:.0f} GB/s", rf["fraction_of_copy_bw"]
        else:
            ach, frac = f"{rf['achieved_tflops']:.0f} TFLOP/s", rf.get("fraction_of_bf16_matmul")
        out.append(f"| {op} | {_fmt_shape(r['shape'])} | {dtype} | {PASS_LABEL[p]} | {ach} | "
                   + (f"{frac:.0%}" if frac is not None else "-") + " |")
    return out


def step_table(data: Dict[str, Any]) -> List[str]:
    recs, _ = latest_step_records(data)
    if not recs:
        return []
    lines = ["| model | tokens | variant | step ms | peak extra MiB (step) | peak extra MiB (fwd+bwd) | "
             "resident before MiB | time vs erpo-stock | fwd+bwd memory vs erpo-stock |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (model, tokens, variant), r in recs.items():
        base = recs.get((model, tokens, "erpo-stock"))
        ok = r.get("status") == "ok"
        bok = base is not None and base.get("status") == "ok"
        lines.append(
            f"| {model} | {tokens} | {variant} | "
            + (f"{r['median_ms']:.1f} | {r['peak_extra_mb']:.0f} | {_num(r.get('peak_extra_fwd_bwd_mb'))} | "
               f"{r['before_mb']:.0f} | " if ok else f"{r.get('status')} | - | - | - | ")
            + (f"{_ratio(r['median_ms'], base['median_ms'])} | "
               f"{_ratio(r.get('peak_extra_fwd_bwd_mb'), base.get('peak_extra_fwd_bwd_mb'))} |"
               if ok and bok else "- | - |")
        )
    return lines


def calibration_table(data: Dict[str, Any]) -> List[str]:
    """`bench calibrate`: measured linear-op and lm_head GEMM times beside the cost model's."""
    recs, run = _latest(data, "calibrate", lambda r: (r["case"], _shape_key(r["shape"]), r["pass"]))
    if not recs:
        return []
    out = [f"Cost-model calibration (`bench calibrate`): {_meta(run)}; model: {run.get('hardware_model')} "
           f"from the `bench cost` run at commit {str(run.get('model_commit'))[:12]}.", "",
           "| case | shape | pass | measured ms | model ms | measured / model |", "|---|---|---|---|---|---|"]
    for (case, _, p), r in recs.items():
        ok = r.get("status") == "ok"
        out.append(f"| {case} | {_fmt_shape(r['shape'])} | {PASS_LABEL.get(p, p)} | "
                   f"{r['median_ms']:.2f} | " if ok else f"| {case} | {_fmt_shape(r['shape'])} | "
                   f"{PASS_LABEL.get(p, p)} | {r.get('status')} | ")
        out[-1] += (f"{r['model_ms']:.2f} | " if r.get("model_ms") else "- | ") + \
            (f"{r['measured_over_model']:.2f}x |" if r.get("measured_over_model") else "- |")
    return out


def _meta(run: Dict[str, Any]) -> str:
    v = run.get("versions", {})
    return (f"{run.get('device_name')}; torch {v.get('torch')}, triton {v.get('triton')}, "
            f"commit {str(run.get('commit'))[:12]}, {run.get('timestamp')}")


def markdown(results: Dict[str, Dict[str, Any]], cost_run: Optional[Dict[str, Any]] = None) -> str:
    """The README section: one block per machine (and the cost model's summary line, when run)."""
    out = [
        "Generated by `python -m bench report` from `bench/results/*.json` (newest record of each case); do not "
        "edit by hand.",
        "",
        "Kernel table: forward + backward of each op (forward and backward alone are in the JSON). `ms` / "
        "`MiB`: our median time and peak extra memory (`erpo`: the default call, Triton on CUDA and the chunked "
        "PyTorch reference on CPU; `erpo-inplace`: inplace_backward=True); each `vs <peer>` cell is *our time / "
        "peer time* and *our memory / peer memory* (below 1x: ours is faster / leaner). Memory is the peak "
        "allocated during the op minus the allocation before it (CPU: peak RSS minus RSS before it, one "
        "subprocess per measurement). `absent`: not installed or cannot run on that device; `oom`: out of "
        "memory; `-`: not measured in that case.",
    ]
    if cost_run is not None and cost_summary_line(cost_run):
        out += ["", cost_summary_line(cost_run)]
    for machine, data in results.items():
        _, krun = latest_kernel_records(data)
        _, srun = latest_step_records(data)
        if not (krun or srun or calibration_table(data)):
            continue
        out += ["", f"### {machine}", ""]
        if krun:
            out += [f"Kernels: {_meta(krun)}.", ""]
            labels = {p: lab for p, lab in krun.get("peers", {}).items() if p not in OURS}
            if labels:
                out += ["Peers: " + "; ".join(f"`{p}` = {lab}" for p, lab in labels.items()) + ".", ""]
            absent = _absent(data)
            if absent:
                out += ["Absent peers: " + "; ".join(f"`{p}` ({why})" for p, why in absent.items()) + ".", ""]
            out += kernel_table(data)
            tl = target_lines(data)
            if tl:
                out += [""] + tl
            rl = roofline_lines(data)
            if rl:
                out += [""] + rl
        if srun:
            out += ["", f"Training step ({srun.get('step_definition', '')}): {_meta(srun)}.", ""]
            out += step_table(data)
        cal = calibration_table(data)
        if cal:
            out += [""] + cal
        if (Path(RESULTS_DIR) / f"{machine}.png").exists():
            out += ["", f"![{machine}](bench/results/{machine}.png)"]
    return "\n".join(out) + "\n"


def write_readme(text: str, readme: Path = README) -> bool:
    """Replace what lies between the README's markers; False (and nothing written) when they are missing."""
    return write_between(readme, START, END, text)


# ----------------------------------------------------------------------------- plots


def plot(machine: str, data: Dict[str, Any], out_dir: str | os.PathLike) -> Optional[Path]:
    """<out_dir>/<machine>.png: per op, time and peak extra memory of forward + backward relative to
    PyTorch eager (= 1, lower is better) for each case and peer; the training step, if measured."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return None
    recs, _ = latest_kernel_records(data)
    srecs, _ = latest_step_records(data)
    ops = sorted({k[0] for k in recs if k[4] == "both"}, reverse=True)
    rows = len(ops) + (1 if srecs else 0)
    if rows == 0:
        return None
    fig, axes = plt.subplots(rows, 2, figsize=(14, 4.4 * rows), squeeze=False)
    for i, op in enumerate(ops):
        cases = []
        for (o, peer, shape, dtype, p), r in recs.items():
            if o == op and p == "both" and (shape, dtype) not in [c[:2] for c in cases]:
                cases.append((shape, dtype, r["shape"]))
        peers = [p for p in ("erpo",) + PEER_ORDER if any(k[0] == op and k[1] == p for k in recs)]
        width = 0.8 / max(1, len(peers))
        panels = (("ratio_time_vs_eager", "time"), ("ratio_mem_vs_eager", "peak extra memory"))
        for j, (field, what) in enumerate(panels):
            ax = axes[i][j]
            for k, peer in enumerate(peers):
                xs, ys = [], []
                for c, (shape, dtype, _) in enumerate(cases):
                    r = recs.get((op, peer, shape, dtype, "both"))
                    if r and r.get("status") == "ok" and r.get(field) is not None:
                        xs.append(c + k * width)
                        ys.append(r[field])
                ax.bar(xs, ys, width=width, label=peer)
            ax.axhline(1.0, color="gray", lw=0.8, ls="--")
            ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))])
            ax.set_xticklabels([f"{_fmt_shape(s)}\n{d}" for _, d, s in cases], fontsize=7)
            ax.set_ylabel(f"{what} / eager's")
            ax.set_title(f"{op}, forward + backward: {what} relative to PyTorch eager (lower is better)", fontsize=9)
            ax.legend(fontsize=7)
    if srecs:
        keys = list(srecs)
        labels = [f"{m} N={t}\n{v}" for m, t, v in keys]
        fields = (("median_ms", "step time, ms"), ("peak_extra_fwd_bwd_mb", "peak extra of forward + backward, MiB"))
        for j, (field, unit) in enumerate(fields):
            ax = axes[rows - 1][j]
            ys = [srecs[k].get(field) or 0 for k in keys]
            ax.bar(range(len(keys)), ys, color=["C0" if "fused" in k[2] else "C1" for k in keys])
            ax.set_xticks(range(len(keys)))
            ax.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
            ax.set_ylabel(unit)
            ax.set_title("training step (blue: erpo kernels, orange: stock logits path)", fontsize=9)
    fig.suptitle(f"{machine}: bench/results/{machine}.json", fontsize=10)
    fig.tight_layout()
    path = Path(out_dir) / f"{machine}.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- summaries


def kernels_summary(run: Dict[str, Any]) -> str:
    lines = [f"== bench kernels on {run['device_name']} ({run.get('elapsed_s', '?')} s) =="]
    for r in run["results"]:
        if r["peer"] not in ("erpo", "eager"):
            continue
        head = f"  {r['op']:<22} {_fmt_shape(r['shape']):<38} {r['dtype']:<5} {r['pass']:<9} {r['peer']:<6}"
        if r.get("status") != "ok":
            lines.append(f"{head} {r.get('status')}")
            continue
        extra = ""
        if r["peer"] == "erpo":
            extra = f"  vs eager: time {_r(r.get('ratio_time_vs_eager'))}, memory {_r(r.get('ratio_mem_vs_eager'))}"
        lines.append(f"{head} {r['median_ms']:>10.2f} ms {r['peak_extra_mb']:>9.1f} MiB{extra}")
    if run.get("skipped_cases"):
        lines.append(f"  skipped {len(run['skipped_cases'])} (case, peer) measurement group(s): "
                     f"{run['skipped_cases'][0]['reason']}")
    return "\n".join(lines)


def regenerate(out_dir: str | os.PathLike = RESULTS_DIR, write_readme_table: bool = False,
               echo: bool = False, missing: Optional[List[str]] = None) -> str:
    """Plots for every results file in out_dir, and the README section's text.

    Only `python -m bench report` passes `write_readme_table` (measuring never edits the README):
    the section is then written between the README's markers when out_dir is bench/results.
    It is printed when `echo`, or when the README has no markers to receive it; the pages
    without their markers are appended to `missing`.
    """
    missing = [] if missing is None else missing
    results = all_results(out_dir)
    for machine, data in results.items():
        plot(machine, data, out_dir)
    text = markdown(results, current_cost_run(cost_runs(out_dir)))
    if write_readme_table and Path(out_dir).resolve() == Path(RESULTS_DIR).resolve():
        if write_readme(text, README):
            print(f"README.md: section between {START} and {END} regenerated")
        else:
            print(f"{README} has no {START} ... {END} markers: nothing written; the section is:\n")
            echo = True
            missing.append(str(README))
        cost = cost_markdown(out_dir)
        if cost:
            if write_between(BENCH_DOC, COST_START, COST_END, cost):
                print(f"docs/benchmarks.md: section between {COST_START} and {COST_END} regenerated")
            else:
                print(f"docs/benchmarks.md has no {COST_START} ... {COST_END} markers: nothing written")
                missing.append(str(BENCH_DOC))
    if echo:
        print(text)
    return text


def report_command(out_dir: str | os.PathLike, echo: bool = False) -> int:
    """`bench report`: regenerate; a page without its markers (or no results at all) is an
    error, exit status 1 with an `erpo: error:` line, not a success that wrote nothing."""
    from .measure import IN_CHECKOUT, PROG

    if not all_results(out_dir) and not cost_runs(out_dir):
        where = "" if IN_CHECKOUT else " (the installed suite writes its results there; it has no README to rewrite)"
        print(f"erpo: error: no bench results in {out_dir}{where}; measure first ({PROG} kernels / step / cost) or "
              f"give --out-dir", file=sys.stderr)
        return 1
    missing: List[str] = []
    regenerate(out_dir, write_readme_table=True, echo=echo or not IN_CHECKOUT, missing=missing)
    if missing:
        print(f"erpo: error: {', '.join(missing)} lack the markers `bench report` writes between; nothing written "
              f"there (the section is printed above)", file=sys.stderr)
        return 1
    return 0


def _num(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.0f}"


def _r(x: Optional[float]) -> str:
    return "?" if x is None else f"{x:.2f}x"


# ----------------------------------------------------------------------------- the cost model (bench cost)



def cost_runs(out_dir: str | os.PathLike = RESULTS_DIR) -> List[Dict[str, Any]]:
    p = Path(out_dir) / COST_FILE
    if not p.exists():
        return []
    data = json.loads(p.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise ValueError(f"{p}: not a cost results file (expected an object with a 'runs' list)")
    return data["runs"]


def _model_of(run: Dict[str, Any]) -> Tuple:
    """What makes two runs' numbers comparable: the hardware figures, the rules and the targets."""
    return (json.dumps(run.get("hardware"), sort_keys=True), run.get("bytes_rule"), run.get("l2_rule"),
            json.dumps(run.get("targets"), sort_keys=True))


def current_cost_run(runs: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The newest run, with every subject it did not count taken from the newest older run of
    the same model (hardware, rules, targets) that did: what the docs show. A `bench cost
    --record --subjects ...` run restricted to some subjects thus leaves the others' records in
    place. Each subject carries the commit and timestamp of the run that counted it."""
    if not runs:
        return None
    newest = runs[-1]
    view = dict(newest)
    seen = set()
    subjects = []
    for run in reversed(runs):
        if run is not newest and _model_of(run) != _model_of(newest):
            continue
        for sub in run["subjects"]:
            key = (sub["name"], sub["op"])
            if key in seen:
                continue
            seen.add(key)
            subjects.append(dict(sub, commit=run.get("commit"), timestamp=run.get("timestamp"),
                                 compile_facts=run.get("compile_facts")))
    view["subjects"] = subjects
    return view


def append_cost_run(run: Dict[str, Any], out_dir: str | os.PathLike = RESULTS_DIR) -> Path:
    p = Path(out_dir) / COST_FILE
    runs = cost_runs(out_dir) if p.exists() else []
    run.setdefault("run_id", uuid.uuid4().hex[:12])
    p.parent.mkdir(parents=True, exist_ok=True)  # compact: a run holds every launch group of every subject
    atomic_write(str(p), (json.dumps({"command": "cost", "runs": runs + [run]}, separators=(",", ":")) + "\n").encode())
    return p


def _shape_label(s: Dict[str, int], op: str) -> str:
    return f"N={s['N']} V={s['V']}" if op == "token_logprobs" else f"N={s['N']} D={s['D']} V={s['V']}"


def _gb(x: float) -> str:
    if x >= 1e11:
        return f"{x / 1e9:.0f} GB"
    return f"{x / 1e9:.3g} GB" if x >= 1e8 else f"{x / 1e6:.3g} MB"


def model_sentence(run: Dict[str, Any], hw: str = "H200") -> str:
    """Which model a run's numbers are: the hardware figures and the rules, with the L2 when charged."""
    h = run["hardware"][hw]
    l2 = h.get("l2_bytes_per_s") and run.get("l2_rule")
    charged = ("max(FLOP time, HBM time, L2 time, shared-memory time)" if l2
               else "max(FLOP time, HBM time) (this run's model did not charge the L2)")
    figures = (f"{h['hbm_bytes_per_s'] / 1e12:.2f} TB/s HBM, " + (f"{h['l2_bytes_per_s'] / 1e12:.1f} TB/s L2, "
               f"{h['smem_bytes_per_s'] / 1e12:.1f} TB/s shared memory, " if l2 else "")
               + f"{h['peaks']['bf16'] / 1e12:.0f} TFLOP/s bf16, {h['peaks']['fp32'] / 1e12:.0f} TFLOP/s fp32, "
               f"{h['l2_bytes'] / 1e6:.0f} MB L2")  # fmt: skip
    return (f"Model, not a measurement: {hw} ({figures}), bf16 inputs; commit {str(run.get('commit'))[:12]}, "
            f"triton {run.get('versions', {}).get('triton')}, torch {run.get('versions', {}).get('torch')}, "
            f"{run.get('timestamp')}. Per launch group: {charged}; {run['bytes_rule']}"
            + (f"; {run['l2_rule']} ({h.get('l2_source')})" if l2 else "") + ". Lower bounds: no launch latency, "
            "occupancy or elementwise math. `x floor`: modelled time / the 4-GEMM floor (4 x 2NDV FLOPs at the bf16 "
            "peak); `HBM`: the modelled HBM traffic of forward + backward.")


def _facts_cell(facts: Dict[str, Any], group: str, arch: str) -> str:
    from .aot import facts_text

    f = (facts or {}).get(group.split("/")[-1], {}).get(arch)
    return facts_text(f) if f else "-"


def _launch_table(run: Dict[str, Any], s: Dict[str, Any], r: Dict[str, Any], hw: str) -> List[str]:
    """Per launch group of one subject at one target: counts, the four times' winner, compile facts."""
    groups = [g for g in r["groups"] if g["model"][hw]["ms"] >= 0.005]
    compile_facts = s.get("compile_facts", run.get("compile_facts")) or {}
    facts = bool(compile_facts) and "error" not in compile_facts
    out = [f"`{s['name']}` {s['op']} at {_shape_label(r['shape'], s['op'])}, per launch group ({hw}):", "",
           "| group | launches | programs | L2 bytes (loaded + stored) | FLOP per L2 byte | HBM bytes (rule) | "
           "shared-memory bytes | FLOPs | ms | bound by |" + (" sm_90 | sm_100 |" if facts else ""),
           "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if facts else "")]
    for g in groups:
        m = g["model"][hw]
        total = sum(g["flops"].values())
        l2 = m.get("l2_bytes", g["loaded"] + g["stored"])
        fl = ", ".join(f"{v / 1e12:.3g} T {k}" for k, v in g["flops"].items()) or "-"
        cells = [g["group"], str(g["launches"]), str(g["programs"]), _gb(l2), f"{total / l2:.1f}" if total and l2
                 else "-", f"{_gb(m['hbm_bytes'])} ({m['bytes_rule']})", _gb(m.get("smem_bytes", 0)), fl,
                 f"{m['ms']:.2f}", {"bytes": "HBM"}.get(m["dominant"], m["dominant"])]  # fmt: skip
        if facts:
            cells += [_facts_cell(compile_facts, g["group"], "sm_90"), _facts_cell(compile_facts, g["group"], "sm_100")]
        out.append("| " + " | ".join(cells) + " |")
    return out + [""]


# The ops of a cost run, in table order: (op, first column's title, the floor the ratio is to)
COST_OPS = (("linear_token_logprobs", "linear_token_logprobs", "4-GEMM"),
            (LOSS_OP, "fused loss (hidden, weight -> scalar)", "3-GEMM"),
            ("token_logprobs", "token_logprobs", None))
OURS = ("erpo", "erpo-loss", "erpo-loss-triton")  # the subjects whose launch groups are tabled


def _subject_name(s: Dict[str, Any], run: Dict[str, Any]) -> str:
    name = f"`{s['name']}`" + (f" {s['version']}" if s.get("version") else "")
    if s.get("commit") and s.get("commit") != run.get("commit"):
        name += f" (commit {str(s['commit'])[:12]})"
    return name


def cost_tables(run: Dict[str, Any], hw: str = "H200") -> List[str]:
    """The modelled times of every subject at the targets (fwd+bwd, and fwd), beside the GEMM
    floors, then the per-kernel breakdown of ours at each target."""
    order = [op for op, _, _ in COST_OPS]
    subs = sorted(run["subjects"], key=lambda s: (order.index(s["op"]) if s["op"] in order else 9,
                                                   COST_ORDER.index(s["name"]) if s["name"] in COST_ORDER else 99))
    out = [model_sentence(run, hw), ""]
    for op, title, floor in COST_OPS:
        rows = [s for s in subs if s["op"] == op]
        if not rows:
            continue
        ok = next((s for s in rows if s["status"] == "ok"), None)
        shapes = [r["shape"] for r in ok["results"]] if ok else []
        head = "| " + title + " | " + " | ".join(f"{_shape_label(x, op)} fwd+bwd | fwd" for x in shapes) + " |"
        out += [head, "|---|" + "---|---|" * len(shapes)]
        if floor and ok:
            for k in (3, 4):
                out.append(f"| {k}-GEMM floor | " + " | ".join(
                    f"{r['floors_ms'][hw][f'{k}-GEMM']:.1f} ms | -" for r in ok["results"]) + " |")
        for s in rows:
            name = _subject_name(s, run)
            if s["status"] != "ok":
                out.append(f"| {name} | " + " | ".join(f"{s['status']} | -" for _ in shapes) + " |")
                continue
            cells = []
            for r in s["results"]:
                both, fwd = r["passes"]["both"][hw]["ms"], r["passes"]["forward"][hw]["ms"]
                hbm = sum(g["model"][hw]["hbm_bytes"] for g in r.get("groups", []))
                which = f"{floor} " if op == LOSS_OP else ""  # the linear op's ratio has always been to 4 GEMMs
                ratio = f"{both / r['floors_ms'][hw][floor]:.2f}x {which}floor, " if floor else ""
                cells.append(f"{both:.1f} ms ({ratio}{_gb(hbm)} HBM) | {fwd:.1f} ms")
            inexact = "" if s.get("exact") else f" (fit off by {s.get('held_out_rel_err', float('nan')):.0e} held out)"
            out.append(f"| {name}{inexact} | " + " | ".join(cells) + " |")
        out.append("")
    notes = [f"`{s['name']}` ({s['op']}): {s['label']}" + (f"; counted on {s['gpu_path']}" if s.get("gpu_path") else "")
             + (f"; {s['status']}: {s['reason']}" if s["status"] != "ok" else "") for s in subs]
    out += ["Subjects: " + "; ".join(notes) + ". Inputs: " + run.get("targets_note", "")
            + (f"; {run['layout_note']}" if run.get("layout_note") else "") + ".", ""]
    out += support_lines(run, hw)
    for s in subs:
        if s["name"] not in OURS or s["status"] != "ok":
            continue
        for r in s["results"]:
            out += _launch_table(run, s, r, hw)
    return out


def support_lines(run: Dict[str, Any], hw: str = "H200") -> List[str]:
    """What support= adds to our ops (issue 34): each form's counted fwd+bwd over `erpo`'s at
    every target, in HBM bytes and modelled ms."""
    by = {(s["name"], s["op"]): s for s in run["subjects"] if s["status"] == "ok"}
    parts = []
    for op in ("linear_token_logprobs", "token_logprobs"):
        base = by.get(("erpo", op))
        for form, what in (("threshold", "one fp32 per row"), ("bitmask", "ceil(V / 32) int32 words per row")):
            s = by.get((f"erpo-support-{form}", op))
            if base is None or s is None:
                continue
            cells = []
            for r, r0 in zip(s["results"], base["results"]):
                hbm = lambda x: sum(g["model"][hw]["hbm_bytes"] for g in x.get("groups", []))  # noqa: E731
                ms = r["passes"]["both"][hw]["ms"] - r0["passes"]["both"][hw]["ms"]
                extra = hbm(r) - hbm(r0)
                size = f"{extra / 1e3:+.0f} kB" if abs(extra) < 1e6 else f"{extra / 1e6:+.0f} MB"
                cells.append(f"{_shape_label(r['shape'], op)}: {ms:+.3f} ms, {size} HBM")
            parts.append(f"{op} with a {form} ({what}): " + "; ".join(cells))
    if not parts:
        return []
    return ["support= (issue 34), counted, over the same op without it (fwd+bwd, " + hw + " model): "
            + ". ".join(parts) + ".", ""]


def cost_history(runs: List[Dict[str, Any]], hw: str = "H200") -> List[str]:
    """Our linear op's modelled fwd+bwd per commit (every run), at each target."""
    lines, shapes = [], []
    for run in runs:
        s = next((x for x in run["subjects"] if x["name"] == "erpo" and x["op"] == "linear_token_logprobs"
                  and x["status"] == "ok"), None)
        if s:
            shapes = s["results"]
            lines.append(f"| {str(run.get('commit'))[:12]} | {run.get('timestamp')} | " + " | ".join(
                f"{r['passes']['both'][hw]['ms']:.1f} ms ({r['passes']['both'][hw]['ms'] / r['floors_ms'][hw]['4-GEMM']:.2f}x)"
                for r in s["results"]) + " |")
    if len(lines) < 2:
        return []
    return ([f"`erpo` linear_token_logprobs fwd+bwd by commit ({hw} model, x the 4-GEMM floor):", "",
             "| commit | run | " + " | ".join(_shape_label(r["shape"], "linear") for r in shapes) + " |",
             "|---|---|" + "---|" * len(shapes)] + lines + [""])


def cost_summary_line(run: Dict[str, Any], hw: str = "H200") -> str:
    """One line for the README: fwd+bwd at the first target of the linear op and of the fused
    losses, ours and the peers."""
    order = lambda s: COST_ORDER.index(s["name"]) if s["name"] in COST_ORDER else 99  # noqa: E731
    subs = [s for s in run["subjects"] if s["op"] == "linear_token_logprobs" and s["status"] == "ok"]
    losses = sorted((s for s in run["subjects"] if s["op"] == LOSS_OP and s["status"] == "ok"), key=order)
    if not subs and not losses:
        return ""
    h = run["hardware"][hw]
    model = (f"FLOPs, HBM, L2 at {h['l2_bytes_per_s'] / 1e12:.0f} TB/s and shared memory charged"
             if h.get("l2_bytes_per_s") and run.get("l2_rule") else "FLOPs and HBM charged, not the L2")
    parts = []
    if subs:
        r0 = subs[0]["results"][0]
        floor = r0["floors_ms"][hw]["4-GEMM"]
        parts.append(f"linear_token_logprobs fwd+bwd, bf16, {_shape_label(r0['shape'], 'linear')}; 4-GEMM floor "
                     f"{floor:.1f} ms): " + ", ".join(f"`{s['name']}` {s['results'][0]['passes']['both'][hw]['ms']:.1f} ms"
                                                      for s in sorted(subs, key=order)))
    if losses:
        r0 = losses[0]["results"][0]
        floor3 = r0["floors_ms"][hw]["3-GEMM"]
        loss_part = (f"fused loss fwd+bwd at {_shape_label(r0['shape'], 'linear')} (3-GEMM floor {floor3:.1f} ms): "
                     + ", ".join(f"`{s['name']}` {s['results'][0]['passes']['both'][hw]['ms']:.1f} ms "
                                 f"({s['results'][0]['passes']['both'][hw]['ms'] / floor3:.2f}x)" for s in losses))
        parts.append(loss_part if subs else loss_part + ")")
    text = f"Cost model ({hw}, {model}; not a measurement; " + parts[0]
    if len(parts) > 1:
        text += "; " + parts[1]
    return text + ". Tables: [docs/benchmarks.md](docs/benchmarks.md#cost-model)."


def cost_markdown(out_dir: str | os.PathLike = RESULTS_DIR) -> str:
    runs = cost_runs(out_dir)
    if not runs:
        return ""
    text = ["Generated by `python -m bench report` from `bench/results/cost.json` (`python -m bench cost`); "
            "do not edit by hand.", ""] + cost_tables(current_cost_run(runs)) + cost_history(runs)
    return "\n".join(text) + "\n"


def write_between(path: Path, start: str, end: str, text: str) -> bool:
    """Replace what lies between the markers of `path`; False (nothing written) without them."""
    if not path.exists():
        return False
    body = path.read_text()
    a, b = body.find(start), body.find(end)
    if a < 0 or b < a:
        return False
    new = body[: a + len(start)] + "\n" + text + body[b:]
    if new != body:
        atomic_write(str(path), new.encode())
    return True
