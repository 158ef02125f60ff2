"""What every engine of the training loop shares (`Engine`): scalelm's own loop (scalelm.train.trainer) and
Lightning's (scalelm.train.lightning_engine) differ only in how they run a step.

The base builds the run (the model with the seed's initial weights on the layout, each rank's dropout streams, AdamW
and its schedule, the checkpoints and the state resumed from them, the metrics, the measurements, the hang watchdog,
the stop flag) and owns what happens around the steps: `fit` runs the engine's `train_steps`, which call
`after_step` once per optimizer step, where each component says when it is due: the loss interval its log line (with
its finite check), the validator its evaluation, the checkpointer its checkpoint (`save`, which refuses non-finite
weights); a stop signal ends the steps at the next one with a checkpoint; the exact evaluation and run.json
(`finish`) close the run.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from scalelm import seeds
from scalelm.config import Config, Devices, dump_config
from scalelm.data.prepared import PreparedData
from scalelm.data.stage import Staged
from scalelm.data.windows import TrainBatches
from scalelm.errors import ScaleLMError
from scalelm.hang.watchdog import Watchdog
from scalelm.measure.device import Stopwatch, reset_peak_memory
from scalelm.measure.experts import ExpertLoad
from scalelm.measure.instruments import Instruments
from scalelm.model.architecture import parameter_counts
from scalelm.model.transformer import TransformerLM
from scalelm.optim import build_optimizer, build_scheduler, scaled_lr
from scalelm.parallel.env import DistEnv, global_reduce
from scalelm.parallel.runtime import ModelOptions, Parallel, pipeline_of
from scalelm.plan.memory import Workload
from scalelm.train import provenance
from scalelm.train.checkpoint import Checkpointer, Origin, TrainerState, model_shape, ranks_where
from scalelm.train.evaluation import Validator
from scalelm.train.metrics import MetricsLogger
from scalelm.train.preemption import Preempted, StopFlag, StopRequested
from scalelm.train.record import Results, RunRecord, write_record
from scalelm.train.rundir import RunDir, identity, lineage
from scalelm.train.wandb_offline import WandbRun


class TrainingError(ScaleLMError):
    pass


def overflow_settings(config: Config) -> str:
    """What a run whose loss, weights or gradients overflow may lower: optim.lr, and each router loss weight that adds
    a loss to the training loss (model.moe), with its value."""
    weights = config.model.moe.loss_weights() if config.model.moe is not None else {}
    return ", or ".join(["optim.lr", *(f"model.moe.{key} ({weight})" for key, weight in weights.items())])


def total_steps(config: Config, batches: TrainBatches) -> int:
    """The run's optimizer steps: its epochs', or train.max_steps where fewer."""
    total = config.train.epochs * batches.steps_per_epoch
    return min(total, config.train.max_steps) if config.train.max_steps else total


def origin(
    config: Config, run_identity: dict[str, Any], batches: TrainBatches, run_dir: RunDir, here: Devices
) -> Origin:
    """What this run's checkpoints record of it, and what it expects of those it resumes."""
    steps, accepts = total_steps(config, batches), run_dir.lineages(run_identity, here)
    return Origin(seed=config.seed, lineage=lineage(run_identity), steps=steps, accepts=accepts)


def train_batches(config: Config, parallel: Parallel, data: PreparedData) -> TrainBatches:
    """This rank's training batches: each data-parallel rank takes its share of the global batch, the ranks of a TP
    group share theirs (the layout's checks passed: the batch splits over its ranks and micro-batches). The split
    lives on the training device, where each batch is then gathered: no host work or copy per step, for a few MiB
    (WikiText-2's train split in int32 on a GPU)."""
    global_batch, micro_batch = config.batch.sizes(parallel.dims.dp_size)
    return TrainBatches(
        tokens=data.splits["train"].to(parallel.env.device),
        seq_len=config.data.seq_len,
        stride=config.data.stride or config.data.seq_len,
        global_batch=global_batch,
        micro_batch=micro_batch,
        rank=parallel.dp_rank,
        world_size=parallel.dims.dp_size,
        seed=config.seed,
    )


class LossInterval:
    """The steps since the last logged line, kept on the device so that no step waits on the host: their summed loss,
    their count, and how many had a non-finite gradient norm (a loss that overflows only in its gradients); the mean
    loss of the last line logged; and when a line is due (every `log_every` steps, and at the last)."""

    def __init__(self, device: torch.device, log_every: int, total_steps: int):
        self.loss_sum = torch.zeros((), device=device)
        self.steps = 0
        self.nonfinite_norms = torch.zeros((), device=device)
        self.last_loss = math.nan
        self.log_every, self.total_steps = log_every, total_steps

    def due(self, step: int) -> bool:
        return step == self.total_steps or step % self.log_every == 0

    def add(self, step_loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.loss_sum += step_loss
        self.steps += 1
        self.nonfinite_norms += ~grad_norm.detach().isfinite().to(self.nonfinite_norms.device)

    def values(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """This rank's mean loss, the last step's gradient norm and the count of non-finite norms, to reduce."""
        norm_now = grad_norm.detach().float().to(self.loss_sum.device)
        return torch.stack([self.loss_sum / self.steps, norm_now, self.nonfinite_norms])

    def logged(self, loss: float) -> None:
        """The interval's line is out (its mean loss over the ranks `loss`): the next interval starts."""
        self.loss_sum.zero_()
        self.nonfinite_norms.zero_()
        self.steps = 0
        self.last_loss = loss


class Engine:
    """The run an engine trains, and what happens around its steps (module docstring). A subclass runs the steps
    (`train_steps`, calling `after_step` after each); `wraps_replicas`: the engine wraps DDP's replicas itself."""

    label = ""  # how the engine names itself in the log and in run.json's layout, beside scalelm's own
    wraps_replicas = False

    def __init__(
        self,
        config: Config,
        env: DistEnv,
        parallel: Parallel,
        data: PreparedData,
        batches: TrainBatches,
        staging: Staged | None = None,
    ):
        self.config, self.env, self.parallel, self.data, self.batches = config, env, parallel, data, batches
        self.staging = staging or Staged(data.path)
        self.run_dir = RunDir(Path(config.run_dir))
        self.tokens_per_step = batches.global_batch * config.data.seq_len
        self.total_steps = total_steps(config, batches)

        if config.train.deterministic:
            torch.use_deterministic_algorithms(True)
        self.shape = model_shape(config, data.vocab_size)
        # the initial weights of a single process with this seed, whatever the layout
        make = lambda: TransformerLM(config.model, data.vocab_size)
        options = ModelOptions.of(config.train)
        self.model = parallel.build(make, config.seed, options, replicate=not self.wraps_replicas)
        torch.manual_seed(seeds.dropout(config.seed, parallel.dp_rank))
        lr = scaled_lr(config.optim, config.batch, parallel.dims.dp_size)
        self.optimizer = build_optimizer(self.model, config.optim, lr, compiled=config.train.compile_optimizer)
        self.scheduler = build_scheduler(self.optimizer, config.optim, self.total_steps)

        run_identity = identity(config, data.checksums(), env.world_size, env.here)
        run_origin = origin(config, run_identity, batches, self.run_dir, env.here)
        checkpoints = config.checkpoint
        self.checkpointer = Checkpointer(
            self.run_dir.checkpoints, env, checkpoints.keep, run_origin, checkpoints.every, overflow_settings(config)
        )
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
        self.stop = StopFlag()
        self.validator = Validator(
            self.model,
            data,
            config.train,
            config.data.seq_len,
            env.device,
            parallel,
            self.stop.raised,
            self.total_steps,
        )
        workload = Workload(config, data.vocab_size, env.device.type)
        self.instruments = Instruments(
            config, env, parallel, pipeline_of(self.model), workload, self.total_steps, self.state.step
        )
        if config.model.moe is not None and self.state.experts is None:
            self.state.experts = {}  # the run's totals, checkpointed with the state
        self.experts = ExpertLoad.of(self.model, config.model, parallel.dims.tp, self.state.experts)  # None: dense
        train = config.train
        self.watchdog = Watchdog.for_job(env.rank, self.run_dir.autopsy, train.hang_factor, train.hang_floor_s)
        self.interval = LossInterval(env.device, config.train.log_every, self.total_steps)
        self.validation: dict[str, Any] | None = None  # the last step's
        self.stop_requested = False

    def close(self) -> None:
        self.watchdog.close()
        self.metrics.close()

    # ------------------------------------------------------------------------------------------ the run
    def train_steps(self) -> None:
        """Run the remaining steps (`remaining_steps`), calling `after_step` after each; return early when it says
        stop."""
        raise NotImplementedError

    def fit(self) -> RunRecord:
        config, env, dims = self.config, self.env, self.parallel.dims
        if env.is_main:
            dump_config(config, self.run_dir.config)
            engine = f" with {self.label}" if self.label else ""
            print(
                f"training {self.parallel.name}{engine} ({' x '.join(dims.written_degrees)} = {dims.layout}) on "
                f"{env.world_size} x {env.device.type}: {self.total_steps} steps ({self.batches.steps_per_epoch}"
                f"/epoch), global batch {self.batches.global_batch} x {config.data.seq_len} tokens, accumulation "
                f"{self.batches.accumulation}",
                flush=True,
            )
        facts = provenance.collect(config.to_dict(), env.world_size, env.is_main)
        self.clock = Stopwatch(env.device)  # training time only: evaluation and checkpoints run with the clock paused
        self.instruments.start()
        try:
            if self.state.step < self.total_steps:
                self.train_steps()
            if self.stop_requested:
                raise StopRequested("stop signal during training")
            if self.validation is None:  # resumed after the last step
                self.validation = self.evaluate_split("validation")
            test = self.evaluate_split("test")
            self.stop.close()
        except StopRequested:  # every rank agreed: between steps or between evaluation batches
            with self.clock.paused(), self.instruments.paused():
                path = self.save()
            raise Preempted(
                f"stopped by a signal at step {self.state.step}; checkpoint {path}; rerun to resume"
            ) from None
        return self.finish(facts, test, self.save())

    def remaining_steps(self) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        """The micro-batches of every step left, from where the run stands, measured for their data time."""
        state = self.state
        steps = self.batches.from_position(state.epoch, state.step_in_epoch)
        return self.instruments.batches(itertools.islice(steps, self.total_steps - state.step))

    @contextlib.contextmanager
    def watched_step(self) -> Iterator[None]:
        """Around one optimizer step: the hang watchdog, and the instruments' timing of it."""
        step = self.state.step + 1
        with self.watchdog.watching(step), self.instruments.step(step):
            yield

    def after_step(self, step_loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """After each optimizer step, on every rank: the step counted, then logged, validated and checkpointed as
        each of them says it is due; True if the ranks agreed to stop (a signal, now or during the validation)."""
        state = self.state
        self.interval.add(step_loss, grad_norm)
        if self.experts is not None:
            self.experts.end_step(self.env.device)
        epoch_ended = state.advance(self.tokens_per_step, self.batches.steps_per_epoch)
        if self.interval.due(state.step):
            self.log_train(grad_norm, self.clock.lap())
        try:
            with self.clock.paused(), self.instruments.paused():
                if self.validator.due(state.step, epoch_ended):
                    self.validation = self.evaluate_split("validation")
                if self.checkpointer.due(state.step, epoch_ended):
                    self.save()
            self.stop_requested = self.stop.raised()
        except StopRequested:
            self.stop_requested = True
        return self.stop_requested

    # --------------------------------------------------------------------------------- bookkeeping
    def log_train(self, grad_norm: torch.Tensor, elapsed: float) -> None:
        """The interval's line: its loss averaged over steps and ranks (the gradient norm: its last step's), and a
        mixture of experts' aux loss and load balance, summed over the ranks in the same reduction; the only
        host-device sync of the hot loop. A non-finite loss, or a non-finite gradient norm at any step of the interval
        (a loss that overflows only in its gradients), stops the run, the last good checkpoint kept."""
        steps = self.interval.steps
        values = self.interval.values(grad_norm)
        if self.experts is not None:  # the mixtures' counts ride in the same reduction
            values = torch.cat([values, self.experts.take(values.device)])
        summed = global_reduce(values)
        # every rank holds the same gradient norm; the loss only on those that compute it (a pipeline's last stage)
        world = self.env.world_size
        divisors = torch.tensor([self.parallel.loss_ranks, world, world], device=values.device)
        loss, norm, nonfinite_norms = (summed[:3] / divisors).tolist()
        experts = self.experts.interval(summed[3:].tolist()) if self.experts is not None else {}
        kept, lower = self.checkpointer.kept(), self.checkpointer.lower
        if not math.isfinite(loss):
            bad = ranks_where(~self.interval.loss_sum.isfinite(), self.env)
            raise TrainingError(
                f"non-finite training loss ({loss}) at step {self.state.step} on rank(s) {bad}; {kept}. Lower "
                f"{lower} or set optim.grad_clip"
            )
        if nonfinite_norms:
            raise TrainingError(
                f"non-finite gradient norm at {round(nonfinite_norms)} of the {steps} steps up to step "
                f"{self.state.step} (the last: {norm}): the gradients overflow; {kept}. Lower {lower}"
            )
        self.interval.logged(loss)
        state = self.state
        interval = self.instruments.interval(state.step - steps + 1, state.step, elapsed, steps * self.tokens_per_step)
        reset_peak_memory(self.env.device)  # each interval's peak is its own
        state.spent(elapsed, interval["energy_j"])
        step_time = elapsed / steps
        self.metrics.log(
            {
                "kind": "train",
                "step": state.step,
                "epoch": state.epoch,
                "tokens": state.tokens_seen,
                "loss": loss,
                "lr": self.scheduler.get_last_lr()[0],
                "grad_norm": norm,
                "step_time_s": step_time,
                "tokens_per_s": self.tokens_per_step / step_time,
                "tokens_per_s_per_device": self.tokens_per_step / step_time / self.env.world_size,
                "mfu": self.instruments.mfu(self.tokens_per_step / step_time),
                **experts,  # a mixture of experts' aux loss and load balance (scalelm.measure.experts)
                **interval,
                "global_batch": self.batches.global_batch,
                "tokens_per_step": self.tokens_per_step,
                "world_size": self.env.world_size,
            }
        )

    def evaluate_split(self, split: str) -> dict[str, Any]:
        result = self.validator.evaluate(split)
        self.metrics.log({"kind": "eval", "split": split, "step": self.state.step, "epoch": self.state.epoch, **result})
        return result

    def save(self) -> Path:
        """A checkpoint of this step, once (the last step's is asked for at the end, and maybe at its epoch's end or
        on a stop signal); Checkpointer.save refuses non-finite weights or a non-finite loss not yet logged."""
        if self.checkpointer.latest_step != self.state.step:
            self.checkpointer.save(self.model, self.optimizer, self.scheduler, self.state, self.interval.loss_sum)
        return self.checkpointer.latest_path

    def finish(self, facts: dict[str, Any], test: dict[str, Any], checkpoint: Path) -> RunRecord:
        """run.json (written by rank 0; a collective): the provenance `facts` (scalelm.train.provenance) and the
        results."""
        state = self.state
        measured = self.instruments.results(state.tokens_seen, state.train_seconds, state.energy_j)
        results = Results(
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
            final_train_loss=self.interval.last_loss,
            validation=self.validation,
            test=test,
            checkpoint=str(checkpoint),
            staging=self.staging.record(),
            parameters=parameter_counts(self.config.model, self.data.vocab_size),
            experts=self.experts.results() if self.experts is not None else None,
        )
        parallel = self.parallel.describe(self.model)
        record = RunRecord(
            **facts,
            end_time=provenance.now(),
            wall_time_s=self.clock.wall(),
            host_load=self.instruments.host_loads(),
            parallel={**parallel, "engine": self.label} if self.label else parallel,
            results=results,
        )
        if self.env.is_main:
            write_record(self.run_dir.path, record)
        return record
