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
schedule (scalelm.optim), clipping to the global norm, checkpoints (scalelm.train.checkpoint, so the workflow's
consolidate turns the last one into the same model.pt), the exact evaluation, metrics.jsonl and run.json.

So that `ddp_lightning` and `ddp` differ in the loop only, both engines share one base (scalelm.train.engine): the
model Lightning trains is the one scalelm builds (Parallel.build, with activation checkpointing and compilation,
less the DDP wrapper, which Lightning's strategy adds with scalelm's DDP options, DDP_OPTIONS), and after each
optimizer step Lightning's hooks call the base's `after_step`: the same cadence, log line, finite checks, hang
watchdog and measurements. What Lightning cannot take is refused by name before the run (scalelm.config.setting's
`lightning_refuses`, checked with the layout).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from scalelm.errors import ConfigError
from scalelm.parallel.data import DDP_OPTIONS  # Lightning's defaults would make `ddp_lightning` measure other terms
from scalelm.parallel.env import backend_for
from scalelm.train.engine import Engine

PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed"}


def require_lightning():
    try:
        import lightning
    except ImportError:
        raise ConfigError("train.engine=lightning needs the optional extra: pip install 'scalelm[lightning]'") from None
    return lightning


class LightningEngine(Engine):
    """The engine whose steps lightning.Trainer runs; built on every rank."""

    wraps_replicas = True

    def __init__(self, *args, **kwargs):
        self.L = require_lightning()
        self.label = f"lightning {self.L.__version__}"
        super().__init__(*args, **kwargs)
        self.in_step: contextlib.ExitStack | None = None  # the running optimizer step's watchdog and instruments
        self.step_loss = torch.zeros((), device=self.env.device)

    def train_steps(self) -> None:
        from lightning.fabric.utilities.optimizer import _optimizers_to_device

        self.lightning_trainer().fit(lightning_module(self), train_dataloaders=self.micro_batches())
        # Lightning's teardown moves the model and the optimizer's state to the CPU (Strategy.teardown); the base's
        # evaluations and last checkpoint run on this rank's device, the state moved back as Lightning's setup moves it
        self.model.to(self.env.device)
        _optimizers_to_device([self.optimizer], self.env.device)

    def micro_batches(self):
        """The micro-batches of every remaining step, one after the other: Lightning accumulates them."""
        for step in self.remaining_steps():
            yield from step

    def lightning_trainer(self):
        from lightning.fabric.utilities.warnings import PossibleUserWarning
        from lightning.pytorch.plugins.environments import LightningEnvironment, TorchElasticEnvironment
        from lightning.pytorch.strategies import SingleDeviceStrategy

        # torchrun starts these processes, inside the Slurm step on a cluster (module docstring): not srun's job
        message = "The `srun` command is available on your system but is not used"
        warnings.filterwarnings("ignore", message=message, category=PossibleUserWarning)
        # Lightning 2.6 (the newest) builds torch's deprecated LeafSpec for every batch: nothing of ours to change
        leaf_spec, pytree = (
            r"`isinstance\(treespec, LeafSpec\)` is deprecated",
            r"lightning\.pytorch\.utilities\._pytree",
        )
        warnings.filterwarnings("ignore", message=leaf_spec, category=FutureWarning, module=pytree)

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
            precision=PRECISION[self.parallel.precision],
            max_epochs=1,  # one pass over `micro_batches`, which holds every remaining step, epoch after epoch
            max_steps=self.total_steps - self.state.step,
            accumulate_grad_batches=self.batches.accumulation,
            plugins=[environment],
            callbacks=[bookkeeping_callback(self)],
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

    def begin_step(self) -> None:
        """Before each micro-batch: the first of an optimizer step enters the base's `watched_step`."""
        if self.in_step is None:
            self.in_step = contextlib.ExitStack()
            self.in_step.enter_context(self.watched_step())

    def end_step(self, error: BaseException | None = None) -> None:
        """After the optimizer step (or the `error` that ended it): the step is no longer watched or measured."""
        in_step, self.in_step = self.in_step, None
        if in_step is not None and error is None:
            in_step.close()
        elif in_step is not None:  # the watchdog leaves a step that raised unwatched, as scalelm's loop does
            in_step.__exit__(type(error), error, error.__traceback__)

    def after_optimizer_step(self, trainer, grad_norm: torch.Tensor) -> None:
        """After each optimizer step: the base's bookkeeping; Lightning's loop ends if the ranks agreed to stop."""
        self.end_step()
        stop = self.after_step(self.step_loss, grad_norm)  # added into the interval's sum: reused for the next step
        self.step_loss.zero_()
        if stop:
            trainer.should_stop = True


def ddp_strategy(device: torch.device):
    """Lightning's DDP strategy with scalelm's DDP options, on the backend scalelm's process group uses."""
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(process_group_backend=backend_for(device), **DDP_OPTIONS)


def lightning_module(engine: LightningEngine):
    """The LightningModule over the engine's model, optimizer and schedule (a class made once lightning is here)."""
    L = engine.L

    class ScaleLMModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = engine.model

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            loss = self.model(inputs, targets)  # the mean cross-entropy; Lightning divides by the accumulation
            engine.step_loss += loss.detach() / engine.batches.accumulation
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
            engine.instruments.note_state(self.model, optimizer)  # gradients are zeroed at the next step's backward
            self.optimizer_stepped = True

    return ScaleLMModule()


def bookkeeping_callback(engine: LightningEngine):
    """The Lightning callback that hands each step to the engine's base (a class made once lightning is here)."""
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
            if getattr(pl_module, "optimizer_stepped", False):
                pl_module.optimizer_stepped = False
                engine.after_optimizer_step(trainer, pl_module.grad_norm)

    return ScaleLMCallback()
