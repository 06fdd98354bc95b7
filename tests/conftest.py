"""Test set-up. TRITON_INTERPRET must be set before any kernel is decorated, so it is
set here, at import time, before erpo_kernels is imported: on a machine without a GPU
every Triton kernel runs in the interpreter on CPU tensors; with a GPU (bench/gpu_check.sh)
the compiled kernels run on CUDA tensors.
"""
import atexit
import os
import shutil
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    from _interpreter_speed import skip_repeated_language_patches  # noqa: E402

    skip_repeated_language_patches()  # the same interpreted operations, a third faster

import pytest  # noqa: E402

# cache_dir=auto is the user cache ($XDG_CACHE_HOME/erpo): a test that does not name its own
# cache_dir (and every subprocess it starts) writes into a cache of this session, never the user's.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="erpo-tests-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# The live suites run in their own venvs (make test: .venv-vllm with vLLM's CPU build, .venv-verl
# with verl), each by naming its directory (`python -m pytest tests/vllm_live`): a directory named
# on the command line is collected, `pytest tests` leaves these out.
collect_ignore = ["vllm_live", "verl_live"]


@pytest.fixture
def device() -> str:
    """Where the kernels under test run: CUDA when present, else the CPU interpreter."""
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
