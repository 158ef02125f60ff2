"""The lecture's launcher: `torch.multiprocessing.spawn` starts one node's processes, the world size given by the
user, where torchrun would (`launcher: spawn` in an experiment; torchrun stays the default).

    python -m scalelm.launch.spawn --nprocs 2 -- -m scalelm.train --config train.yaml

Each process gets the environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT), then runs the module as `python -m` would: the program cannot tell the two
launchers apart, so the training is the same, bitwise on CPU. What spawn lacks is torchrun's rendezvous across
nodes and its restarts: one node only. A stop signal (SIGUSR1 from scalelm.launch.supervise, SIGTERM, SIGINT) is
passed on to the processes as SIGUSR1: they checkpoint together and exit 75, as under torchrun.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys

import torch.multiprocessing as mp

from scalelm.launch.launcher import free_port
from scalelm.launch.supervise import STOP_SIGNALS
from scalelm.parallel.env import one_node_environment


def worker(local_rank: int, nprocs: int, port: int, module: str, argv: list[str]) -> None:
    os.environ.update(one_node_environment(local_rank, nprocs, port))
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def spawn(nprocs: int, module: str, argv: list[str]) -> int:
    """Run `python -m module argv` in `nprocs` processes; the first failing one's exit status, else 0."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the processes start ignoring it, until the training's handler
    context = mp.start_processes(
        worker, args=(nprocs, free_port(), module, argv), nprocs=nprocs, join=False, start_method="spawn"
    )

    def stop(signum, frame):
        for pid in context.pids():
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                continue

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)
    try:
        while not context.join(timeout=0.5, grace_period=5):  # then SIGTERM, and SIGKILL 5 s later
            pass
    except mp.ProcessRaisedException as err:  # an exception the program let out; the others are stopped
        print(err, file=sys.stderr, flush=True)
        return 1
    except mp.ProcessExitedException as err:  # a program's own exit status (75 after a stop signal, ...)
        return err.exit_code if err.exit_code > 0 else 128 - err.exit_code
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    program = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(prog="python -m scalelm.launch.spawn", description=__doc__.split("\n")[0])
    parser.add_argument("--nprocs", type=int, required=True, help="processes on this node (the world size)")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.nprocs < 1 or len(program) < 2 or program[0] != "-m":
        parser.error("usage: --nprocs N (1 or more) -- -m MODULE [ARGS ...]")
    sys.exit(spawn(args.nprocs, program[1], program[2:]))


if __name__ == "__main__":
    main()
