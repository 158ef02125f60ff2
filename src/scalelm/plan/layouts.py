"""The layouts a machine can hold, each planned (memory and communication), and the one to choose.

The candidates are the course's ladder on the whole machine: single (one GPU), DDP, FSDP with and without
reshard after forward, HSDP (shards within a node, replicas across nodes), TP (one node), PP, FSDP x TP (TP inside
each node), 3D (pipeline across nodes, TP inside, FSDP between), CP (every sequence split over a node's GPUs,
FSDP over all) and, for a mixture of experts only, EP (the experts split over as many of a node's GPUs as divide
them, FSDP over all for the rest); plus the layout the config itself sets, if any.
Without the machine's speeds, the recommendation follows the lectures' "deciding on a parallelism strategy": the
least parallelism that fits; with them (a baseline: scalelm.plan.steptime), the layout that fits, uses the whole
machine and should train the most tokens per second.
A model and batch that fit one GPU are replicated (DDP: one all-reduce per step, the least traffic); one that does
not is sharded, HSDP first where there are several nodes (only its shards' all-reduce crosses nodes), then FSDP over
every GPU; then tensor parallelism inside the node, then the pipeline across nodes, and last context parallelism,
which divides the activations of long sequences that nothing else does. A mixture of experts that does not fit one
GPU tries expert parallelism first where its all-to-alls send fewer bytes than FSDP, which gathers every expert.
Where nothing fits, the plan names the smallest machine of the same nodes on which something would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from scalelm.errors import ConfigError
from scalelm.parallel.dims import ParallelDims, degrees_of, resolve_dims
from scalelm.parallel.layout import Layout, check_layout
from scalelm.plan.comm import Traffic, totals, traffic
from scalelm.plan.memory import MemoryPlan, Workload, plan_memory
from scalelm.plan.steptime import Speeds, StepTime, predict

LADDER = ("single", "ddp", "fsdp_no_reshard", "fsdp", "hsdp", "tp", "pp", "fsdp_tp", "3d", "cp", "ep")
GB = 1e9
LARGEST_MACHINE_NODES = 4096  # how far the search for a machine that would hold the model goes
# the largest machine planned: beyond the largest built (about 200,000 GPUs), and planned in seconds (each layout's
# traffic is worked out group by group of ranks); a node is one host, with up to 16 GPUs (or, planning for CPUs, a
# process per core at most)
MAX_GPUS = 2**18
MAX_GPUS_PER_NODE = 1024


@dataclass(frozen=True)
class Machine:
    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float
    headroom: float = 0.1  # the share of a GPU's memory left to the CUDA context and the allocator's caching

    def __post_init__(self) -> None:
        for flag, value in (("--nodes", self.nodes), ("--gpus-per-node", self.gpus_per_node)):
            if value < 1:
                raise ConfigError(f"the machine's {flag[2:]} must be at least 1 ({flag}), got {value}")
        if self.gpus_per_node > MAX_GPUS_PER_NODE:
            raise ConfigError(
                f"--gpus-per-node {self.gpus_per_node:,} is not one node's: a node (one host) holds at most "
                f"{MAX_GPUS_PER_NODE:,} GPUs or processes here; give one node's count, and the nodes as --nodes"
            )
        if self.gpus > MAX_GPUS:
            raise ConfigError(
                f"the machine's {self.nodes:,} nodes x {self.gpus_per_node:,} GPUs = {self.gpus:,} GPUs (--nodes x "
                f"--gpus-per-node) exceed the {MAX_GPUS:,} the planner plans for (more than the largest machines "
                "built); give the machine the job runs on"
            )
        if self.gpu_memory_gb <= 0:
            raise ConfigError(f"--gpu-memory-gb must be one GPU's memory in GB (positive), got {self.gpu_memory_gb}")
        if not 0 <= self.headroom < 1:
            raise ConfigError(f"--headroom must be a share of a GPU's memory in [0, 1), got {self.headroom}")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_bytes(self) -> float:
        return self.gpu_memory_gb * GB * (1 - self.headroom)

    def describe(self) -> str:
        return f"{self.nodes} node(s) x {self.gpus_per_node} GPU(s) of {self.gpu_memory_gb:g} GB"


@dataclass
class LayoutPlan:
    name: str  # a LADDER entry, or "configured"
    dims: ParallelDims
    strategy: str | None  # the shorthand that gives these degrees on the machine, where one does
    options: dict  # parallel.* settings the layout changes (reshard_after_forward)
    memory: MemoryPlan
    flows: list[Traffic]
    fits: bool
    recommended: bool = False
    reason: str = ""
    step: StepTime | None = None  # with the machine's speeds
    tokens_per_step: int = 0

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens_per_step / self.step.total_s if self.step else None

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "strategy": self.strategy,
            "degrees": self.dims.to_dict(),
            "layout": self.dims.layout,
            "gpus": self.dims.world_size,
            "options": self.options,
            **self.memory.to_dict(),
            "fits": self.fits,
            "communication": [flow.to_dict() for flow in self.flows],
            "communication_bytes": totals(self.flows),
            "recommended": self.recommended,
            "reason": self.reason,
            **({"step_time": self.step.to_dict(), "tokens_per_s": self.tokens_per_s} if self.step else {}),
        }


@dataclass
class Candidate:
    name: str
    dims: ParallelDims
    strategy: str | None
    options: dict = field(default_factory=dict)


def candidates(machine: Machine, experts: int | None = None) -> list[Candidate]:
    """The ladder's layouts on `machine` (those that need more GPUs or nodes than it has are left out); `experts`: a
    mixture's, for which the ladder has expert parallelism (None: a dense model, which has none)."""
    n, g = machine.gpus, machine.gpus_per_node
    out = [Candidate("single", ParallelDims(), "single")]
    if n > 1:
        out += [
            Candidate("ddp", ParallelDims(dp_replicate=n), "ddp"),
            Candidate("fsdp_no_reshard", ParallelDims(dp_shard=n), "fsdp", {"reshard_after_forward": False}),
            Candidate("fsdp", ParallelDims(dp_shard=n), "fsdp"),
            Candidate("pp", ParallelDims(pp=n), "pp"),
        ]
    if machine.nodes > 1 and g > 1:
        out.append(Candidate("hsdp", ParallelDims(dp_replicate=machine.nodes, dp_shard=g), "hsdp"))
    if g > 1:
        out.append(Candidate("tp", ParallelDims(tp=g), None if machine.nodes > 1 else "tp"))
    if machine.nodes > 1 and g > 1:
        out.append(Candidate("fsdp_tp", ParallelDims(dp_shard=machine.nodes, tp=g), "fsdp_tp"))
    elif g >= 4:  # one node: TP over half of it, FSDP over the two halves
        out.append(Candidate("fsdp_tp", ParallelDims(dp_shard=2, tp=g // 2), None))
    three = three_d(machine)
    if three:
        out.append(Candidate("3d", three, None))
    if g > 1:  # every sequence split over a node's GPUs (the ring stays inside it), FSDP across the nodes
        out.append(Candidate("cp", ParallelDims(dp_shard=machine.nodes, cp=g), "cp" if machine.nodes == 1 else None))
    ep = expert_degree_within_node(machine, experts)
    if ep > 1:  # the all-to-alls stay inside a node; FSDP over every GPU
        out.append(Candidate("ep", ParallelDims(dp_shard=n, ep=ep), "ep" if ep == n else None))
    order = {name: i for i, name in enumerate(LADDER)}
    return sorted(out, key=lambda c: order[c.name])


def expert_degree_within_node(machine: Machine, experts: int | None) -> int:
    """The largest ep that divides both the experts and a node's GPUs (ep groups are consecutive ranks: each then
    stays inside a node); 1 for a dense model."""
    return math.gcd(experts, machine.gpus_per_node) if experts else 1


def three_d(machine: Machine) -> ParallelDims | None:
    """pp, dp_shard and tp all above 1: TP as wide as a node allows, the pipeline as short as possible."""
    for tp in sorted((t for t in range(2, machine.gpus_per_node + 1) if machine.gpus_per_node % t == 0), reverse=True):
        rest = machine.gpus // tp
        for pp in range(2, rest // 2 + 1):
            if rest % pp == 0:
                return ParallelDims(dp_shard=rest // pp, tp=tp, pp=pp)
    return None


def feasible(work: Workload, dims: ParallelDims) -> None:
    """What the trainer checks before it builds a model (`check_layout`): a ConfigError says why `dims` cannot run
    the workload."""
    check_layout(work.config, Layout.of(dims, work.config.parallel), work.vocab_size)


def plan_layout(work: Workload, candidate: Candidate, machine: Machine, speeds: Speeds | None = None) -> LayoutPlan:
    """One layout planned on `machine` (`feasible` first: this one assumes it runs), timed where `speeds` are known."""
    options = replace(work.config.parallel, **candidate.options)
    work = replace(work, config=replace(work.config, parallel=options))
    memory = plan_memory(work, candidate.dims)
    flows = traffic(work, candidate.dims, machine.gpus_per_node)
    fits = memory.total <= machine.usable_bytes
    step = predict(work, candidate.dims, machine.gpus_per_node, speeds) if speeds else None
    tokens = work.config.batch.sizes(candidate.dims.dp_size)[0] * work.config.data.seq_len
    return LayoutPlan(
        candidate.name,
        candidate.dims,
        candidate.strategy,
        candidate.options,
        memory,
        flows,
        fits,
        step=step,
        tokens_per_step=tokens,
    )


def configured(work: Workload, machine: Machine) -> Candidate | None:
    """The layout the config sets (strategy or degrees) on the whole machine, or None if it sets none."""
    config = work.config
    explicit = degrees_of(config)
    if config.parallel.strategy is None and config.parallel.ep is None and all(v is None for v in explicit.values()):
        return None
    try:
        dims = resolve_dims(config.parallel.strategy, explicit, machine.gpus, machine.gpus_per_node, config.parallel.ep)
    except ConfigError as err:
        raise ConfigError(f"the config's layout cannot run on {machine.describe()}: {err}") from None
    return Candidate("configured", dims, config.parallel.strategy)


def plan_machine(
    work: Workload, machine: Machine, speeds: Speeds | None = None
) -> tuple[list[LayoutPlan], list[tuple[str, str]]]:
    """Every candidate that can run, planned (and timed, with `speeds`), with the recommendation marked; and those
    that cannot, with why."""
    plans, impossible = [], []
    own = configured(work, machine)
    moe = work.config.model.moe
    for candidate in candidates(machine, moe.experts if moe else None) + ([own] if own else []):
        try:
            feasible(work, candidate.dims)
        except ConfigError as err:
            if candidate is own:
                where = f"{candidate.dims.layout} on {machine.describe()}"
                raise ConfigError(f"the config's layout {where}: {err}") from None
            impossible.append((candidate.name, str(err)))
            continue
        plans.append(plan_layout(work, candidate, machine, speeds))
    if speeds:
        recommend_fastest(plans, machine)
    else:
        recommend(plans, machine)
    return plans, impossible


def recommend_fastest(plans: list[LayoutPlan], machine: Machine) -> LayoutPlan | None:
    """Mark the layout that fits, uses the whole machine and should train the most tokens per second (not the
    shortest step: with a per-device batch the layouts' steps hold different numbers of tokens)."""
    whole = sorted(
        (plan for plan in plans if plan.fits and plan.dims.world_size == machine.gpus and plan.step),
        key=lambda plan: -plan.tokens_per_s,
    )
    if not whole:
        return None
    choice = whole[0]
    choice.recommended = True
    against = f"; {whole[1].name} {rate(whole[1].tokens_per_s)}" if len(whole) > 1 else ""
    choice.reason = (
        f"it fits and should train the most tokens per second on this machine "
        f"({rate(choice.tokens_per_s)}{against}; the step-time model of docs/plan.md)"
    )
    return choice


def recommend(plans: list[LayoutPlan], machine: Machine) -> LayoutPlan | None:
    """Mark the ladder's first layout that fits and uses the whole machine (single where it is one GPU)."""
    by_name = {plan.name: plan for plan in plans}
    single = by_name.get("single")
    if single and single.fits:
        choice = by_name.get("ddp") if machine.gpus > 1 else single
        if choice and choice.fits:
            choice.recommended = True
            choice.reason = (
                f"the model, its optimizer state and a micro-batch's activations fit one GPU "
                f"({gb(single.memory.total)} of {gb(machine.usable_bytes)} GB usable): "
                + (
                    "nothing to split"
                    if machine.gpus == 1
                    else "replicate it; DDP's one all-reduce of the gradients "
                    "per step is the least communication of any layout"
                )
            )
            return choice
    reasons = {
        "ep": "the experts split over a node's GPUs, each token sent to its experts' ranks and back (all-to-all), the "
        "dense parameters sharded over every GPU: fewer bytes a step than FSDP's gathers of every expert",
        "hsdp": "shards within each node, replicas across nodes: only the shards' all-reduce crosses the network",
        "fsdp_no_reshard": "sharded over every GPU, gathered weights kept from forward to backward (a third less "
        "all-gather traffic than fsdp)",
        "fsdp": "parameters, gradients and optimizer state sharded over every GPU",
        "fsdp_tp": "tensor parallelism inside each node divides the activations too; FSDP across nodes",
        "3d": "a pipeline across nodes, tensor parallelism inside them, FSDP between",
        "pp": "the blocks split into stages, one per GPU",
        "tp": "tensor parallelism across the node",
        "cp": "every sequence split over a node's GPUs (ring attention): each holds a share of every activation; "
        "FSDP over all of them",
    }
    for name in reasons:
        plan = by_name.get(name)
        if name == "ep" and plan and moves_more(plan, by_name.get("fsdp")):
            continue  # the routed rows outweigh the experts' weights: FSDP's gathers are the cheaper way
        if plan and plan.fits and plan.dims.world_size == machine.gpus:
            plan.recommended = True
            too_big = gb(single.memory.total) if single else "?"
            plan.reason = f"one GPU would need {too_big} GB ({gb(machine.usable_bytes)} usable): {reasons[name]}"
            return plan
    return None


def moves_more(plan: LayoutPlan, other: LayoutPlan | None) -> bool:
    """Whether `plan` sends more bytes a step than `other` (None: nothing to compare with, so no)."""
    return other is not None and sum(totals(plan.flows).values()) > sum(totals(other.flows).values())


def smallest_fsdp(work: Workload, machine: Machine) -> int | None:
    """The fewest GPUs (up to one node, then whole nodes) on which FSDP over all of them fits; None if none does."""

    def fits(count: int) -> bool:
        dims = ParallelDims(dp_shard=count)
        try:
            feasible(work, dims)
        except ConfigError:
            return False
        nodes, per_node = math.ceil(count / machine.gpus_per_node), min(count, machine.gpus_per_node)
        sized = replace(machine, nodes=nodes, gpus_per_node=per_node)
        return plan_layout(work, Candidate("fsdp", dims, "fsdp"), sized).fits

    g = machine.gpus_per_node
    return first_fitting([*range(1, g + 1), *range(2 * g, largest_nodes(g) * g + 1, g)], fits)


def smallest_machine(work: Workload, machine: Machine) -> tuple[int, LayoutPlan] | None:
    """The fewest nodes like `machine`'s on which some layout fits, and the one recommended there."""

    def chosen(nodes: int) -> LayoutPlan | None:
        plans, _ = plan_machine(work, replace(machine, nodes=nodes))
        return next((plan for plan in plans if plan.recommended), None)

    largest = largest_nodes(machine.gpus_per_node)
    nodes = first_fitting(list(range(machine.nodes + 1, largest + 1)), lambda n: chosen(n) is not None)
    return (nodes, chosen(nodes)) if nodes else None


def largest_nodes(gpus_per_node: int) -> int:
    """The most nodes of `gpus_per_node` the searches for a machine that would hold the model try: within MAX_GPUS."""
    return min(LARGEST_MACHINE_NODES, MAX_GPUS // gpus_per_node)


def first_fitting(sizes: list[int], fits) -> int | None:
    """The first of the ascending `sizes` for which `fits` holds, by bisection (more GPUs never need more memory
    each); None if even the last does not."""
    if not sizes or not fits(sizes[-1]):
        return None
    low, high = 0, len(sizes) - 1
    while low < high:
        middle = (low + high) // 2
        if fits(sizes[middle]):
            high = middle
        else:
            low = middle + 1
    return sizes[low]


def gb(value: float) -> str:
    return f"{value / GB:,.2f}"


def rate(tokens_per_s: float) -> str:
    """Tokens per second as the plan shows them: whole numbers, but two significant digits below 1 (never 0)."""
    return f"{tokens_per_s:,.0f}" if tokens_per_s >= 1 else f"{tokens_per_s:.2g}"
