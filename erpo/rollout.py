"""Rollout engines: sample G responses per prompt.

The trainer talks to a RolloutEngine; HFRolloutEngine (transformers' generate, the CPU
path) is the one shipped. A vLLM engine fits the same two methods: `generate` samples
from the current weights, `sync_weights` pushes new weights after an optimizer step.
`generate_ids` is the one place that calls HF generate: the rollout and the
evaluation (erpo.evaluate) both sample through it.
"""
from __future__ import annotations

from typing import Any, Iterable, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(
        self, prompt_ids: Sequence[Sequence[int]], n: int, temperature: float, max_new_tokens: int
    ) -> List[List[List[int]]]:
        """n sampled responses per prompt: out[i][j] = token ids of response j to prompt i,
        ending at (and including) the first EOS, or max_new_tokens long. temperature 0 =
        greedy; otherwise plain sampling from softmax(logits / temperature) (no top-k,
        top-p or penalties, so the trainer's 1/tau scoring is the sampler's distribution)."""
        ...

    def sync_weights(self, model: Any) -> None:
        """Make the engine sample from `model`'s current weights."""
        ...


class HFRolloutEngine:
    """Sampling with transformers' `generate` on the training model itself (shared
    weights, so sync_weights has nothing to do). Each prompt is repeated n times;
    batch_size (0 = all) caps the sequences per generate call. Randomness comes from
    torch's global generator (the trainer seeds it per step).
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
    ) -> List[List[List[int]]]:
        flat = [list(p) for p in prompt_ids for _ in range(n)]  # [m * n] prompts
        step = self.batch_size or len(flat)
        out: List[List[int]] = []
        for start in range(0, len(flat), step):
            out.extend(generate_ids(
                self.model, flat[start:start + step], temperature=temperature, max_new_tokens=max_new_tokens,
                pad_token_id=self.pad_token_id, eos_token_ids=self.eos_token_ids,
            ))
        return [out[i * n:(i + 1) * n] for i in range(len(prompt_ids))]


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


@torch.no_grad()
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
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_token_id)  # [b, Lp]
    sampling = dict(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0) if temperature > 0 \
        else dict(do_sample=False)
    config = GenerationConfig(
        max_new_tokens=int(max_new_tokens), pad_token_id=int(pad_token_id), eos_token_id=[int(e) for e in eos_token_ids],
        num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0, use_cache=True, **sampling,
    )
    saved = model.generation_config
    model.generation_config = GenerationConfig()  # the model's defaults must not fill in what we leave unset
    try:
        seqs = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
    finally:
        model.generation_config = saved
    new = seqs[:, ids.shape[1]:].tolist()  # [b, <= max_new_tokens]
    return [cut_at_eos(row, eos_token_ids) for row in new]


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
