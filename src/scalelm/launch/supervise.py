"""Run torchrun processes so that a stop signal becomes a checkpoint and exit 75, and a failure stops them all.

    python -m scalelm.launch.supervise -- torchrun ... -m scalelm.train ...

`scalelm.launch` supervises the torchrun(s) it starts on its own host; under Slurm it starts this module on every
node of its `srun` step instead, because Slurm's `--signal` and `scancel --signal` reach the processes of job steps,
not the batch shell the launcher runs in. A stop signal (SIGTERM, SIGUSR1, SIGINT) is passed on as SIGUSR1 to the
training processes themselves, not to torchrun: they checkpoint together (scalelm.train.preemption) and exit 75,
torchrun ends because they did, and the supervisor exits EXIT_PREEMPTED. Asked to stop, torchrun would give its
workers 30 seconds and kill them, whatever the checkpoint's size (torch < 2.12 has no setting for it). torchrun
itself ignores SIGUSR1: it has no handler for it and would die of it, leaving its workers behind.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

import psutil

from scalelm.errors import EXIT_PREEMPTED

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def ignore_usr1() -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # kept across exec; the workers install their own handler


def training_processes(pid: int) -> list[psutil.Process]:
    """The training processes (`-m scalelm.train`) started under process `pid`: a torchrun's workers, or a
    container's, or the spawn launcher, which passes the signal on to its processes (scalelm.launch.spawn). Not the
    utilisation monitor they start (`-m scalelm.measure.sampler`)."""
    try:
        found = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    workers = []
    for process in found:
        try:
            if "scalelm.train" in process.cmdline():
                workers.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return workers


def pass_stop(process: subprocess.Popen) -> None:
    """Ask the training under `process` to checkpoint and stop; before it has started (torchrun still meeting its
    other nodes) there is nothing to save, and torchrun is asked to stop."""
    workers = training_processes(process.pid)
    for worker in workers:
        try:
            worker.send_signal(signal.SIGUSR1)
        except psutil.NoSuchProcess:
            continue
    if not workers and process.poll() is None:
        process.send_signal(signal.SIGTERM)


def supervise(commands: list[list[str]]) -> int:
    """Run the commands concurrently; when one fails, stop the others; return the first non-zero status,
    or EXIT_PREEMPTED after a stop signal (the workers have checkpointed; rerunning resumes)."""
    # what the processes inherit and a failure is first read from: their threads and the GPUs this step was given
    shown = [f"{name}={os.environ[name]}" for name in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES") if name in os.environ]
    for command in commands:
        print("+", *shown, shlex.join(command), flush=True)
    processes = [subprocess.Popen(c, preexec_fn=ignore_usr1) for c in commands]
    stop_signals = []

    def stop(signum, frame):
        stop_signals.append(signum)
        for p in processes:
            if p.poll() is None:
                pass_stop(p)

    for sig in STOP_SIGNALS:
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
        print(
            f"stopped by {signal.Signals(stop_signals[0]).name} on {os.uname().nodename}: rerun to resume", flush=True
        )
        return EXIT_PREEMPTED
    return status


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1 :] if "--" in argv else argv
    if not command:
        sys.exit("usage: python -m scalelm.launch.supervise -- COMMAND [ARGS ...]")
    sys.exit(supervise([command]))


if __name__ == "__main__":
    main()
