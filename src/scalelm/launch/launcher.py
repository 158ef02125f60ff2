"""Start one training run on `nodes` x `procs_per_node` processes, wherever the job landed.

    python -m scalelm.launch --nodes 2 --procs-per-node 4 [--container IMAGE ...] -- --config train.yaml
    python -m scalelm.launch --program baseline --nodes 2 --procs-per-node 4 -- --out baseline.json

- without a scheduler: `torchrun --standalone --nproc-per-node=P -m scalelm.train ...` on one node (or with
  `--launcher spawn`, `python -m scalelm.launch.spawn --nprocs P -- -m scalelm.train ...`: the lecture's
  torch.multiprocessing.spawn, one node only); several
  "nodes" (the local default) are N torchrun processes on this machine, meeting on a free port;
- inside a Slurm allocation: one `srun` step with one task per node, each `python -m scalelm.launch.supervise --
  torchrun ...` (`--standalone` on one node; else `--nnodes=N --rdzv-backend=c10d --rdzv-endpoint=<first host>
  <suffix>:<port> --rdzv-id=$SLURM_JOB_ID`, the port derived from the job id so that two jobs sharing a node do not
  collide).

With --container, each torchrun runs inside the image (`apptainer exec --cleanenv [--nv] --bind ...`); in a Slurm
step each node's container gets what Slurm set for that node (its CUDA_VISIBLE_DEVICES, ...), and the compile
caches are node-local (scalelm.launch.container).
The launcher prints the command it runs and exits with the status of the first failing process, or 75 after a stop
signal once the workers have checkpointed (scalelm.launch.supervise).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from scalelm.errors import ConfigError, friendly_errors
from scalelm.launch import slurm
from scalelm.launch.container import (
    EMULATED_ENV,
    check_architecture,
    exec_prefix,
    passed_environment,
    step_prefix,
)
from scalelm.launch.supervise import supervise
from scalelm.parallel.hostmemory import with_huge_pages

# what the processes run: a training, or the machine's baseline (scalelm.measure.baseline) on the same geometry
PROGRAMS = {"train": "scalelm.train", "baseline": "scalelm.measure.baseline"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(nnodes: int, nproc: int, rendezvous: list[str]) -> list[str]:
    return ["torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", *rendezvous]


def check_launcher(launcher: str, nodes: int, keys: tuple[str, str] = ("--launcher", "--nodes")) -> None:
    """spawn has no rendezvous across nodes: one node only (`keys` name the two settings as the caller knows them)."""
    if launcher == "spawn" and nodes > 1:
        raise ConfigError(
            f"{keys[0]} spawn starts one node's processes, but {keys[1]} is {nodes}: use torchrun, "
            "whose rendezvous joins the nodes"
        )


def starter(args: argparse.Namespace, python: str, rendezvous: list[str]) -> list[str]:
    """What starts a node's processes: torchrun, or the lecture's torch.multiprocessing.spawn (one node)."""
    if args.launcher == "spawn":
        return [python, "-m", "scalelm.launch.spawn", f"--nprocs={args.procs_per_node}", "--"]
    return torchrun(args.nodes, args.procs_per_node, rendezvous)


# What Snakemake exports to every job as <rule threads>; MKL (torch's CPU matrix products) and OpenBLAS read theirs.
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


def threads_per_process(cpus: int, processes: int) -> int:
    """CPU threads for each training process on a node: the node's CPUs for this job, shared out."""
    return max(1, cpus // processes)


def limit_threads(threads: int) -> None:
    """OMP_NUM_THREADS for every training process, and every other thread count already set (by Snakemake, to the
    rule's threads): kept, each of several workers would start that many threads and oversubscribe the cores
    (docs/benchmarks.md, "Threads per process")."""
    for name in THREAD_VARIABLES:
        if name == "OMP_NUM_THREADS" or name in os.environ:
            os.environ[name] = str(threads)


def in_image(args: argparse.Namespace, slurm_step: bool = False) -> list[str]:
    """The container prefix of each torchrun (empty without --container), set after OMP_NUM_THREADS; in a Slurm
    step each node's container gets that node's GPUs and ranks, not the batch node's (container.step_prefix)."""
    if not args.container:
        return []
    if slurm_step:
        return step_prefix(args.container_runtime, args.container, args.bind, args.gpu, os.environ)
    return exec_prefix(args.container_runtime, args.container, args.bind, args.gpu, passed_environment(os.environ))


def build_commands(args: argparse.Namespace, train_args: list[str]) -> list[list[str]]:
    os.environ["GLIBC_TUNABLES"] = with_huge_pages(os.environ.get("GLIBC_TUNABLES"))
    if "SLURM_JOB_ID" in os.environ:
        return [slurm_command(args, train_args, os.environ["SLURM_JOB_ID"])]
    processes_here = args.procs_per_node * args.nodes  # without a scheduler every "node" runs here
    limit_threads(threads_per_process(len(os.sched_getaffinity(0)), processes_here))
    inside = in_image(args)
    tail = ["-m", PROGRAMS[args.program], *train_args]
    if args.nodes == 1:
        return [[*inside, *starter(args, "python" if inside else sys.executable, ["--standalone"]), *tail]]
    port = free_port()
    rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=local-{port}"]
    return [[*inside, *torchrun(args.nodes, args.procs_per_node, rendezvous), *tail] for _ in range(args.nodes)]


def slurm_command(args: argparse.Namespace, train_args: list[str], job_id: str) -> list[str]:
    """One srun step with one task per node, each `scalelm.launch.supervise` around that node's torchrun.

    Also on one node: Slurm's --signal reaches job steps, not the batch shell, and the train rule runs in the batch
    shell (its `mpi` resource), so the stop signal reaches the training and its supervisor only.
    """
    allocation = slurm.allocation(job_id)
    if len(allocation.hosts) < args.nodes:
        raise ConfigError(f"the allocation has {len(allocation.hosts)} node(s) but the experiment needs {args.nodes}")
    if allocation.restarts:
        print(f"Slurm requeued job {job_id} ({allocation.restarts} time(s)): the training resumes", flush=True)
    limit_threads(threads_per_process(allocation.cpus_per_node, args.procs_per_node))
    if args.nodes == 1:
        rendezvous = ["--standalone"]
    else:
        on_rendezvous_host = socket.gethostname().split(".")[0] == allocation.hosts[0]
        port = slurm.job_port(job_id, args.port_range, probe=on_rendezvous_host)
        endpoint = f"{allocation.hosts[0]}{args.host_suffix}:{port}"
        rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job_id}"]
    inside = in_image(args, slurm_step=True)
    python = "python" if inside else sys.executable  # the image's own Python, or this one
    supervisor = [python, "-m", "scalelm.launch.supervise", "--"]
    step = slurm.srun_step(job_id, args.nodes, allocation.cpus_per_node, args.procs_per_node if args.gpu else 0)
    program = ["-m", PROGRAMS[args.program], *train_args]
    return [*step, *inside, *supervisor, *starter(args, python, rendezvous), *program]


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m scalelm.launch", description=__doc__.split("\n")[0])
    parser.add_argument("--program", choices=PROGRAMS, default="train", help="what to run (default: train)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument(
        "--launcher",
        choices=("torchrun", "spawn"),
        default="torchrun",
        help="what starts a node's processes (spawn: torch.multiprocessing.spawn, one node only)",
    )
    parser.add_argument("--procs-per-node", type=int, default=1)
    parser.add_argument("--container", help="Apptainer image to run torchrun in (default: none)")
    parser.add_argument("--container-runtime", default="apptainer", help="apptainer or singularity")
    parser.add_argument(
        "--allow-emulation",
        action="store_true",
        help="with --container: run an image built for another architecture under QEMU emulation (slow: to prove an "
        "image, not to time)",
    )
    parser.add_argument("--bind", action="append", default=[], help="apptainer --bind (repeatable)")
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="one GPU per process: the Slurm step asks for them, the container gets them (--nv)",
    )
    parser.add_argument("--host-suffix", default="", help="appended to the head node's name, e.g. 'i' at JSC")
    parser.add_argument("--port-range", type=int, nargs=2, default=(29500, 29999), metavar=("LOW", "HIGH"))
    args = parser.parse_args(argv)
    if not train_args:  # torchrun would start the program with its defaults, and fail there with a traceback
        raise ConfigError(
            f"nothing to run: give the {args.program} program's arguments after `--`, e.g. `python -m scalelm.launch "
            "--nodes 1 --procs-per-node 2 -- --config train.yaml` (--help lists the launcher's options)"
        )
    for key in ("nodes", "procs_per_node"):
        if getattr(args, key) <= 0:
            raise ConfigError(f"--{key.replace('_', '-')} must be positive, got {getattr(args, key)}")
    if args.allow_emulation and not args.container:  # it would change nothing: said, not ignored
        raise ConfigError(
            "--allow-emulation applies only with --container IMAGE (it lets an image built for another architecture "
            "run under QEMU); without an image the run is on this machine's own Python: give --container, or drop "
            "--allow-emulation"
        )
    check_launcher(args.launcher, args.nodes)
    return args, train_args


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    args, train_args = parse_args(argv)
    if args.container:
        emulated = check_architecture(args.container_runtime, args.container, allow_emulation=args.allow_emulation)
        if emulated:  # into the image's environment (PASSED_ENV), and so into each run's record
            os.environ[EMULATED_ENV] = emulated
    sys.exit(supervise(build_commands(args, train_args)))
