"""Files written all at once: a reader, or a run interrupted mid-write, sees the old file
or the new one, never part of one. Their modes are the umask's (0644 under umask 022), as a
plain open() gives, whatever the writer chose (safetensors writes 0600): a run directory on a
shared file system is readable by those the umask lets read it."""
from __future__ import annotations

import os
from typing import Callable, Union


def current_umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc), else set and restored."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_modes(path: str) -> None:
    """Give the file `path`, or every file under the directory `path`, the mode a plain
    open() would under the umask: 0666 & ~umask (0777 & ~umask for an executable)."""
    mask = current_umask()
    files = [path] if not os.path.isdir(path) else [
        os.path.join(d, name) for d, _, names in os.walk(path) for name in names]
    for name in files:
        if os.path.islink(name):
            continue
        mode = os.stat(name).st_mode
        os.chmod(name, (0o777 if mode & 0o111 else 0o666) & ~mask)


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
        umask_modes(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
