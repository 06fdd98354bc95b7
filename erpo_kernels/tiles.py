"""Launch configurations ("tiles") of the ops' Triton kernels, per GPU architecture.

`default_tiles(op, dtype, capability)` is what each op launches with on a device of that
compute capability (`tiles=` overrides it): tiles that fit the architecture's shared memory
per block, spill no register and put the dots on its
tensor cores (mma.sync on sm_80 / 86 / 89 / 120, wgmma on sm_90, tcgen05 on sm_100),
checked for every kernel by compiling it ahead of time (`python -m bench aot`,
tests/test_tiles.py). An architecture not in the table gets the most conservative tiles
(those of the 99 KB parts), never an error; so do CPU tensors (the interpreter).

A tile choice changes the order of a row's sums, so results depend on it; it never depends
on the batch (N): a row's results stay batch invariant. A tuning file written by
`python -m bench tune` on a GPU (erpo_kernels.tuning) may name faster tiles for that GPU,
dtype, D and V; it is read only where the op is called without `tiles=`.
"""
from __future__ import annotations

import functools
from dataclasses import astuple, dataclass, fields, replace
from typing import Dict, List, Optional, Tuple, Union

import torch

from . import tuning


def _check_power_of_two(owner: str, name: str, value: object, low: int, high: Optional[int] = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and not value & (value - 1)
    if not ok or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{owner}.{name} must be a power of two {bound}, got {value!r}")


@dataclass(frozen=True)
class Tiles:
    """Launch configuration of linear_token_logprobs' kernels (`tiles=`; default_tiles per GPU).

    The logit tiles (block_n x block_v, block_d at a time, num_warps, num_stages) are
    shared by the forward and the backward's recompute on purpose: the backward must
    reproduce the forward's logits bit for bit. A tile computed with another shape can
    differ by an ulp of the logit, and near p = 1 the gradient g (onehot - p) is a
    difference of nearly equal numbers: an ulp at |s| ~ 400 (3e-5) then becomes a 3e-5
    gradient error where the true value is ~0. Both process the vocabulary in chunks of
    `split_tiles` vocabulary tiles (the forward: one program per (row tile, chunk); the
    backward: one pair of launches per chunk, its workspace [N, split_tiles * block_v]):
    the chunks depend on V and this configuration only, never on the batch, so that a
    row's results do not either (batch invariance). The backward's products on a chunk
    run on gemm_warps warps (gemm_stages pipeline stages): d_weight in [gemm_v, gemm_d]
    tiles over the rows, d_hidden in [gemm_n, gemm_d] tiles over the chunk's columns,
    both gemm_k at a time. Block sizes are powers of two >= 16 (tl.dot); num_stages
    (software pipelining of the loads) changes no result. gemm_engine: who runs the two
    products of erpo_loss's fused path (fused_linear_loss.py) and of the op's own
    backward: 0 our Triton product kernel
    (gemm_* tiles), 1 torch matmuls (cuBLAS on a GPU: the input dtype's operands, fp32
    accumulation); `python -m bench tune` may record either per GPU. kept_block_v: the
    logit tile width of erpo_loss's kept-logit forward (fused_linear_loss.py; 0: block_v),
    with the op's block_n, block_d, warps and stages over the same vocabulary chunks
    (split_tiles * block_v columns, in whole tiles of its own): that forward is never recomputed,
    so it need not match the backward's tiles, and a wider tile loads fewer bytes per FLOP
    (Tiles.kept_forward).
    """

    block_n: int = 64
    block_v: int = 128
    block_d: int = 32
    num_warps: int = 8
    split_tiles: int = 32
    gemm_n: int = 128
    gemm_v: int = 128
    gemm_d: int = 128
    gemm_warps: int = 8
    gemm_k: int = 32
    num_stages: int = 3
    gemm_stages: int = 3
    gemm_engine: int = 0
    kept_block_v: int = 0

    def __post_init__(self) -> None:
        if self.gemm_engine not in (0, 1) or isinstance(self.gemm_engine, bool):
            raise ValueError(f"Tiles.gemm_engine must be 0 (Triton) or 1 (torch matmuls), got {self.gemm_engine!r}")
        for name in ("block_n", "block_v", "block_d", "gemm_n", "gemm_v", "gemm_d", "gemm_k"):
            _check_power_of_two("Tiles", name, getattr(self, name), 16)
        for name in ("num_warps", "gemm_warps"):
            _check_power_of_two("Tiles", name, getattr(self, name), 1, 32)
        for name in ("split_tiles", "num_stages", "gemm_stages"):
            k = getattr(self, name)
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(f"Tiles.{name} must be an int >= 1, got {k!r}")
        if self.kept_block_v != 0:
            _check_power_of_two("Tiles", "kept_block_v", self.kept_block_v, 16)

    def kept_forward(self) -> "Tiles":
        """The tiles of erpo_loss's kept-logit forward and of the gradient formed from its
        kept logits: block_v = kept_block_v over chunks of split_tiles * block_v columns
        rounded up to whole tiles of kept_block_v (self when kept_block_v is 0 or block_v)."""
        if self.kept_block_v in (0, self.block_v):
            return self
        chunk = self.split_tiles * self.block_v
        return replace(self, block_v=self.kept_block_v, split_tiles=-(-chunk // self.kept_block_v), kept_block_v=0)

    def as_list(self) -> List[int]:
        """The fields in order, as a custom op takes them (Tiles(*tiles) rebuilds it)."""
        return [getattr(self, f.name) for f in fields(self)]


@dataclass(frozen=True)
class RowTiles:
    """Launch configuration of token_logprobs' row kernels (`tiles=`): one program per row,
    streaming the row in blocks of at most `fwd_max_block_v` (forward) and
    `bwd_max_block_v` (backward) columns; small vocabularies use one block of
    next_power_of_2(V). A row's results depend on this choice (the order of its sums),
    never on the other rows.

    Defaults: forward 8192 columns with 4 warps (64 values per thread; sm_90: 8 warps,
    32 per thread, see default_tiles); backward 4096
    columns with 8 warps (16 per thread: it has no reductions, and fewer registers keep
    more rows in flight). At 32 and at 16 values per thread the forward spilled 8 B (a
    64-bit value ptxas saves around the row loop) on sm_80, 86, 89 and 100, and at 64 on
    sm_90 in fp16; these defaults spill nothing (95 registers on sm_80 with the entropy
    and a soft cap). The three block reductions per step also cost less per
    value the more values a thread holds (sm_90 SASS at 32 per thread: ~13 instructions
    per bf16 logit with the entropy, ~10 without; ~15.5 and ~12 at 16). V = 151,936 takes
    19 forward and 38 backward steps. They use a few hundred bytes of shared memory (the
    block reductions). Tests pass tiny blocks to run several per row.
    """

    fwd_max_block_v: int = 8192
    bwd_max_block_v: int = 4096
    fwd_values_per_thread: int = 64
    bwd_values_per_thread: int = 16

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_power_of_two("RowTiles", f.name, getattr(self, f.name), 1)

    def as_list(self) -> List[int]:
        """The four sizes, as a custom op takes them (RowTiles(*sizes) rebuilds it)."""
        return list(astuple(self))


OPS = ("linear_token_logprobs", "token_logprobs")
OpTiles = Union[Tiles, RowTiles]
Capability = Tuple[int, int]

# Shared memory per block (the opt-in maximum) by compute capability, bytes (CUDA
# programming guide, "Technical Specifications per Compute Capability").
SHARED_MEMORY_PER_BLOCK: Dict[Capability, int] = {
    (8, 0): 166_912, (8, 6): 101_376, (8, 9): 101_376, (9, 0): 232_448, (10, 0): 232_448, (12, 0): 101_376,
}
# The tensor-core instruction (SASS) each architecture's dots must compile to.
TENSOR_CORE_INSTRUCTION: Dict[Capability, str] = {
    (8, 0): "HMMA", (8, 6): "HMMA", (8, 9): "HMMA", (9, 0): "HGMMA", (10, 0): "UTCHMMA", (12, 0): "HMMA",
}

# Every default below compiles with no register spill (STACK 0 in `cuobjdump -res-usage`)
# for every kernel of both ops in every variant, erpo_loss's kept-logit forward and the
# bitmask support included (python -m bench aot, tests/test_tiles.py). The logit kernels
# form a tile of block_v >= 128 columns as parts of 64 or more (two, or four from 256) from
# one loop over D and run the epilogue part after part (linear_token_logprobs._logit_dots):
# the L2 traffic of the whole tile, the epilogue's temporaries of one part.
#
# The 99 KB parts (sm_86 / 89 / 120: A10, A40, L4, L40S, RTX 30xx-50xx), also what an
# unknown architecture and the interpreter get: 64 x 128 logit tiles, 128 x 128 product
# tiles, 32 deep, 3 stages (48 KB in the products, 24 KB in the logit kernels).
_SMALL = Tiles()
# sm_120: 64 x 64 logit tiles (one part; 32 FLOP per L2 byte against 43 at 64 x 128) in 2
# stages: at 64 x 128 the kept-logit forward with every option and a bitmask spilled 48 B in 3
# stages, 24 B in 2 (16 deep 16 B; on 4 warps 120 B; 64 x 256 96-192 B in every variant);
# 32 x 128 (26 FLOP per byte) also spills nothing. The chunk is 2048 columns (32 tiles of 64).
_SM120 = replace(_SMALL, block_v=64, num_stages=2)
# fp32 runs FMA dots (input_precision="ieee", no tensor cores): 32 x 64 tiles on 4 warps,
# 16 deep, on every architecture (at 64 x 64 on 4 warps the forwards spilled 8-32 B on
# sm_80-120, on 8 warps ptxas held them at 128 registers and spilled 8-16 B).
_FP32 = Tiles(block_n=32, block_v=64, block_d=16, num_warps=4, gemm_n=64, gemm_v=64, gemm_d=64, gemm_k=16)
# A100 (163 KB): 128 x 128 product tiles, 32 deep. The logit kernels keep the 99 KB parts'
# 64 x 128 tiles (43 FLOP per L2 byte), 16 deep in 4 stages: at 32 deep the kept-logit
# forward with a bitmask support spilled 8-32 B in 2-4 stages (and at 128 x 128 8 B).
_SM80 = replace(_SMALL, block_d=16, num_stages=4)
# Hopper (227 KB, 9 TB/s of L2 against ~1 PFLOP/s): 128 x 128 tiles for the logits and the
# products, 64 deep, 8 warps (2 warpgroups of 64 x 64 wgmma per logit part), 3 stages: 96 KB
# of shared memory, 64 FLOP per byte through the L2. 128 x 256 logit tiles (85 FLOP per
# byte, four parts) still spill 8-64 B on 8 warps (128 accumulators a thread beside the
# epilogue's) and 24-192 B on 16 (128 registers a thread); 256 x 128 (two parts) 8-424 B in bf16
# (the kept-logit forward 424, the recompute 80-112); the products' read-add-write of
# d_hidden 280 B. The chunk is 4096 columns (32 tiles of 128).
# erpo_loss's kept-logit forward, never recomputed, has its own 128 x 256 tiles (kept_block_v,
# over the same 4096-column chunks): 85 FLOP per L2 byte, one 128 x 256 wgmma per D step whose
# accumulator the epilogue takes in four parts of 64 (linear_token_logprobs._logit_dots; four
# dots of 64 staged the hidden tile four times: 21 FLOP per shared-memory byte, which bound the
# modelled time), 144 KB of shared memory in 3 stages, and no spill in any of its 24 option
# combinations since the target logit is a per-row dot after the tiles
# (linear_token_logprobs._target_logits); with the epilogue's column gather, 17 of them spilled.
# erpo_loss's fused-path products run on cuBLAS (gemm_engine 1): the L2-charged model
# (bench/cost_model.py) counts a cuBLAS GEMM at 85.3 FLOP per L2 byte against 64 for our
# spill-free 128 x 128 Triton product tiles, and Hopper's products are L2-bound at either
# (compute-bound needs ~110); `python -m bench tune` on a GPU records the faster engine.
# The fp32 tiles keep our products: torch's fp32 matmuls turn to TF32 under
# torch.backends.cuda.matmul.allow_tf32, ours never do.
_SM90 = Tiles(block_n=128, block_v=128, block_d=64, num_warps=8, split_tiles=32,
              gemm_n=128, gemm_v=128, gemm_d=128, gemm_k=64, gemm_warps=8, gemm_engine=1,
              kept_block_v=256)  # fmt: skip
# Blackwell's tcgen05 (accumulators in tensor memory) takes 4 or 8 warps in Triton: with 16
# the dots fall back to mma.sync. The logit tiles are Hopper's 128 x 128; the products keep
# 128 x 256 tiles (85 FLOP per L2 byte), their d_hidden summed in two column halves
# (_dhidden_tile): 144 KB of shared memory. The kept-logit forward stays at 128 x 128: at
# 128 x 256 as four dots of 64 ptxas held its bias-only combination at 128 registers and
# spilled 40 B; as one dot split in four (Hopper's) all 24 combinations spilled 240-1432 B.
_SM100 = replace(_SM90, gemm_d=256, gemm_engine=0, kept_block_v=0)
_LINEAR: Dict[Capability, Dict[str, Tiles]] = {
    (8, 0): {"lowp": _SM80, "fp32": _FP32},
    (8, 6): {"lowp": _SMALL, "fp32": _FP32},
    (8, 9): {"lowp": _SMALL, "fp32": _FP32},
    (9, 0): {"lowp": _SM90, "fp32": _FP32},
    (10, 0): {"lowp": _SM100, "fp32": _FP32},
    (12, 0): {"lowp": _SM120, "fp32": _FP32},
}
CONSERVATIVE: Dict[str, Tiles] = {"lowp": _SMALL, "fp32": _FP32}
_ROW_SM90 = RowTiles(fwd_values_per_thread=32)
ARCHITECTURES: Tuple[Capability, ...] = tuple(_LINEAR)


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")


def default_tiles(op: str, dtype: torch.dtype, capability: Optional[Capability]) -> OpTiles:
    """The tiles `op` ("linear_token_logprobs" -> a Tiles, "token_logprobs" -> a RowTiles)
    launches with for `dtype` inputs on a GPU of compute capability (major, minor);
    None or an architecture not in the table: the most conservative tiles."""
    _check_op(op)
    if op == "token_logprobs":
        # sm_90 spilled 8 B at 64 values per thread in fp16 (none at 32); the others at 32 (none at 64)
        return _ROW_SM90 if capability is not None and tuple(capability) == (9, 0) else RowTiles()
    table = _LINEAR.get(tuple(capability) if capability is not None else None, CONSERVATIVE)  # type: ignore[arg-type]
    return table["fp32" if dtype in (torch.float32, torch.float64) else "lowp"]


def device_capability(device: torch.device) -> Optional[Capability]:
    """(major, minor) of a CUDA device; None elsewhere (CPU tensors: the interpreter)."""
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


@functools.lru_cache(maxsize=None)
def _device_tiles(op: str, device: torch.device, dtype: torch.dtype, d: int, v: int) -> OpTiles:
    cap = device_capability(device)
    if cap is not None:
        cls = Tiles if op == "linear_token_logprobs" else RowTiles
        tuned = tuning.tuned_tiles(op, torch.cuda.get_device_name(device), dtype, d, v, cls)
        if tuned is not None:
            return tuned
    return default_tiles(op, dtype, cap)


def launch_tiles(op: str, tensor: torch.Tensor, d: int, v: int) -> OpTiles:
    """The tiles `op` launches with on `tensor`'s device and dtype at D = d (0 for
    token_logprobs) and V = v without `tiles=`: the tuning file's entry for that GPU, else
    default_tiles. Never a function of N; fixed for the process (forward and backward agree)."""
    device = tensor.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _device_tiles(op, device, tensor.dtype, int(d), int(v))


__all__ = ["ARCHITECTURES", "OPS", "RowTiles", "SHARED_MEMORY_PER_BLOCK", "TENSOR_CORE_INSTRUCTION", "Tiles",
           "default_tiles", "device_capability", "launch_tiles"]
