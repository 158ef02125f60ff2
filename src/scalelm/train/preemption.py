"""Graceful stop on SIGTERM or SIGUSR1 (Slurm's --signal, preemption, scancel --signal).

The handler only sets a flag. After each optimizer step, and between evaluation batches, the ranks agree on it (a
one-element all-reduce on a gloo group, so GPUs are not synchronised), save a checkpoint together and exit with
EXIT_PREEMPTED; rerunning resumes.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from scalelm.errors import ScaleLMError
from scalelm.parallel.env import is_distributed

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: try again later, the run will resume
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
        if is_distributed():
            # the default group is NCCL on GPUs; this flag lives on the CPU
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD

    def _handle(self, signum, frame) -> None:
        self.signal = signum

    def raised(self) -> bool:
        """True on every rank if any rank got a stop signal (a collective: every rank calls it)."""
        if self._group is None:
            return self.signal is not None
        flag = torch.tensor([0 if self.signal is None else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
