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
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

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

TEMPERATURES = (0.1, 0.3, 0.5, 0.7, 0.9, 1.0, 1.1, 1.3, 1.5)
# A sample counts as correct when its reward reaches this (the built-in rewards are 0/1).
CORRECT_THRESHOLD = 0.5


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


# ----------------------------------------------------------------------------- generation


def _eos_ids(model, tokenizer) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS and the model's."""
    ids = []
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if source is None:
            continue
        for i in source if isinstance(source, (list, tuple)) else [source]:
            if int(i) not in ids:
                ids.append(int(i))
    return ids


def _left_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> input_ids [B, T_max], attention_mask [B, T_max], padded on the left."""
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        if s:
            input_ids[b, width - len(s):] = torch.tensor(s, dtype=torch.long)
            attention_mask[b, width - len(s):] = 1
    return input_ids.to(device), attention_mask.to(device)


def _generate(model, tokenizer, seqs: list[list[int]], generation_config, pad_id: int,
              eos_ids: list[int]) -> list[str]:
    """One generate call on prompt token lists -> the decoded new text of each."""
    input_ids, attention_mask = _left_pad(seqs, pad_id, model.device)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                         generation_config=generation_config)   # [B, T_max + new]
    new = out[:, input_ids.shape[1]:].tolist()                    # [B, <= max_new_tokens]
    completions = []
    for tokens in new:
        cut = next((j for j, t in enumerate(tokens) if t in eos_ids), len(tokens))
        completions.append(tokenizer.decode(tokens[:cut], skip_special_tokens=True))
    return completions


def _derived_seed(seed: int, index: int) -> int:
    """A distinct, reproducible torch seed for each (seed, temperature index)."""
    return (seed * 1_000_003 + index * 7_919 + 17) % (2**63 - 1)


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
    prompts: list[str],
    answers: list[str],
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

    ``prompts`` are fully templated strings (tokenised without adding special tokens);
    ``answers`` the gold answers, scored by ``reward_fn(completion, answer)`` with a
    sample correct when the reward is >= CORRECT_THRESHOLD. ``batch_size`` counts
    sequences per ``model.generate`` call. The same arguments give the same result
    (torch RNG seeded per temperature from ``seed``; the caller's RNG state is left as
    it was). The model's mode, generation_config and the tokenizer are left unchanged.
    """
    from tqdm.auto import tqdm
    from transformers import GenerationConfig

    _check_eval_args(prompts, answers, temperatures, n_samples, k_values, max_new_tokens,
                     batch_size, reward_fn)
    k_values = sorted({int(k) for k in k_values})
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = _eos_ids(model, tokenizer)
    if pad_id is None or not eos_ids:
        raise ValueError("tokenizer: needs an eos token (and a pad token, or eos is used to pad)")

    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    empty = [i for i, ids in enumerate(encoded) if not ids]
    if empty:
        raise ValueError(f"prompts: prompt {empty[0]} tokenises to no tokens")
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))  # similar lengths batch together
    sampled_items = [i for i in order for _ in range(n_samples)]       # problem index of each sequence
    n_chunks = math.ceil(len(order) / batch_size) + len(temperatures) * math.ceil(len(sampled_items) / batch_size)

    common = dict(max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_ids,
                  bos_token_id=getattr(model.generation_config, "bos_token_id", None),
                  num_beams=1, num_return_sequences=1, repetition_penalty=1.0, use_cache=True)
    greedy_config = GenerationConfig(do_sample=False, **common)

    def is_correct(completion: str, problem: int) -> int:
        return int(float(reward_fn(completion, answers[problem])) >= CORRECT_THRESHOLD)

    def run(items: list[int], config, bar) -> list[int]:
        """Generate for each problem index in ``items`` (in order) -> correctness of each."""
        results = []
        for start in range(0, len(items), batch_size):
            chunk = items[start:start + batch_size]
            texts = _generate(model, tokenizer, [encoded[i] for i in chunk], config, pad_id, eos_ids)
            results.extend(is_correct(text, i) for text, i in zip(texts, chunk))
            bar.update(1)
        return results

    was_training = model.training
    saved_generation_config = model.generation_config
    on_accelerator = model.device.type != "cpu"
    fork = dict(devices=[model.device] if on_accelerator else [],
                device_type=model.device.type if on_accelerator else None)
    model.eval()
    # A neutral config underneath ours: the model's own defaults (top_k, top_p,
    # repetition_penalty, min_p, ...) must not leak into the protocol.
    model.generation_config = GenerationConfig()
    try:
        with torch.no_grad(), torch.random.fork_rng(**fork), \
                tqdm(total=n_chunks, desc="eval", disable=not progress, leave=False) as bar:
            bar.set_postfix_str("greedy")
            greedy = dict(zip(order, run(order, greedy_config, bar)))
            greedy_correct = [greedy[i] for i in range(len(prompts))]

            rows = []
            for t_index, temperature in enumerate(temperatures):
                bar.set_postfix_str(f"T={temperature:g}")
                torch.manual_seed(_derived_seed(seed, t_index))
                config = GenerationConfig(do_sample=True, temperature=float(temperature), top_p=1.0,
                                          top_k=0, **common)
                n_correct = [0] * len(prompts)
                for problem, ok in zip(sampled_items, run(sampled_items, config, bar)):
                    n_correct[problem] += ok
                rows.append(TemperatureRow(
                    temperature=float(temperature),
                    avg_at_n=sum(n_correct) / (len(prompts) * n_samples),
                    pass_at_k={k: sum(pass_at_k(n_samples, c, k) for c in n_correct) / len(prompts)
                               for k in k_values},
                    n_correct=n_correct,
                ))
    finally:
        model.generation_config = saved_generation_config
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


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a temp file next to ``path``, then rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
    _atomic_write(paths["json"], (json.dumps(payload, indent=2) + "\n").encode("utf-8"))
    _atomic_write(paths["md"], _eval_markdown(result, title).encode("utf-8"))
    _atomic_write(paths["png"], _png_bytes(_eval_figure(result, title)))
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
    _atomic_write(out / "compare.png", _png_bytes(fig))

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
    _atomic_write(path, text.encode("utf-8"))
    return path
