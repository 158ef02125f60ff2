"""The losses, in one place.

The language-modelling loss: the cross-entropy of next-token logits, computed in fp32 whatever the logits'
precision, positions whose target is IGNORE_INDEX (an evaluation's padding rows) left out. The model's head (fused
with the output projection on CPU: cpu_ops.linear_cross_entropy, which computes the same; a pipeline's last stage goes
through it too, TransformerLM.head_loss) and evaluation call `lm_loss`; under torch's loss_parallel() it takes
vocabulary-split logits too.

The training loss adds auxiliary losses (a mixture of experts' load balance, scalelm.model.moe) with their weights:
lm_loss + sum of weight x aux. They join it from inside the model (`join_auxiliary_loss`), so the model returns, logs
and evaluates the language-model loss alone, and a pipeline's earlier stages add theirs without sending them on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # a target the loss skips (F.cross_entropy's default)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: Literal["mean", "sum"] = "mean") -> torch.Tensor:
    """logits (..., vocab) against targets (...): the mean (or summed) cross-entropy over the counted positions."""
    flat = logits.flatten(0, logits.dim() - 2) if logits.dim() > 2 else logits
    return F.cross_entropy(flat.float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction)


_loss_weight = 1.0  # the weight of the micro-batch being computed in its optimizer step (`weighted`)


@contextlib.contextmanager
def weighted(weight: float) -> Iterator[None]:
    """Forwards and backwards inside compute a micro-batch whose loss is multiplied by `weight` in its step (gradient
    accumulation, a pipeline's micro-batches): its auxiliary losses take the same weight."""
    global _loss_weight
    before, _loss_weight = _loss_weight, weight
    try:
        yield
    finally:
        _loss_weight = before


class _AuxiliaryLoss(torch.autograd.Function):
    """`output` unchanged; in the backward, `aux` gets the gradient `weight`, as if weight x aux had been added to the
    loss `output` flows into (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        ctx.save_for_backward(aux)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.weight), None


def join_auxiliary_loss(output: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
    """`output`, through which weight x aux joins the training loss (times the micro-batch's weight, `weighted`)."""
    if not (weight and torch.is_grad_enabled() and aux.requires_grad):
        return output
    return _AuxiliaryLoss.apply(output, aux, weight * _loss_weight)


def stored_gradients(ctx, grad_loss: torch.Tensor, name: str) -> list[torch.Tensor | None]:
    """For a loss whose forward computes its inputs' gradients (cpu_ops' and gpu_ops' fused head and loss, which keep
    no logits for a backward): those gradients (`ctx.grads`), scaled by `grad_loss`, None where no input needs one;
    taken once."""
    if ctx.grads is None:
        raise RuntimeError(f"{name}: backward through the same loss twice is not supported")
    grads, ctx.grads = ctx.grads, None
    # a factor on the CPU is read for free (1: nothing to scale); on a GPU it is never read: the host would wait
    scale = grad_loss.device.type != "cpu" or grad_loss.item() != 1.0
    return [
        (g.mul_(grad_loss) if scale else g) if g is not None and need else None
        for g, need in zip(grads, ctx.needs_input_grad)
    ]
