"""Process group and device from torchrun's environment: NCCL on the LOCAL_RANK's GPU, gloo on CPU.

SCALELM_SHARE_GPU=1 puts every rank of a node on its first GPU (cuda:0), for correctness tests of multi-rank layouts
on a machine with one GPU (bench/gpu_paths.py, check I), never for speed: NCCL refuses two ranks on one device
("Duplicate GPU detected") unless each looks like a node of its own, so each rank gets an NCCL_HOSTID of its own
and NCCL's transport between nodes over the loopback interface (`shared_gpu_environment`; unsupported by NVIDIA,
contexts time-sliced). DistEnv.local_rank stays torchrun's (one rank of a node stages the data and samples the GPU).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Mapping
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


SHARE_GPU = "SCALELM_SHARE_GPU"


def shares_gpu(environ: Mapping[str, str] = os.environ) -> bool:
    """SCALELM_SHARE_GPU: 1, every rank of a node on its first GPU; unset, empty or 0, one GPU per rank."""
    value = environ.get(SHARE_GPU, "")
    if value not in ("", "0", "1"):
        raise ConfigError(f"{SHARE_GPU}={value!r}: set it to 1 (every rank on the node's first GPU) or 0, or unset it")
    return value == "1"


def shared_gpu_environment(rank: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What NCCL needs to run this rank beside others on one GPU: a host id of its own (NCCL hashes NCCL_HOSTID in
    place of the host name, so the ranks look like nodes of one GPU each and NCCL's duplicate check passes), and its
    transport between nodes on the loopback interface without InfiniBand or NVLink SHARP (transport settings already
    made stay; a job-wide NCCL_HOSTID does not)."""
    defaults = {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo", "NCCL_NVLS_ENABLE": "0", "NCCL_MNNVL_ENABLE": "0"}
    made = {name: environ[name] for name in defaults if name in environ}
    return {**defaults, **made, "NCCL_HOSTID": f"{socket.gethostname()}-rank{rank}"}


def pick_device(preference: str, local_rank: int, share_gpu: bool = False) -> torch.device:
    """The device of the process with torchrun's `local_rank`: its own GPU, or with `share_gpu` the node's first."""
    if preference == "cuda" and not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(
            f"device: 'cuda' was asked for but no CUDA GPU is visible (torch {torch.__version__}, {build}); run on a "
            "GPU node with a CUDA build of torch, or use device=auto or device=cpu"
        )
    if preference in ("cuda", "auto") and torch.cuda.is_available():
        index = 0 if share_gpu else local_rank
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK {local_rank} has no GPU: {torch.cuda.device_count()} visible; "
                f"start at most one process per GPU (torchrun --nproc-per-node), or set {SHARE_GPU}=1 to test a "
                "layout's correctness with every rank on one GPU"
            )
        return torch.device("cuda", index)
    return torch.device("cpu")


def backend_for(device: torch.device, cpu_collectives: bool = False) -> str:
    """The process group's backend: gloo on CPU, NCCL on CUDA; with `cpu_collectives` (FSDP's CPU offload keeps
    gradients on the host, and their norm is all-reduced there) gloo for CPU tensors beside NCCL."""
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"


def one_node_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What torchrun gives each worker on one node (what `setup` reads, and torch's env:// rendezvous), for the
    launchers that stand in for it: torch.multiprocessing.spawn (scalelm.launch.spawn) and the tests' forked ranks."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def setup(preference: str, timeout_s: int, cpu_collectives: bool = False) -> DistEnv:
    """Read torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK, pick the device
    (SCALELM_SHARE_GPU:
    the module's docstring) and, for more than one process, start the process group (`backend_for`).

    On CPU, host memory freed by one step is kept for the next (scalelm.parallel.hostmemory).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank, rank = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("RANK", "0"))
    share_gpu = shares_gpu()
    device = pick_device(preference, local_rank, share_gpu)
    if device.type == "cuda":
        if share_gpu:  # before NCCL starts: it reads its host id once
            os.environ.update(shared_gpu_environment(rank))
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
        rank=rank,
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
