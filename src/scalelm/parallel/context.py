"""Context parallelism's core: causal ring attention over a group of ranks that each hold part of every sequence.

Each rank keeps its queries and passes its key/value block around the ring (to rank + 1, from rank - 1); after
cp - 1 hops every query has met every key. A block's partial attention (scalelm.parallel.ring_blocks: its kernels,
products, dropout masks and log-sum-exp merge) is merged into the running result, and blocks wholly in a query
block's future are skipped. Backward recomputes the probabilities block by block from the saved log-sum-exp; dq stays
home, while the dk/dv accumulator of a block travels with it and takes one last hop after the final step, which
brings it back to its owner.

The ring is one operator, `scalelm::ring_attention` (torch.library.custom_op, with `scalelm::ring_attention_backward`):
dynamo traces it as one node, without a graph break, and selective activation checkpointing keeps its output and
log-sum-exp instead of each block's products. An operator takes no process group: the group travels by its name.

Nothing is read back to the host in a call: every rank's positions follow from (sequence length, cp, load
balancing), so the block bounds are Python ints, computed once per shape (`_plan`), and the positions that dropout
masks need are made on the device once and kept.

The messages between the ranks (what is sent to whom, and how many bytes a call moves): scalelm.parallel.ring_transport.

The split of the sequence (chunk_positions): contiguous, or load-balanced as in torchtitan, where rank r holds chunks
r and 2 cp - 1 - r of 2 cp, so that every rank gets the same share of the causal mask's work.

`simulated_ring_attention` runs every rank's blocks of a cp-way split on one device, without messages: the blocks'
shapes and kernels of a real ring, for checks on a single GPU.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from scalelm.parallel.layout import sequence_chunk
from scalelm.parallel.ring_blocks import (
    _acc,
    _acc_dtype,
    _Block,
    _block_forward,
    _cols,
    _contiguous,
    _Dropout,
    _merge,
    _product_backward,
    _rows,
    fused_kernel,
)
from scalelm.parallel.ring_transport import LocalRing, MessageRing, group_named, size_rank

Tensor = torch.Tensor


def _chunk_ranges(seq_len: int, cp_rank: int, cp_size: int, load_balance: bool) -> list[range]:
    chunk = sequence_chunk(seq_len, cp_size, load_balance)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside 0..{cp_size - 1}")
    chunks = [cp_rank] if not load_balance else [cp_rank, 2 * cp_size - 1 - cp_rank]
    return [range(c * chunk, (c + 1) * chunk) for c in chunks]


def chunk_positions(
    seq_len: int, cp_rank: int, cp_size: int, load_balance: bool, device: torch.device | str | None = None
) -> torch.Tensor:
    """The global positions (int64, ascending) of the tokens of a sequence that rank `cp_rank` of `cp_size` holds,
    made on `device` (no copy)."""
    parts = [
        torch.arange(r.start, r.stop, dtype=torch.int64, device=device)
        for r in _chunk_ranges(seq_len, cp_rank, cp_size, load_balance)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def shard_sequence(x: torch.Tensor, dim: int, cp_rank: int, cp_size: int, load_balance: bool) -> torch.Tensor:
    """This rank's part of `x` along `dim`, the tokens at chunk_positions (a view when the split is contiguous)."""
    chunk = sequence_chunk(x.size(dim), cp_size, load_balance)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside 0..{cp_size - 1}")
    if not load_balance:
        return x.narrow(dim, cp_rank * chunk, chunk)
    tail = 2 * cp_size - 1 - cp_rank
    return torch.cat([x.narrow(dim, cp_rank * chunk, chunk), x.narrow(dim, tail * chunk, chunk)], dim)


def _unsplit(parts: list[torch.Tensor], dim: int, load_balance: bool) -> torch.Tensor:
    """The whole sequence along `dim` from every rank's part, in rank order."""
    n = len(parts)
    if n == 1:
        return parts[0]
    seq_len = parts[0].size(dim) * n
    device = parts[0].device
    order = torch.cat([chunk_positions(seq_len, r, n, load_balance, device) for r in range(n)])
    return torch.cat(parts, dim).index_select(dim, torch.argsort(order))


# --- the ring's schedule ---------------------------------------------------------------------------------------------


class _Plan:
    """The blocks rank `rank` of `n` computes, by ring step (step s: its queries, rank (rank - s) % n's keys), and
    their positions and masks on a device, made there once."""

    def __init__(self, length: int, n: int, rank: int, load_balance: bool):
        self.length, self.n, self.rank, self.load_balance = length, n, rank, load_balance
        positions = [[i for part in _chunk_ranges(length * n, r, n, load_balance) for i in part] for r in range(n)]
        self.blocks = [_Block(positions[rank], positions[(rank - step) % n]) for step in range(n)]
        self.general_masks = any(block.masked and not block.causal for block in self.blocks)
        self._on: dict[tuple[int, torch.device], tuple] = {}

    def on(self, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Block `step`'s query and key positions on `device`, and where its mask hides a key from a query there
        (None: unmasked)."""
        key = (step, device)
        if key not in self._on:
            block, whole = self.blocks[step], self.length * self.n
            q_pos = _rows(chunk_positions(whole, self.rank, self.n, self.load_balance, device), block, 0)
            k_pos = chunk_positions(whole, (self.rank - step) % self.n, self.n, self.load_balance, device)
            k_pos = k_pos.narrow(0, 0, block.cols)
            hidden = q_pos.view(-1, 1) < k_pos.view(1, -1) if block.masked else None
            self._on[key] = (q_pos, k_pos, hidden)
        return self._on[key]


@functools.lru_cache(maxsize=64)
def _plan(length: int, n: int, rank: int, load_balance: bool) -> _Plan:
    return _Plan(length, n, rank, load_balance)


# --- the ring ---------------------------------------------------------------------------------------------------------


def _rank_forward(q, ring, plan: _Plan, drop: _Dropout, kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's output (q's dtype) and log-sum-exp (accumulation dtype) over all the ring's blocks."""
    batch, heads, length, dim = q.shape
    scale = 1.0 / math.sqrt(dim)
    acc = {"device": q.device, "dtype": _acc_dtype(q.dtype)}
    out = torch.zeros((batch, heads, length, dim), **acc)  # normalised over the keys seen so far
    lse = torch.full((batch, heads, length), float("-inf"), **acc)  # their log-sum-exp
    for step, block in enumerate(plan.blocks):
        k, v = ring.kv(step).unbind(0)
        if block.empty:
            continue
        positions = plan.on(step, q.device)
        out_b, lse_b = _block_forward(
            _rows(q, block), _cols(k, block), _cols(v, block), positions, block, scale, drop, kernel
        )
        lse = _merge(out, lse, block, out_b, lse_b)
    return out.to(q.dtype), lse


def _rank_backward(d_out, q, out, lse, ring, plan: _Plan, drop: _Dropout, kernel) -> torch.Tensor:
    """One rank's dq (accumulation dtype); each block's dk/dv go into the accumulator the ring hands out."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    fused = kernel is not None and not drop.p
    products = not fused or plan.general_masks
    delta = (_acc(d_out) * _acc(out)).sum(-1, keepdim=True) if products else None  # rowsum(dO * O), the softmax's
    dq = torch.zeros(q.shape, device=q.device, dtype=_acc_dtype(q.dtype))
    for step, block in enumerate(plan.blocks):
        k, v = ring.kv(step).unbind(0)
        dk, dv = ring.dkv(step).unbind(0)
        if not block.empty:
            args = _rows(d_out, block), _rows(q, block), _cols(k, block), _cols(v, block)
            if fused and (not block.masked or block.causal):
                lse_rows = _contiguous(_rows(lse, block, -1))  # torch's context_parallel: a strided one reads wrong
                grads = kernel.backward(*args, _rows(out, block), lse_rows, block.causal, scale)
            else:
                positions = plan.on(step, q.device)
                grads = _product_backward(*args, _rows(lse, block, -1), _rows(delta, block), positions, scale, drop)
            _rows(dq, block).add_(grads[0])
            _cols(dk, block).add_(grads[1])
            _cols(dv, block).add_(grads[2])
        ring.done(step)
    return dq


# --- the operator ----------------------------------------------------------------------------------------------------


def _setup(q, k, v, seed, group_name, load_balance, dropout_p, batch_offset, head_offset):
    """The ring's messages, its rank's blocks, the dropout masks' maker and the kernel of one call."""
    group = group_named(group_name)
    n, rank = size_rank(group)
    batch, heads, length, _ = q.shape
    ring = MessageRing(group, n, rank, torch.stack([k, v]))
    drop = _Dropout(dropout_p, seed, batch, heads, (batch_offset, head_offset), q.device)
    return ring, _plan(length, n, rank, load_balance), drop, None if dropout_p else fused_kernel(q)


def _ring_forward(q, k, v, *options) -> tuple[torch.Tensor, torch.Tensor]:
    """The operator's forward: this rank's output (q's dtype) and log-sum-exp (accumulation dtype)."""
    return _rank_forward(q, *_setup(q, k, v, *options))


def _ring_backward(d_out, q, k, v, out, lse, *options) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The operator's backward: dq, dk, dv in the inputs' dtypes."""
    ring, plan, drop, kernel = _setup(q, k, v, *options)
    dq = _rank_backward(d_out.to(q.dtype), q, out, lse, ring, plan, drop, kernel)
    dk, dv = ring.own_dkv().unbind(0)
    # copies: an operator's outputs may not alias each other, and are fresh, as its fake kernel makes them
    return dq.to(q.dtype), dk.to(k.dtype, copy=True), dv.to(v.dtype, copy=True)


@torch.library.custom_op("scalelm::ring_attention", mutates_args=())
def _ring_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seed: Optional[Tensor],
    group_name: Optional[str],
    load_balance: bool,
    dropout_p: float,
    batch_offset: int,
    head_offset: int,
) -> tuple[Tensor, Tensor]:
    return _ring_forward(q, k, v, seed, group_name, load_balance, dropout_p, batch_offset, head_offset)


def _contiguous_like(t: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    """An empty tensor laid out as the ring's outputs always are, contiguous: what its fake kernels return (empty_like
    would keep the strides of a permuted input, dense or gapped, and compiled code would read the outputs wrong)."""
    return torch.empty(t.shape if shape is None else shape, dtype=dtype or t.dtype, device=t.device)


@_ring_attention_op.register_fake
def _(q, k, v, seed, group_name, load_balance, dropout_p, batch_offset, head_offset):
    return _contiguous_like(q), _contiguous_like(q, q.shape[:3], _acc_dtype(q.dtype))


@torch.library.custom_op("scalelm::ring_attention_backward", mutates_args=())
def _ring_attention_backward_op(
    d_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    seed: Optional[Tensor],
    group_name: Optional[str],
    load_balance: bool,
    dropout_p: float,
    batch_offset: int,
    head_offset: int,
) -> tuple[Tensor, Tensor, Tensor]:
    options = (seed, group_name, load_balance, dropout_p, batch_offset, head_offset)
    return _ring_backward(d_out, q, k, v, out, lse, *options)


@_ring_attention_backward_op.register_fake
def _(d_out, q, k, v, out, lse, seed, group_name, load_balance, dropout_p, batch_offset, head_offset):
    return _contiguous_like(q), _contiguous_like(k), _contiguous_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, seed, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seed)
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _backward(ctx, d_out, _d_lse):
    q, k, v, out, lse, seed = ctx.saved_tensors
    dq, dk, dv = _ring_attention_backward_op(d_out, q, k, v, out, lse, seed, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None


_ring_attention_op.register_autograd(_backward, setup_context=_setup_context)
RING_OP = torch.ops.scalelm.ring_attention.default  # what checkpoint policies see


def _seed_tensor(seed) -> torch.Tensor | None:
    if seed is None or isinstance(seed, torch.Tensor):
        return seed
    return torch.tensor(seed, dtype=torch.int64)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group=None,
    dropout_p: float = 0.0,
    seed: int | torch.Tensor | None = None,
    *,
    load_balance: bool = False,
    batch_offset: int = 0,
    head_offset: int = 0,
    group_name: str | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, whose parts the ranks of `group` hold.

    q, k, v: (batch, heads, local_seq, head_dim), this rank's part of every sequence as chunk_positions splits it
    (`load_balance`). group None or of one rank: plain causal attention, through the same code. seed (an int, or an
    int64 tensor, which keeps the call free of Python numbers under torch.compile): the dropout masks'; batch_offset
    and head_offset place this rank's batch and heads among the global ones (data or tensor parallelism), so that
    the dropout masks are those of the whole batch and all heads, whatever the split. group_name in place of group:
    what a compiled caller passes (dynamo does not read process groups' attributes)."""
    if isinstance(group, torch.Tensor):
        raise TypeError(
            "ring_attention takes no positions: they follow from the split, so pass load_balance= (and group=) instead"
        )
    if group is not None:
        group_name = group.group_name
    out, _ = _ring_attention_op(
        q, k, v, _seed_tensor(seed), group_name, load_balance, float(dropout_p), batch_offset, head_offset
    )
    return out


# --- one device: every rank's blocks ---------------------------------------------------------------------------------


class _Simulation:
    """Every rank's blocks of a cp-way split of whole sequences on one device, with LocalRing in place of messages."""

    def __init__(self, q, k, v, cp: int, load_balance: bool, dropout_p: float, seed):
        self.cp, self.load_balance = cp, load_balance
        self.qs, ks, vs = ([shard_sequence(t, 2, r, cp, load_balance) for r in range(cp)] for t in (q, k, v))
        self.kvs = [torch.stack([k_r, v_r]) for k_r, v_r in zip(ks, vs)]
        self.plans = [_plan(self.qs[0].shape[2], cp, r, load_balance) for r in range(cp)]
        self.drop = _Dropout(dropout_p, seed, q.shape[0], q.shape[1], (0, 0), q.device)
        self.kernel = None if dropout_p else fused_kernel(q)

    def forward(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every rank's output and log-sum-exp."""
        ranks = [
            _rank_forward(self.qs[r], LocalRing(self.kvs, None, r), self.plans[r], self.drop, self.kernel)
            for r in range(self.cp)
        ]
        return [out for out, _ in ranks], [lse for _, lse in ranks]

    def backward(self, d_out, outs, lses) -> list[torch.Tensor]:
        """dq, dk, dv of the whole sequences (accumulation dtype) from the whole output's gradient."""
        d_outs = [shard_sequence(d_out, 2, r, self.cp, self.load_balance) for r in range(self.cp)]
        dkvs = [torch.zeros(kv.shape, device=kv.device, dtype=_acc_dtype(kv.dtype)) for kv in self.kvs]
        dqs = [
            _rank_backward(
                d_outs[r],
                self.qs[r],
                outs[r],
                lses[r],
                LocalRing(self.kvs, dkvs, r),
                self.plans[r],
                self.drop,
                self.kernel,
            )
            for r in range(self.cp)
        ]
        dks, dvs = zip(*(dkv.unbind(0) for dkv in dkvs))
        return [_unsplit(list(g), 2, self.load_balance) for g in (dqs, dks, dvs)]


class _SimulatedRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp, load_balance, dropout_p, seed):
        simulation = _Simulation(q, k, v, cp, load_balance, dropout_p, seed)
        outs, lses = simulation.forward()
        ctx.save_for_backward(q, k, v, *outs, *lses)
        ctx.options = (cp, load_balance, dropout_p, seed)
        return _unsplit(outs, 2, load_balance)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, *rest = ctx.saved_tensors
        cp = ctx.options[0]
        grads = _Simulation(q, k, v, *ctx.options).backward(d_out.to(q.dtype), rest[:cp], rest[cp:])
        return *(g.to(t.dtype) for g, t in zip(grads, (q, k, v))), None, None, None, None


def simulated_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: int = 1,
    load_balance: bool = False,
    dropout_p: float = 0.0,
    seed: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """ring_attention's result for a `cp`-way split, every rank's blocks computed in turn on q's device, without a
    process group: q, k, v (batch, heads, seq, head_dim) hold whole sequences. Differentiable. The blocks' shapes,
    kernels and merges are a real ring's (half blocks under load balancing), so a single GPU checks them."""
    return _SimulatedRing.apply(q, k, v, cp, load_balance, float(dropout_p), _seed_tensor(seed))


# --- context parallelism applied to a model --------------------------------------------------------------------------


class SequenceSplit:
    """This rank's part of every sequence of a context-parallel group: which tokens (`shard`) and their global
    positions (`positions`), for the model's positional table and the ring's causal mask."""

    def __init__(self, group, load_balance: bool):
        self.group, self.load_balance = group, load_balance
        self.size, self.rank = size_rank(group)
        self.group_name = None if group is None else group.group_name  # what the ring operator takes
        self._positions: dict[tuple[int, torch.device], torch.Tensor] = {}

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return shard_sequence(x, dim, self.rank, self.size, self.load_balance)

    def positions(self, local_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The global positions of this rank's `local_len` tokens of each sequence, made on `device` once."""
        key = (local_len, torch.device(device))
        if key not in self._positions:
            whole = local_len * self.size
            self._positions[key] = chunk_positions(whole, self.rank, self.size, self.load_balance, key[1])
        return self._positions[key]


class RingCore:
    """Causal attention of a block's heads over the whole sequence (the model's attention calls it in place of
    scaled_dot_product_attention). The dropout masks' seed is one draw of the default CPU generator, which the ranks of
    a context-parallel group share (their RNG states are equal), so they drop the same probabilities; it stays a
    tensor, so that dynamo traces the draw. `tp_rank` places this rank's heads among all of them."""

    def __init__(self, split: SequenceSplit, tp_rank: int):
        self.split, self.tp_rank = split, tp_rank

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        seed = torch.randint(2**62, (), dtype=torch.int64) if dropout_p else None
        return ring_attention(
            q,
            k,
            v,
            None,
            dropout_p,
            seed,
            load_balance=self.split.load_balance,
            head_offset=self.tp_rank * q.shape[1],
            group_name=self.split.group_name,
        )


def apply_cp(model, split: SequenceSplit, tp_rank: int, tp_size: int) -> None:
    """Context parallelism on a TransformerLM, in place: its attention becomes a ring over the split's group, its
    positional table (llama: its rotary positions) is read at this rank's global positions, and its activation
    dropouts, each on this rank's own part of the sequence, draw from a stream of their own."""
    model.sequence_split = split
    for block in model.blocks.values():
        block.attn.core = RingCore(split, tp_rank)
        block.attn.sequence_split = split  # (llama's rotary positions: this rank's tokens' true ones)
    # streams 1.. are this rank's own across the cp x tp ranks that share the default generator (0: the shared one)
    model.split_dropout_streams(split.rank * tp_size + tp_rank + 1, sequence_parallel=True)
