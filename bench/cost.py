"""Counted GPU cost without a GPU: what each Triton launch and each PyTorch op does, exactly.

Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported) executes every
tl.load, tl.store and tl.dot of a real kernel on CPU tensors. `count_launches` hooks those
three operations (and the atomics) for the duration of one call and returns one record per
kernel launch, plus one per PyTorch op that runs outside a kernel:

    from bench.cost import count_launches, table
    launches = count_launches(lambda: linear_token_logprobs(h, w, t).sum().backward())
    print(table(launches))
    launches[0].name, launches[0].programs, launches[0].loaded, launches[0].flops  # ...

A Triton record (`kind="triton"`) holds, with every mask respected (only active lanes count):
    programs         the grid's size
    loaded, stored   bytes moved by tl.load / tl.store (an atomic counts as both)
    distinct_loaded, distinct_stored, distinct
                     bytes at distinct addresses: the launch's compulsory traffic
    smem             bytes of its tl.dot operands through shared memory: each operand tile written
                     once and read once (2 x (M K + K N) x element size per dot)
    flops            {operand dtype: 2 M N K summed over its tl.dot calls}; "bf16>fp32" are fp32
                     dots whose operands were widened from bf16 just before (the interpreter's bf16
                     workaround of our kernels: on the GPU a bf16 tensor-core dot)
    args             the same per kernel argument, plus `program_distinct`: distinct bytes per
                     program summed over the programs (equal to `distinct` when no two programs
                     touch the same bytes: the argument is private to its programs)
A torch record (`kind="torch"`) holds one ATen op: loaded = the bytes of its tensor inputs (a
gather: the gathered elements; copy_/fill_/out=: not the destination), stored = the bytes of its
outputs (0 for views), flops from torch.utils.flop_counter by the narrowest floating input dtype;
distinct = loaded + stored (an op is taken to read its inputs and write its outputs once). A
torch.library custom op is counted by what it runs (its ATen ops and kernels), not as one op;
a CUDA-only ATen op a peer's GPU branch calls (addmm with out_dtype) is computed by an
equivalent on CPU and counted as called.

Counting changes no result, except that a bf16 tl.dot (wrong in triton 3.9's interpreter,
which multiplies the raw bit patterns) is computed from the bf16 values, as a GPU does, and
that the interpreter's libdevice stubs used by peers (log1p, tanh) get triton.language math.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode


# ----------------------------------------------------------------------------- records


@dataclass
class ArgCounts:
    """Bytes one kernel argument (or a group of arguments sharing a tensor) saw in a launch."""

    loaded: int = 0
    stored: int = 0
    distinct_loaded: int = 0
    distinct_stored: int = 0
    distinct: int = 0
    program_distinct: int = 0  # sum over programs of the distinct bytes each touched

    @property
    def private(self) -> bool:
        """No two programs touched the same bytes of it."""
        return self.program_distinct == self.distinct


@dataclass
class Launch:
    """One Triton kernel launch or one PyTorch op (see the module docstring)."""

    name: str
    kind: str  # "triton" or "torch"
    grid: Tuple[int, ...] = ()
    programs: int = 0
    loaded: int = 0
    stored: int = 0
    distinct_loaded: int = 0
    distinct_stored: int = 0
    distinct: int = 0
    flops: Dict[str, int] = field(default_factory=dict)
    atomics: int = 0  # atomic operations (lanes), a sign of a non-deterministic reduction
    smem: int = 0  # shared-memory bytes of its dots: each operand staged into shared memory once and read once
    args: Dict[str, ArgCounts] = field(default_factory=dict)
    phase: str = ""  # set by the caller (e.g. "forward" / "backward") with `counting(phase=...)`
    out_shape: Tuple[int, ...] = ()  # a torch op's first output shape

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())

    def as_dict(self) -> Dict[str, Any]:
        d = {k: getattr(self, k) for k in ("name", "kind", "phase", "programs", "loaded", "stored",
                                           "distinct_loaded", "distinct_stored", "distinct", "atomics", "smem")}
        d["grid"] = list(self.grid)
        d["out_shape"] = list(self.out_shape)
        d["flops"] = dict(self.flops)
        d["args"] = {k: vars(a).copy() for k, a in self.args.items()}
        return d


# ----------------------------------------------------------------------------- the Triton side


class _Marks:
    """Which elements of one (argument, element size) were loaded / stored in the launch, and
    touched in the current program: boolean maps over the argument's span (addresses outside
    every argument's span, not expected, are kept as sorted unique arrays instead)."""

    def __init__(self, start: int, end: int, elem: int):
        self.start, self.elem = start, elem
        n = (end - start + elem - 1) // elem if end > start else 0
        self.mapped = n > 0
        size = n if self.mapped else 0
        self.ld = np.zeros(size, dtype=bool)
        self.st = np.zeros(size, dtype=bool)
        self.prog = np.zeros(size, dtype=bool)
        self.prog_idx: List[np.ndarray] = []
        self.extra = {"ld": np.empty(0, np.uint64), "st": np.empty(0, np.uint64), "prog": np.empty(0, np.uint64)}

    def add(self, addrs: np.ndarray, store: bool) -> None:
        if not self.mapped:
            for k in ("st" if store else "ld", "prog"):
                self.extra[k] = np.union1d(self.extra[k], addrs)
            return
        idx = ((addrs - np.uint64(self.start)) // np.uint64(self.elem)).astype(np.int64)
        (self.st if store else self.ld)[idx] = True
        self.prog[idx] = True
        self.prog_idx.append(idx)

    def end_program(self) -> int:
        """Distinct bytes the program touched; resets the program's map."""
        if not self.mapped:
            n = self.extra["prog"].size
            self.extra["prog"] = np.empty(0, np.uint64)
            return n * self.elem
        if not self.prog_idx:
            return 0
        idx = np.concatenate(self.prog_idx)
        # the map's count costs its size, a sort of the indices their number: the cheaper one
        n = int(np.count_nonzero(self.prog)) if idx.size >= self.prog.size // 8 else int(np.unique(idx).size)
        self.prog[idx] = False
        self.prog_idx.clear()
        return n * self.elem

    def distinct(self) -> Tuple[int, int, int]:
        """(distinct loaded, distinct stored, distinct touched) bytes of the launch."""
        if not self.mapped:
            ld, st = self.extra["ld"], self.extra["st"]
            return ld.size * self.elem, st.size * self.elem, np.union1d(ld, st).size * self.elem
        return (int(np.count_nonzero(self.ld)) * self.elem, int(np.count_nonzero(self.st)) * self.elem,
                int(np.count_nonzero(self.ld | self.st)) * self.elem)


class _LaunchState:
    """What the hooks gather during one launch: spans of the arguments, per-(argument, element
    size) marks of the touched elements, byte and FLOP totals."""

    def __init__(self, name: str):
        self.rec = Launch(name=name, kind="triton")
        self.starts = np.empty(0, dtype=np.uint64)
        self.ends = np.empty(0, dtype=np.uint64)
        self.names: List[str] = []
        self.marks: Dict[Tuple[int, int], _Marks] = {}
        self.program_distinct: Dict[int, int] = {}
        self.started = False  # a program is running
        self.patched: set = set()  # triton.language modules patched for this launch (see _triton_hooks)

    def set_args(self, named: List[Tuple[str, torch.Tensor]]) -> None:
        """The byte span of each tensor argument; arguments whose spans overlap share one (joined) name."""
        spans: Dict[Tuple[int, int], List[Tuple[int, str]]] = {}
        for i, (name, t) in enumerate(named):
            if t.numel() == 0:
                continue
            extent = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
            start = t.data_ptr()
            spans.setdefault((start, start + extent * t.element_size()), []).append((i, name))
        merged: List[List] = []  # overlapping spans (a tensor and a slice of it, say) are one region
        for (start, end) in sorted(spans):
            if merged and start < merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
                merged[-1][2] += spans[(start, end)]
            else:
                merged.append([start, end, list(spans[(start, end)])])
        self.starts = np.array([m[0] for m in merged], dtype=np.uint64)
        self.ends = np.array([m[1] for m in merged], dtype=np.uint64)
        self.names = ["|".join(n for _, n in sorted(m[2])) for m in merged] + ["<unknown>"]  # in argument order

    def _arg_of(self, addrs: np.ndarray) -> np.ndarray:
        if not self.starts.size:
            return np.zeros(addrs.shape, dtype=np.int64)
        idx = np.searchsorted(self.starts, addrs, side="right").astype(np.int64) - 1
        ok = (idx >= 0) & (addrs < self.ends[np.maximum(idx, 0)])
        return np.where(ok, idx, len(self.names) - 1)

    def access(self, ptrs: np.ndarray, mask: Optional[np.ndarray], elem: int, store: bool) -> None:
        addrs = ptrs[mask] if mask is not None else ptrs.reshape(-1)
        if addrs.size == 0:
            return
        addrs = addrs.reshape(-1).astype(np.uint64, copy=False)
        nbytes = int(addrs.size) * elem
        if store:
            self.rec.stored += nbytes
        else:
            self.rec.loaded += nbytes
        lo, hi = addrs.min(), addrs.max()
        ends = self._arg_of(np.array([lo, hi], dtype=np.uint64))
        if ends[0] == ends[1]:
            groups = [(int(ends[0]), addrs)]  # one load/store touches one tensor (the usual case)
        else:
            which = self._arg_of(addrs)
            groups = [(int(i), addrs[which == i]) for i in np.unique(which)]
        for i, a in groups:
            counts = self.rec.args.setdefault(self.names[i], ArgCounts())
            if store:
                counts.stored += int(a.size) * elem
            else:
                counts.loaded += int(a.size) * elem
            marks = self.marks.get((i, elem))
            if marks is None:
                known = i < len(self.starts)
                marks = self.marks[(i, elem)] = _Marks(int(self.starts[i]) if known else 0,
                                                       int(self.ends[i]) if known else 0, elem)
            marks.add(a, store)

    def end_program(self) -> None:
        for (i, _), marks in self.marks.items():
            self.program_distinct[i] = self.program_distinct.get(i, 0) + marks.end_program()

    def finish(self) -> Launch:
        self.end_program()
        rec = self.rec
        for (i, _), marks in self.marks.items():
            counts = rec.args[self.names[i]]
            ld, st, both = marks.distinct()
            counts.distinct_loaded += ld
            counts.distinct_stored += st
            counts.distinct += both
        for i, b in self.program_distinct.items():
            rec.args[self.names[i]].program_distinct += b
        rec.distinct_loaded = sum(a.distinct_loaded for a in rec.args.values())
        rec.distinct_stored = sum(a.distinct_stored for a in rec.args.values())
        rec.distinct = sum(a.distinct for a in rec.args.values())
        return rec


def _elem_bytes(handle) -> int:
    return max(1, handle.get_element_ty().primitive_bitwidth // 8)


def _dtype_name(dt) -> str:
    return str(dt)  # "fp32", "bf16", "fp16", ...


class _Sink:
    """Where the hooks write: the records of the current `counting` block."""

    def __init__(self, phase: str = ""):
        self.records: List[Launch] = []
        self.launch: Optional[_LaunchState] = None
        self.phase = phase

    def add(self, rec: Launch) -> None:
        rec.phase = self.phase
        self.records.append(rec)


_WIDENED = "erpo_cost_widened_from"  # TensorHandle attribute: the fp16/bf16 dtype an fp32 value came from


class _InterpreterHooks:
    """Hooks on triton 3.9's interpreter: its builder's load, store, dot, atomics and casts, its grid
    index (program boundaries), its launcher (one record per launch, the arguments' spans) and its
    per-call re-patching of triton.language (skipped once a launch has patched it: speed only)."""

    BUILDER = ("create_masked_load", "create_masked_store", "create_dot", "create_atomic_rmw", "create_atomic_cas",
               "cast_impl", "create_fp_to_fp", "set_grid_idx", "set_grid_dim")
    # libdevice is a stub in the interpreter (every function returns None): the few that peers use get
    # the same math from triton.language, so that their kernels run (values only; counts are unchanged)
    LIBDEVICE = {"log1p": lambda x: _tl().log(1.0 + x), "tanh": lambda x: 2.0 * _tl().sigmoid(2.0 * x) - 1.0}

    def __init__(self, sink: _Sink):
        from triton.runtime import interpreter

        self.sink, self.interp, self.tl = sink, interpreter, _tl()
        self.builder = interpreter.interpreter_builder
        self.orig = {n: getattr(self.builder, n) for n in self.BUILDER}
        self.langs_of: Dict[Any, frozenset] = {}

    # --- builder hooks (called by the interpreter with the builder's arguments)

    def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        self._access(ptrs, np.asarray(mask.data, dtype=bool), store=False)
        return self.orig["create_masked_load"](ptrs, mask, other, cache_policy, is_volatile)

    def create_masked_store(self, ptrs, value, mask, cache_policy):
        self._access(ptrs, np.asarray(mask.data, dtype=bool), store=True)
        return self.orig["create_masked_store"](ptrs, value, mask, cache_policy)

    def create_atomic_rmw(self, rmw_op, ptr, val, mask, sem, scope):
        self._atomic(ptr, np.asarray(mask.data, dtype=bool))
        return self.orig["create_atomic_rmw"](rmw_op, ptr, val, mask, sem, scope)

    def create_atomic_cas(self, ptr, cmp, val, sem, scope):
        self._atomic(ptr, None)
        return self.orig["create_atomic_cas"](ptr, cmp, val, sem, scope)

    def cast_impl(self, src, dst_type):
        return self._widened(self.orig["cast_impl"](src, dst_type), src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        return self._widened(self.orig["create_fp_to_fp"](src, dst_type, rounding_mode), src, dst_type)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        tl = self.tl
        m, k = a.data.shape[-2:]
        batch = int(np.prod(a.data.shape[:-2])) if a.data.ndim > 2 else 1
        key = _dtype_name(a.dtype.scalar)
        wa, wb = a.attr.get(_WIDENED), b.attr.get(_WIDENED)
        if a.dtype.scalar == tl.float32 and wa is not None and wa == wb:
            key = f"{wa}>fp32"
        launch = self.sink.launch
        if launch is not None:
            launch.rec.flops[key] = launch.rec.flops.get(key, 0) + 2 * batch * m * b.data.shape[-1] * k
            elem = 2 if ">" in key else a.data.itemsize  # a widened bf16 / fp16 operand: 2 bytes on the GPU
            launch.rec.smem += 2 * batch * (m * k + k * b.data.shape[-1]) * elem
        # the interpreter multiplies raw bf16 bits: give it the values
        a, b = (self.interp.TensorHandle(_bf16_to_f32(x.data), tl.float32) if x.dtype.scalar == tl.bfloat16 else x
                for x in (a, b))
        return self.orig["create_dot"](a, b, d, input_precision, max_num_imprecise_acc)

    def set_grid_idx(self, x, y, z):
        launch = self.sink.launch
        if launch is not None:
            if launch.started:
                launch.end_program()
            launch.started = True
        return self.orig["set_grid_idx"](x, y, z)

    def set_grid_dim(self, nx, ny, nz):
        if self.sink.launch is not None:
            self.sink.launch.rec.grid = (nx, ny, nz)
            self.sink.launch.rec.programs = nx * ny * nz
        return self.orig["set_grid_dim"](nx, ny, nz)

    def _access(self, ptrs, mask: Optional[np.ndarray], store: bool) -> None:
        if self.sink.launch is not None:
            self.sink.launch.access(ptrs.data, mask, _elem_bytes(ptrs), store=store)

    def _atomic(self, ptr, mask: Optional[np.ndarray]) -> None:
        """An atomic reads and writes its active lanes."""
        if self.sink.launch is not None:
            self._access(ptr, mask, store=False)
            self._access(ptr, mask, store=True)
            self.sink.launch.rec.atomics += int(mask.sum()) if mask is not None else int(ptr.data.size)

    def _widened(self, result, src, dst_type):
        if src.dtype.scalar in (self.tl.bfloat16, self.tl.float16) and dst_type.scalar == self.tl.float32:
            result.attr[_WIDENED] = _dtype_name(src.dtype.scalar)
        return result

    # --- launcher hooks

    def executor_call(self, orig_call, executor, *args, **kwargs):
        if self.sink.launch is not None:  # a launch inside a launch: not expected, counted in the outer one
            return orig_call(executor, *args, **kwargs)
        self.sink.launch = _LaunchState(executor.fn.__name__)
        try:
            orig_call(executor, *args, **kwargs)
            self.sink.add(self.sink.launch.finish())
        finally:
            self.sink.launch = None

    def init_args(self, orig_init, executor, args_dev, kwargs):
        args_hst, kwargs_hst = orig_init(executor, args_dev, kwargs)
        if self.sink.launch is not None:
            named = list(zip(executor.arg_names, args_hst)) + list(kwargs_hst.items())
            self.sink.launch.set_args([(n, a) for n, a in named if isinstance(a, torch.Tensor)])
        return args_hst, kwargs_hst

    def patch_lang(self, orig_patch_lang, fn):
        langs = self.langs_of.get(fn)
        if langs is None:
            tl = self.tl
            langs = self.langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        launch = self.sink.launch
        if launch is not None and langs <= launch.patched:
            return _NoScope()
        scope = orig_patch_lang(fn)
        if launch is not None:
            launch.patched |= langs
        return scope

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Everything patched for the block, restored on exit."""
        from triton.language.extra import libdevice

        interp, b = self.interp, self.builder
        saved_builder = {n: b.__dict__.get(n, _MISSING) for n in self.BUILDER}
        saved_libdevice = {n: getattr(libdevice, n) for n in self.LIBDEVICE}
        saved = (interp.GridExecutor.__call__, interp.GridExecutor._init_args_hst, interp._patch_lang)
        orig_call, orig_init, orig_patch = saved
        try:
            for n in self.BUILDER:
                setattr(b, n, getattr(self, n))
            interp.GridExecutor.__call__ = lambda ex, *a, **k: self.executor_call(orig_call, ex, *a, **k)
            interp.GridExecutor._init_args_hst = lambda ex, a, k: self.init_args(orig_init, ex, a, k)
            interp._patch_lang = lambda fn: self.patch_lang(orig_patch, fn)
            for n, f in self.LIBDEVICE.items():
                setattr(libdevice, n, f)
            with np.errstate(all="ignore"):  # a peer's garbage values (bf16 arithmetic) warn; counts do not care
                yield
        finally:
            interp.GridExecutor.__call__, interp.GridExecutor._init_args_hst, interp._patch_lang = saved
            for n, f in saved_libdevice.items():
                setattr(libdevice, n, f)
            for n, v in saved_builder.items():
                if v is _MISSING:
                    b.__dict__.pop(n, None)
                else:
                    setattr(b, n, v)


def _tl():
    import triton.language as tl

    return tl


def _triton_hooks(sink: _Sink) -> contextlib.AbstractContextManager:
    """The interpreter's hooks for the block (see _InterpreterHooks)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("bench.cost counts Triton kernels in the interpreter: set TRITON_INTERPRET=1 "
                           "before triton (or erpo_kernels) is imported")
    return _InterpreterHooks(sink).installed()


_MISSING = object()


class _NoScope:
    def restore(self) -> None:
        pass


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


# ----------------------------------------------------------------------------- the PyTorch side


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements of t (an expanded dimension, stride 0, counts once)."""
    n = 1
    for s, st in zip(t.shape, t.stride()):
        if st != 0:
            n *= s
    return n * t.element_size() if t.numel() else 0


def _tensors(tree) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    for x in torch.utils._pytree.tree_leaves(tree):
        if isinstance(x, torch.Tensor) and not any(x is y for y in out):
            out.append(x)
    return out


class _TorchOps(TorchDispatchMode):
    """One record per ATen op run outside a Triton launch."""

    def __init__(self, sink: _Sink):
        super().__init__()
        self.sink = sink
        from torch.utils.flop_counter import flop_registry

        self.flop_registry = flop_registry

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = _custom_op_impl(func)
        if impl is not None:  # a torch.library custom op: count what it runs (its ATen ops, its kernels), not it
            with self:
                return impl(*args, **kwargs)
        if self.sink.launch is None and func.overloadpacket not in self.flop_registry:
            # a composite op (matmul, to, softmax, ...) seen undecomposed, as ops called inside a custom op
            # are: count what it decomposes into (mm, _to_copy, _softmax), as outside one
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        try:
            out = func(*args, **kwargs)
        except NotImplementedError:
            emulate = _CUDA_ONLY.get(func)
            if emulate is None:
                raise
            out = emulate(*args, **kwargs)  # a CUDA-only op a peer's GPU path calls, computed on CPU
        if self.sink.launch is None:
            self.sink.add(self._record(func, args, kwargs, out))
        return out

    def _record(self, func, args, kwargs, out) -> Launch:
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        mutable = func._schema.is_mutable
        in_storages = {_storage_key(t) for t in ins}
        # a view (an output sharing an input's storage from an op that mutates nothing) moves no bytes
        view = not mutable and bool(outs) and all(_storage_key(t) in in_storages for t in outs)
        rec = Launch(name=str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func),
                     kind="torch")
        rec.name = f"aten.{func.overloadpacket.__name__}" if hasattr(func, "overloadpacket") else str(func)
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        if outs:
            rec.out_shape = tuple(outs[0].shape)
        if not view:
            # an in-place op reads its mutated input too, except those that only overwrite it (copy_,
            # fill_, zero_, out=); the *_like / new_* / empty factories read no input, empty writes nothing
            reads = [] if name in _NO_READ else [t for t in ins if not _overwritten(name, t, args, kwargs)]
            if name == "addmm" and kwargs.get("beta", 1) == 0 and args:  # beta = 0: the input matrix is not read
                reads = [t for t in reads if t is not args[0]]
            rec.loaded = sum(_tensor_bytes(t) for t in reads)
            rec.stored = 0 if name in _NO_WRITE else sum(_tensor_bytes(t) for t in outs)
            if name in _GATHER:  # reads the gathered elements and the indices, not the whole source
                rec.loaded = rec.stored + sum(_tensor_bytes(t) for t in ins if not t.is_floating_point())
            elif name in _SCATTER:  # reads the values and indices, writes the values' worth of its first argument
                rest = [t for t in ins if t is not ins[0]]
                rec.loaded = sum(_tensor_bytes(t) for t in rest)
                rec.stored = sum(_tensor_bytes(t) for t in rest if t.is_floating_point())
            rec.distinct_loaded, rec.distinct_stored = rec.loaded, rec.stored
            rec.distinct = rec.loaded + rec.stored
        count = self.flop_registry.get(func.overloadpacket) if hasattr(func, "overloadpacket") else None
        if count is not None:
            try:
                flops = int(count(*args, **kwargs, out_val=out))
            except TypeError:  # an overload with extra positional arguments (addmm.dtype_out's out_dtype)
                flops = int(count(*[a for a in args if isinstance(a, torch.Tensor)], out_val=out))
            if flops:
                # the operands' dtype: the narrowest floating input (addmm(fp32 acc, bf16, bf16) is a bf16 GEMM)
                floats = [t.dtype for t in ins if t.is_floating_point()]
                dt = min(floats, key=lambda d: torch.finfo(d).bits) if floats else None
                rec.flops[_torch_dtype_name(dt)] = flops
        return rec


def _custom_op_impl(func) -> Optional[Callable]:
    """The Python function behind a torch.library.custom_op (None for ATen and other ops)."""
    if getattr(func, "namespace", "aten") in ("aten", "prims"):
        return None
    try:
        from torch._library.custom_ops import _maybe_get_opdef

        opdef = _maybe_get_opdef(func)
    except (ImportError, AttributeError):
        return None
    return getattr(opdef, "_init_fn", None) if opdef is not None else None


def _storage_key(t: torch.Tensor):
    try:
        return (t.device.type, t.untyped_storage().data_ptr()) if t.device.type != "meta" else ("meta", id(t))
    except (RuntimeError, NotImplementedError):
        return ("?", id(t))


# ops that read none of their tensor inputs (shape/dtype only) and ops that write nothing
_NO_READ = {"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "new_empty",
            "new_empty_strided", "new_zeros", "new_ones", "new_full", "empty_strided", "empty", "zeros", "ones",
            "full", "scalar_tensor", "arange"}
_NO_WRITE = {"empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty"}
_GATHER = {"index", "index_select", "gather", "take", "embedding", "masked_select"}
_SCATTER = {"index_put_", "index_put", "scatter_", "scatter", "scatter_add_", "scatter_add", "index_add_",
            "index_add", "index_copy_", "index_copy", "masked_scatter_"}
_OVERWRITE = {"copy_", "fill_", "zero_", "normal_", "uniform_", "random_"}  # their first argument is written only


def _overwritten(name: str, t: torch.Tensor, args, kwargs) -> bool:
    """t is only written by the op: the destination of copy_ / fill_ / zero_, or passed as out=
    and not also as an input (addmm(acc, a, b, out=acc) reads acc)."""
    if name in _OVERWRITE and bool(args) and t is args[0]:
        return True
    positional = any(t is x for x in torch.utils._pytree.tree_leaves(args))
    return not positional and any(t is v for k, v in kwargs.items() if k.startswith("out"))


def _addmm_out_dtype(acc, a, b, out_dtype=None, *, beta=1, alpha=1, out=None):
    out = acc.clone() if out is None else out
    if beta == 0:  # acc is not read (it may hold anything, NaN included), as on CUDA
        return torch.mm(a.to(out.dtype), b.to(out.dtype), out=out).mul_(alpha)
    if out is not acc:
        out.copy_(acc)
    return out.mul_(beta).addmm_(a.to(out.dtype), b.to(out.dtype), alpha=alpha)


# CUDA-only ATen ops computed on CPU by an equivalent (counted as the op that was called)
_CUDA_ONLY = {torch.ops.aten.addmm.dtype_out: _addmm_out_dtype}


_TORCH_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def _torch_dtype_name(dt: Optional[torch.dtype]) -> str:
    return _TORCH_DTYPES.get(dt, str(dt).replace("torch.", ""))


# ----------------------------------------------------------------------------- the API


@contextlib.contextmanager
def counting(phase: str = "", torch_ops: bool = True) -> Iterator[List[Launch]]:
    """Count every Triton launch (and, with torch_ops, every ATen op outside a launch) run in
    the block; yields the list the records are appended to, in launch order."""
    sink = _Sink(phase)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_triton_hooks(sink))
        if torch_ops:
            stack.enter_context(_TorchOps(sink))
        yield sink.records


def count_launches(fn: Callable[..., Any], *args, phase: str = "", torch_ops: bool = True, **kwargs) -> List[Launch]:
    """Run fn(*args, **kwargs) once and return its launches (see the module docstring)."""
    with counting(phase=phase, torch_ops=torch_ops) as records:
        fn(*args, **kwargs)
    return records


def merge_by_name(records: List[Launch]) -> List[Launch]:
    """Launches of the same (name, kind, phase) summed into one record (first-seen order)."""
    out: Dict[Tuple[str, str, str], Launch] = {}
    for r in records:
        key = (r.name, r.kind, r.phase)
        m = out.get(key)
        if m is None:
            m = out[key] = Launch(name=r.name, kind=r.kind, phase=r.phase, grid=r.grid)
            m.launches = 0  # type: ignore[attr-defined]
        m.launches += 1  # type: ignore[attr-defined]
        for k in ("programs", "loaded", "stored", "distinct_loaded", "distinct_stored", "distinct", "atomics", "smem"):
            setattr(m, k, getattr(m, k) + getattr(r, k))
        for k, v in r.flops.items():
            m.flops[k] = m.flops.get(k, 0) + v
        for k, a in r.args.items():
            ma = m.args.setdefault(k, ArgCounts())
            for f in vars(a):
                setattr(ma, f, getattr(ma, f) + getattr(a, f))
    return list(out.values())


def _si(x: float, unit: str = "B") -> str:
    if x == 0:
        return "0"
    p = min(int(math.log10(abs(x)) // 3), 4) if abs(x) >= 1 else 0
    return f"{x / 10 ** (3 * p):.3g} {' kMGT'[p].strip()}{unit}"


def table(records: List[Launch], merge: bool = True) -> str:
    """A plain-text table of launches (merged by name when `merge`)."""
    rows = merge_by_name(records) if merge else records
    lines = [f"{'launch':<36} {'kind':<6} {'n':>4} {'programs':>9} {'loaded':>10} {'stored':>10} "
             f"{'distinct':>10} flops"]
    for r in rows:
        n = getattr(r, "launches", 1)
        fl = ", ".join(f"{k} {_si(v, 'FLOP')}" for k, v in r.flops.items())
        lines.append(f"{r.name[:36]:<36} {r.kind:<6} {n:>4} {r.programs:>9} {_si(r.loaded):>10} "
                     f"{_si(r.stored):>10} {_si(r.distinct):>10} {fl}")
    return "\n".join(lines)
