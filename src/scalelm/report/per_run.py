"""summary.md's first section: one row per run with what a reader looks at first (every figure: summary.csv), the
flags a reader must not miss, and the notes under the table (runs that shared a host or that other work disturbed,
flagged comparisons with the baseline, what the two MFU columns count)."""

from __future__ import annotations

from typing import Any

from scalelm.report import history_compare, machine
from scalelm.report.tables import fmt, markdown_table

# the summary's first table: what a reader looks at first, per run (every figure: summary.csv)
LEAD = [
    "experiment",
    "seed",
    "layout",
    "world_size",
    "tokens_per_s_per_device",
    "speedup",
    "scaling_efficiency",
    "mfu",
    "mfu_causal",
    "comm_share",
    "peak_mem_mb_per_rank",
    "state_mb_per_rank",
    "test_perplexity",
]


def flags(
    row: dict[str, Any], checks: list[dict[str, Any]], changes: list[history_compare.Change], machine_checks: list[dict]
) -> str:
    """What a reader must not miss about a run: shared hosts, other work on them, a disturbed or implausible
    comparison with the baseline, a straggler, a machine below its reference or measured beside other work, missed
    expectations (or any on disturbed runs), regressions since last time (and whether a side was disturbed)."""
    found = ["not isolated"] if row["overlapped_by"] else []
    found += ["disturbed"] if row.get("disturbed") else []
    found += [row["scaling_flag"]] if row.get("scaling_flag") else []
    found += [f"straggler {row['straggler']}"] if row.get("straggler") else []
    found += machine.flags(row["nodes"], machine_checks)
    found += ["machine baseline disturbed"] if row.get("machine_disturbed") else []
    found += [
        f"{c['status'].replace('no reference', 'no reference for')} {c['expectation']}"
        + (" (disturbed)" if c.get("disturbed") else "")
        for c in checks
        if c["experiment"] == row["experiment"] and (c["status"] != "met" or c.get("disturbed"))
    ]
    found += [
        f"{c.verdict} {c.figure}" + (" (disturbed)" if c.disturbed else "")
        for c in changes
        if c.experiment == row["experiment"] and c.verdict.startswith("regression")
    ]
    return ", ".join(found)


def markdown(
    rows: list[dict[str, Any]],
    checks: list[dict[str, Any]],
    changes: list[history_compare.Change],
    machine_checks: list[dict[str, Any]],
    disturbed_share: float,
) -> list[str]:
    """The section: the table, then its notes."""
    lines = ["Per run; every figure of every run is in `summary.csv`.", ""]
    lines += markdown_table(
        [*LEAD, "flags"], [[fmt(r.get(c)) for c in LEAD] + [flags(r, checks, changes, machine_checks)] for r in rows]
    )
    shared = [f"`{r['experiment']}` seed {r['seed']} (with {r['overlapped_by']})" for r in rows if r["overlapped_by"]]
    if shared:
        lines += [
            "",
            "**Not isolated**: trained while another run trained on the same host, so their speed figures "
            "measure both: " + ", ".join(shared) + ".",
        ]
    return lines + disturbed_notes(rows, disturbed_share) + mfu_note(rows)


def mfu_note(rows: list[dict[str, Any]]) -> list[str]:
    """What the two MFU columns count, and the peaks they divide by."""
    peaks = sorted({r["peak_tflops"] for r in rows if r.get("peak_tflops")})
    if not peaks:
        return []
    return [
        "",
        "**MFU**: the model's training FLOPs per second over its devices' dense peak "
        f"({', '.join(fmt(p) for p in peaks)} TFLOP/s per device; `peak_tflops` in `summary.csv`). `mfu` counts "
        "attention over the whole sequence (scalelm's and torchtitan's count), `mfu_causal` the causal half of it "
        "(llm.c's): compare each with MFU counted the same way.",
    ]


def disturbed_notes(rows: list[dict[str, Any]], share: float) -> list[str]:
    """The notes under the lead table: the runs other work disturbed and why, the comparisons with the baseline
    flagged."""
    lines = []
    disturbed = [f"`{r['experiment']}` seed {r['seed']} ({r['disturbed']})" for r in rows if r.get("disturbed")]
    if disturbed:
        lines += [
            "",
            f"**Disturbed**: other work on their hosts took more than {share:g} of the cores they were given "
            "(`disturbed_share`), so their speed figures, and every speedup against them, measure that work "
            "too: " + ", ".join(disturbed) + ".",
        ]
    flagged = [f"`{r['experiment']}` seed {r['seed']} ({r['scaling_flag']})" for r in rows if r.get("scaling_flag")]
    if flagged:
        lines += ["", "**Speedup and efficiency flagged**: " + ", ".join(flagged) + "."]
    return lines
