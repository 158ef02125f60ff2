"""The summary's figures: loss curves, scaling, a mixture of experts' load balance, and the trend over the results
history (utilisation.png: scalelm.report.utilisation).

An experiment with several seeds is drawn as their mean: loss curves with the seeds' range (min to max) as a band,
scaling figures with their standard deviation as error bars. Each experiment keeps one colour and one marker in
every figure, none shared with another up to 20 experiments, and legends sit beside the axes, never on the data.

What other work disturbed (scalelm.report.disturbance) is marked where its figures of time are drawn, and named in a
note under the figure: a red ring around its speedup and efficiency (a disturbed seed, a disturbed baseline run, an
implausible efficiency), a hatched throughput bar (a disturbed seed), a dashed loss curve over wall time with a ring
at its end, a ring around a study's speed in the trend.
"""

from __future__ import annotations

import itertools
import statistics
import textwrap
from pathlib import Path
from typing import Any

from scalelm.report.disturbance import contaminated, experiment_flags
from scalelm.report.figures import TIMED, RunSummary
from scalelm.report.history_compare import TrendPoint
from scalelm.report.history_store import TREND_FIGURES

# tab20's dark hues, then their light partners: neighbours in the matrix never differ only in shade
TAB20_ORDER = (*range(0, 20, 2), *range(1, 20, 2))
MAX_VIO = "expert_max_vio_"  # a metrics line's per-layer load balance, by layer (scalelm.measure.experts)
MARKERS = "osD^v<>PX*hpd8H1234+"  # matplotlib's 15 filled markers, then 5 drawn by lines
DISTURBED = "red"  # the ring around what other work disturbed, the hatch of its bars, its note


def ring(ax, x, y) -> None:
    """A red ring around a disturbed point, outside any legend."""
    ax.plot(
        x,
        y,
        linestyle="",
        marker="o",
        markersize=15,
        markerfacecolor="none",
        markeredgecolor=DISTURBED,
        markeredgewidth=1.5,
        zorder=5,
    )


def wrapped(fig, lines: list[str]) -> str:
    """`lines` wrapped to the figure's width in 8-point text."""
    return "\n".join(part for line in lines for part in textwrap.wrap(line, int(fig.get_figwidth() * 14)))


def note_under(fig, lines: list[str]) -> None:
    """A note under the figure, clear of its axes and labels (`save` grows the figure to hold it)."""
    fig.text(0.01, 0.0, wrapped(fig, lines), ha="left", va="top", fontsize=8, color=DISTURBED)


def experiment_styles(names: list[str]) -> dict[str, tuple[str, str]]:
    """A colour and a marker of its own for each experiment, in the order given (20 colours, 20 markers)."""
    import matplotlib

    tab20 = matplotlib.colormaps["tab20"]
    return {
        name: (matplotlib.colors.to_hex(tab20(TAB20_ORDER[i % 20])), MARKERS[i % len(MARKERS)])
        for i, name in enumerate(dict.fromkeys(names))
    }


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
    save(loss_figure(runs, x_key, x_label), path)


def loss_figure(runs: list[RunSummary], x_key: str, x_label: str):
    import matplotlib.pyplot as plt

    experiments: dict[str, list[RunSummary]] = {}
    for run in runs:
        experiments.setdefault(run.figures["experiment"], []).append(run)
    styles = experiment_styles(list(experiments))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    notes = []
    for name, runs in experiments.items():
        first = runs[0].figures
        seeds = f"seed {first['seed']}" if len(runs) == 1 else f"mean of {len(runs)} seeds"
        # over wall time, a curve with a disturbed seed runs slower than the run alone would
        disturbed = [r.figures for r in runs if contaminated(r.figures)] if x_key == "time" else []
        # the layout: dp_replicate x dp_shard x tp x pp (x cp where > 1)
        label = f"{name} ({first['layout']}, {seeds}{', disturbed' if disturbed else ''})"
        colour, marker = styles[name]
        line = "--" if disturbed else "-"
        for ax, split in zip(axes, ("train", "validation")):
            x, mean, low, high = across_seeds(runs, x_key, split)
            shape = None if split == "train" else marker
            ax.plot(x, mean, color=colour, marker=shape, markersize=4, label=label, linestyle=line)
            if len(runs) > 1:
                ax.fill_between(x, low, high, color=colour, alpha=0.2, linewidth=0)
            if disturbed and x:
                ring(ax, x[-1], mean[-1])
        notes += [f"{name} seed {f['seed']}: {contaminated(f)}" for f in disturbed]
    axes[0].set_title("train loss")
    axes[1].set_title("validation loss")
    for ax in axes:
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("cross-entropy (nats/token)")
    legend_beside(fig, axes[1])
    if notes:
        why = "; ".join(notes)
        note_under(fig, [f"Disturbed (dashed, red ring at the end): its time measures other work too: {why}."])
    return fig


def save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legends beside the axes included
    plt.close(fig)


def legend_beside(fig, ax, source=None) -> None:
    """The legend (of `source`'s lines, else the axes') right of the axes (one column up to 20 entries), outside the
    data, the figure widened for it."""
    fig.tight_layout()
    handles, labels = (source or ax).get_legend_handles_labels()
    columns = 1 if len(labels) <= 20 else 2
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0, ncol=columns)


def plot_scaling(summaries: list[dict[str, Any]], path: Path) -> None:
    save(scaling_figure(summaries), path)


def scaling_figure(summaries: list[dict[str, Any]]):
    """Throughput per experiment; speedup and scaling efficiency against the number of devices, with the ideal.

    summaries: one per experiment (scalelm.report.repeats.by_experiment). Weak-scaling experiments are drawn hollow;
    an experiment with a disturbed seed has a hatched bar, and one whose speedup is flagged (a disturbed seed or
    baseline run, an implausible efficiency) a red ring, both named in a note under the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    baseline = next((s for s in summaries if s["experiment"] == s["baseline"]), summaries[0])
    base_devices = baseline["world_size"]
    styles = experiment_styles([s["experiment"] for s in summaries])
    # throughput as horizontal bars: one row per experiment, so 15 names never run into each other
    fig, axes = plt.subplots(1, 3, figsize=(18, max(4.8, 0.32 * len(summaries) + 1.8)))
    labels = [f"{s['experiment']} ({s['layout']})" for s in summaries]  # dp_replicate x dp_shard x tp x pp (x cp)
    speeds = [s["tokens_per_s_mean"] or 0.0 for s in summaries]
    spreads = [s["tokens_per_s_std"] or 0.0 for s in summaries]
    colours = [styles[s["experiment"]][0] for s in summaries]
    bars = axes[0].barh(labels, speeds, xerr=spreads, capsize=3, color=colours)
    for bar, s in zip(bars, summaries):
        if s.get("disturbed_seeds"):
            bar.set_hatch("///")
            bar.set_edgecolor(DISTURBED)
    axes[0].invert_yaxis()  # the matrix's order from the top
    axes[0].tick_params(axis="y", labelsize=8)
    axes[0].set_title("throughput (tokens/s, all devices)", fontsize=10)

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
            name, mean, std = s["experiment"], s[f"{figure}_mean"], s[f"{figure}_std"] or 0.0
            colour, marker = styles[name]
            face = "none" if s["scaling"] == "weak" else colour
            x, label = positions[name], f"{name} {s['layout']} ({s['scaling']})"
            ax.errorbar(x, mean, yerr=std, fmt=marker, capsize=3, color=colour, markerfacecolor=face, label=label)
            if experiment_flags(s):
                ring(ax, x, mean)
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks(devices, [str(d) for d in devices])
        ax.set_xlabel("devices (world size)")
        ax.set_title(title, fontsize=10)
    axes[1].plot(devices, [d / base_devices for d in devices], color="gray", linestyle="--", linewidth=1, label="ideal")
    axes[1].set_yscale("log", base=2)  # log-log: ideal scaling is the diagonal
    axes[1].yaxis.set_major_formatter(ScalarFormatter())
    axes[2].axhline(1.0, color="gray", linestyle="--", linewidth=1, label="ideal")
    for ax in axes:
        ax.grid(alpha=0.3)
    legend_beside(fig, axes[2])
    notes = [f"{s['experiment']}: {experiment_flags(s)}" for s in summaries if experiment_flags(s)]
    if notes:
        note_under(fig, ["Flagged (red ring; hatched bar: a disturbed seed): " + "; ".join(notes) + "."])
    return fig


def plot_experts(runs: list[RunSummary], path: Path) -> None:
    save(experts_figure(runs), path)


def experts_figure(runs: list[RunSummary]):
    """Per mixture-of-experts run, over its logged steps: each layer's load balance (tokens per expert, max over
    mean: MaxVio + 1, 1 is even; the least balanced layer's where a run logged no layer's own) and the load-balancing
    loss (1 when balanced), from its metrics lines."""
    import matplotlib.pyplot as plt

    mixtures = [r for r in runs if any("expert_load_max_over_mean" in m for m in r.metrics)]
    if not mixtures:
        fig, ax = plt.subplots(figsize=(7, 1.5))
        ax.text(0.5, 0.5, "no mixture-of-experts experiment in this study", ha="center", va="center")
        ax.axis("off")
        return fig
    styles = experiment_styles([r.figures["experiment"] for r in mixtures])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in mixtures:
        lines = [m for m in run.metrics if m["kind"] == "train"]
        colour, _ = styles[run.figures["experiment"]]
        layers = sorted({k for m in lines for k in m if k.startswith(MAX_VIO)}, key=lambda k: int(k[len(MAX_VIO) :]))
        curves = [(axes[0], k, 1.0, f"{run.label}, layer {k[len(MAX_VIO) :]}") for k in layers]
        curves = curves or [(axes[0], "expert_load_max_over_mean", 0.0, run.label)]
        for (ax, key, offset, label), style in zip(curves, itertools.cycle(("-", "--", ":", "-."))):
            points = [(m["step"], m[key] + offset) for m in lines if m.get(key) is not None]
            ax.plot([s for s, _ in points], [v for _, v in points], color=colour, linestyle=style, label=label)
        points = [(m["step"], m["aux_loss"]) for m in lines if m.get("aux_loss") is not None]
        axes[1].plot([s for s, _ in points], [v for _, v in points], color=colour)
    axes[0].set_title("load balance per layer: tokens per expert, max / mean")
    axes[1].set_title("load-balancing loss (before its coefficient)")
    for ax in axes:
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)  # even: both are 1
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    legend_beside(fig, axes[1], source=axes[0])
    return fig


def plot_trend(points: dict[str, list[TrendPoint]], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = trend_figure(points)
    fig.savefig(path, dpi=110)  # not `save`'s tight box: it would move the legend of the environments onto the note
    plt.close(fig)


def trend_figure(points: dict[str, list[TrendPoint]]):
    """Per experiment (a row), tokens/s per device and test loss over the studies in the results history: one marker
    per study (the mean over its seeds, their range as the error bar), coloured by the environment it ran in; a red
    ring around the speed of a study with disturbed runs, named in a note."""
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    environments = sorted({p.environment for study in points.values() for p in study})
    colours = {env: f"C{i % 10}" for i, env in enumerate(environments)}
    fig, axes = plt.subplots(len(points), 2, figsize=(12, 2.4 * len(points) + 1), squeeze=False)
    notes = []
    for row, (experiment, study) in zip(axes, points.items()):
        for ax, figure in zip(row, TREND_FIGURES):
            for p in study:
                values = p.values[figure]
                if not values:
                    continue
                mean = statistics.fmean(values)
                error = [[mean - min(values)], [max(values) - mean]]
                ax.errorbar(p.recorded, mean, yerr=error, fmt="o", capsize=3, color=colours[p.environment])
                if p.disturbed and figure in TIMED:
                    ring(ax, p.recorded, mean)
            ax.set_title(f"{experiment}: {figure.replace('_', ' ')}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(ax.xaxis.get_major_locator()))
            ax.tick_params(axis="x", labelsize=7)
        notes += [f"{experiment} of {p.recorded:%Y-%m-%d %H:%M} ({p.disturbed} run(s))" for p in study if p.disturbed]
    note = ""
    if notes:
        text = f"Disturbed (red ring: their speed measures other work too, and is no reference): {'; '.join(notes)}."
        note = wrapped(fig, [text])
    # the note at the bottom, the legend of the environments above it, the axes above both
    note_height = (note.count("\n") + 1) * 8 * 1.3 / 72 / fig.get_figheight() if note else 0.0
    if note:
        fig.text(0.01, 0.005, note, ha="left", va="bottom", fontsize=8, color=DISTURBED)
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=colours[env]) for env in environments]
    columns = min(len(environments), 2)
    fig.legend(handles, environments, loc="lower center", bbox_to_anchor=(0.5, note_height), fontsize=7, ncol=columns)
    fig.tight_layout(rect=(0, note_height + 0.04 + 0.02 * ((len(environments) + 1) // 2), 1, 1))
    return fig
