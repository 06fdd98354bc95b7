"""Optional Triton import.

`import erpo_kernels` must work on machines without Triton (the reference path then
serves). Op files import `triton` and `tl` from here; when Triton is missing they are
stand-ins that let the kernel definitions parse but can never launch (the dispatch in
`_utils.resolve_backend` refuses `backend="triton"` first).
"""
from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on machines without triton
    HAS_TRITON = False

    class _Missing:
        """Absorbs `triton.jit`, `tl.constexpr`, ... so kernel definitions still parse."""

        def __getattr__(self, name: str) -> "_Missing":
            return self

        def __call__(self, *args, **kwargs):
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return args[0]  # used as a bare decorator: keep the function
            return self

    triton = tl = _Missing()


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """x (fp32, or fp64 when dtype is fp64) -> dtype, rounding to nearest even.

    Compiled code rounds so already. Triton's CPU interpreter (3.9) truncates
    fp32 -> bf16 instead, which would make bf16 results up to one ulp off under test;
    there the bits are rounded by hand. Every kernel that stores a
    low-precision result goes through it.
    """
    if INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            y = x.to(dtype)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def soft_cap(x, cap, scale_over_cap):
    """(cap * tanh(x * scale_over_cap), 1 - tanh^2) in fp32: the Gemma-2 soft cap of the
    logits x * scale (scale_over_cap = logit_scale / cap) and its derivative with
    respect to x * scale.

    tanh(a) = sign(a) (1 - e) / (1 + e) and 1 - tanh(a)^2 = 4 e / (1 + e)^2 with
    e = exp(-2 |a|) in (0, 1]: no overflow, no cancellation in the derivative, and
    a = -inf (a masked logit) gives -cap with derivative 0, as torch.tanh does.
    """
    a = x * scale_over_cap
    e = tl.exp(-2.0 * tl.abs(a))
    one_plus_e = 1.0 + e
    t = (1.0 - e) / one_plus_e
    t = tl.where(a < 0, -t, t)
    return cap * t, 4.0 * e / (one_plus_e * one_plus_e)


__all__ = ["triton", "tl", "HAS_TRITON", "interpreting", "round_to", "soft_cap"]
