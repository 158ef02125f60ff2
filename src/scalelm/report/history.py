"""The results history: every aggregation appends its runs to an SQLite database (Python's sqlite3), one row per
run attempt with its summary figures and the fingerprint of the environment it ran in, so that a rerun of the matrix
a month or a cluster later can be compared with what came before.

    python -m scalelm.report.history list [--db FILE] [--experiment NAME] [--since TIME]
    python -m scalelm.report.history compare [A [B]] [--db FILE] [--tolerance 0.05] [--alpha 0.05] [--out DIR] [--json]
    python -m scalelm.report.history export [--db FILE] > runs.jsonl
    python -m scalelm.report.history import FILE... [--db FILE]

A study is one aggregation (its study id: the time it was recorded, its results directory and the runs' study name,
where they were trained for one). `compare A B` sets study B
(default: the latest) against study A (default: the one before it), figure by figure (scalelm.report.history_compare:
Welch's t-test, the tolerance, the machine's spread where one seed a side allows no test, what changed between the two
environments); it exits 1 on a regression: significant, or with one seed beyond the spread, never a disturbed run's
speed. Export and import as JSON lines merge the histories of several clusters (scalelm.report.history_store: the
database, kept whole, every imported line checked before any is added).

This module is the command line only.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from scalelm.errors import ConfigError, DataError, friendly_errors
from scalelm.report.disturbance import contaminated
from scalelm.report.history_compare import Change, compare, describe
from scalelm.report.history_store import insert, read_rows, row_problem, studies
from scalelm.report.tables import markdown_table

DEFAULT_DB = "results/history.sqlite"

COLUMNS = [
    "experiment",
    "figure",
    "before",
    "after",
    "relative",
    "seeds",
    "p_value",
    "low",
    "high",
    "verdict",
    "environment",
    "disturbed",
]


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return describe(value)
    if isinstance(value, (list, tuple)):
        return "/".join(map(str, value))
    return str(value)


def write_comparison(changes: list[Change], out: Path, title: str) -> None:
    """compare.csv and compare.md in the directory `out`; one that cannot be (a file there, no permission) is one
    error naming it."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: give a directory for compare.md and compare.csv")
    rows = [[_cell(getattr(c, k)) for k in COLUMNS] for c in changes]
    try:
        out.mkdir(parents=True, exist_ok=True)
        with (out / "compare.csv").open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(COLUMNS)
            writer.writerows(rows)
        (out / "compare.md").write_text("\n".join([f"# {title}", "", *markdown_table(COLUMNS, rows)]) + "\n")
    except OSError as err:
        raise ConfigError(
            f"--out {out}: compare.md and compare.csv could not be written there ({err}); give a directory you may "
            "write in"
        ) from None


# ------------------------------------------------------------------------------------------------ list
SINCE_FORMS = "a date or time in ISO 8601: 2026-12-01, 2026-12-01T09:30, 2026-12-01T09:30+01:00"


def since_time(text: str) -> datetime:
    """`--since`: an ISO 8601 date or time (a month or day of one digit too, 2026-12-1), UTC unless it names its
    offset, as the history records its times; anything else is refused, not compared as text."""
    short_date = re.fullmatch(r"(\d{4})-(\d{1,2})-(\d{1,2})", text.strip())
    try:
        when = datetime(*map(int, short_date.groups())) if short_date else datetime.fromisoformat(text.strip())
    except ValueError as err:
        raise ConfigError(f"--since {text!r} is not a time scalelm can read ({err}): give {SINCE_FORMS}") from None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def list_runs(db: str | Path, experiment: str | None, since: datetime | None) -> None:
    """The studies and their runs, of `experiment` and recorded at or after `since` where given."""
    rows = read_rows(db, "WHERE experiment = ?" if experiment else "", (experiment,) if experiment else ())
    if since:  # by time, not as text: an imported history's times may have other UTC offsets
        rows = [r for r in rows if datetime.fromisoformat(r["recorded"]) >= since]
    if not rows and (experiment or since):
        print(
            f"no run in {db} was recorded{f' of {experiment}' if experiment else ''}"
            f"{f' since {since.isoformat()}' if since else ''}",
            file=sys.stderr,
        )
    for study_id in sorted({r["study"] for r in rows}):
        print(study_id)
        for r in (r for r in rows if r["study"] == study_id):
            f, env = r["figures"], r["environment"]
            disturbed = "  disturbed" if contaminated(f) else ""
            print(
                f"  {r['experiment']:<16} seed {r['seed']:<4} {r['layout'] or '':<10} "
                f"{_cell(f.get('tokens_per_s_per_device')):>10} tokens/s/device  test loss "
                f"{_cell(f.get('test_loss'))}  {env.get('device')} torch {env.get('torch')}{disturbed}"
            )


# ------------------------------------------------------------------------------------------------ the command
def choose(db: str | Path, a: str | None, b: str | None) -> tuple[str, str]:
    """Studies by their study id or a unique part of it (a study name is one); B defaults to the latest, A to the one
    before B."""
    known = studies(db)

    def find(part: str) -> str:
        found = [s for s in known if part in s]
        if len(found) != 1:
            raise ConfigError(f"{part!r} names {len(found)} studies of {db}; list them with `list`")
        return found[0]

    after = find(b) if b else (known[-1] if known else None)
    if after is None or (a is None and known.index(after) == 0):
        raise DataError(f"{db} holds {len(known)} study(ies): compare needs two")
    before = find(a) if a else known[known.index(after) - 1]
    return before, after


def export_rows(db: str | Path, out=sys.stdout) -> int:
    rows = read_rows(db)
    for row in rows:
        out.write(json.dumps(row, sort_keys=True) + "\n")
    return len(rows)


def import_rows(db: str | Path, files: list[Path]) -> int:
    """The runs of exported JSON lines, every line checked before any is added."""
    rows = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise DataError(f"{path} could not be read as a history export ({err}); nothing was imported") from None
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError) as err:  # not JSON, an integer of thousands of digits, too deep
                    raise DataError(
                        f"{path}:{number} is not a JSON line of a history export ({err}); nothing was imported"
                    ) from None
                problem = row_problem(row)
                if problem:
                    raise DataError(
                        f"{path}:{number}: {problem}; nothing was imported: correct or remove the line, then import "
                        "again"
                    )
                rows.append(row)
    return insert(db, rows)


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalelm.report.history", description=__doc__.split("\n")[0])
    parser.add_argument("--db", default=DEFAULT_DB, help=f"the history database (default {DEFAULT_DB})")
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="the studies and their runs")
    listing.add_argument("--experiment")
    listing.add_argument("--since", help=f"recorded at or after this time, UTC unless it says: {SINCE_FORMS}")
    compared = commands.add_parser("compare", help="study B against study A, figure by figure")
    compared.add_argument("a", nargs="?", help="study A (default: the one before B)")
    compared.add_argument("b", nargs="?", help="study B (default: the latest)")
    compared.add_argument("--tolerance", type=float, default=0.05, help="relative change that counts (default 0.05)")
    compared.add_argument("--alpha", type=float, default=0.05, help="significance level (default 0.05)")
    compared.add_argument("--out", type=Path, help="write compare.md and compare.csv here")
    compared.add_argument("--json", action="store_true", help="the changes as JSON on standard output")
    commands.add_parser("export", help="every run as JSON lines on standard output")
    imported = commands.add_parser("import", help="add the runs of exported JSON lines")
    imported.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "list":
        list_runs(args.db, args.experiment, None if args.since is None else since_time(args.since))
    elif args.command == "compare":
        if not 0 <= args.tolerance < 1 or not 0 < args.alpha < 1:
            parser.error("--tolerance must be in [0, 1) and --alpha in (0, 1)")
        a, b = choose(args.db, args.a, args.b)
        rows = read_rows(args.db, "WHERE study IN (?, ?)", (a, b))
        changes = compare(
            [r for r in rows if r["study"] == a], [r for r in rows if r["study"] == b], args.tolerance, args.alpha
        )
        if args.out:
            write_comparison(changes, args.out, f"{b} against {a}")
        if args.json:
            json.dump({"a": a, "b": b, "changes": [c.to_dict() for c in changes]}, sys.stdout, indent=1)
            sys.stdout.write("\n")
        else:
            print(f"B: {b}\nA: {a}")
            for c in changes:
                test = f"p {c.p_value:.3g}" if c.p_value is not None else "one seed a side"
                print(
                    f"  {c.experiment:<16} {c.figure:<28} {c.before:>12.4g} -> {c.after:<12.4g} "
                    f"{c.relative:+7.1%}  {test:<16} {c.verdict}"
                )
                if c.environment:
                    print(f"      changed: {_cell(c.environment)}")
                if c.disturbed:
                    print(f"      disturbed: {c.disturbed}")
        if any(c.verdict.startswith("regression") for c in changes):
            raise SystemExit(1)
    elif args.command == "export":
        export_rows(args.db)
    else:
        print(f"{import_rows(args.db, args.files)} new runs added to {args.db}")


if __name__ == "__main__":
    main()
