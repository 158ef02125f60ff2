"""Fault-tolerance figures: preemption and crash trials at random steps, for DDP and FSDP (2 ranks, CPU, tiny model).

    python bench/fault_trials.py [--trials 10] [--strategies ddp,fsdp] [--seed S] [--json OUT]

Preemption: one run is stopped `trials` times at random steps by SIGUSR1 to its process group (what Slurm's
`--signal` and `scancel --signal=USR1` do), restarted after each stop, and its final weights compared bitwise with
an uninterrupted run's. Reports trials survived (exit 75, checkpoint written, the restart resumed from it), the time
from the signal to the checkpoint's completion marker, and whether the end result is bitwise equal.
Crash: `trials` fresh runs each lose a random rank to SIGKILL at a random step; reports the jobs that exited
non-zero within 60 s naming the rank, with no training process left behind, and the rerun resuming.
The drills themselves are tests/drills.py, shared with tests/test_faults.py.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import drills  # noqa: E402
from argtypes import count, names, output_file  # noqa: E402
from conftest import TINY, sample_files  # noqa: E402
from scalelm.data.prefetch import main as prefetch  # noqa: E402
from scalelm.data.prepare import main as prepare  # noqa: E402
from scalelm.parallel.dims import SHORTHANDS  # noqa: E402

TRIAL_STEPS = 108  # the steps a preemption may fall on (2 to 109 of 120): each trial takes another


def write_config(directory: Path, name: str, prepared: Path, strategy: str, max_steps: int, dropout: float) -> Path:
    values = yaml.safe_load(yaml.safe_dump(TINY))
    values["data"]["prepared_dir"] = str(prepared)
    values["run_dir"] = str(directory / name)
    values["model"]["dropout"] = dropout
    values["parallel"] = {"strategy": strategy}
    values["train"]["max_steps"] = max_steps
    values["checkpoint"] = {"every": 5, "keep": 3}
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def preemption_trials(workdir: Path, prepared: Path, strategy: str, trials: int, rng: random.Random) -> dict[str, Any]:
    straight = write_config(workdir, f"{strategy}-straight", prepared, strategy, 120, 0.1)
    broken = write_config(workdir, f"{strategy}-broken", prepared, strategy, 120, 0.1)
    assert drills.run(straight).returncode == 0
    stopped, records = 0, []
    for target in sorted(rng.sample(range(2, 2 + TRIAL_STEPS), trials)):
        stop = drills.interrupt(broken, max(target, stopped + 1))
        resumed = not stopped or f"resumed from step {stopped}" in stop.output
        records.append(
            {
                "signal_at": stop.target,
                "exit": stop.exit_code,
                "stopped_at": stop.stopped_at,
                "signal_to_checkpoint_s": stop.signal_to_checkpoint_s,
                "survived": stop.survived and resumed,
            }
        )
        print(
            f"  {strategy} preemption: signal at step {stop.target}, exit {stop.exit_code}, "
            f"checkpoint at step {stop.stopped_at}, {stop.signal_to_checkpoint_s or float('nan'):.2f} s",
            flush=True,
        )
        if not stop.survived:
            break
        stopped = stop.stopped_at
    final = drills.run(broken)
    a = drills.final_weights(straight, workdir / f"{strategy}-straight.pt")
    b = drills.final_weights(broken, workdir / f"{strategy}-broken.pt")
    times = [r["signal_to_checkpoint_s"] for r in records if r["signal_to_checkpoint_s"] is not None]
    return {
        "tried": trials,
        "survived": sum(r["survived"] for r in records),
        "bitwise_equal": final.returncode == 0 and all(torch.equal(a[k], b[k]) for k in a),
        "signal_to_checkpoint_s": {"median": statistics.median(times), "max": max(times)} if times else None,
        "trials": records,
    }


def crash_trials(workdir: Path, prepared: Path, strategy: str, trials: int, rng: random.Random) -> dict[str, Any]:
    records = []
    for i in range(trials):
        config = write_config(workdir, f"{strategy}-crash-{i}", prepared, strategy, 400, 0.0)
        rank, step = rng.randrange(2), rng.randrange(6, 60)
        crash = drills.kill_rank(config, rank, at_step=step)
        named = f"rank: {rank}" in crash.output and "SIGKILL" in crash.output
        rerun = drills.run(config)
        ok = crash.exit_code != 0 and crash.detected_s < 60 and named and crash.survivors == 0
        resumed = rerun.returncode == 0 and "resumed from step" in rerun.stdout
        records.append(
            {
                "rank": rank,
                "at_step": step,
                "exit": crash.exit_code,
                "detected_s": crash.detected_s,
                "named": named,
                "survivors": crash.survivors,
                "detected": ok,
                "rerun_resumed": resumed,
            }
        )
        print(
            f"  {strategy} crash: rank {rank} killed at step {step}, job exit {crash.exit_code} after "
            f"{crash.detected_s:.2f} s, rank named: {named}, rerun resumed: {resumed}",
            flush=True,
        )
    times = [r["detected_s"] for r in records]
    return {
        "tried": trials,
        "detected_within_60s": sum(r["detected"] for r in records),
        "rerun_resumed": sum(r["rerun_resumed"] for r in records),
        "detected_s": {"median": statistics.median(times), "max": max(times)},
        "trials": records,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=count(1, TRIAL_STEPS), default=10)
    parser.add_argument("--strategies", type=names(SHORTHANDS, "strategy"), default="ddp,fsdp")
    parser.add_argument("--seed", type=int, default=time.time_ns() % 100_000)
    parser.add_argument("--json", type=output_file)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    result: dict[str, Any] = {"seed": args.seed, "torch": torch.__version__, "preemption": {}, "crash": {}}
    with tempfile.TemporaryDirectory(prefix="scalelm-faults-") as tmp:
        workdir = Path(tmp)
        prefetch(["--out", str(workdir / "raw"), "--files", sample_files()])
        prepare(["--raw", str(workdir / "raw"), "--out", str(workdir / "prepared"), "--min-freq", "2"])
        for strategy in args.strategies:
            result["preemption"][strategy] = preemption_trials(
                workdir, workdir / "prepared", strategy, args.trials, rng
            )
            result["crash"][strategy] = crash_trials(workdir, workdir / "prepared", strategy, args.trials, rng)
    print(f"seed {args.seed}")
    for strategy, p in result["preemption"].items():
        c, t = result["crash"][strategy], p["signal_to_checkpoint_s"] or {"median": float("nan"), "max": float("nan")}
        print(
            f"{strategy}: preemptions survived {p['survived']}/{p['tried']}, final weights bitwise equal: "
            f"{p['bitwise_equal']}, signal -> checkpoint median {t['median']:.2f} s (max {t['max']:.2f} s); "
            f"crashes detected within 60 s {c['detected_within_60s']}/{c['tried']} (median "
            f"{c['detected_s']['median']:.2f} s, max {c['detected_s']['max']:.2f} s), reruns resumed "
            f"{c['rerun_resumed']}/{c['tried']}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
