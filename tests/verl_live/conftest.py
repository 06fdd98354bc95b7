"""The live verl suite: erpo.integrations.verl against the real verl 0.9.1, on CPU, in one
process. It runs in its own venv (`make test-verl` builds .venv-verl) by naming the
directory, `python -m pytest tests/verl_live`; `pytest tests` leaves it out (tests/conftest.py).

What makes verl's FSDP2 engine run on a CPU here: a CPU platform registered with verl's
platform manager (its auto-detection falls back to nvidia), gloo initialised by us before
any worker, VERL_ENGINE_DEVICE=cuda (the engine registry lists fsdp2 for cuda and npu
only), sdpa attention (verl defaults to flash-attention 2).
"""
from __future__ import annotations

import contextlib
import os
import socket

import pytest
import torch

os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import verl  # noqa: E402,F401  (loads the verl.plugins entry points, erpo's among them)
from verl.plugin.platform.platform_cuda import PlatformCUDA  # noqa: E402
from verl.plugin.platform.platform_manager import set_platform  # noqa: E402

for _name in ("max_memory_allocated", "max_memory_reserved"):  # logged by verl's worker; 0 on the CPU
    if not hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda *args, **kwargs: 0)


class PlatformCPU(PlatformCUDA):
    """verl's platform interface on the CPU (gloo, no device calls)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return torch.cpu

    def is_available(self) -> bool:
        return True

    def current_device(self):
        return "cpu"  # verl moves modules with .to(current_device())

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def communication_backend_name(self) -> str:
        return "gloo"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass


set_platform(PlatformCPU())


@pytest.fixture(scope="session", autouse=True)
def _gloo():
    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group("gloo")
    yield
