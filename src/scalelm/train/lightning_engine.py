"""`train.engine: lightning`: the same model, data order, optimizer and records as scalelm's trainer, trained by
PyTorch Lightning's Trainer with its DDP strategy (`pip install 'scalelm[lightning]'`).

scalelm's launcher starts the processes (torchrun, under Slurm inside the job step with scalelm's supervisor), so
Lightning takes the world from torchrun's environment (TorchElasticEnvironment: devices = LOCAL_WORLD_SIZE, nodes =
WORLD_SIZE / LOCAL_WORLD_SIZE) and joins the process group scalelm.parallel.env.setup already started. Lightning's
SLURMEnvironment does not apply: it expects srun to start every process as a task of its own and requeues the job
itself, where here torchrun starts them and the supervisor handles Slurm's signal. A stop signal is handled as the
scalelm trainer does: the ranks agree on it after a step (StopFlag), save a checkpoint and exit with EXIT_PREEMPTED;
rerunning the same command resumes from it.

What Lightning drives is the loop: forward and backward (its DDP wrapper, its precision plugin), the optimizer step
and gradient accumulation. What scalelm keeps is everything the report compares: the initial weights of the run's
seed, each data-parallel rank's TrainBatches (same permutations, same share, same micro-batches), AdamW and its
schedule (scalelm.train.optim), clipping to the global norm, checkpoints (scalelm.train.checkpoint, so the workflow's
consolidate turns the last one into the same model.pt), the exact evaluation, metrics.jsonl and run.json.

So that `ddp_lightning` and `ddp` differ in the loop only, the model Lightning trains is scalelm's: activation
checkpointing and compilation (train.activation_checkpointing, train.compile) applied as scalelm's trainer applies
them, before the DDP wrapper, and that wrapper has scalelm's DDP options (DDP_OPTIONS). Each optimizer step runs
under the hang watchdog (scalelm.train.watchdog) and is measured by the same Instruments (MFU, energy, memory, data
time, the communication profile of the last steps).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any

import torch

from scalelm.config import dump_config, resolve_precision
from scalelm.errors import ConfigError
from scalelm.model.transformer import TransformerLM
from scalelm.parallel.data import DDP_OPTIONS  # Lightning's defaults would make `ddp_lightning` measure other terms
from scalelm.parallel.env import backend_for, global_reduce
from scalelm.train import provenance
from scalelm.train.metrics import Stopwatch, reset_peak_memory
from scalelm.train.preemption import Preempted, StopRequested
from scalelm.train.record import RunRecord, write_record
from scalelm.train.trainer import TrainerBase, TrainingError, due

PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed"}


def require_lightning():
    try:
        import lightning
    except ImportError:
        raise ConfigError("train.engine=lightning needs the optional extra: pip install 'scalelm[lightning]'") from None
    return lightning


class LightningTrainer(TrainerBase):
    """The scalelm Trainer's interface (`fit`, `close`) over lightning.Trainer; built on every rank."""

    def __init__(self, config, env, parallel, data, batches, staging):
        self.L = require_lightning()

        def build() -> torch.nn.Module:  # the initial weights of a single process with this seed
            torch.manual_seed(config.seed)
            model = TransformerLM(config.model, data.vocab_size).to(env.device)
            parallel.apply_recompute_and_compile(model)  # scalelm's order: checkpointing, compile, then DDP
            return model

        super().__init__(config, env, parallel, data, batches, staging, build)
        self.in_step: contextlib.ExitStack | None = None  # the running optimizer step's watchdog and instruments
        self.validation: dict[str, Any] | None = None
        self.preempted = False

    # -------------------------------------------------------------------------------------- the loop
    def micro_batches(self):
        """This rank's micro-batches of every remaining step, one after the other: Lightning accumulates them."""
        state = self.state
        steps = itertools.islice(self.batches.from_position(state.epoch, state.step_in_epoch),
                                 self.total_steps - state.step)  # fmt: skip
        for step in steps:
            yield from step

    def lightning_trainer(self):
        from lightning.pytorch.plugins.environments import LightningEnvironment, TorchElasticEnvironment
        from lightning.pytorch.strategies import SingleDeviceStrategy

        env = self.env
        # torchrun's world, never Slurm's: torchrun started these processes inside the job step (module docstring)
        environment: Any = LightningEnvironment()
        strategy: Any = SingleDeviceStrategy(device=env.device)
        if env.world_size > 1:  # joins the process group scalelm.parallel.env.setup started
            environment, strategy = TorchElasticEnvironment(), ddp_strategy(env.device)
        return self.L.Trainer(
            accelerator="gpu" if env.device.type == "cuda" else "cpu",
            devices=env.procs_per_node,
            num_nodes=env.world_size // env.procs_per_node,
            strategy=strategy,
            precision=PRECISION[resolve_precision(self.config.train.precision, env.device.type)],
            max_epochs=1,  # one pass over `micro_batches`, which holds every remaining step, epoch after epoch
            max_steps=self.total_steps - self.state.step,
            accumulate_grad_batches=self.batches.accumulation,
            plugins=[environment],
            callbacks=[Bookkeeping(self)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            use_distributed_sampler=False,
            deterministic=self.config.train.deterministic,
            default_root_dir=str(self.run_dir.path),
        )

    def fit(self) -> RunRecord:
        config, env = self.config, self.env
        if env.is_main:
            dump_config(config, self.run_dir.config)
            print(f"training {self.parallel.name} with lightning {self.L.__version__} ({self.parallel.dims.layout}) "
                  f"on {env.world_size} x {env.device.type}: {self.total_steps} steps", flush=True)  # fmt: skip
        self.where = provenance.collect(config.to_dict(), env.world_size)
        self.clock = Stopwatch(env.device)
        self.instruments.start()
        self.loss_acc, self.steps_acc = torch.zeros((), device=env.device), 0
        if self.state.step < self.total_steps:
            batches = self.instruments.batches(self.micro_batches())
            self.lightning_trainer().fit(Module(self), train_dataloaders=batches)
        try:
            if self.preempted:
                raise StopRequested("stop signal during training")
            if self.validation is None:  # resumed after the last step
                self.validation = self.evaluate_split("validation")
            test = self.evaluate_split("test")
            self.stop.close()
        except StopRequested:
            with self.clock.paused(), self.instruments.paused():
                path = self.save()
            raise Preempted(
                f"stopped by a signal at step {self.state.step}; checkpoint {path}; rerun to resume"
            ) from None
        return self.finish(test, self.save())

    def begin_step(self) -> None:
        """Before each micro-batch: the first of an optimizer step starts it under the watchdog and the
        instruments, as scalelm's trainer runs its `train_step`."""
        if self.in_step is None:
            self.in_step = contextlib.ExitStack()
            self.in_step.enter_context(self.watchdog.watching(self.state.step + 1))
            self.in_step.enter_context(self.instruments.step(self.state.step + 1))

    def end_step(self, error: BaseException | None = None) -> None:
        """After the optimizer step (or the `error` that ended it): the step is no longer watched or measured."""
        in_step, self.in_step = self.in_step, None
        if in_step is not None and error is None:
            in_step.close()
        elif in_step is not None:  # the watchdog leaves a step that raised unwatched, as scalelm's loop does
            in_step.__exit__(type(error), error, error.__traceback__)

    def after_step(self, trainer, grad_norm: torch.Tensor) -> None:
        """Bookkeeping after each optimizer step, on every rank: logs, evaluations, checkpoints, the stop flag."""
        self.end_step()
        config, state = self.config, self.state
        epoch_ended = state.advance(self.tokens_per_step, self.batches.steps_per_epoch)
        last = state.step == self.total_steps
        if last or due(state.step, config.train.log_every):
            self.log_train(grad_norm, self.clock.lap())
        try:
            with self.clock.paused(), self.instruments.paused():
                if last or epoch_ended or due(state.step, config.train.eval_every):
                    self.validation = self.evaluate_split("validation")
                if epoch_ended or due(state.step, config.checkpoint.every):
                    self.save()
            self.preempted = self.stop.raised()
        except StopRequested:  # every rank agreed, between evaluation batches
            self.preempted = True
        if self.preempted:
            trainer.should_stop = True

    def log_train(self, grad_norm: torch.Tensor, elapsed: float) -> None:
        values = torch.stack([self.loss_acc / self.steps_acc, grad_norm.detach().float().to(self.env.device)])
        loss, norm = (global_reduce(values) / self.env.world_size).tolist()
        steps = self.steps_acc
        self.loss_acc.zero_()
        self.steps_acc = 0
        interval = self.instruments.interval(self.state.step - steps + 1, self.state.step, elapsed,
                                             steps * self.tokens_per_step)  # fmt: skip
        if not math.isfinite(loss):
            raise TrainingError(
                f"non-finite training loss ({loss}) at step {self.state.step}; the last good checkpoint stays in "
                f"{self.checkpointer.directory}. Lower optim.lr or set optim.grad_clip"
            )
        self.state.spent(elapsed, interval["energy_j"])
        self.last_loss = loss
        step_time = elapsed / steps
        reset_peak_memory(self.env.device)  # each interval's peak is its own
        self.metrics.log({
            "kind": "train", "step": self.state.step, "epoch": self.state.epoch, "tokens": self.state.tokens_seen,
            "loss": loss, "lr": self.scheduler.get_last_lr()[0], "grad_norm": norm, "step_time_s": step_time,
            "tokens_per_s": self.tokens_per_step / step_time,
            "tokens_per_s_per_device": self.tokens_per_step / step_time / self.env.world_size,
            "mfu": self.instruments.mfu(self.tokens_per_step / step_time), **interval,
            "global_batch": self.batches.global_batch, "tokens_per_step": self.tokens_per_step,
            "world_size": self.env.world_size,
        })  # fmt: skip

    def save(self):
        """A checkpoint of this step, once: refused, as scalelm's engine's, if a weight or the loss not yet logged
        is not finite (Checkpointer.save)."""
        if self.checkpointer.latest_step != self.state.step:
            self.checkpointer.save(self.model, self.optimizer, self.scheduler, self.state, self.loss_acc)
        return self.checkpointer.latest_path

    def finish(self, test: dict[str, Any], checkpoint) -> RunRecord:
        state = self.state
        record = RunRecord(
            **self.where,
            end_time=provenance.now(),
            wall_time_s=self.clock.wall(),
            host_load=self.instruments.host_loads(),
            parallel={**self.parallel.describe(self.model), "engine": f"lightning {self.L.__version__}"},
            results=self.results(
                self.validation,
                test,
                checkpoint,
                **self.instruments.results(state.tokens_seen, state.train_seconds, state.energy_j),
            ),  # fmt: skip
        )
        if self.env.is_main:
            write_record(self.run_dir.path, record)
        return record


def ddp_strategy(device: torch.device):
    """Lightning's DDP strategy with scalelm's DDP options, on the backend scalelm's process group uses."""
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(process_group_backend=backend_for(device), **DDP_OPTIONS)


def Module(engine: LightningTrainer):
    """The LightningModule over the engine's model, optimizer and schedule (a class made once lightning is here)."""
    L = engine.L

    class ScaleLMModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = engine.model

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            loss = self.model(inputs, targets)  # the mean cross-entropy; Lightning divides by the accumulation
            engine.loss_acc += loss.detach() / engine.batches.accumulation
            return loss

        def configure_optimizers(self):
            return engine.optimizer  # the schedule is stepped with it, below: a checkpoint after a step holds both

        def on_before_optimizer_step(self, optimizer) -> None:
            # the global norm of the averaged gradients, clipped as scalelm clips (Parallel.clip_grad_norm)
            params = [p for p in self.model.parameters() if p.grad is not None]
            self.grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            if engine.config.optim.grad_clip:
                torch.nn.utils.clip_grads_with_norm_(params, engine.config.optim.grad_clip, self.grad_norm)

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
            optimizer.step(closure=optimizer_closure)
            engine.scheduler.step()
            engine.instruments.note_state(
                self.model, optimizer
            )  # gradients are zeroed at the next step's first backward
            engine.steps_acc += 1
            self.stepped = True

    return ScaleLMModule()


def Bookkeeping(engine: LightningTrainer):
    L = engine.L

    class ScaleLMCallback(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            # Lightning's own SIGTERM handler would end the loop at once; scalelm's StopFlag agrees on a step first
            engine.stop.reinstall()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            engine.begin_step()

        def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
            engine.end_step(exception)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if getattr(pl_module, "stepped", False):
                pl_module.stepped = False
                engine.after_step(trainer, pl_module.grad_norm)

    return ScaleLMCallback()
