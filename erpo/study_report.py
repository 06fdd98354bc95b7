"""The report of `erpo study` (erpo/study.py): everything read back from the study's
files (eval.json of every checkpoint, metrics.jsonl of every run, times.jsonl), nothing
typed by hand.

    results.json   per variant, seed and checkpoint: Avg@n and Pass@n at every temperature,
                   greedy Pass@1, Avg@n per difficulty level; the training curves, binned;
                   wall and CPU seconds of every unit
    report.md      the tables and the findings (sections <!-- study:NAME --> ... <!-- /study:NAME -->,
                   which the study's doc= page gets too)
    accuracy.png   Avg@n and Pass@n against step, one panel per temperature group, and greedy
    training.png   reward, Query-KL, Policy-KL, entropy and response length against step

Every number is a mean over seeds; +- is the sample standard deviation over seeds (the
bands in the plots too).
"""
from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .atomic import atomic_write
from .errors import ErpoError

# A change of accuracy smaller than this (absolute) is called no change by the findings.
DECLINE = 0.02
# The training metrics the report follows: (metrics.jsonl key, name in results.json, title).
CURVES = (
    ("reward/mean", "reward", "reward (mean)"),
    ("qkl/value", "query_kl", "Query-KL (k3)"),
    ("policy_kl", "policy_kl", "Policy-KL (k3, monitored)"),
    ("entropy/mean", "entropy", "entropy (response tokens)"),
    ("response_length/mean", "length", "response length (tokens)"),
)
FIGURES = ("accuracy.png", "training.png")


def mean_sd(values: Sequence[float]) -> Tuple[float, float]:
    """(mean, sample standard deviation; 0 for one value) of `values`."""
    values = [v for v in values if v is not None and v == v]
    if not values:
        return float("nan"), float("nan")
    m = sum(values) / len(values)
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return m, sd


def _fmt(pair: Tuple[float, float], digits: int = 3) -> str:
    m, sd = pair
    if m != m:
        return "-"
    return f"{m:.{digits}f} ± {sd:.{digits}f}"


def _sci(pair: Tuple[float, float]) -> str:
    m, sd = pair
    return "-" if m != m else f"{m:.2e} ± {sd:.1e}"


# ---------------------------------------------------------------------- collecting


def _point(report: Dict[str, Any], levels: Optional[List[str]]) -> Dict[str, Any]:
    """One evaluation as results.json keeps it: Avg@n and Pass@n per temperature (sorted),
    greedy Pass@1, and (task=mixed) Avg@n per difficulty level, averaged over temperatures."""
    rows = sorted(report["rows"], key=lambda r: float(r["temperature"]))
    n = int(report["n_samples"])
    top = str(max(int(k) for k in report["k_values"]))
    point = {"avg": [float(r["avg_at_n"]) for r in rows], "pass": [float(r["pass_at_k"][top]) for r in rows],
             "greedy": float(report["greedy_pass_at_1"])}
    if levels:
        by_level: Dict[str, List[float]] = {}
        for row in rows:
            for level, c in zip(levels, row["n_correct"]):
                by_level.setdefault(level, []).append(c / n)
        point["levels"] = {lv: sum(v) / len(v) for lv, v in by_level.items()}
    return point


def _binned(rows: List[Dict[str, Any]], width: int) -> Dict[str, List[float]]:
    """Each CURVES metric averaged over windows of `width` steps (step = the window's end)."""
    out: Dict[str, List[float]] = {"step": []}
    for _, name, _ in CURVES:
        out[name] = []
    for end in range(width, max((r["step"] for r in rows), default=0) + 1, width):
        window = [r for r in rows if end - width < r["step"] <= end]
        if not window:
            continue
        out["step"].append(end)
        for key, name, _ in CURVES:
            values = [r[key] for r in window if r.get(key) is not None]
            out[name].append(sum(values) / len(values) if values else None)
    return out


def _times(out: str) -> Dict[str, Dict[str, float]]:
    """{unit: {train_wall_s, train_cpu_s, train_steps, eval_wall_s, eval_cpu_s, evals, ...}} from times.jsonl."""
    totals: Dict[str, Dict[str, float]] = {}
    path = os.path.join(out, "times.jsonl")
    if not os.path.isfile(path):
        return totals
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            t = totals.setdefault(rec["unit"], {})
            what = rec["what"]
            for key in ("wall_s", "cpu_s"):
                t[f"{what}_{key}"] = t.get(f"{what}_{key}", 0.0) + rec[key]
            if what == "train":
                t["train_steps"] = t.get("train_steps", 0) + rec["steps"][1] - rec["steps"][0] + 1
            if what == "eval":
                t["evals"] = t.get("evals", 0) + 1
    return totals


def collect(spec: Any, units: Sequence[Any]) -> Dict[str, Any]:
    """results.json's content from the study's files (what is missing is listed, not
    invented); `spec` an erpo.study.StudyConfig, `units` its erpo.study.Unit list."""
    from .data import MIXED_LEVELS, difficulty_of, load_examples
    from .plot import read_metrics

    runs = [u for u in units if u.kind == "run"]
    base = runs[0].cfg
    levels_of: Dict[int, List[str]] = {}  # seed -> the difficulty level of each evaluated problem
    if base.is_demo_task and base.demo.task == "mixed":
        for u in units:
            if u.kind == "start":
                examples = load_examples(u.cfg, "eval")[: u.cfg.eval.limit or None]
                levels_of[u.seed] = [difficulty_of(ex.prompt) for ex in examples]
    width = max(1, spec.eval_every // 5)
    results: Dict[str, Any] = {
        "variants": dict(spec.variants), "seeds": list(spec.seeds), "steps": [0] + runs[0].eval_steps,
        "temperatures": sorted(base.eval.temperatures), "groups": spec.temperature_groups,
        "n_samples": base.eval.n_samples, "levels": list(MIXED_LEVELS) if levels_of else [],
        "eval": {}, "train": {}, "missing": [], "time": _times(spec.out), "bin_steps": width,
    }
    starts = {u.seed: u for u in units if u.kind == "start"}
    for u in runs:
        points = results["eval"].setdefault(u.variant, {}).setdefault(str(u.seed), {})
        for step in [0] + u.eval_steps:
            owner = starts[u.seed] if step == 0 else u
            path = owner.report_path(step)
            if path is None:
                results["missing"].append(f"{owner.name} step {step}")
                continue
            with open(path, encoding="utf-8") as f:
                report = json.load(f)
            points[str(step)] = _point(report, levels_of.get(u.seed))
        rows = read_metrics(u.cfg.run_dir) if os.path.isfile(os.path.join(u.cfg.run_dir, "metrics.jsonl")) else []
        results["train"].setdefault(u.variant, {})[str(u.seed)] = _binned(rows, width)
    return results


# ---------------------------------------------------------------------- reading results


def _group_value(point: Dict[str, Any], results: Dict[str, Any], group: Optional[str], key: str = "avg") -> float:
    """A checkpoint's `key` (avg or pass) averaged over a temperature group (None: greedy)."""
    if group is None:
        return point["greedy"]
    temps = results["temperatures"]
    values = [point[key][temps.index(t)] for t in results["groups"][group]]
    return sum(values) / len(values)


def series(results: Dict[str, Any], variant: str, fn: Callable[[Dict[str, Any]], float]) -> Dict[int, List[float]]:
    """{step: [fn(point) of each seed that has the step]} of one variant."""
    out: Dict[int, List[float]] = {}
    for seed in map(str, results["seeds"]):
        for step, point in results["eval"].get(variant, {}).get(seed, {}).items():
            out.setdefault(int(step), []).append(fn(point))
    return dict(sorted(out.items()))


def _per_seed(results: Dict[str, Any], variant: str, fn: Callable[[Dict[str, Any]], float]) -> Dict[str, Dict[int, float]]:
    return {seed: {int(s): fn(p) for s, p in results["eval"].get(variant, {}).get(seed, {}).items()}
            for seed in map(str, results["seeds"])}


def _window_means(results: Dict[str, Any], variant: str, name: str, every: int) -> Dict[int, List[float]]:
    """{end of each eval_every window: [the seeds' mean of a training curve over it]}."""
    out: Dict[int, List[float]] = {}
    for curve in results["train"].get(variant, {}).values():
        windows: Dict[int, List[float]] = {}
        for step, value in zip(curve["step"], curve[name]):
            if value is not None:
                windows.setdefault(every * math.ceil(step / every), []).append(value)
        for end, values in windows.items():
            out.setdefault(end, []).append(sum(values) / len(values))
    return dict(sorted(out.items()))


def _high_group(results: Dict[str, Any]) -> str:
    return max(results["groups"], key=lambda g: max(results["groups"][g]))


# ---------------------------------------------------------------------- tables


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _group_label(results: Dict[str, Any], group: Optional[str]) -> str:
    if group is None:
        return "greedy Pass@1"
    return f"{group} temperatures ({', '.join(f'{t:g}' for t in results['groups'][group])})"


def accuracy_tables(results: Dict[str, Any], key: str = "avg") -> str:
    """Per temperature group (and greedy): a row per checkpoint, a column per variant."""
    n = results["n_samples"]
    what = f"Avg@{n}" if key == "avg" else f"Pass@{n}"
    variants = list(results["variants"])
    blocks = []
    for group in list(results["groups"]) + ([None] if key == "avg" else []):
        cols = {v: series(results, v, lambda p, g=group: _group_value(p, results, g, key)) for v in variants}
        rows = [[str(step)] + [_fmt(mean_sd(cols[v].get(step, []))) for v in variants] for step in results["steps"]]
        title = _group_label(results, group) + ("" if group is None else f", {what} (mean over the group)")
        blocks.append(f"**{title}**\n\n" + _table(["step"] + variants, rows))
    return "\n".join(blocks)


def temperature_tables(results: Dict[str, Any]) -> str:
    """Per variant: a row per checkpoint, Avg@n at every temperature and greedy Pass@1."""
    temps = results["temperatures"]
    blocks = []
    for v in results["variants"]:
        cols = [series(results, v, lambda p, i=i: p["avg"][i]) for i in range(len(temps))]
        greedy = series(results, v, lambda p: p["greedy"])
        rows = [[str(step)] + [_fmt(mean_sd(c.get(step, [])), 2) for c in cols] + [_fmt(mean_sd(greedy.get(step, [])), 2)]
                for step in results["steps"]]
        blocks.append(f"**{v}**: Avg@{results['n_samples']} at each temperature\n\n"
                      + _table(["step"] + [f"T={t:g}" for t in temps] + ["greedy"], rows))
    return "\n".join(blocks)


def curve_table(results: Dict[str, Any], name: str, every: int, sci: bool = False) -> str:
    """A training curve's mean over each eval_every window: a row per window, a column per variant."""
    variants = list(results["variants"])
    cols = {v: _window_means(results, v, name, every) for v in variants}
    ends = sorted({e for c in cols.values() for e in c})
    fmt = _sci if sci else (lambda pair: _fmt(pair, 3))
    rows = [[f"{end - every + 1}-{end}"] + [fmt(mean_sd(cols[v].get(end, []))) for v in variants] for end in ends]
    return _table(["steps"] + variants, rows)


def level_table(results: Dict[str, Any]) -> str:
    """Avg@n per difficulty level (mean over temperatures): the starting model and each variant's last checkpoint."""
    if not results["levels"]:
        return "(the task has no difficulty levels)\n"
    variants = list(results["variants"])
    last = results["steps"][-1]
    rows = []
    for level in results["levels"]:
        start = series(results, variants[0], lambda p: p["levels"][level]).get(0, [])
        rows.append([level, _fmt(mean_sd(start))] + [
            _fmt(mean_sd(series(results, v, lambda p: p["levels"][level]).get(last, []))) for v in variants])
    return _table(["level", "step 0"] + [f"{v}, step {last}" for v in variants], rows)


# ---------------------------------------------------------------------- findings


def trend(results: Dict[str, Any], variant: str, group: Optional[str]) -> Optional[Dict[str, Any]]:
    """How a variant's accuracy in a temperature group moved: the mean over seeds at step 0,
    at its best checkpoint (the starting model, step 0, counts: a run that only falls from
    where it started declines) and at the last one; each seed's last minus its value at
    that best checkpoint; how many seeds end more than DECLINE below it; the first
    checkpoint after the best whose mean lies more than DECLINE below it. None without data."""
    fn = (lambda p: _group_value(p, results, group)) if group else (lambda p: p["greedy"])
    per_seed = _per_seed(results, variant, fn)
    last = results["steps"][-1]
    seeds = [s for s, c in per_seed.items() if 0 in c and last in c]
    if not seeds:
        return None
    curve = {step: mean_sd([per_seed[s][step] for s in seeds if step in per_seed[s]])[0] for step in results["steps"]}
    best = max((s for s in results["steps"] if curve[s] == curve[s]), key=lambda s: curve[s])
    change = [per_seed[s][last] - per_seed[s][best] for s in seeds]
    below = [s for s in results["steps"] if s > best and curve[s] < curve[best] - DECLINE]
    return {"start": curve[0], "best": curve[best], "best_step": best, "last": curve[last], "last_step": last,
            "change": mean_sd(change), "declining_seeds": sum(c < -DECLINE for c in change), "seeds": len(seeds),
            "first_below": below[0] if below else None}


def declines(t: Dict[str, Any]) -> bool:
    """The rule of the findings: the mean ends more than DECLINE below its best, and so do most seeds."""
    return t["change"][0] < -DECLINE and 2 * t["declining_seeds"] > t["seeds"]


def _trend_sentence(results: Dict[str, Any], variant: str, group: Optional[str]) -> str:
    t = trend(results, variant, group)
    if t is None:
        return f"- {variant}, {_group_label(results, group)}: not evaluated yet."
    what = "greedy Pass@1" if group is None else f"Avg@{results['n_samples']}"
    onset = f", first more than {DECLINE} below it at step {t['first_below']}" if t["first_below"] else ""
    return (f"- **{variant}**, {_group_label(results, group)}: {what} {t['start']:.3f} at step 0, best "
            f"{t['best']:.3f} at step {t['best_step']}, {t['last']:.3f} at step {t['last_step']}{onset}; last minus "
            f"best {t['change'][0]:+.3f} ± {t['change'][1]:.3f}, more than {DECLINE} below it in {t['declining_seeds']} "
            f"of {t['seeds']} seeds: **{'declines' if declines(t) else 'no decline'}**.")


def _paired(results: Dict[str, Any], a: str, b: str, group: Optional[str]) -> Optional[Tuple[Tuple[float, float], int, int]]:
    """(mean ± sd of a - b at the last checkpoint over seeds, seeds where a > b, seeds)."""
    fn = (lambda p: _group_value(p, results, group)) if group else (lambda p: p["greedy"])
    last = results["steps"][-1]
    pa, pb = _per_seed(results, a, fn), _per_seed(results, b, fn)
    diffs = [pa[s][last] - pb[s][last] for s in pa if last in pa[s] and last in pb.get(s, {})]
    return (mean_sd(diffs), sum(d > 0 for d in diffs), len(diffs)) if diffs else None


def kl_ratio(results: Dict[str, Any], variant: str, every: int) -> Optional[Tuple[float, float]]:
    """Query-KL over Policy-KL in the last eval_every window, mean ± sd over seeds."""
    q = _window_means(results, variant, "query_kl", every)
    p = _window_means(results, variant, "policy_kl", every)
    common = sorted(set(q) & set(p))
    if not common or len(q[common[-1]]) != len(p[common[-1]]):
        return None
    end = common[-1]
    return mean_sd([a / b for a, b in zip(q[end], p[end]) if b > 0])


def findings(results: Dict[str, Any], every: int) -> str:
    """The generated answer to the study's question, and what it rests on."""
    high = _high_group(results)
    variants = list(results["variants"])
    lines = []
    for name in ("grpo", "erpo"):
        if name in variants:
            t = trend(results, name, high)
            answer = "not evaluated yet" if t is None else ("yes" if declines(t) else "no")
            lines.append(f"- Does {name.upper()}'s {high}-temperature accuracy degrade over the run here? "
                         f"**{answer}** (the rule: the mean over seeds ends more than {DECLINE} below its best "
                         f"checkpoint, and so do most seeds).")
    lines.append("")
    for group in list(results["groups"]) + [None]:
        lines += [_trend_sentence(results, v, group) for v in variants]
    if "grpo" in variants:
        lines.append("")
        for v in [x for x in variants if x != "grpo"]:
            for group in list(results["groups"]) + [None]:
                p = _paired(results, v, "grpo", group)
                if p is not None:
                    lines.append(f"- {v} minus grpo at step {results['steps'][-1]}, {_group_label(results, group)}: "
                                 f"{p[0][0]:+.3f} ± {p[0][1]:.3f} (higher in {p[1]} of {p[2]} seeds).")
    lines.append("")
    for v in variants:
        r = kl_ratio(results, v, every)
        if r is not None:
            lines.append(f"- {v}: Query-KL / Policy-KL over the last {every} steps: {r[0]:.2f} ± {r[1]:.2f}.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- figures


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _band(ax: Any, xs: List[int], groups: List[List[float]], color: str, label: str) -> None:
    """Mean over seeds as a line, mean ± sd as a band."""
    stats = [mean_sd(g) for g in groups]
    m = [s[0] for s in stats]
    ax.plot(xs, m, marker=".", color=color, label=label, linewidth=1.5)
    ax.fill_between(xs, [a - b for a, b in stats], [a + b for a, b in stats], color=color, alpha=0.15, linewidth=0)


def accuracy_figure(results: Dict[str, Any]) -> bytes:
    """Row 1: Avg@n against step per temperature group, and greedy Pass@1; row 2: Pass@n."""
    from matplotlib.figure import Figure

    groups: List[Optional[str]] = list(results["groups"]) + [None]
    fig = Figure(figsize=(3.6 * len(groups), 6.4))
    axes = fig.subplots(2, len(groups), squeeze=False)
    n = results["n_samples"]
    for col, group in enumerate(groups):
        for row, key in enumerate(("avg", "pass")):
            ax = axes[row][col]
            if group is None and key == "pass":
                ax.axis("off")
                continue
            for i, v in enumerate(results["variants"]):
                s = series(results, v, lambda p, g=group, k=key: _group_value(p, results, g, k))
                if s:
                    _band(ax, list(s), list(s.values()), f"C{i % 10}", v)
            what = "greedy Pass@1" if group is None else f"{'Avg' if key == 'avg' else 'Pass'}@{n}, T in " + \
                ",".join(f"{t:g}" for t in results["groups"][group])
            ax.set_title(what if group is None else f"{group}: {what}", fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=max(1, len(labels)), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    return _png(fig)


def training_figure(results: Dict[str, Any]) -> bytes:
    """Each CURVES metric against step (binned), mean over seeds ± sd; the KLs on a log scale."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.6 * len(CURVES), 3.4))
    axes = fig.subplots(1, len(CURVES), squeeze=False)[0]
    for ax, (_, name, title) in zip(axes, CURVES):
        for i, v in enumerate(results["variants"]):
            by_step: Dict[int, List[float]] = {}
            for curve in results["train"].get(v, {}).values():
                for step, value in zip(curve["step"], curve[name]):
                    if value is not None:
                        by_step.setdefault(step, []).append(value)
            if by_step:
                steps = sorted(by_step)
                _band(ax, steps, [by_step[s] for s in steps], f"C{i % 10}", v)
        if name in ("query_kl", "policy_kl") and ax.has_data():
            ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=max(1, len(labels)), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.88))
    return _png(fig)


# ---------------------------------------------------------------------- setup and time


def _prompts(cfg: Any) -> str:
    """The training problems of the embedded task: the warm start's and the RL prompts."""
    demo = cfg.demo
    if not demo.task_rl_size:
        return f"{demo.task_train_size} training problems"
    return (f"{demo.task_train_size} training problems (the warm start's demonstrations; a fixed "
            f"{demo.task_rl_size} of them are the RL prompts)")


def _epochs(cfg: Any) -> str:
    """How often a run passes over its RL prompts: per step and in all."""
    if not cfg.is_demo_task:
        return ""
    from .data import batches_per_epoch

    prompts = cfg.demo.task_rl_size or cfg.demo.task_train_size
    per_epoch = batches_per_epoch(prompts, cfg.queries_per_step)  # a step of an epoch's remainder is dropped
    return (f"; {1 / per_epoch:.4f} epochs per step ({per_epoch} steps per pass over the {prompts} RL prompts), "
            f"{cfg.steps / per_epoch:.1f} epochs in all")


def setup_section(spec: Any, units: Sequence[Any]) -> str:
    """The study's settings, as the runs were made."""
    from .data import MIXED_LEVELS

    cfg = next(u.cfg for u in units if u.kind == "run")
    task = (f"task=mixed ({', '.join(MIXED_LEVELS)}; {_prompts(cfg)} and {cfg.demo.task_eval_size} "
            f"held-out problems, equal parts per level)" if cfg.demo.task == "mixed" else
            f"task={cfg.demo.task} (a+b, operands <= {cfg.demo.task_max_operand}; {_prompts(cfg)})") if cfg.is_demo_task else f"dataset={cfg.dataset}"
    model = (f"the demo model (Qwen2 architecture, {cfg.demo.tiny_layers} layers of width {cfg.demo.tiny_hidden_size}, "
             f"warm start of {cfg.demo.warmstart_steps} steps, {cfg.demo.warmstart_unboxed:.0%} of its demonstrations "
             f"without \\boxed{{}})" if cfg.is_demo_model else f"model={cfg.model}")
    epochs = _epochs(cfg)
    variants = "; ".join(f"{v}: {', '.join(f'{k}={val}' for k, val in o.items()) or 'train: as it is'}"
                         for v, o in spec.variants.items())
    return "\n".join([
        f"- {task}; {model}.",
        f"- {cfg.steps} steps per run of m={cfg.queries_per_step} queries x G={cfg.group_size} responses "
        f"(at most {cfg.max_new_tokens} tokens, sampled at temperature {cfg.temperature:g}), "
        f"{cfg.mini_batches} x {cfg.ppo_epochs} optimizer updates per rollout batch{epochs}; lr={cfg.lr:g} "
        f"({cfg.lr_schedule}), beta={cfg.beta:g} (grpo), alpha={cfg.alpha:g} (erpo).",
        f"- Variants ({variants}), seeds {', '.join(map(str, spec.seeds))}; Policy-KL of the runs without a KL term "
        f"(erpo, grpo with beta=0) measured by a monitoring-only reference forward (monitor_policy_kl={cfg.monitor_policy_kl}).",
        f"- Evaluated every {spec.eval_every} steps: greedy and {cfg.eval.n_samples} samples per problem at "
        f"each temperature of {', '.join(f'{t:g}' for t in sorted(cfg.eval.temperatures))} on the held-out "
        f"split{f' (first {cfg.eval.limit} problems)' if cfg.eval.limit else ''}.",
    ]) + "\n"


def time_section(results: Dict[str, Any]) -> str:
    """Wall and CPU seconds per unit kind, from times.jsonl (CPU seconds are what a quiet core would take)."""
    times = results["time"]
    rows = []
    for v in results["variants"]:
        units = [times[f"{v}-seed{s}"] for s in results["seeds"] if f"{v}-seed{s}" in times]
        steps = [u.get("train_steps", 0) for u in units]
        if not units or not sum(steps):
            continue
        per_k = lambda key: 1000 * sum(u.get(key, 0) for u in units) / sum(steps)  # noqa: E731
        evals = sum(u.get("evals", 0) for u in units)
        per_eval = lambda key: sum(u.get(key, 0) for u in units) / max(1, evals)  # noqa: E731
        rows.append([v, f"{per_k('train_wall_s'):.0f}", f"{per_k('train_cpu_s'):.0f}",
                     f"{per_eval('eval_wall_s'):.1f}", f"{per_eval('eval_cpu_s'):.1f}"])
    starts = sorted((name, t) for name, t in times.items() if name.startswith("start-seed"))
    total_cpu = sum(t.get(k, 0) for t in times.values() for k in t if k.endswith("cpu_s"))
    total_wall = sum(t.get(k, 0) for t in times.values() for k in t if k.endswith("wall_s"))
    text = _table(["variant", "train s / 1000 steps (wall)", "(CPU)", "eval s / checkpoint (wall)", "(CPU)"], rows)
    if starts:
        text += ("\nStarting models (the warm start, unless it was cached, and its evaluation): " + "; ".join(
            f"{name} {t.get('eval_wall_s', 0):.0f} s wall, {t.get('eval_cpu_s', 0):.0f} s CPU" for name, t in starts)
            + ".\n")
    return text + (f"\nAll units: {total_wall:.0f} s wall (summed over units), {total_cpu:.0f} s CPU; on a quiet "
                   f"machine, one unit per core, 2 cores would take about {total_cpu / 2 / 60:.{0 if total_cpu > 1200 else 1}f} minutes.\n")


# ---------------------------------------------------------------------- the report


def sections(spec: Any, units: Sequence[Any], results: Dict[str, Any]) -> Dict[str, str]:
    """{name: markdown} of every generated section (report.md has them all, a doc= page those it marks)."""
    every = spec.eval_every
    missing = list(dict.fromkeys(results["missing"]))  # in the study's order, once each
    done = evaluations_in(results)
    status = (f"Incomplete: {len(missing)} evaluations missing ({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}); "
              f"{done} in.\n" if missing else f"Complete: every run and evaluation of the study is in ({done} evaluations).\n")
    return {
        "status": status,
        "setup": setup_section(spec, units),
        "findings": findings(results, every),
        "accuracy": accuracy_tables(results, "avg"),
        "pass": accuracy_tables(results, "pass"),
        "temperatures": temperature_tables(results),
        "kl": "**Query-KL**\n\n" + curve_table(results, "query_kl", every, sci=True)
              + "\n**Policy-KL**\n\n" + curve_table(results, "policy_kl", every, sci=True),
        "entropy": "**Entropy of the response tokens**\n\n" + curve_table(results, "entropy", every)
                   + "\n**Response length (tokens)**\n\n" + curve_table(results, "length", every)
                   + "\n**Training reward**\n\n" + curve_table(results, "reward", every),
        "levels": level_table(results),
        "time": time_section(results),
    }


def evaluations_in(results: Dict[str, Any]) -> int:
    """How many evaluations (variant x seed x checkpoint) the results hold."""
    return sum(len(points) for seeds in results["eval"].values() for points in seeds.values())


def held_status(doc: str, label: str = "") -> Optional[Tuple[bool, Optional[int], Optional[int]]]:
    """What the doc= page's status section says of the report it holds: (complete,
    evaluations missing, evaluations in: None where the page does not say); None when the
    page has no status section of this label."""
    if not os.path.isfile(doc):
        return None
    with open(doc, encoding="utf-8") as f:
        text = f.read()
    for m in _block(label).finditer(text):
        if m.group(2) == "status":
            status = m.group(3).strip()
            if not status.startswith(("Complete", "Incomplete")):
                return None
            complete = status.startswith("Complete")
            gone = re.match(r"Incomplete: (\d+) evaluations missing", status)
            done = re.search(r"(?:\((\d+) evaluations\)|; (\d+) in)\.?$", status)
            return (complete, 0 if complete else (int(gone.group(1)) if gone else None),
                    int(done.group(1) or done.group(2)) if done else None)
    return None


def less_than_held(doc: str, label: str, missing: int, done: int) -> Optional[str]:
    """Why the page's report has more in it than one of `done` evaluations (`missing`
    missing), in words; None when this one has as much or more (or the page says nothing)."""
    held = held_status(doc, label)
    if held is None:
        return None
    complete, held_missing, held_done = held
    if held_done is not None:
        more = held_done > done
    elif complete:
        more = missing > 0
    else:
        more = held_missing is not None and held_missing < missing
    if not more:
        return None
    page = ("complete" if complete else f"{held_missing} evaluations missing") + (
        f", {held_done} in" if held_done is not None else "")
    return f"{doc} holds a report of more evaluations ({page}) than this one ({missing} missing, {done} in)"


TITLES = {"status": "Status", "setup": "Setup", "findings": "Findings", "accuracy": "Accuracy against step",
          "pass": "Pass@n against step", "temperatures": "Every temperature", "kl": "Query-KL and Policy-KL",
          "entropy": "Entropy, response length, reward", "levels": "Accuracy per difficulty level",
          "time": "Time"}
def _tag(label: str) -> str:
    """The marker word of a study's sections: study, or study-LABEL (the study key label)."""
    return f"study-{label}" if label else "study"


def _block(label: str) -> "re.Pattern[str]":
    tag = re.escape(_tag(label))
    return re.compile(rf"(<!-- {tag}:(\w+) -->\n)(.*?)(<!-- /{tag}:\2 -->)", re.S)


def marked(name: str, text: str, label: str = "") -> str:
    tag = _tag(label)
    return f"<!-- {tag}:{name} -->\n{text.rstrip()}\n<!-- /{tag}:{name} -->"


def refresh_doc(doc: str, parts: Dict[str, str], figures: Dict[str, str], label: str = "") -> List[str]:
    """Rewrite the <!-- study:NAME --> sections of `doc` (<!-- study-LABEL:NAME --> with a
    label; another study's are left alone) from `parts` and copy the figures beside it as
    <doc stem>-<figure> (<doc stem>-LABEL-<figure>); returns the names of the sections rewritten."""
    if not os.path.isfile(doc):
        raise ErpoError(f"doc={doc} does not exist; give a markdown page with <!-- study:NAME --> sections, or doc=")
    with open(doc, encoding="utf-8") as f:
        text = f.read()
    block = _block(label)
    found = [m.group(2) for m in block.finditer(text)]
    unknown = [n for n in found if n not in parts]
    if unknown:
        raise ErpoError(f"doc={doc} marks a section {_tag(label)}:{unknown[0]} the report does not have "
                        f"({', '.join(parts)})")
    text = block.sub(lambda m: marked(m.group(2), parts[m.group(2)], label), text)
    atomic_write(doc, text.encode("utf-8"))
    stem = os.path.splitext(doc)[0] + (f"-{label}" if label else "")
    for name, path in figures.items():
        shutil.copyfile(path, f"{stem}-{name}")
    return found


def write_study_report(spec: Any, units: Sequence[Any], log: Callable[[str], None] = print) -> Dict[str, str]:
    """results.json, report.md and the figures in <out>, and the doc= page's sections."""
    results = collect(spec, units)
    out = spec.out
    os.makedirs(out, exist_ok=True)
    paths = {"results": os.path.join(out, "results.json"), "report": os.path.join(out, "report.md")}
    atomic_write(paths["results"], (json.dumps(results, indent=1) + "\n").encode("utf-8"))
    figures = {"accuracy.png": accuracy_figure(results), "training.png": training_figure(results)}
    for name, png in figures.items():
        paths[name] = os.path.join(out, name)
        atomic_write(paths[name], png)
    parts = sections(spec, units, results)
    body = "\n\n".join(f"## {TITLES[n]}\n\n{marked(n, t)}" for n, t in parts.items())
    images = "".join(f"![{n}]({n})\n" for n in figures)
    atomic_write(paths["report"], f"# Stability study: {out}\n\n{images}\n{body}\n".encode("utf-8"))
    fewer = None if not spec.doc or getattr(spec, "force_doc", False) else less_than_held(
        spec.doc, spec.label, len(set(results["missing"])), evaluations_in(results))
    if fewer:
        log(f"erpo: study: {fewer}: left as it is; this report is in {paths['report']} (force_doc=true rewrites "
            f"the page from it)")
    elif spec.doc:
        done = refresh_doc(spec.doc, parts, {n: paths[n] for n in figures}, spec.label)
        log(f"erpo: study: rewrote {len(done)} sections of {spec.doc} and its figures")
        paths["doc"] = spec.doc
    log(f"erpo: study report: {paths['report']} ({parts['status'].strip()})")
    return paths
