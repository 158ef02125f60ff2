"""Compare the runs of the experiment matrix: summary tables (CSV and Markdown) and plots (PNG).

    python -m scalelm.report.aggregate --run results/runs/ddp/seed1 [--run ...] --out-dir results \
        [--baseline single_gpu] [--expect ddp.min_mfu=0.3 ...] [--disturbed-share 0.1]

Each run directory holds run.json (provenance and results, from training), metrics.jsonl, and the outputs of the
consolidate and evaluate steps (model.pt.json, test.json). Speed is the steady state after warm-up (median step
time, its spread, tokens/s and MFU of the median: scalelm.report.timing); speedup and scaling efficiency compare
tokens per second with the baseline experiment, strong or weak scaling by the run's batch mode
(scalelm.report.scaling). A run that trained while another did on one of its hosts is named in `overlapped_by`, and
one whose hosts did other work beyond a share of the cores it was given (--disturbed-share) says why in `disturbed`
(scalelm.report.disturbance); `other_cpu_cores` says how busy its hosts were with other work. No contaminated figure
goes unmarked: such a run is flagged in the lead table, counted in `disturbed_seeds` per experiment, marked in the
plots with a note under them, in its expectations and in the results history; a speedup against such a baseline
run, or an efficiency too far above 1 to be real, in `scaling_flag`; a machine baseline measured beside other work
in `machine_disturbed` and in the step-time errors planned from it. Utilisation
per device (mean, and the least busy device) comes from the run's monitor files (scalelm.report.utilisation), and
`utilisation.png` shows it over time.

summary.csv has one row per run (experiment x seed), summary_by_experiment.csv one per experiment with the mean,
standard deviation, min and max over its seeds (scalelm.report.repeats); expectations.csv says which of the
experiments' reference values (`expect:`) were met (scalelm.report.expectations).

Nothing is summarised from a run it cannot trust: a file of another shape than its writer gives it (a metrics line,
by its number), a figure that is not a finite number (a broken run), or a run given twice is refused naming the file,
the figure or the run; and a results history (--history) among the files the aggregation writes or inside a run
directory, or an --out-dir inside a run directory, is refused before anything is recorded
(scalelm.report.history_store.check_location). MFU divides by the peak of `train.peak_tflops` as the run is configured
now (its config.yaml) where that is set, else by the peak the run recorded (`peak_tflops`), under two conventions:
`mfu` counts attention over the whole sequence (scalelm's and torchtitan's count), `mfu_causal` causal attention at
half (llm.c's; scalelm.measure.peak).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalelm.errors import DataError, friendly_errors
from scalelm.files import OutputError
from scalelm.measure.peak import causal_flops_per_token, mfu
from scalelm.plan.machine import MachineBaseline
from scalelm.report import (
    bubble,
    expectations,
    experts,
    history_compare,
    history_store,
    machine,
    per_run,
    repeats,
    steptime,
)
from scalelm.report.disturbance import DEFAULT_SHARE, run_disturbance
from scalelm.report.figures import COLUMNS, RunSummary, finite_number
from scalelm.report.plots import plot_experts, plot_losses, plot_scaling, plot_trend
from scalelm.report.scaling import SCALING, add_scaling, choose_baseline
from scalelm.report.tables import write_csv
from scalelm.report.timing import overlapping_runs, steady_state, straggler
from scalelm.report.utilisation import device_series, plot_utilisation, summarise
from scalelm.settings_yaml import read_settings, shown
from scalelm.site import MachineReferences, load_site
from scalelm.train.record import RunRecord, metrics_lines, read_record
from scalelm.train.rundir import RunDir

# what writes a file of a run directory anew, for the error that refuses it: its kind, and what to do
AGAIN = "remove run.json and run the training again: it resumes from its last checkpoint"
# a finished run's metrics.jsonl is not written again (a rerun restores its run.json, the log kept as it is): what
# the report cannot read of it goes, line by line
LINES_AWAY = "the summary then leaves it out; training the run again would keep its log as it is"
RUN_FILES = {
    "run.json": ("a run record", AGAIN),
    "config.yaml": ("the settings of a run", "set train.peak_tflops there to one device's TFLOP/s, or null"),
    "metrics.jsonl": ("a metrics log", f"remove the lines the report cannot read ({LINES_AWAY})"),
    "identity.json": ("a run identity", AGAIN),
    "model.pt.json": ("a model record", "remove it and consolidate the run again"),
    "test.json": ("a test evaluation", "remove it and evaluate the model again"),
    "monitor": ("a monitor's readings", "remove the directory: the run's utilisation figures are then left empty"),
}


@contextmanager
def shape_errors(path: Path) -> Iterator[None]:
    """A file of a run directory of another shape than its writer gives it (damaged, cut short, edited, another
    version's) as one error naming it and how to write it anew, never a KeyError from deep in the report."""
    try:
        yield
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, ZeroDivisionError) as err:
        what, fix = RUN_FILES[path.name]
        raise DataError(f"{path} is not {what} this scalelm reads ({type(err).__name__}: {err}): {fix}") from None


def read_object(path: Path, numbers: tuple[str, ...] = (), strings: tuple[str, ...] = ()) -> dict[str, Any]:
    """A JSON object with these keys holding numbers and strings."""
    with shape_errors(path):
        found = json.loads(path.read_text())
        if not isinstance(found, dict):
            raise TypeError(f"a JSON object was expected, not {type(found).__name__}")
        for key in numbers:
            if not isinstance(found[key], (int, float)) or isinstance(found[key], bool):
                raise TypeError(f"{key} is {found[key]!r}, not a number")
        for key in strings:
            if not isinstance(found[key], str):
                raise TypeError(f"{key} is {found[key]!r}, not a string")
        return found


# what the report reads of each metrics record, by kind: numbers (and an evaluation's split)
METRICS_NUMBERS = {
    "train": ("step", "time", "tokens", "loss", "step_time_s", "tokens_per_step", "world_size", "peak_mem_mb"),
    "eval": ("step", "time", "loss"),
}


def read_report_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl, each with what the report reads of it: a line without is named with
    what to do (remove it: a rerun of a finished run would not write it again), never a KeyError in a figure."""
    lines, _ = metrics_lines(path)
    unread = [(line.number, metrics_problem(line.record)) for line in lines if metrics_problem(line.record)]
    if unread:
        (number, problem), more = unread[0], len(unread) - 1
        others = f" (and {more} more line{'s' if more > 1 else ''})" if more else ""
        raise DataError(
            f"{path}, line {number}, is not a metrics record this scalelm reads ({problem}){others}: remove that "
            f"line ({LINES_AWAY})"
        )
    return [line.record for line in lines]


def metrics_problem(record: dict[str, Any]) -> str | None:
    """What the report cannot read in one metrics record; None if nothing."""
    kind = record.get("kind")
    if kind not in METRICS_NUMBERS:
        return f"kind {shown(kind, 40)}, not train or eval"
    if kind == "eval" and not isinstance(record.get("split"), str):
        return "an evaluation without its split"
    for key in METRICS_NUMBERS[kind]:
        if key not in record:
            return f"no {key}"
        if not finite_number(record[key]):
            return f"{key} {shown(record[key], 40)}, not a finite number"
    return None


@dataclass(frozen=True)
class ReportOptions:
    """How runs are read into the report: the steps left out of the speed figures (None: 10% of the run, at least
    5), the experiment speedups are taken against (None: the one with the fewest devices), and the share of the cores
    a run (or a machine baseline) was given that other work on its hosts may take before it is marked disturbed
    (scalelm.report.disturbance)."""

    warmup_steps: int | None = None
    baseline: str | None = None
    disturbed_share: float = DEFAULT_SHARE


def read_run(run: RunDir, options: ReportOptions = ReportOptions()) -> RunSummary:
    """The run's row of summary.csv and what the plots draw besides. A file of the run of another shape than its
    writer gives it, or a figure that is not a finite number (a broken run), is refused naming the file. Other work
    on its hosts beyond `options.disturbed_share` of the cores it was given marks it `disturbed`."""
    try:
        with shape_errors(run.record):
            record = read_record(run.path)
        model = read_object(run.model_meta, strings=("model", "sha256", "checkpoint"))
        test = read_object(run.test_result, numbers=("loss", "perplexity"))
        check_own_model(run, model, test)
        identity = read_object(run.identity)
        metrics = read_report_metrics(run.metrics)
    except FileNotFoundError as err:
        raise DataError(f"{run.path} is incomplete ({err.filename} is missing): run the workflow up to it") from None
    with shape_errors(run.metrics):
        train = [m for m in metrics if m["kind"] == "train"]
        unprofiled = [m for m in train if not m.get("profiled")] or train
        steady = steady_state(train, options.warmup_steps)
        memory = {  # the profiler's records would count (scalelm.measure.comm)
            "peak_mem_mb_per_rank": max((m["peak_mem_mb"] for m in unprofiled), default=None),
            "peak_reserved_mb_per_rank": max(
                (m["peak_reserved_mb"] for m in unprofiled if m.get("peak_reserved_mb")), default=None
            ),
        }
    with shape_errors(run.monitor):
        series, monitor_cost = device_series(run.monitor)
        utilisation = summarise(series, monitor_cost)
    with shape_errors(run.record):
        figures = run_figures(run, record, steady, memory, utilisation, test, model)
        figures["disturbed"] = run_disturbance(record, options.disturbed_share)
    sources = {
        **dict.fromkeys([*steady, *memory], run.metrics),
        **dict.fromkeys(utilisation, run.monitor),
        "test_loss": run.test_result,
        "test_perplexity": run.test_result,
    }
    check_finite(figures, sources, run.record)
    return RunSummary(figures, metrics, record, series, identity, model.get("vocab_size"))


def check_own_model(run: RunDir, model: dict[str, Any], test: dict[str, Any]) -> None:
    """The model and the test loss a run reports are its own: its model.pt.json names a checkpoint of the run (by
    its path where it is still there, else by the run's experiment, seed and checkpoints/), and its test.json scored
    the model that record describes."""
    checkpoint = Path(model["checkpoint"])
    if checkpoint.exists():
        own = checkpoint.resolve().parent == run.checkpoints.resolve()
    else:  # a results directory moved or copied since
        own = checkpoint.parts[-4:-1] == run.checkpoints.parts[-3:]
    if not own:
        raise DataError(
            f"{run.model_meta} records a model consolidated from {checkpoint}, which is not a checkpoint of this run "
            f"({run.checkpoints}): remove {run.model}, {run.model_meta.name} and {run.test_result.name}, and run the "
            "workflow again to consolidate and evaluate this run's own"
        )
    scored = test.get("model_sha256")
    if scored is not None and scored != model["sha256"]:
        raise DataError(
            f"{run.test_result} scored a model of sha256 {str(scored)[:12]}, but {run.model_meta} records "
            f"{model['sha256'][:12]}: remove {run.test_result.name} and run the workflow again to evaluate this run's "
            "model"
        )


def run_figures(
    run: RunDir,
    record: RunRecord,
    steady: dict[str, Any],
    memory: dict[str, Any],
    utilisation: dict[str, Any],
    test: dict[str, Any],
    model: dict[str, Any],
) -> dict[str, Any]:
    """The run's row of summary.csv: its record's figures beside those of its other files."""
    results, config = record.results, record.config
    state = results.state_mb_per_rank or {}
    plan = results.plan_mb_per_rank  # what scalelm.plan predicts for the layout
    peak = peak_now(run, record)  # None where the device's peak is unknown
    steady_mfu = steady_mfu_causal = None
    if peak and steady:
        steady_mfu = mfu(results.flops_per_token, steady["tokens_per_s"], record.world_size, peak)
        shape, seq_len = config["model"], config["data"]["seq_len"]
        causal = causal_flops_per_token(results.flops_per_token, shape["n_layers"], shape["d_model"], seq_len)
        steady_mfu_causal = mfu(causal, steady["tokens_per_s"], record.world_size, peak)
    return {
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
        **experts.columns(record),  # parameters; a mixture's experts, load balance, aux loss, all-to-all share
        "steps": results.steps,
        "wall_time_s": record.wall_time_s,
        "train_time_s": results.train_time_s,
        "staging_s": (results.staging or {}).get("seconds"),
        **steady,
        "mfu": steady_mfu,
        "mfu_causal": steady_mfu_causal,
        "peak_tflops": peak / 1e12 if peak else None,
        # the share of the profiled steps with a collective running (scalelm.measure.comm); 0 for one process
        "comm_share": (results.comm or {}).get("share"),
        "straggler": straggler(results.comm, record.hostnames),
        **bubble.columns(results),
        "state_mb_per_rank": state.get("total"),
        "planned_state_mb_per_rank": plan.get("state"),
        "planned_peak_mb_per_rank": plan.get("total"),
        **memory,
        "other_cpu_cores": max((h["other_cores"] for h in record.host_load.values()), default=None),
        "overlapped_by": "",
        "disturbed": "",
        **utilisation,
        "energy_j": (results.energy or {}).get("joules"),
        "joules_per_token": (results.energy or {}).get("joules_per_token"),
        "final_train_loss": results.final_train_loss,
        "validation_loss": results.validation["loss"],
        "test_loss": test["loss"],
        "test_perplexity": test["perplexity"],
        "checkpoint": model["model"],
        "sha256": model["sha256"],
    }


def peak_now(run: RunDir, record: RunRecord) -> float | None:
    """One device's peak FLOP/s for the run's MFU: train.peak_tflops as the run is configured now (its config.yaml,
    which a rerun that restores a finished run's record writes anew), winning as it does in training
    (scalelm.measure.peak.peak_flops); else the peak the run recorded."""
    if not run.config.is_file():
        return record.results.peak_flops_per_device
    with shape_errors(run.config):
        configured = (read_settings(run.config).get("train") or {}).get("peak_tflops")
        if configured is not None and not (finite_number(configured) and configured > 0):
            raise ValueError(f"train.peak_tflops is {shown(configured, 40)}, not a device's TFLOP/s")
    return configured * 1e12 if configured else record.results.peak_flops_per_device


def check_finite(figures: dict[str, Any], sources: dict[str, Path], record: Path) -> None:
    """A NaN or an infinity in a run's figures is a broken run (a diverged loss, a clock that did not advance): one
    such figure would make its experiment's mean, spread and comparisons meaningless, or fail them."""
    for name, value in figures.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise DataError(
                f"{sources.get(name, record)} gives {name} = {value}: the run is broken and would spoil its "
                "experiment's statistics; train it again (with other settings if its loss diverged), or aggregate "
                "without it"
            )


def check_distinct(run_dirs: list[Path], runs: list[RunSummary] | None = None) -> None:
    """Each run once: a directory given twice, or two of the same experiment and seed, would count as two seeds."""
    given: dict[Path, Path] = {}
    for path in run_dirs:
        if Path(path).resolve() in given:
            raise DataError(f"{given[Path(path).resolve()]} is given twice: each run counts once; give it once")
        given[Path(path).resolve()] = Path(path)
    seeds: dict[tuple[str, Any], Path] = {}
    for path, run in zip(run_dirs, runs or []):
        experiment, seed = run.figures["experiment"], run.figures["seed"]
        if (experiment, seed) in seeds:
            raise DataError(
                f"{seeds[experiment, seed]} and {path} are both seed {seed} of {experiment}: one seed would count "
                "twice; give one of them"
            )
        seeds[experiment, seed] = Path(path)


def check_out_dir(out_dir: Path, run_dirs: list[Path]) -> None:
    """The summary's files land apart from the runs they summarise, as every command's outputs lie apart from its
    inputs (scalelm.files.check_apart): not in a run directory nor inside one (its checkpoints/). A directory that
    holds run directories (results/) is where they belong: only the summary's own files are written there."""
    target = Path(out_dir).resolve()
    for run in run_dirs:
        source = Path(run).resolve()
        if target == source or source in target.parents:
            where = "is" if target == source else "lies inside"
            raise OutputError(
                f"--out-dir {out_dir} {where} the run directory {run}: the summary would be written among the run's "
                "files; choose another --out-dir"
            )


# every file the aggregation writes in its out directory (workflow/rules/aggregate.smk's outputs)
OUTPUTS = (
    "summary.csv",
    "summary_by_experiment.csv",
    "expectations.csv",
    "machine.csv",
    "summary.md",
    "loss_vs_tokens.png",
    "loss_vs_time.png",
    "scaling.png",
    "utilisation.png",
    "pipeline.png",
    "experts.png",
    "trend.png",
)


def write_tables(
    rows: list[dict[str, Any]],
    summaries: list[dict[str, Any]],
    checks: list[dict[str, Any]],
    out_dir: Path,
    options: ReportOptions,
    since: tuple[str, list[history_compare.Change]] | None = None,
    machine_figures: tuple[list[MachineBaseline], list[dict[str, Any]], dict[int, str]] = ([], [], {}),
) -> None:
    """summary.csv (every figure of every run), summary_by_experiment.csv, expectations.csv, machine.csv, and
    summary.md: its sections in order, each written by the module of its figures (`since`: the previous study's id
    and the changes, from the results history; `machine_figures`: the machine's baselines, their checks and
    why each was disturbed, by node count)."""
    baselines, machine_checks, disturbed = machine_figures
    write_csv(out_dir / "summary.csv", COLUMNS, rows)
    write_csv(out_dir / "summary_by_experiment.csv", repeats.COLUMNS, summaries)
    write_csv(out_dir / "expectations.csv", expectations.COLUMNS, checks)
    write_csv(out_dir / "machine.csv", machine.COLUMNS, machine.rows(baselines))
    changes = since[1] if since else []
    lines = [
        *per_run.markdown(rows, checks, changes, machine_checks, options.disturbed_share),
        *repeats.markdown(summaries),
        *experts.markdown(rows),
        *machine.markdown(baselines, machine_checks, disturbed),
        *steptime.markdown(rows),
        *expectations.markdown(checks),
        *history_compare.markdown(since),
    ]
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
    plot_experts(runs, out_dir / "experts.png")
    if trend is not None:
        plot_trend(trend, out_dir / "trend.png")


def mark_overlaps(runs: list[RunSummary]) -> None:
    names = {f"{r.figures['experiment']}/seed{r.figures['seed']}": r for r in runs}
    for name, others in overlapping_runs({name: r.record for name, r in names.items()}).items():
        names[name].figures["overlapped_by"] = " ".join(sorted(others))


def aggregate(
    run_dirs: list[Path],
    out_dir: Path,
    options: ReportOptions = ReportOptions(),
    expected: list[expectations.Expectation] | None = None,
    history_db: Path | None = None,
    machine_files: list[Path] = (),
    references: MachineReferences | None = None,
) -> list[RunSummary]:
    """The summary of `run_dirs` in `out_dir`, read as `options` say; with `history_db` the runs are appended to the
    results history first, and the summary compares them with the previous study there; with `machine_files`
    (scalelm.measure.baseline) it shows the machine's baseline against the site's `references`."""
    if history_db:
        history_store.check_location(
            history_db, [out_dir / name for name in OUTPUTS], run_dirs, "--history", f"{out_dir / 'history.sqlite'}"
        )
    check_out_dir(out_dir, run_dirs)
    check_distinct(run_dirs)
    runs = [read_run(RunDir(Path(d)), options) for d in run_dirs]
    check_distinct(run_dirs, runs)
    mark_overlaps(runs)
    baselines = machine.read_baselines(list(machine_files))
    disturbed = steptime.add_planned(runs, baselines, machine.disturbances(baselines, options.disturbed_share))
    runs.sort(key=lambda r: (r.figures["world_size"], r.figures["experiment"], r.figures["seed"]))
    rows = [run.figures for run in runs]
    add_scaling(rows, choose_baseline({r["experiment"]: r["world_size"] for r in rows}, options.baseline))
    summaries = repeats.by_experiment(rows)
    since = trend = reference = None
    if history_db:
        study_id, new = history_store.record_runs(history_db, runs, out_dir)
        print(f"results history {history_db}: {new} new run(s) of {len(runs)} (study {study_id!r})")
        recorded = history_store.read_rows(history_db)  # once, for the comparison, the trend and the limits it gives
        since, trend = history_compare.since_previous(recorded, runs), history_compare.trend(recorded, runs)

        def reference(experiment: str, figure: str, n: int) -> tuple[float | None, str]:
            return history_compare.reference(recorded, runs, experiment, figure, n, history_db)

    checks = expectations.check(expectations.resolve(expected or [], reference), summaries)
    machine_checks = machine.check(baselines, references or MachineReferences())
    out_dir.mkdir(parents=True, exist_ok=True)
    write_tables(rows, summaries, checks, out_dir, options, since, (baselines, machine_checks, disturbed))
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
        "--expect",
        action="append",
        default=[],
        metavar="EXPERIMENT.KEY=VALUE",
        help="a reference value, e.g. ddp.min_mfu=0.3 or ddp.tolerance=0.1 (repeatable; scalelm.report.expectations)",
    )
    parser.add_argument("--history", type=Path, help="also append the runs to this results history (SQLite)")
    parser.add_argument(
        "--machine",
        type=Path,
        action="append",
        default=[],
        help="a machine baseline (scalelm.measure.baseline; repeatable)",
    )
    parser.add_argument("--site", type=Path, help="the site file whose `references:` the machine is checked against")
    parser.add_argument(
        "--disturbed-share",
        type=float,
        default=DEFAULT_SHARE,
        metavar="SHARE",
        help="other work on a run's hosts beyond this share of the cores it was given marks it "
        f"disturbed (default {DEFAULT_SHARE:g}; scalelm.report.disturbance)",
    )
    args = parser.parse_args(argv)
    if args.warmup_steps is not None and args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be 0 or more, got {args.warmup_steps}")
    if not (math.isfinite(args.disturbed_share) and args.disturbed_share > 0):
        parser.error(
            f"--disturbed-share must be a positive share of the cores (0.1: a tenth), got {args.disturbed_share}"
        )
    expected = expectations.from_arguments(args.expect)
    references = load_site(args.site).references if args.site else None
    runs = aggregate(
        args.run,
        args.out_dir,
        ReportOptions(args.warmup_steps, args.baseline, args.disturbed_share),
        expected=expected,
        history_db=args.history,
        machine_files=args.machine,
        references=references,
    )
    print((args.out_dir / "summary.md").read_text())
    print(
        f"{len(runs)} runs summarised in {args.out_dir}: summary.csv, summary_by_experiment.csv, summary.md, "
        "expectations.csv, machine.csv and *.png"
    )


if __name__ == "__main__":
    main()
