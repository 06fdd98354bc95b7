"""What `python -m bench cost` counts for whole losses: a fused loss's forward + backward from
the final hidden states and the lm_head weight to a scalar, ours and the peers' (op LOSS).

A loss reads sequences, not just rows: the batch at a target (N, D, V) is B = N / S sequences
of S = LAYOUT.seq_rows rows, G = LAYOUT.group sequences per query, each sequence a prompt of
LAYOUT.prompt_rows rows and a response (our PackedLossBatch layout; the peers get the same
B x S rows, every one scored). Counted at small shapes with small layouts (a table per plan:
each counting shape has its own S, and so its own B), fitted exactly with B and the chunk
counts among the terms (bench.cost_model), extrapolated with the target's layout and the
peers' real chunk constants.

    erpo-loss         erpo_kernels.erpo_loss(hidden, weight, batch, LossConfig()) (algorithm
                      erpo, vanilla policy loss, the Query-KL) then loss.backward(): whatever
                      erpo_loss's default path is at the counted commit, on the sm_90 default
                      tiles (their products engine, Tiles.gemm_engine: cuBLAS since 87f5527)
    erpo-loss-triton  the same with the products on our Triton kernels (gemm_engine 0): the
                      engine the default does not use on sm_90
    liger-grpo        Liger-Kernel's LigerFusedLinearGRPOLoss (liger_kernel.chunked_loss)
    trl-grpo          TRL's GRPO loss (GRPOTrainer._compute_loss) on the log-probs and entropies
                      of its fused LM head (ChunkedLogProbFunction)

The peers run with TRL's GRPOConfig defaults (loss_type "dapo", beta 0, epsilon 0.2, on-policy:
old log-probs = the detached current ones), ours with LossConfig's defaults.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import types
import warnings
from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from .cost_model import Features, Shape, multilinear, residue_values

LOSS = "loss"  # Subject.op of the fused losses: (hidden, weight, layout) -> a scalar loss


@dataclass(frozen=True)
class LossLayout:
    """B = N / seq_rows sequences of seq_rows rows (prompt_rows of prompt, the rest response),
    `group` sequences per query (m = B / group); chunk_rows: the rows a fused loss's chunk may
    hold (our erpo_loss's budget, in rows; None: the op's default budget)."""

    seq_rows: int
    prompt_rows: int
    group: int
    chunk_rows: Optional[int] = None

    def sequences(self, n: int) -> int:
        if n % (self.seq_rows * self.group):
            raise ValueError(f"N = {n} is not whole queries of {self.group} sequences of {self.seq_rows} rows")
        return n // self.seq_rows


# The targets' batches: 128-row prompts and 384-row responses (bench step's GPU sequences), one
# response per prompt and every row scored (each prompt by its own sequence): B = 16, 4, 32 at the
# targets. Every row scored: the peers' batches score every row too (the same GEMM work at the
# same N), and every kernel tile of valid rows is whole at the counting shapes as at the targets
# (a kernel works on the valid rows of a chunk in whole row tiles: ignored rows, such as the
# prompt copies of a group, would make the counts depend on where each chunk's last tile ends).
LAYOUT = LossLayout(seq_rows=512, prompt_rows=128, group=1)
LAYOUT_NOTE = (f"a loss's batch at N rows: B = N / {LAYOUT.seq_rows} sequences of {LAYOUT.prompt_rows} prompt + "
               f"{LAYOUT.seq_rows - LAYOUT.prompt_rows} response rows, one response per prompt, every row scored "
               "(ours: the prompt rows by the Query-KL, the response rows by the policy loss; the peers' [B, S] "
               "batches: every row by the policy loss)")

_counting_layout: List[Optional[LossLayout]] = [None]  # the layout of the shape being counted (a plan's patch)


def layout_of(shape: Shape) -> LossLayout:
    return _counting_layout[0] or LAYOUT


@contextlib.contextmanager
def _with_layout(layout: LossLayout) -> Iterator[None]:
    saved = _counting_layout[0]
    _counting_layout[0] = layout
    try:
        yield
    finally:
        _counting_layout[0] = saved


def loss_run(call: Callable) -> Callable[[Shape], Tuple[Callable, Callable]]:
    """(forward, backward) of a loss call(hidden [N, D], weight [V, D], layout) -> scalar."""
    from .cost_subjects import _linear_inputs

    def run(shape: Shape):
        hidden, weight, _, _ = _linear_inputs(shape[:3])  # a counting shape may carry a layout index
        layout = layout_of(shape)
        return (lambda: call(hidden, weight, layout)), (lambda loss: loss.backward())
    return run


def _advantages(b: int, n: int) -> torch.Tensor:
    return torch.randn(b, generator=torch.Generator().manual_seed(n + b))


# ----------------------------------------------------------------------------- ours


def loss_batch(n: int, layout: LossLayout, vocab: int):
    """Our PackedLossBatch of N rows in `layout` (bench.step.make_batch's layout), every row's
    target token 0 (cost_subjects.TARGETS_NOTE; the last row of a sequence too, and the prompt
    rows of every copy: every row scored, see LAYOUT)."""
    from .step import StepCase, make_batch

    b = layout.sequences(n)
    case = StepCase("tiny", None, b // layout.group, layout.group, layout.prompt_rows,
                    layout.seq_rows - layout.prompt_rows, 1.0, "bf16")
    with warnings.catch_warnings():  # one response per prompt: make_batch's group-normalised advantages are NaN
        warnings.simplefilter("ignore", UserWarning)
        _, batch = make_batch(case, vocab, "cpu")
    return dataclasses.replace(batch, targets=torch.zeros_like(batch.targets), advantages=_advantages(b, n))


def _fused_api():
    """(rows_for_budget(budget, V) of the counted dtype (cost_subjects.DTYPE), row_chunks,
    DEFAULT_FUSED_BUDGET) of erpo_loss's chunked 3-GEMM path, or None at a commit without it
    (erpo_loss is then linear_token_logprobs + the loss)."""
    try:
        from erpo_kernels.fused_linear_loss import DEFAULT_FUSED_BUDGET
        from erpo_kernels.objective.micro_batches import row_chunks
    except ImportError:
        return None
    from .cost_subjects import DTYPE
    from .step import rows_per_chunk

    def rows_of(budget: int, vocab: int) -> int:
        return rows_per_chunk(budget, vocab, DTYPE)
    return rows_of, row_chunks, DEFAULT_FUSED_BUDGET


def budget_for_rows(rows: int, vocab: int) -> int:
    """The smallest fused_budget whose chunks hold `rows` rows at V (erpo_loss's own rows_for_budget)."""
    rows_for_budget = _fused_api()[0]
    lo, hi = 1, 1
    while rows_for_budget(hi, vocab) < rows:
        hi *= 2
    while lo < hi:  # rows_for_budget is non-decreasing in the budget
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if rows_for_budget(mid, vocab) < rows else (lo, mid)
    if rows_for_budget(lo, vocab) != rows:
        raise ValueError(f"no fused_budget gives chunks of {rows} rows at V = {vocab}")
    return lo


def erpo_chunks(n: int, vocab: int, layout: LossLayout) -> int:
    """K, the chunks erpo_loss's default path runs at N rows in `layout` (its row_chunks of
    rows_for_budget(budget, V) rows, the budget layout.chunk_rows' or its default), as the op
    plans them; 1 at a commit without the chunked path."""
    api = _fused_api()
    if api is None:
        return 1
    rows_for_budget, row_chunks, default = api
    budget = budget_for_rows(layout.chunk_rows, vocab) if layout.chunk_rows else default
    chunks = row_chunks(loss_batch(n, layout, vocab), rows_for_budget(budget, vocab))
    if chunks is None:
        raise ValueError(f"erpo-loss: sequences of {layout.seq_rows} rows are longer than a chunk at V = {vocab}")
    return len(chunks)


ENGINES = {0: "our Triton products", 1: "cuBLAS products"}  # Tiles.gemm_engine


def erpo_loss_tiles(engine: Optional[int] = None):
    """The sm_90 default tiles erpo_loss is counted with, products on `engine` (None: the
    default tiles' own engine; 0: ours, 1: cuBLAS)."""
    from .cost_subjects import _erpo_tiles

    tiles = _erpo_tiles("linear_token_logprobs")
    return tiles if engine is None else dataclasses.replace(tiles, gemm_engine=engine)


def _erpo_loss_with(engine: Optional[int]) -> Callable:
    def call(hidden, weight, layout: LossLayout):
        import inspect

        from erpo_kernels import LossConfig, erpo_loss

        batch = loss_batch(hidden.shape[0], layout, weight.shape[0])
        params = inspect.signature(erpo_loss).parameters
        kw = {"tiles": erpo_loss_tiles(engine)} if "tiles" in params else {}  # else: cost_subjects.counted_tiles
        if layout.chunk_rows and "fused_budget" in params:
            kw["fused_budget"] = budget_for_rows(layout.chunk_rows, weight.shape[0])
        loss, _ = erpo_loss(hidden, weight, batch, LossConfig(), backend="triton", **kw)
        return loss
    return call


_erpo_loss = _erpo_loss_with(None)
_erpo_loss_triton = _erpo_loss_with(0)


# Counting layouts of erpo-loss: (N, layout) at each (D, V) of the tiles' residue grid, K and
# B varying apart from N (sequences of 16 or 32 rows; chunks of 256 or 512 rows, whole tiles of
# rows as the target's chunks of 1024 and 512 are), and two more at the first (D, V): the terms
# {1, N, K} x {1, D, V, DV}, B and K B are then determined (rank checked by the fit).
# One chunk (K = 1) writes a 16-bit d_weight directly, without K > 1's fp32 [V, D]
# accumulator, and its products split otherwise between writes and accumulations
# (fused_linear_loss.LinearLogprobsChunks): the terms [K = 1] x {1, N, D, V, ND, NV, DV, NDV},
# from two more points at each corner, one chunk of all 512 and of all 768 rows (2048 x 4096 x
# 151,936 is one chunk of 16-bit kept logits at the default budget), and a check at K = 1 and
# another N.
_ERPO_POINTS = [(512, LossLayout(32, 8, 1, 256)), (768, LossLayout(32, 8, 1, 256)),
                (768, LossLayout(32, 8, 1, 512)), (512, LossLayout(32, 8, 1, 512)), (768, LossLayout(32, 8, 1, 768))]
_ERPO_EXTRA = [(512, LossLayout(16, 4, 1, 256)), (768, LossLayout(16, 4, 1, 256))]
_ERPO_CHECKS = [(768, 0, 0, LossLayout(64, 16, 1, 256)), (512, 1, 0, LossLayout(16, 4, 1, 256)),
                (1024, 1, 1, LossLayout(32, 8, 1, 1024))]


def _erpo_loss_features(layouts: Dict[Tuple, LossLayout]) -> Features:
    def features(shape) -> Dict[str, Fraction]:
        n, d, v = shape[:3]
        layout = layouts.get(tuple(shape), LAYOUT)
        b, k = layout.sequences(n), erpo_chunks(n, v, layout)
        f = multilinear((n, d, v))
        f.update({"B": Fraction(b), "K": Fraction(k), "KD": Fraction(k * d), "KV": Fraction(k * v),
                  "KDV": Fraction(k * d * v), "KB": Fraction(k * b)})
        one = int(k == 1)
        f.update({f"K1.{t}": x * one for t, x in multilinear((n, d, v)).items()})
        return f
    return features


def _mm_into_as_on_cuda(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """erpo_kernels.linear_token_logprobs._mm_into's CUDA branch on any device: an fp32 accumulator
    from input-dtype operands is one addmm(out_dtype=float32) (bench.cost computes it on a CPU
    and counts it as called), not the CPU branch's upcast operands and fp32 GEMM."""
    if out.dtype == a.dtype:
        _mm_into_saved[0](out, a, b, accumulate)
    else:
        torch.addmm(out, a, b, beta=1 if accumulate else 0, out_dtype=out.dtype, out=out)


_mm_into_saved: List[Callable] = []


@contextlib.contextmanager
def cuda_products() -> Iterator[None]:
    """Our torch products (Tiles.gemm_engine 1: linear_token_logprobs' backward and erpo_loss's
    fused path both go through its _mm_into) counted as on CUDA (_mm_into_as_on_cuda); a no-op
    for our Triton products, which never call it."""
    import importlib

    ltl = importlib.import_module("erpo_kernels.linear_token_logprobs")  # the module (the package exports the op)
    if not hasattr(ltl, "_mm_into"):  # a commit before the torch products
        yield
        return
    _mm_into_saved[:] = [ltl._mm_into]
    ltl._mm_into = _mm_into_as_on_cuda
    try:
        yield
    finally:
        ltl._mm_into = _mm_into_saved[0]


def _erpo_loss_plan(target: Shape):
    """The residue grid of our kernels' tiles (cost_subjects._erpo_linear_plan's moduli) in D
    and V, the _ERPO_POINTS layouts at each (D, V) corner; counted with the sm_90 tiles, torch
    products as on CUDA (cuda_products)."""
    from .cost_subjects import FitPlan, _erpo_linear_plan, counted_tiles

    moduli = _erpo_linear_plan(target).key[2]
    (d0, d1), (v0, v1) = (residue_values(t, m) for t, m in zip(target[1:], moduli[1:]))
    v0, v1 = (v0, v1) if v0 > moduli[2] else (v0 + moduli[2], v1 + moduli[2])  # two vocabulary chunks at least
    layouts: Dict[Tuple, LossLayout] = {}
    for d, v in ((d0, v0), (d0, v1), (d1, v0), (d1, v1)):
        for i, (n, layout) in enumerate(_ERPO_POINTS + (_ERPO_EXTRA if (d, v) == (d0, v0) else [])):
            layouts[(n, d, v, i)] = layout
    checks = {}
    for n, dd, vv, layout in _ERPO_CHECKS:
        checks[(n, (d0, d1)[dd], (v0, v1)[vv], 9)] = layout
    for n in {n for n, _ in _ERPO_POINTS + _ERPO_EXTRA} | {n for n, *_ in _ERPO_CHECKS}:
        if n % moduli[0] or any(l.chunk_rows % moduli[0] for l in layouts.values() if l.chunk_rows):
            raise ValueError("erpo-loss counting rows must be whole row tiles")
    table = {**layouts, **checks}

    @contextlib.contextmanager
    def patch(shape) -> Iterator[None]:
        with _with_layout(table[tuple(shape)]), counted_tiles(), cuda_products():
            yield

    return FitPlan(key=("erpo-loss", moduli, (d0, d1, v0, v1)), fit=sorted(layouts), check=list(checks),
                   features=_erpo_loss_features(table), target_features=_erpo_loss_features({}), patch=patch)


# ----------------------------------------------------------------------------- Liger


LIGER_VOCAB, LIGER_ROWS = 4096, 2048  # liger_kernel.chunked_loss.fused_linear_ppo at 0.8.5 (read when present)
_LIGER_SMALL = 16  # its vocabulary chunk while counting


def _liger_constants() -> Tuple[int, int]:
    try:
        from liger_kernel.chunked_loss import fused_linear_ppo as lp
    except ImportError:
        return LIGER_VOCAB, LIGER_ROWS
    return lp._SELECTIVE_LOGPROB_VOCAB_CHUNK_SIZE, lp._SELECTIVE_LOGPROB_SEQ_CHUNK_SIZE


def _liger_grpo(hidden, weight, layout: LossLayout):
    """LigerFusedLinearGRPOLoss with TRL's GRPOConfig defaults, one chunk per sequence (its chunk_size=1)."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    n, d = hidden.shape
    b = layout.sequences(n)
    fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, compiled=False, epsilon_low=0.2,
                                  epsilon_high=0.2, loss_type="dapo")
    ids = torch.zeros(b, layout.seq_rows, dtype=torch.long)  # cost_subjects.TARGETS_NOTE
    mask = torch.ones(b, layout.seq_rows, dtype=torch.long)
    loss, _ = fn(hidden.view(b, layout.seq_rows, d), weight, ids, mask, _advantages(b, n))
    return loss


def _liger_grpo_features(layouts: Dict[Shape, LossLayout], vocab_chunk: int) -> Features:
    def features(shape: Shape) -> Dict[str, Fraction]:
        n, d, v = shape
        b = layouts.get(shape, LAYOUT).sequences(n)
        kv = -(-v // vocab_chunk)
        f = multilinear(shape)
        for x, xs in (("", 1), ("D", d)):
            f.update({f"N{x}.KV": Fraction(n * xs * kv), f"B{x}.KV": Fraction(b * xs * kv), f"{x}.KV": Fraction(xs * kv)})
        f.update({"B": Fraction(b), "BD": Fraction(b * d), "BV": Fraction(b * v), "BDV": Fraction(b * d * v),
                  "BN": Fraction(b * n)})  # each sequence's loss reads the whole batch's mask (its normaliser)
        return f
    return features


# ----------------------------------------------------------------------------- TRL


def _trl_stand_in(hidden, weight, chunk: int):
    """What GRPOTrainer._compute_loss reads of its trainer (GRPOConfig's defaults, one process,
    no gradient accumulation), with the per-token log-probs and entropies of TRL's fused LM head:
    trl.trainer.utils.add_fused_lm_head's forward on a Triton device (the valid positions
    compacted, ChunkedLogProbFunction with outputs log_probs and entropy, scattered back)."""
    from trl.kernels import ChunkedLogProbFunction

    def logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **_):
        mask = attention_mask[:, -logits_to_keep:].bool()
        rows = hidden.view(*mask.shape, hidden.shape[-1])
        out = ChunkedLogProbFunction.apply(rows[mask], weight, None, input_ids[:, -logits_to_keep:][mask], 1.0,
                                           chunk, None, 1.0, ("log_probs", "entropy"))
        logp, ent = (x.new_zeros(mask.shape).masked_scatter(mask, x) for x in out[:2])
        return logp, ent, None

    identity = types.SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x,
                                     reduce=lambda x, reduction="sum": x, num_processes=1, sync_gradients=True)
    args = types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
    return types.SimpleNamespace(
        _get_per_token_logps_and_entropies=logps_and_entropies, aux_loss_enabled=False, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, importance_sampling_level="token", beta=0.0, loss_type="dapo",
        epsilon_low=0.2, epsilon_high=0.2, args=args, use_vllm=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, accelerator=identity, _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)})


_trl_grpo_chunk: List[Optional[int]] = [None]  # the vocabulary chunk (patched while counting; None: TRL's own)


def _trl_grpo(hidden, weight, layout: LossLayout):
    from trl.trainer import utils as tu
    from trl.trainer.grpo_trainer import GRPOTrainer

    n = hidden.shape[0]
    b, s = layout.sequences(n), layout.seq_rows
    chunk = _trl_grpo_chunk[0] or tu._CHUNKED_LOGPROB_CHUNK_SIZE
    trainer = _trl_stand_in(hidden, weight, chunk)
    inputs = {"prompt_ids": torch.zeros(b, 0, dtype=torch.long), "prompt_mask": torch.zeros(b, 0, dtype=torch.long),
              "completion_ids": torch.zeros(b, s, dtype=torch.long),  # cost_subjects.TARGETS_NOTE
              "completion_mask": torch.ones(b, s, dtype=torch.long), "advantages": _advantages(b, n),
              "num_items_in_batch": torch.tensor(float(n))}
    return GRPOTrainer._compute_loss(trainer, None, inputs)


def _trl_grpo_features(layouts: Dict[Shape, LossLayout], consts: Tuple[int, int, int]) -> Features:
    from .cost_subjects import _trl_features

    base = _trl_features(consts)

    def features(shape: Shape) -> Dict[str, Fraction]:
        f = base(shape)
        f["B"] = Fraction(layouts.get(shape, LAYOUT).sequences(shape[0]))
        return f
    return features


# ----------------------------------------------------------------------------- plans


def _random_layouts(seed: int, features: Callable[[Dict[Shape, LossLayout]], Features], seq_rows=(3, 4, 5, 6),
                    groups=(1, 2), queries=(1, 2, 3), dims=(8, 16, 24),
                    vocabs=(40, 70, 96, 150, 200, 290)) -> Dict[Shape, LossLayout]:
    """Small counting shapes, each with its own layout (sequences of 3-6 rows, so that B varies
    apart from N), drawn at random and kept while they add a term the fit could not yet
    determine, until every term of `features` is determined (the fit's held-out shapes then
    check the terms are the right ones)."""
    import numpy as np

    rng = random.Random(seed)
    out: Dict[Shape, LossLayout] = {}
    rows: List[List[float]] = []
    rank, terms = 0, None
    for _ in range(2000):
        s, g, m = rng.choice(seq_rows), rng.choice(groups), rng.choice(queries)
        shape = (s * g * m, rng.choice(dims), rng.choice(vocabs))
        if shape in out:
            continue
        f = features({shape: LossLayout(s, 1, g)})(shape)
        terms = terms or list(f)
        row = [float(f[t]) for t in terms]
        if np.linalg.matrix_rank(np.array(rows + [row])) > rank:
            out[shape], rank = LossLayout(s, 1, g), rank + 1
            rows.append(row)
            if rank == len(terms):
                return out
    raise ValueError(f"no {len(terms)} small layouts determine every term")


def _layout_patch(layouts: Dict[Shape, LossLayout], extra: Callable[[], contextlib.AbstractContextManager]):
    @contextlib.contextmanager
    def patch(shape: Shape) -> Iterator[None]:
        with _with_layout(layouts[shape]), extra():
            yield
    return patch


def _liger_grpo_plan(target: Shape):
    from .cost_subjects import FitPlan

    layouts = _random_layouts(33, lambda table: _liger_grpo_features(table, _LIGER_SMALL), seq_rows=(2, 3, 4),
                              dims=(8, 16), vocabs=(20, 40, 50, 70))
    checks = {(24, 24, 90): LossLayout(4, 1, 2), (18, 16, 30): LossLayout(3, 1, 3)}
    layouts.update(checks)

    @contextlib.contextmanager
    def small() -> Iterator[None]:
        from liger_kernel.chunked_loss import fused_linear_ppo as lp

        saved = lp._SELECTIVE_LOGPROB_VOCAB_CHUNK_SIZE
        lp._SELECTIVE_LOGPROB_VOCAB_CHUNK_SIZE = _LIGER_SMALL
        try:
            yield
        finally:
            lp._SELECTIVE_LOGPROB_VOCAB_CHUNK_SIZE = saved

    fit = sorted(s for s in layouts if s not in checks)
    vocab, rows = _liger_constants()
    if LAYOUT.seq_rows > rows:  # one sequence chunk per sequence, as while counting
        raise ValueError(f"liger-grpo: sequences of {LAYOUT.seq_rows} rows exceed its {rows}-row chunks")
    return FitPlan(key=("liger-grpo",), fit=fit, check=list(checks),
                   features=_liger_grpo_features(layouts, _LIGER_SMALL),
                   target_features=_liger_grpo_features({}, vocab), patch=_layout_patch(layouts, small))


def _trl_grpo_plan(target: Shape):
    from .cost_subjects import _TRL_SMALL, FitPlan, _trl_addmm_cuda, _trl_constants

    layouts = _random_layouts(34, lambda table: _trl_grpo_features(table, _TRL_SMALL),
                              vocabs=(70, 96, 150, 200, 290), dims=(16, 24, 40))
    checks = {(120, 32, 260): LossLayout(5, 1, 3), (36, 48, 100): LossLayout(6, 1, 2)}
    layouts.update(checks)

    @contextlib.contextmanager
    def small() -> Iterator[None]:
        from trl.kernels import chunked_logprob as cl

        saved = (cl.TOKEN_CHUNK_SIZE, cl._BLOCK_SIZE, cl._use_triton, cl._addmm_fp32, _trl_grpo_chunk[0])
        cl.TOKEN_CHUNK_SIZE, _trl_grpo_chunk[0], cl._BLOCK_SIZE = _TRL_SMALL
        cl._use_triton = lambda device: True  # the Triton fold kernels of its CUDA path
        cl._addmm_fp32 = _trl_addmm_cuda
        try:
            yield
        finally:
            cl.TOKEN_CHUNK_SIZE, cl._BLOCK_SIZE, cl._use_triton, cl._addmm_fp32, _trl_grpo_chunk[0] = saved

    fit = sorted(s for s in layouts if s not in checks)
    return FitPlan(key=("trl-grpo",), fit=fit, check=list(checks), features=_trl_grpo_features(layouts, _TRL_SMALL),
                   target_features=_trl_grpo_features({}, _trl_constants()), patch=_layout_patch(layouts, small))
