"""The training loop. One step reads like the method:

    rollout -> reward -> group advantages -> pack -> forward to hidden states
    -> fused log-probs (linear_token_logprobs, prompt and response rows in one call)
    -> segment sums -> ERPO / GRPO objective -> backward -> optimizer step

The stock loss path (model(...).logits, log_softmax over [N, V]) is never used: the
base model gives hidden states and erpo_kernels.erpo_loss does the rest.

Trainer(cfg) checks everything first (config, paths, dataset, model, tokenizer,
reference cache) and raises an ErpoError before any training starts; train() runs the
loop, writes metrics.jsonl, checkpoints and the plot.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from erpo_kernels import (LossNormalizers, MicroBatch, PackedLossBatch, combine_metrics, entropy_threshold, erpo_loss,
                          linear_token_logprobs, metrics_to_floats, plan_micro_batches, response_entropies, split_batch)

from . import checkpoint as ckpt
from . import distributed
from .config import TrainConfig
from .errors import ErpoError
from .data import derived_seed, step_indices
from .models import autocast
from .packing import PackedSequences, forward_hidden, lm_head_options, pack, prompt_lengths
from .divergence import DivergenceMonitor
from .dynamic_sampling import SampledGroups, refill_indices, uniform_groups
from .plot import CURVES_FILE, METRICS_FILE, plot_runs, read_metrics
from .query_weights import QueryWeighter
from .rewards import CORRECT_THRESHOLD, get_reward_fn, overlong_penalty
from .rollout import Rollout, RolloutEngine, check_rollout_backend, eos_ids_of, make_engine
from .run_plan import apply_plan, plan_run
from .start import (check_cache_early, check_world_size, load_optimizer, load_policy, load_reference_cache, load_start,
                    setup_data, setup_device)

# Logged every step (docs/method.md section 6); "policy_kl" too when a reference model is monitored.
METRIC_KEYS = (
    "reward/mean", "reward/accuracy", "qkl/value", "qkl/delta_mean", "qkl/guarded_frac", "entropy/mean",
    "response_length/mean", "response_length/truncated_frac", "pg/clipfrac", "weights/ess", "weights/min", "weights/max", "grad_norm",
    "time/step_s", "throughput/tokens_per_s",
    "mismatch/logp_diff_mean", "mismatch/logp_diff_max", "mismatch/ratio_out_frac",
)
ADV_EPS = 1e-6


# ---------------------------------------------------------------------- small pieces


def group_advantages(rewards: torch.Tensor, adv_norm: str = "std") -> torch.Tensor:
    """A [m, G] from rewards [m, G] (docs/method.md section 4).

    std:  (R - mean) / (std + 1e-6), unbiased std over the group.
    none: R - mean (Dr.GRPO).
    A group whose rewards are all equal gets exactly 0.
    """
    r = rewards.to(torch.float32)
    centred = r - r.mean(dim=1, keepdim=True)  # [m, G]
    same = uniform_groups(r)[:, None]  # [m, 1]
    centred = torch.where(same, torch.zeros_like(centred), centred)
    if adv_norm == "none":
        return centred
    if r.shape[1] < 2:
        raise ValueError("adv_norm='std' needs at least 2 responses per group")
    return centred / (r.std(dim=1, unbiased=True, keepdim=True) + ADV_EPS)


@dataclasses.dataclass
class MiniBatch:
    """One mini-batch (one optimizer step): its packed rows, its loss batch and the
    sequences of each of its micro-batches (`plan`, whole sequences in order)."""

    packed: PackedSequences
    batch: PackedLossBatch
    plan: List[List[int]]

    def rows_of(self, micro: Optional[MicroBatch]) -> Tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [n_k], position_ids [n_k]) of one micro-batch's rows (None: all rows);
        positions restart at each sequence, so a subset of whole sequences keeps its own."""
        if micro is None:
            return self.packed.input_ids, self.packed.position_ids
        return self.packed.input_ids[micro.rows], self.packed.position_ids[micro.rows]


def steps_phrase(first: int, last: int) -> str:
    """'step 3' for one step, 'steps 3-5' for several."""
    return f"step {first}" if first == last else f"steps {first}-{last}"


def mean_metrics(updates: Sequence[Dict[str, float]]) -> Dict[str, float]:
    """{key: mean over the updates} of the updates' metrics (one update: its own values)."""
    return {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}


# ---------------------------------------------------------------------- the trainer


class Trainer:
    """A GRPO / ERPO run. Construction validates and loads everything (ErpoError on bad
    input, before any training or any change to the run directory); train() runs."""

    def __init__(self, cfg: TrainConfig, log: Callable[[str], None] = print, engine: Optional[RolloutEngine] = None):
        cfg.resolve_training_defaults()
        cfg.validate()
        self.cfg = cfg
        self.log = log if distributed.is_main() else (lambda _msg: None)  # rank 0 speaks for the run
        check_world_size(cfg, distributed.world_size())
        self.device, self.compute_dtype = setup_device(cfg)
        distributed.use_tensor_parallel(self.device.type, cfg.tp_size)  # the (data, tensor) mesh; tp_size 1: none
        check_rollout_backend(cfg, self.device)
        self.reward_fn = get_reward_fn(cfg.resolved_reward)
        self.examples, self.data_fingerprint = setup_data(cfg)
        self.plan = plan_run(cfg, self.data_fingerprint)  # where this start begins, what it keeps, copies, deletes
        self.start_step = self.plan.start_step  # the last step trained: train() continues after it
        check_cache_early(cfg, self.plan, self.examples, self.device, self.compute_dtype)
        start = load_start(cfg, self.plan, self.examples, self.device, self.compute_dtype, self.log)
        self.model_dir, self.tokenizer, self.prompt_ids = start.model_dir, start.tokenizer, start.prompt_ids
        self.reference = start.reference  # what the cache and every checkpoint are checked against
        self.cache, self.cache_rows, new_cache = load_reference_cache(
            cfg, self.plan, start, self.examples, self.device, self.compute_dtype, self.log)  # rows: [M]
        self.weighter = QueryWeighter.from_config(cfg, self.cache.score[self.cache_rows])
        self.model, self.ref_model = load_policy(cfg, self.plan, start, self.device, self.compute_dtype)
        self.loss_config = cfg.loss_config()
        self.eos_ids = set(eos_ids_of(self.model, self.tokenizer))  # where a response ends before max_new_tokens
        self.engine = engine or make_engine(cfg, self.model, self.plan.checkpoint or self.model_dir, self.tokenizer,
                                            self.prompt_ids, self.compute_dtype, log=self.log)
        self.optimizer, self.scheduler = load_optimizer(cfg, self.plan, self.model)
        distributed.barrier()  # every rank has read the run dir before rank 0 changes it
        if distributed.is_main():  # only now, every check passed, is the run dir touched
            apply_plan(self.plan, cfg, self.cache if new_cache else None, self.log)
        distributed.barrier()

    # ------------------------------------------------------------------ one step

    def step(self, step: int) -> Dict[str, float]:
        """One rollout batch and its optimizer updates (docs/method.md sections 1-5, 9);
        returns the step's metrics (section 6; loss metrics are means over the updates)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        world = distributed.data_world()  # a tensor-parallel group samples and trains on one share, alike
        rank_seed = ("rank", distributed.data_rank()) if world > 1 else ()  # one process: the seeds of a plain run
        torch.manual_seed(derived_seed(cfg.seed, "step", step, *rank_seed))  # the sampler's randomness
        queries = step_indices(len(self.examples), cfg.queries_per_step, step, cfg.seed)  # the step's m queries

        # 1. rollout: G responses per query, sampled at tau, and 2. their rewards (this rank's share of each mini-batch)
        drawn = self._sample(distributed.rank_items(queries, cfg.mini_batches))
        groups, metrics = drawn, {}
        if cfg.filter_groups:  # DAPO's dynamic sampling: the groups with a learning signal, refilled from new queries
            groups, metrics = self._dynamic_sampling(step, queries, drawn)
        t_rollout = time.perf_counter() - t0

        # 3. group advantages (section 4), of the rewards with DAPO's overlong shaping when it is on
        rewards = groups.rewards  # [m, G]
        if cfg.overlong_buffer:
            penalties = self._overlong_penalties(groups)  # [m, G] <= 0
            rewards = rewards + penalties
            metrics.update(self._overlong_metrics(penalties))
        advantages = group_advantages(rewards, cfg.adv_norm)  # [m, G]

        # 4.-7. mini_batches x ppo_epochs updates, each: pack, forward, objective, optimizer step
        updates, num_rows = self._updates(groups.idx, groups.prompts, groups.responses, advantages, groups.logprobs,
                                          groups.support)
        self.scheduler.step()  # the learning rate moves once per rollout batch
        self.engine.sync_weights(self.model)

        step_s = time.perf_counter() - t0
        num_rows = int(distributed.all_reduce_sum(torch.tensor(num_rows)))
        metrics.update(mean_metrics(updates))  # the step's value of each loss metric: the mean over its updates
        metrics.update(self._rollout_metrics(drawn))
        metrics.update({"time/rollout_s": t_rollout, "time/step_s": step_s,
                        "throughput/tokens_per_s": num_rows / step_s})
        return {"step": step, **{k: metrics[k] for k in sorted(metrics)}}

    def _sample(self, idx: Sequence[int]) -> SampledGroups:
        """1. rollout: G responses to each query of `idx`, sampled at tau; 2. their rewards."""
        cfg = self.cfg
        prompts = [self.prompt_ids[i] for i in idx]  # m token lists
        with autocast(self.device, self.compute_dtype):
            rollout = self.engine.generate(prompts, cfg.group_size, cfg.temperature, cfg.max_new_tokens)
        responses = rollout.responses  # [m][G] token lists
        truncated = torch.tensor([[float(len(r) >= cfg.max_new_tokens and r[-1] not in self.eos_ids) for r in group]
                                  for group in responses])  # [m, G] 1 = cut off at max_new_tokens, no EOS
        rewards = torch.tensor([
            [float(self.reward_fn(self.tokenizer.decode(r, skip_special_tokens=True), self.examples[i].answer))
             for r in group]
            for i, group in zip(idx, responses)
        ])  # [m, G]
        return SampledGroups(list(idx), prompts, responses, rollout.logprobs, rewards, truncated, rollout.support)

    def _rollout_metrics(self, drawn: SampledGroups) -> Dict[str, float]:
        """reward/* and response_length/truncated_frac of the step's own queries (every
        rank's; with filter_groups: before any group is dropped, as a run without it)."""
        cfg = self.cfg
        rewards = distributed.all_gather_items(drawn.rewards, cfg.mini_batches)  # [m, G] of every rank, in step order
        truncated = distributed.all_gather_items(drawn.truncated, cfg.mini_batches)  # [m, G]
        return {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "reward/accuracy": float((rewards >= CORRECT_THRESHOLD).float().mean()),
            "reward/zero_std_frac": float(uniform_groups(rewards).float().mean()),
            "response_length/truncated_frac": float(truncated.mean()),
        }

    def _dynamic_sampling(self, step: int, queries: Sequence[int], drawn: SampledGroups
                          ) -> Tuple[SampledGroups, Dict[str, float]]:
        """DAPO's dynamic sampling (docs/training.md): of the step's groups `drawn` (this
        rank's share of `queries`), those whose rewards are not all equal, refilled from
        further rollout batches of new queries (refill_indices) until queries_per_step
        are kept or filter_groups_max_batches batches were sampled; short of that, the
        step fills up with dropped groups. Every rank samples its share of each batch and
        the choice is made over every rank's groups; returns this rank's share of the
        step's groups (rank_items) and the filter_groups/* metrics."""
        cfg = self.cfg
        m = cfg.queries_per_step
        limit = cfg.filter_groups_max_batches or math.inf  # 0: no limit
        batches = [drawn]  # this rank's groups of each rollout batch
        kept = int(distributed.all_reduce_sum((~uniform_groups(drawn.rewards)).sum()))  # over every rank
        while kept < m and len(batches) < limit:
            idx = refill_indices(len(self.examples), m, step, cfg.seed, len(batches), queries)
            if not idx:
                break  # the dataset holds no further batch of new queries
            self.engine.sync_weights(self.model)  # the same weights: a sleeping engine (vLLM's) dropped them
            batches.append(self._sample(distributed.rank_items(idx)))
            kept += int(distributed.all_reduce_sum((~uniform_groups(batches[-1].rewards)).sum()))
        every = distributed.all_gather_data_object(batches)  # [data rank][batch]
        groups = SampledGroups.concat([g for parts in zip(*every) for g in parts])  # batch by batch, ranks in order
        uniform = uniform_groups(groups.rewards)  # [n]
        order = torch.cat([torch.nonzero(~uniform), torch.nonzero(uniform)]).flatten()[:m]  # signal first, then fill
        metrics = {
            "filter_groups/batches": float(len(batches)),
            "filter_groups/dropped_frac": float(uniform.float().mean()),
            "filter_groups/filled_frac": max(0, m - kept) / m,
        }
        return groups.take(order.tolist()).take(distributed.rank_items(list(range(m)), cfg.mini_batches)), metrics

    def _overlong_penalties(self, groups: SampledGroups) -> torch.Tensor:
        """[m, G] <= 0: DAPO's overlong penalty of each response (erpo.rewards.overlong_penalty)."""
        cfg = self.cfg
        return torch.tensor([[overlong_penalty(len(r), cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
                              for r in group] for group in groups.responses])

    def _overlong_metrics(self, penalties: torch.Tensor) -> Dict[str, float]:
        """reward/overlong_penalty (the mean penalty) and reward/overlong_frac (the fraction
        of responses penalised) of the step's trained groups, every rank's."""
        every = distributed.all_gather_items(penalties, self.cfg.mini_batches)  # [m, G]
        return {"reward/overlong_penalty": float(every.mean()),
                "reward/overlong_frac": float((every < 0).float().mean())}

    def _updates(self, idx: Sequence[int], prompts: List[List[int]], responses: List[List[List[int]]],
                 advantages: torch.Tensor, rollout_logprobs: Optional[List[List[List[float]]]] = None,
                 support: Optional[List[List[torch.Tensor]]] = None) -> Tuple[List[Dict[str, float]], int]:
        """The optimizer updates of one rollout batch (docs/method.md section 9): its m
        queries split into mini_batches equal shares of whole groups, ppo_epochs passes
        over them. With more than one update, old_logp of every row comes from one no-grad
        pass under the sampling weights, before the first update (none with bypass_mode and
        the engine's log-probs: they are pi_old). rollout_logprobs [m][G][L]:
        the engine's log-probs of the response tokens, or None; support [m][G] of [L, ceil(V / 32)]:
        their kept sets (replay_support), or None. Returns each update's
        metrics (also kept in self.last_updates) and the rows N of the rollout batch."""
        cfg = self.cfg
        size = len(idx) // cfg.mini_batches  # queries per mini-batch
        shares = [slice(j * size, (j + 1) * size) for j in range(cfg.mini_batches)]
        batches = [self._mini_batch(idx[s], prompts[s], responses[s], advantages[s],
                                    None if rollout_logprobs is None else rollout_logprobs[s],
                                    None if support is None else support[s]) for s in shares]
        bypass = cfg.policy_loss == "bypass_mode" and rollout_logprobs is not None  # pi_old = pi_rollout: no pass
        if cfg.mini_batches * cfg.ppo_epochs > 1 and not bypass:
            for mini in batches:
                mini.batch.old_logp = self._row_logp(self.model, mini)  # [N_j] under the weights that sampled
        self.last_mini_batches = batches
        self.last_updates = [self._update(mini) for _ in range(cfg.ppo_epochs) for mini in batches]
        return self.last_updates, sum(mini.packed.num_rows for mini in batches)

    def _mini_batch(self, idx: Sequence[int], prompts: List[List[int]], responses: List[List[List[int]]],
                    advantages: torch.Tensor, rollout_logprobs: Optional[List[List[List[float]]]] = None,
                    support: Optional[List[List[torch.Tensor]]] = None) -> MiniBatch:
        """The packed rows, loss batch and micro-batch plan of queries `idx` (their prompts,
        responses [m][G], advantages [m, G], rollout log-probs [m][G][L] or None, and the
        kept sets [m][G] of [L, ceil(V / 32)] or None); the query weights are this mini-batch's."""
        cfg = self.cfg
        # 4. pack: prompt rows at temperature 1 (scored once per group), response rows at 1/tau
        packed = pack(prompts, responses, cfg.temperature).to(self.device)  # N rows, B = m G sequences
        rows = self.cache_rows[idx]  # [m] cache rows of this batch's queries
        ref_query_logp = self.cache.ref_query_logp[rows]  # [m] l_0(q), cached (section 7)
        if cfg.algorithm == "erpo":  # w_B(q) over the whole batch of every rank (section 3), this rank's share
            scores = distributed.all_gather_tensor(self.cache.score[rows])  # [m * world]
            query_weights = self.weighter.batch_weights(scores)[distributed.rank_share(len(scores))]  # [m]
        else:
            query_weights = torch.ones(len(idx))  # [m] grpo weighs every query 1
        rollout_logp = None if rollout_logprobs is None else \
            packed.rows_from_response_tokens(Rollout(responses, rollout_logprobs).flat_logprobs())  # [N]
        row_support = None if support is None else \
            packed.support_rows(Rollout(responses, None, support).flat_support())  # [N, ceil(V / 32)]
        batch = packed.loss_batch(advantages.reshape(-1), ref_query_logp, query_weights, rollout_logp=rollout_logp,
                                  support=row_support)
        # whole sequences per micro-batch, at most micro_batch_tokens rows each (0: one micro-batch)
        batch.validate(vocab_size=self.model.get_output_embeddings().weight.shape[0])  # values, once, here
        mini = MiniBatch(packed, batch, plan_micro_batches(batch, cfg.micro_batch_tokens))
        if self.ref_model is not None:
            mini.batch.ref_logp = self._row_logp(self.ref_model, mini)  # [N] frozen reference, no grad
        return mini

    def _update(self, mini: MiniBatch) -> Dict[str, float]:
        """One optimizer step on one mini-batch, its gradient accumulated over the
        micro-batches (each normalised by the whole mini-batch: the sum is the mini-batch's
        loss); returns the loss's metrics with grad_norm and lr."""
        cfg = self.cfg
        norm = None  # one micro-batch on one rank: the batch normalises itself
        if len(mini.plan) > 1 or distributed.data_world() > 1:
            norm = LossNormalizers.of(mini.batch)  # T, B, m, G_q, sum w of the mini-batch
            distributed.reduce_normalizers(norm)  # under torchrun: of every rank's share (summed)
            if cfg.top_entropy_quantile < 1:  # the entropy quantile of every micro-batch's and rank's tokens
                norm.entropy_threshold = self._entropy_threshold(mini)
        parts = []
        # 5. forward to hidden states (no logits), micro-batch by micro-batch
        for batch, hidden, weight, bias, repeat in self._micro_batch_passes(self.model, mini):
            # 6. the objective: fused log-probs of every row -> segment sums to query_logp
            #    -> Query-KL against ref_query_logp, clipped policy loss weighted by query_weights
            loss, metrics = erpo_loss(hidden, weight, batch, self.loss_config, bias=bias, backend=cfg.kernel_backend,
                                      normalizers=norm, validate=False, sync_metrics=False,  # no host sync
                                      fused_budget=cfg.fused_budget_mb << 20, **lm_head_options(self.model))
            if repeat:  # a pass that only keeps this rank in step with the others
                loss = loss * 0.0
            else:
                parts.append(metrics)
            loss.backward()  # 7. gradients accumulate over the micro-batches
        metrics = metrics_to_floats(combine_metrics(parts))  # the update's one device-to-host transfer
        metrics = distributed.reduce_metrics(metrics)  # under torchrun: each rank's parts of the mini-batch's
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        grad_norm = distributed.clip_grad_norm(self.model.parameters(), max_norm)
        metrics.update({"grad_norm": float(grad_norm), "lr": float(self.optimizer.param_groups[0]["lr"])})
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    @torch.no_grad()
    def _row_logp(self, model: Any, mini: MiniBatch, entropy: bool = False) -> torch.Tensor:
        """Per-row log-probs [N] of `model` as it is now (the policy before an update, or
        the frozen reference), micro-batch by micro-batch, without a graph; computed as
        the update computes them (same dtype, kernel and per-row temperatures). entropy:
        instead, the rows' response_entropies [N] (+inf off the response rows)."""
        out = []
        for batch, hidden, weight, bias, repeat in self._micro_batch_passes(model, mini):
            logp = linear_token_logprobs(
                hidden, weight, batch.targets, bias=bias, inv_temperature=batch.inv_temperature,
                ignore_index=batch.ignore_index, return_entropy=entropy, backend=self.cfg.kernel_backend,
                validate=False, support=batch.support, **lm_head_options(model),
            )  # [n_k], or ([n_k], [n_k]) with the entropy
            if not repeat:
                out.append(response_entropies(logp[1], batch) if entropy else logp.float())
        return torch.cat(out)

    def _entropy_threshold(self, mini: MiniBatch) -> torch.Tensor:
        """top_entropy_quantile's threshold (0-d) over the response tokens of the whole
        mini-batch, every data-parallel rank's, at the current weights (a no-grad pass,
        needed once the mini-batch spans micro-batches or ranks)."""
        local = self._row_logp(self.model, mini, entropy=True)  # [N], +inf off the response rows
        longest = distributed.max_over_ranks(local.shape[0])
        padded = torch.cat([local, local.new_full((longest - local.shape[0],), float("inf"))])  # [longest]
        return entropy_threshold(distributed.all_gather_tensor(padded), self.cfg.top_entropy_quantile)

    def _micro_batch_passes(self, model: Any, mini: MiniBatch) -> Iterator[
            Tuple[PackedLossBatch, torch.Tensor, torch.Tensor, Optional[torch.Tensor], bool]]:
        """The forward of `model` over each micro-batch of `mini` to hidden states (no
        logits), the one loop of an update and of a no-grad pass: yields (the micro-batch's
        loss batch, hidden [n_k, D], weight [V, D], bias [V] or None, repeat), hidden, weight
        and bias in the compute dtype. `repeat`: a pass _same_count adds under FSDP2 (its
        results are for the collectives only). The caller consumes each pass before the next."""
        micros = split_batch(mini.batch, mini.plan) if len(mini.plan) > 1 else [None]
        for k, micro in enumerate(self._same_count(micros, model)):
            input_ids, position_ids = mini.rows_of(micro)  # [n_k], [n_k]
            batch = mini.batch if micro is None else micro.batch
            # prompt rows as the reference cache computed them
            with autocast(self.device, self.compute_dtype):
                hidden = forward_hidden(model, input_ids, position_ids, prompt_lengths(batch.span_cu_seqlens))
            weight, bias = distributed.lm_head_for_call(model)  # [V, D] whole (FSDP: gathered), [V] or None
            hidden, weight, bias = self._to_compute(hidden, weight, bias)  # hidden [n_k, D]
            yield batch, hidden, weight, bias, k >= len(micros)

    @staticmethod
    def _same_count(micros: List[Any], model: Any) -> List[Any]:
        """`micros`, and under FSDP2 its last one repeated until every rank has as many
        passes as the rank with the most (each forward and backward holds collectives:
        a rank with fewer would leave the others waiting). The caller discards the repeats."""
        if not distributed.is_sharded(model):
            return micros
        return micros + micros[-1:] * (distributed.max_over_ranks(len(micros)) - len(micros))

    def _to_compute(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """hidden [N, D], weight [V, D], bias [V] in the compute dtype (a differentiable
        cast: the gradient reaches the fp32 parameters)."""
        dt = self.compute_dtype
        if weight.dtype != dt:
            weight = weight.to(dt)
            bias = None if bias is None else bias.to(dt)
        return hidden.to(dt), weight, bias

    # ------------------------------------------------------------------ the loop

    def save(self, step: int) -> str:
        state = {
            "reference": self.reference,
            "data_fingerprint": self.data_fingerprint,
            "seed": self.cfg.seed,
            "algorithm": self.cfg.algorithm,
            "world_size": distributed.world_size(),
        }
        save = ckpt.save_sharded_checkpoint if distributed.is_sharded(self.model) else ckpt.save_checkpoint
        return save(
            self.cfg.run_dir, step, self.model, self.tokenizer, self.optimizer, self.scheduler, state,
            keep=self.cfg.keep_checkpoints,
        )

    def train(self, until_step: Optional[int] = None, plot: bool = True) -> Dict[str, Any]:
        """Run steps start+1 .. cfg.steps (or until_step); returns a summary dict. A later
        call continues from the last step run (train(until_step=k), then train(): the same
        run as one train()). plot=False: no curves.png (erpo study plots its own)."""
        cfg = self.cfg
        last = min(cfg.steps, until_step) if until_step else cfg.steps
        metrics_path = os.path.join(cfg.run_dir, METRICS_FILE)
        history: List[Dict[str, float]] = []
        t_start = time.perf_counter()
        bar = None
        main = distributed.is_main()  # rank 0 writes metrics, the plot and the progress bar
        if cfg.progress and last > self.start_step and main:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=self.start_step, desc="erpo", unit="step", dynamic_ncols=True,
                       file=sys.stderr)
        checkpoint = ckpt.latest_checkpoint(cfg.run_dir)
        monitor = DivergenceMonitor()
        warned: set = set()  # the setting warnings given in this call (each once)
        try:
            for step in range(self.start_step + 1, last + 1):
                metrics = self.step(step)
                history.append(metrics)
                if main:
                    self._write(step, lambda: self._append_metrics(metrics_path, metrics))
                warnings, fatal = monitor.check(metrics)  # divergence: one line each, with what to try
                if fatal:  # non-finite: stop before this step's checkpoint (every rank sees the same metrics)
                    raise ErpoError(warnings[0])
                warnings += self._setting_warnings(step, metrics, warned)
                for line in warnings:
                    self._warn(f"erpo: warning: {line}", bar)
                if bar is not None:
                    bar.update(1)
                    flags = {"warning": monitor.warning_tag} if monitor.warning_tag else {}
                    bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", qkl=f"{metrics['qkl/value']:.2e}", **flags)
                if step == last or (cfg.save_every and step % cfg.save_every == 0):
                    checkpoint = self._write(step, lambda: self.save(step))
                self.start_step = step
        finally:
            if bar is not None:
                bar.close()
        plot = plot_runs([cfg.run_dir]) if plot and main and os.path.isfile(metrics_path) else None
        run_rows = read_metrics(cfg.run_dir) if main and history and os.path.isfile(metrics_path) else history
        summary = self._summary(history, run_rows, time.perf_counter() - t_start, checkpoint, plot)
        self.log(summary["line"])
        return summary

    def _setting_warnings(self, step: int, metrics: Dict[str, float], warned: set) -> List[str]:
        """Warnings about a setting rather than an episode, each once (its name then joins `warned`)."""
        cfg = self.cfg
        lines = []
        if metrics["response_length/truncated_frac"] == 1.0 and "truncation" not in warned:
            warned.add("truncation")
            lines.append(f"step {step}: every response reached max_new_tokens={cfg.max_new_tokens} without ending; "
                         f"answers are cut off, so rewards may miss them (raise max_new_tokens=)")
        filled = metrics.get("filter_groups/filled_frac", 0.0)
        if filled > 0 and "filter_groups" not in warned:
            warned.add("filter_groups")
            lines.append(f"step {step}: filter_groups found fewer than queries_per_step={cfg.queries_per_step} groups "
                         f"with unequal rewards in {metrics['filter_groups/batches']:.0f} rollout batches (the limit "
                         f"filter_groups_max_batches={cfg.filter_groups_max_batches}, or the dataset's new queries ran "
                         f"out); {filled:.0%} of the step are groups of equal rewards, which add no policy gradient "
                         f"(filter_groups/filled_frac logs it every step; raise filter_groups_max_batches=, 0 = no "
                         f"limit)")
        return lines

    @staticmethod
    def _append_metrics(path: str, metrics: Dict[str, float]) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(metrics) + "\n")

    def _write(self, step: int, write: Callable[[], Any]) -> Any:
        """write(): its result; an OSError (a full disk, a file system gone read-only) is an
        ErpoError saying what survived: every checkpoint written before is complete."""
        try:
            return write()
        except OSError as exc:
            last = ckpt.latest_checkpoint(self.cfg.run_dir)
            then = "free some space, then" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "once it can be written again,"
            kept = (f"the last complete checkpoint, {last}, is intact; {then} continue with: erpo train "
                    f"resume={self.cfg.run_dir}" if last else "no checkpoint was written yet")
            raise ErpoError(f"step {step}: writing to {self.cfg.run_dir} failed ({exc.strerror or exc}); {kept}") from None

    def _warn(self, line: str, bar: Any) -> None:
        """A line in the log, printed above the progress bar when there is one."""
        if bar is None:
            self.log(line)
            return
        with bar.external_write_mode():
            self.log(line)

    def _summary(self, history, run_rows, seconds, checkpoint, plot) -> Dict[str, Any]:
        """The closing line: the rewards of the whole run (run_rows: metrics.jsonl, steps 1..last,
        the steps before a resume included), the time of this start's steps (history)."""
        cfg = self.cfg
        if not history:
            line = f"erpo: nothing to do: {cfg.run_dir} is already at step {self.start_step} of steps={cfg.steps}"
            return {"line": line, "steps": 0, "checkpoint": checkpoint, "plot": plot}
        k = max(1, min(10, len(run_rows) // 10))
        first = sum(h["reward/mean"] for h in run_rows[:k]) / k
        final = sum(h["reward/mean"] for h in run_rows[-k:]) / k
        these = f" ({steps_phrase(history[0]['step'], history[-1]['step'])} in this start)" if history[0]["step"] > 1 else ""
        a, b = run_rows[0]["step"], run_rows[-1]["step"]
        over = f"means of the run's first and last {k} steps" if k > 1 else f"step {a}" + (f" -> step {b}" if b > a else "")
        line = (
            f"erpo: {cfg.algorithm} finished step {history[-1]['step']}/{cfg.steps} in {seconds:.0f}s{these}: "
            f"reward {first:.3f} -> {final:.3f} ({over}), "
            f"Query-KL {history[-1]['qkl/value']:.2e}; run {cfg.run_dir} (metrics.jsonl, {CURVES_FILE}, "
            f"{os.path.relpath(checkpoint, cfg.run_dir) if checkpoint else 'no checkpoint'})"
        )
        return {"line": line, "steps": len(history), "reward_first": first, "reward_last": final,
                "checkpoint": checkpoint, "plot": plot, "seconds": seconds}
