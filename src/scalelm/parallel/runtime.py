"""The hooks through which the trainer uses a layout (`Parallel`), and the build of a model on it.

    parallel = Parallel.start(config, env, vocab_size)    # the layout resolved and checked, the meshes built
    model = parallel.build(lambda: TransformerLM(config.model, vocab_size), config.seed, ModelOptions.of(config.train))

`build` makes the model on the meta device, applies tensor parallelism, then FSDP/HSDP, materialises only this
rank's part, and fills it with exactly the weights a single process would have made from the seed (rank 0 builds
them once on the CPU and each rank receives its own shards), so no rank but the first ever holds the whole model
and every layout starts from the same point. With pipeline stages it builds this rank's stages only, each
parallelized the same way, and returns them as one module (pipeline.StageParts). The trainer then sees the model
and a handful of hooks of `Parallel` (forward_backward, no_sync, clip_grad_norm, ...), and never a strategy's name:
a pipeline differs only inside `forward_backward` and `forward`, where its schedule (the `pipeline` of the
StageParts that `build` returned) runs the micro-batches. `Parallel` holds the layout, its named meshes, the
parallel options and the resolved precision; building a model changes the model, never `Parallel`. What is applied
to the blocks besides the layout (activation checkpointing, compilation) is the model's `ModelOptions`, passed to
`build`.

The numerics (precision, TF32, the attention kernels' order, autocast) are scalelm.parallel.numerics' policy, which
`forward_context` enters. One single-GPU lever of docs/benchmarks.md lives here: `train.precision: bf16_params` on
one process builds a mesh of one rank so that FSDP's policy casts the parameters to bf16 (every activation bf16, fp32
master weights).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from scalelm.config import Config, ParallelConfig, TrainConfig
from scalelm.errors import ConfigError
from scalelm.model.dtensors import local_shard
from scalelm.model.loss import weighted
from scalelm.parallel.activation_checkpoint import apply_activation_checkpointing
from scalelm.parallel.compile import apply_compile, check_c_compiler
from scalelm.parallel.context import SequenceSplit, apply_cp
from scalelm.parallel.data import apply_ddp, apply_fsdp, materialise
from scalelm.parallel.dims import MESH_DIMS, ParallelDims
from scalelm.parallel.env import DistEnv, all_gather_object, backend_for
from scalelm.parallel.expert import apply_ep
from scalelm.parallel.hostmemory import keep_freed_memory, reuse_threshold
from scalelm.parallel.layout import Layout, fsdp_of_one, resolve_layout
from scalelm.parallel.numerics import Numerics, check_attention_lengths
from scalelm.parallel.pipeline import Pipeline, StageParts, stage_part
from scalelm.parallel.tensor import apply_tp, keep_embedding_gradient_split


def start_group_of_one(device: torch.device, options: ParallelConfig) -> None:
    """The process group of a single process (a store in memory), for a mesh of one rank; torchrun started none."""
    if not dist.is_initialized():
        backend = backend_for(device, options.cpu_offload)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


@dataclass(frozen=True)
class ModelOptions:
    """What `build` applies to each block besides the layout, in this order, before FSDP or DDP wraps it: activation
    checkpointing (train.activation_checkpointing) and compilation (train.compile, train.compile_mode); and the path
    of the head's loss (train.fused_loss)."""

    activation_checkpointing: str = "none"
    compile: bool = False
    compile_mode: str = "default"
    fused_loss: str = "auto"

    @classmethod
    def of(cls, train: TrainConfig) -> ModelOptions:
        return cls(train.activation_checkpointing, train.compile, train.compile_mode, train.fused_loss)

    def apply(self, model: nn.Module, device: torch.device) -> None:
        if model.head is not None:  # (a pipeline stage before the last has none)
            model.head.fused_loss = self.fused_loss
        apply_activation_checkpointing(model, self.activation_checkpointing)
        if self.compile:
            apply_compile(model, device, self.compile_mode)


@dataclass(frozen=True)
class Meshes:
    """The named sub-meshes of a layout, cut from the world mesh once (torchtitan's ParallelDims does the same):
    `dp` the data-parallel ranks (replicas x shards, flattened), `fsdp` what FSDP shards over (dp_shard, with the
    context-parallel ranks, which hold the same parameters, flattened in) and replicates over (dp_replicate, for
    HSDP), `replicate` DDP's replicas, the `tp`, `pp` and `cp` groups, and expert parallelism's: `ep` and
    `expert_dp`, cut from the same world mesh with dp_shard unflattened into (efsdp, ep) (ParallelDims' grouping,
    EXPERT_MESH_DIMS)."""

    dp: DeviceMesh
    fsdp: DeviceMesh
    replicate: DeviceMesh
    tp: DeviceMesh
    pp: DeviceMesh
    cp: DeviceMesh
    ep: DeviceMesh | None = None  # ep consecutive ranks of dp_shard, sharing out the experts; None without ep
    expert_dp: DeviceMesh | None = None  # (dp_replicate,) efsdp: the ranks holding the same experts, for FSDP

    @classmethod
    def of(cls, world: DeviceMesh, dims: ParallelDims) -> Meshes:
        # torch has no public way to flatten mesh dimensions that keeps the root mesh FSDP needs to combine its mesh
        # with tensor parallelism's (it asserts a common parent), hence DeviceMesh._flatten, as torchtitan uses it
        shard = world["dp_shard", "cp"]._flatten("dp_shard_cp") if dims.cp > 1 else world["dp_shard"]
        if dims.dp_replicate > 1 and dims.cp > 1 and hasattr(DeviceMesh, "_concatenate"):
            # replicas joined to the flattened dimension: torch warns on slicing a flattened one out of the world mesh
            fsdp = DeviceMesh._concatenate([world["dp_replicate"], shard])
        else:
            fsdp = world["dp_replicate", shard.mesh_dim_names[0]] if dims.dp_replicate > 1 else shard
        experts = {}
        if dims.ep > 1:
            split = world._unflatten("dp_shard", (dims.expert_shards, dims.ep), ("efsdp", "ep"))
            replicas = ("dp_replicate",) if dims.dp_replicate > 1 else ()
            experts = {"ep": split["ep"], "expert_dp": split[(*replicas, "efsdp")]}
        return cls(
            dp=world["dp_replicate", "dp_shard"]._flatten("dp"),
            fsdp=fsdp,
            replicate=world["dp_replicate"],
            tp=world["tp"],
            pp=world["pp"],
            cp=world["cp"],
            **experts,
        )


class Parallel:
    """This rank's place in the layout, and the hooks through which the trainer uses it."""

    def __init__(
        self,
        env: DistEnv,
        layout: Layout,
        meshes: Meshes | None,
        hosts: list[tuple[str, int]],
        options: ParallelConfig,
        train: TrainConfig,
        numerics: Numerics,
    ):
        self.env, self.layout, self.meshes, self.hosts, self.options = env, layout, meshes, hosts, options
        dims = self.dims = layout.dims
        self.numerics = numerics  # Numerics.of(train, env.device): made once, in `start`
        self.uses_fsdp = dims.sharded or fsdp_of_one(train.precision, env.world_size)
        self.uses_ddp = dims.dp_replicate > 1 and not dims.sharded
        self.loss_parallel = dims.tp > 1 and options.loss_parallel
        self.dp_rank = dims.dp_rank(env.rank)
        self.dp_group = meshes.dp.get_group() if meshes is not None else None
        self.pp_group = meshes.pp.get_group() if dims.pp > 1 else None
        self.sequence_split = SequenceSplit(meshes.cp.get_group(), options.cp_load_balance) if dims.cp > 1 else None

    @classmethod
    def start(cls, config: Config, env: DistEnv, vocab_size: int) -> Parallel:
        """Resolve the layout for this world (a clear error if the config cannot run on it) and build the mesh."""
        layout = resolve_layout(config, env.world_size, env.procs_per_node, vocab_size)
        dims = layout.dims
        numerics = Numerics.of(config.train, env.device)  # bf16 on a CPU refused here, before any group starts
        check_on_device(config, env.device)
        one = fsdp_of_one(config.train.precision, env.world_size)
        if one:
            start_group_of_one(env.device, config.parallel)
        hosts = all_gather_object((env.hostname, env.node_rank))  # every rank's host and torchrun node
        check_groups_within_nodes(dims, hosts)
        meshes = None
        if env.world_size > 1 or one:
            world = init_device_mesh(
                env.device.type, tuple(getattr(dims, d) for d in MESH_DIMS), mesh_dim_names=MESH_DIMS
            )
            meshes = Meshes.of(world, dims)
        return cls(env, layout, meshes, hosts, config.parallel, config.train, numerics)

    @property
    def name(self) -> str:
        return self.dims.name

    @property
    def precision(self) -> str:
        return self.numerics.precision

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.numerics.compute_dtype

    def describe(self, model: nn.Module) -> dict:
        """The layout as run.json records it: degrees, the ranks of each tensor- and data-parallel group, the node
        (torchrun's node rank) of every rank, and a pipeline's schedule."""
        pipeline = pipeline_of(model)
        return {
            "name": self.name,
            "layout": self.dims.layout,
            **self.dims.to_dict(),
            "groups": {dim: self.dims.groups(dim) for dim in self.described_groups},
            "node_of_rank": [node for _, node in self.hosts],
            **({"pipeline": pipeline.describe()} if pipeline else {}),
        }

    @property
    def described_groups(self) -> tuple[str, ...]:
        """The groups run.json lists: expert parallelism's only where it has some (older records read alike)."""
        return ("tp", "dp", "pp", "cp", "ep") if self.dims.ep > 1 else ("tp", "dp", "pp", "cp")

    @property
    def loss_ranks(self) -> int:
        """The ranks that compute the loss (a pipeline's last stage): what the logged loss is averaged over."""
        return self.env.world_size // self.dims.pp

    # ------------------------------------------------------------------------------------------ the model
    def build(
        self,
        make: Callable[[], nn.Module],
        seed: int,
        model_options: ModelOptions = ModelOptions(),
        replicate: bool = True,
    ) -> nn.Module:
        """The model of `make()` with its seed's initial weights, parallelized, with `model_options` applied; this rank
        holds only its part. `replicate`: False leaves DDP's wrapper to the caller (Lightning's strategy adds its
        own)."""
        options, device = self.options, self.env.device
        if device.type == "cpu":
            keep_freed_memory(reuse_threshold(options.host_reuse_below_mb, self.uses_fsdp))
        if self.meshes is None:
            torch.manual_seed(seed)
            model = make().to(device)
            model_options.apply(model, device)
            return model
        initial = {}
        if self.env.is_main:  # the one full copy, on the CPU, from the seed: what a single process starts from
            torch.manual_seed(seed)
            initial = make().state_dict()
        stage_ids = self.stage_ids()
        with torch.device("meta"):
            if stage_ids:
                layers, last = self.layout.stage_blocks(len(make().blocks)), self.layout.num_stages - 1
                parts = [stage_part(make(), layers[s], s == 0, s == last) for s in stage_ids]
            else:
                parts = [make()]
        parts = [self.parallelize(part, model_options) for part in parts]
        for part in parts:
            materialise(part, device, self.uses_fsdp and options.cpu_offload)
            part.init_buffers()
            if self.dims.tp > 1 and not self.uses_fsdp:
                keep_embedding_gradient_split(part)
        model = StageParts(parts) if stage_ids else parts[0]
        # rank 0 sends every tensor; each rank keeps those of its own stages (hence not strict with a pipeline)
        from_rank0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not stage_ids)
        set_model_state_dict(model, initial, options=from_rank0)
        del initial
        if stage_ids:
            model.pipeline = Pipeline(parts, stage_ids, self.layout, self.pp_group, device)
        if self.uses_ddp and replicate:
            model = apply_ddp(model, self.meshes.replicate, device)
        return model

    def stage_ids(self) -> list[int]:
        """The pipeline stages of this rank, in order (none without a pipeline)."""
        return self.layout.stages_of(self.dims.coordinates(self.env.rank)["pp"]) if self.dims.pp > 1 else []

    def parallelize(self, model: nn.Module, model_options: ModelOptions) -> nn.Module:
        """Tensor and context parallelism, the `model_options`, then FSDP/HSDP, on a model (or pipeline stage) still on
        the meta device."""
        options, device = self.options, self.env.device
        if self.dims.tp > 1:
            apply_tp(model, self.meshes.tp, self.loss_parallel, options.sequence_parallel)
        if self.sequence_split is not None:
            apply_cp(model, self.sequence_split, self.dims.coordinates(self.env.rank)["tp"], self.dims.tp)
        meshes = self.meshes
        if meshes.ep is not None:
            apply_ep(model, meshes.ep)
        model_options.apply(model, device)
        if self.uses_fsdp:
            # one rank frees nothing by resharding: it would only copy the weights again for the backward
            reshard = options.reshards(self.dims.pp) if self.env.world_size > 1 else bool(options.reshard_after_forward)
            model = apply_fsdp(
                model,
                meshes.fsdp,
                self.compute_dtype,
                reshard,
                options.cpu_offload,
                expert_mesh=meshes.expert_dp,
                data_parallel_ranks=self.dims.dp_size,
            )
        return model

    # ----------------------------------------------------------------------------------- the step's hooks
    def forward_backward(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, scale: float, step: int
    ) -> torch.Tensor:
        """Forward and backward of one batch for optimizer step `step`, its loss weighted by `scale`; returns that
        weighted mean loss (zero on pipeline ranks without the last stage)."""
        inputs, targets = self.sequence_part(inputs), self.sequence_part(targets)
        pipeline = pipeline_of(model)
        with weighted(scale):  # the weight of the model's auxiliary losses too (scalelm.model.loss)
            if pipeline is not None:
                with self.forward_context():  # the schedule runs the forwards (and backwards) inside
                    return pipeline.step(inputs, targets, scale, step)
            with self.forward_context():
                # the model's mean cross-entropy (in fp32), fused with the output projection on CPU
                loss = model(inputs, targets) * scale
            loss.backward()
        return loss.detach()

    def forward(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor | None:
        """Logits of this rank's part of each sequence (`sequence_part`) for evaluation, on the ranks that compute the
        loss (None on a pipeline's other stages)."""
        inputs = self.sequence_part(inputs)
        with self.forward_context():
            pipeline = pipeline_of(model)
            return pipeline.forward(inputs) if pipeline is not None else model(inputs)

    def sequence_part(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's part of each sequence of a (batch, seq) batch: all of it, but under context parallelism."""
        return tokens if self.sequence_split is None else self.sequence_split.shard(tokens, dim=1)

    def sum_over_data(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the data-parallel ranks (in place): what each of them counted of its own batch."""
        if self.dp_group is not None:
            dist.all_reduce(tensor, group=self.dp_group)

    def reduce_eval(self, totals: torch.Tensor) -> None:
        """Sum evaluation totals over the data-parallel ranks, the parts of a sequence (context parallelism), and from
        a pipeline's last stage to all."""
        cp_group = self.sequence_split.group if self.sequence_split is not None else None
        for group in (self.dp_group, cp_group, self.pp_group):
            if group is not None:
                dist.all_reduce(totals, group=group)

    def no_sync(self, model: nn.Module) -> ContextManager:
        """Context for micro-batches whose gradients are accumulated locally, without communication."""
        if pipeline_of(model) is not None:  # the schedule switches FSDP's gradient reduction itself
            return contextlib.nullcontext()
        if self.uses_ddp:
            return model.no_sync()
        if self.uses_fsdp:
            return _fsdp_no_sync(model)
        return contextlib.nullcontext()

    def forward_context(self) -> contextlib.ExitStack:
        """Around forward passes: mixed precision (`autocast`) and the attention kernels' order (`attention`)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.autocast())
        stack.enter_context(self.attention())
        return stack

    def attention(self) -> ContextManager:
        return self.numerics.attention()

    def autocast(self) -> ContextManager:
        return self.numerics.autocast(self.env.device, cast_by_fsdp=self.uses_fsdp)

    def loss_context(self) -> ContextManager:
        """Around forward and backward: the vocabulary-parallel cross-entropy, where the layout has one."""
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float | None) -> torch.Tensor:
        """The global gradient norm (over all ranks and shards), clipping to max_norm when given.

        Parameters live on different meshes (TP weights on (dp, tp), the rest on dp alone; plain tensors without
        a mesh), so each group's norm is taken on its own and the groups are combined."""
        params = [p for p in model.parameters() if p.grad is not None]
        groups: dict[object, list[torch.Tensor]] = {}
        for p in params:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
        norms = []
        for group in groups.values():
            norm = torch.nn.utils.get_total_norm([p.grad for p in group])
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), device=self.env.device)
        if self.pp_group is not None:  # each stage holds other parameters: their squares add up
            total = total.float() ** 2
            dist.all_reduce(total, group=self.pp_group)
            total = total.sqrt()
        if max_norm:
            for group in groups.values():
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
        return total

    def state_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes of this rank's own parameters, gradients and optimizer state: what sharding divides."""

        def size(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in map(local_shard, tensors))

        params = list({id(p): p for p in model.parameters()}.values())
        states = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()]
        return {
            "params": size(params),
            "grads": size(p.grad for p in params if p.grad is not None),
            "optimizer": size(states),
        }


def pipeline_of(model: nn.Module) -> Pipeline | None:
    """The schedule of a rank's pipeline stages (built with them); None for a model without a pipeline."""
    return model.pipeline if isinstance(model, StageParts) else None


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def check_on_device(config: Config, device: torch.device) -> None:
    """What only the device decides, refused before the run directory is touched (and, in one process, before a
    process group is started) besides its precision (Numerics.of): FSDP's CPU offload without a GPU, cuDNN's attention
    forced first on sequence lengths its version mishandles, compilation (of the blocks or the optimizer's step) on
    CUDA without a C compiler."""
    if config.parallel.cpu_offload and device.type != "cuda":
        raise ConfigError(
            "parallel.cpu_offload moves FSDP's parameters from GPU to CPU memory and needs CUDA; this run's device is "
            f"{device.type}: set parallel.cpu_offload=false"
        )
    check_attention_lengths(config, device)
    compiled = tuple(f"train.{key}" for key in ("compile", "compile_optimizer") if getattr(config.train, key))
    if compiled and device.type == "cuda":
        check_c_compiler(compiled)


def check_groups_within_nodes(dims: ParallelDims, hosts: list[tuple[str, int]]) -> None:
    """Every tensor-parallel group on one node: its ranks share the host name and torchrun's node rank."""
    for group in dims.groups("tp"):
        seen = {hosts[rank] for rank in group}
        if len(seen) > 1:
            where = ", ".join(f"rank {r} on {hosts[r][0]} (node {hosts[r][1]})" for r in group)
            raise ConfigError(
                f"tensor-parallel group {group} spans nodes ({where}); tp must stay within a node: start the "
                "processes of a node with consecutive ranks (torchrun does) and choose tp dividing them"
            )
