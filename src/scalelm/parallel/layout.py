"""A layout: the parallel degrees (dims.py) with the pipeline's options, and whether a training config can run on it.

`resolve_layout` is what every caller uses: the trainer (`Parallel.start`, for its world), the workflow (each
experiment on its nodes, before any job is queued) and the planner (each candidate on a machine) resolve the
degrees and call the one `check_layout`, so a new option is checked in one place. Torch-free, like dims.py: the
workflow's parse, the planner and the launcher read layouts without importing torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scalelm.config import Config, ModelConfig, ParallelConfig, refusals
from scalelm.errors import ConfigError
from scalelm.parallel.dims import ParallelDims, degrees_of, resolve_dims


@dataclass(frozen=True)
class Layout:
    dims: ParallelDims
    schedule: str = "1f1b"  # the pipeline's schedule (no meaning without a pipeline)
    microbatches: int = 1  # the pieces a pipeline cuts each forward/backward's batch into; 1 without one
    virtual_stages: int = 1  # pipeline stages per rank (the interleaved schedule); 1 without a pipeline

    @classmethod
    def of(cls, dims: ParallelDims, options: ParallelConfig) -> Layout:
        if dims.pp == 1:
            return cls(dims)
        return cls(dims, options.pp_schedule, options.pp_microbatches or 2 * dims.pp, options.pp_virtual_stages)

    @property
    def num_stages(self) -> int:
        return self.dims.pp * self.virtual_stages

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages of pipeline rank `pp_rank`: itself, + pp, ... (the interleaved schedule's loop)."""
        return list(range(pp_rank, self.num_stages, self.dims.pp))

    def stage_blocks(self, n_layers: int) -> list[range]:
        """The blocks of each stage (one stage of every block without a pipeline)."""
        return stage_blocks(n_layers, self.num_stages)

    @property
    def predicted_bubble(self) -> float:
        return predicted_bubble(self.schedule, self.dims.pp, self.microbatches, self.virtual_stages)


def resolve_layout(config: Config, world_size: int, procs_per_node: int, vocab_size: int | None = None) -> Layout:
    """The config's layout on `world_size` ranks in nodes of `procs_per_node`, checked (`check_layout`)."""
    options = config.parallel
    dims = resolve_dims(options.strategy, degrees_of(config), world_size, procs_per_node, options.ep)
    layout = Layout.of(dims, config.parallel)
    check_layout(config, layout, vocab_size)
    return layout


def check_layout(config: Config, layout: Layout, vocab_size: int | None = None) -> None:
    """Whether `config` can run on `layout`: a ConfigError names the value and what to change. The vocabulary is
    checked where it is known (None: not yet)."""
    dims, options = layout.dims, config.parallel
    check_tp(dims.tp, config.model, vocab_size, options.loss_parallel, config.data.seq_len, options.sequence_parallel)
    check_pipeline(dims.pp, options, config.model)
    check_cp(dims, options, config.data.seq_len)
    check_experts(config, dims)
    check_engine(config, dims)
    check_bf16_params(config.train.precision, dims)
    check_cpu_offload(config, dims)
    _, per_replica = config.batch.sizes(dims.dp_size)
    if dims.pp > 1:
        check_microbatches(layout.microbatches, per_replica)


def check_tp(
    tp: int,
    model: ModelConfig,
    vocab_size: int | None,
    loss_parallel: bool,
    seq_len: int | None = None,
    sequence_parallel: bool = False,
) -> None:
    """The sizes a TP degree must divide."""
    if tp == 1:
        return
    for name, value in (("model.n_heads", model.n_heads), ("model.d_ff", model.d_ff)):
        if value % tp:
            raise ConfigError(f"{name}={value} is not divisible by parallel.tp={tp}; each TP rank needs an equal share")
    if model.kv_heads % tp:  # (llama's grouped-query attention: a rank holds whole groups of query heads)
        raise ConfigError(
            f"model.n_kv_heads={model.kv_heads} is not divisible by parallel.tp={tp}: each TP rank holds whole "
            "key/value heads with their query heads; choose a tp dividing n_kv_heads, or more key/value heads"
        )
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise ConfigError(
            f"parallel.sequence_parallel splits sequences of data.seq_len={seq_len} tokens across parallel.tp={tp} "
            "ranks, which does not divide it; choose a multiple of tp or switch sequence_parallel off"
        )
    if loss_parallel and vocab_size is not None and vocab_size % tp:
        raise ConfigError(
            f"parallel.loss_parallel splits the vocabulary of {vocab_size} words across parallel.tp={tp} ranks, "
            "which does not divide it; switch loss_parallel off or choose another tp"
        )


def check_experts(config: Config, dims: ParallelDims) -> None:
    """A mixture of experts (model.moe) and expert parallelism (parallel.ep) against the layout."""
    moe = config.model.moe
    if dims.ep > 1 and moe is None:
        raise ConfigError(
            f"parallel.ep={dims.ep} splits a mixture's experts over ranks, and this model has none: set model.moe "
            "(e.g. {experts: 4, top_k: 2}), or leave parallel.ep unset"
        )
    if moe is None:
        return
    if moe.experts % dims.ep:
        raise ConfigError(
            f"model.moe.experts={moe.experts} is not divisible by parallel.ep={dims.ep}: every expert-parallel rank "
            "holds an equal share of the experts; choose a multiple of ep experts, or another ep"
        )
    if dims.cp > 1:
        raise ConfigError(
            f"model.moe balances its experts' load per sequence, and parallel.cp={dims.cp} splits every sequence "
            "across ranks: leave parallel.cp unset for a mixture of experts, or drop model.moe"
        )


def check_bf16_params(precision: str, dims: ParallelDims) -> None:
    """train.precision=bf16_params casts the parameters through FSDP's policy: one process (a mesh of one rank,
    scalelm.parallel.runtime) or an FSDP layout."""
    if precision == "bf16_params" and dims.world_size > 1 and not dims.sharded:
        raise ConfigError(
            f"train.precision=bf16_params casts the parameters through FSDP's policy, and the {dims.name} layout "
            f"({dims.layout}) has no FSDP: use train.precision=bf16 there, or shard (parallel.dp_shard)"
        )


def fsdp_of_one(precision: str, world_size: int) -> bool:
    """train.precision=bf16_params in one process: FSDP on a mesh of one rank, whose policy casts the parameters."""
    return precision == "bf16_params" and world_size == 1


def check_cpu_offload(config: Config, dims: ParallelDims) -> None:
    """parallel.cpu_offload keeps FSDP's parameters in host memory: a layout with FSDP (or one process casting its
    parameters through FSDP's policy, train.precision=bf16_params); elsewhere it would be silently ignored."""
    if config.parallel.cpu_offload and not (dims.sharded or fsdp_of_one(config.train.precision, dims.world_size)):
        raise ConfigError(
            f"parallel.cpu_offload moves FSDP's parameters to host memory, and the {dims.name} layout ({dims.layout}) "
            "has no FSDP: shard (parallel.dp_shard), or set parallel.cpu_offload=false"
        )


def check_engine(config: Config, dims: ParallelDims) -> None:
    """train.engine=lightning runs Lightning's DDP strategy: data parallelism by replicas only, a dense model, and
    none of the settings whose field says Lightning refuses them (scalelm.config.refusals); all named at once."""
    if config.train.engine != "lightning":
        return
    refused = [
        f"train.engine=lightning runs DDP only, not {dims.name} ({degree} {getattr(dims, degree)}): use "
        "parallel.strategy=ddp (data parallelism is parallel.dp_replicate), or train.engine=scalelm for this layout"
        for degree in ("dp_shard", "tp", "pp", "cp")
        if getattr(dims, degree) > 1
    ][:1]
    if config.model.moe is not None:
        refused.append(
            "model.moe is scalelm's engine only (its load-balancing loss and load measurements are not wired into "
            "Lightning's strategy); set train.engine=scalelm, or drop model.moe"
        )
    refused += refusals(config, "lightning")
    if len(refused) == 1:
        raise ConfigError(refused[0])
    if refused:
        listed = "; ".join(f"({i}) {why}" for i, why in enumerate(refused, 1))
        raise ConfigError(f"train.engine=lightning refuses {len(refused)} things in these settings: {listed}")


def check_cp(dims: ParallelDims, options: ParallelConfig, seq_len: int) -> None:
    """The sequence a context-parallel group splits, each rank's part split again by sequence parallelism."""
    if dims.cp == 1:
        return
    sequence_chunk(seq_len, dims.cp, options.cp_load_balance)
    if options.sequence_parallel and dims.tp > 1 and (seq_len // dims.cp) % dims.tp:
        raise ConfigError(
            f"parallel.sequence_parallel splits each context-parallel rank's {seq_len // dims.cp} tokens (data.seq_len="
            f"{seq_len} / parallel.cp={dims.cp}) across parallel.tp={dims.tp} ranks, which does not divide them; "
            "choose another seq_len or switch sequence_parallel off"
        )


def sequence_unit(dims: ParallelDims, options: ParallelConfig) -> int:
    """What every sequence length of a layout must be a multiple of: the context-parallel split's chunks, and tensor
    parallelism's share of each rank's part under sequence parallelism."""
    unit = sequence_pieces(dims.cp, options.cp_load_balance) if dims.cp > 1 else 1
    if options.sequence_parallel and dims.tp > 1:
        unit = math.lcm(unit, dims.cp * dims.tp)
    return unit


def sequence_pieces(cp: int, load_balance: bool) -> int:
    """The chunks a sequence is cut into for `cp` ranks: one each, or two each with load balancing."""
    return 2 * cp if load_balance else cp


def sequence_chunk(seq_len: int, cp: int, load_balance: bool) -> int:
    """The length of one chunk of a sequence split over `cp` ranks: a rank holds one (contiguous), or two with load
    balancing (chunks r and 2 cp - 1 - r of 2 cp, which evens out the causal mask's work)."""
    if cp < 1:
        raise ConfigError(f"parallel.cp must be a positive integer, got {cp}")
    pieces = sequence_pieces(cp, load_balance)
    if seq_len % pieces:
        if load_balance:
            why = f"2 x parallel.cp = {pieces} (context parallelism with load balancing cuts each sequence into 2 x cp "
            why += "chunks)"
        else:
            why = f"parallel.cp = {pieces} (context parallelism gives each rank an equal part of each sequence)"
        raise ConfigError(
            f"data.seq_len={seq_len} is not divisible by {why}; choose a sequence length that is a multiple of {pieces}"
        )
    return seq_len // pieces


def check_pipeline(pp: int, options: ParallelConfig, model: ModelConfig) -> None:
    """The pipeline's schedule, virtual stages and blocks against its degree."""
    virtual = options.pp_virtual_stages
    if pp == 1:
        return
    if options.pp_schedule == "interleaved_1f1b" and virtual < 2:
        raise ConfigError(
            f"parallel.pp_schedule=interleaved_1f1b runs several stages per rank, but parallel.pp_virtual_stages="
            f"{virtual}; set it to 2 or more, or use pp_schedule 1f1b or gpipe"
        )
    if options.pp_schedule != "interleaved_1f1b" and virtual > 1:
        raise ConfigError(
            f"parallel.pp_virtual_stages={virtual} needs parallel.pp_schedule=interleaved_1f1b "
            f"({options.pp_schedule} runs one stage per rank); set pp_virtual_stages to 1 or change the schedule"
        )
    stages = pp * virtual
    if model.n_layers < stages:
        raise ConfigError(
            f"model.n_layers={model.n_layers} blocks cannot fill {stages} pipeline stages (parallel.pp={pp} x "
            f"pp_virtual_stages={virtual}); every stage needs a block: lower pp or pp_virtual_stages, or add layers"
        )
    if model.tie_weights:
        raise ConfigError(
            "model.tie_weights shares the embedding of the first pipeline stage with the output projection of the "
            f"last, which parallel.pp={pp} places on different ranks; set model.tie_weights=false or parallel.pp=1"
        )


def check_microbatches(count: int, batch: int) -> None:
    """The micro-batches of a pipeline step must cut each replica's batch (of one accumulation step) evenly."""
    if batch % count:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        raise ConfigError(
            f"parallel.pp_microbatches={count} does not divide the batch of {batch} sequences that each replica "
            f"pipelines per step (batch.size, or batch.micro_size with accumulation); choose one of {divisors}"
        )


def stage_blocks(n_layers: int, stages: int) -> list[range]:
    """The blocks of each stage: consecutive, as even as possible, earlier stages one more where needed."""
    base, extra = divmod(n_layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def predicted_bubble(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """The idle share of a step the schedule implies with equal stages and free communication: (pp - 1) slots of
    fill and drain among the m (GPipe, 1F1B) or m x v (interleaved, each slot 1/v as long) slots of work."""
    work = microbatches * (virtual if schedule == "interleaved_1f1b" else 1)
    return (pp - 1) / (work + pp - 1)
