"""erpo inside TRL (tested with trl==1.16.0; `pip install erpo[trl]`).

Our kernel behind TRL's fused LM head, a two-line change:

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)
    use_erpo_kernels(trainer)   # TRL's fused LM head now runs erpo_kernels.linear_token_logprobs
    trainer.train()

ERPO as a TRL trainer (docs/method.md: weighted policy loss + alpha * Query-KL):

    trainer = ERPOTrainer(model=..., reward_funcs=..., args=ERPOConfig(alpha=0.01, ...), train_dataset=...)
    trainer.train()            # logs query_kl, weights/ess, weights/min, weights/max with TRL's metrics

How the kernel gets in. TRL's `add_fused_lm_head` patches `model.forward`: with
`fused_lm_head=True` it runs the backbone, gathers an FSDP2 DTensor lm_head with
`full_tensor()`, and hands (hidden rows, weight, bias, targets, temperature, chunk size,
softcap, logit scale, outputs) to `trl.trainer.utils._ChunkedLogProbFunction.apply`.
`use_erpo_kernels` replaces that module attribute, once, by `_KernelSwitch`, which
calls TRL's own function unless the call happens inside the forward of a model given
to `use_erpo_kernels` (a forward pre-hook marks those calls in a context variable);
those calls go to `linear_token_logprobs`. Everything else is TRL's own forward.

ERPOTrainer reuses the same switch: around its policy forward it also labels the
prompt tokens of one copy per query (scored at temperature 1, the completion rows at
1 / tau, in the same kernel call), then adds the Query-KL from those log-probs and
puts the per-query weights into TRL's policy loss through the advantages.

With ERPOConfig.policy_loss, the switch forms the whole loss in that call instead:
erpo_kernels.erpo_loss on TRL's hidden rows and (gathered) lm_head weight, with a
PackedLossBatch of the same rows (the scoring copies' prompt rows, the completion rows),
L_PG(w_B) + alpha * R_query in one fused call (3 GEMMs of lm_head work: the gradient
formed in the forward, docs/objective.md). Where erpo_loss's fused path does not apply
(`fused_path_reason`: the torch backend, no gradient, a batch-wide policy loss,
fused_budget_mb=0, or a sequence longer than a chunk) the call returns the log-probs
and the trainer runs erpo_loss_from_logp + the Query-KL on them;
`trainer.erpo_head.loss_path` says which ran.

The head's log-probs themselves (every trainer, any loss): a training call on the Triton
backend whose kept logits (2 bytes each in bf16 / fp16, 4 in fp32) fit the budget
(use_erpo_kernels' fused_budget_mb, ERPOConfig.fused_budget_mb) keeps them for its
backward, which then forms the softmax gradient from them: 3 GEMMs instead of 4
(erpo_kernels.kept_logits);
`head.forward_path` says which ran.
"""
from __future__ import annotations

import contextvars
import hashlib
import os
import sys
from dataclasses import dataclass, field
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

try:
    import trl
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer import utils as _trl_utils
except ImportError:
    raise ImportError("erpo.integrations.trl needs TRL: pip install erpo[trl]") from None

import torch

from erpo_kernels import (LossConfig, LossNormalizers, PackedLossBatch, check_backend, erpo_loss, erpo_loss_from_logp,
                          linear_token_logprobs, prompt_logp_sums, query_kl_value, weighted_k3)
from erpo_kernels.fused_linear_loss import rows_for_budget
from erpo_kernels.linear_token_logprobs import operand_dtype
from erpo_kernels.objective.fused import fused_path_reason

from erpo_kernels.kept_logits import kept_linear_token_logprobs

from ..erpo_settings import ERPOSettings
from ..query_weights import QueryWeighter, effective_sample_size
from ..ref_cache import (
    RefCache,
    RefCacheError,
    build_ref_cache,
    fixed_by,
    model_fingerprint,
    query_id,
    read_ref_cache,
    save_ref_cache,
    tokenizer_fingerprint,
    validate_ref_cache,
)

__all__ = ["ERPOConfig", "ERPOTrainer", "ErpoKernelsHead", "use_erpo_kernels"]

TESTED_TRL = "1.16.0"
IGNORE_INDEX = -100
# The per-token outputs TRL's fused head can ask for that linear_token_logprobs computes.
SUPPORTED_OUTPUTS = ("log_probs", "entropy")
# ERPOTrainer's policy loss (ERPOConfig.policy_loss) formed in the head's call (ErpoKernelsHead.loss_path).
FUSED_PATH = "erpo_loss's fused path (3 GEMMs)"

# ----------------------------------------------------------------------------- the kernel switch

# The head whose model's forward is running now (None: not one given to use_erpo_kernels).
_ACTIVE: contextvars.ContextVar[Optional["ErpoKernelsHead"]] = contextvars.ContextVar("erpo_trl_head", default=None)


class _KernelSwitch:
    """Stands in for `trl.trainer.utils._ChunkedLogProbFunction` (same `apply` signature and
    5-tuple result): TRL's own function, or our kernel inside a use_erpo_kernels model."""

    trl_function: Any = None  # TRL's ChunkedLogProbFunction, set when the switch is installed

    @classmethod
    def apply(cls, hidden, weight, bias, targets, temperature, chunk_size,
              final_logit_softcapping=None, logit_scale=1.0, outputs=("log_probs",)):
        head = _ACTIVE.get()
        if head is None:
            return cls.trl_function.apply(
                hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs
            )
        return head.score(hidden, weight, bias, targets, temperature, final_logit_softcapping, logit_scale, outputs)


def _install_switch() -> None:
    current = getattr(_trl_utils, "_ChunkedLogProbFunction", None)
    if current is _KernelSwitch:
        return
    if current is None or not hasattr(current, "apply"):
        raise RuntimeError(
            f"erpo: this TRL ({trl.__version__}) has no trl.trainer.utils._ChunkedLogProbFunction to route; "
            f"use_erpo_kernels is built for trl=={TESTED_TRL} (pip install erpo[trl])"
        )
    _KernelSwitch.trl_function = current
    _trl_utils._ChunkedLogProbFunction = _KernelSwitch


def _full(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A whole tensor from an FSDP2 DTensor, anything else unchanged. TRL's fused head
    already gathers a DTensor lm_head (full_tensor()) before the kernel call; this covers a
    DTensor that still arrives, with erpo.distributed.gather_for_call, whose backward
    reduce-scatters (sums) the gradient into the shard."""
    if t is None:
        return None
    from ..distributed import gather_for_call

    return gather_for_call(t)


@dataclass
class _PromptPlan:
    """ERPOTrainer's request for the next fused forward of the policy: also score the
    prompt tokens of the sequences in `scored` ([B] bool), at temperature 1."""

    prompt_len: int  # P, width of the left-padded prompt block of input_ids [B, P + C]
    scored: torch.Tensor  # [B] bool, the copy that scores its query's prompt
    is_prompt_row: Optional[torch.Tensor] = None  # [B, P + C - 1] bool, set by the pre-hook
    label_mask: Optional[torch.Tensor] = None  # [B, P + C - 1] bool, set by the pre-hook
    targets: Optional[torch.Tensor] = None  # [B, P + C - 1] the token row j scores (IGNORE_INDEX: none), pre-hook
    log_probs: Optional[torch.Tensor] = None  # [B, P + C - 1] fp32, the forward's log-probs
    loss: Optional["_FusedLoss"] = None  # ERPOConfig.policy_loss: the loss the head forms in its call


@dataclass
class _FusedLoss:
    """ERPOTrainer's request (policy_loss=): form erpo_loss on the rows of the fused head's
    call, when erpo_loss's fused path applies to them."""

    inputs: Dict[str, Any]  # the micro-batch (TRL's inputs with ERPOTrainer's query fields)
    group_size: int  # G = num_generations
    config: LossConfig  # L_PG(w_B) + alpha * R_query
    fused_budget: int  # bytes of kept logits per chunk (0: the 4-GEMM path)
    result: Optional[Tuple[torch.Tensor, Dict[str, Any]]] = None  # (loss, metrics) when the fused path ran
    reason: Optional[str] = None  # why it did not (fused_path_reason's, or a sequence longer than a chunk)


class ErpoKernelsHead:
    """What `use_erpo_kernels` attaches to a model as `model.erpo_kernels`.

    calls: fused-LM-head calls our kernel has served (> 0 once training ran: the way to
    tell that our kernel is in use); rows: token rows they scored; backend: the
    backend argument of linear_token_logprobs ("auto": Triton on CUDA, the PyTorch
    reference elsewhere).
    """

    def __init__(self, model_name: str, backend: str, verbose: bool = False) -> None:
        self.model_name = model_name
        self.backend = backend
        self.verbose = verbose
        self.calls = 0
        self.rows = 0
        self.fused_budget = 1 << 30  # bytes of logits a training call may keep for its backward
        self.forward_path: Optional[str] = None  # the last call's lm_head path (kept_logits.kept_linear_token_logprobs)
        self.loss_path: Optional[str] = None  # ERPOConfig.policy_loss: which path formed the last loss
        self.plan: Optional[_PromptPlan] = None
        self._tokens: List[contextvars.Token] = []

    def note_loss_path(self, reason: Optional[str]) -> None:
        """Record (and, when verbose, print once per change) which path formed the policy loss:
        FUSED_PATH, or erpo_loss_from_logp on the head's log-probs (reason: why not fused)."""
        path = FUSED_PATH if reason is None else f"erpo_loss_from_logp ({reason}) on {self.forward_path}"
        if path != self.loss_path and self.verbose:
            print(f"erpo: ERPOTrainer's policy loss runs {path}", file=sys.stderr)
        self.loss_path = path

    def __repr__(self) -> str:
        return (f"ErpoKernelsHead({self.model_name}: erpo_kernels.linear_token_logprobs, backend={self.backend!r}, "
                f"calls={self.calls}, rows={self.rows})")

    # -- forward hooks: mark the model's fused-head calls -------------------------------------

    def _pre_hook(self, module, args, kwargs):
        if not kwargs.get("fused_lm_head"):
            return None
        self._tokens.append(_ACTIVE.set(self))
        if self.plan is None:
            return None
        kwargs = dict(kwargs)
        kwargs["labels"] = self._label_prompts(self.plan, kwargs)
        return args, kwargs

    def _post_hook(self, module, args, kwargs, output):
        if not kwargs.get("fused_lm_head") or not self._tokens:
            return None
        _ACTIVE.reset(self._tokens.pop())
        plan = self.plan
        if plan is not None and plan.log_probs is None and output is not None:
            plan.log_probs = output.log_probs
        return None

    @staticmethod
    def _label_prompts(plan: _PromptPlan, kwargs: Dict[str, Any]) -> torch.Tensor:
        """TRL's labels [B, L] (completion tokens) plus the prompt tokens of the scored copies
        that have a predecessor in their sequence (left padding: the first real token has none)."""
        input_ids, attention_mask, labels = kwargs.get("input_ids"), kwargs.get("attention_mask"), kwargs.get("labels")
        if input_ids is None or attention_mask is None or labels is None or kwargs.get("shift_labels") is not None:
            raise ValueError("erpo: ERPOTrainer scores prompts from input_ids, attention_mask and labels; "
                             "this forward has no such keyword arguments (shift_labels / context parallelism is not supported)")
        b, width = input_ids.shape
        p = plan.prompt_len
        if plan.scored.shape[0] != b or p > width:
            raise ValueError(f"erpo: the fused forward got {b} sequences of width {width}, ERPOTrainer planned "
                             f"{plan.scored.shape[0]} with prompts of width {p}")
        real = attention_mask[:, :p].bool()  # [B, P]
        has_pred = torch.zeros_like(real)
        has_pred[:, 1:] = real[:, 1:] & real[:, :-1]  # [B, P] the token has a real predecessor
        score = has_pred & plan.scored.to(real.device)[:, None]  # [B, P]
        labels = labels.clone()
        labels[:, :p] = torch.where(score, input_ids[:, :p], labels[:, :p])
        plan.targets = labels[:, 1:]  # [B, L - 1]
        plan.label_mask = plan.targets != IGNORE_INDEX  # [B, L - 1] rows the kernel scores
        is_prompt = torch.zeros_like(plan.label_mask)
        is_prompt[:, : p - 1] = True
        plan.is_prompt_row = is_prompt  # [B, L - 1] rows at temperature 1
        return labels

    # -- the kernel call ---------------------------------------------------------------------

    def score(self, hidden, weight, bias, targets, temperature, softcap, logit_scale, outputs):
        """TRL's _ChunkedLogProbFunction contract with linear_token_logprobs: hidden [n, D],
        weight [V, D], bias [V] or None, targets [n] -> (log_probs [n], entropy [n] or None,
        None, None, None)."""
        extra = [o for o in outputs if o not in SUPPORTED_OUTPUTS]
        if extra:
            raise ValueError(
                f"erpo: use_erpo_kernels computes the fused head's {' and '.join(SUPPORTED_OUTPUTS)}; this trainer also "
                f"asks for {', '.join(extra)} (TRL's other outputs), which erpo does not compute. Use TRL's own head "
                f"for this trainer (do not call use_erpo_kernels on it)"
            )
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():
            raise ValueError("erpo: use_erpo_kernels does not support DeepSpeed ZeRO-3 (its lm_head weight is "
                             "partitioned outside TRL's gather); use FSDP2 or ZeRO-1/2")
        hidden, weight, bias = _full(hidden), _full(weight), _full(bias)
        dev = hidden.device
        # TRL computes in the autocast dtype when autocast is on, else in hidden's dtype.
        dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else hidden.dtype
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        inv_t: Any = 1.0 / float(temperature)
        plan = self.plan
        softcap = None if softcap is None else float(softcap)
        logit_scale = None if float(logit_scale) == 1.0 else float(logit_scale)
        if plan is not None and plan.loss is not None and plan.is_prompt_row is not None:
            fused = self._fused_loss(plan, plan.loss, hidden, weight, bias, 1.0 / float(temperature), softcap,
                                     logit_scale)  # fmt: skip
            if fused is not None:
                zeros = fused.new_zeros(hidden.shape[0], dtype=torch.float32)  # TRL scatters them; nothing reads them
                return zeros, zeros if "entropy" in outputs else None, None, None, None
        if plan is not None and plan.is_prompt_row is not None:
            inv_t = self._row_inv_temperature(plan, hidden.shape[0], 1.0 / float(temperature))
        with torch.autocast(dev.type, enabled=False):
            logp, entropy, path = kept_linear_token_logprobs(  # a training call keeps its logits when they fit
                hidden, weight, targets, bias=bias, inv_temperature=inv_t, ignore_index=IGNORE_INDEX,
                backend=self.backend, fused_budget=self.fused_budget,
                softcap=softcap, logit_scale=logit_scale,  # TRL's order: the scale, softcap * tanh(z / softcap), 1 / T
            )
        self.forward_path = path
        entropy = entropy if "entropy" in outputs else None
        self.calls += 1
        self.rows += int(hidden.shape[0])
        return logp, entropy, None, None, None

    def _fused_loss(self, plan: _PromptPlan, request: _FusedLoss, hidden: torch.Tensor, weight: torch.Tensor,
                    bias: Optional[torch.Tensor], inv_tau: float, softcap: Optional[float],
                    logit_scale: Optional[float]) -> Optional[torch.Tensor]:
        """erpo_loss on the rows of this call (hidden [n, D], weight [V, D]: TRL's, gathered and
        cast) into request.result, when its fused path applies (3 GEMMs); else None with
        request.reason set (the caller then scores log-probs for the 4-GEMM path). Returns the loss."""
        kept = self._rows_kept(plan, hidden.shape[0])  # [B, L - 1] bool, None: every position
        reason = fused_path_reason(hidden, weight, bias, request.config, None, self.backend, request.fused_budget)
        max_rows = (rows_for_budget(request.fused_budget, weight.shape[0], operand_dtype(hidden))
                    if request.fused_budget else 0)
        if reason is None and hidden.shape[0] > max_rows:  # erpo_loss chunks whole sequences
            longest = plan.targets.shape[1] if kept is None else int(kept.sum(1).max())
            if longest > max_rows:
                reason = (f"a sequence of {longest} rows is longer than a chunk ({max_rows} rows: raise "
                          f"ERPOConfig.fused_budget_mb)")
        request.reason = reason
        if reason is not None:
            return None
        prompt_width = plan.prompt_len - 1
        inv_t = torch.where(plan.is_prompt_row, 1.0, inv_tau).to(torch.float32)  # [B, L - 1]
        old = request.inputs.get("old_per_token_logps")  # [B, C] or None (the detached current log-probs)
        if old is not None:
            old = torch.cat([old.new_zeros(old.shape[0], prompt_width), old], dim=1)  # [B, L - 1]
        batch, norm = _sequence_batch(request.inputs, request.group_size, plan.targets, inv_t, old, prompt_width, kept)
        dev = hidden.device
        with torch.autocast(dev.type, enabled=False):
            loss, metrics = erpo_loss(hidden, weight, batch, request.config, bias=bias, backend=self.backend,
                                      with_entropy=False, normalizers=norm, softcap=softcap, logit_scale=logit_scale,
                                      fused_budget=request.fused_budget)  # fmt: skip
        request.result = (loss, metrics)
        self.calls += 1
        self.rows += int(hidden.shape[0])
        return loss

    @staticmethod
    def _rows_kept(plan: _PromptPlan, n_rows: int) -> Optional[torch.Tensor]:
        """Which positions [B, L - 1] TRL handed over as rows: None for every position
        (n = B (L - 1)), the labelled ones (on Triton devices, n = label_mask.sum())."""
        if n_rows == plan.label_mask.numel():
            return None
        if n_rows == int(plan.label_mask.sum()):
            return plan.label_mask
        raise ValueError(f"erpo: the fused head got {n_rows} rows, which fits neither every position "
                         f"({plan.label_mask.numel()}) nor the labelled ones ({int(plan.label_mask.sum())})")

    @staticmethod
    def _row_inv_temperature(plan: _PromptPlan, n_rows: int, inv_tau: float) -> torch.Tensor:
        """[n] inverse temperature of the rows TRL hands over: 1 on prompt rows, 1 / tau on
        completion rows. TRL passes every position (n = B (L - 1)) or, on Triton devices,
        only the labelled ones (n = label_mask.sum())."""
        full = torch.where(plan.is_prompt_row, 1.0, inv_tau).to(torch.float32)  # [B, L - 1]
        kept = ErpoKernelsHead._rows_kept(plan, n_rows)
        return full.reshape(-1) if kept is None else full[kept]


def _hook(model: torch.nn.Module, backend: str, verbose: bool, fused_budget_mb: int) -> ErpoKernelsHead:
    head = getattr(model, "erpo_kernels", None)
    if isinstance(head, ErpoKernelsHead):
        head.backend, head.fused_budget = backend, fused_budget_mb << 20
        return head
    head = ErpoKernelsHead(type(model).__name__, backend, verbose)
    head.fused_budget = fused_budget_mb << 20
    model.register_forward_pre_hook(head._pre_hook, with_kwargs=True)
    model.register_forward_hook(head._post_hook, with_kwargs=True, always_call=True)
    model.erpo_kernels = head
    if verbose:
        print(f"erpo: TRL's fused LM head of {head.model_name} runs erpo_kernels.linear_token_logprobs "
              f"(backend={backend!r}); model.erpo_kernels.calls counts its calls", file=sys.stderr)
    return head


def use_erpo_kernels(model_or_trainer: Any, *, backend: str = "auto", verbose: bool = True,
                     fused_budget_mb: int = 1024) -> ErpoKernelsHead:
    """Make TRL's fused LM head run erpo_kernels.linear_token_logprobs (log-probs and entropy).

    Args:
        model_or_trainer: a TRL trainer (its model and, when it has one, its reference
            model are switched), or a model whose fused head TRL adds (add_fused_lm_head)
            before or after this call. Only calls with `fused_lm_head=True` change;
            generation and the plain forward are TRL's / transformers' own.
        backend: linear_token_logprobs' backend: "auto" (Triton on CUDA, the chunked
            PyTorch reference elsewhere), "triton" or "torch".
        verbose: print one line per switched model to stderr.
        fused_budget_mb: MiB of kept logits a training call (a gradient wanted, the Triton
            backend) may keep for its backward, which then reuses them: 3 GEMMs of lm_head
            work instead of 4 (erpo_kernels.kept_logits; head.forward_path says which
            ran). 0: always recompute them.
    Returns:
        The policy model's ErpoKernelsHead (also `model.erpo_kernels`): `.calls` counts
        the fused-head calls our kernel served. A model's final_logit_softcapping and
        logit scale (as TRL reads them from its config) pass to the kernel; TRL's other
        optional outputs (log_sum_sq_probs, mean_logits, is_top1) are refused with a
        ValueError at the first such call.
    """
    check_backend(backend)
    if isinstance(fused_budget_mb, bool) or not isinstance(fused_budget_mb, int) or fused_budget_mb < 0:
        raise ValueError(f"fused_budget_mb must be an int >= 0 (MiB; 0 = recompute the logits), got {fused_budget_mb!r}")
    _install_switch()
    if isinstance(model_or_trainer, torch.nn.Module):
        return _hook(model_or_trainer, backend, verbose, fused_budget_mb)
    model = getattr(model_or_trainer, "model", None)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model_or_trainer must be a torch model or a TRL trainer, got {type(model_or_trainer).__name__}")
    accelerator = getattr(model_or_trainer, "accelerator", None)
    verbose = verbose and (accelerator is None or accelerator.is_main_process)
    head = _hook(model, backend, verbose, fused_budget_mb)
    ref_model = getattr(model_or_trainer, "ref_model", None)
    if isinstance(ref_model, torch.nn.Module):
        _hook(ref_model, backend, verbose, fused_budget_mb)
    return head


# ----------------------------------------------------------------------------- ERPO as a TRL trainer


@dataclass
class ERPOConfig(GRPOConfig):
    """GRPOConfig plus the keys of ERPO (docs/method.md sections 2, 3, 5, 7)."""

    alpha: float = field(default=0.01, metadata={"help": "Query-KL coefficient: loss = TRL's policy loss with the "
                         "query weights + alpha * weighted Query-KL; 0 = the weights-only ablation."})
    query_weighting: str = field(default="prevalence", metadata={"help": "Per-query weights: prevalence, softmax "
                                 "or none (none = uniform weights, the Query-KL-only ablation)."})
    bins: int = field(default=20, metadata={"help": "K, equal-width histogram bins of the prevalence weights."})
    gamma: float = field(default=1.0, metadata={"help": "Prevalence exponent: u(q) = p(q) ** gamma."})
    weight_temperature: float = field(default=1.0, metadata={"help": "T_w of the softmax weights: u(q) = exp(s(q) / T_w)."})
    w_min: float = field(default=0.1, metadata={"help": "Lower clip of the batch-normalised query weights (<= 1)."})
    w_max: float = field(default=10.0, metadata={"help": "Upper clip of the batch-normalised query weights (>= 1)."})
    kl_guard: float = field(default=10.0, metadata={"help": "c of the K3 guard: linear continuation of the "
                            "Query-KL for delta > c."})
    ref_cache: Optional[str] = field(default=None, metadata={"help": "Reference-cache file (l_0(q) of every training "
                                     "prompt under the starting model): loaded when it exists, else built and written "
                                     "there. None: built in memory at every start."})
    erpo_backend: str = field(default="auto", metadata={"help": "Backend of the erpo kernels: auto (Triton on CUDA), "
                              "triton or torch."})
    policy_loss: Optional[str] = field(default=None, metadata={"help": "erpo's policy loss (erpo_kernels.POLICY_LOSSES: "
                                       "vanilla, gspo, sapo, gpg, clip_cov, kl_cov, geo_mean, cispo, dppo_tv, dppo_kl, "
                                       "dro, bypass_mode, luspo, vespo) in place of TRL's loss_type, with epsilon / "
                                       "epsilon_high as its clip range (dppo_*: its thresholds), sapo_temperature_* as "
                                       "sapo's and vespo_* as vespo's; None: TRL's loss_type."})
    dro_beta: Optional[float] = field(default=None, metadata={"help": "With policy_loss='dro': its quadratic log-ratio "
                                      "coefficient (> 0, required)."})
    loss_agg: str = field(default="token-mean", metadata={"help": "With policy_loss: its aggregation over the "
                          "generation batch (token-mean, seq-mean-token-mean, seq-mean-token-sum, "
                          "seq-mean-token-sum-norm with max_completion_length as the constant)."})
    fused_budget_mb: int = field(default=1024, metadata={"help": "MiB of kept logits the lm_head work may keep: "
                                 "with policy_loss, per chunk of whole sequences on erpo_loss's fused path; else "
                                 "per fused-head call, kept for its backward (3 GEMMs of lm_head work instead of "
                                 "4 either way; larger calls recompute the logits); 0 = always 4 GEMMs."})

    def __post_init__(self) -> None:
        super().__post_init__()
        ERPOSettings.of(self).validate()  # ERPO's keys, checked where erpo train's are
        if self.policy_loss is not None:
            self.erpo_loss_config()  # checked by LossConfig
            if self.beta != 0 or self.top_entropy_quantile < 1 or self.entropy_coef != 0 or self.use_adaptive_entropy:
                raise ValueError("policy_loss= runs erpo's policy loss alone: set beta=0, top_entropy_quantile=1 and "
                                 "entropy_coef=0 (TRL's KL and entropy terms belong to its loss types), or "
                                 "policy_loss=None")
            if self.use_vllm or self.off_policy_mask_threshold is not None:
                raise ValueError("policy_loss= does not apply TRL's vLLM importance sampling or off-policy mask: "
                                 "use TRL's loss_type (policy_loss=None) with use_vllm or off_policy_mask_threshold")
        check_backend(self.erpo_backend, "erpo_backend")
        budget = self.fused_budget_mb
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"fused_budget_mb must be an int >= 0 (MiB; 0 = the 4-GEMM path), got {budget!r}")
        if self.ref_cache is not None and os.path.isdir(self.ref_cache):
            raise ValueError(f"ref_cache={self.ref_cache} is a directory; give a file path (e.g. DIR/ref_cache.safetensors)")

    def erpo_loss_config(self) -> Optional[LossConfig]:
        """The LossConfig of policy_loss (None without it): erpo's L_PG(w_B) alone (alpha=0:
        ERPOTrainer adds the Query-KL itself), TRL's clip range, SAPO temperatures and VESPO
        constants. bypass_mode reads old_per_token_logps as the rollout's (TRL samples with the
        trained weights; use_vllm is refused with policy_loss)."""
        if self.policy_loss is None:
            return None
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        scale = float(self.max_completion_length) if self.loss_agg == "seq-mean-token-sum-norm" else None
        return LossConfig(algorithm="erpo", alpha=0.0, policy_loss=self.policy_loss, loss_agg=self.loss_agg,
                          eps_low=self.epsilon, eps_high=high, loss_scale_factor=scale,
                          tau_pos=self.sapo_temperature_pos, tau_neg=self.sapo_temperature_neg, dro_beta=self.dro_beta,
                          vespo_k_pos=self.vespo_k_pos, vespo_lambda_pos=self.vespo_lambda_pos,
                          vespo_k_neg=self.vespo_k_neg, vespo_lambda_neg=self.vespo_lambda_neg)


class ERPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with ERPO's objective (docs/method.md sections 1-5):

        loss = TRL's policy loss with advantages A_i * w_B(q_i)  +  alpha * R_query

    Each prompt is scored once per group (its first copy in the generation batch), at
    temperature 1, in the same linear_token_logprobs call as the completions (1 / tau);
    l_theta(q) is a segment_sum over its prompt rows; R_query = weighted_k3(l_theta,
    l_0, w_B). l_0 and the weights' scores come from the reference cache, built from the
    train dataset under the starting model (or loaded from ERPOConfig.ref_cache).
    Sampling, rewards, advantages, loss types, beta, logging and launch are TRL's own.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, ERPOConfig):
            raise ValueError(f"ERPOTrainer needs args=ERPOConfig(...), got {type(self.args).__name__}")
        if self.environment_factories is not None:
            raise ValueError("ERPOTrainer needs its prompts in the train dataset (environment_factory is not supported)")
        if self.train_dataset is None or not hasattr(self.train_dataset, "__len__"):
            raise ValueError("ERPOTrainer needs a map-style train_dataset: the reference cache covers every training prompt")
        if self.args.policy_loss is not None and self.accelerator.num_processes > 1:
            raise ValueError("ERPOConfig.policy_loss runs on one process (its normalisers are a process's generation "
                             "batch, and TRL's groups can span processes): use TRL's loss_type (policy_loss=None)")
        self.erpo_head = use_erpo_kernels(self, backend=self.args.erpo_backend, fused_budget_mb=self.args.fused_budget_mb)
        self.ref_cache = self._reference_cache()
        self.query_weighter = QueryWeighter.from_config(self.args, self.ref_cache.score[self._train_rows])

    # -- reference cache (docs/method.md section 7) ---------------------------------------------

    def _template_text(self) -> str:
        template = getattr(self, "chat_template", None) or getattr(self._tokenizer, "chat_template", None)
        if not template:
            return "trl: plain-text prompts"
        return f"trl: chat template sha256:{hashlib.sha256(str(template).encode()).hexdigest()[:16]}"

    def _tokenized_train_prompts(self) -> Tuple[List[Any], List[List[int]]]:
        prompts = list(self.train_dataset["prompt"])
        ids: List[List[int]] = []
        for start in range(0, len(prompts), 256):
            chunk_ids, _, _ = self._tokenize_prompts(prompts[start:start + 256])
            ids.extend([int(t) for t in p] for p in chunk_ids)
        return prompts, ids

    def _reference_cache(self) -> RefCache:
        prompts, prompt_ids = self._tokenized_train_prompts()
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        name = str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
        expect = {
            "model": name,
            "model_fingerprint": model_fingerprint(model),
            "tokenizer_fingerprint": tokenizer_fingerprint(self._tokenizer),
            "template": self._template_text(),
        }
        path = self.args.ref_cache
        rebuild = f"delete {path} (ERPOTrainer rebuilds a missing cache from the train dataset)" if path else ""
        if path and os.path.isfile(path):
            with fixed_by(rebuild):
                cache = read_ref_cache(path)
                self._train_rows = validate_ref_cache(cache, path, expect=expect, prompt_ids=prompt_ids,
                                                      describe=lambda i: f"({str(prompts[i])[:40]!r})")
            return cache
        was_training = model.training
        model.eval()
        cache = build_ref_cache(
            model, prompt_ids, expect, pad_token_id=int(self._tokenizer.pad_token_id), backend=self.args.erpo_backend,
        )
        model.train(was_training)
        if path and self.accelerator.is_main_process:
            save_ref_cache(cache, path)
        if path:
            self.accelerator.wait_for_everyone()
        self._train_rows = cache.rows([query_id(p) for p in prompt_ids])
        return cache

    # -- per-query weights and the scoring copy, once per generation batch ----------------------

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = out["prompt_ids"], out["prompt_mask"]  # [B, P] left-padded
        dev = prompt_ids.device
        qids = [query_id(row[mask.bool()].tolist()) for row, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        first: Dict[int, int] = {}
        for b, q in enumerate(qids):
            first.setdefault(q, b)
        distinct = list(first)  # m queries, in order of first appearance
        q_index = torch.tensor([distinct.index(q) for q in qids], dtype=torch.long)  # [B]
        scored = torch.zeros(len(qids), dtype=torch.bool)
        scored[list(first.values())] = True  # [B] one copy per query scores its prompt
        missing = self.ref_cache.missing(distinct)
        if missing and mode == "train":
            raise RefCacheError(f"erpo: a training prompt (id {distinct[missing[0]]:016x}) is not in the reference cache; "
                                f"its tokens differ from the train dataset's")
        if missing:  # eval prompts outside the cache: no Query-KL, uniform weights
            w_q = torch.ones(len(distinct), dtype=torch.float32)
            ref_q = torch.zeros(len(distinct), dtype=torch.float32)
            scored[:] = False
        else:
            rows = self.ref_cache.rows(distinct)
            w_q = self.query_weighter.batch_weights(self.ref_cache.score[rows]).float()  # [m] w_B, mean 1
            ref_q = self.ref_cache.ref_query_logp[rows].float()  # [m] l_0(q)
            self._metrics[mode]["weights/ess"].append(effective_sample_size(w_q))
            self._metrics[mode]["weights/min"].append(float(w_q.min()))
            self._metrics[mode]["weights/max"].append(float(w_q.max()))
        out["query_weights"] = w_q[q_index].to(dev)  # [B] w_B of each sequence's query
        out["ref_query_logp"] = ref_q[q_index].to(dev)  # [B]
        out["query_scored"] = scored.to(dev)  # [B]
        out["query_weight_total"] = w_q.sum().to(dev)  # 0-d: sum of w_B over the generation batch (= m)
        out["query_index"] = q_index.to(dev)  # [B] each sequence's query among the generation batch's m
        out["query_count"] = torch.tensor(len(distinct), device=dev)  # 0-d: m
        return out

    # -- the loss: TRL's policy loss with weighted advantages + alpha * R_query -----------------

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        w = inputs["query_weights"]  # [B]
        adv = inputs["advantages"]  # [B] (or [B, T])
        weighted = dict(inputs)
        # Every TRL loss type is positively homogeneous in A for a fixed sign of A, so
        # A * w(q) (w >= 0) multiplies each sequence's policy loss by w(q): L_PG(w_B).
        weighted["advantages"] = adv * (w if adv.dim() == 1 else w[:, None])
        scored = inputs["query_scored"]  # [B]
        plan = _PromptPlan(prompt_len=int(inputs["prompt_ids"].shape[1]), scored=scored)
        self.erpo_head.plan = plan
        self.erpo_head.fused_budget = self.args.fused_budget_mb << 20
        try:
            if self.args.policy_loss is None:
                loss = super()._compute_loss(model, weighted)
            else:
                loss = self._erpo_policy_loss(model, inputs, plan)
        finally:
            self.erpo_head.plan = None
        if plan.loss is not None and plan.loss.result is not None:
            return loss  # the fused path: alpha * R_query is in erpo_loss's loss, its metrics logged
        if plan.log_probs is None:
            raise RuntimeError("erpo: the policy forward did not go through TRL's fused LM head")
        query_kl, share, metrics = self.query_kl_term(plan.log_probs, plan.prompt_len, inputs)
        if query_kl is not None:
            if mode == "train":  # the generation batch is split over steps_per_generation micro-batches
                share = share * self.args.steps_per_generation / self.current_gradient_accumulation_steps
            if self.args.alpha > 0:
                loss = loss + self.args.alpha * query_kl * share
            for key, value in metrics.items():
                self._metrics[mode][key].append(value)
        return loss

    def _erpo_policy_loss(self, model, inputs, plan: _PromptPlan) -> torch.Tensor:
        """The loss of this micro-batch with ERPOConfig.policy_loss, normalised by its
        generation batch (on this process): the micro-batches of one generation batch add up
        to its loss, scaled to the optimizer step.

        The fused head forms L_PG(w_B) + alpha * R_query with erpo_loss in the policy forward
        (3 GEMMs) when its fused path applies; else it returns the log-probs and this is
        L_PG(w_B) by erpo_loss_from_logp, the Query-KL added by _compute_loss (4 GEMMs).
        The metrics logged are the same either way."""
        args = self.args
        request = _FusedLoss(inputs=inputs, group_size=self.num_generations, fused_budget=args.fused_budget_mb << 20,
                             config=replace(args.erpo_loss_config(), alpha=float(args.alpha), kl_guard=args.kl_guard))
        plan.loss = request
        prompt_ids, completion_mask = inputs["prompt_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        logp, _, _ = self._get_per_token_logps_and_entropies(model, input_ids, attention_mask,
                                                             completion_mask.shape[1])  # [B, T]
        self.erpo_head.note_loss_path(request.reason)
        mode = "train" if self.model.training else "eval"
        if request.result is not None:
            loss, metrics = request.result
            for key, value in _trainer_query_kl_metrics(metrics, inputs).items():
                self._metrics[mode][key].append(value)
        else:
            old = inputs.get("old_per_token_logps")
            mask = completion_mask.bool()
            batch, norm = _sequence_batch(inputs, self.num_generations, torch.where(mask, 0, IGNORE_INDEX),
                                          torch.ones_like(logp), logp.detach() if old is None else old, 0)
            loss, metrics = erpo_loss_from_logp(logp.reshape(-1), batch, args.erpo_loss_config(),
                                                normalizers=norm, backend="torch")
        for key in ("pg/loss", "pg/clipfrac", "pg/ratio_mean"):
            self._metrics[mode][key].append(metrics[key])
        if mode == "train":
            loss = loss * args.steps_per_generation / self.current_gradient_accumulation_steps
        return loss

    def query_kl_term(
        self, log_probs: torch.Tensor, prompt_len: int, inputs: Dict[str, Any]
    ) -> Tuple[Optional[torch.Tensor], float, Dict[str, float]]:
        """R_query of the queries scored in this micro-batch, its share of the generation
        batch's weight, and its metrics.

        log_probs [B, L - 1] fp32 from the fused forward (row j scores token j + 1; prompt
        rows [0, P - 1) are nonzero only on the scoring copies). Returns (R, share,
        metrics) with R = weighted_k3(l_theta, l_0, w_B) over the scored queries (None
        when none is) and share = sum of their w_B / sum of w_B over the generation batch:
        sum over micro-batches of R * share is the batch's R_query.
        """
        b, width = log_probs.shape
        rows = inputs["query_scored"].nonzero().squeeze(1)  # [k]
        if rows.numel() == 0:
            return None, 0.0, {}
        dev = log_probs.device
        starts = torch.arange(b, device=dev, dtype=torch.long) * width  # [B]
        cu = torch.stack([starts, starts + (prompt_len - 1)], dim=1).reshape(-1)  # [2B] prompt, completion, ...
        cu = torch.cat([cu, cu.new_tensor([b * width])])  # [2B + 1]
        backend = self.args.erpo_backend
        query_logp = prompt_logp_sums(log_probs.reshape(-1), cu, backend=backend)[rows]  # [k] l_theta(q), scored copies
        ref = inputs["ref_query_logp"][rows].to(query_logp.dtype)  # [k] l_0(q)
        w = inputs["query_weights"][rows].to(query_logp.dtype)  # [k] w_B(q)
        guard = float(self.args.kl_guard)
        r_query = query_kl_value(query_logp, ref, w, w.sum(), guard=guard, backend=backend)  # the objective's term
        share = float(w.sum() / inputs["query_weight_total"].clamp(min=1e-12))
        with torch.no_grad():
            delta = ref - query_logp.detach()
            metrics = {
                "query_kl": float(r_query.detach()),
                "qkl/value": float(weighted_k3(query_logp.detach(), ref, None, guard=guard, backend=self.args.erpo_backend)),
                "qkl/delta_mean": float(delta.mean()),
                "query_logp/mean": float(query_logp.detach().mean()),
            }
        return r_query, share, metrics


def _trainer_query_kl_metrics(metrics: Dict[str, Any], inputs: Dict[str, Any]) -> Dict[str, float]:
    """The Query-KL metrics query_kl_term logs (the values over this
    micro-batch's k scored queries) from erpo_loss's (this micro-batch's share of the
    generation batch's: sums over its scored queries / m, R_query's part / sum_q w(q));
    none when it scores no query, as query_kl_term."""
    scored = inputs["query_scored"]  # [B]
    k = int(scored.sum())
    if k == 0:
        return {}
    m = float(inputs["query_count"])
    w_local = float(inputs["query_weights"][scored].sum())
    w_total = float(inputs["query_weight_total"])
    means = {key: float(metrics[key]) * m / k for key in ("qkl/value", "qkl/delta_mean", "query_logp/mean")}
    return {"query_kl": float(metrics["qkl/loss"]) * w_total / max(w_local, 1e-12), **means}


def _sequence_batch(inputs: Dict[str, Any], group_size: int, targets: torch.Tensor, inv_temperature: torch.Tensor,
                    old_logp: Optional[torch.Tensor], prompt_width: int, kept: Optional[torch.Tensor] = None):
    """(PackedLossBatch, LossNormalizers) of a micro-batch's sequences, for erpo's loss.

    targets, inv_temperature, old_logp (or None: the detached current log-probs) are
    [B, W] grids: column j < prompt_width is a prompt row (the Query-KL's span), the rest
    the completion rows (completion token j - prompt_width). The batch's rows are the
    grid's positions where kept [B, W] bool (None: all), row-major. Queries and their
    weights are the generation batch's (query_index, query_count, query_weights,
    ref_query_logp), normalisers its own (one process: TRL's num_items_in_batch tokens,
    G = num_generations sequences per query, each query's prompt scored by one copy, the
    Query-KL's sum_q w(q) = query_weight_total)."""
    mask = inputs["completion_mask"].bool()  # [B, C]
    b = mask.shape[0]
    dev = mask.device
    grid = torch.ones_like(targets, dtype=torch.bool) if kept is None else kept  # [B, W]
    counts = torch.stack([grid[:, :prompt_width].sum(1), grid[:, prompt_width:].sum(1)], dim=1).reshape(-1)  # [2B]
    spans = torch.cat([counts.new_zeros(1), counts.cumsum(0)])  # [2B + 1] prompt_0, completion_0, ...

    def rows(values: torch.Tensor) -> torch.Tensor:  # [B, W] -> [N]
        return values.reshape(-1) if kept is None else values[kept]

    q_index = inputs["query_index"].long()  # [B]
    m = int(inputs["query_count"])
    w = torch.zeros(m, dtype=torch.float32, device=dev).index_put((q_index,), inputs["query_weights"].float())
    ref = torch.zeros(m, dtype=torch.float32, device=dev).index_put((q_index,), inputs["ref_query_logp"].float())
    adv = inputs["advantages"]
    batch = PackedLossBatch(
        targets=rows(targets), inv_temperature=rows(inv_temperature).float(), span_cu_seqlens=spans,
        group_index=q_index, advantages=adv if adv.dim() == 1 else adv[:, 0], ref_query_logp=ref, query_weights=w,
        old_logp=None if old_logp is None else rows(old_logp),
    )
    tokens = inputs["num_items_in_batch"] if "num_items_in_batch" in inputs else mask.sum()
    norm = LossNormalizers(
        n_tokens=torch.as_tensor(tokens, device=dev).reshape(()), n_sequences=torch.tensor(m * group_size, device=dev),
        n_queries=torch.tensor(m, device=dev), group_sizes=torch.full((m,), group_size, device=dev),
        prompt_copies=torch.ones(m, dtype=torch.long, device=dev),
        weight_mass=torch.as_tensor(inputs["query_weight_total"], device=dev).double().reshape(()).clamp(min=1e-12),
        weight_sq_mass=(w.double() ** 2).sum(),  # this micro-batch's queries' (the weights/ess metric, not logged)
    )
    return batch, norm
