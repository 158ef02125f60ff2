"""Activation checkpointing: a block keeps less of its forward pass for the backward and recomputes the rest there.

    full        a block keeps its input only; its whole forward runs again in the backward
    selective   a block keeps the outputs of its matrix products and attention (the work worth keeping) and recomputes
                the element-wise rest: norms, activations, dropout, residual additions (torchtitan's op-level policy)

Applied to each block, after tensor parallelism and before compilation and FSDP (torchtitan's order). The block
becomes, in place, a subclass of its class whose forward is checkpointed (as FSDP2's fully_shard makes its own):
parameter names, and so checkpoints, stay those of the plain model, and all blocks share one class, which
torch.compile's guards see alike. The random state is restored for the recomputation, so dropout draws the same
masks and the loss is that of the plain model.

Under torch.compile a checkpointed block is one graph only if dynamo traces all of it: `checkpoint` itself is
dynamo-disabled, so a graph break inside the block runs the whole block eagerly, and train.compile would silently do
nothing there. `graph_breaks` says whether a block compiles whole (tests/test_compile_checkpoint.py asks it of every
layout's block in every mode).

A mixture of experts' block (scalelm.model.moe) has a part that must run once and eagerly: its exchange (the row
counts read to the host, expert parallelism's all-to-alls), which a recomputation would repeat and which, inside a
checkpoint, would leave the block uncompiled. So the checkpoints stop short of it: under full its attention and its
experts' product are recomputed, each on its own, and the norms, residuals, router and the exchange keep what they
keep; under selective the block stays as it is (the outputs of its products, what selective keeps, are most of what
it holds; the element-wise rest lies around the exchange).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from scalelm.model.cpu_ops import STREAM_ATTENTION_OP
from scalelm.model.moe import MoE
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
    one of train.activation_checkpointing's values (checked with the config); a mixture's block around its exchange
    (module docstring)."""
    if mode == "none":
        return
    for block in model.blocks.values():
        if not isinstance(block.ffn, MoE):
            _recompute(block, mode)
        elif mode == "full":
            _recompute(block.attn, mode)
            _recompute(block.ffn.experts, mode)


def _recompute(module: nn.Module, mode: str) -> None:
    module.__class__ = _recomputing(type(module), mode)


@functools.cache
def _recomputing(cls: type[nn.Module], mode: str) -> type[nn.Module]:
    """`cls`, its forward checkpointed in `mode` (which its `activation_checkpointing` names): one class for all its
    modules (as FSDP2's fully_shard does), so that torch.compile's guards on a block see the same class in every
    block. (A forward set on each module would be an object of its own, which dynamo guards by identity: a
    recompilation per block, and past its cache limit the remaining blocks eager.)"""

    def forward(self, *args, **kwargs):
        return _checkpointed(super(recomputed, self).forward, mode, *args, **kwargs)

    attributes = {"forward": forward, "activation_checkpointing": mode, "__module__": cls.__module__}
    recomputed = type(f"Recomputed{cls.__name__}", (cls,), attributes)
    return recomputed


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
