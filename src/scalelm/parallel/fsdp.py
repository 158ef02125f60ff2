"""FSDP2: fully_shard on every Transformer block, then on the root (embedding, final norm, head).

Sharding each block (not only the root, as the course did) is what lets FSDP free one block's
gathered weights before the next block needs memory. Precision is handled by MixedPrecisionPolicy
(bf16 compute, fp32 gradient reduction), so autocast is not used on top of it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from scalelm.errors import ConfigError
from scalelm.parallel.base import Strategy

# The head's logits are a view of a matmul result; scalelm never modifies them in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


class FSDPStrategy(Strategy):
    name = "fsdp"
    sharded_checkpoint = True

    def wrap(self, model: nn.Module) -> nn.Module:
        device = self.env.device
        if self.config.cpu_offload and device.type != "cuda":
            raise ConfigError("parallel.cpu_offload moves parameters from GPU to CPU memory; it needs CUDA")
        mesh = init_device_mesh(device.type, (self.env.world_size,))
        options = {
            "mesh": mesh,
            "reshard_after_forward": self.config.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32),
            "offload_policy": CPUOffloadPolicy() if self.config.cpu_offload else OffloadPolicy(),
        }
        model = model.to(device)
        for block in model.blocks:
            fully_shard(block, **options)
        return fully_shard(model, **options)

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
