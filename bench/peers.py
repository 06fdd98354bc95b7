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
from functools import lru_cache
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


# ----------------------------------------------------------------------------- TRL


def chunked_selective_log_softmax(
    logits: torch.Tensor, targets: torch.Tensor, chunk_rows: int = TRL_CHUNK_ROWS
) -> torch.Tensor:
    """TRL's selective log-softmax, rewritten from its description.

    logits [N, V], targets [N] -> logp [N] fp32. fp32/fp64 inputs: gather the target logits,
    then subtract a log-sum-exp computed one row chunk at a time. fp16/bf16 inputs: a
    log_softmax (in the input dtype) per row chunk, then gather.
    """
    n = logits.shape[0]
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(1, targets[:, None]).squeeze(1)
        lse = torch.cat([torch.logsumexp(logits[a : a + chunk_rows], dim=-1) for a in range(0, n, chunk_rows)])
        return (picked - lse).float()
    parts = [
        torch.log_softmax(logits[a : a + chunk_rows], dim=-1).gather(1, targets[a : a + chunk_rows, None])
        for a in range(0, n, chunk_rows)
    ]
    return torch.cat(parts).squeeze(1).float()


@lru_cache(maxsize=None)  # looked up once, not inside every timed call
def _trl_function() -> Optional[Callable]:
    mod = import_optional("trl.trainer.utils")
    return getattr(mod, "selective_log_softmax", None) if mod is not None else None


def _trl(op: str, x: Inputs) -> torch.Tensor:
    logits = _logits(op, x)
    fn = _trl_function()
    if fn is None:
        return chunked_selective_log_softmax(logits, x["targets"])
    n, v = logits.shape
    rows = TRL_CHUNK_ROWS if n % TRL_CHUNK_ROWS == 0 else n
    # TRL takes [batch, seq, V]; its loop runs over the batch (one sequence per step).
    out = fn(logits.view(n // rows, rows, v), x["targets"].view(n // rows, rows))
    return out.reshape(n).float()


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


def _trl_label() -> str:
    if _trl_function() is not None:
        return "TRL selective_log_softmax (imported)"
    return "TRL-style chunked selective log-softmax (reimplemented; trl not installed)"


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
    Peer("trl", "TRL selective log-softmax", OPS, "trl", False, None, _trl),
    Peer("erpo-inplace", "erpo_kernels, inplace_backward=True", (TOKEN,), None, False, None, _erpo_inplace),
    Peer("compile", "torch.compile of the eager log_softmax + gather", OPS, None, False, None, _compile),
]
PEER_BY_NAME = {p.name: p for p in PEERS}


def peer_label(name: str) -> str:
    return _trl_label() if name == "trl" else PEER_BY_NAME[name].label


def peer_versions() -> Dict[str, Optional[str]]:
    return {p.name: p.version() for p in PEERS if p.dist}
