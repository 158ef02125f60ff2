"""The ring's references for tests (tests/test_context.py): the whole sequence gathered from every rank's part, and
causal attention on one process by plain autograd operations, with the ring's dropout masks."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from scalelm.parallel.context import _seed_tensor, _unsplit
from scalelm.parallel.ring_blocks import _acc, _Dropout, _scores
from scalelm.parallel.ring_transport import size_rank


def gather_sequence(part: torch.Tensor, dim: int, group, load_balance: bool) -> torch.Tensor:
    """The whole sequence along `dim` from every rank's part (shard_sequence's inverse; not differentiable)."""
    n, _ = size_rank(group)
    if n == 1:
        return part
    parts = [torch.empty_like(part, memory_format=torch.contiguous_format) for _ in range(n)]
    dist.all_gather(parts, part.contiguous(), group=group)
    return _unsplit(parts, dim, load_balance)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    seed: int | torch.Tensor | None = None,
    *,
    batch_offset: int = 0,
    head_offset: int = 0,
) -> torch.Tensor:
    """ring_attention's result on one process with the whole sequence (positions 0..S-1), by plain autograd
    operations on the full score matrix, with the same dropout masks."""
    batch, heads, length, dim = q.shape
    drop = _Dropout(dropout_p, _seed_tensor(seed), batch, heads, (batch_offset, head_offset), q.device)
    pos = torch.arange(length, device=q.device)
    s = _scores(q, k, 1.0 / math.sqrt(dim), pos.view(-1, 1) < pos.view(1, -1))
    p = torch.softmax(s, dim=-1)
    dropped = drop.dropped(pos, pos)
    if dropped is not None:
        p = p.masked_fill(dropped, 0.0) * drop.factor
    return torch.matmul(p, _acc(v)).to(q.dtype)
