"""The site settings (profiles/slurm/site.yaml): typed, checked like the training settings, and turned into what a
job needs from the site: its sbatch options, the shell prelude of a training job and the launcher's flags."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from scalelm.errors import ConfigError
from scalelm.settings_yaml import from_mapping, read_settings, shown

# the collectives the machine's baseline times (scalelm.measure.baseline), and where: over the whole job (across its
# nodes), within one node; a reference's key is `<scope>_<op>`
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all")
SCOPES = ("job", "node")


@dataclass(frozen=True)
class MachineReferences:
    """What the site's machine should deliver, each checked in the summary against the machine's baseline
    (scalelm.measure.baseline): met within the relative tolerance, or missed."""

    matmul_tflops: float | None = None  # one device, the model's matrix products in the training dtype
    # the bus bandwidth (GB/s, nccl-tests' convention) at the baseline's largest message, by `<scope>_<op>`, e.g.
    # job_all_reduce: 91 (across the job's nodes), node_all_reduce: 300 (within a node)
    busbw_gbps: dict[str, float] = field(default_factory=dict)
    tolerance: float = 0.05

    def __post_init__(self) -> None:
        known = [f"{scope}_{op}" for scope in SCOPES for op in OPS]
        for key, value in self.busbw_gbps.items():
            if key not in known:
                raise ConfigError(f"references.busbw_gbps: unknown key {shown(key)} (known: {', '.join(known)})")
            if value <= 0:
                raise ConfigError(f"references.busbw_gbps.{key} must be a positive GB/s, got {value}")
        if self.matmul_tflops is not None and self.matmul_tflops <= 0:
            raise ConfigError(f"references.matmul_tflops must be positive or null, got {self.matmul_tflops}")
        if not 0 <= self.tolerance < 1:
            raise ConfigError(f"references.tolerance must be a fraction from 0 to below 1, got {self.tolerance}")


@dataclass
class SiteConfig:
    account: str | None = None  # sbatch --account
    partition: str | None = None  # sbatch --partition (None: the cluster's default partition)
    # the partition of jobs that need no GPU (consolidation, evaluation); None: `partition`. A GPU partition may
    # refuse such jobs, or charge a whole GPU node for them
    cpu_partition: str | None = None
    reservation: str | None = None  # sbatch --reservation
    qos: str | None = None  # sbatch --qos
    constraint: str | None = None  # sbatch --constraint
    gpus_per_node: int = 0  # 0: CPU-only nodes; else each node's GPUs, one per process (gres gpu:<processes>)
    gpu_memory_gb: float | None = None  # one GPU's memory (GB, 1e9 bytes): experiments are planned against it
    host_suffix: str = ""  # appended to the first node's name for the rendezvous (JSC: "i", InfiniBand names)
    network_interface: str | None = None  # NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME
    port_range: tuple[int, int] = (29500, 29999)  # rendezvous port = low + job id mod size
    modules: list[str] = field(default_factory=list)  # `module load`ed before each training job
    peak_tflops: float | None = None  # one GPU's dense TFLOP/s for MFU, where scalelm's table lacks the GPU
    # the catalogue's GPU and network between nodes (scalelm.plan.catalogue: h100-sxm, ndr-8x): `scalelm plan` takes
    # the step time's speeds, and what gpus_per_node and gpu_memory_gb leave out, from them unless a baseline is given;
    # the names are checked against the catalogue where they are read (scalelm.plan.catalogue.check_site: the planner,
    # the workflow at parse time), the catalogue standing above the site
    gpu: str | None = None
    network: str | None = None
    exclusive: bool = True  # training jobs get whole nodes (sbatch --exclusive): nothing shares a timed job's nodes
    # the nodes' network: with infiniband, a machine baseline in which NCCL chose sockets warns
    # (scalelm.measure.baseline)
    interconnect: Literal["infiniband", "ethernet"] | None = None
    references: MachineReferences = field(default_factory=MachineReferences)
    # where training jobs copy the prepared data first, unless an experiment says (data.stage: scalelm.data.stage):
    # shm (/dev/shm, in memory), local (stage_dir, else the job's $TMPDIR: node-local disk), none
    stage: Literal["none", "shm", "local"] | None = None
    stage_dir: str | None = None
    # Inductor's cache for training jobs (TORCHINDUCTOR_CACHE_DIR): compiled graphs and what train.compile_mode's
    # max-autotune found, reused by every later run that reads it; on a shared file system, by every node's. None:
    # the node-local default (scalelm.launch.container), which a job's /tmp may not outlive; an absolute path
    inductor_cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.gpus_per_node < 0:
            raise ConfigError(f"gpus_per_node must be 0 (CPU nodes) or positive, got {self.gpus_per_node}")
        if self.gpu_memory_gb is not None and self.gpu_memory_gb <= 0:
            raise ConfigError(f"gpu_memory_gb must be one GPU's memory in GB or null, got {self.gpu_memory_gb}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"peak_tflops must be one GPU's positive dense TFLOP/s or null, got {self.peak_tflops}")
        if self.inductor_cache_dir is not None and not Path(self.inductor_cache_dir).is_absolute():
            raise ConfigError(
                f"inductor_cache_dir must be an absolute path (each job's shell does not expand ~ or variables in "
                f"it), got {shown(self.inductor_cache_dir)}"
            )
        low, high = self.port_range
        if not 1024 <= low <= high <= 65535:
            raise ConfigError(f"port_range [{low}, {high}] must be two ports within 1024-65535, the lower first")

    def sbatch_resources(self, gpus: bool = True) -> dict[str, str]:
        """The sbatch options of a job (one that needs no GPU with `gpus=False`), under the resource names the
        Slurm executor plugin reads."""
        named = {
            "slurm_account": self.account,
            "slurm_partition": self.partition if gpus else self.cpu_partition or self.partition,
            "qos": self.qos,
            "constraint": self.constraint,
        }
        return {name: value for name, value in named.items() if value}

    def slurm_extra(self, stop_signal_s: int = 0, training: bool = False, gpus: bool = True) -> str:
        """Further sbatch flags: the reservation (not for a job sent to `cpu_partition`, which it does not cover);
        for training jobs, USR1 `stop_signal_s` before the time limit and, with `exclusive`, whole nodes."""
        reserved = self.reservation and (gpus or not self.cpu_partition)
        flags = [f"--reservation={self.reservation}"] if reserved else []
        if training and self.exclusive:
            flags.append("--exclusive")
        if stop_signal_s:
            flags.append(f"--signal=USR1@{stop_signal_s}")
        return shlex.join(flags)

    def gres(self, procs_per_node: int) -> str:
        return f"gpu:{procs_per_node}" if self.gpus_per_node else ""

    def check_fits(self, experiment: str, procs_per_node: int) -> None:
        if self.gpus_per_node and procs_per_node > self.gpus_per_node:
            raise ConfigError(
                f"experiment {experiment} runs {procs_per_node} processes per node but the site's nodes have "
                f"{self.gpus_per_node} GPUs (gpus_per_node): lower its procs_per_node"
            )

    def prelude(self) -> str:
        """Shell run before a training job: the site's modules, the network interface for NCCL and gloo, and the
        persistent Inductor cache."""
        parts = []
        if self.modules:
            parts.append(shlex.join(["module", "load", *self.modules]))
        if self.network_interface:
            nic = shlex.quote(self.network_interface)
            parts.append(f"export NCCL_SOCKET_IFNAME={nic} GLOO_SOCKET_IFNAME={nic}")
        if self.inductor_cache_dir:
            parts.append(f"export TORCHINDUCTOR_CACHE_DIR={shlex.quote(self.inductor_cache_dir)}")
        return "".join(f"{part} && " for part in parts)

    def launch_flags(self) -> list[str]:
        """scalelm.launch options for the rendezvous across nodes."""
        flags = ["--host-suffix", self.host_suffix] if self.host_suffix else []
        return [*flags, "--port-range", str(self.port_range[0]), str(self.port_range[1])]


def load_site(path: str | Path | None) -> SiteConfig:
    """The site file's settings; without a file (the local default), a site of CPU nodes and Slurm's defaults."""
    if not path:
        return SiteConfig()
    values = read_settings(path, "site file")
    try:
        return from_mapping(SiteConfig, values)
    except ConfigError as err:
        raise ConfigError(f"site file {path}: {err}") from None
