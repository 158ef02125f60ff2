"""The summary's figures: loss curves, scaling, and the trend over the results history (utilisation.png:
scalelm.report.utilisation).

An experiment with several seeds is drawn as their mean: loss curves with the seeds' range (min to max) as a band,
scaling figures with their standard deviation as error bars.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from scalelm.report.figures import RunSummary
from scalelm.report.history import TREND_FIGURES, TrendPoint


def loss_points(run: RunSummary, x_key: str, split: str) -> dict[int, tuple[float, float]]:
    """step -> (tokens seen or time, loss) of one run's train records or evaluations of `split`."""
    train = [m for m in run.metrics if m["kind"] == "train"]
    if split == "train":
        return {m["step"]: (m[x_key], m["loss"]) for m in train}
    tokens_at = {m["step"]: m["tokens"] for m in train}
    evals = [m for m in run.metrics if m["kind"] == "eval" and m["split"] == split]
    # an evaluation's tokens: those of the train record at its step (or, without one, the steps' worth)
    tokens = {m["step"]: tokens_at.get(m["step"], m["step"] * run.figures["global_batch_tokens"]) for m in evals}
    return {m["step"]: (m["time"] if x_key == "time" else tokens[m["step"]], m["loss"]) for m in evals}


def across_seeds(runs: list[RunSummary], x_key: str, split: str) -> tuple[list[float], ...]:
    """x, mean loss, min and max over the seeds, at the steps every seed logged."""
    curves = [loss_points(r, x_key, split) for r in runs]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    losses = [[c[s][1] for c in curves] for s in steps]
    x = [statistics.fmean(c[s][0] for c in curves) for s in steps]
    return x, [statistics.fmean(v) for v in losses], [min(v) for v in losses], [max(v) for v in losses]


def plot_losses(runs: list[RunSummary], x_key: str, x_label: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    experiments: dict[str, list[RunSummary]] = {}
    for run in runs:
        experiments.setdefault(run.figures["experiment"], []).append(run)
    for name, runs in experiments.items():
        first = runs[0].figures
        seeds = f"seed {first['seed']}" if len(runs) == 1 else f"mean of {len(runs)} seeds"
        label = f"{name} ({first['layout']}, {seeds})"  # dp_replicate x dp_shard x tp x pp (x cp where > 1)
        for ax, split in zip(axes, ("train", "validation")):
            x, mean, low, high = across_seeds(runs, x_key, split)
            (line,) = ax.plot(x, mean, marker=None if split == "train" else "o", label=label)
            if len(runs) > 1:
                ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    axes[0].set_title("train loss")
    axes[1].set_title("validation loss")
    for ax in axes:
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("cross-entropy (nats/token)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scaling(summaries: list[dict[str, Any]], path: Path) -> None:
    """Throughput per experiment; speedup and scaling efficiency against the number of devices, with the ideal.

    summaries: one per experiment (scalelm.report.repeats.by_experiment)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    baseline = next((s for s in summaries if s["experiment"] == s["baseline"]), summaries[0])
    base_devices = baseline["world_size"]
    colours = {s["experiment"]: f"C{i % 10}" for i, s in enumerate(summaries)}
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))

    names = [s["experiment"] for s in summaries]
    throughput = [s["tokens_per_s_mean"] or 0.0 for s in summaries]
    errors = [s["tokens_per_s_std"] or 0.0 for s in summaries]
    labels = [
        f"{s['experiment']}\n{s['layout']}" for s in summaries
    ]  # dp_replicate x dp_shard x tp x pp (x cp where > 1)
    axes[0].bar(labels, throughput, yerr=errors, capsize=3, color=[colours[n] for n in names])
    axes[0].set_title("throughput (tokens/s, all devices)")
    axes[0].tick_params(axis="x", labelsize=8, rotation=30)

    # experiments on the same number of devices side by side, not on top of each other
    offsets: dict[int, int] = {}
    positions = {}
    for s in summaries:
        k = offsets[s["world_size"]] = offsets.get(s["world_size"], -1) + 1
        positions[s["experiment"]] = s["world_size"] * (1 + 0.04 * k)
    devices = sorted({s["world_size"] for s in summaries})
    for ax, figure, title in (
        (axes[1], "speedup", f"speedup over {baseline['experiment']} ({base_devices} device(s))"),
        (axes[2], "scaling_efficiency", "scaling efficiency (speedup / devices relative to the baseline)"),
    ):
        for s in summaries:
            if s[f"{figure}_mean"] is None:
                continue
            marker = "s" if s["scaling"] == "weak" else "o"
            name, mean, std = s["experiment"], s[f"{figure}_mean"], s[f"{figure}_std"] or 0.0
            label = f"{name} {s['layout']} ({s['scaling']})"
            ax.errorbar(positions[name], mean, yerr=std, fmt=marker, capsize=3, color=colours[name], label=label)
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks(devices, [str(d) for d in devices])
        ax.set_xlabel("devices (world size)")
        ax.set_title(title, fontsize=10)
    axes[1].plot(devices, [d / base_devices for d in devices], color="gray", linestyle="--", linewidth=1, label="ideal")
    axes[1].set_yscale("log", base=2)  # log-log: ideal scaling is the diagonal
    axes[1].yaxis.set_major_formatter(ScalarFormatter())
    axes[2].axhline(1.0, color="gray", linestyle="--", linewidth=1, label="ideal")
    axes[2].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_trend(points: dict[str, list[TrendPoint]], path: Path) -> None:
    """Per experiment (a row), tokens/s per device and test loss over the studies in the results history: one marker
    per study (the mean over its seeds, their range as the error bar), coloured by the environment it ran in."""
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    environments = sorted({p.environment for study in points.values() for p in study})
    colours = {env: f"C{i % 10}" for i, env in enumerate(environments)}
    fig, axes = plt.subplots(len(points), 2, figsize=(12, 2.4 * len(points) + 1), squeeze=False)
    for row, (experiment, study) in zip(axes, points.items()):
        for ax, figure in zip(row, TREND_FIGURES):
            for p in study:
                values = p.values[figure]
                if not values:
                    continue
                mean = statistics.fmean(values)
                error = [[mean - min(values)], [max(values) - mean]]
                ax.errorbar(p.recorded, mean, yerr=error, fmt="o", capsize=3, color=colours[p.environment])
            ax.set_title(f"{experiment}: {figure.replace('_', ' ')}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(ax.xaxis.get_major_locator()))
            ax.tick_params(axis="x", labelsize=7)
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=colours[env]) for env in environments]
    fig.legend(handles, environments, loc="lower center", fontsize=7, ncol=min(len(environments), 2))
    fig.tight_layout(rect=(0, 0.04 + 0.02 * ((len(environments) + 1) // 2), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
