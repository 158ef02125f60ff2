"""The machine's baseline in the summary (scalelm.measure.baseline writes it, one per node count of the matrix):
every collective at every size in machine.csv, and in summary.md each node count's matrix-product rate and bus
bandwidths at the largest message against the site's references (site.yaml `references:`, met within their
tolerance), so that "the network delivered 22% of its reference" sits beside the experiments on those nodes. A
baseline measured beside other work (its `host_load`: scalelm.report.disturbance) is marked in both, and on every run
of its node count: its rates, and the step times planned from them, measure that work too. The report's verdicts on
a baseline (why it was disturbed, by node count) stay beside its record (scalelm.plan.machine), never in it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scalelm.errors import DataError
from scalelm.plan.machine import Figure, MachineBaseline
from scalelm.report.disturbance import DEFAULT_SHARE, baseline_disturbance
from scalelm.report.tables import fmt, markdown_table
from scalelm.site import MachineReferences

COLUMNS = [
    "nodes",
    "procs_per_node",
    "hosts",
    "device",
    "scope",
    "op",
    "ranks",
    "bytes",
    "time_s",
    "time_s_min",
    "time_s_max",
    "algbw_gbps",
    "busbw_gbps",
    "busbw_gbps_min",
    "busbw_gbps_max",
]
CHECK_COLUMNS = ["nodes", "figure", "value", "reference", "share", "threshold", "status"]


def read_baselines(paths: list[Path]) -> list[MachineBaseline]:
    """The baselines, by node count."""
    found = []
    for path in paths:
        try:
            found.append(MachineBaseline.from_json(json.loads(Path(path).read_text())))
        except (OSError, ValueError) as err:
            raise DataError(f"{path} is not a machine baseline ({err}): run the workflow's machine_baseline") from None
    return sorted(found, key=lambda b: b.nodes)


def disturbances(baselines: list[MachineBaseline], share: float = DEFAULT_SHARE) -> dict[int, str]:
    """Why other work disturbed each baseline, by node count (empty if nothing did)."""
    return {b.nodes: baseline_disturbance(b, share) for b in baselines}


def rows(baselines: list[MachineBaseline]) -> list[dict[str, Any]]:
    """machine.csv: every collective at every size, with the node count it ran on."""
    return [
        {
            "nodes": b.nodes,
            "procs_per_node": b.procs_per_node,
            "hosts": " ".join(b.hosts),
            "device": b.device,
            **row.to_json(),
        }
        for b in baselines
        for row in b.collectives
    ]


def check(baselines: list[MachineBaseline], references: MachineReferences) -> list[dict[str, Any]]:
    """Each reference against each baseline that measured its figure: met at reference x (1 - tolerance) or more."""
    checks = []
    for b in baselines:
        measured = {"matmul_tflops": b.matmul_tflops}
        measured |= {f"{key}_busbw_gbps": row.busbw_gbps.median for key, row in b.largest().items()}
        wanted = {"matmul_tflops": references.matmul_tflops}
        wanted |= {f"{key}_busbw_gbps": value for key, value in references.busbw_gbps.items()}
        for figure, reference in wanted.items():
            if reference is None or figure not in measured:
                continue
            value, threshold = measured[figure], reference * (1 - references.tolerance)
            checks.append(
                {
                    "nodes": b.nodes,
                    "figure": figure,
                    "value": value,
                    "reference": reference,
                    "share": value / reference,
                    "threshold": threshold,
                    "status": "met" if value >= threshold else "missed",
                }
            )
    return checks


def flags(nodes: int, checks: list[dict[str, Any]]) -> list[str]:
    """A run's flags from the baseline of its node count: each reference its machine missed."""
    return [
        f"machine below reference ({c['figure']} {c['share']:.0%})"
        for c in checks
        if c["nodes"] == nodes and c["status"] == "missed"
    ]


def model_step_cell(baseline: MachineBaseline) -> str:
    step = baseline.model_step  # not in a baseline of an older scalelm
    return with_spread(step.seconds) if step else ""


def with_spread(figure: Figure) -> str:
    """A median with its spread (min-max), where the baseline measured one (not before scalelm timed repetitions)."""
    return fmt(figure.median) + (f" ({fmt(figure.low)}-{fmt(figure.high)})" if figure.low is not None else "")


def check_cell(check: dict[str, Any], column: str) -> str:
    """A reference check's cell in summary.md: the status in bold, the share as a percentage."""
    if column == "status":
        return f"**{check[column]}**"
    return f"{check[column]:.0%}" if column == "share" else fmt(check[column])


def markdown(baselines: list[MachineBaseline], checks: list[dict[str, Any]], disturbed: dict[int, str]) -> list[str]:
    """summary.md's section: per node count the products' rate and every collective at its largest message, the
    baselines `disturbed` (nodes -> why), then the references."""
    if not baselines:
        return []
    at_largest = [b.largest() for b in baselines]
    keys = sorted({key for found in at_largest for key in found})
    table = [
        [
            str(b.nodes),
            str(b.procs_per_node),
            ", ".join(b.hosts),
            fmt(b.matmul_tflops),
            model_step_cell(b),
            *(with_spread(found[key].busbw_gbps) if key in found else "" for key in keys),
        ]
        for b, found in zip(baselines, at_largest)
    ]
    sizes = sorted({row.bytes for found in at_largest for row in found.values()})
    lines = [
        "",
        "## The machine",
        "",
        "Its baseline (`scalelm.measure.baseline`, every size in `machine.csv`): the model's matrix products "
        "(the slowest rank's TFLOP/s), the model's own step alone (the slowest rank's) and each collective's bus "
        f"bandwidth (nccl-tests' convention) at the largest message ({', '.join(f'{s / 2**20:g} MiB' for s in sizes)}), "
        "over the job (`job_`) and within a node (`node_`); the median of the repetitions, their spread (min-max) in "
        "brackets.",
        "",
    ]
    headers = ["nodes", "processes", "hosts", "matmul TFLOP/s", "model step s", *(f"{key} GB/s" for key in keys)]
    lines += markdown_table(headers, table)
    troubled = [f"on {b.nodes} node(s) {disturbed[b.nodes]}" for b in baselines if disturbed.get(b.nodes)]
    if troubled:
        lines += [
            "",
            "**Disturbed baseline**: measured beside other work, or slower than its runs found the machine, so its "
            "rates, the references they are checked against and the step times planned from them are not the "
            "machine's alone: " + "; ".join(troubled) + ".",
        ]
    if checks:
        lines += ["", "Against the site's references (site.yaml `references:`):", ""]
        lines += markdown_table(CHECK_COLUMNS, [[check_cell(c, k) for k in CHECK_COLUMNS] for c in checks])
    return lines
