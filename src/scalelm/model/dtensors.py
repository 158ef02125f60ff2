"""This rank's shard of a tensor that may be distributed: the one check every room needs (a mixture's experts under
expert parallelism, a loss from vocabulary-split logits, the checkpoint's finite check, the state bytes a rank
holds)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP's, tensor or expert parallelism's), else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
