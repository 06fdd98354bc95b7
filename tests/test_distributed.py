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
import torch
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


# The embedded default shrunk to seconds (as tests/test_trainer.py's `tiny`), 3 steps of
# 2 mini-batches each (off-policy second updates: old_logp pass), micro-batches of at most
# 19 tokens (2 to 4 per mini-batch, and not as many on both ranks), checkpoints at steps 2 and 3.
TINY = dict(
    tiny_hidden_size=32, tiny_layers=1, warmstart_steps=100, warmstart_batch_size=16, warmstart_unboxed=0.0,
    task_max_operand=4, task_train_size=20, task_eval_size=5, group_size=4, queries_per_step=4, max_new_tokens=6,
    mini_batches=2, micro_batch_tokens=19, steps=3, save_every=2, keep_checkpoints=0, progress=False, lr=1e-3,
    warmup_steps=1,
)


def overrides(**values):
    return [f"{k}={v}" for k, v in values.items()]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One 2-rank launch: the erpo.distributed checks, then 3 steps of the tiny default
    with its rollouts recorded, then `erpo train resume=` of a copy of that run without its
    step-3 checkpoint (the CLI in the same ranks). Returns (out_dir, run_dir, cache_dir,
    per-rank results, the launch's stdout)."""
    out = tmp_path_factory.mktemp("two-ranks")
    run_dir, cache_dir = out / "run", out / "cache"
    args = overrides(**TINY, run_dir=run_dir, cache_dir=cache_dir)
    proc = torchrun([WORKER, "both+resume", str(out), *args], cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, run_dir, cache_dir, rank_files(out), proc.stdout


def test_fsdp2_wiring_on_two_ranks(two_ranks):
    """erpo.distributed: collectives; the lm_head gathered for the fused call (whole [V, D],
    gradient summed back into the shard; plain DTensor.full_tensor() drops the other ranks'
    gradient, which is why gather_for_call exists); FSDP2-sharded tied and untied Qwen2
    with each rank on half the sequences == one process on all of them (fp32 gradients
    within 1e-5); optimizer state through torch.distributed.checkpoint reloads bit-exactly;
    the consolidated state dict on rank 0 only."""
    ranks = two_ranks[3]
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


class Replay:
    """A rollout engine returning, for each prompt of generate call k, the group the
    2-rank run sampled for it at its call k (one call per step on every rank)."""

    def __init__(self, ranks):
        self.groups = {}
        for res in ranks:
            for k, call in enumerate(res["rollouts"]):
                for prompt, group, logprobs in call:
                    self.groups[(k, tuple(prompt))] = (group, logprobs)
        self.calls = 0

    def generate(self, prompt_ids, n, temperature, max_new_tokens):
        from erpo.rollout import Rollout

        out = [self.groups.pop((self.calls, tuple(p))) for p in prompt_ids]
        self.calls += 1
        logprobs = [lp for _, lp in out]
        return Rollout([g for g, _ in out], None if any(lp is None for lp in logprobs) else logprobs)

    def sync_weights(self, model):
        pass


@pytest.fixture
def _keep_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def weights_of(checkpoint):
    from safetensors.torch import load_file

    return load_file(os.path.join(checkpoint, "model.safetensors"))


def metrics_of(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "throughput/"))} for line in f]


# fp32 weights after 3 AdamW steps (lr 1e-3): the two runs differ only in the order of
# floating-point sums (each rank's gradient, then their sum), measured at ~1e-7.
WEIGHT_TOL = 1e-5


def test_two_ranks_equal_one_process_on_the_same_global_batch(two_ranks, tmp_path, _keep_torch_threads):
    """3 steps of the tiny default, 2 mini-batches each in micro-batches, on 2 ranks (each
    its half of every mini-batch, loss normalised by the all-reduced counts and weight mass,
    gradients accumulated over micro-batches whose number differs by rank) == 1 process on
    the same global batches (the 2-rank rollouts replayed, the same reference cache):
    weights within WEIGHT_TOL, every step's rewards equal, every other metric within
    1e-5 (the second update of each step is off-policy: old_logp from the no-grad pass)."""
    from erpo.config import TrainConfig
    from erpo.trainer import Trainer

    _, run_dir, cache_dir, ranks, _ = two_ranks
    # the ranks' micro-batch counts differed (the one with fewer made empty passes to keep in step)
    assert ranks[0]["micro_batches"] != ranks[1]["micro_batches"], ranks[0]["micro_batches"]
    cfg = TrainConfig(**TINY, run_dir=str(tmp_path / "one"), cache_dir=str(cache_dir),
                      ref_cache=str(run_dir / "ref_cache.safetensors"))
    replay = Replay(ranks)
    one = Trainer(cfg, log=lambda _msg: None, engine=replay)
    one.train(plot=False)
    assert replay.calls == 3 and not replay.groups  # every sampled group trained on, none missing
    two = weights_of(run_dir / "checkpoints" / "step-000003")
    mine = one.model.state_dict()
    assert sorted(two) == sorted(mine)
    err = max(float((two[k] - mine[k]).abs().max()) for k in two)
    moved = max(float((two[k] - weights_of(run_dir / "checkpoints" / "step-000002")[k]).abs().max()) for k in two)
    assert err < WEIGHT_TOL and moved > 50 * WEIGHT_TOL, (err, moved)
    a, b = metrics_of(run_dir), metrics_of(cfg.run_dir)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        assert sorted(ra) == sorted(rb)
        for key in ra:
            if key.startswith("reward/"):
                assert ra[key] == rb[key], key
            else:
                assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-6), key
    assert all(r["pg/ratio_mean"] != 1.0 for r in a)  # the second update of each step is off-policy


def test_two_rank_resume_equals_the_uninterrupted_run(two_ranks):
    """A 2-rank `erpo train resume=RUN` (the CLI, after the run in the same launch: a new
    Trainer from what the step-2 checkpoint holds) gives step 3 bit for bit: consolidated
    weights and the metrics row."""
    out, run_dir, _, ranks, stdout = two_ranks
    resumed = out / "resumed"
    assert [r["resume_exit"] for r in ranks] == [0, 0] and all(r["resumed"] == str(resumed) for r in ranks)
    assert stdout.count("erpo: erpo finished step 3/3") == 1  # rank 0 speaks for the run
    a = weights_of(run_dir / "checkpoints" / "step-000003")
    b = weights_of(resumed / "checkpoints" / "step-000003")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert metrics_of(resumed) == metrics_of(run_dir)
    with open(resumed / "checkpoints" / "step-000003" / "trainer_state.json") as f:
        assert json.load(f)["world_size"] == 2
    assert sorted(os.listdir(resumed / "checkpoints" / "step-000003" / "optimizer")) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]


def run_cli(args, monkeypatch, capsys, world=None):
    """erpo's CLI in this process, as rank 0 of a torchrun launch of `world` ranks when
    given (the world-size checks run before any process group starts)."""
    from erpo.cli import main

    for key in ("WORLD_SIZE", "LOCAL_RANK", "RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    if world:
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("RANK", "0")
    code = main(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("world, m, mini, expected", [
    (2, 1, 1, "torchrun started 2 ranks but queries_per_step=1"),
    (2, 3, 1, "queries_per_step=3 does not divide over 2 ranks"),
    (2, 6, 2, "queries_per_step=6 does not divide over 2 mini-batches x 2 ranks"),
])
def test_bad_world_size_is_one_line_before_anything_runs(tmp_path, monkeypatch, capsys, world, m, mini, expected):
    run = tmp_path / "run"
    cfg = dict(TINY, queries_per_step=m, mini_batches=mini)
    code, err = run_cli(["train", *overrides(**cfg, run_dir=run, cache_dir=tmp_path)],
                        monkeypatch, capsys, world=world)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"erpo: error: {expected}"), err
    assert not run.exists()


def test_resume_on_another_world_size_is_one_line(two_ranks, tmp_path, monkeypatch, capsys):
    _, run_dir, _, _, _ = two_ranks
    before = metrics_of(run_dir)
    for world in (None, 4):  # plain `erpo train`, and a 4-rank torchrun
        code, err = run_cli(["train", f"resume={run_dir}", "steps=4"], monkeypatch, capsys, world=world)
        assert code == 2 and err.count("\n") == 1, err
        assert f"the run was trained on 2 rank(s) and this start has {world or 1}; resume it with torchrun " \
               f"--nproc-per-node 2 -m erpo train resume={run_dir}" in err, err
    assert metrics_of(run_dir) == before and not (run_dir / "checkpoints" / "step-000004").exists()


def test_other_commands_refuse_torchrun(tmp_path, monkeypatch, capsys):
    code, err = run_cli(["ref-cache", f"run_dir={tmp_path / 'r'}"], monkeypatch, capsys, world=2)
    assert code == 2 and err.startswith("erpo: error: erpo ref-cache runs in one process"), err


def test_torchrun_with_more_ranks_than_queries_is_one_error_line(tmp_path):
    """The real launch: both ranks refuse before any process group starts; one
    `erpo: error:` line in all of their output (rank 0's), nothing written."""
    run = tmp_path / "run"
    proc = torchrun(["-m", "erpo", "train", *overrides(**dict(TINY, queries_per_step=1, mini_batches=1), run_dir=run,
                                                        cache_dir=tmp_path / "cache")], cwd=tmp_path)
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("erpo: error:")]
    assert lines == ["erpo: error: torchrun started 2 ranks but queries_per_step=1: every rank needs at least one "
                     "query (groups are never split across ranks); use --nproc-per-node <= 1 or raise "
                     "queries_per_step"], proc.stderr[-2000:]
    assert not run.exists() and not (tmp_path / "cache").exists()
