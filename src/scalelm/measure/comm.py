"""Communication share: the last few training steps run under torch's profiler, which times every collective where
it executes (gloo's worker threads on CPU, NCCL's kernels on the GPU).

    share = (time during which at least one collective ran) / (wall time of the profiled steps)

Both are taken inside the steps themselves (each marked in the profile, and on CUDA ended by a synchronisation), so
an evaluation or a checkpoint between them does not count. The union of the collectives' intervals counts
overlapping collectives once. The share includes time spent waiting
for the slowest rank inside a collective, and counts communication that overlaps computation (DDP's bucketed
all-reduce during backward, FSDP's prefetched all-gathers) as well as communication the step waits for: it is the
share of a step with the network busy, not the time overlap would save. The profiler slows the profiled steps down
and its records take host memory (every operator is recorded), so they come last, when no other figure is left to
measure, and their logging interval is marked `profiled`: left out of the steady-state speed
(scalelm.report.timing) and of the peak memory.

The all-to-all of expert parallelism (scalelm.parallel.expert) is counted apart as well, the share of the steps with
one running (`all_to_all_share`): gloo names it (gloo:all_to_all); NCCL runs it in the kernel its send and receive
share, which is told apart by the operation that launched it (nccl:all_to_all, or the dispatcher's alltoall).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

# Where a collective's execution shows in the profile: gloo's record functions on its worker threads, NCCL's kernels.
CPU_COLLECTIVE_PREFIXES = ("gloo:",)
DEVICE_COLLECTIVE_MARK = "nccl"
STEP_MARK = "scalelm:train_step"
ALL_TO_ALL = "all_to_all"
# what kineto writes on the process's stderr at each start and stop of a profile, whatever KINETO_LOG_LEVEL says
PROFILER_NOTICES = (b"USDT:", b"STAGE:")


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def clip(intervals: list[tuple[float, float]], windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of `intervals` inside `windows`."""
    return [(max(s, a), min(e, b)) for s, e in intervals for a, b in windows if s < b and a < e]


def is_all_to_all(name: str) -> bool:
    """An all-to-all by its name in the profile: gloo:all_to_all, nccl:all_to_all, c10d::alltoall_base_."""
    return ALL_TO_ALL in name or "alltoall" in name


def launched_by_all_to_all(kernel, cpu_ops: dict[int, Any]) -> bool:
    """Whether a device kernel was launched inside an all-to-all: the profile links a kernel to the innermost CPU
    operation running when it was launched, whose ancestors include the collective's."""
    op = cpu_ops.get(getattr(kernel, "linked_correlation_id", 0))
    while op is not None:
        if is_all_to_all(op.name):
            return True
        op = op.cpu_parent
    return False


def frontend_ops(events) -> dict[int, Any]:
    """The CPU operations that the profile links device kernels to, by id: torch's own (its profiler's frontend
    events: linked to nothing, not asynchronous). The CUDA runtime's calls (cudaLaunchKernel, ...) are CPU events as
    well, but their ids are CUPTI's correlation ids, another counter: keyed with the operations, one would replace
    the operation whose id it shares."""
    return {
        e.id: e
        for e in events
        if e.device_type.name == "CPU" and not getattr(e, "linked_correlation_id", 0) and not e.is_async
    }


def collective_intervals(events, device: torch.device) -> dict[str, list[tuple[float, float]]]:
    """Each collective's (start, end) in seconds, by name, from a profiler's events: on CUDA by kernel name, but an
    all-to-all's kernels (NCCL's send and receive kernel, which a pipeline's transfers use too) by theirs."""
    found: dict[str, list[tuple[float, float]]] = {}
    cpu_ops = frontend_ops(events) if device.type == "cuda" else {}
    for event in events:
        name = event.name
        if device.type == "cuda":
            found_here = event.device_type.name == "CUDA" and DEVICE_COLLECTIVE_MARK in name.lower()
            if found_here and launched_by_all_to_all(event, cpu_ops):
                name = f"{DEVICE_COLLECTIVE_MARK}:{ALL_TO_ALL}"
        else:
            found_here = name.startswith(CPU_COLLECTIVE_PREFIXES)
        if found_here:
            found.setdefault(name, []).append((event.time_range.start / 1e6, event.time_range.end / 1e6))
    return found


@contextlib.contextmanager
def without_profiler_notices() -> Iterator[None]:
    """Around a profile's start or stop: kineto's notices (`USDT: ... profiler_start`) would land in the middle of
    the training's step lines, so the process's stderr goes to a file meanwhile and every other line written there
    (another thread's, a warning) is passed on after."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(keepends=True) if not line.startswith(PROFILER_NOTICES)]
            if kept:
                os.write(2, b"".join(kept))


class CommProfile:
    """Profiles the last `steps` of the run's `total` steps (1-based), or as many of them as are after the step this
    attempt resumed from."""

    def __init__(self, steps: int, total: int, resumed: int, device: torch.device, enabled: bool):
        self.first, self.last = max(total - steps, resumed) + 1, total
        self.device, self.enabled = device, enabled and steps > 0 and self.first <= self.last
        self.profiler: profile | None = None
        self.result: dict[str, Any] | None = None

    def covers(self, step: int) -> bool:
        return self.enabled and self.first <= step <= self.last

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around training step `step`: starts the profiler before the first profiled step, stops it after the last."""
        if not self.covers(step):
            yield
            return
        if step == self.first:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.profiler = profile(activities=activities)
            with without_profiler_notices():
                self.profiler.__enter__()
        with record_function(STEP_MARK):
            yield
            if self.device.type == "cuda":  # the step's kernels, collectives included, end inside its mark
                torch.cuda.synchronize(self.device)
        if step == self.last and self.profiler is not None:
            with without_profiler_notices():
                self.profiler.__exit__(None, None, None)
            self.result = self.summarise(self.profiler.events())
            self.profiler = None

    def summarise(self, events) -> dict[str, Any]:
        steps = [(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in events if e.name == STEP_MARK]
        wall = sum(end - start for start, end in steps)
        by_name = {name: clip(v, steps) for name, v in collective_intervals(events, self.device).items()}
        busy = union_seconds([interval for intervals in by_name.values() for interval in intervals])
        exchange = union_seconds([i for name, intervals in by_name.items() if is_all_to_all(name) for i in intervals])
        return {
            "steps": [self.first, self.last],
            "step_s": wall / len(steps),
            "comm_s_per_step": busy / len(steps),
            "share": busy / wall if wall > 0 else None,
            "all_to_all_s_per_step": exchange / len(steps),
            "all_to_all_share": exchange / wall if wall > 0 else None,
            "ops_s_per_step": {name: sum(e - s for s, e in v) / len(steps) for name, v in sorted(by_name.items())},
        }
