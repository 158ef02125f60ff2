"""Metrics: one JSON object per line in the run's metrics.jsonl, and readable progress lines, on rank 0 only."""

from __future__ import annotations

import contextlib
import json
import math
import re
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from scalelm.files import append_text, atomic_write_text
from scalelm.train.record import metrics_lines

PROC_STATUS, PROC_CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


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


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics line's numbers as tagged scalars: train/loss, validation/perplexity, ..."""
    group = record["kind"] if record["kind"] == "train" else record.get("split", record["kind"])
    return {
        f"{group}/{key}": value
        for key, value in record.items()
        if key not in ("time", "step", "epoch") and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


class MetricsLogger:
    """metrics.jsonl, the progress line, TensorBoard event files (`tensorboard --logdir results/runs`) and, where
    asked for, an offline Weights & Biases run (scalelm.train.wandb_offline)."""

    def __init__(
        self,
        path: Path,
        enabled: bool,
        resume_step: int | None = None,
        board_dir: Path | None = None,
        wandb=None,
        evaluations_redone: bool = False,
    ):
        """`resume_step`: the step training goes on from (0 for a run starting afresh), whose evaluations are kept
        unless `evaluations_redone` (a run resumed at its end evaluates it again)."""
        self.path = Path(path)
        self.enabled = enabled
        self.start = time.time()
        self.board = None
        self.wandb = wandb if enabled else None
        if enabled and resume_step is not None:
            self._truncate_after(resume_step, evaluations_redone)
        if enabled and board_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only where it writes

            # a resumed run redoes the steps after its checkpoint: TensorBoard drops their old events
            self.board = SummaryWriter(str(board_dir), purge_step=None if resume_step is None else resume_step + 1)

    def _truncate_after(self, step: int, evaluations_redone: bool) -> None:
        """On resume, drop the records of what will be redone: the steps the restored checkpoint has not seen, and a
        torn last line (a write cut short)."""
        if not self.path.is_file():
            return
        lines, torn = metrics_lines(self.path)
        if torn:
            print(f"dropped the incomplete last line of {self.path} (a write cut short, as on a full disk)", flush=True)

        def redone(record: dict[str, Any]) -> bool:
            evaluation_redone = evaluations_redone and record.get("kind") == "eval"
            return record["step"] > step or (record["step"] == step and evaluation_redone)

        atomic_write_text(self.path, "".join(line + "\n" for line, record in lines if not redone(record)))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time() - self.start, 3), **record}
        append_text(self.path, json.dumps(record) + "\n")
        if self.board is not None:
            for tag, value in scalars(record).items():
                self.board.add_scalar(tag, value, record["step"])
            self.board.flush()  # readable while training runs, and complete if the job is killed
        if self.wandb is not None:
            self.wandb.log(scalars(record), record["step"])
        print(progress_line(record), flush=True, file=sys.stdout)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
        if self.wandb is not None:
            self.wandb.close()


def progress_line(record: dict[str, Any]) -> str:
    if record["kind"] == "train":
        return (
            f"step {record['step']:>7} | epoch {record['epoch']} | loss {record['loss']:.4f} | "
            f"lr {record['lr']:.2e} | grad norm {record['grad_norm']:.3f} | "
            f"{record['tokens_per_s']:,.0f} tok/s ({record['tokens_per_s_per_device']:,.0f}/device) | "
            f"{record['step_time_s'] * 1000:.0f} ms/step | mem {record['peak_mem_mb']:,.0f} MB"
        )
    return (
        f"step {record['step']:>7} | {record['split']} loss {record['loss']:.4f} | "
        f"ppl {record['perplexity']:.2f} | {record['tokens']:,} tokens"
    )


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


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work: the host runs steps ahead of it, and a clock read without this would count
    that work in the next interval, or in a paused span (an evaluation) not at all."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf
