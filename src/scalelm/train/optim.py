"""AdamW and the learning-rate schedule (linear warmup, then constant or cosine decay)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from scalelm.config import BatchConfig, OptimConfig

FUSED_DEVICES = ("cpu", "cuda")


def scaled_lr(optim: OptimConfig, batch: BatchConfig, world_size: int) -> float:
    """Peak learning rate: with a per-device batch the global batch grows with the world size, and the
    course slides discuss scaling the rate with it, linearly or by its square root."""
    factor = {"none": 1.0, "linear": float(world_size), "sqrt": math.sqrt(world_size)}[batch.lr_scaling]
    return optim.lr * factor


def param_groups(model: nn.Module) -> list[dict]:
    """The parameters in one group per tensor type: tensor parallelism without FSDP leaves the embedding, norms and
    head plain beside DTensor blocks, and neither the fused nor the foreach kernel (CUDA's default) takes a mix of
    both in one call ("got mixed torch.Tensor and DTensor")."""
    groups: dict[bool, list[nn.Parameter]] = {}
    for param in model.parameters():
        groups.setdefault(isinstance(param, DTensor), []).append(param)
    return [{"params": params} for params in groups.values()]


def build_optimizer(model: nn.Module, optim: OptimConfig, lr: float) -> torch.optim.Optimizer:
    # The fused kernel does the update in one pass over each tensor's state, on CPU much faster than torch's
    # per-tensor default (docs/benchmarks.md), on CUDA fewer passes than its foreach default.
    fused = all(p.device.type in FUSED_DEVICES for p in model.parameters()) or None
    return torch.optim.AdamW(
        param_groups(model), lr=lr, betas=optim.betas, weight_decay=optim.weight_decay, fused=fused
    )


def build_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig, total_steps: int):
    warmup, floor = optim.warmup_steps, optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
