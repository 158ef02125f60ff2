"""A device's synchronised clock and memory peak: what every timing and memory figure of scalelm reads, in training
(scalelm.measure.instruments, the engines' `Stopwatch`), in the machine's baseline and in the benchmarks."""

from __future__ import annotations

import contextlib
import re
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import torch

PROC_STATUS, PROC_CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work: the host runs steps ahead of it, and a clock read without this would count
    that work in the next interval, or in a paused span (an evaluation) not at all."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mb(device: torch.device) -> tuple[float, float | None]:
    """(peak, reserved) in MiB since the last `reset_peak_memory`. CUDA: the peak memory allocated by tensors, and
    the peak the caching allocator held (what the device had to have). CPU: the peak resident set size of this
    process (Linux's VmHWM; elsewhere the lifetime peak), and None."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, torch.cuda.max_memory_reserved(device) / 2**20
    try:
        return int(re.search(r"VmHWM:\s+(\d+) kB", PROC_STATUS.read_text())[1]) / 1024, None
    except (OSError, TypeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, None  # Linux reports KiB


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak (at each logged interval and after each evaluation or checkpoint): since the process
    started, every later interval's peak would include the start-up and the largest evaluation. CPU: Linux resets
    the process's peak resident set (VmHWM) to its current one; elsewhere the lifetime peak stays."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        PROC_CLEAR_REFS.write_text("5")
    except OSError:
        pass


class Stopwatch:
    """Training time between laps, excluding the spans run inside `paused()` (evaluation, checkpoints). On CUDA
    the device's queued work is waited for at every boundary, so each span has its own work."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.started = self.lap_start = time.perf_counter()
        self.paused_s = 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.paused_s += time.perf_counter() - start
            reset_peak_memory(self.device)

    def lap(self) -> float:
        synchronize(self.device)
        now = time.perf_counter()
        elapsed = now - self.lap_start - self.paused_s
        self.lap_start, self.paused_s = now, 0.0
        return elapsed

    def wall(self) -> float:
        return time.perf_counter() - self.started
