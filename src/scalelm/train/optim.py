"""AdamW and the learning-rate schedule (linear warmup, then constant or cosine decay)."""

from __future__ import annotations

import math

import torch
from torch import nn

from scalelm.config import BatchConfig, OptimConfig


def scaled_lr(optim: OptimConfig, batch: BatchConfig, world_size: int) -> float:
    """Peak learning rate: with a per-device batch the global batch grows with the world size, and the
    course slides discuss scaling the rate with it, linearly or by its square root."""
    factor = {"none": 1.0, "linear": float(world_size), "sqrt": math.sqrt(world_size)}[batch.lr_scaling]
    return optim.lr * factor


def build_optimizer(model: nn.Module, optim: OptimConfig, lr: float) -> torch.optim.Optimizer:
    params = list(model.parameters())
    # On CPU torch defaults to the per-tensor loop (about ten passes over every tensor, with temporaries); the fused
    # kernel does the same update in one pass, several times faster (docs/benchmarks.md), for plain and for DTensor
    # parameters (FSDP), but not for a mix of both (TP without FSDP). GPUs keep torch's default choice.
    fused = (all(p.device.type == "cpu" for p in params) and len({type(p) for p in params}) == 1) or None
    return torch.optim.AdamW(params, lr=lr, betas=optim.betas, weight_decay=optim.weight_decay, fused=fused)


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
