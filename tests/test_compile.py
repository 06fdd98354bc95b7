"""Ahead-of-time compile of the row kernels for Hopper (sm_90), no GPU needed.

The interpreter forgives what the compiler does not (loop-carried values that change
type, scalar/tensor mix-ups, unsupported casts), so every kernel of token_logprobs,
segment_sum and weighted_k3 is compiled to PTX with the installed Triton in a
subprocess without TRITON_INTERPRET (tests/_aot.py). linear_token_logprobs has its own
compile test, which also checks tensor-core use.
"""
from _aot import run_aot

_AOT = r"""
import importlib, json
from _aot import compile_ptx

tlp = importlib.import_module("erpo_kernels.token_logprobs")
ss = importlib.import_module("erpo_kernels.segment_sum")
wk = importlib.import_module("erpo_kernels.weighted_k3")

done = []
for dt in ("bf16", "fp32"):
    cap = {"softcap": "fp32", "softcap_pre": "fp32", "logit_scale": "fp32"}
    for has_softcap in (False, True):
        compile_ptx(tlp._token_logprobs_fwd_kernel,
                    dict(cap, logits_ptr="*" + dt, targets_ptr="*i64", stride_row="i64"),
                    dict(RETURN_ENTROPY=True, HAS_SOFTCAP=has_softcap, BLOCK_V=8192), num_warps=8)
        compile_ptx(tlp._token_logprobs_bwd_kernel,
                    dict(cap, logits_ptr="*" + dt, grad_ptr="*" + dt, targets_ptr="*i64"),
                    dict(HAS_LOGP_GRAD=True, HAS_ENTROPY_GRAD=True, HAS_SOFTCAP=has_softcap, INTERPRET=False,
                         BLOCK_V=4096), num_warps=8)
    done.append("token_logprobs fwd " + dt)
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
    done = run_aot(_AOT)
    assert len(done) == 8, done
