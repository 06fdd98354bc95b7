"""linear_token_logprobs with the lm_head sharded on the vocabulary (tensor parallel).

The weight (and bias) is a DTensor Shard(0) on a 1-D mesh of K ranks: rank r holds
the vocabulary rows [o_r, o_r + V_r) (torch's chunking: uneven shards included).
hidden [N, D] and targets [N] are the same on every rank (the decoder's replicated
output, as after torch's ColwiseParallel / RowwiseParallel blocks). Nothing of size
[N, V] and no gathered weight exists anywhere: each rank runs the op's own kernels
(`_forward_splits`, `_backward_op` of linear_token_logprobs.py) or the reference on
its rows, and the ranks exchange per-row statistics.

Forward, per row, rank r's shard gives (over its columns j, s_j = inv_T z_j)
    m_r = max_j s_j,   l_r = sum_j e^(s_j - m_r),   a_r = sum_j e^(s_j - m_r) (s_j - m_r),
    t_r = s_target if the target is in the shard, else 0
(the kernel's per-split statistics merged over the rank's splits in order). Then
    M = max_r m_r                                              (all-reduce MAX, [N])
    L = sum_r e^(m_r - M) l_r,  A = sum_r e^(m_r - M) (a_r + (m_r - M) l_r),  T = sum_r t_r
                                            (all-gather of [3, N], added in rank order)
    logp = (T - M) - log L,   H = log L - A / L,
the one-device merge of linear_token_logprobs.py with ranks for splits. Every rank
gets the same M, L, A, T, so the same logp and H (plain tensors).

Backward. The loss is computed the same on every rank (upstream g_logp, g_H equal on
every rank), and with lse = M + log L and H global, rank r's columns get exactly the
one-device gradient (formula above the backward kernels):
    dz_j = inv_T (g_logp (onehot_j - p_j) - g_H p_j (s_j - lse + H)),  p_j = e^(s_j - lse)
(times the soft cap's slope), so
    d_weight[o_r + j] = dr_j^T hidden        (the local rows: a Shard(0) DTensor)
    d_bias[o_r + j]   = sum over rows of dr_j
    d_hidden          = sum_r dr_r @ weight_r (all-reduce SUM, [N, D]).
The kernels' backward takes the global M, log L and H in place of the local ones;
targets outside the shard become OUTSIDE (no column matches: onehot = 0).

Support (`support=`, support.py): the same [N] threshold or [N, ceil(V / 32)] bitmask on
every rank, read at global token ids (rank r's column j is token o_r + j; o_r need not
be a multiple of 32), so every rank drops its own columns outside the kept set and the
sums above run over the kept set.

Communication per call, per row: forward an all-reduce of 4 bytes (M) and an
all-gather of 12 bytes (L, A, T; 8 without the entropy) from each rank; backward
d_hidden's D elements of hidden's dtype summed over the ranks as a reduce-scatter
(an all-to-all) and an all-gather, 2 (K - 1) / K of them sent per rank, the traffic of a
ring all-reduce. Determinism and batch invariance for a fixed group size: each rank
merges its splits in order, and every sum over the ranks (the statistics, d_hidden) is
added in rank order by the rank that owns it and then gathered: the same bits on every
rank, each element's value independent of the other rows and of N (an all-reduce's
ring cuts the message by its size, so with 3 or more ranks its order of addition
would follow N). The MAX is exact. So a row's logp, entropy and d_hidden row do not
depend on the rest of the batch, as on one device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple, Union

import torch

from . import reference
from ._utils import (FLOAT_DTYPES, autocast_dtype, check_targets, check_tensor, compute_dtype, device_guard,
                     is_dtensor, nan_where_out_of_range, no_autocast, resolve_kernel_backend)
from .linear_token_logprobs import (Tiles, _backward_op, _forward_splits, _int32_safe_columns, _Launch,
                                    register_vocab_parallel)
from .logit_transform import LogitTransform
from .support import check_support, reference_mask
from .tiles import launch_tiles

# Local targets: ignored rows and targets outside this rank's shard (negative: no column index).
LOCAL_IGNORE = -1
OUTSIDE = -2


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows [offset, offset + size) of a vocabulary of `vocab` rows, sharded
    over `group`."""

    group: Any  # torch.distributed ProcessGroup
    offset: int
    size: int
    vocab: int

    @staticmethod
    def of(name: str, t: Any) -> "VocabShard":
        """The shard of a DTensor Shard(0) on a 1-D mesh (ValueError naming `name` otherwise)."""
        from torch.distributed.tensor import Shard

        if not is_dtensor(t) or t.device_mesh.ndim != 1 or list(t.placements) != [Shard(0)]:
            how = f"a DTensor with placements {tuple(t.placements)} on a {t.device_mesh.ndim}-D mesh" if is_dtensor(t) \
                else f"a {type(t).__name__}"  # fmt: skip
            raise ValueError(f"{name} must be a DTensor sharded Shard(0) on a 1-D mesh (the vocabulary split "
                             f"over a tensor-parallel group) when the weight is one, got {how}")
        mesh = t.device_mesh
        k, r, vocab = mesh.size(), mesh.get_local_rank(), t.shape[0]
        chunk = -(-vocab // k)  # torch's Shard(0): ceil-sized chunks, the last ones short or empty
        offset = min(r * chunk, vocab)
        size = min(chunk, vocab - offset)
        if t.to_local().shape[0] != size:
            raise ValueError(f"{name}: this rank holds {t.to_local().shape[0]} rows, expected {size} of {vocab}")
        return VocabShard(mesh.get_group(), offset, size, vocab)

    def local_targets(self, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        """targets [N] -> this shard's column of each target, OUTSIDE when another rank holds
        it, LOCAL_IGNORE for ignored rows."""
        inside = (targets >= self.offset) & (targets < self.offset + self.size)
        local = torch.where(inside, targets - self.offset, torch.full_like(targets, OUTSIDE))
        return torch.where(targets == ignore_index, torch.full_like(targets, LOCAL_IGNORE), local)


def _all_reduce(t: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """t reduced over the group in place ("max" or "sum")."""
    import torch.distributed as dist

    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return t


def _sum_rows_in_rank_order(t: torch.Tensor, group: Any) -> torch.Tensor:
    """sum_r t_r of [N, D] partials over the group, each element added in rank order (the
    same bits on every rank, and a row's sum independent of N): a reduce-scatter by rows
    done as an all-to-all (rank q receives every rank's partial of row block q and adds
    them in rank order), then an all-gather of the blocks. As much traffic as a ring
    all-reduce (2 (K - 1) / K of the tensor per rank), none of its size-dependent order."""
    import torch.distributed as dist

    k, n = dist.get_world_size(group), t.shape[0]
    per = -(-n // k)
    send = t.new_zeros(per * k, *t.shape[1:])
    send[:n] = t
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    blocks = recv.view(k, per, *t.shape[1:])
    total = blocks[0]
    for block in blocks[1:]:
        total = total + block
    parts = [torch.empty_like(total) for _ in range(k)]
    dist.all_gather(parts, total.contiguous(), group=group)
    return torch.cat(parts)[:n]


def _sum_in_rank_order(t: torch.Tensor, group: Any) -> torch.Tensor:
    """sum_r t_r over the group, added in rank order on every rank (an all-gather of t):
    the same bits on every rank whatever the collective's algorithm, and each element's
    sum depends on that element alone (an all-reduce's ring cuts the message by its size,
    so with 3 or more ranks an element's order of addition would depend on N)."""
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


# ---------------------------------------------------------------------- forward


def _merge_splits(stats: torch.Tensor) -> torch.Tensor:
    """[4, splits, N] per-split (m, l, a, t) -> [4, N] over the splits, visited in order
    (the merge kernel's formula; elementwise steps only, so a row's result depends on its
    own statistics)."""
    m_all = stats[0].amax(dim=0)  # exact whatever the order
    m_use = torch.where(m_all == float("-inf"), torch.zeros_like(m_all), m_all)
    l_all, a_all, t_all = (torch.zeros_like(m_all) for _ in range(3))
    for m_k, l_k, a_k, t_k in zip(*stats.unbind(0)):
        scale = torch.exp(m_k - m_use)
        l_all = l_all + scale * l_k
        a_all = a_all + scale * (a_k + torch.where(l_k > 0, m_k - m_use, torch.zeros_like(m_k)) * l_k)
        t_all = t_all + t_k
    # m_all, not m_use: a row with no token in this shard (all outside its support) is m = -inf,
    # l = 0, so that it never sets the group's max (_combine)
    return torch.stack([m_all, l_all, a_all, t_all])


def _kernel_stats(launch: _Launch, want_entropy: bool) -> torch.Tensor:
    """This shard's [4, N] (m, l, a, t) per row from the kernels (0 in ignored rows)."""
    compact = _merge_splits(_forward_splits(launch, want_entropy))  # [4, N] at compact positions
    rows = torch.zeros_like(compact)
    rows[:, launch.order] = compact  # positions past n_valid (unwritten) land on ignored rows
    return torch.where((launch.targets != LOCAL_IGNORE)[None], rows, 0.0)


def _scaled_rows(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], transform: LogitTransform,
                 inv_t: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(s, slope) of a chunk of rows x [c, D] in the reference: s = inv_T z [c, V_r] and the
    soft cap's dz/draw (None without one)."""
    raw = x @ w.T
    if b is not None:
        raw = raw + b
    z, slope = transform.cap(raw)
    return z * inv_t[:, None], slope


def _reference_stats(hidden, w, b, tgt, transform, want_entropy: bool, support, offset: int) -> torch.Tensor:
    """This shard's [4, N] (m, l, a, t) per row in plain PyTorch, in row chunks (0 in ignored rows),
    over the support when given (this shard's column j is token offset + j)."""
    work = compute_dtype(hidden.dtype)
    out = torch.zeros(4, hidden.shape[0], dtype=work, device=hidden.device)
    rows = (tgt != LOCAL_IGNORE).nonzero().squeeze(1)
    w, b = w.to(work), b.to(work) if b is not None else None
    step = reference.chunk_rows_for(w.shape[0], reference.LINEAR_CHUNK_ELEMENTS)
    for a0 in range(0, rows.numel(), step):
        r = rows[a0:a0 + step]
        s, _ = _scaled_rows(hidden[r].to(work), w, b, transform, transform.inv_t[r].to(work))
        s = reference_mask(s, s, support, r, tgt[r], offset)
        m = s.amax(dim=1)  # -inf where no token of the shard is in the row's support
        m_use = torch.where(m == float("-inf"), torch.zeros_like(m), m)[:, None]
        e = torch.exp(s - m_use)
        t = tgt[r]
        out[0, r], out[1, r] = m, e.sum(dim=1)
        if want_entropy:
            # p log p = 0 where s = -inf (a token outside the support): no 0 * -inf (a NaN logit stays NaN)
            out[2, r] = (e * (s - m_use).masked_fill_(s == float("-inf"), 0.0)).sum(dim=1)
        at = s.gather(1, t.clamp(min=0).long()[:, None]).squeeze(1)
        out[3, r] = torch.where(t >= 0, at, torch.zeros_like(at))
    return out


def _combine(local: torch.Tensor, valid: torch.Tensor, group: Any, want_entropy: bool) -> Tuple[torch.Tensor, ...]:
    """This shard's [4, N] (m, l, a, t) -> (logp, entropy, M, log L) of the whole vocabulary,
    the same on every rank (an all-reduce MAX, an all-gather of [3, N]; module docstring)."""
    m, l, a, t = local.unbind(0)
    big = _all_reduce(m.clone(), "max", group)
    scale = torch.exp(m - big)  # 0 for an empty shard (m = -inf)
    shifted = torch.where(l > 0, (m - big) * l, torch.zeros_like(l))
    parts = [scale * l, t] + ([scale * (a + shifted)] if want_entropy else [])
    total = _sum_in_rank_order(torch.stack(parts), group)
    zero = torch.zeros_like(big)
    log_l = torch.log(torch.where(valid, total[0], torch.ones_like(big)))
    logp = torch.where(valid, (total[1] - big) - log_l, zero)
    entropy = torch.where(valid, log_l - total[2] / torch.where(valid, total[0], 1.0), zero) if want_entropy else None
    return logp, entropy, torch.where(valid, big, zero), log_l


# ---------------------------------------------------------------------- backward


def _reference_grads(hidden, w, b, tgt, transform, stats, g_logp, g_entropy, need, support,
                     offset: int) -> List[Optional[torch.Tensor]]:
    """(d_hidden, d_weight, d_bias) of this shard in plain PyTorch, from the global M, log L
    and H (stats [3, N]; formula in the module docstring), in row chunks."""
    work = compute_dtype(hidden.dtype)
    rows = (tgt != LOCAL_IGNORE).nonzero().squeeze(1)
    wk, bk = w.to(work), b.to(work) if b is not None else None
    d_hidden = torch.zeros_like(hidden) if need[0] else None
    d_weight = torch.zeros_like(wk)
    d_bias = torch.zeros_like(bk) if bk is not None else None
    step = reference.chunk_rows_for(w.shape[0], reference.LINEAR_CHUNK_ELEMENTS)
    for a0 in range(0, rows.numel(), step):
        r = rows[a0:a0 + step]
        x, inv_t = hidden[r].to(work), transform.inv_t[r].to(work)
        s, slope = _scaled_rows(x, wk, bk, transform, inv_t)
        s = reference_mask(s, s, support, r, tgt[r], offset)
        shift, log_l, entropy = (v[r].to(work)[:, None] for v in stats.unbind(0))
        log_p = (s - shift) - log_l
        p = torch.exp(log_p)
        g = g_logp[r].to(work)[:, None]
        coef = -g * p
        if g_entropy is not None:
            coef = coef - g_entropy[r].to(work)[:, None] * torch.where(p > 0, p * (log_p + entropy), 0.0)
        t = tgt[r].long()[:, None]
        coef = coef + torch.where(torch.arange(s.shape[1], device=s.device)[None, :] == t, g, 0.0)
        dr = coef * inv_t[:, None] if slope is None else coef * inv_t[:, None] * slope
        if d_hidden is not None:
            d_hidden[r] = (dr @ wk).to(hidden.dtype)
        d_weight.addmm_(dr.T, x)
        if d_bias is not None:
            d_bias += dr.sum(dim=0)
    return [d_hidden, d_weight.to(w.dtype) if need[1] else None,
            d_bias.to(b.dtype) if d_bias is not None and need[2] else None]  # fmt: skip


# ---------------------------------------------------------------------- the op


@dataclass(frozen=True)
class _Call:
    """What one call's forward and backward share besides tensors."""

    shard: VocabShard
    softcap: Optional[float]
    logit_scale: Optional[float]
    unit: bool
    want_entropy: bool
    use_triton: bool
    tiles: Tiles


def _local_stats(call: _Call, hidden, w, b, tgt, transform, support) -> Tuple[torch.Tensor, Optional[_Launch]]:
    """This shard's [4, N] (m, l, a, t), and the kernels' launch (None on the reference)."""
    if w.shape[0] == 0:  # more ranks than vocabulary rows: an empty shard adds nothing
        dtype = torch.float32 if call.use_triton else compute_dtype(hidden.dtype)
        stats = torch.zeros(4, hidden.shape[0], dtype=dtype, device=hidden.device)
        stats[0] = float("-inf")
        return stats, None
    if not call.use_triton:
        return _reference_stats(hidden, w, b, tgt, transform, call.want_entropy, support, call.shard.offset), None
    launch = _Launch.build(hidden, w, b, tgt, transform, LOCAL_IGNORE, call.tiles, support, call.shard.offset)
    return _kernel_stats(launch, call.want_entropy), launch


class _VocabParallel(torch.autograd.Function):
    """hidden [N, D] (the same on every rank), this rank's weight rows [V_r, D] and bias
    [V_r], local targets [N], the support (None, or the whole vocabulary's, support.py) ->
    logp [N], entropy [N] (or [0]) of the whole vocabulary."""

    @staticmethod
    def forward(ctx, hidden, w, b, tgt, support, transform: LogitTransform, call: _Call):
        valid = tgt != LOCAL_IGNORE
        with torch.no_grad(), no_autocast(hidden.device), device_guard(hidden.device):  # backward: _backward_op's
            local, launch = _local_stats(call, hidden, w, b, tgt, transform, support)
            logp, entropy, shift, log_l = _combine(local, valid, call.shard.group, call.want_entropy)
        stats = torch.stack([shift, log_l, entropy if entropy is not None else log_l])  # fp32 on the kernels
        order = launch.order if launch is not None else tgt.new_empty(0, dtype=torch.int64)
        n_valid = launch.n_valid if launch is not None else tgt.new_empty(0, dtype=torch.int64)
        ctx.save_for_backward(hidden, w, b, tgt, support, stats, order, n_valid)
        ctx.transform, ctx.call = transform, call
        ctx.set_materialize_grads(False)
        return logp, entropy if entropy is not None else logp.new_empty(0)

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, w, b, tgt, support, stats, order, n_valid = ctx.saved_tensors
        call, transform = ctx.call, ctx.transform
        need = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2]]
        g_entropy = g_entropy if call.want_entropy else None
        if (g_logp is None and g_entropy is None) or not any(need) or w.shape[0] == 0:
            grads = [torch.zeros_like(hidden) if need[0] else None, torch.zeros_like(w) if need[1] else None,
                     torch.zeros_like(b) if need[2] else None]  # fmt: skip
        else:
            if g_logp is None:
                g_logp = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
            with no_autocast(hidden.device):
                grads = _shard_grads(call, transform, hidden, w, b, tgt, support, stats, order, n_valid, g_logp,
                                     g_entropy, need)  # fmt: skip
        if need[0]:  # every rank's columns add to d_hidden
            grads[0] = _sum_rows_in_rank_order(grads[0], call.shard.group)
        return grads[0], grads[1], grads[2], None, None, None, None


def _shard_grads(call, transform, hidden, w, b, tgt, support, stats, order, n_valid, g_logp, g_entropy, need):
    """[d_hidden (this shard's part), d_weight rows, d_bias rows], None where not needed."""
    if not call.use_triton:
        return _reference_grads(hidden, w, b, tgt, transform, stats, g_logp, g_entropy, need, support,
                                call.shard.offset)
    entropy = stats[2] if g_entropy is not None else stats[2].new_empty(0)
    grads = _backward_op(
        hidden, w, b, tgt, transform.inv_t, support, stats[:2].contiguous(), order, n_valid, entropy.contiguous(),
        g_logp, g_entropy, softcap=call.softcap, logit_scale=call.logit_scale, unit=call.unit,
        ignore_index=LOCAL_IGNORE, use_triton=True, tiles=call.tiles.as_list(), need=need,
        support_offset=call.shard.offset,
    )
    return [g if want else None for g, want in zip(grads, need)]


def _local_operands(hidden, weight, bias) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], VocabShard]:
    """(hidden, weight's local rows, bias's local rows or None, the shard), checked
    (ValueError naming the argument). The local rows come through DTensor.to_local, so
    their gradients arrive as Shard(0) DTensors of the same rows (no communication)."""
    shard = VocabShard.of("weight", weight)
    if bias is not None:
        if VocabShard.of("bias", bias) != shard or bias.device_mesh != weight.device_mesh:
            raise ValueError("bias must be sharded like weight: Shard(0) on the same mesh")
    if is_dtensor(hidden):
        from torch.distributed.tensor import Replicate

        if any(p != Replicate() for p in hidden.placements):
            raise ValueError(f"hidden must be the same on every rank of the weight's group (a plain tensor or a "
                             f"replicated DTensor), got placements {tuple(hidden.placements)}")
        hidden = hidden.to_local()
    w, b = weight.to_local(), bias.to_local() if bias is not None else None
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    amp = autocast_dtype(hidden.device)
    if amp is not None:  # as linear_token_logprobs: cast as autocast casts a linear layer's operands
        hidden, w, b = (t.to(amp) if t is not None and t.dtype != torch.float64 else t for t in (hidden, w, b))
    check_tensor("weight", w, ndim=2, dtypes=(hidden.dtype,), device=hidden.device)
    if bias is not None:
        check_tensor("bias", b, ndim=1, dtypes=(hidden.dtype,), device=hidden.device)
    if w.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight has D = {w.shape[1]} columns but hidden has D = {hidden.shape[1]}")
    return hidden, w, b, shard


def vocab_parallel_linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    inv_temperature: Union[None, float, torch.Tensor] = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    softcap: Optional[float] = None,
    logit_scale: Optional[float] = None,
    backend: str = "auto",
    validate: bool = True,
    tiles: Optional[Tiles] = None,
    support: Optional[torch.Tensor] = None,
):
    """linear_token_logprobs (same arguments, same results) with weight [V, D] (and bias
    [V]) a DTensor Shard(0) on a 1-D mesh; hidden [N, D] and targets [N] the same on
    every rank, and so is `support` (the whole vocabulary's). Returns plain tensors, the same on every rank: logp [N] (and entropy
    [N]). Gradients: d_hidden summed over the group (whole on every rank), d_weight and
    d_bias Shard(0) DTensors of this rank's rows. Under autocast the operands are cast
    as on one device. The collectives run eagerly (not inside a torch.compile graph)."""
    hidden, w, b, shard = _local_operands(hidden, weight, bias)
    n = hidden.shape[0]
    check_targets(targets, n, shard.vocab, ignore_index, hidden.device, validate=validate)
    transform = LogitTransform.build(inv_temperature, n, hidden.device, softcap=softcap, logit_scale=logit_scale,
                                     validate=validate)  # fmt: skip
    support = check_support(support, n, shard.vocab, hidden.device, validate=validate)
    if tiles is not None and not isinstance(tiles, Tiles):
        raise ValueError(f"tiles must be None or a Tiles, got {type(tiles).__name__}")
    use_triton = resolve_kernel_backend(backend, {"hidden": hidden}) == "triton"
    if use_triton:  # as on one device: a strided view copied once, saved for the backward
        hidden, w = _int32_safe_columns(hidden), _int32_safe_columns(w)
    call = _Call(shard, transform.softcap, transform.logit_scale, transform.unit, bool(return_entropy), use_triton,
                 tiles or launch_tiles("linear_token_logprobs", hidden, hidden.shape[1], w.shape[0]))  # fmt: skip
    logp, entropy = _VocabParallel.apply(hidden, w, b, shard.local_targets(targets.contiguous(), ignore_index),
                                         support, transform, call)  # fmt: skip
    logp = nan_where_out_of_range(logp, targets, shard.vocab, ignore_index, validate)
    return (logp, entropy) if return_entropy else logp


register_vocab_parallel(vocab_parallel_linear_token_logprobs)  # linear_token_logprobs hands DTensor weights here
