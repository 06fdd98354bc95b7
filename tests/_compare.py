"""The accuracy criterion every kernel test uses.

fp32: within 1e-5 of the float64 reference (absolute, plus 1e-5 relative).
fp16 / bf16: no worse than PyTorch in the same dtype, plus a small margin: the error
of ours against the float64 reference is at most MARGIN x PyTorch's error plus a tiny
floor (PyTorch's error can be exactly 0 on easy inputs).
"""
from __future__ import annotations

from typing import Optional

import torch

MARGIN = 1.5


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    return float((x.double() - ref.double()).abs().max())


def assert_close_to_ref(
    ours: torch.Tensor,
    ref64: torch.Tensor,
    torch_same_dtype: Optional[torch.Tensor] = None,
    *,
    input_dtype: torch.dtype = torch.float32,
    name: str = "value",
) -> None:
    """Assert `ours` is as accurate as the criterion above demands.

    ours: our result; ref64: the float64 reference; torch_same_dtype: PyTorch's result
    computed from the same low-precision inputs (required for fp16/bf16 inputs).
    """
    assert ours.shape == ref64.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref64.shape)}"
    assert not torch.isnan(ours).any(), f"{name}: NaN in result"
    scale = 1.0 + (float(ref64.abs().max()) if ref64.numel() else 0.0)
    err = max_err(ours, ref64)
    if input_dtype in (torch.float32, torch.float64):
        tol = 1e-5 * scale
        assert err <= tol, f"{name}: fp32 error {err:.3e} > {tol:.3e}"
        return
    assert torch_same_dtype is not None, f"{name}: low-precision check needs PyTorch's result"
    torch_err = max_err(torch_same_dtype, ref64)
    tol = MARGIN * torch_err + 1e-6 * scale
    assert err <= tol, f"{name}: error {err:.3e} > {MARGIN} x PyTorch's {torch_err:.3e} (+floor)"
