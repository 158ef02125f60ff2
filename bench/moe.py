"""A mixture of experts against the dense model at equal active parameters, and expert parallelism against one process.

    python bench/moe.py [--steps 10] [--warmup 3] [--json FILE]

First the experts' two products side by side, forward and backward of one rank's routed rows in the course
mixture's shape (`products`): torch's grouped product (`torch._grouped_mm`, what scalelm runs where torch has it)
against a product per expert (what it falls back to elsewhere), the median of 20 after 3 warm-up. Then five runs, each
alone, through the real entry point as bench/layouts.py runs them (random tokens of WikiText-2's vocabulary,
`batch.mode: per_device` with 128 sequences of 32 tokens per data-parallel rank, dropout 0, one thread per process,
the last steps under the profiler):

- dense: the course model (d_model 128, 4 heads, 2 blocks, FFN 2048), one process;
- moe: the same with each block's FFN a mixture of 4 experts of width 1024, top 2 (`course_moe`): a token meets
  2 x 1024 hidden units as the dense model's 2048, so the active parameters and FLOPs per token are the same and the
  FFNs hold twice as many in all;
- moe ep 2: the mixture on 2 ranks, ep 2 borrowed from dp_shard 2 (the dense parameters FSDP-sharded over them);
- dense fsdp 2: the dense model on the same 2 ranks, so that what ep adds to the FSDP beside it shows;
- moe fsdp 4 x ep 2: the experts over pairs of 4 ranks and FSDP-sharded over the other pair, whose expert state per
  rank is set beside what it was when FSDP left the experts whole on their ranks (`before`: the plan's experts
  times the ranks now sharding them).

From each run's records (run.json, metrics.jsonl): tokens/s over the timed steps, state and peak memory per rank
with scalelm.plan's figures beside them, the communication share and the all-to-all's part of the profiled steps
(`results.comm`), and the mixture's auxiliary loss (before its coefficient), load balance (tokens per expert, the
largest over the mean: 1 when even) and each expert's share of the tokens per layer (`results.experts`, the
metrics lines); the CPU cores other work took meanwhile (`host_load`), which says whether the figures of time can be
trusted. Figures and the machine: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch

from argtypes import count, output_file
from layouts import LAYOUTS, MODELS, VOCAB, figures_line, finish, percent, row_cells, run_layout
from scalelm.config import from_dict
from scalelm.model import moe as moe_module
from scalelm.model.architecture import parameter_counts
from throughput import make_prepared

RUNS = (
    ("course", "single"),
    ("course_moe", "single"),
    ("course_moe", "ep"),
    ("course", "fsdp"),
    ("course_moe", "fsdp_ep"),
)
PRODUCT_REPEATS, PRODUCT_WARMUP = 20, 3


def read_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    record = json.loads((run_dir / "run.json").read_text())
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return record, lines


def expert_figures(record: dict[str, Any], lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The profiled steps' all-to-all share, and the mixture's figures (scalelm.measure.experts): the aux loss and
    load balance of the last logged interval, and over the run the mean load balance and each expert's token share."""
    results = record["results"]
    logged = [m for m in lines if m["kind"] == "train"]
    experts = results.get("experts") or {}
    return {
        "all_to_all_share": (results["comm"] or {}).get("all_to_all_share"),
        "aux_loss": logged[-1].get("aux_loss"),
        "load_last": logged[-1].get("expert_load_max_over_mean"),
        "load_run": experts.get("expert_load_max_over_mean"),
        "token_share": experts.get("expert_token_share_per_layer"),
        # other work on the host's cores while the run trained: the figures of time are only as good as this is small
        "other_cores": max((h["other_cores"] for h in record["host_load"].values()), default=None),
    }


def products(model: str = "course_moe") -> dict[str, float]:
    """Seconds of one forward and backward of a rank's routed rows (batch x seq_len x top_k, uneven over the experts)
    through the mixture's experts of `model`, grouped and per expert: the median of PRODUCT_REPEATS."""
    config = from_dict({"model": MODELS[model]["model"]}).model
    torch.manual_seed(0)
    experts = moe_module.GroupedExperts(config.moe.experts, config.d_model, config.expert_width())
    experts.reset_parameters()
    rows = MODELS[model]["batch"] * MODELS[model]["seq_len"] * config.moe.top_k
    share = torch.softmax(torch.arange(config.moe.experts, dtype=torch.float), 0)  # uneven, as routers are
    counts = (share * rows).long()
    counts[-1] += rows - counts.sum()
    tokens = torch.randn(rows, config.d_model, requires_grad=True)
    seconds = {}
    chosen = moe_module.grouped_product  # where torch runs the grouped product; the loop is forced below
    for name, grouped in (("grouped_mm", True), ("per_expert_loop", False)):
        with mock.patch.object(moe_module, "grouped_product", lambda *args, g=grouped: g and chosen(*args)):
            times = []
            for _ in range(PRODUCT_WARMUP + PRODUCT_REPEATS):
                start = time.perf_counter()
                experts(tokens, counts, counts.tolist()).sum().backward()
                times.append(time.perf_counter() - start)
        assert experts.product == name, f"this torch ran {experts.product} where {name} was asked for"
        seconds[name] = statistics.median(times[PRODUCT_WARMUP:])
    return seconds


def measure(model: str, layout: str, prepared: Path, workdir: Path, warmup: int, steps: int) -> dict[str, Any]:
    row = run_layout(model, layout, prepared, workdir, warmup, steps)
    return {**row, **expert_figures(*read_run(workdir / f"{model}-{layout}"))}


def figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def shares(layer: str, share: list[float] | None) -> str:
    return f"{layer}: " + ("-" if share is None else " / ".join(f"{s:.0%}" for s in share))


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | layout | degrees | procs | tokens/s | per device | state MiB/rank (planned) | peak MiB/rank "
        "(planned) | comm | all-to-all | aux loss | load max/mean (last, run) | token share per expert, by layer | "
        "other cores |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        share = "; ".join(shares(layer, s) for layer, s in r["token_share"].items()) if r["token_share"] else "-"
        lines.append(
            f"{row_cells(r)} {percent(r['all_to_all_share'])} | {figure(r['aux_loss'])} | {figure(r['load_last'])}, "
            f"{figure(r['load_run'])} | {share} | {figure(r['other_cores'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warmup", type=count(0), default=3)
    parser.add_argument("--steps", type=count(1), default=10)
    parser.add_argument("--json", type=output_file)
    args = parser.parse_args(argv)
    for model in dict(RUNS):
        counts = parameter_counts(from_dict({"model": MODELS[model]["model"]}).model, VOCAB)
        print(f"{model}: {counts['total'] / 1e6:.2f} M parameters, {counts['active'] / 1e6:.2f} M active per token")
    seconds = products()
    print(
        f"experts' product, forward and backward: grouped {seconds['grouped_mm'] * 1e3:.1f} ms, per expert "
        f"{seconds['per_expert_loop'] * 1e3:.1f} ms ({seconds['per_expert_loop'] / seconds['grouped_mm']:.2f}x)",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prepared = make_prepared(Path(tmp) / "prepared")
        for model, layout in RUNS:
            rows.append(measure(model, layout, prepared, Path(tmp), args.warmup, args.steps))
            r = rows[-1]
            print(
                f"  {model:10} {layout:6} ({LAYOUTS[layout][0]} proc) {figures_line(r)}"
                f"  all-to-all {percent(r['all_to_all_share']):>4}  aux {figure(r['aux_loss'])}"
                f"  load {figure(r['load_run'])}  other cores {figure(r['other_cores'])}",
                flush=True,
            )
    sharded = rows[-1]
    shards = LAYOUTS["fsdp_ep"][1]["dp_shard"] // LAYOUTS["fsdp_ep"][1]["ep"]
    experts = sharded["plan_mb_per_rank"]["expert_state"]
    print(
        f"fsdp 4 x ep 2: state {sharded['state_mb_per_rank']['total']:.2f} MiB per rank, of which the experts "
        f"{experts:.2f}; before FSDP sharded them, {sharded['state_mb_per_rank']['total'] + experts * (shards - 1):.2f}",
        flush=True,
    )
    finish(rows, table(rows) + f"\n\nexperts' product: {json.dumps(seconds)}", args.json)


if __name__ == "__main__":
    main()
