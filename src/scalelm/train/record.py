"""What a run leaves for the report, read without torch: `metrics.jsonl` (a line per log interval and evaluation,
written by train.metrics) and `run.json`, the run's record (`RunRecord`: provenance, layout and `Results`), written
by the trainer at its end and read by the report and the preflight, of format RECORD_FORMAT; a record of another
format, or with keys this format does not have, is refused by name rather than misread."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scalelm.config import identity_settings
from scalelm.errors import DataError
from scalelm.files import atomic_write_text
from scalelm.settings_yaml import shown
from scalelm.train.rundir import RunDir

RECORD_FORMAT = 1  # of run.json: a change in what a key means, or a key removed, is a new format


@dataclass(frozen=True)
class Results:
    """What the run did and measured, beside what scalelm.plan predicted for its layout (MiB, the fullest rank)."""

    strategy: str  # the layout's name: single, ddp, fsdp, hsdp, tp, fsdp_tp, pp, ...
    layout: str  # dp_replicate x dp_shard x tp x pp (x cp where > 1)
    steps: int
    global_batch: int  # sequences per optimizer step
    tokens_per_step: int
    train_time_s: float  # training only: evaluations and checkpoints paused the clock
    final_train_loss: float
    validation: dict[str, Any]  # the last evaluation: loss, perplexity, tokens
    plan_mb_per_rank: dict[str, float]
    flops_per_token: int
    test: dict[str, Any] | None = None
    epochs_completed: int = 0
    tokens_seen: int = 0
    tokens_per_s: float | None = None
    checkpoint: str | None = None
    state_mb_per_rank: dict[str, float] | None = None  # measured on this attempt's first step; None without one
    mfu: float | None = None
    peak_flops_per_device: float | None = None  # None where the device's peak is unknown
    peak_flops_source: str | None = None
    comm: dict[str, Any] | None = None  # the profiled steps' communication share (scalelm.measure.comm)
    pipeline: dict[str, Any] | None = None  # schedule, bubble, timeline (scalelm.parallel.pipeline)
    energy: dict[str, Any] | None = None  # joules, joules_per_token, source, unknown (scalelm.measure.energy)
    staging: dict[str, Any] | None = None  # the last attempt's: mode, dir, seconds, bytes (scalelm.data.stage)
    parameters: dict[str, int] | None = None  # the model's in all and per token (total, active); None: an older run
    experts: dict[str, Any] | None = None  # a mixture's load balance, aux loss (scalelm.measure.experts); None: dense


@dataclass(frozen=True)
class RunRecord:
    """run.json: where and with what the run ran (scalelm.train.provenance), its layout, and its results."""

    config: dict[str, Any]  # the resolved training settings
    world_size: int
    launch: dict[str, int]  # torchrun's view: nodes, procs_per_node
    nodes: list[str]
    start_time: str
    end_time: str
    wall_time_s: float
    results: Results
    hostnames: list[str] = field(default_factory=list)  # by rank
    machines: list[str] = field(default_factory=list)  # by rank: the machine (boot id) whose cores the rank shares
    parallel: dict[str, Any] = field(default_factory=dict)  # degrees, groups, node of each rank, pipeline
    host_load: dict[str, dict[str, float]] = field(default_factory=dict)  # per host: the run's and other work's cores
    git_commit: str | None = None
    versions: dict[str, Any] = field(default_factory=dict)
    device: dict[str, Any] = field(default_factory=dict)
    container: dict[str, Any] | None = None
    environment: dict[str, str] = field(default_factory=dict)
    format: int = RECORD_FORMAT

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "run.json") -> RunRecord:
        if data.get("format") != RECORD_FORMAT:
            raise DataError(
                f"{source} is a run record of format {data.get('format')!r}; this scalelm reads format "
                f"{RECORD_FORMAT}: report it with the scalelm that trained it, or train the run again"
            )
        try:
            return cls(**{**data, "results": Results(**data["results"])})
        except (KeyError, TypeError) as err:
            raise DataError(
                f"{source} is not a run record of format {RECORD_FORMAT} ({err}): train the run again"
            ) from None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl, less a torn last line (`metrics_lines`)."""
    lines, _ = metrics_lines(RunDir(Path(run_dir)).metrics)
    return [line.record for line in lines]


@dataclass(frozen=True)
class MetricsLine:
    number: int  # in the file, from 1: what an error names
    text: str
    record: dict[str, Any]


def metrics_lines(path: Path) -> tuple[list[MetricsLine], bool]:
    """Each line of a metrics.jsonl with its number and record, and whether the last line was torn: what follows the
    last newline that is not a complete record (a write cut short, as on a full disk, or one still under way), left
    out. A damaged line before it, or a record without a step number (what a resume and the report order records
    by), is an error naming the file and the line."""
    lines = Path(path).read_text(encoding="utf-8", errors="replace").split("\n")
    parsed, torn = [], False
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = metrics_record(line)
        if record is None and number == len(lines):
            torn = True
        elif record is None:
            raise DataError(damaged_line(path, number, "is not a complete JSON record"))
        elif not is_step(record.get("step")):
            raise DataError(
                damaged_line(path, number, f"is a record without a step number (step: {shown(record.get('step'), 40)})")
            )
        else:
            parsed.append(MetricsLine(number, line, record))
    return parsed, torn


def damaged_line(path: Path, number: int, problem: str) -> str:
    return f"{path}, line {number}, {problem}: the file is damaged; repair or delete that line, then run again"


def is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def metrics_record(line: str) -> dict[str, Any] | None:
    """The record of one metrics line; None if it is not one."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None  # a line cut short is no JSON object: its brace is gone


def changed_settings(before: dict[str, Any], after: dict[str, Any], prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """The settings (dotted keys, sections unfolded) whose values differ between two settings trees
    (Config.to_dict()'s form), with both values (None where absent)."""
    changed = {}
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changed |= changed_settings(a, b, f"{prefix}{key}.")
        elif a != b:
            changed[f"{prefix}{key}"] = (a, b)
    return changed


# the settings that say where a run's files are: the same record wherever they lie
PLACES = ("run_dir", "data.prepared_dir", "data.stage_dir")


def unreflected_settings(record: RunRecord, settings: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The settings outside the run's identity that `settings` (Config.to_dict()) gives other values than the record
    was measured with (its `config`), where its files lie aside: what a restored record does not reflect."""
    changed = changed_settings(record.config, settings)
    trained = changed_settings(identity_settings(record.config), identity_settings(settings))
    return {key: values for key, values in changed.items() if key not in trained and key not in PLACES}


def write_record(run_dir: str | Path, record: RunRecord) -> None:
    """run.json, and a copy kept with the checkpoints (RunDir.finished) from which `restore_record` rewrites it."""
    run = RunDir(Path(run_dir))
    text = json.dumps(asdict(record), indent=2) + "\n"
    if run.checkpoints.is_dir():
        atomic_write_text(run.finished, text)
    atomic_write_text(run.record, text)


def read_finished(run_dir: str | Path) -> RunRecord | None:
    """The record the run kept when it finished (RunDir.finished); None without one, or with one that is damaged."""
    path = RunDir(Path(run_dir)).finished
    try:
        return RunRecord.from_dict(json.loads(path.read_text()), str(path))
    except (OSError, ValueError, DataError, AttributeError):
        return None


def restore_record(run_dir: str | Path) -> None:
    """run.json as the run wrote it when it finished, byte for byte."""
    run = RunDir(Path(run_dir))
    atomic_write_text(run.record, run.finished.read_text())


def read_record(run_dir: str | Path) -> RunRecord:
    """run.json of the run at `run_dir` (FileNotFoundError if the training has not finished)."""
    path = RunDir(Path(run_dir)).record
    return RunRecord.from_dict(json.loads(path.read_text()), str(path))
