"""A few TrainingWorker steps with impl_backend=erpo and loss_mode=erpo on the CPU move the
weights as the same ERPO steps written by hand (erpo's packed forward, erpo_loss, SGD)."""
from __future__ import annotations

from functools import partial

import pytest
import torch

from _setup import (PROMPTS, RESPONSES, Rows, full_params, make_batch, make_worker, original_forward, packed_batch,
                    tiny_model_dir, to_engine)

TAU, LR, STEPS, ALPHA = 0.7, 2e-3, 3, 0.5


def test_worker_steps_equal_hand_written_erpo_steps(tmp_path, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils import losses

    from erpo.integrations.verl import ERPOPolicyLossConfig
    from erpo.packing import forward_hidden
    from erpo.ref_cache import RefCacheError, build_ref_cache, query_id, save_ref_cache
    from erpo_kernels import LossConfig, erpo_loss

    model_dir = tiny_model_dir(str(tmp_path_factory.getbasetemp()), tied=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").float()
    # the reference cache: l_0(q) of the training prompts under the starting model, once
    built_by = {"model": model_dir, "verl_command": "python -m erpo.integrations.verl ref-cache ..."}  # as ref-cache
    cache = build_ref_cache(model, PROMPTS, built_by, backend="torch")
    path = str(tmp_path / "ref_cache.safetensors")
    save_ref_cache(cache, path)
    settings = ERPOPolicyLossConfig(alpha=ALPHA, ref_cache=path, query_weighting="softmax", weight_temperature=0.05,
                                    kernel_backend="torch")
    distinct = list(dict.fromkeys(tuple(p) for p in PROMPTS))
    group = torch.tensor([distinct.index(tuple(p)) for p in PROMPTS])  # [B] query of each sequence
    w_q = settings.weighter(cache).batch_weights(cache.score[cache.rows([query_id(list(p)) for p in distinct])].double())
    assert not torch.allclose(w_q, torch.ones_like(w_q))

    with original_forward():
        worker = make_worker(model_dir, backend="erpo", remove_padding=True, lr=LR)
        batch = make_batch(PROMPTS, RESPONSES, seed=5)
        old = worker.infer_batch(to_engine(batch, TAU, compute_loss=False))["log_probs"]  # the rollout policy
        batch["old_log_probs"] = torch.stack([
            torch.nn.functional.pad(x[len(p) - 1: len(p) - 1 + len(r)], (0, batch["responses"].shape[1] - len(r)))
            for x, p, r in zip(old.unbind(), PROMPTS, RESPONSES)])
        actor = FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=len(PROMPTS), ppo_micro_batch_size_per_gpu=2,
                                use_dynamic_bsz=False, rollout_n=2, policy_loss=settings, clip_ratio_high=0.28)
        worker.set_loss_fn(partial(losses.ppo_loss, config=actor))  # as verl's ActorRolloutRefWorker binds it
        start = full_params(worker)
        metrics = []
        for _ in range(STEPS):
            out = worker.train_batch(to_engine(batch, TAU))
            metrics.append(out["metrics"])
        trained = full_params(worker)
        # a cache built for another model stops the step (the actor's model.path against the cache's)
        save_ref_cache(build_ref_cache(model, PROMPTS, dict(built_by, model="/elsewhere/model"), backend="torch"), path)
        with pytest.raises(RefCacheError, match=f"built for the model /elsewhere/model, this actor starts from {model_dir}"):
            worker.train_batch(to_engine(batch, TAU))

    # by hand: the same steps with erpo's own pieces on the same packed batch
    data = to_engine(batch, TAU)
    rows = Rows(data)
    ref_q = cache.ref_query_logp[cache.rows([query_id(list(p)) for p in distinct])]
    packed = packed_batch(data, rows, TAU, batch["advantages"][:, 0], ref_q, w_q, group, torch.float32)
    ids, pos = data["input_ids"].values(), data["position_ids"].values()
    config = LossConfig(algorithm="erpo", alpha=ALPHA, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    params = dict(model.named_parameters())
    torch.testing.assert_close({k: params[k].detach() for k in start}, start)
    for _ in range(STEPS):
        model.zero_grad()
        loss, m = erpo_loss(forward_hidden(model, ids, pos), model.lm_head.weight, packed, config, backend="torch")
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    assert m["qkl/loss"] > 0 and m["pg/ratio_mean"] != 1.0  # the Query-KL and the off-policy ratio are live
    moved = max(float((trained[k] - start[k]).abs().max()) for k in start)
    diff = max(float((trained[k] - params[k].detach()).abs().max()) for k in start)
    print(f"weights moved by up to {moved:.3g}; worker vs hand-written: max |difference| {diff:.3g}")
    assert moved > 1e-3
    assert diff <= 1e-5 * max(1.0, moved)
