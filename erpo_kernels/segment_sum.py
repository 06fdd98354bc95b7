"""segment_sum: per-segment sums over packed sequences (cu_seqlens), backward a gather.

Kernels, then the custom ops (torch.library, autograd registered), then the public function.
"""
from __future__ import annotations

import torch

from . import reference
from ._triton import interpreting, round_to, tl, triton
from ._utils import FLOAT_DTYPES, check_cu_seqlens, check_tensor, device_guard, no_autocast, resolve_backend


# Elements each program reads or writes per loop step. A segment longer than this
# (a 32k-token sequence) is walked in several steps by the same program.
BLOCK = 1024


@triton.jit
def _segment_sum_fwd_kernel(
    values_ptr,  # [N] fp16/bf16/fp32/fp64, contiguous
    cu_ptr,  # [S + 1] int32/int64, non-decreasing, within [0, N]
    out_ptr,  # [S] values' dtype
    IS_FP64: tl.constexpr,  # accumulate in fp64 (fp64 input) instead of fp32
    INTERPRET: tl.constexpr,  # running in Triton's CPU interpreter
    BLOCK: tl.constexpr,
):
    # One program per segment s: out[s] = sum(values[cu[s]:cu[s + 1]]); 0 when empty.
    seg = tl.program_id(0).to(tl.int64)
    start = tl.load(cu_ptr + seg).to(tl.int64)
    end = tl.load(cu_ptr + seg + 1).to(tl.int64)
    if IS_FP64:
        acc = tl.zeros([BLOCK], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
    lanes = tl.arange(0, BLOCK)
    for off in range(start, end, BLOCK):
        idx = off + lanes
        x = tl.load(values_ptr + idx, mask=idx < end, other=0.0)
        acc += x.to(acc.dtype)
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + seg, round_to(total, out_ptr.dtype.element_ty, INTERPRET))


# Backward of out[s] = sum_{cu[s] <= i < cu[s+1]} values[i]:
#     d values[i] = g[s]  for the segment s with cu[s] <= i < cu[s + 1]
#     d values[i] = 0     for i < cu[0] or i >= cu[S] (outside every segment)
# Segments are contiguous (cu is non-decreasing), so [0, N) splits into the head
# [0, cu[0]), the S segments, and the tail [cu[S], N). Programs 0..S-1 write g[s] over
# their segment, program S zero-fills the head and program S + 1 the tail: every
# element is written exactly once, with no separate memset.
@triton.jit
def _segment_sum_bwd_kernel(
    grad_out_ptr,  # [S] upstream gradient, contiguous
    cu_ptr,  # [S + 1] int32/int64
    grad_values_ptr,  # [N] values' dtype, written in full
    n_values,  # N
    n_seg,  # S
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    is_seg = pid < n_seg
    is_head = pid == n_seg
    is_tail = pid == n_seg + 1
    # segment s: [cu[s], cu[s+1]); head: [0, cu[0]); tail: [cu[S], N)
    start = tl.load(cu_ptr + tl.minimum(pid, n_seg)).to(tl.int64)
    start = tl.where(is_head, 0, start)
    end = tl.load(cu_ptr + tl.where(is_seg, pid + 1, 0)).to(tl.int64)
    end = tl.where(is_tail, n_values, end)
    g = tl.load(grad_out_ptr + pid, mask=is_seg, other=0.0).to(grad_values_ptr.dtype.element_ty)
    lanes = tl.arange(0, BLOCK)
    fill = tl.zeros([BLOCK], dtype=grad_values_ptr.dtype.element_ty) + g
    for off in range(start, end, BLOCK):
        idx = off + lanes
        tl.store(grad_values_ptr + idx, fill, mask=idx < end)


def _segment_sum_launch(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """values [N] contiguous, cu_seqlens [S + 1] contiguous -> [S] in values' dtype."""
    n_seg = cu_seqlens.numel() - 1
    out = torch.empty(n_seg, dtype=values.dtype, device=values.device)
    if n_seg == 0:
        return out
    if values.numel() == 0:  # every segment is empty
        return out.zero_()
    _segment_sum_fwd_kernel[(n_seg,)](
        values,
        cu_seqlens,
        out,
        IS_FP64=values.dtype == torch.float64,
        INTERPRET=interpreting(),
        BLOCK=BLOCK,
        num_warps=4,
    )
    return out


def _segment_gather_launch(grad_out: torch.Tensor, cu_seqlens: torch.Tensor, n_values: int) -> torch.Tensor:
    """grad_out [S] contiguous -> [N]: grad_out[s] over segment s, 0 outside every segment."""
    n_seg = cu_seqlens.numel() - 1
    grad_values = torch.empty(n_values, dtype=grad_out.dtype, device=grad_out.device)
    if n_values == 0:
        return grad_values
    _segment_sum_bwd_kernel[(n_seg + 2,)](grad_out, cu_seqlens, grad_values, n_values, n_seg, BLOCK=BLOCK, num_warps=4)
    return grad_values


# The Triton path as torch.library custom ops (fake implementations for shapes,
# autograd registered): torch.compile(fullgraph=True) traces a call without a graph
# break, and the kernels run as they are. The sum's backward is the gather and the
# gather's backward the sum, so the op is twice differentiable.
@torch.library.custom_op("erpo_kernels::segment_sum", mutates_args=())
def _segment_sum_op(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """values [N] -> [S] per-segment sums (Triton)."""
    with device_guard(values.device):
        return _segment_sum_launch(values.contiguous(), cu_seqlens.contiguous())


@_segment_sum_op.register_fake
def _segment_sum_fake(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return values.new_empty(cu_seqlens.shape[0] - 1)


@torch.library.custom_op("erpo_kernels::segment_gather", mutates_args=())
def _segment_gather_op(grad_out: torch.Tensor, cu_seqlens: torch.Tensor, n_values: int) -> torch.Tensor:
    """g [S] -> [N], g[s] over segment s (Triton); the adjoint of erpo_kernels::segment_sum."""
    with device_guard(grad_out.device):
        return _segment_gather_launch(grad_out.contiguous(), cu_seqlens.contiguous(), n_values)


@_segment_gather_op.register_fake
def _segment_gather_fake(grad_out: torch.Tensor, cu_seqlens: torch.Tensor, n_values: int) -> torch.Tensor:
    return grad_out.new_empty(n_values)


def _segment_sum_setup(ctx, inputs, output) -> None:
    values, cu_seqlens = inputs
    ctx.save_for_backward(cu_seqlens)
    ctx.n_values = values.shape[0]


def _segment_sum_backward(ctx, grad_out: torch.Tensor):
    (cu_seqlens,) = ctx.saved_tensors
    return _segment_gather_op(grad_out, cu_seqlens, ctx.n_values), None


def _segment_gather_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[1])


def _segment_gather_backward(ctx, grad_grad: torch.Tensor):
    (cu_seqlens,) = ctx.saved_tensors
    return _segment_sum_op(grad_grad, cu_seqlens), None, None


_segment_sum_op.register_autograd(_segment_sum_backward, setup_context=_segment_sum_setup)
_segment_gather_op.register_autograd(_segment_gather_backward, setup_context=_segment_gather_setup)


def _segment_sum_triton(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return _segment_sum_op(values, cu_seqlens)


def segment_sum(
    values: torch.Tensor, cu_seqlens: torch.Tensor, *, backend: str = "auto", validate: bool = True
) -> torch.Tensor:
    """Sum `values` over each segment [cu_seqlens[s], cu_seqlens[s + 1]).

    Args:
        values: [N] float (fp16/bf16/fp32/fp64).
        cu_seqlens: [S + 1] int32/int64, non-decreasing, starting at 0 and ending at N:
            the segments cover every value (S = 0 needs cu_seqlens = [0] and N = 0).
        backend: "auto", "triton" or "torch".
        validate: check cu_seqlens' values (start, end, monotone). The check reads
            them on the host (a device sync); pass False in a hot loop once the batch
            has been validated. Rank, dtype and device are always checked.
    Returns:
        [S] in values' dtype, accumulated in fp32 (fp64 for fp64 values); empty
        segments give 0. The gradient of each value is the upstream gradient of its
        segment. Autocast does not change the computation.
    """
    check_tensor("values", values, ndim=1, dtypes=FLOAT_DTYPES)
    check_cu_seqlens(cu_seqlens, values.shape[0], values.device, covers=True, validate=validate)
    if resolve_backend(backend, values) == "torch":
        return reference.segment_sum(values, cu_seqlens)
    with no_autocast(values.device):
        return _segment_sum_triton(values, cu_seqlens)
