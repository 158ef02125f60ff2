"""DistributedDataParallel: a full replica per rank, gradients averaged by all-reduce during backward."""

from typing import ContextManager

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from scalelm.parallel.base import Strategy


class DDPStrategy(Strategy):
    name = "ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        model = model.to(self.env.device)
        device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
        # DDP broadcasts rank 0's weights at construction; identical seeds make that a no-op anyway.
        return DistributedDataParallel(model, device_ids=device_ids)

    def no_sync(self, model: nn.Module) -> ContextManager:
        return model.no_sync()
