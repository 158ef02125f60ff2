"""The rank side of the utilisation sampler (scalelm.measure.sampler): local rank 0 of each node starts the node's
sampler with the node's training processes and GPUs, and closes its standard input at the end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scalelm.parallel.env import DistEnv


class Monitor:
    """Started by every rank at the start of training: local rank 0 of each node starts the node's sampler."""

    def __init__(self, directory: Path, env: DistEnv, interval_s: float, board: Path | None = None):
        from scalelm.parallel.env import all_gather_object

        self.process: subprocess.Popen | None = None
        if not interval_s:
            return
        mine = (env.hostname, env.node_rank, env.local_rank, env.rank, os.getpid(), device_uuid(env.device))
        everyone = all_gather_object(mine)
        if env.local_rank != 0:
            return
        node = [entry for entry in everyone if entry[:2] == (env.hostname, env.node_rank)]
        command = [
            sys.executable,
            "-m",
            "scalelm.measure.sampler",
            "--out",
            str(directory / f"node{env.node_rank}.jsonl"),
        ]
        command += ["--interval", str(interval_s)]
        command += ["--board", str(board / f"node{env.node_rank}")] if board else []
        command += [arg for *_, rank, pid, _ in node for arg in ("--proc", f"{rank}:{pid}")]
        command += [arg for uuid in sorted({u for *_, u in node if u}) for arg in ("--gpu", uuid)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.stdin.close()  # the sampler writes its last line and ends
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def device_uuid(device) -> str | None:
    """NVML's name for a rank's CUDA device: its UUID, which neither CUDA_VISIBLE_DEVICES (renumbering, dropped by
    the container's --cleanenv), a cgroup-constrained Slurm step nor CUDA's device order can change."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
