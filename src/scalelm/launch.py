"""Start one training run on `nodes` x `procs_per_node` processes, wherever the job landed.

    python -m scalelm.launch --nodes 2 --procs-per-node 4 [--container IMAGE ...] -- --config train.yaml

- one node: `torchrun --standalone --nproc-per-node=P -m scalelm.train ...`
- several nodes inside a Slurm allocation: `srun --ntasks-per-node=1 torchrun --nnodes=N ... --rdzv-backend=c10d
  --rdzv-endpoint=<first host><suffix>:<port> --rdzv-id=$SLURM_JOB_ID`, the port derived from the job id so that two
  jobs sharing a node do not collide;
- several "nodes" without Slurm (the local default): N torchrun processes on this machine, meeting on a free port.

With --container, each torchrun runs inside the image (`apptainer exec --cleanenv [--nv] --bind ...`).
The launcher prints the command it runs, and exits with the status of the first failing process.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from scalelm.errors import ConfigError, friendly_errors
from scalelm.preemption import EXIT_PREEMPTED

TRAIN = ["-m", "scalelm.train"]


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


def slurm_hosts(job_id: str) -> list[str]:
    """Hosts of the allocation. Snakemake's Slurm executor strips SLURM_JOB_NODELIST from a job's environment
    (only SLURM_JOB_ID is left), so ask the controller when it is missing."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        job = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True)
        fields = dict(f.split("=", 1) for f in job.stdout.split() if "=" in f)
        nodelist = fields["NodeList"]
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()


def container_prefix(image: str | None, binds: Sequence[str], gpu: bool, runtime: str) -> list[str]:
    if not image:
        return []
    prefix = [runtime, "exec", "--cleanenv"]
    if gpu:
        prefix.append("--nv")
    for bind in binds:
        prefix += ["--bind", bind]
    # --cleanenv drops the host environment; pass on what torchrun and NCCL/gloo need
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS", "SLURM_JOB_ID"):
        if name in os.environ:
            prefix += ["--env", f"{name}={os.environ[name]}"]
    return [*prefix, image]


def torchrun(nnodes: int, nproc: int, rendezvous: list[str]) -> list[str]:
    return ["torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", *rendezvous]


def ignore_usr1() -> None:
    """In torchrun (before exec): it has no handler for SIGUSR1 and would die of Slurm's --signal=USR1, leaving
    its workers behind. Its workers install their own handler (scalelm.preemption)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def run_all(commands: list[list[str]]) -> int:
    """Run the commands concurrently; when one fails, stop the others; return the first non-zero status,
    or EXIT_PREEMPTED after a stop signal (the workers have checkpointed; rerunning resumes)."""
    for command in commands:
        print(f"+ OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}", shlex.join(command), flush=True)
    processes = [subprocess.Popen(c, preexec_fn=ignore_usr1) for c in commands]
    stop_signals = []

    def stop(signum, frame):  # torchrun turns SIGTERM into a graceful stop of its workers
        stop_signals.append(signum)
        for p in processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, stop)
    status = 0
    while any(p.poll() is None for p in processes):
        failed = [p.returncode for p in processes if p.returncode not in (None, 0)]
        if failed and not status:
            status = failed[0]
            for p in processes:
                if p.poll() is None:
                    p.terminate()
        time.sleep(0.2)
    status = status or next((p.returncode for p in processes if p.returncode), 0)
    if stop_signals and status:
        print(f"stopped by signal {signal.Signals(stop_signals[0]).name}: rerun to resume", flush=True)
        return EXIT_PREEMPTED
    return status


def threads_per_process(processes_here: int) -> int:
    """CPU threads for each training process on this node: the CPUs this job may use, shared out.
    Snakemake exports OMP_NUM_THREADS=<rule threads> to every job; kept, each of several workers would start that
    many threads and oversubscribe the cores (measured: 9x slower DDP on 2 cores)."""
    return max(1, len(os.sched_getaffinity(0)) // processes_here)


def build_commands(args: argparse.Namespace, train_args: list[str]) -> list[list[str]]:
    local_nodes = args.nodes > 1 and "SLURM_JOB_ID" not in os.environ
    processes_here = args.procs_per_node * (args.nodes if local_nodes else 1)
    os.environ["OMP_NUM_THREADS"] = str(threads_per_process(processes_here))
    inside = container_prefix(args.container, args.bind, args.gpu, args.container_runtime)
    tail = [*TRAIN, *train_args]
    if args.nodes == 1:
        return [[*inside, *torchrun(1, args.procs_per_node, ["--standalone"]), *tail]]
    if "SLURM_JOB_ID" in os.environ:
        hosts = slurm_hosts(os.environ["SLURM_JOB_ID"])
        if len(hosts) < args.nodes:
            raise ConfigError(f"the allocation has {len(hosts)} node(s) but the experiment needs {args.nodes}")
        on_rendezvous_host = socket.gethostname().split(".")[0] == hosts[0]
        port = job_port(os.environ["SLURM_JOB_ID"], args.port_range, probe=on_rendezvous_host)
        endpoint = f"{hosts[0]}{args.host_suffix}:{port}"
        rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={os.environ['SLURM_JOB_ID']}"]
        srun = [
            "srun", f"--jobid={os.environ['SLURM_JOB_ID']}", f"--nodes={args.nodes}", f"--ntasks={args.nodes}",
            "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        ]  # fmt: skip
        return [[*srun, *inside, *torchrun(args.nodes, args.procs_per_node, rendezvous), *tail]]
    # no scheduler: every "node" is a torchrun process on this machine
    port = free_port()
    rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=local-{port}"]
    return [[*inside, *torchrun(args.nodes, args.procs_per_node, rendezvous), *tail] for _ in range(args.nodes)]


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
    sys.exit(run_all(build_commands(args, train_args)))


if __name__ == "__main__":
    main()
