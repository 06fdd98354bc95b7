"""Packing: m prompts x G responses -> one row space of N rows (the layout of
erpo_kernels.PackedLossBatch), and the forward pass to hidden states.

Sequence b = prompt_b | response_b starts at row r (seq_cu_seqlens[b]); T prompt
tokens, L response tokens:
    rows [r, r+T-1)       prompt span: row t targets token t+1 at inverse temperature 1;
                          ignore_index on every copy of a group but the first
    rows [r+T-1, r+T+L)   response span: rows score y_1..y_L at 1/tau; the last row
                          has nothing to predict (ignore_index)
position_ids restart at 0 in every sequence; targets never cross a sequence boundary.

`forward_hidden` runs the model's base (decoder without lm_head) on the N rows as one
packed row [1, N] with those position_ids, no attention mask and no KV cache, which
transformers detects as packed sequences (a position that does not follow its
predecessor starts a new sequence): every row attends only to earlier rows of its own
sequence, with varlen attention (flash_attention_2, flex_attention) or a block-diagonal
causal mask (sdpa, eager). No padding is computed and the logits are never formed.
`forward_hidden_padded` is the same function on a right-padded [B, Lmax] batch (the
bench's baseline and the tests' reference).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from erpo_kernels import PackedLossBatch

from .distributed import BASE_FORWARD

IGNORE_INDEX = -100


@dataclass
class PackedSequences:
    """Row-space tensors of B packed sequences (N rows in all), on CPU until .to()."""

    input_ids: torch.Tensor  # [N] int64 token at each row
    position_ids: torch.Tensor  # [N] int64 position within its own sequence
    seq_cu_seqlens: torch.Tensor  # [B + 1] int64 sequence boundaries
    span_cu_seqlens: torch.Tensor  # [2B + 1] int64 prompt_0, response_0, prompt_1, ... boundaries
    targets: torch.Tensor  # [N] int64 next token within the sequence, or ignore_index
    inv_temperature: torch.Tensor  # [N] fp32: 1 on prompt rows, 1/tau on response rows
    group_index: torch.Tensor  # [B] int64 query of each sequence
    ignore_index: int = IGNORE_INDEX

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_sequences(self) -> int:
        return int(self.group_index.shape[0])

    def to(self, device: Any) -> "PackedSequences":
        """A copy with every tensor on `device`."""
        return replace(self, **{k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)})

    def response_token_rows(self) -> torch.Tensor:
        """The row scoring each response token, in packing order (sequence 0's y_1..y_L, then
        sequence 1's, ...): [sum of response lengths] int64. Row span_start + t of a response
        span targets y_(t+1); the span's last row has no target."""
        span = self.span_cu_seqlens.long()
        starts, ends = span[1:-1:2], span[2::2] - 1  # [B] first and one-past-last scoring row
        lengths = ends - starts  # [B] L of each response
        seq = torch.repeat_interleave(torch.arange(lengths.shape[0], device=span.device), lengths)  # [sum L]
        first = torch.cumsum(lengths, 0) - lengths  # [B] offset of each response among the tokens
        return starts[seq] + torch.arange(seq.shape[0], device=span.device) - first[seq]

    def rows_from_response_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """Per-response-token values [sum L] (packing order) -> row space [N] fp32, 0 on the
        rows that score no response token: e.g. the rollout engine's log-probs as the
        objective's `rollout_logp`."""
        rows = self.response_token_rows()
        if values.shape != rows.shape:
            raise ValueError(f"values has shape {tuple(values.shape)}, expected ({rows.shape[0]},): one per "
                             f"response token")
        out = torch.zeros(self.num_rows, dtype=torch.float32, device=self.targets.device)
        out[rows] = values.to(out.device, torch.float32)
        return out

    def support_rows(self, bitmasks: torch.Tensor) -> torch.Tensor:
        """Per-response-token kept sets [sum L, W] int32 (packing order, packed bitmasks) ->
        row space [N, W] int32: each response token's row gets its bitmask, every other row
        (prompt rows, the rows that score nothing) all ones, i.e. unrestricted."""
        rows = self.response_token_rows()
        if bitmasks.ndim != 2 or bitmasks.shape[0] != rows.shape[0] or bitmasks.dtype != torch.int32:
            raise ValueError(f"bitmasks has shape {tuple(bitmasks.shape)} ({bitmasks.dtype}), expected int32 "
                             f"({rows.shape[0]}, W): one row per response token")
        out = torch.full((self.num_rows, bitmasks.shape[1]), -1, dtype=torch.int32, device=self.targets.device)
        out[rows] = bitmasks.to(out.device)
        return out

    def loss_batch(
        self,
        advantages: torch.Tensor,
        ref_query_logp: torch.Tensor,
        query_weights: torch.Tensor,
        ref_logp: Optional[torch.Tensor] = None,
        rollout_logp: Optional[torch.Tensor] = None,
        support: Optional[torch.Tensor] = None,
    ) -> PackedLossBatch:
        """The objective's batch: advantages [B], ref_query_logp [m], query_weights [m], ref_logp [N] or
        None, rollout_logp [N] or None (the rollout engine's log-probs, rows_from_response_tokens),
        support [N] / [N, W] or None (the kept sets, support_rows)."""
        dev = self.targets.device
        return PackedLossBatch(
            targets=self.targets,
            inv_temperature=self.inv_temperature,
            span_cu_seqlens=self.span_cu_seqlens,
            group_index=self.group_index,
            advantages=advantages.to(dev, torch.float32),
            ref_query_logp=ref_query_logp.to(dev, torch.float32),
            query_weights=query_weights.to(dev, torch.float32),
            old_logp=None,
            ref_logp=None if ref_logp is None else ref_logp.to(dev),
            rollout_logp=None if rollout_logp is None else rollout_logp.to(dev),
            support=None if support is None else support.to(dev),
            ignore_index=self.ignore_index,
        )


def pack(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[Sequence[int]]],
    temperature: float,
    *,
    ignore_index: int = IGNORE_INDEX,
    score_prompt_once: bool = True,
) -> PackedSequences:
    """Pack m prompts with their responses (responses[q] = the G_q responses of prompt q)
    in the order prompt_0|resp_0,0, prompt_0|resp_0,1, ..., prompt_1|resp_1,0, ...

    temperature: tau (> 0) of the response rows. score_prompt_once: ignore the prompt
    targets of every copy but the first of a group (docs/method.md section 1).
    A prompt alone (no response) is `responses[q] = [[]]`.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"responses has {len(responses)} groups but prompts has {len(prompts)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    ids, pos, tgt, inv, groups, seq_cu, span_cu = [], [], [], [], [], [0], [0]
    inv_tau = 1.0 / float(temperature)
    for q, (prompt, group) in enumerate(zip(prompts, responses)):
        prompt = [int(t) for t in prompt]
        if len(prompt) < 1:
            raise ValueError(f"prompt {q} is empty")
        if len(group) < 1:
            raise ValueError(f"prompt {q} has no response (use [[]] for a prompt alone)")
        for copy, response in enumerate(group):
            seq = prompt + [int(t) for t in response]
            n_prompt, n = len(prompt), len(seq)
            ids.extend(seq)
            pos.extend(range(n))
            shifted = seq[1:] + [ignore_index]  # row t predicts token t+1; the last row predicts nothing
            if score_prompt_once and copy > 0:
                shifted[: n_prompt - 1] = [ignore_index] * (n_prompt - 1)
            tgt.extend(shifted)
            inv.extend([1.0] * (n_prompt - 1) + [inv_tau] * (n - n_prompt + 1))
            groups.append(q)
            span_cu.append(span_cu[-1] + n_prompt - 1)
            span_cu.append(span_cu[-1] + n - n_prompt + 1)
            seq_cu.append(seq_cu[-1] + n)
    return PackedSequences(
        input_ids=torch.tensor(ids, dtype=torch.long),
        position_ids=torch.tensor(pos, dtype=torch.long),
        seq_cu_seqlens=torch.tensor(seq_cu, dtype=torch.long),
        span_cu_seqlens=torch.tensor(span_cu, dtype=torch.long),
        targets=torch.tensor(tgt, dtype=torch.long),
        inv_temperature=torch.tensor(inv, dtype=torch.float32),
        group_index=torch.tensor(groups, dtype=torch.long),
        ignore_index=ignore_index,
    )


def base_model_of(model: Any) -> Any:
    """The decoder without its lm_head (Qwen2ForCausalLM -> model.model)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if base is None:
        raise ValueError(f"{type(model).__name__} has no base model attribute to take hidden states from")
    return base


def lm_head_of(model: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(weight [V, D], bias [V] or None) of the output projection."""
    head = model.get_output_embeddings()
    return head.weight, getattr(head, "bias", None)


def lm_head_options(model: Any) -> Dict[str, Optional[float]]:
    """How the model transforms hidden @ lm_head.weight.T into the logits it samples from,
    as the keywords of linear_token_logprobs / erpo_loss: `logit_scale` (a multiplier:
    Cohere's logit_scale, 1 / Granite's logits_scaling) and `softcap` (Gemma 2's
    final_logit_softcapping). None where the model does not transform its logits."""
    config = getattr(model, "config", None)
    scale = getattr(config, "logit_scale", None)  # logits * scale
    divisor = getattr(config, "logits_scaling", None)  # logits / divisor
    if divisor not in (None, 1, 1.0):
        scale = (1.0 if scale is None else float(scale)) / float(divisor)
    cap = getattr(config, "final_logit_softcapping", None)
    return {
        "logit_scale": None if scale in (None, 1, 1.0) else float(scale),
        "softcap": None if cap in (None, 0, 0.0) else float(cap),
    }


def row_layout(seq_cu_seqlens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """(sequence of each row [N], offset of each row in its sequence [N], Lmax)."""
    cu = seq_cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]  # [B]
    n = int(cu[-1])
    seq_of_row = torch.repeat_interleave(torch.arange(lengths.shape[0], device=cu.device), lengths, output_size=n)  # [N]
    offset = torch.arange(n, device=cu.device) - cu[seq_of_row]  # [N]
    return seq_of_row, offset, int(lengths.max()) if lengths.numel() else 0


# ---------------------------------------------------------------------- attention


ATTN_IMPLEMENTATIONS = ("auto", "flash_attention_2", "flex_attention", "sdpa_varlen", "sdpa", "eager")
VARLEN_SDPA = "sdpa_varlen"


def resolve_attn_implementation(name: str, device: Any) -> str:
    """The attention of the packed forward: `name`, or for auto flash_attention_2 when the
    flash-attn package is installed (CUDA), flex_attention on CUDA otherwise, sdpa_varlen
    elsewhere. ValueError naming attn_implementation for an unknown name or one the device
    cannot run.

    sdpa_varlen (ours, registered with transformers' attention interface) runs PyTorch's
    scaled_dot_product_attention causally on each sequence of the packed row, sequences of
    equal length batched together: the work of the sequences alone, where sdpa on a packed
    row computes all N x N scores under a block-diagonal mask (correct, and on CPU several
    times slower than padding; bench/step.py measures both)."""
    if name not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation={name!r} is not one of {', '.join(ATTN_IMPLEMENTATIONS)}")
    cuda = torch.device(device).type == "cuda"
    has_flash = importlib.util.find_spec("flash_attn") is not None
    if name == "auto":
        return ("flash_attention_2" if has_flash else "flex_attention") if cuda else VARLEN_SDPA
    if name == "flash_attention_2" and not (cuda and has_flash):
        why = "runs on CUDA only" if not cuda else "needs the flash-attn package (pip install flash-attn)"
        raise ValueError(f"attn_implementation=flash_attention_2 {why}; use attn_implementation=auto")
    if name == "flex_attention" and not cuda:  # PyTorch's FlexAttention has no backward on CPU
        raise ValueError("attn_implementation=flex_attention trains on CUDA only (PyTorch's FlexAttention has no "
                         "backward on CPU); use attn_implementation=auto (sdpa_varlen here)")
    return name


def set_attn_implementation(model: Any, name: str = "auto") -> str:
    """Switch `model` (and its sub-models) to the attention `name` resolves to on the
    model's device; returns the resolved name."""
    resolved = resolve_attn_implementation(name, next(model.parameters()).device)
    if resolved == VARLEN_SDPA:
        _register_varlen_sdpa()
    if getattr(model.config, "_attn_implementation", None) != resolved:
        model.set_attn_implementation(resolved)
    return resolved


PROMPT_LENGTHS = "erpo_prompt_lengths"  # forward_hidden's keyword for sdpa_varlen: [B] prompt tokens per sequence


def varlen_sdpa_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0, scaling: Optional[float] = None, position_ids: Optional[torch.Tensor] = None, **kwargs: Any,
) -> Tuple[torch.Tensor, None]:
    """transformers attention function (query [1, H, N, d], key and value [1, Hkv, N, d])
    of one packed row: each sequence (position_ids [1, N] restart at 0) attends causally to
    itself alone; returns ([1, N, H, d], None), in the dtype sdpa computes in (autocast's).
    Anything else (a mask, a batch of rows, decoding with a KV cache) goes to transformers'
    own sdpa function.

    With erpo_prompt_lengths ([B] prompt tokens T of each sequence; forward_hidden passes
    it), the T prompt rows of a sequence attend among themselves exactly as the prompt alone
    does (the same sdpa call as the reference cache's, bit for bit) and its response rows
    attend to the whole sequence under a lower-right causal mask: the same function, but a
    prompt's hidden states never depend on the response after it (docs/method.md section 7)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    n = query.shape[2]
    prompt_lengths = kwargs.pop(PROMPT_LENGTHS, None)
    if attention_mask is not None or position_ids is None or query.shape[0] != 1 or key.shape[2] != n:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    q, k, v = query[0], repeat_kv(key, groups)[0], repeat_kv(value, groups)[0]  # [H, N, d]
    starts = torch.nonzero(position_ids.reshape(-1) == 0).flatten().tolist()  # first row of each sequence
    lengths = [b - a for a, b in zip(starts, starts[1:] + [n])]
    split = lengths if prompt_lengths is None else [min(int(t), n_b) for t, n_b in zip(prompt_lengths, lengths)]
    out: Optional[torch.Tensor] = None

    def attend(seqs: Sequence[int], first: int, count: int, keys: int) -> None:
        """Rows first..first+count-1 of each sequence in `seqs` (one batch), attending to its
        rows 0..keys-1 causally (lower-right aligned: query row i sees key rows <= i)."""
        nonlocal out
        base = torch.tensor([starts[b] for b in seqs], device=q.device)[:, None]  # [S, 1]
        q_rows = (base + first + torch.arange(count, device=q.device)).reshape(-1)  # [S * count]
        kv_rows = (base + torch.arange(keys, device=q.device)).reshape(-1)  # [S * keys]

        def gather(t: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
            return t[:, rows].reshape(t.shape[0], len(seqs), width, -1).transpose(0, 1)  # [S, H, width, d]

        mask = None if first == 0 else torch.ones(count, keys, dtype=torch.bool, device=q.device).tril(first)
        o = torch.nn.functional.scaled_dot_product_attention(
            gather(q, q_rows, count), gather(k, kv_rows, keys), gather(v, kv_rows, keys), attn_mask=mask,
            is_causal=mask is None, scale=scaling, dropout_p=dropout,
        )  # [S, H, count, d]
        if out is None:  # sdpa's dtype: under autocast not q's
            out = o.new_empty(q.shape)  # [H, N, d]
        out[:, q_rows] = o.transpose(0, 1).reshape(o.shape[1], len(seqs) * count, -1)

    by_prompt: Dict[int, List[int]] = {}
    by_shape: Dict[Tuple[int, int], List[int]] = {}
    for b, (t, n_b) in enumerate(zip(split, lengths)):
        by_prompt.setdefault(t, []).append(b)
        if n_b > t:
            by_shape.setdefault((t, n_b), []).append(b)
    for t, seqs in by_prompt.items():  # the prompts (whole sequences without prompt lengths), equal T together
        attend(seqs, 0, t, t)
    for (t, n_b), seqs in by_shape.items():  # the responses, equal (T, T + L) together
        attend(seqs, t, n_b - t, n_b)
    return out.transpose(0, 1)[None].contiguous(), None


def _varlen_sdpa_mask(*args: Any, attention_mask: Optional[torch.Tensor] = None, **kwargs: Any) -> Any:
    """No mask for a packed row (the attention reads position_ids); sdpa's mask otherwise."""
    from transformers.masking_utils import sdpa_mask

    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def _register_varlen_sdpa() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    AttentionMaskInterface.register(VARLEN_SDPA, _varlen_sdpa_mask)


def check_packing_support() -> None:
    """RuntimeError unless transformers detects packed sequences from position_ids
    (transformers >= 4.53: masking_utils.find_packed_sequence_indices); without it the
    sequences of one packed row would silently attend to each other."""
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        import transformers

        raise RuntimeError(
            f"transformers {transformers.__version__} does not detect packed sequences; "
            f"upgrade it: pip install 'transformers>=4.53'"
        ) from None


# ---------------------------------------------------------------------- forward


def _base_forward(model: Any) -> Any:
    """The base model's forward; under FSDP2 it runs through the root's forward hooks
    (erpo.distributed.shard_model)."""
    return getattr(model, BASE_FORWARD, None) or base_model_of(model)


def prompt_lengths(span_cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[B] prompt tokens T of each packed sequence from its spans ([2B + 1]: the prompt span
    holds T - 1 rows)."""
    cu = span_cu_seqlens.long()
    return cu[1::2] - cu[0:-1:2] + 1


def forward_hidden(model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   prompt_lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Final hidden states [N, D] of packed rows: input_ids [N], position_ids [N]
    (restarting at 0 at each sequence's first row, as `pack` makes them); prompt_lengths
    [B] (or None): the prompt tokens of each sequence, for sdpa_varlen, whose prompt rows
    then equal the prompt's alone bit for bit (varlen_sdpa_attention).

    One row [1, N] through the base model with no attention mask and use_cache=False,
    so transformers treats it as packed sequences: row i's hidden state is the one of
    its sequence run alone (tests/test_packing.py checks it against separate forwards).
    With the cache on, or a mask given, the packing would not be detected and the
    sequences would attend to each other. No logits are computed.
    """
    check_packing_support()
    extra = {}
    if prompt_lengths is not None and getattr(model.config, "_attn_implementation", None) == VARLEN_SDPA:
        extra[PROMPT_LENGTHS] = prompt_lengths.tolist()
    out = _base_forward(model)(
        input_ids=input_ids[None], position_ids=position_ids[None], attention_mask=None, use_cache=False, **extra
    )
    return out.last_hidden_state[0]  # [N, D]


def forward_hidden_padded(
    model: Any, input_ids: torch.Tensor, seq_cu_seqlens: torch.Tensor, pad_token_id: int = 0
) -> torch.Tensor:
    """`forward_hidden` computed on a right-padded batch: the rows (input_ids [N],
    seq_cu_seqlens [B + 1]) go to [B, Lmax] (positions 0..L-1, padding masked), through the
    base model, and back to [N, D]. Every padding position is computed; the bench's
    baseline and the tests' reference."""
    seq_of_row, offset, width = row_layout(seq_cu_seqlens)
    n_seq = seq_cu_seqlens.shape[0] - 1
    dev = input_ids.device
    padded = torch.full((n_seq, width), int(pad_token_id), dtype=torch.long, device=dev)  # [B, Lmax]
    mask = torch.zeros((n_seq, width), dtype=torch.long, device=dev)  # [B, Lmax]
    padded[seq_of_row, offset] = input_ids
    mask[seq_of_row, offset] = 1
    positions = torch.arange(width, device=dev).expand(n_seq, width)  # [B, Lmax]
    out = _base_forward(model)(input_ids=padded, attention_mask=mask, position_ids=positions, use_cache=False)
    return out.last_hidden_state[seq_of_row, offset]  # [N, D]
