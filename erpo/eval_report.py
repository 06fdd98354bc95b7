"""The reports of an evaluation (erpo.evaluate's EvalResult): eval.json, eval.md (a row
per temperature, a mean row, greedy Pass@1) and eval.png (accuracy against temperature)
per model; compare.{md,json,png} overlaying several. Every file is written atomically."""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Sequence

from .atomic import atomic_write
from .evaluate import EvalResult

__all__ = ["compare_report", "compare_table", "format_table", "write_report"]


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
                 questions: Sequence[str] | None = None, answers: Sequence[str] | None = None,
                 prompts: Sequence[str] | None = None) -> dict[str, Path]:
    """Write eval.json, eval.md (table: a row per temperature, a mean row, greedy Pass@1)
    and eval.png (accuracy vs temperature) into ``out_dir``, each atomically; with kept
    samples also samples.jsonl, a line per completion (with its problem's question, the
    prompt the model saw (the template applied) and the gold answer when given).

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
            if prompts is not None:
                extra["prompt"] = prompts[sample["problem"]]
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
