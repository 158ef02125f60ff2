"""Run torchrun processes so that a stop signal becomes a checkpoint and exit 75, and a failure stops them all.

    python -m scalelm.launch.supervise -- torchrun ... -m scalelm.train ...

`scalelm.launch` supervises the torchrun(s) it starts on its own host; under Slurm it starts this module on every
node of its `srun` step instead, because Slurm's `--signal` and `scancel --signal` reach the processes of job steps,
not the batch shell the launcher runs in. A stop signal (SIGTERM, SIGUSR1, SIGINT) is passed to torchrun as SIGTERM,
which torchrun turns into a graceful stop of its workers; they checkpoint (scalelm.train.preemption) and the supervisor
exits EXIT_PREEMPTED. torchrun itself ignores SIGUSR1: it has no handler for it and would die of it, leaving its
workers behind.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

from scalelm.train.preemption import EXIT_PREEMPTED

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def ignore_usr1() -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # kept across exec; the workers install their own handler


def supervise(commands: list[list[str]]) -> int:
    """Run the commands concurrently; when one fails, stop the others; return the first non-zero status,
    or EXIT_PREEMPTED after a stop signal (the workers have checkpointed; rerunning resumes)."""
    threads = os.environ.get("OMP_NUM_THREADS")
    for command in commands:
        print("+", *([f"OMP_NUM_THREADS={threads}"] if threads else []), shlex.join(command), flush=True)
    processes = [subprocess.Popen(c, preexec_fn=ignore_usr1) for c in commands]
    stop_signals = []

    def stop(signum, frame):
        stop_signals.append(signum)
        for p in processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

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
        print(f"stopped by {signal.Signals(stop_signals[0]).name} on {os.uname().nodename}: rerun to resume", flush=True)
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
