"""The report's figures with the real matrix: every experiment told apart at a glance, no text on other text, no
legend on the data. Drawn from synthetic rows (the figures' layout, not a measurement)."""

from __future__ import annotations

import itertools
from datetime import datetime
from pathlib import Path

import matplotlib
import yaml

from scalelm.report.figures import RunSummary
from scalelm.report.history_compare import TrendPoint
from scalelm.report.plots import DISTURBED, loss_figure, scaling_figure, trend_figure

matplotlib.use("Agg")
REPO = Path(__file__).resolve().parents[1]


def real_matrix() -> list[tuple[str, int]]:
    """(experiment, world size) of config/config.yaml, in its order."""
    experiments = yaml.safe_load((REPO / "config/config.yaml").read_text())["experiments"]
    return [(name, e["nodes"] * e["procs_per_node"]) for name, e in experiments.items()]


def summaries(matrix: list[tuple[str, int]]) -> list[dict]:
    rows = []
    for i, (name, devices) in enumerate(matrix):
        speedup = devices * (0.6 + 0.02 * i)
        rows.append(
            {
                "experiment": name,
                "baseline": matrix[0][0],
                "world_size": devices,
                "scaling": "strong",
                "layout": f"{devices}x1x1x1",
                "tokens_per_s_mean": 1e4 * speedup,
                "tokens_per_s_std": 100.0,
                "speedup_mean": speedup,
                "speedup_std": 0.1,
                "scaling_efficiency_mean": speedup / devices,
                "scaling_efficiency_std": 0.01,
            }
        )
    rows[-1]["scaling"] = "weak"
    return rows


def loss_runs(matrix: list[tuple[str, int]]) -> list[RunSummary]:
    runs = []
    for i, (name, devices) in enumerate(matrix):
        train = [
            {"kind": "train", "step": s, "tokens": 512 * s, "time": s / devices, "loss": 7 - s / 10 - i / 50}
            for s in range(1, 21)
        ]
        evals = [
            {"kind": "eval", "split": "validation", "step": s, "time": s / devices, "loss": 7 - s / 10}
            for s in (10, 20)
        ]
        figures = {"experiment": name, "seed": 1, "layout": f"{devices}x1x1x1", "global_batch_tokens": 512}
        runs.append(RunSummary(figures=figures, metrics=train + evals))
    return runs


def overlapping(boxes: list) -> list[tuple[int, int]]:
    return [(i, j) for (i, a), (j, b) in itertools.combinations(enumerate(boxes), 2) if a.overlaps(b)]


def check_readable(fig, data_axes: list) -> dict[str, tuple[str, str]]:
    """Tick labels apart on every axis, the legend clear of every axes' data area; each legend entry's colour and
    marker (label -> (colour, marker))."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            boxes = [t.get_window_extent(renderer) for t in axis.get_ticklabels() if t.get_visible() and t.get_text()]
            assert not overlapping(boxes), (ax.get_title(), [t.get_text() for t in axis.get_ticklabels()])
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    assert len(legends) == 1
    legend = legends[0].get_window_extent(renderer)
    for ax in data_axes:
        assert not legend.overlaps(ax.get_window_extent(renderer)), ax.get_title()
    styles = {}
    for handle, label in zip(*legends[0].axes.get_legend_handles_labels()):
        line = handle if hasattr(handle, "get_marker") else handle.lines[0]  # a line, or an errorbar's container
        styles[label] = (matplotlib.colors.to_hex(line.get_color()), line.get_marker())
    assert sorted(styles) == sorted(t.get_text() for t in legends[0].get_texts())
    return styles


def test_the_real_matrix_is_drawn_readable_with_a_colour_and_a_marker_per_experiment():
    matrix = real_matrix()
    assert len(matrix) >= 15
    names = [name for name, _ in matrix]

    fig = scaling_figure(summaries(matrix))
    styles = check_readable(fig, fig.axes)
    points = {label.split()[0]: style for label, style in styles.items() if label != "ideal"}
    assert sorted(points) == sorted(names)
    assert len({colour for colour, _ in points.values()}) == len(names)  # no two experiments share a colour
    assert len({marker for _, marker in points.values()}) == len(names)  # nor a marker
    bars = [patch.get_facecolor() for patch in fig.axes[0].patches]
    assert len({matplotlib.colors.to_hex(c) for c in bars}) == len(names)
    throughput_labels = [t.get_text().split()[0] for t in fig.axes[0].get_yticklabels()]
    assert throughput_labels == names  # every experiment named, in the matrix's order from the top
    assert {matplotlib.colors.to_hex(c) for c in bars} == {colour for colour, _ in points.values()}  # same colours

    fig = loss_figure(loss_runs(matrix), "tokens", "tokens seen")
    losses = check_readable(fig, fig.axes)
    assert {label.split()[0]: colour for label, (colour, _) in losses.items()} == {
        name: colour for name, (colour, _) in points.items()
    }  # an experiment has the same colour in every figure


def rings(ax) -> list[tuple[float, float]]:
    """The red rings on an axes (plots.ring): where they are."""
    return [
        (line.get_xdata()[0], line.get_ydata()[0])
        for line in ax.get_lines()
        if line.get_markeredgecolor() == DISTURBED and line.get_marker() == "o"
    ]


def note_below_the_axes(fig) -> str:
    """The figure's note, checked to lie under every axes with its labels."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (note,) = fig.texts
    top = note.get_window_extent(renderer).y1
    assert all(top < ax.get_tightbbox(renderer).y0 for ax in fig.axes), "the note covers an axes"
    return note.get_text().replace("\n", " ")


def test_what_other_work_disturbed_is_marked_in_the_real_matrix_and_named_under_the_figure():
    matrix = real_matrix()
    rows = summaries(matrix)
    disturbed, compared = rows[0], rows[3]  # the baseline with a disturbed seed, and a run compared with it
    disturbed |= {"disturbed_seeds": 1, "seeds": 2}
    compared |= {"disturbed_seeds": 0, "seeds": 1, "scaling_flag": "baseline disturbed (x seed 1)"}
    fig = scaling_figure(rows)
    check_readable(fig, fig.axes)  # the rings add no legend entry
    for ax, figure in zip(fig.axes[1:], ("speedup_mean", "scaling_efficiency_mean")):
        assert sorted(y for _, y in rings(ax)) == sorted([disturbed[figure], compared[figure]])
    hatched = [
        label.get_text().split()[0]
        for bar, label in zip(fig.axes[0].patches, fig.axes[0].get_yticklabels())
        if bar.get_hatch()
    ]
    assert hatched == [disturbed["experiment"]]  # the throughput of a disturbed seed; the other's is its own
    note = note_below_the_axes(fig)
    assert f"{disturbed['experiment']}: 1 of 2 seed(s) disturbed" in note
    assert f"{compared['experiment']}: baseline disturbed (x seed 1)" in note
    assert not scaling_figure(summaries(matrix)).texts  # nothing disturbed: no note, no ring
    assert not any(rings(ax) for ax in scaling_figure(summaries(matrix)).axes)

    runs = loss_runs(matrix)
    runs[2].figures |= {"disturbed": "other work took 1.04 of the 2 cores it was given on vm", "overlapped_by": ""}
    fig = loss_figure(runs, "time", "wall time (s)")
    styles = check_readable(fig, fig.axes)
    name = matrix[2][0]
    (label,) = [label for label in styles if label.startswith(f"{name} ")]
    assert label.endswith(", disturbed)") and sum("disturbed" in label for label in styles) == 1
    dashed = {line.get_label() for ax in fig.axes for line in ax.get_lines() if line.get_linestyle() == "--"}
    assert dashed == {label} and all(len(rings(ax)) == 1 for ax in fig.axes)
    assert f"{name} seed 1: other work took 1.04 of the 2 cores it was given on vm" in note_below_the_axes(fig)
    fig = loss_figure(runs, "tokens", "tokens seen")  # tokens are not time: the curve is the run's own
    assert not fig.texts and not any(rings(ax) for ax in fig.axes)

    # the trend: a ring around the speed of the study with a disturbed run, none around its test loss
    studies = [
        TrendPoint(
            datetime(2026, 11, day),
            "local, cpu",
            {"tokens_per_s_per_device": [100.0 * day], "test_loss": [5.0]},
            disturbed,
        )
        for day, disturbed in ((1, 0), (8, 1), (15, 0))
    ]
    fig = trend_figure({name: studies})
    speed, loss = fig.axes[:2]
    assert [y for _, y in rings(speed)] == [800.0] and not rings(loss)
    assert f"{name} of 2026-11-08 00:00 (1 run(s))" in note_below_the_axes(fig)
    renderer = fig.canvas.get_renderer()
    assert not fig.legends[0].get_window_extent(renderer).overlaps(fig.texts[0].get_window_extent(renderer))
