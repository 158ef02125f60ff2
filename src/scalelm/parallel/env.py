"""Process group and device from torchrun's environment: NCCL on the LOCAL_RANK's GPU, gloo on CPU."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from scalelm.config import Devices
from scalelm.errors import ConfigError
from scalelm.parallel.hostmemory import keep_freed_memory


def is_distributed() -> bool:
    """Inside a started process group (torchrun's)."""
    return dist.is_available() and dist.is_initialized()


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    procs_per_node: int = 1  # torchrun's LOCAL_WORLD_SIZE
    node_rank: int = 0  # torchrun's GROUP_RANK
    hostname: str = field(default_factory=socket.gethostname)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def here(self) -> Devices:
        """The device type this process trains on, and the one device=auto picks on this machine."""
        return Devices(used=self.device.type, auto="cuda" if torch.cuda.is_available() else "cpu")


def pick_device(preference: str, local_rank: int) -> torch.device:
    if preference == "cuda" and not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(
            f"device: 'cuda' was asked for but no CUDA GPU is visible (torch {torch.__version__}, {build}); run on a "
            "GPU node with a CUDA build of torch, or use device=auto or device=cpu"
        )
    if preference in ("cuda", "auto") and torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK {local_rank} has no GPU: {torch.cuda.device_count()} visible; "
                "start at most one process per GPU (torchrun --nproc-per-node)"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(device: torch.device, cpu_collectives: bool = False) -> str:
    """The process group's backend: gloo on CPU, NCCL on CUDA; with `cpu_collectives` (FSDP's CPU offload keeps
    gradients on the host, and their norm is all-reduced there) gloo for CPU tensors beside NCCL."""
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"


def setup(preference: str, timeout_s: int, cpu_collectives: bool = False) -> DistEnv:
    """Read torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK, pick the device and, for more
    than one process, start the process group (`backend_for`).

    On CPU, host memory freed by one step is kept for the next (scalelm.parallel.hostmemory).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(preference, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        keep_freed_memory()
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend_for(device, cpu_collectives),
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return DistEnv(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=local_rank,
        world_size=world_size,
        device=device,
        procs_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        node_rank=int(os.environ.get("GROUP_RANK", "0")),
    )


def exit_after(main: Callable[[], object]) -> NoReturn:
    """Run a command's `main`, then end the process at once with its exit status, skipping Python's finalization.

    torch keeps process groups alive in global state (device meshes, their sub-groups); when the interpreter is torn
    down with them, gloo's worker threads meet a half-destroyed runtime and, now and then, abort the process
    (SIGABRT, "terminate called without an active exception") after it has done all its work, which fails the job.
    An exception still ends the process the usual way, with its traceback.
    """
    try:
        main()
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def teardown() -> None:
    if is_distributed():
        dist.destroy_process_group()


def global_reduce(values: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """`values` reduced over every rank, in place (as they are without a process group)."""
    if is_distributed():
        dist.all_reduce(values, op=op)
    return values


def all_gather_object(obj):
    """Every rank's obj, in rank order (just [obj] without a process group)."""
    if not is_distributed():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def barrier() -> None:
    if is_distributed():
        dist.barrier()
