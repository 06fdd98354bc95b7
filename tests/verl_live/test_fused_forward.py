"""impl_backend=erpo inside verl's FSDP2 engine: the same log-probs, entropies and
gradients as verl's own (logits) path, tied and untied lm_head, padded and
remove-padding; prompt rows at temperature 1, response rows at 1 / T."""
from __future__ import annotations

import pytest
import torch

from _setup import (PROMPTS, RESPONSES, full_grads, make_batch, make_worker, nested_rows, original_forward,
                    tiny_model_dir, to_engine)

TAU = 0.7


def _probe_loss(model_output, data, dp_group=None):
    """A loss that reaches every row's log-prob and entropy (fixed coefficients by row) but
    the last row of each sequence (see below)."""
    lp, ent = model_output["log_probs"].values(), model_output["entropy"].values()
    last = data["input_ids"].offsets()[1:] - 1
    c = torch.cos(torch.arange(lp.shape[0], dtype=lp.dtype)).index_fill(0, last, 0.0)
    return (c * lp).sum() + 0.5 * (c * ent).sum(), {}


def _run(worker, temperature):
    out = worker.infer_batch(to_engine(make_batch(PROMPTS, RESPONSES), temperature, compute_loss=False))
    return nested_rows(out["log_probs"]), nested_rows(out["entropy"])


def _grads(worker, temperature):
    """The gradient of _probe_loss, through verl's engine (the worker's train_batch zeroes
    the gradients on leaving train mode; this keeps them)."""
    data = to_engine(make_batch(PROMPTS, RESPONSES), temperature, use_remove_padding=worker.engine_config.use_remove_padding,
                     use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
                     use_fused_kernels=worker.engine_config.use_fused_kernels)
    with worker.engine.train_mode(zero_grad_on_exit=False):
        worker.engine.train_batch(data, loss_function=_probe_loss)
    return full_grads(worker)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """verl's own logits path (packed layout) on the tied and the untied model: log-probs and
    entropies at the rollout temperature and at 1, and the probe loss's gradients at 1."""
    out = {}
    for tied in (False, True):
        model_dir = tiny_model_dir(str(tmp_path_factory.getbasetemp()), tied)
        with original_forward():
            ref = make_worker(model_dir, backend=None, remove_padding=True)
            out[tied] = (model_dir, _run(ref, TAU), _run(ref, 1.0), _grads(ref, 1.0))
    return out


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("remove_padding", [True, False], ids=["packed", "padded"])
def test_erpo_backend_matches_verls_logits_path(reference, tied, remove_padding):
    model_dir, (lp_t, ent_t), (lp_1, ent_1), grads_ref = reference[tied]
    with original_forward():
        ours = make_worker(model_dir, backend="erpo", remove_padding=remove_padding)
        assert type(ours.engine.module).forward.__name__ == "forward_with_erpo_backend"
        lp, ent = _run(ours, TAU)
        grads = _grads(ours, 1.0)
        # the training forward says which lm_head path ran: this venv has no triton, so the recompute
        assert ours.engine.module._erpo_training_path == "linear_token_logprobs (4 GEMMs) (the torch backend)"
    worst = {"logp": 0.0, "entropy": 0.0}
    for b, p in enumerate(PROMPTS):
        k = len(p) - 1  # rows [0, k) score prompt tokens: temperature 1; the rest 1 / TAU
        n = len(p) + len(RESPONSES[b])
        assert lp[b].shape == lp_t[b].shape == (n,)
        # the last row scores past the sequence (verl's losses never read it): verl's logits
        # path rolls the packed tokens there, its fused forwards (and ours) the padded row
        for name, got, at_1, at_t in (("logp", lp[b], lp_1[b], lp_t[b]), ("entropy", ent[b], ent_1[b], ent_t[b])):
            got, want = got[: n - 1], torch.cat([at_1[:k], at_t[k: n - 1]])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
            worst[name] = max(worst[name], float((got - want).abs().max()))
        assert not torch.allclose(lp_1[b][:k], lp_t[b][:k])  # the two temperatures differ there
    assert grads.keys() == grads_ref.keys()
    for name, g in grads.items():
        scale = float(grads_ref[name].abs().max())
        assert scale > 0, name
        torch.testing.assert_close(g, grads_ref[name], rtol=1e-4, atol=1e-5 * scale)
        worst["grad/largest"] = max(worst.get("grad/largest", 0.0), float((g - grads_ref[name]).abs().max()) / scale)
    print(f"max |difference| {worst}")


def test_untied_fsdp2_lm_head_is_a_dtensor_that_verls_torch_backend_trips_on(reference):
    """Why erpo's forward gathers the lm_head weight: under verl's FSDP2 wrapping an untied
    lm_head weight reaches the fused forward as a sharded DTensor, which verl's own torch
    fused backend multiplies with plain hidden states and fails; ours matched above."""
    model_dir = reference[False][0]
    with original_forward():
        theirs = make_worker(model_dir, backend="torch", remove_padding=True)
        with pytest.raises(Exception, match="DTensor"):
            _run(theirs, TAU)


def test_the_forward_takes_its_kernel_backend_from_fused_kernel_options(reference):
    """+actor_rollout_ref.model.fused_kernel_options.kernel_backend (and fused_budget_mb) reach
    the kernel of every forward (read by the engine wrap at each micro-batch); a bad value is
    refused naming the key."""
    model_dir = reference[False][0]
    with original_forward():
        ours = make_worker(model_dir, backend="erpo", remove_padding=True)
        options = ours.engine.model_config.fused_kernel_options
        options["kernel_backend"] = "triton"  # this venv has no triton: the kernel's own refusal shows it got there
        with pytest.raises(ValueError, match="backend='triton' needs the triton package"):
            _run(ours, TAU)
        options["kernel_backend"] = "fast"
        with pytest.raises(ValueError,
                           match="fused_kernel_options.kernel_backend must be one of auto, triton, torch, got 'fast'"):
            _run(ours, TAU)
        options["kernel_backend"] = "torch"
        _run(ours, TAU)
        options["fused_budget_mb"] = -1
        with pytest.raises(ValueError, match="fused_kernel_options.fused_budget_mb must be an int >= 0"):
            _run(ours, TAU)
