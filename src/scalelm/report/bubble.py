"""Pipeline runs in the study: the summary's bubble columns and the figure of one step per pipeline experiment.

The figure is the picture the course draws: a row per pipeline rank, a box for each forward (F), loss (L) and
backward (B) of a micro-batch, numbered (hatched: a later virtual stage of the rank, under the interleaved schedule),
where the rank worked on it, from the run's own timestamps
(scalelm.parallel.pipeline.StageTimeline). The empty stretches are the bubble.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scalelm.report.figures import RunSummary
from scalelm.train.record import Results

COLORS = {"F": "#9ecae1", "L": "#bdbdbd", "B": "#fd8d3c"}


def columns(results: Results) -> dict[str, Any]:
    """The summary's pipeline columns of a run's results (empty for other layouts)."""
    pipeline = results.pipeline
    if not pipeline:
        return {
            "pp_schedule": "",
            "pp_microbatches": None,
            "bubble_predicted": None,
            "bubble_measured": None,
            "peak_mem_mb_per_pp_rank": "",
        }
    peaks = pipeline.get("peak_mem_mb_per_pp_rank") or []
    virtual = pipeline["virtual_stages"]
    return {
        "pp_schedule": pipeline["schedule"] + (f" x{virtual}" if virtual > 1 else ""),  # virtual stages per rank
        "pp_microbatches": pipeline["microbatches"],
        "bubble_predicted": pipeline["predicted_bubble"],
        "bubble_measured": pipeline["measured_bubble"],
        "peak_mem_mb_per_pp_rank": " / ".join(f"{p:.0f}" if p is not None else "-" for p in peaks),
    }


def stage_rows(pipeline: dict[str, Any], groups: list[list[int]]) -> list[tuple[int, dict[str, Any]]]:
    """(pipeline rank, timeline) of the first replica: the lowest global rank holding each pipeline rank's stages."""
    pp_rank = {rank: group.index(rank) for group in groups for rank in group}
    first: dict[int, dict[str, Any]] = {}
    for timeline in pipeline["timeline"]:
        p = pp_rank[timeline["rank"]]
        if p not in first or timeline["rank"] < first[p]["rank"]:
            first[p] = timeline
    return sorted(first.items())


def plot_pipelines(summaries: list[RunSummary], path: Path) -> None:
    import matplotlib.pyplot as plt

    runs = {}
    for run in summaries:  # one run per pipeline experiment: its first seed
        pipeline = run.record.results.pipeline
        if pipeline and pipeline.get("timeline") and run.figures["experiment"] not in runs:
            runs[run.figures["experiment"]] = run
    if not runs:
        fig, ax = plt.subplots(figsize=(7, 1.5))
        ax.text(0.5, 0.5, "no pipeline experiment in this study", ha="center", va="center")
        ax.axis("off")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.4 + 0.9 * max(len(runs), 1) * 2), squeeze=False)
    for ax, (name, run) in zip(axes[:, 0], runs.items()):
        record = run.record
        pipeline = record.results.pipeline
        stages = stage_rows(pipeline, record.parallel["groups"]["pp"])
        for p, timeline in stages:
            for chunk in timeline["chunks"]:
                start, width = chunk["start"] * 1e3, (chunk["end"] - chunk["start"]) * 1e3
                later_round = chunk["stage"] >= len(stages)  # a virtual stage after the first: hatched
                ax.broken_barh(
                    [(start, width)],
                    (p - 0.4, 0.8),
                    facecolors=COLORS[chunk["kind"]],
                    edgecolors="black",
                    linewidth=0.4,
                    hatch="//" if later_round else None,
                )
                if chunk["kind"] != "L":
                    ax.text(start + width / 2, p, str(chunk["mb"]), ha="center", va="center", fontsize=7)
        measured = pipeline["measured_bubble"]
        ax.set_title(
            f"{name} ({run.figures['layout']}): {pipeline['schedule']}, {pipeline['microbatches']} micro-batches, step "
            f"{stages[0][1]['step']}; bubble predicted {pipeline['predicted_bubble']:.0%}, measured "
            + (f"{measured:.0%}" if measured is not None else "-"),
            fontsize=9,
        )
        ax.set_yticks([p for p, _ in stages], [f"pp rank {p}" for p, _ in stages])
        ax.invert_yaxis()
        ax.set_xlabel("ms since the step began (per rank)")
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="black") for c in COLORS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", hatch="//"))
    labels = ["forward", "loss", "backward", "a later virtual stage"]
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
