"""Data parallelism over the mesh's "dp_replicate" and "dp_shard" dimensions.

FSDP2 (`fully_shard`) on the embedding, every Transformer block and the output head, then on the root (final norm):
sharding each part, not only the root as the course did, lets FSDP free one part's gathered weights and gradients
before the next needs memory (the embedding and head hold most of a small model's parameters). Under expert
parallelism a mixture's experts are a unit of their own, over the ranks that hold the same experts
(scalelm.parallel.expert). On a 2D (dp_replicate, dp_shard) mesh the same call is HSDP: shards within a node,
replicas across nodes.
Precision is FSDP's MixedPrecisionPolicy (bf16 compute, fp32 gradient reduction), so no autocast on top of it; one
process with train.precision=bf16_params shards over a mesh of one rank for that policy alone (parallel.runtime).

DDP (a full replica per rank, gradients all-reduced during backward) serves replication alone; beside tensor
parallelism, replication goes through FSDP's HSDP path with shards of one rank, which composes with DTensor weights.
"""

from __future__ import annotations

import inspect
import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from scalelm.model.moe import mixtures

# The head's logits are a view of a matmul result; scalelm never modifies them in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reshard_after_forward: bool,
    cpu_offload: bool,
    expert_mesh: DeviceMesh | None = None,
    data_parallel_ranks: int = 1,
) -> nn.Module:
    """FSDP (HSDP on a 2D mesh) over each block, the embedding, the head and the rest; under expert parallelism a
    mixture's experts first, over `expert_mesh`, their gradients divided by all `data_parallel_ranks`."""
    options = {
        "mesh": dp_mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    # tied weights stay together, in the root; a pipeline stage holds the embedding, the head or neither
    tied = model.embed is not None and model.head is not None and model.head.weight is model.embed.weight
    if model.embed is not None and not tied:
        fully_shard(model.embed, **options)
    if model.head is not None and not tied:
        # the head's backward follows its forward at once: no point in freeing its gathered weights in between
        fully_shard(model.head, **{**options, "reshard_after_forward": False})
    for block in model.blocks.values():
        if expert_mesh is not None:
            for moe in mixtures(block).values():
                shard_experts(moe.experts, {**options, "mesh": expert_mesh}, data_parallel_ranks)
        fully_shard(block, **options)
    return fully_shard(model, **options)


def shard_experts(experts: nn.Module, options: dict, data_parallel_ranks: int) -> None:
    """FSDP over a rank's experts (DTensors on the ep mesh) with `options`' mesh: the ranks holding the same experts,
    whose gradients already sum the tokens of their ep group, so FSDP divides them by every data-parallel rank
    (torchtitan's factor), not by its own ranks only. Over several ranks the reduction is a plain sum and that
    division (gloo has no pre-multiplied sum, NCCL's PreMulSum): one path on every backend. (Over one rank torch
    divides in its copy, and a forced sum would divide twice.)"""
    fully_shard(experts, **options)
    experts.set_gradient_divide_factor(data_parallel_ranks)
    if options["mesh"].size(-1) > 1:
        experts.set_force_sum_reduction_for_comms(True)


def materialise(model: nn.Module, device: torch.device, cpu_offload: bool) -> None:
    """Storage for a model built on the meta device, on `device`; with FSDP's CPU offload the parameters on the host
    (FSDP copies each to the device when it gathers it, and refuses to start otherwise) and the buffers, which it
    leaves alone, on the device. A parameter that several modules share (model.tie_weights) stays one: to_empty gives
    each module a new parameter of its own where it cannot fill the old one in place (a meta tensor's)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, name))
    model.to_empty(device="cpu" if cpu_offload else device)
    for (owner, name), *others in (places for places in holders.values() if len(places) > 1):
        for module, other in others:
            setattr(module, other, getattr(owner, name))
    if cpu_offload:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))


def no_buffer_sync_per_forward() -> dict[str, bool]:
    """DDP's option against broadcasting the buffers before every forward, under the name this torch reads: torch 2.13
    deprecates `broadcast_buffers` (a FutureWarning on every run) for `forward_sync_buffers`. The new option still
    broadcasts the buffers once, with the weights at construction: here only the positional table, which every rank
    has computed alike (init_buffers), so its values do not change."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


# DDP's options wherever scalelm wraps a model in DDP (here, and Lightning's DDP strategy). Gradients are views into
# DDP's all-reduce buckets instead of copies beside them: one model's worth of memory less per rank. The only buffer,
# the positional table, is the same computed constant on every rank: no broadcast before each forward (the
# communication profile showed one in every step).
DDP_OPTIONS = {"gradient_as_bucket_view": True, **no_buffer_sync_per_forward()}


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, device: torch.device) -> nn.Module:
    device_ids = [device.index] if device.type == "cuda" else None
    # DDP broadcasts rank 0's weights at construction: every rank already holds them
    return DistributedDataParallel(model, device_ids=device_ids, process_group=dp_mesh.get_group(), **DDP_OPTIONS)
