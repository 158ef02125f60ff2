"""Everything scalelm asks of Slurm: on the login node, what the partition can give; inside a job, its nodes, CPUs
and requeue count, and the rendezvous port derived from its id.

Slurm accepts a job that asks for more nodes than its partition has (unless the site sets EnforcePartLimits) and
leaves it pending for ever (reason PartitionNodeLimit): the workflow would wait with it. So the workflow asks
`sinfo` first and refuses such an experiment by name.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from dataclasses import dataclass

from scalelm.errors import ConfigError


@dataclass
class Allocation:
    hosts: list[str]
    cpus_per_node: int  # the CPUs of the job's one task per node
    restarts: int  # times Slurm requeued the job (node failure, preemption)


def allocation(job_id: str) -> Allocation:
    """Hosts and CPUs of the job, from the controller: Snakemake's Slurm executor strips every SLURM_* variable but
    the job id from a job's environment, and srun no longer takes --cpus-per-task from it (Slurm 22.05)."""
    job = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True)
    fields = dict(f.split("=", 1) for f in job.stdout.split() if "=" in f)
    out = subprocess.run(
        ["scontrol", "show", "hostnames", fields["NodeList"]], capture_output=True, text=True, check=True
    )
    return Allocation(out.stdout.split(), int(fields.get("CPUs/Task", "1")), int(fields.get("Restarts", "0")))


def job_port(job_id: str, port_range: tuple[int, int], probe: bool = False) -> int:
    """The rendezvous port of a multi-node job: derived from the job id, so that jobs sharing a node differ.

    With `probe` (the launcher runs on the rendezvous host, Slurm's batch host) a port already in use there is
    skipped for the next one of the range; the launcher alone decides and passes it to every node on the srun line.
    """
    low, high = port_range
    if not 1024 <= low <= high <= 65535:
        raise ConfigError(
            f"launch port range {low}-{high} is not within 1024-65535; fix port_range in the site file "
            "(profiles/slurm/site.yaml)"
        )
    size = high - low + 1
    candidates = [low + (int(job_id) + i) % size for i in range(size)]
    if not probe:
        return candidates[0]
    for port in candidates:
        if port_is_free(port):
            return port
    raise ConfigError(
        f"launch port range {low}-{high} is exhausted: all {size} ports are in use on {socket.gethostname()}; "
        "widen port_range in the site file (profiles/slurm/site.yaml)"
    )


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def srun_step(job_id: str, nodes: int, cpus_per_node: int, gpus_per_node: int = 0) -> list[str]:
    """A job step of one task per node with all of the node's CPUs and GPUs of the job; one failing task ends the
    step. A step gets only the GPUs it asks for (Slurm 20.11 on), and its one task must see them all: no binding."""
    gpus = [f"--gres=gpu:{gpus_per_node}", "--gpu-bind=none"] if gpus_per_node else []
    return [
        "srun",
        f"--jobid={job_id}",
        f"--nodes={nodes}",
        f"--ntasks={nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={cpus_per_node}",
        *gpus,
        "--kill-on-bad-exit=1",
    ]


def partition_nodes(partition: str | None) -> tuple[str, int] | None:
    """(name, number of nodes) of `partition`, or of the cluster's default partition; None where sinfo is missing
    or does not answer (no cluster here: the scheduler will judge)."""
    if shutil.which("sinfo") is None:
        return None
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %P"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        return None
    nodes: dict[str, set[str]] = {}
    default = None
    for line in out.stdout.splitlines():
        node, name = line.split()
        if name.endswith("*"):
            name = default = name[:-1]
        nodes.setdefault(name, set()).add(node)
    name = partition or default
    if name is None:
        return None
    if name not in nodes:
        raise ConfigError(
            f"partition {name!r} does not exist on this cluster (sinfo lists {', '.join(sorted(nodes))}); "
            "fix partition in the site file (profiles/slurm/site.yaml)"
        )
    return name, len(nodes[name])


def check_node_counts(nodes_by_experiment: dict[str, int], partition: str | None) -> None:
    """Refuse an experiment that asks for more nodes than the partition has."""
    found = partition_nodes(partition)
    if found is None:
        return
    name, available = found
    for experiment, nodes in sorted(nodes_by_experiment.items()):
        if nodes > available:
            raise ConfigError(
                f"experiment {experiment} asks for {nodes} nodes but partition {name} has {available} (sinfo); "
                "lower its nodes in the config, or choose a larger partition in profiles/slurm/site.yaml"
            )
