"""A faster Triton interpreter for the tests, with the same results.

Triton's interpreter (3.9) patches triton.language (`interpreter._patch_lang`: an
inspect.getmembers of four modules, about 1 ms) when a kernel launches, and again at
every call of a @triton.jit helper inside the kernel, though the helper's `tl` is the
same module the launch has already patched and restores when it ends (a helper whose
module holds another language module, triton.language.core in Triton's own standard
library, still patches that one once per launch). In the linear
op's kernels, which call helpers inside their loops, those repeated patches were about
30% of the interpreted time (measured: 25 of 80 s in a batch-invariance test). Here a
helper called inside a launch skips them; a launch, and a helper called outside any
launch, still patch as before. The kernels run the same interpreted operations, so
every result is the same bits.
"""
from __future__ import annotations


def skip_repeated_language_patches() -> bool:
    """Install the shortcut (once per process); False where this Triton has no such
    internals (then nothing changes)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    executor = getattr(interpreter, "GridExecutor", None)
    patch = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if executor is None or patch is None or scope_type is None or getattr(patch, "_erpo_tests", False):
        return False
    import inspect

    import triton.language as tl

    state = {"launches": 0, "patched": set()}  # the language modules patched in this launch
    langs_of = {}  # fn -> the language modules its globals hold (what _patch_lang patches for it)
    launch = executor.__call__

    def counted_launch(self, *args, **kwargs):
        state["launches"] += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            state["launches"] -= 1
            if state["launches"] == 0:
                state["patched"] = set()

    def patch_once_per_launch(fn):
        if fn not in langs_of:
            langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                     if inspect.ismodule(v) and v in (tl, tl.core))  # fmt: skip
        if state["launches"] and langs_of[fn] <= state["patched"]:
            return scope_type()  # nothing to restore: the launch's own patches hold until it ends
        scope = patch(fn)
        if state["launches"]:
            state["patched"] |= langs_of[fn]
        return scope

    patch_once_per_launch._erpo_tests = True
    patch_once_per_launch.original, counted_launch.original = patch, launch
    executor.__call__ = counted_launch
    interpreter._patch_lang = patch_once_per_launch
    convert = getattr(interpreter, "_convert_float", None)
    if convert is not None:
        interpreter._convert_float = bf16_fp32_by_shifts(convert)
    return True


def bf16_fp32_by_shifts(convert):
    """The interpreter's bf16 <-> fp32 casts (`_convert_float`: field by field, with a loop over
    mantissa bits whenever an element has a zero exponent, as every masked-out 0 does: about
    27 ms a tile, most of a bf16 test's time) as the 16-bit shift they are for every element
    but the nonzero subnormals, which still go through `convert` (it rounds them its own way).
    Each element's result depends on that element only, so the bits are the interpreter's
    (tests/test_launch_safety.py checks every bf16 value and a sample of fp32 ones)."""
    import numpy as np
    import triton.language as tl

    def convert_by_shifts(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.bfloat16 and output_dtype == tl.float32:
            bits = np.frombuffer(input.tobytes(), dtype=np.uint16).reshape(input.shape)
            out = bits.astype(np.uint32) << 16
            odd = ((bits & 0x7F80) == 0) & ((bits & 0x7F) != 0)
        elif input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rounding_mode is None:
            bits = np.frombuffer(input.tobytes(), dtype=np.uint32).reshape(input.shape)
            out = (bits >> 16).astype(np.uint16)
            odd = ((bits & 0x7F800000) == 0) & ((bits & 0x7FFFFF) != 0)
        else:
            return convert(input, input_dtype, output_dtype, rounding_mode)
        if odd.any():
            out[odd] = convert(input[odd], input_dtype, output_dtype, rounding_mode)
        return out

    convert_by_shifts._erpo_tests = True
    convert_by_shifts.original = convert
    return convert_by_shifts
