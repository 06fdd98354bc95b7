"""erpo inside verl (tested with verl==0.9.1, installed in a venv of its own: docs/verl.md).

verl imports every package of the `verl.plugins` entry-point group inside `import verl`
(in the driver and in every Ray worker); erpo's entry point is this module, and
importing it calls `install()`. Nothing changes until a run asks for it:

    actor_rollout_ref.model.use_fused_kernels=True
    actor_rollout_ref.model.fused_kernel_options.impl_backend=erpo       # our kernel
    actor_rollout_ref.actor.policy_loss._target_=erpo.integrations.verl.ERPOPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=erpo                     # ERPO's objective
    +actor_rollout_ref.actor.policy_loss.alpha=0.01
    +actor_rollout_ref.actor.policy_loss.ref_cache=/path/ref_cache.safetensors

and, once before training, with the same overrides (erpo.integrations.verl.cache_command):

    python -m erpo.integrations.verl ref-cache <the overrides you train with>

What install() changes, and why it has to be a wrap (verl has no extension point here):

- impl_backend=erpo. verl's `apply_monkey_patch` calls
  `monkey_patch.patch_forward_with_backends` (a module global, resolved at call time),
  which accepts torch, triton and liger. The wrapper installs `forward_with_erpo_backend`
  for "erpo" and hands every other backend to verl's function. Our forward runs the base
  model and `erpo_kernels.linear_token_logprobs` on (hidden, lm_head weight), tied or not,
  padded or packed (remove-padding), never forming [N, V] logits (a training forward on
  the Triton backend whose micro-batch's kept logits (2 bytes each in bf16 / fp16, 4 in
  fp32) fit fused_kernel_options.fused_budget_mb
  keeps them for its backward instead: 3 GEMMs, not 4; erpo_kernels.kept_logits); an FSDP2 DTensor
  lm_head weight is gathered with `erpo.distributed.gather_for_call` (its gradient is
  reduce-scattered into the shard). Prompt rows are scored at temperature 1, response
  rows at 1 / T: `FSDPEngineWithLMHead.prepare_model_inputs` is wrapped to pass the
  prompt rows of each micro-batch (a bool mask, `erpo_prompt_rows`) and the kernel backend
  (fused_kernel_options.kernel_backend, `erpo_kernel_backend`) to the forward.
- loss_mode=erpo. verl's registered policy losses see only the padded response tensors,
  so the Query-KL (which needs the prompt rows of the same forward) lives in the actor's
  loss function: `verl.workers.utils.losses.ppo_loss` (and the name bound in
  `verl.workers.engine_workers`) becomes `erpo_ppo_loss`, which is verl's own ppo_loss
  for every other loss_mode. For loss_mode=erpo it runs verl's ppo_loss with the
  registered "erpo" policy loss (verl's vanilla clipped loss on advantages times the
  per-query weights) and adds alpha * R_query from the prompt rows of the forward and
  the reference cache l_0(q).

Normalisation (docs/method.md section 2): every copy of a query scores its prompt (verl's
forward scores every row anyway); sequence b of query q carries the coefficient
c_b = w_B(q) / (copies of q in the mini-batch * its distinct queries m), and a micro-batch
adds dp_size * sum_b c_b k3(l_0(q) - l_theta(q)) (verl averages gradients over ranks), so
the mini-batch's loss holds sum_q w_B(q) k3_q / m = R_query (w_B has mean 1), however
verl splits it over ranks and micro-batches.

Per-query weights need the whole mini-batch's prompts (w_B is normalised over its
queries, as erpo's trainer does), which a micro-batch does not have: `BaseEngine.train_batch`
(one optimizer step on one rank's share of a mini-batch) is wrapped, once an
ERPOPolicyLossConfig with loss_mode=erpo exists in the process, to add each sequence's
w_B(q), l_0(q) and R_query coefficient (`add_mini_batch_fields`, query ids all-gathered
over the data-parallel ranks) before verl splits it into micro-batches.
"""
from __future__ import annotations

import contextvars
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

try:
    import verl
    from verl.models.transformers import monkey_patch as _monkey_patch
    from verl.trainer.ppo import core_algos as _core_algos
    from verl.workers.config import PolicyLossConfig
    from verl.workers.utils import losses as _verl_losses
except ImportError as _missing:
    if sys.argv[:1] == ["-m"]:  # `python -m erpo.integrations.verl ...` (runpy imports this first): one line
        from ._command import without_verl

        raise SystemExit(without_verl(sys.argv[1:], "" if _missing.name == "verl" else str(_missing)))
    raise ImportError("erpo.integrations.verl needs verl 0.9.1 (docs/verl.md says how to install it beside erpo)") from None

import torch

from erpo_kernels import check_backend, prompt_logp_sums, query_kl_value

from ...distributed import gather_for_call
from erpo_kernels.kept_logits import kept_linear_token_logprobs
from ...erpo_settings import ERPOSettings
from ...packing import lm_head_options
from ...query_weights import QueryWeighter
from ...ref_cache import RefCache, RefCacheError, fixed_by, query_id, read_ref_cache

__all__ = [
    "BACKEND",
    "ERPOPolicyLossConfig",
    "add_mini_batch_fields",
    "compute_policy_loss_erpo",
    "erpo_ppo_loss",
    "forward_kernel_backend",
    "verl_policy_loss",
    "forward_with_erpo_backend",
    "install",
    "query_fields",
]

TESTED_VERL = "0.9.1"
BACKEND = "erpo"  # fused_kernel_options.impl_backend
LOSS_MODE = "erpo"  # policy_loss.loss_mode
IGNORE_INDEX = -100
PROMPT_ROWS = "erpo_prompt_rows"  # model keyword: [B, L] / [1, nnz] bool, rows that score a prompt token
KERNEL_BACKEND = "erpo_kernel_backend"  # model keyword: fused_kernel_options.kernel_backend
FUSED_BUDGET = "erpo_fused_budget"  # model keyword: fused_kernel_options.fused_budget_mb, in bytes
DEFAULT_FUSED_BUDGET_MB = 1024
# builds the reference cache from a run's own overrides (erpo.integrations.verl.cache_command)
from ._command import REF_CACHE_COMMAND  # noqa: E402  (one home: the command without verl says it too)
# ERPO's per-sequence fields of a mini-batch (add_mini_batch_fields)
WEIGHTS_KEY = "erpo_query_weights"  # [B] w_B(q) of each sequence's query
REF_KEY = "erpo_ref_query_logp"  # [B] l_0(q)
COEF_KEY = "erpo_qkl_coef"  # [B] the sequence's coefficient in R_query
PROMPTS_AT_T1 = "erpo_prompt_rows_at_t1"  # micro-batch flag set by the engine wrap
# Model types with their own fused forward in verl (vision-language): not served by ours.
_VL_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "qwen3_5", "qwen3_5_moe")


# ----------------------------------------------------------------------------- config


@dataclass
class ERPOPolicyLossConfig(PolicyLossConfig):
    """verl's PolicyLossConfig plus ERPO's keys (docs/method.md sections 2, 3, 7); select it with
    policy_loss._target_=erpo.integrations.verl.ERPOPolicyLossConfig and set the keys with
    +actor_rollout_ref.actor.policy_loss.KEY=VALUE.

    alpha: Query-KL coefficient (0: the weights-only ablation, GRPO's numbers with
        query_weighting=none). ref_cache: the reference-cache file (l_0(q) of every training
        prompt under the starting model, written by `python -m erpo.integrations.verl ref-cache`).
        query_weighting:
        prevalence, softmax or none; bins, gamma, weight_temperature, w_min, w_max: the
        weights' keys (erpo.query_weights.QueryWeighter).
        kl_guard: c of the K3 guard. kernel_backend: auto (Triton on CUDA), triton or torch.
        inner_loss_mode: the policy loss ERPO weights and adds its Query-KL to: any name of
        verl's registry but erpo (vanilla, dppo_tv, dppo_kl, gspo, sapo, gpg, clip_cov, kl_cov,
        geo_mean, dro, cispo, bypass_mode; and TRL's luspo, vespo, which install() registers
        there: verl_policy_loss), with its own keys of this config and the actor's (clip
        ratios, tau_pos, dro_beta, rollout_correction, ...). vespo_k_pos, vespo_lambda_pos,
        vespo_k_neg, vespo_lambda_neg: vespo's constants (TRL's names and defaults).
    """

    loss_mode: str = LOSS_MODE
    alpha: float = 0.01
    ref_cache: Optional[str] = None
    query_weighting: str = "prevalence"
    bins: int = 20
    gamma: float = 1.0
    weight_temperature: float = 1.0
    w_min: float = 0.1
    w_max: float = 10.0
    kl_guard: float = 10.0
    kernel_backend: str = "auto"
    inner_loss_mode: str = "vanilla"
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        try:  # ERPO's keys checked in one place (as ERPOConfig and TrainConfig do)
            ERPOSettings.of(self).validate()
            check_backend(self.kernel_backend, "kernel_backend")
            from erpo_kernels import LossConfig

            LossConfig(vespo_k_pos=self.vespo_k_pos, vespo_lambda_pos=self.vespo_lambda_pos,
                       vespo_k_neg=self.vespo_k_neg, vespo_lambda_neg=self.vespo_lambda_neg)  # their checks
        except ValueError as exc:
            raise ValueError(f"policy_loss.{exc}") from None
        names = [n for n in _core_algos.POLICY_LOSS_REGISTRY if n != LOSS_MODE]
        if self.inner_loss_mode not in names:
            raise ValueError(f"policy_loss.inner_loss_mode must be one of verl's policy losses {names}, "
                             f"got {self.inner_loss_mode!r}")
        if self.loss_mode == LOSS_MODE and float(self.alpha) > 0 and not self.ref_cache:
            raise ValueError("policy_loss.alpha > 0 needs the reference cache: set "
                             "+actor_rollout_ref.actor.policy_loss.ref_cache=PATH (or alpha=0) and build it with "
                             f"{REF_CACHE_COMMAND} <the overrides you train with>")
        if self.ref_cache and os.path.isdir(os.path.expanduser(self.ref_cache)):
            raise ValueError(f"policy_loss.ref_cache={self.ref_cache} is a directory; give the cache file's path")
        if self.loss_mode == LOSS_MODE:
            # the engine module is imported here, not at `import verl`: importing it detects the platform
            _install_train_batch_wrap()

    def weighter(self, cache: RefCache) -> QueryWeighter:
        """The query weighter over the cache's scores (every training query)."""
        return QueryWeighter(cache.score.double(), scheme=self.query_weighting, bins=self.bins, gamma=self.gamma,
                             temperature=self.weight_temperature, w_min=self.w_min, w_max=self.w_max)


def _erpo_settings(policy_loss: Any) -> ERPOPolicyLossConfig:
    if isinstance(policy_loss, ERPOPolicyLossConfig):
        return policy_loss
    raise ValueError("erpo: loss_mode=erpo needs ERPO's config class: set actor_rollout_ref.actor.policy_loss._target_="
                     "erpo.integrations.verl.ERPOPolicyLossConfig")


# ----------------------------------------------------------------------------- the fused forward


def forward_kernel_backend(fused_kernel_options: Any) -> str:
    """The kernel backend of impl_backend=erpo's forward: fused_kernel_options.kernel_backend
    (actor_rollout_ref.model.fused_kernel_options; auto when unset), checked."""
    backend = (fused_kernel_options or {}).get("kernel_backend", "auto")
    check_backend(backend, "actor_rollout_ref.model.fused_kernel_options.kernel_backend")
    return backend


def forward_fused_budget(fused_kernel_options: Any) -> int:
    """The bytes of logits impl_backend=erpo's forward may keep for its backward:
    fused_kernel_options.fused_budget_mb (default 1024; 0: never), checked."""
    mb = (fused_kernel_options or {}).get("fused_budget_mb", DEFAULT_FUSED_BUDGET_MB)
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 0:
        raise ValueError(f"actor_rollout_ref.model.fused_kernel_options.fused_budget_mb must be an int >= 0 (MiB; "
                         f"0 = recompute the logits in the backward), got {mb!r}")
    return mb << 20


def forward_with_erpo_backend(
    self: Any,
    input_ids: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    past_key_values: Any = None,
    inputs_embeds: Optional[torch.Tensor] = None,
    labels: Optional[torch.Tensor] = None,
    use_cache: Optional[bool] = None,
    output_attentions: Optional[bool] = None,
    output_hidden_states: Optional[bool] = None,
    return_dict: Optional[bool] = None,
    cache_position: Optional[torch.Tensor] = None,
    logits_to_keep: Any = 0,
    temperature: float = 1.0,
    shift_labels: Optional[torch.Tensor] = None,
    erpo_prompt_rows: Optional[torch.Tensor] = None,
    erpo_kernel_backend: str = "auto",
    erpo_fused_budget: int = DEFAULT_FUSED_BUDGET_MB << 20,
    **unused: Any,
):
    """verl's fused forward contract (dense_common.forward_with_torch_backend) with our kernel.

    input_ids [B, L] (padded, with attention_mask) or [1, nnz] (remove-padding, with
    shift_labels); row t scores token t + 1 (verl's rolled labels). erpo_prompt_rows: bool
    like input_ids, rows scored at temperature 1 (the others at 1 / temperature).
    erpo_kernel_backend: auto, triton or torch (the engine wrap passes the config's).
    erpo_fused_budget: bytes of logits the forward may keep for its backward (the engine
    wrap passes fused_kernel_options.fused_budget_mb): with a gradient wanted on the
    Triton backend and the micro-batch's N x V kept logits within it, the backward reuses
    them (3 GEMMs, erpo_kernels.kept_logits), else it recomputes them (4 GEMMs);
    `model._erpo_training_path` says which the last training forward ran (printed when
    it changes).
    Returns verl's CausalLMOutputForPPO with log_probs and entropy [B, L] fp32 (0 on
    padding rows).
    """
    from verl.models.transformers.dense_common import CausalLMOutputForPPO, forward_base_model

    outputs = forward_base_model(
        self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
        output_attentions=output_attentions, output_hidden_states=output_hidden_states,
        return_dict=True, cache_position=cache_position,
    )
    hidden = outputs[0]  # [B, L, D]
    targets = _row_targets(input_ids, labels, shift_labels, attention_mask)  # [B L]
    inv_t = _row_inv_temperature(temperature, erpo_prompt_rows, targets.numel(), hidden.device)
    head = self.get_output_embeddings()
    weight = gather_for_call(head.weight)
    bias = getattr(head, "bias", None)
    bias = None if bias is None else gather_for_call(bias)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if not torch.is_autocast_enabled(flat.device.type) and flat.dtype != weight.dtype:
        flat = flat.to(weight.dtype)
    log_probs, entropy, path = kept_linear_token_logprobs(
        flat, weight, targets, bias=bias, inv_temperature=inv_t, ignore_index=IGNORE_INDEX,
        backend=erpo_kernel_backend, fused_budget=erpo_fused_budget, **lm_head_options(self),
    )
    if torch.is_grad_enabled():  # a training forward (verl's log-prob passes run without a gradient)
        if getattr(self, "_erpo_training_path", None) != path:
            print(f"erpo: {type(self).__name__}'s training forward runs {path}", file=sys.stderr)
        self._erpo_training_path = path
    rows = hidden.shape[:-1]  # (B, L)
    return CausalLMOutputForPPO(
        log_probs=log_probs.reshape(rows), entropy=entropy.reshape(rows),
        past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
    )


def _row_targets(input_ids, labels, shift_labels, attention_mask) -> torch.Tensor:
    """[B L] the token each row scores, as verl's fused forwards roll them; ignore_index on
    padding rows (they cost nothing)."""
    if shift_labels is not None:
        targets = shift_labels
    elif labels is not None:
        targets = torch.roll(labels, shifts=-1, dims=-1)
    elif input_ids is not None:
        targets = torch.roll(input_ids, shifts=-1, dims=-1)
    else:
        raise ValueError("erpo: impl_backend=erpo scores input_ids (or labels / shift_labels); none was given")
    targets = targets.reshape(-1)
    if attention_mask is not None:
        targets = torch.where(attention_mask.reshape(-1).bool(), targets, torch.full_like(targets, IGNORE_INDEX))
    return targets


def _row_inv_temperature(temperature: float, prompt_rows: Optional[torch.Tensor], n_rows: int, device) -> Any:
    """1 / temperature, or [n] fp32: 1 on the prompt rows, 1 / temperature elsewhere."""
    inv_tau = 1.0 / float(temperature)
    if prompt_rows is None or inv_tau == 1.0:
        return inv_tau
    if prompt_rows.numel() != n_rows:
        raise ValueError(f"erpo: erpo_prompt_rows has {prompt_rows.numel()} rows, the forward {n_rows}")
    return torch.where(prompt_rows.reshape(-1).to(device), 1.0, inv_tau).to(torch.float32)


def _unwrapped(module: Any) -> Any:
    """The Hugging Face model inside an FSDP1 wrapper (FSDP2 keeps the model itself)."""
    while hasattr(module, "_fsdp_wrapped_module"):
        module = module._fsdp_wrapped_module
    return module


def prompt_lengths(data: Any) -> Optional[torch.Tensor]:
    """[B] real prompt tokens of each sequence of a verl micro-batch (None without "prompts"),
    read as verl's no_padding_2_padding reads them."""
    if "prompts" not in data.keys():
        return None
    prompts = data["prompts"]
    if prompts.is_nested:
        return prompts.offsets().diff()
    return data["attention_mask"][:, : prompts.shape[1]].sum(dim=1)


def _prompt_rows(engine: Any, micro_batch: Any, model_inputs: Dict[str, Any]) -> Optional[torch.Tensor]:
    """The bool rows of model_inputs["input_ids"] whose target is a prompt token."""
    plen = prompt_lengths(micro_batch)
    if plen is None:
        return None
    if getattr(engine, "use_ulysses_sp", False):
        raise ValueError("erpo: impl_backend=erpo does not support ulysses_sequence_parallel_size > 1 yet")
    input_ids = micro_batch["input_ids"]  # nested [B, j]
    offsets = input_ids.offsets().to(plen.device)
    lengths = offsets.diff()
    model_ids = model_inputs["input_ids"]
    if model_ids.shape[0] == 1 and model_inputs.get("attention_mask") is None:  # packed [1, nnz (+ pad)]
        nnz = int(offsets[-1])
        starts = torch.repeat_interleave(offsets[:-1], lengths, output_size=nnz)
        pos = torch.arange(nnz, device=plen.device) - starts  # position within its sequence
        rows = pos < torch.repeat_interleave(plen - 1, lengths, output_size=nnz)
        rows = torch.cat([rows, rows.new_zeros(model_ids.shape[-1] - nnz)])
        return rows[None].to(model_ids.device)
    width = model_ids.shape[-1]  # padded [B, L]
    return (torch.arange(width, device=plen.device)[None] < (plen - 1)[:, None]).to(model_ids.device)


# ----------------------------------------------------------------------------- the loss


@dataclass
class _LossScope:
    query_weights: Optional[torch.Tensor]  # [B] w_B(q) of the micro-batch's sequences, or None (ones)
    inner_loss_mode: str = "vanilla"  # the verl policy loss they weight


_SCOPE: contextvars.ContextVar[Optional[_LossScope]] = contextvars.ContextVar("erpo_verl_loss", default=None)


def compute_policy_loss_erpo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """verl's policy loss "erpo": L_PG(w_B), verl's policy loss policy_loss.inner_loss_mode
    (vanilla by default) with each token's loss times its query's weight w_B(q_i), passed
    as a factor of verl's rollout_is_weights (every registered loss multiplies its
    per-token losses by them before aggregating; geo_mean takes their geometric mean per
    sequence, w_B(q_i) again). [B, R] tensors as verl passes them; the weights come from
    erpo_ppo_loss (this loss runs only inside it).
    """
    scope = _SCOPE.get()
    if scope is None:
        raise RuntimeError("erpo: loss_mode=erpo runs inside erpo's actor loss (erpo.integrations.verl.erpo_ppo_loss, "
                           "installed by the verl.plugins entry point); this worker called verl's own ppo_loss: check "
                           "that erpo is installed where the workers run and VERL_USE_EXTERNAL_PLUGINS is not 'none'")
    if scope.query_weights is not None:
        w = scope.query_weights.to(device=log_prob.device, dtype=log_prob.dtype)[:, None].expand_as(log_prob)  # [B, R]
        if scope.inner_loss_mode == "bypass_mode":
            # verl's bypass_mode drops rollout_is_weights (it computes its own); its losses (PPO-clip with
            # dual clip, REINFORCE) are positively homogeneous in A, so w_B >= 0 scales the advantages
            advantages = advantages * w
        else:
            rollout_is_weights = w if rollout_is_weights is None else rollout_is_weights * w
    inner = _core_algos.get_policy_loss_fn(scope.inner_loss_mode)
    return inner(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
        loss_agg_mode=loss_agg_mode, config=config, rollout_is_weights=rollout_is_weights,
    )


# erpo_kernels' policy losses that verl 0.9.1 lacks (TRL's), registered under their names in
# verl's registry: usable as loss_mode=NAME and inner_loss_mode=NAME
ERPO_ONLY_LOSSES = ("luspo", "vespo")


def verl_policy_loss(name: str) -> Any:
    """verl's policy-loss function over erpo_kernels.POLICY_LOSSES[name]: verl's [B, R] tensors
    (one sequence per row, its response tokens where response_mask is set) as a packed batch
    of empty prompts, our per-token losses times rollout_is_weights, aggregated by verl's
    agg_loss at loss_agg_mode with config.global_batch_info (as verl's own losses are). The
    clip range is the actor's clip_ratio_low / _high (clip_ratio_c: dual_clip); vespo's
    constants are policy_loss.vespo_* when set (TRL's defaults else)."""
    from erpo_kernels import POLICY_LOSSES, LossConfig, LossNormalizers, PackedLossBatch
    from erpo_kernels.objective.rows import LossRows

    def loss_fn(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                rollout_is_weights: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Dict[str, Any]]:
        b, r = log_prob.shape
        mask = response_mask.bool()
        dev = log_prob.device
        ends = torch.arange(b + 1, device=dev) * r
        spans = torch.cat([ends[:1], torch.stack([ends[:-1], ends[1:]], dim=1).reshape(-1)])  # [2B + 1]: empty prompts
        batch = PackedLossBatch(
            targets=torch.where(mask, 0, -100).reshape(-1), inv_temperature=torch.ones(b * r, device=dev),
            span_cu_seqlens=spans, group_index=torch.zeros(b, dtype=torch.long, device=dev),
            advantages=advantages.detach()[:, 0].to(torch.float32), ref_query_logp=torch.zeros(1, device=dev),
            query_weights=torch.ones(1, device=dev))
        rows = LossRows.build(log_prob.reshape(-1), batch, LossNormalizers.of(batch), query_weighted=False)
        low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
        high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
        policy = config.policy_loss
        vespo = {k: float(policy.get(k, getattr(LossConfig, k))) for k in
                 ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")}
        cfg = LossConfig(policy_loss=name, eps_low=float(low), eps_high=float(high),
                         dual_clip=float(config.get("clip_ratio_c", 3.0)), **vespo)
        old = torch.where(rows.response, old_log_prob.detach().reshape(-1).to(rows.dtype), rows.logp.detach())
        token = POLICY_LOSSES[name](rows, old, advantages.detach().reshape(-1).to(rows.dtype), cfg)
        pg_losses = token.loss.reshape(b, r).to(log_prob.dtype)
        if rollout_is_weights is not None:
            pg_losses = pg_losses * rollout_is_weights
        pg_loss = _core_algos.agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                                       **config.global_batch_info)
        with torch.no_grad():
            n = response_mask.sum().clamp(min=1)
            metrics = {"actor/pg_clipfrac": float((token.clipped.reshape(b, r) & mask).sum() / n),
                       "actor/ppo_kl": float(((old_log_prob - log_prob) * response_mask).sum() / n)}
        return pg_loss, metrics

    loss_fn.__name__ = f"compute_policy_loss_{name}"
    return loss_fn


def prompt_token_lists(data: Any) -> List[List[int]]:
    """The real prompt token ids of each sequence of a verl batch (nested or left-padded "prompts")."""
    prompts = data["prompts"]
    if prompts.is_nested:
        return [row.tolist() for row in prompts.unbind()]
    width = prompts.shape[1]
    return [row[width - int(n):].tolist() for row, n in zip(prompts.cpu(), prompt_lengths(data).cpu())]


_CACHES: Dict[Tuple[str, int, int], RefCache] = {}  # (path, mtime_ns, size) -> the cache read from it
_BUILD = f"{REF_CACHE_COMMAND} <the overrides you train with> (docs/verl.md)"


def _cache(settings: ERPOPolicyLossConfig) -> RefCache:
    """The cache file of settings.ref_cache, read once per version of the file."""
    if not settings.ref_cache:
        raise ValueError("erpo: query weights and the Query-KL need the reference cache: set "
                         "+actor_rollout_ref.actor.policy_loss.ref_cache=PATH")
    path = os.path.expanduser(settings.ref_cache)
    with fixed_by(_BUILD):
        if not os.path.isfile(path):
            return read_ref_cache(path)  # the error naming the command
        state = os.stat(path)
        key = (path, state.st_mtime_ns, state.st_size)
        if key not in _CACHES:
            _CACHES.clear()
            _CACHES[key] = read_ref_cache(path)
    return _CACHES[key]


def missing_prompt_error(qid: int, n_tokens: Optional[int], cache: RefCache, settings: ERPOPolicyLossConfig) -> str:
    """The error of a training prompt the cache lacks, naming the command that rebuilds it."""
    built = cache.meta.get("verl_command")
    size = f", {n_tokens} tokens" if n_tokens is not None else ""
    return (f"erpo: a training prompt (id {qid:016x}{size}) is not in the reference cache {settings.ref_cache}"
            f"{f' (built by: {built})' if built else ''}: this run's rollout prompts are not the ones it was built "
            f"from (another data file, chat template, prompt length or tokenizer?); rebuild it with the overrides this "
            f"run trains with: {REF_CACHE_COMMAND} <the overrides> --overwrite")


def query_fields(qids: Sequence[int], cache: RefCache, settings: ERPOPolicyLossConfig,
                 lengths: Optional[Sequence[int]] = None) -> Dict[str, torch.Tensor]:
    """ERPO's per-sequence fields of a mini-batch from its sequences' query ids (all ranks';
    lengths: their prompts' token counts, quoted when one is missing).

    Returns [B] float64 tensors: WEIGHTS_KEY w_B(q) (mean 1 over the mini-batch's distinct
    queries, clipped; ones with query_weighting=none), REF_KEY l_0(q), and COEF_KEY
    w_B(q) / (copies of q in the mini-batch * distinct queries), so that summing
    coef * k3 over the sequences gives sum_q w_B(q) k3_q / m: R_query (docs/method.md section 2).
    """
    distinct = list(dict.fromkeys(qids))
    missing = cache.missing(distinct)
    if missing:
        qid = distinct[missing[0]]
        n_tokens = lengths[list(qids).index(qid)] if lengths is not None else None
        raise RefCacheError(missing_prompt_error(qid, n_tokens, cache, settings))
    rows = cache.rows(distinct)
    w_q = settings.weighter(cache).batch_weights(cache.score[rows].double())  # [m] float64
    where = {q: i for i, q in enumerate(distinct)}
    index = torch.tensor([where[q] for q in qids], dtype=torch.long)  # [B] query of each sequence
    copies = torch.bincount(index, minlength=len(distinct)).double()  # [m]
    return {
        WEIGHTS_KEY: w_q[index],
        REF_KEY: cache.ref_query_logp[rows].double()[index],
        COEF_KEY: (w_q / (copies * len(distinct)))[index],
    }


def add_mini_batch_fields(data: Any, settings: ERPOPolicyLossConfig, group: Any = None,
                          model_path: Optional[str] = None) -> None:
    """Put ERPO's per-sequence fields (query_fields) into a verl mini-batch (one optimizer
    step's data on this rank) in place; the mini-batch is the union of every rank's in the
    data-parallel `group` (its query ids are all-gathered, so every rank computes the same
    weights). model_path: the actor's actor_rollout_ref.model.path, checked against the
    model a `ref-cache` cache was built for."""
    import torch.distributed as dist

    cache = _cache(settings)
    built_for = cache.meta.get("model") if cache.meta.get("verl_command") else None
    if model_path is not None and built_for is not None and str(model_path) != built_for:
        raise RefCacheError(f"erpo: the reference cache {settings.ref_cache} was built for the model {built_for}, this "
                            f"actor starts from {model_path}; rebuild it with the overrides this run trains with: "
                            f"{REF_CACHE_COMMAND} <the overrides> --overwrite")
    prompts = prompt_token_lists(data)
    qids = [(query_id(p), len(p)) for p in prompts]
    parts = [qids]
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, qids, group=group)
    everyone = [q for part in parts for q in part]
    fields = query_fields([q for q, _ in everyone], cache, settings, [n for _, n in everyone])
    rank = dist.get_rank(group) if len(parts) > 1 else 0
    start = sum(len(part) for part in parts[:rank])
    for key, value in fields.items():
        data[key] = value[start:start + len(qids)].to(data["prompts"].device)


def _require(data: Any, key: str) -> torch.Tensor:
    if key not in data.keys():
        raise ValueError(f"erpo: loss_mode=erpo needs {key} in the batch, which erpo's plugin adds in the engine's "
                         f"train_batch from the whole mini-batch; when calling the loss yourself, call "
                         f"erpo.integrations.verl.add_mini_batch_fields(data, config.policy_loss) first")
    return data[key]


def query_kl_term(
    log_probs: torch.Tensor, data: Any, settings: ERPOPolicyLossConfig, dp_size: int
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """This micro-batch's part of R_query, and its metrics.

    log_probs: verl's nested [B, j] per-row log-probs of whole sequences (prompt rows at
    temperature 1). l_theta(q_b) = sum of sequence b's prompt rows (prompt_logp_sums); the part
    is dp_size * sum_b coef_b k3(l_0(q_b) - l_theta(q_b)) (verl averages gradients over
    the data-parallel ranks).
    """
    values, offsets = log_probs.values(), log_probs.offsets().to(log_probs.values().device)
    plen = prompt_lengths(data).to(offsets.device)
    cu = torch.stack([offsets[:-1], offsets[:-1] + (plen - 1).clamp(min=0)], dim=1).reshape(-1)  # prompt, rest, ...
    cu = torch.cat([cu, offsets[-1:]])  # [2B + 1]
    backend = settings.kernel_backend
    query_logp = prompt_logp_sums(values, cu, backend=backend)  # [B] l_theta(q_b)
    ref = _require(data, REF_KEY).to(device=values.device, dtype=values.dtype)  # [B] l_0(q_b)
    coef = _require(data, COEF_KEY).to(device=values.device, dtype=values.dtype)  # [B]
    guard = float(settings.kl_guard)
    # dp_size * sum_b coef_b k3: the objective's term with weight mass 1 / dp_size
    part = query_kl_value(query_logp, ref, coef, 1.0 / float(dp_size), guard=guard, backend=backend)
    from verl.utils.metric import AggregationType, Metric

    with torch.no_grad():
        metrics = {  # summed over micro-batches like verl's actor/pg_loss: the mini-batch's R_query
            "actor/erpo_query_kl": Metric(value=float(part.detach()), aggregation=AggregationType.SUM),
            "actor/erpo_qkl_delta_mean": float((ref - query_logp.detach()).float().mean()),
            "actor/erpo_query_logp_mean": float(query_logp.detach().float().mean()),
        }
    return part, metrics


def erpo_ppo_loss(config: Any, model_output: Dict[str, Any], data: Any, dp_group: Any = None):
    """The actor's loss: verl's ppo_loss, and for loss_mode=erpo ERPO's objective
    L_PG(w_B) + alpha * R_query on the micro-batch (module docstring)."""
    policy_loss = config.policy_loss
    if policy_loss.get("loss_mode", "vanilla") != LOSS_MODE:
        return _VERL_PPO_LOSS(config, model_output, data, dp_group)
    settings = _erpo_settings(policy_loss)
    weights = _require(data, WEIGHTS_KEY) if settings.query_weighting != "none" else None
    token = _SCOPE.set(_LossScope(query_weights=weights, inner_loss_mode=settings.inner_loss_mode))
    try:
        loss, metrics = _VERL_PPO_LOSS(config, model_output, data, dp_group)
    finally:
        _SCOPE.reset(token)
    if float(settings.alpha) == 0.0:
        return loss, metrics
    temperature = _non_tensor(data.get("temperature", 1.0))
    if float(temperature) != 1.0 and not _non_tensor(data.get(PROMPTS_AT_T1, False)):
        raise ValueError("erpo: the Query-KL needs the prompt rows at temperature 1, but this forward scored them at "
                         f"the rollout temperature {temperature}: set actor_rollout_ref.model.use_fused_kernels=True and "
                         "actor_rollout_ref.model.fused_kernel_options.impl_backend=erpo")
    part, qkl_metrics = query_kl_term(model_output["log_probs"], data, settings, config.global_batch_info["dp_size"])
    metrics.update(qkl_metrics)
    return loss + float(settings.alpha) * part, metrics


def _non_tensor(value: Any) -> Any:
    """A verl NonTensorData's value (the value itself otherwise)."""
    return getattr(value, "data", value)


def _settings_of(loss_function: Any) -> Optional[ERPOPolicyLossConfig]:
    """The ERPO settings of an actor loss bound as verl binds it (partial(ppo_loss, config=...)), else None."""
    config = getattr(loss_function, "keywords", {}).get("config")
    policy_loss = getattr(config, "policy_loss", None)
    if isinstance(policy_loss, ERPOPolicyLossConfig) and policy_loss.loss_mode == LOSS_MODE:
        return policy_loss
    return None


# ----------------------------------------------------------------------------- install


_VERL_PATCH_FORWARD = None
_VERL_PPO_LOSS = _verl_losses.ppo_loss if not getattr(_verl_losses.ppo_loss, "_erpo", False) else None


def _patch_forward_with_backends(model: Any, use_fused_kernels: bool = False, fused_kernels_backend: str = None):
    """verl's patch_forward_with_backends, plus impl_backend=erpo."""
    if not (use_fused_kernels and fused_kernels_backend == BACKEND):
        return _VERL_PATCH_FORWARD(model, use_fused_kernels=use_fused_kernels, fused_kernels_backend=fused_kernels_backend)
    if model.config.model_type in _VL_MODEL_TYPES:
        raise ValueError(f"erpo: impl_backend=erpo serves text-only causal LMs; {model.config.model_type} has its own "
                         f"fused forward in verl (use impl_backend=torch or triton)")
    _install_engine_wrap()
    model._verl_fused_kernels_backend = BACKEND
    model.__class__.forward = forward_with_erpo_backend
    print(f"erpo: {model.__class__.__name__}'s fused log-probs run erpo_kernels.linear_token_logprobs", file=sys.stderr)


def _wrap_once(owner: Any, name: str, make: Any) -> None:
    """owner.name = make(verl's original), once (the wrapper is marked `_erpo`)."""
    original = getattr(owner, name)
    if getattr(original, "_erpo", False):
        return
    wrapper = make(original)
    wrapper._erpo = True
    setattr(owner, name, wrapper)


def _install_engine_wrap() -> None:
    """Wrap FSDPEngineWithLMHead.prepare_model_inputs to pass the prompt rows and the kernel
    backend to our forward."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    def make(original):
        def prepare_model_inputs(self, micro_batch):
            model_inputs, output_args = original(self, micro_batch)
            fused = tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False)
            if fused and getattr(_unwrapped(self.module), "_verl_fused_kernels_backend", None) == BACKEND:
                model_inputs[KERNEL_BACKEND] = forward_kernel_backend(self.model_config.fused_kernel_options)
                model_inputs[FUSED_BUDGET] = forward_fused_budget(self.model_config.fused_kernel_options)
                rows = _prompt_rows(self, micro_batch, model_inputs)
                if rows is not None:
                    model_inputs[PROMPT_ROWS] = rows
                    tu.assign_non_tensor(micro_batch, **{PROMPTS_AT_T1: True})
            return model_inputs, output_args

        return prepare_model_inputs

    _wrap_once(FSDPEngineWithLMHead, "prepare_model_inputs", make)


def _install_train_batch_wrap() -> None:
    """Wrap BaseEngine.train_batch (one optimizer step on a mini-batch) to add ERPO's fields."""
    from verl.workers.engine.base import BaseEngine

    def make(original):
        def train_batch(self, data, loss_function):
            settings = _settings_of(loss_function)
            if settings is not None and (settings.query_weighting != "none" or float(settings.alpha) > 0):
                model_path = getattr(getattr(self, "model_config", None), "path", None)
                add_mini_batch_fields(data, settings, self.get_data_parallel_group(), model_path)
            return original(self, data, loss_function)

        return train_batch

    _wrap_once(BaseEngine, "train_batch", make)


def install() -> None:
    """Register impl_backend=erpo and loss_mode=erpo with verl (idempotent; called on import)."""
    global _VERL_PATCH_FORWARD, _VERL_PPO_LOSS
    if verl.__version__ != TESTED_VERL:
        print(f"erpo: erpo.integrations.verl is tested with verl=={TESTED_VERL}, this is verl {verl.__version__}",
              file=sys.stderr)
    if not getattr(_monkey_patch.patch_forward_with_backends, "_erpo", False):
        _VERL_PATCH_FORWARD = _monkey_patch.patch_forward_with_backends
        _patch_forward_with_backends._erpo = True
        _monkey_patch.patch_forward_with_backends = _patch_forward_with_backends
    _core_algos.register_policy_loss(LOSS_MODE)(compute_policy_loss_erpo)
    for name in ERPO_ONLY_LOSSES:
        if name not in _core_algos.POLICY_LOSS_REGISTRY:
            _core_algos.register_policy_loss(name)(verl_policy_loss(name))
    erpo_ppo_loss._erpo = True
    _verl_losses.ppo_loss = erpo_ppo_loss
    workers = sys.modules.get("verl.workers.engine_workers")  # imported before us: rebind its name too
    if workers is not None and getattr(workers, "ppo_loss", None) is _VERL_PPO_LOSS:
        workers.ppo_loss = erpo_ppo_loss


install()
