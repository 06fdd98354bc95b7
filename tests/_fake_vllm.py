"""A stand-in for the `vllm` module (version erpo.rollout.VLLM_VERSION) that checks every
call erpo's vLLM engine makes against that version's API, read from its source:

    vllm.LLM(model, *, tokenizer=None, tensor_parallel_size=1, dtype="auto", seed=0,
             gpu_memory_utilization=0.92, ..., **kwargs)   kwargs: EngineArgs fields
    LLM.generate(prompts, sampling_params=None, *, use_tqdm=True, lora_request=None,
                 priority=None, tokenization_kwargs=None, mm_processor_kwargs=None)
    LLM.sleep(level=1, mode="abort"), LLM.wake_up(tags=None) (tags from weights,
    kv_cache, scheduling), LLM.apply_model(func), LLM.reset_prefix_cache(
    reset_running_requests=False, reset_connector=False)
    vllm.SamplingParams(n=1, presence_penalty=0.0, ..., top_k=0 (0 or -1 disable), ...)
    RequestOutput.outputs[i]: CompletionOutput(index, text, token_ids, cumulative_logprob,
             logprobs: [{token_id: Logprob(logprob, rank, decoded_token)}], finish_reason, ...)
    the model's load_weights(weights: Iterable[tuple[str, Tensor]]) -> set[str]

    vllm.platforms.current_platform: device_name, is_cpu(), is_sleep_mode_available() (a CUDA machine's)

and behaves like the engine in what erpo relies on: sleep(level=2) drops the weights (the
engine's copy becomes NaN) and the KV cache, generating while asleep is an error, writing
weights while they are asleep is an error, and generation samples from the engine's own
copy of the model (so a stale or partial weight sync shows in the samples and log-probs).
Sampling uses transformers' generate (erpo.rollout.generate_ids_with_logprobs), so the
returned log-probs are processed log-probs: log softmax(logits / tau).

It stands in for vLLM on CUDA only, which cannot run here: the sleep / wake order, the
external launcher, load_weights through apply_model. vLLM's CPU build runs live in
tests/vllm_live (make test), which checks the sampler, the weight sync and training.
"""
from __future__ import annotations

import copy
import os
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch

__version__ = "0.33.0"

# EngineArgs fields of 0.33.0 that LLM(**kwargs) forwards (the subset any caller here may use).
ENGINE_ARGS = {
    "enable_sleep_mode": bool, "logprobs_mode": str, "max_model_len": int, "distributed_executor_backend": str,
    "generation_config": str, "enable_prefix_caching": bool, "max_num_seqs": int, "max_num_batched_tokens": int,
    "max_logprobs": int, "disable_log_stats": bool, "use_tqdm_on_load": bool,
}
class CudaPlatform:
    """vllm.platforms.current_platform on a CUDA machine (the parts erpo reads)."""

    device_name = "cuda"

    def is_cpu(self) -> bool:
        return False

    def is_sleep_mode_available(self) -> bool:
        return True


platforms = types.SimpleNamespace(current_platform=CudaPlatform())

LOGPROBS_MODES = ("raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs")
EXECUTOR_BACKENDS = ("ray", "mp", "uni", "external_launcher")
WAKE_TAGS = ("weights", "kv_cache", "scheduling")


@dataclass
class SamplingParams:
    """The fields of vllm 0.33.0's SamplingParams that shape sampling, with their defaults;
    any other keyword is a TypeError, as it is for the real msgspec struct."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Any] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    logit_bias: Optional[Dict[int, float]] = None
    allowed_token_ids: Optional[List[int]] = None
    bad_words: Optional[List[str]] = None

    def __post_init__(self):  # the checks of _verify_args that apply
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.temperature < 0:
            raise ValueError("temperature must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1 or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.logprobs is not None and self.logprobs != -1 and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative or -1, got {self.logprobs}.")


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[List[Dict[int, Logprob]]]
    finish_reason: Optional[str] = None
    stop_reason: Any = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    prompt_logprobs: Any
    outputs: List[CompletionOutput]
    finished: bool = True


class EngineModel(torch.nn.Module):
    """The engine's own copy of the model, with vLLM's load_weights contract."""

    def __init__(self, hf_model: torch.nn.Module, log: List[Tuple]):
        super().__init__()
        self.inner = copy.deepcopy(hf_model).eval()
        self.log = log
        self.loaded_since_wake: Set[str] = set()

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        params = dict(self.inner.named_parameters())
        loaded: Set[str] = set()
        for name, tensor in weights:  # consumed one at a time
            if name not in params:
                raise KeyError(f"load_weights: unknown weight name {name!r}")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"load_weights: {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
            self.log.append(("load_weight", name))
        self.loaded_since_wake |= loaded
        return loaded

    def has_dropped_weights(self) -> bool:
        return any(bool(torch.isnan(p).any()) for p in self.inner.parameters())


class LLM:
    """vllm.LLM of 0.33.0 as far as erpo uses it; every call is appended to `calls`."""

    instances: List["LLM"] = []
    hf_model: Optional[torch.nn.Module] = None  # the model a test "serves" (the fake cannot read a directory)

    def __init__(self, model: str, *, runner: str = "auto", convert: str = "auto", tokenizer: Optional[str] = None,
                 tokenizer_mode: str = "auto", skip_tokenizer_init: bool = False, trust_remote_code: bool = False,
                 tensor_parallel_size: int = 1, dtype: str = "auto", quantization: Optional[str] = None,
                 revision: Optional[str] = None, seed: int = 0, gpu_memory_utilization: float = 0.92,
                 cpu_offload_gb: float = 0, enforce_eager: bool = False, **kwargs: Any) -> None:
        for key, value in kwargs.items():
            if key not in ENGINE_ARGS:
                raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument {key!r}")
            if not isinstance(value, ENGINE_ARGS[key]):
                raise TypeError(f"{key}={value!r} is not a {ENGINE_ARGS[key].__name__}")
        if kwargs.get("logprobs_mode", "raw_logprobs") not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={kwargs['logprobs_mode']!r}")
        if kwargs.get("distributed_executor_backend", "uni") not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={kwargs['distributed_executor_backend']!r}")
        if dtype not in ("auto", "half", "float16", "bfloat16", "float", "float32"):
            raise ValueError(f"dtype={dtype!r}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if kwargs.get("distributed_executor_backend") == "external_launcher":
            assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0", (
                "To get deterministic execution, please set VLLM_ENABLE_V1_MULTIPROCESSING=0")
        if LLM.hf_model is None:
            raise RuntimeError("fake vllm: set LLM.hf_model to the model the engine serves")
        self.model_path = model
        self.init_kwargs = dict(tokenizer=tokenizer, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                                seed=seed, gpu_memory_utilization=gpu_memory_utilization, **kwargs)
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        self.calls: List[Tuple] = []
        self.model = EngineModel(LLM.hf_model, self.calls)
        self.model.loaded_since_wake = {n for n, _ in self.model.inner.named_parameters()}  # loaded from `model`
        self.weights_asleep = False
        self.cache_asleep = False
        LLM.instances.append(self)

    # -- sampling
    def generate(self, prompts: Any, sampling_params: Optional[SamplingParams] = None, *,
                 use_tqdm: Any = True, lora_request: Any = None, priority: Any = None,
                 tokenization_kwargs: Optional[Dict[str, Any]] = None,
                 mm_processor_kwargs: Optional[Dict[str, Any]] = None) -> List[RequestOutput]:
        from erpo.rollout import generate_ids_with_logprobs

        self.calls.append(("generate", sampling_params))
        if self.weights_asleep or self.cache_asleep:
            raise RuntimeError("generate on a sleeping engine (wake_up with every tag first)")
        if self.model.has_dropped_weights():
            raise RuntimeError("generate with dropped weights: some parameters were never reloaded after sleep")
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams")
        p = sampling_params
        if self.init_kwargs.get("logprobs_mode") != "processed_logprobs" or p.logprobs is None:
            raise AssertionError("fake vllm serves processed log-probs only (the engine must ask for them)")
        prompts = prompts if isinstance(prompts, list) else [prompts]
        stops = sorted(set(p.stop_token_ids or []))
        out = []
        for r, prompt in enumerate(prompts):
            ids = prompt["prompt_token_ids"]
            with torch.random.fork_rng():  # the request's own generator, as vLLM seeds one per request
                torch.manual_seed((p.seed if p.seed is not None else 0) + r)
                tokens, logprobs = generate_ids_with_logprobs(
                    self.model.inner, [ids] * p.n, temperature=p.temperature, max_new_tokens=p.max_tokens,
                    pad_token_id=0, eos_token_ids=stops)
            completions = [CompletionOutput(
                index=j, text="", token_ids=t, cumulative_logprob=float(sum(lp)),
                logprobs=[{tok: Logprob(v, rank=1)} for tok, v in zip(t, lp)],
                finish_reason="stop" if t and t[-1] in stops else "length",
                stop_reason=t[-1] if t and t[-1] in stops else None) for j, (t, lp) in enumerate(zip(tokens, logprobs))]
            out.append(RequestOutput(str(r), None, list(ids), None, completions))
        return out

    # -- sleep mode
    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", level))
        if not self.init_kwargs.get("enable_sleep_mode"):
            raise AssertionError("sleep mode is disabled (LLM(enable_sleep_mode=True))")
        if level not in (0, 1, 2) or mode not in ("abort", "wait", "keep"):
            raise ValueError(f"sleep(level={level}, mode={mode!r})")
        if level >= 1:
            self.weights_asleep = self.cache_asleep = True
        if level == 2:  # weights discarded: what wakes up is uninitialised memory
            with torch.no_grad():
                for p in self.model.inner.parameters():
                    p.fill_(float("nan"))
            self.model.loaded_since_wake = set()

    def wake_up(self, tags: Optional[List[str]] = None) -> bool:
        self.calls.append(("wake_up", None if tags is None else tuple(tags)))
        if tags is not None and any(t not in WAKE_TAGS for t in tags):
            raise ValueError(f"wake_up tags must be in {WAKE_TAGS}, got {tags}")
        if tags is None or "weights" in tags:
            self.weights_asleep = False
        if tags is None or "kv_cache" in tags:
            self.cache_asleep = False
        return not (self.weights_asleep or self.cache_asleep)

    # -- the model in the worker
    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> List[Any]:
        self.calls.append(("apply_model",))
        if not self.in_process:
            raise AssertionError("apply_model with a closure over training tensors needs the engine in-process "
                                 "(VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        if self.weights_asleep:
            raise RuntimeError("touching the weights of a sleeping engine (wake_up(tags=['weights']) first)")
        return [func(self.model)]

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return True
