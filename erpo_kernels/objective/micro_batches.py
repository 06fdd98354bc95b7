"""The micro-batch plan (docs/method.md section 10): a mini-batch split into micro-batches
of whole sequences, each scored with the mini-batch's LossNormalizers so that their
losses and gradients add up to the mini-batch's. Host-side work: done where the batch
is built."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

import torch

from .batch import PackedLossBatch


@dataclass
class MicroBatch:
    """One micro-batch of a mini-batch: `batch` (its rows, the mini-batch's query
    arrays), `rows` [n_k] int64 (its rows' indices in the mini-batch's row space, in
    order: index input_ids / position_ids / hidden states with it) and `sequences` (the
    mini-batch's sequence indices it holds, in order)."""

    batch: PackedLossBatch
    rows: torch.Tensor
    sequences: List[int]


def plan_micro_batches(batch: PackedLossBatch, max_rows: int) -> List[List[int]]:
    """Sequence indices of each micro-batch: whole sequences in order, packed greedily so
    that each micro-batch holds at most `max_rows` rows (0 = everything in one). A
    sequence longer than max_rows is a ValueError. Reads span_cu_seqlens on the host:
    call it where the batch is built."""
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0:
        raise ValueError(f"max_rows must be an int >= 0, got {max_rows!r}")
    cu = batch.span_cu_seqlens.tolist()
    lengths = [cu[2 * b + 2] - cu[2 * b] for b in range(batch.num_sequences)]
    if max_rows == 0:
        return [list(range(len(lengths)))]
    too_long = [b for b, n in enumerate(lengths) if n > max_rows]
    if too_long:
        b = too_long[0]
        raise ValueError(f"max_rows = {max_rows} is smaller than sequence {b} ({lengths[b]} rows); raise the budget")
    return _pack(lengths, max_rows)


def _pack(lengths: Sequence[int], max_rows: int) -> List[List[int]]:
    """Whole sequences in order, greedily, at most max_rows rows per part (each length <= max_rows)."""
    plan: List[List[int]] = []
    used = 0
    for b, n in enumerate(lengths):
        if plan and used + n <= max_rows:
            plan[-1].append(b)
            used += n
        else:
            plan.append([b])
            used = n
    return plan


def row_chunks(batch: PackedLossBatch, max_rows: int) -> Optional[List[Tuple[int, int, PackedLossBatch]]]:
    """erpo_loss's fused path: the batch as consecutive chunks of whole sequences of at most
    max_rows rows each, as (r0, r1, the chunk's batch) with rows [r0, r1) of the batch.
    Each chunk's batch is a micro-batch as split_batch makes them (the batch's query
    arrays, its rows' and sequences' fields), its row and sequence fields views (slices,
    no copies). N <= max_rows: the batch itself, reading nothing on the host. Else one
    host read of span_cu_seqlens; None when a sequence is longer than max_rows (the
    caller takes another path)."""
    n = batch.num_rows
    if n <= max_rows:
        return [(0, n, batch)]
    cu = batch.span_cu_seqlens.tolist()  # the one host read
    lengths = [cu[2 * b + 2] - cu[2 * b] for b in range(batch.num_sequences)]
    if max(lengths) > max_rows:
        return None
    out = []
    for part in _pack(lengths, max_rows):
        b0, b1 = part[0], part[-1] + 1
        r0, r1 = cu[2 * b0], cu[2 * b1]

        def rows(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t[r0:r1]

        spans = torch.tensor([c - r0 for c in cu[2 * b0 : 2 * b1 + 1]], dtype=batch.span_cu_seqlens.dtype)
        out.append((r0, r1, replace(
            batch, targets=batch.targets[r0:r1], inv_temperature=batch.inv_temperature[r0:r1],
            span_cu_seqlens=spans.to(batch.span_cu_seqlens.device), group_index=batch.group_index[b0:b1],
            advantages=batch.advantages[b0:b1], old_logp=rows(batch.old_logp), ref_logp=rows(batch.ref_logp),
            rollout_logp=rows(batch.rollout_logp), support=rows(batch.support),
        )))  # fmt: skip
    return out


def split_batch(batch: PackedLossBatch, plan: Sequence[Sequence[int]]) -> List[MicroBatch]:
    """Split a mini-batch into micro-batches of whole sequences.

    plan: the sequence indices of each micro-batch (e.g. plan_micro_batches); every
    sequence in exactly one. Each MicroBatch.batch keeps the mini-batch's query indexing
    (group_index values, ref_query_logp and query_weights [m] unchanged), so a group may
    span micro-batches and a query's prompt stays scored once: by the micro-batch that
    holds its scoring copy. Row fields (targets, inv_temperature, old_logp, ref_logp,
    rollout_logp, support) are gathered, sequence fields (group_index, advantages) selected,
    span_cu_seqlens rebuilt. Use with normalizers=LossNormalizers.of(batch). Host-side
    work: call it where the batch is built.
    """
    batch.check_structure()
    n_seq = batch.num_sequences
    flat = [int(b) for part in plan for b in part]
    if sorted(flat) != list(range(n_seq)) or any(len(part) == 0 for part in plan):
        raise ValueError(f"plan must hold every sequence 0..{n_seq - 1} exactly once, in non-empty micro-batches")
    cu = batch.span_cu_seqlens.long().cpu()
    dev = batch.targets.device
    out: List[MicroBatch] = []
    for part in plan:
        seqs = [int(b) for b in part]
        row_parts, spans = [], [0]
        for b in seqs:
            p0, p1, r1 = int(cu[2 * b]), int(cu[2 * b + 1]), int(cu[2 * b + 2])
            row_parts.append(torch.arange(p0, r1))
            spans += [spans[-1] + p1 - p0, spans[-1] + r1 - p0]
        rows = torch.cat(row_parts).to(dev)
        sel = torch.tensor(seqs, dtype=torch.long, device=dev)

        def take(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t[rows]

        micro = replace(
            batch,
            targets=batch.targets[rows],
            inv_temperature=batch.inv_temperature[rows],
            span_cu_seqlens=torch.tensor(spans, dtype=batch.span_cu_seqlens.dtype, device=dev),
            group_index=batch.group_index[sel],
            advantages=batch.advantages[sel],
            old_logp=take(batch.old_logp),
            ref_logp=take(batch.ref_logp),
            rollout_logp=take(batch.rollout_logp),
            support=take(batch.support),
        )
        out.append(MicroBatch(batch=micro, rows=rows, sequences=seqs))
    return out
