"""erpo_loss reads tensor values on the host (a device sync on a GPU) at most once per
call with its defaults: the metrics' one transfer, which carries the value checks too;
none with validate=False and sync_metrics=False; an explicit validate=True adds one
(the checks before any kernel). Forward and backward, one batch and micro-batches.
"""
import contextlib
from collections import Counter

import pytest
import torch

from _host_reads import HOST_READS
from erpo_kernels import (
    LossConfig,
    LossNormalizers,
    combine_metrics,
    erpo_loss,
    erpo_loss_from_logp,
    metrics_to_floats,
    split_batch,
)
from test_objective import PROMPT_LENS, SEQS, VOCAB, build, make_point

# nonzero returns a value-dependent shape: a sync too on a GPU. The objective's own code
# never calls it (counted for erpo_loss_from_logp); linear_token_logprobs compacts its
# scored rows with it (the kernels' side), so erpo_loss counts the value reads only.
NONZERO = ("nonzero",)


@contextlib.contextmanager
def count_host_reads(nonzero_too=True):
    """Counter of the calls of Tensor methods that hand values to Python."""
    counts = Counter()
    names = HOST_READS + (NONZERO if nonzero_too else ())
    saved = {name: getattr(torch.Tensor, name) for name in names}
    saved_nonzero = torch.nonzero

    def counting(name, method):
        def wrapper(self, *args, **kwargs):
            counts[name] += 1
            return method(self, *args, **kwargs)

        return wrapper

    def nonzero(*args, **kwargs):
        counts["torch.nonzero"] += 1
        return saved_nonzero(*args, **kwargs)

    try:
        for name, method in saved.items():
            setattr(torch.Tensor, name, counting(name, method))
        if nonzero_too:
            torch.nonzero = nonzero
        yield counts
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
        torch.nonzero = saved_nonzero


def _inputs(dtype):
    batch, _, logp, _ = make_point("softmax", with_ref_logp=True)
    batch.rollout_logp = batch.old_logp + 0.05
    fields = ("inv_temperature", "advantages", "ref_query_logp", "query_weights", "old_logp", "ref_logp",
              "rollout_logp")
    for f in fields:
        setattr(batch, f, getattr(batch, f).to(dtype))
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(batch.targets.numel(), 8, generator=g, dtype=dtype)
    weight = torch.randn(VOCAB, 8, generator=g, dtype=dtype)
    return batch, hidden, weight


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float64), ("triton", torch.float32)])
@pytest.mark.parametrize("algorithm", ["erpo", "grpo"])
def test_erpo_loss_reads_the_host_at_most_once(backend, dtype, algorithm):
    batch, hidden, weight = _inputs(dtype)
    cfg = LossConfig(algorithm=algorithm, alpha=0.2, beta=0.1, loss_agg="seq-mean-token-mean", rollout_is="token")
    batch.validate(vocab_size=VOCAB)  # where the batch is built: the one value check
    for sync_metrics, expect in ((True, 1), (False, 0)):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        with count_host_reads(nonzero_too=False) as fwd:
            loss, metrics = erpo_loss(h, w, batch, cfg, backend=backend, validate=False, sync_metrics=sync_metrics)
        with count_host_reads(nonzero_too=False) as bwd:
            loss.backward()
        assert sum(fwd.values()) == expect, dict(fwd)
        assert sum(bwd.values()) == 0, dict(bwd)
        assert h.grad.abs().sum() > 0 and w.grad.abs().sum() > 0
        assert all(isinstance(v, float if sync_metrics else torch.Tensor) for v in metrics.values())
    # the defaults: one read in all, the value checks riding on the metrics' transfer
    with count_host_reads(nonzero_too=False) as default:
        loss, metrics = erpo_loss(hidden, weight, batch, cfg, backend=backend)
    assert sum(default.values()) == 1, dict(default)
    assert isinstance(metrics["loss"], float)
    # without synced metrics the default checks in one read of their own
    with count_host_reads(nonzero_too=False) as unsynced:
        erpo_loss(hidden, weight, batch, cfg, backend=backend, sync_metrics=False)
    assert sum(unsynced.values()) == 1, dict(unsynced)
    # an explicit validate=True adds exactly one: every value check in one transfer, first
    with count_host_reads(nonzero_too=False) as checked:
        erpo_loss(hidden, weight, batch, cfg, backend=backend, validate=True)
    assert sum(checked.values()) == 2, dict(checked)


@pytest.mark.parametrize("validate", [None, True])
@pytest.mark.parametrize("sync_metrics", [True, False])
def test_every_validation_mode_catches_a_bad_batch(validate, sync_metrics):
    """The default mode's checks travel with the metrics, and the loss meanwhile runs on
    a batch whose indices cannot leave their arrays: each bad index is the same
    ValueError as validate=True gives, never an IndexError or a crash."""
    batch, hidden, weight = _inputs(torch.float64)
    bad_cases = {
        "targets": ("targets", lambda t: t.index_fill(0, torch.tensor([3]), VOCAB + 5)),
        "group_index": ("group_index", lambda g: g.index_fill(0, torch.tensor([1]), 99)),
        "span_cu_seqlens": ("span_cu_seqlens", lambda c: c.index_fill(0, torch.tensor([2]), -7)),
        "advantages": ("advantages", lambda a: a.index_fill(0, torch.tensor([0]), float("nan"))),
    }
    for field, mutate in bad_cases.values():
        bad = batch.__class__(**{**batch.__dict__, field: mutate(getattr(batch, field))})
        with pytest.raises(ValueError, match=field):
            erpo_loss(hidden, weight, bad, backend="torch", validate=validate, sync_metrics=sync_metrics)
    # a valid batch: the default's safe copy computes exactly what the batch does
    plain = erpo_loss(hidden, weight, batch, backend="torch", validate=False, sync_metrics=True)
    assert erpo_loss(hidden, weight, batch, backend="torch", validate=validate, sync_metrics=True) == plain


@pytest.mark.parametrize("algorithm", ["erpo", "grpo"])
def test_loss_from_logp_triton_path_no_nonzero(algorithm):
    """The objective itself (segment_sum, weighted_k3 kernels, row-space policy loss, TIS):
    no value read and no nonzero, forward and backward."""
    batch, _, _ = _inputs(torch.float32)
    _, _, logp, entropy = make_point("softmax")
    cfg = LossConfig(algorithm=algorithm, alpha=0.2, beta=0.1, rollout_is="sequence")
    x = logp.float().requires_grad_(True)
    with count_host_reads() as counts:
        loss, _ = erpo_loss_from_logp(x, batch, cfg, entropy=entropy.float(), backend="triton", validate=False,
                                      sync_metrics=False)
        loss.backward()
    assert sum(counts.values()) == 0, dict(counts)
    assert x.grad.abs().sum() > 0


def test_micro_batches_read_the_host_once_per_mini_batch():
    batch, hidden, weight = _inputs(torch.float64)
    cfg = LossConfig(algorithm="erpo", alpha=0.2)
    micro = split_batch(batch, [[0, 1, 2], [3, 4], [5, 6, 7]])  # where the batch is built
    norm = LossNormalizers.of(batch)
    for mb in micro:
        mb.batch.validate(vocab_size=VOCAB, normalizers=norm)
    w = weight.clone().requires_grad_(True)
    with count_host_reads(nonzero_too=False) as counts:
        parts = []
        for mb in micro:
            loss, metrics = erpo_loss(hidden[mb.rows], w, mb.batch, cfg, backend="torch", normalizers=norm,
                                      validate=False, sync_metrics=False)
            loss.backward()
            parts.append(metrics)
        floats = metrics_to_floats(combine_metrics(parts))
    assert sum(counts.values()) == 1, dict(counts)
    assert floats["loss"] == pytest.approx(float(erpo_loss(hidden, weight, batch, cfg, backend="torch")[0]), rel=1e-12)


def test_validate_catches_bad_targets_once_for_all_ops():
    """With validate=False the ops do not check the values: the objective's one check must
    cover what they would (targets < V, inv_temperature > 0, span offsets)."""
    batch, hidden, weight = _inputs(torch.float64)
    bad = batch.targets.clone()
    bad[3] = VOCAB
    with pytest.raises(ValueError, match="targets"):
        erpo_loss(hidden, weight, build(PROMPT_LENS, SEQS)[0].__class__(**{**batch.__dict__, "targets": bad}),
                  backend="torch")
    inv = batch.inv_temperature.clone()
    inv[0] = 0.0
    with pytest.raises(ValueError, match="inv_temperature"):
        erpo_loss(hidden, weight, batch.__class__(**{**batch.__dict__, "inv_temperature": inv}), backend="torch")


@pytest.mark.parametrize("validate,sync_metrics,expect",
                         [(False, False, 0), (False, True, 1), (None, False, 1), (None, True, 1), (True, True, 2)])
def test_loss_from_logp_reads_the_host_once_per_check_and_metrics(validate, sync_metrics, expect):
    batch, _, _ = _inputs(torch.float64)
    _, _, logp, _ = make_point("softmax")
    x = logp.clone().requires_grad_(True)
    with count_host_reads() as counts:
        loss, _ = erpo_loss_from_logp(x, batch, LossConfig(rollout_is="token"), backend="torch", validate=validate,
                                      sync_metrics=sync_metrics)  # fmt: skip
        loss.backward()
    assert sum(counts.values()) == expect, dict(counts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.set_sync_debug_mode)")
@pytest.mark.parametrize("algorithm", ["erpo", "grpo"])
def test_erpo_loss_on_cuda_never_syncs(algorithm):
    """On a GPU (bench/gpu_check.sh runs this file with the compiled kernels): a validated
    batch's loss, forward and backward, with device metrics, raises under the CUDA
    sync-debug mode "error" if anything in the path waits for the device."""
    batch, hidden, weight = _inputs(torch.float32)
    batch.validate(vocab_size=VOCAB)  # on the CPU, where the batch is built
    batch = batch.to("cuda")
    h = hidden.cuda().requires_grad_(True)
    w = weight.cuda().requires_grad_(True)
    cfg = LossConfig(algorithm=algorithm, alpha=0.2, beta=0.1, rollout_is="token")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, metrics = erpo_loss(h, w, batch, cfg, backend="triton", validate=False, sync_metrics=False)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item() and h.grad is not None and w.grad is not None
    assert all(isinstance(v, torch.Tensor) and v.is_cuda for v in metrics.values())
