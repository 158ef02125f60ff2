"""Parallel degrees: how the world's ranks divide into data-parallel replicas, shards and tensor-parallel groups.

A layout is five integers whose product is the world size (torchtitan's convention):

    dp_replicate  replicas that all-reduce gradients (DDP; the outer dimension of HSDP)
    dp_shard      ranks that shard parameters, gradients and optimizer state (FSDP; the inner dimension of HSDP)
    tp            ranks that split each matrix multiplication (Megatron-style tensor parallelism)
    pp            pipeline stages: successive groups of blocks, micro-batches handed from stage to stage
    cp            ranks that split every sequence, attention included (context parallelism: ring attention); they
                  share a batch, and FSDP shards the parameters over dp_shard x cp, which averages their gradients

Expert parallelism takes no ranks of its own: `ep` divides dp_shard, which the world mesh unflattens into
(efsdp, ep), ep innermost (torchtitan's dp_shard_in_ep x ep), so that a group of ep consecutive ranks holds a
mixture's experts once (scalelm.parallel.expert) and FSDP shards each rank's experts over `expert_dp`, the ranks at
the same place of the other groups (efsdp, and dp_replicate's replicas): EXPERT_MESH_DIMS. The layout shows it inside
dp_shard: 1x4[ep2]x1x1 is FSDP over 4 ranks, the experts split over pairs of them and sharded over the other pair.

At most one degree may be -1, "the rest of the world size". The strategy names of earlier configs are shorthands
that fill in the degrees a config does not set itself: `fsdp` with `tp: 2` on 4 ranks is dp_shard 2 x tp 2.

Ranks are laid out on the mesh (pp, dp_replicate, dp_shard, cp, tp), tp innermost: torchrun numbers a node's processes
consecutively, so a tensor-parallel group, which communicates in every layer, never leaves its node, a context-
parallel group (key/value blocks in every attention) stays as close as it can, and pipeline stages, which exchange
only activations at their boundary, are the ones spread over nodes.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass

from scalelm.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first
EXPERT_MESH_DIMS = ("pp", "dp_replicate", "efsdp", "ep", "cp", "tp")  # dp_shard unflattened into efsdp x ep
# the groups that span several dimensions of EXPERT_MESH_DIMS (any other name is one dimension's)
SPANS = {
    "dp_shard": ("efsdp", "ep"),
    "dp": ("dp_replicate", "efsdp", "ep"),  # every data-parallel rank
    "dp_shard_cp": ("efsdp", "ep", "cp"),  # what dense FSDP shards over
    "expert_dp": ("dp_replicate", "efsdp"),  # the ranks holding the same experts: what FSDP shards them over
}
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "cp")  # the order a layout is written in (cp only where > 1)
SHORTHANDS = ("single", "ddp", "fsdp", "hsdp", "tp", "fsdp_tp", "pp", "cp", "ep")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # a divisor of dp_shard: not a degree of the world's (module docstring)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each sees its own share of every global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_size(self) -> int:
        """The ranks FSDP shards each tensor over: dp_shard x cp (a context-parallel group holds one replica)."""
        return self.dp_shard * self.cp

    @property
    def sharded(self) -> bool:
        """FSDP applies: parameters are sharded (over dp_shard x cp), or replicated by FSDP's HSDP path beside TP or
        PP."""
        return self.shard_size > 1 or (self.dp_replicate > 1 and (self.tp > 1 or self.pp > 1))

    @property
    def layout(self) -> str:
        """dp_replicate x dp_shard x tp x pp, and x cp where cp > 1: e.g. 2x2x1x1 for HSDP on 2 nodes of 2, 1x2x1x1x2
        for FSDP 2 x CP 2 (the four-part form of the layouts without context parallelism is kept)."""
        written = {d: str(getattr(self, d)) for d in self.written_degrees}
        if self.ep > 1:
            written["dp_shard"] += f"[ep{self.ep}]"
        return "x".join(written.values())

    @property
    def written_degrees(self) -> tuple[str, ...]:
        return DEGREES if self.cp > 1 else DEGREES[:-1]

    @property
    def name(self) -> str:
        """A readable name of the layout: single, ddp, fsdp, hsdp, tp, fsdp_tp, pp, fsdp_pp, fsdp_tp_pp, cp, fsdp_cp_tp,
        ..."""
        if self.world_size == 1:
            return "single"
        data = {(False, False): "", (True, False): "ddp", (False, True): "fsdp", (True, True): "hsdp"}
        parts = [
            data[(self.dp_replicate > 1, self.dp_shard > 1)],
            "cp" if self.cp > 1 else "",
            "tp" if self.tp > 1 else "",
            "pp" if self.pp > 1 else "",
            "ep" if self.ep > 1 else "",
        ]
        return "_".join(p for p in parts if p)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @property
    def expert_shards(self) -> int:
        """The ranks FSDP shards a rank's experts over (efsdp: dp_shard / ep; the replicas hold copies of them)."""
        return self.dp_shard // self.ep

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension of MESH_DIMS and EXPERT_MESH_DIMS (row-major)."""
        coords = {}
        for dim in reversed(MESH_DIMS):
            size = getattr(self, dim)
            coords[dim] = rank % size
            rank //= size
        coords["efsdp"], coords["ep"] = divmod(coords["dp_shard"], self.ep)
        return coords

    def dp_rank(self, rank: int) -> int:
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def groups(self, dim: str) -> list[list[int]]:
        """The ranks of every group along `dim`, each in rank order: a dimension of EXPERT_MESH_DIMS (dp_shard's ep and
        efsdp included) or one of SPANS ("dp", FSDP's "dp_shard_cp", the experts' "expert_dp", ...)."""
        along = SPANS.get(dim, (dim,))
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coordinates(rank)
            groups.setdefault(tuple(c[d] for d in EXPERT_MESH_DIMS if d not in along), []).append(rank)
        return list(groups.values())


def degrees_of(config) -> dict[str, int | None]:
    """The degrees a training config (scalelm.config.Config) sets itself; None where it leaves them to the strategy."""
    return {name: getattr(config.parallel, name) for name in DEGREES}


def shorthand_degrees(strategy: str, nodes: int, procs_per_node: int) -> dict[str, int]:
    """The degrees a strategy name stands for, on `nodes` nodes of `procs_per_node` processes."""
    return {
        "single": {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, "cp": 1},
        "ddp": {"dp_replicate": -1},
        "fsdp": {"dp_shard": -1},
        "hsdp": {"dp_replicate": nodes, "dp_shard": procs_per_node},
        "tp": {"tp": -1},
        "fsdp_tp": {"dp_shard": -1, "tp": procs_per_node},
        "pp": {"pp": -1},
        "cp": {"cp": -1},
        "ep": {"dp_shard": -1},  # and ep = dp_shard (resolve_dims)
    }[strategy]


def check_strategy(strategy: str | None) -> None:
    if strategy is not None and strategy not in SHORTHANDS:
        close = difflib.get_close_matches(strategy, SHORTHANDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"parallel.strategy: unknown strategy {strategy!r}{hint} (choose one of {', '.join(SHORTHANDS)}, "
            "or set the degrees parallel.dp_replicate, dp_shard, tp, pp, cp)"
        )


def check_degrees(explicit: dict[str, int | None]) -> None:
    """Checks that need no world size: each degree positive or -1, at most one -1."""
    for name, value in explicit.items():
        if value is not None and (value == 0 or value < -1):
            raise ConfigError(f"parallel.{name} must be a positive integer or -1 (the rest of the world), got {value}")
    rest = [name for name, value in explicit.items() if value == -1]
    if len(rest) > 1:
        raise ConfigError(
            f"parallel: only one degree may be -1 (the rest of the world size), got {' and '.join(rest)} = -1; "
            "set all but one of them"
        )


def resolve_dims(
    strategy: str | None, explicit: dict[str, int | None], world_size: int, procs_per_node: int, ep: int | None = None
) -> ParallelDims:
    """The layout for `world_size` ranks on nodes of `procs_per_node`: the degrees set explicitly, the strategy's
    shorthand for the others, 1 for the rest; -1 takes what is left; `ep` (parallel.ep; -1 or the ep strategy: all of
    dp_shard) divides dp_shard. Every inconsistency is a ConfigError."""
    check_strategy(strategy)
    check_degrees(explicit)
    if world_size % procs_per_node:
        raise ConfigError(f"the world size {world_size} is not a whole number of nodes of {procs_per_node} processes")
    nodes = world_size // procs_per_node
    given = {name: value for name, value in explicit.items() if value is not None}
    if strategy == "single" and any(value != 1 for value in given.values()):
        raise ConfigError(
            f"parallel.strategy=single runs one process but sets {given}; drop the strategy or the degrees"
        )
    if strategy == "single" and world_size > 1:
        raise ConfigError(
            f"strategy 'single' runs one process, but it was started with WORLD_SIZE={world_size}; "
            f"use parallel.strategy={', '.join(SHORTHANDS[1:])} (or set the degrees), or start one process"
        )
    if strategy is None and not given and world_size > 1 and ep is None:
        raise ConfigError(
            f"started with WORLD_SIZE={world_size}, but the config sets no parallel layout (that is one process); "
            f"set parallel.strategy ({', '.join(SHORTHANDS[1:])}) or the degrees, or start one process"
        )
    degrees = {name: 1 for name in DEGREES}
    if strategy:
        degrees.update(shorthand_degrees(strategy, nodes, procs_per_node))
    degrees.update(given)
    rest = [name for name, value in degrees.items() if value == -1]
    if len(rest) > 1:
        raise ConfigError(
            f"parallel: {' and '.join(rest)} would both take the rest of the world size (strategy {strategy!r} "
            f"with {given}); set one of them"
        )
    known = math.prod(value for value in degrees.values() if value != -1)
    if rest:
        if world_size % known:
            raise ConfigError(
                f"parallel: {_written(degrees)} cannot fill the world size {world_size}: {known} does not divide it; "
                "change the degrees or the number of processes"
            )
        degrees[rest[0]] = world_size // known
    dims = ParallelDims(**degrees, ep=expert_degree(ep, strategy, degrees["dp_shard"]))
    if dims.world_size != world_size:
        raise ConfigError(
            f"parallel: {_written(degrees)} = {dims.world_size} processes, but the world size is {world_size}; "
            "the degrees must multiply to the number of processes (one may be -1: the rest)"
        )
    if dims.tp > 1 and procs_per_node % dims.tp:
        raise ConfigError(
            f"parallel.tp={dims.tp} does not divide the {procs_per_node} processes of a node: a tensor-parallel group "
            "would span nodes (it communicates in every layer); choose tp dividing the processes per node"
        )
    return dims


def expert_degree(ep: int | None, strategy: str | None, dp_shard: int) -> int:
    """parallel.ep against the resolved dp_shard, whose ranks it borrows: -1 (or the ep strategy, ep unset) takes
    them all."""
    if ep is None:
        return dp_shard if strategy == "ep" else 1
    if ep == 0 or ep < -1:
        raise ConfigError(f"parallel.ep must be a positive integer or -1 (all of dp_shard), got {ep}")
    if ep == -1:
        return dp_shard
    if dp_shard % ep:
        raise ConfigError(
            f"parallel.ep={ep} does not divide parallel.dp_shard={dp_shard}: expert parallelism borrows its ranks "
            "from the data-parallel shards, in groups of ep; choose an ep dividing dp_shard, or raise dp_shard"
        )
    return ep


def _written(degrees: dict[str, int]) -> str:
    return " x ".join(f"{name} {degrees[name]}" for name in DEGREES if name != "cp" or degrees[name] != 1)
