"""Files written all at once: a reader, or a run interrupted mid-write, sees the old file
or the new one, never part of one."""
from __future__ import annotations

import os
from typing import Callable, Union


def atomic_write(path: str, data: Union[bytes, Callable[[str], None]]) -> None:
    """Write `path` through a temp file beside it and a rename.
    `data`: the bytes, or a function that writes the file at the path it is given."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        if callable(data):
            data(tmp)
        else:
            with open(tmp, "wb") as f:
                f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
