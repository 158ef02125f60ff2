"""The language-modelling loss, in one place: the cross-entropy of next-token logits, computed in fp32 whatever the
logits' precision, positions whose target is IGNORE_INDEX (an evaluation's padding rows) left out. The model's head
(fused with the output projection on CPU: cpu_ops.linear_cross_entropy, which computes the same; a pipeline's last
stage goes through it too, TransformerLM.head_loss) and evaluation call `lm_loss`; under torch's loss_parallel() it
takes vocabulary-split logits too."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # a target the loss skips (F.cross_entropy's default)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: Literal["mean", "sum"] = "mean") -> torch.Tensor:
    """logits (..., vocab) against targets (...): the mean (or summed) cross-entropy over the counted positions."""
    flat = logits.flatten(0, logits.dim() - 2) if logits.dim() > 2 else logits
    return F.cross_entropy(flat.float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction)
