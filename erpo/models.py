"""Loading models and tokenizers, and where and in which dtype they run: what the
trainer, the evaluation and the demo model share.

    device = resolve_device(cfg)                      # torch.device (cuda when available)
    dtype = resolve_compute_dtype(cfg, device)        # the dtype of forward passes
    model = load_model(path, device)                  # a local causal LM, never the network
    with autocast(device, dtype): ...                 # mixed precision over fp32 parameters

Imports only erpo.config (and transformers, lazily): tiny, trainer and eval_command import
this module, never the other way round.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from .config import ConfigError, TrainConfig
from .errors import ErpoError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(cfg: TrainConfig) -> torch.device:
    """The torch device of the run (and, on CPU, the number of threads torch uses)."""
    threads = cfg.cpu_threads or (1 if cfg.is_demo_model else 0)
    if threads:
        torch.set_num_threads(threads)
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={cfg.device} but no CUDA device is available; use device=cpu or device=auto")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device={cfg.device} but there are {torch.cuda.device_count()} CUDA devices (cuda:0 ...)")
    return device


def resolve_compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """The dtype of forward passes (parameters and optimizer state stay fp32)."""
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[cfg.dtype]


def autocast(device: torch.device, dtype: torch.dtype) -> Any:
    """Mixed precision for forward passes of fp32 parameters (a no-op for fp32)."""
    if dtype not in (torch.bfloat16, torch.float16):  # fp32 (and fp64 in tests): nothing to cast
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def quiet_transformers() -> None:
    """No per-file progress bars or advisory warnings from transformers in our output."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def check_model_dir(path: str, what: str = "model", alternatives: str = "or model=tiny for the embedded demo model") -> None:
    """ErpoError unless `path` is a directory with a config.json (`what` names the setting)."""
    if not os.path.isdir(path):
        problem = "is a file, not a directory" if os.path.exists(path) else "does not exist"
        raise ErpoError(
            f"{what} {path!r} {problem}; give a local Hugging Face model directory (with config.json), {alternatives}"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ErpoError(f"{what} {path!r} has no config.json; is it a Hugging Face model directory (save_pretrained)?")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_model(path: str, device: torch.device, dtype: torch.dtype = torch.float32) -> Any:
    """A causal LM from a local directory (never the network)."""
    import transformers
    from transformers import AutoModelForCausalLM

    check_model_dir(path)
    quiet_transformers()
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **{key: dtype})
    except (OSError, ValueError, KeyError) as exc:
        raise ErpoError(f"model {path!r} could not be loaded as a causal LM: {_first_line(exc)}") from None
    # A model that scales or soft-caps its logits is scored with the same transform
    # (erpo.packing.lm_head_options -> the kernels' logit_scale / softcap).
    return model.to(device)


# What a saved tokenizer leaves in a model directory (one of them at least).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a local model directory, with pad = EOS when it has no pad token.
    ErpoError for a directory without tokenizer files (transformers 5 would build an empty
    tokenizer from config.json alone) and for a tokenizer that encodes text to nothing."""
    from transformers import AutoTokenizer

    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ErpoError(f"model {path!r} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); save the "
                        f"model's tokenizer into it: AutoTokenizer.from_pretrained(SOURCE).save_pretrained({path!r})")
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ErpoError(f"model {path!r}: no usable tokenizer in the directory ({_first_line(exc)})") from None
    if len(tok) < 2 or not tok("1 + 1 = 2", add_special_tokens=False)["input_ids"]:
        raise ErpoError(f"model {path!r}: its tokenizer is empty ({len(tok)} token(s); text encodes to nothing); "
                        f"save the model's own tokenizer into the directory")
    if tok.eos_token_id is None:
        raise ErpoError(f"model {path!r}: the tokenizer has no EOS token, so a response cannot end; set eos_token "
                        f"in its tokenizer_config.json")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def check_vocabulary(model: Any, tokenizer: Any, path: str) -> None:
    """ErpoError when the tokenizer has more tokens than the model has embedding rows (a token
    id past them would fail inside the embedding): not the model's own tokenizer."""
    rows = int(model.get_input_embeddings().weight.shape[0])
    if len(tokenizer) > rows:
        raise ErpoError(f"model {path!r}: its tokenizer has {len(tokenizer)} tokens, the model's embedding {rows} "
                        f"rows (token ids >= {rows} have none); use the tokenizer the model was trained with")


# RoPE scalings that stretch the trained context by their factor (YaRN, linear, dynamic NTK).
STRETCHING_ROPE = ("yarn", "linear", "dynamic")


def context_length(path: str) -> int | None:
    """The most positions the model in directory `path` has (its config.json's n_positions,
    GPT-2 style learned positions, else max_position_embeddings, stretched by a YaRN / linear /
    dynamic rope scaling's factor as vLLM counts it); None when it states neither."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    limit = next((v for v in (getattr(config, k, None) for k in ("n_positions", "max_position_embeddings"))
                  if isinstance(v, int) and v > 0), None)
    rope = getattr(config, "rope_scaling", None)
    if limit is not None and isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in STRETCHING_ROPE:
        factor = float(rope.get("factor") or 1.0)
        limit = max(limit, int(int(rope.get("original_max_position_embeddings") or limit) * factor))
    return limit


def check_context_length(path: str, longest_prompt: int, max_new_tokens: int, key: str = "max_new_tokens",
                         limit: int | None = None) -> None:
    """ErpoError, before anything runs, when the longest prompt + `max_new_tokens` does not fit
    in the context of the model in `path` (learned position embeddings fail mid-run with an
    IndexError inside generate; rotary ones leave the range the model was trained on).
    `limit`: the context when it is known without reading `path` (model=tiny before its warm start)."""
    source = "n_positions / max_position_embeddings in its config.json" if limit is None else "the demo model's"
    limit = context_length(path) if limit is None else limit
    need = longest_prompt + max_new_tokens
    if limit is None or need <= limit:
        return
    room = limit - longest_prompt
    fix = (f"set {key}={room} or less, or use a model with a longer context" if room > 0 else
           f"the longest prompt alone fills it: use shorter prompts (max_prompt_tokens={limit - 1} refuses longer "
           f"ones) or a model with a longer context")
    raise ErpoError(f"model {path!r} has a context of {limit} positions ({source}), but the longest prompt "
                    f"({longest_prompt} tokens) + {key}={max_new_tokens} needs {need}; {fix}")


def enable_gradient_checkpointing(model: Any) -> None:
    """The model's own (transformers) activation checkpointing of each decoder layer.

    transformers checkpoints a layer only while that layer is in training mode; the
    trainer keeps the model in eval mode (no dropout: the sampler and the loss see the
    same function). So the checkpointed layers alone are flagged as training, not their
    submodules: attention and MLP dropouts stay off, and only layers that checkpoint
    read the flag (for that purpose alone)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ErpoError(f"gradient_checkpointing=true: {type(model).__name__} does not support gradient "
                        f"checkpointing; set gradient_checkpointing=false")
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    from transformers.modeling_layers import GradientCheckpointingLayer

    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing:
            module.training = True
