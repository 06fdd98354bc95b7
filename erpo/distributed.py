"""torchrun + FSDP2 wiring, and nothing else (no engine of our own).

    torchrun --nproc-per-node N -m erpo train [config.yaml] [key=value ...]

`erpo train` alone is one process and never touches this module's collectives. Under
torchrun each rank runs the same trainer on its share of a step's queries; the model is
sharded with PyTorch's own FSDP2 (`fully_shard` on every decoder layer and on the root),
gradients are summed across ranks (not averaged: every rank's loss is already its part
of the global loss, normalised by counts all-reduced over the ranks, so the sum is the
gradient of the one-process loss on the same global batch).

The lm_head weight and the fused kernel. The trainer never calls the model's own
forward (that would form [N, V] logits): it calls the base model for hidden states and
hands hidden states plus the lm_head weight to the fused kernel. Under FSDP2 that base
call goes through the root module (`BASE_FORWARD`, registered with
`register_fsdp_forward_method`), so FSDP all-gathers the root's parameters (embeddings,
final norm, lm_head; tied or not) for it and keeps them gathered until the backward, as
it does for the root of any model. Between that call and the backward,
`model.lm_head.weight` is the whole [V, D] weight (in the compute dtype of the
mixed-precision policy); the kernel's gradient on it is reduce-scattered back to the
shards by FSDP's post-backward. No rank ever holds [N, V].

A sharded DTensor reached outside that window is gathered with `gather_for_call`:
`DTensor.full_tensor()` alone is wrong under autograd (its backward treats the incoming
gradient as replicated and keeps only the local rows of this rank's gradient, dropping
the other ranks' contributions); `to_local(grad_placements=[Partial()])` makes the
backward a reduce-scatter (sum) into the shard. tests/test_distributed.py checks both.

Tensor parallelism (`tp_size` > 1, docs/distributed.md): the ranks form a (world / tp,
tp) mesh; each tp-rank group runs one data-parallel share (the data collectives here run
over the data-parallel ranks), its decoder layers and lm_head split with torch's
parallelize_module, FSDP2 over the groups. lm_head_for_call then returns this rank's
Shard(0) rows of the lm_head, which linear_token_logprobs takes as they are
(erpo_kernels/vocab_parallel.py): the weight is never gathered.

Shutdown: `shutdown()` is a barrier, then destroy_process_group (without the barrier a
rank can abort in gloo's teardown while another still finishes its last collective).
"""
from __future__ import annotations

import contextlib
import logging
import os
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from .errors import ErpoError

# Name of the method installed on an FSDP root that runs its base model (decoder without
# lm_head) through FSDP's forward hooks; erpo.packing.forward_hidden calls it when present.
BASE_FORWARD = "erpo_base_forward"


# ---------------------------------------------------------------------- launch


def env_world_size() -> int:
    """WORLD_SIZE that torchrun set for this process (1 without torchrun); readable before init."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched() -> bool:
    """True in a process started by torchrun (it sets LOCAL_RANK and WORLD_SIZE)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank: torch.distributed's, or before init torchrun's RANK (0 without torchrun)."""
    return dist.get_rank() if is_initialized() else int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """Number of ranks (1 without torch.distributed)."""
    return dist.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    """True on rank 0, and in a plain one-process run: the rank that logs, plots and writes files."""
    return rank() == 0


def init(device_type: str) -> torch.device:
    """Join torchrun's process group (nccl on CUDA, gloo on CPU tensors) and return this rank's
    device: cuda:LOCAL_RANK on CUDA, cpu otherwise. Idempotent."""
    device = local_device(torch.device(device_type))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not is_initialized():
        if device.type == "cuda":  # nccl for CUDA tensors, gloo for the few CPU-side collectives (metrics)
            dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return device


def local_device(device: torch.device) -> torch.device:
    """cuda:LOCAL_RANK for a CUDA device under torchrun (each rank its own GPU); `device` otherwise."""
    if device.type == "cuda" and launched():
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return device


def shutdown() -> None:
    """End a distributed run: barrier, then destroy the process group (no-op when not initialised)."""
    if is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def barrier() -> None:
    if is_initialized():
        dist.barrier()


# ---------------------------------------------------------------------- tensor parallel

# The (data, tensor) layout of the ranks: set by use_tensor_parallel, once per process.
_LAYOUT: Dict[str, Any] = {"tp": 1, "mesh": None}


def use_tensor_parallel(device_type: str, tp: int) -> None:
    """Arrange the ranks as a (world / tp, tp) device mesh ("dp", "tp"): ranks
    d * tp ... d * tp + tp - 1 form tensor-parallel group d, which takes data-parallel
    share d (its ranks run the same data). A collective; tp 1 (FSDP2 alone): every rank
    is its own data-parallel rank. world must divide by tp (start.check_world_size)."""
    if tp == 1 or not is_initialized():
        _LAYOUT.update(tp=1, mesh=None)
        return
    from torch.distributed.device_mesh import init_device_mesh

    _LAYOUT.update(tp=tp, mesh=two_d_mesh(init_device_mesh, device_type, world_size() // tp, tp))


def two_d_mesh(init_device_mesh: Callable[..., Any], device_type: str, dp: int, tp: int) -> Any:
    """The ("dp", "tp") mesh of dp x tp ranks, with its two dimensions also flattened into one
    ("dp_tp"; a collective). A DTensor spread over both dimensions (the gradient norm of
    clip_grad_norm_, Partial on both; a checkpoint's full_state_dict, sharded on both) is then
    reduced or gathered in one collective over all ranks. Without it torch runs one per
    dimension, and says so in a warning per rank ("... 2 sequential all_reduce operations ...
    may give inconsistent results between ranks ..."; docs/distributed.md)."""
    mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
    flatten = getattr(mesh["dp", "tp"], "_flatten", None)  # private in torch 2.13; its own recipes use it
    if flatten is not None:
        flatten("dp_tp")
    return mesh


def tp_size() -> int:
    """Ranks per tensor-parallel group (1: none)."""
    return _LAYOUT["tp"]


def data_rank() -> int:
    """This rank's data-parallel share (its rank without tensor parallelism)."""
    return rank() // tp_size()


def data_world() -> int:
    """Number of data-parallel shares (world size / tp_size)."""
    return world_size() // tp_size()


def data_group() -> Any:
    """The process group of this rank's data-parallel peers (None: every rank)."""
    mesh = _LAYOUT["mesh"]
    return None if mesh is None else mesh.get_group("dp")


# ---------------------------------------------------------------------- collectives


# The collectives of the data below run over the data-parallel ranks: every rank, or with
# tp_size > 1 one rank of each tensor-parallel group (whose ranks hold the same data).


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` (a tensor of per-rank sums or counts) over the data-parallel ranks, in
    place; returned for chaining. Unchanged in a one-process run."""
    return all_reduce(t, "sum")


def all_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
    """In-place all-reduce over the data-parallel ranks with op "sum", "min" or "max"
    (unchanged in a one-process run)."""
    if is_initialized() and data_world() > 1:
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op],
                        group=data_group())  # fmt: skip
    return t


def max_over_ranks(n: int) -> int:
    """The largest `n` of any data-parallel rank (`n` in a one-process run)."""
    return int(all_reduce(torch.tensor(n, dtype=torch.long), "max"))


def all_gather_object(obj: Any) -> List[Any]:
    """[obj of rank 0, obj of rank 1, ...] on every rank ([obj] in a one-process run)."""
    if not (is_initialized() and world_size() > 1):
        return [obj]
    out: List[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def all_gather_data_object(obj: Any) -> List[Any]:
    """[obj of data rank 0, obj of data rank 1, ...] on every rank: all_gather_object
    with one entry per tensor-parallel group (its ranks hold the same data)."""
    return all_gather_object(obj)[::tp_size()]


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank src's obj on every rank."""
    if not (is_initialized() and world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def rank_share(n: int, rank_: Optional[int] = None, world: Optional[int] = None) -> slice:
    """The contiguous slice of n items (n divisible by the data-parallel world) that data
    rank `rank_` owns."""
    r = data_rank() if rank_ is None else rank_
    w = data_world() if world is None else world
    if n % w:
        raise ValueError(f"{n} items do not divide over {w} ranks")
    k = n // w
    return slice(r * k, (r + 1) * k)


def rank_items(items: Sequence[Any], parts: int = 1, rank_: Optional[int] = None,
               world: Optional[int] = None) -> List[Any]:
    """This rank's share of `items` cut into `parts` equal consecutive parts (a step's
    queries cut into mini-batches): its contiguous slice of every part, in order. Cut
    again into `parts` equal parts, the share gives this rank's slice of each part, so N
    ranks together hold exactly the parts one process would. len(items) must divide by
    parts * world. Rank and world: the data-parallel ones (a tensor-parallel group shares one)."""
    r = data_rank() if rank_ is None else rank_
    w = data_world() if world is None else world
    n = len(items)
    if n % (parts * w):
        raise ValueError(f"{n} items do not divide into {parts} parts over {w} ranks")
    size = n // parts
    out: List[Any] = []
    for p in range(parts):
        part = list(items[p * size:(p + 1) * size])
        out.extend(part[rank_share(size, r, w)])
    return out


def all_gather_items(t: torch.Tensor, parts: int = 1) -> torch.Tensor:
    """The inverse of rank_items on rows: every rank's `t` (its rank_items share, rows
    along dim 0) gathered back into the one-process order of the items."""
    whole = all_gather_tensor(t)  # [world * n, ...] in rank order
    w = data_world()
    if w == 1 or parts == 1:
        return whole
    per = t.shape[0] // parts  # rows of one part on one rank
    return whole.reshape(w, parts, per, *t.shape[1:]).transpose(0, 1).reshape(whole.shape)


def all_gather_tensor(t: torch.Tensor) -> torch.Tensor:
    """Every data-parallel rank's `t` (same shape on each) concatenated along dim 0 in
    rank order (`t` itself in a one-process run)."""
    if not (is_initialized() and data_world() > 1):
        return t
    parts = [torch.empty_like(t) for _ in range(data_world())]
    dist.all_gather(parts, t.contiguous(), group=data_group())
    return torch.cat(parts, dim=0)


def reduce_metrics(metrics: Dict[str, float]) -> Dict[str, float]:
    """A metrics dict whose values are this rank's parts of global quantities, combined
    over ranks: keys ending in "max" by max, "min" by min, every other key by sum (the
    rule erpo_kernels.combine_metrics applies to micro-batches; with the
    mini-batch's normalisers summed over ranks every such metric is a sum of parts).
    Unchanged in a one-process run (and over a tensor-parallel group, whose ranks agree)."""
    if not (is_initialized() and data_world() > 1):
        return dict(metrics)
    keys = list(metrics)
    out: Dict[str, float] = {}
    for op, pick in (("max", lambda k: k.endswith("max")), ("min", lambda k: k.endswith("min")),
                     ("sum", lambda k: not k.endswith(("max", "min")))):
        chosen = [k for k in keys if pick(k)]
        if chosen:
            t = torch.tensor([float(metrics[k]) for k in chosen], dtype=torch.float64)
            all_reduce(t, op)
            out.update(zip(chosen, t.tolist()))
    return {k: out[k] for k in keys}


# LossNormalizers fields that are sums over a mini-batch's queries (group_sizes and
# prompt_copies are per query, and a query's group never spans ranks).
SUMMED_NORMALIZERS = ("n_tokens", "n_sequences", "n_queries", "weight_mass", "weight_sq_mass")


def reduce_normalizers(norm: Any) -> Any:
    """A rank's erpo_kernels.LossNormalizers (of its share of a mini-batch) made
    the global mini-batch's, in place: its summed fields all-reduced over the ranks.
    Every rank then divides by the same global counts and weight mass, so the per-rank
    losses add up to the one-process loss of the whole mini-batch."""
    for name in SUMMED_NORMALIZERS:
        all_reduce_sum(getattr(norm, name))
    return norm


def main_first(fn: Callable[[], Any]) -> Any:
    """fn() on rank 0 first, then on the other ranks (e.g. build a file cache once, then
    read it). An exception on rank 0 is raised on every rank (the same type when it is
    an ErpoError, with its message), so no rank waits for one that failed."""
    if not (is_initialized() and world_size() > 1):
        return fn()
    failure = None
    result = None
    if is_main():
        try:
            result = fn()
        except Exception as exc:  # re-raised below, after the other ranks heard of it
            failure = exc
    told = broadcast_object(None if failure is None else (type(failure), str(failure)))
    if failure is not None:
        raise failure
    if told is not None:
        kind, message = told
        try:
            error = kind(message)
        except Exception:  # an exception type that takes other arguments
            error = RuntimeError(message)
        raise error
    return result if is_main() else fn()


# ---------------------------------------------------------------------- FSDP2


def decoder_layers(model: Any) -> List[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM (model.model.layers for Llama/Qwen2-style models)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found at "
                         f"{getattr(model, 'base_model_prefix', 'model')}.layers to shard")
    return list(layers)


def _base_forward(self: Any, **kwargs: Any) -> Any:
    """The base model (decoder without lm_head) run inside the FSDP root's forward hooks."""
    return getattr(self, getattr(self, "base_model_prefix", "model"))(**kwargs)


def shard_model(model: Any, compute_dtype: torch.dtype = torch.float32) -> Any:
    """FSDP2 on `model` in place: fully_shard on each decoder layer, then on the root.

    Parameters (and so AdamW's state) stay fp32 and sharded. compute_dtype bfloat16 or
    float16 sets the mixed-precision policy: the gathered parameters in that dtype for
    forward and backward, gradients reduced in fp32. Gradients are summed over ranks
    (see the module docstring). Returns the model (now an FSDPModule).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    device = next(model.parameters()).device
    if tp_size() > 1:  # tensor parallel inside each group, FSDP2 over the groups (a 2-D mesh)
        parallelize_decoder(model, _LAYOUT["mesh"]["tp"])
        mesh = _LAYOUT["mesh"]["dp"]
    else:
        mesh = init_device_mesh(device.type, (world_size(),))
    kwargs: Dict[str, Any] = {"mesh": mesh}
    if compute_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum, not mean, over ranks
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    setattr(model, BASE_FORWARD, types.MethodType(_base_forward, model))
    register_fsdp_forward_method(model, BASE_FORWARD)
    return model


# torch's tensor-parallel plan of a Llama / Qwen2-style decoder layer: the projections
# into heads and into the MLP split by output columns, the ones out of them by input rows
# (one all-reduce each after attention and after the MLP); norms and residuals replicated.
LAYER_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
              "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
              "mlp.down_proj": "rowwise"}


def check_tensor_parallel(config: Any, tp: int) -> None:
    """ErpoError unless the model's heads, key/value heads and MLP width divide over tp ranks."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name, None)
        if value is not None and value % tp:
            raise ErpoError(f"tp_size={tp}: the model's {name}={value} does not divide over {tp} ranks; "
                             f"use a tp_size that divides it")


def _submodule(module: torch.nn.Module, name: str) -> Optional[torch.nn.Module]:
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def parallelize_decoder(model: Any, tp_mesh: Any) -> None:
    """torch's parallelize_module on `model` in place over the 1-D mesh tp_mesh: LAYER_PLAN
    on every decoder layer, and the lm_head split on the vocabulary (Shard(0) rows; its own
    forward, used only by generation, gathers the logits). The trainer's loss never calls
    the lm_head: it hands the Shard(0) weight to the vocabulary-parallel fused op."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    check_tensor_parallel(model.config, tp_mesh.size())
    if getattr(model.config, "tie_word_embeddings", False):
        raise ErpoError("tp_size > 1 needs separate input and output embeddings, and this model ties them "
                        "(tie_word_embeddings=true in its config.json: sharding the lm_head would shard the input "
                        "embedding too); train it with tp_size=1 (FSDP2 alone shards it over every rank)")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in decoder_layers(model):
        missing = [name for name in LAYER_PLAN if not isinstance(_submodule(layer, name), torch.nn.Linear)]
        if missing:
            raise ErpoError(f"tp_size > 1: {type(layer).__name__} has no {missing[0]} (the plan is Llama / Qwen2's)")
        parallelize_module(layer, tp_mesh, {name: styles[style]() for name, style in LAYER_PLAN.items()})
    head = model.get_output_embeddings()
    parallelize_module(head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))


def is_sharded(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def gather_for_call(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded DTensor, for one call, with a gradient that flows
    back to the shard summed over ranks (reduce-scatter). A plain tensor is returned as is."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if not isinstance(t, DTensor):
        return t
    full = t.redistribute(placements=[Replicate()] * t.device_mesh.ndim)
    return full.to_local(grad_placements=[Partial()] * t.device_mesh.ndim)


def lm_head_for_call(model: Any) -> tuple:
    """(weight [V, D], bias [V] or None) of the output projection, whole: gathered by FSDP
    after a BASE_FORWARD call, or with gather_for_call outside that window. With
    tensor parallelism (tp_size > 1), after a BASE_FORWARD call: this rank's vocabulary
    rows as they are, a DTensor Shard(0) on the tensor-parallel mesh (FSDP2 gathered the
    data-parallel shards only), which linear_token_logprobs takes without gathering it."""
    head = model.get_output_embeddings()
    bias = getattr(head, "bias", None)
    if tp_size() > 1:
        return head.weight, bias
    return gather_for_call(head.weight), None if bias is None else gather_for_call(bias)


def clip_grad_norm(params: List[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ on the model's parameters; returns the total norm (a
    plain tensor). With tensor parallelism the parameters are DTensors on two meshes (the
    projections on the 2-D mesh, the rest on the data-parallel one), which torch's cannot
    stack: each mesh's gradients' norm is made whole, then the total of them all, then the clip."""
    from torch.distributed.tensor import DTensor

    params = list(params)
    if tp_size() == 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm  # FSDP2: a DTensor
    grads = [p.grad for p in params if p.grad is not None]
    by_mesh: Dict[Any, List[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.tensor(0.0)
    coef = min(1.0, max_norm / (float(total) + 1e-6))  # clip_grad_norm_'s coefficient
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total


# ---------------------------------------------------------------------- checkpoints


def full_state_dict(model: Any) -> Dict[str, torch.Tensor]:
    """The whole (unsharded, fp32, CPU) state dict on rank 0 and {} on the others (a
    collective: every rank calls it). A one-process model's own state dict otherwise."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with _quiet_gathers():
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class _SequentialGathers(logging.Filter):
    """Drops DTensor's warning that a tensor sharded over both mesh dimensions (FSDP2's
    _StridedShard over "dp", the tensor-parallel Shard(0) over "tp": not in ascending order,
    so not mergeable) is gathered by 2 sequential all_gathers, "which may give inconsistent
    results between ranks due to different reduction orders": a gather adds nothing, so its
    result is the same bits on every rank whatever the order (docs/distributed.md)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential all_gather operations" not in record.getMessage()


@contextlib.contextmanager
def _quiet_gathers() -> Iterator[None]:
    log, quiet = logging.getLogger("torch.distributed.tensor._redistribute"), _SequentialGathers()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def save_optimizer(model: Any, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Every rank writes its shard of the optimizer state into directory `path`
    (torch.distributed.checkpoint; a collective). Resumes on the same world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=path)


def load_optimizer(model: Any, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Load what save_optimizer wrote into `optimizer` (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    # get_optimizer_state_dict builds the state to load into only when no parameter holds a gradient
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        state = get_optimizer_state_dict(model, optimizer)
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(model, optimizer, state)
    finally:
        for p, g in zip(params, grads):
            p.grad = g
