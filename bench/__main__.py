"""Command line of the benchmark suite: its --help is the package's docstring (the commands and
the definitions of speed and memory)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

from .measure import IN_CHECKOUT, LOCAL_RESULTS_DIR, PROG, RESULTS_DIR, RunOptions

def _shown_targets() -> str:
    from .cost_subjects import TARGETS

    return ",".join("x".join(map(str, t)) for t in TARGETS)


_LOCAL_SHOWN = "bench/results/local, untracked" if IN_CHECKOUT else str(LOCAL_RESULTS_DIR)


def _csv(text: Optional[str]) -> Optional[List[str]]:
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


def _ints(text: Optional[str]) -> Optional[List[int]]:
    return [int(t) for t in _csv(text)] if text else None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--quick", action="store_true", help="the small preset (a few minutes)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs before measuring")
    p.add_argument("--repeats", type=int, default=None, help="timed runs (the median is reported)")
    p.add_argument("--out-dir", default=None,
                   help=f"where <machine>.json and the plot go (default: {_LOCAL_SHOWN}; with --record: bench/results)")
    p.add_argument("--record", action="store_true",
                   help="append the run to the project's record, bench/results/<machine>.json (tracked by git)")
    p.add_argument("--machine", default=None, help="results file name (default: derived from the device)")
    p.add_argument("--budget-s", type=float, default=None, help="start no new case after this many seconds")
    p.add_argument("--worker-timeout-s", type=float, default=1800.0, help="CPU: limit of one measurement")
    p.add_argument("--no-report", action="store_true", help="do not regenerate the plots (the README table is only written by `bench report`)")


def _record_args(p: argparse.ArgumentParser, stem: str, doc: str = "docs/vllm.md") -> None:
    """--out-dir, --record and --machine of a subcommand writing <stem>-<machine>.json and a table of `doc`."""
    p.add_argument("--out-dir", default=None, help=f"where {stem}-<machine>.json goes (default: {_LOCAL_SHOWN}; with "
                                                   "--record: bench/results)")
    p.add_argument("--record", action="store_true",
                   help=f"write bench/results/{stem}-<machine>.json (tracked) and {doc}'s table")
    p.add_argument("--machine", default=None, help="results file name (default: derived from the device)")


def _out_dir(args: argparse.Namespace) -> str:
    """--out-dir, else bench/results with --record, else the untracked LOCAL_RESULTS_DIR."""
    if args.out_dir and args.record:
        raise SystemExit("erpo: error: --record writes into bench/results; give it or --out-dir, not both")
    if args.record and not IN_CHECKOUT:
        raise SystemExit(f"erpo: error: --record appends to the project's record, bench/results of a clone of erpo; "
                         f"this is the installed suite: without --record it writes to {LOCAL_RESULTS_DIR}")
    return args.out_dir or str(RESULTS_DIR if args.record else LOCAL_RESULTS_DIR)


def _recorded_where(opts: RunOptions) -> None:
    """Say where the run went and, for an untracked one, how to record it."""
    from .measure import machine_name
    from .report import results_path

    path = results_path(opts.out_dir, machine_name(opts.device, opts.machine))
    if Path(opts.out_dir).resolve() == LOCAL_RESULTS_DIR.resolve() and IN_CHECKOUT:
        print(f"[bench] results in {path} (untracked); record them with: python -m bench merge {path}")
    else:
        print(f"[bench] results in {path}")


def _options(args: argparse.Namespace, cuda: tuple, cpu: tuple) -> RunOptions:
    """The run's options; (warm-up, repeats) default to `cuda` or `cpu` by device."""
    args.out_dir = _out_dir(args)
    warm, reps = cuda if args.device == "cuda" else cpu
    if args.warmup is None:
        args.warmup = warm
    if args.repeats is None:
        args.repeats = reps
    return RunOptions(
        device=args.device, warmup=args.warmup, repeats=args.repeats, out_dir=args.out_dir, machine=args.machine,
        budget_s=args.budget_s, worker_timeout_s=args.worker_timeout_s, args=vars(args),
        make_report=not args.no_report,
    )


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:  # one CPU measurement in a fresh process (bench/measure.py)
        return _worker(argv[1], json.loads(argv[2]))

    _DEFAULT_TARGETS = _shown_targets()  # named in --help (issue 18's three shapes)
    parser = argparse.ArgumentParser(prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description=sys.modules[__package__].__doc__.replace("python -m bench", PROG))
    sub = parser.add_subparsers(dest="command", required=True)

    k = sub.add_parser("kernels", help="token_logprobs / linear_token_logprobs vs PyTorch and the peers")
    _common(k)
    k.add_argument("--target", action="store_true",
                   help="the CPU target case: token_logprobs, N=4096, V=151936, fp32 "
                   "(one process holds ~10 GB at its peak)")
    k.add_argument("--ops", default=None, help="comma list: token_logprobs,linear_token_logprobs")
    k.add_argument("--peers", default=None, help="comma list (default: all; absent ones are listed)")
    k.add_argument("--passes", default="forward,backward,both")
    k.add_argument("--models", default=None, help="comma list of model shapes (with --n)")
    k.add_argument("--n", default=None, help="comma list of token counts N (replaces the preset's shapes)")
    k.add_argument("--dtypes", default=None, help="comma list: fp32,bf16,fp16 (with --n)")
    k.add_argument("--d", type=int, default=None, help="override D of the chosen models (tiny tests)")
    k.add_argument("--v", type=int, default=None, help="override V of the chosen models (tiny tests)")

    s = sub.add_parser("step", help="a whole GRPO/ERPO training step, fused vs stock")
    _common(s)
    s.add_argument("--variants", default=",".join(("erpo-fused", "erpo-stock", "grpo-stock", "grpo-fused",
                                                   "erpo-padded", "erpo-packed")))
    s.add_argument("--model", default=None, help="qwen2.5-0.5b, qwen2.5-1.5b or tiny (replaces the preset)")
    s.add_argument("--layers", type=int, default=None, help="override the depth (CPU: keep it small)")
    s.add_argument("--queries", type=int, default=4, help="m (with --model)")
    s.add_argument("--group", type=int, default=4, help="G (with --model)")
    s.add_argument("--prompt-len", type=int, default=32, help="T (with --model)")
    s.add_argument("--response-len", type=int, default=32, help="L (with --model)")
    s.add_argument("--tau", type=float, default=1.0, help="rollout temperature (with --model)")
    s.add_argument("--dtype", default=None, help="fp32 or bf16 (default: fp32 on CPU, bf16 on CUDA)")
    s.add_argument("--micro-batch-tokens", default=None,
                   help="comma list of budgets K: adds an erpo-micro-K variant each (peak memory against K)")

    c = sub.add_parser("cost", help="the counted cost model: ours and the peers at the target shapes (CPU, interpreter)")
    c.add_argument("--subjects", default=None, help="comma list of names (default: all; absent peers are listed)")
    c.add_argument("--ops", default=None, help="comma list: linear_token_logprobs,token_logprobs,loss (the fused losses)")
    c.add_argument("--targets", default=None, help=f"comma list of NxDxV (default: {_DEFAULT_TARGETS})")
    c.add_argument("--out-dir", default=None,
                   help="where cost.json goes (default: bench/results/local, untracked; with --record: bench/results)")
    c.add_argument("--record", action="store_true",
                   help="append the run to the project's record, bench/results/cost.json (tracked; what "
                        "`bench report` writes into the docs)")
    c.add_argument("--no-save", action="store_true", help="print only")
    c.add_argument("--jobs", type=int, default=None, help="worker processes counting shapes (default: CPUs, at most 8)")

    tu = sub.add_parser("tune", help="GPU: time the tile candidates that pass the compile check, record the "
                                     "fastest per (GPU, dtype, D, V) in the tuning file the op reads")
    tu.add_argument("--device", choices=("cuda",), default="cuda")
    tu.add_argument("--shapes", default=None, help="comma list of DxV (default: the Qwen2.5 1.5B, 7B and 8B-class heads)")
    tu.add_argument("--dtypes", default="bf16", help="comma list: bf16,fp16,fp32")
    tu.add_argument("--budget-s", type=float, default=600.0, help="time no new candidate after this many seconds")
    tu.add_argument("--out", default=None, help="the tuning file (default: erpo_kernels.tuning.tuning_path())")

    ao = sub.add_parser("aot", help="compile every kernel for six GPU architectures (no GPU needed): shared memory, "
                                    "registers, spills, tensor cores per kernel")
    from . import aot

    aot.add_arguments(ao)

    cal = sub.add_parser("calibrate", help="GPU: the linear op and the bare lm_head GEMMs timed beside the cost model")
    _common(cal)
    cal.add_argument("--targets", default=None, help=f"comma list of NxDxV (default: {_DEFAULT_TARGETS})")
    cal.add_argument("--subjects", default=None, help="comma list (default: every installed linear-op subject)")

    ro = sub.add_parser("rollout", help="rollout tokens/s of the HF and vLLM engines on one tiny model (needs vLLM)")
    ro.add_argument("--repeats", type=int, default=3, help="timed rollouts per engine (the median is reported)")
    ro.add_argument("--hidden", type=int, default=128, help="the tiny model's width (4 heads: 128 -> head_dim 32)")
    ro.add_argument("--layers", type=int, default=2, help="the tiny model's depth")
    ro.add_argument("--queries", type=int, default=16, help="m, prompts per rollout")
    ro.add_argument("--group", type=int, default=8, help="G, responses per prompt")
    ro.add_argument("--max-new-tokens", type=int, default=32)
    ro.add_argument("--tau", type=float, default=1.0, help="sampling temperature")
    _record_args(ro, "rollout")

    dv = sub.add_parser("demo-vllm", help="configs/demo-vllm.yaml trained with each rollout backend, side by side "
                                          "(the vLLM venv)")
    dv.add_argument("overrides", nargs="*", help="key=value settings on top of the config (e.g. lr=3e-4)")
    dv.add_argument("--label", default="shipped", help="the runs' name in the table (default: shipped)")
    dv.add_argument("--backends", default="hf,vllm", help="comma list of rollout backends (default: hf,vllm)")
    _record_args(dv, "demo-vllm")

    rp = sub.add_parser("replay", help="configs/demo.yaml at top_p=0.8 trained with the sampler's support replayed "
                                       "and without (docs/training.md)")
    rp.add_argument("overrides", nargs="*", help="key=value settings on top of the config and top_p=0.8")
    _record_args(rp, "replay", "docs/training.md")

    r = sub.add_parser("report", help="regenerate the README table and the plots from bench/results/*.json")
    r.add_argument("--out-dir", default=str(RESULTS_DIR if IN_CHECKOUT else LOCAL_RESULTS_DIR))
    r.add_argument("--print", action="store_true", help="also print the generated section")

    mg = sub.add_parser("merge", help="fold the runs of a results file into bench/results/<machine>.json")
    mg.add_argument("file")
    mg.add_argument("--out-dir", default=str(RESULTS_DIR if IN_CHECKOUT else LOCAL_RESULTS_DIR))

    args = parser.parse_args(argv)
    if args.command == "report":
        from . import report

        return report.report_command(args.out_dir, echo=args.print)
    if args.command == "merge":
        from . import report

        report.merge(args.file, args.out_dir)
        report.regenerate(args.out_dir)
        return 0
    if args.command == "kernels":
        return _kernels(args)
    if args.command == "aot":
        return aot.run(args, ao)
    if args.command == "cost":
        return _cost(args, argv)
    if args.command == "calibrate":
        return _calibrate(args)
    if args.command == "tune":
        return _tune(args)
    if args.command == "rollout":
        return _rollout(args)
    if args.command == "replay":
        from . import replay

        replay.run(_out_dir(args), args.overrides, args.machine, write_doc=args.record)
        return 0
    if args.command == "demo-vllm":
        from . import demo_vllm

        demo_vllm.run(_out_dir(args), args.label, _csv(args.backends), args.overrides, args.machine,
                      write_doc=args.record)
        return 0
    return _step(args)


def _kernels(args: argparse.Namespace) -> int:
    from . import kernels
    from .peers import OPS

    if args.target and args.device != "cpu":
        raise SystemExit("--target is the CPU target case; use --device cpu")
    opts = _options(args, cuda=(2, 5) if args.quick else (3, 10), cpu=(0, 2) if args.quick else (1, 3))
    if args.n:
        ops = _csv(args.ops) or list(OPS)
        models = _csv(args.models) or ["qwen2.5-1.5b"]
        dtypes = _csv(args.dtypes) or (["bf16"] if args.device == "cuda" else ["fp32"])
        bad = [m for m in models if m not in kernels.MODELS]
        if bad:
            raise SystemExit(f"unknown model(s) {bad}; known: {list(kernels.MODELS)}")
        cases = kernels.custom_cases(ops, models, _ints(args.n), dtypes, args.d, args.v)
    else:
        cases = kernels.preset_cases(args.device, args.quick, args.target)
        if args.ops:
            cases = [c for c in cases if c.op in _csv(args.ops)]
    peers = _csv(args.peers)
    if args.target and peers is None:
        peers = ["erpo", "erpo-inplace", "eager", "eager-ce", "trl", "trl-chunked"]
    elif args.device == "cpu" and args.quick and peers is None:
        peers = list(kernels.CPU_QUICK_PEERS)
    passes = _csv(args.passes)
    bad = [p for p in passes if p not in kernels.PASSES]
    if bad:
        raise SystemExit(f"unknown pass(es) {bad}; known: {list(kernels.PASSES)}")
    kernels.run(cases, peers, passes, opts)
    _recorded_where(opts)
    return 0


def _targets(text: Optional[str]):
    from .cost_subjects import TARGETS

    if not text:
        return TARGETS
    try:
        targets = [tuple(int(x) for x in t.lower().split("x")) for t in _csv(text)]
        if any(len(t) != 3 or min(t) < 1 for t in targets):
            raise ValueError
    except ValueError:
        raise SystemExit("erpo: error: --targets takes NxDxV sizes, e.g. 8192x4096x151936,2048x4096x151936")
    return targets


def _tune(args: argparse.Namespace) -> int:
    from . import tune

    shapes = tune.DEFAULT_SHAPES
    if args.shapes:
        try:
            shapes = [tuple(int(x) for x in t.lower().split("x")) for t in _csv(args.shapes)]
            if any(len(t) != 2 or min(t) < 1 for t in shapes):
                raise ValueError
        except ValueError:
            raise SystemExit("erpo: error: --shapes takes DxV sizes, e.g. 4096x151936,1536x151936")
    dtypes = _csv(args.dtypes) or ["bf16"]
    if set(dtypes) - {"bf16", "fp16", "fp32"}:
        raise SystemExit(f"erpo: error: --dtypes takes bf16, fp16, fp32; got {args.dtypes}")
    return tune.run(shapes, dtypes, args.budget_s, args.out)


def _calibrate(args: argparse.Namespace) -> int:
    from . import calibrate, report

    opts = _options(args, cuda=(1, 5), cpu=(0, 1))
    runs = report.cost_runs(args.out_dir) or report.cost_runs()
    calibrate.run(_targets(args.targets), _csv(args.subjects), opts, runs[-1] if runs else None)
    return 0


def _cost(args: argparse.Namespace, argv: List[str]) -> int:
    import os
    import subprocess

    if os.environ.get("TRITON_INTERPRET") != "1":  # read when kernels are decorated: start afresh with it
        env = dict(os.environ, TRITON_INTERPRET="1")
        return subprocess.run([sys.executable, "-m", __package__, *argv], env=env).returncode  # bench / erpo_bench
    from . import cost_subjects as cs
    from . import report
    from .measure import commit_hash, versions

    subjects = [s for s in cs.SUBJECTS if (not args.subjects or s.name in _csv(args.subjects))
                and (not args.ops or s.op in _csv(args.ops))]
    if not subjects:
        raise SystemExit(f"no subject matches; known: {sorted({s.name for s in cs.SUBJECTS})}")
    targets = _targets(args.targets)
    import datetime as _dt

    meta = dict(command="cost", commit=commit_hash(), versions=versions(),  # the code counted: taken first
                timestamp=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    jobs = args.jobs or min(8, os.cpu_count() or 1)
    out_dir = _out_dir(args)
    run = cs.run(subjects, targets, jobs=jobs)
    run.update(meta)
    if any(sub.name == "erpo" for sub in subjects):  # the facts of the kernels counted, no others
        run["compile_facts"] = _compile_facts(sorted({sub.op for sub in subjects if sub.name == "erpo"}))
    print("\n".join(report.cost_tables(run)))
    if not args.no_save:
        path = report.append_cost_run(run, out_dir)
        if args.record or args.out_dir:
            print(f"saved to {path}; `python -m bench report` puts the tables into docs/benchmarks.md")
        else:
            print(f"saved to {path} (untracked); rerun with --record to append it to bench/results/cost.json, "
                  "which `python -m bench report` writes into docs/benchmarks.md")
    return 0


def _compile_facts(ops: List[str]) -> dict:
    """The sm_90 / sm_100 compile facts of `ops`' kernels at the counted tiles (bench.aot), or why not."""
    from . import aot

    try:
        return aot.counted_facts(ops=ops)
    except Exception as exc:  # noqa: BLE001 (no NVIDIA backend in this Triton build, ...): reported
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def _step(args: argparse.Namespace) -> int:
    from . import step

    opts = _options(args, cuda=(2, 5), cpu=(1, 2) if args.quick else (1, 3))
    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    if args.model:
        if args.model not in step.MODELS:
            raise SystemExit(f"unknown model {args.model!r}; known: {list(step.MODELS)}")
        cases = [step.StepCase(args.model, args.layers, args.queries, args.group, args.prompt_len,
                               args.response_len, args.tau, dtype)]
    else:
        cases = step.preset_cases(args.device, args.quick)
    variants = _csv(args.variants) + [f"{step.MICRO_PREFIX}{k}" for k in (_ints(args.micro_batch_tokens) or [])]
    step.run(cases, variants, opts)
    _recorded_where(opts)
    return 0


def _rollout(args: argparse.Namespace) -> int:
    import torch

    from . import rollout

    device = "cuda" if torch.cuda.is_available() else "cpu"
    opts = RunOptions(device=device, warmup=1, repeats=args.repeats, out_dir=_out_dir(args), machine=args.machine,
                      args=vars(args), make_report=False)
    rollout.run(opts, args.hidden, args.layers, args.queries, args.group, args.max_new_tokens, args.tau,
                write_doc=args.record)
    return 0


def _worker(kind: str, spec: dict) -> int:
    if kind == "kernels":
        from .kernels import worker
    elif kind == "step":
        from .step import worker
    else:
        raise SystemExit(f"unknown worker kind {kind!r}")
    print(json.dumps(worker(spec)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
