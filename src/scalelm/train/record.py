"""What a run leaves for the report, read without torch: `metrics.jsonl` (a line per log interval and evaluation,
written by train.metrics) and `run.json` (the run's record, written by the trainer at its end)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scalelm.train.rundir import RunDir


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = RunDir(Path(run_dir)).metrics
    return [json.loads(line) for line in path.read_text().splitlines() if line]
