"""CUDA fast paths of the model's operations, each computing exactly the function of its plain torch counterpart.

- `aligned_linear`: the output projection with its rows padded to a multiple of ROW_MULTIPLE, whole or (tensor
  parallelism's loss_parallel) each rank's share of the vocabulary.
- `chunked_linear_cross_entropy` (train.fused_loss: chunked): the output projection and its cross-entropy chunk by chunk
  of tokens, each chunk's loss and gradients computed in the forward pass (compiled with train.compile), so that the
  (tokens x vocabulary) logits are never kept for the backward (Liger's and Cut Cross-Entropy's idea, in torch ops).

Measurements behind each choice: docs/benchmarks.md (GPU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Shard

from scalelm.model.architecture import GPU_LOSS_CHUNK_ROWS
from scalelm.model.loss import IGNORE_INDEX, stored_gradients

# cuBLAS's Hopper kernels read rows in 16-byte units; a weight of 33,278 rows (WikiText-2's vocabulary) gives the
# logits rows of 66,556 bytes in bf16, and the largest matmuls of the model fall back to older, slower kernels
ROW_MULTIPLE = 64
PADDED_DEVICES = ("cuda",)


def aligned_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), computed with the weight's rows padded by zeros to a multiple of ROW_MULTIPLE and
    the padding's outputs dropped, on the devices where that is faster. The padded copy of the weight costs one
    pass over it (autocast copies it anyway). A weight split by rows across ranks (loss_parallel's DTensor) is padded
    rank by rank: a vocabulary that tp does not split into multiples of ROW_MULTIPLE (33,278 rows over tp 4: 8,320,
    8,320, 8,319, 8,319) would otherwise leave some ranks with odd rows, and the slow kernels (review 3, finding 13)."""
    if x.device.type not in PADDED_DEVICES:
        return F.linear(x, weight, bias)
    if isinstance(weight, DTensor):
        return _vocab_parallel_linear(x, weight, bias)
    padded, padded_bias = padded_rows(x, weight, bias)
    if padded is weight:
        return F.linear(x, weight, bias)
    return F.linear(x, padded, padded_bias)[..., : weight.shape[0]]


def padded_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fill: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight `aligned_linear` multiplies `x` by: its rows padded by zeros to a multiple of ROW_MULTIPLE on
    PADDED_DEVICES, and the bias by `fill` (a missing bias is zeros where `fill` is not 0); unchanged (the same
    tensors) elsewhere, or where the rows are a multiple already."""
    pad = -weight.shape[0] % ROW_MULTIPLE if x.device.type in PADDED_DEVICES else 0
    if not pad:
        return weight, bias
    if bias is None and fill:
        bias = weight.new_zeros(weight.shape[0])
    padded_bias = F.pad(bias, (0, pad), value=fill) if bias is not None else None
    return F.pad(weight, (0, 0, 0, pad)), padded_bias


def _vocab_parallel_linear(x: DTensor, weight: DTensor, bias: DTensor | None) -> DTensor:
    """The logits of a head split by vocabulary (its weight's rows Shard(0), its input replicated), each rank's share
    from its own rows through `aligned_linear`: the same DTensor, split along the vocabulary, as F.linear gives. The
    input's gradient is a partial sum on every rank (as F.linear's), which the input's redistribution sums."""
    if not all(p.is_replicate() for p in x.placements) or weight.placements != (Shard(0),):
        return F.linear(x, weight, bias)
    local = aligned_linear(
        x.to_local(grad_placements=[Partial()]),
        weight.to_local(),
        bias.to_local() if bias is not None else None,
    )
    shape = torch.Size((*x.shape[:-1], weight.shape[0]))
    stride = torch.empty(shape, device="meta").stride()  # the whole logits', contiguous, as F.linear's
    mesh, placements = weight.device_mesh, [Shard(local.dim() - 1)]
    return DTensor.from_local(local, mesh, placements, shape=shape, stride=stride)


# ------------------------------------------------------------------------------------------ the chunked loss
ChunkLoss = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]


def loss_chunk(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk of tokens: the sum of its counted tokens' losses, and the gradients of `scale` x that sum with
    respect to x, weight (fp32) and bias (fp32), all operands in the compute precision. The logits as F.linear gives
    them, their cross-entropy in fp32 (`lm_loss`), the logits' gradient cast back, as autograd does: a token whose
    target is IGNORE_INDEX counts nothing and gets no gradient. What train.compile compiles, chunk by chunk."""
    logits = F.linear(x, weight, bias).float()
    counted = targets != IGNORE_INDEX
    safe = torch.where(counted, targets, 0)[:, None]  # any in-range word: the ignored rows' weight is 0 below
    log_sum = logits.logsumexp(-1)
    loss = torch.where(counted, log_sum - logits.gather(-1, safe).squeeze(-1), 0.0).sum()
    row_weight = (counted * scale)[:, None]  # d(scale x loss) / d(row loss)
    grad = (logits - log_sum[:, None]).exp_().mul_(row_weight).scatter_add_(-1, safe, -row_weight).to(x.dtype)
    grad_bias = grad.sum(0, dtype=torch.float32) if bias is not None else None
    return loss, grad @ weight, (grad.t() @ x).float(), grad_bias


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The precision F.linear computes in: autocast's on the input's device where it is on, else the weight's (the
    chunked loss's, a mixture's experts' products)."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def chunked_loss_applies(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Where the chunked loss computes the training loss: gradients wanted, a whole (not vocabulary-split) weight."""
    return (
        torch.is_grad_enabled()
        and not isinstance(weight, DTensor)
        and hidden.shape[0] > 0
        and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    )


@torch.compiler.disable  # a loop of chunks, each compiled on its own (OutputHead.compile): no graph of its own
def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk: ChunkLoss = loss_chunk,
) -> torch.Tensor:
    """`lm_loss(aligned_linear(hidden, weight, bias), targets)`, the mean loss, chunk by chunk of at most
    GPU_LOSS_CHUNK_ROWS tokens (`ChunkedLinearCrossEntropy`); `chunk` computes one (`loss_chunk`, or it compiled)."""
    return ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Output projection + mean cross-entropy, with all three gradients computed in the forward pass, chunk by chunk
    of tokens: what the backward keeps is the gradients (tokens x d_model, and the weight's), never the logits. The
    weight's gradient is summed over the chunks in fp32. Its products run on `aligned_linear`'s padded rows, the
    padding's logits -inf (probability 0, no gradient). backward() scales the kept gradients by the incoming one
    (the micro-batch's weight under accumulation)."""

    CHUNK_ROWS = GPU_LOSS_CHUNK_ROWS

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk):
        dtype = compute_dtype(hidden, weight)
        with torch.autocast(hidden.device.type, enabled=False):  # cast as autocast would, once
            x, w = hidden.to(dtype), weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            # the three products of every chunk on aligned_linear's padded rows (the vocabulary's own row stride
            # sends cuBLAS to slow kernels), padded once per call. The padding's logits are -inf (its bias entries;
            # without a bias, one of zeros is made for them, its gradient unused: the model's head has a bias), so
            # their probability and gradient are exactly 0: the loss and the vocabulary's gradients are unchanged,
            # and the padding's gradient rows are dropped below
            vocab = weight.shape[0]
            w, b = padded_rows(x, w, b, fill=-torch.inf)
            scale = 1.0 / (targets != IGNORE_INDEX).sum().float()  # the mean's (inf, and so nan, if none counts)
            n = x.shape[0]
            chunks = -(-n // ChunkedLinearCrossEntropy.CHUNK_ROWS)
            rows = -(-n // chunks)  # balanced: at most two shapes to compile
            total, grad_hidden, grad_weight, grad_bias = None, [], None, None
            for first in range(0, n, rows):
                part = slice(first, first + rows)
                loss, gx, gw, gb = chunk(x[part], w, b, targets[part], scale)
                grad_hidden.append(gx)
                total = loss if total is None else total + loss
                grad_weight = gw if grad_weight is None else grad_weight.add_(gw)
                if gb is not None:
                    grad_bias = gb if grad_bias is None else grad_bias.add_(gb)
        ctx.grads = (
            torch.cat(grad_hidden).to(hidden.dtype),
            grad_weight[:vocab].to(weight.dtype),
            grad_bias[:vocab].to(bias.dtype) if bias is not None else None,
        )
        return total * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        return (*stored_gradients(ctx, grad_loss, "ChunkedLinearCrossEntropy"), None, None)
