"""Run by tests/test_vocab_parallel.py under `torchrun --nproc-per-node K` (gloo, CPU,
TRITON_INTERPRET=1): the vocabulary-parallel linear_token_logprobs against the
unsharded op on the same inputs, every case in one launch.

    python -m torch.distributed.run --nproc-per-node K tests/_vocab_parallel_worker.py OUT_DIR CASES

Each rank writes OUT_DIR/rank<r>.json (what it measured) and rank<r>.pt (its outputs,
to compare across ranks); the test decides pass/fail from those and the exit code.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

# 403 rows: uneven shards on 2 ranks (202 + 201) and on 3 (135 + 135 + 133), each over several of the
# kernels' vocabulary tiles on CPU tensors (64 or 128 columns), the last partial
V, D, N = 403, 24, 37

# name -> options of linear_token_logprobs; every case returns the entropy unless it says no
CASES = {
    "triton": dict(backend="triton", bias=True),
    "triton_softcap_temp": dict(backend="triton", softcap=3.0, logit_scale=0.7, temperature=True),
    "triton_temp_no_entropy": dict(backend="triton", temperature=True, return_entropy=False),
    "torch": dict(backend="torch", bias=True),
    "torch_softcap_temp": dict(backend="torch", softcap=3.0, temperature=True),
    # an ignore_index that is a vocabulary row (rank 0's row 7, and a local index on every rank)
    "torch_ignore_index_7": dict(backend="torch", ignore_index=7),
    # support= (issue 34): rank 1's shard starts at token 202, inside a bitmask word
    "triton_support_bitmask": dict(backend="triton", bias=True, temperature=True, support="bitmask"),
    "triton_support_threshold": dict(backend="triton", softcap=3.0, logit_scale=0.7, temperature=True,
                                     support="threshold"),
    "torch_support_threshold": dict(backend="torch", bias=True, softcap=3.0, temperature=True, support="threshold"),
}


def support_of(case: dict, hidden, weight, bias, targets, inv_t):
    """The case's support, the same on every rank: None; a bitmask keeping 30% of the tokens
    (row 0 unrestricted, row 1's target cleared: kept all the same); or a threshold at each
    row's 90th percentile of the scaled logits (mid-way between two of them; row 0 -inf).
    Row 2 keeps tokens of rank 0's shard only, its target set to 3 here (the bitmask: tokens
    0-4; the threshold: above every logit, so the target alone), so rank 1's shard has none."""
    from erpo_kernels import pack_support

    g = torch.Generator().manual_seed(2)
    if case.get("support") == "bitmask":
        kept = torch.rand(N, V, generator=g) < 0.3
        kept[0] = True
        kept[1, targets[1]] = False
        kept[2] = False
        kept[2, :5] = True
        targets[2] = 3
        return pack_support(kept)
    if case.get("support") == "threshold":
        z = hidden.double() @ weight.double().T + (bias.double() if bias is not None else 0.0)
        z = z * case.get("logit_scale", 1.0)
        z = case["softcap"] * torch.tanh(z / case["softcap"]) if case.get("softcap") else z
        s = z * (inv_t.double()[:, None] if inv_t is not None else 1.0)
        threshold = torch.quantile(s, 0.9, dim=1, interpolation="midpoint").float()
        threshold[0] = float("-inf")
        threshold[2], targets[2] = float(s[2].max()) + 1.0, 3
        return threshold
    return None


def inputs(case: dict):
    """The same hidden, weight, bias, targets, inv_temperature and upstream gradients on every rank."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, D, generator=g) * 2
    weight = torch.randn(V, D, generator=g)
    bias = torch.randn(V, generator=g) if case.get("bias") else None
    targets = torch.randint(0, V, (N,), generator=g)
    ignore = case.get("ignore_index", -100)
    targets[[3, 17, 18]] = ignore  # ignored rows
    targets[20] = ignore + (V + 1) // 2 if ignore >= 0 else targets[20]  # with ignore_index=7: rank 1's local row 7
    targets[5] = V - 1  # the last rank's last row
    inv_t = (0.5 + torch.rand(N, generator=g)) if case.get("temperature") else None
    g_logp, g_entropy = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return hidden, weight, bias, targets, inv_t, g_logp, g_entropy


class Comms:
    """Records what a call sends: every all_reduce, all_gather and all_to_all_single (the
    bytes of this rank's input tensor), and every other way a tensor could be gathered
    or moved (-1: a call that must not happen)."""

    OTHERS = [(dist, "all_gather_into_tensor"), (dist, "all_gather_object"), (dist, "broadcast"),
              (dist, "reduce_scatter_tensor"), (dist, "send"), (dist, "recv")]

    def __init__(self):
        from torch.distributed import _functional_collectives as funcol
        from torch.distributed.tensor import DTensor

        self.others = self.OTHERS + [(DTensor, "full_tensor"), (DTensor, "redistribute"),
                                     (funcol, "all_gather_tensor"), (funcol, "all_gather_tensor_autograd")]
        self.calls = []  # (name, bytes of this rank's payload)

    @contextlib.contextmanager
    def counting(self):
        saved = [(owner, name, getattr(owner, name)) for owner, name in self.others]
        real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "all_to_all_single")}

        def wrap(name, fn, payload):
            def counted(*a, **k):
                self.calls.append((name, payload(*a)))
                return fn(*a, **k)
            return counted

        for owner, name, fn in saved:
            setattr(owner, name, wrap(name, fn, lambda *a: -1))
        dist.all_reduce = wrap("all_reduce", real["all_reduce"], lambda t, *a: t.numel() * t.element_size())
        dist.all_gather = wrap("all_gather", real["all_gather"], lambda out, t, *a: t.numel() * t.element_size())
        dist.all_to_all_single = wrap("all_to_all_single", real["all_to_all_single"],
                                      lambda out, t, *a: t.numel() * t.element_size())
        try:
            yield self
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)
            for name, fn in real.items():
                setattr(dist, name, fn)

    def bytes(self, start=0):
        return sum(b for _, b in self.calls[start:])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|"""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run_case(name: str, case: dict, mesh, rank: int) -> dict:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from erpo_kernels import linear_token_logprobs

    hidden, weight, bias, targets, inv_t, g_logp, g_entropy = inputs(case)
    want_h = case.get("return_entropy", True)
    opts = dict(inv_temperature=inv_t, softcap=case.get("softcap"), logit_scale=case.get("logit_scale"),
                backend=case["backend"], return_entropy=True, ignore_index=case.get("ignore_index", -100))
    opts["return_entropy"] = want_h
    support = support_of(case, hidden, weight, bias, targets, inv_t)

    def loss_of(out):
        logp, entropy = out if want_h else (out, None)
        return (logp * g_logp).sum() + ((entropy * g_entropy).sum() if want_h else 0.0), logp, entropy

    # the unsharded op
    leaves = [t.clone().requires_grad_() for t in (hidden, weight)] + [bias.clone().requires_grad_() if bias is not None else None]
    loss, logp, entropy = loss_of(linear_token_logprobs(leaves[0], leaves[1], targets, bias=leaves[2], **opts,
                                                        support=support))
    loss.backward()
    # the sharded op: weight (and bias) Shard(0) parameters, hidden a plain leaf
    h = hidden.clone().requires_grad_()
    w = torch.nn.Parameter(distribute_tensor(weight.clone(), mesh, [Shard(0)]))
    b = torch.nn.Parameter(distribute_tensor(bias.clone(), mesh, [Shard(0)])) if bias is not None else None
    comms = Comms()
    with comms.counting():
        loss_s, logp_s, entropy_s = loss_of(linear_token_logprobs(h, w, targets, bias=b, **opts, support=support))
        n_fwd = len(comms.calls)
        loss_s.backward()
    again = linear_token_logprobs(h.detach(), w.detach(), targets, bias=None if b is None else b.detach(), **opts,
                                  support=support)
    again = again[0] if want_h else again
    lo = w.to_local().shape[0]
    offset = sum(-(-V // mesh.size()) for _ in range(rank))  # torch's chunks before this rank's
    rows = slice(offset, offset + lo)
    res = dict(
        logp=rel(logp_s, logp), d_hidden=rel(h.grad, leaves[0].grad),
        d_weight=rel(w.grad.to_local(), leaves[1].grad[rows]),
        d_weight_is_shard=isinstance(w.grad, DTensor) and list(w.grad.placements) == [Shard(0)],
        outputs_plain=not isinstance(logp_s, DTensor), local_rows=lo, collectives=comms.calls, n_forward=n_fwd,
        fwd_bytes_per_row=comms.bytes(0) / N - comms.bytes(n_fwd) / N, bwd_bytes_per_row=comms.bytes(n_fwd) / N,
        deterministic=bool(torch.equal(again, logp_s)), ignored_zero=bool((logp_s[targets == opts["ignore_index"]] == 0).all()),
        scored_rows=int((logp_s != 0).sum()),
    )
    if want_h:
        res["entropy"] = rel(entropy_s, entropy)
    if b is not None:
        res["d_bias"] = rel(b.grad.to_local(), leaves[2].grad[rows])
    if support is not None:  # the support is applied: rows 1.. change, row 0 (unrestricted) does not
        free = linear_token_logprobs(hidden, weight, targets, bias=bias, **opts)
        free = free[0] if want_h else free
        res["support_row0_unchanged"] = bool(torch.equal(free[0], logp_s[0]))
        res["support_raised_rows"] = int((logp_s[1:] > free[1:]).sum())
        res["target_only_rows"] = int(case["support"] == "threshold")  # row 2: logp = 0, not counted as scored
    return res, logp_s.detach()


def sequence_parallel(mesh, rank: int, world: int) -> dict:
    """Rows split over the ranks (each its own hidden rows): with the weight replicated the
    plain op runs per rank and the summed weight gradient is the unsharded one; with the
    weight sharded the ranks' rows are gathered (torch's own redistribute of a Shard(0)
    hidden: its backward keeps each rank's rows) before the vocabulary-parallel call,
    whose loss is then the same on every rank."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from erpo_kernels import linear_token_logprobs

    hidden, weight, _, targets, inv_t, g_logp, _ = inputs(dict(temperature=True))
    per = N // world
    mine = slice(rank * per, (rank + 1) * per)
    whole_h, whole_w = hidden[:per * world].clone().requires_grad_(), weight.clone().requires_grad_()
    t_all, it_all, g_all = targets[:per * world], inv_t[:per * world], g_logp[:per * world]
    logp = linear_token_logprobs(whole_h, whole_w, t_all, inv_temperature=it_all, backend="triton")
    (logp * g_all).sum().backward()
    # weight replicated: the plain op on this rank's rows, the weight's gradient summed over ranks
    h, w = hidden[mine].clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_token_logprobs(h, w, targets[mine], inv_temperature=inv_t[mine], backend="triton")
    (out * g_logp[mine]).sum().backward()
    dist.all_reduce(w.grad)
    res = dict(sp_replicated_logp=rel(out, logp[mine]), sp_replicated_d_hidden=rel(h.grad, whole_h.grad[mine]),
               sp_replicated_d_weight=rel(w.grad, whole_w.grad))
    # weight sharded: hidden rows gathered by DTensor (backward: reduce-scatter to the rows)
    h = hidden[mine].clone().requires_grad_()
    w = torch.nn.Parameter(distribute_tensor(weight.clone(), mesh, [Shard(0)]))
    rows = DTensor.from_local(h, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local()
    out = linear_token_logprobs(rows, w, t_all, inv_temperature=it_all, backend="triton")
    (out * g_all).sum().backward()  # the loss of every row, the same on every rank
    out = out[mine]
    lo = w.to_local().shape[0]
    offset = sum(-(-V // world) for _ in range(rank))
    res.update(sp_sharded_logp=rel(out, logp[mine]), sp_sharded_d_hidden=rel(h.grad, whole_h.grad[mine]),
               sp_sharded_d_weight=rel(w.grad.to_local(), whole_w.grad[offset:offset + lo]))
    return res


def low_precision(mesh, rank: int) -> dict:
    """bf16 on the kernels: the sharded op as accurate as test_linear_token_logprobs demands
    of the unsharded one (_compare: within 1.5 x PyTorch's bf16 error against float64);
    {name: None or the failed check's message}."""
    from _compare import assert_close_to_ref
    from test_linear_token_logprobs import NAMES, _torch_same_dtype, _truth
    from torch.distributed.tensor import Shard, distribute_tensor

    from erpo_kernels import linear_token_logprobs

    hidden, weight, _, targets, inv_t, g_logp, g_entropy = inputs(dict(temperature=True))
    hidden, weight = hidden.bfloat16(), (weight * 0.3).bfloat16()
    args = (hidden, weight, None, targets, inv_t, g_logp, g_entropy)
    truth, same = _truth(*args), _torch_same_dtype(*args, dtype=torch.bfloat16)
    h = hidden.clone().requires_grad_()
    w = torch.nn.Parameter(distribute_tensor(weight.clone(), mesh, [Shard(0)]))
    logp, entropy = linear_token_logprobs(h, w, targets, inv_temperature=inv_t, return_entropy=True, backend="triton")
    ((logp * g_logp).sum() + (entropy * g_entropy).sum()).backward()
    lo = w.to_local().shape[0]
    rows = slice(rank * -(-V // mesh.size()), rank * -(-V // mesh.size()) + lo)
    found = {}
    for name, ours, t, p in zip(NAMES, (logp, entropy, h.grad, w.grad.to_local()), truth, same):
        t, p = (t[rows], p[rows]) if name == "d_weight" else (t, p)
        try:
            assert_close_to_ref(ours.detach(), t, p, input_dtype=torch.bfloat16, name=name)
            found[name] = None
        except AssertionError as exc:
            found[name] = str(exc)
    return {"bf16": found}


def errors(mesh) -> dict:
    """The ValueError of each misuse, by name."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from erpo_kernels import linear_token_logprobs

    hidden, weight, bias, targets, _, _, _ = inputs(dict(bias=True))
    w = distribute_tensor(weight, mesh, [Shard(0)])
    bad = {
        "plain_bias": lambda: linear_token_logprobs(hidden, w, targets, bias=bias),
        "replicated_weight": lambda: linear_token_logprobs(hidden, distribute_tensor(weight, mesh, [Replicate()]),
                                                           targets),
        "row_sharded_hidden": lambda: linear_token_logprobs(DTensor.from_local(hidden, mesh, [Shard(0)]), w, targets),
        "target_out_of_range": lambda: linear_token_logprobs(hidden, w, torch.full((N,), V)),
        "wrong_d": lambda: linear_token_logprobs(hidden[:, :5], w, targets),
        # a bitmask of this rank's columns instead of the whole vocabulary's
        "support_local_width": lambda: linear_token_logprobs(
            hidden, w, targets, support=torch.zeros(N, -(-w.to_local().shape[0] // 32), dtype=torch.int32)),
    }
    found = {}
    for name, call in bad.items():
        try:
            call()
            found[name] = None
        except ValueError as exc:
            found[name] = str(exc)
    return {"errors": found}


def batch_invariance() -> dict:
    """One row in batches of 1, 37 and 70 rows at several positions, ignored rows around
    it: its logp, entropy and d_hidden row bit for bit (the interpreter's tl.dot made
    independent of a row's position, as test_batch_invariance.py does)."""
    from test_batch_invariance import _row_independent_dot
    from torch.distributed.tensor import Shard, distribute_tensor
    from triton.runtime.interpreter import InterpreterBuilder

    from erpo_kernels import linear_token_logprobs

    g = torch.Generator().manual_seed(1)
    weight = distribute_tensor(torch.randn(V, D, generator=g), init_mesh(), [Shard(0)])
    row = torch.randn(D, generator=g)
    real_dot = InterpreterBuilder.create_dot
    InterpreterBuilder.create_dot = _row_independent_dot
    seen = []
    try:
        for n, pos, ignored in [(1, 0, []), (37, 17, [15, 16, 18]), (70, 69, [0, 68])]:
            hidden = torch.randn(n, D, generator=g)
            hidden[pos] = row
            targets = torch.randint(0, V, (n,), generator=g)
            targets[pos], targets[ignored] = V - 3, -100
            inv_t = torch.rand(n, generator=g) + 0.5
            inv_t[pos] = 0.8
            h = hidden.requires_grad_()
            logp, ent = linear_token_logprobs(h, weight, targets, inv_temperature=inv_t, return_entropy=True,
                                              softcap=3.0, backend="triton")
            (d_h,) = torch.autograd.grad(0.6 * logp[pos] - 1.3 * ent[pos] + 0.1 * logp.sum(), h)
            seen.append((logp[pos].item(), ent[pos].item(), d_h[pos].tolist()))
    finally:
        InterpreterBuilder.create_dot = real_dot
    return {"batch_invariant": all(s == seen[0] for s in seen), "batch_invariance_rows": seen}


def init_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def run(out_dir: str, names) -> None:
    """Every case in `names` on the ranks of the process group (already joined): this rank's
    OUT_DIR/rank<r>.json and rank<r>.pt. Also run by tests/_dist_worker.py's vocab: step, so
    that one 2-rank launch serves these cases and the tensor-parallel trainer."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        from _interpreter_speed import skip_repeated_language_patches

        skip_repeated_language_patches()  # as tests/conftest.py does in the test process
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    res: dict = {"rank": rank, "world": world}
    outputs = {}
    for name in names:
        if name == "sequence_parallel":
            res.update(sequence_parallel(mesh, rank, world))
        elif name == "errors":
            res.update(errors(mesh))
        elif name == "bf16":
            res.update(low_precision(mesh, rank))
        elif name == "batch_invariance":
            res.update(batch_invariance())
        else:
            res[name], outputs[name] = run_case(name, CASES[name], mesh, rank)
    os.makedirs(out_dir, exist_ok=True)
    torch.save(outputs, os.path.join(out_dir, f"rank{rank}.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def main() -> None:
    out_dir, names = sys.argv[1], sys.argv[2].split(",")
    dist.init_process_group("gloo")
    try:
        run(out_dir, names)
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
