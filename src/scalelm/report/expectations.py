"""Reference values per experiment (`expect:` in the study config), checked by the aggregation: met or missed.

    experiments:
      ddp:
        expect: {min_tokens_per_s_per_device: 9000, max_test_perplexity: 180, tolerance: 0.1}

A key is `min_` or `max_` and a figure of summary_by_experiment.csv (scalelm.report.repeats); the figure's mean over
the experiment's seeds is checked. `tolerance` is relative and applies to every limit of the experiment (default
0.05): a minimum is met by a mean of at least limit x (1 - tolerance), a maximum by one of at most
limit x (1 + tolerance). A figure without a value (MFU of an unknown GPU) misses.

A limit may come from the results history instead of a number, so that a matrix run every week fails on drift
without hand-written limits:

        expect: {min_tokens_per_s_per_device: {history: median_of_last, n: 5, tolerance: 0.1}}

the median, over the last `n` earlier studies of the experiment with the same settings on the same site and device
(scalelm.report.history_compare.reference), of each study's mean; its own `tolerance` wins over the experiment's. Before
there is such a study the check has no reference: the study's runs are recorded, and the next one has one.

A check of a figure of time whose mean includes a disturbed seed (other work on its hosts, another run beside it),
or of a speedup or efficiency flagged (scalelm.report.disturbance), says so in its `disturbed` column and in its
description: such a miss may be the disturbance's, such a met efficiency a slow baseline's.

The aggregation lists every check in expectations.csv and summary.md; this module's command fails when one was
missed or had no reference, which the workflow runs with `expect_strict: true` (rule check_expectations), so
rerunning the matrix later detects a regression:

    python -m scalelm.report.expectations results/expectations.csv
"""

from __future__ import annotations

import argparse
import csv
import difflib
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from scalelm.errors import ConfigError, DataError, ScaleLMError, friendly_errors
from scalelm.report.disturbance import seeds_caveat
from scalelm.report.figures import LIMITS, finite_number
from scalelm.report.tables import fmt, markdown_table

DEFAULT_TOLERANCE = 0.05
HISTORY_METHODS = ("median_of_last",)
COLUMNS = [
    "experiment",
    "expectation",
    "value",
    "limit",
    "reference",
    "tolerance",
    "threshold",
    "seeds",
    "status",
    "disturbed",
]


class ExpectationsMissed(ScaleLMError):
    exit_code = 1  # a result, not a usage error (2)


@dataclass(frozen=True)
class Expectation:
    experiment: str
    key: str  # one of LIMITS
    limit: float | None  # None: from the history, not (or not yet) found there
    tolerance: float = DEFAULT_TOLERANCE
    history_n: int | None = None  # the limit is the median of the last this many comparable studies
    reference: str = ""  # where a limit from the history came from, or why there is none

    @property
    def from_history(self) -> bool:
        return self.history_n is not None

    @property
    def figure(self) -> str:
        return self.key.split("_", 1)[1]

    @property
    def is_minimum(self) -> bool:
        return self.key.startswith("min_")

    @property
    def threshold(self) -> float | None:
        """The limit with the tolerance applied in the lenient direction."""
        if self.limit is None:
            return None
        return self.limit * (1 - self.tolerance if self.is_minimum else 1 + self.tolerance)

    def status(self, value: float | None) -> str:
        if self.threshold is None:
            return "no reference"
        if value is None:
            return "missed"
        return "met" if (value >= self.threshold if self.is_minimum else value <= self.threshold) else "missed"


def parse_expectations(experiments: dict[str, dict[str, Any]]) -> list[Expectation]:
    """Every experiment's `expect:` entries; an unknown key or a bad value is an error naming it."""
    found = []
    for name, spec in experiments.items():
        expect = (spec or {}).get("expect")
        if expect is None:
            continue
        where = f"experiments.{name}.expect"
        if not isinstance(expect, dict):
            raise ConfigError(f"{where}: expected a mapping such as {{max_test_perplexity: 200}}, got {expect!r}")
        tolerance = expect.get("tolerance", DEFAULT_TOLERANCE)
        if not finite_number(tolerance) or not 0 <= tolerance < 1:
            raise ConfigError(f"{where}.tolerance must be a fraction from 0 to below 1 (0.05: 5%), got {tolerance!r}")
        for key, limit in expect.items():
            if key == "tolerance":
                continue
            if key not in LIMITS:
                close = difflib.get_close_matches(str(key), [*LIMITS, "tolerance"], n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ConfigError(
                    f"{where}: unknown key {key!r}{hint} (known: {', '.join(LIMITS)}, tolerance); rename or remove it"
                )
            if isinstance(limit, dict):
                found.append(from_history(name, key, limit, tolerance, f"{where}.{key}"))
                continue
            if not finite_number(limit) or limit <= 0:
                raise ConfigError(
                    f"{where}.{key} must be a positive number or {{history: median_of_last, n: 5}}, got {limit!r}"
                )
            found.append(Expectation(name, key, float(limit), float(tolerance)))
    return found


def from_history(experiment: str, key: str, spec: dict[str, Any], tolerance: float, where: str) -> Expectation:
    """`{history: median_of_last, n: 5, tolerance: 0.1}`: a limit the aggregation takes from the results history."""
    unknown = sorted(set(spec) - {"history", "n", "tolerance"})
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (known: history, n, tolerance)")
    if spec.get("history") not in HISTORY_METHODS:
        raise ConfigError(f"{where}.history must be one of {', '.join(HISTORY_METHODS)}, got {spec.get('history')!r}")
    n = spec.get("n", 5)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"{where}.n must be a whole number of earlier studies, 1 or more, got {n!r}")
    tolerance = spec.get("tolerance", tolerance)
    if not finite_number(tolerance) or not 0 <= tolerance < 1:
        raise ConfigError(f"{where}.tolerance must be a fraction from 0 to below 1 (0.05: 5%), got {tolerance!r}")
    return Expectation(experiment, key, None, float(tolerance), history_n=n)


def resolve(
    expected: list[Expectation], reference: Callable[[str, str, int], tuple[float | None, str]] | None
) -> list[Expectation]:
    """The limits from the history filled in: `reference(experiment, figure, n)` gives a value (None: none found)
    and where it came from (scalelm.report.history_compare.reference). Without a history, such a limit is an error."""
    if reference is None and any(e.from_history for e in expected):
        names = ", ".join(f"{e.experiment}.{e.key}" for e in expected if e.from_history)
        raise ConfigError(
            f"expect: {names} take their limit from the results history: give the aggregation one "
            "(--history FILE; the workflow always does)"
        )
    resolved = []
    for e in expected:
        if e.from_history:
            limit, where = reference(e.experiment, e.figure, e.history_n)
            e = replace(e, limit=limit, reference=where)
        resolved.append(e)
    return resolved


def to_arguments(expectations: list[Expectation]) -> list[str]:
    """`EXPERIMENT.KEY=VALUE` for the aggregate command's --expect options."""
    arguments, tolerances = [], {}
    for e in expectations:
        if e.from_history:  # a YAML flow mapping, as in the config
            spec = {"history": HISTORY_METHODS[0], "n": e.history_n, "tolerance": e.tolerance}
            arguments.append(f"{e.experiment}.{e.key}={json.dumps(spec)}")
            continue
        arguments.append(f"{e.experiment}.{e.key}={e.limit!r}")
        tolerances[e.experiment] = e.tolerance
    return arguments + [f"{name}.tolerance={tolerance!r}" for name, tolerance in tolerances.items()]


def from_arguments(arguments: list[str]) -> list[Expectation]:
    """The inverse of to_arguments, with parse_expectations' checks."""
    experiments: dict[str, dict[str, Any]] = {}
    for argument in arguments:
        target, sep, value = argument.partition("=")
        name, dot, key = target.partition(".")
        if not (sep and dot and name and key):
            raise ConfigError(f"--expect {argument!r}: expected EXPERIMENT.KEY=VALUE, e.g. ddp.min_mfu=0.3")
        try:
            number: Any = float(value)
        except ValueError:
            number = value  # refused below, naming the key
        if value.lstrip().startswith("{"):
            try:
                number = yaml.safe_load(value)
            except yaml.YAMLError as err:
                raise ConfigError(f"--expect {argument!r}: the limit is not a YAML mapping ({err})") from None
        experiments.setdefault(name, {"expect": {}})["expect"][key] = number
    return parse_expectations(experiments)


def check(expectations: list[Expectation], summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each expectation against its experiment's mean (summaries: scalelm.report.repeats.by_experiment)."""
    by_name = {s["experiment"]: s for s in summaries}
    checks = []
    for e in expectations:
        if e.experiment not in by_name:
            raise ConfigError(
                f"expect: no run of experiment {e.experiment!r} was aggregated (runs of: {', '.join(by_name)}); "
                "aggregate its runs too, or drop its expectations"
            )
        summary = by_name[e.experiment]
        value = summary[f"{e.figure}_mean"]
        checks.append(
            {
                "experiment": e.experiment,
                "expectation": e.key,
                "value": value,
                "limit": e.limit,
                "reference": e.reference,
                "tolerance": e.tolerance,
                "threshold": e.threshold,
                "seeds": summary["seeds"],
                "status": e.status(value),
                "disturbed": seeds_caveat(summary, e.figure),
            }
        )
    return checks


def describe(c: dict[str, Any]) -> str:
    """One check in words, e.g. `ddp: test_perplexity 212.4 (mean of 2 seeds) is above the maximum 200 (210 with
    the 5% tolerance): missed`, and the disturbance its runs saw, if any."""
    disturbed = f" (on disturbed runs: {c['disturbed']})" if c.get("disturbed") else ""
    return _describe(c) + disturbed


def _describe(c: dict[str, Any]) -> str:
    e = Expectation(c["experiment"], c["expectation"], c["limit"], c["tolerance"])
    bound = "minimum" if e.is_minimum else "maximum"
    seeds = f"mean of {c['seeds']} seed{'s' if c['seeds'] != 1 else ''}"
    if c["status"] == "no reference":
        value = "no value" if c["value"] is None else f"{c['value']:.4g}"
        return f"{e.experiment}: {e.figure} {value} ({seeds}) has no {bound} from the history: {c['reference']}"
    source = f", {c['reference']}" if c.get("reference") else ""
    if c["value"] is None:
        measured = f"has no value ({seeds})"
    else:
        side = "within" if c["status"] == "met" else ("below" if bound == "minimum" else "above")
        measured = f"{c['value']:.4g} ({seeds}) is {side}"
    limits = f"the {bound} {e.limit:.4g}{source} ({e.threshold:.4g} with the {e.tolerance * 100:g}% tolerance)"
    return f"{e.experiment}: {e.figure} {measured} {limits}: {c['status']}"


def markdown(checks: list[dict[str, Any]]) -> list[str]:
    """summary.md's section: how many were met, missed or had no reference, then each check; none without checks."""
    if not checks:
        return []
    missed = sum(c["status"] == "missed" for c in checks)
    unchecked = sum(c["status"] == "no reference" for c in checks)
    disturbed = sum(bool(c.get("disturbed")) for c in checks)
    on_disturbed = (
        f" {disturbed} on disturbed runs (`disturbed`): a miss there may be the disturbance's, a met "
        "speedup or efficiency a slow baseline's."
        if disturbed
        else ""
    )
    lines = [
        "",
        "## Expectations",
        "",
        f"{len(checks) - missed - unchecked} met, {missed} missed, {unchecked} without a reference (a limit "
        "from the results history before it holds an earlier study); each checked against the mean over "
        "the experiment's seeds (threshold: the limit with its relative tolerance)." + on_disturbed,
        "",
    ]
    return lines + markdown_table(
        COLUMNS, [[fmt(c[k]) if k != "status" else f"**{c[k]}**" for k in COLUMNS] for c in checks]
    )


def read_checks(path: Path) -> list[dict[str, Any]]:
    """expectations.csv as written by the aggregation, numbers as numbers."""
    if not path.is_file():
        raise ScaleLMError(f"{path} does not exist: run the aggregation first (python -m scalelm.report.aggregate)")
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            optional = ("reference", "disturbed")  # an older scalelm's file lacks them
            missing = [c for c in COLUMNS if c not in optional and c not in (reader.fieldnames or [])]
            if missing:
                raise ValueError(f"no column {', '.join(missing)}")
            rows = list(reader)
        for row in rows:
            for key in ("value", "limit", "tolerance", "threshold"):
                row[key] = float(row[key]) if row[key] else None
            row["seeds"] = int(row["seeds"])
            row.setdefault("reference", "")
            row.setdefault("disturbed", "")
    except (UnicodeDecodeError, csv.Error, TypeError, ValueError) as err:  # another file, or one damaged
        raise DataError(
            f"{path} is not an expectations.csv as the aggregation writes it ({err}): give the one in a study's "
            "results, or aggregate again"
        ) from None
    return rows


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalelm.report.expectations", description=__doc__.split("\n")[0])
    parser.add_argument("checks", type=Path, help="expectations.csv written by scalelm.report.aggregate")
    args = parser.parse_args(argv)
    checks = read_checks(args.checks)
    for c in checks:
        print(describe(c))
    missed = [c for c in checks if c["status"] != "met"]
    unchecked = [c for c in missed if c["status"] == "no reference"]
    if missed:
        first = ""
        if unchecked:
            first += (
                " This study's runs are in the results history now, so the next study has the reference it lacked; "
                "a first study passes with expect_strict: false."
            )
        if any(c.get("disturbed") for c in missed):
            first += (
                " A miss on disturbed runs may be the disturbance's: train those runs again on quiet hosts "
                "before changing anything."
            )
        raise ExpectationsMissed(
            f"{len(missed)} of {len(checks)} expectations missed (expect_strict): "
            + "; ".join(describe(c) for c in missed)
            + f". The summary and plots are kept beside {args.checks}: find the cause, or update `expect:` in the "
            "config if the new figures are right." + first
        )
    print(f"all {len(checks)} expectations met")


if __name__ == "__main__":
    main()
