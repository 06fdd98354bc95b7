"""Shared pieces of the verl suite: a tiny Qwen2 on disk (from a config, erpo's local
tokenizer), verl batches in the trainer's left/right-padded layout, and TrainingWorkers."""
from __future__ import annotations

import contextlib
import os
from typing import Dict, List, Optional, Sequence

import torch
from tensordict import TensorDict

VOCAB = 64  # a slice of erpo's character tokenizer is enough: ids < VOCAB
PAD = 0


def tiny_model_dir(root: str, tied: bool, seed: int = 0) -> str:
    """A 2-layer Qwen2 (hidden 32) with a tied or untied lm_head, saved with erpo's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from erpo.tiny import build_tokenizer

    path = os.path.join(root, "tied" if tied else "untied")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tok = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # logits of a useful size (random init gives near-uniform ones)
        model.get_output_embeddings().weight.mul_(20.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def make_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], seed: int = 0,
               old_shift: float = 0.1) -> TensorDict:
    """The trainer's layout: left-padded prompts [B, P], right-padded responses [B, R],
    input_ids / attention_mask / position_ids [B, P + R], response_mask, and random
    advantages (one per sequence, on every response token) and old_log_probs."""
    b = len(prompts)
    p = max(len(x) for x in prompts)
    r = max(len(x) for x in responses)
    prompt_ids = torch.full((b, p), PAD, dtype=torch.long)
    resp_ids = torch.full((b, r), PAD, dtype=torch.long)
    mask = torch.zeros(b, p + r, dtype=torch.long)
    for i, (x, y) in enumerate(zip(prompts, responses)):
        prompt_ids[i, p - len(x):] = torch.tensor(x)
        resp_ids[i, : len(y)] = torch.tensor(y)
        mask[i, p - len(x): p + len(y)] = 1
    input_ids = torch.cat([prompt_ids, resp_ids], dim=1)
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
    response_mask = mask[:, p:].clone()
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(b, 1, generator=g).expand(b, r) * response_mask
    old = (-2.0 + old_shift * torch.randn(b, r, generator=g)) * response_mask
    return TensorDict({
        "input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids, "prompts": prompt_ids,
        "responses": resp_ids, "response_mask": response_mask, "advantages": adv.contiguous(),
        "old_log_probs": old,
    }, batch_size=[b])


def to_engine(td: TensorDict, temperature: float, **extra) -> TensorDict:
    """The worker's input: verl's no-padding layout plus the keys the trainer sets."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(td.clone())
    lengths = td["input_ids"].offsets().diff().tolist()
    tu.assign_non_tensor(td, temperature=temperature, calculate_entropy=True, global_token_num=lengths,
                         global_batch_size=td.batch_size[0], **extra)
    return td


# three queries (different lengths), two sequences each, responses of different lengths
PROMPTS = [[1, 5, 9, 13, 17], [1, 5, 9, 13, 17], [1, 22, 30], [1, 22, 30], [1, 40, 41, 42], [1, 40, 41, 42]]
RESPONSES = [[7, 8, 9], [10, 11], [12, 13, 14, 15], [16], [20, 21, 22, 23], [24, 25, 26]]


@contextlib.contextmanager
def original_forward():
    """Restores Qwen2ForCausalLM.forward afterwards: verl's fused patch replaces the class's
    forward process-wide."""
    from transformers import Qwen2ForCausalLM

    saved = Qwen2ForCausalLM.forward
    try:
        yield
    finally:
        Qwen2ForCausalLM.forward = saved


def make_worker(model_dir: str, *, backend: Optional[str], remove_padding: bool, lr: float = 0.0,
                micro_batch: int = 2):
    """A verl TrainingWorker (FSDP2 engine, fp32, SGD) on the CPU. backend None: verl's own
    logits path; else use_fused_kernels with that impl_backend."""
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, TrainingWorkerConfig
    from verl.workers.config.checkpoint import CheckpointConfig
    from verl.workers.engine_workers import TrainingWorker

    model_config = HFModelConfig(
        path=model_dir, use_remove_padding=remove_padding, enable_gradient_checkpointing=False,
        use_fused_kernels=backend is not None,
        fused_kernel_options={"impl_backend": backend} if backend is not None else None,
        override_config={"attn_implementation": "sdpa"},
    )
    engine_config = FSDPEngineConfig(
        strategy="fsdp2", use_torch_compile=False, use_dynamic_bsz=False, model_dtype="fp32",
        mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        micro_batch_size_per_gpu=micro_batch, infer_micro_batch_size_per_gpu=micro_batch,
    )
    optim = FSDPOptimizerConfig(optimizer="SGD", lr=lr, weight_decay=0.0, clip_grad=1e9)
    worker = TrainingWorker(TrainingWorkerConfig(
        model_type="language_model", model_config=model_config, engine_config=engine_config,
        optimizer_config=optim, checkpoint_config=CheckpointConfig(),
    ))
    worker.reset()
    return worker


def full_params(worker) -> Dict[str, torch.Tensor]:
    """name -> whole fp32 parameter of the worker's (FSDP2) model."""
    out = {}
    for name, p in worker.engine.module.named_parameters():
        out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def full_grads(worker) -> Dict[str, torch.Tensor]:
    out = {}
    for name, p in worker.engine.module.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def nested_rows(t) -> List[torch.Tensor]:
    return [x.detach().clone() for x in t.unbind()]


class Rows:
    """The micro-batch's packed row space (verl's: every token of every sequence)."""

    def __init__(self, data):
        self.offsets = data["input_ids"].offsets()
        self.plen = torch.tensor([len(p) for p in PROMPTS])
        self.rlen = torch.tensor([len(r) for r in RESPONSES])
        ids = data["input_ids"].values()
        self.n = ids.shape[0]
        self.verl_targets = torch.roll(ids, shifts=-1, dims=0)  # verl's rolled labels
        b = len(PROMPTS)
        pos = torch.arange(self.n) - torch.repeat_interleave(self.offsets[:-1], self.offsets.diff())
        seq = torch.repeat_interleave(torch.arange(b), self.offsets.diff())
        self.prompt_row = pos < (self.plen[seq] - 1)
        self.last_row = pos == (self.offsets.diff()[seq] - 1)
        self.seq, self.pos = seq, pos


def packed_batch(data, rows: "Rows", tau: float, advantages, ref_query_logp, query_weights, group_index, dtype):
    """The same micro-batch as erpo_kernels' PackedLossBatch: every copy scores its prompt
    (temperature 1), the response rows at 1 / tau, the last row of each sequence nothing."""
    from erpo_kernels import PackedLossBatch

    targets = torch.where(rows.last_row, torch.full_like(rows.verl_targets, -100), rows.verl_targets)
    inv_t = torch.where(rows.prompt_row, 1.0, 1.0 / tau).to(dtype)
    starts = rows.offsets[:-1]
    cu = torch.cat([torch.stack([starts, starts + rows.plen - 1], 1).reshape(-1), rows.offsets[-1:]])
    resp = ~rows.prompt_row & ~rows.last_row
    old = torch.zeros(rows.n, dtype=dtype)
    padded_old = data.select("old_log_probs").to_padded_tensor()["old_log_probs"].to(dtype)
    old[resp] = padded_old[rows.seq[resp], rows.pos[resp] - (rows.plen[rows.seq[resp]] - 1)]
    return PackedLossBatch(targets=targets, inv_temperature=inv_t, span_cu_seqlens=cu, group_index=group_index,
                           advantages=advantages.to(dtype), ref_query_logp=ref_query_logp.to(dtype),
                           query_weights=query_weights.to(dtype), old_logp=old)


# A ChatML template (Qwen2.5's layout) with Qwen3's enable_thinking switch: a chat-template
# kwarg (data.apply_chat_template_kwargs) that changes the prompt the rollout receives.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def chat_model_dir(root: str, seed: int = 1) -> str:
    """A 2-layer Qwen2 with a Qwen2 tokenizer verl loads as it loads Qwen's: byte-level BPE
    (one token per byte, no merges), <|endoftext|> (pad), <|im_start|>, <|im_end|> (EOS),
    and CHAT_TEMPLATE."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    path = os.path.join(root, "chat")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHAT_TEMPLATE
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_train_parquet(path: str, questions: Sequence[str], system: Optional[str] = None) -> str:
    """A verl training file (the columns of verl's examples/data_preprocess): data_source,
    prompt (chat messages), ability, reward_model, extra_info."""
    import pandas as pd

    rows = []
    for i, q in enumerate(questions):
        messages = ([{"role": "system", "content": system}] if system and i % 2 else []) + [{"role": "user", "content": q}]
        rows.append({"data_source": "tiny/arith", "prompt": messages, "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"split": "train", "index": i}})
    pd.DataFrame(rows).to_parquet(path)
    return path
