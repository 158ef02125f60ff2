"""AdamW and the learning-rate schedule (linear warmup, then constant or cosine decay), and the optimizer step.

With train.compile_optimizer the step runs under torch.compile (PyTorch's "compiling the optimizer" recipe): Inductor
fuses AdamW's element-wise passes over every parameter into a few kernels. The learning rate is then a tensor that
the schedule fills in place, so that the compiled step sees it change without compiling again; the schedule still
reports plain numbers. Each run keeps its own kind of step whatever a checkpoint it resumes was written by: loading
an optimizer's state restores the saved hyperparameters, and `keep_implementation` puts the run's back.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from scalelm.config import BatchConfig, OptimConfig

FUSED_DEVICES = ("cpu", "cuda")
# the devices where AdamW's step may keep its step count on the device (capturable), which the foreach step with a
# tensor learning rate needs; elsewhere the compiled step takes the single-tensor implementation
CAPTURABLE_DEVICES = ("cuda",)


def scaled_lr(optim: OptimConfig, batch: BatchConfig, world_size: int) -> float:
    """Peak learning rate: with a per-device batch the global batch grows with the world size, and the
    course slides discuss scaling the rate with it, linearly or by its square root."""
    factor = {"none": 1.0, "linear": float(world_size), "sqrt": math.sqrt(world_size)}[batch.lr_scaling]
    return optim.lr * factor


def param_groups(model: nn.Module) -> list[dict]:
    """The parameters in one group per mesh: tensor parallelism without FSDP leaves the embedding, norms and head plain
    beside DTensor blocks, and neither the fused nor the foreach kernel (CUDA's default) takes a mix of both in one call
    ("got mixed torch.Tensor and DTensor"); the compiled foreach step does not take DTensors of two meshes in one call
    either ("Cannot run aten.mul.Tensor on inputs with different meshes": an expert-parallel model's experts beside its
    FSDP parameters, and so FSDP's beside tensor parallelism's). A checkpoint keeps each parameter's own state and
    hyperparameters (flattened by name), so it loads whatever the groups were."""
    groups: dict[object, list[nn.Parameter]] = {}
    for param in model.parameters():
        groups.setdefault(param.device_mesh if isinstance(param, DTensor) else None, []).append(param)
    return [{"params": params} for params in groups.values()]


def build_optimizer(model: nn.Module, optim: OptimConfig, lr: float, compiled: bool = False) -> torch.optim.Optimizer:
    """AdamW over the model's parameters: the fused kernel, or with `compiled` the implementation torch.compile
    fuses itself (foreach on CUDA, a tensor learning rate); `optimizer_step` takes the step."""
    implementation = compiled_implementation(model) if compiled else eager_implementation(model)
    optimizer = torch.optim.AdamW(
        param_groups(model),
        lr=torch.tensor(lr) if compiled else lr,
        betas=optim.betas,
        weight_decay=optim.weight_decay,
        **implementation,
    )
    optimizer.register_load_state_dict_post_hook(lambda loaded: keep_implementation(loaded, implementation, compiled))
    return optimizer


def eager_implementation(model: nn.Module) -> dict:
    # The fused kernel does the update in one pass over each tensor's state, on CPU much faster than torch's
    # per-tensor default (docs/benchmarks.md), on CUDA fewer passes than its foreach default.
    fused = all(p.device.type in FUSED_DEVICES for p in model.parameters()) or None
    return {"fused": fused, "foreach": None, "capturable": False}


def compiled_implementation(model: nn.Module) -> dict:
    # the foreach kernels are what Inductor fuses across parameters (the fused kernel is one opaque call); with a
    # tensor learning rate they need the step count on the device. The recipe's: torch.compile sets capturable
    # itself only for a state not yet initialised, which a resumed run's is
    capturable = all(p.device.type in CAPTURABLE_DEVICES for p in model.parameters())
    return {"fused": None, "foreach": True if capturable else None, "capturable": capturable}


def keep_implementation(optimizer: torch.optim.Optimizer, implementation: dict, compiled: bool) -> None:
    """After a checkpoint's state is loaded: this run's implementation and learning-rate type, not the writer's."""
    for group in optimizer.param_groups:
        group.update(implementation)
        for key in ("lr", "initial_lr"):
            if key in group:
                value = float(group[key])
                group[key] = torch.tensor(value) if compiled else value


def optimizer_step(optimizer: torch.optim.Optimizer, compiled: bool) -> Callable[[], None]:
    """What takes one optimizer step: `optimizer.step`, or that step compiled (graph breaks allowed, as the recipe
    has them: the optimizer's bookkeeping around the traced update)."""
    if not compiled:
        return optimizer.step

    @torch.compile(fullgraph=False)
    def step() -> None:
        optimizer.step()

    return step


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose rates are plain numbers (the metrics', a checkpoint's) also over a tensor learning rate, which
    it fills in place."""

    def __init__(self, optimizer: torch.optim.Optimizer, factor: Callable[[int], float]):
        super().__init__(optimizer, factor)
        self.base_lrs = [float(lr) for lr in self.base_lrs]

    def get_last_lr(self) -> list[float]:
        return [float(lr) for lr in super().get_last_lr()]

    def load_state_dict(self, state_dict: dict) -> None:
        """A checkpoint's place in the schedule, for this optimizer's groups: the writer's layout may have grouped the
        parameters otherwise (`param_groups`), every group at the one peak rate."""
        super().load_state_dict(state_dict)
        groups = len(self.optimizer.param_groups)
        self.base_lrs, self._last_lr = self.base_lrs[:1] * groups, self._last_lr[:1] * groups


def build_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig, total_steps: int) -> Schedule:
    warmup, floor = optim.warmup_steps, optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return Schedule(optimizer, factor)
