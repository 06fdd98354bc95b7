"""Timing and memory measurement shared by `bench kernels` and `bench step`.

A measurement is a region of code run repeatedly: `prepare()` builds what the region
needs (untimed, e.g. the forward pass before a backward-only measurement) and returns
a state; `region(state)` is the measured code. Speed is the median over `repeats` runs
after `warmup` runs; memory is the peak extra memory of one run of the region:

  cuda: torch.cuda.max_memory_allocated() during the region minus
        torch.cuda.memory_allocated() just before it (the caching allocator's reserve
        is not counted; allocations made by prepare() are in the baseline).
  cpu:  peak resident set size during the region (VmHWM, reset just before it by
        writing 5 to /proc/self/clear_refs) minus the resident set size just before it.
        Each CPU measurement runs in its own subprocess (see `run_worker`); before its
        memory run glibc is told to map every allocation above 64 KiB on its own, so freed
        buffers leave the resident set and cannot hide the peak (`exact_cpu_allocator`).
Order: warm-up runs, timed runs (allocator as configured by default), then the memory run.
"""
from __future__ import annotations

import datetime as _dt
import gc
import importlib
import importlib.metadata
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"  # bench/results in a checkout
# A checkout (bench/ beside setup.py: `python -m bench`) keeps the project's record in
# bench/results and its README; the installed suite (erpo_bench in site-packages) has neither.
IN_CHECKOUT = Path(__file__).resolve().parent.name == "bench" and (REPO / "setup.py").is_file()
PROG = f"python -m {__package__ or 'bench'}"  # how the suite is run: python -m bench, or python -m erpo_bench
# Where a measurement goes unless it is recorded (--record) or sent elsewhere (--out-dir): in a
# checkout bench/results/local (untracked, .gitignore); installed, erpo-bench-results in the
# current directory (never site-packages).
LOCAL_RESULTS_DIR = RESULTS_DIR / "local" if IN_CHECKOUT else Path.cwd() / "erpo-bench-results"
MIB = float(1 << 20)

SPEED_DEFINITION = (
    "median over repeats after warm-up; CUDA events around the region on GPU, "
    "time.perf_counter on CPU"
)
MEMORY_DEFINITION = {
    "cuda": "peak torch.cuda.max_memory_allocated during the region minus torch.cuda.memory_allocated "
    "just before it (MiB)",
    "cpu": "peak resident set size during the region (VmHWM reset just before it) minus the resident set "
    "size just before it, one fresh subprocess per measurement (MiB)",
}

# Packages whose versions every results file records (absent ones are recorded as null).
VERSIONED = (
    "torch",
    "triton",
    "transformers",
    "numpy",
    "liger-kernel",
    "cut-cross-entropy",
    "flash-attn",
    "trl",
    "matplotlib",
)


# ----------------------------------------------------------------------------- environment


def package_version(dist: str) -> Optional[str]:
    """Installed version of a distribution, or None; never imports it."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> Dict[str, Optional[str]]:
    out: Dict[str, Optional[str]] = {"python": platform.python_version()}
    for dist in VERSIONED:
        out[dist] = package_version(dist)
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    try:
        import erpo_kernels

        out["erpo_kernels"] = erpo_kernels.__version__
    except Exception:  # pragma: no cover - the package is part of this repo
        out["erpo_kernels"] = None
    return out


def commit_hash() -> str:
    """The checkout's commit (+ '-dirty' with uncommitted changes); ERPO_BENCH_COMMIT overrides."""
    if os.environ.get("ERPO_BENCH_COMMIT"):
        return os.environ["ERPO_BENCH_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"{cpu_name()} ({os.cpu_count()} logical CPUs, {torch.get_num_threads()} torch threads)"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "unknown"


def machine_name(device: str, override: Optional[str] = None) -> str:
    """Name of the results file: --machine, else ERPO_BENCH_MACHINE, else derived from the device."""
    name = override or os.environ.get("ERPO_BENCH_MACHINE")
    if name:
        return slug(name)
    if device == "cuda":
        return slug(torch.cuda.get_device_name(0))
    model = re.sub(r"\((r|tm)\)|cpu|@.*$|processor", "", cpu_name().lower())
    return "cpu-" + slug(model)


@dataclass
class RunOptions:
    """What every `bench kernels` / `bench step` run takes from the command line."""

    device: str  # "cpu" or "cuda"
    warmup: int
    repeats: int
    out_dir: str = str(RESULTS_DIR)
    machine: Optional[str] = None  # results file name; None: derived from the device
    budget_s: Optional[float] = None  # start no new case after this many seconds
    worker_timeout_s: float = 1800.0  # CPU: limit of one measurement subprocess
    args: Dict[str, Any] = field(default_factory=dict)  # the command line, recorded in the run
    make_report: bool = True  # regenerate the plots at the end (never the README: `bench report` does)

    def __post_init__(self) -> None:
        if self.device not in MEMORY_DEFINITION:
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible")


def run_header(command: str, opts: RunOptions) -> Dict[str, Any]:
    """The metadata every run in a results file carries."""
    return {
        "command": command,
        "machine": machine_name(opts.device, opts.machine),
        "device": opts.device,
        "device_name": device_name(opts.device),
        "host": platform.node(),
        "versions": versions(),
        "commit": commit_hash(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "args": opts.args,
        "definitions": {"speed": SPEED_DEFINITION, "memory": MEMORY_DEFINITION[opts.device]},
    }


# ----------------------------------------------------------------------------- CPU memory


def _status_bytes(key: str) -> int:
    """A size from /proc/self/status (VmRSS, VmHWM), in bytes; without that file, the
    process-lifetime peak RSS (ru_maxrss)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # pragma: no cover


def rss_bytes() -> int:
    return _status_bytes("VmRSS")


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    return _status_bytes("VmHWM")


# ----------------------------------------------------------------------------- the measurement


@dataclass
class Measurement:
    median_ms: Optional[float] = None
    times_ms: List[float] = field(default_factory=list)
    peak_extra_mb: Optional[float] = None
    before_mb: Optional[float] = None
    status: str = "ok"
    error: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "median_ms": self.median_ms,
            "times_ms": [round(t, 4) for t in self.times_ms],
            "peak_extra_mb": self.peak_extra_mb,
            "before_mb": self.before_mb,
            "status": self.status,
            "error": self.error,
            **self.extra,
        }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def measure(
    prepare: Callable[[], Any],
    region: Callable[[Any], Any],
    *,
    device: str,
    warmup: int,
    repeats: int,
) -> Measurement:
    """Warm up, time `repeats` runs of the region, then measure the peak extra memory of one more run.

    `region(state)` may return anything; it is kept alive until the peak is read (so
    outputs and saved-for-backward tensors count) and dropped afterwards. The memory run
    comes last because on CPU it switches the allocator to exact accounting (see
    `exact_cpu_allocator`), which must not slow the timed runs.
    """
    m = Measurement()
    for _ in range(warmup):
        state = prepare()
        out = region(state)
        del state, out
    _sync(device)

    # speed
    for _ in range(repeats):
        state = prepare()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            out = region(state)
            end.record()
            torch.cuda.synchronize()
            m.times_ms.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = region(state)
            m.times_ms.append((time.perf_counter() - t0) * 1e3)
        del state, out
    m.median_ms = round(statistics.median(m.times_ms), 4) if m.times_ms else None
    _free(device)

    # memory: one more run of the region
    if device == "cpu" and not exact_cpu_allocator():
        m.extra["memory_note"] = "glibc mallopt unavailable: freed heap memory may hide part of the peak"
    state = prepare()
    _sync(device)
    gc.collect()
    if device == "cuda":
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = region(state)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        exact = reset_peak_rss()
        before = rss_bytes()
        out = region(state)
        peak = peak_rss_bytes() - before
        if not exact:
            m.extra["memory_note"] = "VmHWM could not be reset: peak is the process-lifetime peak"
    m.before_mb = round(before / MIB, 2)
    m.peak_extra_mb = round(max(peak, 0) / MIB, 2)
    del state, out
    _free(device)
    return m


def exact_cpu_allocator() -> bool:
    """Make the resident set track live CPU tensors exactly (glibc only; False elsewhere).

    glibc keeps freed heap chunks resident and, after the first free of a large block,
    serves blocks up to 32 MiB from that heap: a region reusing such memory would not
    raise the peak RSS. From here on every allocation above 64 KiB is its own mapping
    (mapped when made, returned when freed), and the free heap memory is handed back now.
    Timed runs happen before this, under the allocator's normal behaviour.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 64 * 1024) == 1 and libc.mallopt(m_trim_threshold, 128 * 1024) == 1
        libc.malloc_trim(0)
        return bool(ok)
    except (OSError, AttributeError):
        return False


def guarded(fn: Callable[[], Measurement], device: str) -> Measurement:
    """Run a measurement, turning out-of-memory and other failures into a status."""
    try:
        return fn()
    except torch.OutOfMemoryError as e:  # type: ignore[attr-defined]
        _free(device)
        return Measurement(status="oom", error=str(e).splitlines()[0][:300])
    except NotImplementedError as e:
        _free(device)
        return Measurement(status="not-implemented", error=str(e)[:300])
    except Exception as e:  # noqa: BLE001 - a failing peer must not end the suite
        _free(device)
        return Measurement(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")


# ----------------------------------------------------------------------------- isolation


def measure_isolated(
    kind: str, spec: Dict[str, Any], worker: Callable[[Dict[str, Any], str], Dict[str, Any]], opts: RunOptions
) -> Dict[str, Any]:
    """One measurement, isolated from the others; returns its record (Measurement.to_dict()).

    CPU: in a fresh interpreter (`run_worker`), which calls `worker(spec, "cpu")`. CUDA: here,
    `worker(spec, "cuda")`, then the allocator's cache is emptied, so that every measurement
    starts from an empty cache (no fragmentation left by the one before).
    """
    if opts.device == "cpu":
        return run_worker(kind, spec, opts.worker_timeout_s)
    rec = worker(spec, opts.device)
    _free(opts.device)
    return rec


def run_worker(kind: str, spec: Dict[str, Any], timeout_s: float) -> Dict[str, Any]:
    """Run one CPU measurement in a fresh interpreter: `python -m bench _worker KIND SPEC`.

    Returns the worker's JSON result, or a dict with status 'timeout' / 'error'.
    """
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the CPU suite measures the PyTorch paths, never the interpreter
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", __package__, "_worker", kind, json.dumps(spec)]  # bench, or erpo_bench installed
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"worker exceeded {timeout_s:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                break
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"status": "error", "error": f"worker exit {proc.returncode}: {' | '.join(tail)[:400]}"}


def import_optional(module: str):
    """Import a module, or return None when it (or something it needs) is missing or broken."""
    try:
        return importlib.import_module(module)
    except Exception:  # noqa: BLE001 - an optional peer failing to import is "absent"
        return None
