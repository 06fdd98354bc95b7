"""The `erpo` command.

    erpo train [config.yaml] [key=value ...]       train (no arguments: the embedded demo)
    erpo train resume=RUN [steps=N ...]            continue RUN exactly where it stopped
    erpo ref-cache [config.yaml] [key=value ...]   build the reference cache of a run
    erpo plot RUN [RUN ...] [--out PNG]            curves of one run, or several overlaid
    erpo eval [config.yaml] [key=value ...]        evaluate checkpoints (erpo-method.md section 8)

Bad input is one line, `erpo: error: ...`, and exit status 2; no traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence, Tuple

from .config import ConfigError, ErpoError, TrainConfig, help_text, load_config, merge_for_resume, read_yaml

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


def resolve_config(args: Sequence[str], command: str = "train") -> TrainConfig:
    """Defaults <- config file <- overrides. With resume=RUN (train only) the base is
    RUN/config.yaml; for `eval` without a config file, <run_dir>/config.yaml when there is one."""
    path, overrides = _split_args(args)
    cfg, given = load_config(path, overrides)
    if command != "train":
        if any(item.split("=", 1)[0].strip() == "resume" for item in overrides) and cfg.resume:
            raise ConfigError(f"resume= continues a training run: use it with `erpo train`, not `erpo {command}`")
        if command == "eval" and path is None and os.path.isfile(os.path.join(cfg.run_dir, "config.yaml")):
            saved = read_yaml(os.path.join(cfg.run_dir, "config.yaml"))
            saved.update(given)
            cfg = TrainConfig(**saved)
        cfg.resume = ""  # the saved config of a resumed run records resume=; only train resumes
    if cfg.resume:
        saved_path = os.path.join(cfg.resume, "config.yaml")
        if not os.path.isdir(cfg.resume):
            raise ConfigError(f"resume={cfg.resume}: no such run directory")
        if not os.path.isfile(saved_path):
            raise ConfigError(f"resume={cfg.resume}: no config.yaml there; is it a run directory?")
        saved = read_yaml(saved_path)
        given = {k: v for k, v in given.items() if k not in ("resume", "run_dir")}
        run = os.path.normpath(cfg.resume)
        cfg = merge_for_resume(saved, given)
        cfg.resume = cfg.run_dir = run
    cfg.validate()
    return cfg


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="erpo", description="GRPO / ERPO training with fused loss kernels.", epilog=USAGE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", metavar="{train,ref-cache,plot,eval}")
    for name, text in (
        ("train", "train a model (no arguments: the embedded demo)"),
        ("ref-cache", "build the reference cache of a run"),
        ("eval", "evaluate checkpoints over temperatures"),
    ):
        sp = sub.add_parser(name, help=text, add_help=False)
        sp.add_argument("-h", "--help", action="store_true")
        sp.add_argument("args", nargs="*", metavar="[config.yaml] key=value")
    sp = sub.add_parser("plot", help="plot the curves of one or more runs")
    sp.add_argument("runs", nargs="*", metavar="RUN")
    sp.add_argument("--out", default=None, help="PNG path (default: RUN/curves.png, or compare.png beside the runs)")
    return p


def _print_help(command: str) -> None:
    print(f"usage: erpo {command} [config.yaml] [key=value ...]\n\nkeys:\n{help_text()}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "help", False):
        _print_help(args.command)
        return 0
    trainer = None
    try:
        if args.command == "plot":
            from .plot import plot_runs

            print(f"erpo: wrote {plot_runs(args.runs, args.out)}")
            return 0
        cfg = resolve_config(args.args, args.command)
        if args.command == "train":
            from .trainer import Trainer

            trainer = Trainer(cfg)
            trainer.train()
        elif args.command == "ref-cache":
            from .trainer import build_cache_command

            build_cache_command(cfg)
        elif args.command == "eval":
            from .trainer import eval_command

            eval_command(cfg)
        return 0
    except ErpoError as exc:
        print(f"erpo: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        where = ""
        if trainer is not None:
            from .checkpoint import latest_checkpoint

            last = latest_checkpoint(trainer.cfg.run_dir)
            where = (f"; the last checkpoint is {last}, continue with: erpo train resume={trainer.cfg.run_dir}"
                     if last else "; no checkpoint was written yet")
        print(f"erpo: interrupted{where}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
