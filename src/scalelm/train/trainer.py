"""Train the language model in the parallel layout the config names.

    python -m scalelm.train --config FILE [--set key=value ...]                       # one process
    torchrun --nproc-per-node=2 -m scalelm.train --config FILE --set parallel.strategy=ddp
    torchrun --nproc-per-node=4 -m scalelm.train --config FILE --set parallel.dp_shard=2 --set parallel.tp=2

Everything goes to `run_dir` (scalelm.train.rundir): the resolved config, metrics.jsonl, checkpoints/, and run.json
(provenance and results), written last so that its presence means the run finished. Rerunning the same command
resumes from the latest complete checkpoint; rerunning a finished run (its settings outside its identity changed, say)
trains and evaluates nothing and restores its run.json as it finished.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scalelm import seeds
from scalelm.config import Config, dump_config, load_config
from scalelm.data.prepared import PreparedData, load_prepared
from scalelm.data.stage import Staged, staged
from scalelm.data.windows import TrainBatches
from scalelm.errors import ScaleLMError, friendly_errors
from scalelm.files import disk_errors
from scalelm.measure.instruments import Instruments
from scalelm.measure.monitor import Monitor
from scalelm.model.transformer import TransformerLM
from scalelm.parallel.env import DistEnv, all_gather_object, barrier, global_reduce, setup, teardown
from scalelm.parallel.runtime import Parallel, pipeline_of
from scalelm.plan.memory import Workload
from scalelm.train import provenance
from scalelm.train.checkpoint import (
    Checkpointer,
    Origin,
    TrainerState,
    check_origin,
    complete_checkpoints,
    ranks_where,
    read_trainer,
    verify,
)
from scalelm.train.evaluation import evaluate
from scalelm.train.flight_recorder import flight_recorder_env
from scalelm.train.metrics import MetricsLogger, Stopwatch, reset_peak_memory
from scalelm.train.optim import build_optimizer, build_scheduler, optimizer_step, scaled_lr
from scalelm.train.preemption import Preempted, StopFlag, StopRequested
from scalelm.train.record import Results, RunRecord, read_finished, restore_record, write_record
from scalelm.train.rundir import RunDir, identity, lineage
from scalelm.train.wandb_offline import WandbRun
from scalelm.train.watchdog import Watchdog
from scalelm.version import check_lock


class TrainingError(ScaleLMError):
    pass


def model_shape(config: Config, vocab_size: int) -> dict[str, Any]:
    """The settings a checkpoint's tensors depend on; resuming with others is an error, not a silent mismatch."""
    keys = ("d_model", "n_heads", "n_layers", "d_ff", "max_seq_len", "norm", "tie_weights")
    return {**{k: getattr(config.model, k) for k in keys}, "vocab_size": vocab_size}


def due(step: int, every: int | None) -> bool:
    return bool(every) and step % every == 0


def total_steps(config: Config, batches: TrainBatches) -> int:
    """The run's optimizer steps: its epochs', or train.max_steps where fewer."""
    total = config.train.epochs * batches.steps_per_epoch
    return min(total, config.train.max_steps) if config.train.max_steps else total


def origin(config: Config, run_identity: dict[str, Any], batches: TrainBatches) -> Origin:
    """What this run's checkpoints record of it, and what it expects of those it resumes."""
    return Origin(seed=config.seed, lineage=lineage(run_identity), steps=total_steps(config, batches))


def train_batches(config: Config, parallel: Parallel, data: PreparedData) -> TrainBatches:
    """This rank's training batches: each data-parallel rank takes its share of the global batch, the ranks of a TP
    group share theirs (the layout's checks passed: the batch splits over its ranks and micro-batches). The split
    lives on the training device, where each batch is then gathered: no host work or copy per step, for a few MiB
    (WikiText-2's train split in int32 on a GPU)."""
    global_batch, micro_batch = config.batch.sizes(parallel.dims.dp_size)
    batches = TrainBatches(
        tokens=data.splits["train"].to(parallel.env.device),
        seq_len=config.data.seq_len,
        stride=config.data.stride or config.data.seq_len,
        global_batch=global_batch,
        micro_batch=micro_batch,
        rank=parallel.dp_rank,
        world_size=parallel.dims.dp_size,
        seed=config.seed,
    )
    return batches


class TrainerBase:
    """What every engine of the loop shares (this module's Trainer, scalelm.train.lightning_engine's): the run's
    settings and steps, the model with the seed's initial weights and each rank's dropout streams, AdamW and its
    schedule, the checkpoints and the state resumed from them, the metrics, the measurements (`instruments`), the hang
    watchdog, the stop flag, the exact evaluation and the results run.json records. `build` makes the model (after
    determinism is set, before the dropout streams)."""

    def __init__(self, config: Config, env: DistEnv, parallel: Parallel, data: PreparedData, batches: TrainBatches,
                 staging: Staged, build: Callable[[], nn.Module]):  # fmt: skip
        self.config, self.env, self.parallel, self.data, self.batches = config, env, parallel, data, batches
        self.staging = staging
        self.run_dir = RunDir(Path(config.run_dir))

        self.tokens_per_step = self.batches.global_batch * config.data.seq_len
        self.total_steps = total_steps(config, batches)

        if config.train.deterministic:
            torch.use_deterministic_algorithms(True)
        self.shape = model_shape(config, data.vocab_size)
        self.model = build()
        torch.manual_seed(seeds.dropout(config.seed, parallel.dp_rank))
        lr = scaled_lr(config.optim, config.batch, parallel.dims.dp_size)
        self.optimizer = build_optimizer(self.model, config.optim, lr, compiled=config.train.compile_optimizer)
        self.scheduler = build_scheduler(self.optimizer, config.optim, self.total_steps)

        run_origin = origin(config, identity(config, data.checksums(), env.world_size), batches)
        self.checkpointer = Checkpointer(self.run_dir.checkpoints, env, config.checkpoint.keep, run_origin)
        resumed = self.checkpointer.resume(self.model, self.optimizer, self.scheduler, self.shape)
        if resumed and not self.checkpointer.rng_restored:  # saved by another world size: fresh, distinct streams
            torch.manual_seed(seeds.dropout_after_resume(resumed.step, parallel.dp_rank))
        self.state = resumed or TrainerState(model_shape=self.shape, energy_j=0.0)
        wandb = None
        if config.train.wandb and env.is_main:
            group = f"{self.run_dir.experiment}/{self.run_dir.path.name}"  # an experiment's seed, all its attempts
            wandb = WandbRun(self.run_dir.wandb, group, config.to_dict())
        self.metrics = MetricsLogger(
            self.run_dir.metrics,
            env.is_main,
            resumed.step if resumed else 0,  # afresh: an attempt before that saved no checkpoint logged in vain
            self.run_dir.tensorboard,
            wandb,
            evaluations_redone=resumed is not None and resumed.step == self.total_steps,
        )
        if resumed and env.is_main:
            print(f"resumed from step {resumed.step} (epoch {resumed.epoch}) in {self.checkpointer.latest_path}")
        self.last_loss = math.nan
        self.stop = StopFlag()
        workload = Workload(config, data.vocab_size, env.device.type)
        self.instruments = Instruments(
            config, env, parallel, pipeline_of(self.model), workload, self.total_steps, self.state.step
        )
        self.watchdog = Watchdog.for_job(env.rank, self.run_dir.autopsy, config.train.hang_factor,
                                         config.train.hang_floor_s)  # fmt: skip

    def close(self) -> None:
        self.watchdog.close()
        self.metrics.close()

    def evaluate_split(self, split: str) -> dict[str, Any]:
        result = evaluate(
            self.model,
            self.data.splits[split],
            self.config.data.seq_len,
            self.config.train.eval_batch_size,
            self.env.device,
            self.parallel,
            should_stop=self.stop.raised,
            max_tokens=self.config.train.eval_batch_tokens,
        )
        self.metrics.log({"kind": "eval", "split": split, "step": self.state.step, "epoch": self.state.epoch, **result})
        return result

    def results(self, validation, test, checkpoint: Path, **measured) -> Results:
        """run.json's results at the end: the run's progress and losses, and what the engine `measured`."""
        state = self.state
        return Results(
            **measured,
            strategy=self.parallel.name,
            layout=self.parallel.dims.layout,
            steps=state.step,
            epochs_completed=state.epoch,
            tokens_seen=state.tokens_seen,
            global_batch=self.batches.global_batch,
            tokens_per_step=self.tokens_per_step,
            train_time_s=state.train_seconds,
            tokens_per_s=state.tokens_seen / state.train_seconds if state.train_seconds else None,
            final_train_loss=self.last_loss,
            validation=validation,
            test=test,
            checkpoint=str(checkpoint),
            staging=self.staging.record(),
        )


class Trainer(TrainerBase):
    def __init__(self, config: Config, env: DistEnv, parallel: Parallel, data: PreparedData, batches: TrainBatches,
                 staging: Staged | None = None):  # fmt: skip
        # the initial weights of a single process with this seed, whatever the layout
        build = lambda: parallel.build(lambda: TransformerLM(config.model, data.vocab_size), config.seed)  # noqa: E731
        super().__init__(config, env, parallel, data, batches, staging or Staged(data.path), build)
        self.optimizer_step = optimizer_step(self.optimizer, config.train.compile_optimizer)

    # ------------------------------------------------------------------------------------------- steps
    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over this rank's micro-batches: the step's mean loss on this rank, and the gradient's
        global norm (before clipping)."""
        loss_sum = torch.zeros((), device=self.env.device)
        step = self.state.step + 1
        for i, (inputs, targets) in enumerate(micro_batches):
            inputs = inputs.to(self.env.device, non_blocking=True)
            targets = targets.to(self.env.device, non_blocking=True)
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last else self.parallel.no_sync(self.model), self.parallel.loss_context():
                loss_sum += self.parallel.forward_backward(self.model, inputs, targets, 1 / len(micro_batches), step)
        grad_norm = self.parallel.clip_grad_norm(self.model, self.config.optim.grad_clip)
        self.optimizer_step()
        self.scheduler.step()
        self.instruments.note_state(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm

    def fit(self) -> RunRecord:
        config, env, state, dims = self.config, self.env, self.state, self.parallel.dims
        if env.is_main:
            dump_config(config, self.run_dir.config)
            print(
                f"training {self.parallel.name} ({' x '.join(dims.written_degrees)} = {dims.layout}) "
                f"on {env.world_size} x {env.device.type}: "
                f"{self.total_steps} steps ({self.batches.steps_per_epoch}/epoch), global batch "
                f"{self.batches.global_batch} x {config.data.seq_len} tokens, accumulation {self.batches.accumulation}",
                flush=True,
            )
        where = provenance.collect(config.to_dict(), env.world_size)
        clock = Stopwatch(env.device)  # training time only: evaluation and checkpoints run with the clock paused
        self.instruments.start()
        loss_acc, steps_acc = torch.zeros((), device=env.device), 0
        validation = None  # the last step's
        remaining = itertools.islice(
            self.batches.from_position(state.epoch, state.step_in_epoch), self.total_steps - state.step
        )
        try:
            for micro_batches in self.instruments.batches(remaining):
                with self.watchdog.watching(state.step + 1), self.instruments.step(state.step + 1):
                    loss, grad_norm = self.train_step(micro_batches)
                loss_acc += loss
                steps_acc += 1
                epoch_ended = state.advance(self.tokens_per_step, self.batches.steps_per_epoch)
                last = state.step == self.total_steps
                if last or due(state.step, config.train.log_every):
                    self.log_train(loss_acc, grad_norm, steps_acc, clock.lap())
                    loss_acc.zero_()
                    steps_acc = 0
                    reset_peak_memory(env.device)  # each interval's peak is its own
                with clock.paused(), self.instruments.paused():
                    if last or epoch_ended or due(state.step, config.train.eval_every):
                        validation = self.evaluate_split("validation")
                    if epoch_ended or due(state.step, config.checkpoint.every):
                        self.save(loss_acc)
                if self.stop.raised():
                    raise StopRequested("stop signal during training")
            if validation is None:  # resumed after the last step
                validation = self.evaluate_split("validation")
            test = self.evaluate_split("test")
            self.stop.close()
        except StopRequested:  # every rank agreed: between steps or between evaluation batches
            with clock.paused(), self.instruments.paused():
                path = self.save(loss_acc)
            raise Preempted(f"stopped by a signal at step {state.step}; checkpoint {path}; rerun to resume") from None
        checkpoint = self.save(loss_acc)
        return self.finish(where, clock, validation, test, checkpoint)

    # --------------------------------------------------------------------------------- bookkeeping
    def log_train(self, loss_acc: torch.Tensor, grad_norm: torch.Tensor, steps: int, elapsed: float) -> None:
        """Average the interval's loss over steps and ranks (the gradient norm: its last step's); the only
        host-device sync of the hot loop."""
        values = torch.stack([loss_acc / steps, grad_norm.detach().float().to(loss_acc.device)])
        # every rank holds the same gradient norm; the loss only on those that compute it (a pipeline's last stage)
        divisors = torch.tensor([self.parallel.loss_ranks, self.env.world_size], device=values.device)
        values = global_reduce(values) / divisors
        interval = self.instruments.interval(self.state.step - steps + 1, self.state.step, elapsed,
                                             steps * self.tokens_per_step)  # fmt: skip
        loss, grad_norm = values.tolist()
        if not math.isfinite(loss):
            bad = ranks_where(~loss_acc.isfinite(), self.env)
            raise TrainingError(
                f"non-finite training loss ({loss}) at step {self.state.step} on rank(s) {bad}; the last good "
                f"checkpoint stays in {self.checkpointer.directory}. Lower optim.lr or set optim.grad_clip"
            )
        self.state.spent(elapsed, interval["energy_j"])
        self.last_loss = loss
        step_time = elapsed / steps
        self.metrics.log(
            {
                "kind": "train",
                "step": self.state.step,
                "epoch": self.state.epoch,
                "tokens": self.state.tokens_seen,
                "loss": loss,
                "lr": self.scheduler.get_last_lr()[0],
                "grad_norm": grad_norm,
                "step_time_s": step_time,
                "tokens_per_s": self.tokens_per_step / step_time,
                "tokens_per_s_per_device": self.tokens_per_step / step_time / self.env.world_size,
                "mfu": self.instruments.mfu(self.tokens_per_step / step_time),
                **interval,
                "global_batch": self.batches.global_batch,
                "tokens_per_step": self.tokens_per_step,
                "world_size": self.env.world_size,
            }
        )

    def save(self, pending_loss: torch.Tensor) -> Path:
        """A checkpoint of this step, once (the last step's is asked for at the end, and maybe at its epoch's end
        or on a stop signal)."""
        if self.checkpointer.latest_step != self.state.step:
            self.checkpointer.save(self.model, self.optimizer, self.scheduler, self.state, pending_loss)
        return self.checkpointer.latest_path

    def finish(self, where: dict[str, Any], clock: Stopwatch, validation, test, checkpoint: Path) -> RunRecord:
        """run.json (written by rank 0; a collective): `where` (scalelm.train.provenance) and the results."""
        state = self.state
        record = RunRecord(
            **where,
            end_time=provenance.now(),
            wall_time_s=clock.wall(),
            host_load=self.instruments.host_loads(),
            parallel=self.parallel.describe(self.model),
            results=self.results(
                validation,
                test,
                checkpoint,
                **self.instruments.results(state.tokens_seen, state.train_seconds, state.energy_j),
            ),  # fmt: skip
        )
        if self.env.is_main:
            write_record(self.run_dir.path, record)
        return record


def run(config: Config) -> RunRecord:
    # Compute nodes have no internet: never let a library try it (and wait for its retries).
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
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


def engine(config: Config) -> type:
    """What runs the loop (train.engine): this module's Trainer, or Lightning's (same interface: fit, close)."""
    if config.train.engine == "lightning":
        from scalelm.train.lightning_engine import LightningTrainer, require_lightning

        require_lightning()
        return LightningTrainer
    return Trainer


def train_from(config: Config, env: DistEnv, staging: Staged) -> RunRecord:
    """`run`'s training, from the prepared data where `staging` put it (removed when this returns or fails)."""
    # Everything that can be refused is refused before the run directory is touched: the data, the layout against
    # the world and the data, the batch against both.
    make_trainer = engine(config)
    check_lock()  # the lock SCALELM_LOCK names, read for the record at the end: refused now, not then
    data = load_prepared(staging.path)
    parallel = Parallel.start(config, env, data.vocab_size)
    batches = train_batches(config, parallel, data)
    run_dir = RunDir(Path(config.run_dir))
    with run_dir.lock() if env.is_main else contextlib.nullcontext(), disk_errors(run_dir.path):
        run_identity = identity(config, data.checksums(), env.world_size)
        if env.is_main:
            run_dir.start(run_identity)
        barrier()
        finished = finished_before(run_dir, origin(config, run_identity, batches)) if env.is_main else None
        finished = all_gather_object(finished)[0]  # rank 0's answer, on every rank
        if finished is not None:
            return finished
        trainer = make_trainer(config, env, parallel, data, batches, staging)
        with Monitor(run_dir.monitor, env, config.train.monitor_interval_s, run_dir.tensorboard):
            try:
                record = trainer.fit()
            finally:
                trainer.close()
        barrier()  # every rank done with every collective before any shuts its process groups down
    return record


def finished_before(run_dir: RunDir, run_origin: Origin) -> RunRecord | None:
    """The record this attempt kept when it finished, if its latest checkpoint is still the one it finished at:
    then run.json is restored as it was written (its provenance, its results) and nothing is trained or evaluated,
    as when the run is rerun for settings outside its identity (staging, logging) after Snakemake removed run.json.
    A run whose last checkpoint is damaged, or whose record was not kept, resumes as any other."""
    record = read_finished(run_dir.path)
    if record is None or record.results.checkpoint is None or record.results.steps != run_origin.steps:
        return None
    found = complete_checkpoints(run_dir.checkpoints)
    if not found or found[-1].name != Path(record.results.checkpoint).name or verify(found[-1]) is not None:
        return None
    check_origin(found[-1], read_trainer(found[-1]), run_origin)
    restore_record(run_dir.path)
    print(
        f"the run in {run_dir.path} finished at step {record.results.steps} (checkpoint {found[-1]}): nothing to train "
        f"or evaluate; {run_dir.record} restored as it finished",
        flush=True,
    )
    return record


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalelm.train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, help="YAML file of settings (defaults: the course's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    parser.add_argument("--run-dir", help="shorthand for --set run_dir=DIR")
    args = parser.parse_args(argv)
    overrides = args.set + ([f"run_dir={args.run_dir}"] if args.run_dir else [])
    run(load_config(args.config, overrides))


if __name__ == "__main__":
    main()
