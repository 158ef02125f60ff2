"""Before the queue, optional: whether each experiment's layout is wired right (its memory: plan_check.py).

`snakemake preflight`: every experiment of several processes runs PREFLIGHT_STEPS steps on this machine's CPU, all
its processes on one node, on a slice of the prepared data, with dropout off and one global batch every layout
divides; a single process runs the same settings. Every layout trains the same model on the same data, so
their losses must agree step by step (to LOSS_TOLERANCE, fp32's reordered sums): a mismatch names the experiment
within minutes, before hours of GPU time.

    python -m scalelm.data.slice --data data/prepared --out results/preflight/data --tokens 4096
    python -m scalelm.study.preflight compare --run ddp=results/preflight/ddp:results/preflight/reference.0 ... \
        --out results/preflight/preflight.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path
from typing import Any

from scalelm.errors import ConfigError, ScaleLMError, friendly_errors
from scalelm.parallel.dims import ParallelDims
from scalelm.parallel.layout import sequence_unit
from scalelm.study.experiments import Experiment, deep_merge
from scalelm.train.record import read_metrics, read_record

PREFLIGHT_STEPS = 3
LOSS_TOLERANCE = 1e-4  # relative, per step
MIN_BATCH = 8  # sequences per step, at least
MAX_SEQ_LEN = 64  # longer sequences are halved towards this: the wiring is the same, the check seconds long
COLUMNS = ["experiment", "layout", "world_size", "reference", "steps", "max_relative_gap", "matches"]


class PreflightError(ScaleLMError):
    pass


# ------------------------------------------------------------------------------------------------- wiring
def preflight_batch(matrix: list[Experiment]) -> int:
    """A global batch every experiment's data-parallel ranks and pipeline micro-batches divide."""
    batch = 1
    for e in matrix:
        batch = math.lcm(batch, e.dims.dp_size * e.layout.microbatches)
    return batch * math.ceil(MIN_BATCH / batch)


def preflight_seq_len(matrix: list[Experiment], seq_len: int) -> int:
    """`seq_len`, halved while above MAX_SEQ_LEN and still a multiple of what every layout of the matrix splits
    sequences into (context parallelism's chunks): the same for every experiment of that length, so they share a
    reference. A long-context experiment's check thus takes seconds on a CPU, not hours."""
    unit = math.lcm(*(sequence_unit(e.dims, e.config.parallel) for e in matrix))
    while seq_len > MAX_SEQ_LEN and seq_len % 2 == 0 and (seq_len // 2) % unit == 0:
        seq_len //= 2
    return seq_len


def preflight_settings(
    training: dict, dims: ParallelDims, batch: int, seq_len: int, data_dir: str, run_dir: str
) -> dict:
    """An experiment's training settings for the wiring check: its layout as explicit degrees, a mixture's ep among
    them (one node holds all its processes), CPU and fp32, no dropout, PREFLIGHT_STEPS steps of `batch` sequences of
    `seq_len` tokens on the sliced data (not staged)."""
    parallel = {k: v for k, v in training["parallel"].items() if k not in ("cpu_offload", "strategy")}
    settings = {k: v for k, v in training.items() if k != "parallel"}
    return deep_merge(
        settings,
        {
            "run_dir": run_dir,
            "device": "cpu",
            # a slice of the data in results: no staging to check
            "data": {"prepared_dir": data_dir, "stage": "none", "seq_len": seq_len},
            "model": {"dropout": 0.0},
            "batch": {"mode": "global", "size": batch, "micro_size": None, "lr_scaling": "none"},
            "train": {
                "max_steps": PREFLIGHT_STEPS,
                "epochs": 1,
                "log_every": 1,
                "eval_every": None,
                "precision": "fp32",
                "monitor_interval_s": 0,
                "comm_profile_steps": 0,
                "wandb": False,
            },
            "checkpoint": {"every": None},
        },
    ) | {"parallel": parallel | dims.to_dict()}


def preflight_runs(matrix: list[Experiment], results: str) -> dict[str, dict[str, Any]]:
    """name -> {settings, world_size, reference}: every experiment of several processes (its first seed; one of a
    single process has no wiring to check), and one single process ("reference.<i>") per distinct settings among
    their preflight runs but the layout."""
    batch = preflight_batch(matrix)
    data, runs_dir = f"{results}/preflight/data", f"{results}/preflight/runs"
    runs, references = {}, {}
    for e in matrix:
        if e.name in runs or e.world_size == 1:
            continue
        seq_len = preflight_seq_len(matrix, e.config.data.seq_len)
        settings = preflight_settings(e.settings, e.dims, batch, seq_len, data, f"{runs_dir}/{e.name}")
        same = json.dumps({k: v for k, v in settings.items() if k not in ("parallel", "run_dir")}, sort_keys=True)
        reference = references.setdefault(same, f"reference.{len(references)}")
        if reference not in runs:
            alone = preflight_settings(e.settings, ParallelDims(), batch, seq_len, data, f"{runs_dir}/{reference}")
            runs[reference] = {"settings": alone, "world_size": 1, "reference": None}
        runs[e.name] = {"settings": settings, "world_size": e.world_size, "reference": reference}
    return runs


def compare(pairs: dict[str, tuple[Path, Path]], out: Path) -> list[dict[str, Any]]:
    """Each run's losses against its reference's, step by step; the table is written, then a mismatch raised."""
    rows = []
    for name, (run, reference) in pairs.items():
        mine, theirs = losses(run), losses(reference)
        gaps = [abs(a - b) / abs(b) for a, b in zip(mine, theirs)]
        record = read_record(run)
        complete = len(mine) == len(theirs) == PREFLIGHT_STEPS
        gap = max(gaps) if gaps else math.inf
        rows.append(
            {
                "experiment": name,
                "layout": record.results.layout,
                "world_size": record.world_size,
                "reference": reference.name,
                "steps": len(mine),
                "max_relative_gap": gap,
                "matches": complete and gap <= LOSS_TOLERANCE,
            }
        )
    with out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    wrong = [
        f"{r['experiment']} (layout {r['layout']}: {r['steps']} steps, largest gap {r['max_relative_gap']:.2e})"
        for r in rows
        if not r["matches"]
    ]
    if wrong:
        raise PreflightError(
            f"the loss of {', '.join(wrong)} departs from one process's beyond a relative {LOSS_TOLERANCE:g} "
            f"(each layout should train the same model on the same data); see {out} and the runs' metrics.jsonl"
        )
    return rows


def losses(run: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run) if m["kind"] == "train"]


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalelm.study.preflight", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    compared = commands.add_parser("compare", help="each run's losses against its reference's")
    compared.add_argument("--run", action="append", required=True, metavar="NAME=RUN_DIR:REFERENCE_DIR")
    compared.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    pairs = {}
    for text in args.run:
        name, _, dirs = text.partition("=")
        run, _, reference = dirs.partition(":")
        if not (name and run and reference):
            raise ConfigError(f"--run {text!r}: expected NAME=RUN_DIR:REFERENCE_DIR")
        pairs[name] = (Path(run), Path(reference))
    rows = compare(pairs, args.out)
    print(f"preflight: every layout's loss matches one process's over {PREFLIGHT_STEPS} steps ({len(rows)} runs)")


if __name__ == "__main__":
    main()
