"""What the compiler makes of each kernel for each GPU, without a GPU.

Triton compiles for any NVIDIA architecture on a CPU machine. `compile_kernel` builds a
kernel as the JIT specializes a contiguous launch at a real shape (16-byte aligned
pointers and multiples of 16 marked divisible, unit strides constant); `facts` reads
what the compiler made: the block's dynamic shared memory (`metadata.shared`), registers,
the stack frame and local memory from `cuobjdump -res-usage` of the cubin Triton built
with its own ptxas flags (register spills land in the stack frame: STACK > 0 is a spill,
what `ptxas -v` reports as spill stores; LOCAL counts other local memory), the
tensor-core, TMA, TF32 and FMA instructions in the PTX (a tensor-core instruction by the
SASS family ptxas lowers it to: its only lowering, so the same family nvdisasm lists in the
SASS, checked on all 276 default kernels; a disassembly cost ~0.35 CPU-s a kernel), and the
CTAs that fit on one SM.
`kernel_variants(op, dtype, tiles)` lists every kernel of an op at some tiles in the
constexpr variants that change its code, and `problems(...)` says what breaks the rules
of erpo_kernels.tiles (shared memory over the architecture's per-block limit, any stack
frame or local memory, dots off the tensor cores, TF32 in an fp32 kernel).

    python -m bench aot                                  # every kernel of both ops, default tiles, six GPUs
    python -m bench aot --archs 90,100 --json out.json   # the facts as JSON

Run without TRITON_INTERPRET (a compiling process). Compiles go to a fresh Triton cache
in a temporary folder, so an earlier run's kernels can never stand in for this one's, and
without line info (TRITON_DISABLE_LINE_INFO=1 unless set: debug metadata, which changes no
fact of the default kernels).
"""
from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ARCH_NAMES = {80: "A100", 86: "A10/A40/RTX 30xx", 89: "L4/L40S/RTX 40xx", 90: "H100/H200", 100: "B200",
              120: "RTX 50xx"}
# Per SM: shared memory (bytes, including the 1 KB per block the driver reserves), 32-bit
# registers, resident threads and blocks (CUDA programming guide, compute capabilities table).
SM_LIMITS = {80: (167_936, 65_536, 2048, 32), 86: (102_400, 65_536, 1536, 16), 89: (102_400, 65_536, 1536, 24),
             90: (233_472, 65_536, 2048, 32), 100: (233_472, 65_536, 2048, 32), 120: (102_400, 65_536, 1536, 32)}
DTYPES = ("bf16", "fp16", "fp32")
OPS = ("linear_token_logprobs", "token_logprobs")
# The kernels the ops' variants compile (kernel_variants; tests/test_tiles.py checks the list)
KERNELS = ("_ltl_fwd_kernel", "_fused_dr_kernel", "_ltl_bwd_dr_kernel", "_ltl_bwd_gemm_kernel", "_ltl_merge_kernel",
           "_token_logprobs_fwd_kernel", "_token_logprobs_bwd_kernel")

# Arguments the JIT marks divisible by 16 at N x 4096 x 151,936 on contiguous operands.
_DIVISIBLE = [a + "_ptr" for a in ("h", "w", "b", "dr", "dw", "db", "dh", "acc", "db_part", "targets", "inv_t",
              "order", "shift", "log_l", "entropy", "g_logp", "g_entropy", "max", "sum", "target_logit", "kept",
              "logits", "grad", "logp", "row_max", "log_norm")]  # fmt: skip
_DIVISIBLE += ["D", "V", "stride_hn", "stride_wv", "stride_dr", "v0", "chunk_cols", "v_per_split", "vocab",
               "stride_row", "stride_grad_row", "n_rows"]  # fmt: skip
_UNIT = dict(stride_hd=1, stride_wd=1, stride_b=1)
_SCALARS = dict(softcap="fp32", softcap_pre="fp32", logit_scale="fp32", stride_row="i64", ignore_index="i32")


@dataclass
class Variant:
    """One kernel specialization: its name, the @triton.jit function, argument types and constexprs."""

    name: str
    fn: Any
    types: Dict[str, str]
    consts: Dict[str, Any]
    num_warps: int
    num_stages: int
    tensor_dots: bool  # its dots must be on tensor cores (bf16 / fp16); fp32: IEEE FMA, no TF32
    has_dots: bool = True


@dataclass
class Facts:
    op: str
    kernel: str
    variant: str
    dtype: str
    arch: int
    shared: int
    registers: int
    stack: int  # the stack frame: register spills (Triton's kernels keep no arrays there)
    local: int
    threads: int
    ctas_per_sm: int
    tensor_core: List[str]
    tma: bool
    tf32: bool
    ffma: bool  # fma.rn.f32 in the PTX (an fp32 dot on FMA; each an FFMA in the SASS)
    tensor_dots: bool
    has_dots: bool
    problems: List[str] = field(default_factory=list)
    seconds: float = 0.0  # compile + cuobjdump time


def _module(name: str):
    return importlib.import_module(f"erpo_kernels.{name}")  # the module (the package exports the function)


def _types(dtype: str) -> Dict[str, str]:
    t = {p: "*" + dtype for p in ("h_ptr", "w_ptr", "b_ptr", "dr_ptr", "dw_ptr", "db_ptr", "dh_ptr", "logits_ptr",
                                  "grad_ptr")}  # fmt: skip
    t.update(targets_ptr="*i64", order_ptr="*i64", n_valid_ptr="*i64", support_ptr="*i32", **_SCALARS)
    return t


def _with_support(types: Dict[str, str], kind: int) -> Dict[str, str]:
    """`types` for a variant whose SUPPORT is `kind`, as launched: a threshold through an fp32
    pointer (the bitmask's and the stand-in's: int32, _types)."""
    return dict(types, support_ptr="*fp32") if kind == _module("support").THRESHOLD else types


def _support_flag(on: bool) -> int:
    """The kernels' SUPPORT flag of a variant: the bitmask (its word loads) with the options on, else none."""
    support = _module("support")
    return support.BITMASK if on else support.NO_SUPPORT


def _threshold_flag(on: bool) -> int:
    """The SUPPORT flag of a threshold support with the options on, else none."""
    support = _module("support")
    return support.THRESHOLD if on else support.NO_SUPPORT


def _linear_variants(dtype: str, tiles) -> List[Variant]:
    """The forward and recompute kernels with every optional feature (bias, soft cap, entropy, a support: the
    forward's threshold, the kept-logit forward's bitmask, the recompute's bitmask and threshold; a threshold
    read through an fp32 pointer, as launched) and with none (the union of the
    code and the plain call), the product kernel (one specialization: its chunk position is a runtime value)
    and the merge."""
    m = _module("linear_token_logprobs")
    fused = _module("fused_linear_loss")
    types = _types(dtype)
    lowp = dtype != "fp32"
    flags = dict(IEEE=not lowp, UPCAST=False)
    # erpo_loss's kept logits: fp16 s - m (and fp32 per-part maxima) for bf16 / fp16, fp32 s for fp32
    kept_types = dict(types, kept_ptr="*fp16") if lowp else types
    keep = m.KEEP_FP16 if lowp else m.KEEP_FP32
    kept_tiles = tiles.kept_forward()  # the kept-logit forward's own logit width (Tiles.kept_block_v)
    out = []
    for on in (True, False):
        base = dict(flags, BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v, BLOCK_D=tiles.block_d, HAS_BIAS=on,
                    HAS_SOFTCAP=on, SUPPORT=_support_flag(False))  # fmt: skip
        tag = "bias+softcap+entropy" if on else "plain"
        # the op's forward (with the options on, a threshold support too)
        out.append(Variant(f"threshold+{tag}" if on else tag, m._ltl_fwd_kernel,
                           _with_support(types, _threshold_flag(on)),
                           dict(base, WANT_ENTROPY=on, KEEP_LOGITS=m.KEEP_NONE, SUPPORT=_threshold_flag(on)),
                           tiles.num_warps, tiles.num_stages, lowp))  # fmt: skip
        # erpo_loss's fused path: the forward that also stores the logits it kept (with the options on,
        # a bitmask support too)
        out.append(Variant(f"kept+support+{tag}" if on else f"kept+{tag}", m._ltl_fwd_kernel, kept_types,
                           dict(base, BLOCK_V=kept_tiles.block_v, WANT_ENTROPY=on, KEEP_LOGITS=keep,
                                SUPPORT=_support_flag(on)),
                           tiles.num_warps, tiles.num_stages, lowp))  # fmt: skip
        # erpo_loss's fused path: the softmax gradient from the kept logits (no dot)
        out.append(Variant(f"{tag}", fused._fused_dr_kernel, kept_types,
                           dict(HAS_SOFTCAP=on, HAS_ENTROPY_GRAD=on, WANT_DB=on, ZERO_PAD=on, UPCAST=False,
                                KEPT_FP16=lowp, PART=m.logit_part(kept_tiles.block_v), BLOCK_N=tiles.block_n,
                                BLOCK_V=fused.dr_block_v(kept_tiles)),
                           fused.DR_WARPS, tiles.num_stages, False, has_dots=False))  # fmt: skip
        dr = dict(base, HAS_ENTROPY_GRAD=on, WANT_DB=on, ZERO_PAD=on)
        out.append(Variant(f"{tag}", m._ltl_bwd_dr_kernel, types, dr, tiles.num_warps, tiles.num_stages, lowp))
        if on:  # the recompute under a bitmask support, and under a threshold
            out.append(Variant(f"support+{tag}", m._ltl_bwd_dr_kernel, types, dict(dr, SUPPORT=_support_flag(True)),
                               tiles.num_warps, tiles.num_stages, lowp))  # fmt: skip
            out.append(Variant(f"threshold+{tag}", m._ltl_bwd_dr_kernel, _with_support(types, _threshold_flag(True)),
                               dict(dr, SUPPORT=_threshold_flag(True)), tiles.num_warps, tiles.num_stages, lowp))
    gemm = dict(flags, GEMM_N=tiles.gemm_n, GEMM_V=tiles.gemm_v, GEMM_D=tiles.gemm_d, GEMM_K=tiles.gemm_k)
    out.append(Variant("products", m._ltl_bwd_gemm_kernel, types, gemm, tiles.gemm_warps, tiles.gemm_stages, lowp))
    if dtype == "bf16":  # the merge reads fp32 statistics only: one specialization serves every dtype
        out.append(Variant("entropy", m._ltl_merge_kernel, types, dict(WANT_ENTROPY=True, BLOCK=m.MERGE_BLOCK), 4, 3,
                           False, has_dots=False))
    return out


def _every_option(dtype: str, tiles, listed: List[Variant]) -> List[Variant]:
    """The op's forward, the kept-logit forward and the recompute in every combination of
    bias, soft cap, entropy (the forward's, the recompute's gradient) and support (none,
    threshold, bitmask) not already in `listed`: 24 each, the recompute zeroing padded rows
    as the tiles' products engine has it launched. bench aot's default list compiles
    each with every option on and with none; a combination between can spill where neither
    does (at 128 x 256 on sm_90, 19 of the kept-logit forward's 24 did)."""
    import itertools

    support = _module("support")
    bases = [(v, v.fn.__name__ == "_ltl_fwd_kernel") for v in listed
             if v.name in ("plain", "kept+plain") and v.fn.__name__ in ("_ltl_fwd_kernel", "_ltl_bwd_dr_kernel")]
    seen = {(v.fn.__name__, tuple(sorted(v.consts.items()))) for v in listed}
    out = []
    for base, forward in bases:
        for bias, cap, ent, kind in itertools.product((False, True), (False, True), (False, True),
                                                       (support.NO_SUPPORT, support.THRESHOLD, support.BITMASK)):
            consts = dict(base.consts, HAS_BIAS=bias, HAS_SOFTCAP=cap, SUPPORT=kind)
            if forward:
                consts.update(WANT_ENTROPY=ent)
            else:  # ZERO_PAD as the tiles' products engine launches it (the torch products: 1)
                consts.update(HAS_ENTROPY_GRAD=ent, WANT_DB=bias, ZERO_PAD=tiles.gemm_engine == 1)
            key = (base.fn.__name__, tuple(sorted(consts.items())))
            if key in seen:
                continue
            seen.add(key)
            tag = "+".join(n for n, on in (("bias", bias), ("softcap", cap), ("entropy", ent)) if on) or "none"
            where = {support.THRESHOLD: "threshold+", support.BITMASK: "support+"}.get(kind, "")
            name = f"each:{'kept+' if base.name.startswith('kept') else ''}{where}{tag}"
            out.append(Variant(name, base.fn, _with_support(base.types, kind), consts, base.num_warps, base.num_stages,
                               base.tensor_dots))  # fmt: skip
    return out


def _token_variants(dtype: str, tiles) -> List[Variant]:
    """The row kernels with every option (entropy, soft cap, a bitmask support; both upstream gradients) and with
    none."""
    m = _module("token_logprobs")
    types = _types(dtype)
    out = []
    fwd_block, fwd_warps = m._launch_config(1 << 30, tiles.fwd_max_block_v, tiles.fwd_values_per_thread)
    bwd_block, bwd_warps = m._launch_config(1 << 30, tiles.bwd_max_block_v, tiles.bwd_values_per_thread)
    for on in (True, False):
        tag = "entropy+softcap" if on else "plain"
        out.append(Variant(tag, m._token_logprobs_fwd_kernel, types,
                           dict(RETURN_ENTROPY=on, HAS_SOFTCAP=on, SUPPORT=_support_flag(on),
                                BLOCK_V=fwd_block), fwd_warps, 3, False,
                           has_dots=False))  # fmt: skip
        out.append(Variant(tag, m._token_logprobs_bwd_kernel, types,
                           dict(HAS_LOGP_GRAD=True, HAS_ENTROPY_GRAD=on, HAS_SOFTCAP=on, INTERPRET=False,
                                SUPPORT=_support_flag(on), BLOCK_V=bwd_block), bwd_warps, 3, False,
                           has_dots=False))  # fmt: skip
    return out


def kernel_variants(op: str, dtype: str, tiles, every: bool = False) -> List[Variant]:
    """The variants compiled for an op; every=True adds `_every_option`'s combinations (the linear op)."""
    if op != "linear_token_logprobs":
        return _token_variants(dtype, tiles)
    out = _linear_variants(dtype, tiles)
    return out + _every_option(dtype, tiles, out) if every else out


def compile_kernel(v: Variant, arch: int):
    """triton.compile of one variant for sm_<arch>, specialized as the JIT specializes a contiguous launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = v.fn
    consts = dict(v.consts, **{k: x for k, x in _UNIT.items() if k in fn.arg_names})
    sig = {a: "constexpr" if a in consts else v.types.get(a, "*fp32" if a.endswith("_ptr") else "i32")
           for a in fn.arg_names}  # fmt: skip
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in _DIVISIBLE
             if a in fn.arg_names and a not in consts}  # fmt: skip
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): x for k, x in consts.items()},
                    attrs=attrs)  # fmt: skip
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": v.num_warps, "num_stages": v.num_stages})  # fmt: skip


def _cuobjdump() -> str:
    """The path of the cuobjdump Triton ships beside its ptxas."""
    from triton.backends.nvidia.compiler import get_ptxas

    return str(Path(get_ptxas(90).path).parent / "cuobjdump")


def ctas_per_sm(arch: int, shared: int, registers: int, threads: int) -> int:
    """Blocks of this kernel resident on one SM: the least of what shared memory, registers
    (allocated per warp in units of 256), threads and the block limit allow."""
    smem, regs, max_threads, max_blocks = SM_LIMITS[arch]
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = regs // (per_warp * (threads // 32))
    by_smem = smem // (shared + 1024) if shared else max_blocks
    return max(0, min(by_regs, by_smem, max_threads // threads, max_blocks))


# The SASS family ptxas lowers each tensor-core PTX instruction to (its only lowering: nvdisasm
# of all 276 default kernels listed the same family for each), by the instruction and its operand
# types; one named nowhere here stays its PTX name, which no architecture's rule accepts.
_TENSOR_CORE_OF_PTX = ((r"mma\.sync\.\S*\.(?:bf16|f16|tf32)\.", "HMMA"), (r"mma\.sync\.\S*\.[su]8\.", "IMMA"),
                       (r"wgmma\.mma_async\.\S*\.(?:bf16|f16|tf32)$", "HGMMA"),
                       (r"tcgen05\.mma\.\S*kind::(?:f16|tf32)$", "UTCHMMA"),
                       (r"tcgen05\.mma\.\S*kind::f8f6f4$", "UTCQMMA"))  # fmt: skip
_PTX_TMA = "cp.async.bulk.tensor"  # a TMA copy (UTMALDG in the SASS)


def tensor_core_of_ptx(ptx: str) -> List[str]:
    """The SASS families of the tensor-core instructions in `ptx` (sorted, each once):
    mma.sync on 16-bit floats -> HMMA, wgmma -> HGMMA, tcgen05.mma kind::f16 -> UTCHMMA, ...;
    an instruction of another kind as its PTX name."""
    out = set()
    for ins in re.findall(r"\b((?:mma\.sync|wgmma\.mma_async|tcgen05\.mma)[\w.:]*)", ptx):
        out.add(next((sass for pattern, sass in _TENSOR_CORE_OF_PTX if re.match(pattern, ins)), ins))
    return sorted(out)


def facts(op: str, dtype: str, v: Variant, arch: int, limit: int, want: str) -> Facts:
    """Compile `v` for sm_<arch> and read its facts (its resources from the cubin, its
    instructions from the PTX)."""
    start = time.time()
    k = compile_kernel(v, arch)
    ptx = k.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(k.asm["cubin"])
        res = subprocess.run([_cuobjdump(), "-res-usage", str(path)], capture_output=True, text=True, check=True)
    tensor_core, tma, ffma = tensor_core_of_ptx(ptx), _PTX_TMA in ptx, bool(re.search(r"\bfma\.rn\.f32\b", ptx))
    usage = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", res.stdout))
    threads = 32 * v.num_warps
    f = Facts(op, v.fn.__name__, v.name, dtype, arch, int(k.metadata.shared), int(usage.get("REG", 0)),
              int(usage["STACK"]), int(usage.get("LOCAL", 0)), threads, 0, tensor_core, tma, ".tf32" in ptx, ffma,
              v.tensor_dots, v.has_dots)  # fmt: skip
    f.ctas_per_sm = ctas_per_sm(arch, f.shared, f.registers, threads)
    f.seconds = round(time.time() - start, 2)
    f.problems = problems(f, limit, want)
    return f


def problems(f: Facts, limit: int, want: str) -> List[str]:
    """What breaks the rules: shared memory over `limit`, spills, dots off `want`, TF32."""
    out = []
    if f.shared > limit:
        out.append(f"shared memory {f.shared} B > {limit} B per block")
    if f.stack:
        out.append(f"{f.stack} B of stack frame (register spills)")
    if f.local:
        out.append(f"{f.local} B of local memory")
    if f.has_dots and f.tensor_dots and want not in f.tensor_core:
        out.append(f"dots not on {want} (found {f.tensor_core or 'none'})")
    if f.has_dots and not f.tensor_dots and f.tf32:
        out.append("fp32 dot on TF32")
    if not f.has_dots and f.tensor_core:
        out.append(f"tensor-core instructions ({', '.join(f.tensor_core)}) in a kernel listed without dots")
    if f.ctas_per_sm < 1:
        out.append("no CTA fits on an SM")
    return out


def jobs(archs: Sequence[int], ops: Sequence[str], dtypes: Sequence[str],
         tiles: Optional[Dict[Tuple[str, int, str], Any]] = None, every: bool = False) -> List[Tuple[str, str, int, int]]:
    """(op, dtype, arch, variant index) of every compile; `tiles` overrides default_tiles per (op, arch, dtype);
    every: kernel_variants' option combinations too."""
    out = []
    for op in ops:
        for arch in archs:
            for dtype in dtypes:
                n = len(kernel_variants(op, dtype, _tiles(op, arch, dtype, tiles), every))
                out.extend((op, dtype, arch, i) for i in range(n))
    return out


def job_variant(job: Tuple[str, str, int, int], tiles: Optional[Dict[Tuple[str, int, str], Any]] = None,
                every: bool = False) -> Variant:
    """The variant a job of `jobs` (op, dtype, arch, index; with its tiles and `every`) compiles."""
    op, dtype, arch, i = job
    return kernel_variants(op, dtype, _tiles(op, arch, dtype, tiles), every)[i]


def select(todo: Sequence[Tuple[str, str, int, int]], kernels: Sequence[str], prefixes: Sequence[str],
           tiles: Optional[Dict[Tuple[str, int, str], Any]] = None, every: bool = False
           ) -> Tuple[List[Tuple[str, str, int, int]], List[str]]:
    """The jobs of `todo` (`jobs`' output, with its tiles and `every`) whose kernel is one of `kernels` and whose
    variant name starts with one of `prefixes`; and the distinct variant names of those kernels (for an error)."""
    out, names = [], {}
    for job in todo:
        v = job_variant(job, tiles, every)
        if v.fn.__name__ in kernels:
            names[v.name] = None
            if v.name.startswith(tuple(prefixes)):
                out.append(job)
    return out, list(names)


_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _tiles(op: str, arch: int, dtype: str, tiles: Optional[Dict] = None):
    if tiles and (op, arch, dtype) in tiles:
        return tiles[(op, arch, dtype)]
    import torch

    from erpo_kernels.tiles import default_tiles

    return default_tiles(op, getattr(torch, _TORCH_DTYPES[dtype]), (arch // 10, arch % 10))


def run_jobs(todo: Sequence[Tuple[str, str, int, int]], tiles: Optional[Dict] = None,
             every: bool = False) -> List[Facts]:
    from erpo_kernels.tiles import SHARED_MEMORY_PER_BLOCK, TENSOR_CORE_INSTRUCTION

    out = []
    for job in todo:
        op, dtype, arch, _ = job
        cap = (arch // 10, arch % 10)
        v = job_variant(job, tiles, every)
        out.append(facts(op, dtype, v, arch, SHARED_MEMORY_PER_BLOCK[cap], TENSOR_CORE_INSTRUCTION[cap]))
    return out


_RESULT = "bench.aot facts: "  # the prefix of a worker's answer line (anything else on its stdout is ignored)


def compile_all(todo: Sequence[Tuple[str, str, int, int]], workers: Optional[int] = None,
                tiles_json: Optional[str] = None, timeout: float = 3600, every: bool = False) -> List[Dict]:
    """Run the compiles in one pool of `workers` subprocesses (default: the CPU count) for
    every architecture, each with a fresh Triton cache and no TRITON_INTERPRET, handing out
    one job at a time to whichever worker is free (the compiles differ 20-fold in cost);
    the facts as dicts, in `todo` order (`jobs`' indices, with its `every`). A job listed twice is
    compiled once."""
    import selectors

    order = list(dict.fromkeys(tuple(j) for j in todo))  # distinct jobs, first-seen order
    workers = max(1, min(workers or os.cpu_count() or 1, len(order)))
    env = {k: x for k, x in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns unless told; 3.6 (the GPU's) fuses
    # No line info (debug metadata, which the JIT adds): every fact of the 276 default kernels is the
    # same without it, for ~15% less CPU in Triton's passes and ptxas
    env.setdefault("TRITON_DISABLE_LINE_INFO", "1")
    done: Dict[Tuple, Dict] = {}
    deadline = time.time() + timeout
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "tiles.json"
        spec.write_text(json.dumps({"tiles": tiles_json, "every": every}))
        sel = selectors.DefaultSelector()
        procs, pending = [], list(reversed(order))
        try:
            for w in range(workers):
                penv = dict(env, TRITON_CACHE_DIR=str(Path(tmp) / f"cache{w}"))
                err = open(Path(tmp) / f"stderr{w}", "w+")
                p = subprocess.Popen([sys.executable, "-m", f"{__package__}.aot", "--worker", str(spec)], env=penv,
                                     cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                     bufsize=1)  # fmt: skip
                procs.append((p, err))
                sel.register(p.stdout, selectors.EVENT_READ, (p, err, [pending.pop()]))
                p.stdin.write(json.dumps(sel.get_key(p.stdout).data[2][0]) + "\n")
            while len(done) < len(order):
                events = sel.select(timeout=max(1.0, deadline - time.time()))
                if not events or time.time() > deadline:
                    raise RuntimeError(f"bench.aot: {len(order) - len(done)} compiles still running after {timeout} s")
                for key, _ in events:
                    p, err, job = key.data
                    line = ""
                    while not line.startswith(_RESULT):  # its answer follows whatever else it printed
                        line = key.fileobj.readline()
                        if not line:  # the worker ended before answering
                            err.seek(0)
                            raise RuntimeError(f"bench.aot worker failed on {job[0]}:\n{err.read()[-3000:]}")
                    done[job[0]] = json.loads(line[len(_RESULT):])
                    if pending:
                        job[0] = pending.pop()
                        p.stdin.write(json.dumps(job[0]) + "\n")
                    else:
                        sel.unregister(key.fileobj)
                        p.stdin.close()
        finally:
            for p, err in procs:
                if p.stdin and not p.stdin.closed:
                    p.stdin.close()
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                err.close()
    return [done[tuple(j)] for j in todo]


# The variant of each kernel `bench cost` counts (bf16, no bias, no soft cap, no entropy).
COUNTED_VARIANTS = ("plain", "products", "entropy")


def counted_facts(archs: Sequence[int] = (90, 100), workers: Optional[int] = None,
                  ops: Sequence[str] = OPS) -> Dict[str, Dict[str, Dict]]:
    """kernel name -> "sm_<arch>" -> its compile facts at the default bf16 tiles, for the kernels
    of `ops` in the variant bench cost counts: what the per-launch table shows beside the counts."""
    todo = [j for j in jobs(archs, ops, ["bf16"]) if job_variant(j).name in COUNTED_VARIANTS]
    out: Dict[str, Dict[str, Dict]] = {}
    for f in compile_all(todo, workers):
        keep = ("tensor_core", "tma", "registers", "stack", "local", "shared", "ctas_per_sm", "threads", "problems")
        out.setdefault(f["kernel"], {})[f"sm_{f['arch']}"] = {k: f[k] for k in keep}
    return out


def facts_text(f: Dict) -> str:
    """One cell: 'HGMMA, no TMA, 128 regs, 0 B spilled, 144 KB smem, 1 CTA/SM', where
    spilled is the stack frame (register spills) plus local memory; facts recorded before
    the stack frame was read say 'spills not read' (they read local memory only)."""
    tc = ",".join(f["tensor_core"]) or "no tensor core"
    spilled = f"{f['stack'] + f['local']} B spilled" if "stack" in f else "spills not read"
    return (f"{tc}, {'TMA' if f['tma'] else 'no TMA'}, {f['registers']} regs, {spilled}, "
            f"{f['shared'] / 1024:.0f} KB smem, {f['ctas_per_sm']} CTA/SM")


def _tiles_from_json(text: Optional[str]) -> Optional[Dict]:
    """{"op|arch|dtype": {field: value}} -> {(op, arch, dtype): Tiles / RowTiles}."""
    if not text:
        return None
    from erpo_kernels.tiles import RowTiles, Tiles

    out = {}
    for key, fields_ in json.loads(text).items():
        op, arch, dtype = key.split("|")
        out[(op, int(arch), dtype)] = (Tiles if op == "linear_token_logprobs" else RowTiles)(**fields_)
    return out


def _worker(spec_path: str) -> None:
    """A pool worker: one job [op, dtype, arch, variant] per stdin line, one answer line each."""
    spec = json.loads(Path(spec_path).read_text())
    tiles = _tiles_from_json(spec.get("tiles"))
    for line in sys.stdin:
        (f,) = run_jobs([tuple(json.loads(line))], tiles, bool(spec.get("every")))
        print(_RESULT + json.dumps(asdict(f)), flush=True)


def format_table(rows: List[Dict]) -> str:
    lines = ["| op | kernel | variant | dtype | sm | shared B | regs | stack B | local B | CTAs/SM | tensor core | TMA | "
             "problems |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in rows:
        lines.append(f"| {f['op']} | {f['kernel']} | {f['variant']} | {f['dtype']} | {f['arch']} | {f['shared']} | "
                     f"{f['registers']} | {f['stack']} | {f['local']} | {f['ctas_per_sm']} | {','.join(f['tensor_core']) or '-'} | "
                     f"{'yes' if f['tma'] else 'no'} | {'; '.join(f['problems']) or '-'} |")
    return "\n".join(lines)


def _list_of(what: str, choices: Sequence, convert=str):
    """An argparse type: a comma list of `choices` (after `convert`), else a one-line usage error."""
    import argparse

    def parse(text: str) -> list:
        out = []
        for item in (t.strip() for t in text.split(",")):
            try:
                value = convert(item)
            except ValueError:
                value = None
            if value not in choices:
                raise argparse.ArgumentTypeError(f"{item!r} is not {what}; choose from "
                                                 f"{', '.join(str(c) for c in choices)} (comma separated)")
            out.append(value)
        return out

    return parse


def add_arguments(p) -> None:
    """The options of `python -m bench aot` (also `python -m bench.aot`)."""
    import argparse

    archs = ", ".join(f"{a} ({n})" for a, n in ARCH_NAMES.items())
    arch = _list_of("an architecture", tuple(ARCH_NAMES), lambda t: int(t.removeprefix("sm_")))
    p.add_argument("--archs", type=arch, default=list(ARCH_NAMES), help=f"comma list of compute capabilities: {archs} (default: all)")
    p.add_argument("--ops", type=_list_of("an op", OPS), default=list(OPS),
                   help=f"comma list: {', '.join(OPS)} (default: both)")
    p.add_argument("--dtypes", type=_list_of("a dtype", DTYPES), default=list(DTYPES),
                   help=f"comma list: {', '.join(DTYPES)} (default: all)")
    p.add_argument("--workers", type=int, default=None, help="compiling processes (default: the CPU count)")
    p.add_argument("--json", default=None, help="also write the facts here")
    p.add_argument("--tiles", default=None,
                   help='JSON fields replacing the default tiles of every (op, arch, dtype) compiled, e.g. '
                        '\'{"block_n": 128}\' (fields of erpo_kernels.Tiles apply to linear_token_logprobs, of '
                        'RowTiles to token_logprobs)')
    p.add_argument("--every-option", action="store_true",
                   help="also compile the op's forward, the kept-logit forward and the recompute in every "
                        "combination of bias, soft cap, entropy and support (none, threshold, bitmask): 24 each, "
                        "where the default list has each with every option and with none")
    p.add_argument("--kernels", type=_list_of("a kernel", KERNELS), default=None,
                   help=f"comma list of the kernels to compile: {', '.join(KERNELS)} (default: all)")
    p.add_argument("--variants", default=None,
                   help="comma list of variant-name prefixes to compile, e.g. 'kept,each:kept' for erpo_loss's "
                        "kept-logit forward (the table's variant column; default: all)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)


def run(args, parser) -> int:
    """Compile what `args` names, print the table; 1 if any kernel breaks a rule. Bad
    --tiles or --workers: parser.error (one usage line, exit status 2)."""
    if args.worker:
        _worker(args.worker)
        return 0
    if args.workers is not None and args.workers < 1:
        parser.error(f"argument --workers: must be >= 1, got {args.workers}")
    archs, ops, dtypes = args.archs, args.ops, args.dtypes
    tiles_json = None
    if args.tiles:
        from dataclasses import asdict as fields_of, replace

        from dataclasses import fields as fields_of_class

        from erpo_kernels.tiles import RowTiles, Tiles

        try:
            fields_ = json.loads(args.tiles)
            if not isinstance(fields_, dict):
                raise ValueError("not a JSON object")
            # each op takes the fields that are its own (Tiles: the linear op, RowTiles: the row op)
            mine = [op for op in ops if set(fields_) <= {f.name for f in fields_of_class(
                Tiles if op == "linear_token_logprobs" else RowTiles)}]  # fmt: skip
            if not mine:
                raise ValueError(f"{sorted(fields_)} are not all fields of the tiles of {' or '.join(ops)}")
            over = {f"{op}|{a}|{dt}": fields_of(replace(_tiles(op, a, dt), **fields_))
                    for op in mine for a in archs for dt in dtypes}  # fmt: skip
        except (ValueError, TypeError) as exc:
            parser.error(f"argument --tiles: {str(exc).splitlines()[0]}")
        tiles_json = json.dumps(over)
    tiles = _tiles_from_json(tiles_json)
    todo = jobs(archs, ops, dtypes, tiles, args.every_option)
    if args.kernels or args.variants:
        kernels = args.kernels or KERNELS
        prefixes = tuple(t.strip() for t in (args.variants or "").split(",") if t.strip()) or ("",)
        todo, names = select(todo, kernels, prefixes, tiles, args.every_option)
        if not names:
            parser.error(f"argument --kernels: {', '.join(kernels)} is not a kernel of {' or '.join(ops)}")
        if not todo:
            parser.error(f"argument --variants: no variant of {', '.join(kernels)} starts with "
                         f"{' or '.join(map(repr, prefixes))}; the variants: {', '.join(names)}")
    rows = compile_all(todo, args.workers, tiles_json, every=args.every_option)
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if r["problems"]]
    print(f"{len(rows)} kernels compiled, {len(bad)} with problems")
    return 1 if bad else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog=f"python -m {__package__} aot", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv), p)


if __name__ == "__main__":
    sys.exit(main())
