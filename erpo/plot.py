"""Training curves from metrics.jsonl: one run, or several overlaid (GRPO vs ERPO).

    erpo plot runs/grpo runs/erpo --out runs/compare.png
"""
from __future__ import annotations

import io
import json
import math
import os
from typing import Dict, List, Optional, Sequence

from .atomic import atomic_write
from .errors import ErpoError

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
# (metric, panel title), in panel order; panels with no data in any run are left out.
PANELS = [
    ("reward/mean", "reward (mean)"),
    ("reward/accuracy", "accuracy"),
    ("qkl/value", "Query-KL (k3)"),
    ("qkl/delta_mean", "l_0(q) - l_theta(q)"),
    ("policy_kl", "policy KL (k3)"),
    ("entropy/mean", "entropy (response tokens)"),
    ("response_length/mean", "response length"),
    ("weights/ess", "query-weight ESS"),
    ("pg/clipfrac", "clip fraction"),
    ("grad_norm", "grad norm"),
    ("mismatch/logp_diff_mean", "rollout mismatch: mean |logp_rollout - logp_old|"),
    ("mismatch/logp_diff_max", "rollout mismatch: max |logp_rollout - logp_old|"),
    ("mismatch/ratio_out_frac", "rollout ratio outside [0.9, 1.1]"),
]


def read_metrics(run_dir: str) -> List[Dict[str, float]]:
    """The rows of <run_dir>/metrics.jsonl (an ErpoError when there is none)."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise ErpoError(f"{run_dir} has no {METRICS_FILE}; is it a run directory (erpo train run_dir=...)?")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a line cut short by an interruption ends the record
    return rows


def _label(run_dir: str) -> str:
    name = os.path.basename(os.path.normpath(run_dir))
    try:
        import yaml

        with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as f:
            cfg = yaml.safe_load(f) or {}
        algo = cfg.get("algorithm", "")
        return f"{name} ({algo})" if algo and algo not in name else name
    except OSError:
        return name


def smooth(values: Sequence[float], window: int) -> List[float]:
    """Trailing moving average over `window` points (NaNs skipped)."""
    out, buf = [], []
    for v in values:
        buf.append(v)
        if len(buf) > window:
            buf.pop(0)
        finite = [x for x in buf if x == x]
        out.append(sum(finite) / len(finite) if finite else float("nan"))
    return out


def plot_runs(run_dirs: Sequence[str], out_path: Optional[str] = None, labels: Optional[Sequence[str]] = None) -> str:
    """Draw the curves of one or more runs into a PNG; returns its path.

    Default path: <run>/curves.png for one run, <parent of the first run>/compare.png for several.
    Each panel shows the raw values faintly and a moving average on top.
    """
    if not run_dirs:
        raise ErpoError("plot needs at least one run directory: erpo plot RUN [RUN ...] [--out PNG]")
    runs = [(labels[i] if labels else _label(d), read_metrics(d)) for i, d in enumerate(run_dirs)]
    if out_path is None:
        if len(run_dirs) == 1:
            out_path = os.path.join(run_dirs[0], CURVES_FILE)
        else:
            out_path = os.path.join(os.path.dirname(os.path.normpath(run_dirs[0])) or ".", "compare.png")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, t) for k, t in PANELS if any(k in row for _, rows in runs for row in rows)]
    if not panels:
        panels = PANELS[:1]
    cols = 3 if len(panels) > 4 else 2
    nrows = math.ceil(len(panels) / cols)
    # margins fixed in inches (room for the legend above, the titles and the tick labels) rather than
    # fig.tight_layout, whose text layout is an extra draw of the figure: ~40% of a plot's time
    width, height = 4.2 * cols, 2.9 * nrows
    fig, axes = plt.subplots(nrows, cols, figsize=(width, height), squeeze=False,
                             gridspec_kw=dict(left=0.5 / width, right=1 - 0.15 / width, bottom=0.45 / height,
                                              top=1 - 0.55 / height, wspace=0.22, hspace=0.45))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, title) in zip(axes.flat, panels):
        for i, (label, rows) in enumerate(runs):
            pts = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None]
            if not pts:
                continue
            steps, values = zip(*pts)
            color = colors[i % len(colors)]
            window = max(1, len(values) // 12)
            if window > 1:
                ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(steps, smooth(values, window), color=color, linewidth=1.6, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, names = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, loc="upper center", ncol=min(len(names), 4), fontsize=9, frameon=False)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    atomic_write(out_path, png.getvalue())
    return out_path
