"""The chunked PyTorch reference (backend="torch", CPU) never allocates an [N, V] tensor:
measured, not assumed.

Each case runs in a fresh interpreter (sys.executable -c ...), which warms every op up
on a tiny input, builds its inputs, resets Linux's peak-RSS counter
(/proc/self/clear_refs; ru_maxrss when that is not writable), runs forward + backward
once and reports peak RSS minus the RSS before the work. The reference must stay
below a quarter of N x V x 4 bytes; in the same test the plain PyTorch log_softmax path
must exceed that bound, which shows the measurement can see an [N, V] buffer.

Sizes: the reference's work chunks are shrunk (CHUNK_ELEMENTS and LINEAR_CHUNK_ELEMENTS
= 64k values, 256 KB of fp32) so that N x V x 4 = 128 MB dwarfs them at a shape that runs
in seconds on 2 cores; the default chunks (4M values, 16M for linear_token_logprobs) would
need N x V in the billions to be dwarfed as much.
glibc's malloc is pinned to mmap every block >= 1 MB (MALLOC_MMAP_THRESHOLD_) so that
freed tensors leave the resident set at once and RSS tracks live tensors, not the
allocator's cache.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
N, V, D = 2048, 16384, 32
NV_BYTES = N * V * 4  # one [N, V] fp32 tensor: 128 MB
BOUND = NV_BYTES // 4

_PRELUDE = r"""
import gc, json, os, resource, sys
import torch
torch.set_num_threads(1)
import erpo_kernels
from erpo_kernels import reference
reference.CHUNK_ELEMENTS = reference.LINEAR_CHUNK_ELEMENTS = 1 << 16
N, V, D = {n}, {v}, {d}

def vm(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)

def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return "VmHWM"
    except OSError:
        return "ru_maxrss"

def peak(method):
    if method == "VmHWM":
        return vm("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def measure(make_inputs, work):
    work(*make_inputs(9, 37, 8))  # warm-up: loads every op's code before the baseline
    inputs = make_inputs(N, V, D)
    gc.collect()
    method = reset_peak()
    before = vm("VmRSS") if method == "VmHWM" else peak(method)
    work(*inputs)
    print(json.dumps({{"increase": peak(method) - before, "method": method}}))
"""

_LINEAR = r"""
def make_inputs(n, v, d):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    weight = (0.1 * torch.randn(v, d, generator=g)).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::7] = -100
    return hidden, weight, targets

def reference_path(hidden, weight, targets):
    logp, ent = erpo_kernels.linear_token_logprobs(hidden, weight, targets, return_entropy=True, backend="torch")
    (logp.sum() + ent.sum()).backward()

def naive_path(hidden, weight, targets):
    logp = torch.log_softmax(hidden @ weight.T, dim=-1)  # [N, V]
    valid = targets != -100
    picked = logp[valid].gather(1, targets[valid][:, None])
    picked.sum().backward()

measure(make_inputs, {path})
"""

_TOKEN = r"""
def make_inputs(n, v, d):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=g)
    weight = (0.1 * torch.randn(v, d, generator=g)).requires_grad_()
    logits = hidden @ weight.T  # [N, V], exists before the baseline (an lm_head output)
    targets = torch.randint(0, v, (n,), generator=g)
    return logits, targets

def reference_path(logits, targets):
    logp, ent = erpo_kernels.token_logprobs(
        logits, targets, return_entropy=True, inplace_backward=True, backend="torch"
    )
    (logp.sum() + ent.sum()).backward()

def naive_path(logits, targets):
    logp = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])
    logp.sum().backward()

measure(make_inputs, {path})
"""


def _increase(body: str, path: str) -> int:
    code = _PRELUDE.format(n=N, v=V, d=D) + body.format(path=path)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)  # the reference only
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return int(result["increase"])


def _assert_bounded(script: str, what: str) -> None:
    """The reference path of `script` stays under BOUND while its naive path exceeds it
    (the control that shows the measurement can see an [N, V] buffer)."""
    ours = _increase(script, "reference_path")
    naive = _increase(script, "naive_path")
    mb = 1 / 2**20
    assert naive > BOUND, f"control: naive path grew only {naive * mb:.1f} MB; the measurement sees nothing"
    assert ours < BOUND, (
        f"{what} grew RSS by {ours * mb:.1f} MB; "
        f"bound {BOUND * mb:.0f} MB = 1/4 of one [N, V] fp32 ({NV_BYTES * mb:.0f} MB)"
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")
def test_linear_reference_never_allocates_n_by_v():
    _assert_bounded(_LINEAR, "reference linear_token_logprobs forward+backward")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")
def test_token_reference_inplace_backward_never_allocates_n_by_v():
    # The logits are an input here: the bound is on what forward + backward add to them.
    # With inplace_backward=True the gradient reuses the logits' storage.
    _assert_bounded(_TOKEN, "reference token_logprobs forward+backward (inplace)")
