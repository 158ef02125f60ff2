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

A run's figures of time that other work disturbed (scalelm.report.disturbance: its `disturbed` or `overlapped_by`,
and for speedup and efficiency its `scaling_flag`) are no reference: `reference` leaves them out and says how many, a
comparison names the disturbed runs on either side beside each change (`Change.disturbed`), and the trend marks
their studies.

Several studies and users may share one database (`history:` in the config; a shared filesystem too): each write is
one immediate transaction under SQLite's file lock with a long busy timeout, in its rollback journal (WAL needs shared
memory, which network filesystems lack), and a run already recorded (the same experiment, seed, settings and
attempt) is not added again. Export and import as JSON lines merge the histories of several clusters.

The history is kept whole: the database has a format (SQLite's user_version, HISTORY_FORMAT) and its runs table the
columns of that format, checked before anything is written (rows are written by column name); a history of another
format or with other columns is refused by name, never written into. Every row is checked before it is added
(`row_problem`: an import's lines all first, naming the bad one), and again when read. The workflow and the
aggregation refuse a history among the files they write or in a directory they replace (`check_location`).
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
from collections.abc import Iterable, Iterator
from contextlib import closing, contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from scalelm.errors import ConfigError, DataError, friendly_errors
from scalelm.report.disturbance import contaminated, figure_caveat
from scalelm.report.figures import FIGURES, RunSummary, finite_number
from scalelm.report.tables import markdown_table

DEFAULT_DB = "results/history.sqlite"
BUSY_TIMEOUT_S = 120.0
# The database's format (SQLite's user_version): a change in a column's meaning, or a column added or removed, is a
# new format. 0 is the history of a scalelm before formats, whose columns are format 1's: adopted on first use.
HISTORY_FORMAT = 1
COLUMNS_OF_RUNS = {
    "key": "TEXT PRIMARY KEY",  # experiment, seed, settings and attempt: a run is recorded once
    "study": "TEXT NOT NULL",  # the aggregation that recorded it
    "recorded": "TEXT NOT NULL",  # an ISO 8601 time with its UTC offset
    "experiment": "TEXT NOT NULL",
    "seed": "INTEGER NOT NULL",
    "layout": "TEXT",
    "settings_hash": "TEXT NOT NULL",
    "start_time": "TEXT",
    "end_time": "TEXT",
    "figures": "TEXT NOT NULL",  # JSON: the run's row of summary.csv
    "environment": "TEXT NOT NULL",  # JSON: the fingerprint (`fingerprint`)
}
SCHEMA = (
    f"CREATE TABLE IF NOT EXISTS runs ({', '.join(f'{name} {kind}' for name, kind in COLUMNS_OF_RUNS.items())})",
    "CREATE INDEX IF NOT EXISTS runs_by_study ON runs (study)",
)
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


# ------------------------------------------------------------------------------------------------ its place
def check_location(
    db: str | Path, written: Iterable[str | Path], replaced: Iterable[str | Path], setting: str, suggestion: str
) -> None:
    """Refuse a history `db` that is one of the files a study writes over (`written`) or lies in a directory it
    replaces whole (`replaced`: the data, a run directory): the history would be overwritten or deleted with it.
    `setting` names where it was given, `suggestion` a place apart."""
    where = Path(db).resolve()
    for output in written:
        if where == Path(output).resolve():
            raise ConfigError(
                f"{setting} {db} is {Path(output)}, which the study writes: the history would be overwritten; "
                f"choose a file apart from them, such as {suggestion}"
            )
    for directory in replaced:
        if where.is_relative_to(Path(directory).resolve()):
            raise ConfigError(
                f"{setting} {db} lies in {Path(directory)}, which the workflow replaces whole (the data, a run "
                f"directory): the history would be deleted with it; choose a file apart from them, such as "
                f"{suggestion}"
            )


# ------------------------------------------------------------------------------------------------ the database
ELSEWHERE = "point `history:` (--history, --db) at another file"


@contextmanager
def database_errors(db: str | Path, doing: str) -> Iterator[None]:
    """sqlite3's errors as one line naming the history."""
    try:
        yield
    except sqlite3.OperationalError as err:  # a directory, no permission, a lock held past the busy timeout
        raise DataError(
            f"{db}: the results history could not be {doing} ({err}): check that you may read and write it, or "
            f"{ELSEWHERE}"
        ) from None
    except sqlite3.Error as err:  # not an SQLite database, or a damaged one
        raise DataError(f"{db} is not a scalelm results history, or a damaged one ({err}): {ELSEWHERE}") from None


def connect(db: str | Path, write: bool = True) -> sqlite3.Connection:
    """The history `db`, created if new; one of another format or with other columns is refused before anything is
    written to it."""
    path = Path(db)
    path.parent.mkdir(parents=True, exist_ok=True)
    with database_errors(db, "opened"):
        connection = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            connection.execute("PRAGMA journal_mode=DELETE")
            check_format(connection, db, write)
        except BaseException:
            connection.close()
            raise
    return connection


def check_format(connection: sqlite3.Connection, db: str | Path, write: bool) -> None:
    """Format HISTORY_FORMAT with its columns: as it is. An empty file, or a history of the scalelm before formats
    (user_version 0, the same columns; read as it is): made so at the first write, in one transaction. Anything else
    refused by name."""
    version = _format(connection, db)
    if _holds_runs(connection, db) and (version == HISTORY_FORMAT or not write):
        return
    connection.execute("BEGIN IMMEDIATE")  # another writer may be setting up the same file
    try:
        if _format(connection, db) != HISTORY_FORMAT or not _holds_runs(connection, db):
            for statement in SCHEMA:
                connection.execute(statement)
            connection.execute(f"PRAGMA user_version = {HISTORY_FORMAT}")
        connection.execute("COMMIT")
    except BaseException:
        with suppress(sqlite3.Error):
            connection.execute("ROLLBACK")
        raise


def _holds_runs(connection: sqlite3.Connection, db: str | Path) -> bool:
    """Whether `db` holds the runs table, with this format's columns; a database of other tables is refused."""
    tables = [name for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    if tables and "runs" not in tables:
        raise DataError(
            f"{db} is not a scalelm results history (it holds the table(s) {', '.join(sorted(tables))} and no runs): "
            f"{ELSEWHERE}"
        )
    if "runs" in tables:
        check_columns(connection, db)
    return "runs" in tables


def _format(connection: sqlite3.Connection, db: str | Path) -> int:
    version = connection.execute("PRAGMA user_version").fetchone()[0]
    if version not in (0, HISTORY_FORMAT):
        raise DataError(
            f"{db} is a results history of format {version}; this scalelm reads format {HISTORY_FORMAT}: use the "
            f"scalelm that wrote it{' (a later one)' if version > HISTORY_FORMAT else ''}, or {ELSEWHERE}"
        )
    return version


def check_columns(connection: sqlite3.Connection, db: str | Path) -> None:
    """The runs table has the columns this scalelm writes, in any order (rows are written by column name)."""
    found = {row[1] for row in connection.execute("PRAGMA table_info(runs)")}
    foreign, missing = sorted(found - set(COLUMNS_OF_RUNS)), [c for c in COLUMNS_OF_RUNS if c not in found]
    if foreign or missing:
        has = f"has the column(s) {', '.join(foreign)}, which this scalelm does not write" if foreign else ""
        lacks = f"lacks the column(s) {', '.join(missing)}" if missing else ""
        raise DataError(
            f"{db}: its runs table {' and '.join(p for p in (has, lacks) if p)}: another version of scalelm wrote it; "
            f"use the scalelm that wrote it, or {ELSEWHERE}"
        )


def insert(db: str | Path, rows: Iterable[dict[str, Any]]) -> int:
    """Rows (the columns of `runs`, figures and environment as mappings) added in one transaction, each checked
    first (`row_problem`); those already recorded are left alone. Returns how many were new."""
    rows = list(rows)
    for row in rows:
        problem = row_problem(row)
        if problem:
            raise DataError(f"the run {row.get('key')!r} was not recorded in {db}: {problem}")  # scalelm's own bug
    names = ", ".join(COLUMNS_OF_RUNS)
    values = ", ".join(f":{name}" for name in COLUMNS_OF_RUNS)
    with closing(connect(db)) as connection, database_errors(db, "written"):
        connection.execute("BEGIN IMMEDIATE")  # the write lock now, not at the first insert: no upgrade deadlock
        try:
            before = connection.total_changes
            connection.executemany(
                f"INSERT OR IGNORE INTO runs ({names}) VALUES ({values})",
                [{**row, "figures": json.dumps(row["figures"]), "environment": json.dumps(row["environment"])}
                 for row in rows],
            )  # fmt: skip
            connection.execute("COMMIT")
        except BaseException:
            with suppress(sqlite3.Error):
                connection.execute("ROLLBACK")
            raise
        return connection.total_changes - before


# ------------------------------------------------------------------------------------------------ a row's check
def row_problem(row: Any) -> str | None:
    """What makes `row` (a run as `export` writes it: every column, figures and environment as mappings) unfit for
    the history, or None: a row that reads back as anything else breaks `list`, `compare` and every later
    aggregation of its experiment."""
    if not isinstance(row, dict):
        return f"a run is a JSON object of the keys {', '.join(COLUMNS_OF_RUNS)}, got {_short(row)}"
    missing = [name for name in COLUMNS_OF_RUNS if name not in row]
    extra = sorted(str(name) for name in row if name not in COLUMNS_OF_RUNS)
    if missing:
        return f"the run lacks {', '.join(missing)}"
    if extra:
        return f"the run has {', '.join(extra)}, which a run of this format does not"
    for name in ("key", "study", "experiment", "settings_hash"):
        if not isinstance(row[name], str) or not row[name]:
            return f"{name} must be a non-empty string, got {_short(row[name])}"
    for name in ("layout", "start_time", "end_time"):
        if row[name] is not None and not isinstance(row[name], str):
            return f"{name} must be a string or null, got {_short(row[name])}"
    if not isinstance(row["seed"], int) or isinstance(row["seed"], bool):
        return f"seed must be a whole number, got {_short(row['seed'])}"
    if not _timestamp(row["recorded"]):
        return (
            "recorded must be an ISO 8601 time with its UTC offset (as `export` writes it, e.g. "
            f"2026-11-25T10:00:00.000000+00:00), got {_short(row['recorded'])}"
        )
    if not isinstance(row["environment"], dict):
        return f"environment must be a mapping, got {_short(row['environment'])}"
    return figures_problem(row["figures"])


def figures_problem(figures: Any) -> str | None:
    """Figures are a row of summary.csv: numbers, strings or null; those compared or drawn finite numbers or null."""
    if not isinstance(figures, dict):
        return f"figures must be a mapping of figure names to values, got {_short(figures)}"
    for name, value in figures.items():
        finite = finite_number(value) or value is None
        if (name in COMPARED and not finite) or (isinstance(value, float) and not finite):
            return f"figures.{name} must be a finite number or null, got {_short(value)}"
        if not (finite or isinstance(value, str)):
            return f"figures.{name} must be a number, a string or null, got {_short(value)}"
    return None


def _timestamp(value: Any) -> bool:
    try:
        return isinstance(value, str) and datetime.fromisoformat(value).utcoffset() is not None
    except ValueError:
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
    with closing(connect(db, write=False)) as connection, database_errors(db, "read"):
        connection.row_factory = sqlite3.Row
        found = connection.execute(f"SELECT * FROM runs {where} ORDER BY recorded, experiment, seed", args)
        return [_decoded(dict(row), db) for row in found]


def _decoded(row: dict[str, Any], db: str | Path) -> dict[str, Any]:
    """A row as recorded, its figures and environment decoded and the whole checked: one written by other means
    than scalelm's (an editor, an old import) is refused by name with how to remove it."""
    try:
        row = {**row, "figures": json.loads(row["figures"]), "environment": json.loads(row["environment"])}
        problem = row_problem(row)
    except (TypeError, ValueError) as err:
        problem = f"figures and environment must be JSON ({err})"
    if problem:
        quoted = str(row["key"]).replace("'", "''")  # as an SQL string
        raise DataError(
            f"{db}: the run {row['key']!r} (study {row['study']!r}) is damaged: {problem}; remove it: sqlite3 {db} "
            f"\"DELETE FROM runs WHERE key = '{quoted}'\""
        )
    return row


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
    value = statistics.median(statistics.fmean(means[study]) for study in last)
    return value, f"median of the last {len(last)} stud{'y' if len(last) == 1 else 'ies'} (n {n}){left_out}"


def _machine(environment: dict[str, Any]) -> tuple[str | None, str | None]:
    return environment.get("site"), environment.get("device")


TREND_FIGURES = ("tokens_per_s_per_device", "test_loss")
COMPARED = {*DIRECTIONS, *TREND_FIGURES}  # the figures a history's row must hold as numbers (or null)


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
    verdict: str  # "regression", "regression (not tested)", "improvement", "within tolerance", "not significant"
    environment: dict[str, tuple[Any, Any]]  # what differs between the two sides' environments
    disturbed: str = ""  # the runs of either side whose figure other work disturbed, e.g. "after: ddp seed 1"

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
            x = [float(r["figures"][figure]) for r in a if finite_number(r["figures"].get(figure))]
            y = [float(r["figures"][figure]) for r in b if finite_number(r["figures"].get(figure))]
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
                                  verdict, env if worse else {}, disturbed_sides(a, b, figure)))  # fmt: skip
    return changes


def disturbed_sides(before: list[dict], after: list[dict], figure: str) -> str:
    """The runs of each side whose `figure` other work disturbed, e.g. `before: seed 1; after: seeds 1, 2`."""
    sides = []
    for side, rows in (("before", before), ("after", after)):
        seeds = [str(r["seed"]) for r in rows if figure_caveat(r["figures"], figure)]
        if seeds:
            sides.append(f"{side}: seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)}")
    return "; ".join(sides)


COLUMNS = ["experiment", "figure", "before", "after", "relative", "seeds", "p_value", "low", "high", "verdict",
           "environment", "disturbed"]  # fmt: skip


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
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{number} is not a JSON line of a history export ({err})") from None
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
                disturbed = "  disturbed" if contaminated(f) else ""
                print(f"  {r['experiment']:<16} seed {r['seed']:<4} {r['layout'] or '':<10} "
                      f"{_cell(f.get('tokens_per_s_per_device')):>10} tokens/s/device  test loss "
                      f"{_cell(f.get('test_loss'))}  {env.get('device')} torch {env.get('torch')}{disturbed}")  # fmt: skip
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
