"""How long a call takes on a device, as the baseline times everything: runs of enough calls to last about a given
time, the device synchronised before and after each run, (min, median, max) over the runs; what one call takes more
than another, paired run by run; and a figure's median and spread as the per-rank figures hold them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where the measuring starts: the workflow reads this module without it
    import torch


MODEL_STEP_SAMPLE_S = 0.2  # each of a model step's timed runs: several steps, one would be at the mercy of a hiccup


def median_seconds(
    call: Callable[[], Any], device: torch.device, sample_s: float = 0.01, samples: int = 5, warmup: int = 0
) -> float:
    return seconds_spread(call, device, sample_s, samples, warmup)[1]


def seconds_spread(
    call: Callable[[], Any], device: torch.device, sample_s: float = 0.01, samples: int = 5, warmup: int = 0
) -> tuple[float, float, float]:
    """Seconds per call, (min, median, max) over `samples` runs of enough calls to last about `sample_s` each,
    after `warmup` untimed calls and a timed one that sizes the runs (a single sub-millisecond kernel is at the
    mercy of one preemption)."""
    for _ in range(warmup):
        call()
    calls = calls_lasting(call, device, sample_s)
    return spread([per_call(call, device, calls) for _ in range(samples)])


def excess_seconds(
    call: Callable[[], Any], other: Callable[[], Any], device: torch.device, pairs: int = 7
) -> tuple[float, float, float]:
    """What `other` takes more than `call` per call, (min, median, max) over `pairs` runs of each timed back to back
    (the machine's drift between runs, which moves either alone by more than the difference, cancels in a pair)."""
    calls = calls_lasting(call, device, MODEL_STEP_SAMPLE_S)
    per_call(other, device, 1)  # its first call: what the runs of `call` sized above paid for it
    return spread([per_call(other, device, calls) - per_call(call, device, calls) for _ in range(pairs)])


def calls_lasting(call: Callable[[], Any], device: torch.device, seconds: float) -> int:
    """How many calls last about `seconds`, from one timed call."""
    return max(1, min(1000, int(seconds / max(per_call(call, device, 1), 1e-7))))


def calls_agreed(call: Callable[[], Any], device: torch.device, seconds: float, group: Any = None) -> int:
    """`calls_lasting` on the group's slowest rank: a collective inside `call` needs every rank to call as often."""
    import torch
    import torch.distributed as dist

    calls = torch.tensor([calls_lasting(call, device, seconds)], device=device)
    dist.all_reduce(calls, op=dist.ReduceOp.MIN, group=group)
    return int(calls.item())


def per_call(call: Callable[[], Any], device: torch.device, calls: int) -> float:
    """Seconds per call over `calls` calls, the device synchronised before and after."""
    from scalelm.measure.device import synchronize  # imports torch: not at the module's import

    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        call()
    synchronize(device)
    return (time.perf_counter() - start) / calls


def spread(values: list[float]) -> tuple[float, float, float]:
    """(min, median, max)."""
    return min(values), statistics.median(values), max(values)


def timed(name: str, seconds: tuple[float, float, float]) -> dict[str, Any]:
    """A figure's median as `name` and its (min, max) as `<name>_spread`, as the per-rank figures hold them."""
    fastest, median, longest = seconds
    return {name: median, f"{name}_spread": [fastest, longest]}
