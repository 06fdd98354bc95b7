"""The stability evaluation of erpo-method.md section 8.

For every temperature in ``TEMPERATURES`` the model samples ``n_samples`` completions
per problem; Avg@n is the mean correctness over all samples, Pass@k the unbiased
estimator 1 - C(n-c, k) / C(n, k) averaged over problems (c = correct samples of a
problem). Pass@1 of greedy decoding is reported once, next to the mean over
temperatures of every column. ``write_report`` writes the numbers as JSON, a markdown
table and an accuracy-vs-temperature plot; ``compare_report`` overlays several runs.

Sampling is plain temperature sampling (top_p = 1, top_k = 0, no repetition penalty),
whatever the model's own generation_config says, so numbers compare across models.
"""
from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .config import EVAL_TEMPERATURES, atomic_write
from .data import derived_seed
from .rewards import CORRECT_THRESHOLD
from .rollout import eos_ids_of, generate_ids

__all__ = [
    "CORRECT_THRESHOLD",
    "TEMPERATURES",
    "EvalResult",
    "TemperatureRow",
    "compare_report",
    "evaluate",
    "pass_at_k",
    "write_report",
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


def _check_eval_args(prompts, answers, temperatures, n_samples, k_values, max_new_tokens,
                     batch_size, reward_fn) -> None:
    if len(prompts) == 0:
        raise ValueError("prompts: need at least one prompt")
    if len(answers) != len(prompts):
        raise ValueError(f"answers: need one answer per prompt, got {len(answers)} for {len(prompts)} prompts")
    if not callable(reward_fn):
        raise ValueError("reward_fn: must be a callable (completion, answer) -> float")
    if len(temperatures) == 0 or any(not (t > 0) for t in temperatures):
        raise ValueError(f"temperatures: need positive temperatures, got {tuple(temperatures)}")
    if n_samples < 1:
        raise ValueError(f"n_samples: must be >= 1, got {n_samples}")
    if len(k_values) == 0 or any(not 1 <= int(k) <= n_samples for k in k_values):
        raise ValueError(f"k_values: each k must be in [1, n_samples={n_samples}], got {tuple(k_values)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")


def evaluate(
    model,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    answers: Sequence[str],
    *,
    reward_fn: Callable[[str, str], float],
    temperatures: Sequence[float] = TEMPERATURES,
    n_samples: int = 4,
    k_values: Sequence[int] = (1, 2, 4),
    max_new_tokens: int = 64,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = True,
) -> EvalResult:
    """Avg@n and Pass@k at every temperature, and greedy Pass@1 (erpo-method.md s.8).

    ``prompts`` are fully templated strings (tokenised without adding special tokens)
    or prompt token ids (used as they are, e.g. the training prompts with their BOS);
    ``answers`` the gold answers, scored by ``reward_fn(completion, answer)`` with a
    sample correct when the reward is >= CORRECT_THRESHOLD. ``batch_size`` counts
    sequences per ``model.generate`` call (erpo.rollout.generate_ids). The same
    arguments give the same result (torch RNG seeded per temperature from ``seed``; the
    caller's RNG state is left as it was). The model's mode, generation_config and the
    tokenizer are left unchanged.
    """
    from tqdm.auto import tqdm

    _check_eval_args(prompts, answers, temperatures, n_samples, k_values, max_new_tokens,
                     batch_size, reward_fn)
    k_values = sorted({int(k) for k in k_values})
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = eos_ids_of(model, tokenizer)
    if pad_id is None or not eos_ids:
        raise ValueError("tokenizer: needs an eos token (and a pad token, or eos is used to pad)")

    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else [int(t) for t in p]
               for p in prompts]
    empty = [i for i, ids in enumerate(encoded) if not ids]
    if empty:
        raise ValueError(f"prompts: prompt {empty[0]} has no tokens")
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))  # similar lengths batch together
    sampled_items = [i for i in order for _ in range(n_samples)]       # problem index of each sequence
    n_chunks = math.ceil(len(order) / batch_size) + len(temperatures) * math.ceil(len(sampled_items) / batch_size)

    def run(items: list[int], temperature: float, bar) -> list[int]:
        """Generate for each problem index in ``items`` (in order; temperature 0 = greedy)
        -> correctness of each."""
        results = []
        for start in range(0, len(items), batch_size):
            chunk = items[start:start + batch_size]
            responses = generate_ids(model, [encoded[i] for i in chunk], temperature=temperature,
                                     max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_ids=eos_ids)
            for tokens, i in zip(responses, chunk):
                if tokens and tokens[-1] in eos_ids:
                    tokens = tokens[:-1]
                completion = tokenizer.decode(tokens, skip_special_tokens=True)
                results.append(int(float(reward_fn(completion, answers[i])) >= CORRECT_THRESHOLD))
            bar.update(1)
        return results

    was_training = model.training
    on_accelerator = model.device.type != "cpu"
    fork = dict(devices=[model.device] if on_accelerator else [],
                device_type=model.device.type if on_accelerator else None)
    model.eval()
    try:
        with torch.random.fork_rng(**fork), \
                tqdm(total=n_chunks, desc="eval", disable=not progress, leave=False) as bar:
            bar.set_postfix_str("greedy")
            greedy = dict(zip(order, run(order, 0.0, bar)))
            greedy_correct = [greedy[i] for i in range(len(prompts))]

            rows = []
            for t_index, temperature in enumerate(temperatures):
                bar.set_postfix_str(f"T={temperature:g}")
                torch.manual_seed(derived_seed(seed, "eval", t_index))
                n_correct = [0] * len(prompts)
                for problem, ok in zip(sampled_items, run(sampled_items, float(temperature), bar)):
                    n_correct[problem] += ok
                rows.append(TemperatureRow(
                    temperature=float(temperature),
                    avg_at_n=sum(n_correct) / (len(prompts) * n_samples),
                    pass_at_k={k: sum(pass_at_k(n_samples, c, k) for c in n_correct) / len(prompts)
                               for k in k_values},
                    n_correct=n_correct,
                ))
    finally:
        model.train(was_training)

    return EvalResult(
        rows=rows,
        greedy_pass_at_1=sum(greedy_correct) / len(prompts),
        n_samples=n_samples,
        n_problems=len(prompts),
        greedy_correct=greedy_correct,
        settings={"max_new_tokens": max_new_tokens, "seed": seed, "batch_size": batch_size,
                  "top_p": 1.0, "top_k": 0, "correct_threshold": CORRECT_THRESHOLD},
    )


# ----------------------------------------------------------------------------- reports


def _fmt(x: float) -> str:
    return f"{x:.4f}"


def _fmt_temperature(t: float) -> str:
    s = f"{t:g}"
    return s if any(ch in s for ch in ".e") else s + ".0"   # 1 -> "1.0", 0.05 -> "0.05"


def _markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _eval_markdown(result: EvalResult, title: str) -> str:
    n = result.n_samples
    header = ["temperature", f"Avg@{n}"] + [f"Pass@{k}" for k in result.k_values]
    rows = [[_fmt_temperature(r.temperature), _fmt(r.avg_at_n)] + [_fmt(r.pass_at_k[k]) for k in result.k_values]
            for r in result.rows]
    mean_pass = result.mean_pass_at_k
    rows.append(["mean", _fmt(result.mean_avg_at_n)] + [_fmt(mean_pass[k]) for k in result.k_values])
    text = f"# {title}\n\n" if title else ""
    text += (f"{result.n_problems} problems, {n} samples per problem and temperature; "
             f"Pass@k is the unbiased estimator.\n\n")
    text += _markdown_table(header, rows)
    text += f"\nGreedy Pass@1: {_fmt(result.greedy_pass_at_1)}\n\n![accuracy vs temperature](eval.png)\n"
    return text


def _png_bytes(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    return buffer.getvalue()


def _eval_figure(result: EvalResult, title: str):
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg canvas

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot(1, 1, 1)
    temps = result.temperatures
    ax.plot(temps, [r.avg_at_n for r in result.rows], marker="o", linewidth=2, label=f"Avg@{result.n_samples}")
    for k in result.k_values:
        ax.plot(temps, [r.pass_at_k[k] for r in result.rows], marker=".", linestyle="--", label=f"Pass@{k}")
    ax.axhline(result.greedy_pass_at_1, color="black", linestyle=":", label="greedy Pass@1")
    ax.set_xlabel("sampling temperature")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title or "accuracy vs temperature")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def write_report(result: EvalResult, out_dir: str | Path, title: str = "") -> dict[str, Path]:
    """Write eval.json, eval.md (table: a row per temperature, a mean row, greedy Pass@1)
    and eval.png (accuracy vs temperature) into ``out_dir``, each atomically.

    Returns {"json": path, "md": path, "png": path}.
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
    return paths


def compare_report(results: dict[str, EvalResult], out_dir: str | Path) -> Path:
    """Overlay several runs (e.g. {"grpo": ..., "erpo": ...}): compare.png plots each
    run's Avg@n against temperature (greedy Pass@1 dotted in the same colour), and
    compare.md holds Avg@n per temperature and a summary (means, greedy Pass@1).

    Returns the path of compare.md (it links the plot next to it).
    """
    if not results:
        raise ValueError("results: need at least one run to compare")
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = list(results)

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot(1, 1, 1)
    for i, name in enumerate(names):
        r = results[name]
        color = f"C{i % 10}"
        ax.plot(r.temperatures, [row.avg_at_n for row in r.rows], marker="o", color=color,
                label=f"{name} Avg@{r.n_samples}")
        ax.axhline(r.greedy_pass_at_1, color=color, linestyle=":", linewidth=1, label=f"{name} greedy Pass@1")
    ax.set_xlabel("sampling temperature")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Avg@n vs temperature")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    atomic_write(out / "compare.png", _png_bytes(fig))

    temps = sorted({t for r in results.values() for t in r.temperatures})
    by_temp = {name: {row.temperature: row.avg_at_n for row in results[name].rows} for name in names}
    header = ["temperature"] + [f"{name} Avg@{results[name].n_samples}" for name in names]
    rows = [[_fmt_temperature(t)] + [_fmt(by_temp[name][t]) if t in by_temp[name] else "-" for name in names]
            for t in temps]
    rows.append(["mean"] + [_fmt(results[name].mean_avg_at_n) for name in names])
    text = "# Avg@n vs temperature\n\n" + _markdown_table(header, rows)

    ks = sorted({k for r in results.values() for k in r.k_values})
    header = ["run", "problems", "mean Avg@n"] + [f"mean Pass@{k}" for k in ks] + ["greedy Pass@1"]
    rows = []
    for name in names:
        r = results[name]
        mean_pass = r.mean_pass_at_k
        rows.append([name, str(r.n_problems), _fmt(r.mean_avg_at_n)]
                    + [_fmt(mean_pass[k]) if k in mean_pass else "-" for k in ks]
                    + [_fmt(r.greedy_pass_at_1)])
    text += "\n## Summary (means over temperatures)\n\n" + _markdown_table(header, rows)
    text += "\n![Avg@n vs temperature](compare.png)\n"
    path = out / "compare.md"
    atomic_write(path, text.encode("utf-8"))
    return path
