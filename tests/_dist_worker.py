"""Run by tests/test_distributed.py under `torchrun --nproc-per-node 2` (gloo, CPU).

    python -m torch.distributed.run --nproc-per-node 2 tests/_dist_worker.py units OUT_DIR

Each rank writes OUT_DIR/rank<r>.json with what it measured; the test decides pass/fail
from those files and the exit code (never from a rank's own asserts alone).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

import torch


def tiny_qwen2(tied: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=37, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=tied, max_position_embeddings=64)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


def units(out_dir: str) -> dict:
    """Checks of erpo.distributed on 2 ranks: collectives, the lm_head gather's gradient,
    FSDP2 gradients against one process on the whole batch, optimizer checkpoint round trip."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from erpo import distributed as D
    from erpo.packing import forward_hidden, pack
    from erpo_kernels import linear_token_logprobs

    D.init("cpu")
    rank, world = D.rank(), D.world_size()
    res: dict = {"rank": rank, "world": world}

    # collectives
    res["all_reduce_sum"] = D.all_reduce_sum(torch.tensor([rank + 1.0, 1.0])).tolist()  # [1+2, 2]
    res["all_gather_object"] = D.all_gather_object({"r": rank})

    # a sharded DTensor gathered for one call: the gradient must reach the shard summed over ranks
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    w_full = torch.randn(7, 3, dtype=torch.float64)
    x_all = torch.randn(2 * world, 3, dtype=torch.float64)
    x = x_all[2 * rank:2 * rank + 2]
    expected = (2 * (x_all @ w_full.T)).T @ x_all  # d/dW sum((X W^T)^2) over every rank's rows [7, 3]
    for how in ("gather_for_call", "full_tensor"):
        p = torch.nn.Parameter(distribute_tensor(w_full.clone(), mesh, [Shard(0)]))
        full = D.gather_for_call(p) if how == "gather_for_call" else p.full_tensor()
        res[f"{how}_is_whole"] = list(full.shape) == [7, 3] and not isinstance(full, DTensor)
        (x @ full.T).square().sum().backward()
        res[f"{how}_grad_err"] = float((p.grad.full_tensor() - expected).abs().max())

    # FSDP2: per-rank share of a packed batch, fused log-probs on the gathered lm_head;
    # summed gradients == the one-process gradient of the whole batch
    prompts = [[1, 5, 6], [1, 7], [1, 8, 9, 10], [1, 11]]
    responses = [[[12, 13], [14]], [[15, 16, 17], [18, 2]], [[19], [20, 21]], [[22, 23], [24, 25, 26]]]
    for tied in (False, True):
        tag = "tied" if tied else "untied"
        ref = tiny_qwen2(tied)
        model = tiny_qwen2(tied)
        whole = pack(prompts, responses, 0.7)

        def loss_of(m, packed, head):
            hidden = forward_hidden(m, packed.input_ids, packed.position_ids)  # [N, D]
            weight, _ = head(m)
            logp = linear_token_logprobs(hidden, weight, packed.targets, inv_temperature=packed.inv_temperature,
                                         backend="torch")  # [N]
            return -(logp * (packed.targets != packed.ignore_index)).sum(), weight

        loss, _ = loss_of(ref, whole, D.lm_head_for_call)
        loss.backward()
        D.shard_model(model)
        share = D.rank_share(len(prompts))
        mine = pack(prompts[share], responses[share], 0.7)
        loss, weight = loss_of(model, mine, D.lm_head_for_call)
        res[f"{tag}_lm_head_whole_in_call"] = list(weight.shape) == [37, 16] and not isinstance(weight, DTensor)
        loss.backward()
        res[f"{tag}_lm_head_sharded_after"] = isinstance(model.lm_head.weight, DTensor)
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        err = 0.0
        for n, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            err = max(err, float((g - ref_grads[n]).abs().max()))
        res[f"{tag}_grad_err"] = err

        # optimizer state through torch.distributed.checkpoint: after a reload, the next step is bit-identical
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=1e-2)
        opt.step()  # step 1 (the gradients stay in .grad)
        path = os.path.join(out_dir, f"optim-{tag}")
        D.save_optimizer(model, opt, path)
        after_one = [p.detach().to_local().clone() for p in params]
        opt.step()  # step 2
        after_two = [p.detach().to_local().clone() for p in params]
        with torch.no_grad():
            for p, saved in zip(params, after_one):
                p.to_local().copy_(saved)
        again = torch.optim.AdamW(params, lr=1e-2)
        D.load_optimizer(model, again, path)
        again.step()  # step 2 again, from the reloaded state
        res[f"{tag}_optimizer_reload_exact"] = all(torch.equal(p.detach().to_local(), t) for p, t in zip(params, after_two))
        full = D.full_state_dict(model)  # rank 0: the whole fp32 weights, others: {}
        res[f"{tag}_full_state_dict_keys"] = len(full)
        if rank == 0:
            ref_sd = ref.state_dict()
            res[f"{tag}_full_state_dict_shapes_ok"] = sorted(full) == sorted(ref_sd) and all(
                full[k].shape == ref_sd[k].shape and not isinstance(full[k], DTensor) for k in ref_sd)
    D.barrier()
    return res


class Recorder:
    """A rollout engine wrapper that remembers what was sampled for each prompt, in order."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = []

    def generate(self, prompt_ids, n, temperature, max_new_tokens):
        out = self.inner.generate(prompt_ids, n, temperature, max_new_tokens)  # a Rollout
        logprobs = out.logprobs or [None] * len(prompt_ids)
        self.calls.append([[list(p), g, lp] for p, g, lp in zip(prompt_ids, out.responses, logprobs)])
        return out

    def sync_weights(self, model):
        self.inner.sync_weights(model)


def train(out_dir: str, *overrides: str) -> dict:
    """`erpo train OVERRIDES` as the CLI runs it under torchrun, with the rollouts recorded
    (so a one-process run can replay the same global batch)."""
    from erpo import distributed as D
    from erpo.cli import resolve_config
    from erpo.start import check_world_size
    from erpo.trainer import Trainer

    cfg = resolve_config(list(overrides), "train")
    check_world_size(cfg, D.env_world_size())
    D.init("cpu")
    trainer = Trainer(cfg, log=lambda _msg: None)
    trainer.engine = Recorder(trainer.engine)
    plans = []  # micro-batches of each mini-batch on this rank
    updates = trainer._updates

    gathers = []  # the shape of every DTensor made whole in an update (the no-grad passes and the steps)

    def recording_updates(*args):
        with recording_gathers(gathers):
            out = updates(*args)
        plans.append([len(mini.plan) for mini in trainer.last_mini_batches])
        return out

    trainer._updates = recording_updates
    with recording_lm_head(D) as heads:
        trainer.train()
    return {"rank": D.rank(), "rollouts": trainer.engine.calls, "micro_batches": plans, "lm_heads": heads,
            "gathered_shapes": gathers, "run_dir": str(cfg.run_dir), "steps": cfg.steps}


def resume(out_dir: str, run_dir: str, steps: int) -> dict:
    """`erpo train resume=OUT_DIR/resumed` as `torchrun -m erpo train resume=...` runs it (the
    CLI's main, in these ranks: one launch serves the run and its resume), where
    OUT_DIR/resumed is a copy of the run just trained without its last checkpoint. Returns
    the CLI's exit status."""
    import shutil

    from erpo import distributed as D
    from erpo.cli import main as cli

    resumed = os.path.join(out_dir, "resumed")
    if D.rank() == 0:
        shutil.copytree(run_dir, resumed)
        shutil.rmtree(os.path.join(resumed, "checkpoints", f"step-{steps:06d}"))
    D.barrier()
    rank = D.rank()
    return {"rank": rank, "resumed": resumed, "resume_exit": cli(["train", f"resume={resumed}"])}


@contextlib.contextmanager
def recording_lm_head(D):
    """What every fused call got as the lm_head weight: [kind, placements, local rows]."""
    from torch.distributed.tensor import DTensor

    seen = []
    real = D.lm_head_for_call

    def recorded(model):
        weight, bias = real(model)
        if isinstance(weight, DTensor):
            seen.append(["DTensor", str(tuple(weight.placements)), weight.device_mesh.ndim, weight.to_local().shape[0]])
        else:
            seen.append(["Tensor", "", 0, weight.shape[0]])
        return weight, bias

    D.lm_head_for_call = recorded
    try:
        yield seen
    finally:
        D.lm_head_for_call = real


@contextlib.contextmanager
def recording_gathers(seen):
    """Appends to `seen` the global shape of every DTensor made whole (full_tensor, or a
    redistribute to all Replicate) inside the block."""
    from torch.distributed.tensor import DTensor, Replicate

    real_full, real_redistribute = DTensor.full_tensor, DTensor.redistribute

    def full_tensor(self, *a, **k):
        seen.append(list(self.shape))
        return real_full(self, *a, **k)

    def redistribute(self, device_mesh=None, placements=None, *a, **k):
        if placements is not None and all(p == Replicate() for p in placements):
            seen.append(list(self.shape))
        return real_redistribute(self, device_mesh, placements, *a, **k)

    DTensor.full_tensor, DTensor.redistribute = full_tensor, redistribute
    try:
        yield seen
    finally:
        DTensor.full_tensor, DTensor.redistribute = real_full, real_redistribute


def main() -> None:
    """python tests/_dist_worker.py STEPS OUT_DIR key=value ..., STEPS joined by "+", run in this
    order: vocab:CASE,CASE,... (tests/_vocab_parallel_worker.py's cases, written to OUT_DIR/vocab),
    units, train (both = units+train), resume (the run's resume from its next-to-last
    checkpoint, see `resume`): one launch for all of them."""
    steps, out_dir, overrides = sys.argv[1].split("+"), sys.argv[2], sys.argv[3:]
    from erpo import distributed as D

    if "both" in steps:
        steps[steps.index("both"):steps.index("both") + 1] = ["units", "train"]
    try:
        res = {}
        for step in steps:
            if step.startswith("vocab:"):
                from _vocab_parallel_worker import run as vocab_cases

                D.init("cpu")
                vocab_cases(os.path.join(out_dir, "vocab"), step[len("vocab:"):].split(","))
            elif step == "units":
                res.update(units(out_dir))
            elif step == "train":
                res.update(train(out_dir, *overrides))
            elif step == "resume":
                res.update(resume(out_dir, res["run_dir"], res["steps"]))
            else:
                raise SystemExit(f"unknown step {step!r}")
        with open(os.path.join(out_dir, f"rank{res['rank']}.json"), "w") as f:
            json.dump(res, f)
    finally:
        D.shutdown()


if __name__ == "__main__":
    main()
