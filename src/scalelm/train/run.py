"""Train the language model in the parallel layout the config names: the process's entry point.

    python -m scalelm.train --config FILE [--set key=value ...]                       # one process
    torchrun --nproc-per-node=2 -m scalelm.train --config FILE --set parallel.strategy=ddp
    torchrun --nproc-per-node=4 -m scalelm.train --config FILE --set parallel.dp_shard=2 --set parallel.tp=2

Everything goes to `run_dir` (scalelm.train.rundir): the resolved config, metrics.jsonl, checkpoints/, and run.json
(provenance and results), written last so that its presence means the run finished. Rerunning the same command
resumes from the latest complete checkpoint; rerunning a finished run (its settings outside its identity changed, say)
trains and evaluates nothing and restores its run.json as it finished. What runs the loop is train.engine's engine
(scalelm.train.trainer, scalelm.train.lightning_engine), over the same base (scalelm.train.engine).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
from pathlib import Path

from scalelm.config import Config, dump_config, load_config, validate
from scalelm.data.prepare import offline_hub
from scalelm.data.prepared import load_prepared
from scalelm.data.stage import Staged, staged
from scalelm.errors import friendly_errors
from scalelm.files import disk_errors
from scalelm.hang.flight_recorder import flight_recorder_env
from scalelm.measure.monitor import Monitor
from scalelm.parallel.env import DistEnv, all_gather_object, barrier, setup, teardown
from scalelm.parallel.runtime import Parallel
from scalelm.train.checkpoint import Origin, check_origin, complete_checkpoints, read_trainer, verify
from scalelm.train.engine import Engine, origin, train_batches
from scalelm.train.record import RunRecord, read_finished, restore_record, unreflected_settings
from scalelm.train.rundir import RunDir, identity
from scalelm.train.trainer import Trainer
from scalelm.train.wandb_offline import check_available
from scalelm.version import check_lock


def run(config: Config) -> RunRecord:
    offline_hub()  # compute nodes have no internet: never let a library try it (and wait for its retries)
    if config.train.deterministic:  # cuBLAS refuses deterministic mode without a fixed workspace, read at its start
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    for name, value in flight_recorder_env(RunDir(Path(config.run_dir)).autopsy).items():  # read by NCCL's start
        os.environ.setdefault(name, value)
    env = setup(config.device, config.parallel.timeout_s, cpu_collectives=config.parallel.cpu_offload)
    try:
        data = config.data
        with staged(data.prepared_dir, data.stage or "none", data.stage_dir, env, config.run_dir) as staging:
            return train_from(config, env, staging)
    finally:
        teardown()


def engine_for(config: Config) -> type[Engine]:
    """What runs the loop (train.engine): scalelm's Trainer, or Lightning's, refused now if it is not installed."""
    if config.train.engine == "lightning":
        from scalelm.train.lightning_engine import LightningEngine, require_lightning

        require_lightning()
        return LightningEngine
    return Trainer


def train_from(config: Config, env: DistEnv, staging: Staged) -> RunRecord:
    """`run`'s training, from the prepared data where `staging` put it (removed when this returns or fails)."""
    # Everything that can be refused is refused before the run directory is touched: what is installed (the engine,
    # the lock, the offline logger), the data, the layout against the world, the device and the data, the batch.
    make_engine = engine_for(config)
    check_lock()  # the lock SCALELM_LOCK names, read for the record at the end: refused now, not then
    if config.train.wandb:
        check_available()
    data = load_prepared(staging.path)
    parallel = Parallel.start(config, env, data.vocab_size)
    batches = train_batches(config, parallel, data)
    run_dir = RunDir(Path(config.run_dir))
    with run_dir.lock() if env.is_main else contextlib.nullcontext(), disk_errors(run_dir.path):
        run_identity = identity(config, data.checksums(), env.world_size, env.here)
        if env.is_main:
            run_dir.start(run_identity, env.here)
        barrier()
        run_origin = origin(config, run_identity, batches, run_dir, env.here)
        finished = finished_before(run_dir, run_origin, config) if env.is_main else None
        finished = all_gather_object(finished)[0]  # rank 0's answer, on every rank
        if finished is not None:
            return finished
        engine = make_engine(config, env, parallel, data, batches, staging)
        with Monitor(run_dir.monitor, env, config.train.monitor_interval_s, run_dir.tensorboard):
            try:
                record = engine.fit()
            finally:
                engine.close()
        barrier()  # every rank done with every collective before any shuts its process groups down
    return record


def finished_before(run_dir: RunDir, run_origin: Origin, config: Config) -> RunRecord | None:
    """The record this attempt kept when it finished, if its latest checkpoint is still the one it finished at:
    then run.json is restored as it was written (its provenance, its results) and nothing is trained or evaluated,
    as when the run is rerun for settings outside its identity (staging, logging) after Snakemake removed run.json.
    config.yaml takes this attempt's settings (the report's MFU follows its train.peak_tflops), and those the
    restored record was measured with otherwise are named. A run whose last checkpoint is damaged, or whose record
    was not kept, resumes as any other."""
    record = read_finished(run_dir.path)
    if record is None or record.results.checkpoint is None or record.results.steps != run_origin.steps:
        return None
    found = complete_checkpoints(run_dir.checkpoints)
    if not found or found[-1].name != Path(record.results.checkpoint).name or verify(found[-1]) is not None:
        return None
    check_origin(found[-1], read_trainer(found[-1]), run_origin)
    restore_record(run_dir.path)
    dump_config(config, run_dir.config)
    print(
        f"the run in {run_dir.path} finished at step {record.results.steps} (checkpoint {found[-1]}): nothing to train "
        f"or evaluate; {run_dir.record} restored as it finished (to measure it again, name a new study: "
        "snakemake --config study=NAME, or give a new run_dir)",
        flush=True,
    )
    unreflected = unreflected_settings(record, config.to_dict())
    if unreflected:
        settings = ", ".join(
            f"{key} {json.dumps(then)} (now {json.dumps(now)})" for key, (then, now) in unreflected.items()
        )
        peak_now = unreflected.get("train.peak_tflops", (None, None))[1]  # (a configured peak wins: measure.peak)
        mfu = f"; the report takes MFU from train.peak_tflops {peak_now}" if peak_now else ""
        print(
            f"{run_dir.record} was measured with {settings}{mfu}: to measure with the settings of now, train the run "
            "afresh in another run_dir",
            flush=True,
        )
    return record


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalelm.train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, help="YAML file of settings (defaults: the course's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    parser.add_argument("--run-dir", help="where the run writes (--set run_dir=DIR, the path taken as it is)")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.set)
    if args.run_dir is not None:
        config = dataclasses.replace(config, run_dir=args.run_dir)
        validate(config)
    run(config)


if __name__ == "__main__":
    main()
