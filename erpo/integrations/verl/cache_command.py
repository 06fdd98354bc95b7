"""`python -m erpo.integrations.verl ref-cache OVERRIDES... [--overwrite]`: the reference
cache of a verl run (l_0(q) of every training prompt under its starting model, docs/method.md
section 7), built from the overrides the run trains with.

The prompts are the token ids verl's rollout receives, made by verl's own code: its
ppo_trainer config composed with the overrides (as main_ppo composes it), the training set
read by the dataset class and collate_fn its trainer uses (create_rl_dataset: prompt_key,
the overlong-prompt filter, train_max_samples), and each row run through verl's agent loop
(the row's agent_name, else rollout.agent.default_agent_loop: chat template,
apply_chat_template_kwargs, custom_chat_template, tools, the rollout.prompt_length cut) up
to the call to the rollout server, which this command stands in for: the prompt ids of
that call are the row's prompt. Each distinct prompt is scored once under
actor_rollout_ref.model.path at the actor's FSDP parameter dtype by
erpo.ref_cache.build_ref_cache (erpo train's scoring), and the cache is written atomically
to +actor_rollout_ref.actor.policy_loss.ref_cache, the file the loss reads; an existing
file is replaced only with --overwrite.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import shlex
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from ...errors import ErpoError
from ...models import autocast
from ...ref_cache import (RefCache, RefCacheError, build_ref_cache, model_fingerprint, read_ref_cache, save_ref_cache,
                          tokenizer_fingerprint)
from . import REF_CACHE_COMMAND, forward_kernel_backend

CACHE_KEY = "actor_rollout_ref.actor.policy_loss.ref_cache"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        raise ErpoError(f"{message} (see {REF_CACHE_COMMAND} --help)")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = _Parser(prog=REF_CACHE_COMMAND, description="Build the reference cache of a verl run from the overrides it "
                "trains with (docs/verl.md).")
    p.add_argument("overrides", nargs="*", help="verl config overrides, as given to python -m verl.trainer.main_ppo "
                   f"(the cache goes to +{CACHE_KEY}=PATH)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing cache file")
    p.add_argument("--device", default=None, help="device of the starting model: cuda (the default when there is "
                   "one), cuda:N or cpu")
    p.add_argument("--batch-size", type=int, default=64, help="prompts per forward (default 64)")
    p.add_argument("--config-path", default=None, help="directory of your own hydra config (default: verl's "
                   "trainer/config, as main_ppo)")
    p.add_argument("--config-name", default="ppo_trainer", help="config name (default ppo_trainer)")
    args = p.parse_intermixed_args(list(argv))
    if args.batch_size < 1:
        raise ErpoError(f"--batch-size must be at least 1, got {args.batch_size}")
    return args


def resolve_device(name: Optional[str]) -> torch.device:
    """--device: cuda when there is one (else cpu) by default; a named one must exist."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ErpoError(f"--device={name} is not a device; use cuda, cuda:N or cpu") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ErpoError(f"--device={name} but no CUDA device is available; use --device cpu")
    return device


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def compose_config(overrides: Sequence[str], config_path: Optional[str] = None, config_name: str = "ppo_trainer"):
    """verl's trainer config with the overrides, composed as main_ppo's hydra main does and
    resolved as its task runner resolves it."""
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    config_dir = os.path.abspath(config_path) if config_path else os.path.join(
        os.path.dirname(verl.__file__), "trainer", "config")
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = compose(config_name, overrides=list(overrides))
        OmegaConf.resolve(cfg)
        return cfg
    except (HydraException, OmegaConfBaseException, OSError) as exc:
        raise ErpoError(f"the verl config does not compose with these overrides: {_first_line(exc)}") from None


def cache_path(cfg: Any, overwrite: bool) -> str:
    """Where the cache goes (the loss's policy_loss.ref_cache); refused when it exists, without overwrite."""
    from omegaconf import OmegaConf

    path = OmegaConf.select(cfg, CACHE_KEY)
    if not path:
        raise ErpoError(f"set +{CACHE_KEY}=PATH (the training override the loss reads the cache from; this command "
                        f"writes it there)")
    path = os.path.expanduser(str(path))
    if os.path.isdir(path):
        raise ErpoError(f"{CACHE_KEY}={path} is a directory; give the cache file's path")
    if os.path.exists(path) and not overwrite:
        try:
            built = read_ref_cache(path).meta.get("verl_command")
            built = f" (built by: {built})" if built else ""
        except RefCacheError:
            built = " (not a cache erpo can read)"
        raise ErpoError(f"reference cache {path} exists{built}; replace it with --overwrite, or write another with "
                        f"+{CACHE_KEY}=OTHER_PATH")
    return path


def model_config(cfg: Any) -> Any:
    """verl's HFModelConfig of the actor (tokenizer with custom_chat_template, processor, hf_config)."""
    from verl.utils.config import omega_conf_to_dataclass

    try:
        return omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    except (OSError, ValueError) as exc:
        raise ErpoError(f"actor_rollout_ref.model.path={cfg.actor_rollout_ref.model.path}: {_first_line(exc)}") from None


def training_set(cfg: Any, model: Any) -> Any:
    """The training rows as verl's trainer reads them (create_rl_dataset over data.train_files)."""
    from omegaconf import ListConfig
    from verl.trainer.ppo.utils import create_rl_dataset

    data = cfg.data
    files = list(data.train_files) if isinstance(data.train_files, (list, ListConfig)) else [data.train_files]
    for f in files:
        if "://" not in str(f) and not os.path.exists(os.path.expanduser(str(f))):
            raise ErpoError(f"data.train_files: {f} does not exist")
    max_samples = data.get("train_max_samples", -1)
    if max_samples > 0 and data.get("shuffle", False) and data.get("seed") is None:
        raise ErpoError("data.train_max_samples with data.shuffle=True and no data.seed draws other rows in every "
                        "run; set data.seed=N so that the cache and the run see the same rows")
    dataset = create_rl_dataset(files, data, model.tokenizer, model.processor, is_train=True, max_samples=max_samples)
    if len(dataset) == 0:
        raise ErpoError("data.train_files: no training rows (after verl's filter of prompts over data.max_prompt_length)")
    return dataset


class _Prompt(BaseException):
    """Raised by _PromptCapture.generate: the prompt an agent loop sends to the rollout (a
    BaseException, so that an agent loop's `except Exception` does not swallow it)."""

    def __init__(self, prompt_ids: List[int]):
        super().__init__()
        self.prompt_ids = prompt_ids


class _PromptCapture:
    """Stands in for verl's LLMServerClient: an agent loop's first generate call carries its prompt."""

    async def generate(self, *, prompt_ids: Sequence[int], **unused: Any) -> None:
        raise _Prompt([int(t) for t in prompt_ids])


def rollout_prompts(cfg: Any, dataset: Any, batch_size: int = 64) -> List[List[int]]:
    """The prompt token ids verl's agent loop sends to the rollout for each row of `dataset`
    (batches of verl's collate_fn, one agent loop per row as verl's AgentLoopWorker runs them)."""
    from torch.utils.data import DataLoader
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.utils.dataset.rl_dataset import collate_fn

    worker = AgentLoopWorker(cfg, _PromptCapture())
    rollout = cfg.actor_rollout_ref.rollout
    sampling = dict(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                    repetition_penalty=1.0, logprobs=rollout.calculate_log_probs)

    async def every_row() -> List[List[int]]:
        out: List[List[int]] = []
        for batch in DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate_fn):
            for i in range(len(batch["raw_prompt"])):
                row = {k: v[i] for k, v in batch.items()}
                row.setdefault("agent_name", rollout.agent.default_agent_loop)
                out.append(await _prompt_of(worker, row, sampling, len(out)))
        return out

    return asyncio.run(every_row())


async def _prompt_of(worker: Any, row: Dict[str, Any], sampling: Dict[str, Any], index: int) -> List[int]:
    trajectory = {"step": 0, "sample_index": index, "rollout_n": 0, "validate": False}
    try:
        await worker._run_agent_loop(dict(sampling), trajectory, trace=False, session_id=0, **row)
    except _Prompt as sent:
        return sent.prompt_ids
    except Exception as exc:  # the row's agent loop failed before its rollout: bad data or template
        raise ErpoError(f"training row {index}: verl's agent loop {row['agent_name']!r} failed before calling the "
                        f"rollout: {_first_line(exc)}") from None
    raise ErpoError(f"training row {index}: verl's agent loop {row['agent_name']!r} returned without calling the rollout")


def param_dtype(cfg: Any) -> torch.dtype:
    """The dtype the actor's forward runs in: its FSDP mixed_precision.param_dtype (verl's default bf16)."""
    from omegaconf import OmegaConf
    from verl.utils.torch_dtypes import PrecisionType

    mixed = OmegaConf.select(cfg, "actor_rollout_ref.actor.fsdp_config.mixed_precision")
    return PrecisionType.to_dtype((mixed or {}).get("param_dtype", "bf16"))


def starting_model(model: Any, device: torch.device) -> Any:
    """The actor's starting weights in fp32 (verl's hf_config, overrides included; sdpa attention)."""
    from transformers import AutoModelForCausalLM

    try:
        net = AutoModelForCausalLM.from_pretrained(model.local_path, config=copy.deepcopy(model.hf_config),
                                                   dtype=torch.float32, attn_implementation="sdpa",
                                                   trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ErpoError(f"actor_rollout_ref.model.path={model.path}: {_first_line(exc)}") from None
    return net.to(device).eval()


def score(cfg: Any, model: Any, prompts: Sequence[Sequence[int]], device: torch.device, batch_size: int,
          command: str) -> RefCache:
    """build_ref_cache of the distinct prompts under the starting model, with the meta of this build."""
    net = starting_model(model, device)
    dtype = param_dtype(cfg)
    template = {"chat_template": getattr(model.tokenizer, "chat_template", None),
                "apply_chat_template_kwargs": dict(cfg.data.get("apply_chat_template_kwargs") or {})}
    backend = forward_kernel_backend(cfg.actor_rollout_ref.model.get("fused_kernel_options"))
    meta = {"model": str(model.path), "model_fingerprint": model_fingerprint(net),
            "tokenizer_fingerprint": tokenizer_fingerprint(model.tokenizer),
            "template": json.dumps(template, sort_keys=True), "compute_dtype": str(dtype).replace("torch.", ""),
            "attn_implementation": "sdpa", "kernel_backend": backend, "verl_command": command}
    pad = model.tokenizer.pad_token_id
    with autocast(device, dtype):
        return build_ref_cache(net, prompts, meta, pad_token_id=int(pad if pad is not None else 0),
                               batch_size=batch_size, backend=backend, compute_dtype=dtype)


def build(argv: Sequence[str], log: Any = print) -> str:
    """The command: compose, read the rows, take their rollout prompts, score, write. Returns the path."""
    args = parse_args(argv)
    device = resolve_device(args.device)
    t0 = time.perf_counter()
    cfg = compose_config(args.overrides, args.config_path, args.config_name)
    path = cache_path(cfg, args.overwrite)
    model = model_config(cfg)
    dataset = training_set(cfg, model)
    prompts = rollout_prompts(cfg, dataset)
    command = " ".join([REF_CACHE_COMMAND] + [shlex.quote(a) for a in argv if a != "--overwrite"])
    cache = score(cfg, model, prompts, device, args.batch_size, command)
    save_ref_cache(cache, path)
    log(f"erpo: wrote {path}: {len(prompts)} training rows, {len(cache)} distinct prompts, mean l_0(q) "
        f"{float(cache.ref_query_logp.mean()):.2f} nats over {float(cache.n_tokens.float().mean()):.1f} tokens "
        f"({cache.meta['compute_dtype']}, {device}), in {time.perf_counter() - t0:.1f}s")
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`ref-cache`'s entry: 0 when the cache is written, 2 with one `erpo: error:` line on bad input."""
    try:
        build(list(sys.argv[1:] if argv is None else argv))
    except ErpoError as exc:
        print(f"erpo: error: {exc}", file=sys.stderr)
        return 2
    return 0
