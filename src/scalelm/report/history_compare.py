"""The results history's statistics: studies compared figure by figure, the limits an `expect:` takes from the
history and the trend figure's points (the store: scalelm.report.history_store).

`compare` sets one study's runs against another's: per experiment and figure of the registry that has a better
direction (scalelm.report.figures: an `expect:` minimum is better higher, a maximum lower), the relative change of the
mean, and with two seeds or more a side Welch's t-test and a 95% confidence interval of the difference (scipy). A
change is a regression only when it goes the worse way beyond the tolerance and is significant. With one seed on a
side no test tells a change from the machine's own noise: a figure of time is judged against the run-to-run spread
the machine's baseline measured (`machine_spread`), or ASSUMED_SPREAD where the history holds none, and is a
regression "(not tested)" only beyond it; a figure not of time (the loss, memory) does not move with the machine and
is one beyond the tolerance. Beside each flagged figure: what changed between the two environments (torch, CUDA,
NCCL, the device, the image, the nodes, the commit).

The aggregation also reads the history for two things: the limit of an `expect:` that names it (`reference`: the
median of the experiment's last n comparable studies) and the trend figure (`trend`: every study of the same
settings, coloured by environment).

A run's figures of time that other work disturbed (scalelm.report.disturbance: its `disturbed` or `overlapped_by`,
and for speedup and efficiency its `scaling_flag`) are no reference: `reference` leaves them out and says how many, a
comparison names the disturbed runs on either side beside each change (`Change.disturbed`) and judges no change they
enter ("not judged: disturbed"), and the trend marks their studies.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from scalelm.report.disturbance import SCALED, contaminated, figure_caveat
from scalelm.report.figures import TIMED, RunSummary, finite_number
from scalelm.report.history_store import DIRECTIONS, TREND_FIGURES, fingerprint, run_key, settings_hash
from scalelm.report.tables import fmt, markdown_table


def since_previous(
    rows: list[dict[str, Any]], runs: list[RunSummary], tolerance: float = 0.05, alpha: float = 0.05
) -> tuple[str, list[Change]] | None:
    """These runs (as recorded in the history's `rows`) against the latest study recorded before them: its id and
    the changes; None if there is none."""
    keys = {run_key(run) for run in runs}
    current = [r for r in rows if r["key"] in keys]
    if not current:
        return None
    first = min(r["study"] for r in current)  # study ids sort as they were recorded
    earlier = sorted({r["study"] for r in rows if r["study"] < first})
    if not earlier:
        return None
    return earlier[-1], compare([r for r in rows if r["study"] == earlier[-1]], current, tolerance, alpha)


def reference(
    rows: list[dict[str, Any]], runs: list[RunSummary], experiment: str, figure: str, n: int, db: str | Path
) -> tuple[float | None, str]:
    """The limit an `expect: {history: median_of_last, n: N}` takes: over the last `n` studies of the history `db`
    (its `rows`) recorded before these runs with runs of `experiment` comparable with theirs (the same identity, on
    the same site and device), the median of each study's mean of `figure`, its disturbed runs left out (a study of
    only such runs is none); and where it came from, or why there is none."""
    mine = [run for run in runs if run.figures["experiment"] == experiment]
    keys, hashes = {run_key(run) for run in mine}, {settings_hash(run) for run in mine}
    machines = {_machine(fingerprint(run)) for run in mine}
    first = min((r["study"] for r in rows if r["key"] in keys), default=None)
    means: dict[str, list[float]] = {}
    disturbed = 0
    for r in rows:
        comparable = r["experiment"] == experiment and r["settings_hash"] in hashes
        comparable = comparable and _machine(r["environment"]) in machines
        if comparable and (first is None or r["study"] < first) and finite_number(r["figures"].get(figure)):
            if figure_caveat(r["figures"], figure):
                disturbed += 1
                continue
            means.setdefault(r["study"], []).append(float(r["figures"][figure]))
    left_out = f" ({disturbed} disturbed run(s) left out)" if disturbed else ""
    if not means:
        return None, f"no earlier study of {experiment} with these settings on this site and device in {db}{left_out}"
    last = sorted(means)[-n:]
    value = statistics.median(statistics.fmean(means[study_id]) for study_id in last)
    return value, f"median of the last {len(last)} stud{'y' if len(last) == 1 else 'ies'} (n {n}){left_out}"


def _machine(environment: dict[str, Any]) -> tuple[str | None, str | None]:
    return environment.get("site"), environment.get("device")


@dataclass(frozen=True)
class TrendPoint:
    """One study of an experiment in the trend figure: when, in which environment, each figure's values by seed, and
    how many of its runs had their figures of time disturbed."""

    recorded: datetime
    environment: str
    values: dict[str, list[float]]
    disturbed: int = 0


def environment_label(environment: dict[str, Any]) -> str:
    """An environment in a few words: site, device, torch, the image, the commit (not the nodes, which change from
    job to job)."""
    image = Path(environment["image"]).name if environment.get("image") else None
    commit = (environment.get("git_commit") or "")[:8] or None
    torch = f"torch {environment['torch']}" if environment.get("torch") else None
    parts = [environment.get("site"), environment.get("device"), torch, image, commit]
    return ", ".join(str(p) for p in parts if p)


def trend(rows: list[dict[str, Any]], runs: list[RunSummary]) -> dict[str, list[TrendPoint]]:
    """Per experiment of these runs, every study in the history's `rows` (these runs' own included) with runs of the
    same identity: the trend figure's points, oldest first."""
    hashes = {run.figures["experiment"]: set() for run in runs}
    for run in runs:
        hashes[run.figures["experiment"]].add(settings_hash(run))
    points: dict[str, list[TrendPoint]] = {}
    for experiment, mine in hashes.items():
        by_study: dict[str, list[dict]] = {}
        for r in rows:
            if r["experiment"] == experiment and r["settings_hash"] in mine:
                by_study.setdefault(r["study"], []).append(r)
        points[experiment] = [
            TrendPoint(
                datetime.fromisoformat(rows[0]["recorded"]),
                " | ".join(sorted({environment_label(r["environment"]) for r in rows})),
                {
                    f: [float(r["figures"][f]) for r in rows if finite_number(r["figures"].get(f))]
                    for f in TREND_FIGURES
                },
                sum(bool(contaminated(r["figures"])) for r in rows),
            )
            for _, rows in sorted(by_study.items())
        ]
    return points


# --------------------------------------------------------------------------------------------- comparison
@dataclass(frozen=True)
class Change:
    experiment: str
    figure: str
    before: float
    after: float
    relative: float  # (after - before) / |before|, of the means
    seeds: tuple[int, int]
    p_value: float | None  # Welch's t-test; None with fewer than two seeds a side
    low: float | None  # 95% confidence interval of the difference of the means (after - before)
    high: float | None
    # "regression", "regression (not tested, beyond ...)", "improvement", "within tolerance", "not significant",
    # "within the machine's spread of 17%", "not judged: disturbed"; only "regression..." fails the command
    verdict: str
    environment: dict[str, tuple[Any, Any]]  # what differs between the two sides' environments
    disturbed: str = ""  # the runs of either side whose figure other work disturbed, e.g. "after: ddp seed 1"
    spread: float | None = None  # the machine's run-to-run spread (`machine_spread`); None where none was recorded

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.__dict__,
            "seeds": list(self.seeds),
            "environment": {k: list(v) for k, v in self.environment.items()},
        }


def welch(before: list[float], after: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """Welch's t-test p-value and the confidence interval of mean(after) - mean(before)."""
    from scipy import stats

    if len(set(before)) == 1 and len(set(after)) == 1:  # no spread on either side: the difference is exact
        difference = after[0] - before[0]
        return (0.0 if difference else 1.0), difference, difference
    test = stats.ttest_ind(after, before, equal_var=False)
    interval = test.confidence_interval(confidence)
    p_value = float(test.pvalue) if math.isfinite(test.pvalue) else (1.0 if after == before else 0.0)
    return p_value, float(interval.low), float(interval.high)


def environment_difference(before: list[dict], after: list[dict]) -> dict[str, tuple[Any, Any]]:
    def merged(side: list[dict]) -> dict[str, Any]:
        keys = {k for env in side for k in env}
        return {k: sorted({json.dumps(env.get(k), sort_keys=True) for env in side}) for k in keys}

    a, b = merged(before), merged(after)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def compare(before: list[dict], after: list[dict], tolerance: float = 0.05, alpha: float = 0.05) -> list[Change]:
    """Each experiment of both sides, each figure with a direction: the change from `before` to `after`."""
    changes = []
    for experiment in sorted({r["experiment"] for r in before} & {r["experiment"] for r in after}):
        a = [r for r in before if r["experiment"] == experiment]
        b = [r for r in after if r["experiment"] == experiment]
        env = environment_difference([r["environment"] for r in a], [r["environment"] for r in b])
        spread = machine_spread(a + b)  # the wider of the two machines' noise enters a change
        for figure, direction in DIRECTIONS.items():
            x = [float(r["figures"][figure]) for r in a if finite_number(r["figures"].get(figure))]
            y = [float(r["figures"][figure]) for r in b if finite_number(r["figures"].get(figure))]
            if not x or not y:
                continue
            mean_x, mean_y = statistics.fmean(x), statistics.fmean(y)
            relative = (mean_y - mean_x) / abs(mean_x) if mean_x else (0.0 if mean_y == mean_x else math.inf)
            p_value = low = high = None
            if len(x) >= 2 and len(y) >= 2:
                p_value, low, high = welch(x, y)
            disturbed = disturbed_sides(a, b, figure)
            verdict = judge(figure, relative * direction, p_value, spread, disturbed, tolerance, alpha)
            seeds, changed = (len(x), len(y)), env if relative * direction < -tolerance else {}
            found = (mean_x, mean_y, relative, seeds, p_value, low, high, verdict, changed, disturbed, spread)
            changes.append(Change(experiment, figure, *found))
    return changes


def judge(
    figure: str,
    gain: float,
    p_value: float | None,
    spread: float | None,
    disturbed: str,
    tolerance: float,
    alpha: float,
) -> str:
    """The verdict on a change of `figure` by `gain` (relative, + the better way): within the tolerance; not judged
    where a disturbed run enters it (its speed measures the other work too); with fewer than two seeds on a side,
    against the machine's `spread` (`untested`); else by Welch's p-value."""
    if abs(gain) <= tolerance:
        return "within tolerance"
    if disturbed:
        return "not judged: disturbed"  # which runs: `disturbed`
    if p_value is None:
        return untested(figure, gain, spread)
    if p_value >= alpha:
        return "not significant"
    return "regression" if gain < 0 else "improvement"


# Without a machine spread in the history (a run without a machine baseline, one recorded by an older scalelm): the
# local VM's model step alone moved 10-20% from one baseline to the next (docs/plan.md), so a one-seed change of a
# figure of time within 20% may be that noise and no more.
ASSUMED_SPREAD = 0.2


def untested(figure: str, gain: float, spread: float | None) -> str:
    """The verdict on a change beyond the tolerance with fewer than two seeds on a side: a figure of time within the
    machine's spread (or ASSUMED_SPREAD) is its noise; beyond it, or a figure the machine does not move (the loss,
    memory), a regression or improvement "(not tested)"."""
    direction = "regression" if gain < 0 else "improvement"
    if figure not in TIMED:
        return f"{direction} (not tested)"
    measured = ASSUMED_SPREAD if spread is None else spread
    bound = noise_bound(figure, measured)
    whose = "the machine's" if spread is not None else "the assumed"
    source = f"{whose} spread of {measured:.0%}"
    source += f", {bound:.0%} over two runs" if figure in SCALED else ""
    source += "" if spread is not None else ", no machine spread recorded"
    return f"within {source}" if abs(gain) <= bound else f"{direction} (not tested, beyond {source})"


def noise_bound(figure: str, spread: float) -> float:
    """The relative change of `figure` between two runs within a machine's `spread`: a speedup or efficiency divides
    by the baseline experiment's speed, which moves as much again."""
    return (1 + spread) ** 2 - 1 if figure in SCALED else spread


def machine_spread(rows: list[dict]) -> float | None:
    """The widest run-to-run spread the machines of these runs showed: the step planned at the slow end of their
    machine baseline's repetitions over the step planned at the fast end, less 1 (scalelm.report.steptime), the
    largest relative change of a step, or of tokens/s, between two runs within it; None where no run records it
    (no baseline on its node count, an older scalelm's history)."""
    spreads = [
        r["figures"]["planned_step_time_s_max"] / r["figures"]["planned_step_time_s_min"] - 1
        for r in rows
        if _positive(r["figures"].get("planned_step_time_s_min"))
        and _positive(r["figures"].get("planned_step_time_s_max"))
    ]
    return max(spreads, default=None)


def _positive(value: Any) -> bool:
    return finite_number(value) and value > 0


def disturbed_sides(before: list[dict], after: list[dict], figure: str) -> str:
    """The runs of each side whose `figure` other work disturbed, e.g. `before: seed 1; after: seeds 1, 2`."""
    sides = []
    for side, rows in (("before", before), ("after", after)):
        seeds = [str(r["seed"]) for r in rows if figure_caveat(r["figures"], figure)]
        if seeds:
            sides.append(f"{side}: seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)}")
    return "; ".join(sides)


def describe(environment: dict[str, tuple[Any, Any]]) -> str:
    """What changed between two environments, e.g. `torch: "2.9.0" -> "2.13.0"`."""
    return "; ".join(f"{k}: {' | '.join(a or ['-'])} -> {' | '.join(b or ['-'])}" for k, (a, b) in environment.items())


def markdown(since: tuple[str, list[Change]] | None) -> list[str]:
    """summary.md's section "Since the previous study" (`since`: its id and the changes; none without it): the
    regressions counted, the changes beyond the tolerance listed."""
    if not since:
        return []
    previous, changes = since
    lines = [
        "",
        "## Since the previous study",
        "",
        f"Against `{previous}` in the results history (`scalelm history compare`): "
        f"{sum(c.verdict.startswith('regression') for c in changes)} regression(s); changes beyond the "
        "tolerance below, the others within it.",
        "",
    ]
    return lines + markdown_table(
        ["experiment", "figure", "before", "after", "change", "p", "verdict", "what changed", "disturbed"],
        [change_cells(c) for c in changes if c.verdict != "within tolerance"],
    )


def change_cells(c: Change) -> list[str]:
    """A change since the previous study as a row of summary.md's table."""
    p = fmt(c.p_value) if c.p_value is not None else "one seed"
    before, after, environment = fmt(c.before), fmt(c.after), describe(c.environment)
    return [c.experiment, c.figure, before, after, f"{c.relative:+.1%}", p, c.verdict, environment, c.disturbed]
