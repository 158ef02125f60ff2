"""scalelm's own training loop: one optimizer step over a rank's micro-batches, through the layout's hooks
(scalelm.parallel.runtime.Parallel), never naming a strategy. Everything around the steps is the engines' shared
base (scalelm.train.engine); the process's entry point is scalelm.train.run."""

from __future__ import annotations

import contextlib

import torch

from scalelm.model.moe import biased_mixtures, update_expert_biases
from scalelm.optim import optimizer_step
from scalelm.train.engine import Engine


class Trainer(Engine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prepare_steps()

    def prepare_steps(self) -> None:
        """What train_step needs beyond the engine's model, optimizer and schedule (bench/gpu_mfu.py's Stepper builds
        those alone, then calls this)."""
        self.optimizer_step = optimizer_step(self.optimizer, self.config.train.compile_optimizer)
        self.biased_mixtures = biased_mixtures(self.model)  # model.moe.balance=bias: moved after each step

    def train_steps(self) -> None:
        for micro_batches in self.remaining_steps():
            with self.watched_step():
                loss, grad_norm = self.train_step(micro_batches)
            if self.after_step(loss, grad_norm):
                return

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
        update_expert_biases(self.biased_mixtures, self.parallel.sum_over_data)
        self.scheduler.step()
        self.instruments.note_state(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm
