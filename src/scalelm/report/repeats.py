"""The seeds of an experiment as one: mean, sample standard deviation, min and max of each figure.

summary.csv keeps one row per experiment x seed; summary_by_experiment.csv has one row per experiment with these
statistics, and expectations (scalelm.report.expectations) are checked against their means. The standard deviation
is empty for a single seed. `disturbed_seeds` counts the seeds whose speed figures measure other work too, and
`scaling_flag` gathers the seeds' flags on speedup and efficiency (scalelm.report.disturbance): a mean over disturbed
seeds is marked as such.
"""

from __future__ import annotations

import statistics
from typing import Any

from scalelm.report.disturbance import contaminated, experiment_flags
from scalelm.report.figures import SHARED, STATISTICS
from scalelm.report.tables import fmt, markdown_table

SPREAD = ("mean", "std", "min", "max")
COLUMNS = [
    *SHARED,
    "seeds",
    "disturbed_seeds",
    "scaling_flag",
    *(f"{figure}_{stat}" for figure in STATISTICS for stat in SPREAD),
]


def spread(values: list[float | None]) -> dict[str, float | None]:
    known = [v for v in values if v is not None]
    if not known:
        return dict.fromkeys(SPREAD)
    return {
        "mean": statistics.fmean(known),
        "std": statistics.stdev(known) if len(known) > 1 else None,
        "min": min(known),
        "max": max(known),
    }


def group_by_experiment(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each experiment's runs, experiments in the order of their first run."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["experiment"], []).append(row)
    return groups


def by_experiment(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary per experiment: the shared columns, the number of seeds and of those disturbed, the seeds'
    scaling flags, and the spread of each figure."""
    summaries = []
    for runs in group_by_experiment(rows).values():
        summary = {key: runs[0].get(key) for key in SHARED} | {"seeds": len(runs)}
        summary["disturbed_seeds"] = sum(bool(contaminated(r)) for r in runs)
        summary["scaling_flag"] = "; ".join(
            dict.fromkeys(f for r in runs for f in (r.get("scaling_flag") or "").split("; ") if f)
        )
        for figure in STATISTICS:
            for stat, value in spread([r.get(figure) for r in runs]).items():
                summary[f"{figure}_{stat}"] = value
        summaries.append(summary)
    return summaries


def markdown(summaries: list[dict[str, Any]]) -> list[str]:
    """summary.md's section per experiment: the statistics over its seeds, the speedup's baseline named."""
    base = next(s for s in summaries if s["experiment"] == s["baseline"])
    lines = [
        "",
        "## Per experiment",
        "",
        "Mean over the seeds, with several seeds `mean ± std (min–max)` (sample standard deviation). Speedup "
        f"and scaling efficiency in total tokens/s against `{base['experiment']}` ({base['world_size']} "
        "device(s)); strong scaling: global batch fixed, weak: batch per device fixed.",
        "",
    ]
    columns = ["experiment", "scaling", "world_size", "seeds"]
    return lines + markdown_table(
        [*columns, *STATISTICS, "flags"],
        [
            [fmt(s[c]) for c in columns] + [fmt_spread(s, f) for f in STATISTICS] + [experiment_flags(s)]
            for s in summaries
        ],
    )


def fmt_spread(summary: dict[str, Any], figure: str) -> str:
    """mean, and with several seeds `mean ± std (min–max)`."""
    mean = fmt(summary[f"{figure}_mean"])
    if summary["seeds"] == 1 or summary[f"{figure}_std"] is None:
        return mean
    low, high = fmt(summary[f"{figure}_min"]), fmt(summary[f"{figure}_max"])
    return f"{mean} ± {fmt(summary[f'{figure}_std'])} ({low}–{high})"
