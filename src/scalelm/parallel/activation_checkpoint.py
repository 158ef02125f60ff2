"""Activation checkpointing: a block keeps less of its forward pass for the backward and recomputes the rest there.

    full        a block keeps its input only; its whole forward runs again in the backward
    selective   a block keeps the outputs of its matrix products and attention (the work worth keeping) and recomputes
                the element-wise rest: norms, activations, dropout, residual additions (torchtitan's op-level policy)

Applied to each block, after tensor parallelism and before compilation and FSDP (torchtitan's order). The block's
forward is wrapped in place: parameter names, and so checkpoints, stay those of the plain model. The random state is
restored for the recomputation, so dropout draws the same masks and the loss is that of the plain model.

Under torch.compile a checkpointed block is one graph only if dynamo traces all of it: `checkpoint` itself is
dynamo-disabled, so a graph break inside the block runs the whole block eagerly, and train.compile would silently do
nothing there. `graph_breaks` says whether a block compiles whole (tests/test_compile_checkpoint.py asks it of every
layout's block in every mode).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from scalelm.model.cpu_ops import STREAM_ATTENTION_OP
from scalelm.parallel.context import RING_OP

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
    RING_OP,  # context parallelism's ring attention: its output and log-sum-exp, not its blocks' products
    STREAM_ATTENTION_OP,  # attention on a rank's own dropout stream, as compile traces it (tensor parallelism)
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


def graph_breaks(block: nn.Module, *inputs: torch.Tensor) -> list[str]:
    """Why torch.compile would not run `block(*inputs)` as one graph: dynamo's reasons for each graph break, and
    "no graph" where it captured nothing (a break inside a checkpoint: the whole block runs eagerly). Empty: one
    graph, the whole block compiled. Runs the block's forward once, without inductor; resets dynamo's caches first
    (variants of one block class would otherwise hit its recompilation limit)."""
    import torch._dynamo

    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(*inputs)
    reasons = [str(b.reason).strip().splitlines()[0] for b in explained.break_reasons]
    if explained.graph_count == 0:
        reasons.append("no graph: dynamo traced nothing, the block runs eagerly")
    return reasons
