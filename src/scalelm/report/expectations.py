"""Reference values per experiment (`expect:` in the study config), checked by the aggregation: met or missed.

    experiments:
      ddp:
        expect: {min_tokens_per_s_per_device: 9000, max_test_perplexity: 180, tolerance: 0.1}

A key is `min_` or `max_` and a figure of summary_by_experiment.csv (scalelm.report.repeats); the figure's mean over
the experiment's seeds is checked. `tolerance` is relative and applies to every limit of the experiment (default
0.05): a minimum is met by a mean of at least limit x (1 - tolerance), a maximum by one of at most
limit x (1 + tolerance). A figure without a value (MFU of an unknown GPU) misses. The aggregation lists every check
in expectations.csv and summary.md; this module's command fails when one was missed, which the workflow runs with
`expect_strict: true` (rule check_expectations), so rerunning the matrix later detects a regression:

    python -m scalelm.report.expectations results/expectations.csv
"""

from __future__ import annotations

import argparse
import csv
import difflib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalelm.errors import ConfigError, ScaleLMError, friendly_errors
from scalelm.report.figures import LIMITS

DEFAULT_TOLERANCE = 0.05
COLUMNS = ["experiment", "expectation", "value", "limit", "tolerance", "threshold", "seeds", "status"]


class ExpectationsMissed(ScaleLMError):
    exit_code = 1  # a result, not a usage error (2)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Expectation:
    experiment: str
    key: str  # one of LIMITS
    limit: float
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def figure(self) -> str:
        return self.key.split("_", 1)[1]

    @property
    def is_minimum(self) -> bool:
        return self.key.startswith("min_")

    @property
    def threshold(self) -> float:
        """The limit with the tolerance applied in the lenient direction."""
        return self.limit * (1 - self.tolerance if self.is_minimum else 1 + self.tolerance)

    def met(self, value: float | None) -> bool:
        if value is None:
            return False
        return value >= self.threshold if self.is_minimum else value <= self.threshold


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
        if not _is_number(tolerance) or not 0 <= tolerance < 1:
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
            if not _is_number(limit) or limit <= 0:
                raise ConfigError(f"{where}.{key} must be a positive number, got {limit!r}")
            found.append(Expectation(name, key, float(limit), float(tolerance)))
    return found


def to_arguments(expectations: list[Expectation]) -> list[str]:
    """`EXPERIMENT.KEY=VALUE` for the aggregate command's --expect options."""
    arguments, tolerances = [], {}
    for e in expectations:
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
        checks.append({
            "experiment": e.experiment, "expectation": e.key, "value": value, "limit": e.limit,
            "tolerance": e.tolerance, "threshold": e.threshold, "seeds": summary["seeds"],
            "status": "met" if e.met(value) else "missed",
        })  # fmt: skip
    return checks


def describe(c: dict[str, Any]) -> str:
    """One check in words, e.g. `ddp: test_perplexity 212.4 (mean of 2 seeds) is above the maximum 200 (210 with
    the 5% tolerance): missed`."""
    e = Expectation(c["experiment"], c["expectation"], c["limit"], c["tolerance"])
    bound = "minimum" if e.is_minimum else "maximum"
    seeds = f"mean of {c['seeds']} seed{'s' if c['seeds'] != 1 else ''}"
    if c["value"] is None:
        measured = f"has no value ({seeds})"
    else:
        side = "within" if c["status"] == "met" else ("below" if bound == "minimum" else "above")
        measured = f"{c['value']:.4g} ({seeds}) is {side}"
    limits = f"the {bound} {e.limit:.4g} ({e.threshold:.4g} with the {e.tolerance * 100:g}% tolerance)"
    return f"{e.experiment}: {e.figure} {measured} {limits}: {c['status']}"


def read_checks(path: Path) -> list[dict[str, Any]]:
    """expectations.csv as written by the aggregation, numbers as numbers."""
    if not path.is_file():
        raise ScaleLMError(f"{path} does not exist: run the aggregation first (python -m scalelm.report.aggregate)")
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        for key in ("value", "limit", "tolerance", "threshold"):
            row[key] = float(row[key]) if row[key] else None
        row["seeds"] = int(row["seeds"])
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
    if missed:
        raise ExpectationsMissed(
            f"{len(missed)} of {len(checks)} expectations missed (expect_strict): "
            + "; ".join(describe(c) for c in missed)
            + f". The summary and plots are kept beside {args.checks}: find the cause, or update `expect:` in the "
            "config if the new figures are right"
        )
    print(f"all {len(checks)} expectations met")


if __name__ == "__main__":
    main()
