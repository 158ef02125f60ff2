"""What a CPU host whose cores its ranks share does to a layout's step, apart from the step-time model's own terms
(scalelm.plan.steptime): the CPU-only terms, measured by the machine's baseline on such a host (scalelm.plan.machine).

A host's ranks share its throughput, which the baseline measures with every rank at work, and a lone process gains
what its threads gained there (two threads or two processes on two virtual cores do not run twice as fast as one:
they share caches, memory and, on a virtual machine, perhaps a physical core). A machine is a kernel
(scalelm.measure.hostload.machine_id): the local default's "nodes" and the Slurm test cluster's share one. Nothing
hides behind the compute: gloo's collectives run on the cores it uses. Each message costs at least what the baseline
measured a small collective to cost inside the model's step (a rank woken from a collective waits for a core), and
the ranks of a step with collectives drift apart between two and wait for the last at each. Where a machine's ranks
want more cores than it has, a collective also waits for its members to get a core from the ranks computing
meanwhile, and takes as much longer as the machine is oversubscribed. A GPU's plan has none of this
(`HostContention.none()`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from scalelm.launch.launcher import threads_per_process
from scalelm.plan.comm import Traffic


class Speeds(Protocol):
    """What the host's terms read of the machine's speeds (scalelm.plan.steptime.Speeds, which uses this module)."""

    threads: int | None  # CPU: the threads the rates were measured with; None on GPUs
    cpus: int | None
    host_speedup: float | None
    thread_speedup: float | None
    in_step_latency_s: float | None
    drift_share: float | None

    @property
    def on_cpu(self) -> bool: ...

    def bus_gbps(self, link: str, op: str, size: int) -> float: ...


@dataclass(frozen=True)
class HostContention:
    """The host's terms of one layout's step, for its ranks' threads and their number on a host."""

    speedup: float = 1.0  # how much faster than measured alone a rank computes
    collective_factor: float = 1.0  # how many times longer a collective takes than in the baseline (crowding)
    overlaps: bool = True  # whether collectives can hide behind the compute (a GPU's streams; a CPU's cores cannot)
    in_step_latency_s: float | None = None  # a small collective's seconds inside a step on an uncrowded host
    drift_share: float | None = None  # the ranks' wait for one another at the collectives, a share of their compute

    @classmethod
    def none(cls) -> HostContention:
        """A GPU's: the rates as measured, collectives on their own stream, no host to share."""
        return cls()

    @classmethod
    def of(cls, speeds: Speeds, threads: int | None, ranks_on_host: int) -> HostContention:
        """On a CPU (`speeds.on_cpu`), `ranks_on_host` ranks of `threads` each (default: the launcher's share of the
        host's cores); none() elsewhere."""
        if not speeds.on_cpu:
            return cls.none()
        if threads is None and speeds.cpus:
            threads = threads_per_process(speeds.cpus, ranks_on_host)
        return cls(
            speedup=rank_speedup(speeds, threads, ranks_on_host),
            collective_factor=collective_crowding(speeds, threads, ranks_on_host),
            overlaps=False,
            in_step_latency_s=speeds.in_step_latency_s,
            drift_share=speeds.drift_share,
        )

    def latency(self, flow: Traffic, speeds: Speeds) -> float:
        """What `flow`'s messages wait beyond the curve's back-to-back latency (its time at the smallest size
        measured): each at least the in-step latency. 0 where the baseline measured none."""
        if not (self.in_step_latency_s and flow.messages and flow.message_bytes):
            return 0.0
        # the bus convention's bytes of a 1-byte message, at the bandwidth below the smallest size: that size's time
        back_to_back = flow.bytes / flow.messages / flow.message_bytes / (speeds.bus_gbps(flow.link, flow.op, 1) * 1e9)
        return flow.messages * max(0.0, self.in_step_latency_s - back_to_back)

    def drift(self, compute_s: float) -> float:
        """Seconds the ranks wait for the last at a step's collectives, crowded as the collectives are."""
        return self.drift_share * self.collective_factor * compute_s if self.drift_share else 0.0


def rank_speedup(speeds: Speeds, threads: int | None, ranks_on_host: int) -> float:
    """How much faster than measured alone a rank computes: alone on its machine, what its threads gained in the
    baseline; beside others, its share of the machine's throughput (the launcher shares every core out); without
    those figures its share of the cores over the measuring rank's threads. 1 on GPUs."""
    if speeds.threads is None or threads is None:
        return 1.0
    if ranks_on_host == 1 and speeds.thread_speedup and speeds.cpus and speeds.cpus > speeds.threads:
        # one process: threads help as far as they did in the baseline (little, for small products)
        share = (min(threads, speeds.cpus) - speeds.threads) / (speeds.cpus - speeds.threads)
        return 1 + max(share, 0.0) * (speeds.thread_speedup - 1)
    if speeds.host_speedup:
        return speeds.host_speedup / ranks_on_host
    share = min(threads, (speeds.cpus or threads * ranks_on_host) / ranks_on_host)
    return share / speeds.threads


def collective_crowding(speeds: Speeds, threads: int | None, ranks_on_host: int) -> float:
    """How much longer a collective takes in a step than in the baseline on a CPU whose ranks want more cores than it
    has: its members share their cores with the ranks computing meanwhile. 1 on GPUs."""
    if speeds.threads is None or threads is None or not speeds.cpus:
        return 1.0
    return crowding(threads, ranks_on_host, speeds.cpus)


def crowding(threads: int, ranks_on_host: int, cpus: int) -> float:
    """How many times over a host's ranks, each with its threads, want its cores (at least 1)."""
    return max(1.0, threads * ranks_on_host / cpus)
