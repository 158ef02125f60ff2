"""How long a step of a layout should take on a machine, from what the machine's baseline measured
(scalelm.measure.baseline) or what the user says it delivers: the step-time model of docs/plan.md.

    step = (matrix products + attention + elementwise work) / efficiency + fixed cost + exposed communication
           + drift + bubble

- matrix products: the rank's training FLOPs per step (6 per weight and token, 8 with full activation
  checkpointing; the output layer's whether tied to the embedding or not; the busiest pipeline stage's; tensor
  parallelism's share; a mixture's router and the top_k experts a token goes through, which under expert parallelism
  a rank computes for as many rows as its tokens choose, with uniform routing) over the baseline's rate at the model's
  own product shapes;
- attention: where the speeds name a fused attention kernel's rate (the catalogue's: a share of the peak from flash
  attention's published figures), its causal kernel's FLOPs as the flash-attention benchmark counts them (7 s d per
  token and block: 2 forward, 5 backward; the forward again with full checkpointing) at that rate; else among the
  products, 12 s d per token and block, as MFU counts it;
- elementwise work: the bytes the step's memory-bound work moves over the bandwidth the baseline measured for an
  elementwise operation at the size of the logits. Where a measured model step calibrates the efficiency (a
  baseline's; every CPU plan), 3 passes over what the memory plan says a block keeps, 4 over the fp32 logits of the
  loss and AdamW's 28 bytes per parameter the rank updates: the count that efficiency was measured against. Where
  nothing calibrates it (a catalogue's GPU, speeds typed on the command line) and the step runs on GPUs, op by op
  (scalelm.plan.elementwise): what each kernel of the eager step reads and writes (norms, casts, residual adds,
  activations, biases' gradients, the loss's log-softmax over the fp32 logits, autocast's weight casts), or each
  region Inductor fuses under train.compile, and AdamW's and the gradient norm's passes as the trainer runs them;
- fixed cost: what a pass of the model costs whatever its tokens (dispatching its operations), from the baseline's
  model step timed at two token counts, per micro-batch pass (a stage's share of it in a pipeline);
- a layout's overheads, per micro-batch pass as the fixed cost: what the baseline's model step cost more with the
  layout's machinery run in one process (scalelm.measure.baseline.layout_overheads): tensor parallelism's DTensor
  dispatch, a context-parallel rank's ring of blocks in place of one attention kernel (its steps, and so its
  overhead, grow with cp: the baseline's ring has RING_RANKS), expert parallelism's dispatch of a mixture's rows,
  FSDP's units (hooks, DTensors, the gathered weights' copies in and out) wherever parameters are sharded;
- efficiency: the share of the rest of the model's own training step, timed alone on one device by the baseline,
  that the products and bytes explain (cold caches, the softmax's transcendental work), for every layout alike;
- communication: each collective of the plan (scalelm.plan.comm) at its message size, over the bus bandwidth the
  baseline measured for that operation, link and size (interpolated between the sizes it measured). On a GPU,
  collectives run on their own stream and hide behind the pass they overlap (DDP's buckets and FSDP's
  reduce-scatter and backward gathers behind the backward, two thirds of the compute; FSDP's prefetched gathers
  behind the forward) except for one message that nothing covers; tensor parallelism's all-reduces, the
  pipeline's transfers and expert parallelism's all-to-alls are waited for (on a CPU, all of them: its host's).
  An all-to-all is priced at the baseline's all-to-all figures where it measured them, else at its all-gather's
  (nccl-tests define both bus bandwidths alike: (n - 1)/n of a rank's buffer leaves it); `all_to_all_s` is its
  share of the step;
- the bubble: the busiest pipeline rank waits while the others fill the pipeline and drain it, one micro-batch slot
  of each (with equal stages the schedule's share, scalelm.parallel.layout.predicted_bubble).

What a CPU host whose cores the ranks share adds (its per-rank speedup, collectives that cannot hide and wait for a
core, the ranks' drift apart) is scalelm.plan.host's, applied where the formula says; a GPU's plan has none of it. The
machine's figures come from its baseline's record (scalelm.plan.machine) or from its user (`Speeds.given`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple

from scalelm.errors import ConfigError
from scalelm.model.architecture import is_moe_block
from scalelm.parallel.dims import ParallelDims
from scalelm.parallel.layout import fsdp_of_one
from scalelm.plan.comm import INTER, INTRA, Traffic, traffic
from scalelm.plan.elementwise import (
    ADAMW_BYTES,
    block_bytes,
    edge_bytes,
    forward_share,
    loss_bytes,
    optimizer_bytes_per_parameter,
    weight_pass_bytes,
)
from scalelm.plan.host import HostContention, collective_crowding, crowding, rank_speedup
from scalelm.plan.machine import MachineBaseline
from scalelm.plan.memory import Workload, block_indices, blocks_bytes_per_token, gathered, held, rank_tensors

ACTIVATION_PASSES = 3  # written in the forward, read in the backward, a gradient of the same size written
LOGIT_PASSES = 4  # the loss's softmax reads the logits and writes its output; the backward reads it, writes the grad
BACKWARD_SHARE = 2 / 3  # of a step's compute: the backward does twice the forward's products
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all")
STAND_IN = {"all_to_all": "all_gather"}  # an op the baseline did not time: the one whose bus bandwidth is alike
RING_RANKS = 2  # the context-parallel ring whose overhead the baseline measures (measure.baseline.layout_overheads)
DRIFT = "waiting for the last rank at each collective"  # the step's collectives' wait beyond their own latency
# what a hand-typed speed (`Speeds.given`) may be, in its unit (TFLOP/s, GB/s), per GPU: wider than any device's
# (an H200's 990 dense bf16 TFLOP/s and 4,800 GB/s, NVLink's 900 GB/s) and any laptop core's, so that a value outside
# is a typo or a unit off by a thousand or more; within it every step time is a finite, positive number of seconds
SPEED_RANGE = (1e-3, 1e6)


@dataclass(frozen=True)
class Speeds:
    """What one rank of the machine delivers."""

    matmul_tflops: float  # the model's matrix products in the training dtype
    elementwise_gbps: float  # bytes read and written per second by an elementwise operation at the logits' size
    busbw_gbps: dict[str, dict[str, list[tuple[int, float]]]]  # link -> op -> [(message bytes, bus GB/s)], ascending
    threads: int | None = None  # CPU: the threads the rates were measured with; None on GPUs
    cpus: int | None = None  # CPU: the cores of a host
    model_step: tuple[int, float] | None = None  # (tokens, seconds) of the model's own step alone on one device
    model_vocab: int | None = None  # the vocabulary of that step's model, where the baseline says (else the study's)
    small_step: tuple[int, float] | None = None  # the same for fewer tokens: the step's fixed cost
    host_speedup: float | None = None  # CPU: a machine's throughput with every rank at work over one rank's alone
    thread_speedup: float | None = None  # CPU: one process's with every core as a thread over one rank's alone
    # what a pass of the model costs more with a layout's machinery: tp, cp (a RING_RANKS-way ring), ep, fsdp
    layout_overhead_s: dict[str, float] = field(default_factory=dict)
    # CPU: a small collective's seconds inside a step on a host its ranks do not crowd (else None: the curves alone)
    in_step_latency_s: float | None = None
    # CPU: how long ranks wait for one another at a step's collectives, as a share of their compute (else None)
    drift_share: float | None = None
    source: str = ""
    # a fused causal attention kernel's TFLOP/s as it counts its work (stage_work's by_operation); None: the products'
    attention_tflops: float | None = None

    def __post_init__(self) -> None:
        for name in ("matmul_tflops", "elementwise_gbps"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"the machine's {name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_baseline(cls, baseline: MachineBaseline, source: str = "", at: str = "median") -> Speeds:
        """A baseline's slowest rank's rates and its collectives: those over the whole job carry inter-node
        traffic where the baseline spanned nodes (intra-node otherwise), those within a node intra-node. `at`: the
        median of its repetitions, or the fast or slow end of their spread (ENDS; a baseline of an older scalelm has
        no spread: its medians). A CPU's waits were measured with the baseline's ranks at work: as on a host they do
        not crowd."""
        step = baseline.model_step
        # a catalogue's record has no model step: its rates are the achievable ones (efficiency 1, no fixed cost)
        if baseline.elementwise_gbps is None or (step is None and not baseline.modelled):
            named = f" {source}" if source else ""
            raise ConfigError(
                f"the machine baseline{named} lacks the step-time model's figures (made by an older "
                "scalelm): rerun the workflow's machine_baseline"
            )
        curves: dict[str, dict[str, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
        for row in baseline.collectives:
            link = INTRA if row.scope == "node" or baseline.nodes == 1 else INTER
            curves[link][row.op].append((row.bytes, row.busbw_gbps.at(at)))
        cpu, first, waits = baseline.on_cpu, baseline.per_rank[0], baseline.waits
        crowded = crowding(first.threads, step.ranks_per_host, first.cpus) if cpu and waits else 1.0
        return cls(
            matmul_tflops=baseline.matmul_tflops,
            elementwise_gbps=baseline.elementwise_gbps,
            busbw_gbps={link: {op: sorted(points) for op, points in ops.items()} for link, ops in curves.items()},
            threads=first.threads if cpu else None,
            cpus=first.cpus if cpu else None,
            model_step=(step.tokens, step.seconds.at(at)) if step else None,
            model_vocab=step.vocab_size if step else None,
            small_step=(step.small_tokens, step.small_seconds.at(at)) if step and step.small_seconds else None,
            host_speedup=step.host_speedup.at(at) if cpu and step and step.host_speedup else None,
            thread_speedup=step.thread_speedup if cpu and step else None,
            layout_overhead_s={name: figure.at(at) for name, figure in step.layout_overhead_s.items()} if step else {},
            in_step_latency_s=waits.in_step_latency_s.at(at) / crowded if cpu and waits else None,
            drift_share=waits.drift_share.at(at) / crowded if cpu and waits else None,
            attention_tflops=baseline.attention_tflops,
            source=source
            or baseline.modelled
            or f"baseline of {baseline.world_size} process(es) on {', '.join(baseline.hosts)}",
        )

    @classmethod
    def given(
        cls, matmul_tflops: float, elementwise_gbps: float, intra_gbps: float, inter_gbps: float | None
    ) -> Speeds:
        """A machine not yet measured, as its user knows it: one bus bandwidth per link for every operation."""
        given = {
            "matmul_tflops": matmul_tflops,
            "elementwise_gbps": elementwise_gbps,
            "busbw_intra_gbps": intra_gbps,
            "busbw_inter_gbps": inter_gbps,
        }
        for name, value in given.items():
            if value is not None:
                check_given_speed(name, value)
        curves = {INTRA: {op: [(1, intra_gbps)] for op in OPS}}
        if inter_gbps:
            curves[INTER] = {op: [(1, inter_gbps)] for op in OPS}
        return cls(matmul_tflops, elementwise_gbps, curves, source="the command line")

    def bus_gbps(self, link: str, op: str, size: int) -> float:
        """The bus bandwidth of `op` on `link` for a message of `size` bytes: interpolated in log-log between
        the measured sizes; below the smallest the time stays the smallest's (latency), above the largest the
        bandwidth stays the largest's. A link the baseline did not measure takes the other's figures, an op it did not
        time its STAND_IN's, else all_reduce's."""
        curves = self.busbw_gbps.get(link) or self.busbw_gbps.get(INTER if link == INTRA else INTRA)
        if not curves:
            raise ConfigError(f"the machine's {self.source} has no collectives: time it with more than one process")
        points = (
            curves.get(op)
            or curves.get(STAND_IN.get(op, op))
            or curves.get("all_reduce")
            or next(iter(curves.values()))
        )
        (small, small_bw), (large, large_bw) = points[0], points[-1]
        if size <= small:
            return small_bw * size / small
        if size >= large:
            return large_bw
        for (a, bw_a), (b, bw_b) in zip(points, points[1:]):
            if a <= size <= b:
                share = math.log(size / a) / math.log(b / a)
                return math.exp(math.log(bw_a) + share * (math.log(bw_b) - math.log(bw_a)))
        return large_bw  # not reached: the sizes are ascending

    @property
    def calibrated(self) -> bool:
        """Whether a measured model step calibrates these speeds' efficiency (a baseline's), or nothing does (the
        catalogue's, the command line's): then a GPU's step is counted op by op (stage_work's by_operation)."""
        return self.model_step is not None

    @property
    def on_cpu(self) -> bool:
        """Whether these are a CPU's speeds (per thread, the cores shared with gloo's collectives)."""
        return self.threads is not None

    def crowding(self, threads: int | None, ranks_on_host: int) -> float:
        """scalelm.plan.host.collective_crowding of these speeds."""
        return collective_crowding(self, threads, ranks_on_host)

    def per_rank(self, threads: int | None, ranks_on_host: int) -> float:
        """scalelm.plan.host.rank_speedup of these speeds."""
        return rank_speedup(self, threads, ranks_on_host)


def check_given_speed(name: str, value: float) -> None:
    """A hand-typed speed within SPEED_RANGE, else refused naming its flag (--matmul-tflops for matmul_tflops)."""
    low, high = SPEED_RANGE
    if not low <= value <= high:
        unit = "TFLOP/s" if name.endswith("tflops") else "GB/s"
        raise ConfigError(
            f"the machine's {name} must be positive, from {low:g} to {high:,.0f} {unit} per GPU "
            f"(--{name.replace('_', '-')}), got {value}"
        )


@dataclass
class StepTime:
    """The predicted seconds of one optimizer step by part, on the busiest rank."""

    matmul_s: float
    elementwise_s: float
    efficiency: float = 1.0  # the share of the model's own step that its products and bytes explain (divided in)
    fixed_s: float = 0.0  # what its passes cost whatever their tokens (dispatch)
    overhead_s: dict[str, float] = field(default_factory=dict)  # the layout's machinery's, by degree (tp, cp, ep)
    communication_s: dict[str, float] = field(default_factory=dict)  # exposed seconds by collective
    bubble_s: float = 0.0
    all_to_all_s: float = 0.0  # expert parallelism's all-to-alls among communication_s
    attention_s: float = 0.0  # the attention kernels', where priced apart from the products (stage_work)

    @property
    def compute_s(self) -> float:
        return self.matmul_s + self.attention_s + self.elementwise_s + self.fixed_s + sum(self.overhead_s.values())

    @property
    def total_s(self) -> float:
        return self.compute_s + sum(self.communication_s.values()) + self.bubble_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "compute_s": self.compute_s, "total_s": self.total_s}


class StageWork(NamedTuple):
    """What one pipeline rank computes and moves in a step."""

    flops: float  # its matrix products' (and, counted the legacy way, attention's QK^T and AV at their rate)
    attention_flops: float  # its attention kernels', as they run them (0 where counted among the products)
    moved: float  # the bytes its memory-bound work reads and writes


def stage_work(work: Workload, dims: ParallelDims, by_operation: bool = False) -> list[StageWork]:
    """Each pipeline rank's work per step (the one rank's without a pipeline). `by_operation` (a GPU's speeds that
    nothing measured calibrates): attention as its causal kernel computes it, at its own rate, and the elementwise
    bytes counted op by op (scalelm.plan.elementwise); else attention among the products as MFU counts it (12 s d per
    token and block) and the elementwise bytes as passes over what a block keeps, which a baseline's efficiency was
    calibrated against."""
    config, model = work.config, work.config.model
    d, s, vocab = model.d_model, config.data.seq_len, work.vocab_size
    global_batch, micro = config.batch.sizes(dims.dp_size)
    tokens = global_batch // dims.dp_size * s // dims.cp  # every micro-batch of the step on this rank
    passes = max(1, global_batch // dims.dp_size // micro) * work.layout(dims).microbatches
    recompute = {"full": 8 / 6, "selective": 1.0}.get(work.checkpointing, 1.0)  # full: the forward twice
    vocab_share = dims.tp if config.parallel.loss_parallel else 1
    stages = []
    for tensors in rank_tensors(work, dims):
        blocks = block_indices(tensors)
        last = any(t.unit == "root" for t in tensors)  # the final norm: the head's stage
        matrices = [t for t in tensors if t.unit.startswith("blocks.") and len(t.shape) == 2 and not t.expert]
        block_weights = sum(t.numel(dims.tp) for t in matrices)
        head = vocab // vocab_share * d if last else 0  # the output layer's products, tied to the embedding or not
        flops = tokens * (6 * (block_weights + active_expert_weights(work, tensors)) * recompute + 6 * head)
        if by_operation:
            attention = tokens * len(blocks) * attention_kernel_flops(work, dims)
            products = [t for t in tensors if len(t.shape) > 1 and t.unit not in ("embed", "head")]
            weights = sum(gathered(t, dims) for t in products) + head  # the weights the rank's products take
            moved = operation_bytes(work, dims, tensors, tokens, passes, weights)
        else:
            attention = 0.0
            flops += tokens * 12 * len(blocks) * s * d / dims.tp * recompute  # QK^T and AV, every rank's keys
            moved = ACTIVATION_PASSES * tokens * sum(blocks_bytes_per_token(work, dims, blocks))
            moved += LOGIT_PASSES * tokens * 4 * vocab / vocab_share if last else 0
            moved += ADAMW_BYTES["fused"] * sum(held(t, dims) for t in tensors)
        stages.append(StageWork(flops, attention, moved))
    return stages


def attention_kernel_flops(work: Workload, dims: ParallelDims) -> float:
    """FLOPs per token and block of a causal fused attention kernel (flash attention's, cuDNN's), as the
    flash-attention benchmark counts them: forward 4 s d per sequence's token halved by the mask (2 s d), backward 2.5
    times the forward (it computes QK^T again), and the forward again under full activation checkpointing; over tp,
    whose ranks hold a share of the heads."""
    s, d = work.config.data.seq_len, work.config.model.d_model
    forward, backward = 2 * s * d, 5 * s * d
    recomputed = forward if work.checkpointing == "full" else 0
    return (forward + backward + recomputed) / dims.tp


def operation_bytes(
    work: Workload, dims: ParallelDims, tensors: list, tokens: int, passes: int, weights: float
) -> float:
    """A rank's bytes per step counted op by op (scalelm.plan.elementwise): its blocks' (their forward again under
    activation checkpointing), the embedding's and final norm's, the loss's on the last stage, `weights`' casts over
    `passes` micro-batches and the optimizer's pass over the state the rank holds."""
    compiled, model = work.config.train.compile, work.config.model
    blocks = block_indices(tensors)
    first, last = any(t.unit == "embed" for t in tensors), any(t.unit == "root" for t in tensors)
    checkpointed = work.checkpointing in ("full", "selective")
    per_token = 0.0
    for mixture in (False, True):
        count = sum(is_moe_block(model, i) == mixture for i in blocks)
        if count:
            again = forward_share(work, dims, mixture, compiled) if checkpointed else 0.0
            per_token += count * (block_bytes(work, dims, mixture, compiled) + again)
    per_token += edge_bytes(work, dims, first, last, compiled)
    moved = tokens * per_token + (loss_bytes(work, dims, tokens, compiled) if last else 0.0)
    state = sum(held(t, dims) for t in tensors)
    moved += weight_pass_bytes(work, dims, passes, weights, state)
    return moved + optimizer_bytes_per_parameter(work) * state


def active_expert_weights(work: Workload, tensors: list) -> int:
    """The experts' matrix weights among `tensors` that one token goes through: top_k of each mixture's."""
    moe = work.config.model.moe
    if moe is None:
        return 0
    return sum(t.numel() // moe.experts * moe.top_k for t in tensors if t.expert and len(t.shape) == 3)


def flow_seconds(flow: Traffic, speeds: Speeds, host: HostContention) -> float:
    """A flow's seconds per step: its bytes over the bus bandwidth at its message size, with what its messages wait
    on the host beyond the curve's latency (`HostContention.latency`), as much longer as the host's ranks crowd it."""
    wire = flow.bytes / (speeds.bus_gbps(flow.link, flow.op, flow.message_bytes) * 1e9)
    return (wire + host.latency(flow, speeds)) * host.collective_factor


def exposed(flows: list[Traffic], speeds: Speeds, compute_s: float, host: HostContention) -> dict[str, float]:
    """Each collective's seconds that the step waits for: all of them where nothing hides (`host.overlaps`: not on a
    CPU); on a GPU a pass's collectives beyond what its compute covers, and at least one message of each."""
    seconds = {f.collective: flow_seconds(f, speeds, host) for f in flows}
    if not host.overlaps:
        return seconds
    window = {"forward": compute_s * (1 - BACKWARD_SHARE), "backward": compute_s * BACKWARD_SHARE}
    out = {}
    for phase in (None, "forward", "backward"):
        group = [f for f in flows if f.overlaps == phase]
        total = sum(seconds[f.collective] for f in group)
        left = total if phase is None else max(total - window[phase], 0.0)
        for f in group:  # the uncovered rest shared out by size; one message never hides
            share = seconds[f.collective] / total if total else 0.0
            out[f.collective] = max(left * share, seconds[f.collective] / f.messages if phase else 0.0)
    return out


def fixed_cost(speeds: Speeds) -> float:
    """Seconds a forward and backward pass of the model costs whatever its tokens (dispatching its operations, the
    optimizer's loop over tensors): where a line through the baseline's two timed steps meets no tokens; 0 without
    them, or where the line says less."""
    if not (speeds.model_step and speeds.small_step):
        return 0.0
    (tokens, seconds), (few, few_seconds) = speeds.model_step, speeds.small_step
    per_token = (seconds - few_seconds) / (tokens - few)
    return max(0.0, seconds - per_token * tokens)


def efficiency(work: Workload, speeds: Speeds) -> float:
    """The matrix products' and elementwise bytes' time of the model's own step on one device over the time the
    baseline measured for it less the fixed cost (1 without that measurement): what cold caches and the softmax's
    transcendental work add, as a share, for every layout alike. The step's model has the baseline's vocabulary (a
    baseline made before the data was prepared timed WikiText-2's: its output layer is another size)."""
    if not speeds.model_step:
        return 1.0
    tokens, seconds = speeds.model_step
    config = work.config
    alone = replace(config.batch, mode="global", size=max(1, tokens // config.data.seq_len), micro_size=None)
    reference = replace(
        work,
        config=replace(config, batch=alone),
        vocab_size=speeds.model_vocab or work.vocab_size,
        activation_checkpointing="none",
    )
    ((flops, _, moved),) = stage_work(reference, ParallelDims())
    ideal = flops / (speeds.matmul_tflops * 1e12) + moved / (speeds.elementwise_gbps * 1e9)
    return ideal / max(seconds - fixed_cost(speeds), 1e-9)


def predict(
    work: Workload,
    dims: ParallelDims,
    gpus_per_node: int,
    speeds: Speeds,
    threads: int | None = None,
    ranks_on_host: int | None = None,
) -> StepTime:
    """The step time of `dims` on nodes of `gpus_per_node` ranks. On a CPU, `threads` per rank and `ranks_on_host`
    (default: the launcher's share of the host's cores for a node's ranks, which share one host)."""
    host = HostContention.of(speeds, threads, ranks_on_host or gpus_per_node)
    share = host.speedup
    faster = share * efficiency(work, speeds)
    layout = work.layout(dims)
    global_batch, micro = work.config.batch.sizes(dims.dp_size)
    passes = max(1, global_batch // dims.dp_size // micro) * layout.microbatches  # forward and backward, each
    fixed = fixed_cost(speeds) * passes / share / dims.pp  # a pipeline rank dispatches its stages' share of each
    by_operation = not speeds.calibrated and work.device == "cuda"
    attention_tflops = speeds.attention_tflops or speeds.matmul_tflops
    stages = [
        (
            flops / (speeds.matmul_tflops * 1e12 * faster),
            moved / (speeds.elementwise_gbps * 1e9 * faster),
            attention / (attention_tflops * 1e12 * faster),
        )
        for flops, attention, moved in stage_work(work, dims, by_operation)
    ]
    busiest = max(range(len(stages)), key=lambda rank: sum(stages[rank]))
    used = {
        "tp": dims.tp > 1,
        "cp": dims.cp / RING_RANKS if dims.cp > 1 else 0,
        "ep": dims.ep > 1,
        "fsdp": dims.sharded or fsdp_of_one(work.config.train.precision, dims.world_size),
    }
    overhead = {  # per operation, as the fixed cost
        name: seconds * used[name] * passes / share / dims.pp
        for name, seconds in speeds.layout_overhead_s.items()
        if used.get(name)
    }
    matmul_s, elementwise_s, attention_s = stages[busiest]
    step = StepTime(
        matmul_s,
        elementwise_s,
        efficiency=efficiency(work, speeds),
        fixed_s=fixed,
        overhead_s=overhead,
        attention_s=attention_s,
    )
    flows = traffic(work, dims, gpus_per_node)
    step.communication_s = exposed(flows, speeds, step.compute_s, host)
    drift = host.drift(step.compute_s)
    if drift and step.communication_s:  # ranks that drift apart between collectives wait for the last at each
        step.communication_s[DRIFT] = drift
    step.all_to_all_s = sum(step.communication_s[f.collective] for f in flows if f.op == "all_to_all")
    if dims.pp > 1:
        # the busiest rank waits while the others fill the pipeline and drain it: one micro-batch slot of each
        # (1/v of one under the interleaved schedule); with equal stages, predicted_bubble's share of the step
        slots = layout.microbatches * (layout.virtual_stages if layout.schedule == "interleaved_1f1b" else 1)
        step.bubble_s = sum(sum(stages[rank]) + fixed for rank in range(len(stages)) if rank != busiest) / slots
    return step
