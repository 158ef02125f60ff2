"""Training ranks forked from one server that imported torch and scalelm once (multiprocessing's forkserver, its
preload): a rank starts at once instead of paying an interpreter and scalelm's imports (about 4 s of a core here).

A test launcher only, for runs where nothing process-level is under test: each rank gets the variables torchrun
would give a single-node job (rank, world, rendezvous address), its own stdout and stderr, and the job fails as
torchrun's does when one rank fails. torchrun itself stays where the launcher is part of what is tested
(tests/test_launch.py, the faults and stop signals, one layout of the parity test, Lightning, the per-node monitor,
the no-warning test). The server forks before any rank computed anything, so no thread is copied.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import subprocess
import sys
import tempfile
import time
from multiprocessing import forkserver
from pathlib import Path

from scalelm.version import installed

PRELOAD = ["forked", "scalelm.train.run", "scalelm.train.trainer", "scalelm.parallel.env"]
# read once in the server, as a long-lived process reads it once: the installed packages' metadata (scalelm.version
# caches it), which a run's first rank records and every rank forked from here then has
installed()
# the others' time to end by themselves once a rank failed, as torchrun waits: on a machine busy with other tests a
# rank can lag its peer by seconds on its way to the same error
FAILED_RANK_GRACE_S = 30

_context = None


def context() -> multiprocessing.context.ForkServerContext:
    """The session's fork server, started at the first launch with one thread per rank: OMP_NUM_THREADS=1 is read
    when torch's OpenMP loads, in the server, so the server alone starts with it (this process keeps its own)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
        before = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            forkserver.ensure_running()
        finally:
            if before is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = before
    return _context


def rank_main(argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    """One rank: the environment, stdout and stderr it was given, then `python -m scalelm.train` as a process."""
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    from scalelm.parallel.env import exit_after
    from scalelm.train.run import main

    sys.argv = ["python -m scalelm.train", *argv]
    exit_after(lambda: main(argv))


def run_forked(argv: list[str], nproc: int, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`python -m scalelm.train ARGV` on `nproc` forked ranks of one node, as `torchrun --standalone` runs it: the
    ranks' stdout and stderr in rank order, the first failed rank's exit status."""
    from scalelm.launch.launcher import free_port
    from scalelm.parallel.env import one_node_environment

    ctx = context()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="forked-") as logs:
        ranks = []
        for rank in range(nproc):
            rank_env = {**env, **(one_node_environment(rank, nproc, port) if nproc > 1 else {})}
            paths = (f"{logs}/{rank}.out", f"{logs}/{rank}.err")
            process = ctx.Process(target=rank_main, args=(argv, rank_env, *paths), name=f"rank{rank}")
            process.start()
            ranks.append((process, paths))
        status = wait(ranks, timeout, argv)
        out, err = ("".join(Path(paths[i]).read_text() for _, paths in ranks) for i in (0, 1))
    return subprocess.CompletedProcess(["forked", *argv], status, out, err)


def wait(ranks: list, timeout: float, argv: list[str]) -> int:
    """Every rank's end; once one fails, the others get FAILED_RANK_GRACE_S before they are killed."""
    deadline, failed_at = time.monotonic() + timeout, None
    while any(process.is_alive() for process, _ in ranks):
        codes = [process.exitcode for process, _ in ranks]
        if failed_at is None and any(code not in (None, 0) for code in codes):
            failed_at = time.monotonic()
        now = time.monotonic()
        if now > deadline or (failed_at is not None and now > failed_at + FAILED_RANK_GRACE_S):
            for process, _ in ranks:
                process.kill()
            for process, _ in ranks:
                process.join()
            if now > deadline:
                raise subprocess.TimeoutExpired(["forked", *argv], timeout)
            break
        multiprocessing.connection.wait([process.sentinel for process, _ in ranks if process.is_alive()], 0.5)
    codes = [process.exitcode for process, _ in ranks]
    return next((code for code in codes if code != 0), 0)
