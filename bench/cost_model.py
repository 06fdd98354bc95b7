"""Exact fits of counted costs in N, D, V and the lower-bound GPU time model built on them.

Fits. For fixed tiles, every count of a launch (bytes, FLOPs, programs, launches) is a
polynomial in N, D and V with ceil terms at tile and chunk boundaries. On a residue class
(N = N* mod mN, D = D* mod mD, V = V* mod mV, with m the lcm of the subject's tile and chunk
sizes along that dimension) each ceil(x / t) is affine in x, so the count is an exact
multilinear polynomial (terms 1, N, D, V, ND, NV, DV, NDV): `fit_exact` solves it from the 2 x 2
x 2 grid of shapes with Fractions, `Fit.check` verifies it on held-out shapes of the same
classes, and `Fit.at` evaluates it at the target (N*, D*, V*).

Time model, per launch group (one kernel's launches, or one PyTorch op with one output pattern):
    t = max(FLOP time, HBM byte time, L2 byte time, shared-memory byte time)
    FLOP time  = sum over operand dtypes of dot / GEMM FLOPs / that dtype's dense peak
    byte time  = HBM bytes / bandwidth, where HBM bytes are
      Triton:  the compulsory bytes (distinct loaded + distinct stored) of every argument, except
               the arguments private to their programs (no two programs touch the same bytes) that
               are re-read or re-written: when their live footprint, min(programs per launch, SMs) x
               their bytes per program, exceeds the L2, all their loaded + stored bytes go to HBM.
               Re-reads of data shared across programs are taken to hit the L2 (a lower bound).
      PyTorch: each op reads its inputs and writes its outputs once (loaded + stored).
    L2 time    = L2 bytes / the L2 bandwidth: every byte a program loads or stores crosses the L2
               (all re-reads; a PyTorch op: inputs and outputs once, a cuBLAS GEMM at least its FLOPs /
               its tile intensity, GEMM_TILE_INTENSITY), L2_RULE
    smem time  = shared-memory bytes / all SMs' shared-memory bandwidth: each tl.dot operand staged
               once and read once (counted by bench.cost), a cuBLAS GEMM twice its operand L2 bytes
The sum over groups is the subject's modelled time: a lower bound that ignores launch
latency, occupancy and elementwise math (exp, log); FLOPs are tl.dot / GEMM FLOPs only.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .cost import Launch

Shape = Tuple[int, int, int]  # (N, D, V)
Counts = Dict[str, Dict[str, int]]  # group key -> quantity -> value

MB = 1e6


# ----------------------------------------------------------------------------- hardware


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes_per_s: float  # the bandwidth the model uses
    hbm_nominal: float
    l2_bytes: float
    sms: int
    peaks: Dict[str, float]  # FLOP/s by operand dtype (dense)
    source: str
    l2_bytes_per_s: float = 0.0  # what every byte a program loads or stores crosses (0: not charged)
    smem_bytes_per_s: float = 0.0  # all SMs' shared memory together (0: not charged)
    l2_source: str = ""


_TENSOR = 989.4e12  # dense bf16 / fp16 tensor-core peak of an H100 SXM / H200 (NVIDIA datasheets)
_FP32 = 66.9e12  # fp32 FMA (non-tensor) peak of the same SXM parts
_PEAKS = {"bf16": _TENSOR, "fp16": _TENSOR, "bf16>fp32": _TENSOR, "fp16>fp32": _TENSOR, "fp32": _FP32,
          "fp64": _FP32}
_SOURCE = ("NVIDIA H100 / H200 datasheets: HBM 3.35 TB/s (H100 SXM) and 4.8 TB/s (H200), dense bf16 989.4 "
           "TFLOP/s, fp32 66.9 TFLOP/s; the model uses 90% of the nominal HBM bandwidth (H200: 4.3 TB/s, as the "
           "issue). L2: 50 MB on both (NVIDIA's Hopper architecture blog: 50 MB on H100 SXM5, 60 MB on the full "
           "GH100 die; H200 is the same GH100 product configuration with 132 SMs)")
_CLOCK_H100 = 1.755e9  # boost clock the L2 and shared-memory rates are quoted at (Chips and Cheese measured 1755 MHz)
_L2_SOURCE_H100 = ("L2 5,120 B/clk at 1.755 GHz = 9.0 TB/s (GH100's L2 read bandwidth per clock, as Chips and "
                   "Cheese's 'Nvidia's H100: Funny L2, and Tons of Bandwidth' measured it; issue 26); shared memory "
                   "128 B/clk per SM x 132 SMs at 1.755 GHz = 29.7 TB/s")
# B200: NVIDIA's HGX B200 datasheet (8 TB/s HBM3e, 2.25 PFLOP/s dense bf16 = 4.5 with sparsity, 148 SMs);
# 126 MB of L2 (Chips and Cheese, 'Nvidia's B200: Keeping the CUDA Juggernaut Rolling'). NVIDIA publishes no L2
# bandwidth for it and none was found measured: the model assumes H100's per-SM L2 rate (5,120 / 132 B/clk)
# on 148 SMs at 1.965 GHz (11.3 TB/s), an assumption stated beside every B200 number.
_B200_PEAKS = {"bf16": 2.25e15, "fp16": 2.25e15, "bf16>fp32": 2.25e15, "fp16>fp32": 2.25e15, "fp32": 80e12,
               "fp64": 40e12}
_CLOCK_B200 = 1.965e9
HARDWARE = {
    "H100": Hardware("H100 SXM", 0.9 * 3.35e12, 3.35e12, 50 * MB, 132, _PEAKS, _SOURCE,
                     5120 * _CLOCK_H100, 128 * 132 * _CLOCK_H100, _L2_SOURCE_H100),
    "H200": Hardware("H200", 0.9 * 4.8e12, 4.8e12, 50 * MB, 132, _PEAKS, _SOURCE,
                     5120 * _CLOCK_H100, 128 * 132 * _CLOCK_H100, _L2_SOURCE_H100),
    "B200": Hardware("B200", 0.9 * 8e12, 8e12, 126 * MB, 148, _B200_PEAKS,
                     "NVIDIA HGX B200 datasheet: HBM3e 8 TB/s, dense bf16 2.25 PFLOP/s; 126 MB L2 (Chips and Cheese)",
                     5120 / 132 * 148 * _CLOCK_B200, 128 * 148 * _CLOCK_B200,
                     "L2 ASSUMED 11.3 TB/s (H100's per-SM rate on 148 SMs at 1.965 GHz: no published figure); "
                     "shared memory 128 B/clk per SM x 148 SMs at 1.965 GHz = 37.2 TB/s"),
}
BYTES_RULE = ("HBM bytes = compulsory (distinct) bytes, except arguments private to their programs that are "
              "re-read or re-written with a live footprint (min(programs, SMs) x bytes per program) above the "
              "L2: all their loaded + stored bytes; shared re-reads hit the L2; PyTorch ops read inputs and write "
              "outputs once")
# cuBLAS's GEMMs are charged through the L2 at the intensity of the tiles it runs on Hopper: 128 x 256 for
# bf16 / fp16 (2 x 128 x 256 / ((128 + 256) x 2) = 85.3 FLOP per byte), 128 x 128 for fp32 (32 FLOP per byte).
GEMM_TILE_INTENSITY = {"bf16": 85.3, "fp16": 85.3, "fp32": 32.0, "fp64": 16.0}
L2_RULE = ("L2 bytes = every byte a Triton program loads or stores (all programs, all re-reads); a PyTorch op's "
           "inputs and outputs once, and a cuBLAS GEMM at least its FLOPs / its tile intensity (bf16 128 x 256 "
           "tiles: 85.3 FLOP/B; fp32 128 x 128: 32); shared-memory bytes = each tl.dot operand written to shared "
           "memory once and read once (a cuBLAS GEMM: twice its operand L2 bytes)")


# ----------------------------------------------------------------------------- counts of one run


def group_key(r: Launch, shape: Shape, gemm_roles: bool = True) -> str:
    """Launches summed into one group: a Triton kernel by name; a PyTorch op by name and the
    pattern of its first output's dimensions (V, D, or r for any other size), so that an op
    used in two roles (a logits GEMM and a gradient GEMM, say) is timed as two groups."""
    if r.kind == "triton":
        return f"{r.phase}/{r.name}"
    if not r.flops or not gemm_roles:  # not a GEMM (bytes only), or roles not told apart: one group per op name
        return f"{r.phase}/{r.name}"
    _, d, v = shape
    dims = r.out_shape or ()
    pat = "".join("V" if x == v else "D" if x == d else "1" if x == 1 else "r" for x in dims)
    return f"{r.phase}/{r.name}[{pat}]"


def flatten(records: Iterable[Launch], shape: Shape, gemm_roles: bool = True) -> Counts:
    """Group the records (see group_key) and sum their quantities."""
    out: Counts = {}
    for r in records:
        if r.kind == "torch" and not (r.loaded or r.stored or r.flops):
            continue  # views and other metadata ops: nothing to time
        q = out.setdefault(("torch/" if r.kind == "torch" else "") + group_key(r, shape, gemm_roles), {})
        q["launches"] = q.get("launches", 0) + 1
        for k in ("programs", "loaded", "stored", "distinct_loaded", "distinct_stored", "distinct", "atomics", "smem"):
            q[k] = q.get(k, 0) + getattr(r, k)
        for k, v in r.flops.items():
            q[f"flops:{k}"] = q.get(f"flops:{k}", 0) + v
        for name, a in r.args.items():
            for f in ("loaded", "stored", "distinct_loaded", "distinct_stored", "distinct", "program_distinct"):
                key = f"arg:{name}:{f}"
                q[key] = q.get(key, 0) + getattr(a, f)
    return out


# ----------------------------------------------------------------------------- exact fits


Features = Callable[[Shape], Dict[str, Fraction]]  # the basis terms' values at a shape


def multilinear(shape: Shape) -> Dict[str, Fraction]:
    """1, N, D, V, ND, NV, DV, NDV: the basis on a residue class of the tiles."""
    val = dict(zip("NDV", shape))
    out = {}
    for k in range(4):
        for m in itertools.combinations("NDV", k):
            x = Fraction(1)
            for s in m:
                x *= val[s]
            out["".join(m) or "1"] = x
    return out


def _solve_least_squares(a: List[List[Fraction]], b: List[List[Fraction]]) -> List[List[Fraction]]:
    """Exact least squares on Fractions: x minimising |a x - b| column by column, from the normal
    equations by Gauss-Jordan; columns of `a` that depend on earlier ones get coefficient 0."""
    k = len(a[0])
    ata = [[sum(r[i] * r[j] for r in a) for j in range(k)] for i in range(k)]
    atb = [[sum(r[i] * rb[j] for r, rb in zip(a, b)) for j in range(len(b[0]))] for i in range(k)]
    m = [ata[i] + atb[i] for i in range(k)]
    pivots, row = [], 0
    for c in range(k):
        p = next((r for r in range(row, k) if m[r][c] != 0), None)
        if p is None:
            continue
        m[row], m[p] = m[p], m[row]
        inv = 1 / m[row][c]
        m[row] = [x * inv for x in m[row]]
        for r in range(k):
            if r != row and m[r][c] != 0:
                f = m[r][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[row])]
        pivots.append(c)
        row += 1
    x = [[Fraction(0)] * len(b[0]) for _ in range(k)]
    for r, c in enumerate(pivots):
        x[c] = m[r][k:]
    return x


@dataclass
class Fit:
    """Exact polynomials, one per (group, quantity), in the basis `features`."""

    features: Features
    terms: List[str]
    coefs: Dict[str, Dict[str, List[Fraction]]]
    shapes: List[Shape]
    checks: List[Dict] = field(default_factory=list)  # held-out shapes (Fit.check)
    fit_exact: bool = False  # reproduces every fit shape
    target_features: Optional[Features] = None  # the basis at the target, when it differs (a peer's real chunks)

    def at(self, shape: Shape, features: Optional[Features] = None) -> Counts:
        """The fitted counts at `shape`, in `features` (default: target_features, else the fit's)."""
        f = (features or self.target_features or self.features)(shape)
        row = [f[t] for t in self.terms]
        out: Counts = {}
        for g, qs in self.coefs.items():
            out[g] = {q: _as_number(sum(c * x for c, x in zip(cs, row))) for q, cs in qs.items()}
        return out

    def check(self, shape: Shape, counted: Counts) -> Dict:
        """Compare the fit with counts at a shape (in the fit's basis); records and returns the result."""
        pred = self.at(shape, self.features)
        bad = []
        for g in sorted(set(pred) | set(counted)):
            p, c = pred.get(g, {}), counted.get(g, {})
            for q in sorted(set(p) | set(c)):
                if p.get(q, 0) != c.get(q, 0):
                    bad.append(f"{g} {q}: fit {p.get(q, 0)} counted {c.get(q, 0)}")
        def total(c: Counts, prefix: Tuple[str, ...]) -> float:
            return float(sum(v for q in c.values() for k, v in q.items() if k.startswith(prefix)))

        errs = {}
        for what, prefix in (("bytes", ("loaded", "stored")), ("flops", ("flops:",))):
            want = total(counted, prefix)
            errs[f"{what}_rel_err"] = abs(total(pred, prefix) - want) / want if want else 0.0
        res = {"shape": list(shape), "exact": not bad, "mismatches": bad[:10], "n_mismatches": len(bad), **errs}
        self.checks.append(res)
        return res

    @property
    def exact(self) -> bool:
        return bool(self.checks) and all(c["exact"] for c in self.checks)


def _as_number(x: Fraction):
    return int(x) if x.denominator == 1 else float(x)


def grid(values_n: Sequence[int], values_d: Sequence[int], values_v: Sequence[int]) -> List[Shape]:
    return [(n, d, v) for n in values_n for d in values_d for v in values_v]


def fit_exact(counts: Dict[Shape, Counts], features: Features = multilinear) -> Fit:
    """Fit every (group, quantity) seen at the shapes (absent = 0) in the basis `features`;
    the fit is exact when it reproduces every fit shape (checked: `Fit.checks`)."""
    shapes = list(counts)
    terms = list(features(shapes[0]))
    a = [[features(s)[t] for t in terms] for s in shapes]
    keys = sorted({(g, q) for c in counts.values() for g, qs in c.items() for q in qs})
    b = [[Fraction(counts[s].get(g, {}).get(q, 0)) for g, q in keys] for s in shapes]
    x = _solve_least_squares(a, b)
    coefs: Dict[str, Dict[str, List[Fraction]]] = {}
    for j, (g, q) in enumerate(keys):
        coefs.setdefault(g, {})[q] = [x[i][j] for i in range(len(terms))]
    fit = Fit(features, terms, coefs, shapes)
    fit.fit_exact = all(fit.check(s, counts[s])["exact"] for s in shapes)
    fit.checks.clear()
    return fit


def residue_values(target: int, modulus: int, base: int = 1) -> Tuple[int, int]:
    """The two smallest sizes >= base congruent to `target` mod `modulus`."""
    first = target % modulus or modulus
    while first < base:
        first += modulus
    return first, first + modulus


# ----------------------------------------------------------------------------- time model


def _flop_seconds(q: Dict[str, int], hw: Hardware) -> float:
    t = 0.0
    for k, v in q.items():
        if k.startswith("flops:"):
            dt = k.split(":", 1)[1]
            t += v / hw.peaks.get(dt, _FP32)
    return t


def group_bytes(q: Dict[str, int], hw: Hardware, torch_group: bool = False) -> Tuple[float, str]:
    """(HBM bytes, why) of one group under BYTES_RULE."""
    if torch_group:
        return float(q["loaded"] + q["stored"]), "op in/out"
    programs = max(1, q.get("programs", 0))
    resident = min(programs / max(1, q.get("launches", 1)), hw.sms)  # programs of one launch in flight
    compulsory = reread = footprint = 0.0
    for a in sorted({k.split(":")[1] for k in q if k.startswith("arg:")}):
        g = lambda f: q.get(f"arg:{a}:{f}", 0)  # noqa: E731
        comp = g("distinct_loaded") + g("distinct_stored")
        private = g("program_distinct") == g("distinct")  # no two programs touch the same bytes
        if private and g("loaded") + g("stored") > comp:
            reread += g("loaded") + g("stored") - comp
            footprint += resident * g("distinct") / programs
        compulsory += comp
    if footprint > hw.l2_bytes:
        return compulsory + reread, f"private re-reads, live {footprint / MB:.0f} MB > L2"
    return compulsory, "compulsory" + (f" (private re-reads, live {footprint / MB:.0f} MB, fit L2)" if footprint else "")


def gemm_l2_bytes(q: Dict[str, int]) -> float:
    """L2 operand bytes of a PyTorch GEMM group at cuBLAS's tile intensity (GEMM_TILE_INTENSITY)."""
    return sum(v / GEMM_TILE_INTENSITY.get(k.split(":", 1)[1].split(">")[0], 32.0)
               for k, v in q.items() if k.startswith("flops:"))  # fmt: skip


def group_l2_smem(q: Dict[str, int], torch_group: bool) -> Tuple[float, float]:
    """(L2 bytes, shared-memory bytes) of one group under L2_RULE."""
    moved = float(q.get("loaded", 0) + q.get("stored", 0))
    if not torch_group:
        return moved, float(q.get("smem", 0))
    operands = gemm_l2_bytes(q)
    return max(moved, operands), 2 * operands


@dataclass
class GroupTime:
    group: str
    launches: int
    programs: int
    loaded: int
    stored: int
    hbm_bytes: float
    flops: Dict[str, int]
    flop_s: float
    byte_s: float
    bytes_why: str
    l2_bytes: float = 0.0
    l2_s: float = 0.0
    smem_bytes: float = 0.0
    smem_s: float = 0.0

    @property
    def seconds(self) -> float:
        return max(self.flop_s, self.byte_s, self.l2_s, self.smem_s)

    @property
    def dominant(self) -> str:
        times = {"FLOPs": self.flop_s, "bytes": self.byte_s, "L2": self.l2_s, "smem": self.smem_s}
        return max(times, key=lambda k: times[k])  # ties: the first (FLOPs)

    def as_dict(self) -> Dict:
        return {"group": self.group, "launches": self.launches, "programs": self.programs, "loaded": self.loaded,
                "stored": self.stored, "hbm_bytes": self.hbm_bytes, "flops": self.flops,
                "flop_ms": self.flop_s * 1e3, "byte_ms": self.byte_s * 1e3, "ms": self.seconds * 1e3,
                "dominant": self.dominant, "bytes_rule": self.bytes_why, "l2_bytes": self.l2_bytes,
                "l2_ms": self.l2_s * 1e3, "smem_bytes": self.smem_bytes, "smem_ms": self.smem_s * 1e3}


def model_times(counts: Counts, hw: Hardware) -> List[GroupTime]:
    out = []
    for g, q in counts.items():
        torch_group = g.startswith("torch/")
        hbm, why = group_bytes(q, hw, torch_group)
        l2, smem = group_l2_smem(q, torch_group)
        flops = {k.split(":", 1)[1]: v for k, v in q.items() if k.startswith("flops:") and v}
        out.append(GroupTime(g, int(q.get("launches", 0)), int(q.get("programs", 0)), int(q.get("loaded", 0)),
                             int(q.get("stored", 0)), hbm, flops, _flop_seconds(q, hw), hbm / hw.hbm_bytes_per_s,
                             why, l2, l2 / hw.l2_bytes_per_s if hw.l2_bytes_per_s else 0.0, smem,
                             smem / hw.smem_bytes_per_s if hw.smem_bytes_per_s else 0.0))  # fmt: skip
    return out


def gemm_floor_s(shape: Shape, gemms: int, hw: Hardware) -> float:
    n, d, v = shape
    return gemms * 2 * n * d * v / hw.peaks["bf16"]
