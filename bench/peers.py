"""The implementations `bench kernels` compares: ours and the baselines a user would otherwise pick.

Every peer is wrapped to the same contract, so the harness treats them alike:

    token_logprobs:        fn(logits [N, V], targets [N]) -> logp [N] fp32, differentiable in logits
    linear_token_logprobs: fn(hidden [N, D], weight [V, D], targets [N]) -> logp [N] fp32,
                           differentiable in hidden and weight

Cross-entropy peers return the loss -logp; the wrapper negates it (one [N] op). A peer is
used only where its package imports (and, for Triton/CUDA-only peers, on CUDA); otherwise
the results file lists it as absent with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .measure import import_optional, package_version

TOKEN = "token_logprobs"
LINEAR = "linear_token_logprobs"
OPS = (TOKEN, LINEAR)

# Rows per chunk of the TRL-style selective log-softmax: TRL loops over the batch
# dimension, one sequence at a time; a 1024-token sequence is the stand-in here.
TRL_CHUNK_ROWS = 1024

Inputs = Dict[str, torch.Tensor]


@dataclass(frozen=True)
class Peer:
    name: str
    label: str
    ops: Tuple[str, ...]
    dist: Optional[str]  # distribution whose version is recorded (None: part of torch / this repo)
    cuda_only: bool
    module: Optional[str]  # module that must import for the peer to be present
    fn: Callable[[str, Inputs], torch.Tensor]

    def absent_reason(self, device: str) -> Optional[str]:
        """None when usable on `device`, else why not."""
        if self.cuda_only and device != "cuda":
            return "needs CUDA (Triton kernels)"
        if self.module is not None and import_optional(self.module) is None:
            return f"not installed (import {self.module} failed)"
        return None

    def version(self) -> Optional[str]:
        return package_version(self.dist) if self.dist else None


def _logits(op: str, x: Inputs) -> torch.Tensor:
    """The [N, V] logits a non-fused peer works on: given, or hidden @ weight.T (input dtype)."""
    if op == TOKEN:
        return x["logits"]
    return x["hidden"] @ x["weight"].T


# ----------------------------------------------------------------------------- ours


def _erpo(op: str, x: Inputs) -> torch.Tensor:
    import erpo_kernels

    if op == TOKEN:
        return erpo_kernels.token_logprobs(x["logits"], x["targets"])
    return erpo_kernels.linear_token_logprobs(x["hidden"], x["weight"], x["targets"])


def _erpo_inplace(op: str, x: Inputs) -> torch.Tensor:
    import erpo_kernels

    return erpo_kernels.token_logprobs(x["logits"], x["targets"], inplace_backward=True)


# ----------------------------------------------------------------------------- PyTorch


def eager_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax in fp32 + gather: what most RL code writes."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).squeeze(1)


def _eager(op: str, x: Inputs) -> torch.Tensor:
    return eager_logprobs(_logits(op, x), x["targets"])


def _eager_ce(op: str, x: Inputs) -> torch.Tensor:
    loss = F.cross_entropy(_logits(op, x), x["targets"], reduction="none")
    return -loss.float()


_COMPILED: Dict[str, Callable] = {}


def _eager_linear(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return eager_logprobs(hidden @ weight.T, targets)


def _compile(op: str, x: Inputs) -> torch.Tensor:
    if op not in _COMPILED:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
        _COMPILED[op] = torch.compile(eager_logprobs if op == TOKEN else _eager_linear)
    if op == TOKEN:
        return _COMPILED[op](x["logits"], x["targets"])
    return _COMPILED[op](x["hidden"], x["weight"], x["targets"])


# ----------------------------------------------------------------------------- TRL (the installed trl)

# Rows per call of TRL's selective_log_softmax: it takes [batch, seq, V] and loops over the
# batch, one sequence per step; a 1024-token sequence is the stand-in here.
TRL_SEQ_ROWS = 1024
# TRL's fused LM head calls ChunkedLogProbFunction with this vocabulary chunk
# (trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in trl 1.16; read from trl when present).
TRL_VOCAB_CHUNK = 32768


def _as_sequences(logits: torch.Tensor, targets: torch.Tensor):
    """[N, V] -> [N / rows, rows, V] and [N / rows, rows], rows = TRL_SEQ_ROWS when it divides N."""
    n, v = logits.shape
    rows = TRL_SEQ_ROWS if n % TRL_SEQ_ROWS == 0 else n
    return logits.view(n // rows, rows, v), targets.view(n // rows, rows)


def _trl(op: str, x: Inputs) -> torch.Tensor:
    """trl.trainer.utils.selective_log_softmax on the logits (hidden @ weight.T for the linear op)."""
    from trl.trainer.utils import selective_log_softmax

    logits, targets = _as_sequences(_logits(op, x), x["targets"])
    return selective_log_softmax(logits, targets).reshape(-1).float()


def _trl_chunked(op: str, x: Inputs) -> torch.Tensor:
    """trl.kernels.ChunkedLogProbFunction, as TRL's fused LM head calls it (log-probs only, T = 1):
    cuBLAS tiles of [4096, chunk] logits folded by a Triton kernel on CUDA (torch ops elsewhere)."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer import utils as trl_utils

    chunk = getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", TRL_VOCAB_CHUNK)
    out = ChunkedLogProbFunction.apply(x["hidden"], x["weight"], None, x["targets"], 1.0, chunk, None, 1.0, ("log_probs",))
    return out[0]


def _trl_triton(op: str, x: Inputs) -> torch.Tensor:
    """trl.kernels.logprob_entropy.selective_log_softmax_and_entropy (Triton, log-prob and entropy in
    one pass over [batch, seq, V] logits); the entropy is computed and dropped, as the kernel always does."""
    from trl.kernels.logprob_entropy import selective_log_softmax_and_entropy

    logits, targets = _as_sequences(_logits(op, x), x["targets"])
    logp, _ = selective_log_softmax_and_entropy(logits, targets, 1.0)
    return logp.reshape(-1).float()


# ----------------------------------------------------------------------------- Liger, CCE, flash-attn


def _liger(op: str, x: Inputs) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_cross_entropy, liger_fused_linear_cross_entropy

    if op == TOKEN:
        loss = liger_cross_entropy(x["logits"], x["targets"], reduction="none")
    else:
        loss = liger_fused_linear_cross_entropy(x["hidden"], x["weight"], x["targets"], reduction="none")
    return -loss.float()


def _cce(op: str, x: Inputs) -> torch.Tensor:
    from cut_cross_entropy import linear_cross_entropy

    return -linear_cross_entropy(x["hidden"], x["weight"], x["targets"], reduction="none").float()


def _flash_attn(op: str, x: Inputs) -> torch.Tensor:
    from flash_attn.ops.triton.cross_entropy import cross_entropy_loss

    out = cross_entropy_loss(_logits(op, x), x["targets"])
    loss = out[0] if isinstance(out, tuple) else out
    return -loss.float()


# Measured in this order (the slow-to-compile torch.compile last, so a time budget cuts it first).
PEERS: List[Peer] = [
    Peer("erpo", "erpo_kernels (Triton on CUDA, chunked PyTorch reference on CPU)", OPS, None, False, None, _erpo),
    Peer("eager", "PyTorch eager: log_softmax(fp32) + gather", OPS, None, False, None, _eager),
    Peer("liger", 'Liger-Kernel cross_entropy / fused_linear_cross_entropy, reduction="none"', OPS,
         "liger-kernel", True, "liger_kernel.transformers.functional", _liger),
    Peer("cce", 'Cut Cross-Entropy linear_cross_entropy, reduction="none", default filter_eps', (LINEAR,),
         "cut-cross-entropy", True, "cut_cross_entropy", _cce),
    Peer("flash-attn", "flash-attn Triton cross_entropy_loss", OPS, "flash-attn", True,
         "flash_attn.ops.triton.cross_entropy", _flash_attn),
    Peer("eager-ce", 'PyTorch eager: F.cross_entropy(reduction="none"), input dtype', OPS, None, False, None,
         _eager_ce),
    Peer("trl", "TRL selective_log_softmax (trl.trainer.utils) on the logits", OPS, "trl", False,
         "trl.trainer.utils", _trl),
    Peer("trl-chunked", "TRL ChunkedLogProbFunction, its fused LM head's kernel (trl.kernels)", (LINEAR,), "trl",
         False, "trl.kernels", _trl_chunked),
    Peer("trl-triton", "TRL Triton selective_log_softmax_and_entropy on the logits (trl.kernels.logprob_entropy)",
         OPS, "trl", True, "trl.kernels.logprob_entropy", _trl_triton),
    Peer("erpo-inplace", "erpo_kernels, inplace_backward=True", (TOKEN,), None, False, None, _erpo_inplace),
    Peer("compile", "torch.compile of the eager log_softmax + gather", OPS, None, False, None, _compile),
]
PEER_BY_NAME = {p.name: p for p in PEERS}


def peer_label(name: str) -> str:
    return PEER_BY_NAME[name].label


def peer_versions() -> Dict[str, Optional[str]]:
    return {p.name: p.version() for p in PEERS if p.dist}
