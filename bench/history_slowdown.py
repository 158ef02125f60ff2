"""The results history on real trainings: does it flag a real slowdown, and leave a rerun alone?

    python bench/history_slowdown.py [--seeds 3] [--steps 25] [--keep DIR] [--json OUT]

Three studies of one tiny experiment (d_model 128, seq_len 64, batch 32) on the shipped WikiText-2 sample, each
run trained in a process of its own, consolidated, evaluated and aggregated into one results history, as the
workflow does: `first` and `rerun` on two threads per process, `one_thread` on one. The runs are trained in turn
(seed 1 of each study, then seed 2, ...) so that a drift of the machine falls on all alike. Prints each study's
tokens/s per device and test loss, then the history's verdict on rerun against first (expected: no regression,
the test loss bitwise the same) and on one_thread against rerun (expected: a significant regression of
tokens_per_s_per_device, the thread count named as what changed). Exits 1 when a verdict is not the expected one.

A measured speed depends on the machine and what else runs on it: this is a demonstration, not a test
(tests/test_aggregate.py::test_the_history_flags_a_slowdown_and_no_rerun checks the detection on set figures). On
a shared machine check `uptime` first; with one core, two threads cannot be faster than one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from argtypes import count, output_dir, output_file
from scalelm.data.prefetch import main as prefetch
from scalelm.data.prepare import main as prepare
from scalelm.report import history_compare, history_store
from scalelm.report.aggregate import aggregate
from scalelm.train.consolidate import consolidate
from scalelm.train.evaluation import main as evaluate
from scalelm.train.rundir import RunDir

SAMPLE = Path(__file__).resolve().parents[1] / "resources" / "wikitext-2-sample"
STUDIES = {"first": 2, "rerun": 2, "one_thread": 1}  # threads per process
SETTINGS = {
    "data": {"seq_len": 64},
    "model": {"d_model": 128, "n_heads": 2, "n_layers": 2, "d_ff": 512, "dropout": 0.0},
    "batch": {"mode": "global", "size": 32},
    "train": {"epochs": 1, "log_every": 1, "eval_every": None, "eval_batch_size": 128, "monitor_interval_s": 0},
    "checkpoint": {"every": None},
}


def prepared_sample(root: Path) -> Path:
    files = ",".join(f"{split}={SAMPLE / f'{split}.txt'}" for split in ("train", "validation", "test"))
    prefetch(["--out", str(root / "raw"), "--files", files])
    prepare(["--raw", str(root / "raw"), "--out", str(root / "prepared"), "--min-freq", "2"])
    return root / "prepared"


def train(run: RunDir, prepared: Path, seed: int, steps: int, threads: int) -> float:
    """One run trained, consolidated and evaluated as the workflow's rules do; the training's wall seconds."""
    settings = yaml.safe_load(yaml.safe_dump(SETTINGS))
    settings.update(seed=seed, run_dir=str(run.path))
    settings["data"]["prepared_dir"] = str(prepared)
    settings["train"]["max_steps"] = steps
    config = run.path.parent / f"seed{seed}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump(settings))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "scalelm.train", "--config", str(config)], env=env, check=True, stdout=subprocess.DEVNULL
    )
    seconds = time.perf_counter() - start
    consolidate(run)
    evaluate(["--model", str(run.model), "--data", str(prepared), "--out", str(run.test_result)])
    return seconds


def verdicts(db: Path) -> dict[str, dict[str, history_compare.Change]]:
    """The history's comparisons: rerun against first, one_thread against rerun, by figure."""
    rows = history_store.read_rows(db)
    first, rerun, one_thread = sorted({r["study"] for r in rows})
    by_study = {study: [r for r in rows if r["study"] == study] for study in (first, rerun, one_thread)}
    return {
        "rerun": {c.figure: c for c in history_compare.compare(by_study[first], by_study[rerun])},
        "one_thread": {c.figure: c for c in history_compare.compare(by_study[rerun], by_study[one_thread])},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=count(2), default=3, help="seeds per study (Welch's test needs 2 or more)")
    parser.add_argument("--steps", type=count(1), default=25, help="training steps per run")
    parser.add_argument(
        "--keep", type=output_dir, help="train here and keep the runs and the history (default: a temp dir)"
    )
    parser.add_argument("--json", type=output_file, help="also write the figures and verdicts here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        prepared = prepared_sample(root / "data")
        seconds: dict[str, list[float]] = {study: [] for study in STUDIES}
        for seed in range(1, args.seeds + 1):
            for study, threads in STUDIES.items():
                run = RunDir.of(root / study, "tiny", seed)
                seconds[study].append(train(run, prepared, seed, args.steps, threads))
        db = root / "history.sqlite"
        figures = {}
        for study in STUDIES:
            runs = [RunDir.of(root / study, "tiny", seed).path for seed in range(1, args.seeds + 1)]
            summaries = aggregate(runs, root / study / "summary", history_db=db)
            figures[study] = {
                "tokens_per_s_per_device": [s.figures["tokens_per_s_per_device"] for s in summaries],
                "test_loss": [s.figures["test_loss"] for s in summaries],
                "train_wall_s": seconds[study],
            }
        found = verdicts(db)
    print(f"\n{args.seeds} seeds x {args.steps} steps per study, {time.perf_counter() - started:.0f} s in all")
    for study, threads in STUDIES.items():
        speeds = ", ".join(f"{v:,.0f}" for v in figures[study]["tokens_per_s_per_device"])
        print(
            f"  {study:<11} {threads} thread(s): tokens/s/device {speeds}; test loss "
            f"{', '.join(f'{v:.4f}' for v in figures[study]['test_loss'])}"
        )
    for study, changes in found.items():
        for figure in ("tokens_per_s_per_device", "step_time_s", "test_loss"):
            c = changes[figure]
            test = f"p {c.p_value:.2g}" if c.p_value is not None else "one seed a side"
            print(
                f"  {study:<11} {figure:<24} {c.relative:+7.1%}  {test:<9} {c.verdict}  {history_compare.describe(c.environment)}"
            )
    rerun, slower = found["rerun"], found["one_thread"]["tokens_per_s_per_device"]
    expected = (
        not [c for c in rerun.values() if c.verdict.startswith("regression")]
        and rerun["test_loss"].relative == 0
        and slower.verdict == "regression"
        and "threads" in slower.environment
    )
    print("as expected" if expected else "NOT as expected: see the verdicts above")
    if args.json:
        changes = {
            study: {figure: c.to_dict() for figure, c in by_figure.items()} for study, by_figure in found.items()
        }
        args.json.write_text(json.dumps({"figures": figures, "changes": changes}, indent=1) + "\n")
    sys.exit(0 if expected else 1)


if __name__ == "__main__":
    main()
