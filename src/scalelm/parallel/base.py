"""The interface every strategy implements. The trainer calls these methods and nothing strategy-specific."""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch import nn

from scalelm.config import ParallelConfig
from scalelm.errors import ConfigError
from scalelm.parallel.env import DistEnv


class Strategy:
    name: str = ""
    needs_process_group: bool = True
    sharded_checkpoint: bool = False  # True: DCP directory written by all ranks; False: one file from rank 0

    def __init__(self, config: ParallelConfig, env: DistEnv):
        self.config = config
        self.env = env
        self.compute_dtype: torch.dtype = torch.float32

    def set_precision(self, dtype: torch.dtype) -> None:
        if dtype == torch.bfloat16 and self.env.device.type != "cuda":
            # bf16 matmuls on CPU are emulated, about 25x slower than fp32: never worth it here
            raise ConfigError("train.precision=bf16 is for CUDA devices; use fp32 (or auto) on CPU")
        self.compute_dtype = dtype

    def wrap(self, model: nn.Module) -> nn.Module:
        """Return the model to train (on self.env.device), wrapped as the strategy needs."""
        raise NotImplementedError

    def no_sync(self, model: nn.Module) -> ContextManager:
        """Context for micro-batches whose gradients are accumulated locally, without communication."""
        return contextlib.nullcontext()

    def autocast(self) -> ContextManager:
        """Context around forward passes; mixed precision for strategies that do not handle it themselves."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.env.device.type, dtype=self.compute_dtype)

    def clip_grad_norm(self, model: nn.Module, max_norm: float | None) -> torch.Tensor:
        """Global gradient norm (over all ranks), clipping to max_norm when given."""
        if max_norm:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        else:  # the norm only: clip_grad_norm_(inf) would also multiply every gradient by 1.0, a pass for nothing
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
