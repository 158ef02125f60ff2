"""Throughput and per-rank memory of every parallel layout, each run alone (one torchrun after the other).

    python bench/layouts.py [--models course,m59,m136,m270] [--layouts ddp,fsdp] [--steps 4] [--warmup 2] [--json FILE]

For each model and layout (single; DDP, FSDP with and without resharding after forward, TP with and without sequence
parallelism, CP load-balanced and contiguous on 2 ranks; HSDP 2x2 and FSDP x TP 2x2 on 4 ranks) it trains through the
real entry point (`torchrun ... -m scalelm.train`) on random token ids of WikiText-2's vocabulary, with `batch.mode:
per_device` (each data-parallel rank its own batch: weak scaling, as the course compares), and reports from the run's
own records:

- tokens/s (total and per device): tokens over the timed steps' time, after `--warmup` steps;
- per-rank state: the exact bytes of the largest rank's parameters, gradients and optimizer state;
- per-rank peak: the largest rank's peak RSS on CPU (max allocated on CUDA);
- beside both, in brackets, what scalelm.plan predicts for the layout from the shapes alone;
- communication share: the share of two more steps, run under the profiler after the timed ones, during which a
  collective ran (scalelm.measure.comm).

Every process has one thread (torchrun's default for several processes, set here for one) and starts as
`scalelm.launch` starts it (GLIBC_TUNABLES: huge pages for what malloc maps). The models are named by their
parameters; m136 has GPT-2 small's shape with WikiText-2's vocabulary, m270 more and wider blocks, so that the
state outgrows what every layout holds regardless. Figures and the machine: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from argtypes import count, names, output_file
from scalelm.config import from_dict
from scalelm.model.architecture import flops_per_token
from scalelm.model.transformer import (
    TransformerLM,
    count_parameters,
)
from scalelm.parallel.hostmemory import with_huge_pages
from throughput import make_prepared

VOCAB = 33_278
MODELS: dict[str, dict[str, Any]] = {
    "course": {"model": {"d_model": 128, "n_heads": 4, "n_layers": 2, "d_ff": 2048}, "seq_len": 32, "batch": 128},
    "m59": {"model": {"d_model": 512, "n_heads": 8, "n_layers": 8, "d_ff": 2048}, "seq_len": 64, "batch": 4},
    "m136": {"model": {"d_model": 768, "n_heads": 12, "n_layers": 12, "d_ff": 3072}, "seq_len": 64, "batch": 4},
    "m270": {"model": {"d_model": 1024, "n_heads": 16, "n_layers": 16, "d_ff": 4096}, "seq_len": 64, "batch": 4},
    # a long sequence of a small model, where context parallelism pays
    "long4k": {
        "model": {"d_model": 128, "n_heads": 4, "n_layers": 2, "d_ff": 512, "max_seq_len": 4096},
        "seq_len": 4096,
        "batch": 1,
    },
    # the course model with a mixture of 4 experts of half the FFN's width, top 2, in each block: the dense model's
    # active parameters per token (bench/moe.py)
    "course_moe": {
        "model": {
            "d_model": 128,
            "n_heads": 4,
            "n_layers": 2,
            "d_ff": 2048,
            "moe": {"experts": 4, "top_k": 2, "d_ff": 1024},
        },
        "seq_len": 32,
        "batch": 128,
    },
}
PROFILED = 2  # the last steps, under the profiler for the communication share
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {  # name: (processes, parallel settings)
    "single": (1, {}),
    "ddp": (2, {"strategy": "ddp"}),
    "fsdp": (2, {"strategy": "fsdp"}),
    "fsdp_no_reshard": (2, {"strategy": "fsdp", "reshard_after_forward": False}),
    "tp": (2, {"strategy": "tp"}),
    "tp_sp": (2, {"strategy": "tp", "sequence_parallel": True}),
    "hsdp_2x2": (4, {"dp_replicate": 2, "dp_shard": 2}),
    "fsdp_tp_2x2": (4, {"strategy": "fsdp", "tp": 2}),
    "cp": (2, {"strategy": "cp"}),
    "cp_contiguous": (2, {"strategy": "cp", "cp_load_balance": False}),
    "ep": (2, {"strategy": "ep"}),  # a mixture's experts over dp_shard's 2 ranks (model course_moe)
    "fsdp_ep": (4, {"dp_shard": 4, "ep": 2}),  # ... over pairs of 4, each pair's sharded over the other (FSDP)
}


def run_layout(
    model: str,
    layout: str,
    prepared: Path,
    workdir: Path,
    warmup: int,
    steps: int,
    parallel_layout: tuple[int, dict[str, Any]] | None = None,
    batch: int | None = None,
) -> dict[str, Any]:
    """One run alone; `parallel_layout` (processes, parallel settings) and `batch` replace LAYOUTS[layout] and the
    model's batch where given (bench/pipeline.py)."""
    nproc, parallel = parallel_layout or LAYOUTS[layout]
    spec = MODELS[model]
    config = {
        "run_dir": str(workdir / f"{model}-{layout}"),
        "device": "cpu",
        "data": {"prepared_dir": str(prepared), "seq_len": spec["seq_len"]},
        "model": {**spec["model"], "dropout": 0.0},
        "batch": {"mode": "per_device", "size": batch or spec["batch"]},
        "train": {
            "epochs": 1,
            "max_steps": warmup + steps + PROFILED,
            "log_every": 1,
            "eval_every": None,
            "eval_batch_size": 64,
            "comm_profile_steps": PROFILED,
        },
        "checkpoint": {"every": None},
        "parallel": parallel,
    }
    path = workdir / f"{model}-{layout}.yaml"
    path.write_text(yaml.safe_dump(config))
    # as scalelm.launch starts training processes: one thread each, huge pages for what malloc maps
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLIBC_TUNABLES": with_huge_pages(os.environ.get("GLIBC_TUNABLES"))}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    done = subprocess.run(
        [*launch, "-m", "scalelm.train", "--config", str(path)], capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(f"{model} {layout} failed:\n{done.stderr[-3000:]}")
    run_dir = Path(config["run_dir"])
    record = json.loads((run_dir / "run.json").read_text())
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [m for m in lines if m["kind"] == "train" and m["step"] > warmup and not m["profiled"]]
    seconds = sum(m["step_time_s"] for m in timed)
    tokens = sum(m["tokens_per_step"] for m in timed)
    state = record["results"]["state_mb_per_rank"]
    return {
        "model": model,
        "layout": layout,
        "degrees": record["results"]["layout"],
        "processes": nproc,
        "global_batch": record["results"]["global_batch"],
        "step_s": seconds / len(timed),
        "tokens_per_s": tokens / seconds,
        "tokens_per_s_per_device": tokens / seconds / nproc,
        "state_mb_per_rank": state,
        "plan_mb_per_rank": record["results"]["plan_mb_per_rank"],  # scalelm.plan's figures for the same layout
        "peak_mb_per_rank": max(m["peak_mem_mb"] for m in lines if m["kind"] == "train" and not m["profiled"]),
        "comm_share": (record["results"]["comm"] or {}).get("share"),
        "final_loss": timed[-1]["loss"],
        "pipeline": record["results"].get("pipeline"),
    }


def percent(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.0%}"


def figures_line(r: dict[str, Any]) -> str:
    """A run's speed, state, peak, communication share and final loss, as the bench scripts print each run."""
    return (
        f"{r['tokens_per_s']:9,.0f} tok/s  state {r['state_mb_per_rank']['total']:7,.0f} MiB"
        f"  peak {r['peak_mb_per_rank']:7,.0f} MiB  comm {percent(r['comm_share']):>4}  loss {r['final_loss']:.4f}"
    )


def finish(rows: list[dict[str, Any]], markdown: str, path: Path | None) -> None:
    """The runs' table on stdout, and the rows as JSON where asked."""
    print(markdown)
    if path:
        path.write_text(json.dumps(rows, indent=2) + "\n")


def row_cells(r: dict[str, Any]) -> str:
    """A run's common cells, as every bench table of layouts starts its row: the layout, its speed, its memory beside
    the plan's, its communication share."""
    plan = r["plan_mb_per_rank"]
    return (
        f"| {r['model']} | {r['layout']} | {r['degrees']} | {r['processes']} | {r['tokens_per_s']:,.0f} | "
        f"{r['tokens_per_s_per_device']:,.0f} | {r['state_mb_per_rank']['total']:,.1f} ({plan['state']:,.1f}) | "
        f"{r['peak_mb_per_rank']:,.0f} ({plan['total']:,.0f}) | {percent(r['comm_share'])} |"
    )


def table(rows: list[dict[str, Any]]) -> str:
    head = "| model | layout | dp_r x dp_s x tp x pp (x cp) | procs | tokens/s | per device | state MiB/rank (planned) "
    lines = [head + "| peak MiB/rank (planned) | comm |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    return "\n".join(lines + [row_cells(r) for r in rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=names(MODELS, "model"), default="course,m59")
    parser.add_argument("--layouts", type=names(LAYOUTS, "layout"), default=",".join(LAYOUTS))
    parser.add_argument("--warmup", type=count(0), default=2)
    parser.add_argument("--steps", type=count(1), default=4)
    parser.add_argument("--json", type=output_file)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prepared = make_prepared(Path(tmp) / "prepared")
        for model in args.models:
            config = from_dict({"model": MODELS[model]["model"]}).model
            params = count_parameters(TransformerLM(config, VOCAB))
            flops = flops_per_token(config, VOCAB, MODELS[model]["seq_len"])
            print(f"{model}: {params / 1e6:.1f} M parameters, {flops / 1e6:.0f} MFLOP per token", flush=True)
            for layout in args.layouts:
                rows.append(run_layout(model, layout, prepared, Path(tmp), args.warmup, args.steps))
                print(f"  {layout:16} {figures_line(rows[-1])}", flush=True)
    finish(rows, table(rows), args.json)


if __name__ == "__main__":
    main()
