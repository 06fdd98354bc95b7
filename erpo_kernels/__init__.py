"""erpo_kernels: fused Triton ops for the loss path of RL fine-tuning with large vocabularies.

Every op has a Triton forward and backward, and a memory-bounded PyTorch reference
(`erpo_kernels.reference`) that `backend="auto"` uses where Triton cannot run.
Everything a user (or erpo's trainer) needs is importable from here; the modules whose
names start with "_" are private.
"""
from . import reference
from ._triton import HAS_TRITON, interpreting
from ._utils import BACKENDS, check_backend, resolve_backend
from .linear_token_logprobs import linear_token_logprobs
from .objective import (
    ALGORITHMS,
    LOSS_AGGS,
    POLICY_LOSSES,
    ROLLOUT_IS,
    LossConfig,
    LossNormalizers,
    MicroBatch,
    PackedLossBatch,
    TokenLoss,
    combine_metrics,
    entropy_threshold,
    erpo_loss,
    erpo_loss_from_logp,
    metrics_to_floats,
    plan_micro_batches,
    prompt_logp_sums,
    query_kl_value,
    query_logp_from_logp,
    response_entropies,
    register_policy_loss,
    split_batch,
)
from .segment_sum import segment_sum
from .support import pack_support, support_from_token_ids, support_words, unpack_support
from .tiles import RowTiles, Tiles, default_tiles
from .token_logprobs import token_logprobs
from . import vocab_parallel  # noqa: F401,E402  registers linear_token_logprobs' path for a sharded weight
from .weighted_k3 import MAX_GUARD, weighted_k3

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "BACKENDS",
    "HAS_TRITON",
    "LOSS_AGGS",
    "POLICY_LOSSES",
    "MAX_GUARD",
    "ROLLOUT_IS",
    "LossConfig",
    "LossNormalizers",
    "MicroBatch",
    "PackedLossBatch",
    "RowTiles",
    "Tiles",
    "TokenLoss",
    "check_backend",
    "combine_metrics",
    "default_tiles",
    "entropy_threshold",
    "erpo_loss",
    "erpo_loss_from_logp",
    "interpreting",
    "linear_token_logprobs",
    "metrics_to_floats",
    "pack_support",
    "plan_micro_batches",
    "prompt_logp_sums",
    "query_kl_value",
    "query_logp_from_logp",
    "reference",
    "response_entropies",
    "register_policy_loss",
    "resolve_backend",
    "segment_sum",
    "split_batch",
    "support_from_token_ids",
    "support_words",
    "token_logprobs",
    "unpack_support",
    "weighted_k3",
]
