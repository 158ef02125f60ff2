"""CUDA fast paths of the model's operations, each computing exactly the function of its plain torch counterpart.

Measurements behind each choice: docs/benchmarks.md (GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

# cuBLAS's Hopper kernels read rows in 16-byte units; a weight of 33,278 rows (WikiText-2's vocabulary) gives the
# logits rows of 66,556 bytes in bf16, and the largest matmuls of the model fall back to older, slower kernels
ROW_MULTIPLE = 64
PADDED_DEVICES = ("cuda",)


def aligned_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), computed with the weight's rows padded by zeros to a multiple of ROW_MULTIPLE and
    the padding's outputs dropped, on the devices where that is faster. The padded copy of the weight costs one
    pass over it (autocast copies it anyway); a weight split across ranks (DTensor) is left as it is."""
    rows = weight.shape[0]
    pad = -rows % ROW_MULTIPLE
    if not pad or x.device.type not in PADDED_DEVICES or isinstance(weight, DTensor):
        return F.linear(x, weight, bias)
    padded_bias = F.pad(bias, (0, pad)) if bias is not None else None
    return F.linear(x, F.pad(weight, (0, 0, 0, pad)), padded_bias)[..., :rows]
