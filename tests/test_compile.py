"""Ahead-of-time compile of the row kernels for Hopper (sm_90), no GPU needed.

The interpreter forgives what the compiler does not (loop-carried values that change
type, scalar/tensor mix-ups, unsupported casts), so every kernel of segment_sum and
weighted_k3 is compiled to PTX with the installed Triton in a subprocess without
TRITON_INTERPRET (tests/_aot.py). token_logprobs and linear_token_logprobs are compiled
for six architectures, with their resources checked, by tests/test_tiles.py.
"""
from _aot import run_aot

_AOT = r"""
import importlib, json
from _aot import compile_ptx

ss = importlib.import_module("erpo_kernels.segment_sum")
wk = importlib.import_module("erpo_kernels.weighted_k3")

done = []
for dt in ("bf16", "fp32"):
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
    done = run_aot(_AOT)
    assert len(done) == 4, done
