"""Snakemake's own command line, as the Slurm tier (tests/test_slurm.py) runs it: `python tests/slurm_snakemake.py ARGS`
is `snakemake ARGS` with the Slurm executor's status checks at most POLL_CAP_S apart.

The executor plugin (snakemake-executor-plugin-slurm 2.x) waits 10 s longer after every status check that finds none
of its jobs completed (checks 1, 12, 33, 64, 105, 156 s after a submission, up to 180 s apart), which on a real cluster
spares the controller during a study of hours. The test cluster's jobs take seconds to a minute: a job that ended after
70 s was noticed at 105 s, a resubmission of a stopped job waited 26 s, and after a failed job (which does not reset the
wait) Snakemake took another 53 s to exit, sleeping out its last interval. Nothing else changes: the same Snakemake,
profile, plugin and jobs, only polled sooner.
"""

from __future__ import annotations

import sys

from snakemake.cli import main
from snakemake_interface_executor_plugins.executors.remote import RemoteExecutor

POLL_CAP_S = 2  # a sacct query takes about 0.1 s here


def cap_status_check_interval(cap_s: float = POLL_CAP_S) -> None:
    interval = RemoteExecutor.__dict__.get("next_seconds_between_status_checks")
    if not isinstance(interval, property) or interval.fset is None:
        # a newer snakemake-interface-executor-plugins: find its new hook rather than poll as slowly as before
        raise RuntimeError("RemoteExecutor.next_seconds_between_status_checks is no longer a settable property")
    RemoteExecutor.next_seconds_between_status_checks = property(
        interval.fget, lambda executor, seconds: interval.fset(executor, min(seconds, cap_s))
    )


if __name__ == "__main__":
    cap_status_check_interval()
    sys.exit(main())
