"""Tensor parallelism (Megatron-style) over the mesh's "tp" dimension, applied to a TransformerLM in place.

The model declares its plan (scalelm.model.architecture.block_tp_plan): in every block the first matrix of a pair is
split by output columns and the second by input rows, so a block costs one all-reduce forward and one backward for
attention and one each for the feed-forward network (llama's SwiGLU: w1 and w3 column-wise, w2 row-wise; its qkv
rows grouped by key/value head, so a rank holds whole groups: tp divides model.n_kv_heads):

    attention   qkv: column-wise (whole heads per rank: the qkv rows are grouped by head)   out: row-wise
    FFN         up: column-wise                                                             down: row-wise

Options:
- `sequence_parallel`: between those pairs (norms, residual dropout and additions) each rank holds only its part of
  the sequence: every all-reduce becomes a reduce-scatter after the row-wise matrix and an all-gather before the
  column-wise one, and those activations take 1/tp of the memory.
- `loss_parallel`: the output projection is split by vocabulary and the cross-entropy computed without gathering
  the logits (torch's loss_parallel).

A mixture of experts (model.moe) stays whole: every rank of a group routes and computes it alike, on the whole
sequence (under SP gathered before it and split again after it).

The embedding is split by vocabulary (Megatron's vocabulary-parallel embedding, torchtitan's rowwise plan): each rank
looks up the tokens in its rows, the others' read as zeros, and an all-reduce sums them, so a large vocabulary's table
and its optimizer state take 1/tp of a rank's memory. An embedding tied to the head (model.tie_weights) follows it:
split alike under loss_parallel, and the head's weight tied to it again after the split (parallelize_module gives each
module its own copy), whole otherwise. Norms (without SP) and the head (without loss_parallel) are replicated: every
rank of a TP group computes them on the same activations and so gets the same gradients. A dropout on activations
every rank of the group holds draws the same masks on all of them (their RNG states are equal); one on a rank's own
slice (its heads, its FFN columns, its part of the sequence) gets a stream of its own (scalelm.model.cpu_ops).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from scalelm.model.architecture import block_tp_plan
from scalelm.model.moe import MoE


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool) -> None:
    """Parallelize `model` (on the meta device or materialised) over `tp_mesh`, in place."""
    # the residual stream between the pairs: replicated, or (SP) this rank's part of the sequence as a plain tensor
    between = Shard(1) if sequence_parallel else Replicate()
    styles = {"colwise": ColwiseParallel, "rowwise": lambda: RowwiseParallel(output_layouts=between)}
    plan = {name: styles[split]() for name, split in block_tp_plan(model.config).items()}
    if sequence_parallel:
        gather = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
        plan |= {"attn": gather, "ffn": gather}
        plan |= {"norm1": SequenceParallel(use_local_output=True), "norm2": SequenceParallel(use_local_output=True)}
    mixture_plan = {name: style for name, style in plan.items() if not name.startswith("ffn")}
    if sequence_parallel:
        mixture_plan["ffn"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        )
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, mixture_plan if isinstance(block.ffn, MoE) else plan)
    model.split_dropout_streams(tp_mesh.get_local_rank() + 1, sequence_parallel)  # 0 is the stream the group shares

    top = {}
    tied = model.embed is not None and model.head is not None and model.head.weight is model.embed.weight
    if model.embed is not None and (loss_parallel or not tied):
        # replicated output: the positions' table (the course's block) is added to the whole sequence
        top["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if sequence_parallel and model.embed is not None:  # (a pipeline stage after the first has no embedding)
        # the embedding's sum is replicated: each rank keeps its part of the sequence (a slice, no communication)
        top["drop"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
    if sequence_parallel and model.norm is not None:
        top["norm"] = SequenceParallel(use_local_output=True)
    if model.head is None:  # a pipeline stage before the last
        pass
    elif loss_parallel:
        top["head"] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)
        model.register_forward_hook(_replicated_as_local)
    elif sequence_parallel:  # the head takes (hidden states, targets): gather the sequence of the first
        top["head"] = PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_output=True
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    if tied:
        model.head.weight = model.embed.weight  # both split by vocabulary, or both whole
    model.loss_parallel = loss_parallel


def keep_embedding_gradient_split(model: nn.Module) -> None:
    """DTensor's embedding backward returns the whole table's gradient, replicated: keep this rank's rows of it, as of
    the weight (a slice, no communication), or each rank would hold and step the whole table's gradient. Called on the
    materialised model (its parameters are new tensors) where no FSDP wraps it (FSDP's reduce-scatter already gives
    each rank its part of the gradient)."""
    weight = getattr(model.embed, "weight", None) if model.embed is not None else None
    if isinstance(weight, DTensor):
        weight.register_hook(lambda grad: grad.redistribute(placements=weight.placements))


def _replicated_as_local(module: nn.Module, args, output):
    """The loss computed from vocabulary-split logits is replicated on the TP group: hand it on as a plain tensor
    (the logits themselves, split, stay a DTensor for a cross-entropy under loss_parallel)."""
    if isinstance(output, DTensor) and all(p.is_replicate() for p in output.placements):
        return output.to_local()
    return output
