"""The reference cache (docs/method.md section 7): l_0(q) of every training query under
the pre-RL model, computed once, so ERPO never runs a reference model while training.

One row per distinct training query: query_id (a hash of its prompt token ids),
n_tokens (scored prompt tokens), ref_query_logp (l_0(q)), score (s(q) = l_0 / n).
Metadata: the model's identifier and weights fingerprint, the tokenizer fingerprint,
the prompt template. One safetensors file, the metadata as JSON in its header,
written to a temp file and renamed into place (never half-written).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch

from erpo_kernels import linear_token_logprobs, segment_sum

from .atomic import atomic_write
from .errors import ErpoError
from .packing import forward_hidden, lm_head_of, lm_head_options, pack
from .query_weights import query_scores

CACHE_FORMAT = "erpo-ref-cache/1"
META_KEY = "erpo_ref_cache"


class RefCacheError(ErpoError):
    """A missing, stale or mismatched reference cache. The message says what is wrong; the
    caller, who knows how its cache is built, adds how to fix it: ``with fixed_by(command):``
    around its reads and checks (or ``raise exc.with_fix(command)``)."""

    def __init__(self, problem: str, *, missing: bool = False, fix: str = "") -> None:
        verb = "build" if missing else "rebuild"
        super().__init__(f"{problem}; {verb} it with: {fix}" if fix else problem)
        self.problem, self.missing, self.fix = problem, missing, fix

    def with_fix(self, command: str) -> "RefCacheError":
        """This error, its message ending in how to (re)build the cache: with `command`
        (kept as it is when it already names a fix, or `command` is empty)."""
        if self.fix or not command:
            return self
        return RefCacheError(self.problem, missing=self.missing, fix=command)


@contextlib.contextmanager
def fixed_by(command: str) -> Iterator[None]:
    """RefCacheErrors raised inside end in how to (re)build the cache: with `command`."""
    try:
        yield
    except RefCacheError as exc:
        raise exc.with_fix(command) from None


def query_id(prompt_ids: Sequence[int]) -> int:
    """63-bit id of a prompt: sha256 of its token ids (little-endian int64)."""
    data = torch.tensor(list(prompt_ids), dtype=torch.int64).numpy().astype("<i8").tobytes()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") & ((1 << 63) - 1)


def model_fingerprint(model: Any) -> str:
    """sha256 over every parameter and buffer's name, shape, dtype and bytes (16 hex digits).

    Models over 2**28 bytes of weights hash 4096 evenly spaced values per tensor
    instead of every byte (it catches any real change of checkpoint at a fraction of
    the cost).
    """
    tensors = list(model.state_dict().items())
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    sampled = total > (1 << 28)
    h = hashlib.sha256(b"sampled" if sampled else b"full")
    for name, t in tensors:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        flat = t.detach().reshape(-1)
        if sampled and flat.numel() > 4096:
            flat = flat[torch.linspace(0, flat.numel() - 1, 4096).long().to(flat.device)]
        flat = flat.cpu().contiguous()
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's full definition (tokenizer.json of a fast tokenizer,
    else its vocabulary) and special tokens (16 hex digits)."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(
        {k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())}
    ).encode())
    return h.hexdigest()[:16]


@torch.no_grad()
def compute_ref_query_logp(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int = 0,
    batch_size: int = 64,
    backend: str = "auto",
    compute_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """l_0(q) [M] fp32 of each prompt at temperature 1, with the kernels:
    hidden states -> linear_token_logprobs -> segment_sum over each prompt span."""
    device = next(model.parameters()).device
    weight, bias = lm_head_of(model)
    head_options = lm_head_options(model)  # the model's logit scale / soft cap, if any
    out = []
    for start in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[start:start + batch_size]
        packed = pack(chunk, [[[]] for _ in chunk], 1.0).to(device)  # prompts alone
        hidden = forward_hidden(model, packed.input_ids, packed.position_ids)  # [N, D]
        w, b = weight, bias
        if compute_dtype is not None:
            hidden, w = hidden.to(compute_dtype), w.to(compute_dtype)
            b = None if b is None else b.to(compute_dtype)
        elif hidden.dtype != w.dtype:
            hidden = hidden.to(w.dtype)
        logp = linear_token_logprobs(
            hidden, w, packed.targets, bias=b, inv_temperature=packed.inv_temperature, backend=backend,
            **head_options,
        )  # [N]
        spans = segment_sum(logp, packed.span_cu_seqlens, backend=backend)  # [2B]
        out.append(spans[0::2].float().cpu())  # prompt spans
    return torch.cat(out) if out else torch.zeros(0)


@dataclass
class RefCache:
    query_id: torch.Tensor  # [M] int64
    n_tokens: torch.Tensor  # [M] int64 scored prompt tokens
    ref_query_logp: torch.Tensor  # [M] fp32 l_0(q)
    score: torch.Tensor  # [M] fp32 s(q) = l_0(q) / n(q)
    meta: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._row = {int(q): i for i, q in enumerate(self.query_id.tolist())}

    def __len__(self) -> int:
        return int(self.query_id.shape[0])

    def rows(self, ids: Sequence[int]) -> torch.Tensor:
        """Row of each query id [len(ids)] int64; KeyError(id) for an id not in the cache."""
        return torch.tensor([self._row[int(q)] for q in ids], dtype=torch.long)

    def missing(self, ids: Sequence[int]) -> List[int]:
        """Positions in `ids` whose query is not in the cache."""
        return [i for i, q in enumerate(ids) if int(q) not in self._row]


def build_ref_cache(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    meta: Dict[str, Any],
    *,
    pad_token_id: int = 0,
    batch_size: int = 64,
    backend: str = "auto",
    compute_dtype: Optional[torch.dtype] = None,
) -> RefCache:
    """The cache of the distinct prompts in `prompt_ids` under `model` (the pre-RL model).

    meta: at least "model", "model_fingerprint", "tokenizer_fingerprint", "template".
    """
    unique: Dict[int, Sequence[int]] = {}
    for ids in prompt_ids:
        unique.setdefault(query_id(ids), ids)
    qids = list(unique)
    prompts = [unique[q] for q in qids]
    ref = compute_ref_query_logp(
        model, prompts, pad_token_id=pad_token_id, batch_size=batch_size, backend=backend, compute_dtype=compute_dtype
    )
    n_tokens = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long)
    full_meta = dict(meta)
    full_meta.update(format=CACHE_FORMAT, n_queries=len(qids), created=time.strftime("%Y-%m-%dT%H:%M:%S"))
    return RefCache(
        query_id=torch.tensor(qids, dtype=torch.long),
        n_tokens=n_tokens,
        ref_query_logp=ref.float(),
        score=query_scores(ref.float(), n_tokens).float(),
        meta=full_meta,
    )


def save_ref_cache(cache: RefCache, path: str) -> None:
    """Write atomically: a temp file in the same directory, then os.replace."""
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tensors = {
        "query_id": cache.query_id.contiguous(),
        "n_tokens": cache.n_tokens.contiguous(),
        "ref_query_logp": cache.ref_query_logp.contiguous(),
        "score": cache.score.contiguous(),
    }
    metadata = {META_KEY: json.dumps(cache.meta, sort_keys=True)}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def read_ref_cache(path: str) -> RefCache:
    """Read a cache file; a missing or unreadable file is a RefCacheError."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise RefCacheError(f"reference cache {path} does not exist", missing=True)
    try:
        with safe_open(path, framework="pt") as f:
            meta_text = (f.metadata() or {}).get(META_KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = json.loads(meta_text) if meta_text else None
    except Exception as exc:  # corrupt / not safetensors
        raise RefCacheError(f"reference cache {path} is unreadable ({type(exc).__name__})") from None
    need = ("query_id", "n_tokens", "ref_query_logp", "score")
    if not isinstance(meta, dict) or meta.get("format") != CACHE_FORMAT or any(k not in tensors for k in need):
        raise RefCacheError(f"reference cache {path} is not an {CACHE_FORMAT} file")
    return RefCache(meta=meta, **{k: tensors[k] for k in need})


# What a cache was built for, checked against a run: (meta key, what it is, the key naming it).
META_CHECKS = (
    ("model_fingerprint", "model weights", "model"),
    ("tokenizer_fingerprint", "tokenizer", None),
    ("template", "prompt template", None),
    ("compute_dtype", "compute dtype (dtype=)", None),
    ("attn_implementation", "attention (attn_implementation=)", None),
    ("kernel_backend", "kernel backend (kernel_backend=)", None),
)


def shown(value: Any, width: int = 60) -> str:
    """`value` quoted for a message, a long text shortened at a word boundary (" ..." marks the cut)."""
    text = str(value)
    return repr(textwrap.shorten(text, width, placeholder=" ...") if len(text) > width else text)


def check_cache_meta(meta: Dict[str, Any], path: str, expect: Dict[str, str]) -> None:
    """RefCacheError naming the first of META_CHECKS (those in ``expect``) that differs."""
    for key, what, name_key in META_CHECKS:
        if key in expect and key not in meta:
            raise RefCacheError(f"reference cache {path} does not record its {what.split(' (')[0]} (an older erpo "
                                f"built it), so it may not match this run's")
        if key in expect and meta.get(key) != expect.get(key):
            built = f"{meta.get(name_key)} ({meta.get(key)})" if name_key else shown(meta.get(key))
            now = f"{expect.get(name_key)} ({expect.get(key)})" if name_key else shown(expect.get(key))
            raise RefCacheError(
                f"reference cache {path} is stale: built for {what} {built}, this run uses {now}"
            )


def validate_ref_cache(
    cache: RefCache,
    path: str,
    *,
    expect: Dict[str, str],
    prompt_ids: Sequence[Sequence[int]],
    describe: Any,
) -> torch.Tensor:
    """Check the cache against the run; return the cache row of each training query [M].

    expect: {"model_fingerprint", "tokenizer_fingerprint", "template"} of this run (and
    "model", only quoted). describe(i) -> a short text naming training query i.
    """
    check_cache_meta(cache.meta, path, expect)
    ids = [query_id(p) for p in prompt_ids]
    missing = cache.missing(ids)
    if missing:
        i = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise RefCacheError(
            f"reference cache {path} has no entry for training query {i} {describe(i)} "
            f"(id {ids[i]:016x}){more}"
        )
    rows = cache.rows(ids)
    n_expected = torch.tensor([len(p) - 1 for p in prompt_ids], dtype=torch.long)
    bad = (cache.n_tokens[rows] != n_expected).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise RefCacheError(
            f"reference cache {path} disagrees on the length of training query {i} {describe(i)}"
        )
    if not bool(torch.isfinite(cache.ref_query_logp).all()):
        raise RefCacheError(f"reference cache {path} holds non-finite values")
    return rows
