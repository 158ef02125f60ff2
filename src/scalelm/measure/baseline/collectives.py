"""Every collective the baseline times (all_reduce, all_gather, reduce_scatter, send/recv, all_to_all with uneven
splits) over message sizes on a process group: each repetition's slowest rank, and the bus bandwidth in nccl-tests'
convention; the group of this rank's node."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from scalelm.measure.baseline.timing import calls_agreed, per_call, spread
from scalelm.site import OPS

if TYPE_CHECKING:  # torch is imported where the measuring starts: the workflow reads this module without it
    import torch
    import torch.distributed as dist


# nccl-tests' bus bandwidth: the algorithm bandwidth times the share of the message each link carries
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n,
}


def bus_bandwidth(op: str, size_bytes: int, seconds: float, ranks: int) -> tuple[float, float]:
    """(algorithm, bus) bandwidth in GB/s (10^9 bytes per second, as nccl-tests reports)."""
    algorithm = size_bytes / seconds / 1e9
    return algorithm, algorithm * BUS_FACTOR[op](ranks)


LOAD_SKEW = 0.3  # an all_to_all's busiest destination gets 1.3 x the mean: the local default's routers at most


def uneven_splits(elements: int, ranks: int, me: int) -> tuple[list[int], list[int]]:
    """The elements rank `me` sends to each rank and receives from each in an all_to_all of `elements` per rank,
    uneven as a mixture's dispatch is: a rank's share for the rank k places after it ramps from 1 - LOAD_SKEW to
    1 + LOAD_SKEW times the mean over k, so every rank sends and receives `elements` in all."""
    weights = [1 - LOAD_SKEW + 2 * LOAD_SKEW * k / max(ranks - 1, 1) for k in range(ranks)]
    by_offset = [int(elements * w / sum(weights)) for w in weights]
    by_offset[-1] += elements - sum(by_offset)
    sent = [by_offset[(rank - me) % ranks] for rank in range(ranks)]
    received = [by_offset[(me - rank) % ranks] for rank in range(ranks)]
    return sent, received


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def run_op(op: str, size_bytes: int, group: dist.ProcessGroup, device: torch.device) -> Callable[[], None]:
    """One `op` of `size_bytes` (fp32) on `group`, ready to call."""
    import torch
    import torch.distributed as dist

    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    elements = max(size_bytes // 4 // ranks, 1) * ranks
    buffer = torch.ones(elements, device=device)
    piece = torch.ones(elements // ranks, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(buffer, group=group)
    # the same collectives under their newer names (torch >= 2.13), where there are
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if op == "all_gather":
        return lambda: gather(buffer, piece, group=group)
    if op == "reduce_scatter":
        return lambda: scatter(piece, buffer, group=group)
    if op == "all_to_all":
        sent, received = uneven_splits(elements, ranks, me)
        arrived = torch.empty(sum(received), device=device)
        return lambda: dist.all_to_all_single(arrived, buffer, received, sent, group=group)
    received = torch.empty_like(buffer)
    after = dist.get_global_rank(group, (me + 1) % ranks)
    before = dist.get_global_rank(group, (me - 1) % ranks)

    def send_recv() -> None:
        ops = [dist.P2POp(dist.isend, buffer, after, group), dist.P2POp(dist.irecv, received, before, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return send_recv


COLLECTIVE_SAMPLE_S = 0.02  # each repetition of a collective: calls enough to last about this long


def time_collectives(
    scope: str, group: dist.ProcessGroup, sizes: list[int], device: torch.device, iterations: int
) -> list[dict[str, Any]]:
    """Every op at every size on `group`: each repetition's slowest rank, the median and the spread over the
    repetitions of its time and bandwidths. A repetition is the mean of as many calls as last about
    COLLECTIVE_SAMPLE_S (at least one; the same count on every rank), as nccl-tests averages its iterations: one
    call of a small message is at the mercy of one preemption."""
    import torch
    import torch.distributed as dist

    ranks = dist.get_world_size(group)
    rows = []
    for op in OPS:
        if op == "send_recv" and ranks < 2:
            continue
        for size in sizes:
            call = run_op(op, size, group, device)
            dist.barrier(group=group)
            # its one timed call warms up (connections, buffers); every rank then calls as often
            calls = calls_agreed(call, device, COLLECTIVE_SAMPLE_S, group)
            times = []
            for _ in range(iterations):
                dist.barrier(group=group)
                times.append(per_call(call, device, calls))
            slowest = torch.tensor(times, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)  # a repetition ends with its last rank
            fastest, seconds, longest = spread(slowest.tolist())
            algorithm, bus = bus_bandwidth(op, size, seconds, ranks)
            rows.append(
                {
                    "scope": scope,
                    "op": op,
                    "ranks": ranks,
                    "bytes": size,
                    "time_s": seconds,
                    "time_s_min": fastest,
                    "time_s_max": longest,
                    "algbw_gbps": algorithm,
                    "busbw_gbps": bus,
                    "busbw_gbps_min": bus_bandwidth(op, size, longest, ranks)[1],
                    "busbw_gbps_max": bus_bandwidth(op, size, fastest, ranks)[1],
                }
            )
    return rows


def node_group(procs_per_node: int, world_size: int) -> dist.ProcessGroup | None:
    """This rank's node (torchrun places a node's ranks together); None with one node or one process per node."""
    import torch.distributed as dist

    if procs_per_node < 2 or procs_per_node >= world_size or world_size % procs_per_node:
        return None
    mine, _ = dist.new_subgroups(group_size=procs_per_node)
    return mine
