"""`python -m bench step`: one whole RL training step of a Qwen2.5-shaped model.

The model is transformers' Qwen2ForCausalLM built from a Qwen2Config with random weights
(no download). One step = forward (+ the reference model's forward, GRPO) + loss + backward
+ AdamW step (zero_grad with set_to_none runs before it, untimed), on a batch of m queries x G
responses, each sequence a T-token prompt and an L-token response (N = m G (T + L) rows, laid
out as erpo_kernels.PackedLossBatch describes). Variants:

  erpo-fused   hidden states -> erpo_kernels.erpo_loss, its default path (on a GPU the fused
               3-GEMM path: the gradient formed in the forward, a chunk of whole sequences
               at a time; never an [N, V] tensor); each record says which path ran (loss_path)
  erpo-stock   logits [N, V] -> log_softmax(fp32, / tau) + gather (entropy under no_grad,
               chunked) -> erpo_kernels.erpo_loss_from_logp: the same loss math
  grpo-stock   the GRPO objective (beta k3 per response token): a reference-model forward
               (no_grad, stock log-probs) + the stock policy path
  grpo-fused   the same with our kernels for both the reference and the policy
  erpo-padded  erpo-fused on rollout-like lengths (response lengths skewed: most short, a
               long tail up to L, see skewed_lengths) forwarded as a right-padded [B, T + L]
               batch (erpo.packing.forward_hidden_padded): every padding position computed
  erpo-packed  the same batch packed into one row with no padding (erpo.packing.forward_hidden,
               attn_implementation=auto); tokens/s of both count the real tokens only
  erpo-micro-K erpo-packed in micro-batches of at most K tokens (whole sequences, packed
               greedily), gradients accumulated, every micro-batch normalised by the whole
               batch (the trainer's micro_batch_tokens=K): the same update, a lower peak;
               `--micro-batch-tokens K1,K2,...` adds one variant per budget
Time and peak extra memory are defined in bench/measure.py; "resident before" is what the
step starts from (weights, optimizer state, the reference model for GRPO). Two peaks are
recorded: of the whole step, and of forward + loss + backward alone (read just before the
optimizer step), since at small N the AdamW step's temporaries can set the whole-step peak.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import report
from .measure import MIB, Measurement, RunOptions, guarded, measure, measure_isolated, peak_rss_bytes, run_header

PACKING_VARIANTS = ("erpo-padded", "erpo-packed")
VARIANTS = ("erpo-fused", "erpo-stock", "grpo-stock", "grpo-fused") + PACKING_VARIANTS
MICRO_PREFIX = "erpo-micro-"  # + the token budget K of each micro-batch


def micro_budget(variant: str) -> Optional[int]:
    """K of an erpo-micro-K variant (None for the other variants; SystemExit for a bad K)."""
    if not variant.startswith(MICRO_PREFIX):
        return None
    text = variant[len(MICRO_PREFIX):]
    if not text.isdigit() or int(text) < 1:
        raise SystemExit(f"variant {variant!r}: the micro-batch budget must be a positive integer (erpo-micro-4096)")
    return int(text)


def is_packing_variant(variant: str) -> bool:
    """Variants on the skewed, packed batch (erpo-padded, erpo-packed, erpo-micro-K)."""
    return variant in PACKING_VARIANTS or micro_budget(variant) is not None
STEP_DEFINITION = (
    "forward (+ reference forward for grpo) + loss + backward + AdamW step, timed; zero_grad(set_to_none) "
    "before it, untimed; m queries x G responses, T prompt + L response tokens each"
)

# Qwen2.5 architectures (public configs); random weights, so only the shapes matter.
MODELS: Dict[str, Dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    # for the smoke test only
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True),
}


@dataclass(frozen=True)
class StepCase:
    model: str
    layers: Optional[int]  # None: the model's own depth
    queries: int  # m
    group: int  # G
    prompt_len: int  # T
    response_len: int  # L
    tau: float
    dtype: str

    @property
    def tokens(self) -> int:
        return self.queries * self.group * (self.prompt_len + self.response_len)

    def label(self) -> str:
        return self.model + (f"/{self.layers}L" if self.layers is not None else "")


def preset_cases(device: str, quick: bool) -> List[StepCase]:
    if device == "cuda":
        cases = [StepCase("qwen2.5-0.5b", None, 4, 8, 128, 384, 1.0, "bf16")]  # N = 16384
        if not quick:
            cases.append(StepCase("qwen2.5-1.5b", None, 4, 8, 128, 384, 1.0, "bf16"))
            cases.append(StepCase("qwen2.5-0.5b", None, 8, 8, 128, 384, 1.0, "bf16"))  # N = 32768
        return cases
    if quick:  # CPU: the real width and vocabulary, two layers, 256 tokens
        return [StepCase("qwen2.5-0.5b", 2, 2, 2, 32, 32, 1.0, "fp32")]
    return [StepCase("qwen2.5-0.5b", 4, 2, 4, 32, 32, 1.0, "fp32")]


# ----------------------------------------------------------------------------- model and batch


def build_model(case: StepCase, device: str, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    kw = dict(MODELS[case.model])
    if case.layers is not None:
        kw["num_hidden_layers"] = case.layers
    config = Qwen2Config(**kw, use_cache=False)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[case.dtype]
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(config, dtype=dtype)
    return model


def make_batch(case: StepCase, vocab: int, device: str, seed: int = 0):
    """input_ids [B, S] and the PackedLossBatch of their N = B S rows (B = m G, S = T + L)."""
    from erpo_kernels import PackedLossBatch

    g = torch.Generator().manual_seed(seed)
    m, G, T, L = case.queries, case.group, case.prompt_len, case.response_len
    B, S = m * G, T + L
    ignore = -100
    prompts = torch.randint(0, vocab, (m, T), generator=g)  # [m, T]
    ids = torch.randint(0, vocab, (B, S), generator=g)  # [B, S]
    ids[:, :T] = prompts.repeat_interleave(G, dim=0)  # the G copies of a query share its prompt
    targets = torch.full((B, S), ignore, dtype=torch.long)
    targets[:, : S - 1] = ids[:, 1:]  # row t scores token t + 1 of its own sequence
    copy = torch.arange(B) % G
    targets[copy != 0, : T - 1] = ignore  # the prompt is scored once per group
    inv_t = torch.ones(B, S)
    inv_t[:, T - 1 :] = 1.0 / case.tau  # response rows at 1 / tau
    starts = torch.arange(B) * S
    cu = torch.stack([starts, starts + T - 1], dim=1).reshape(-1)  # prompt_b, response_b starts
    cu = torch.cat([cu, torch.tensor([B * S])])  # [2B + 1]
    rewards = torch.randn(B, generator=g).view(m, G)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).reshape(B)
    ref_q = -(T - 1) * math.log(vocab) + torch.randn(m, generator=g)  # near l_theta of a random model
    w = 0.5 + torch.rand(m, generator=g)
    batch = PackedLossBatch(
        targets=targets.reshape(-1).to(device),
        inv_temperature=inv_t.reshape(-1).to(device),
        span_cu_seqlens=cu.to(device),
        group_index=(torch.arange(B) // G).to(device),
        advantages=adv.float().to(device),
        ref_query_logp=ref_q.float().to(device),
        query_weights=(w / w.mean()).float().to(device),
        ignore_index=ignore,
    )
    return ids.to(device), batch


def skewed_lengths(count: int, max_len: int, seed: int = 0) -> List[int]:
    """`count` response lengths in [1, max_len] skewed as RL rollouts are: exponential with
    mean max_len / 4 (most responses short, a long tail), the first at max_len so the
    padded width is T + max_len."""
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(count).exponential_(generator=g) * (max_len / 4)
    lengths = x.round().clamp(1, max_len).long().tolist()
    lengths[0] = max_len
    return lengths


def make_packed_batch(case: StepCase, vocab: int, device: str, seed: int = 0):
    """(erpo.packing.PackedSequences, PackedLossBatch) of m prompts of T tokens and G responses
    each with skewed_lengths: the batch of the erpo-padded and erpo-packed variants."""
    from erpo.packing import pack

    g = torch.Generator().manual_seed(seed)
    m, G, T = case.queries, case.group, case.prompt_len
    lengths = skewed_lengths(m * G, case.response_len, seed)
    prompts = torch.randint(0, vocab, (m, T), generator=g).tolist()  # m prompts
    responses = [[torch.randint(0, vocab, (lengths[q * G + j],), generator=g).tolist() for j in range(G)]
                 for q in range(m)]  # [m][G] token lists
    packed = pack(prompts, responses, case.tau).to(device)
    rewards = torch.randn(m, G, generator=g)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).reshape(-1)  # [B]
    ref_q = -(T - 1) * math.log(vocab) + torch.randn(m, generator=g)  # [m]
    w = 0.5 + torch.rand(m, generator=g)
    return packed, packed.loss_batch(adv, ref_q, w / w.mean())


def case_tokens(case: StepCase, variant: str) -> int:
    """The real tokens N of a variant's batch (skewed lengths for the packing variants)."""
    if is_packing_variant(variant):
        return case.queries * case.group * case.prompt_len + sum(
            skewed_lengths(case.queries * case.group, case.response_len))
    return case.tokens


def stock_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, inv_t: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The usual path: logits [N, V], targets [N], inv_t [N] -> logp [N] (fp32 log_softmax of
    logits * inv_t, gather) and the entropy [N] under no_grad, in row chunks (metric only)."""
    lp_all = torch.log_softmax(logits.float() * inv_t[:, None], dim=-1)  # [N, V] fp32
    tgt = targets.clamp(min=0)  # ignored rows read column 0; the loss masks them
    logp = lp_all.gather(1, tgt[:, None]).squeeze(1)  # [N]
    with torch.no_grad():
        ent = torch.empty_like(logp)
        step = max(1, (1 << 22) // logits.shape[1])
        for a in range(0, logits.shape[0], step):
            c = lp_all[a : a + step]
            ent[a : a + step] = -(c.exp() * c).sum(-1)
    return logp, ent


# ----------------------------------------------------------------------------- one step


def make_step(case: StepCase, variant: str, device: str):
    """(model, optimizer, step function, N, peaks) of one variant.

    The step function returns the loss metrics; `peaks` collects the device's peak memory
    read after each step's backward (before the optimizer step).
    """
    import erpo_kernels
    from erpo_kernels import LossConfig, erpo_loss, erpo_loss_from_logp

    model = build_model(case, device, seed=0)
    model.train()
    vocab = model.config.vocab_size
    if is_packing_variant(variant):
        return _packing_step(case, variant, device, model)
    ids, batch = make_batch(case, vocab, device)
    n = ids.numel()
    ref = None
    if variant.startswith("grpo"):
        ref = build_model(case, device, seed=1).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
    config = LossConfig(algorithm="grpo" if variant.startswith("grpo") else "erpo")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    fused = variant.endswith("fused")
    peaks: List[int] = []
    path: List[str] = []  # erpo_loss's path (fused variants)

    def ref_logp() -> torch.Tensor:
        with torch.no_grad():
            if fused:
                h = ref.model(input_ids=ids).last_hidden_state.reshape(n, -1)  # [N, D]
                return erpo_kernels.linear_token_logprobs(
                    h, ref.lm_head.weight, batch.targets, inv_temperature=batch.inv_temperature)
            logits = ref(input_ids=ids).logits.reshape(n, -1)  # [N, V]
            return stock_logprobs(logits, batch.targets, batch.inv_temperature)[0]

    def step():
        if ref is not None:
            batch.ref_logp = ref_logp()
        if fused:
            hidden = model.model(input_ids=ids).last_hidden_state.reshape(n, -1)  # [N, D]
            if not path:
                path.append(fused_loss_path(hidden, model.lm_head.weight, batch, config))
            loss, metrics = erpo_loss(hidden, model.lm_head.weight, batch, config)
        else:
            logits = model(input_ids=ids).logits.reshape(n, -1)  # [N, V]
            logp, ent = stock_logprobs(logits, batch.targets, batch.inv_temperature)
            del logits
            loss, metrics = erpo_loss_from_logp(logp, batch, config, entropy=ent)
        loss.backward()
        peaks.append(_current_peak(device))  # the peak of forward + loss + backward, before the optimizer
        opt.step()
        batch.ref_logp = None
        return metrics

    step.loss_path = path  # type: ignore[attr-defined]
    return model, opt, step, n, peaks


def _packing_step(case: StepCase, variant: str, device: str, model: Any):
    """make_step's result for erpo-padded / erpo-packed: the erpo-fused step on the skewed
    batch, forwarded padded or packed."""
    from erpo.packing import forward_hidden, forward_hidden_padded, set_attn_implementation
    from erpo_kernels import LossConfig, erpo_loss

    packed, batch = make_packed_batch(case, model.config.vocab_size, device)
    if variant == "erpo-packed":
        set_attn_implementation(model, "auto")
    config = LossConfig(algorithm="erpo")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    peaks: List[int] = []

    budget = micro_budget(variant)
    if budget is not None:
        return model, opt, _micro_step(model, opt, packed, batch, config, budget, device, peaks), packed.num_rows, peaks

    def step():
        if variant == "erpo-packed":
            hidden = forward_hidden(model, packed.input_ids, packed.position_ids)  # [N, D], one row
        else:
            hidden = forward_hidden_padded(model, packed.input_ids, packed.seq_cu_seqlens)  # [N, D] via [B, T + L]
        loss, metrics = erpo_loss(hidden, model.lm_head.weight, batch, config)
        loss.backward()
        peaks.append(_current_peak(device))
        opt.step()
        return metrics

    return model, opt, step, packed.num_rows, peaks


def _micro_step(model: Any, opt: Any, packed: Any, batch: Any, config: Any, budget: int, device: str,
                peaks: List[int]):
    """The erpo-micro-K step function: micro-batches of at most `budget` rows, gradients
    accumulated, normalised by the whole batch (erpo_kernels' micro-batch API)."""
    from erpo.packing import forward_hidden
    from erpo_kernels import LossNormalizers, combine_metrics, erpo_loss, plan_micro_batches, split_batch

    norm = LossNormalizers.of(batch)
    micros = split_batch(batch, plan_micro_batches(batch, budget))

    def step():
        parts = []
        for micro in micros:
            hidden = forward_hidden(model, packed.input_ids[micro.rows], packed.position_ids[micro.rows])  # [n_k, D]
            loss, metrics = erpo_loss(hidden, model.lm_head.weight, micro.batch, config, normalizers=norm)
            loss.backward()  # gradients accumulate
            parts.append(metrics)
        peaks.append(_current_peak(device))
        opt.step()
        return combine_metrics(parts)

    return step


def rows_per_chunk(budget: int, vocab: int, dtype: torch.dtype) -> int:
    """erpo_kernels.fused_linear_loss.rows_for_budget at any commit that has it: for operands
    of `dtype` where it takes one (16-bit kept logits), else its rows of fp32 kept logits."""
    import inspect

    from erpo_kernels.fused_linear_loss import rows_for_budget

    if len(inspect.signature(rows_for_budget).parameters) >= 3:
        return rows_for_budget(budget, vocab, dtype)
    return rows_for_budget(budget, vocab)


def fused_loss_path(hidden: torch.Tensor, weight: torch.Tensor, batch: Any, config: Any) -> str:
    """Which path erpo_loss(hidden, weight, batch, config) takes: "fused (3 GEMMs)", or
    "4-GEMM: " and why not (erpo_kernels.objective.fused's rules; reads span_cu_seqlens)."""
    try:
        from erpo_kernels.objective.fused import check_fused_budget, fused_path_reason
        from erpo_kernels.objective.micro_batches import row_chunks
    except ImportError:
        return "4-GEMM: this erpo_kernels has no fused path"
    budget = check_fused_budget(None)
    reason = fused_path_reason(hidden, weight, None, config, None, "auto", budget)
    if reason is None and row_chunks(batch, rows_per_chunk(budget, weight.shape[0], hidden.dtype)) is None:
        reason = "a sequence longer than a chunk"
    return "fused (3 GEMMs)" if reason is None else f"4-GEMM: {reason}"


def _current_peak(device: str) -> int:
    return torch.cuda.max_memory_allocated() if device == "cuda" else peak_rss_bytes()


def measure_variant(case: StepCase, variant: str, device: str, warmup: int, repeats: int) -> Measurement:
    model, opt, step, n, peaks = make_step(case, variant, device)
    last: Dict[str, Any] = {}
    warmup = max(1, warmup)  # the first step creates the optimizer state

    def prepare():
        opt.zero_grad(set_to_none=True)

    def region(_):
        last.update(step())

    m = measure(prepare, region, device=device, warmup=warmup, repeats=repeats)
    if peaks and m.before_mb is not None:  # peaks[-1] was read during the memory run (the last one)
        m.extra["peak_extra_fwd_bwd_mb"] = round(max(0.0, peaks[-1] / MIB - m.before_mb), 2)
    m.extra["loss"] = last.get("loss")
    if getattr(step, "loss_path", None):
        m.extra["loss_path"] = step.loss_path[0]
    m.extra["finite"] = bool(all(math.isfinite(v) for v in last.values())) if last else False
    m.extra["params_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)
    if m.median_ms:
        m.extra["tokens_per_s"] = round(n / (m.median_ms * 1e-3), 1)
    return m


def worker(spec: Dict[str, Any], device: str = "cpu") -> Dict[str, Any]:
    """One measurement from its JSON spec (in a subprocess on CPU: python -m bench _worker step SPEC)."""
    case = StepCase(**spec["case"])
    return guarded(
        lambda: measure_variant(case, spec["variant"], device, spec["warmup"], spec["repeats"]), device
    ).to_dict()


# ----------------------------------------------------------------------------- the run


def run(cases: List[StepCase], variants: Sequence[str], opts: RunOptions) -> Dict[str, Any]:
    """Measure every (case, variant), rewriting the run in <out_dir>/<machine>.json after each."""
    bad = [v for v in variants if v not in VARIANTS and micro_budget(v) is None]
    if bad:
        raise SystemExit(f"unknown variant(s) {bad}; known: {list(VARIANTS)} and {MICRO_PREFIX}K")
    header = run_header("step", opts)
    header["step_definition"] = STEP_DEFINITION
    out = report.RunWriter(header, opts)
    print(f"[bench step] {header['device_name']}; results -> {out.path}")
    for case in cases:
        for variant in variants:
            if out.spent():
                out.skip({"case": asdict(case), "variant": variant})
                continue
            spec = {"case": asdict(case), "variant": variant, "warmup": opts.warmup, "repeats": opts.repeats}
            rec = {"model": case.label(), "tokens": case_tokens(case, variant), "variant": variant, "case": asdict(case),
                   **measure_isolated("step", spec, worker, opts)}
            out.add(rec)
            if rec.get("status") == "ok":
                print(f"  {case.label():<16} N={rec['tokens']:<6} {variant:<11} {rec['median_ms']:>10.1f} ms "
                      f"{rec.get('tokens_per_s')} tokens/s "
                      f"{rec['peak_extra_mb']:>9.0f} MiB extra, fwd+bwd {rec.get('peak_extra_fwd_bwd_mb')} MiB "
                      f"(resident before {rec['before_mb']:.0f} MiB) "
                      f"loss {rec.get('loss')}", flush=True)
            else:
                print(f"  {case.label():<16} N={rec['tokens']:<6} {variant:<11} {rec.get('status')}: {rec.get('error')}",
                      flush=True)
    return out.finish(lambda run: "\n".join(report.step_table({"runs": [run]})))
