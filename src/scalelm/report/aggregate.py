"""Compare the runs of the experiment matrix: summary tables (CSV and Markdown) and plots (PNG).

    python -m scalelm.report.aggregate --run results/runs/ddp/seed1 [--run ...] --out-dir results \
        [--baseline single_gpu] [--expect ddp.min_mfu=0.3 ...]

Each run directory holds run.json (provenance and results, from training), metrics.jsonl, and the outputs of the
consolidate and evaluate steps (model.pt.json, test.json). Speed is the steady state after warm-up (median step
time, its spread, tokens/s and MFU of the median: scalelm.report.timing); speedup and scaling efficiency compare
tokens per second with the baseline experiment, strong or weak scaling by the run's batch mode
(scalelm.report.scaling). A run that trained while another did on one of its hosts is named in `overlapped_by`, and
`other_cpu_cores` says how busy its hosts were with other work: no contaminated figure goes unmarked. Utilisation
per device (mean, and the least busy device) comes from the run's monitor files (scalelm.report.utilisation), and
`utilisation.png` shows it over time.

summary.csv has one row per run (experiment x seed), summary_by_experiment.csv one per experiment with the mean,
standard deviation, min and max over its seeds (scalelm.report.repeats); expectations.csv says which of the
experiments' reference values (`expect:`) were met (scalelm.report.expectations).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from scalelm.errors import DataError, friendly_errors
from scalelm.measure.peak import mfu
from scalelm.report import bubble, expectations, history, machine, repeats, steptime
from scalelm.report.figures import COLUMNS, RunSummary
from scalelm.report.plots import plot_losses, plot_scaling, plot_trend
from scalelm.report.scaling import SCALING, add_scaling, choose_baseline
from scalelm.report.tables import fmt, markdown_table, write_csv
from scalelm.report.timing import overlapping_runs, steady_state, straggler
from scalelm.report.utilisation import device_series, plot_utilisation, summarise
from scalelm.site import MachineReferences, load_site
from scalelm.train.record import read_metrics, read_record
from scalelm.train.rundir import RunDir


def read_run(run: RunDir, warmup_steps: int | None = None) -> RunSummary:
    try:
        record = read_record(run.path)
        model = json.loads(run.model_meta.read_text())
        test = json.loads(run.test_result.read_text())
        identity = json.loads(run.identity.read_text())
    except FileNotFoundError as err:
        raise DataError(f"{run.path} is incomplete ({err.filename} is missing): run the workflow up to it") from None
    metrics = read_metrics(run.path)
    results, config = record.results, record.config
    train = [m for m in metrics if m["kind"] == "train"]
    unprofiled = [m for m in train if not m.get("profiled")] or train
    steady = steady_state(train, warmup_steps)
    state = results.state_mb_per_rank or {}
    plan = results.plan_mb_per_rank  # what scalelm.plan predicts for the layout
    peak = results.peak_flops_per_device  # None where the device's peak is unknown
    steady_mfu = None
    if peak and steady:
        steady_mfu = mfu(results.flops_per_token, steady["tokens_per_s"], record.world_size, peak)
    series, monitor_cost = device_series(run.monitor)
    figures = {
        "experiment": run.experiment,
        "strategy": results.strategy,
        "layout": results.layout,
        "seed": config["seed"],
        "nodes": record.launch["nodes"],
        "procs_per_node": record.launch["procs_per_node"],
        "world_size": record.world_size,
        "global_batch_sequences": results.global_batch,
        "global_batch_tokens": results.tokens_per_step,
        "scaling": SCALING[config["batch"]["mode"]],  # strong: global batch fixed; weak: per-device batch fixed
        "steps": results.steps,
        "wall_time_s": record.wall_time_s,
        "train_time_s": results.train_time_s,
        "staging_s": (results.staging or {}).get("seconds"),
        **steady,
        "mfu": steady_mfu,
        # the share of the profiled steps with a collective running (scalelm.measure.comm); 0 for one process
        "comm_share": (results.comm or {}).get("share"),
        "straggler": straggler(results.comm, record.hostnames),
        **bubble.columns(results),
        "state_mb_per_rank": state.get("total"),
        "planned_state_mb_per_rank": plan.get("state"),
        "planned_peak_mb_per_rank": plan.get("total"),
        # the profiler's records would count (scalelm.measure.comm)
        "peak_mem_mb_per_rank": max((m["peak_mem_mb"] for m in unprofiled), default=None),
        "peak_reserved_mb_per_rank": max(
            (m["peak_reserved_mb"] for m in unprofiled if m.get("peak_reserved_mb")), default=None
        ),
        "other_cpu_cores": max((h["other_cores"] for h in record.host_load.values()), default=None),
        "overlapped_by": "",
        **summarise(series, monitor_cost),
        "energy_j": (results.energy or {}).get("joules"),
        "joules_per_token": (results.energy or {}).get("joules_per_token"),
        "final_train_loss": results.final_train_loss,
        "validation_loss": results.validation["loss"],
        "test_loss": test["loss"],
        "test_perplexity": test["perplexity"],
        "checkpoint": model["model"],
        "sha256": model["sha256"],
    }
    return RunSummary(figures, metrics, record, series, identity, model.get("vocab_size"))


def fmt_spread(summary: dict[str, Any], figure: str) -> str:
    """mean, and with several seeds `mean ± std (min–max)`."""
    mean = fmt(summary[f"{figure}_mean"])
    if summary["seeds"] == 1 or summary[f"{figure}_std"] is None:
        return mean
    low, high = fmt(summary[f"{figure}_min"]), fmt(summary[f"{figure}_max"])
    return f"{mean} ± {fmt(summary[f'{figure}_std'])} ({low}–{high})"


# the summary's first table: what a reader looks at first, per run (every figure: summary.csv)
LEAD = ["experiment", "seed", "layout", "world_size", "tokens_per_s_per_device", "speedup", "scaling_efficiency",
        "mfu", "comm_share", "peak_mem_mb_per_rank", "state_mb_per_rank", "test_perplexity"]  # fmt: skip


def flags(
    row: dict[str, Any], checks: list[dict[str, Any]], changes: list[history.Change], machine_checks: list[dict]
) -> str:
    """What a reader must not miss about a run: shared hosts, a straggler, a machine below its reference, missed
    expectations, regressions since last time."""
    found = ["not isolated"] if row["overlapped_by"] else []
    found += [f"straggler {row['straggler']}"] if row.get("straggler") else []
    found += machine.flags(row["nodes"], machine_checks)
    found += [f"{c['status'].replace('no reference', 'no reference for')} {c['expectation']}" for c in checks
              if c["experiment"] == row["experiment"] and c["status"] != "met"]  # fmt: skip
    found += [f"{c.verdict} {c.figure}" for c in changes
              if c.experiment == row["experiment"] and c.verdict.startswith("regression")]  # fmt: skip
    return ", ".join(found)


def write_tables(
    rows: list[dict[str, Any]],
    summaries: list[dict[str, Any]],
    checks: list[dict[str, Any]],
    out_dir: Path,
    since: tuple[str, list[history.Change]] | None = None,
    baselines: list[dict[str, Any]] = (),
    machine_checks: list[dict[str, Any]] = (),
) -> None:
    """summary.csv (every figure of every run), summary_by_experiment.csv, expectations.csv, and summary.md: the
    lead table, the statistics per experiment, the expectations, the changes since the previous study (`since`:
    its id and the changes, from the results history)."""
    write_csv(out_dir / "summary.csv", COLUMNS, rows)
    write_csv(out_dir / "summary_by_experiment.csv", repeats.COLUMNS, summaries)
    write_csv(out_dir / "expectations.csv", expectations.COLUMNS, checks)
    write_csv(out_dir / "machine.csv", machine.COLUMNS, machine.rows(baselines))
    changes = since[1] if since else []
    lines = ["Per run; every figure of every run is in `summary.csv`.", ""]
    lines += markdown_table(
        [*LEAD, "flags"], [[fmt(r.get(c)) for c in LEAD] + [flags(r, checks, changes, machine_checks)] for r in rows]
    )
    shared = [f"`{r['experiment']}` seed {r['seed']} (with {r['overlapped_by']})" for r in rows if r["overlapped_by"]]
    if shared:
        lines += ["", "**Not isolated**: trained while another run trained on the same host, so their speed figures "
                  "measure both: " + ", ".join(shared) + "."]  # fmt: skip

    base = next(s for s in summaries if s["experiment"] == s["baseline"])
    lines += ["", "## Per experiment", "",
              "Mean over the seeds, with several seeds `mean ± std (min–max)` (sample standard deviation). Speedup "
              f"and scaling efficiency in total tokens/s against `{base['experiment']}` ({base['world_size']} "
              "device(s)); strong scaling: global batch fixed, weak: batch per device fixed.", ""]  # fmt: skip
    columns = ["experiment", "scaling", "world_size", "seeds"]
    lines += markdown_table(
        [*columns, *repeats.STATISTICS],
        [[fmt(s[c]) for c in columns] + [fmt_spread(s, f) for f in repeats.STATISTICS] for s in summaries],
    )
    lines += machine.markdown(baselines, machine_checks)
    lines += steptime.markdown(rows)
    if checks:
        missed = sum(c["status"] == "missed" for c in checks)
        unchecked = sum(c["status"] == "no reference" for c in checks)
        lines += ["", "## Expectations", "",
                  f"{len(checks) - missed - unchecked} met, {missed} missed, {unchecked} without a reference (a limit "
                  "from the results history before it holds an earlier study); each checked against the mean over "
                  "the experiment's seeds (threshold: the limit with its relative tolerance).", ""]  # fmt: skip
        lines += markdown_table(
            expectations.COLUMNS,
            [[fmt(c[k]) if k != "status" else f"**{c[k]}**" for k in expectations.COLUMNS] for c in checks],
        )
    if since:
        previous, shown = since[0], [c for c in changes if c.verdict != "within tolerance"]
        lines += ["", "## Since the previous study", "",
                  f"Against `{previous}` in the results history (`scalelm history compare`): "
                  f"{sum(c.verdict.startswith('regression') for c in changes)} regression(s); changes beyond the "
                  "tolerance below, the others within it.", ""]  # fmt: skip
        lines += markdown_table(
            ["experiment", "figure", "before", "after", "change", "p", "verdict", "what changed"],
            [[c.experiment, c.figure, fmt(c.before), fmt(c.after), f"{c.relative:+.1%}",
              fmt(c.p_value) if c.p_value is not None else "one seed", c.verdict, history.describe(c.environment)]
             for c in shown],
        )  # fmt: skip
    files = [f"- `{r['experiment']}` seed {r['seed']}: `{r['checkpoint']}` (sha256 `{r['sha256']}`)" for r in rows]
    text = "# scalelm summary\n\n" + "\n".join(lines) + "\n\n## Consolidated models\n\n" + "\n".join(files) + "\n"
    (out_dir / "summary.md").write_text(text)


def plot(runs: list[RunSummary], summaries: list[dict[str, Any]], out_dir: Path, trend: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    plot_losses(runs, "tokens", "tokens seen", out_dir / "loss_vs_tokens.png")
    plot_losses(runs, "time", "wall time (s)", out_dir / "loss_vs_time.png")
    plot_scaling(summaries, out_dir / "scaling.png")
    plot_utilisation(runs, out_dir / "utilisation.png")
    bubble.plot_pipelines(runs, out_dir / "pipeline.png")
    if trend is not None:
        plot_trend(trend, out_dir / "trend.png")


def mark_overlaps(runs: list[RunSummary]) -> None:
    names = {f"{r.figures['experiment']}/seed{r.figures['seed']}": r for r in runs}
    for name, others in overlapping_runs({name: r.record for name, r in names.items()}).items():
        names[name].figures["overlapped_by"] = " ".join(sorted(others))


def aggregate(
    run_dirs: list[Path],
    out_dir: Path,
    warmup_steps: int | None = None,
    baseline: str | None = None,
    expected: list[expectations.Expectation] | None = None,
    history_db: Path | None = None,
    machine_files: list[Path] = (),
    references: MachineReferences | None = None,
) -> list[RunSummary]:
    """The summary of `run_dirs` in `out_dir`; with `history_db` the runs are appended to the results history first,
    and the summary compares them with the previous study there; with `machine_files` (scalelm.measure.baseline)
    it shows the machine's baseline against the site's `references`."""
    runs = [read_run(RunDir(Path(d)), warmup_steps) for d in run_dirs]
    mark_overlaps(runs)
    baselines = machine.read_baselines(list(machine_files))
    steptime.add_planned(runs, baselines)
    runs.sort(key=lambda r: (r.figures["world_size"], r.figures["experiment"], r.figures["seed"]))
    rows = [run.figures for run in runs]
    add_scaling(rows, choose_baseline({r["experiment"]: r["world_size"] for r in rows}, baseline))
    summaries = repeats.by_experiment(rows)
    since = trend = reference = None
    if history_db:
        study, new = history.record_runs(history_db, runs, out_dir)
        print(f"results history {history_db}: {new} new run(s) of {len(runs)} (study {study!r})")
        recorded = history.read_rows(history_db)  # once, for the comparison, the trend and the limits it gives
        since, trend = history.since_previous(recorded, runs), history.trend(recorded, runs)

        def reference(experiment: str, figure: str, n: int) -> tuple[float | None, str]:
            return history.reference(recorded, runs, experiment, figure, n, history_db)

    checks = expectations.check(expectations.resolve(expected or [], reference), summaries)
    machine_checks = machine.check(baselines, references or MachineReferences())
    out_dir.mkdir(parents=True, exist_ok=True)
    write_tables(rows, summaries, checks, out_dir, since, baselines, machine_checks)
    plot(runs, summaries, out_dir, trend)
    return runs


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalelm.report.aggregate", description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, action="append", required=True, help="a run directory (repeatable)")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument(
        "--warmup-steps", type=int, help="steps left out of the speed figures (default: 10%% of the run, at least 5)"
    )
    parser.add_argument(
        "--baseline", help="experiment to compare speed with (default: the one with the fewest devices)"
    )
    parser.add_argument(
        "--expect", action="append", default=[], metavar="EXPERIMENT.KEY=VALUE",
        help="a reference value, e.g. ddp.min_mfu=0.3 or ddp.tolerance=0.1 (repeatable; scalelm.report.expectations)",
    )  # fmt: skip
    parser.add_argument("--history", type=Path, help="also append the runs to this results history (SQLite)")
    parser.add_argument("--machine", type=Path, action="append", default=[],
                        help="a machine baseline (scalelm.measure.baseline; repeatable)")  # fmt: skip
    parser.add_argument("--site", type=Path, help="the site file whose `references:` the machine is checked against")
    args = parser.parse_args(argv)
    if args.warmup_steps is not None and args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be 0 or more, got {args.warmup_steps}")
    expected = expectations.from_arguments(args.expect)
    references = load_site(args.site).references if args.site else None
    runs = aggregate(args.run, args.out_dir, args.warmup_steps, args.baseline, expected, args.history, args.machine,
                     references)  # fmt: skip
    print((args.out_dir / "summary.md").read_text())
    print(f"{len(runs)} runs summarised in {args.out_dir}: summary.csv, summary_by_experiment.csv, summary.md, "
          "expectations.csv, machine.csv and *.png")  # fmt: skip


if __name__ == "__main__":
    main()
