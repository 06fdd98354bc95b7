"""The objective's metrics that are not a term's own (the weights, the response length,
the entropy), their transfer to the host, and their combination across micro-batches.

Every metric is this batch's share of the mini-batch's value: keys ending in "max" or
"min" combine across micro-batches by max / min, every other key by sum.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch

from .batch import PackedLossBatch, raise_failed_check
from .rows import LossRows


def batch_metrics(
    rows: LossRows, batch: PackedLossBatch, entropy: Optional[torch.Tensor]
) -> Dict[str, torch.Tensor]:
    """weights/ess (of the mini-batch, split over its micro-batches in proportion to their
    sequences), weights/min and weights/max (over the queries with a sequence here),
    response_length/mean and, given entropy [N], entropy/mean over the scored response rows."""
    with torch.no_grad():
        n_sequences = rows.normalizers.n_sequences.to(rows.dtype)
        local_sequences = torch.full((), batch.num_sequences, dtype=rows.dtype, device=rows.logp.device)
        w, w_mass, w_sq_mass = rows.weights, rows.weight_mass, rows.weight_sq_mass
        present = torch.zeros(batch.num_queries, dtype=torch.bool, device=w.device).index_fill_(0, rows.group_index, True)
        metrics = {
            "weights/ess": w_mass * w_mass / (rows.n_queries * w_sq_mass) * (local_sequences / n_sequences),
            "weights/min": torch.where(present, w, torch.full_like(w, math.inf)).min(),
            "weights/max": torch.where(present, w, torch.full_like(w, -math.inf)).max(),
            "response_length/mean": rows.layout.response_length.to(rows.dtype).sum() / n_sequences,
        }
        if entropy is not None:
            metrics["entropy/mean"] = torch.where(rows.response, entropy.detach().to(rows.dtype), rows.zeros).sum() / rows.n_tokens
    return metrics


def metrics_out(
    metrics: Dict[str, torch.Tensor], checks: Optional[List[Tuple[str, torch.Tensor]]], sync_metrics: bool
) -> Dict[str, Union[float, torch.Tensor]]:
    """The metrics as python floats in one transfer that also carries the value checks'
    flags (raising the first failed check's ValueError), or as 0-d tensors without
    sync_metrics and while torch.compile traces (a graph hands no floats to Python)."""
    if not sync_metrics or torch.compiler.is_compiling():
        return metrics
    if not checks:
        return metrics_to_floats(metrics)
    values = list(metrics.values()) + [c.to(next(iter(metrics.values())).dtype) for _, c in checks]
    host = torch.stack([v.reshape(()) for v in values]).tolist()  # the one transfer
    raise_failed_check(checks, host[len(metrics):])
    return dict(zip(metrics.keys(), host[: len(metrics)]))


def combine_metrics(parts: Iterable[Mapping[str, Union[float, torch.Tensor]]]) -> Dict[str, Union[float, torch.Tensor]]:
    """The mini-batch's metrics from its micro-batches' (erpo_loss with the mini-batch's
    normalizers): keys ending in "max" by max, "min" by min, every other key by sum.
    Works on python floats and on 0-d tensors (no host sync for tensors). A key missing
    from some parts is combined over the parts that have it."""
    out: Dict[str, Union[float, torch.Tensor]] = {}
    for part in parts:
        for key, value in part.items():
            if key not in out:
                out[key] = value
            elif key.endswith("max"):
                out[key] = torch.maximum(out[key], value) if isinstance(value, torch.Tensor) else max(out[key], value)
            elif key.endswith("min"):
                out[key] = torch.minimum(out[key], value) if isinstance(value, torch.Tensor) else min(out[key], value)
            else:
                out[key] = out[key] + value
    return out


def metrics_to_floats(metrics: Mapping[str, Union[float, torch.Tensor]]) -> Dict[str, float]:
    """Python floats from 0-d tensor metrics in one device-to-host transfer."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    if keys:
        dtype = torch.float64 if any(metrics[k].dtype == torch.float64 for k in keys) else torch.float32
        values = torch.stack([metrics[k].detach().to(dtype).reshape(()) for k in keys]).tolist()  # the one transfer
        out.update(zip(keys, values))
    return {k: out[k] for k in metrics}
