"""Pipeline schedules against the number of micro-batches: speed, the bubble predicted and measured, memory per stage.

    python bench/pipeline.py [--model m59] [--microbatches 2,4,8] [--schedules gpipe,1f1b,interleaved_1f1b]
                             [--batch 8] [--steps 4] [--warmup 2] [--json FILE]

Two ranks (pp 2; the interleaved schedule with 2 virtual stages each), each run alone through the real entry point
as bench/layouts.py runs it (random tokens of WikiText-2's vocabulary, one thread per process), with the same batch
of 8 sequences per replica so that every micro-batch count divides it, and a single process on that batch for
reference. From each run's own records: tokens/s over the timed steps; the bubble the schedule predicts
((pp - 1) / (m + pp - 1), interleaved (pp - 1) / (v m + pp - 1)) beside the measured one (the idle share of each
rank's pipeline work, scalelm.parallel.pipeline.StageTimeline, averaged over the kept unprofiled steps and the
ranks) and each rank's idle share; the peak memory of each pipeline rank. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from argtypes import count, counts, names, output_file
from layouts import MODELS, run_layout
from scalelm.parallel.pipeline import SCHEDULES
from throughput import make_prepared

BATCH = 8  # sequences per replica and step: divisible by 2, 4 and 8 micro-batches


def pipeline_layout(schedule: str, microbatches: int) -> tuple[int, dict[str, Any]]:
    virtual = 2 if schedule == "interleaved_1f1b" else 1
    settings = {"pp": 2, "pp_schedule": schedule, "pp_microbatches": microbatches, "pp_virtual_stages": virtual}
    return 2, settings


def share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def table(reference: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "| schedule | micro-batches | tokens/s | step s | bubble predicted | measured | idle rank 0 / 1 | "
        "peak MiB rank 0 / 1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| single process | - | {reference['tokens_per_s']:,.0f} | {reference['step_s']:.2f} | - | - | - | "
        f"{reference['peak_mb_per_rank']:,.0f} |",
    ]
    for r in rows:
        p = r["pipeline"]
        idle = " / ".join(share(s) for s in p["idle_share_per_rank"])
        peaks = " / ".join(f"{m:,.0f}" for m in p["peak_mem_mb_per_pp_rank"])
        lines.append(
            f"| {p['schedule']} | {p['microbatches']} | {r['tokens_per_s']:,.0f} | {r['step_s']:.2f} | "
            f"{share(p['predicted_bubble'])} | {share(p['measured_bubble'])} | {idle} | {peaks} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="m59")
    parser.add_argument("--microbatches", type=counts(1), default="2,4,8")
    parser.add_argument("--schedules", type=names(SCHEDULES, "schedule"), default="gpipe,1f1b,interleaved_1f1b")
    parser.add_argument("--warmup", type=count(0), default=2)
    parser.add_argument("--steps", type=count(1), default=4)
    parser.add_argument("--batch", type=count(1), default=BATCH, help="sequences per replica and step")
    parser.add_argument("--json", type=output_file)
    args = parser.parse_args(argv)
    uneven = [m for m in args.microbatches if args.batch % m]
    if uneven:
        parser.error(f"--batch {args.batch} does not split into {uneven} micro-batches: give counts that divide it")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir, prepared = Path(tmp), make_prepared(Path(tmp) / "prepared")
        reference = run_layout(args.model, "single", prepared, workdir, args.warmup, args.steps, batch=args.batch)
        print(f"single: {reference['tokens_per_s']:,.0f} tok/s", flush=True)
        for schedule in args.schedules:
            for m in args.microbatches:
                name = f"{schedule}-{m}"
                layout = pipeline_layout(schedule, m)
                rows.append(
                    run_layout(args.model, name, prepared, workdir, args.warmup, args.steps, layout, args.batch)
                )
                p = rows[-1]["pipeline"]
                print(
                    f"{name:20} {rows[-1]['tokens_per_s']:7,.0f} tok/s  bubble predicted {share(p['predicted_bubble'])}"
                    f" measured {share(p['measured_bubble'])}  peak {p['peak_mem_mb_per_pp_rank']}",
                    flush=True,
                )
    print(table(reference, rows))
    if args.json:
        args.json.write_text(json.dumps({"reference": reference, "pipelines": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
