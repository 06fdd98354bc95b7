"""`python -m bench tune --device cuda`: the fastest tiles of linear_token_logprobs on this GPU.

For each (dtype, D, V) asked for, the candidate tiles of the GPU's architecture (`candidates`:
the default first, then variations of the logit and product tiles) that pass the compile
check of erpo_kernels.tiles (bench/aot.py: shared memory within the per-block limit, no
spills, dots on the tensor cores) are timed, forward + backward at a fixed timing batch, and
the fastest is recorded in the tuning file the op reads (erpo_kernels.tuning). Where the
tiles have a products engine (Tiles.gemm_engine: 0 our Triton product kernel, 1 cuBLAS via
torch matmuls), erpo_loss's fused path, whose products it picks, is then timed forward +
backward with the fastest tiles on each engine, and the faster engine is what is recorded
(the entry's "engine" and "engine_ms" say which and by how much). The key is
(GPU, op, dtype, D, V): the batch size N is only how the timing is done, never part of what
is chosen, so a row's results stay independent of the batch. Without a tuning file (or
without an entry for a shape) the defaults of erpo_kernels.default_tiles apply.

    python -m bench tune --device cuda                                   # Qwen2.5-1.5B/7B heads, bf16
    python -m bench tune --device cuda --shapes 4096x151936 --dtypes bf16,fp16 --budget-s 300
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

DEFAULT_SHAPES: Tuple[Tuple[int, int], ...] = ((1536, 151936), (3584, 152064), (4096, 151936))  # (D, V)
TIMING_ROWS = 4096  # the batch the candidates are timed at (not part of the key)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def candidates(capability: Tuple[int, int], dtype: torch.dtype):
    """Tiles to try on an architecture: its default first, then other logit and product tiles
    (each a whole Tiles: the forward and the backward's recompute always share the logit tiles)."""
    from erpo_kernels import default_tiles

    base = default_tiles("linear_token_logprobs", dtype, capability)
    if dtype == torch.float32:
        variants = [dict(block_n=128), dict(block_v=128, split_tiles=16), dict(gemm_k=32)]
    elif capability in ((9, 0), (10, 0)):
        variants = [dict(num_stages=4), dict(block_n=256, block_v=128, split_tiles=32),
                    dict(gemm_n=256, gemm_d=128), dict(block_d=32, num_stages=4), dict(gemm_stages=4)]
    else:
        variants = [dict(block_n=128), dict(num_stages=2, block_d=64), dict(gemm_k=64, gemm_stages=2),
                    dict(num_warps=4)]
    out = [base]
    for v in variants:
        t = replace(base, **v)
        if t not in out:
            out.append(t)
    return out


def passing(capability: Tuple[int, int], dtype: torch.dtype, tiles: Sequence, check: Optional[Callable] = None):
    """The tiles whose kernels pass the compile check for this architecture (bench.aot), in order;
    an architecture the check does not know keeps them all (a failing launch is skipped when timed)."""
    from erpo_kernels.tiles import ARCHITECTURES

    if tuple(capability) not in ARCHITECTURES:
        return list(tiles)
    check = check or _compile_ok
    return [t for t in tiles if check(capability, dtype, t)]


def _compile_ok(capability: Tuple[int, int], dtype: torch.dtype, tiles) -> bool:
    from . import aot

    arch = capability[0] * 10 + capability[1]
    name = next(k for k, v in _DTYPES.items() if v == dtype)
    key = f"linear_token_logprobs|{arch}|{name}"
    todo = aot.jobs([arch], ["linear_token_logprobs"], [name], {("linear_token_logprobs", arch, name): tiles})
    try:
        rows = aot.compile_all(todo, tiles_json=json.dumps({key: asdict(tiles)}))
    except Exception as exc:  # noqa: BLE001 (this Triton cannot compile ahead of time): the launch decides
        print(f"  compile check unavailable ({type(exc).__name__}): timing {tiles} unchecked")
        return True
    return not any(r["problems"] for r in rows)


def _median_ms(step: Callable[[], None], leaves, repeats: int) -> float:
    """Median ms of `step()` on the GPU over `repeats` calls after one untimed call (the
    compile); the gradients of `leaves` are cleared after each call."""
    times = []
    for i in range(repeats + 1):  # the first call compiles
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        if i:
            times.append(start.elapsed_time(end))
        for t in leaves:
            t.grad = None
    return sorted(times)[len(times) // 2]


def time_tiles(tiles, dtype: torch.dtype, d: int, v: int, n: int = TIMING_ROWS, repeats: int = 5) -> float:
    """Median ms of one forward + backward of linear_token_logprobs at these tiles on the GPU."""
    from erpo_kernels import linear_token_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
    weight = (torch.randn(v, d, device="cuda", dtype=dtype, generator=g) / d ** 0.5).requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)

    def step() -> None:
        linear_token_logprobs(hidden, weight, targets, tiles=tiles, validate=False).sum().backward()

    return _median_ms(step, (hidden, weight), repeats)


ENGINES = {0: "triton", 1: "cublas"}  # Tiles.gemm_engine: who runs erpo_loss's fused-path products


def has_engine() -> bool:
    """This erpo_kernels' Tiles choose the products engine (Tiles.gemm_engine)."""
    from dataclasses import fields

    from erpo_kernels import Tiles

    return "gemm_engine" in {f.name for f in fields(Tiles)}


def time_fused(tiles, dtype: torch.dtype, d: int, v: int, n: int = TIMING_ROWS, repeats: int = 5) -> float:
    """Median ms of one forward + backward of erpo_loss (vanilla erpo with the Query-KL, the
    cost model's batch layout: bench.cost_losses.LAYOUT) at these tiles on the GPU: its
    default fused path, where Tiles.gemm_engine runs the products."""
    from erpo_kernels import LossConfig, erpo_loss

    from .cost_losses import LAYOUT, loss_batch

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
    weight = (torch.randn(v, d, device="cuda", dtype=dtype, generator=g) / d ** 0.5).requires_grad_()
    batch = loss_batch(n, LAYOUT, v).to("cuda")

    def step() -> None:
        erpo_loss(hidden, weight, batch, LossConfig(), tiles=tiles, sync_metrics=False)[0].backward()

    return _median_ms(step, (hidden, weight), repeats)


def choose_engine(tiles, dtype: torch.dtype, d: int, v: int, timer: Callable = time_fused,
                  log=print) -> Tuple[object, Dict[str, float]]:
    """(tiles with the faster products engine, ms per engine that ran) at these tiles;
    an engine that fails to run is left out (the tiles' own engine if neither ran)."""
    from dataclasses import replace

    timed: Dict[int, float] = {}
    for engine in ENGINES:
        candidate = replace(tiles, gemm_engine=engine)
        try:
            timed[engine] = timer(candidate, dtype, d, v)
        except Exception as exc:  # noqa: BLE001 (OutOfResources, ...): this engine does not run here
            log(f"  engine {ENGINES[engine]}: failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
            continue
        log(f"  {timed[engine]:8.2f} ms  erpo_loss fwd+bwd, products on {ENGINES[engine]}")
    if not timed:
        return tiles, {}
    best = min(timed, key=lambda e: timed[e])
    return replace(tiles, gemm_engine=best), {ENGINES[e]: ms for e, ms in timed.items()}


def tune_one(gpu: str, capability: Tuple[int, int], dtype: torch.dtype, d: int, v: int, deadline: float,
             log=print, timer: Callable = time_tiles, check: Optional[Callable] = None,
             engine_timer: Optional[Callable] = time_fused) -> Optional[Dict]:
    """The tuning entry of the fastest candidate that ran (None if none did before the deadline),
    with the faster products engine for erpo_loss's fused path where the tiles have one
    (engine_timer None: the candidates' own engine)."""
    from erpo_kernels.tuning import dtype_name

    timed: List[Tuple[float, object]] = []
    for tiles in passing(capability, dtype, candidates(capability, dtype), check):
        if time.monotonic() > deadline and timed:
            log("  budget spent: the remaining candidates are not timed")
            break
        try:
            ms = timer(tiles, dtype, d, v)
        except Exception as exc:  # noqa: BLE001 (OutOfResources, ...): this candidate does not run here
            log(f"  {tiles}: failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
            continue
        log(f"  {ms:8.2f} ms  {tiles}")
        timed.append((ms, tiles))
    if not timed:
        return None
    ms, best = min(timed, key=lambda x: x[0])
    entry = {"gpu": gpu, "capability": list(capability), "op": "linear_token_logprobs", "dtype": dtype_name(dtype),
             "D": d, "V": v, "tiles": asdict(best), "ms": ms, "timing_rows": TIMING_ROWS,
             "timed": [{"ms": m, "tiles": asdict(t)} for m, t in timed], "triton": _triton_version()}
    if engine_timer is not None and has_engine():
        best, engine_ms = choose_engine(best, dtype, d, v, engine_timer, log)
        if engine_ms:
            entry.update(tiles=asdict(best), engine=ENGINES[best.gemm_engine], engine_ms=engine_ms,
                         engine_timed=f"erpo_loss fwd+bwd (its fused path) at N={TIMING_ROWS}")
    return entry


def _triton_version() -> str:
    import triton

    return getattr(triton, "__version__", "?")


def write_entries(entries: List[Dict], path: Optional[Path] = None) -> Path:
    """Merge `entries` into the tuning file (same keys replaced), written atomically."""
    from erpo.atomic import atomic_write
    from erpo_kernels import tuning

    path = Path(path or tuning.tuning_path())
    old = json.loads(path.read_text()) if path.exists() else None
    data = tuning.merged(old, entries)
    tuning.parse(data)  # what is written can be read back
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(str(path), (json.dumps(data, indent=1) + "\n").encode())
    tuning.clear_cache()
    return path


def run(shapes: Sequence[Tuple[int, int]], dtypes: Sequence[str], budget_s: float, out: Optional[str],
        log=print) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("erpo: error: bench tune times the kernels on a GPU and found no CUDA device; "
                         "run it on the GPU machine (bench/gpu_check.sh does, first)")
    gpu, cap = torch.cuda.get_device_name(0), tuple(torch.cuda.get_device_capability(0))
    deadline = time.monotonic() + budget_s
    entries = []
    for name in dtypes:
        for d, v in shapes:
            if time.monotonic() > deadline:
                log(f"budget spent: {name} D={d} V={v} and what follows keep the default tiles")
                break
            log(f"{gpu} (sm_{cap[0]}{cap[1]}) {name} D={d} V={v}, fwd+bwd at N={TIMING_ROWS}:")
            entry = tune_one(gpu, cap, _DTYPES[name], d, v, deadline, log)
            if entry is not None:
                entries.append(entry)
                path = write_entries([entry], Path(out) if out else None)  # saved as it goes
                engine = f", products on {entry['engine']}" if entry.get("engine") else ""
                log(f"  fastest {entry['ms']:.2f} ms{engine} -> {path}")
    return 0 if entries else 1
