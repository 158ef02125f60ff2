"""Compare the runs of the experiment matrix: a summary table (CSV and Markdown) and plots (PNG).

    python -m scalelm.study.aggregate --run results/runs/ddp/seed1 [--run ...] --out-dir results

Each run directory holds run.json (provenance and results, from training), metrics.jsonl, and the outputs of the
consolidate and evaluate steps (model.pt.json, test.json). Speed is the steady state after warm-up (median step
time, its spread, tokens/s and MFU of the median: scalelm.study.timing); speedup and scaling efficiency compare
tokens per second with the single-device experiment of the same seed. A run that trained while another did on one
of its hosts is named in `overlapped_by`, and `other_cpu_cores` says how busy its hosts were with other work: no
contaminated figure goes unmarked. Utilisation per device (mean, and the least busy device) comes from the run's
monitor files (scalelm.study.utilisation), and `utilisation.png` shows it over time.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from typing import Any

from scalelm.errors import DataError, friendly_errors
from scalelm.study.timing import overlapping_runs, steady_state
from scalelm.study.utilisation import plot_utilisation, summarise
from scalelm.train.metrics import read_metrics
from scalelm.train.peak import mfu
from scalelm.train.rundir import RunDir

COLUMNS = [
    "experiment", "strategy", "layout", "seed", "nodes", "procs_per_node", "world_size", "global_batch_sequences",
    "global_batch_tokens", "steps", "wall_time_s", "train_time_s",
    # steady state after warm-up (scalelm.study.timing)
    "warmup_steps", "steady_intervals", "step_time_s", "step_time_s_min", "step_time_s_max", "tokens_per_s",
    "tokens_per_s_per_device", "speedup", "scaling_efficiency", "mfu",
    # memory, utilisation and isolation
    "state_mb_per_rank", "peak_mem_mb_per_rank", "util_mean_percent", "util_min_percent", "monitor_cpu_percent",
    "other_cpu_cores", "overlapped_by",
    "final_train_loss", "validation_loss", "test_loss", "test_perplexity", "checkpoint", "sha256",
]  # fmt: skip


def read_run(run: RunDir, warmup_steps: int | None = None) -> dict[str, Any]:
    try:
        record = json.loads(run.record.read_text())
        model = json.loads(run.model_meta.read_text())
        test = json.loads(run.test_result.read_text())
    except FileNotFoundError as err:
        raise DataError(f"{run.path} is incomplete ({err.filename} is missing): run the workflow up to it") from None
    metrics = read_metrics(run.path)
    results, config = record["results"], record["config"]
    train = [m for m in metrics if m["kind"] == "train"]
    steady = steady_state(train, warmup_steps)
    state = results.get("state_mb_per_rank") or {}
    peak = results.get("peak_flops_per_device")  # absent in runs from before MFU was recorded
    steady_mfu = None
    if peak and steady:
        steady_mfu = mfu(results["flops_per_token"], steady["tokens_per_s"], record["world_size"], peak)
    return {
        "experiment": run.experiment,
        "strategy": results["strategy"],
        "layout": results.get("layout", ""),  # dp_replicate x dp_shard x tp x pp
        "seed": config["seed"],
        "nodes": record["launch"]["nodes"],
        "procs_per_node": record["launch"]["procs_per_node"],
        "world_size": record["world_size"],
        "global_batch_sequences": results["global_batch"],
        "global_batch_tokens": results["tokens_per_step"],
        "steps": results["steps"],
        "wall_time_s": record["wall_time_s"],
        "train_time_s": results["train_time_s"],
        **steady,
        "mfu": steady_mfu,
        "state_mb_per_rank": state.get("total"),
        "peak_mem_mb_per_rank": max((m["peak_mem_mb"] for m in train), default=None),
        "other_cpu_cores": max((h["other_cores"] for h in (record.get("host_load") or {}).values()), default=None),
        "overlapped_by": "",
        **summarise(run.monitor),
        "final_train_loss": results["final_train_loss"],
        "validation_loss": results["validation"]["loss"],
        "test_loss": test["loss"],
        "test_perplexity": test["perplexity"],
        "checkpoint": model["model"],
        "sha256": model["sha256"],
        "_metrics": metrics,
        "_record": record,
    }


def add_scaling(rows: list[dict[str, Any]]) -> None:
    baselines = {r["seed"]: r for r in rows if r["world_size"] == 1}
    for row in rows:
        base = baselines.get(row["seed"])
        if base is None:
            row["speedup"] = row["scaling_efficiency"] = None
            continue
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["scaling_efficiency"] = row["speedup"] / row["world_size"]


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return "" if value is None else str(value)


def write_tables(rows: list[dict[str, Any]], out_dir: Path) -> None:
    with (out_dir / "summary.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    shown = [c for c in COLUMNS if c not in ("checkpoint", "sha256")]
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in shown) + " |" for r in rows]
    shared = [f"`{r['experiment']}` seed {r['seed']} (with {r['overlapped_by']})" for r in rows if r["overlapped_by"]]
    if shared:
        lines += ["", "**Not isolated**: trained while another run trained on the same host, so their speed figures "
                  "measure both: " + ", ".join(shared) + "."]  # fmt: skip
    files = [f"- `{r['experiment']}` seed {r['seed']}: `{r['checkpoint']}` (sha256 `{r['sha256']}`)" for r in rows]
    text = "# scalelm summary\n\n" + "\n".join(lines) + "\n\n## Consolidated models\n\n" + "\n".join(files) + "\n"
    (out_dir / "summary.md").write_text(text)


def plot(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for x_key, x_label, name in (("tokens", "tokens seen", "loss_vs_tokens.png"), ("time", "wall time (s)", "loss_vs_time.png")):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for row in rows:
            label = f"{row['experiment']} (seed {row['seed']}, {row['world_size']} proc)"
            train = [m for m in row["_metrics"] if m["kind"] == "train"]
            val = [m for m in row["_metrics"] if m["kind"] == "eval" and m["split"] == "validation"]
            tokens_at = {m["step"]: m["tokens"] for m in train}
            val_x = [m["time"] if x_key == "time" else tokens_at.get(m["step"], m["step"] * row["global_batch_tokens"]) for m in val]
            axes[0].plot([m[x_key] for m in train], [m["loss"] for m in train], label=label)
            axes[1].plot(val_x, [m["loss"] for m in val], marker="o", label=label)
        axes[0].set_title("train loss")
        axes[1].set_title("validation loss")
        for ax in axes:
            ax.set_xlabel(x_label)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("cross-entropy (nats/token)")
        axes[1].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        paths.append(out_dir / name)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{r['experiment']}\nseed {r['seed']}" for r in rows]
    axes[0].bar(labels, [r["tokens_per_s"] for r in rows], color="tab:blue")
    axes[0].set_title("throughput (tokens/s, all devices)")
    efficiency = [r["scaling_efficiency"] or 0.0 for r in rows]
    axes[1].bar(labels, efficiency, color="tab:green")
    axes[1].axhline(1.0, color="gray", linestyle="--", linewidth=1)
    axes[1].set_title("scaling efficiency (speedup / world size)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "scaling.png", dpi=110)
    plt.close(fig)
    paths.append(out_dir / "scaling.png")
    plot_utilisation(rows, out_dir / "utilisation.png")
    paths.append(out_dir / "utilisation.png")
    return paths


def mark_overlaps(rows: list[dict[str, Any]]) -> None:
    names = {f"{r['experiment']}/seed{r['seed']}": r for r in rows}
    for name, others in overlapping_runs({name: r["_record"] for name, r in names.items()}).items():
        names[name]["overlapped_by"] = " ".join(sorted(others))


def aggregate(run_dirs: list[Path], out_dir: Path, warmup_steps: int | None = None) -> list[dict[str, Any]]:
    rows = [read_run(RunDir(Path(d)), warmup_steps) for d in run_dirs]
    mark_overlaps(rows)
    rows.sort(key=lambda r: (r["world_size"], r["experiment"], r["seed"]))
    add_scaling(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_tables(rows, out_dir)
    plot(rows, out_dir)
    return rows


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalelm.study.aggregate", description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, action="append", required=True, help="a run directory (repeatable)")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument(
        "--warmup-steps", type=int, help="steps left out of the speed figures (default: 10%% of the run, at least 5)"
    )
    args = parser.parse_args(argv)
    if args.warmup_steps is not None and args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be 0 or more, got {args.warmup_steps}")
    rows = aggregate(args.run, args.out_dir, args.warmup_steps)
    print((args.out_dir / "summary.md").read_text())
    print(f"{len(rows)} runs summarised in {args.out_dir}/summary.csv, summary.md and *.png")


if __name__ == "__main__":
    main()
