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
from scalelm.plan.memory import Workload
from scalelm.plan.steptime import Speeds, StepTime, predict
from scalelm.report.disturbance import contaminated
from scalelm.report.figures import RunSummary
from scalelm.report.tables import fmt, markdown_table

PLANNED = ("planned_step_time_s", "planned_compute_s", "planned_comm_s", "planned_bubble_s")


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


def add_planned(runs: list[RunSummary], baselines: list[dict[str, Any]]) -> None:
    """The PLANNED columns of every run whose node count has a baseline the model can read (None for the others: a
    baseline of an older scalelm lacks its figures, and says so without stopping the summary), and why that
    baseline was disturbed (`machine_disturbed`)."""
    by_nodes, disturbed = {}, {b["nodes"]: b.get("disturbed") or "" for b in baselines}
    for baseline in baselines:
        try:
            by_nodes[baseline["nodes"]] = Speeds.from_baseline(baseline)
        except ConfigError as err:
            print(f"scalelm: no planned step time on {baseline['nodes']} node(s): {err}", file=sys.stderr)
    for run in runs:
        speeds = by_nodes.get(run.figures["nodes"])
        step = planned_step(run, run.vocab_size, speeds) if speeds and run.vocab_size else None
        values = (step.total_s, step.compute_s, sum(step.communication_s.values()), step.bubble_s) if step else ()
        run.figures.update(dict(zip(PLANNED, values or (None,) * len(PLANNED))))
        run.figures["machine_disturbed"] = disturbed.get(run.figures["nodes"], "")


def error(row: dict[str, Any]) -> float | None:
    """The measured step over the planned one, less 1: +0.2 took 20% longer than planned."""
    measured, planned = row.get("step_time_s"), row.get("planned_step_time_s")
    return measured / planned - 1 if measured and planned else None


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
        "The planned step of each layout on its machine (docs/plan.md's step-time model, with the speeds of the "
        "machine's baseline on the run's node count): matrix products and elementwise work (compute), the "
        "collectives the step waits for (comm), the pipeline's bubble. Error: measured over planned, less 1; "
        "where other work disturbed the machine's baseline or the run, the error measures that work too, and "
        "says so.",
        "",
    ]
    lines += markdown_table([*columns, "error"], [[fmt(r.get(c)) for c in columns] + [error_cell(r)] for r in timed])
    return lines
