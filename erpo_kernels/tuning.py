"""The tuning file: the fastest tiles `python -m bench tune --device cuda` timed on a GPU.

One JSON file (ERPO_TUNING_FILE, else $XDG_CACHE_HOME/erpo/tiles.json, else
~/.cache/erpo/tiles.json):

    {"format": "erpo-tiles/1",
     "entries": [{"gpu": "NVIDIA H200", "capability": [9, 0], "op": "linear_token_logprobs",
                  "dtype": "bfloat16", "D": 4096, "V": 151936,
                  "tiles": {"block_n": 128, ...}, "ms": 12.3, "timed": {...}, "triton": "3.6.0"}]}

An entry is found by (op, GPU name, dtype, D, V): never by N, so a row's results stay
independent of the batch whatever the file says. The file is read once per process (the
forward and the backward of a call always agree); a file that cannot be read or an entry
whose tiles do not parse is skipped with one warning, and the default tiles apply.
"""
from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

FORMAT = "erpo-tiles/1"
ENV = "ERPO_TUNING_FILE"
Key = Tuple[str, str, str, int, int]  # (op, gpu, dtype, D, V)


def tuning_path() -> Path:
    """Where the op looks for the tuning file (and where bench tune writes it)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "erpo" / "tiles.json"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def entry_key(op: str, gpu: str, dtype: torch.dtype, d: int, v: int) -> Key:
    """The lookup key of an entry: no N in it (batch invariance)."""
    return (op, gpu, dtype_name(dtype), int(d), int(v))


def _key_of(entry: Dict) -> Key:
    return (str(entry["op"]), str(entry["gpu"]), str(entry["dtype"]), int(entry["D"]), int(entry["V"]))


def parse(data: Dict) -> Dict[Key, Dict[str, int]]:
    """key -> tiles (field name -> value) of a tuning file's contents; ValueError if it is not one."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
        raise ValueError(f"not an {FORMAT} file (a dict with format {FORMAT!r} and a list of entries)")
    out = {}
    for entry in data["entries"]:
        out[_key_of(entry)] = dict(entry["tiles"])
    return out


@functools.lru_cache(maxsize=None)
def _read(path: str) -> Dict[Key, Dict[str, int]]:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return parse(json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"erpo: ignoring the tuning file {path} ({exc}); default tiles apply", stacklevel=3)
        return {}


def tuned_tiles(op: str, gpu: str, dtype: torch.dtype, d: int, v: int, cls) -> Optional[object]:
    """The tuning file's tiles (a `cls`) for this key, or None."""
    fields = _read(str(tuning_path())).get(entry_key(op, gpu, dtype, d, v))
    if fields is None:
        return None
    try:
        return cls(**fields)
    except (TypeError, ValueError) as exc:
        warnings.warn(f"erpo: ignoring the tuning entry {entry_key(op, gpu, dtype, d, v)} ({exc})", stacklevel=3)
        return None


def clear_cache() -> None:
    """Forget the file read (tests; a process that rewrote it)."""
    _read.cache_clear()


def merged(data: Optional[Dict], entries: List[Dict]) -> Dict:
    """A tuning file's contents with `entries` replacing those of the same keys."""
    old = data["entries"] if data else []
    keys = {_key_of(e) for e in entries}
    return {"format": FORMAT, "entries": [e for e in old if _key_of(e) not in keys] + list(entries)}
