"""Start one training run on `nodes` x `procs_per_node` processes, wherever the job landed.

    python -m scalelm.launch --nodes 2 --procs-per-node 4 [--container IMAGE ...] -- --config train.yaml

- without a scheduler: `torchrun --standalone --nproc-per-node=P -m scalelm.train ...` on one node; several
  "nodes" (the local default) are N torchrun processes on this machine, meeting on a free port;
- inside a Slurm allocation: one `srun` step with one task per node, each `python -m scalelm.supervise -- torchrun
  ...` (`--standalone` on one node; else `--nnodes=N --rdzv-backend=c10d --rdzv-endpoint=<first host><suffix>:<port>
  --rdzv-id=$SLURM_JOB_ID`, the port derived from the job id so that two jobs sharing a node do not collide).

With --container, each torchrun runs inside the image (`apptainer exec --cleanenv [--nv] --bind ...`).
The launcher prints the command it runs and exits with the status of the first failing process, or 75 after a stop
signal once the workers have checkpointed (scalelm.supervise).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from scalelm.errors import ConfigError, friendly_errors
from scalelm.supervise import supervise

TRAIN = ["-m", "scalelm.train"]
# apptainer --cleanenv drops the host environment; these are what torchrun and NCCL/gloo need from it
CONTAINER_ENV = (
    "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS", "SLURM_JOB_ID", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
)  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_port(job_id: str, port_range: tuple[int, int], probe: bool = False) -> int:
    """The rendezvous port of a multi-node job: derived from the job id, so that jobs sharing a node differ.

    With `probe` (the launcher runs on the rendezvous host, Slurm's batch host) a port already in use there is
    skipped for the next one of the range; the launcher alone decides and passes it to every node on the srun line.
    """
    low, high = port_range
    if not 1024 <= low <= high <= 65535:
        raise ConfigError(f"launch port range {low}-{high} is not within 1024-65535; fix launch.port_range")
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


@dataclass
class Allocation:
    hosts: list[str]
    cpus_per_node: int  # the CPUs of the job's one task per node
    restarts: int  # times Slurm requeued the job (node failure, preemption)


def slurm_allocation(job_id: str) -> Allocation:
    """Hosts and CPUs of the job, from the controller: Snakemake's Slurm executor strips every SLURM_* variable but
    the job id from a job's environment, and srun no longer takes --cpus-per-task from it (Slurm 22.05)."""
    job = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True)
    fields = dict(f.split("=", 1) for f in job.stdout.split() if "=" in f)
    out = subprocess.run(
        ["scontrol", "show", "hostnames", fields["NodeList"]], capture_output=True, text=True, check=True
    )
    return Allocation(out.stdout.split(), int(fields.get("CPUs/Task", "1")), int(fields.get("Restarts", "0")))


def container_prefix(image: str | None, binds: Sequence[str], gpu: bool, runtime: str) -> list[str]:
    if not image:
        return []
    prefix = [runtime, "exec", "--cleanenv"]
    if gpu:
        prefix.append("--nv")
    for bind in binds:
        prefix += ["--bind", bind]
    for name in CONTAINER_ENV:
        if name in os.environ:
            prefix += ["--env", f"{name}={os.environ[name]}"]
    return [*prefix, image]


def torchrun(nnodes: int, nproc: int, rendezvous: list[str]) -> list[str]:
    return ["torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", *rendezvous]


def threads_per_process(cpus: int, processes: int) -> int:
    """CPU threads for each training process on a node: the node's CPUs for this job, shared out.
    Snakemake exports OMP_NUM_THREADS=<rule threads> to every job; kept, each of several workers would start that
    many threads and oversubscribe the cores (measured: 9x slower DDP on 2 cores)."""
    return max(1, cpus // processes)


def build_commands(args: argparse.Namespace, train_args: list[str]) -> list[list[str]]:
    if "SLURM_JOB_ID" in os.environ:
        return [slurm_command(args, train_args, os.environ["SLURM_JOB_ID"])]
    processes_here = args.procs_per_node * args.nodes  # without a scheduler every "node" runs here
    os.environ["OMP_NUM_THREADS"] = str(threads_per_process(len(os.sched_getaffinity(0)), processes_here))
    inside = container_prefix(args.container, args.bind, args.gpu, args.container_runtime)
    tail = [*TRAIN, *train_args]
    if args.nodes == 1:
        return [[*inside, *torchrun(1, args.procs_per_node, ["--standalone"]), *tail]]
    port = free_port()
    rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=local-{port}"]
    return [[*inside, *torchrun(args.nodes, args.procs_per_node, rendezvous), *tail] for _ in range(args.nodes)]


def slurm_command(args: argparse.Namespace, train_args: list[str], job_id: str) -> list[str]:
    """One srun step with one task per node, each `scalelm.supervise` around that node's torchrun.

    Also on one node: Slurm's --signal reaches job steps, not the batch shell, and the train rule runs in the batch
    shell (its `mpi` resource), so the stop signal reaches the training and its supervisor only.
    """
    allocation = slurm_allocation(job_id)
    if len(allocation.hosts) < args.nodes:
        raise ConfigError(f"the allocation has {len(allocation.hosts)} node(s) but the experiment needs {args.nodes}")
    if allocation.restarts:
        print(f"Slurm requeued job {job_id} ({allocation.restarts} time(s)): the training resumes", flush=True)
    os.environ["OMP_NUM_THREADS"] = str(threads_per_process(allocation.cpus_per_node, args.procs_per_node))
    if args.nodes == 1:
        rendezvous = ["--standalone"]
    else:
        on_rendezvous_host = socket.gethostname().split(".")[0] == allocation.hosts[0]
        port = job_port(job_id, args.port_range, probe=on_rendezvous_host)
        endpoint = f"{allocation.hosts[0]}{args.host_suffix}:{port}"
        rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job_id}"]
    srun = [
        "srun", f"--jobid={job_id}", f"--nodes={args.nodes}", f"--ntasks={args.nodes}", "--ntasks-per-node=1",
        f"--cpus-per-task={allocation.cpus_per_node}", "--kill-on-bad-exit=1",
    ]  # fmt: skip
    inside = container_prefix(args.container, args.bind, args.gpu, args.container_runtime)
    python = "python" if inside else sys.executable  # the image's own Python, or this one
    supervisor = [python, "-m", "scalelm.supervise", "--"]
    return [*srun, *inside, *supervisor, *torchrun(args.nodes, args.procs_per_node, rendezvous), *TRAIN, *train_args]


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m scalelm.launch", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--procs-per-node", type=int, default=1)
    parser.add_argument("--container", help="Apptainer image to run torchrun in (default: none)")
    parser.add_argument("--container-runtime", default="apptainer", help="apptainer or singularity")
    parser.add_argument("--bind", action="append", default=[], help="apptainer --bind (repeatable)")
    parser.add_argument("--gpu", action="store_true", help="pass the GPUs into the container (--nv)")
    parser.add_argument("--host-suffix", default="", help="appended to the head node's name, e.g. 'i' at JSC")
    parser.add_argument("--port-range", type=int, nargs=2, default=(29500, 29999), metavar=("LOW", "HIGH"))
    args = parser.parse_args(argv)
    for key in ("nodes", "procs_per_node"):
        if getattr(args, key) <= 0:
            raise ConfigError(f"--{key.replace('_', '-')} must be positive, got {getattr(args, key)}")
    return args, train_args


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    args, train_args = parse_args(argv)
    sys.exit(supervise(build_commands(args, train_args)))


if __name__ == "__main__":
    main()
