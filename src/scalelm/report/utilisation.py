"""How busy each device of a run was, from its monitor files (scalelm.measure.sampler): the summary's mean and least
utilisation per device, so "4 GPUs requested, 1 busy" shows at a glance, and the utilisation-over-time figure.

A device is a GPU where the run had GPUs (NVML utilisation, percent) and otherwise a training process (CPU use,
percent of one core: a process with several threads can exceed 100).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from scalelm.report.figures import RunSummary


def device_series(monitor_dir: Path) -> tuple[dict[str, list[tuple[float, float]]], dict[str, float]]:
    """Every device's (time, utilisation) samples, and the samplers' own cost (CPU seconds, wall seconds)."""
    series: dict[str, list[tuple[float, float]]] = {}
    cost = {"cpu_s": 0.0, "wall_s": 0.0}
    for path in sorted(monitor_dir.glob("node*.jsonl")):
        node = path.stem
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["kind"] == "end":
                cost["cpu_s"] += record["cpu_s"]
                cost["wall_s"] += record["wall_s"]
            elif record.get("gpus"):
                for gpu in record["gpus"]:
                    if gpu["util_percent"] is not None:  # null where the GPU cannot say (a MIG slice)
                        series.setdefault(f"{node} gpu {gpu['gpu']}", []).append((record["time"], gpu["util_percent"]))
            else:
                for proc in record["procs"]:
                    series.setdefault(f"rank {proc['rank']}", []).append((record["time"], proc["cpu_percent"]))
    return series, cost


def summarise(series: dict[str, list[tuple[float, float]]], cost: dict[str, float]) -> dict[str, Any]:
    """The summary's figures of a run's `device_series`."""
    means = [statistics.fmean(u for _, u in samples) for samples in series.values() if samples]
    return {
        "util_mean_percent": statistics.fmean(means) if means else None,
        "util_min_percent": min(means) if means else None,  # the least busy device
        "monitor_cpu_percent": 100 * cost["cpu_s"] / cost["wall_s"] if cost["wall_s"] else None,  # of one core
    }


def plot_utilisation(runs: list[RunSummary], path: Path) -> None:
    import matplotlib.pyplot as plt

    columns = min(4, max(1, len(runs)))
    lines = -(-len(runs) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(4 * columns, 3 * lines), squeeze=False, sharey=True)
    for ax, run in zip(axes.flat, runs):
        for device, samples in sorted(run.utilisation.items()):
            start = samples[0][0]
            ax.plot([t - start for t, _ in samples], [u for _, u in samples], label=device, linewidth=1)
        ax.set_title(run.label, fontsize=9)
        ax.set_xlabel("time (s)")
        ax.grid(alpha=0.3)
        if run.utilisation:
            ax.legend(fontsize=6)
    for ax in axes.flat[len(runs) :]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("utilisation (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
