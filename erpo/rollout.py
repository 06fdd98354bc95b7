"""Rollout engines: sample G responses per prompt, with the sampled tokens' log-probs.

The trainer talks to a RolloutEngine: `generate` samples from the current weights and
returns a Rollout (the responses and, per response token, its log-probability under the
sampling distribution softmax(logits / tau): what the engine actually sampled from);
`sync_weights` pushes new weights after an optimizer step.

HFRolloutEngine (transformers' generate on the training model) is the CPU path;
VLLMRolloutEngine is a colocated vLLM engine (rollout_backend=vllm; its protocol below).
`generate_ids` is the one place that calls HF generate: the rollout and the evaluation
(erpo.evaluate) both sample through it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch

from .config import ConfigError
from .errors import ErpoError
from .distributed import is_sharded

ROLLOUT_BACKENDS = ("hf", "vllm")


@dataclass
class Rollout:
    """What an engine returns for m prompts and n samples each."""

    responses: List[List[List[int]]]  # [m][n] token ids, up to and including the first EOS
    logprobs: Optional[List[List[List[float]]]] = None  # [m][n][L]: log pi_rollout(y_t) at the sampling temperature

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


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(
        self, prompt_ids: Sequence[Sequence[int]], n: int, temperature: float, max_new_tokens: int
    ) -> Rollout:
        """n sampled responses per prompt: responses[i][j] = token ids of response j to
        prompt i, ending at (and including) the first EOS, or max_new_tokens long.
        temperature 0 = greedy; otherwise plain sampling from softmax(logits / temperature)
        (no top-k, top-p, min-p or penalties, so the trainer's 1/tau scoring is the
        sampler's distribution). logprobs[i][j][t] = log of the probability the sampler
        gave token t (None when the engine cannot tell)."""
        ...

    def sync_weights(self, model: Any) -> None:
        """Make the engine sample from `model`'s current weights."""
        ...


class HFRolloutEngine:
    """Sampling with transformers' `generate` on the training model itself (shared
    weights, so sync_weights has nothing to do). Each prompt is repeated n times;
    batch_size (0 = all) caps the sequences per generate call. Randomness comes from
    torch's global generator (the trainer seeds it per step). The log-probs are those
    of generate's own logits at the sampling temperature (generate_ids_with_logprobs).
    """

    def __init__(self, model: Any, pad_token_id: int, eos_token_ids: Iterable[int], batch_size: int = 0):
        self.model = model
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
        for start in range(0, len(flat), step):
            toks, lps = _generate(self.model, flat[start:start + step], temperature, max_new_tokens,
                                  self.pad_token_id, self.eos_token_ids, record=temperature > 0)
            tokens.extend(toks)
            logprobs.extend(lps or [])
        def by_prompt(rows: List[Any]) -> List[List[Any]]:
            return [rows[i * n:(i + 1) * n] for i in range(len(prompt_ids))]

        return Rollout(by_prompt(tokens), by_prompt(logprobs) if temperature > 0 else None)


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
    """A logits processor that records log softmax(scores / tau) of each sampled token.

    transformers runs processors passed to `generate` before its temperature warper, so
    the scores seen here are the model's fp32 logits; the token sampled at step t is the
    last column of input_ids at step t + 1 (and of the final sequences for the last
    step), so only one [b, V] row of log-probs is held at a time.
    """

    def __init__(self, temperature: float):
        self.inv_temperature = 1.0 / float(temperature)
        self.pending: Optional[torch.Tensor] = None  # [b, V] log-probs of the step whose token is not yet known
        self.columns: List[torch.Tensor] = []  # [b] per generated token

    def take(self, sampled: torch.Tensor) -> None:
        if self.pending is not None:
            self.columns.append(self.pending.gather(1, sampled[:, None].to(self.pending.device))[:, 0].cpu())
            self.pending = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.take(input_ids[:, -1])
        self.pending = torch.log_softmax(scores.float() * self.inv_temperature, dim=-1)  # [b, V]
        return scores


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
    return _generate(model, prompts, temperature, max_new_tokens, pad_token_id, eos_token_ids, False)[0]


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
    tokens, logprobs = _generate(model, prompts, temperature, max_new_tokens, pad_token_id, eos_token_ids, True)
    return tokens, logprobs


@torch.no_grad()
def _generate(
    model: Any, prompts: Sequence[Sequence[int]], temperature: float, max_new_tokens: int, pad_token_id: int,
    eos_token_ids: Sequence[int], record: bool,
) -> Tuple[List[List[int]], Optional[List[List[float]]]]:
    """(responses, their tokens' sampling log-probs when `record`, else None): one generate call."""
    from transformers import GenerationConfig, LogitsProcessorList

    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_token_id)  # [b, Lp]
    sampling = dict(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0) if temperature > 0 \
        else dict(do_sample=False)
    config = GenerationConfig(
        max_new_tokens=int(max_new_tokens), pad_token_id=int(pad_token_id), eos_token_id=[int(e) for e in eos_token_ids],
        num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0, use_cache=True, **sampling,
    )
    recorder = _SampledLogprobs(temperature) if record else None
    extra = {"logits_processor": LogitsProcessorList([recorder])} if recorder is not None else {}
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
        return tokens, None
    recorder.take(seqs[:, -1])
    table = torch.stack(recorder.columns, dim=1) if recorder.columns else torch.zeros(len(tokens), 0)  # [b, steps]
    return tokens, [table[i, :len(t)].tolist() for i, t in enumerate(tokens)]


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
# Between rollouts it sleeps so the trainer gets the GPU memory back:
#
#     generate:      wake_up(kv_cache) -> LLM.generate -> sleep(level=2)   (weights and KV cache dropped)
#     sync_weights:  wake_up(weights) -> the model's load_weights, one parameter at a time
#
# so every rollout samples from the weights of the latest optimizer step, and the engine
# holds no memory while the trainer runs its forward and backward passes. The sampling
# parameters are exactly the trainer's: temperature tau, no top-p / top-k / min-p, no
# penalties, n = G, max_tokens, stop at the EOS ids; the sampled tokens' log-probs come
# back as vLLM's processed log-probs (logprobs_mode="processed_logprobs": after the
# temperature, i.e. log softmax(logits / tau)), the rollout log-probs of the mismatch
# correction.
#
# Written against the API of vLLM VLLM_VERSION (the `erpo[vllm]` extra) and tested in this
# repository against a fake module that checks each call against that version's signatures
# (tests/_fake_vllm.py), not against a live vLLM: vLLM needs a CUDA machine.

VLLM_VERSION = "0.33.0"
INSTALL_HINT = f"pip install 'erpo[vllm]' (vllm=={VLLM_VERSION}; needs a CUDA machine)"
SLEEP_LEVEL = 2  # drop weights and KV cache: the weights are reloaded after every optimizer step anyway


def import_vllm() -> Any:
    """The vllm module, or an ErpoError saying how to install it."""
    try:
        import vllm
    except ImportError:
        raise ErpoError(f"rollout_backend=vllm needs vLLM, which is not installed: {INSTALL_HINT}") from None
    return vllm


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
    model was loaded from); see the module docstring for the sleep / wake protocol.

    dtype: vLLM's dtype name (bfloat16, float16, float32). max_model_len: longest prompt
    plus max_new_tokens. seed: the engine's seed (each generate call also passes a
    per-request seed drawn from torch's global generator, which the trainer seeds per step).
    vllm_module: the vllm module (tests pass a fake one).
    """

    def __init__(
        self,
        model_dir: str,
        eos_token_ids: Iterable[int],
        *,
        dtype: str,
        max_model_len: int,
        gpu_memory_utilization: float = 0.3,
        seed: int = 0,
        vllm_module: Any = None,
    ):
        self.vllm = vllm_module if vllm_module is not None else import_vllm()
        self.eos_token_ids = sorted({int(e) for e in eos_token_ids})
        if not self.eos_token_ids:
            raise ValueError("eos_token_ids must name at least one end-of-sequence token")
        # The engine must run in this process (its model is reached by apply_model, and the
        # external_launcher executor requires it).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs: Dict[str, Any] = dict(
            tokenizer=model_dir,
            dtype=dtype,
            seed=int(seed),
            gpu_memory_utilization=float(gpu_memory_utilization),
            max_model_len=int(max_model_len),
            enable_sleep_mode=True,
            logprobs_mode="processed_logprobs",  # log-probs after the temperature: what was sampled from
            generation_config="vllm",  # the model's generation_config.json must not add defaults
            tensor_parallel_size=1,
        )
        if _distributed():
            kwargs["distributed_executor_backend"] = "external_launcher"
            kwargs["seed"] = int(seed) + torch.distributed.get_rank()
        self.llm = self.vllm.LLM(model_dir, **kwargs)
        self.weights_awake = True  # a new engine holds the weights of model_dir
        self.cache_awake = True

    # ------------------------------------------------------------------ sampling

    def sampling_params(self, n: int, temperature: float, max_new_tokens: int, seed: int) -> Any:
        """vLLM SamplingParams equal to the trainer's sampler: softmax(logits / tau), nothing else."""
        return self.vllm.SamplingParams(
            n=int(n),
            temperature=float(temperature),
            top_p=1.0,
            top_k=0,  # 0 disables top-k in this version
            min_p=0.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            repetition_penalty=1.0,
            max_tokens=int(max_new_tokens),
            min_tokens=0,
            stop_token_ids=list(self.eos_token_ids),
            ignore_eos=False,
            logprobs=0,  # only the sampled token's log-prob
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
        self.llm.sleep(level=SLEEP_LEVEL)
        self.weights_awake = self.cache_awake = False
        if len(outputs) != len(prompt_ids):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompt_ids)} prompts")
        responses: List[List[List[int]]] = []
        logprobs: List[List[List[float]]] = []
        for request in outputs:
            completions = sorted(request.outputs, key=lambda c: c.index)
            group, group_lp = [], []
            for c in completions:
                tokens = cut_at_eos(list(c.token_ids), self.eos_token_ids)
                group.append(tokens)
                group_lp.append(self._token_logprobs(c, tokens) if temperature > 0 else [])
            responses.append(group)
            logprobs.append(group_lp)
        return Rollout(responses, logprobs if temperature > 0 else None)

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
        load: Callable[[Any], Any] = lambda engine_model: engine_model.load_weights(named_weights(model))  # noqa: E731
        self.llm.apply_model(load)
        if self.cache_awake:  # cached prefixes were computed with the old weights
            self.llm.reset_prefix_cache()


# ---------------------------------------------------------------------- choosing one

VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_rollout_backend(backend: str, device: torch.device) -> None:
    """Before anything is loaded: rollout_backend=vllm needs vLLM installed (ErpoError saying
    how) and a CUDA device (ConfigError)."""
    if backend != "vllm":
        return
    import_vllm()
    if torch.device(device).type != "cuda":
        raise ConfigError(f"rollout_backend=vllm runs on CUDA only (this run is on {device}); "
                          f"use rollout_backend=hf or device=cuda")


def make_engine(cfg: Any, model: Any, model_dir: str, tokenizer: Any, prompt_ids: Sequence[Sequence[int]],
                compute_dtype: torch.dtype, vllm_module: Any = None) -> RolloutEngine:
    """The engine cfg.rollout_backend names, sampling from `model` (loaded from model_dir)."""
    eos = eos_ids_of(model, tokenizer)
    if cfg.rollout_backend == "hf":
        return HFRolloutEngine(model, int(tokenizer.pad_token_id), eos, cfg.rollout_batch_size)
    return VLLMRolloutEngine(
        model_dir, eos, dtype=VLLM_DTYPES[compute_dtype],
        max_model_len=max(len(p) for p in prompt_ids) + cfg.max_new_tokens,
        gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, seed=cfg.seed, vllm_module=vllm_module,
    )
