"""The results history's store: an SQLite database (Python's sqlite3) that every aggregation appends its runs to, one
row per run attempt with its summary figures and the fingerprint of the environment it ran in (`fingerprint`).

Several studies and users may share one database (`history:` in the config; a shared filesystem too): each write is
one immediate transaction under SQLite's file lock with a long busy timeout, in its rollback journal (WAL needs shared
memory, which network filesystems lack), and a run already recorded (the same experiment, seed, settings and
attempt) is not added again.

The history is kept whole: the database has a format (SQLite's user_version, HISTORY_FORMAT) and its runs table the
columns of that format, checked before anything is written (rows are written by column name); a history of another
format or with other columns is refused by name, never written into. Every row is checked before it is added
(`row_problem`: an import's lines all first, naming the bad one), and again when read. The workflow and the
aggregation refuse a history among the files they write or in a directory they replace (`check_location`).

Its statistics are scalelm.report.history_compare, its command line scalelm.report.history.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import closing, contextmanager, suppress
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from scalelm.config import identity_settings
from scalelm.errors import ConfigError, DataError
from scalelm.report.figures import FIGURES, RunSummary, finite_number

BUSY_TIMEOUT_S = 120.0
# The database's format (SQLite's user_version): a change in a column's meaning, or a column added or removed, is a
# new format. 0 is the history of a scalelm before formats, whose columns are format 1's: adopted on first use.
HISTORY_FORMAT = 1
COLUMNS_OF_RUNS = {
    "key": "TEXT PRIMARY KEY",  # experiment, seed, settings and attempt: a run is recorded once
    "study": "TEXT NOT NULL",  # the study id: the aggregation that recorded it (time, results directory, name)
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
# The figures compared (those with a better direction, an `expect:` bound: higher is better for a minimum) and those
# the trend figure draws: a history's row must hold them as numbers (or null).
DIRECTIONS = {figure.name: 1 if figure.expect == "min" else -1 for figure in FIGURES if figure.expect}
TREND_FIGURES = ("tokens_per_s_per_device", "test_loss")
COMPARED = {*DIRECTIONS, *TREND_FIGURES}


def settings_hash(run: RunSummary) -> str:
    """The run's identity (scalelm.train.rundir.identity: the settings that determine the model, the data's
    checksums, the world size), hashed as this scalelm counts identity: an older run's identity.json may hold
    settings no longer counted (scalelm.config.identity_settings)."""
    identity = run.identity
    if isinstance(identity, dict) and isinstance(identity.get("settings"), dict):
        identity = {**identity, "settings": identity_settings(identity["settings"])}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


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
    resolved = Path(db).resolve()
    for output in written:
        if resolved == Path(output).resolve():
            raise ConfigError(
                f"{setting} {db} is {Path(output)}, which the study writes: the history would be overwritten; "
                f"choose a file apart from them, such as {suggestion}"
            )
    for directory in replaced:
        if resolved.is_relative_to(Path(directory).resolve()):
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
                [
                    {**row, "figures": json.dumps(row["figures"]), "environment": json.dumps(row["environment"])}
                    for row in rows
                ],
            )
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
    if not -(2**63) <= row["seed"] < 2**63:
        return f"seed must be a whole number of 64 bits at most, as SQLite stores them, got {_short(row['seed'])}"
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
        finite = _finite(value) or value is None
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if (name in COMPARED or number) and not finite:
            return f"figures.{name} must be a finite number or null, got {_short(value)}"
        if not (finite or isinstance(value, str)):
            return f"figures.{name} must be a number, a string or null, got {_short(value)}"
    return None


def _finite(value: Any) -> bool:
    try:
        return finite_number(value)
    except OverflowError:  # an integer beyond a float's range: no figure could be compared or averaged with it
        return False


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
    """Append an aggregation's runs as one study; returns its study id and how many runs were new. The id (the time,
    the results directory) ends in the runs' study name where they were trained for one (the workflow's `study`)."""
    now = datetime.now(timezone.utc).isoformat(timespec="microseconds")  # ids sort as the studies were recorded
    names = sorted({str(run.record.config.get("study")) for run in runs if run.record.config.get("study")})
    study_id = " ".join([now, str(Path(results_dir).resolve()), *(f"({name})" for name in names)])
    rows = []
    for run in runs:
        figures, record = run.figures, run.record
        digest = settings_hash(run)
        rows.append(
            {
                "key": run_key(run),
                "study": study_id,
                "recorded": now,
                "experiment": figures["experiment"],
                "seed": figures["seed"],
                "layout": figures["layout"],
                "settings_hash": digest,
                "start_time": record.start_time,
                "end_time": record.end_time,
                "figures": figures,
                "environment": fingerprint(run),
            }
        )
    return study_id, insert(db, rows)


def read_rows(db: str | Path, clause: str = "", args: tuple = ()) -> list[dict[str, Any]]:
    """The history's rows in the order they were recorded; `clause` (a WHERE with `args`) keeps some."""
    if not Path(db).exists():
        raise DataError(f"no results history at {db}: aggregate a study first (its summary records its runs)")
    with closing(connect(db, write=False)) as connection, database_errors(db, "read"):
        connection.row_factory = sqlite3.Row
        found = connection.execute(f"SELECT * FROM runs {clause} ORDER BY recorded, experiment, seed", args)
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
