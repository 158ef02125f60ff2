"""Activation checkpointing: a block keeps less of its forward pass for the backward and recomputes the rest there.

    full        a block keeps its input only; its whole forward runs again in the backward
    selective   a block keeps the outputs of its matrix products and attention (the work worth keeping) and recomputes
                the element-wise rest: norms, activations, dropout, residual additions (torchtitan's op-level policy)

Applied to each block, after tensor parallelism and before compilation and FSDP (torchtitan's order). The block's
forward is wrapped in place: parameter names, and so checkpoints, stay those of the plain model. The random state is
restored for the recomputation, so dropout draws the same masks and the loss is that of the plain model.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# what `selective` keeps: the outputs of the matrix products and of the attention kernels, and (tensor parallelism)
# of the collectives, which would otherwise run again
KEPT_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
}


def _keep_products(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward, mode: str, *args, **kwargs):
    if mode == "selective":
        context = functools.partial(create_selective_checkpoint_contexts, _keep_products)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Checkpoint every block of `model` (a whole model or a pipeline stage, on any device, meta included) in `mode`,
    one of train.activation_checkpointing's values (checked with the config)."""
    if mode == "none":
        return
    for block in model.blocks.values():
        block.forward = functools.partial(_checkpointed, block.forward, mode)
