"""Process group and device from torchrun's environment: NCCL on the LOCAL_RANK's GPU, gloo on CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from scalelm.errors import ConfigError
from scalelm.parallel.hostmemory import keep_freed_memory


def is_distributed() -> bool:
    """Inside a started process group (torchrun's, or the group of one a distributed strategy starts alone)."""
    return dist.is_available() and dist.is_initialized()


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0



def pick_device(preference: str, local_rank: int) -> torch.device:
    if preference == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: 'cuda' was asked for but no CUDA GPU is visible; use device=auto or device=cpu")
    if preference in ("cuda", "auto") and torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK {local_rank} has no GPU: {torch.cuda.device_count()} visible; "
                "start at most one process per GPU (torchrun --nproc-per-node)"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup(preference: str, needs_group: bool, timeout_s: int) -> DistEnv:
    """Read RANK/WORLD_SIZE/LOCAL_RANK (torchrun), pick the device and start the process group if needed.

    On CPU, host memory freed by one step is kept for the next (scalelm.parallel.hostmemory).

    A distributed strategy started without torchrun runs as a group of one, so the same code path
    (and the same checkpoint format) serves one process too.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(preference, local_rank)
    if world_size > 1 and not needs_group:
        raise ConfigError(
            f"strategy 'single' runs one process, but it was started with WORLD_SIZE={world_size}; "
            "use parallel.strategy=ddp or fsdp, or start one process"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        keep_freed_memory()
    if needs_group and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        if world_size > 1:
            dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def teardown() -> None:
    if is_distributed():
        dist.destroy_process_group()


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
