"""The results history: every aggregation appends its runs to an SQLite database (Python's sqlite3), one row per
run attempt with its summary figures and the fingerprint of the environment it ran in, so that a rerun of the matrix
a month or a cluster later can be compared with what came before.

    python -m scalelm.report.history list [--db FILE] [--experiment NAME] [--since DATE]
    python -m scalelm.report.history compare [A [B]] [--db FILE] [--tolerance 0.05] [--alpha 0.05] [--out DIR] [--json]
    python -m scalelm.report.history export [--db FILE] > runs.jsonl
    python -m scalelm.report.history import FILE... [--db FILE]

A study is one aggregation (its id: the time it was recorded and its results directory). `compare A B` sets study B
(default: the latest) against study A (default: the one before it): per experiment and figure of the registry that
has a better direction (scalelm.report.figures: an `expect:` minimum is better higher, a maximum lower), the relative
change of the mean, and with two seeds or more a side Welch's t-test and a 95% confidence interval of the difference
(scipy). A change is a regression only when it goes the worse way beyond the tolerance and is significant; with one
seed a side, beyond the tolerance is flagged "not tested". Beside each flagged figure: what changed between the two
environments (torch, CUDA, NCCL, the device, the image, the nodes, the commit).

The aggregation also reads the history for two things: the limit of an `expect:` that names it (`reference`: the
median of the experiment's last n comparable studies) and the trend figure (`trend`: every study of the same
settings, coloured by environment).

Several studies and users may share one database (`history:` in the config; a shared filesystem too): each write is
one immediate transaction under SQLite's file lock with a long busy timeout, in its rollback journal (WAL needs shared
memory, which network filesystems lack), and a run already recorded (the same experiment, seed, settings and
attempt) is not added again. Export and import as JSON lines merge the histories of several clusters.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import sqlite3
import statistics
import sys
from collections.abc import Iterable
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from scalelm.errors import ConfigError, DataError, friendly_errors
from scalelm.report.figures import FIGURES, RunSummary
from scalelm.report.tables import markdown_table

DEFAULT_DB = "results/history.sqlite"
BUSY_TIMEOUT_S = 120.0
SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    key TEXT PRIMARY KEY,        -- experiment, seed, settings and attempt: a run is recorded once
    study TEXT NOT NULL,         -- the aggregation that recorded it
    recorded TEXT NOT NULL,
    experiment TEXT NOT NULL,
    seed INTEGER NOT NULL,
    layout TEXT,
    settings_hash TEXT NOT NULL,
    start_time TEXT,
    end_time TEXT,
    figures TEXT NOT NULL,       -- JSON: the run's row of summary.csv
    environment TEXT NOT NULL    -- JSON: the fingerprint (`fingerprint`)
);
CREATE INDEX IF NOT EXISTS runs_by_study ON runs (study);
"""
# the figures compared: those with a better direction (an `expect:` bound), higher is better for a minimum
DIRECTIONS = {figure.name: 1 if figure.expect == "min" else -1 for figure in FIGURES if figure.expect}


def settings_hash(run: RunSummary) -> str:
    """The run's identity (scalelm.train.rundir.identity: the settings that determine the model, the data's
    checksums, the world size), hashed."""
    return hashlib.sha256(json.dumps(run.identity, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint(run: RunSummary) -> dict[str, Any]:
    """What a figure depends on besides the settings, from the run's record: the machine, the threads, the software
    (each installed package scalelm needs, `package NAME`, and the lock with the pins the environment missed)."""
    record = run.record
    container = record.container or {}
    labels = container.get("labels") or {}
    lock = record.versions.get("lock") or {}
    return {
        "site": record.environment.get("SLURM_CLUSTER_NAME") or "local",
        "partition": record.environment.get("SLURM_JOB_PARTITION"),
        "nodes": record.nodes,
        "device": record.device.get("name") or "cpu",
        "cpu": record.device.get("cpu"),
        "threads": record.environment.get("OMP_NUM_THREADS"),
        "driver": record.device.get("driver"),
        "nccl": record.device.get("nccl"),
        **{name: record.versions.get(name) for name in ("torch", "cuda", "python", "scalelm")},
        "git_commit": record.git_commit,
        "image": container.get("image"),
        "image_labels": {k: v for k, v in labels.items() if k.startswith("org.scalelm")} or None,
        "lock": lock.get("sha256", "")[:16] or None,
        "lock_missed": sorted(lock.get("differs") or {}) or None,
        **{f"package {name}": version for name, version in (record.versions.get("packages") or {}).items()},
    }


# ------------------------------------------------------------------------------------------------ the database
def connect(db: str | Path) -> sqlite3.Connection:
    path = Path(db)
    path.parent.mkdir(parents=True, exist_ok=True)
    connection = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    try:
        connection.execute("PRAGMA journal_mode=DELETE")
        connection.executescript(SCHEMA)
    except sqlite3.DatabaseError as err:
        connection.close()
        raise DataError(f"{db} is not a scalelm results history ({err}): point `history:` at another file") from None
    return connection


def insert(db: str | Path, rows: Iterable[dict[str, Any]]) -> int:
    """Rows (the columns of `runs`, figures and environment as mappings) added in one transaction; those already
    recorded are left alone. Returns how many were new."""
    rows = list(rows)
    with closing(connect(db)) as connection:
        connection.execute("BEGIN IMMEDIATE")  # the write lock now, not at the first insert: no upgrade deadlock
        try:
            before = connection.total_changes
            connection.executemany(
                "INSERT OR IGNORE INTO runs VALUES (:key, :study, :recorded, :experiment, :seed, :layout, "
                ":settings_hash, :start_time, :end_time, :figures, :environment)",
                [{**row, "figures": json.dumps(row["figures"]), "environment": json.dumps(row["environment"])}
                 for row in rows],
            )  # fmt: skip
            connection.execute("COMMIT")
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        return connection.total_changes - before


def run_key(run: RunSummary) -> str:
    """A run attempt: its experiment, seed, settings, start and end."""
    figures, record = run.figures, run.record
    attempt = f"{figures['experiment']}|{figures['seed']}|{settings_hash(run)}|{record.start_time}|{record.end_time}"
    return hashlib.sha256(attempt.encode()).hexdigest()


def record_runs(db: str | Path, runs: list[RunSummary], results_dir: str | Path) -> tuple[str, int]:
    """Append an aggregation's runs as one study; returns the study's id and how many runs were new."""
    now = datetime.now(timezone.utc).isoformat(timespec="microseconds")  # ids sort as the studies were recorded
    study = f"{now} {Path(results_dir).resolve()}"
    rows = []
    for run in runs:
        figures, record = run.figures, run.record
        digest = settings_hash(run)
        rows.append({
            "key": run_key(run), "study": study, "recorded": now,
            "experiment": figures["experiment"], "seed": figures["seed"], "layout": figures["layout"],
            "settings_hash": digest, "start_time": record.start_time, "end_time": record.end_time,
            "figures": figures, "environment": fingerprint(run),
        })  # fmt: skip
    return study, insert(db, rows)


def read_rows(db: str | Path, where: str = "", args: tuple = ()) -> list[dict[str, Any]]:
    if not Path(db).exists():
        raise DataError(f"no results history at {db}: aggregate a study first (its summary records its runs)")
    with closing(connect(db)) as connection:
        connection.row_factory = sqlite3.Row
        found = connection.execute(f"SELECT * FROM runs {where} ORDER BY recorded, experiment, seed", args)
        return [{**dict(r), "figures": json.loads(r["figures"]), "environment": json.loads(r["environment"])}
                for r in found]  # fmt: skip


def studies(db: str | Path) -> list[str]:
    return sorted({row["study"] for row in read_rows(db)})


def since_previous(
    rows: list[dict[str, Any]], runs: list[RunSummary], tolerance: float = 0.05, alpha: float = 0.05
) -> tuple[str, list[Change]] | None:
    """These runs (as recorded in the history's `rows`) against the latest study recorded before them: its id and
    the changes; None if there is none."""
    keys = {run_key(run) for run in runs}
    current = [r for r in rows if r["key"] in keys]
    if not current:
        return None
    first = min(r["study"] for r in current)
    earlier = sorted({r["study"] for r in rows if r["study"] < first})
    if not earlier:
        return None
    return earlier[-1], compare([r for r in rows if r["study"] == earlier[-1]], current, tolerance, alpha)


def reference(
    rows: list[dict[str, Any]], runs: list[RunSummary], experiment: str, figure: str, n: int, db: str | Path
) -> tuple[float | None, str]:
    """The limit an `expect: {history: median_of_last, n: N}` takes: over the last `n` studies of the history `db`
    (its `rows`) recorded before these runs with runs of `experiment` comparable with theirs (the same identity, on
    the same site and device), the median of each study's mean of `figure`; and where it came from, or why there is
    none."""
    mine = [run for run in runs if run.figures["experiment"] == experiment]
    keys, hashes = {run_key(run) for run in mine}, {settings_hash(run) for run in mine}
    machines = {_machine(fingerprint(run)) for run in mine}
    first = min((r["study"] for r in rows if r["key"] in keys), default=None)
    means: dict[str, list[float]] = {}
    for r in rows:
        comparable = r["experiment"] == experiment and r["settings_hash"] in hashes
        comparable = comparable and _machine(r["environment"]) in machines
        if comparable and (first is None or r["study"] < first) and _number(r["figures"].get(figure)):
            means.setdefault(r["study"], []).append(float(r["figures"][figure]))
    if not means:
        return None, f"no earlier study of {experiment} with these settings on this site and device in {db}"
    last = sorted(means)[-n:]
    value = statistics.median(statistics.fmean(means[study]) for study in last)
    return value, f"median of the last {len(last)} stud{'y' if len(last) == 1 else 'ies'} (n {n})"


def _machine(environment: dict[str, Any]) -> tuple[str | None, str | None]:
    return environment.get("site"), environment.get("device")


TREND_FIGURES = ("tokens_per_s_per_device", "test_loss")


@dataclass(frozen=True)
class TrendPoint:
    """One study of an experiment in the trend figure: when, in which environment, each figure's values by seed."""

    recorded: datetime
    environment: str
    values: dict[str, list[float]]


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
                {f: [float(r["figures"][f]) for r in rows if _number(r["figures"].get(f))] for f in TREND_FIGURES},
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
    verdict: str  # "regression", "regression (not tested)", "improvement", "within tolerance", "not significant"
    environment: dict[str, tuple[Any, Any]]  # what differs between the two sides' environments

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
        for figure, direction in DIRECTIONS.items():
            x = [float(r["figures"][figure]) for r in a if _number(r["figures"].get(figure))]
            y = [float(r["figures"][figure]) for r in b if _number(r["figures"].get(figure))]
            if not x or not y:
                continue
            mean_x, mean_y = statistics.fmean(x), statistics.fmean(y)
            relative = (mean_y - mean_x) / abs(mean_x) if mean_x else (0.0 if mean_y == mean_x else math.inf)
            p_value = low = high = None
            if len(x) >= 2 and len(y) >= 2:
                p_value, low, high = welch(x, y)
            worse = relative * direction < -tolerance
            better = relative * direction > tolerance
            if not (worse or better):
                verdict = "within tolerance"
            elif p_value is None:
                verdict = "regression (not tested)" if worse else "improvement (not tested)"
            elif p_value >= alpha:
                verdict = "not significant"
            else:
                verdict = "regression" if worse else "improvement"
            changes.append(Change(experiment, figure, mean_x, mean_y, relative, (len(x), len(y)), p_value, low, high,
                                  verdict, env if worse else {}))  # fmt: skip
    return changes


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


COLUMNS = ["experiment", "figure", "before", "after", "relative", "seeds", "p_value", "low", "high", "verdict",
           "environment"]  # fmt: skip


def describe(environment: dict[str, tuple[Any, Any]]) -> str:
    """What changed between two environments, e.g. `torch: "2.9.0" -> "2.13.0"`."""
    return "; ".join(f"{k}: {' | '.join(a or ['-'])} -> {' | '.join(b or ['-'])}" for k, (a, b) in environment.items())


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
    out.mkdir(parents=True, exist_ok=True)
    with (out / "compare.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        writer.writerows([[_cell(getattr(c, k)) for k in COLUMNS] for c in changes])
    lines = [f"# {title}", "", *markdown_table(COLUMNS, [[_cell(getattr(c, k)) for k in COLUMNS] for c in changes])]
    (out / "compare.md").write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------------ the command
def choose(db: str | Path, a: str | None, b: str | None) -> tuple[str, str]:
    """Studies by id or by a unique part of it; B defaults to the latest, A to the one before B."""
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
    rows = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{number} is not a JSON line of a history export ({err})") from None
    return insert(db, rows)


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalelm.report.history", description=__doc__.split("\n")[0])
    parser.add_argument("--db", default=DEFAULT_DB, help=f"the history database (default {DEFAULT_DB})")
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="the studies and their runs")
    listing.add_argument("--experiment")
    listing.add_argument("--since", help="recorded on or after this date (YYYY-MM-DD)")
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
        where, values = [], []
        if args.experiment:
            where.append("experiment = ?")
            values.append(args.experiment)
        if args.since:
            where.append("recorded >= ?")
            values.append(args.since)
        rows = read_rows(args.db, ("WHERE " + " AND ".join(where)) if where else "", tuple(values))
        for study in sorted({r["study"] for r in rows}):
            print(study)
            for r in (r for r in rows if r["study"] == study):
                f, env = r["figures"], r["environment"]
                print(f"  {r['experiment']:<16} seed {r['seed']:<4} {r['layout'] or '':<10} "
                      f"{_cell(f.get('tokens_per_s_per_device')):>10} tokens/s/device  test loss "
                      f"{_cell(f.get('test_loss'))}  {env.get('device')} torch {env.get('torch')}")  # fmt: skip
    elif args.command == "compare":
        if not 0 <= args.tolerance < 1 or not 0 < args.alpha < 1:
            parser.error("--tolerance must be in [0, 1) and --alpha in (0, 1)")
        a, b = choose(args.db, args.a, args.b)
        rows = read_rows(args.db, "WHERE study IN (?, ?)", (a, b))
        changes = compare([r for r in rows if r["study"] == a], [r for r in rows if r["study"] == b],
                          args.tolerance, args.alpha)  # fmt: skip
        if args.out:
            write_comparison(changes, args.out, f"{b} against {a}")
        if args.json:
            json.dump({"a": a, "b": b, "changes": [c.to_dict() for c in changes]}, sys.stdout, indent=1)
            sys.stdout.write("\n")
        else:
            print(f"B: {b}\nA: {a}")
            for c in changes:
                test = f"p {c.p_value:.3g}" if c.p_value is not None else "one seed a side"
                print(f"  {c.experiment:<16} {c.figure:<28} {c.before:>12.4g} -> {c.after:<12.4g} "
                      f"{c.relative:+7.1%}  {test:<16} {c.verdict}")  # fmt: skip
                if c.environment:
                    print(f"      changed: {_cell(c.environment)}")
        if any(c.verdict.startswith("regression") for c in changes):
            raise SystemExit(1)
    elif args.command == "export":
        export_rows(args.db)
    else:
        print(f"{import_rows(args.db, args.files)} new runs added to {args.db}")


if __name__ == "__main__":
    main()
