"""What `python -m bench cost` counts: our ops and each installed peer, as `Subject`s.

A subject runs one forward (phase "forward") and one backward (phase "backward") of an op on
CPU tensors under `bench.cost.counting`, at small shapes chosen so that the counts are exact
polynomials (`bench.cost_model`), and is extrapolated to the target shapes. Peers run their own
package's code; where a peer's GPU branch differs from its CPU branch, the GPU branch is what is
counted (each case says how, in `Subject.gpu_path`).
"""
from __future__ import annotations

import contextlib
import importlib
import math
import random
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from . import cost
from . import cost_losses as _loss
from .cost_losses import LOSS
from .cost_model import Counts, Features, Fit, Shape, fit_exact, flatten, grid, multilinear, residue_values

LINEAR, TOKEN = "linear_token_logprobs", "token_logprobs"
DTYPE = torch.bfloat16
# The target shapes of issue 18 (bf16): N tokens, D hidden size, V vocabulary (Qwen2.5's 151,936)
TARGETS: List[Shape] = [(8192, 4096, 151936), (2048, 4096, 151936), (16384, 1536, 151936)]


TARGETS_NOTE = ("every target is token 0: a kernel that gathers weight rows by target then touches one distinct "
                "row (random targets would make distinct bytes data-dependent, not polynomial); at most N x D "
                "bytes of compulsory traffic are left out")


@dataclass
class Subject:
    name: str
    op: str
    label: str
    call: Callable  # linear: (hidden, weight, targets) -> logp [N]; token: (logits, targets) -> logp [N];
    # loss (bench.cost_losses): (hidden, weight, layout) -> a scalar
    fit_plan: Callable[[Shape], "FitPlan"]  # target -> how to fit for it
    module: Optional[str] = None  # must import for the subject to be present
    dist: Optional[str] = None
    gpu_path: str = ""  # how the counted path is the peer's GPU path
    adjust: Optional[Callable[[List[cost.Launch]], List[cost.Launch]]] = None
    uses_d: bool = True
    # time a PyTorch GEMM per output pattern (False: per op name, see cost_model.group_key). Ours have
    # no GEMM but the products (cuBLAS with Tiles.gemm_engine 1): one group, also where a counting
    # shape's chunk of rows is as long as D (a pattern would then name it D, apart from the target's)
    gemm_roles: bool = True

    def closures(self, shape: Shape) -> Tuple[Callable, Callable]:
        """(forward, backward) at `shape`: forward() -> logp (a loss: the scalar), backward(it)."""
        from .cost_losses import LOSS, loss_run

        return {LINEAR: _linear_run, TOKEN: _token_run, LOSS: loss_run}[self.op](self.call)(shape)

    def absent_reason(self) -> Optional[str]:
        if self.module is None:
            return None
        try:
            importlib.import_module(self.module)
        except Exception as e:  # noqa: BLE001 (any import failure means absent)
            return f"not installed (import {self.module}: {type(e).__name__}: {e})"[:200]
        return None

    def version(self) -> Optional[str]:
        from .measure import package_version

        return package_version(self.dist) if self.dist else None


@dataclass
class FitPlan:
    """Shapes to count and the basis: `fit` shapes for the solve, `check` held-out shapes; `patch`
    applies small constants while counting (with `features` in them), `target_features` the real
    ones at the target. `key`: plans with equal keys share one fit."""

    key: Tuple
    fit: List[Shape]
    check: List[Shape]
    features: Features = multilinear
    target_features: Optional[Features] = None
    patch: Callable[[Shape], contextlib.AbstractContextManager] = lambda shape: contextlib.nullcontext()


def count(subject: Subject, shape: Shape, plan: FitPlan) -> Counts:
    """Counts of one forward + backward of `subject` at `shape` (grouped, see cost_model.flatten)."""
    with plan.patch(shape):
        forward, backward = subject.closures(shape)
        with cost.counting("forward") as fwd:
            out = forward()
        with cost.counting("backward") as bwd:
            backward(out)
    records = fwd + bwd
    if subject.adjust is not None:
        records = subject.adjust(records)
    return flatten(records, shape[:3], subject.gemm_roles)  # a counting shape may carry a layout index


# ----------------------------------------------------------------------------- inputs


def _linear_inputs(shape: Shape, dtype=DTYPE):
    n, d, v = shape
    g = torch.Generator().manual_seed(n * 1_000_003 + d * 1009 + v)
    hidden = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g) / math.sqrt(d)).to(dtype).requires_grad_()
    targets = torch.zeros(n, dtype=torch.long)  # see TARGETS_NOTE
    grad = torch.randn(n, generator=g)
    return hidden, weight, targets, grad


def _linear_run(call: Callable) -> Callable[[Shape], Tuple[Callable, Callable]]:
    """(forward, backward) of a log-prob function call(hidden, weight, targets) -> logp [N]."""
    def run(shape: Shape):
        hidden, weight, targets, grad = _linear_inputs(shape)
        return (lambda: call(hidden, weight, targets)), (lambda out: out.backward(grad.to(out.dtype)))
    return run


def _token_run(call: Callable) -> Callable[[Shape], Tuple[Callable, Callable]]:
    def run(shape: Shape):
        n, _, v = shape
        g = torch.Generator().manual_seed(n * 1009 + v)
        logits = (3 * torch.randn(n, v, generator=g)).to(DTYPE).requires_grad_()
        targets = torch.zeros(n, dtype=torch.long)  # see TARGETS_NOTE
        grad = torch.randn(n, generator=g)
        return (lambda: call(logits, targets)), (lambda out: out.backward(grad.to(out.dtype)))
    return run


def _residue_plan(key: str, target: Shape, moduli: Tuple[int, int, int], base=(1, 1, 1),
                  patch: Callable[[Shape], contextlib.AbstractContextManager] = None,
                  torch_gemms: bool = False) -> FitPlan:
    """The 2 x 2 x 2 grid on the target's residue classes, and two held-out shapes (a third
    value of N and D; a third value of V). torch_gemms: no size shared by two dimensions (the
    group of a PyTorch GEMM names its output's V and D dimensions)."""
    vals = [residue_values(t, m, b) for t, m, b in zip(target, moduli, base)]
    for i in (1, 2) if torch_gemms else ():
        while set(vals[i]) & {x for j in range(i) for x in vals[j]}:
            vals[i] = (vals[i][0] + moduli[i], vals[i][1] + moduli[i])
    (n0, n1), (d0, d1), (v0, v1) = vals
    mn, md, mv = moduli
    checks = [[n1 + mn, d1 + md, v0], [n0, d0, v1 + mv]]
    for c in checks if torch_gemms else ():
        for i in (1, 2):
            while c[i] in c[:i]:
                c[i] += moduli[i]
    plan = FitPlan(key=(key, tuple(t % m for t, m in zip(target, moduli)), moduli), fit=grid(*vals),
                   check=[tuple(c) for c in checks])
    if patch is not None:
        plan.patch = patch
    return plan


# ----------------------------------------------------------------------------- ours


# The architecture whose default tiles ours are counted with: the modelled GPUs (H100, H200)
# are sm_90 (B200's sm_100 tiles have the same logit tiles but 128 x 256 product tiles).
COUNTED_CAPABILITY = (9, 0)


def _erpo_tiles(op: str):
    from erpo_kernels import default_tiles

    return default_tiles(op, DTYPE, COUNTED_CAPABILITY)


@contextlib.contextmanager
def counted_tiles() -> Iterator[None]:
    """Ops called without tiles= (erpo_loss's kernels) launch with COUNTED_CAPABILITY's default
    tiles, as on that GPU without a tuning file, instead of the interpreter's."""
    from erpo_kernels import tiles

    saved = tiles._device_tiles
    tiles._device_tiles = lambda op, device, dtype, d, v: tiles.default_tiles(op, dtype, COUNTED_CAPABILITY)
    try:
        yield
    finally:
        tiles._device_tiles = saved


def _erpo_linear(hidden, weight, targets):
    import erpo_kernels

    return erpo_kernels.linear_token_logprobs(hidden, weight, targets, backend="triton",
                                              tiles=_erpo_tiles("linear_token_logprobs"))


def _erpo_linear_plan(target: Shape) -> FitPlan:
    """Residue classes of every tile and chunk of the kernels' Tiles (rows: block_n, gemm_n, gemm_k
    and the merge block; D: block_d, gemm_d; V: block_v, gemm_v, gemm_k and the vocabulary chunk,
    split_tiles x block_v), with at least two vocabulary chunks (a single chunk may take another
    path)."""
    ltl = importlib.import_module("erpo_kernels.linear_token_logprobs")  # the module (the package exports the function)
    t = _erpo_tiles("linear_token_logprobs")
    size = lambda name: getattr(t, name, 1)  # noqa: E731 (tiles a design may not have)
    mn = math.lcm(t.block_n, size("gemm_n"), size("gemm_k"), getattr(ltl, "MERGE_BLOCK", 1))
    md = math.lcm(t.block_d, size("gemm_d"))
    mv = math.lcm(t.block_v, size("gemm_v"), size("gemm_k"), t.block_v * size("split_tiles"))
    return _residue_plan("erpo", target, (mn, md, mv), base=(1, 1, mv + 1), patch=lambda shape: _loss.cuda_products())


def _erpo_token(logits, targets):
    import erpo_kernels

    return erpo_kernels.token_logprobs(logits, targets, backend="triton", tiles=_erpo_tiles("token_logprobs"))


# ----------------------------------------------------------------------------- support= (issue 34)


def support_tensor(form: str, n: int, vocab: int) -> torch.Tensor:
    """A kept set per row in one of support='s two forms: "threshold" [N] fp32 (0.0: the tokens
    whose scaled logit is >= 0) or "bitmask" [N, ceil(V / 32)] int32 (random bits)."""
    if form == "threshold":
        return torch.zeros(n, dtype=torch.float32)
    from erpo_kernels.support import pack_support

    g = torch.Generator().manual_seed(n * 7 + vocab)
    return pack_support(torch.rand(n, vocab, generator=g) < 0.5)


_supports: Dict[Tuple[str, int, int], torch.Tensor] = {}  # made by the plan's patch, before counting starts


def _erpo_linear_support(form: str) -> Callable:
    def call(hidden, weight, targets):
        import erpo_kernels

        return erpo_kernels.linear_token_logprobs(hidden, weight, targets, backend="triton",
                                                  tiles=_erpo_tiles("linear_token_logprobs"),
                                                  support=_supports[(form, hidden.shape[0], weight.shape[0])])
    return call


def _erpo_token_support(form: str) -> Callable:
    def call(logits, targets):
        import erpo_kernels

        return erpo_kernels.token_logprobs(logits, targets, backend="triton", tiles=_erpo_tiles("token_logprobs"),
                                           support=_supports[(form, *logits.shape)])
    return call


def _support_plan(plan_of: Callable[[Shape], FitPlan], form: str) -> Callable[[Shape], FitPlan]:
    """plan_of's plan, with the support tensor of each counted shape made before counting (an
    input of the op, as the logits are: what making it costs is not the op's)."""
    def plan(target: Shape) -> FitPlan:
        p = plan_of(target)
        inner = p.patch

        @contextlib.contextmanager
        def patch(shape: Shape) -> Iterator[None]:
            key = (form, shape[0], shape[2])
            _supports[key] = support_tensor(form, shape[0], shape[2])
            try:
                with inner(shape):
                    yield
            finally:
                _supports.pop(key, None)

        p.patch = patch
        return p
    return plan


SUPPORT_FORMS = ("threshold", "bitmask")


def _erpo_token_plan(target: Shape) -> FitPlan:
    blocks = _erpo_tiles("token_logprobs")
    mv = math.lcm(getattr(blocks, "fwd_max_block_v", 1), getattr(blocks, "bwd_max_block_v", 1))
    return _residue_plan("erpo-token", target, (1, 1, mv), base=(16, 1, 1))


def _reference_linear(hidden, weight, targets):
    import erpo_kernels

    return erpo_kernels.linear_token_logprobs(hidden, weight, targets, backend="torch")


def _reference_token(logits, targets):
    import erpo_kernels

    return erpo_kernels.token_logprobs(logits, targets, backend="torch")


def _reference_plan(constant: str, key: str) -> Callable[[Shape], FitPlan]:
    """The reference's row chunks hold reference.<constant> elements: rows = constant // V.
    Counted with the target's rows per chunk (the constant set to rows x V at each shape), on
    the residue class of N mod rows."""
    def plan(target: Shape) -> FitPlan:
        from erpo_kernels import reference

        rows = max(1, getattr(reference, constant) // target[2])  # reference.chunk_rows_for

        @contextlib.contextmanager
        def patch(shape: Shape) -> Iterator[None]:
            old = getattr(reference, constant)
            setattr(reference, constant, rows * shape[2])
            try:
                yield
            finally:
                setattr(reference, constant, old)

        return _residue_plan(key, target, (rows, 1, 1), base=(1, 16, 16), patch=patch, torch_gemms=True)
    return plan


# ----------------------------------------------------------------------------- TRL


TRL_ROWS, TRL_VOCAB, TRL_BLOCK = 4096, 32768, 1024  # trl.kernels.chunked_logprob at 1.16 (read when present)
_TRL_SMALL = (32, 96, 32)  # the same constants while counting at small shapes


def _trl_constants() -> Tuple[int, int, int]:
    try:
        from trl.kernels import chunked_logprob as cl
        from trl.trainer import utils as tu
    except ImportError:
        return TRL_ROWS, TRL_VOCAB, TRL_BLOCK
    return (getattr(cl, "TOKEN_CHUNK_SIZE", TRL_ROWS), getattr(tu, "_CHUNKED_LOGPROB_CHUNK_SIZE", TRL_VOCAB),
            getattr(cl, "_BLOCK_SIZE", TRL_BLOCK))


_trl_vocab_chunk = [TRL_VOCAB]  # the vocabulary chunk passed to ChunkedLogProbFunction (patched while counting)


def _trl_chunked(hidden, weight, targets):
    from trl.kernels import ChunkedLogProbFunction

    return ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, _trl_vocab_chunk[0], None, 1.0,
                                        ("log_probs",))[0]


def _trl_features(consts: Tuple[int, int, int]) -> Features:
    rows, chunk, block = consts

    def features(shape: Shape) -> Dict[str, Fraction]:
        n, d, v = shape
        kn, kv = -(-n // rows), -(-v // chunk)
        vb = (v // chunk) * -(-chunk // block) + -(-(v % chunk) // block)  # backward kernel blocks per row
        f = multilinear(shape)
        f.update({"N.KV": Fraction(n * kv), "ND.KV": Fraction(n * d * kv), "V.KN": Fraction(v * kn),
                  "DV.KN": Fraction(d * v * kn), "N.VB": Fraction(n * vb), "KN.KV": Fraction(kn * kv),
                  "D.KN.KV": Fraction(d * kn * kv), "KN": Fraction(kn), "KV": Fraction(kv)})
        return f
    return features


def _trl_plan(target: Shape) -> FitPlan:
    @contextlib.contextmanager
    def patch(shape: Shape) -> Iterator[None]:
        from trl.kernels import chunked_logprob as cl

        saved = (cl.TOKEN_CHUNK_SIZE, cl._BLOCK_SIZE, cl._use_triton, cl._addmm_fp32, _trl_vocab_chunk[0])
        cl.TOKEN_CHUNK_SIZE, _trl_vocab_chunk[0], cl._BLOCK_SIZE = _TRL_SMALL
        cl._use_triton = lambda device: True  # the Triton fold kernels of its CUDA path
        cl._addmm_fp32 = _trl_addmm_cuda
        try:
            yield
        finally:
            cl.TOKEN_CHUNK_SIZE, cl._BLOCK_SIZE, cl._use_triton, cl._addmm_fp32, _trl_vocab_chunk[0] = saved

    rng = random.Random(18)
    fit = [(rng.choice((40, 64, 72, 100)), rng.choice((16, 24, 40)), rng.choice((70, 96, 150, 200, 290)))
           for _ in range(26)]
    fit = sorted(set(fit))
    return FitPlan(key=("trl",), fit=fit, check=[(120, 32, 260), (36, 48, 100)], features=_trl_features(_TRL_SMALL),
                   target_features=_trl_features(_trl_constants()), patch=patch)


def _trl_addmm_cuda(acc, a, b):
    """trl's _addmm_fp32 on CUDA: one GEMM of the bf16 operands accumulated into the fp32 acc."""
    torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


# ----------------------------------------------------------------------------- Liger


def _liger(hidden, weight, targets):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return -liger_fused_linear_cross_entropy(hidden, weight, targets, reduction="none")


def _liger_chunks(shape: Shape) -> Tuple[int, int]:
    """(chunks, rows per chunk) of Liger 0.8.5's fused linear cross entropy: rows bounded by
    next_power_of_2(ceil(N / ceil(V / D))) (liger_kernel/ops/fused_linear_cross_entropy.py)."""
    n, d, v = shape
    inc = -(-v // d)
    rows = min(1 << max(0, (-(-n // inc) - 1).bit_length()), n)
    return -(-n // rows), rows


def _liger_features(shape: Shape) -> Dict[str, Fraction]:
    k, _ = _liger_chunks(shape)
    n, d, v = shape
    f = multilinear(shape)
    f.update({"K": Fraction(k), "K.D": Fraction(k * d), "K.V": Fraction(k * v), "K.DV": Fraction(k * d * v)})
    return f


def _liger_plan(target: Shape) -> FitPlan:
    rng = random.Random(5)
    fit = sorted({(rng.choice((32, 48, 64, 96, 128)), rng.choice((24, 40, 56)), rng.choice((20, 36, 80, 150, 300)))
                  for _ in range(24)})
    return FitPlan(key=("liger",), fit=fit, check=[(160, 40, 400), (128, 24, 16)], features=_liger_features)


def _liger_gpu_weight_grad(records: List[cost.Launch]) -> List[cost.Launch]:
    """Liger's CPU branch accumulates d_weight as grad_weight += mm(g.T, x).float() (a [V, D] GEMM
    output, a cast to fp32, an add); on CUDA (sm_80+, bf16) it is one addmm into grad_weight.
    Each such triple of records becomes one addmm: the GEMM's inputs plus grad_weight read, grad_weight written."""
    out: List[cost.Launch] = []
    i = 0
    while i < len(records):
        r = records[i]
        trio = records[i:i + 3]
        if (len(trio) == 3 and [x.name for x in trio] == ["aten.mm", "aten._to_copy", "aten.add_"]
                and trio[0].out_shape == trio[1].out_shape == trio[2].out_shape and trio[0].flops):
            mm, cast, add = trio
            acc_bytes = cast.loaded  # grad_weight in the parameter dtype: the cast's bf16 input size
            fused = cost.Launch(name="aten.addmm", kind="torch", phase=mm.phase, out_shape=mm.out_shape,
                                flops=dict(mm.flops), loaded=mm.loaded + acc_bytes, stored=acc_bytes)
            fused.distinct_loaded, fused.distinct_stored = fused.loaded, fused.stored
            fused.distinct = fused.loaded + fused.stored
            out.append(fused)
            i += 3
            continue
        out.append(r)
        i += 1
    return out


# ----------------------------------------------------------------------------- Cut Cross-Entropy


def _cce(hidden, weight, targets):
    from cut_cross_entropy import linear_cross_entropy

    return -linear_cross_entropy(hidden, weight, targets, reduction="none", filter_eps=None)


def _cce_plan(target: Shape) -> FitPlan:
    # tiles of cut_cross_entropy 25.1.1 (tl_autotune defaults): forward 256 x 128 x 32, backward
    # 128 x 128 x 32, indexed dot 128 x 256
    return _residue_plan("cce", target, (256, 256, 128))


# ----------------------------------------------------------------------------- the list


SUBJECTS: List[Subject] = [
    Subject("erpo", LINEAR, "erpo_kernels.linear_token_logprobs (Triton)", _erpo_linear,
            _erpo_linear_plan,
            gpu_path="the sm_90 default tiles and their products engine (Tiles.gemm_engine; cuBLAS products "
                     "counted as erpo-loss's)", gemm_roles=False),
    Subject("erpo-reference", LINEAR, "erpo_kernels.linear_token_logprobs, backend='torch' (the chunked "
            "PyTorch reference, fp32 compute)", _reference_linear,
            _reference_plan("LINEAR_CHUNK_ELEMENTS", "ref-linear")),
    Subject("trl-chunked", LINEAR, "TRL ChunkedLogProbFunction (trl.kernels), log-probs only", _trl_chunked,
            _trl_plan, module="trl.kernels", dist="trl", gemm_roles=False,
            gpu_path="its CUDA branch: the Triton fold kernels (_use_triton forced) and the fp32-accumulating "
                     "addmm(out_dtype=float32) of bf16 operands (computed on CPU by an equivalent); counted with "
                     "small chunk constants, extrapolated with its own (4096 rows, 32768 columns, 1024 blocks)"),
    Subject("liger", LINEAR, 'Liger-Kernel fused_linear_cross_entropy, reduction="none"', _liger,
            _liger_plan, module="liger_kernel.transformers.functional", dist="liger-kernel",
            adjust=_liger_gpu_weight_grad,
            gpu_path="its CUDA (sm_80+) d_weight accumulation: one addmm into the bf16 grad_weight per chunk "
                     "(the CPU branch's mm + cast + add is rewritten to it)"),
    Subject("cce", LINEAR, "Cut Cross-Entropy linear_cross_entropy, reduction='none', filter_eps=None",
            _cce, _cce_plan, module="cut_cross_entropy", dist="cut-cross-entropy",
            gpu_path="its Triton kernels as on CUDA (libdevice log1p / tanh given triton.language equivalents "
                     "in the interpreter; bf16 elementwise values are wrong there, counts are value-independent "
                     "without a gradient filter)"),
    Subject("erpo-loss", LOSS, "erpo_kernels.erpo_loss (algorithm erpo, vanilla, the Query-KL; its default "
            "path)", _loss._erpo_loss, _loss._erpo_loss_plan,
            gpu_path="the sm_90 default tiles and their products engine (Tiles.gemm_engine; 1 since 87f5527: cuBLAS, "
                     "the fp32-accumulating products as its CUDA branch runs them, addmm(out_dtype=float32) of the "
                     "bf16 operands, computed on CPU by an equivalent)", gemm_roles=False),
    Subject("erpo-loss-triton", LOSS, "erpo_kernels.erpo_loss as erpo-loss, the products on our Triton kernels "
            "(Tiles.gemm_engine 0: _ltl_bwd_gemm_kernel)", _loss._erpo_loss_triton, _loss._erpo_loss_plan,
            gpu_path="the sm_90 default tiles with gemm_engine 0", gemm_roles=False),
    Subject("liger-grpo", LOSS, "Liger-Kernel LigerFusedLinearGRPOLoss (loss_type dapo, beta 0, one chunk per "
            "sequence: chunk_size 1)", _loss._liger_grpo, _loss._liger_grpo_plan,
            module="liger_kernel.chunked_loss", dist="liger-kernel", gemm_roles=False,
            gpu_path="its torch code, the same on CUDA: the chunks' logits GEMMs in bf16, the recomputed "
                     "gradient GEMMs in fp32 (weight.float(), hidden.float(); PyTorch's default fp32 matmul, "
                     "no TF32); compiled=False (its torch.compile of the [B, T] loss math left out); counted "
                     "with a 16-column vocabulary chunk, extrapolated with its own (4096 columns, 2048 rows)"),
    Subject("trl-grpo", LOSS, "TRL GRPOTrainer._compute_loss (loss_type dapo, beta 0) on its fused LM head's "
            "log-probs and entropies (ChunkedLogProbFunction)", _loss._trl_grpo, _loss._trl_grpo_plan,
            module="trl.kernels", dist="trl", gemm_roles=False,
            gpu_path="its CUDA branch: the valid positions compacted as add_fused_lm_head does on a Triton device, "
                     "the Triton fold kernels and addmm(out_dtype=float32) of ChunkedLogProbFunction (as "
                     "trl-chunked), TRL's own _compute_loss on a stand-in trainer (GRPOConfig defaults, one process)"),
    Subject("erpo", TOKEN, "erpo_kernels.token_logprobs (Triton)", _erpo_token, _erpo_token_plan,
            uses_d=False),
    *[Subject(f"erpo-support-{form}", op, f"{label} with support= as a {form} ({what})", call(form),
              _support_plan(plan, form), module="erpo_kernels.support", uses_d=op == LINEAR, gemm_roles=False)
      for form, what in zip(SUPPORT_FORMS, ("[N] fp32", "[N, ceil(V / 32)] int32"))
      for op, label, call, plan in ((LINEAR, "erpo_kernels.linear_token_logprobs (Triton)", _erpo_linear_support,
                                     _erpo_linear_plan),
                                    (TOKEN, "erpo_kernels.token_logprobs (Triton)", _erpo_token_support,
                                     _erpo_token_plan))],
    Subject("erpo-reference", TOKEN, "erpo_kernels.token_logprobs, backend='torch'", _reference_token,
            _reference_plan("CHUNK_ELEMENTS", "ref-token"), uses_d=False),
]


def _count_job(name: str, op: str, target: Shape, shape: Shape) -> Counts:
    """count() in a worker process (the subject and its plan looked up again there)."""
    subject = next(s for s in SUBJECTS if s.name == name and s.op == op)
    return count(subject, shape, subject.fit_plan(target))


def say(line: str) -> None:
    """A progress line, out at once (a pipe or a log file would hold it back for minutes)."""
    print(line, flush=True)


def fit_subject(subject: Subject, target: Shape, cache: Dict[Tuple, Fit], log=say, jobs: int = 1) -> Fit:
    """The subject's fit for `target` (shared by targets whose plans have the same key); with
    jobs > 1 the shapes are counted in that many worker processes."""
    plan = subject.fit_plan(target)
    key = (subject.name, subject.op, plan.key)
    if key in cache:
        return cache[key]
    # a subject that ignores D is counted once per (N, V)
    todo = list(dict.fromkeys(s if subject.uses_d else (s[0], plan.fit[0][1], s[2]) for s in plan.fit + plan.check))
    t0 = time.monotonic()
    log(f"  {subject.name} {subject.op}: counting {len(todo)} shapes (N, D, V) for the target "
        f"{'x'.join(map(str, target))}, {min(jobs, len(todo))} at a time ...")

    def counted_one(i: int, shape: Shape) -> None:  # a line per shape: how far, and about how long is left
        took = time.monotonic() - t0
        log(f"    {subject.name} {subject.op}: {i}/{len(todo)} shapes counted ({shape}), {took:.0f} s so far, "
            f"about {took / i * (len(todo) - i):.0f} s left")

    done = {}
    if jobs > 1 and len(todo) > 1:
        import concurrent.futures
        import multiprocessing

        with concurrent.futures.ProcessPoolExecutor(min(jobs, len(todo)),
                                                    mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_count_job, subject.name, subject.op, target, s): s for s in todo}
            for i, future in enumerate(concurrent.futures.as_completed(futures), 1):
                done[futures[future]] = future.result()
                counted_one(i, futures[future])
    else:
        for i, shape in enumerate(todo, 1):
            done[shape] = count(subject, shape, plan)
            counted_one(i, shape)
    log(f"  counted {subject.name} {subject.op} at {len(todo)} shapes (N, D, V): {todo}")
    counted = {s: done[s if subject.uses_d else (s[0], plan.fit[0][1], s[2])] for s in plan.fit + plan.check}
    fit = fit_exact({s: counted[s] for s in plan.fit}, plan.features)
    for s in plan.check:
        fit.check(s, counted[s])
    fit.target_features = plan.target_features
    cache[key] = fit
    return fit


# ----------------------------------------------------------------------------- the run


PASSES = ("forward", "backward", "both")


def evaluate(fit: Fit, target: Shape) -> Dict:
    """Counts and modelled times of a fitted subject at `target`: per launch group its counts and,
    per hardware, its model; per pass and hardware the total."""
    from .cost_model import HARDWARE, gemm_floor_s, model_times

    counts = fit.at(target)
    models = {hw_name: {g.group: g for g in model_times(counts, hw)} for hw_name, hw in HARDWARE.items()}
    groups = []
    for name in sorted(counts, key=lambda g: -models["H200"][g].seconds):
        g = models["H200"][name]
        groups.append({"group": name, "launches": g.launches, "programs": g.programs, "loaded": g.loaded,
                       "stored": g.stored, "flops": g.flops,
                       "model": {hw: {k: v for k, v in models[hw][name].as_dict().items()
                                      if k in ("hbm_bytes", "flop_ms", "byte_ms", "ms", "dominant", "bytes_rule",
                                                "l2_bytes", "l2_ms", "smem_bytes", "smem_ms")}
                                 for hw in HARDWARE}})
    passes = {p: {hw: {"ms": sum(g["model"][hw]["ms"] for g in groups
                                 if p == "both" or g["group"].split("/")[-2] == p)} for hw in HARDWARE}
              for p in PASSES}
    floors = {hw_name: {f"{k}-GEMM": gemm_floor_s(target, k, hw) * 1e3 for k in (1, 2, 3, 4)}
              for hw_name, hw in HARDWARE.items()}
    return {"shape": dict(zip("NDV", target)), "passes": passes, "floors_ms": floors, "groups": groups}


def run(subjects: List[Subject], targets: List[Shape], log=say, jobs: int = 1) -> Dict:
    """Fit and evaluate every subject (absent or failing ones are recorded with the reason)."""
    from .cost_model import BYTES_RULE, HARDWARE, L2_RULE

    import time

    cache: Dict[Tuple, Fit] = {}
    entries = []
    for s in subjects:
        t0 = time.monotonic()
        entry: Dict = {"name": s.name, "op": s.op, "label": s.label, "version": s.version(), "gpu_path": s.gpu_path}
        why = s.absent_reason()
        if why:
            entry.update(status="absent", reason=why)
            entries.append(entry)
            log(f"{s.name} ({s.op}): absent: {why}")
            continue
        try:
            results, fits = [], []
            for t in targets:
                fit = fit_subject(s, t, cache, log=log, jobs=jobs)
                fits.append(fit)
                results.append(evaluate(fit, t))
        except Exception as e:  # noqa: BLE001 (a peer that cannot run here is reported, not dropped)
            entry.update(status="error", reason=f"{type(e).__name__}: {e}"[:400])
            entries.append(entry)
            log(f"{s.name} ({s.op}): cannot be counted here: {entry['reason']}")
            continue
        exact = all(f.exact and f.fit_exact for f in fits)
        worst = max((c[k] for f in fits for c in f.checks for k in ("bytes_rel_err", "flops_rel_err")), default=0.0)
        entry.update(status="ok", exact=exact, held_out_rel_err=worst, results=results,
                     fits=[{"shapes": [list(x) for x in f.shapes], "terms": f.terms, "fit_exact": f.fit_exact,
                            "checks": f.checks} for f in {id(f): f for f in fits}.values()])
        entries.append(entry)
        entry["count_s"] = round(time.monotonic() - t0, 1)
        log(f"{s.name} ({s.op}): fitted in {entry['count_s']:.0f} s" + ("" if exact else f" (NOT exact on the held-out shapes: totals off by "
                                                  f"{worst:.1e})") + "; "
            + "; ".join(f"{r['shape']['N']}x{r['shape']['D']}x{r['shape']['V']}: "
                        f"{r['passes']['both']['H200']['ms']:.1f} ms" for r in results))
    return {"hardware": {k: vars(h) for k, h in HARDWARE.items()}, "bytes_rule": BYTES_RULE, "l2_rule": L2_RULE,
            "targets_note": TARGETS_NOTE, "dtype": "bf16", "subjects": entries,
            **({"layout_note": _loss.LAYOUT_NOTE} if any(s.op == LOSS for s in subjects) else {}),
            "targets": [dict(zip("NDV", t)) for t in targets]}
