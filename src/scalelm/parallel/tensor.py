"""Tensor parallelism (Megatron-style) over the mesh's "tp" dimension, applied to a TransformerLM in place.

In every block the first matrix of a pair is split by output columns and the second by input rows, so a block costs
one all-reduce forward and one backward for attention and one each for the feed-forward network:

    attention   qkv: column-wise (whole heads per rank: the qkv rows are grouped by head)   out: row-wise
    FFN         in: column-wise                                                             out: row-wise

`loss_parallel` also splits the output projection by vocabulary and computes the cross-entropy without gathering
the logits (torch's loss_parallel). Embedding, norms and (without loss_parallel) the head are replicated: every rank
of a TP group computes them on the same activations and so gets the same gradients; the residual dropout, on those
replicated activations, draws the same masks on every rank of the group.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from scalelm.config import ModelConfig
from scalelm.errors import ConfigError


def check_tp(tp: int, model: ModelConfig, vocab_size: int | None, loss_parallel: bool) -> None:
    """The sizes a TP degree must divide, checked before any model is built."""
    if tp == 1:
        return
    for name, value in (("model.n_heads", model.n_heads), ("model.d_ff", model.d_ff)):
        if value % tp:
            raise ConfigError(f"{name}={value} is not divisible by parallel.tp={tp}; each TP rank needs an equal share")
    if loss_parallel and vocab_size is not None and vocab_size % tp:
        raise ConfigError(
            f"parallel.loss_parallel splits the vocabulary of {vocab_size} words across parallel.tp={tp} ranks, "
            "which does not divide it; switch loss_parallel off or choose another tp"
        )


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Parallelize `model` (on the meta device or materialised) over `tp_mesh`, in place."""
    plan = {
        "attn.qkv": ColwiseParallel(),
        "attn.out": RowwiseParallel(),
        "ffn.0": ColwiseParallel(),  # FFN in
        "ffn.3": RowwiseParallel(),  # FFN out
    }
    stream = tp_mesh.get_local_rank() + 1  # 0 is the stream the TP group shares
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)
        # these dropouts act on activations split across the TP group (heads, FFN features): each rank its own masks
        block.attn.dropout_stream = stream
        block.ffn[2].stream = stream
    if loss_parallel:
        parallelize_module(model.head, tp_mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
        model.register_forward_hook(_replicated_as_local)
    model.loss_parallel = loss_parallel


def _replicated_as_local(module: nn.Module, args, output):
    """The loss computed from vocabulary-split logits is replicated on the TP group: hand it on as a plain tensor
    (the logits themselves, split, stay a DTensor for a cross-entropy under loss_parallel)."""
    if isinstance(output, DTensor) and all(p.is_replicate() for p in output.placements):
        return output.to_local()
    return output
