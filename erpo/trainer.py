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
import shlex
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from erpo_kernels import linear_token_logprobs
from erpo_kernels._utils import resolve_backend
from erpo_kernels.objective import (LossNormalizers, MicroBatch, PackedLossBatch, combine_metrics, erpo_loss,
                                    metrics_to_floats, plan_micro_batches, split_batch)

from . import checkpoint as ckpt
from . import distributed
from .atomic import atomic_write
from .config import ConfigError, TrainConfig, save_config
from .errors import ErpoError
from .data import (
    Example,
    batches_per_epoch,
    check_prompts,
    derived_seed,
    encode_prompts,
    examples_fingerprint,
    load_examples,
    step_indices,
    template_text,
)
from .models import (autocast, check_vocabulary, enable_gradient_checkpointing, load_model, load_tokenizer,
                     resolve_compute_dtype, resolve_device)
from .packing import (PackedSequences, forward_hidden, lm_head_options, pack, prompt_lengths,
                      resolve_attn_implementation, set_attn_implementation)
from .divergence import DivergenceMonitor
from .plot import CURVES_FILE, METRICS_FILE, plot_runs, read_metrics
from .query_weights import QueryWeighter
from .ref_cache import (
    RefCache,
    RefCacheError,
    build_ref_cache,
    check_cache_meta,
    model_fingerprint,
    query_id,
    read_ref_cache,
    save_ref_cache,
    shown,
    tokenizer_fingerprint,
    validate_ref_cache,
)
from .rewards import CORRECT_THRESHOLD, get_reward_fn
from .rollout import Rollout, RolloutEngine, check_rollout_backend, eos_ids_of, make_engine
from .tiny import resolve_model_dir, warmstart_dir

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
    same = (r.max(dim=1, keepdim=True).values == r.min(dim=1, keepdim=True).values)  # [m, 1]
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


def check_micro_batch_budget(cfg: TrainConfig, prompt_ids: Sequence[Sequence[int]]) -> None:
    """ConfigError, before anything runs, when micro_batch_tokens cannot hold the longest
    sequence a step can produce (its longest prompt + max_new_tokens rows)."""
    longest = max(len(p) for p in prompt_ids) + cfg.max_new_tokens
    if cfg.micro_batch_tokens and cfg.micro_batch_tokens < longest:
        raise ConfigError(
            f"micro_batch_tokens={cfg.micro_batch_tokens} is smaller than the longest sequence a step can hold "
            f"({longest} tokens: the longest prompt, {longest - cfg.max_new_tokens}, + max_new_tokens="
            f"{cfg.max_new_tokens}); set micro_batch_tokens={longest} or more, or 0 (the whole mini-batch at once)"
        )


def mean_metrics(updates: Sequence[Dict[str, float]]) -> Dict[str, float]:
    """{key: mean over the updates} of the updates' metrics (one update: its own values)."""
    return {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}


def check_writable(path: str, key: str) -> None:
    """ConfigError unless directory `path` can be made (when missing) and written in: its
    nearest existing ancestor is a directory a file can be created in (tried: a read-only
    file system refuses even root)."""
    at = os.path.abspath(path)
    while not os.path.exists(at):
        at = os.path.dirname(at)
    if not os.path.isdir(at):
        raise ConfigError(f"{key}={path} is under {at}, a file, not a directory; choose another {key}=")
    try:
        fd, probe = tempfile.mkstemp(dir=at, prefix=".erpo-write-check-")
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(f"{key}={path}: {at} cannot be written ({exc.strerror}); choose a writable {key}=") from None


def check_setup(cfg: TrainConfig, device: torch.device, writes_run_dir: bool = True) -> None:
    """ConfigError, before anything is loaded, for a kernel backend or an attention this
    device cannot run, or an output path that cannot be written (run_dir when
    `writes_run_dir`, and the reference cache's directory when the cache is to be built)."""
    try:
        resolve_backend(cfg.kernel_backend, torch.empty(0, device=device))
    except ValueError as exc:
        raise ConfigError(f"kernel_backend={cfg.kernel_backend}: {exc}") from None
    try:
        resolve_attn_implementation(cfg.attn_implementation, device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if os.path.exists(cfg.run_dir) and not os.path.isdir(cfg.run_dir):
        raise ConfigError(f"run_dir={cfg.run_dir} is a file, not a directory; choose another run_dir")
    if os.path.isdir(cfg.ref_cache_path):
        raise ConfigError(f"ref_cache={cfg.ref_cache_path} is a directory; give a file path (e.g. DIR/ref_cache.safetensors)")
    if writes_run_dir:
        check_writable(cfg.run_dir, "run_dir")
    if cfg.overwrite or not os.path.isfile(cfg.ref_cache_path):
        check_writable(os.path.dirname(os.path.abspath(cfg.ref_cache_path)), "ref_cache" if cfg.ref_cache else "run_dir")


def scoring_meta(cfg: TrainConfig, device: torch.device, dtype: torch.dtype) -> Dict[str, str]:
    """How the run computes log-probs, recorded in the reference cache (docs/method.md section 7):
    the compute dtype, the packed forward's attention and the kernel backend. A cache computed
    otherwise differs from the run's own l(q) at the starting weights by more than fp32 rounding."""
    return {
        "compute_dtype": str(dtype).replace("torch.", ""),
        "attn_implementation": resolve_attn_implementation(cfg.attn_implementation, device),
        "kernel_backend": resolve_backend(cfg.kernel_backend, torch.empty(0, device=device)),
    }


def reference_meta(model_dir: str, model: Any, tokenizer: Any, template: str,
                   scoring: Dict[str, str]) -> Dict[str, str]:
    """What the reference cache is checked against (docs/method.md section 7): the
    starting model's path and weights fingerprint, the tokenizer fingerprint, the template,
    and how it is scored (scoring_meta)."""
    return {
        "model": os.path.abspath(model_dir),
        "model_fingerprint": model_fingerprint(model),
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "template": template_text(template),
        **scoring,
    }


# Keys that decide which prompts the cache holds, under which model, and how they are scored.
_CACHE_KEYS = ("model", "dataset", "prompt_field", "answer_field", "template", "max_prompt_tokens", "dtype",
               "attn_implementation", "kernel_backend", "device")
_DEMO_MODEL_KEYS = ("tiny_hidden_size", "tiny_layers", "warmstart_steps", "warmstart_lr", "warmstart_batch_size",
                    "warmstart_unboxed", "cache_dir")
_DEMO_TASK_KEYS = ("task_max_operand", "task_train_size", "task_eval_size")


def rebuild_command(cfg: TrainConfig) -> str:
    """`erpo ref-cache ...` with the keys (differing from the defaults) that rebuild this run's cache,
    shell-quoted, ready to paste: the cache it reads (<run_dir>/ref_cache.safetensors, or the file
    ref_cache= names) is replaced, so overwrite=true is part of it when that file exists."""
    default = TrainConfig()
    keys = list(_CACHE_KEYS)
    if cfg.is_demo_model:
        keys += list(_DEMO_MODEL_KEYS)
    if cfg.is_demo_task:
        keys += list(_DEMO_TASK_KEYS)
    if cfg.is_demo_model or cfg.is_demo_task:
        keys.append("seed")
    parts = [f"{k}={getattr(cfg, k)}" for k in keys if getattr(cfg, k) != getattr(default, k)]
    parts.append(f"ref_cache={cfg.ref_cache}" if cfg.ref_cache else f"run_dir={cfg.run_dir}")
    if os.path.isfile(cfg.ref_cache_path):
        parts.append("overwrite=true")
    return "erpo ref-cache " + " ".join(shlex.quote(p) for p in parts)


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    def scale(i: int) -> float:  # i = optimizer steps taken so far
        if cfg.warmup_steps and i < cfg.warmup_steps:
            return (i + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        frac = min(1.0, (i - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return 1.0 - frac if cfg.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))

    return scale


def earlier_run_files(run_dir: str) -> List[str]:
    """What an earlier run left in ``run_dir`` that a new run would replace."""
    names = (METRICS_FILE, ckpt.CHECKPOINTS, CURVES_FILE, "eval")
    return [os.path.join(run_dir, n) for n in names if os.path.exists(os.path.join(run_dir, n))]


# ---------------------------------------------------------------------- set-up steps
# Shared by Trainer (erpo train) and build_cache_command (erpo ref-cache).


def check_run_dir(cfg: TrainConfig) -> List[str]:
    """What an earlier run left in run_dir (replaced only with overwrite=true; ErpoError
    without it); [] when resuming in place (a fork into another run_dir is checked too)."""
    in_place = bool(cfg.resume) and ckpt.resume_point(cfg.resume)[0] == os.path.normpath(cfg.run_dir)
    earlier = [] if in_place else earlier_run_files(cfg.run_dir)
    if earlier and not cfg.overwrite:
        last = ckpt.latest_checkpoint(cfg.run_dir)
        go_on = f"continue it with: erpo train resume={cfg.run_dir}, " if last else ""
        raise ErpoError(
            f"run_dir={cfg.run_dir} holds an earlier run "
            f"({f'checkpoint {os.path.basename(last)}' if last else 'one that wrote no checkpoint'}); "
            f"{go_on}start over with overwrite=true (deletes it), or choose another run_dir="
        )
    return earlier


def check_world_size(cfg: TrainConfig, world: int) -> None:
    """ErpoError, before anything runs, when `world` ranks (torchrun --nproc-per-node)
    cannot run cfg: every rank needs an equal share of whole groups, and a run resumes on
    the world size it was trained on (data shares, sampler seeds and optimizer shards are per rank)."""
    last = ckpt.resume_point(cfg.resume)[1] if cfg.resume else None
    saved = int(ckpt.read_state(last).get("world_size", 1)) if last else world
    if saved != world:
        how = "erpo train (one process)" if saved == 1 else f"torchrun --nproc-per-node {saved} -m erpo train"
        raise ErpoError(f"resume={cfg.resume}: the run was trained on {saved} rank(s) and this start has {world}; "
                        f"resume it with {how} resume={cfg.resume}, or start a new run")
    m = cfg.queries_per_step
    if world > m:
        raise ErpoError(f"torchrun started {world} ranks but queries_per_step={m}: every rank needs at least one "
                        f"query (groups are never split across ranks); use --nproc-per-node <= {m} or raise "
                        f"queries_per_step")
    if m % (world * cfg.mini_batches):
        per = f"{cfg.mini_batches} mini-batches x {world} ranks" if cfg.mini_batches > 1 else f"{world} ranks"
        raise ErpoError(f"queries_per_step={m} does not divide over {per} (each rank takes an equal share of whole "
                        f"groups of every mini-batch); use a multiple of {world * cfg.mini_batches} or another "
                        f"--nproc-per-node")


def setup_device(cfg: TrainConfig, writes_run_dir: bool = True) -> Tuple[torch.device, torch.dtype]:
    """(device, compute dtype) of the run, after checking the kernel backend and output paths."""
    device = distributed.local_device(resolve_device(cfg))  # cuda:LOCAL_RANK under torchrun
    dtype = resolve_compute_dtype(cfg, device)
    check_setup(cfg, device, writes_run_dir)
    return device, dtype


def setup_data(cfg: TrainConfig, training: bool = True) -> Tuple[List[Example], str]:
    """(the training examples, their fingerprint); a missing file or field fails here, and
    when ``training`` a dataset smaller than one step (the cache does not need one)."""
    examples = load_examples(cfg, "train")
    if training:
        batches_per_epoch(len(examples), cfg.queries_per_step)
    return examples, examples_fingerprint(examples)


def setup_prompts(cfg: TrainConfig, examples: Sequence[Example], tokenizer_dir: str) -> Tuple[Any, List[List[int]]]:
    """(tokenizer, prompt token ids of every example under the run's template), prompt lengths checked."""
    tokenizer = load_tokenizer(tokenizer_dir)
    prompt_ids = encode_prompts(tokenizer, examples, cfg.resolved_template)
    check_prompts(prompt_ids, examples, cfg.max_prompt_tokens)
    return tokenizer, prompt_ids


def load_scoring_model(cfg: TrainConfig, model_dir: str, device: torch.device) -> Any:
    """The model of `model_dir` in fp32 with the run's attention (the packed forward's)."""
    model = load_model(model_dir, device)
    set_attn_implementation(model, cfg.attn_implementation)
    return model


def starting_model(cfg: TrainConfig, model_dir: str, tokenizer: Any, device: torch.device,
                   dtype: torch.dtype) -> Tuple[Any, Dict[str, str]]:
    """(the starting model in fp32 with the run's attention, the reference meta the cache is
    checked against): the cache is scored by the forward that trains."""
    model = load_scoring_model(cfg, model_dir, device)
    check_vocabulary(model, tokenizer, model_dir)
    return model, reference_meta(model_dir, model, tokenizer, cfg.resolved_template, scoring_meta(cfg, device, dtype))


def score_reference(cfg: TrainConfig, model: Any, prompt_ids: Sequence[Sequence[int]], meta: Dict[str, str],
                    pad_token_id: int, device: torch.device, dtype: torch.dtype) -> Tuple[RefCache, float]:
    """(the reference cache of every prompt under `model`, seconds it took)."""
    t0 = time.perf_counter()
    with autocast(device, dtype):
        cache = build_ref_cache(model, prompt_ids, meta, pad_token_id=pad_token_id,
                                backend=cfg.kernel_backend, compute_dtype=dtype)
    return cache, time.perf_counter() - t0


def score_reference_sharded(cfg: TrainConfig, model: Any, prompt_ids: Sequence[Sequence[int]], meta: Dict[str, str],
                            pad_token_id: int, device: torch.device, dtype: torch.dtype) -> Tuple[RefCache, float]:
    """score_reference with the distinct prompts split over the ranks (the unsharded
    starting model on each) and the parts gathered: every rank gets the whole cache."""
    unique = list({query_id(p): p for p in prompt_ids}.values())  # distinct prompts, first-seen order
    w, r = distributed.world_size(), distributed.rank()
    bounds = [len(unique) * k // w for k in range(w + 1)]
    part, seconds = score_reference(cfg, model, unique[bounds[r]:bounds[r + 1]], meta, pad_token_id, device, dtype)
    fields = ("query_id", "n_tokens", "ref_query_logp", "score")
    parts = distributed.all_gather_object({k: getattr(part, k).cpu() for k in fields})
    whole = {k: torch.cat([p[k] for p in parts]) for k in fields}
    meta = dict(part.meta, n_queries=len(unique))
    return RefCache(meta=distributed.broadcast_object(meta), **whole), seconds


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
        self.earlier_run = check_run_dir(cfg)
        self.device, self.compute_dtype = setup_device(cfg)
        check_rollout_backend(cfg.rollout_backend, self.device)
        self.template = cfg.resolved_template
        self.reward_fn = get_reward_fn(cfg.resolved_reward)
        self.examples, self.data_fingerprint = setup_data(cfg)
        saved = self._setup_resume()
        self._check_reference_cache_early(saved)
        initial = self._setup_model(saved)
        initial = self._setup_reference_cache(initial)
        self._setup_policy(initial, engine)
        self._setup_optimizer()
        distributed.barrier()  # every rank has read the run dir before rank 0 changes it
        if distributed.is_main():
            self._prepare_run_dir()
        distributed.barrier()

    # ------------------------------------------------------------------ set-up steps

    def _setup_resume(self) -> Dict[str, Any]:
        """Where we start from: step 0, or (resume=RUN) its latest checkpoint, or
        (resume=RUN/checkpoints/step-N) that one, whose saved state is returned after checking
        that the training data is the run's. A run_dir other than RUN forks: the new run
        continues from the checkpoint and RUN is left as it is."""
        cfg = self.cfg
        self.start_step = 0
        self.resume_from: Optional[str] = None
        self.source_run: Optional[str] = None
        self.fork = False
        self.later_checkpoints: List[str] = []
        if not cfg.resume:
            return {}
        self.source_run, self.resume_from = ckpt.resume_point(cfg.resume)
        self.fork = self.source_run != os.path.normpath(cfg.run_dir)
        if self.resume_from is None:
            raise ErpoError(
                f"resume={cfg.resume}: no checkpoint there yet (expected {cfg.resume}/checkpoints/step-N); "
                f"start it over with: erpo train run_dir={cfg.resume} overwrite=true"
            )
        saved = ckpt.read_state(self.resume_from)
        self.start_step = int(saved["step"])
        if saved.get("data_fingerprint") != self.data_fingerprint:
            raise ErpoError(
                f"resume={cfg.resume}: the training data differs from the run's (fingerprint "
                f"{saved.get('data_fingerprint')} -> {self.data_fingerprint}); restore it or start a new run"
            )
        if not self.fork:  # continuing in place from an older checkpoint replaces the later ones
            self.later_checkpoints = [p for s, p in ckpt.checkpoint_dirs(cfg.run_dir) if s > self.start_step]
        if self.later_checkpoints and not cfg.overwrite:
            raise ErpoError(
                f"resume={cfg.resume}: {cfg.run_dir} has later checkpoints "
                f"({', '.join(os.path.basename(p) for p in self.later_checkpoints)}) that continuing there would "
                f"replace; continue in a new run with run_dir=NEW (this one is kept), or delete them with overwrite=true"
            )
        return saved

    def _check_reference_cache_early(self, saved: Dict[str, Any]) -> None:
        """Where the reference cache is read from, and its staleness checked before the
        starting model is built (model=tiny trains a warm start first): against the
        checkpoint's reference when resuming; for a new run its template, and for a warm
        start not trained yet the model directory it will have."""
        cfg = self.cfg
        self.cache_path = cfg.ref_cache_path
        self.rebuild = rebuild_command(cfg)
        read_from = self.cache_path
        if self.fork and not cfg.ref_cache and not os.path.isfile(read_from):  # the forked run's own cache
            read_from = os.path.join(self.source_run, os.path.basename(self.cache_path))
        self._cache_copy_from = read_from if read_from != self.cache_path and os.path.isfile(read_from) else None
        self._cache_read_from = self._cache_copy_from or self.cache_path
        if not os.path.isfile(self._cache_read_from):
            return
        meta = read_ref_cache(self._cache_read_from, self.rebuild).meta
        if self.resume_from:
            check_cache_meta(meta, self._cache_read_from, saved["reference"], self.rebuild)
            return
        if cfg.is_demo_model:
            planned = os.path.abspath(warmstart_dir(cfg, self.examples, self.template))
            if not os.path.isdir(planned) and meta.get("model") != planned:
                raise RefCacheError(
                    f"reference cache {self._cache_read_from} is stale: built for model weights {meta.get('model')} "
                    f"({meta.get('model_fingerprint')}), this run starts from {planned} (a warm start of other "
                    f"settings); rebuild it with: {self.rebuild}"
                )
        expect = {"template": template_text(self.template), **scoring_meta(cfg, self.device, self.compute_dtype)}
        check_cache_meta(meta, self._cache_read_from, expect, self.rebuild)

    def _setup_model(self, saved: Dict[str, Any]) -> Optional[Any]:
        """Model directory, tokenizer, prompts and the reference meta; returns the starting
        (pre-RL) model when loaded (a fresh run), None when resuming."""
        # the demo model's warm start: trained and cached by rank 0, read from the cache by the others
        self.model_dir = distributed.main_first(lambda: resolve_model_dir(self.cfg, self.examples, self.log))
        self.tokenizer, self.prompt_ids = setup_prompts(
            self.cfg, self.examples, self.resume_from or self.model_dir
        )
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        check_micro_batch_budget(self.cfg, self.prompt_ids)
        if not self.resume_from:
            initial, self.reference = starting_model(self.cfg, self.model_dir, self.tokenizer, self.device,
                                                     self.compute_dtype)
            return initial
        self.reference = dict(saved["reference"])
        if tokenizer_fingerprint(self.tokenizer) != self.reference["tokenizer_fingerprint"]:
            raise ErpoError(f"resume={self.cfg.resume}: the checkpoint's tokenizer does not match the run's")
        return None

    def _setup_reference_cache(self, initial: Optional[Any]) -> Optional[Any]:
        """The reference cache (validated, or built from the starting model when missing)
        and the query weighter over its scores; returns the starting model if loaded."""
        cfg = self.cfg
        read_from = self._cache_read_from  # located in _check_reference_cache_early
        self._cache_is_new = not os.path.isfile(read_from)
        if self._cache_is_new:
            if initial is None:  # resuming without a cache: the starting model must be the run's
                initial = load_scoring_model(cfg, self.model_dir, self.device)
                if model_fingerprint(initial) != self.reference["model_fingerprint"]:
                    raise ErpoError(
                        f"resume={cfg.resume}: the reference cache {self.cache_path} is gone and {self.model_dir} no "
                        f"longer holds the run's starting weights, so it cannot be rebuilt; restore either"
                    )
            score = score_reference_sharded if distributed.world_size() > 1 else score_reference
            self.cache, seconds = score(cfg, initial, self.prompt_ids, self.reference, self.pad_token_id,
                                        self.device, self.compute_dtype)
            self.log(f"erpo: reference cache: {len(self.cache)} queries scored in {seconds:.1f}s")
        else:
            self.cache = read_ref_cache(read_from, self.rebuild)
        self.cache_rows = validate_ref_cache(
            self.cache, read_from, expect=self.reference, prompt_ids=self.prompt_ids,
            describe=lambda i: f"({self.examples[i].prompt[:40]!r})", rebuild=self.rebuild,
        )  # [M] cache row of each training query
        self.weighter = QueryWeighter.from_config(cfg, self.cache.score[self.cache_rows])
        return initial

    def _setup_policy(self, initial: Optional[Any], engine: Optional[RolloutEngine]) -> None:
        """The policy (the starting weights, or the checkpoint's), a frozen reference model
        when needed, the loss settings and the rollout engine."""
        cfg = self.cfg
        self.model = load_model(self.resume_from, self.device) if self.resume_from else initial
        check_vocabulary(self.model, self.tokenizer, self.resume_from or self.model_dir)
        self.model.eval()  # no dropout: the sampler and the loss see the same function
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        set_attn_implementation(self.model, cfg.attn_implementation)  # the packed forward's attention
        if distributed.world_size() > 1:  # FSDP2: each rank keeps a shard of the weights and of AdamW's state
            distributed.shard_model(self.model, self.compute_dtype)
        self.ref_model = None
        if (cfg.algorithm == "grpo" and cfg.beta > 0) or cfg.monitor_policy_kl:
            self._check_moved_start()
            self.ref_model = load_model(self.model_dir, self.device, self.compute_dtype).eval()
            self.ref_model.requires_grad_(False)
            set_attn_implementation(self.ref_model, cfg.attn_implementation)
        self.loss_config = cfg.loss_config()
        self.eos_ids = set(eos_ids_of(self.model, self.tokenizer))  # where a response ends before max_new_tokens
        self.engine = engine or make_engine(
            cfg, self.model, self.resume_from or self.model_dir, self.tokenizer, self.prompt_ids, self.compute_dtype
        )

    def _check_moved_start(self) -> None:
        """Resuming with the starting model at another path than the run's (moved, or named
        anew): ErpoError unless it holds the run's starting weights (checked in fp32 on CPU)."""
        if not self.resume_from or os.path.abspath(self.model_dir) == self.reference.get("model"):
            return
        if model_fingerprint(load_model(self.model_dir, torch.device("cpu"))) != self.reference["model_fingerprint"]:
            raise ErpoError(f"resume={self.cfg.resume}: model={self.cfg.model} does not hold the run's starting weights "
                            f"({self.reference.get('model')}); give that model's path")

    def _setup_optimizer(self) -> None:
        """AdamW and the learning-rate schedule (their state restored when resuming)."""
        cfg = self.cfg
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        if self.resume_from:
            state = ckpt.load_optimizer_state(self.resume_from)
            if distributed.is_sharded(self.model):
                distributed.load_optimizer(self.model, self.optimizer, os.path.join(self.resume_from, ckpt.OPTIM_DIR))
            else:
                self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])

    def _prepare_run_dir(self) -> None:
        """Called last in __init__, after every check passed: only now is the run dir touched."""
        cfg = self.cfg
        run = cfg.run_dir
        os.makedirs(run, exist_ok=True)
        metrics = os.path.join(run, METRICS_FILE)
        if self.resume_from and not self.fork:
            ckpt.clean_stale_temps(run)
            for p in self.later_checkpoints:  # overwrite=true, checked in _setup_resume
                self.log(f"erpo: overwrite=true: deleting {p} (after the checkpoint this run continues from)")
                shutil.rmtree(p)
            if os.path.isfile(metrics):  # drop what was logged after the checkpoint
                keep = [row for row in read_metrics(run) if row["step"] <= self.start_step]
                atomic_write(metrics, "".join(json.dumps(row) + "\n" for row in keep).encode("utf-8"))
        else:
            if self.earlier_run:  # overwrite=true, checked in __init__
                self.log(f"erpo: overwrite=true: deleting the earlier run in {run} and starting over")
                for p in self.earlier_run:
                    shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
            if self.fork:  # the new run holds its history up to the checkpoint, and the checkpoint
                source = self.source_run
                rows = read_metrics(source) if os.path.isfile(os.path.join(source, METRICS_FILE)) else []
                keep = [row for row in rows if row["step"] <= self.start_step]
                atomic_write(metrics, "".join(json.dumps(row) + "\n" for row in keep).encode("utf-8"))
                os.makedirs(os.path.join(run, ckpt.CHECKPOINTS), exist_ok=True)
                ckpt.link_tree(self.resume_from,
                               os.path.join(run, ckpt.CHECKPOINTS, os.path.basename(self.resume_from)))
                self.log(f"erpo: {run} continues from {self.resume_from} (step {self.start_step}); {source} is "
                         f"left as it is")
        if self._cache_is_new:
            save_ref_cache(self.cache, self.cache_path)
        elif self._cache_copy_from:
            with open(self._cache_copy_from, "rb") as f:
                atomic_write(self.cache_path, f.read())
        # overwrite is an instruction for this start, not a setting of the run: a config
        # file copied from the run must not delete it
        save_config(dataclasses.replace(cfg, overwrite=False), os.path.join(run, "config.yaml"))

    # ------------------------------------------------------------------ one step

    def step(self, step: int) -> Dict[str, float]:
        """One rollout batch and its optimizer updates (docs/method.md sections 1-5, 9);
        returns the step's metrics (section 6; loss metrics are means over the updates)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        world = distributed.world_size()
        rank_seed = ("rank", distributed.rank()) if world > 1 else ()  # one process: the seeds of a plain run
        torch.manual_seed(derived_seed(cfg.seed, "step", step, *rank_seed))  # the sampler's randomness
        idx = step_indices(len(self.examples), cfg.queries_per_step, step, cfg.seed)  # m training queries
        idx = distributed.rank_items(idx, cfg.mini_batches)  # this rank's share of each mini-batch (all in one process)
        prompts = [self.prompt_ids[i] for i in idx]  # m token lists

        # 1. rollout: G responses per query, sampled at tau
        with autocast(self.device, self.compute_dtype):
            rollout = self.engine.generate(prompts, cfg.group_size, cfg.temperature, cfg.max_new_tokens)
        responses = rollout.responses  # [m][G] token lists
        t_rollout = time.perf_counter() - t0
        truncated = torch.tensor([[float(len(r) >= cfg.max_new_tokens and r[-1] not in self.eos_ids) for r in group]
                                  for group in responses])  # [m, G] 1 = cut off at max_new_tokens, no EOS

        # 2. rewards and 3. group advantages (section 4)
        rewards = torch.tensor([
            [float(self.reward_fn(self.tokenizer.decode(r, skip_special_tokens=True), self.examples[i].answer))
             for r in group]
            for i, group in zip(idx, responses)
        ])  # [m, G]
        advantages = group_advantages(rewards, cfg.adv_norm)  # [m, G]

        # 4.-7. mini_batches x ppo_epochs updates, each: pack, forward, objective, optimizer step
        updates, num_rows = self._updates(idx, prompts, responses, advantages, rollout.logprobs)
        self.scheduler.step()  # the learning rate moves once per rollout batch
        self.engine.sync_weights(self.model)

        step_s = time.perf_counter() - t0
        rewards = distributed.all_gather_items(rewards, cfg.mini_batches)  # [m, G] of every rank, in step order
        truncated = distributed.all_gather_items(truncated, cfg.mini_batches)  # [m, G]
        num_rows = int(distributed.all_reduce_sum(torch.tensor(num_rows)))
        same = (rewards.max(dim=1).values == rewards.min(dim=1).values).float().mean()
        metrics = mean_metrics(updates)  # the step's value of each loss metric: the mean over its updates
        metrics.update({
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "reward/accuracy": float((rewards >= CORRECT_THRESHOLD).float().mean()),
            "reward/zero_std_frac": float(same),
            "response_length/truncated_frac": float(truncated.mean()),
            "time/rollout_s": t_rollout,
            "time/step_s": step_s,
            "throughput/tokens_per_s": num_rows / step_s,
        })
        return {"step": step, **{k: metrics[k] for k in sorted(metrics)}}

    def _updates(self, idx: Sequence[int], prompts: List[List[int]], responses: List[List[List[int]]],
                 advantages: torch.Tensor, rollout_logprobs: Optional[List[List[List[float]]]] = None
                 ) -> Tuple[List[Dict[str, float]], int]:
        """The optimizer updates of one rollout batch (docs/method.md section 9): its m
        queries split into mini_batches equal shares of whole groups, ppo_epochs passes
        over them. With more than one update, old_logp of every row comes from one no-grad
        pass under the sampling weights, before the first update. rollout_logprobs [m][G][L]:
        the engine's log-probs of the response tokens, or None. Returns each update's
        metrics (also kept in self.last_updates) and the rows N of the rollout batch."""
        cfg = self.cfg
        size = len(idx) // cfg.mini_batches  # queries per mini-batch
        shares = [slice(j * size, (j + 1) * size) for j in range(cfg.mini_batches)]
        batches = [self._mini_batch(idx[s], prompts[s], responses[s], advantages[s],
                                    None if rollout_logprobs is None else rollout_logprobs[s]) for s in shares]
        if cfg.mini_batches * cfg.ppo_epochs > 1:
            for mini in batches:
                mini.batch.old_logp = self._row_logp(self.model, mini)  # [N_j] under the weights that sampled
        self.last_mini_batches = batches
        self.last_updates = [self._update(mini) for _ in range(cfg.ppo_epochs) for mini in batches]
        return self.last_updates, sum(mini.packed.num_rows for mini in batches)

    def _mini_batch(self, idx: Sequence[int], prompts: List[List[int]], responses: List[List[List[int]]],
                    advantages: torch.Tensor, rollout_logprobs: Optional[List[List[List[float]]]] = None) -> MiniBatch:
        """The packed rows, loss batch and micro-batch plan of queries `idx` (their prompts,
        responses [m][G], advantages [m, G] and rollout log-probs [m][G][L] or None); the
        query weights are this mini-batch's."""
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
        batch = packed.loss_batch(advantages.reshape(-1), ref_query_logp, query_weights, rollout_logp=rollout_logp)
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
        if len(mini.plan) > 1 or distributed.world_size() > 1:
            norm = LossNormalizers.of(mini.batch)  # T, B, m, G_q, sum w of the mini-batch
            distributed.reduce_normalizers(norm)  # under torchrun: of every rank's share (summed)
        micros = split_batch(mini.batch, mini.plan) if len(mini.plan) > 1 else [None]
        parts = []
        for micro in self._same_count(micros, self.model):
            input_ids, position_ids = mini.rows_of(micro)  # [n_k], [n_k]
            batch = mini.batch if micro is None else micro.batch
            # 5. forward to hidden states (no logits); prompt rows as the reference cache computed them
            with autocast(self.device, self.compute_dtype):
                hidden = forward_hidden(self.model, input_ids, position_ids, prompt_lengths(batch.span_cu_seqlens))
            weight, bias = distributed.lm_head_for_call(self.model)  # [V, D] whole (FSDP: gathered), [V] or None
            hidden, weight, bias = self._to_compute(hidden, weight, bias)  # hidden [n_k, D]
            # 6. the objective: fused log-probs of every row -> segment sums to query_logp
            #    -> Query-KL against ref_query_logp, clipped policy loss weighted by query_weights
            loss, metrics = erpo_loss(hidden, weight, batch, self.loss_config, bias=bias, backend=cfg.kernel_backend,
                                      normalizers=norm, validate=False, sync_metrics=False,  # no host sync
                                      **lm_head_options(self.model))
            if len(parts) == len(micros):  # a pass that only keeps this rank in step with the others
                loss = loss * 0.0
            else:
                parts.append(metrics)
            loss.backward()  # 7. gradients accumulate over the micro-batches
        metrics = metrics_to_floats(combine_metrics(parts))  # the update's one device-to-host transfer
        metrics = distributed.reduce_metrics(metrics)  # under torchrun: each rank's parts of the mini-batch's
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP: a DTensor
        metrics.update({"grad_norm": float(grad_norm), "lr": float(self.optimizer.param_groups[0]["lr"])})
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    @torch.no_grad()
    def _row_logp(self, model: Any, mini: MiniBatch) -> torch.Tensor:
        """Per-row log-probs [N] of `model` as it is now (the policy before an update, or
        the frozen reference), micro-batch by micro-batch, without a graph; computed as
        the update computes them (same dtype, kernel and per-row temperatures)."""
        micros = split_batch(mini.batch, mini.plan) if len(mini.plan) > 1 else [None]
        out = []
        for micro in self._same_count(micros, model):
            input_ids, position_ids = mini.rows_of(micro)  # [n_k], [n_k]
            batch = mini.batch if micro is None else micro.batch
            with autocast(self.device, self.compute_dtype):
                hidden = forward_hidden(model, input_ids, position_ids, prompt_lengths(batch.span_cu_seqlens))
            weight, bias = distributed.lm_head_for_call(model)  # [V, D] whole (FSDP: gathered), [V] or None
            hidden, weight, bias = self._to_compute(hidden, weight, bias)
            out.append(linear_token_logprobs(
                hidden, weight, batch.targets, bias=bias, inv_temperature=batch.inv_temperature,
                ignore_index=batch.ignore_index, backend=self.cfg.kernel_backend, validate=False,
                **lm_head_options(model),
            ).float())
        return torch.cat(out[:len(micros)])

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

    def train(self, until_step: Optional[int] = None) -> Dict[str, Any]:
        """Run steps start+1 .. cfg.steps (or until_step); returns a summary dict."""
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
        warned_truncation = False
        try:
            for step in range(self.start_step + 1, last + 1):
                metrics = self.step(step)
                history.append(metrics)
                if main:
                    self._write(step, lambda: self._append_metrics(metrics_path, metrics))
                warnings, fatal = monitor.check(metrics)  # divergence: one line each, with what to try
                if fatal:  # non-finite: stop before this step's checkpoint (every rank sees the same metrics)
                    raise ErpoError(warnings[0])
                if metrics["response_length/truncated_frac"] == 1.0 and not warned_truncation:
                    warned_truncation = True  # once a run: the length is a setting, not an episode
                    warnings.append(f"step {step}: every response reached max_new_tokens={cfg.max_new_tokens} "
                                    f"without ending; answers are cut off, so rewards may miss them (raise "
                                    f"max_new_tokens=)")
                for line in warnings:
                    self._warn(f"erpo: warning: {line}", bar)
                if bar is not None:
                    bar.update(1)
                    flags = {"warning": monitor.warning_tag} if monitor.warning_tag else {}
                    bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", qkl=f"{metrics['qkl/value']:.2e}", **flags)
                if step == last or (cfg.save_every and step % cfg.save_every == 0):
                    checkpoint = self._write(step, lambda: self.save(step))
        finally:
            if bar is not None:
                bar.close()
        plot = plot_runs([cfg.run_dir]) if main and os.path.isfile(metrics_path) else None
        run_rows = read_metrics(cfg.run_dir) if main and history and os.path.isfile(metrics_path) else history
        summary = self._summary(history, run_rows, time.perf_counter() - t_start, checkpoint, plot)
        self.log(summary["line"])
        return summary

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
        these = f" (steps {history[0]['step']}-{history[-1]['step']} in this start)" if self.start_step else ""
        line = (
            f"erpo: {cfg.algorithm} finished step {history[-1]['step']}/{cfg.steps} in {seconds:.0f}s{these}: "
            f"reward {first:.3f} -> {final:.3f} (mean of the run's first/last {k} steps), "
            f"Query-KL {history[-1]['qkl/value']:.2e}; run {cfg.run_dir} (metrics.jsonl, {CURVES_FILE}, "
            f"{os.path.relpath(checkpoint, cfg.run_dir) if checkpoint else 'no checkpoint'})"
        )
        return {"line": line, "steps": len(history), "reward_first": first, "reward_last": final,
                "checkpoint": checkpoint, "plot": plot, "seconds": seconds}


# ---------------------------------------------------------------------- other commands


def build_cache_command(cfg: TrainConfig, log: Callable[[str], None] = print) -> str:
    """`erpo ref-cache`: score every training query under cfg.model and write the cache
    (the set-up steps of `erpo train`, up to the reference cache)."""
    cfg.resolve_training_defaults()
    cfg.validate()
    path = cfg.ref_cache_path
    if os.path.isfile(path) and not cfg.overwrite:  # before any model is built: it may be another run's
        try:
            meta = read_ref_cache(path, "").meta
            built = f" (built for model {meta.get('model')}, template {shown(meta.get('template'), 40)})"
        except RefCacheError:
            built = " (unreadable)"
        raise ErpoError(
            f"ref_cache {path} exists{built}; a run that uses it would no longer resume once it is replaced: "
            f"write the new one elsewhere with ref_cache=PATH, or replace it with overwrite=true"
        )
    device, dtype = setup_device(cfg, writes_run_dir=not cfg.ref_cache)
    examples, _ = setup_data(cfg, training=False)
    model_dir = resolve_model_dir(cfg, examples, log)
    tokenizer, prompt_ids = setup_prompts(cfg, examples, model_dir)
    model, meta = starting_model(cfg, model_dir, tokenizer, device, dtype)
    cache, seconds = score_reference(cfg, model.eval(), prompt_ids, meta, int(tokenizer.pad_token_id), device, dtype)
    save_ref_cache(cache, cfg.ref_cache_path)
    log(
        f"erpo: wrote {cfg.ref_cache_path}: {len(cache)} queries, mean l_0(q) {float(cache.ref_query_logp.mean()):.2f} "
        f"nats over {float(cache.n_tokens.float().mean()):.1f} tokens, in {seconds:.1f}s"
    )
    return cfg.ref_cache_path
