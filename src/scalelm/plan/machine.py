"""The machine's baseline as one typed record: what scalelm.measure.baseline measured of the devices and the network,
read by the plan (scalelm.plan.steptime) and the report (scalelm.report.machine, .steptime, .disturbance) as fields,
never as strings. Torch-free, as the plan is.

`MachineBaseline.from_json` is the one reader of the JSON file, of every shape an older scalelm wrote (no spreads, no
model step, no elementwise rate, no host load); `to_json` writes today's keys, so that a file read and written again
is unchanged. What depends on the device, the world size, the node count, compiling and --moe is an optional field:
a GPU's baseline has no host speedups and no waits, one process no collectives, a compiled step no `tp` overhead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ENDS = ("median", "fast", "slow")  # a figure at the median of its repetitions or at either end of their spread


@dataclass(frozen=True)
class Figure:
    """A measured figure: the median of its repetitions and their spread (low, high), which a baseline of an older
    scalelm lacks. A rate (a bandwidth, a speedup) is faster at its high end, a time at its low end."""

    median: float
    low: float | None = None
    high: float | None = None
    rate: bool = False

    def at(self, end: str) -> float:
        """The figure at `end` of ENDS (the median where no spread was timed)."""
        if end == "median" or self.low is None or self.high is None:
            return self.median
        return self.high if (end == "fast") == self.rate else self.low

    @classmethod
    def spread_of(cls, values: dict[str, Any], median: str, spread: str, rate: bool = False) -> Figure:
        """From `median` and its [low, high] under `spread`, as the model's step and the waits hold them."""
        low, high = values.get(spread) or (None, None)
        return cls(values[median], low, high, rate)

    def spread_json(self, median: str, spread: str) -> dict[str, Any]:
        return {median: self.median} | ({spread: [self.low, self.high]} if self.low is not None else {})

    @classmethod
    def bounds_of(cls, row: dict[str, Any], name: str, rate: bool = False) -> Figure:
        """From `name`, `name_min` and `name_max`, as a collective's row holds them."""
        return cls(row[name], row.get(f"{name}_min"), row.get(f"{name}_max"), rate)

    def bounds_json(self, name: str) -> dict[str, Any]:
        bounds = {f"{name}_min": self.low, f"{name}_max": self.high} if self.low is not None else {}
        return {name: self.median} | bounds


@dataclass(frozen=True)
class ModelStep:
    """The model's own training step alone on one device (the slowest rank's), for one micro-batch of `tokens`, and
    what else the baseline timed with it."""

    tokens: int
    seconds: Figure
    small_tokens: int | None = None  # a quarter of the tokens on the same rank: the step's fixed cost
    small_seconds: Figure | None = None
    layout_overhead_s: dict[str, Figure] = field(default_factory=dict)  # tp, cp, ep, fsdp: the first rank's excess
    cores: int | None = None  # CPU: the cores rank 0 ran the step on as threads
    thread_speedup: float | None = None  # CPU: that step's speed over one thread's
    together_seconds_max: float | None = None  # CPU: the slowest rank's step with every rank at work
    ranks_per_host: int | None = None  # CPU: the most ranks on one machine (boot id)
    host_speedup: Figure | None = None  # CPU: a machine's throughput with every rank at work over one rank's alone
    compiled: bool | None = None  # None: an older scalelm's, which did not say
    vocab_size: int | None = None
    prepared: bool | None = None  # False: timed with WikiText-2's vocabulary, no prepared data found

    @classmethod
    def from_json(cls, step: dict[str, Any]) -> ModelStep:
        spreads = step.get("layout_overhead_s_spread", {})
        host = (
            Figure.spread_of(step, "host_speedup", "host_speedup_spread", rate=True) if "host_speedup" in step else None
        )
        return cls(
            tokens=step["tokens"],
            seconds=Figure.spread_of(step, "seconds_max", "seconds_spread"),
            small_tokens=step.get("small_tokens"),
            small_seconds=Figure.spread_of(step, "small_seconds_max", "small_seconds_spread")
            if "small_tokens" in step
            else None,
            layout_overhead_s={
                name: Figure(seconds, *spreads.get(name, (None, None)))
                for name, seconds in step.get("layout_overhead_s", {}).items()
            },
            cores=step.get("cores"),
            thread_speedup=step.get("thread_speedup"),
            together_seconds_max=step.get("together_seconds_max"),
            ranks_per_host=step.get("ranks_per_host"),
            host_speedup=host,
            compiled=step.get("compiled"),
            vocab_size=step.get("vocab_size"),
            prepared=step.get("prepared"),
        )

    def to_json(self) -> dict[str, Any]:
        out = {"tokens": self.tokens, **self.seconds.spread_json("seconds_max", "seconds_spread")}
        if self.small_seconds is not None:
            out |= {"small_tokens": self.small_tokens}
            out |= self.small_seconds.spread_json("small_seconds_max", "small_seconds_spread")
        if self.layout_overhead_s:
            overheads = self.layout_overhead_s.items()
            out["layout_overhead_s"] = {name: figure.median for name, figure in overheads}
            out["layout_overhead_s_spread"] = {name: [f.low, f.high] for name, f in overheads if f.low is not None}
        for name in ("cores", "thread_speedup", "together_seconds_max", "ranks_per_host"):
            out |= {name: getattr(self, name)} if getattr(self, name) is not None else {}
        if self.host_speedup is not None:
            out |= self.host_speedup.spread_json("host_speedup", "host_speedup_spread")
        for name in ("compiled", "vocab_size", "prepared"):
            out |= {name: getattr(self, name)} if getattr(self, name) is not None else {}
        return out


@dataclass(frozen=True)
class Waits:
    """CPU: what a small collective costs inside the model's step, every rank at work (measure.baseline's
    collective_waits): the last rank's latency, and the ranks' drift apart between two, a share of their compute."""

    in_step_latency_s: Figure
    drift_share: Figure

    @classmethod
    def from_json(cls, result: dict[str, Any]) -> Waits | None:
        if result.get("in_step_latency_s") is None:
            return None
        return cls(*(Figure.spread_of(result, name, f"{name}_spread") for name in ("in_step_latency_s", "drift_share")))

    def to_json(self) -> dict[str, Any]:
        return self.in_step_latency_s.spread_json("in_step_latency_s", "in_step_latency_s_spread") | (
            self.drift_share.spread_json("drift_share", "drift_share_spread")
        )


@dataclass(frozen=True)
class Collective:
    """One collective at one message size, over the job (`scope` job) or within a node (node): the slowest rank's
    time of each repetition, their median and spread, and the bandwidths in nccl-tests' convention."""

    scope: str
    op: str
    bytes: int
    busbw_gbps: Figure
    ranks: int | None = None  # None: hand-written rows of the tests' older shapes
    time_s: Figure | None = None
    algbw_gbps: float | None = None

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> Collective:
        time = Figure.bounds_of(row, "time_s") if "time_s" in row else None
        bus = Figure.bounds_of(row, "busbw_gbps", rate=True)
        return cls(row["scope"], row["op"], row["bytes"], bus, row.get("ranks"), time, row.get("algbw_gbps"))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"scope": self.scope, "op": self.op}
        out |= {"ranks": self.ranks} if self.ranks is not None else {}
        out |= {"bytes": self.bytes} | (self.time_s.bounds_json("time_s") if self.time_s else {})
        out |= {"algbw_gbps": self.algbw_gbps} if self.algbw_gbps is not None else {}
        return out | self.busbw_gbps.bounds_json("busbw_gbps")


RANK_KEYS = ("rank", "host", "machine", "threads", "cpus", "gpu")


@dataclass(frozen=True)
class Rank:
    """One rank of the baseline: where it ran and, in `figures`, what it measured alone (its products, steps, load:
    measure.baseline's per-rank dictionary), from which the record's own figures were taken."""

    rank: int | None
    host: str | None
    machine: str | None  # its kernel's boot id (measure.hostload.machine_id)
    threads: int | None
    cpus: int | None
    gpu: dict[str, Any] | None  # NVML's worst health seen (measure.baseline.gpu_health.worst_health); None off CUDA
    figures: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, rank: dict[str, Any]) -> Rank:
        figures = {key: value for key, value in rank.items() if key not in RANK_KEYS}
        return cls(*(rank.get(key) for key in RANK_KEYS), figures)

    def to_json(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in RANK_KEYS} | self.figures


@dataclass(frozen=True)
class MachineBaseline:
    """What a job of `world_size` ranks measured of its machine (`*_min`, `*_max`: the slowest rank's)."""

    world_size: int
    procs_per_node: int
    hosts: list[str]
    device: str  # "cpu", or the CUDA device's name
    matmul_tflops: float  # the model's matrix products
    elementwise_gbps: float | None  # an elementwise addition at the logits' size; None: an older scalelm's
    model_step: ModelStep | None  # None: an older scalelm's
    per_rank: list[Rank]
    collectives: list[Collective]
    waits: Waits | None = None  # CPU with several ranks
    nccl_network: str | None = None  # the network NCCL chose ("IB", "Socket")
    host_load: dict[str, dict[str, Any]] | None = None  # per host: its and other work's cores (measure.hostload)
    backend: str | None = None
    torch: str | None = None
    # not measured: modelled from the catalogue's figures (scalelm.plan.catalogue), which it names; it has no model step
    modelled: str | None = None
    # a fused causal attention kernel's TFLOP/s (the catalogue's model of flash attention); None: among the products
    attention_tflops: float | None = None

    @property
    def nodes(self) -> int:
        return self.world_size // self.procs_per_node

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"

    def largest(self) -> dict[str, Collective]:
        """Each collective at its largest message, by `<scope>_<op>` (site.yaml's reference names)."""
        found: dict[str, Collective] = {}
        for row in self.collectives:
            key = f"{row.scope}_{row.op}"
            if key not in found or row.bytes > found[key].bytes:
                found[key] = row
        return found

    @classmethod
    def from_json(cls, result: dict[str, Any]) -> MachineBaseline:
        """The record of a baseline's JSON, as any scalelm wrote it; ValueError where it is none."""
        try:
            return cls._read(result)
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"no machine baseline: {type(err).__name__} {err}") from None

    @classmethod
    def _read(cls, result: dict[str, Any]) -> MachineBaseline:
        return cls(
            world_size=result["world_size"],
            procs_per_node=result["procs_per_node"],
            hosts=list(result["hosts"]),
            device=result["device"],
            matmul_tflops=result["matmul_tflops_min"],
            elementwise_gbps=result.get("elementwise_gbps_min"),
            model_step=ModelStep.from_json(result["model_step"]) if result.get("model_step") else None,
            per_rank=[Rank.from_json(rank) for rank in result.get("per_rank", [])],
            collectives=[Collective.from_json(row) for row in result.get("collectives", [])],
            waits=Waits.from_json(result),
            nccl_network=result.get("nccl_network"),
            host_load=result.get("host_load"),
            backend=result.get("backend"),
            torch=result.get("torch"),
            modelled=result.get("modelled"),
            attention_tflops=result.get("attention_tflops"),
        )

    def to_json(self) -> dict[str, Any]:
        """Today's keys, in the order measure.baseline has always written them."""
        return {
            "world_size": self.world_size,
            "procs_per_node": self.procs_per_node,
            "hosts": self.hosts,
            "device": self.device,
            "backend": self.backend,
            "torch": self.torch,
            "matmul_tflops_min": self.matmul_tflops,
            "elementwise_gbps_min": self.elementwise_gbps,
            "model_step": self.model_step.to_json() if self.model_step else None,
            "per_rank": [rank.to_json() for rank in self.per_rank],
            "collectives": [row.to_json() for row in self.collectives],
            **(self.waits.to_json() if self.waits else {}),
            "nccl_network": self.nccl_network,
            "host_load": self.host_load,
            **({"modelled": self.modelled} if self.modelled else {}),
            **({"attention_tflops": self.attention_tflops} if self.attention_tflops else {}),
        }
