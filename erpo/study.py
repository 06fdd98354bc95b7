"""`erpo study CONFIG`: the long-horizon GRPO-vs-ERPO stability study (docs/stability.md).

A grid of training runs, variants (grpo, erpo and its ablations) x seeds, each an
`erpo train` run (the Trainer, no second loop) evaluated by `erpo eval` (eval_command)
over the temperature sweep of docs/method.md section 8 at every `eval_every` steps; the
starting model of each seed is evaluated once, as step 0 of every variant. Then one
report (erpo.study_report): accuracy against step per temperature group, Query-KL and
Policy-KL, entropy and response length, mean and spread over seeds.

    erpo study configs/study-long.yaml              # runs what is missing, then the report
    erpo study configs/study-long.yaml jobs=2       # two runs at a time (one CPU thread each)
    erpo study configs/study-long.yaml report_only=true   # the report of what is there now

A study config holds two mappings: `study:` (the keys of STUDY_KEYS) and `train:` (the
`erpo train` keys every run shares). Layout of <out>:

    study.json                      every unit's settings: a rerun with other ones is refused
    runs/<variant>-seed<S>/         an `erpo train` run directory (checkpoints, metrics.jsonl)
    eval/<variant>-seed<S>/<variant>-seed<S>-step-NNNNNN/eval.json   `erpo eval` reports
    eval/start-seed<S>/<name>/eval.json       the starting model, step 0 of every variant
    logs/<unit>.log, times.jsonl    each unit's output; wall and CPU seconds of every part
    results.json, report.md, accuracy.png, training.png   the report

Interrupted (Ctrl-C, a kill, a reboot), the same command continues: finished runs and
evaluations are kept, an unfinished run resumes from its latest checkpoint (bit-exact,
as `erpo train resume=` does), and a checkpoint saved but not yet evaluated is evaluated.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import glob
import json
import multiprocessing
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import yaml

from .atomic import atomic_write
from .config import FIELDS, ConfigError, TrainConfig, coerce, unknown_key_error, yaml_mapping
from .errors import ErpoError

STUDY_FILE = "study.json"
TIMES_FILE = "times.jsonl"
STUDY_VERSION = 1

# Every run's settings the study sets itself (refused in train: and in a variant).
MANAGED_KEYS = ("run_dir", "resume", "overwrite", "seed", "save_every", "progress", "ref_cache", "eval_out",
                "eval_checkpoints")
# What decides the starting model and its evaluation: shared by every variant of a seed
# (the step-0 evaluation is theirs), so a variant may not set them.
SHARED_KEYS = ("model", "dataset", "prompt_field", "answer_field", "template", "reward", "max_prompt_tokens",
               "max_new_tokens", "dtype", "device", "cpu_threads", "kernel_backend", "attn_implementation",
               "cache_dir", "task", "task_max_operand", "task_train_size", "task_rl_size", "task_eval_size", "tiny_hidden_size",
               "tiny_layers", "warmstart_steps", "warmstart_lr", "warmstart_unboxed", "warmstart_batch_size") + tuple(
    name for name in FIELDS if name.startswith("eval_"))
# Keys that change nothing a unit computes: not part of its recorded settings (cache_dir only
# says where the warm start is kept; its identity is the recorded starting_model).
UNRECORDED_KEYS = ("progress", "overwrite", "resume", "cache_dir")

DEFAULT_VARIANTS = {
    "grpo": {"algorithm": "grpo"},
    "erpo": {"algorithm": "erpo"},
    "erpo-qkl-only": {"algorithm": "erpo", "query_weighting": "none"},
    "erpo-weights-only": {"algorithm": "erpo", "alpha": 0.0},
}
DEFAULT_GROUPS = {"low": [0.1, 0.3, 0.5], "mid": [0.7, 0.9, 1.0], "high": [1.1, 1.3, 1.5]}

# The `study:` keys: (help, default); `erpo study --help` prints them.
STUDY_KEYS: Dict[str, Tuple[str, Any]] = {
    "out": ("the study directory (runs, evaluations, the report)", "runs/study"),
    "seeds": ("the seeds of every variant (each: its own model init, warm start, data split and order)", [0, 1, 2]),
    "variants": ("name: {train keys} of each variant (on top of train:); on the command line a comma list picks "
                 "some of the config's", DEFAULT_VARIANTS),
    "eval_every": ("evaluate every N steps (and at the last step; step 0 is the starting model)", 100),
    "jobs": ("units (runs or starting-model evaluations) run at once, each in its own process", 1),
    "temperature_groups": ("name: [temperatures] of each accuracy panel (each temperature one of "
                           "eval_temperatures)", DEFAULT_GROUPS),
    "doc": ("a markdown page whose <!-- study:NAME --> sections are rewritten from the results, and the figures "
            "copied beside it as <page>-<figure>.png; empty = none", ""),
    "label": ("names this study's sections on the doc= page, <!-- study-LABEL:NAME -->, and its figures, "
              "<page>-LABEL-<figure>, so that one page holds several studies; empty = <!-- study:NAME -->, "
              "<page>-<figure>", ""),
    "report_only": ("write the report of what is there now, run nothing", False),
    "overwrite": ("delete the study in out= and start it over (without it, a study made with other settings there "
                  "is refused)", False),
    "force_doc": ("rewrite doc= even where it holds a report of more evaluations than this one (without it such a "
                  "page is left as it is, and the report is in out= only)", False),
}


@dataclass
class StudyConfig:
    """A study: its own keys (STUDY_KEYS) and the training keys every run shares."""

    out: str = "runs/study"
    seeds: List[int] = field(default_factory=lambda: [0, 1, 2])
    variants: Dict[str, Dict[str, Any]] = field(default_factory=lambda: dict(DEFAULT_VARIANTS))
    eval_every: int = 100
    jobs: int = 1
    temperature_groups: Dict[str, List[float]] = field(default_factory=lambda: dict(DEFAULT_GROUPS))
    doc: str = ""
    label: str = ""
    report_only: bool = False
    overwrite: bool = False
    force_doc: bool = False
    train: Dict[str, Any] = field(default_factory=dict)  # the typed train: keys (defaults not filled in)

    def base(self) -> TrainConfig:
        return TrainConfig(**self.train)

    def validate(self) -> None:
        """ConfigError (one line: the key and how to fix it) on the first bad value."""
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"seeds={self.seeds}: need a non-empty list of distinct seeds")
        if min(self.seeds) < 0:
            raise ConfigError(f"seeds={','.join(map(str, self.seeds))}: seeds are integers >= 0")
        if not self.variants:
            raise ConfigError("variants: need at least one variant (name: {train keys})")
        if self.label and not self.label.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"label={self.label!r}: use letters, digits, - and _ (it names the doc page's "
                              f"sections and figures)")
        for name in ("eval_every", "jobs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        for name, overrides in [("train:", self.train)] + [(f"variant {v}", o) for v, o in self.variants.items()]:
            managed = [k for k in overrides if k in MANAGED_KEYS]
            if managed:
                raise ConfigError(f"{name} sets {managed[0]}, which the study sets for every run (out=, seeds=, "
                                  f"eval_every=); remove it")
        for variant, overrides in self.variants.items():
            if not variant.replace("-", "").replace("_", "").isalnum() or variant == "start":
                raise ConfigError(f"variant name {variant!r}: use letters, digits, - and _ (it names directories; "
                                  f"start names the starting models)")
            shared = [k for k in overrides if k in SHARED_KEYS]
            if shared:
                raise ConfigError(f"variant {variant} sets {shared[0]}, which decides the starting model or the "
                                  f"evaluation every variant shares; set it under train: (or run another study)")
        temps = self.base().eval.temperatures
        for group, members in self.temperature_groups.items():
            missing = [t for t in members if t not in temps]
            if not members or missing:
                raise ConfigError(f"temperature_groups: {group} = {members} needs temperatures of eval_temperatures="
                                  f"{','.join(map(str, temps))} ({missing or 'none given'})")


# ---------------------------------------------------------------------- loading


def _typed_train_keys(values: Any, where: str) -> Dict[str, Any]:
    """A mapping of `erpo train` keys, each converted to its field's type."""
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a mapping of erpo train keys (key: value)")
    out = {}
    for key, value in values.items():
        if str(key) not in FIELDS:
            raise unknown_key_error(str(key), f" in {where}")
        out[str(key)] = coerce(str(key), value)
    return out


def _study_value(key: str, value: Any, where: str) -> Any:
    """A `study:` value checked against its default's type."""
    default = STUDY_KEYS[key][1]
    if isinstance(value, str) and not isinstance(default, (str, dict)):
        value = [yaml.safe_load(v) for v in value.split(",") if v.strip()] if isinstance(default, list) else \
            yaml.safe_load(value)
    if isinstance(default, list) and isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    ok = {bool: lambda v: isinstance(v, bool), int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str), dict: lambda v: isinstance(v, dict),
          list: lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)}
    if not ok[type(default)](value):
        kind = {bool: "true or false", int: "an integer", str: "a string", dict: "a mapping",
                list: "a list of integers"}[type(default)]
        raise ConfigError(f"{key}={value!r}{where} is not {kind}")
    return value


def _apply_study_key(spec: StudyConfig, key: str, value: Any, where: str) -> None:
    if key not in STUDY_KEYS:
        close = difflib.get_close_matches(key, list(STUDY_KEYS), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else "; `erpo study --help` lists the keys"
        raise ConfigError(f"unknown study key {key!r}{where}{hint}")
    value = _study_value(key, value, where)
    if key == "variants":
        value = {str(name): _typed_train_keys(o, f"variant {name}{where}") for name, o in value.items()}
    if key == "temperature_groups":
        value = {str(g): [float(t) for t in (ts if isinstance(ts, list) else [ts])] for g, ts in value.items()}
    setattr(spec, key, value)


def _read_study_file(path: str) -> Dict[str, Any]:
    data = yaml_mapping(path, "study config")
    extra = sorted(set(data) - {"study", "train"})
    if extra:
        raise ConfigError(f"study config {path!r} must hold the mappings study: and train: (not {extra[0]}:)")
    if not isinstance(data.get("study") or {}, dict):
        raise ConfigError(f"study: in {path} must be a mapping of study keys (`erpo study --help`)")
    return data


def load_study(path: str, overrides: Sequence[str] = ()) -> StudyConfig:
    """The study of a config file under key=value overrides (study keys, or train keys that
    then apply to every run; variants=a,b keeps those of the config's variants), validated."""
    data = _read_study_file(path)
    spec = StudyConfig(train=_typed_train_keys(data.get("train"), f"train: of {path}"))
    for key, value in (data.get("study") or {}).items():
        _apply_study_key(spec, str(key), value, f" in {path}")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"expected key=value, got {item!r} (e.g. jobs=2)")
        key, value = (s.strip() for s in item.split("=", 1))
        key = key.replace("-", "_")
        if key == "variants":
            chosen = [v.strip() for v in value.split(",") if v.strip()]
            unknown = [v for v in chosen if v not in spec.variants]
            if unknown or not chosen:
                raise ConfigError(f"variants={value}: {path} has the variants {', '.join(spec.variants)}")
            spec.variants = {v: spec.variants[v] for v in chosen}
        elif key in STUDY_KEYS:
            _apply_study_key(spec, key, value, "")
        elif key in FIELDS:
            spec.train.update(_typed_train_keys({key: value}, "the command line"))
        else:
            close = difflib.get_close_matches(key, list(STUDY_KEYS) + list(FIELDS), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else "; `erpo study --help` lists the study keys"
            raise ConfigError(f"unknown key {key!r}: neither a study key nor an erpo train key{hint}")
    spec.validate()
    return spec


# ---------------------------------------------------------------------- the grid


@dataclass
class Unit:
    """One piece of the study: a run of one variant and seed ("run"), or the evaluation of
    one seed's starting model ("start")."""

    name: str
    kind: str
    seed: int
    variant: str
    cfg: TrainConfig
    eval_steps: List[int]  # the checkpoints a run evaluates; [0] for a start

    @property
    def eval_dir(self) -> str:
        return self.cfg.eval.out

    def report_path(self, step: int) -> Optional[str]:
        """The eval.json of the unit at `step` when it has been written, else None."""
        if self.kind == "start":
            found = sorted(glob.glob(os.path.join(glob.escape(self.eval_dir), "*", "eval.json")))
            return found[0] if found else None
        path = os.path.join(self.eval_dir, f"{self.name}-step-{step:06d}", "eval.json")
        return path if os.path.isfile(path) else None

    def settings(self) -> Dict[str, Any]:
        """What the unit's results depend on (recorded in study.json, compared on a rerun):
        a run's whole config; for a start, the keys of its starting model and evaluation."""
        keep = SHARED_KEYS + ("seed",) if self.kind == "start" else FIELDS
        recorded = {k: v for k, v in self.cfg.to_dict().items() if k in keep and k not in UNRECORDED_KEYS}
        return {"kind": self.kind, "eval_steps": self.eval_steps, "starting_model": starting_model(self.cfg),
                **recorded}


def starting_model(cfg: TrainConfig) -> str:
    """The model a run starts from: model=, or for the demo model its warm start's directory
    name, whose hash covers the code that trains it (other code, another warm start: a study
    begun with one is not continued with the other)."""
    if not cfg.is_demo_model:
        return os.path.abspath(cfg.model)
    from .data import load_examples
    from .tiny import warmstart_dir

    return os.path.basename(warmstart_dir(cfg, load_examples(cfg, "warmstart"), cfg.resolved_template))


def eval_schedule(steps: int, every: int) -> List[int]:
    """The evaluated checkpoints of a run: every `every` steps, and the last step."""
    return sorted(set(range(every, steps + 1, every)) | {steps})


def units_of(spec: StudyConfig) -> List[Unit]:
    """The study's units: for each seed its starting model, then a run per variant."""
    units = []
    for seed in spec.seeds:
        shared = dict(spec.train, seed=seed, progress=False)
        start = f"start-seed{seed}"
        cfg = TrainConfig(**shared, run_dir=os.path.join(spec.out, "runs", start),
                          eval_out=os.path.join(spec.out, "eval", start), eval_checkpoints=[_start_entry(shared)])
        units.append(Unit(start, "start", seed, "", cfg, [0]))
        for variant, overrides in spec.variants.items():
            name = f"{variant}-seed{seed}"
            cfg = TrainConfig(**{**shared, **overrides}, run_dir=os.path.join(spec.out, "runs", name),
                              save_every=spec.eval_every, eval_out=os.path.join(spec.out, "eval", name))
            units.append(Unit(name, "run", seed, variant, cfg, eval_schedule(cfg.steps, spec.eval_every)))
    for unit in units:
        unit.cfg.validate()
    return units


def _start_entry(train: Dict[str, Any]) -> str:
    """What `erpo eval` scores as step 0: the demo's warm-started model, or model=."""
    model = TrainConfig(**train).model
    return "tiny" if model == "tiny" else model


def unit_done(unit: Unit) -> bool:
    return all(unit.report_path(s) for s in unit.eval_steps)


# ---------------------------------------------------------------------- settings of earlier results


def _first_difference(old: Dict[str, Any], new: Dict[str, Any]) -> Tuple[str, Any, Any]:
    """The first key whose recorded value is not this study's ("" when none): a key the
    record lacks (added to erpo since) is no difference while it keeps its default."""
    for key in list(new) + [k for k in old if k not in new]:
        if key not in old and key in FIELDS and new[key] == TrainConfig().get(key):
            continue
        if old.get(key) != new.get(key):
            return key, old.get(key), new.get(key)
    return "", None, None


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def prepare_out(spec: StudyConfig, units: Sequence[Unit], log: Callable[[str], None] = print) -> None:
    """Check <out> before anything runs, then record every unit's settings in study.json:
    an ErpoError when <out> holds a unit made with other settings (the first differing key
    named) or files that are not a study's; overwrite=true starts a study over. With
    report_only nothing is written and a difference is a note, not an error."""
    out = spec.out
    path = os.path.join(out, STUDY_FILE)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ErpoError(f"out={out} is a file; give the study a directory with out=DIR")
    if not spec.report_only:
        from .start import check_writable

        check_writable(out, "out")  # e.g. out=<a file>/x: one line, not a NotADirectoryError
    if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(path):
        raise ErpoError(f"out={out} holds files that are not a study's (no {STUDY_FILE}); give another out=DIR")
    if spec.report_only and not os.path.isfile(path):
        raise ErpoError(f"out={out} holds no study yet; run it first (without report_only=true)")
    if spec.overwrite and os.path.isfile(path) and not spec.report_only:
        shutil.rmtree(out)
    recorded: Dict[str, Any] = {}
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                recorded = json.load(f)["units"]
        except (OSError, ValueError, KeyError, TypeError):
            raise ErpoError(f"{path} is not a study this version can read; give another out=DIR, or "
                            f"overwrite=true to start the study over") from None
    differ = [u for u in units if u.name in recorded and _first_difference(recorded[u.name], u.settings())[0]]
    if differ:
        unit = differ[0]
        key, old, new = _first_difference(recorded[unit.name], unit.settings())
        where = unit.cfg.run_dir if unit.kind == "run" else unit.eval_dir
        why = " (the code that trains the demo model's warm start changed)" if key == "starting_model" else ""
        made = f"{where} was made with {key}={_shown(old)} (this study: {key}={_shown(new)}){why}"
        if not spec.report_only:
            raise ErpoError(f"{made}; give another out=DIR to keep both, or overwrite=true to start the study over")
        log(f"erpo: study: note: {len(differ)} units were made with other settings than this config gives now, e.g. "
            f"{made}; the report shows them as they were made")  # reading only: nothing is mixed
    if spec.report_only:
        return
    recorded.update({unit.name: unit.settings() for unit in units})
    os.makedirs(out, exist_ok=True)
    payload = {"version": STUDY_VERSION, "units": recorded}
    atomic_write(path, (json.dumps(payload, indent=1) + "\n").encode("utf-8"))


# ---------------------------------------------------------------------- running one unit


class _Clock:
    """Wall and CPU seconds of one part of a unit, appended to <out>/times.jsonl."""

    def __init__(self, out: str, unit: Unit, what: str, **extra: Any):
        self.path, self.record = os.path.join(out, TIMES_FILE), {"unit": unit.name, "what": what, **extra}

    def __enter__(self) -> "_Clock":
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, exc_type, *_: Any) -> None:
        if exc_type is not None:
            return  # an interrupted part is redone, and timed, by the rerun
        self.record.update(wall_s=round(time.perf_counter() - self.wall, 3),
                           cpu_s=round(time.process_time() - self.cpu, 3))
        with open(self.path, "a", encoding="utf-8") as f:  # one short line: appends do not interleave
            f.write(json.dumps(self.record) + "\n")


def _evaluate(out: str, unit: Unit, step: int, log: Callable[[str], None]) -> None:
    """`erpo eval` of the unit's checkpoint at `step` (its starting model for a start)."""
    from . import checkpoint as ckpt
    from .eval_command import eval_command

    cfg = unit.cfg
    if unit.kind == "run":
        path = dict(ckpt.checkpoint_dirs(cfg.run_dir)).get(step)
        if path is None:
            raise ErpoError(f"{cfg.run_dir} has no checkpoint of step {step} to evaluate (deleted?); rerun with "
                            f"overwrite=true to start the study over")
        cfg = dataclasses.replace(cfg, eval_checkpoints=[path])
    with _Clock(out, unit, "eval", step=step):
        eval_command(cfg, log)


def _train(out: str, unit: Unit, log: Callable[[str], None]) -> None:
    """Train the unit's run to its last step, evaluating each scheduled checkpoint as it is
    saved; a run with a checkpoint resumes from the latest one (erpo train resume=)."""
    from . import checkpoint as ckpt
    from .trainer import Trainer

    run_dir = unit.cfg.run_dir
    done = {s for s in unit.eval_steps if unit.report_path(s)}
    for step, _ in ckpt.checkpoint_dirs(run_dir):  # saved, then interrupted before its evaluation
        if step in unit.eval_steps and step not in done:
            _evaluate(out, unit, step, log)
            done.add(step)
    latest = ckpt.latest_checkpoint(run_dir)
    if set(unit.eval_steps) <= done:
        return
    # a run dir without a checkpoint holds nothing worth keeping: it starts over
    cfg = dataclasses.replace(unit.cfg, resume=run_dir if latest else "", overwrite=latest is None)
    with _Clock(out, unit, "setup"):
        trainer = Trainer(cfg, log=log)
    for step in unit.eval_steps:
        if step <= trainer.start_step:
            continue
        first = trainer.start_step + 1
        with _Clock(out, unit, "train", steps=[first, step]):
            trainer.train(until_step=step, plot=False)  # the study's report plots every run
        _evaluate(out, unit, step, log)


def run_unit(out: str, unit: Unit, log: Callable[[str], None]) -> None:
    """Do what is left of one unit (nothing when it is done)."""
    if unit_done(unit):
        return
    if unit.kind == "start":
        _evaluate(out, unit, 0, log)  # trains the demo model's warm start first when it is not cached
    else:
        _train(out, unit, log)


def say(msg: str) -> None:
    """Print a line now: a study's progress shows in a piped or redirected log as it happens."""
    print(msg, flush=True)


def _unit_process(out: str, unit: Unit) -> None:
    """A unit in a process of its own (jobs > 1): its output to logs/<unit>.log, an ErpoError
    as the log's last line and exit status 2; Ctrl-C (which reaches every process of the
    terminal) one line in the log and exit status 130, no traceback: the parent reports it."""
    code = 0
    with open(_log_path(out, unit), "a", encoding="utf-8") as f, contextlib.redirect_stdout(f), \
            contextlib.redirect_stderr(f):
        try:
            run_unit(out, unit, say)
        except ErpoError as exc:
            say(f"erpo: error: {exc}")
            code = 2
        except KeyboardInterrupt:
            say("erpo: interrupted; the study's rerun continues this unit where it stopped")
            code = 130
    sys.exit(code)


def _log_path(out: str, unit: Unit) -> str:
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    return os.path.join(out, "logs", f"{unit.name}.log")


# ---------------------------------------------------------------------- running the grid


def _run_here(out: str, unit: Unit) -> None:
    """A unit in this process (jobs=1), its output to logs/<unit>.log."""
    with open(_log_path(out, unit), "a", encoding="utf-8") as f, contextlib.redirect_stdout(f), \
            contextlib.redirect_stderr(f):
        run_unit(out, unit, say)


def _ready(queue: List[Unit], finished: set) -> Optional[Unit]:
    """The unit to start next: a starting model first (its evaluation trains the warm start
    its seed's runs start from, so a run waits for it; started early, no core idles waiting
    for the last seed's), else the first queued run whose starting model is done."""
    return next((u for u in queue if u.kind == "start"), None) or \
        next((u for u in queue if f"start-seed{u.seed}" in finished), None)


def _last_line(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        lines = []
    return lines[-1] if lines else "no output"


def run_units(spec: StudyConfig, units: Sequence[Unit], log: Callable[[str], None]) -> None:
    """Do every unit not done yet, `jobs` at a time; one line per finished unit."""
    finished = {u.name for u in units if unit_done(u)}
    queue = [u for u in units if u.name not in finished]
    total, t_start = len(queue), time.perf_counter()

    def report(unit: Unit, t0: float) -> None:
        finished.add(unit.name)
        log(f"erpo: study: {unit.name} done in {time.perf_counter() - t0:.0f}s ({total - len(queue) - len(running)}/"
            f"{total}, {time.perf_counter() - t_start:.0f}s in all)")

    running: Dict[Any, Tuple[Any, Unit, float]] = {}
    if spec.jobs == 1:
        while queue:
            unit, t0 = queue.pop(0), time.perf_counter()
            _run_here(spec.out, unit)
            report(unit, t0)
        return
    from multiprocessing.connection import wait

    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no state shared with this one
    failed: Optional[Unit] = None
    try:
        while (queue or running) and failed is None:
            while len(running) < spec.jobs and _ready(queue, finished) is not None:
                unit = _ready(queue, finished)
                queue.remove(unit)
                process = ctx.Process(target=_unit_process, args=(spec.out, unit), name=f"erpo-study-{unit.name}")
                process.start()
                running[process.sentinel] = (process, unit, time.perf_counter())
            if not running:
                break
            for sentinel in wait(list(running)):
                process, unit, t0 = running.pop(sentinel)
                process.join()
                if process.exitcode != 0:
                    failed = failed or unit
                else:
                    report(unit, t0)
    finally:
        for process, _, _ in running.values():  # interrupted, or another unit failed: they resume later
            process.terminate()
            process.join()
    if failed is not None:
        log_file = _log_path(spec.out, failed)
        raise ErpoError(f"study unit {failed.name} failed: {_last_line(log_file)} (log: {log_file}); rerun the same "
                        f"command to continue once it is fixed")


def study_command(args: Sequence[str], log: Callable[[str], None] = say) -> Dict[str, str]:
    """`erpo study CONFIG [key=value ...]`: run what is missing of the study, then write
    its report; returns the report's files ({name: path})."""
    from .study_report import write_study_report

    if not args or "=" in args[0]:
        raise ConfigError("erpo study needs a study config first: erpo study configs/study-long.yaml [key=value ...]")
    from .named_configs import config_path

    spec = load_study(config_path(args[0], "study-"), args[1:])  # a shipped study by name: erpo study study-epochs
    if spec.doc and not os.path.isfile(spec.doc):  # e.g. docs/stability.md of a shipped study, run outside a clone
        log(f"erpo: study: note: doc={spec.doc} does not exist here; the report goes to {spec.out} only")
        spec.doc = ""
    units = units_of(spec)
    prepare_out(spec, units, log)
    if not spec.report_only:
        runs = [u for u in units if u.kind == "run"]
        todo = [u for u in units if not unit_done(u)]
        cfg = runs[0].cfg
        log(f"erpo: study {spec.out}: {len(runs)} runs ({', '.join(spec.variants)} x seeds "
            f"{','.join(map(str, spec.seeds))}) of {cfg.steps} steps, evaluated every {spec.eval_every} steps at "
            f"{len(cfg.eval.temperatures)} temperatures; {len(todo)} of {len(units)} units to do, {spec.jobs} at a "
            f"time (logs in {os.path.join(spec.out, 'logs')})")
        run_units(spec, units, log)
    return write_study_report(spec, units, log)


def study_help() -> str:
    lines = ["usage: erpo study CONFIG [key=value ...]", "",
             "Runs the grid of a study config (study: and train: mappings; configs/study-*.yaml), evaluates every",
             "run at regular checkpoints over the temperature sweep, and writes the report (docs/stability.md).",
             "Rerun the same command to continue an interrupted study. key=value sets a study key or, for every",
             "run, an `erpo train` key (`erpo train --help`).", "", "study keys:"]
    width = max(map(len, STUDY_KEYS))
    for key, (text, default) in STUDY_KEYS.items():
        shown = ", ".join(default) if key == "variants" else (
            "low, mid, high" if key == "temperature_groups" else _shown(default))
        lines.append(f"  {key:<{width}}  {text} [default: {shown}]")
    return "\n".join(lines)
