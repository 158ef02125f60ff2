"""The step-time model in the summary: each run's layout timed (scalelm.plan.steptime) with the speeds of the
machine's baseline on the run's node count, beside the step the run took, so that a layout slower than its machine
allows stands out from a machine slower than its references (scalelm.report.machine). An error from a baseline or a
run that other work disturbed (scalelm.report.disturbance) says so: it measures that work too."""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

from scalelm.config import from_dict
from scalelm.errors import ConfigError
from scalelm.parallel.dims import ParallelDims
from scalelm.plan.machine import ENDS, MachineBaseline
from scalelm.plan.memory import Workload
from scalelm.plan.steptime import Speeds, StepTime, predict
from scalelm.report.disturbance import baseline_unlike_its_runs, contaminated
from scalelm.report.figures import RunSummary
from scalelm.report.tables import fmt, markdown_table

PLANNED = ("planned_step_time_s", "planned_compute_s", "planned_comm_s", "planned_bubble_s", "planned_all_to_all_s")
# the step planned at the fast and the slow end of the baseline's spread (its repetitions' fastest and slowest)
SPREAD = ("planned_step_time_s_min", "planned_step_time_s_max")
GOAL = 0.25  # the model's aim: within 25% of the measured step, or within the baseline's spread where wider


def planned_step(run: RunSummary, vocab_size: int, speeds: Speeds) -> StepTime:
    """The model's step time of `run`'s layout, its threads and its machines, at `speeds`."""
    record = run.record
    work = Workload(from_dict(record.config), vocab_size, "cpu" if speeds.on_cpu else "cuda")
    # (cp and ep: 1 in the records of runs from before them)
    degrees = {name: record.parallel.get(name, 1) for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")}
    threads = record.environment.get("OMP_NUM_THREADS")
    return predict(
        work,
        ParallelDims(**degrees),
        record.launch["procs_per_node"],
        speeds,
        threads=int(threads) if threads else None,
        ranks_on_host=max(Counter(record.machines or record.hostnames).values(), default=1),
    )


def add_planned(runs: list[RunSummary], baselines: list[MachineBaseline], disturbed: dict[int, str]) -> dict[int, str]:
    """The PLANNED columns of every run whose node count has a baseline the model can read (None for the others: a
    baseline of an older scalelm lacks its figures, and says so without stopping the summary), and why that
    baseline was disturbed (`machine_disturbed`): by other work (`disturbed`, by node count), or unlike the machine
    all its runs found (`baseline_unlike_its_runs`). Returns the verdicts with the latter added."""
    by_nodes = {}
    for baseline in baselines:
        try:
            by_nodes[baseline.nodes] = {at: Speeds.from_baseline(baseline, at=at) for at in ENDS}
        except ConfigError as err:
            print(f"scalelm: no planned step time on {baseline.nodes} node(s): {err}", file=sys.stderr)
    for run in runs:
        speeds = by_nodes.get(run.figures["nodes"]) if run.vocab_size else None
        steps = {at: planned_step(run, run.vocab_size, speeds[at]) for at in ENDS} if speeds else {}
        step = steps.get("median")
        values = (
            (step.total_s, step.compute_s, sum(step.communication_s.values()), step.bubble_s, step.all_to_all_s)
            if step
            else (None,) * len(PLANNED)
        )
        run.figures.update(dict(zip(PLANNED, values)))
        run.figures.update(dict(zip(SPREAD, (steps["fast"].total_s, steps["slow"].total_s) if steps else (None, None))))
    verdicts = dict(disturbed)
    for baseline in baselines:
        unlike = baseline_unlike_its_runs([run.figures for run in runs if run.figures["nodes"] == baseline.nodes], GOAL)
        verdicts[baseline.nodes] = "; ".join(reason for reason in (disturbed.get(baseline.nodes), unlike) if reason)
    for run in runs:
        run.figures["machine_disturbed"] = verdicts.get(run.figures["nodes"], "")
        run.figures["steptime_blame"] = blame(run.figures)
    return verdicts


def error(row: dict[str, Any]) -> float | None:
    """The measured step over the planned one, less 1: +0.2 took 20% longer than planned."""
    measured, planned = row.get("step_time_s"), row.get("planned_step_time_s")
    return measured / planned - 1 if measured and planned else None


def within(row: dict[str, Any]) -> bool:
    """Whether the measured step is within GOAL of the planned one, or within the step planned at either end of
    the baseline's spread."""
    measured, low, high = row.get("step_time_s"), row.get("planned_step_time_s_min"), row.get("planned_step_time_s_max")
    return abs(error(row)) <= GOAL or (low is not None and high is not None and low <= measured <= high)


def blame(row: dict[str, Any]) -> str:
    """For a step outside its goal (`within`): the part of the plan furthest from what the run measured, with the
    gap in milliseconds per step (+: longer than planned). The run's profiled steps tell its collectives' share
    (comm_share, all_to_all_share) and a pipeline's bubble; compute is the rest. Empty where the step is within its
    goal, or unprofiled (its collectives unknown)."""
    if error(row) is None or within(row) or row.get("comm_share") is None:
        return ""
    step = row["step_time_s"]
    comm, all_to_all = row["comm_share"] * step, (row.get("all_to_all_share") or 0.0) * step
    bubble = (row.get("bubble_measured") or 0.0) * step
    planned_all_to_all = row.get("planned_all_to_all_s") or 0.0
    gaps = {
        "compute": step - comm - bubble - row["planned_compute_s"],
        "communication": comm - all_to_all - (row["planned_comm_s"] - planned_all_to_all),
        "all-to-all": all_to_all - planned_all_to_all,
        "bubble": bubble - row["planned_bubble_s"],
    }
    term = max(gaps, key=lambda name: abs(gaps[name]))
    return f"{term} {gaps[term] * 1e3:+.1f} ms"


def error_cell(row: dict[str, Any]) -> str:
    """The error as a percentage, and what disturbed it: e.g. `+242% (machine baseline disturbed)`."""
    if error(row) is None:
        return ""
    disturbed = [
        what
        for what, reason in (("machine baseline", row.get("machine_disturbed")), ("run", contaminated(row)))
        if reason
    ]
    return f"{error(row):+.0%}" + (f" ({' and '.join(disturbed)} disturbed)" if disturbed else "")


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The section of summary.md: per run, the measured step beside the planned one and its parts."""
    timed = [r for r in rows if r.get("planned_step_time_s")]
    if not timed:
        return []
    columns = ["experiment", "seed", "layout", "step_time_s", *PLANNED]
    lines = [
        "",
        "## Step time: measured and planned",
        "",
        "The planned step of each layout on its machine (docs/plan.md's step-time model, with the medians of the "
        "machine's baseline on the run's node count): matrix products and elementwise work (compute), the "
        "collectives the step waits for (comm; expert parallelism's all-to-alls among them), the pipeline's "
        "bubble; the spread, the step planned at the fast and the slow end of the baseline's repetitions. Error: "
        "measured over planned, less 1; where other work disturbed the machine's baseline or the run, the error "
        f"measures that work too, and says so. Beyond {GOAL:.0%} and outside the spread, the part of the plan "
        "furthest from what the run's profiled steps measured is blamed.",
        "",
    ]
    cells = [
        [fmt(r.get(c)) for c in columns] + [spread_cell(r), error_cell(r), r.get("steptime_blame") or ""] for r in timed
    ]
    lines += markdown_table([*columns, "planned spread", "error", "blame"], cells)
    return lines


def spread_cell(row: dict[str, Any]) -> str:
    low, high = row.get("planned_step_time_s_min"), row.get("planned_step_time_s_max")
    return f"{fmt(low)}-{fmt(high)}" if low is not None and high is not None else ""
