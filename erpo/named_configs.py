"""The configs that ship with erpo (configs/*.yaml of the repository, installed as the package
data erpo/configs), reachable by name from anywhere: `erpo train demo`, `erpo study
study-epochs`. A path that exists is always the file it names; a name, or the documented
configs/NAME.yaml where no such file is here, is the shipped config of that name."""
from __future__ import annotations

import os
from typing import Dict, List

from .config import ConfigError

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
# installed: erpo/configs (setup.py's package data); in a checkout: configs/ beside erpo/
CONFIG_DIRS = (os.path.join(_PACKAGE, "configs"), os.path.join(os.path.dirname(_PACKAGE), "configs"))


def shipped_configs() -> Dict[str, str]:
    """{name: path} of the shipped configs (the first directory of CONFIG_DIRS that holds them)."""
    for root in CONFIG_DIRS:
        if os.path.isdir(root):
            names = sorted(n for n in os.listdir(root) if n.endswith(".yaml"))
            if names:
                return {n[: -len(".yaml")]: os.path.join(root, n) for n in names}
    return {}


def config_path(path: str, prefix: str = "") -> str:
    """`path` where it exists; else the shipped config it names (NAME, NAME.yaml or
    configs/NAME.yaml); else a ConfigError naming the shipped ones. `prefix` (e.g. study-)
    is what the names of a command's configs start with, listed first."""
    if os.path.exists(path):
        return path
    shipped = shipped_configs()
    head, name = os.path.split(os.path.normpath(path))
    stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
    if head in ("", "configs") and stem in shipped:
        return shipped[stem]
    names: List[str] = sorted(shipped, key=lambda n: (not n.startswith(prefix), n)) if prefix else sorted(shipped)
    known = f"; the shipped configs, by name: {', '.join(names)}" if names else ""
    raise ConfigError(f"config file {path!r} does not exist{known}")
