"""Backend dispatch, input checks and autocast handling shared by every op.

Every public op validates its inputs here *before* anything reaches a kernel: a bad
shape, dtype, device or index is a ValueError that names the argument.

Two kinds of checks:
    structure  rank, shape, dtype, device: read from tensor metadata, free, always run.
    values     targets in range, cu_seqlens monotone, temperatures and weights valid:
               they read tensor contents, i.e. a device-to-host sync on a GPU. They run
               only when the op is called with `validate=True` (the default); a caller
               that has validated a batch once (where it was built, on the CPU) passes
               `validate=False` in the hot path. While torch.compile traces an op the
               value checks are skipped (`checking_values`): a graph cannot read a
               value to raise on it without a sync and a graph break, so a compiled
               loop validates its batches eagerly, where they are built.
"""
from __future__ import annotations

import contextlib
import numbers
from typing import Dict, Iterable, Optional, Union

import torch

from ._triton import HAS_TRITON, interpreting

BACKENDS = ("auto", "triton", "torch")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def checking_values(validate: bool) -> bool:
    """Whether an op runs its value checks: when `validate` asks for them, and not while
    torch.compile traces the op (module docstring)."""
    return bool(validate) and not torch.compiler.is_compiling()


def check_backend(backend: str, name: str = "backend") -> None:
    """ValueError naming `name` (how the caller's user names the setting) unless `backend`
    is one of BACKENDS: the one check of a backend name (ops, TrainConfig, TRL, verl)."""
    if backend not in BACKENDS:
        raise ValueError(f"{name} must be one of {', '.join(BACKENDS)}, got {backend!r}")


def resolve_backend(backend: str, tensor: torch.Tensor) -> str:
    """Return "triton" or "torch" for an op whose main input is `tensor`.

    "auto": Triton on CUDA tensors when Triton is installed, the PyTorch reference
    elsewhere. "triton": the kernels, on CUDA tensors or on CPU tensors under
    TRITON_INTERPRET=1. "torch": the reference (memory-bounded, differentiable).
    """
    check_backend(backend)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if (HAS_TRITON and tensor.is_cuda) else "torch"
    if not HAS_TRITON:
        raise ValueError("backend='triton' needs the triton package; install it or use backend='auto'")
    if not tensor.is_cuda and not interpreting():
        raise ValueError(
            "backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before import for CPU tensors"
        )
    return "triton"


def resolve_kernel_backend(backend: str, inputs: Dict[str, Optional[torch.Tensor]]) -> str:
    """resolve_backend for an op whose kernels take fp16/bf16/fp32 only.

    `inputs` maps argument names to tensors (None skipped); the first decides the device.
    An fp64 input sends "auto" to the reference and is a ValueError naming it under
    "triton".
    """
    which = resolve_backend(backend, next(iter(inputs.values())))
    fp64 = [name for name, t in inputs.items() if t is not None and t.dtype == torch.float64]
    if which == "triton" and fp64:
        if backend == "triton":
            raise ValueError(f"{fp64[0]}: the triton backend takes fp16, bf16 or fp32; use backend='torch' for fp64")
        which = "torch"
    return which


def is_dtensor(t: object) -> bool:
    """Whether t is a torch.distributed DTensor (False without torch.distributed)."""
    if t is None or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: Optional[int] = None,
    dtypes: Optional[Iterable[torch.dtype]] = None,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """Raise ValueError naming `name` unless `t` is a tensor of the given rank, dtype and device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise ValueError(f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")
    return t


def check_rows(name: str, t: torch.Tensor, n: int, what: str = "one per row of the main input") -> None:
    """Raise ValueError unless `t` has exactly `n` rows (its first dimension); `what`
    says what each row stands for."""
    if t.shape[0] != n:
        raise ValueError(f"{name} has {t.shape[0]} rows, expected {n} ({what})")


def check_targets(
    targets: object, n: int, vocab: int, ignore_index: int, device: torch.device, *, validate: bool = True
) -> torch.Tensor:
    """targets [n] int32/int64 on `device`, each in [0, vocab) or equal to ignore_index
    (an int); the range is checked only when `validate` (it syncs)."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    check_tensor("targets", targets, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_rows("targets", targets, n)
    if checking_values(validate) and n > 0:
        bad = ((targets < 0) | (targets >= vocab)) & (targets != ignore_index)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"targets[{i}] = {int(targets[i])} is outside [0, {vocab}) and is not ignore_index={ignore_index}"
            )
    return targets


def out_of_range_targets(targets: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    """[N] bool: targets outside [0, vocab) that are not ignore_index (what
    check_targets refuses; with validate=False they reach the op)."""
    return ((targets < 0) | (targets >= vocab)) & (targets != ignore_index)


def nan_where_out_of_range(
    logp: torch.Tensor, targets: torch.Tensor, vocab: int, ignore_index: int, validate: bool
) -> torch.Tensor:
    """logp [N] with NaN in the rows of out_of_range_targets, unless check_targets has
    run (validate): validate=False lets such a target through, and its row's log-prob is
    NaN, never a finite value. A torch.where on the device (no host sync): the row's
    log-prob passes no gradient back; its entropy is the full vocabulary's, as for any
    row (docs/kernels.md). The kernels and the reference never index outside the row."""
    if checking_values(validate):
        return logp
    return torch.where(out_of_range_targets(targets, vocab, ignore_index), float("nan"), logp)


def row_inv_temperature(
    inv_temperature: Union[None, float, torch.Tensor], n: int, device: torch.device, *, validate: bool = True
) -> torch.Tensor:
    """Normalise inv_temperature (None, a float, or a [n] tensor) to a contiguous fp32 [n] tensor.

    It is a runtime value, never a compile-time constant, so a new temperature never
    recompiles a kernel. It must be positive and finite (checked for a tensor only when
    `validate`: it syncs).
    """
    if inv_temperature is None:
        return torch.ones(n, dtype=torch.float32, device=device)
    if isinstance(inv_temperature, torch.Tensor):
        check_tensor("inv_temperature", inv_temperature, ndim=1, dtypes=FLOAT_DTYPES, device=device)
        check_rows("inv_temperature", inv_temperature, n)
        inv = inv_temperature.detach().to(torch.float32).contiguous()
        if checking_values(validate) and n > 0 and not bool(((inv > 0) & torch.isfinite(inv)).all()):
            raise ValueError("inv_temperature must be positive and finite in every row")
        return inv
    if not is_number(inv_temperature):
        raise ValueError(f"inv_temperature must be None, a float or a [N] tensor, got {type(inv_temperature).__name__}")
    value = float(inv_temperature)
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"inv_temperature must be positive and finite, got {value}")
    return torch.full((n,), value, dtype=torch.float32, device=device)


def is_number(value: object) -> bool:
    """Whether `value` is a real number where a float is meant: a Python int or float, a
    numpy scalar (np.float32(2), np.int64(1)); never a bool or a string float() would parse."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy registers its scalars there


def check_number(name: str, value: object) -> float:
    """`value` as a float when it is a number (is_number: an int, a float, a numpy scalar;
    not a bool, not a string that float() would parse); else a ValueError naming `name`."""
    if not is_number(value):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


def optional_positive_float(name: str, value: object) -> Optional[float]:
    """None, or `value` as a positive finite float (a runtime kernel argument); else a
    ValueError naming `name`."""
    if value is None:
        return None
    if not is_number(value):
        raise ValueError(f"{name} must be None or a positive float, got {type(value).__name__}")
    value = float(value)
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return value


def check_cu_seqlens(
    cu_seqlens: object,
    n: int,
    device: torch.device,
    name: str = "cu_seqlens",
    *,
    covers: bool = False,
    validate: bool = True,
) -> torch.Tensor:
    """cu_seqlens [S + 1] int32/int64, non-decreasing, within [0, n]; with `covers`, also
    starting at 0 and ending at n (the segments cover every row). Errors name `name`.
    The values are checked only when `validate` (it syncs); rank, dtype, device and
    length always."""
    check_tensor(name, cu_seqlens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must hold at least one offset (S + 1 entries for S segments)")
    if not checking_values(validate):
        return cu_seqlens
    if covers:
        first, last = (int(v) for v in cu_seqlens[[0, -1]].tolist())
        if first != 0 or last != n:
            raise ValueError(
                f"{name} must start at 0 and end at N = {n} (the number of values), got {first} ... {last}"
            )
    if bool((cu_seqlens < 0).any()) or bool((cu_seqlens > n).any()):
        raise ValueError(f"{name} must lie in [0, {n}] (the number of rows)")
    if cu_seqlens.numel() > 1 and bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing")
    return cu_seqlens


def autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The dtype autocast is running matmuls in on `device`'s type, or None when autocast is off there."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def no_autocast(device: torch.device):
    """A context that turns autocast off for `device`'s type: inside an op every tensor
    keeps the dtype the op chose (fp32 accumulation, outputs in the documented dtype),
    whatever autocast the caller runs under."""
    return torch.autocast(device.type, enabled=False)


def device_guard(device: torch.device):
    """A context that makes `device` the current CUDA device while an op launches its
    kernels: Triton launches on the current device (and its current stream), not on the
    tensors' own, so tensors on cuda:1 while cuda:0 is current (model parallel in one
    process, `device_map="auto"`) would be read on the wrong device. Every op enters it
    once, in the body of its custom op, around all its launches; a no-op off CUDA (the
    interpreter's CPU tensors)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype: fp32, or fp64 when the input is fp64 (the reference in float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
