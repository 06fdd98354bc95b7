"""tests/_interpreter_speed.py changes how fast Triton's interpreter runs, never what it
computes: its bf16 <-> fp32 casts give the interpreter's own bits for every bf16 value and
a sample of fp32 ones, and an op run with the shortcuts gives the same bits as without."""
import numpy as np
import pytest
import torch

from erpo_kernels import interpreting, linear_token_logprobs

pytestmark = pytest.mark.skipif(not interpreting(), reason="the interpreter's shortcuts: a CUDA device is present")


def _installed():
    from triton.runtime import interpreter

    if not getattr(interpreter._patch_lang, "_erpo_tests", False):
        pytest.skip("this Triton's interpreter has no such internals: tests/_interpreter_speed.py changed nothing")
    return interpreter


def test_bf16_fp32_casts_are_the_interpreters_bits():
    import triton.language as tl

    interpreter = _installed()
    fast, plain = interpreter._convert_float, interpreter._convert_float.original
    every_bf16 = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    assert np.array_equal(fast(every_bf16, tl.bfloat16, tl.float32, None),
                          plain(every_bf16, tl.bfloat16, tl.float32, None))  # fmt: skip
    rng = np.random.default_rng(0)
    edges = np.arange(2**16, dtype=np.uint32)  # around 0, the subnormals, the largest finite, inf and NaN
    fp32 = np.concatenate([rng.integers(0, 2**32, 2**18, dtype=np.uint64).astype(np.uint32), edges,
                           edges | np.uint32(0x7F7F0000), edges | np.uint32(0x7F800000), edges | np.uint32(0x80000000)])
    x = fp32.view(np.float32).reshape(-1, 64)
    assert np.array_equal(fast(x, tl.float32, tl.bfloat16, None), plain(x, tl.float32, tl.bfloat16, None))


def test_an_op_gives_the_same_bits_without_the_shortcuts(monkeypatch):
    # bf16 through the linear op (helpers called inside loops, bf16 <-> fp32 casts), forward
    # and backward, with the shortcuts and with the interpreter as Triton ships it
    interpreter = _installed()

    def run():
        g = torch.Generator().manual_seed(3)
        h = torch.randn(9, 24, generator=g).bfloat16().requires_grad_()
        w = (torch.randn(70, 24, generator=g) * 0.5).bfloat16().requires_grad_()
        t = torch.randint(0, 70, (9,), generator=g)
        logp, ent = linear_token_logprobs(h, w, t, return_entropy=True, softcap=5.0, backend="triton")
        return [logp, ent, *torch.autograd.grad(logp.sum() - ent.sum(), (h, w))]

    fast = run()
    monkeypatch.setattr(interpreter, "_patch_lang", interpreter._patch_lang.original)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", interpreter.GridExecutor.__call__.original)
    monkeypatch.setattr(interpreter, "_convert_float", interpreter._convert_float.original)
    plain = run()
    for a, b in zip(fast, plain):
        assert torch.equal(a, b)
