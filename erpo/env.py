"""`erpo env`: what this machine will run. Device, torch (and the CUDA it was built for),
Triton, and for each op the backend `backend="auto"` picks on the trainer's default device,
confirmed by running the op once on tiny inputs and comparing it with the PyTorch reference."""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Tuple

import torch

import erpo_kernels as ek
from erpo_kernels import HAS_TRITON, interpreting, resolve_backend


def _op_calls(device: torch.device) -> Dict[str, Callable[[str], torch.Tensor]]:
    """Each public op on small fixed inputs: backend name -> output (one tensor)."""
    g = torch.Generator().manual_seed(0)
    n, d, v = 7, 16, 37
    logits = torch.randn(n, v, generator=g).to(device)
    hidden = torch.randn(n, d, generator=g).to(device)
    weight = (0.1 * torch.randn(v, d, generator=g)).to(device)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    values = torch.randn(n, generator=g).to(device)
    cu = torch.tensor([0, 3, 7], device=device)
    logp, ref = -torch.rand(5, generator=g).to(device), -torch.rand(5, generator=g).to(device)
    w = torch.rand(5, generator=g).to(device)
    return {
        "token_logprobs": lambda b: ek.token_logprobs(logits, targets, backend=b),
        "linear_token_logprobs": lambda b: ek.linear_token_logprobs(hidden, weight, targets, backend=b),
        "segment_sum": lambda b: ek.segment_sum(values, cu, backend=b),
        "weighted_k3": lambda b: ek.weighted_k3(logp, ref, w, backend=b).reshape(1),
    }


def op_backends(device: torch.device, backend: str = "auto") -> List[Tuple[str, str, str]]:
    """(op, the backend `backend` resolves to on `device`, result of running it against the reference)."""
    rows = []
    for name, call in _op_calls(device).items():
        chosen = resolve_backend(backend, torch.empty(0, device=device))
        try:
            err = (call(backend).double() - call("torch").double()).abs().max().item()
            check = f"ran; max |{backend} - reference| = {err:.1e}" + ("" if err < 1e-4 else "  (MISMATCH)")
        except Exception as exc:  # noqa: BLE001 - reported, this command is a diagnosis
            check = f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        rows.append((name, chosen, check))
    return rows


def _kernels_lines(cuda: bool) -> List[str]:
    """What runs the Triton kernels here: without CUDA, backend="auto" keeps the reference
    on CPU tensors and the kernels run only in the interpreter (TRITON_INTERPRET=1), when
    forced with backend="triton": then they are run once here too."""
    if cuda:
        return []
    if not interpreting():
        return ["no CUDA device: the compiled Triton kernels run on CUDA tensors (see the README's \"On a GPU "
                "machine\"); here only in Triton's CPU interpreter, with TRITON_INTERPRET=1 and backend=\"triton\""]
    lines = ["backend=\"triton\" on this device (TRITON_INTERPRET=1: the kernels in the CPU interpreter, slowly):"]
    lines += [f"  {name:<22} {chosen:<7} {check}" for name, chosen, check in op_backends(torch.device("cpu"), "triton")]
    lines.append("no CUDA device: backend=\"auto\" runs the PyTorch reference on CPU tensors; the compiled kernels "
                 "need a CUDA device (see the README's \"On a GPU machine\")")
    return lines


def tiles_lines(device: torch.device) -> List[str]:
    """The tiles each op launches with on `device` without tiles= (erpo_kernels.default_tiles,
    or a tuning file's entry at the D and V it names: see `python -m bench tune`)."""
    from erpo_kernels.tiles import ARCHITECTURES, device_capability
    from erpo_kernels.tuning import tuning_path

    cap = device_capability(device)
    if cap is None:
        runs = "backend=\"triton\" in the interpreter" if interpreting() else "the kernels do not launch here"
        where = f"no CUDA device ({runs}): the conservative tiles"
    else:
        known = "" if cap in ARCHITECTURES else ", not in the table: the conservative tiles"
        where = f"sm_{cap[0]}{cap[1]}{known}"
    lines = [f"tiles:   {where}; a tuning file ({tuning_path()}) overrides them per GPU, dtype, D and V"]
    for dtype in (torch.bfloat16, torch.float32):
        t = ek.default_tiles("linear_token_logprobs", dtype, cap)
        lines.append(f"  linear_token_logprobs[{str(dtype).replace('torch.', '')}]: {t}")
    lines.append(f"  token_logprobs[any dtype]: {ek.default_tiles('token_logprobs', torch.bfloat16, cap)}")
    return lines


def env_report() -> str:
    """The lines `erpo env` prints."""
    triton_version = "not installed"
    if HAS_TRITON:
        import triton

        triton_version = getattr(triton, "__version__", "?")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    where = torch.cuda.get_device_name(0) if cuda else f"{os.cpu_count()} logical cores"
    lines = [
        f"device:  {device} ({where}); the trainer's device=auto picks it",
        f"torch:   {torch.__version__} (CUDA build: {torch.version.cuda or 'none, a CPU-only build'})",
        f"CUDA:    {'available, ' + str(torch.cuda.device_count()) + ' device(s)' if cuda else 'not available'}",
        f"triton:  {triton_version}"
        + ("  (TRITON_INTERPRET=1: backend=\"triton\" runs the kernels in the CPU interpreter)" if interpreting() else ""),
        "backend=\"auto\" on this device (triton = the fused kernels; torch = the PyTorch reference):",
    ]
    for name, chosen, check in op_backends(device):
        lines.append(f"  {name:<22} {chosen:<7} {check}")
    return "\n".join(lines + tiles_lines(device) + _kernels_lines(cuda))
