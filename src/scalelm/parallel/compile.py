"""torch.compile, applied with the layout: each block on its own, after tensor parallelism and before FSDP (the order
torchtitan uses), so that FSDP's hooks stay outside the compiled code and every block shares one compiled graph.

Modules are compiled in place (`nn.Module.compile`): parameter names, and so checkpoints, are those of the eager
model, and a compiled run resumes an eager one's checkpoint and the other way round.
"""

from __future__ import annotations

import torch
from torch import nn


def apply_compile(model: nn.Module, device: torch.device) -> None:
    """Compile the blocks of `model` (a whole model or a pipeline stage, on any device, meta included) and, on CUDA,
    the output head with its loss: logits, their fp32 cast and the cross-entropy fused instead of a vocabulary-wide
    tensor each. On CPU the head keeps its hand-fused loss (scalelm.model.cpu_ops)."""
    for block in model.blocks.values():
        block.compile()
    if device.type == "cuda" and model.head is not None:
        model.head.compile()
