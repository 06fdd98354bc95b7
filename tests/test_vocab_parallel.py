"""Tensor parallelism over the vocabulary (issue 28). The op: linear_token_logprobs with
the lm_head a DTensor Shard(0) over 2 and 3 gloo ranks on CPU, V = 403 split unevenly
(202 + 201, 135 + 135 + 133), against the unsharded op on the same inputs, forward and
backward, fp32, on the kernels (Triton's interpreter) and on the reference, with and without
a support= (issue 34: the whole vocabulary's bitmask or threshold, read at each shard's
global token ids; rank 1's shard starts inside a bitmask word); one torchrun
launch per group size runs every case (tests/_vocab_parallel_worker.py). The trainer:
`erpo train tp_size=2` on 2 ranks against one process on the same batches, and its resume,
in the same 2-rank launch as the op's cases (tests/_dist_worker.py). Pass or fail comes
from the files the ranks wrote plus the exit code.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from test_distributed import (ROOT, TINY, WEIGHT_TOL, Replay, _keep_torch_threads, metrics_of, overrides,  # noqa: F401
                              rank_files, run_cli, torchrun, weights_of)

WORKER = os.path.join(ROOT, "tests", "_vocab_parallel_worker.py")
DIST_WORKER = os.path.join(ROOT, "tests", "_dist_worker.py")
N = 37  # rows of the worker's batches (3 of them ignored)
D = 24
# max |sharded - unsharded| / max |unsharded| per tensor, fp32 (the bound)
REL = 2e-5
OP_CASES = ["triton", "triton_softcap_temp", "triton_temp_no_entropy", "torch", "torch_softcap_temp",
            "torch_ignore_index_7", "triton_support_bitmask", "triton_support_threshold", "torch_support_threshold"]

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available in this build")


def read_ranks(out, world):
    ranks = []
    for r in range(world):
        with open(out / f"rank{r}.json") as f:
            ranks.append(json.load(f))
        ranks[-1]["outputs"] = torch.load(out / f"rank{r}.pt")
    return ranks


@pytest.fixture(scope="module")
def two_rank_launch(tmp_path_factory):
    """One 2-rank launch for everything on two ranks (tests/_dist_worker.py): the op's cases
    (in OUT/vocab), then `erpo train tp_size=2` and its resume (see tp_run). Returns
    (OUT, run_dir, cache_dir)."""
    out = tmp_path_factory.mktemp("two-ranks")
    run_dir, cache_dir = out / "run", out / "cache"
    cases = OP_CASES + ["bf16", "sequence_parallel", "errors", "batch_invariance"]
    steps = "+".join(["vocab:" + ",".join(cases), "train", "resume"])
    proc = torchrun([DIST_WORKER, steps, str(out), *overrides(**TP_TRAIN, tp_size=2, run_dir=run_dir,
                                                               cache_dir=cache_dir)], cwd=out, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, run_dir, cache_dir


@pytest.fixture(scope="module")
def two_ranks(two_rank_launch):
    return read_ranks(two_rank_launch[0] / "vocab", 2)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("vocab-parallel-3")
    proc = torchrun([WORKER, str(out), "triton_softcap_temp,torch,batch_invariance"], cwd=out, nproc=3, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_ranks(out, 3)


def check_case(ranks, name, world):
    sizes = [r[name]["local_rows"] for r in ranks]
    assert sum(sizes) == 403 and len(set(sizes)) == 2, sizes  # uneven shards
    for res in ranks:
        case = res[name]
        for key in ("logp", "entropy", "d_hidden", "d_weight", "d_bias"):
            if key in case:
                assert case[key] < REL, (name, res["rank"], key, case[key])
        assert "entropy" in case or name.endswith("no_entropy")
        if "support" in name:  # renormalised over fewer tokens: every restricted row's logp rises
            assert case["support_row0_unchanged"] and case["support_raised_rows"] == N - 1 - 3, (name, case)
        assert case["d_weight_is_shard"] and case["outputs_plain"], name
        assert case["deterministic"] and case["ignored_zero"], name
        # every row but the 3 ignored ones (target 509 included; a support's row of the target alone has logp 0)
        assert case["scored_rows"] == N - 3 - case.get("target_only_rows", 0), name
        # nothing gathers the weight (no full_tensor, redistribute, broadcast, ...): forward an
        # all-reduce (MAX, [N] fp32) and an all-gather of [2 or 3, N] fp32 statistics; backward
        # d_hidden [N, D] fp32 summed by rows: an all-to-all of it (rows padded to a multiple
        # of the group), an all-gather of this rank's block of rows
        stats = 3 if "entropy" in case else 2
        padded = -(-N // world) * world
        assert case["collectives"] == [["all_reduce", 4 * N], ["all_gather", 4 * stats * N],
                                       ["all_to_all_single", 4 * padded * D],
                                       ["all_gather", 4 * padded // world * D]], (name, case["collectives"])
        assert case["fwd_bytes_per_row"] == 4 + 4 * stats
    first = ranks[0]["outputs"][name]
    assert all(torch.equal(r["outputs"][name], first) for r in ranks[1:]), name  # the same bits on every rank


@pytest.mark.parametrize("name", OP_CASES)
def test_two_ranks_equal_the_unsharded_op(two_ranks, name):
    """logp, entropy, d_hidden, d_weight (the local rows, a Shard(0) DTensor), d_bias:
    with and without bias, soft cap + logit scale, per-row temperature, ignored rows (also
    with an ignore_index that is a vocabulary row), on the kernels and on the reference."""
    check_case(two_ranks, name, 2)


def test_two_ranks_in_bf16_are_as_accurate_as_one_device(two_ranks):
    """bf16 on the kernels, against float64: within 1.5 x PyTorch's own bf16 error, as the
    unsharded op is held to (each rank's d_hidden part is rounded to bf16 before the sum)."""
    for res in two_ranks:
        assert sorted(res["bf16"]) == ["d_hidden", "d_weight", "entropy", "logp"]
        assert all(v is None for v in res["bf16"].values()), res["bf16"]


@pytest.mark.parametrize("name", ["triton_softcap_temp", "torch"])
def test_three_ranks_equal_the_unsharded_op(three_ranks, name):
    check_case(three_ranks, name, 3)


@pytest.mark.parametrize("world", [2, 3])
def test_a_row_is_batch_invariant_for_a_fixed_group(two_ranks, three_ranks, world):
    ranks = two_ranks if world == 2 else three_ranks
    for res in ranks:
        assert res["batch_invariant"], res["batch_invariance_rows"]
    assert all(r["batch_invariance_rows"] == ranks[0]["batch_invariance_rows"] for r in ranks)


def test_sequence_parallel_rows_need_no_extra_code(two_ranks):
    """Each rank its own hidden rows: with the weight replicated the plain op per rank (its
    gradient summed by the caller, as DDP / FSDP do); with the weight sharded, the rows
    gathered by DTensor's redistribute and the loss taken on them on every rank."""
    for res in two_ranks:
        for how in ("replicated", "sharded"):
            for key in ("logp", "d_hidden", "d_weight"):
                assert res[f"sp_{how}_{key}"] < REL, (how, key, res[f"sp_{how}_{key}"])


def test_misuse_is_a_value_error_naming_the_argument(two_ranks):
    errors = two_ranks[0]["errors"]
    assert errors["plain_bias"].startswith("bias must be a DTensor sharded Shard(0) on a 1-D mesh")
    assert errors["replicated_weight"].startswith("weight must be a DTensor sharded Shard(0)")
    assert "Replicate()" in errors["replicated_weight"]
    assert errors["row_sharded_hidden"].startswith("hidden must be the same on every rank")
    assert errors["target_out_of_range"].startswith("targets[0] = 403 is outside [0, 403)")
    assert errors["wrong_d"] == "weight has D = 24 columns but hidden has D = 5"
    assert errors["support_local_width"].startswith("support (a bitmask) must have shape [N, ceil(V / 32)] = [37, 13]")


# ---------------------------------------------------------------------- erpo train tp_size=2

# test_distributed's tiny default, 2 steps (checkpoints at steps 1 and 2)
# DAPO's overlong shaping over every length (overlong_buffer = max_new_tokens): a group's shaped
# rewards are uniform only if its responses are all as long and all as correct. At step 1 the
# policy is the reference, so a mini-batch of uniform groups has a true gradient of exactly 0
# (advantages 0, Query-KL 0); the sharded run's Query-KL delta is ~1e-7 there (the cache is
# scored by the unsharded op, docs/distributed.md) and AdamW turns that rounding into a full lr
# step one process never takes (loss -0.031063 vs -0.031250 at step 1 on plain 0/1 rewards, whose
# step-1 mini-batch 1 held two all-wrong groups). The shaped rewards give every step-1
# mini-batch a learning signal, which the test checks before it compares.
TP_TRAIN = dict(TINY, steps=2, save_every=1, overlong_buffer=TINY["max_new_tokens"])
LOSSES = ("loss", "pg/loss", "qkl/loss")


@pytest.fixture(scope="module")
def tp_run(two_rank_launch):
    """`erpo train tp_size=2` on 2 gloo ranks (one tensor-parallel group: the lm_head and
    the decoder's projections sharded, FSDP2 over a data-parallel mesh of 1), its rollouts,
    lm_head weights and every gather inside its updates recorded; then, in the same launch,
    `erpo train resume=` of a copy of the run without its step-2 checkpoint."""
    out, run_dir, cache_dir = two_rank_launch
    return run_dir, cache_dir, rank_files(out)


def test_erpo_train_tp_size_2_matches_one_process(tp_run, tmp_path, _keep_torch_threads):
    """The same global batches (the tensor-parallel run's rollouts replayed, its reference
    cache) in one process, every step-1 mini-batch with a learning signal (rewards shaped by
    length, see TP_TRAIN): every step's rewards equal, losses within 1e-5, weights after 2
    steps within 1e-5 (test_distributed's WEIGHT_TOL); the fused calls got this rank's
    Shard(0) rows of the lm_head and nothing of [V, ...] was made whole in an update."""
    from erpo.config import TrainConfig
    from erpo.trainer import Trainer

    run_dir, cache_dir, ranks = tp_run
    cfg = TrainConfig(**TP_TRAIN, run_dir=str(tmp_path / "one"), cache_dir=str(cache_dir),
                      ref_cache=str(run_dir / "ref_cache.safetensors"))
    replay = Replay(ranks)
    one = Trainer(cfg, log=lambda _msg: None, engine=replay)
    advantages, updates = [], one._updates

    def recording_updates(idx, prompts, responses, adv, *rest):
        advantages.append(adv.reshape(cfg.mini_batches, -1))  # [mini-batches, its queries x G]
        return updates(idx, prompts, responses, adv, *rest)

    one._updates = recording_updates
    one.train(plot=False)
    vocab, width = one.model.lm_head.weight.shape
    assert replay.calls == 2 and not replay.groups
    # the comparison is well posed: no step-1 update whose true gradient is exactly 0 (see TP_TRAIN)
    assert bool((advantages[0] != 0).any(dim=1).all()), advantages[0]
    a, b = metrics_of(run_dir), metrics_of(cfg.run_dir)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for ra, rb in zip(a, b):
        assert sorted(ra) == sorted(rb)
        for key in ra:
            if key.startswith("reward/"):
                assert ra[key] == rb[key], key
        for key in LOSSES:
            assert abs(ra[key] - rb[key]) < 1e-5, (key, ra[key], rb[key])
    two, mine = weights_of(run_dir / "checkpoints" / "step-000002"), one.model.state_dict()
    assert sorted(two) == sorted(mine)
    assert max(float((two[k] - mine[k]).abs().max()) for k in two) < WEIGHT_TOL
    for res, rows in zip(ranks, (-(-vocab // 2), vocab // 2)):  # torch's chunks of the vocabulary
        heads = res["lm_heads"]
        assert heads and all(h == ["DTensor", "(Shard(dim=0),)", 1, rows] for h in heads), heads[:3]
        assert [] in res["gathered_shapes"]  # the recorder sees gathers: the gradient norm (a scalar) made whole
        assert not [s for s in res["gathered_shapes"] if s and s[0] == vocab], res["gathered_shapes"]
    assert width == TINY["tiny_hidden_size"]


def test_tp_size_2_resume_equals_the_uninterrupted_run(tp_run):
    """`erpo train resume=RUN` of the tensor-parallel run from its step-1 checkpoint (the CLI
    in the run's launch: a new Trainer from what the checkpoint holds) gives step 2 bit for
    bit: consolidated weights and the metrics rows."""
    run_dir, _, ranks = tp_run
    assert [r["resume_exit"] for r in ranks] == [0, 0]
    resumed = Path(ranks[0]["resumed"])
    a = weights_of(run_dir / "checkpoints" / "step-000002")
    b = weights_of(resumed / "checkpoints" / "step-000002")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert metrics_of(resumed) == metrics_of(run_dir)


@pytest.mark.parametrize("world, tp, expected", [
    (None, 2, "tp_size=2 does not divide the 1 rank(s) of this start"),
    (2, 3, "tp_size=3 does not divide the 2 rank(s) of this start"),
    (4, 2, "queries_per_step=2 does not divide over 2 mini-batches x 2 ranks"),
])
def test_bad_tp_size_is_one_line(tmp_path, monkeypatch, capsys, world, tp, expected):
    cfg = dict(TINY, queries_per_step=2 if world == 4 else 4)
    code, err = run_cli(["train", *overrides(**cfg, tp_size=tp, run_dir=tmp_path / "run", cache_dir=tmp_path)],
                        monkeypatch, capsys, world=world)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"erpo: error: {expected}"), err
