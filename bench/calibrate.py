"""`python -m bench calibrate`: the linear op's measured times beside the cost model's.

On a GPU, times forward and forward + backward of linear_token_logprobs for ours and each
installed peer (the same calls `bench cost` counts, bench/cost_subjects.py), and the bare
lm_head GEMMs (forward: logits = hidden @ weight.T; backward: d_hidden = g @ weight and
d_weight = g.T @ hidden, g a bf16 [N, V]), at issue 18's target shapes. Each record carries
the cost model's prediction for that GPU (the newest `bench cost` run in
bench/results/cost.json for the subjects; the same rule applied to one GEMM for the GEMMs),
so the first GPU run calibrates the model: measured / modelled is in every record.

Records go to bench/results/<machine>.json as a run of command "calibrate", rewritten after
every record (a run stopped at a time limit keeps what it measured). On CPU it runs the same
code at the shapes given (a smoke test of this file: the Triton subjects need TRITON_INTERPRET=1).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import cost_subjects as cs
from .cost_model import HARDWARE, Hardware, Shape
from .measure import RunOptions, guarded, measure, run_header

GEMMS = ("gemm-fwd", "gemm-bwd")  # logits = h @ W.T; d_h = g @ W and d_W = g.T @ h
PASSES = ("forward", "both")


def hardware_of(device_name: str) -> Optional[str]:
    """The cost model's hardware key for a device name (None: not modelled)."""
    for key in HARDWARE:
        if key.lower() in device_name.lower():
            return key
    return None


def model_hardware(device: str, device_name: str) -> Optional[str]:
    """The cost model's hardware key for the measuring device: its GPU's (None on CPU, or on a
    GPU the model does not know: the records then carry no prediction)."""
    return hardware_of(device_name) if device == "cuda" else None


def gemm_model_ms(shape: Shape, which: str, hw: Hardware) -> float:
    """max(FLOP time, byte time) of the bare bf16 GEMMs, each reading its operands and writing its
    output once (the cost model's rule for one PyTorch op)."""
    n, d, v = shape
    if which == "gemm-fwd":
        gemms = [(2 * n * d * v, 2 * (n * d + v * d + n * v))]
    else:
        gemms = [(2 * n * d * v, 2 * (n * v + v * d + n * d)), (2 * n * d * v, 2 * (n * v + n * d + v * d))]
    return sum(max(f / hw.peaks["bf16"], b / hw.hbm_bytes_per_s) for f, b in gemms) * 1e3


def model_predictions(cost_run: Optional[Dict[str, Any]], hw_key: Optional[str]) -> Dict[Tuple, float]:
    """(subject, N, D, V, pass) -> modelled ms on hw_key, from a `bench cost` run."""
    out: Dict[Tuple, float] = {}
    if not cost_run or not hw_key:
        return out
    for s in cost_run.get("subjects", []):
        if s.get("op") != cs.LINEAR or s.get("status") != "ok":
            continue
        for r in s["results"]:
            sh = r["shape"]
            for p in PASSES:
                out[(s["name"], sh["N"], sh["D"], sh["V"], p)] = r["passes"][p][hw_key]["ms"]
    return out


def _gemm_region(which: str, shape: Shape, device: str) -> Tuple[Callable[[], Any], Callable[[Any], Any]]:
    n, d, v = shape

    def prepare():
        g = torch.Generator(device=device).manual_seed(0)
        h = torch.randn(n, d, device=device, generator=g, dtype=torch.bfloat16)
        w = torch.randn(v, d, device=device, generator=g, dtype=torch.bfloat16)
        dz = torch.randn(n, v, device=device, generator=g, dtype=torch.bfloat16) if which == "gemm-bwd" else None
        return h, w, dz

    def region(state):
        h, w, dz = state
        if which == "gemm-fwd":
            return h @ w.T
        return dz @ w, dz.T @ h

    return prepare, region


def _subject_region(subject: cs.Subject, shape: Shape, device: str, pass_name: str):
    n, d, v = shape
    call = subject.call

    def prepare():
        g = torch.Generator(device=device).manual_seed(0)
        h = torch.randn(n, d, device=device, generator=g).to(torch.bfloat16).requires_grad_()
        w = (torch.randn(v, d, device=device, generator=g) / d ** 0.5).to(torch.bfloat16).requires_grad_()
        t = torch.randint(0, v, (n,), device=device, generator=g)
        return h, w, t, torch.randn(n, device=device, generator=g)

    def region(state):
        h, w, t, grad = state
        out = call(h, w, t)
        if pass_name == "both":
            out.backward(grad.to(out.dtype))
            return out, h.grad, w.grad
        return out

    return prepare, region


def cases(targets: Sequence[Shape], subjects: Sequence[cs.Subject]) -> List[Tuple[str, Shape, str]]:
    """(case, shape, pass) in measuring order: per shape the GEMMs, then each subject."""
    out = []
    for shape in targets:
        out += [(g, shape, "forward" if g == "gemm-fwd" else "backward") for g in GEMMS]
        out += [(s.name, shape, p) for s in subjects for p in PASSES]
    return out


def run(targets: Sequence[Shape], subject_names: Optional[Sequence[str]], opts: RunOptions,
        cost_run: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    from .report import RunWriter

    header = run_header("calibrate", opts)
    hw_key = model_hardware(opts.device, header["device_name"])
    predicted = model_predictions(cost_run, hw_key)
    subjects, absent = [], []
    for s in cs.SUBJECTS:
        if s.op != cs.LINEAR or (subject_names and s.name not in subject_names):
            continue
        why = s.absent_reason()
        if why:
            absent.append({"subject": s.name, "reason": why})
            continue
        subjects.append(s)
    header.update(hardware_model=hw_key, model_commit=(cost_run or {}).get("commit"), absent_subjects=absent,
                  definitions={**header.get("definitions", {}),
                               "model": "bench cost: lower bound per launch group, max(FLOP time, byte time)"})
    writer = RunWriter(header, opts)
    t0 = time.monotonic()
    for name, shape, pass_name in cases(targets, subjects):
        if writer.spent():
            writer.skip({"case": name, "shape": dict(zip("NDV", shape)), "pass": pass_name})
            continue
        if name in GEMMS:
            prepare, region = _gemm_region(name, shape, opts.device)
            model = gemm_model_ms(shape, name, HARDWARE[hw_key]) if hw_key else None
        else:
            subject = next(s for s in subjects if s.name == name)
            prepare, region = _subject_region(subject, shape, opts.device, pass_name)
            model = predicted.get((name, *shape, pass_name))
        m = guarded(lambda: measure(prepare, region, device=opts.device, warmup=opts.warmup, repeats=opts.repeats),
                    opts.device)
        rec = {"case": name, "shape": dict(zip("NDV", shape)), "pass": pass_name, **m.to_dict(),
               "model_ms": model, "measured_over_model": (m.median_ms / model) if (model and m.median_ms) else None}
        writer.add(rec)
        print(f"[calibrate {time.monotonic() - t0:6.0f}s] {name:<16} N={shape[0]} D={shape[1]} V={shape[2]} "
              f"{pass_name:<8} {m.status:<6} {m.median_ms if m.median_ms is not None else '-':>10} ms"
              + (f"   model {model:.2f} ms, measured / model {rec['measured_over_model']:.2f}" if
                 rec["measured_over_model"] else ""), flush=True)
    return writer.finish(lambda r: f"== bench calibrate: {len(r['results'])} records, "
                                   f"{len(r['skipped_cases'])} skipped ({r.get('elapsed_s')} s)")
