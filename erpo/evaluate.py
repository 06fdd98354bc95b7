"""The stability evaluation of docs/method.md section 8.

For every temperature in ``TEMPERATURES`` the model samples ``n_samples`` completions
per problem; Avg@n is the mean correctness over all samples, Pass@k the unbiased
estimator 1 - C(n-c, k) / C(n, k) averaged over problems (c = correct samples of a
problem). Pass@1 of greedy decoding is reported once, next to the mean over
temperatures of every column. This module scores; erpo.eval_report writes the reports
(JSON, a markdown table, an accuracy-vs-temperature plot; several runs overlaid) and
erpo.eval_command is `erpo eval`.

Sampling is plain temperature sampling (top_p = 1, top_k = 0, no repetition penalty),
whatever the model's own generation_config says, so numbers compare across models.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .config import EVAL_TEMPERATURES, check_protocol
from .data import derived_seed
from .rewards import CORRECT_THRESHOLD
from .rollout import eos_ids_of, generate_ids

__all__ = [
    "CORRECT_THRESHOLD",
    "TEMPERATURES",
    "EvalResult",
    "TemperatureRow",
    "Sampler",
    "evaluate",
    "evaluate_sampler",
    "pass_at_k",
]

TEMPERATURES = tuple(EVAL_TEMPERATURES)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased Pass@k of one problem with ``c`` correct out of ``n`` samples:
    1 - C(n-c, k) / C(n, k), as the product 1 - prod_{i=n-c+1}^{n} (1 - k / i), which
    never forms a large binomial."""
    if n < 1:
        raise ValueError(f"n: need at least one sample, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"c: correct count must be in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k: must be in [1, n={n}], got {k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


@dataclass
class TemperatureRow:
    """Results at one sampling temperature."""

    temperature: float
    avg_at_n: float               # mean correctness over n_problems x n_samples samples
    pass_at_k: dict[int, float]   # k -> Pass@k averaged over problems
    n_correct: list[int]          # [n_problems] correct samples of each problem

    def to_dict(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "avg_at_n": self.avg_at_n,
            "pass_at_k": {str(k): v for k, v in self.pass_at_k.items()},
            "n_correct": list(self.n_correct),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TemperatureRow":
        return cls(
            temperature=float(d["temperature"]),
            avg_at_n=float(d["avg_at_n"]),
            pass_at_k={int(k): float(v) for k, v in d["pass_at_k"].items()},
            n_correct=[int(c) for c in d["n_correct"]],
        )


@dataclass
class EvalResult:
    """One evaluation: a row per temperature, greedy Pass@1, and their means."""

    rows: list[TemperatureRow]
    greedy_pass_at_1: float
    n_samples: int
    n_problems: int
    greedy_correct: list[int] = field(default_factory=list)  # [n_problems] 0/1
    settings: dict[str, Any] = field(default_factory=dict)   # max_new_tokens, seed, ...
    # every completion, when kept: {"problem", "temperature" (0 = greedy), "completion", "correct"}
    samples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def temperatures(self) -> list[float]:
        return [row.temperature for row in self.rows]

    @property
    def k_values(self) -> list[int]:
        return sorted(self.rows[0].pass_at_k) if self.rows else []

    @property
    def mean_avg_at_n(self) -> float:
        """Avg@n averaged over temperatures."""
        return sum(row.avg_at_n for row in self.rows) / len(self.rows)

    @property
    def mean_pass_at_k(self) -> dict[int, float]:
        """Pass@k averaged over temperatures, for each k."""
        return {k: sum(row.pass_at_k[k] for row in self.rows) / len(self.rows) for k in self.k_values}

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_samples": self.n_samples,
            "n_problems": self.n_problems,
            "k_values": self.k_values,
            "greedy_pass_at_1": self.greedy_pass_at_1,
            "mean": {
                "avg_at_n": self.mean_avg_at_n,
                "pass_at_k": {str(k): v for k, v in self.mean_pass_at_k.items()},
            },
            "rows": [row.to_dict() for row in self.rows],
            "greedy_correct": list(self.greedy_correct),
            "settings": dict(self.settings),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EvalResult":
        """Inverse of to_dict (the "mean" entry is recomputed, not read)."""
        return cls(
            rows=[TemperatureRow.from_dict(r) for r in d["rows"]],
            greedy_pass_at_1=float(d["greedy_pass_at_1"]),
            n_samples=int(d["n_samples"]),
            n_problems=int(d["n_problems"]),
            greedy_correct=[int(c) for c in d.get("greedy_correct", [])],
            settings=dict(d.get("settings", {})),
        )

    @classmethod
    def load(cls, path: str | Path) -> "EvalResult":
        """Read an eval.json written by write_report."""
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


# ----------------------------------------------------------------------------- evaluation

# sampler(problems, temperature) -> one completion per entry of ``problems`` (problem
# indices; one index repeats once per sample); temperature 0 means greedy decoding.
Sampler = Callable[[Sequence[int], float], Sequence[str]]


def _check_eval_args(answers, temperatures, n_samples, k_values, batch_size, reward_fn) -> None:
    if len(answers) == 0:
        raise ValueError("answers: need at least one problem to evaluate")
    if not callable(reward_fn):
        raise ValueError("reward_fn: must be a callable (completion, answer) -> float")
    check_protocol(temperatures, n_samples, k_values, batch_size)


def _grade(sampler: Sampler, answers: Sequence[str], reward_fn: Callable[[str, str], float], batch_size: int,
           samples: list[dict[str, Any]] | None, items: list[int], temperature: float, per_problem: int,
           bar: Any) -> list[int]:
    """Correctness (0/1) of one completion for each problem index in ``items``, sampled
    ``batch_size`` at a time; every completion appended to ``samples`` unless None. The
    bar advances by the problems finished (``per_problem`` sequences each)."""
    results: list[int] = []
    for start in range(0, len(items), batch_size):
        chunk = items[start:start + batch_size]
        completions = list(sampler(chunk, temperature))
        if len(completions) != len(chunk):
            raise ValueError(f"sampler: returned {len(completions)} completions for {len(chunk)} sequences")
        for completion, i in zip(completions, chunk):
            results.append(int(float(reward_fn(completion, answers[i])) >= CORRECT_THRESHOLD))
            if samples is not None:
                samples.append({"problem": i, "temperature": temperature, "completion": completion,
                                "correct": results[-1]})
        bar.update((start + len(chunk)) // per_problem - start // per_problem)  # problems finished
    return results


def _problem_order(order: Sequence[int] | None, n_problems: int) -> list[int]:
    """``order`` as a list (default 0..P-1), checked to be a permutation of the problems."""
    order = list(range(n_problems)) if order is None else [int(i) for i in order]
    if sorted(order) != list(range(n_problems)):
        raise ValueError(f"order: must be a permutation of the {n_problems} problem indices")
    return order


def _temperature_row(temperature: float, n_correct: list[int], n_samples: int, k_values: list[int]) -> TemperatureRow:
    """Avg@n and Pass@k at one temperature from each problem's count of correct samples."""
    n_problems = len(n_correct)
    return TemperatureRow(
        temperature=temperature,
        avg_at_n=sum(n_correct) / (n_problems * n_samples),
        pass_at_k={k: sum(pass_at_k(n_samples, c, k) for c in n_correct) / n_problems for k in k_values},
        n_correct=n_correct,
    )


def evaluate_sampler(
    sampler: Sampler,
    answers: Sequence[str],
    *,
    reward_fn: Callable[[str, str], float],
    temperatures: Sequence[float] = TEMPERATURES,
    n_samples: int = 4,
    k_values: Sequence[int] | None = None,
    batch_size: int = 16,
    seed: int = 0,
    order: Sequence[int] | None = None,
    progress: bool = True,
    rng_devices: Sequence[torch.device] = (),
    keep_samples: bool = False,
) -> EvalResult:
    """The protocol of docs/method.md s.8 around any sampler: greedy Pass@1, then at every
    temperature ``n_samples`` completions per problem, Avg@n and Pass@k (every k in
    ``k_values``; None = every k from 1 to n_samples).

    ``answers[i]`` is problem i's gold answer; a completion is correct when
    ``reward_fn(completion, answer) >= CORRECT_THRESHOLD``. The sampler is called with at
    most ``batch_size`` sequences at a time, problems in ``order`` (default 0..P-1; the
    samples of one problem are consecutive). Torch's RNG is seeded per temperature from
    ``seed`` inside a fork (CPU and ``rng_devices``), so the caller's state is kept. The
    progress bar counts temperatures x problems (greedy included). ``keep_samples`` keeps
    every completion and its grade in ``result.samples``.
    """
    from tqdm.auto import tqdm

    _check_eval_args(answers, temperatures, n_samples, k_values, batch_size, reward_fn)
    n_problems = len(answers)
    order = _problem_order(order, n_problems)
    k_values = list(range(1, n_samples + 1)) if k_values is None else sorted({int(k) for k in k_values})
    sampled_items = [i for i in order for _ in range(n_samples)]  # problem index of each sampled sequence
    samples: list[dict[str, Any]] = []
    grade = functools.partial(_grade, sampler, answers, reward_fn, batch_size, samples if keep_samples else None)

    rng_devices = [torch.device(d) for d in rng_devices]
    device_type = rng_devices[0].type if rng_devices else "cuda"
    bar = tqdm(total=n_problems * (1 + len(temperatures)), desc="eval", unit="problem", disable=not progress,
               leave=False)
    with torch.random.fork_rng(devices=rng_devices, device_type=device_type), bar:
        bar.set_postfix_str("greedy")
        greedy = dict(zip(order, grade(order, 0.0, 1, bar)))
        greedy_correct = [greedy[i] for i in range(n_problems)]
        rows = []
        for t_index, temperature in enumerate(temperatures):
            bar.set_postfix_str(f"T={temperature:g}")
            torch.manual_seed(derived_seed(seed, "eval", t_index))
            n_correct = [0] * n_problems
            for problem, ok in zip(sampled_items, grade(sampled_items, float(temperature), n_samples, bar)):
                n_correct[problem] += ok
            rows.append(_temperature_row(float(temperature), n_correct, n_samples, k_values))

    settings = {"seed": seed, "batch_size": batch_size, "correct_threshold": CORRECT_THRESHOLD}
    return EvalResult(rows=rows, greedy_pass_at_1=sum(greedy_correct) / n_problems, n_samples=n_samples,
                      n_problems=n_problems, greedy_correct=greedy_correct, settings=settings, samples=samples)


def _pad_and_eos(model: Any, tokenizer: Any) -> tuple[int, list[int]]:
    """(pad token id, EOS token ids) for generation; pad falls back to EOS."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = eos_ids_of(model, tokenizer)
    if pad_id is None or not eos_ids:
        raise ValueError("tokenizer: needs an eos token (and a pad token, or eos is used to pad)")
    return pad_id, eos_ids


def _encode(tokenizer: Any, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
    """Token ids of each prompt: strings tokenised without special tokens, id lists as they are."""
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else [int(t) for t in p]
               for p in prompts]
    empty = [i for i, ids in enumerate(encoded) if not ids]
    if empty:
        raise ValueError(f"prompts: prompt {empty[0]} has no tokens")
    return encoded


def evaluate(
    model,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    answers: Sequence[str],
    *,
    reward_fn: Callable[[str, str], float],
    temperatures: Sequence[float] = TEMPERATURES,
    n_samples: int = 4,
    k_values: Sequence[int] | None = None,
    max_new_tokens: int = 64,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = True,
    keep_samples: bool = False,
) -> EvalResult:
    """Avg@n and Pass@k at every temperature, and greedy Pass@1 (docs/method.md s.8), of a
    Hugging Face causal LM: ``evaluate_sampler`` with batched ``model.generate``.

    ``prompts`` are fully templated strings (tokenised without adding special tokens)
    or prompt token ids (used as they are, e.g. the training prompts with their BOS);
    ``answers`` the gold answers, one per prompt. ``k_values`` None = every k <= n_samples.
    ``batch_size`` counts sequences per ``model.generate`` call (erpo.rollout.generate_ids);
    prompts of similar length are batched together. The same arguments give the same
    result; the caller's RNG state, the model's mode and generation_config and the
    tokenizer are left unchanged.
    """
    if len(answers) != len(prompts):
        raise ValueError(f"answers: need one answer per prompt, got {len(answers)} for {len(prompts)} prompts")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    pad_id, eos_ids = _pad_and_eos(model, tokenizer)
    encoded = _encode(tokenizer, prompts)
    counts = {"sequences": 0, "truncated": 0}

    def sample(problems: Sequence[int], temperature: float) -> list[str]:
        responses = generate_ids(model, [encoded[i] for i in problems], temperature=temperature,
                                 max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_ids=eos_ids)
        counts["sequences"] += len(responses)
        counts["truncated"] += sum(len(r) >= max_new_tokens and r[-1] not in eos_ids for r in responses)
        # generate_ids cuts each response after its first EOS; the EOS itself is not text
        return [tokenizer.decode(tokens[:-1] if tokens and tokens[-1] in eos_ids else tokens, skip_special_tokens=True)
                for tokens in responses]

    was_training = model.training
    model.eval()
    try:
        result = evaluate_sampler(
            sample, answers, reward_fn=reward_fn, temperatures=temperatures, n_samples=n_samples,
            k_values=k_values, batch_size=batch_size, seed=seed, progress=progress,
            order=sorted(range(len(prompts)), key=lambda i: len(encoded[i])),  # similar lengths batch together
            rng_devices=[model.device] if model.device.type != "cpu" else [], keep_samples=keep_samples,
        )
    finally:
        model.train(was_training)
    result.settings.update({"max_new_tokens": max_new_tokens, "top_p": 1.0, "top_k": 0,
                            "truncated_fraction": counts["truncated"] / max(1, counts["sequences"])})
    return result
