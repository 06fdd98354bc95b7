"""FSDP2 under torchrun, on CPU with gloo: 2 ranks, OMP threads 1 (docs: distributed-notes).

Every check launches `torchrun --standalone --nproc-per-node 2` as a subprocess; pass or
fail comes from the files the ranks wrote plus the exit code.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "_dist_worker.py")

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available in this build")


def torchrun(args, cwd, nproc=2, timeout=240):
    """Run `torchrun --standalone --nproc-per-node nproc ARGS` (a script path or -m module
    first); returns the CompletedProcess (stdout and stderr as text)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def rank_files(out_dir, n=2):
    found = []
    for r in range(n):
        path = os.path.join(out_dir, f"rank{r}.json")
        assert os.path.isfile(path), f"rank {r} wrote no result"
        with open(path) as f:
            found.append(json.load(f))
    return found


def test_fsdp2_wiring_on_two_ranks(tmp_path):
    """erpo.distributed: collectives; the lm_head gathered for the fused call (whole [V, D],
    gradient summed back into the shard; plain DTensor.full_tensor() drops the other ranks'
    gradient, which is why gather_for_call exists); FSDP2-sharded tied and untied Qwen2
    with each rank on half the sequences == one process on all of them (fp32 gradients
    within 1e-5); optimizer state through torch.distributed.checkpoint reloads bit-exactly;
    the consolidated state dict on rank 0 only."""
    proc = torchrun([WORKER, "units", str(tmp_path)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = rank_files(tmp_path)
    for r, res in enumerate(ranks):
        assert res["rank"] == r and res["world"] == 2
        assert res["all_reduce_sum"] == [3.0, 2.0]
        assert res["all_gather_object"] == [{"r": 0}, {"r": 1}]
        assert res["gather_for_call_is_whole"] and res["gather_for_call_grad_err"] < 1e-12  # float64
        assert res["full_tensor_grad_err"] > 1.0  # the pitfall gather_for_call avoids
        for tag in ("untied", "tied"):
            assert res[f"{tag}_lm_head_whole_in_call"], tag
            assert res[f"{tag}_lm_head_sharded_after"], tag
            assert res[f"{tag}_grad_err"] < 1e-5, (tag, res[f"{tag}_grad_err"])
            assert res[f"{tag}_optimizer_reload_exact"], tag
    for tag in ("untied", "tied"):
        assert ranks[0][f"{tag}_full_state_dict_keys"] > 0 and ranks[0][f"{tag}_full_state_dict_shapes_ok"]
        assert ranks[1][f"{tag}_full_state_dict_keys"] == 0
