"""One process, one device: the reference the other strategies must match."""

from torch import nn

from scalelm.parallel.base import Strategy


class SingleDevice(Strategy):
    name = "single"
    needs_process_group = False

    def wrap(self, model: nn.Module) -> nn.Module:
        return model.to(self.env.device)
