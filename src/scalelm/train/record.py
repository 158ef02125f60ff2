"""What a run leaves for the report, read without torch: `metrics.jsonl` (a line per log interval and evaluation,
written by train.metrics) and `run.json` (the run's record: provenance and results, written by the trainer at its
end, of format RECORD_FORMAT; a record of another format is refused by name rather than misread)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scalelm.errors import DataError
from scalelm.files import atomic_write_text
from scalelm.train.rundir import RunDir

RECORD_FORMAT = 1  # of run.json: a change in what a key means, or a key removed, is a new format


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = RunDir(Path(run_dir)).metrics
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def write_record(run_dir: str | Path, record: dict[str, Any]) -> None:
    path = RunDir(Path(run_dir)).record
    atomic_write_text(path, json.dumps({"format": RECORD_FORMAT, **record}, indent=2) + "\n")


def read_record(run_dir: str | Path) -> dict[str, Any]:
    """run.json of the run at `run_dir` (FileNotFoundError if the training has not finished)."""
    path = RunDir(Path(run_dir)).record
    record = json.loads(path.read_text())
    if record.get("format") != RECORD_FORMAT:
        raise DataError(
            f"{path} is a run record of format {record.get('format')!r}; this scalelm reads format {RECORD_FORMAT}: "
            "report it with the scalelm that trained it, or train the run again"
        )
    return record
