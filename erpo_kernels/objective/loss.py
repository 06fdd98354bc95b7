"""The ERPO and GRPO objectives of docs/method.md sections 2-5 as single calls, with
micro-batches (section 10) and rollout importance sampling (section 11).

One packed batch of B = sum_q G_q sequences (`prompt_b | response_b`, N rows in all)
goes in; a scalar loss and metrics come out:

    erpo_loss(hidden, weight, batch, config)   hidden states + lm_head weight
    erpo_loss_from_logp(logp, batch, config)   per-row log-probs already computed

    erpo:  L = L_PG(w_B) + alpha R_query,   R_query = sum_q w(q) k3(l_0(q) - l_theta(q)) / sum_q w(q)
    grpo:  L = L_PG(w = 1) + beta * KL,   KL = k3(ref_logp - logp) per response token,
           aggregated with the same loss_agg as L_PG (DeepSeekMath eq. 3: token-mean, or
           (1/m) sum_q (1/G_q) sum_i (1/L_i) sum_t k3 under seq-mean-token-mean)

Micro-batches. A mini-batch (one optimizer step) may be split into k micro-batches of
whole sequences (a group may span micro-batches). Every normaliser of the loss is a
mini-batch quantity, held by `LossNormalizers` (computed once, `LossNormalizers.of(mini)`)
and passed to every micro-batch's call:

    norm = LossNormalizers.of(mini)                  # T, B, m, G_q, prompt copies, sum w, sum w^2
    for micro in split_batch(mini, plan_micro_batches(mini, max_rows)):
        hidden = forward(rows micro.rows of the mini-batch)          # [n_k, D]
        loss, metrics = erpo_loss(hidden, weight, micro.batch, config, normalizers=norm)
        loss.backward()                               # gradients accumulate
        parts.append(metrics)
    metrics = combine_metrics(parts)                   # the mini-batch's metrics

The k losses sum to the one-batch loss, and their gradients to its gradient, because
every term is linear in its micro-batch's tokens and queries once the denominators are
fixed: the loss is sum_t c_t loss_t + alpha sum_q a_q k3_q with c_t and a_q built from
the normalisers only. Without `normalizers` a call normalises by its own batch
(`LossNormalizers.of(batch)`): the one-batch case.

Host syncs. Shapes, dtypes and devices are checked on every call (free). Values
(targets in range, offsets monotone, finite advantages, ...) are checked by
`PackedLossBatch.validate()` in one transfer, once: where the batch is built (on the
CPU, then `validate=False`), or by the loss. With the defaults a call reads the device
once: the metrics' transfer, which carries the value checks too; `validate=True` checks
in a transfer of its own before any kernel, and `sync_metrics=False` keeps the metrics
on the device. Under torch.compile nothing is read back.

The pieces, each in its own file of erpo_kernels/objective/, run with the caller's `backend`:
    batch.py              PackedLossBatch and its validation, its RowLayout, and
                          LossNormalizers, the mini-batch's denominators
    config.py             LossConfig and its checks
    rows.py               LossRows: what every term reads, once per call
    query_kl.py           l_theta(q) (segment_sum) and R_query (weighted_k3)
    policy_loss.py        L_PG: the clipped surrogate, its aggregation, truncated IS
    reference_kl.py       the KL to a reference (grpo's beta term, the policy_kl metric)
    metrics.py            the other metrics, their transfer and their combination
    micro_batches.py      the micro-batch plan
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Dict, List, Optional, Tuple, Union

import torch

from .._utils import FLOAT_DTYPES, check_rows, check_tensor, checking_values
from ..linear_token_logprobs import linear_token_logprobs
from ..tiles import Tiles
from .batch import LossNormalizers, PackedLossBatch, RowLayout
from .config import LossConfig
from .fused import check_fused_budget, fused_erpo_loss, fused_path_reason
from .metrics import batch_metrics, metrics_out
from .policy_loss import policy_term
from .query_kl import query_kl_metrics, query_kl_term
from .reference_kl import reference_kl_term
from .entropy import entropy_bonus, selected_tokens
from .rows import LossRows


def _check_batch_against(batch: PackedLossBatch, name: str, tensor: torch.Tensor) -> None:
    """batch.check_structure for the rows of `tensor` (hidden or logp), on its device. A
    row count that only `tensor` gets wrong (the batch's own fields agree) is named
    as the tensor's, not as the batch's first field's."""
    try:
        batch.check_structure(tensor.shape[0], tensor.device)
    except ValueError as mismatch:
        try:
            batch.check_structure(device=tensor.device)
        except ValueError:
            raise mismatch from None
        raise ValueError(f"{name} has {tensor.shape[0]} rows but the batch has N = {batch.num_rows} "
                         "(one per entry of batch.targets)") from None  # fmt: skip


def _bypass_has_rollout(batch: PackedLossBatch, config: LossConfig) -> bool:
    """bypass_mode reads old_logp as the rollout's log-probs when rollout_logp is None."""
    return config.policy_loss == "bypass_mode" and batch.old_logp is not None


def _check_inputs(
    batch: PackedLossBatch,
    config: LossConfig,
    rows: Tuple[str, torch.Tensor],
    normalizers: Optional[LossNormalizers],
    validate: Optional[bool],
    sync_metrics: bool,
    vocab_size: Optional[int] = None,
) -> Tuple[PackedLossBatch, Optional[List[Tuple[str, torch.Tensor]]]]:
    """Every check of the objective's inputs: structure always, before any kernel;
    values as `validate` and `sync_metrics` say (erpo_loss_from_logp's docstring):
    validate=True (or None without sync_metrics): now, in their own transfer; None with
    sync_metrics: returned as device flags for the metrics' transfer, with the batch
    made safe to compute on meanwhile (PackedLossBatch.made_safe); False, or while
    torch.compile traces: not at all. Returns (the batch to compute on, the flags or None)."""
    if validate is not None and not isinstance(validate, bool):
        raise ValueError(f"validate must be None, True or False, got {validate!r}")
    if not isinstance(config, LossConfig):
        raise ValueError(f"config must be a LossConfig, got {type(config).__name__}")
    config.validate()
    if not isinstance(batch, PackedLossBatch):
        raise ValueError(f"batch must be a PackedLossBatch, got {type(batch).__name__}")
    _check_batch_against(batch, *rows)
    if normalizers is not None:
        if not isinstance(normalizers, LossNormalizers):
            raise ValueError(f"normalizers must be a LossNormalizers or None, got {type(normalizers).__name__}")
        normalizers.check_structure(batch.num_queries, rows[1].device)
    if config.algorithm == "grpo" and config.beta > 0 and batch.ref_logp is None:
        raise ValueError("ref_logp is required for algorithm='grpo' with beta > 0 (set beta = 0 to drop the KL term)")
    if config.rollout_is != "none" and batch.rollout_logp is None and not _bypass_has_rollout(batch, config):
        raise ValueError(f"rollout_logp is required for rollout_is={config.rollout_is!r} (or set rollout_is='none')")
    if config.rollout_rs != "none" and batch.rollout_logp is None and not _bypass_has_rollout(batch, config):
        raise ValueError(f"rollout_logp is required for rollout_rs={config.rollout_rs!r} (or set rollout_rs='none')")
    if not checking_values(validate is not False):
        return batch, None
    if validate is None and sync_metrics:
        return batch.made_safe(vocab_size), batch.value_checks(vocab_size, normalizers)
    batch.validate(vocab_size, normalizers)
    return batch, None


def erpo_loss_from_logp(
    logp: torch.Tensor,
    batch: PackedLossBatch,
    config: LossConfig = LossConfig(),
    *,
    entropy: Optional[torch.Tensor] = None,
    backend: str = "auto",
    normalizers: Optional[LossNormalizers] = None,
    validate: Optional[bool] = None,
    sync_metrics: bool = True,
) -> Tuple[torch.Tensor, Dict[str, Union[float, torch.Tensor]]]:
    """The ERPO (or GRPO) loss of a packed batch from its per-row log-probs.

    Args:
        logp: [N] float, log pi(target) of each row (prompt rows at temperature 1,
            response rows at 1 / tau); differentiable. Rows whose target is
            ignore_index are ignored (their value does not matter, their gradient is 0).
        batch: the packed batch (PackedLossBatch): a whole mini-batch, or one
            micro-batch of it (split_batch) together with `normalizers`.
        config: LossConfig.
        entropy: [N] float or None, per-row entropy for the "entropy/mean" metric only.
        backend: "auto", "triton" or "torch", for segment_sum and weighted_k3.
        normalizers: the mini-batch's LossNormalizers when `batch` is one of its
            micro-batches; None = LossNormalizers.of(batch). With the mini-batch's
            normalisers the micro-batches' losses (and gradients) sum to the mini-batch's.
        validate: the batch's value checks (PackedLossBatch.validate: targets, offsets,
            temperatures, weights, finite advantages, ...), a ValueError naming the
            first that fails. None (the default): with sync_metrics they travel in the
            metrics' one transfer (the loss is computed on PackedLossBatch.made_safe
            meanwhile, and the error raised before anything is returned), else in their
            own transfer first: one host read per call either way. True: in their own
            transfer before any kernel (one more read). False: none; pass it when the
            batch was validated where it was built (batch.validate()).
        sync_metrics: True: metrics are python floats (one host transfer for all).
            False: 0-d detached tensors on the device (no transfer; combine_metrics
            then metrics_to_floats transfer once for all micro-batches).
        Under torch.compile nothing is read back: the value checks are skipped and the
        metrics stay 0-d tensors, so a compiled call with the defaults has no graph break.
    Returns:
        (scalar loss, metrics). Every metric is this batch's share of the mini-batch's
        value (the whole value without normalizers): keys ending in "max" or "min"
        combine across micro-batches by max / min, every other key by sum
        (combine_metrics). Keys: "loss", "pg/loss", "pg/clipfrac", "pg/dual_clipfrac",
        "pg/ratio_mean" (token fractions / means), "qkl/value" (unweighted mean k3 over
        queries), "qkl/delta_mean", "qkl/guarded_frac", "qkl/loss" (R_query with the
        algorithm's weights: w_B for erpo, ones for grpo where it is monitored, not
        optimised), "query_logp/mean", "weights/ess", "weights/min", "weights/max" (of
        the weights L_PG uses), "response_length/mean", "entropy/mean" (response
        tokens, when entropy is given), "policy_kl" (k3 on response tokens aggregated
        with loss_agg at w = 1, grpo's KL term; when ref_logp is given), and when
        rollout_logp is given: "mismatch/logp_diff_mean", "mismatch/logp_diff_max"
        (|rollout_logp - old_logp| over response tokens), "mismatch/ratio_out_frac"
        (tokens with pi_old / pi_rollout outside [0.9, 1.1]), "mismatch/is_weight_mean"
        (the truncated importance weight, 1 with rollout_is="none"). erpo_loss adds
        "support/kept_mass" (kept_mass) when the batch carries a support.
    """
    check_tensor("logp", logp, ndim=1, dtypes=FLOAT_DTYPES)
    batch, checks = _check_inputs(batch, config, ("logp", logp), normalizers, validate, sync_metrics)
    if entropy is not None:
        check_tensor("entropy", entropy, ndim=1, dtypes=FLOAT_DTYPES, device=logp.device)
        check_rows("entropy", entropy, logp.shape[0])
    _check_entropy(config, entropy is not None)
    loss, metrics = _loss_from_logp(logp, batch, config, entropy, backend, normalizers)
    return loss, metrics_out(metrics, checks, sync_metrics)


def _loss_from_logp(
    logp: torch.Tensor,
    batch: PackedLossBatch,
    config: LossConfig,
    entropy: Optional[torch.Tensor],
    backend: str,
    normalizers: Optional[LossNormalizers],
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """erpo_loss_from_logp on a batch already checked against logp: the terms of the
    module docstring, added in the order L_PG, alpha R_query, beta KL, and the metrics."""
    is_erpo = config.algorithm == "erpo"
    guard = float(config.kl_guard)
    norm = normalizers if normalizers is not None else LossNormalizers.of(batch)
    rows = LossRows.build(logp, batch, norm, query_weighted=is_erpo)
    query_kl = query_kl_term(rows, batch, guard, backend, optimised=is_erpo and config.alpha > 0)
    selected = None  # top_entropy_quantile: the rows the policy loss trains on (None: every response row)
    if config.top_entropy_quantile < 1:
        selected = selected_tokens(rows, entropy, config.top_entropy_quantile, norm.entropy_threshold)  # [N]
    policy = policy_term(rows, batch, config, selected)
    loss = policy.value
    if is_erpo and config.alpha > 0:
        loss = loss + config.alpha * query_kl.value
    metrics = {k: v for k, v in policy.metrics.items() if k.startswith("mismatch/")}
    if config.needs_entropy:
        bonus, entropy_metrics = _entropy_terms(rows, entropy, policy.unit, selected, config)
        if config.entropy_coeff > 0:
            loss = loss - config.entropy_coeff * bonus
        metrics.update(entropy_metrics)
    if batch.ref_logp is not None:
        use_kl = (not is_erpo) and config.beta > 0
        policy_kl = reference_kl_term(rows, batch.ref_logp, policy.unit, guard, backend, optimised=use_kl)
        if use_kl:
            loss = loss + config.beta * policy_kl
        metrics["policy_kl"] = policy_kl.detach()
    metrics.update((k, v) for k, v in policy.metrics.items() if k.startswith("pg/"))
    with torch.no_grad():
        metrics.update(query_kl_metrics(query_kl, guard, rows.n_queries))
        metrics.update(batch_metrics(rows, batch, entropy))
        metrics["loss"] = loss.detach()
    return loss, {k: v.to(rows.dtype) for k, v in metrics.items()}


def _check_entropy(config: LossConfig, given: bool) -> None:
    """ValueError when the config's loss reads the entropy and the call has none."""
    if config.needs_entropy and not given:
        raise ValueError(f"the entropy is required for entropy_coeff={config.entropy_coeff} / top_entropy_quantile="
                         f"{config.top_entropy_quantile}: pass entropy= (linear_token_logprobs(..., return_entropy="
                         f"True)), or with_entropy=True to erpo_loss")


def _entropy_terms(rows: LossRows, entropy: torch.Tensor, unit: torch.Tensor, selected: Optional[torch.Tensor],
                   config: LossConfig) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """(the entropy bonus, 0-d: objective/entropy.py, differentiable when entropy_coeff > 0),
    and its metrics: entropy/bonus and, with top_entropy_quantile < 1, entropy/selected_frac
    (the fraction of the response tokens the policy loss trains on)."""
    with nullcontext() if config.entropy_coeff > 0 else torch.no_grad():
        bonus = entropy_bonus(rows, entropy, unit, selected)
    metrics = {"entropy/bonus": bonus.detach()}
    if selected is not None:
        metrics["entropy/selected_frac"] = rows.response_fraction(selected)
    return bonus, metrics


def erpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    batch: PackedLossBatch,
    config: LossConfig = LossConfig(),
    *,
    bias: Optional[torch.Tensor] = None,
    backend: str = "auto",
    with_entropy: bool = True,
    normalizers: Optional[LossNormalizers] = None,
    validate: Optional[bool] = None,
    sync_metrics: bool = True,
    logit_scale: Optional[float] = None,
    softcap: Optional[float] = None,
    fused_budget: Optional[int] = None,
    tiles: Optional[Tiles] = None,
) -> Tuple[torch.Tensor, Dict[str, Union[float, torch.Tensor]]]:
    """The ERPO (or GRPO) loss straight from final hidden states and the lm_head weight.

    hidden [N, D] (the packed rows of `batch`), weight [V, D], bias [V] or None. Runs
    linear_token_logprobs (per-row inverse temperature from the batch, never
    materialising [N, V]; with the entropy for the "entropy/mean" metric unless
    with_entropy is False) and then erpo_loss_from_logp. Gradients flow to hidden,
    weight and bias. normalizers, validate (targets also checked against V),
    sync_metrics: as erpo_loss_from_logp. Returns (scalar loss, metrics) as
    erpo_loss_from_logp.

    Micro-batches: split the mini-batch with split_batch, forward each micro-batch's
    rows, and call erpo_loss(hidden_k, weight, micro.batch, config,
    normalizers=LossNormalizers.of(mini_batch)); backward each loss (gradients
    accumulate to the mini-batch's) and combine_metrics the k metric dicts.

    The fused path (objective/fused.py; docs/objective.md says which calls take it):
    when a gradient is wanted, the loss and its gradients are formed in this call, a
    chunk of whole sequences at a time from logits computed once (3 GEMMs of work
    instead of 4); backward only scales them. fused_budget: the bytes of kept logits a
    chunk keeps (None: 1 GiB; rows = budget // (2 V) for bf16 / fp16 operands, 3533 rows
    at V = 151,936, budget // (4 V) for fp32, 1766 rows; 0: always
    the 4-GEMM path); a batch of more rows is split, which reads span_cu_seqlens on the
    host once. tiles: the kernels' Tiles (None: the device's; Tiles.gemm_engine picks who
    runs the fused path's products).
    """
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES, device=hidden.device)
    batch, checks = _check_inputs(batch, config, ("hidden", hidden), normalizers, validate, sync_metrics,
                                  vocab_size=weight.shape[0])  # fmt: skip
    _check_entropy(config, with_entropy)
    budget = check_fused_budget(fused_budget)
    if fused_path_reason(hidden, weight, bias, config, normalizers, backend, budget) is None:
        fused = fused_erpo_loss(
            _loss_from_logp, hidden, weight, bias, batch, config, backend=backend, with_entropy=with_entropy,
            normalizers=normalizers, softcap=softcap, logit_scale=logit_scale, fused_budget=budget, tiles=tiles,
        )
        if fused is not None:
            if batch.support is not None:  # the chunks' log-probs stay in the fused path: kept_mass scores both
                fused[1]["support/kept_mass"] = kept_mass(
                    hidden, weight, batch, None, normalizers, bias=bias, backend=backend, logit_scale=logit_scale,
                    softcap=softcap).to(fused[1]["loss"].dtype)
            return fused[0], metrics_out(fused[1], checks, sync_metrics)
    out = linear_token_logprobs(
        hidden, weight, batch.targets, bias=bias, inv_temperature=batch.inv_temperature,
        ignore_index=batch.ignore_index, return_entropy=with_entropy, backend=backend,
        validate=False,  # targets (< V) and inv_temperature: checked once by _check_inputs / batch.validate
        logit_scale=logit_scale, softcap=softcap,  # the model's own logit transform, if any
        tiles=tiles,
        support=batch.support,  # the sampler's kept sets: log-probs and entropies renormalised over them
    )
    logp, entropy = out if with_entropy else (out, None)
    loss, metrics = _loss_from_logp(logp, batch, config, entropy, backend, normalizers)
    if batch.support is not None:
        metrics["support/kept_mass"] = kept_mass(
            hidden, weight, batch, logp, normalizers, bias=bias, backend=backend, logit_scale=logit_scale,
            softcap=softcap).to(metrics["loss"].dtype)
    return loss, metrics_out(metrics, checks, sync_metrics)


def kept_mass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    batch: PackedLossBatch,
    supported_logp: Optional[torch.Tensor] = None,
    normalizers: Optional[LossNormalizers] = None,
    *,
    bias: Optional[torch.Tensor] = None,
    backend: str = "auto",
    logit_scale: Optional[float] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """The "support/kept_mass" metric (0-d, no gradient): the probability the full softmax
    at 1 / tau gives the kept set, pi(K) = pi(y) / pi_K(y) = exp(logp_full - logp_K), meaned
    over the scored response rows (this batch's share of the mini-batch's T with
    `normalizers`). supported_logp [N]: the rows' log-probs under batch.support, or None
    (computed here). Costs one more forward of linear_token_logprobs without a graph (two
    without supported_logp)."""
    with torch.no_grad():
        def logp_of(support: Optional[torch.Tensor]) -> torch.Tensor:
            return linear_token_logprobs(
                hidden.detach(), weight.detach(), batch.targets, bias=None if bias is None else bias.detach(),
                inv_temperature=batch.inv_temperature, ignore_index=batch.ignore_index, backend=backend,
                validate=False, logit_scale=logit_scale, softcap=softcap, support=support,
            )  # [N]

        full = logp_of(None)
        if supported_logp is None:
            supported_logp = logp_of(batch.support)
        response = RowLayout(batch).response
        n_tokens = (normalizers if normalizers is not None else LossNormalizers.of(batch)).n_tokens.clamp(min=1)
        mass = torch.exp(full.double() - supported_logp.detach().double())  # [N]
        return torch.where(response, mass, torch.zeros_like(mass)).sum() / n_tokens
