"""The trainer's one config dataclass, its YAML / key=value loading, and its checks.

    cfg = load_config("my.yaml", ["alpha=0.05", "group_size=8"])   # file, then overrides
    cfg.validate()                                                 # ConfigError on bad values

Every field carries its help and its section in the field's metadata (declared with a
Section: ``alpha: float = OBJECTIVE(0.01, "help")``); `erpo train --help` prints them,
section by section. Unknown keys are a ConfigError naming the closest valid key.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import math
import os
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import yaml

from .atomic import atomic_write
from .errors import ErpoError


class ConfigError(ErpoError):
    """A bad config key or value."""


# The paper's evaluation temperatures (docs/method.md section 8).
EVAL_TEMPERATURES = [0.1, 0.3, 0.5, 0.7, 0.9, 1.0, 1.1, 1.3, 1.5]

# The values of the keys whose default is auto: the embedded demo's, and everyone else's.
DEMO_RUN_DIR = os.path.join("runs", "demo")
DEMO_MAX_NEW_TOKENS, MAX_NEW_TOKENS = 8, 1024  # the a+b task's answers are a few tokens long
TINY_CONTEXT = 1024  # positions of the demo model (erpo.tiny builds it)
TINY_MAX_NEW_TOKENS = TINY_CONTEXT // 2  # auto max_new_tokens of model=tiny on other data: leaves half for the prompt
DEMO_LR, LR = 3e-4, 1e-6  # the 2-layer demo model; a pretrained model (TRL's and verl's default)


@dataclass(frozen=True)
class Section:
    """A group of keys, printed together by `erpo train --help`. Calling it declares a key
    of the group: ``alpha: float = OBJECTIVE(0.01, "help")``, the help and the section in
    the field's metadata. ``choices``: the allowed values, or "module:NAME" of the
    constant that lists them where they are implemented (imported when first needed)."""

    name: str
    title: str

    def __call__(self, default: Any, help: str, *, choices: Union[Sequence[str], str, None] = None) -> Any:
        meta = {"help": help, "section": self.name, "choices": choices}
        if isinstance(default, list):
            return field(default_factory=lambda: list(default), metadata=meta)
        return field(default=default, metadata=meta)


OBJECTIVE = Section("objective", "objective (docs/method.md sections 2-5)")
ROLLOUT = Section("rollout", "rollout")
OPTIMISATION = Section("optimisation", "optimisation")
MEMORY = Section("memory", "memory (what lets a real model's step fit)")
MODEL = Section("model", "model and data")
RUN = Section("run", "run directory")
DEMO = Section("demo", "embedded demo (model=tiny, dataset=arithmetic)")
EVALUATION = Section("evaluation", "evaluation (docs/method.md section 8; `erpo eval`, whose short keys are in "
                                   "`erpo eval --help`)")
SECTIONS = (OBJECTIVE, ROLLOUT, OPTIMISATION, MEMORY, MODEL, RUN, DEMO, EVALUATION)


# The six difficulty levels of task=mixed, "<digits of a><op><digits of b>" (erpo.data draws them).
MIXED_LEVELS = ("2+1", "2-1", "2+2", "2-2", "2*1", "3+2")
TINY_HEADS = 4  # query heads of the demo model (erpo.tiny builds it; head_dim = tiny_hidden_size / TINY_HEADS)


@dataclass
class DemoConfig:
    """The embedded demo's keys (model=tiny, dataset=arithmetic): its task and its model's
    supervised warm start. A config file and the command line name them as they are here."""

    task: str = DEMO(
        "add",
        "the embedded task (dataset=arithmetic): add (a + b, the demo) or mixed (+, - and * of 1- to 3-digit "
        "operands in six difficulty levels, train and held-out problems in equal parts per level)",
        choices=("add", "mixed"),
    )
    task_max_operand: int = DEMO(49, "task=add: a + b with a, b in [0, task_max_operand]")
    task_train_size: int = DEMO(1500, "arithmetic training problems")
    task_eval_size: int = DEMO(200, "arithmetic held-out problems (eval)")
    task_rl_size: int = DEMO(
        0,
        "RL training prompts: a fixed subset of the task_train_size problems (task=mixed: equal parts per level); "
        "the warm start still learns from all task_train_size, so the starting model knows more than the RL "
        "prompts, as a pretrained model does; 0 = all of them",
    )
    tiny_hidden_size: int = DEMO(64, "demo model width")
    tiny_layers: int = DEMO(2, "demo model depth")
    warmstart_steps: int = DEMO(1000, "supervised warm-start steps of the demo model (cached)")
    warmstart_lr: float = DEMO(3e-3, "warm-start learning rate")
    warmstart_unboxed: float = DEMO(
        0.7,
        "fraction of warm-start demonstrations answering without \\boxed{} (no reward: RL has a format to "
        "learn)",
    )
    warmstart_batch_size: int = DEMO(64, "warm-start batch size")

    def validate(self) -> None:
        """ConfigError naming the key on the first bad value."""
        check_choices(self)
        for name in ("task_train_size", "task_eval_size", "tiny_hidden_size", "tiny_layers", "warmstart_batch_size"):
            at_least(name, getattr(self, name), 1)
        for name in ("warmstart_steps", "task_max_operand"):
            at_least(name, getattr(self, name), 0)
        positive("warmstart_lr", self.warmstart_lr)
        self._check_rl_size()
        if not 0.0 <= self.warmstart_unboxed < 1.0:
            raise ConfigError(f"warmstart_unboxed={self.warmstart_unboxed} must lie in [0, 1)")
        if self.tiny_hidden_size % TINY_HEADS != 0:
            raise ConfigError(f"tiny_hidden_size={self.tiny_hidden_size} must be a multiple of {TINY_HEADS} "
                              f"({TINY_HEADS} attention heads)")

    def _check_rl_size(self) -> None:
        """task_rl_size: 0, or a subset of task_train_size (task=mixed: a multiple of the levels, each given
        the same share, and no more than each level's training problems)."""
        rl, levels = self.task_rl_size, len(MIXED_LEVELS)
        at_least("task_rl_size", rl, 0)
        if rl > self.task_train_size:
            raise ConfigError(f"task_rl_size={rl} exceeds task_train_size={self.task_train_size} (the RL prompts are "
                              f"a subset of the warm start's problems); lower it, or 0 = all of them")
        if self.task == "mixed" and rl and (rl % levels or rl // levels > self.task_train_size // levels):
            raise ConfigError(f"task_rl_size={rl}: task=mixed draws equal parts of its {levels} levels, so give a "
                              f"multiple of {levels} of at most {levels * (self.task_train_size // levels)}")


def check_protocol(temperatures: Sequence[float], n_samples: int, k_values: Optional[Sequence[int]],
                   batch_size: int, *, key: Callable[[str], str] = str) -> None:
    """ValueError naming the argument (as ``key(name)``: how the caller's user names it)
    unless the temperatures are finite, > 0 and distinct, n_samples >= 1, every k of
    ``k_values`` in [1, n_samples] (None: every k) and batch_size >= 1. The one check of
    the protocol's settings: erpo.evaluate's arguments and EvalConfig's keys."""
    temperatures = tuple(temperatures)
    if len(temperatures) == 0 or any(not (t > 0) or math.isinf(t) for t in temperatures):
        raise ValueError(f"{key('temperatures')}: need finite temperatures > 0, got {temperatures} (greedy "
                         f"decoding, temperature 0, is always reported as Pass@1)")
    if len(set(temperatures)) != len(temperatures):
        raise ValueError(f"{key('temperatures')}: a temperature is listed twice in {temperatures}")
    if not n_samples >= 1:
        raise ValueError(f"{key('n_samples')}={n_samples} must be an integer >= 1")
    if k_values is not None and (len(k_values) == 0 or any(not 1 <= int(k) <= n_samples for k in k_values)):
        n = key("n_samples")
        raise ValueError(f"{key('k_values')}={list(k_values)}: each k of Pass@k must lie in [1, {n}={n_samples}] "
                         f"(k samples are drawn from the n); raise {n}= or lower the k")
    if not batch_size >= 1:
        raise ValueError(f"{key('batch_size')}={batch_size} must be an integer >= 1")


@dataclass
class EvalConfig:
    """What `erpo eval` scores and how (docs/method.md section 8). A config file and
    `erpo train`'s command line name each key eval_<name> (eval_n_samples=8); `erpo eval`
    also takes the short names of EVAL_KEYS (n=8), and then its messages use them."""

    dataset: str = EVALUATION(
        "",
        "evaluation file (a MATH-style .jsonl works as it is) or arithmetic; empty = the arithmetic held-out "
        "split, or `dataset`",
    )
    checkpoints: List[str] = EVALUATION(
        [],
        "what `erpo eval` scores: run, checkpoint or model dirs, or tiny (the demo's starting model); "
        "empty = the run's latest checkpoint",
    )
    temperatures: List[float] = EVALUATION(
        EVAL_TEMPERATURES,
        "sampling temperatures, each > 0 (greedy Pass@1 is always reported)",
    )
    n_samples: int = EVALUATION(8, "samples per problem and temperature (Avg@n, Pass@k)")
    k_values: List[int] = EVALUATION(
        [],
        "k of Pass@k, each <= eval_n_samples; empty = every k from 1 to eval_n_samples",
    )
    max_new_tokens: int = EVALUATION(0, "response length at evaluation; 0 = max_new_tokens (its auto value for "
                                         "the evaluation data outside any run)")
    batch_size: int = EVALUATION(256, "sequences per generate call at evaluation")
    limit: int = EVALUATION(0, "evaluate the first N problems only; 0 = all")
    out: str = EVALUATION("", "where reports go; empty = <run_dir>/eval (runs/eval for a model outside any run)")
    save_samples: bool = EVALUATION(
        False,
        "also write samples.jsonl: every completion with its question, the prompt the model saw, the gold answer "
        "and the grade",
    )

    def __post_init__(self) -> None:
        self.names = {f.name: f"eval_{f.name}" for f in dataclasses.fields(self)}  # how the user names each key

    def key(self, name: str) -> str:
        """The key of field `name` as the user names it: eval_<name>, or under `erpo eval` its short key."""
        return self.names[name]

    def name_keys(self, short: Dict[str, str]) -> None:
        """Name the keys by `short` ({short key: eval_<name>}, EVAL_KEYS) in every message."""
        for short_key, key in short.items():
            self.names[key[len("eval_"):]] = short_key

    def validate(self) -> None:
        """ConfigError naming the key on the first bad value; the protocol's own values
        (temperatures, n_samples, k_values, batch_size) by check_protocol, as erpo.evaluate's."""
        for name in ("max_new_tokens", "limit"):
            at_least(self.key(name), getattr(self, name), 0)
        try:
            check_protocol(self.temperatures, self.n_samples, self.k_values or None, self.batch_size, key=self.key)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


@dataclass
class TrainConfig:
    """Everything a run needs; the defaults are the embedded demo (`make demo`)."""

    algorithm: str = OBJECTIVE(
        "erpo",
        "erpo (weighted policy loss + alpha * Query-KL) or grpo (policy loss + beta * per-token KL)",
        choices="erpo_kernels:ALGORITHMS",
    )
    alpha: float = OBJECTIVE(0.01, "Query-KL coefficient of erpo; 0 = the weights-only ablation")
    beta: float = OBJECTIVE(
        0.01,
        "grpo: per-token KL coefficient to a frozen reference model (forwarded every step); 0 = none",
    )
    query_weighting: str = OBJECTIVE(
        "prevalence",
        "erpo's query weights: prevalence, softmax or none (none = the Query-KL-only ablation)",
        choices="erpo.query_weights:SCHEMES",
    )
    bins: int = OBJECTIVE(20, "K, equal-width histogram bins of the prevalence weights")
    gamma: float = OBJECTIVE(1.0, "prevalence exponent: u(q) = p(q) ** gamma")
    weight_temperature: float = OBJECTIVE(1.0, "T_w of the softmax weights: u(q) = exp(s(q) / T_w)")
    w_min: float = OBJECTIVE(0.1, "lower clip of the batch-normalised query weights")
    w_max: float = OBJECTIVE(10.0, "upper clip of the batch-normalised query weights")
    adv_norm: str = OBJECTIVE(
        "std",
        "group advantages: std ((R - mean) / (std + 1e-6)) or none (R - mean, Dr.GRPO)",
        choices=("std", "none"),
    )
    loss_agg: str = OBJECTIVE(
        "token-mean",
        "policy-loss aggregation (verl's names): token-mean, seq-mean-token-mean, seq-mean-token-sum or "
        "seq-mean-token-sum-norm (token sums / loss_scale_factor, Dr. GRPO)",
        choices="erpo_kernels:LOSS_AGGS",
    )
    eps_low: float = OBJECTIVE(0.2, "lower clip range of the ratio: 1 - eps_low")
    eps_high: float = OBJECTIVE(0.3, "upper clip range of the ratio: 1 + eps_high")
    dual_clip: float = OBJECTIVE(3.0, "dual-clip constant c for negative advantages")
    kl_guard: float = OBJECTIVE(10.0, "c of the K3 guard: linear continuation for delta > c")
    monitor_policy_kl: bool = OBJECTIVE(False, "erpo: also forward a frozen reference model to log policy_kl")
    rollout_is: str = OBJECTIVE(
        "auto",
        "truncated importance sampling against the rollout engine's log-probs: none, token (each token's policy "
        "loss times min(pi_old / pi_rollout, rollout_is_cap)) or sequence (times min(prod_t of that ratio, cap)); "
        "auto = none for rollout_backend=hf (the trained model samples) and for bypass_mode with ppo_clip, "
        "token for vllm",
        choices=("auto",) + ("none", "token", "sequence"),
    )
    rollout_is_cap: float = OBJECTIVE(2.0, "C, the truncation of the rollout importance weight (rollout_is)")
    entropy_coeff: float = OBJECTIVE(
        0.0,
        "entropy bonus: the loss minus entropy_coeff times the response tokens' entropy, aggregated with loss_agg "
        "(verl's entropy_coeff; differentiated through the fused kernel's entropy); 0 = off",
    )
    top_entropy_quantile: float = OBJECTIVE(
        1.0,
        "rho of 'Beyond the 80/20 Rule' (TRL's top_entropy_quantile): the policy loss (and the entropy bonus) "
        "trains only on the response tokens whose entropy reaches the mini-batch's (1 - rho)-quantile, the other "
        "tokens counting with loss 0; 0.2 = the paper's; 1 = every token",
    )
    policy_loss: str = OBJECTIVE(
        "vanilla",
        "per-token policy loss (verl's and TRL's names, docs/objective.md): vanilla (clipped surrogate, dual clip), "
        "gspo (sequence ratio), sapo (soft gate), gpg, clip_cov, kl_cov, geo_mean (GMPO), cispo, dppo_tv, dppo_kl "
        "(DPPO's binary trust regions), dro, bypass_mode (pi_old = the rollout's log-probs), luspo, vespo; erpo adds "
        "its Query-KL",
        choices="erpo_kernels:POLICY_LOSSES",
    )
    loss_scale_factor: float = OBJECTIVE(
        0.0, "the constant of loss_agg=seq-mean-token-sum-norm; 0 = auto: max_new_tokens (Dr. GRPO)"
    )
    tau_pos: float = OBJECTIVE(1.0, "sapo: gate temperature for positive advantages")
    tau_neg: float = OBJECTIVE(1.05, "sapo: gate temperature for non-positive advantages")
    clip_cov_ratio: float = OBJECTIVE(0.0002, "clip_cov: fraction of response tokens whose gradient is dropped")
    clip_cov_lb: float = OBJECTIVE(1.0, "clip_cov: tokens are drawn among those with covariance > clip_cov_lb")
    clip_cov_ub: float = OBJECTIVE(5.0, "clip_cov: ... and covariance < clip_cov_ub")
    kl_cov_ratio: float = OBJECTIVE(0.0002, "kl_cov: fraction of response tokens (largest covariance) penalised")
    ppo_kl_coef: float = OBJECTIVE(0.1, "kl_cov: coefficient of the |log ratio| penalty")
    dro_beta: float = OBJECTIVE(0.0, "dro: coefficient of the quadratic log-ratio penalty, required (> 0) with "
                                     "policy_loss=dro; 0 = unset (verl's policy_loss.dro_beta)")
    bypass_loss_type: str = OBJECTIVE(
        "ppo_clip", "bypass_mode: ppo_clip (vanilla on pi_theta / pi_rollout, no importance weight) or reinforce "
                    "(-A logp times rollout_is's weight min(pi_theta / pi_rollout, rollout_is_cap))",
        choices="erpo_kernels.objective.config:BYPASS_LOSS_TYPES",
    )
    rollout_rs: str = OBJECTIVE(
        "none", "rejection of response tokens by their divergence from the rollout's log-probs (verl's names): none, "
                "or comma-separated token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3; a rejected "
                "token counts with loss 0")
    rollout_rs_threshold: str = OBJECTIVE(
        "", "rollout_rs's thresholds, one for all or one per option, comma-separated: lower_upper ratio bounds for "
            "k1 (e.g. 0.5_2.0), an upper bound for k2 / k3; empty = unset")
    vespo_k_pos: float = OBJECTIVE(2.0, "vespo: power k of the gamma weight for advantages >= 0 (TRL's)")
    vespo_lambda_pos: float = OBJECTIVE(3.0, "vespo: decay lambda of the gamma weight for advantages >= 0")
    vespo_k_neg: float = OBJECTIVE(3.0, "vespo: power k for negative advantages")
    vespo_lambda_neg: float = OBJECTIVE(2.0, "vespo: decay lambda for negative advantages")

    group_size: int = ROLLOUT(8, "G, responses sampled per query")
    queries_per_step: int = ROLLOUT(16, "m, distinct queries per step (a step trains on m * G sequences)")
    temperature: float = ROLLOUT(1.0, "tau, the sampling temperature; response tokens are scored at 1 / tau")
    max_new_tokens: int = ROLLOUT(
        0, f"longest response in tokens; 0 = auto: {DEMO_MAX_NEW_TOKENS} for the embedded task (dataset=arithmetic), "
           f"{TINY_MAX_NEW_TOKENS} for model=tiny on other data (its context is {TINY_CONTEXT}), {MAX_NEW_TOKENS} "
           f"otherwise"
    )
    rollout_backend: str = ROLLOUT(
        "hf",
        "rollout engine: hf (transformers generate on the trained model) or vllm (a colocated vLLM engine, weights "
        "reloaded after every optimizer step: pip install 'erpo[vllm]' on CUDA, asleep between rollouts; on a CPU "
        "vLLM's CPU build, docs/vllm.md)",
        choices="erpo.rollout:ROLLOUT_BACKENDS",
    )
    top_k: int = ROLLOUT(0, "sample among the k most likely tokens only; 0 = off (the whole vocabulary)")
    top_p: float = ROLLOUT(
        1.0, "nucleus sampling: among the most likely tokens whose probabilities add up to top_p (in (0, 1]); 1 = off"
    )
    min_p: float = ROLLOUT(
        0.0, "sample among the tokens whose probability is at least min_p times the most likely one's (in [0, 1)); "
             "0 = off"
    )
    replay_support: bool = ROLLOUT(
        True,
        "when top_k, top_p or min_p truncates the sampler, the rollout records each response token's kept set (a "
        "packed bitmask) and the trainer renormalises every response log-prob over it, so pi_theta, pi_old, "
        "pi_rollout and the reference are compared on the support the token was sampled from (docs/training.md); "
        "false = score under the full softmax (biased ratios)",
    )
    rollout_batch_size: int = ROLLOUT(0, "hf: sequences per generate call; 0 = all m * G at once")
    vllm_gpu_memory_utilization: float = ROLLOUT(
        0.3, "vllm: the fraction of GPU memory the engine may take (weights and KV cache) while it generates "
        "(CUDA; on a CPU the KV cache is sized to the rollout)"
    )
    filter_groups: bool = ROLLOUT(
        False,
        "DAPO's dynamic sampling: drop the groups whose rewards are all equal (advantage 0, no learning signal) and "
        "refill the step with the groups of new queries, sampled in further rollout batches of queries_per_step, "
        "until queries_per_step groups are kept or filter_groups_max_batches batches were sampled (then the step "
        "fills up with dropped groups and warns); filter_groups/* logs the batches and the dropped groups",
    )
    filter_groups_max_batches: int = ROLLOUT(
        10, "filter_groups: the most rollout batches one step samples, its own included (verl's "
            "max_num_gen_batches); 0 = no limit"
    )
    overlong_buffer: int = ROLLOUT(
        0,
        "DAPO's overlong reward shaping: a response longer than max_new_tokens - overlong_buffer tokens gets "
        "-overlong_penalty * (length - (max_new_tokens - overlong_buffer)) / overlong_buffer added to its reward "
        "(down to -overlong_penalty at max_new_tokens); 0 = off",
    )
    overlong_penalty: float = ROLLOUT(
        1.0, "overlong_buffer: the penalty of a response max_new_tokens long (verl's overlong_buffer.penalty_factor)"
    )

    lr: float = OPTIMISATION(
        0.0, f"AdamW learning rate; 0 = auto: {DEMO_LR:g} for the demo model (model=tiny), {LR:g} otherwise (TRL's "
             f"and verl's default)"
    )
    lr_schedule: str = OPTIMISATION(
        "constant",
        "constant, linear or cosine decay to 0 over `steps`, after warmup",
        choices=("constant", "linear", "cosine"),
    )
    warmup_steps: int = OPTIMISATION(10, "linear learning-rate warm-up steps")
    weight_decay: float = OPTIMISATION(0.0, "AdamW weight decay")
    adam_beta1: float = OPTIMISATION(0.9, "AdamW beta1")
    adam_beta2: float = OPTIMISATION(0.99, "AdamW beta2")
    max_grad_norm: float = OPTIMISATION(1.0, "gradient clipping by global norm; 0 = off")
    steps: int = OPTIMISATION(
        200, "training steps, one rollout batch each (mini_batches x ppo_epochs optimizer updates per step)"
    )
    mini_batches: int = OPTIMISATION(
        1,
        "optimizer updates per pass over a rollout batch, each on an equal share of its queries (whole groups); "
        "> 1 makes later updates off-policy, so the clip acts; must divide queries_per_step",
    )
    ppo_epochs: int = OPTIMISATION(1, "passes over each rollout batch (each pass: mini_batches updates)")
    seed: int = OPTIMISATION(0, "seeds data order, sampling and the demo model; a run is reproducible from it")

    micro_batch_tokens: int = MEMORY(
        0,
        "token budget of one forward + backward: each mini-batch's sequences packed greedily into micro-batches "
        "of at most this many tokens, gradients accumulated (the same update as one pass); 0 = the whole "
        "mini-batch at once",
    )
    fused_budget_mb: int = MEMORY(
        1024,
        "MiB of kept logits the loss keeps per chunk of whole sequences on its fused path (the gradient formed "
        "during the forward: 3 GEMMs of lm_head work instead of 4; docs/objective.md); rows per chunk = budget / "
        "(2 bytes for a bf16 / fp16 lm_head, 4 for fp32, x vocabulary size); 0 = the 4-GEMM path",
    )
    gradient_checkpointing: bool = MEMORY(
        False,
        "recompute each decoder layer's activations in the backward instead of keeping them (the model's own "
        "transformers checkpointing): less memory, about one more forward of time",
    )
    tp_size: int = MEMORY(
        1,
        "under torchrun: ranks per tensor-parallel group; the lm_head (on the vocabulary, never gathered) and each "
        "decoder layer's projections sharded over tp_size ranks, FSDP2 over the world / tp_size groups; must "
        "divide the number of ranks; 1 = FSDP2 alone",
    )

    model: str = MODEL(
        "tiny",
        "a local Hugging Face causal-LM directory, a run (its latest checkpoint) or checkpoint, or tiny (the "
        "embedded demo model)",
    )
    dataset: str = MODEL("arithmetic", "a local .jsonl / .parquet file, or arithmetic (the embedded task)")
    prompt_field: str = MODEL("prompt", "dataset field holding the question")
    answer_field: str = MODEL("answer", "dataset field holding the gold answer")
    template: str = MODEL(
        "auto",
        "r1 (<think> reasoning, \\boxed{} answer), chat (r1 through the tokenizer's chat template), plain, a "
        "string with {prompt}; auto = plain for arithmetic, r1 otherwise",
    )
    reward: str = MODEL(
        "auto",
        "exact_match or math_verify (both read the last \\boxed{}); auto = exact_match for arithmetic, "
        "math_verify otherwise",
        choices=("auto", "exact_match", "math_verify"),
    )
    max_prompt_tokens: int = MODEL(0, "refuse prompts longer than this many tokens; 0 = no limit")
    dtype: str = MODEL(
        "auto",
        "float32, bfloat16 or float16 for the trained model; auto = bfloat16 on CUDA, float32 on CPU",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    device: str = MODEL("auto", "cpu, cuda or cuda:N; auto = cuda when available")
    cpu_threads: int = MODEL(
        0,
        "torch CPU threads; 0 = 1 for the demo model (its ops are too small to share out), else torch's "
        "default",
    )
    kernel_backend: str = MODEL(
        "auto",
        "erpo_kernels backend: auto (Triton on CUDA, PyTorch elsewhere), triton or torch",
        choices="erpo_kernels:BACKENDS",
    )
    attn_implementation: str = MODEL(
        "auto",
        "attention of the padding-free packed forward: auto = flash_attention_2 when flash-attn is installed, "
        "else flex_attention on CUDA, sdpa_varlen on CPU (PyTorch sdpa per sequence; plain sdpa on a packed row "
        "computes every pair of rows under a mask)",
        choices="erpo.packing:ATTN_IMPLEMENTATIONS",
    )

    run_dir: str = RUN(
        "auto",
        f"where config.yaml, metrics.jsonl, the plot, the reference cache and checkpoints go; auto = {DEMO_RUN_DIR} "
        f"for the embedded demo (model=tiny, dataset=arithmetic), runs/<model>-<dataset> otherwise",
    )
    resume: str = RUN(
        "",
        "a run (its latest checkpoint) or a checkpoint RUN/checkpoints/step-N to continue from (same data order "
        "and RNG); with another run_dir: a fork, RUN untouched",
    )
    overwrite: bool = RUN(
        False,
        "start over in a run_dir that holds an earlier run, deleting its metrics, checkpoints and eval "
        "reports; false = refuse",
    )
    save_every: int = RUN(50, "checkpoint every N steps (and always at the last step); 0 = only at the end")
    keep_checkpoints: int = RUN(2, "newest checkpoints kept; 0 = keep all")
    ref_cache: str = RUN("", "reference-cache file; empty = <run_dir>/ref_cache.safetensors (built when missing)")
    progress: bool = RUN(True, "show a progress bar")
    cache_dir: str = RUN("auto", "where the demo model's warm start is cached; auto = the user cache: "
                                 "$XDG_CACHE_HOME/erpo, else ~/.cache/erpo")

    demo: DemoConfig = field(default_factory=DemoConfig)  # the embedded demo's keys
    eval: EvalConfig = field(default_factory=EvalConfig)  # `erpo eval`'s keys

    # ------------------------------------------------------------------ keys

    def __init__(self, **keys: Any) -> None:
        """A config from its keys named as in a config file (alpha=0.05, tiny_layers=1,
        eval_n_samples=4; the others at their defaults). A sub-config may also be given whole
        (demo=DemoConfig(...), eval=EvalConfig(...)), its keys given by name going on top."""
        for f in dataclasses.fields(self):
            if f.name in keys:
                value = copy.deepcopy(keys.pop(f.name)) if f.name in SUBCONFIGS else keys.pop(f.name)
            else:
                value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            setattr(self, f.name, value)
        for key, value in keys.items():
            if key not in KEYS:
                raise TypeError(f"TrainConfig has no key {key!r}")
            self.set(key, value)

    def get(self, key: str) -> Any:
        """The value of config key `key`, named as in a config file (tiny_layers, eval_n_samples)."""
        owner, f = KEYS[key]
        return getattr(getattr(self, owner) if owner else self, f.name)

    def set(self, key: str, value: Any) -> None:
        owner, f = KEYS[key]
        setattr(getattr(self, owner) if owner else self, f.name, value)

    def to_dict(self) -> Dict[str, Any]:
        """{key: value} of every key, flat, as config.yaml holds them."""
        return {key: copy.deepcopy(self.get(key)) for key in KEYS}

    # ------------------------------------------------------------------ helpers

    @property
    def resolved_cache_dir(self) -> str:
        """cache_dir, auto resolved to the platform's user cache ($XDG_CACHE_HOME/erpo, else
        ~/.cache/erpo): one warm start per user, whatever directory erpo runs from."""
        if self.cache_dir != "auto":
            return self.cache_dir
        root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(root, "erpo")

    @property
    def is_demo_model(self) -> bool:
        return self.model == "tiny"

    @property
    def is_demo_task(self) -> bool:
        return self.dataset == "arithmetic"

    def template_for(self, demo_task: bool) -> str:
        """`template`, with auto resolved: plain for the embedded task, r1 for a dataset file."""
        return ("plain" if demo_task else "r1") if self.template == "auto" else self.template

    def reward_for(self, demo_task: bool) -> str:
        """`reward`, with auto resolved: exact_match for the embedded task, math_verify for a file."""
        return ("exact_match" if demo_task else "math_verify") if self.reward == "auto" else self.reward

    @property
    def resolved_template(self) -> str:
        return self.template_for(self.is_demo_task)

    @property
    def resolved_reward(self) -> str:
        return self.reward_for(self.is_demo_task)

    @property
    def eval_is_demo_task(self) -> bool:
        """`erpo eval` scores the embedded task's held-out split."""
        return self.eval.dataset == "arithmetic" or (not self.eval.dataset and self.is_demo_task)

    @property
    def eval_max_tokens(self) -> int:
        """The response length at evaluation: eval_max_new_tokens, else max_new_tokens, else
        (auto, a model outside any run) the auto value for the evaluation data."""
        auto = (DEMO_MAX_NEW_TOKENS if self.eval_is_demo_task else
                TINY_MAX_NEW_TOKENS if "tiny" in self.eval.checkpoints else MAX_NEW_TOKENS)  # fits its context
        return self.eval.max_new_tokens or self.max_new_tokens or auto

    @property
    def eval_template(self) -> str:
        """The template at evaluation (auto resolved for the evaluation data)."""
        return self.template_for(self.eval_is_demo_task)

    @property
    def eval_reward(self) -> str:
        """The reward at evaluation (auto resolved for the evaluation data)."""
        return self.reward_for(self.eval_is_demo_task)

    def resolve_run_dir(self) -> None:
        """run_dir=auto replaced, in place, by DEMO_RUN_DIR for the embedded demo, else
        runs/<model>-<dataset> (a checkpoint RUN/checkpoints/step-N is named RUN-step-N)."""
        if self.run_dir != "auto":
            return
        if self.is_demo_model and self.is_demo_task:
            self.run_dir = DEMO_RUN_DIR
            return
        model = os.path.normpath(self.model)
        name = os.path.basename(model)
        if os.path.basename(os.path.dirname(model)) == "checkpoints":
            name = f"{os.path.basename(os.path.dirname(os.path.dirname(model)))}-{name}"
        data = os.path.splitext(os.path.basename(os.path.normpath(self.dataset)))[0]
        self.run_dir = os.path.join("runs", f"{name}-{data}")

    def resolve_training_defaults(self) -> None:
        """The auto values a training run needs, in place: run_dir (resolve_run_dir),
        max_new_tokens=0 (DEMO_MAX_NEW_TOKENS for the embedded task, TINY_MAX_NEW_TOKENS for
        the demo model on other data, else MAX_NEW_TOKENS), lr=0 (DEMO_LR for the demo model,
        else LR) and loss_scale_factor=0 under seq-mean-token-sum-norm (max_new_tokens).
        config.yaml stores the values."""
        self.resolve_run_dir()
        if self.max_new_tokens == 0:
            self.max_new_tokens = (DEMO_MAX_NEW_TOKENS if self.is_demo_task else
                                   TINY_MAX_NEW_TOKENS if self.is_demo_model else MAX_NEW_TOKENS)
        if self.lr == 0:
            self.lr = DEMO_LR if self.is_demo_model else LR
        if self.loss_scale_factor == 0 and self.loss_agg == "seq-mean-token-sum-norm":
            self.loss_scale_factor = float(self.max_new_tokens)

    @property
    def ref_cache_path(self) -> str:
        return self.ref_cache or os.path.join(self.run_dir, "ref_cache.safetensors")

    @property
    def truncates(self) -> bool:
        """top_k, top_p or min_p cuts the sampler's vocabulary."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def replays_support(self) -> bool:
        """The rollouts record their kept sets and the trainer scores over them (replay_support
        on, and a truncating sampler: with nothing cut there is nothing to replay)."""
        return bool(self.replay_support) and self.truncates

    @property
    def resolved_rollout_is(self) -> str:
        """`rollout_is`, with auto resolved: none for hf generate, token for vllm."""
        if self.rollout_is != "auto":
            return self.rollout_is
        if self.policy_loss == "bypass_mode" and self.bypass_loss_type == "ppo_clip":
            return "none"  # its ratio pi_theta / pi_rollout is the correction
        return "token" if self.rollout_backend == "vllm" else "none"

    def loss_config(self) -> Any:
        """The objective's settings as erpo_kernels' LossConfig: every LossConfig field
        this config has (same name, same meaning; rollout_is and loss_scale_factor
        resolved), the rest at LossConfig's defaults."""
        from erpo_kernels import LossConfig

        names = [f.name for f in dataclasses.fields(LossConfig) if f.name in FIELDS]
        values = {name: getattr(self, name) for name in names}
        values["rollout_is"] = self.resolved_rollout_is
        scale = float(self.loss_scale_factor)  # 0 = auto
        if self.loss_agg == "seq-mean-token-sum-norm":
            values["loss_scale_factor"] = scale or float(self.max_new_tokens)
        else:
            values["loss_scale_factor"] = scale or None  # set without its loss_agg: LossConfig says so
        values["dro_beta"] = float(self.dro_beta) or None  # 0 = unset
        values["rollout_rs_threshold"] = self.rollout_rs_threshold or None  # "" = unset
        return LossConfig(**values)

    def validate(self) -> None:
        """ConfigError (one line: the key, what is wrong, how to fix it) on the first bad value."""
        check_choices(self)
        self._validate_by_their_objects()
        self._validate_ranges()
        self._validate_combinations()
        self.demo.validate()
        self.eval.validate()
        if not self.run_dir:
            raise ConfigError("run_dir is empty; give the run a directory, e.g. run_dir=runs/my-run")

    def _validate_by_their_objects(self) -> None:
        """The keys of the objective (alpha, beta, eps_low, eps_high, dual_clip, kl_guard,
        rollout_is_cap, ...), of the query weights (bins, gamma, weight_temperature,
        w_min, w_max) and of the overlong shaping (overlong_buffer, overlong_penalty) are
        checked by LossConfig, ERPOSettings (QueryWeighter's checks) and erpo.rewards themselves."""
        from .erpo_settings import ERPOSettings
        from .rewards import check_overlong

        if not (self.loss_scale_factor >= 0 and self.loss_scale_factor != float("inf")):
            raise ConfigError(f"loss_scale_factor={self.loss_scale_factor} must be finite and > 0, or 0 (auto: "
                              f"max_new_tokens, Dr. GRPO's constant)")
        try:
            self.loss_config()
            ERPOSettings.of(self).validate()  # the one check of ERPO's keys (ERPOConfig's and verl's too)
            check_overlong(self.overlong_buffer, self.overlong_penalty, self.max_new_tokens)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def _validate_ranges(self) -> None:
        """Each numeric key within its own range."""
        if not (self.device == "auto" or self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise ConfigError(f"device={self.device!r}: use auto, cpu, cuda or cuda:N")
        for name in ("weight_decay", "max_grad_norm"):
            at_least(name, getattr(self, name), 0.0)
        positive("temperature", self.temperature)
        at_least("lr", self.lr, 0.0)  # 0 = auto
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name}={getattr(self, name)} must lie in [0, 1)")
        for name in ("queries_per_step", "steps", "mini_batches", "ppo_epochs", "tp_size"):
            at_least(name, getattr(self, name), 1)
        for name in ("cpu_threads", "max_new_tokens", "rollout_batch_size", "warmup_steps", "save_every",
                     "keep_checkpoints", "max_prompt_tokens", "micro_batch_tokens", "filter_groups_max_batches",
                     "fused_budget_mb"):
            at_least(name, getattr(self, name), 0)
        at_least("top_k", self.top_k, 0)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p={self.top_p} must lie in (0, 1] (1 = off)")
        if not 0.0 <= self.min_p < 1.0:
            raise ConfigError(f"min_p={self.min_p} must lie in [0, 1) (0 = off)")
        if not 0.0 < self.vllm_gpu_memory_utilization <= 1.0:
            raise ConfigError(f"vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization} must lie in (0, 1]")

    def _validate_combinations(self) -> None:
        """Keys that must agree with each other."""
        if self.group_size < 1:
            raise ConfigError(f"group_size={self.group_size} must be >= 1")
        if self.group_size == 1:
            what = "the unbiased std of one reward is undefined" if self.adv_norm == "std" else "R - mean(R) is always 0"
            raise ConfigError(
                f"group_size=1 with adv_norm={self.adv_norm}: group advantages need at least 2 responses per query "
                f"({what}); set group_size=2 or more"
            )
        if self.queries_per_step % self.mini_batches:
            divisors = [d for d in range(1, self.queries_per_step + 1) if self.queries_per_step % d == 0]
            raise ConfigError(
                f"mini_batches={self.mini_batches} does not divide queries_per_step={self.queries_per_step}: each "
                f"update takes an equal share of the step's queries (whole groups); use one of "
                f"{', '.join(map(str, divisors))}, or change queries_per_step"
            )
        if self.template not in ("auto", "r1", "chat", "plain") and "{prompt}" not in self.template:
            raise ConfigError(
                f"template={self.template!r} is not r1, chat, plain or auto, and has no {{prompt}} placeholder"
            )


def choice(name: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        # a prefix first (loss_agg=seq-mean: seq-mean-token-mean), else the closest spelling
        close = [a for a in allowed if str(value) and a.startswith(str(value))] or difflib.get_close_matches(
            str(value), allowed, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(allowed)}{hint}")


def check_choices(obj: Any) -> None:
    """ConfigError for the first key of TrainConfig or DemoConfig `obj` (whose keys are
    named as their fields) whose value is not among its choices."""
    for f in dataclasses.fields(obj):
        if f.metadata.get("choices") is not None:
            choice(f.name, getattr(obj, f.name), field_choices(f.name))


def at_least(name: str, value: float, low: float) -> None:
    if not value >= low or value != value or value == float("inf"):
        raise ConfigError(f"{name}={value} must be finite and >= {low}")


def positive(name: str, value: float) -> None:
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{name}={value} must be positive and finite")


# ---------------------------------------------------------------------- loading

# The sub-configs of TrainConfig: attribute -> (class, the prefix of their keys in a config file).
SUBCONFIGS = {"demo": (DemoConfig, ""), "eval": (EvalConfig, "eval_")}


def _keys() -> Dict[str, Tuple[str, dataclasses.Field]]:
    """Every key of a config file -> (the sub-config holding it, or "", its field), in field order."""
    keys: Dict[str, Tuple[str, dataclasses.Field]] = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name in SUBCONFIGS:
            cls, prefix = SUBCONFIGS[f.name]
            keys.update({prefix + g.name: (f.name, g) for g in dataclasses.fields(cls)})
        else:
            keys[f.name] = ("", f)
    return keys


KEYS = _keys()
FIELDS: Dict[str, dataclasses.Field] = {key: f for key, (_, f) in KEYS.items()}


def field_choices(name: str) -> Sequence[str]:
    """The allowed values of key `name` (from its field's metadata; a "module:NAME"
    reference is imported here, so `erpo --help` and plain config loading need no torch)."""
    choices = FIELDS[name].metadata.get("choices")
    if isinstance(choices, str):
        module, constant = choices.split(":")
        choices = getattr(importlib.import_module(module), constant)
    return tuple(choices or ())


def _shown(value: Any) -> str:
    return ",".join(str(v) for v in value) if isinstance(value, list) else str(value)


HELP_WIDTH = 110


def help_text() -> str:
    """Every key with its help, choices and default, under the title of its section."""
    default = TrainConfig()
    width = max(len(n) for n in FIELDS)
    blocks = []
    for section in SECTIONS:
        lines = [f"{section.title}:"]
        for name, f in FIELDS.items():
            if f.metadata["section"] != section.name:
                continue
            choices = f" {{{', '.join(field_choices(name))}}}" if f.metadata.get("choices") else ""
            text = f"{f.metadata['help']}{choices} [default: {_shown(default.get(name))}]"
            lines.append(textwrap.fill(text, HELP_WIDTH, initial_indent=f"  {name:<{width}}  ",
                                       subsequent_indent=" " * (width + 4), break_on_hyphens=False))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


# Names other trainers (TRL's GRPOConfig, verl) use for our keys: suggested, not accepted.
ALIASES = {
    "learning_rate": "lr", "num_generations": "group_size", "n_samples": "group_size", "rollout_n": "group_size",
    "max_completion_length": "max_new_tokens", "response_length": "max_new_tokens", "max_steps": "steps",
    "output_dir": "run_dir", "model_name_or_path": "model", "kl_coef": "beta", "epsilon": "eps_low",
    "epsilon_high": "eps_high", "clip_ratio_low": "eps_low", "clip_ratio_high": "eps_high",
    "loss_agg_mode": "loss_agg", "save_steps": "save_every", "train_batch_size": "queries_per_step",
    "dataset_name": "dataset", "reward_funcs": "reward", "max_num_gen_batches": "filter_groups_max_batches",
    "overlong_buffer_len": "overlong_buffer", "overlong_penalty_factor": "overlong_penalty",
}


# `erpo eval`'s short keys (erpo eval model=RUN data=FILE n=8 k=1,8 ...) and the fields they set.
EVAL_KEYS = {
    "model": "eval_checkpoints", "data": "eval_dataset", "temperatures": "eval_temperatures", "n": "eval_n_samples",
    "k": "eval_k_values", "max_new_tokens": "eval_max_new_tokens", "batch_size": "eval_batch_size",
    "limit": "eval_limit", "out": "eval_out", "save_samples": "eval_save_samples",
}


def unknown_key_error(key: str, where: str = "") -> ConfigError:
    close = [ALIASES[key]] if key in ALIASES else difflib.get_close_matches(key, list(FIELDS), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else "; `erpo train --help` lists the keys"
    return ConfigError(f"unknown config key {key!r}{where}{hint}")


def _field_type(name: str) -> str:
    annotation = FIELDS[name].type
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def coerce(name: str, value: Any, shown: str = "") -> Any:
    """`value` (from YAML or a key=value string) converted to the type of key `name`;
    errors name the key as the user typed it (``shown``, default `name`)."""
    kind = _field_type(name)
    key = shown or name
    if isinstance(value, str) and kind != "str":
        text = value.strip()
        if kind.startswith("List") and text and not text.startswith("["):
            value = [v for v in text.split(",") if v.strip()]
        else:
            if not text and not kind.startswith("List"):
                raise ConfigError(f"{key} is empty; give a value (`erpo train --help` shows the default)")
            try:
                value = yaml.safe_load(text) if text else None
            except yaml.YAMLError:
                raise ConfigError(f"{key}={value!r} is not a valid {kind}") from None
    try:
        if kind == "str":
            return "" if value is None else str(value)
        if kind == "bool":
            if isinstance(value, bool):
                return value
            raise TypeError
        if kind == "int":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
                raise TypeError
            return int(value)
        if kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise TypeError
            return float(value)
        if kind.startswith("List"):
            if value is None:
                return []
            if not isinstance(value, (list, tuple)):
                value = [value]
            inner = kind[len("List["):-1]
            if inner == "str":
                return [str(v).strip() for v in value]
            conv = int if inner == "int" else float
            out = []
            for v in value:
                v = yaml.safe_load(v) if isinstance(v, str) else v
                if isinstance(v, bool) or not isinstance(v, (int, float)) or (conv is int and int(v) != v):
                    raise TypeError
                out.append(conv(v))
            return out
    except (TypeError, ValueError):
        pass
    example = {"bool": "true or false", "int": "an integer", "float": "a number", "List[int]": "a list of integers",
               "List[float]": "a list of numbers"}.get(kind, "a list")
    raise ConfigError(f"{key}={value!r} is not {example}")


def parse_overrides(items: Sequence[str], aliases: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """["key=value", ...] -> {key: typed value}; unknown keys and missing '=' are ConfigErrors.
    ``aliases``: other names of keys ({alias: key}, `erpo eval`'s EVAL_KEYS), named in errors as typed."""
    aliases = aliases or {}
    out: Dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"expected key=value, got {item!r} (e.g. steps=100)")
        typed, value = item.split("=", 1)
        typed = typed.strip().replace("-", "_")
        key = aliases.get(typed, typed)
        if key not in FIELDS:
            raise unknown_key_error(key)
        out[key] = coerce(key, value, shown=typed)
    return out


def yaml_mapping(path: str, what: str = "config file") -> Dict[str, Any]:
    """The mapping a YAML file holds; a ConfigError naming `what` when it is missing, not
    YAML, or not a mapping."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.yaml")):
            raise ConfigError(f"{what} {path!r} is a directory, a run's: continue it with resume={path}, or start "
                              f"from its settings with {os.path.join(path, 'config.yaml')}")
        raise ConfigError(f"{what} {path!r} is a directory; give a YAML file (e.g. configs/demo.yaml)")
    if not os.path.isfile(path):
        raise ConfigError(f"{what} {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path!r} is not valid YAML: {yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path!r} must hold a mapping of key: value")
    return data


def yaml_problem(exc: Exception) -> str:
    """A YAML parse error in one line: the line and column it was found at, and where the
    construct it was parsing began when that is another line."""
    mark, start = getattr(exc, "problem_mark", None), getattr(exc, "context_mark", None)
    problem, context = getattr(exc, "problem", None), getattr(exc, "context", None)
    if mark is None or not problem:
        return str(exc).splitlines()[0]
    text = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    if context and start is not None and start.line != mark.line:
        text += f" ({context} begun at line {start.line + 1})"
    elif context:
        text += f" ({context})"
    return text


def read_yaml(path: str) -> Dict[str, Any]:
    """A config file -> {key: typed value}; unknown keys name the file."""
    data = yaml_mapping(path)
    out = {}
    for key, value in data.items():
        key = str(key)
        if key not in FIELDS:
            raise unknown_key_error(key, f" in {path}")
        out[key] = coerce(key, value)
    return out


def load_config(path: Optional[str] = None, overrides: Sequence[str] = (),
                aliases: Optional[Dict[str, str]] = None) -> Tuple[TrainConfig, Dict[str, Any]]:
    """(config, the explicitly given values): defaults <- YAML file <- key=value overrides.

    The config is not validated here (resume merges it with the saved one first).
    """
    given: Dict[str, Any] = {}
    if path:
        given.update(read_yaml(path))
    given.update(parse_overrides(overrides, aliases))
    return TrainConfig(**given), given


# Keys naming files or directories, and the names among their values that are not paths.
PATH_KEYS = {"model": ("tiny",), "dataset": ("arithmetic",), "eval_dataset": ("arithmetic", ""), "ref_cache": ("",),
             "cache_dir": ("auto",)}


def resolved_path(key: str, value: str) -> str:
    """`value` of path key `key` as an absolute path (a name such as tiny kept as it is)."""
    return value if value in PATH_KEYS[key] else os.path.abspath(value)


def same_path(key: str, a: Any, b: Any) -> bool:
    """Whether two values of path key `key` name the same file or directory (another spelling of it)."""
    if a == b:
        return True
    if not isinstance(a, str) or not isinstance(b, str) or a in PATH_KEYS[key] or b in PATH_KEYS[key]:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def save_config(cfg: TrainConfig, path: str) -> None:
    """Write the config as YAML (atomically), every path absolute: a run resumes, and is
    evaluated, from any working directory."""
    values = cfg.to_dict()
    values.update({key: resolved_path(key, values[key]) for key in PATH_KEYS})
    atomic_write(path, yaml.safe_dump(values, sort_keys=False).encode("utf-8"))


# Keys that may change when a run is resumed: they do not alter what steps 1..k computed.
RESUMABLE_KEYS = frozenset(
    {"steps", "save_every", "keep_checkpoints", "progress", "resume", "run_dir", "overwrite", "gradient_checkpointing"}
    | {name for name in FIELDS if name.startswith("eval_")}
)


def _moved(key: str, saved: Any) -> bool:
    """The run's path `saved` of key `key` exists no more from here (moved, or relative to
    another working directory): another path may be given for it; the trainer checks that
    it holds the run's data (fingerprint), starting weights and reference cache."""
    return isinstance(saved, str) and saved not in PATH_KEYS[key] and not os.path.exists(saved)


def missing_run_paths(cfg: TrainConfig, resume: str) -> None:
    """ConfigError when a resumed run's model or dataset is not found from here, saying how to name it."""
    for key in ("model", "dataset"):
        value = getattr(cfg, key)
        if _moved(key, value):
            raise ConfigError(
                f"resume={resume}: the run's {key} {value!r} does not exist from here ({os.getcwd()}); give its "
                f"path with {key}=PATH (the same {'weights' if key == 'model' else 'data'})"
            )


def merge_for_resume(saved: Dict[str, Any], given: Dict[str, Any]) -> TrainConfig:
    """The saved run's config with the given overrides; changing a key that would break
    exact continuation (anything but steps, save_every, keep_checkpoints, progress, gradient_checkpointing and
    eval settings; steps too under a decaying lr_schedule) is a ConfigError. A path may be given
    in another spelling of the same file, or anew where the saved one exists no more."""
    merged = {}
    for key, value in saved.items():
        if key not in FIELDS:
            raise unknown_key_error(key, " in the saved config.yaml")
        merged[key] = coerce(key, value)
    for key, value in given.items():
        if key == "steps" and value != merged.get(key) and merged.get("lr_schedule", "constant") != "constant":
            raise ConfigError(
                f"steps cannot change when resuming a run with lr_schedule={merged['lr_schedule']} (saved "
                f"{merged.get(key)}, given {value}): the learning rate decays over steps, so the steps already taken "
                f"would not be those of a {value}-step run; start a new run with a different run_dir instead"
            )
        if key in RESUMABLE_KEYS or merged.get(key) == value:
            merged[key] = value
            continue
        if key in PATH_KEYS and (same_path(key, merged.get(key), value) or _moved(key, merged.get(key))):
            merged[key] = value  # the same file by another spelling, or the run's, moved: its contents are checked
            continue
        raise ConfigError(
            f"{key} cannot change when resuming (saved {merged.get(key)!r}, given {value!r}): exact continuation "
            f"needs the same value; start a new run with a different run_dir instead"
        )
    return TrainConfig(**merged)
