"""Where and with what a run ran: resolved config, code version, software versions, hosts, container, times."""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any

import torch

import scalelm
from scalelm.launch.container import EMULATED_ENV
from scalelm.measure import nvml
from scalelm.measure.hostload import machine_id
from scalelm.parallel.env import all_gather_object
from scalelm.version import git_commit, installed, installed_closure, lock_facts

# Environment variables worth keeping; everything else (tokens, keys) stays out of the files we write.
RECORDED_ENV = (
    "SLURM_JOB_ID",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_NUM_NODES",
    "SLURM_CLUSTER_NAME",
    "SLURM_JOB_PARTITION",
    "APPTAINER_CONTAINER",
    EMULATED_ENV,  # the launcher's, for an image of another architecture run under QEMU
    "APPTAINER_NAME",
    "OMP_NUM_THREADS",
)
CONTAINER_LABELS = Path("/.singularity.d/labels.json")


def container() -> dict[str, Any] | None:
    if not (os.environ.get("APPTAINER_CONTAINER") or os.environ.get("SINGULARITY_CONTAINER")):
        return None
    info: dict[str, Any] = {"image": os.environ.get("APPTAINER_CONTAINER") or os.environ.get("SINGULARITY_CONTAINER")}
    if CONTAINER_LABELS.is_file():
        info["labels"] = json.loads(CONTAINER_LABELS.read_text())
    return info


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def cpu_model() -> str | None:
    """The host CPU's model name (/proc/cpuinfo on Linux, the platform's own answer elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def driver_version() -> str | None:
    """The NVIDIA driver's version, from NVML; None where NVML cannot say (no driver, no library)."""
    try:
        version = nvml.binding().nvmlSystemGetDriverVersion()
    except Exception:  # NVMLError, ImportError, an old binding: a fact missing, not a failed run
        return None
    return version.decode() if isinstance(version, bytes) else str(version)


def device_facts() -> dict[str, Any]:
    """What a figure depends on besides the software: the CPU, the GPU and its driver, NCCL, and whether fp32
    matmuls ran on TF32 tensor cores."""
    facts: dict[str, Any] = {"float32_matmul_precision": torch.get_float32_matmul_precision(), "cpu": cpu_model()}
    facts["architecture"] = platform.machine()  # an image's, under QEMU emulation (scalelm launch --allow-emulation)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        facts["name"] = torch.cuda.get_device_name()
        facts["driver"] = driver_version()
        facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        facts["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    return facts


def software() -> dict[str, Any]:
    """The code's commit and the versions of everything it runs with, against the lock."""
    distributions = installed()
    return {
        "git_commit": git_commit(),
        "versions": {
            "scalelm": scalelm.__version__,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "packages": installed_closure(distributions=distributions),
            "lock": lock_facts(distributions),
        },
    }


def collect(config_dict: dict[str, Any], world_size: int, main: bool) -> dict[str, Any]:
    """Call on every rank (gathers the host names); the result matters on the `main` rank, which alone reads the
    software's versions (every installed package's metadata: most of a second, which a tiny run's ranks would each
    pay)."""
    hosts = all_gather_object(socket.gethostname())
    machines = all_gather_object(machine_id())
    return {
        "config": config_dict,
        **(software() if main else {}),
        "world_size": world_size,
        # torchrun's view: GROUP_WORLD_SIZE agents (one per node) of LOCAL_WORLD_SIZE workers each
        "launch": {
            "nodes": int(os.environ.get("GROUP_WORLD_SIZE", "1")),
            "procs_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        },
        "hostnames": hosts,
        "machines": machines,  # by rank: which ranks share a machine's cores (several "nodes" may be one machine)
        "nodes": sorted(set(hosts)),
        "device": device_facts(),
        "container": container(),
        "environment": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ},
        "start_time": now(),
    }
