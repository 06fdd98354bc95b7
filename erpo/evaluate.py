"""The stability evaluation of docs/method.md section 8.

For every temperature in ``TEMPERATURES`` the model samples ``n_samples`` completions
per problem; Avg@n is the mean correctness over all samples, Pass@k the unbiased
estimator 1 - C(n-c, k) / C(n, k) averaged over problems (c = correct samples of a
problem). Pass@1 of greedy decoding is reported once, next to the mean over
temperatures of every column. ``write_report`` writes the numbers as JSON, a markdown
table and an accuracy-vs-temperature plot; ``compare_report`` overlays several runs;
``eval_command`` is `erpo eval`.

Sampling is plain temperature sampling (top_p = 1, top_k = 0, no repetition penalty),
whatever the model's own generation_config says, so numbers compare across models.
"""
from __future__ import annotations

import functools
import io
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .atomic import atomic_write
from .config import EVAL_TEMPERATURES, TrainConfig
from .errors import ErpoError
from .data import derived_seed
from .rewards import CORRECT_THRESHOLD
from .rollout import eos_ids_of, generate_ids

__all__ = [
    "CORRECT_THRESHOLD",
    "TEMPERATURES",
    "EvalResult",
    "TemperatureRow",
    "Sampler",
    "compare_report",
    "compare_table",
    "eval_command",
    "evaluate",
    "evaluate_sampler",
    "format_table",
    "pass_at_k",
    "write_report",
]

TEMPERATURES = tuple(EVAL_TEMPERATURES)
TRUNCATION_WARNING = 0.05  # `erpo eval` warns when more responses than this ran into max_new_tokens


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
    if len(temperatures) == 0 or any(not (t > 0) or math.isinf(t) for t in temperatures):
        raise ValueError(f"temperatures: need finite temperatures > 0, got {tuple(temperatures)} (greedy decoding, "
                         f"temperature 0, is always reported as Pass@1)")
    if len(set(temperatures)) != len(temperatures):
        raise ValueError(f"temperatures: a temperature is listed twice in {tuple(temperatures)}")
    if n_samples < 1:
        raise ValueError(f"n_samples: must be >= 1, got {n_samples}")
    if k_values is not None and (len(k_values) == 0 or any(not 1 <= int(k) <= n_samples for k in k_values)):
        raise ValueError(f"k_values: each k must be in [1, n_samples={n_samples}], got {tuple(k_values)}")
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")


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


# ----------------------------------------------------------------------------- reports


def _fmt(x: float) -> str:
    return f"{x:.4f}"


def _fmt_temperature(t: float) -> str:
    s = f"{t:g}"
    return s if any(ch in s for ch in ".e") else s + ".0"   # 1 -> "1.0", 0.05 -> "0.05"


def _markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table with padded columns, so it also reads as a table on a terminal."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), rule, *map(line, rows)]) + "\n"


def format_table(result: EvalResult, brief: bool = False) -> str:
    """The results as a markdown table (a row per temperature, a mean row) and the
    greedy Pass@1 line: what eval.md holds and `erpo eval` prints. ``brief``: with more
    than 8 values of k, only Pass@1, the powers of two and Pass@n (for a terminal)."""
    n = result.n_samples
    ks = result.k_values
    if brief and len(ks) > 8:
        ks = [k for k in ks if k & (k - 1) == 0 or k == ks[-1]]
    header = ["temperature", f"Avg@{n}"] + [f"Pass@{k}" for k in ks]
    rows = [[_fmt_temperature(r.temperature), _fmt(r.avg_at_n)] + [_fmt(r.pass_at_k[k]) for k in ks]
            for r in result.rows]
    mean_pass = result.mean_pass_at_k
    rows.append(["mean", _fmt(result.mean_avg_at_n)] + [_fmt(mean_pass[k]) for k in ks])
    return _markdown_table(header, rows) + f"\nGreedy Pass@1: {_fmt(result.greedy_pass_at_1)}\n"


def _eval_markdown(result: EvalResult, title: str) -> str:
    text = f"# {title}\n\n" if title else ""
    text += (f"{result.n_problems} problems, {result.n_samples} samples per problem and temperature; "
             f"Pass@k is the unbiased estimator (its Pass@1 at a temperature equals Avg@{result.n_samples}); "
             f"the method's Pass@1 is greedy decoding's, below the table.\n\n")
    return text + format_table(result) + "\n![accuracy vs temperature](eval.png)\n"


def _png_bytes(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    return buffer.getvalue()


def _plotted_ks(ks: list[int]) -> list[int]:
    """The Pass@k curves worth drawing: not k = 1 (the unbiased Pass@1 equals Avg@n); all
    others up to 5 of them, else the powers of two and the largest k."""
    ks = [k for k in ks if k > 1]
    return ks if len(ks) <= 5 else [k for k in ks if k & (k - 1) == 0 or k == ks[-1]]


def _eval_figure(result: EvalResult, title: str):
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg canvas

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot(1, 1, 1)
    rows = sorted(result.rows, key=lambda r: r.temperature)
    temps = [r.temperature for r in rows]
    ax.plot(temps, [r.avg_at_n for r in rows], marker="o", linewidth=2, label=f"Avg@{result.n_samples} (= Pass@1)")
    for k in _plotted_ks(result.k_values):
        ax.plot(temps, [r.pass_at_k[k] for r in rows], marker=".", linestyle="--", label=f"Pass@{k}")
    ax.axhline(result.greedy_pass_at_1, color="black", linestyle=":", label="greedy Pass@1")
    ax.set_xlabel("sampling temperature")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title or "accuracy vs temperature")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def write_report(result: EvalResult, out_dir: str | Path, title: str = "",
                 questions: Sequence[str] | None = None, answers: Sequence[str] | None = None) -> dict[str, Path]:
    """Write eval.json, eval.md (table: a row per temperature, a mean row, greedy Pass@1)
    and eval.png (accuracy vs temperature) into ``out_dir``, each atomically; with kept
    samples also samples.jsonl, a line per completion (with its problem's question and
    gold answer when given).

    Returns {"json": path, "md": path, "png": path} (and "samples").
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "eval.json", "md": out / "eval.md", "png": out / "eval.png"}
    payload = result.to_dict()
    if title:
        payload["title"] = title
    atomic_write(paths["json"], (json.dumps(payload, indent=2) + "\n").encode("utf-8"))
    atomic_write(paths["md"], _eval_markdown(result, title).encode("utf-8"))
    atomic_write(paths["png"], _png_bytes(_eval_figure(result, title)))
    if result.samples:
        paths["samples"] = out / "samples.jsonl"
        lines = []
        for sample in result.samples:
            extra = {}
            if questions is not None:
                extra["question"] = questions[sample["problem"]]
            if answers is not None:
                extra["answer"] = answers[sample["problem"]]
            lines.append(json.dumps({**sample, **extra}) + "\n")
        atomic_write(paths["samples"], "".join(lines).encode("utf-8"))
    elif (out / "samples.jsonl").exists():
        (out / "samples.jsonl").unlink()   # an earlier evaluation's: it would not match this report
    return paths


def compare_table(results: dict[str, EvalResult]) -> str:
    """Several runs side by side (markdown): Avg@n per temperature, then a summary row per
    run (means over temperatures of Avg@n and each Pass@k, greedy Pass@1)."""
    names = list(results)
    temps = sorted({t for r in results.values() for t in r.temperatures})
    by_temp = {name: {row.temperature: row.avg_at_n for row in results[name].rows} for name in names}
    header = ["temperature"] + [f"{name} Avg@{results[name].n_samples}" for name in names]
    rows = [[_fmt_temperature(t)] + [_fmt(by_temp[name][t]) if t in by_temp[name] else "-" for name in names]
            for t in temps]
    rows.append(["mean"] + [_fmt(results[name].mean_avg_at_n) for name in names])
    text = _markdown_table(header, rows)

    ks = sorted({k for r in results.values() for k in r.k_values})
    header = ["run", "problems", "mean Avg@n"] + [f"mean Pass@{k}" for k in ks] + ["greedy Pass@1"]
    rows = []
    for name in names:
        r = results[name]
        mean_pass = r.mean_pass_at_k
        rows.append([name, str(r.n_problems), _fmt(r.mean_avg_at_n)]
                    + [_fmt(mean_pass[k]) if k in mean_pass else "-" for k in ks]
                    + [_fmt(r.greedy_pass_at_1)])
    return text + "\n" + _markdown_table(header, rows)


def compare_report(results: dict[str, EvalResult], out_dir: str | Path) -> Path:
    """Overlay several runs (e.g. {"grpo": ..., "erpo": ...}): compare.png plots each
    run's Avg@n (solid) and Pass@n (dashed) against temperature, greedy Pass@1 dotted, one
    colour per run; compare.md holds compare_table; compare.json every result in full.

    Returns the path of compare.md (it links the plot next to it).
    """
    if not results:
        raise ValueError("results: need at least one run to compare")
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot(1, 1, 1)
    for i, (name, r) in enumerate(results.items()):
        color = f"C{i % 10}"
        rows = sorted(r.rows, key=lambda row: row.temperature)
        temps = [row.temperature for row in rows]
        ax.plot(temps, [row.avg_at_n for row in rows], marker="o", color=color, label=f"{name} Avg@{r.n_samples}")
        top = max(r.k_values)
        if top > 1:
            ax.plot(temps, [row.pass_at_k[top] for row in rows], marker=".", linestyle="--", color=color,
                    label=f"{name} Pass@{top}")
        ax.axhline(r.greedy_pass_at_1, color=color, linestyle=":", linewidth=1, label=f"{name} greedy Pass@1")
    ax.set_xlabel("sampling temperature")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("accuracy vs temperature")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    atomic_write(out / "compare.png", _png_bytes(fig))
    payload = {name: r.to_dict() for name, r in results.items()}
    atomic_write(out / "compare.json", (json.dumps(payload, indent=2) + "\n").encode("utf-8"))

    text = "# accuracy vs temperature\n\n" + compare_table(results) + "\n![accuracy vs temperature](compare.png)\n"
    path = out / "compare.md"
    atomic_write(path, text.encode("utf-8"))
    return path


# ----------------------------------------------------------------------------- `erpo eval`


def _unique(name: str, taken: set[str]) -> str:
    candidate, i = name, 2
    while candidate in taken:
        candidate, i = f"{name}-{i}", i + 1
    return candidate


def _eval_target(entry: str, cfg: TrainConfig, log: Callable[[str], None]) -> tuple[str, str]:
    """(model directory, report name) of one model= entry: a run (its latest checkpoint),
    a checkpoint RUN/checkpoints/step-N, a Hugging Face model directory, or tiny (the
    demo's warm-started starting model)."""
    from dataclasses import replace

    from . import checkpoint as ckpt
    from .data import load_examples
    from .models import check_model_dir
    from .tiny import resolve_model_dir

    if entry == "tiny":
        demo = replace(cfg, model="tiny")
        return resolve_model_dir(demo, load_examples(demo, "train"), log), "tiny-start"
    norm = os.path.normpath(entry)
    if os.path.isdir(os.path.join(norm, ckpt.CHECKPOINTS)) or os.path.isfile(os.path.join(norm, "config.yaml")):
        latest = ckpt.latest_checkpoint(norm)
        if latest is None:
            raise ErpoError(f"eval: run {entry} has no checkpoint yet; train it first, or evaluate another model=")
        return latest, f"{os.path.basename(norm)}-{os.path.basename(latest)}"
    if os.path.basename(norm) == ckpt.CHECKPOINTS and os.path.isdir(norm):
        run = os.path.dirname(norm) or "."
        raise ErpoError(f"model={entry} is the checkpoints folder: name the run (model={run}, its latest checkpoint) "
                        f"or every checkpoint with a quoted glob (model=\"{os.path.join(entry, '*')}\")")
    check_model_dir(entry, "model", "a run directory, a checkpoint (RUN/checkpoints/step-N), or tiny")
    name = os.path.basename(norm)
    if os.path.basename(os.path.dirname(norm)) == ckpt.CHECKPOINTS:
        name = f"{os.path.basename(os.path.dirname(os.path.dirname(norm)))}-{name}"
    return entry, name


# What a report depends on (besides the model's weights): `erpo eval` never replaces a
# report, or a comparison, made with other values without overwrite=true.
REPORT_SETTINGS = ("model", "data", "problems", "template", "reward", "temperatures", "n", "k", "max_new_tokens",
                   "seed", "batch_size")


def report_settings(report: dict[str, Any]) -> dict[str, Any]:
    """The REPORT_SETTINGS of an eval.json payload (EvalResult.to_dict)."""
    s = report.get("settings", {})
    return {
        "model": s.get("model_path") or os.path.abspath(str(s.get("model", ""))),
        "data": s.get("data_path", s.get("data")),
        "problems": report.get("n_problems"),
        "template": s.get("template"),
        "reward": s.get("reward"),
        "temperatures": sorted(float(row["temperature"]) for row in report.get("rows", [])),
        "n": report.get("n_samples"),
        "k": sorted(int(k) for k in report.get("k_values", [])),
        "max_new_tokens": s.get("max_new_tokens"),
        "seed": s.get("seed"),
        "batch_size": s.get("batch_size"),
    }


def _data_path(cfg: TrainConfig) -> str:
    data = cfg.eval_dataset or cfg.dataset
    return os.path.abspath(data) if os.path.isfile(data) else data


def _planned_settings(cfg: TrainConfig, model_dir: str, n_problems: int, max_new_tokens: int) -> dict[str, Any]:
    """report_settings of the report this `erpo eval` is about to write for ``model_dir``."""
    n = cfg.eval_n_samples
    return {
        "model": os.path.abspath(model_dir), "data": _data_path(cfg), "problems": n_problems,
        "template": cfg.eval_template, "reward": cfg.eval_reward,
        "temperatures": sorted(float(t) for t in cfg.eval_temperatures), "n": n,
        "k": sorted({int(k) for k in cfg.eval_k_values}) or list(range(1, n + 1)),
        "max_new_tokens": max_new_tokens, "seed": cfg.seed, "batch_size": cfg.eval_batch_size,
    }


def _fmt_setting(key: str, value: Any) -> str:
    if isinstance(value, list):
        value = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    return f"{key}={value}"


def _differences(old: dict[str, Any], new: dict[str, Any]) -> tuple[str, str]:
    keys = [k for k in REPORT_SETTINGS if old.get(k) != new.get(k)]
    return (" ".join(_fmt_setting(k, old.get(k)) for k in keys), " ".join(_fmt_setting(k, new.get(k)) for k in keys))


def check_no_silent_replace(out_root: str, planned: dict[str, dict[str, Any]]) -> None:
    """ErpoError (before any generation) when <out_root>/<name>/eval.json, or compare.json for
    several models, holds a report made with other settings than ``planned`` ({name: settings}).
    The same command again replaces its own report (it gives the same numbers)."""
    fix = "give another out=DIR to keep both, or overwrite=true to replace it"
    for name, new in planned.items():
        path = os.path.join(out_root, name, "eval.json")
        if not os.path.isfile(path):
            continue
        try:
            old = report_settings(json.loads(Path(path).read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError):
            raise ErpoError(f"{path} is not a report this version can read; {fix}") from None
        if old != new:
            was, now = _differences(old, new)
            raise ErpoError(f"{os.path.join(out_root, name)} holds a report made with {was} (this one: {now}); {fix}")
    path = os.path.join(out_root, "compare.json")
    if len(planned) > 1 and os.path.isfile(path):
        try:
            old_all = {name: report_settings(r) for name, r in json.loads(Path(path).read_text("utf-8")).items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ErpoError(f"{path} is not a comparison this version can read; {fix}") from None
        where = os.path.join(out_root, "compare.md")
        if list(old_all) != list(planned):
            raise ErpoError(f"{where} compares {', '.join(old_all)} (this one: {', '.join(planned)}); {fix}")
        for name, new in planned.items():
            if old_all[name] != new:
                was, now = _differences(old_all[name], new)
                raise ErpoError(f"{where} compares {name} made with {was} (this one: {now}); {fix}")


def _eval_entries(cfg: TrainConfig) -> list[str]:
    """cfg.eval_checkpoints, or the run's own directory (its latest checkpoint) when empty."""
    from . import checkpoint as ckpt

    if cfg.eval_checkpoints:
        return list(cfg.eval_checkpoints)
    if ckpt.latest_checkpoint(cfg.run_dir) is None:
        raise ErpoError(
            f"eval: {cfg.run_dir} holds no checkpoint to evaluate; train it first (make demo, or erpo train "
            f"run_dir={cfg.run_dir}) or name one: erpo eval model=RUN_OR_CHECKPOINT_OR_MODEL_DIR (model=tiny: the "
            f"demo's starting model)"
        )
    return [cfg.run_dir]


def _eval_targets(cfg: TrainConfig, log: Callable[[str], None]) -> dict[str, str]:
    """{model dir: report name} of every model= entry, each checked before the first long
    evaluation; a report per model and evaluation set (data= of another file adds its name)."""
    suffix = f"-{os.path.splitext(os.path.basename(cfg.eval_dataset))[0]}" if cfg.eval_dataset else ""
    targets: dict[str, str] = {}
    for entry in _eval_entries(cfg):
        model_dir, name = _eval_target(entry, cfg, log)
        if model_dir not in targets:
            targets[model_dir] = _unique(name + suffix, set(targets.values()))
    return targets


def _writable_out_root(cfg: TrainConfig) -> str:
    """The report directory (created), or an ErpoError now rather than after hours of generation."""
    out_root = cfg.eval_out or os.path.join(cfg.run_dir, "eval")
    if os.path.exists(out_root) and not os.path.isdir(out_root):
        raise ErpoError(f"out={out_root} is a file; give a directory for the reports with out=DIR")
    try:
        os.makedirs(out_root, exist_ok=True)
        probe = os.path.join(out_root, f".write-test-{os.getpid()}")
        open(probe, "wb").close()
        os.remove(probe)
    except OSError as exc:
        raise ErpoError(f"out={out_root}: reports cannot be written there ({exc.strerror}); give a writable "
                        f"directory with out=DIR") from None
    return out_root


def _evaluate_model(cfg: TrainConfig, model_dir: str, name: str, examples: Sequence[Any], out: str,
                    device: torch.device, dtype: torch.dtype, log: Callable[[str], None]) -> EvalResult:
    """Evaluate one model on `examples`, write its report to `out` and log its table."""
    from .data import encode_prompts
    from .models import load_model, load_tokenizer
    from .rewards import get_reward_fn

    max_new_tokens = cfg.eval_max_new_tokens or cfg.max_new_tokens
    model = load_model(model_dir, device, dtype).eval()
    tokenizer = load_tokenizer(model_dir)
    prompts = encode_prompts(tokenizer, examples, cfg.eval_template)  # as in training (BOS included)
    t0 = time.perf_counter()
    result = evaluate(
        model, tokenizer, prompts, [ex.answer for ex in examples], reward_fn=get_reward_fn(cfg.eval_reward),
        temperatures=cfg.eval_temperatures, n_samples=cfg.eval_n_samples, k_values=cfg.eval_k_values or None,
        max_new_tokens=max_new_tokens, batch_size=cfg.eval_batch_size,
        seed=cfg.seed, progress=cfg.progress, keep_samples=cfg.eval_save_samples,
    )
    result.settings.update({"model": model_dir, "data": cfg.eval_dataset or cfg.dataset, "template": cfg.eval_template,
                            "reward": cfg.eval_reward, "seconds": round(time.perf_counter() - t0, 2),
                            "model_path": os.path.abspath(model_dir), "data_path": _data_path(cfg)})
    written = write_report(result, out, title=name, questions=[ex.prompt for ex in examples],
                           answers=[ex.answer for ex in examples])
    every = " (every Pass@k in eval.md)" if len(result.k_values) > 8 else ""
    log(f"\n{name} ({result.settings['seconds']:.0f}s)\n\n{format_table(result, brief=True)}\n"
        f"-> {out}/{', '.join(p.name for p in written.values())}{every}")
    cut = result.settings["truncated_fraction"]
    if cut > TRUNCATION_WARNING:
        log(f"erpo: warning: {cut:.0%} of {name}'s responses reached max_new_tokens={max_new_tokens} without "
            f"ending; their answers may be cut off (raise max_new_tokens=)")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next model gets the memory back
    return result


def eval_command(cfg: TrainConfig, log: Callable[[str], None] = print) -> dict[str, str]:
    """`erpo eval`: evaluate each of cfg.eval_checkpoints (default: the latest checkpoint of
    cfg.run_dir) on the evaluation set; a table per model on the terminal, reports in
    <out>/<name>/ (eval.json, eval.md, eval.png), and with several models compare.{md,png,json}
    in <out> (cfg.eval_out, default <run_dir>/eval). Returns {name: report dir}."""
    from .data import load_examples
    from .models import resolve_compute_dtype, resolve_device

    cfg.validate()
    examples = load_examples(cfg, "eval")
    if cfg.eval_limit:
        examples = examples[: cfg.eval_limit]
    targets = _eval_targets(cfg, log)  # model dir -> report name
    out_root = _writable_out_root(cfg)
    max_new_tokens = cfg.eval_max_new_tokens or cfg.max_new_tokens
    planned = {name: _planned_settings(cfg, model_dir, len(examples), max_new_tokens)
               for model_dir, name in targets.items()}
    if not cfg.overwrite:
        check_no_silent_replace(out_root, planned)
    device = resolve_device(cfg)
    dtype = resolve_compute_dtype(cfg, device)
    n_temps = len(cfg.eval_temperatures)
    log(f"erpo: eval on {len(examples)} problems of {cfg.eval_dataset or cfg.dataset} (template {cfg.eval_template}, "
        f"reward {cfg.eval_reward}, responses of at most {max_new_tokens} tokens), {cfg.eval_n_samples} samples at "
        f"each of {n_temps} temperature{'s' if n_temps > 1 else ''} + greedy")
    results, out_dirs = {}, {}
    for model_dir, name in targets.items():
        out_dirs[name] = os.path.join(out_root, name)
        results[name] = _evaluate_model(cfg, model_dir, name, examples, out_dirs[name], device, dtype, log)
    if len(results) > 1:
        path = compare_report(results, out_root)
        log(f"\n{compare_table(results)}\n-> {path}, compare.png, compare.json")
    return out_dirs
