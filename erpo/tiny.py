"""The embedded demo model: a character-level tokenizer, a small randomly initialised
Qwen2 model, and a short supervised warm start on the task (cached on disk), so that
`erpo train` runs with no download and starts from rewards that are not all zero.

The warm start lives in <cache_dir>/warmstart-<hash>/ (cache_dir=auto: the user cache,
$XDG_CACHE_HOME/erpo or ~/.cache/erpo), a normal Hugging Face model directory; the hash
covers everything that determines its weights, so a rerun with the same settings, from
any directory, loads it instead of training again.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from typing import Any, Callable, List, Sequence, Tuple

import torch
import transformers

from .config import TINY_CONTEXT, TINY_HEADS, TrainConfig
from .data import Example, derived_seed, render_prompt
from .atomic import umask_modes
from .models import check_model_dir, quiet_transformers

WARMSTART_VERSION = 2  # bump when the warm start's recipe changes
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
# Whole-word tokens of the answer format, so "\boxed{" costs one step, not seven.
WORD_TOKENS = ["\\boxed{", "<think>", "</think>"]
CHARACTERS = [chr(c) for c in range(32, 127)] + ["\n"]


def build_tokenizer() -> Any:
    """A character-level PreTrainedTokenizerFast over printable ASCII (+ newline), with
    <pad>, <bos> (prepended to every encoded text), <eos>, <unk> and the word tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + WORD_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per character
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, normalized=False) for t in WORD_TOKENS])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def build_model(cfg: TrainConfig, tokenizer: Any) -> Any:
    """A Qwen2ForCausalLM from a config (random init from cfg.seed): tiny_layers layers of
    width tiny_hidden_size, 4 query heads, 2 key/value heads, separate input and output embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.demo.tiny_hidden_size,
        intermediate_size=4 * cfg.demo.tiny_hidden_size,
        num_hidden_layers=cfg.demo.tiny_layers,
        num_attention_heads=TINY_HEADS,
        num_key_value_heads=2,
        max_position_embeddings=TINY_CONTEXT,
        tie_word_embeddings=False,  # tied, the policy gradient on output rows also moves the digits' input embeddings: fragile at this size
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(derived_seed(cfg.seed, "tiny-init"))
    return Qwen2ForCausalLM(config)


def answer_text(answer: str) -> str:
    """The completion the warm start teaches: the answer in \\boxed{} (what the rewards read)."""
    return "\\boxed{" + answer + "}"


def demonstrations(cfg: TrainConfig, examples: Sequence[Example], template: str) -> List[str]:
    """The warm start's texts: prompt + answer + nothing else (EOS is appended later).

    A fraction `warmstart_unboxed` of them give the correct answer bare ("82") instead of
    in \\boxed{} ("\\boxed{82}"), which the rewards score 0: the warm-started model answers
    both ways, and RL has a format to learn, as in the paper's zero-RL setting.
    """
    g = torch.Generator().manual_seed(derived_seed(cfg.seed, "warmstart-format"))
    bare = (torch.rand(len(examples), generator=g) < cfg.demo.warmstart_unboxed).tolist()
    return [render_prompt(template, ex.prompt) + (ex.answer if b else answer_text(ex.answer))
            for ex, b in zip(examples, bare)]


def warmstart_key(cfg: TrainConfig, examples: Sequence[Example], template: str) -> str:
    from .data import examples_fingerprint

    spec = {
        "version": WARMSTART_VERSION,
        "seed": cfg.seed,
        "hidden": cfg.demo.tiny_hidden_size,
        "layers": cfg.demo.tiny_layers,
        "steps": cfg.demo.warmstart_steps,
        "lr": cfg.demo.warmstart_lr,
        "batch": cfg.demo.warmstart_batch_size,
        "unboxed": cfg.demo.warmstart_unboxed,
        "data": examples_fingerprint(examples),
        "template": template,
        "torch": torch.__version__.split("+")[0],
        "transformers": transformers.__version__,
        "code": _code_digest(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def _code_digest() -> str:
    """The source of what computes the warm start (this recipe and the loss it trains
    with): a change there, even an ulp-level one, gives other weights, so a cached warm
    start built by older code is not reused."""
    import importlib  # the package re-exports functions under its modules' names

    h = hashlib.sha256()
    for name in ("erpo.tiny", "erpo_kernels.reference", "erpo_kernels.linear_token_logprobs"):
        with open(importlib.import_module(name).__file__, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def resolve_model_dir(cfg: TrainConfig, examples: Sequence[Example], log: Callable[[str], None] = print) -> str:
    """cfg.model (checked to be a model directory), or for model=tiny the (cached)
    warm-started demo model's directory."""
    if cfg.is_demo_model:
        return warm_start(cfg, examples, cfg.resolved_template, log=log)
    check_model_dir(cfg.model)
    return cfg.model


def warmstart_dir(cfg: TrainConfig, examples: Sequence[Example], template: str) -> str:
    """Where the warm-started demo model for these settings lives (whether trained yet or not)."""
    return os.path.join(cfg.resolved_cache_dir, f"warmstart-{warmstart_key(cfg, examples, template)}")


def padded(batch: Sequence[Sequence[int]], pad_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(ids [b, L] right-padded with pad_id, attention mask [b, L]) of b token lists, L the longest."""
    width = max(len(seq) for seq in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, seq in enumerate(batch):
        ids[r, : len(seq)] = torch.tensor(seq)
        mask[r, : len(seq)] = 1
    return ids, mask


def progress_line(done: int, steps: int, loss: float, took: float) -> str:
    """The warm start's line every 10% of its steps: how far, and about how long is left."""
    return (f"erpo: warm start: step {done}/{steps}, loss {loss:.3f}, {took:.0f}s so far, about "
            f"{took / done * (steps - done):.0f}s left")


def warm_start(cfg: TrainConfig, examples: Sequence[Example], template: str, log=print) -> str:
    """The directory of the warm-started demo model for these settings (trained and
    cached on first use)."""
    out = warmstart_dir(cfg, examples, template)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    from erpo_kernels import linear_token_logprobs

    quiet_transformers()
    log(f"erpo: training the demo model's warm start ({cfg.demo.warmstart_steps} supervised steps on "
        f"{torch.get_num_threads()} CPU thread(s); cached for later runs in {out}) ...")
    t0 = time.perf_counter()
    tokenizer = build_tokenizer()
    model = build_model(cfg, tokenizer)
    texts = demonstrations(cfg, examples, template)
    seqs: List[List[int]] = [ids + [tokenizer.eos_token_id] for ids in tokenizer(texts)["input_ids"]]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.demo.warmstart_lr, betas=(0.9, 0.99), weight_decay=0.0)
    g = torch.Generator().manual_seed(derived_seed(cfg.seed, "warmstart"))
    head = model.get_output_embeddings()
    model.train()
    loss = torch.tensor(float("nan"))
    steps = cfg.demo.warmstart_steps
    every = max(1, steps // 10)  # a progress line every 10% of the steps
    for step in range(steps):
        # lr: linear warm-up over 10% of the steps, then cosine to 10%
        frac = step / max(1, cfg.demo.warmstart_steps)
        scale = min(1.0, 10 * frac + 0.1) * (0.55 + 0.45 * torch.cos(torch.tensor(frac * torch.pi)).item())
        for group in opt.param_groups:
            group["lr"] = cfg.demo.warmstart_lr * scale
        pick = torch.randint(len(seqs), (cfg.demo.warmstart_batch_size,), generator=g).tolist()
        ids, mask = padded([seqs[i] for i in pick], tokenizer.pad_token_id)  # [b, L] each
        targets = torch.where(mask[:, 1:] == 1, ids[:, 1:], -100)  # [b, L-1] next token, -100 on padding
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]  # [b, L-1, D]
        logp = linear_token_logprobs(hidden.reshape(-1, hidden.shape[-1]), head.weight, targets.reshape(-1))  # [b(L-1)]
        loss = -logp.sum() / (targets != -100).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % every == 0 and step + 1 < steps:
            log(progress_line(step + 1, steps, loss.item(), time.perf_counter() - t0))
    model.eval()
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "erpo_warmstart.json"), "w", encoding="utf-8") as f:
        json.dump({"steps": cfg.demo.warmstart_steps, "final_loss": loss.item(), "seconds": time.perf_counter() - t0}, f)
    umask_modes(tmp)  # model.safetensors is written 0600: the cache is shared like the run directory
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished the same warm start first
        shutil.rmtree(tmp, ignore_errors=True)
    log(
        f"erpo: warm start of the demo model: {cfg.demo.warmstart_steps} steps in {time.perf_counter() - t0:.0f}s, "
        f"loss {loss.item():.3f} -> {out}"
    )
    return out
