"""How a run starts: the checks that run before anything is loaded or written (device,
kernel backend, attention, output paths, world size), the training data and prompts, the
starting model and the reference cache it scores, the learning-rate schedule. Shared by
`erpo train` (erpo.trainer.Trainer) and `erpo ref-cache` (build_cache_command).
"""
from __future__ import annotations

import math
import os
import shlex
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from erpo_kernels import resolve_backend

from . import checkpoint as ckpt
from . import distributed
from .config import TINY_CONTEXT, ConfigError, TrainConfig
from .data import (Example, batches_per_epoch, check_prompts, encode_prompts, examples_fingerprint, load_examples,
                   template_text)
from .errors import ErpoError
from .models import (autocast, check_context_length, check_vocabulary, enable_gradient_checkpointing, load_model,
                     load_tokenizer, resolve_compute_dtype, resolve_device)
from .packing import resolve_attn_implementation, set_attn_implementation
from .ref_cache import (RefCache, RefCacheError, build_ref_cache, check_cache_meta, fixed_by, model_fingerprint,
                        query_id, read_ref_cache, save_ref_cache, shown, tokenizer_fingerprint, validate_ref_cache)
from .run_plan import RunPlan
from .tiny import build_tokenizer, resolve_model_dir, warmstart_dir


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


def check_prompt_room(cfg: TrainConfig, prompt_ids: Sequence[Sequence[int]], examples: Sequence[Example],
                      model_dir: str, limit: Optional[int] = None) -> None:
    """The prompts' checks against the run's settings and the model's context (max_prompt_tokens,
    micro_batch_tokens, the longest prompt + max_new_tokens): ErpoError before anything runs."""
    check_prompts(prompt_ids, examples, cfg.max_prompt_tokens)
    check_micro_batch_budget(cfg, prompt_ids)
    check_context_length(model_dir, max(len(p) for p in prompt_ids), cfg.max_new_tokens, limit=limit)


def check_demo_prompts(cfg: TrainConfig, examples: Sequence[Example]) -> None:
    """model=tiny: check_prompt_room before its warm start (minutes on a CPU), which does not
    change its tokenizer or its context of TINY_CONTEXT positions."""
    if cfg.is_demo_model:
        ids = encode_prompts(build_tokenizer(), examples, cfg.resolved_template)
        check_prompt_room(cfg, ids, examples, cfg.model, limit=TINY_CONTEXT)


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


_DEMO_TASK_KEYS = ("task", "task_max_operand", "task_train_size", "task_rl_size", "task_eval_size")


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
    parts = [f"{k}={cfg.get(k)}" for k in keys if cfg.get(k) != default.get(k)]
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


def check_world_size(cfg: TrainConfig, world: int) -> None:
    """ErpoError, before anything runs, when `world` ranks (torchrun --nproc-per-node)
    cannot run cfg: tp_size divides the ranks, every data-parallel rank (every rank, or
    every tensor-parallel group) needs an equal share of whole groups, and a run resumes
    on the world size it was trained on (data shares, sampler seeds and optimizer shards
    are per rank)."""
    last = ckpt.resume_point(cfg.resume)[1] if cfg.resume else None
    saved = int(ckpt.read_state(last).get("world_size", 1)) if last else world
    if saved != world:
        how = "erpo train (one process)" if saved == 1 else f"torchrun --nproc-per-node {saved} -m erpo train"
        raise ErpoError(f"resume={cfg.resume}: the run was trained on {saved} rank(s) and this start has {world}; "
                        f"resume it with {how} resume={cfg.resume}, or start a new run")
    tp = cfg.tp_size
    if world % tp:
        raise ErpoError(f"tp_size={tp} does not divide the {world} rank(s) of this start: each tensor-parallel group "
                        f"is tp_size ranks; use torchrun --nproc-per-node with a multiple of {tp} or another tp_size")
    world //= tp  # the data-parallel ranks: a tensor-parallel group takes one share
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


def check_cache_early(cfg: TrainConfig, plan: RunPlan, examples: Sequence[Example], device: torch.device,
                      dtype: torch.dtype) -> None:
    """The reference cache's staleness, checked before the starting model is built
    (model=tiny trains a warm start first): against the checkpoint's reference when
    resuming; for a new run its template and scoring, and for a warm start not trained yet
    the model directory it will have. Nothing to check when the cache is to be built."""
    if not plan.cache_exists:
        return
    with fixed_by(rebuild_command(cfg)):
        meta = read_ref_cache(plan.cache_source).meta
        if plan.resuming:
            check_cache_meta(meta, plan.cache_source, plan.saved_state["reference"])
            return
        if cfg.is_demo_model:
            planned = os.path.abspath(warmstart_dir(cfg, load_examples(cfg, "warmstart"), cfg.resolved_template))
            if not os.path.isdir(planned) and meta.get("model") != planned:
                raise RefCacheError(
                    f"reference cache {plan.cache_source} is stale: built for model weights {meta.get('model')} "
                    f"({meta.get('model_fingerprint')}), this run starts from {planned} (a warm start of other "
                    f"settings)"
                )
        expect = {"template": template_text(cfg.resolved_template), **scoring_meta(cfg, device, dtype)}
        check_cache_meta(meta, plan.cache_source, expect)


@dataclass
class Start:
    """Where training starts from: the starting (pre-RL) model's directory (model=tiny: its
    warm start), the tokenizer and the token ids of every training prompt, the reference
    meta the cache is checked against, and the starting model itself when a new run
    loaded it (None when resuming: the checkpoint's weights are the policy's)."""

    model_dir: str
    tokenizer: Any
    prompt_ids: List[List[int]]
    reference: Dict[str, str]
    model: Optional[Any]


def load_start(cfg: TrainConfig, plan: RunPlan, examples: Sequence[Example], device: torch.device,
               dtype: torch.dtype, log: Callable[[str], None]) -> Start:
    """The Start of this run (ErpoError when a resumed checkpoint's tokenizer is not the run's)."""
    check_demo_prompts(cfg, examples)  # model=tiny: before its warm start
    # the demo model's warm start: trained and cached by rank 0, read from the cache by the others
    model_dir = distributed.main_first(lambda: resolve_model_dir(cfg, load_examples(cfg, "warmstart"), log))
    log(f"erpo: loading {plan.checkpoint or model_dir} and tokenizing {len(examples)} prompts ...")
    tokenizer, prompt_ids = setup_prompts(cfg, examples, plan.checkpoint or model_dir)
    check_prompt_room(cfg, prompt_ids, examples, plan.checkpoint or model_dir)
    if not plan.checkpoint:
        model, reference = starting_model(cfg, model_dir, tokenizer, device, dtype)
        return Start(model_dir, tokenizer, prompt_ids, reference, model)
    reference = dict(plan.saved_state["reference"])
    if tokenizer_fingerprint(tokenizer) != reference["tokenizer_fingerprint"]:
        raise ErpoError(f"resume={cfg.resume}: the checkpoint's tokenizer does not match the run's")
    return Start(model_dir, tokenizer, prompt_ids, reference, None)


def load_reference_cache(cfg: TrainConfig, plan: RunPlan, start: Start, examples: Sequence[Example],
                         device: torch.device, dtype: torch.dtype,
                         log: Callable[[str], None]) -> Tuple[RefCache, torch.Tensor, bool]:
    """(the reference cache, the cache row of each training query [M], whether it was built
    now): read from plan.cache_source and validated, or scored under the starting model
    when there is none (resuming, the starting model must still be the run's)."""
    new = not plan.cache_exists
    if new:
        model = start.model
        if model is None:  # resuming without a cache: the starting model must be the run's
            model = load_scoring_model(cfg, start.model_dir, device)
            if model_fingerprint(model) != start.reference["model_fingerprint"]:
                raise ErpoError(
                    f"resume={cfg.resume}: the reference cache {plan.cache_path} is gone and {start.model_dir} no "
                    f"longer holds the run's starting weights, so it cannot be rebuilt; restore either"
                )
        log(f"erpo: reference cache: scoring the {len(start.prompt_ids)} training prompts under the starting model ...")
        score = score_reference_sharded if distributed.world_size() > 1 else score_reference
        cache, seconds = score(cfg, model, start.prompt_ids, start.reference, int(start.tokenizer.pad_token_id),
                               device, dtype)
        log(f"erpo: reference cache: {len(cache)} queries scored in {seconds:.1f}s")
    with fixed_by(rebuild_command(cfg)):
        if not new:
            cache = read_ref_cache(plan.cache_source)
        rows = validate_ref_cache(cache, plan.cache_source, expect=start.reference, prompt_ids=start.prompt_ids,
                                  describe=lambda i: f"({examples[i].prompt[:40]!r})")
    return cache, rows, new


def _check_moved_start(cfg: TrainConfig, plan: RunPlan, start: Start) -> None:
    """Resuming with the starting model at another path than the run's (moved, or named
    anew): ErpoError unless it holds the run's starting weights (checked in fp32 on CPU)."""
    if not plan.resuming or os.path.abspath(start.model_dir) == start.reference.get("model"):
        return
    if model_fingerprint(load_model(start.model_dir, torch.device("cpu"))) != start.reference["model_fingerprint"]:
        raise ErpoError(f"resume={cfg.resume}: model={cfg.model} does not hold the run's starting weights "
                        f"({start.reference.get('model')}); give that model's path")


def load_policy(cfg: TrainConfig, plan: RunPlan, start: Start, device: torch.device,
                dtype: torch.dtype) -> Tuple[Any, Optional[Any]]:
    """(the policy: the starting weights or the checkpoint's, in fp32, sharded under torchrun;
    the frozen reference model, or None when the run needs none)."""
    model = load_model(plan.checkpoint, device) if plan.checkpoint else start.model
    check_vocabulary(model, start.tokenizer, plan.checkpoint or start.model_dir)
    model.eval()  # no dropout: the sampler and the loss see the same function
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    set_attn_implementation(model, cfg.attn_implementation)  # the packed forward's attention
    if distributed.world_size() > 1:  # FSDP2: each rank keeps a shard of the weights and of AdamW's state
        distributed.shard_model(model, dtype)
    ref_model = None
    if (cfg.algorithm == "grpo" and cfg.beta > 0) or cfg.monitor_policy_kl:
        _check_moved_start(cfg, plan, start)
        ref_model = load_model(start.model_dir, device, dtype).eval()
        ref_model.requires_grad_(False)
        set_attn_implementation(ref_model, cfg.attn_implementation)
    return model, ref_model


def load_optimizer(cfg: TrainConfig, plan: RunPlan, model: Any) -> Tuple[torch.optim.Optimizer, Any]:
    """(AdamW, the learning-rate schedule), their state the checkpoint's when resuming."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    if plan.checkpoint:
        state = ckpt.load_optimizer_state(plan.checkpoint)
        if distributed.is_sharded(model):
            distributed.load_optimizer(model, optimizer, os.path.join(plan.checkpoint, ckpt.OPTIM_DIR))
        else:
            optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    return optimizer, scheduler


def build_cache_command(cfg: TrainConfig, log: Callable[[str], None] = print) -> str:
    """`erpo ref-cache`: score every training query under cfg.model and write the cache
    (the set-up steps of `erpo train`, up to the reference cache)."""
    cfg.resolve_training_defaults()
    cfg.validate()
    path = cfg.ref_cache_path
    if os.path.isfile(path) and not cfg.overwrite:  # before any model is built: it may be another run's
        try:
            meta = read_ref_cache(path).meta
            built = f" (built for model {meta.get('model')}, template {shown(meta.get('template'), 40)})"
        except RefCacheError:
            built = " (unreadable)"
        raise ErpoError(
            f"ref_cache {path} exists{built}; a run that uses it would no longer resume once it is replaced: "
            f"write the new one elsewhere with ref_cache=PATH, or replace it with overwrite=true"
        )
    device, dtype = setup_device(cfg, writes_run_dir=not cfg.ref_cache)
    examples, _ = setup_data(cfg, training=False)
    model_dir = resolve_model_dir(cfg, load_examples(cfg, "warmstart"), log)
    tokenizer, prompt_ids = setup_prompts(cfg, examples, model_dir)
    model, meta = starting_model(cfg, model_dir, tokenizer, device, dtype)
    cache, seconds = score_reference(cfg, model.eval(), prompt_ids, meta, int(tokenizer.pad_token_id), device, dtype)
    save_ref_cache(cache, cfg.ref_cache_path)
    log(
        f"erpo: wrote {cfg.ref_cache_path}: {len(cache)} queries, mean l_0(q) {float(cache.ref_query_logp.mean()):.2f} "
        f"nats over {float(cache.n_tokens.float().mean()):.1f} tokens, in {seconds:.1f}s"
    )
    return cfg.ref_cache_path
