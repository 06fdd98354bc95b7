"""`erpo eval`: which models (runs, checkpoints, model directories, tiny) and reports a
command means, the check that no report made with other settings is replaced silently,
and the loop that evaluates each model (erpo.evaluate) and writes its report
(erpo.eval_report)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .config import TrainConfig
from .errors import ErpoError
from .eval_report import compare_report, compare_table, format_table, write_report
from .evaluate import EvalResult, evaluate

__all__ = ["check_no_silent_replace", "eval_command", "report_settings"]

TRUNCATION_WARNING = 0.05  # `erpo eval` warns when more responses than this ran into max_new_tokens


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
    from .models import check_model_dir, resolve_device
    from .tiny import resolve_model_dir

    if entry == "tiny":  # its warm start trains on the demo model's threads (cpu_threads, else 1), as erpo train's
        demo = replace(cfg, model="tiny")
        threads = torch.get_num_threads()
        resolve_device(demo)
        try:
            return resolve_model_dir(demo, load_examples(demo, "warmstart"), log), "tiny-start"
        finally:
            torch.set_num_threads(threads)
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
    """The evaluation data as reports record it: a file's absolute path, or the embedded
    task (arithmetic; arithmetic:mixed for task=mixed)."""
    data = cfg.eval.dataset or cfg.dataset
    if os.path.isfile(data):
        return os.path.abspath(data)
    return f"{data}:{cfg.demo.task}" if data == "arithmetic" and cfg.demo.task != "add" else data


def _planned_settings(cfg: TrainConfig, model_dir: str, n_problems: int, max_new_tokens: int) -> dict[str, Any]:
    """report_settings of the report this `erpo eval` is about to write for ``model_dir``."""
    n = cfg.eval.n_samples
    return {
        "model": os.path.abspath(model_dir), "data": _data_path(cfg), "problems": n_problems,
        "template": cfg.eval_template, "reward": cfg.eval_reward,
        "temperatures": sorted(float(t) for t in cfg.eval.temperatures), "n": n,
        "k": sorted({int(k) for k in cfg.eval.k_values}) or list(range(1, n + 1)),
        "max_new_tokens": max_new_tokens, "seed": cfg.seed, "batch_size": cfg.eval.batch_size,
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
    """cfg.eval.checkpoints, or the run's own directory (its latest checkpoint) when empty."""
    from . import checkpoint as ckpt

    if cfg.eval.checkpoints:
        return list(cfg.eval.checkpoints)
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
    suffix = f"-{os.path.splitext(os.path.basename(cfg.eval.dataset))[0]}" if cfg.eval.dataset else ""
    targets: dict[str, str] = {}
    for entry in _eval_entries(cfg):
        model_dir, name = _eval_target(entry, cfg, log)
        if model_dir not in targets:
            targets[model_dir] = _unique(name + suffix, set(targets.values()))
    return targets


def _writable_out_root(cfg: TrainConfig) -> str:
    """The report directory (created), or an ErpoError now rather than after hours of generation."""
    out_root = cfg.eval.out or os.path.join(cfg.run_dir, "eval")
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
    from .data import encode_prompts, render_prompt
    from .models import check_context_length, check_vocabulary, load_model, load_tokenizer
    from .rewards import get_reward_fn

    max_new_tokens = cfg.eval_max_tokens
    log(f"erpo: {name}: loading {model_dir} ...")
    model = load_model(model_dir, device, dtype).eval()
    tokenizer = load_tokenizer(model_dir)
    check_vocabulary(model, tokenizer, model_dir)
    prompts = encode_prompts(tokenizer, examples, cfg.eval_template)  # as in training (BOS included)
    check_context_length(model_dir, max(len(p) for p in prompts), max_new_tokens)
    t0 = time.perf_counter()
    result = evaluate(
        model, tokenizer, prompts, [ex.answer for ex in examples], reward_fn=get_reward_fn(cfg.eval_reward),
        temperatures=cfg.eval.temperatures, n_samples=cfg.eval.n_samples, k_values=cfg.eval.k_values or None,
        max_new_tokens=max_new_tokens, batch_size=cfg.eval.batch_size,
        seed=cfg.seed, progress=cfg.progress, keep_samples=cfg.eval.save_samples,
    )
    result.settings.update({"model": model_dir, "data": cfg.eval.dataset or cfg.dataset, "template": cfg.eval_template,
                            "reward": cfg.eval_reward, "seconds": round(time.perf_counter() - t0, 2),
                            "model_path": os.path.abspath(model_dir), "data_path": _data_path(cfg)})
    written = write_report(result, out, title=name, questions=[ex.prompt for ex in examples],
                           answers=[ex.answer for ex in examples],
                           prompts=[render_prompt(cfg.eval_template, ex.prompt, tokenizer) for ex in examples])
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
    """`erpo eval`: evaluate each of cfg.eval.checkpoints (default: the latest checkpoint of
    cfg.run_dir) on the evaluation set; a table per model on the terminal, reports in
    <out>/<name>/ (eval.json, eval.md, eval.png), and with several models compare.{md,png,json}
    in <out> (cfg.eval.out, default <run_dir>/eval). Returns {name: report dir}."""
    from .data import load_examples
    from .models import resolve_compute_dtype, resolve_device

    cfg.validate()
    examples = load_examples(cfg, "eval")
    if cfg.eval.limit:
        examples = examples[: cfg.eval.limit]
    device = resolve_device(cfg)  # and cpu_threads, before a warm start of model=tiny trains
    if "tiny" in cfg.eval.checkpoints:  # its context, checked before its warm start (minutes on a CPU)
        from .config import TINY_CONTEXT
        from .data import encode_prompts
        from .models import check_context_length
        from .tiny import build_tokenizer

        prompts = encode_prompts(build_tokenizer(), examples, cfg.eval_template)
        check_context_length("tiny", max(len(p) for p in prompts), cfg.eval_max_tokens, limit=TINY_CONTEXT)
    targets = _eval_targets(cfg, log)  # model dir -> report name
    out_root = _writable_out_root(cfg)
    max_new_tokens = cfg.eval_max_tokens
    planned = {name: _planned_settings(cfg, model_dir, len(examples), max_new_tokens)
               for model_dir, name in targets.items()}
    if not cfg.overwrite:
        check_no_silent_replace(out_root, planned)
    dtype = resolve_compute_dtype(cfg, device)
    n_temps = len(cfg.eval.temperatures)
    log(f"erpo: eval on {len(examples)} problems of {cfg.eval.dataset or cfg.dataset} (template {cfg.eval_template}, "
        f"reward {cfg.eval_reward}, responses of at most {max_new_tokens} tokens), {cfg.eval.n_samples} samples at "
        f"each of {n_temps} temperature{'s' if n_temps > 1 else ''} + greedy")
    results, out_dirs = {}, {}
    for model_dir, name in targets.items():
        out_dirs[name] = os.path.join(out_root, name)
        results[name] = _evaluate_model(cfg, model_dir, name, examples, out_dirs[name], device, dtype, log)
    if len(results) > 1:
        path = compare_report(results, out_root)
        log(f"\n{compare_table(results)}\n-> {path}, compare.png, compare.json")
    return out_dirs
