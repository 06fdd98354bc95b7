"""The `erpo` command.

    erpo train [config.yaml] [key=value ...]       train (no arguments: the embedded demo; a shipped config
                                                   by name: erpo train demo, configs/*.yaml of the repository)
    erpo train resume=RUN [steps=N ...]            continue RUN exactly where it stopped
    erpo ref-cache [config.yaml] [key=value ...]   build the reference cache of a run
    erpo plot RUN [RUN ...] [--out PNG]            curves of one run, or several overlaid
    erpo eval [model=RUN_OR_DIR[,...]] [data=FILE] [temperatures=...] [n=N] [k=...]
                                                   accuracy over temperatures (docs/method.md section 8)
    erpo study STUDY.yaml [key=value ...]          a grid of runs evaluated over training (docs/stability.md)
    erpo env                                       device, torch, CUDA, triton, and the backend each op uses
    torchrun --nproc-per-node N -m erpo train ...  train on N ranks (FSDP2; each rank an equal share of the queries)

Bad input is one line, `erpo: error: ...`, and exit status 2; no traceback.
"""
from __future__ import annotations

import argparse
import difflib
import glob
import os
import signal
import sys
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .config import (EVAL_KEYS, FIELDS, ConfigError, TrainConfig, help_text, load_config, merge_for_resume,
                     missing_run_paths, read_yaml)
from .errors import ErpoError

USAGE = __doc__.split("\n\n")[1]


def _split_args(args: Sequence[str]) -> Tuple[Optional[str], List[str]]:
    """(config file or None, key=value overrides)."""
    path, overrides = None, []
    for i, a in enumerate(args):
        if "=" in a:
            overrides.append(a)
        elif i == 0 and path is None:
            path = a
        else:
            raise ConfigError(f"expected key=value, got {a!r} (only the first argument may be a config file)")
    return path, overrides


def run_of(path: str) -> Optional[str]:
    """The run directory holding ``path`` (a run, or a checkpoint RUN/checkpoints/step-N), or None."""
    from .checkpoint import CHECKPOINTS  # here: `erpo --help` and config errors need no torch

    norm = os.path.normpath(path)
    for candidate in (norm, os.path.dirname(os.path.dirname(norm))):
        if os.path.isfile(os.path.join(candidate, "config.yaml")) and os.path.isdir(os.path.join(candidate, CHECKPOINTS)):
            if candidate == norm or os.path.basename(os.path.dirname(norm)) == CHECKPOINTS:
                return candidate
    return None


# Training keys a user of `erpo eval` may type for an eval key: refused, naming the right one.
EVAL_LOOKALIKES = {"temperature": "temperatures", "group_size": "n"}


def _check_eval_keys(overrides: Sequence[str]) -> None:
    """ConfigError for a key `erpo eval` takes neither as a short key (model=, data=, n=, k=,
    ...; config.EVAL_KEYS) nor as a config key, or a training key mistaken for an eval key."""
    for item in overrides:
        key = item.split("=", 1)[0].strip().replace("-", "_")
        if key in EVAL_LOOKALIKES:
            raise ConfigError(f"{key}= is a training key that erpo eval does not use; did you mean "
                              f"{EVAL_LOOKALIKES[key]}=?")
        if key not in EVAL_KEYS and key not in FIELDS:
            close = (difflib.get_close_matches(key, list(EVAL_KEYS), n=1, cutoff=0.5)
                     or difflib.get_close_matches(key, list(FIELDS), n=1, cutoff=0.6))
            hint = f"; did you mean {close[0]}?" if close else "; `erpo eval --help` lists the keys"
            raise ConfigError(f"unknown key {key!r} for erpo eval{hint}")


def resolve_config(args: Sequence[str], command: str = "train") -> TrainConfig:
    """Defaults <- config file <- overrides. With resume=RUN (train only) the base is
    RUN/config.yaml. For `eval` without a config file the base is the config.yaml of the
    run the first model= entry belongs to, else of run_dir when it has one."""
    path, overrides = _split_args(args)
    if path:
        from .named_configs import config_path

        path = config_path(path)  # a shipped config by name (erpo train demo) where no such file is here
    if command == "eval":
        _check_eval_keys(overrides)
    cfg, given = load_config(path, overrides, aliases=EVAL_KEYS if command == "eval" else None)
    if command != "train":
        if any(item.split("=", 1)[0].strip() == "resume" for item in overrides) and cfg.resume:
            raise ConfigError(f"resume= continues a training run: use it with `erpo train`, not `erpo {command}`")
        if command == "eval":
            cfg = _eval_config(cfg, given, from_file=path is not None)
        cfg.resume = ""  # the saved config of a resumed run records resume=; only train resumes
    if cfg.resume:
        from .checkpoint import resume_point

        run, point = resume_point(cfg.resume)
        saved_path = os.path.join(run, "config.yaml")
        if not os.path.isdir(cfg.resume):
            raise ConfigError(f"resume={cfg.resume}: no such run directory or checkpoint")
        if not os.path.isfile(saved_path):
            raise ConfigError(f"resume={cfg.resume}: no config.yaml in {run}; give a run directory or one of its "
                              f"checkpoints (RUN/checkpoints/step-N)")
        if point is None and os.path.normpath(cfg.resume) != run:
            raise ConfigError(f"resume={cfg.resume} is not a complete checkpoint; give the run (resume={run}: its "
                              f"latest checkpoint) or another of its checkpoints")
        saved = read_yaml(saved_path)
        # run_dir= other than the resumed run forks it: the new run starts from the checkpoint,
        # the resumed run is left as it is
        target = os.path.normpath(given["run_dir"]) if "run_dir" in given else run
        resume = os.path.normpath(cfg.resume)
        given = {k: v for k, v in given.items() if k not in ("resume", "run_dir")}
        cfg = merge_for_resume(saved, given)
        cfg.resume, cfg.run_dir = resume, target
        missing_run_paths(cfg, cfg.resume)
    if command != "eval":
        cfg.model = model_path(cfg.model)
        cfg.resolve_training_defaults()
    if command == "eval":
        cfg.eval.name_keys(EVAL_KEYS)  # its messages name the keys as erpo eval takes them (n=, not eval_n_samples=)
    cfg.validate()
    return cfg


def model_path(model: str) -> str:
    """model= as a model directory: a run (RUN, holding config.yaml and checkpoints/) stands for
    its latest checkpoint; a checkpoint, a Hugging Face directory or tiny is kept as it is."""
    from .checkpoint import latest_checkpoint

    if model == "tiny" or os.path.isfile(os.path.join(model, "config.json")) or not os.path.isfile(
            os.path.join(model, "config.yaml")):
        return model
    latest = latest_checkpoint(model)
    if latest is None:
        raise ConfigError(f"model={model} is a run without a checkpoint yet; train it first, or name a model "
                          f"directory or a checkpoint (RUN/checkpoints/step-N)")
    return latest


def _eval_config(cfg: TrainConfig, given: Dict[str, Any], from_file: bool) -> TrainConfig:
    """The config `erpo eval` runs with: the saved config of the first model's run under the
    given keys (unless a config file was given), and where its reports go: <run>/eval for
    one run, <the runs' parent>/eval for several, runs/eval for models outside any run."""
    entries = []
    for entry in cfg.eval.checkpoints:  # model=runs/erpo/checkpoints/* (quoted): every checkpoint, in order
        if any(ch in entry for ch in "*?["):
            matches = sorted(m for m in glob.glob(entry) if os.path.isdir(m))
            if not matches:
                raise ConfigError(f"model={entry} matches no directory")
            entries += matches
        else:
            entries.append(entry)
    if "eval_checkpoints" in given:
        cfg.eval.checkpoints = entries
        given = {**given, "eval_checkpoints": entries}
    chosen_run_dir = "run_dir" in given
    cfg.resolve_run_dir()
    run = run_of(entries[0]) if entries and not chosen_run_dir else None
    if run is not None:
        given = {**given, "run_dir": run}
        cfg.run_dir = run
    outside_runs = bool(entries) and run is None and not chosen_run_dir  # e.g. model=/models/Qwen2.5
    base = os.path.join(cfg.run_dir, "config.yaml")
    if not from_file and not outside_runs and os.path.isfile(base):
        saved = read_yaml(base)
        saved.update(given)
        cfg = TrainConfig(**saved)
        _own_template_and_reward(cfg, given, [r for r in map(run_of, entries) if r is not None])
    if "eval_n_samples" in given and "eval_k_values" not in given:
        cfg.eval.k_values = []  # a new n: Pass@k for every k <= n, not the k of a saved config
    runs = sorted({r for r in map(run_of, entries) if r is not None})
    if not cfg.eval.out and not chosen_run_dir:
        if outside_runs:
            cfg.eval.out = os.path.join("runs", "eval")  # not into the default run_dir (the demo's run)
        elif len(runs) > 1:  # several runs compared: beside them, not inside the first (nor lost with it)
            cfg.eval.out = os.path.join(os.path.commonpath([os.path.abspath(os.path.dirname(r)) for r in runs]),
                                        "eval")
    return cfg


def _own_template_and_reward(cfg: TrainConfig, given: Dict[str, Any], runs: List[str]) -> None:
    """A run is evaluated with the template and reward it was trained with (auto resolved
    against its training data), whatever data= names; template=/reward= choose others.
    Runs trained with different ones are refused together unless those keys are given."""
    for key in ("template", "reward"):
        if key in given:
            continue
        own = getattr(cfg, f"{key}_for")(cfg.is_demo_task)
        setattr(cfg, key, own)
        for run in runs:
            other = TrainConfig(**read_yaml(os.path.join(run, "config.yaml")))
            theirs = getattr(other, f"{key}_for")(other.is_demo_task)
            if theirs != own:
                raise ConfigError(f"{run} was trained with {key}={theirs}, {cfg.run_dir} with {key}={own}: evaluate "
                                  f"them separately, or give {key}= to score both the same way")


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, like every other `erpo` error."""

    def error(self, message: str):
        hint = " (keys are given as key=value, e.g. n=4; `erpo --help` lists the commands)" if "--" in message else ""
        self.exit(2, f"erpo: error: {message}{hint}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="erpo", description="GRPO / ERPO training with fused loss kernels.", epilog=USAGE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", metavar="{train,ref-cache,plot,eval,study,env}", parser_class=_Parser)
    for name, text in (
        ("train", "train a model (no arguments: the embedded demo)"),
        ("ref-cache", "build the reference cache of a run"),
        ("eval", "evaluate checkpoints over temperatures"),
        ("study", "run a grid of runs (variants x seeds) evaluated over training, and its report"),
    ):
        sp = sub.add_parser(name, help=text, add_help=False)
        sp.add_argument("-h", "--help", action="store_true")
        sp.add_argument("args", nargs="*", metavar="[config.yaml] key=value")
    sub.add_parser("env", help="device, torch, CUDA, triton and the backend each op will use")
    sp = sub.add_parser("plot", help="plot the curves of one or more runs")
    sp.add_argument("runs", nargs="*", metavar="RUN")
    sp.add_argument("--out", default=None, help="PNG path (default: RUN/curves.png, or compare.png beside the runs)")
    return p


EVAL_HELP = """usage: erpo eval [config.yaml] [model=RUN_OR_DIR[,RUN_OR_DIR ...]] [data=FILE] [temperatures=T1,T2,...]
                 [n=N] [k=K1,K2,...] [key=value ...]

Greedy Pass@1, and at each temperature n samples per problem: Avg@n and unbiased
Pass@k (docs/method.md section 8). A table per model on the terminal; eval.json,
eval.md and eval.png in <out>/<name>/; with several models compare.md/png/json in <out>.

  model=         runs (their latest checkpoint), checkpoints (RUN/checkpoints/step-N),
                 Hugging Face model directories, or tiny (the demo's starting model);
                 comma-separated to compare them on one plot; a quoted glob
                 ("runs/erpo/checkpoints/*") takes every match.  [default: run_dir's latest checkpoint]
  data=          a .jsonl/.json/.parquet file (MATH-style problem/solution records work
                 as they are), or arithmetic.  [default: the run's held-out split, or its dataset]
  template=, reward=  [default: the run's own, whatever data= is; outside any run: r1 and
                 math_verify for a file, plain and exact_match for arithmetic]
  temperatures=  sampling temperatures, each > 0; greedy is always run.  [default: %s]
  n=             samples per problem and temperature.  [default: 8]
  k=             k of Pass@k, each <= n.  [default: every k from 1 to n]
  max_new_tokens= response length (default: the run's; outside any run %d (%d for model=tiny), %d for
                 data=arithmetic)
  batch_size=, limit= (the first N problems only)
  save_samples=true  also write samples.jsonl: every completion, its question and prompt, gold answer, grade
  out=           report directory  [default: <run>/eval for one run, <their parent>/eval
                 for several, runs/eval for a model outside any run]
  overwrite=true replace reports there made with other settings (refused otherwise)

Every training key is accepted too (e.g. device=, dtype=, template=, reward=, seed=):"""


def _print_help(command: str) -> None:
    if command == "study":
        from .study import study_help

        print(study_help())
        return
    if command == "eval":
        from .config import DEMO_MAX_NEW_TOKENS, EVAL_TEMPERATURES, MAX_NEW_TOKENS, TINY_MAX_NEW_TOKENS

        print(EVAL_HELP % (",".join(map(str, EVAL_TEMPERATURES)), MAX_NEW_TOKENS, TINY_MAX_NEW_TOKENS,
                           DEMO_MAX_NEW_TOKENS))
        print(help_text())
        return
    print(f"usage: erpo {command} [config.yaml] [key=value ...]\n\nkeys, by section:\n\n{help_text()}")


def _join_ranks(cfg: TrainConfig, command: str) -> bool:
    """Under torchrun (erpo train only): check the world size, one line of bad input
    before any process group starts, then join torchrun's process group. False (nothing
    done) in one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun --nproc-per-node
    if world > 1 and command != "train":
        raise ConfigError(f"erpo {command} runs in one process: start it without torchrun "
                          f"(torchrun --nproc-per-node N -m erpo train is the distributed command)")
    if command != "train" or "LOCAL_RANK" not in os.environ:
        return False
    from . import distributed
    from .models import resolve_device
    from .start import check_world_size

    check_world_size(cfg, world)
    distributed.init(resolve_device(cfg).type)
    return True


def _leave_ranks(launched: bool) -> None:
    """Barrier, then destroy the process group _join_ranks joined (no-op when it joined none)."""
    if launched:
        from . import distributed

        distributed.shutdown()


def _print_piped(text: str) -> int:
    """Print a report; a reader that stops early (`erpo env | head`) ends it quietly."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM (what schedulers and `kill` send), raised where the run is, as Ctrl-C is: the
    same clean stop (checkpoints are written atomically, the last complete one is named)."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated()


def main(argv: Optional[Sequence[str]] = None) -> int:
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        return _main(argv)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _command_without_config(args: argparse.Namespace) -> Optional[int]:
    """env, plot and study (which reads a study config of its own): their exit status; None
    for the commands of a TrainConfig."""
    if args.command == "env":
        from .env import env_report

        return _print_piped(env_report())
    if args.command == "plot":
        from .plot import plot_runs

        print(f"erpo: wrote {plot_runs(args.runs, args.out)}")
        return 0
    if args.command == "study":
        from .study import study_command

        study_command(args.args)
        return 0
    return None


def _main(argv: Optional[Sequence[str]]) -> int:
    parser = _parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "help", False):
        _print_help(args.command)
        return 0
    trainer = None
    launched = False  # under torchrun: this process joined a process group
    try:
        status = _command_without_config(args)
        if status is not None:
            return status
        cfg = resolve_config(args.args, args.command)
        launched = _join_ranks(cfg, args.command)
        if args.command == "train":
            from .trainer import Trainer

            trainer = Trainer(cfg)
            trainer.train()
            _leave_ranks(launched)
        elif args.command == "ref-cache":
            from .start import build_cache_command

            build_cache_command(cfg)
        elif args.command == "eval":
            from .eval_command import eval_command

            eval_command(cfg)
        return 0
    except ErpoError as exc:
        message = str(exc)
        _leave_ranks(launched)  # every rank raised it (the checks read the same files): end together
        if os.environ.get("RANK", "0") == "0":  # under torchrun, one line for all ranks
            print(f"erpo: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        where = ""
        if trainer is not None:
            from .checkpoint import latest_checkpoint

            last = latest_checkpoint(trainer.cfg.run_dir)
            where = (f"; the last checkpoint is {last}, continue with: erpo train resume={trainer.cfg.run_dir}"
                     if last else "; no checkpoint was written yet")
        if args.command == "study":
            where = "; finished runs and evaluations are kept: rerun the same command to continue"
        terminated = isinstance(exc, Terminated)
        print(f"erpo: {'terminated (SIGTERM)' if terminated else 'interrupted'}{where}", file=sys.stderr)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main())
