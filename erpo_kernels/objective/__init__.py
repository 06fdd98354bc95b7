"""The objective of docs/method.md: ERPO (or GRPO) loss and metrics of a packed batch.

Plain PyTorch over the fused ops of erpo_kernels (segment_sum, weighted_k3,
linear_token_logprobs); the pieces are listed in loss.py's docstring. Everything public
is re-exported by erpo_kernels.
"""
from .batch import LossNormalizers, PackedLossBatch
from .config import ALGORITHMS, LOSS_AGGS, ROLLOUT_IS, LossConfig
from .entropy import entropy_threshold, response_entropies
from .loss import erpo_loss, erpo_loss_from_logp
from .metrics import combine_metrics, metrics_to_floats
from .micro_batches import MicroBatch, plan_micro_batches, split_batch
from .policy_losses import POLICY_LOSSES  # registers the variants
from .query_kl import prompt_logp_sums, query_kl_value, query_logp_from_logp
from .registry import TokenLoss, register_policy_loss

__all__ = [
    "ALGORITHMS",
    "LOSS_AGGS",
    "POLICY_LOSSES",
    "ROLLOUT_IS",
    "LossConfig",
    "LossNormalizers",
    "MicroBatch",
    "PackedLossBatch",
    "TokenLoss",
    "combine_metrics",
    "entropy_threshold",
    "erpo_loss",
    "erpo_loss_from_logp",
    "metrics_to_floats",
    "plan_micro_batches",
    "prompt_logp_sums",
    "query_kl_value",
    "query_logp_from_logp",
    "response_entropies",
    "register_policy_loss",
    "split_batch",
]
