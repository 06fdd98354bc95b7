"""Ahead-of-time compilation of Triton kernels for Hopper (sm_90), no GPU needed.

The interpreter forgives what the compiler does not (loop-carried values that change
type, scalar/tensor mix-ups, unsupported casts), so tests compile kernels to PTX with
the installed Triton in a subprocess without TRITON_INTERPRET (set by conftest for
this process): `run_aot(script)` runs a script that imports `compile_ptx` from here
and prints one JSON line, and returns that JSON.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Sequence

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def compile_ptx(
    fn: Any, types: Dict[str, str], consts: Dict[str, Any], num_warps: int = 4, divisible: Sequence[str] = ()
) -> str:
    """PTX of the @triton.jit kernel `fn` for sm_90. types: argument -> Triton type
    ("*bf16", "i64", "fp32", ...; pointers default to "*fp32", scalars to "i32");
    consts: the constexpr arguments; divisible: arguments known to be multiples of 16
    (16-byte aligned pointers, sizes), as the JIT specializes them at launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {
        a: "constexpr" if a in consts else types.get(a, "*fp32" if a.endswith("_ptr") else "i32")
        for a in fn.arg_names
    }
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible if a not in consts}
    src = ASTSource(
        fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]


def spilled_bytes(ptx: str) -> int:
    """Bytes of register spill stores + loads ptxas reports for `ptx` on sm_90 (the ptxas
    Triton itself uses for that target)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        log = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(src), "-o", str(Path(tmp) / "kernel.o")],
            capture_output=True, text=True, check=True,
        ).stderr
    return sum(int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log))


def run_aot(script: str, timeout: float = 600) -> Any:
    """Run `script` in a compiling (not interpreting) subprocess; the JSON of its last line."""
    try:
        from triton.backends import backends
    except ImportError:
        backends = {}
    if "nvidia" not in backends:
        pytest.skip("this Triton build has no NVIDIA backend to compile for")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
