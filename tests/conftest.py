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

# make test runs this suite in 2 workers, each taking whole files (pytest -n 2 --dist loadfile
# --no-loadscope-reorder: a module's fixtures, e.g. a torchrun launch, run once), in the order
# below: the longest files first, so that no long one is left to run alone at the end.
# Measured in CPU seconds (2026-12-03): the AOT sweep in test_tiles ~220, the rest 30-100 each.
LONG_FILES_FIRST = ("test_tiles.py", "test_study.py", "test_bench.py", "test_trainer.py", "test_cli.py",
                    "test_vocab_parallel.py", "test_large_vocab.py", "test_recipes.py", "test_distributed.py",
                    "test_cost.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept


@pytest.fixture
def device() -> str:
    """Where the kernels under test run: CUDA when present, else the CPU interpreter."""
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
