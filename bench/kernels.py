"""`python -m bench kernels`: token_logprobs and linear_token_logprobs against the peers.

For every (op, shape, dtype) case and every present peer, three passes are measured:
  forward   the op with autograd recording (what a training forward pays, saved tensors included)
  backward  .backward(g) of that output, g ~ N(0, 1) per row (the forward runs untimed before it)
  both      forward + backward
Each record holds the median time, the peak extra memory (definitions in bench/measure.py),
the ratios against PyTorch eager (log_softmax + gather) on the same case, and, for the
forward pass, the largest |logp - reference| (reference: float64 on CPU, float32 chunked on
CUDA, from the same inputs).

On CUDA the suite also measures two ceilings (device-to-device copy bandwidth, dense bf16
matmul rate) and reports the fraction of them our kernels reach:
  token_logprobs bytes model: forward reads the logits once (N V b); backward reads them
    once and writes the gradient once (2 N V b); both: 3 N V b (b = bytes per logit).
  linear_token_logprobs FLOP model: forward 2 N D V; backward recomputes the logits
    (2 N D V) and forms d_hidden and d_weight (4 N D V): 6 N D V; both: 8 N D V.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import report
from .measure import Measurement, RunOptions, guarded, measure, measure_isolated, run_header
from .peers import LINEAR, PEER_BY_NAME, PEERS, TOKEN, peer_label, peer_versions

PASSES = ("forward", "backward", "both")
# `--quick` on CPU: the peers that run in seconds there (torch.compile compiles in every
# measurement subprocess; the full CPU preset and --peers include it).
CPU_QUICK_PEERS = ("erpo", "eager", "eager-ce", "trl", "trl-chunked")
# Logit scale of the synthetic inputs: logits ~ N(0, LOGIT_STD^2), a peaked softmax as in a
# trained LM (this matters for peers that skip near-zero gradient blocks, e.g. CCE).
LOGIT_STD = 4.0

# (hidden size D, vocabulary V) of the models the shapes come from.
MODELS: Dict[str, Tuple[int, int]] = {
    "qwen2.5-1.5b": (1536, 151936),
    "qwen2.5-7b": (3584, 151936),
    "llama3-8b": (4096, 128256),
    "gemma2-2b": (2304, 256000),
}
# token_logprobs depends on V only: one model per vocabulary.
VOCAB_MODELS = ("qwen2.5-1.5b", "llama3-8b", "gemma2-2b")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Case:
    op: str
    model: str
    n: int
    d: Optional[int]  # None for token_logprobs
    v: int
    dtype: str

    def shape(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"model": self.model, "N": self.n, "V": self.v}
        if self.d is not None:
            out["D"] = self.d
        return out

    def name(self) -> str:
        dims = f"N={self.n}" + (f" D={self.d}" if self.d is not None else "") + f" V={self.v}"
        return f"{self.op} {self.model} {dims} {self.dtype}"


def case_for(op: str, model: str, n: int, dtype: str) -> Case:
    d, v = MODELS[model]
    return Case(op, model, n, d if op == LINEAR else None, v, dtype)


def preset_cases(device: str, quick: bool, target: bool) -> List[Case]:
    """The shapes of each preset. GPU: N from 1k to 32k; CPU: reduced N, real vocabularies."""
    if target:  # the CPU target of the issue: N = 4096, V = 151936, fp32
        return [case_for(TOKEN, "qwen2.5-1.5b", 4096, "fp32")]
    cases: List[Case] = []
    if device == "cuda":
        if quick:  # most informative first: a time budget (--budget-s) may cut the tail
            for model, n in (("qwen2.5-1.5b", 16384), ("gemma2-2b", 16384), ("qwen2.5-1.5b", 4096)):
                cases.append(case_for(TOKEN, model, n, "bf16"))
                cases.append(case_for(LINEAR, {"gemma2-2b": "llama3-8b"}.get(model, model), n, "bf16"))
            return cases
        for n in (1024, 4096, 16384, 32768):
            cases += [case_for(TOKEN, m, n, "bf16") for m in VOCAB_MODELS]
            cases += [case_for(LINEAR, m, n, "bf16") for m in MODELS]
        cases.append(case_for(TOKEN, "qwen2.5-1.5b", 4096, "fp32"))
        cases.append(case_for(LINEAR, "qwen2.5-1.5b", 4096, "fp32"))
        return cases
    if quick:
        return [case_for(TOKEN, "qwen2.5-1.5b", 256, "fp32"), case_for(LINEAR, "qwen2.5-1.5b", 32, "fp32")]
    cases = [case_for(TOKEN, m, 1024, "fp32") for m in VOCAB_MODELS]
    cases += [case_for(LINEAR, m, 256, "fp32") for m in ("qwen2.5-1.5b", "llama3-8b")]
    return cases


def custom_cases(ops: Sequence[str], models: Sequence[str], ns: Sequence[int], dtypes: Sequence[str],
                 d: Optional[int], v: Optional[int]) -> List[Case]:
    """Cases from explicit --n/--models (and --d/--v overriding the model's sizes, for tiny tests)."""
    cases = []
    for op in ops:
        for model in models:
            md, mv = MODELS[model]
            for n in ns:
                for dt in dtypes:
                    cases.append(Case(op, model, n, (d or md) if op == LINEAR else None, v or mv, dt))
    return cases


# ----------------------------------------------------------------------------- inputs


def make_inputs(case: Case, device: str, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Seeded inputs of a case (identical for every peer), leaves with requires_grad, and g."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = DTYPES[case.dtype]
    x: Dict[str, torch.Tensor] = {}
    x["targets"] = torch.randint(0, case.v, (case.n,), generator=gen, device=device)
    x["grad"] = torch.randn(case.n, generator=gen, device=device, dtype=torch.float32)
    if case.op == TOKEN:
        logits = torch.randn(case.n, case.v, generator=gen, device=device, dtype=dt)
        x["raw_logits"] = logits.mul_(LOGIT_STD)
        x["anchor"] = torch.zeros((), device=device, requires_grad=True)
    else:
        hidden = torch.randn(case.n, case.d, generator=gen, device=device, dtype=dt)
        weight = torch.randn(case.v, case.d, generator=gen, device=device, dtype=dt)
        x["hidden"] = hidden.requires_grad_()
        x["weight"] = weight.mul_(LOGIT_STD / math.sqrt(case.d)).requires_grad_()
    return x


class _GradSink(torch.autograd.Function):
    """logits = sink(raw, anchor): the logits as the non-leaf output of an upstream layer.

    Its backward takes dL/dlogits and drops it (as an lm_head backward would consume it),
    so the gradient buffer is counted while it lives but is never copied into a leaf's
    .grad (autograd clones a gradient that aliases its leaf, which would charge an
    in-place backward for a copy a real model never makes).
    """

    @staticmethod
    def forward(ctx, raw: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return raw.detach()  # shares storage, not an autograd view (in-place peers may write to it)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, torch.zeros((), device=grad.device)


def op_inputs(case: Case, x: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """What a peer receives: for token_logprobs, fresh sink-wrapped logits on every call."""
    if case.op == TOKEN:
        return {"logits": _GradSink.apply(x["raw_logits"], x["anchor"]), "targets": x["targets"]}
    return x


def leaves(case: Case, x: Dict[str, torch.Tensor]) -> List[torch.Tensor]:
    return [x["anchor"]] if case.op == TOKEN else [x["hidden"], x["weight"]]


@torch.no_grad()
def reference_logp(case: Case, x: Dict[str, torch.Tensor]) -> torch.Tensor:
    """logp [N] from the same inputs in float64 (CPU) or float32 (CUDA), chunked over rows."""
    cpu = x["targets"].device.type == "cpu"
    cdt = torch.float64 if cpu else torch.float32
    n = case.n
    step = max(1, (1 << (22 if cpu else 26)) // case.v)
    out = torch.empty(n, dtype=cdt, device=x["targets"].device)
    w = x["weight"].detach().to(cdt) if case.op == LINEAR else None
    for a in range(0, n, step):
        if case.op == TOKEN:
            z = x["raw_logits"][a : a + step].to(cdt)
        else:
            z = x["hidden"][a : a + step].detach().to(cdt) @ w.T
        lse = torch.logsumexp(z, dim=-1)
        out[a : a + step] = z.gather(1, x["targets"][a : a + step, None]).squeeze(1) - lse
    return out


# ----------------------------------------------------------------------------- one measurement


# The reference logp of the last case (the inputs are seeded, so every peer's are identical).
_REF_CACHE: Dict[str, Any] = {}


def measure_pass(case: Case, peer: str, pass_name: str, device: str, warmup: int, repeats: int) -> Measurement:
    """Build the case's inputs, measure one pass of one peer."""
    peer_fn = PEER_BY_NAME[peer].fn
    x = make_inputs(case, device)
    ls = leaves(case, x)
    g = x["grad"]

    def call() -> torch.Tensor:
        return peer_fn(case.op, op_inputs(case, x))

    err = None
    if pass_name == "forward":
        if _REF_CACHE.get("case") != (case, device):
            _REF_CACHE.clear()
            _REF_CACHE.update(case=(case, device), ref=reference_logp(case, x))
        ref = _REF_CACHE["ref"]
        out = call()
        err = float((out.detach().to(ref.dtype) - ref).abs().max())
        del out, ref

    def clear() -> None:
        for t in ls:
            t.grad = None

    if pass_name == "forward":
        def prepare():
            clear()

        def region(_):
            return call()
    elif pass_name == "backward":
        def prepare():
            clear()
            return call()

        def region(out):
            out.backward(g)
    else:
        def prepare():
            clear()

        def region(_):
            call().backward(g)

    if peer == "compile":
        warmup = max(warmup, 1)  # the first call compiles
    m = measure(prepare, region, device=device, warmup=warmup, repeats=repeats)
    if err is not None:
        m.extra["max_abs_err"] = err
    return m


def worker(spec: Dict[str, Any], device: str = "cpu") -> Dict[str, Any]:
    """One measurement from its JSON spec (in a subprocess on CPU: python -m bench _worker kernels SPEC)."""
    case = Case(**spec["case"])
    return guarded(
        lambda: measure_pass(case, spec["peer"], spec["pass"], device, spec["warmup"], spec["repeats"]), device
    ).to_dict()


# ----------------------------------------------------------------------------- ceilings (GPU)


def measure_ceilings() -> Dict[str, Any]:
    """Measured device-to-device copy bandwidth and dense bf16 matmul rate (CUDA only)."""
    def timed(fn, reps=10, warm=3) -> float:
        for _ in range(warm):
            fn()
        ts = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e))
        ts.sort()
        return ts[len(ts) // 2]

    n = 1 << 29  # 2 GiB of fp32
    a = torch.randn(n, device="cuda")
    b = torch.empty_like(a)
    ms = timed(lambda: b.copy_(a))
    copy_gbps = 2 * n * 4 / (ms * 1e-3) / 1e9
    del a, b
    k = 8192
    x = torch.randn(k, k, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(k, k, device="cuda", dtype=torch.bfloat16)
    ms = timed(lambda: x @ y)
    tflops = 2 * k**3 / (ms * 1e-3) / 1e12
    del x, y
    torch.cuda.empty_cache()
    return {
        "copy_gbps": round(copy_gbps, 1),
        "copy_definition": "device-to-device copy of 2 GiB, bytes read + written over the median of 10 (3 warm-ups)",
        "bf16_matmul_tflops": round(tflops, 1),
        "matmul_definition": "8192^3 bf16 matmul on random data, 2 k^3 FLOPs over the median of 10 (3 warm-ups)",
    }


BYTES_MODEL = {"forward": 1, "backward": 2, "both": 3}  # x N V b
FLOPS_MODEL = {"forward": 2, "backward": 6, "both": 8}  # x N D V


def roofline(case: Case, pass_name: str, median_ms: float, ceilings: Dict[str, Any]) -> Dict[str, Any]:
    secs = median_ms * 1e-3
    if case.op == TOKEN:
        nbytes = BYTES_MODEL[pass_name] * case.n * case.v * DTYPES[case.dtype].itemsize
        gbps = nbytes / secs / 1e9
        return {"model_bytes": nbytes, "achieved_gbps": round(gbps, 1),
                "fraction_of_copy_bw": round(gbps / ceilings["copy_gbps"], 3)}
    flops = FLOPS_MODEL[pass_name] * case.n * case.d * case.v
    tflops = flops / secs / 1e12
    out = {"model_flops": flops, "achieved_tflops": round(tflops, 1)}
    if case.dtype == "bf16":
        out["fraction_of_bf16_matmul"] = round(tflops / ceilings["bf16_matmul_tflops"], 3)
    return out


# ----------------------------------------------------------------------------- the run


def _ratios(records: List[Dict[str, Any]]) -> None:
    """ratio_time_vs_eager / ratio_mem_vs_eager of every record of one case, per pass."""
    for p in PASSES:
        base = next((r for r in records if r["peer"] == "eager" and r["pass"] == p and r["status"] == "ok"), None)
        for r in records:
            if r["pass"] != p:
                continue
            ok = base is not None and r["status"] == "ok"
            r["ratio_time_vs_eager"] = (
                round(r["median_ms"] / base["median_ms"], 4) if ok and base["median_ms"] else None
            )
            r["ratio_mem_vs_eager"] = (
                round(r["peak_extra_mb"] / base["peak_extra_mb"], 4) if ok and base["peak_extra_mb"] else None
            )


def run(cases: List[Case], peers: Optional[Sequence[str]], passes: Sequence[str], opts: RunOptions) -> Dict[str, Any]:
    """Measure every case, rewriting the run in <out_dir>/<machine>.json after each record."""
    t_start = time.monotonic()
    wanted = list(peers) if peers else [p.name for p in PEERS]
    unknown = [p for p in wanted if p not in PEER_BY_NAME]
    if unknown:
        raise SystemExit(f"unknown peer(s) {unknown}; known: {[p.name for p in PEERS]}")
    present, absent = [], []
    for p in wanted:
        reason = PEER_BY_NAME[p].absent_reason(opts.device)
        if reason is None:
            present.append(p)
        else:
            absent.append({"peer": p, "label": peer_label(p), "reason": reason})
    header = run_header("kernels", opts)
    header["versions"]["peers"] = peer_versions()
    header["peers"] = {p: peer_label(p) for p in present}
    header["absent_peers"] = absent
    header["inputs"] = (
        f"logits ~ N(0, {LOGIT_STD}^2) (token_logprobs); hidden ~ N(0, 1), weight ~ N(0, {LOGIT_STD}^2 / D) "
        "(linear_token_logprobs); targets uniform in [0, V), none ignored; no temperature; upstream "
        "gradient g ~ N(0, 1) per row"
    )
    header["models"] = {"roofline_bytes": "token_logprobs: forward N V b, backward 2 N V b, both 3 N V b",
                        "roofline_flops": "linear_token_logprobs: forward 2 N D V, backward 6 N D V "
                        "(recompute 2 + grads 4), both 8 N D V"}
    if opts.device == "cuda":
        header["ceilings"] = measure_ceilings()
    out = report.RunWriter(header, opts, t_start)
    print(f"[bench kernels] {header['device_name']}; results -> {out.path}")
    print(f"[bench kernels] peers: {', '.join(present)}; absent: "
          + (", ".join(f"{a['peer']} ({a['reason']})" for a in absent) or "none"))

    for case in cases:
        case_recs: List[Dict[str, Any]] = []
        for peer in present:
            if case.op not in PEER_BY_NAME[peer].ops:
                continue
            if out.spent():  # a budget bounds the overrun to one peer's measurements
                out.skip({"case": asdict(case), "peer": peer})
                continue
            for p in passes:
                spec = {"case": asdict(case), "peer": peer, "pass": p, "warmup": opts.warmup, "repeats": opts.repeats}
                rec = {"op": case.op, "peer": peer, "shape": case.shape(), "dtype": case.dtype, "pass": p,
                       **measure_isolated("kernels", spec, worker, opts)}
                if opts.device == "cuda" and peer == "erpo" and rec.get("status") == "ok":
                    rec["roofline"] = roofline(case, p, rec["median_ms"], header["ceilings"])
                case_recs.append(rec)
                _ratios(case_recs)  # against eager once it is measured (the list shares the records)
                out.add(rec)
                _print_record(case, rec)
    return out.finish(report.kernels_summary)


def _print_record(case: Case, r: Dict[str, Any]) -> None:
    if r.get("status") != "ok":
        print(f"  {case.name():<60} {r['peer']:<13} {r['pass']:<9} {r.get('status')}: {r.get('error')}", flush=True)
        return
    err = f" err {r['max_abs_err']:.1e}" if r.get("max_abs_err") is not None else ""
    print(f"  {case.name():<60} {r['peer']:<13} {r['pass']:<9} {r['median_ms']:>10.3f} ms "
          f"{r['peak_extra_mb']:>10.1f} MB{err}", flush=True)
