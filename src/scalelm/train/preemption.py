"""Graceful stop on SIGTERM or SIGUSR1 (Slurm's --signal, preemption, scancel --signal).

The handler only sets a flag. After each optimizer step, and between evaluation batches, the ranks agree on it (a
one-element all-reduce on a gloo group, so GPUs are not synchronised), save a checkpoint together and exit with
EXIT_PREEMPTED; rerunning resumes. The all-reduce runs in the background and is read at the next check, so no step
waits for the slowest rank's host: a stop is seen one check later.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from scalelm.errors import EXIT_PREEMPTED, ScaleLMError
from scalelm.parallel.env import is_distributed

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(ScaleLMError):
    exit_code = EXIT_PREEMPTED


class StopRequested(Exception):
    """Every rank agreed to stop (StopFlag.raised): the trainer checkpoints and raises Preempted."""


class StopFlag:
    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        self._group = None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None  # the last check's all-reduce, still running
        if is_distributed():
            # the default group is NCCL on GPUs; this flag lives on the CPU
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD

    def _handle(self, signum, frame) -> None:
        self.signal = signum

    def reinstall(self) -> None:
        """Handle the stop signals again where a library has put its own handlers over this flag's."""
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    def raised(self) -> bool:
        """True on every rank if any rank had a stop signal by the previous call (a collective: every rank calls
        it, as often as the others). Each call reads the previous call's all-reduce and starts its own."""
        if self._group is None:
            return self.signal is not None
        agreed = self._settle()
        if not agreed:
            flag = torch.tensor([0 if self.signal is None else 1])
            self._pending = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag
        return agreed

    def _settle(self) -> bool:
        if self._pending is None:
            return False
        work, flag = self._pending
        work.wait()
        self._pending = None
        return bool(flag.item())

    def close(self) -> None:
        """Wait for the last check's all-reduce (started on every rank, so it completes) before the group goes."""
        self._settle()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
