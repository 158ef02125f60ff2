"""Whether other work disturbed a run's timing, or a machine baseline's, and what that taints: the one home of the
report's "disturbed".

A run records each host's CPU use while it trained, by its own processes and by everything else (run.json
`host_load`, scalelm.measure.hostload); the machine baseline records the same. The cores a run was given on a
machine are its ranks there times their threads (OMP_NUM_THREADS, which the launcher sets to the cores it was given,
shared out), at most the machine's CPUs; without a thread count, the machine's CPUs. Hosts of one machine (containers
on one kernel: one boot id in run.json `machines`) are counted together, so that one "node"'s ranks are not the
other's other work. Other work of more than `share` of those cores on any of its machines (DEFAULT_SHARE; the study's
`disturbed_share:`) disturbed the run: on a CPU its speed figures measure the run and that work together (a test
suite taking 1.04 of a 2-core run's cores left it 754 instead of about 14,000 tokens/s); a tenth of its cores may
slow it by a tenth, twice the results history's default tolerance.

A run in an image of another architecture, under QEMU emulation (the launcher's --allow-emulation, which records
SCALELM_EMULATED in run.json), is disturbed whatever else ran: its timings measure the emulator. A machine baseline
is also doubted when every one of its runs was much faster than even the fast end of what it planned from it
(`baseline_unlike_its_runs`).

What is derived from a disturbed run is marked too: a speed figure of a run that was disturbed or shared its host
with another run (`contaminated`), a speedup or efficiency against such a baseline run, and an efficiency above
IMPLAUSIBLE_EFFICIENCY, which neither caches nor a better layout explain (`scaling_flag`).
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from scalelm.launch.container import EMULATED_ENV
from scalelm.plan.machine import MachineBaseline
from scalelm.report.figures import TIMED
from scalelm.train.record import RunRecord

DEFAULT_SHARE = 0.1  # of the cores the run was given
IMPLAUSIBLE_EFFICIENCY = 1.25  # a quarter beyond linear scaling
SCALED = ("speedup", "scaling_efficiency")  # the figures that compare a run with the baseline's runs


def other_work(
    host_load: dict[str, dict[str, Any]], ranks: dict[str, int], threads: int | None, machine_of: dict[str, str]
) -> list[tuple[str, float, float]]:
    """Per machine of `host_load` (host -> its readings), its hosts' names, the cores other work took there, and the
    cores the run was given there (`ranks` per host, `threads` each; None: unknown)."""
    machines: dict[str, list[str]] = {}
    for host in host_load:
        machines.setdefault(machine_of.get(host) or host, []).append(host)
    found = []
    for hosts in machines.values():
        loads = [host_load[host] for host in hosts]
        if all("busy_cores" in load for load in loads):  # one machine's busy cores, seen from each of its hosts
            busy = statistics.fmean(load["busy_cores"] for load in loads)
            other = max(0.0, busy - sum(load["run_cores"] for load in loads))
        else:
            other = max(load["other_cores"] for load in loads)
        cpus = max((load.get("cpus") or 0 for load in loads), default=0)
        on_machine = sum(ranks.get(host, 0) for host in hosts)
        given = min([x for x in (cpus, on_machine * (threads or 0)) if x], default=0)
        found.append(("+".join(hosts), other, float(given)))
    return found


def disturbance(
    host_load: dict[str, dict[str, Any]],
    ranks: dict[str, int],
    threads: int | None,
    machine_of: dict[str, str],
    share: float = DEFAULT_SHARE,
) -> str:
    """Why the run was disturbed, e.g. `other work took 1.04 of the 2 cores it was given on vm`; empty if it was not
    (or nothing was recorded)."""
    reasons = [
        f"other work took {other:.2f} of the {given:g} cores it was given on {hosts}"
        for hosts, other, given in other_work(host_load, ranks, threads, machine_of)
        if given and other > share * given
    ]
    return "; ".join(reasons)


def run_disturbance(record: RunRecord, share: float = DEFAULT_SHARE) -> str:
    """`disturbance` of a run's record; a run in an image of another architecture, under QEMU (the launcher's
    --allow-emulation), measured the emulator."""
    reasons = [
        disturbance(
            record.host_load or {},
            Counter(record.hostnames),
            _whole(record.environment.get("OMP_NUM_THREADS")),
            dict(zip(record.hostnames, record.machines)),
            share,
        )
    ]
    if record.environment.get(EMULATED_ENV):
        reasons.append(f"run under QEMU emulation ({record.environment[EMULATED_ENV]})")
    return "; ".join(reason for reason in reasons if reason)


def baseline_disturbance(baseline: MachineBaseline, share: float = DEFAULT_SHARE) -> str:
    """`disturbance` of a machine baseline (one without `host_load`, of an older scalelm, is not judged)."""
    ranks = baseline.per_rank
    return disturbance(
        baseline.host_load or {},
        Counter(r.host for r in ranks),
        _whole(ranks[0].threads) if ranks else None,
        {r.host: r.machine for r in ranks},
        share,
    )


MIN_RUNS_TO_DOUBT = 3  # a baseline's runs that must all agree before it is doubted


def baseline_unlike_its_runs(rows: list[dict[str, Any]], goal: float) -> str:
    """Why a machine baseline did not measure the machine its runs ran on: every one of its runs (at least
    MIN_RUNS_TO_DOUBT rows with `step_time_s`, `planned_step_time_s` and `planned_step_time_s_min`, the step planned
    at the fast end of the baseline's spread) took less than 1 - `goal` of its planned step and less than even the
    fast end: it timed something slower than its runs, which the host's CPU readings cannot show (another model
    than theirs, as a baseline that ran before the data was prepared once did; a VM's host slowing it down for a
    minute). Empty otherwise."""
    planned = [row for row in rows if row.get("step_time_s") and row.get("planned_step_time_s")]
    ratios = [row["step_time_s"] / row["planned_step_time_s"] for row in planned]
    if len(planned) < MIN_RUNS_TO_DOUBT or max(ratios) >= 1 - goal:
        return ""
    if any(row["step_time_s"] >= (row.get("planned_step_time_s_min") or 0.0) for row in planned):
        return ""
    return (
        f"slower than the machine its {len(planned)} runs found: each took at most {max(ratios):.0%} of its planned "
        "step, less than the fast end of the spread; measure it again (`snakemake --forcerun machine_baseline`)"
    )


def _whole(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def contaminated(row: dict[str, Any]) -> str:
    """Why a run's speed figures measure more than the run (a row of summary.csv, or of the results history): other
    work on its hosts, another run beside it; empty if neither."""
    reasons = [
        row.get("disturbed") or "",
        f"not isolated (with {row['overlapped_by']})" if row.get("overlapped_by") else "",
    ]
    return "; ".join(r for r in reasons if r)


def figure_caveat(row: dict[str, Any], figure: str) -> str:
    """Why `figure` of a run (a row of summary.csv or of the results history) is not the run's own: its timing was
    contaminated (a figure of time), or its speedup compares it with a disturbed baseline run; empty if neither."""
    if figure not in TIMED:
        return ""
    reasons = [contaminated(row), (row.get("scaling_flag") or "") if figure in SCALED else ""]
    return "; ".join(r for r in reasons if r)


def scaling_flag(row: dict[str, Any], baseline_runs: list[dict[str, Any]]) -> str:
    """What a reader must know about a run's speedup and efficiency: the `baseline_runs` it was compared with were
    disturbed, or the efficiency is implausible (above IMPLAUSIBLE_EFFICIENCY), with its likely cause."""
    found = [
        f"baseline disturbed ({r['experiment']} seed {r['seed']})"
        for r in baseline_runs
        if r is not row and contaminated(r)
    ]
    efficiency = row.get("scaling_efficiency")
    if efficiency is not None and efficiency > IMPLAUSIBLE_EFFICIENCY:
        cause = (
            "its disturbed baseline"
            if found
            else "a baseline run slower than its machine allows (other work on its hosts, a throttled device)"
        )
        found.append(f"implausible efficiency (above {IMPLAUSIBLE_EFFICIENCY:g}): likely {cause}")
    return "; ".join(found)


def seeds_caveat(summary: dict[str, Any], figure: str) -> str:
    """`figure_caveat` of an experiment's mean (a row of summary_by_experiment.csv), e.g. `1 of 2 seeds disturbed`."""
    if figure not in TIMED:
        return ""
    reasons = []
    if summary.get("disturbed_seeds"):
        reasons.append(f"{summary['disturbed_seeds']} of {summary['seeds']} seed(s) disturbed")
    if figure in SCALED and summary.get("scaling_flag"):
        reasons.append(summary["scaling_flag"])
    return "; ".join(reasons)


def experiment_flags(summary: dict[str, Any]) -> str:
    """What a reader must not miss about an experiment's speed figures (a row of summary_by_experiment.csv): its
    disturbed seeds, its flagged speedups; empty if nothing."""
    found = []
    if summary.get("disturbed_seeds"):
        found.append(f"{summary['disturbed_seeds']} of {summary['seeds']} seed(s) disturbed")
    if summary.get("scaling_flag"):
        found.append(summary["scaling_flag"])
    return ", ".join(found)
