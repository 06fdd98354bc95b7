"""Ahead-of-time compile of the row kernels for Hopper (sm_90), no GPU needed.

The interpreter forgives what the compiler does not (loop-carried values that change
type, scalar/tensor mix-ups, unsupported casts), so every kernel of token_logprobs,
segment_sum and weighted_k3 is compiled to PTX with the installed Triton in a
subprocess without TRITON_INTERPRET. (linear_token_logprobs has its own compile test,
which also checks tensor-core use.)
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_AOT = r"""
import importlib, json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

tlp = importlib.import_module("erpo_kernels.token_logprobs")
ss = importlib.import_module("erpo_kernels.segment_sum")
wk = importlib.import_module("erpo_kernels.weighted_k3")


def compile_ptx(fn, types, consts, num_warps=4):
    sig = {}
    for i, a in enumerate(fn.arg_names):
        if a in consts:
            sig[a] = "constexpr"
        else:
            sig[a] = types.get(a, "*fp32" if a.endswith("_ptr") else "i32")
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]


done = []
for dt in ("bf16", "fp32"):
    compile_ptx(tlp._token_logprobs_fwd_kernel, {"logits_ptr": "*" + dt, "targets_ptr": "*i64", "stride_row": "i64"},
                dict(RETURN_ENTROPY=True, BLOCK_V=8192), num_warps=8)
    done.append("token_logprobs fwd " + dt)
    compile_ptx(tlp._token_logprobs_bwd_kernel,
                {"logits_ptr": "*" + dt, "grad_ptr": "*" + dt, "targets_ptr": "*i64"},
                dict(HAS_LOGP_GRAD=True, HAS_ENTROPY_GRAD=True, INTERPRET=False, BLOCK_V=4096), num_warps=8)
    done.append("token_logprobs bwd " + dt)
    compile_ptx(ss._segment_sum_fwd_kernel, {"values_ptr": "*" + dt, "cu_ptr": "*i64", "out_ptr": "*" + dt},
                dict(IS_FP64=False, INTERPRET=False, BLOCK=1024))
    compile_ptx(ss._segment_sum_bwd_kernel, {"grad_out_ptr": "*" + dt, "cu_ptr": "*i64", "grad_values_ptr": "*" + dt},
                dict(BLOCK=1024))
    done.append("segment_sum " + dt)
    t = {"logp_ptr": "*" + dt, "ref_ptr": "*" + dt, "w_ptr": "*" + dt, "c": "fp32", "ec1": "fp32", "k3c": "fp32"}
    compile_ptx(wk._weighted_k3_fwd_kernel, t, dict(HAS_WEIGHT=True, BLOCK=1024))
    compile_ptx(wk._weighted_k3_bwd_kernel, dict(t, dlogp_ptr="*" + dt, dref_ptr="*" + dt, dw_ptr="*" + dt),
                dict(HAS_WEIGHT=True, INTERPRET=False, BLOCK=1024))
    done.append("weighted_k3 " + dt)
print(json.dumps(done))
"""


def test_row_kernels_compile_for_hopper():
    try:
        from triton.backends import backends
    except ImportError:
        backends = {}
    if "nvidia" not in backends:
        pytest.skip("this Triton build has no NVIDIA backend to compile for")
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", _AOT], capture_output=True, text=True, env=env, cwd=repo, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(done) == 8, done
