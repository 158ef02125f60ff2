"""Context parallelism's core: causal ring attention over a group of ranks that each hold part of every sequence.

torch's own context_parallel needs CUDA kernels and NCCL; this one is written with plain tensor operations and
point-to-point messages, so it runs on CPUs and gloo as well (and on GPUs, without flash kernels).

Each rank keeps its queries and passes its key/value block around the ring (to rank + 1, from rank - 1); after
cp - 1 hops every query has met every key. A block's partial attention is merged into the running result through its
log-sum-exp (fp32), and blocks wholly in a query block's future are skipped. Backward recomputes the probabilities
block by block from the saved log-sum-exp; dq stays home, while the dk/dv accumulator of a block travels with it and
takes one last hop after the final step, which brings it back to its owner. On the CPU without dropout each block goes
through torch's flash kernel (`_scaled_dot_product_flash_attention_for_cpu` and its backward), which never holds a
block's whole score matrix; elsewhere, and for dropout, through plain matrix products.

Communication per attention call on a rank, with a local block of B x H x L x D elements of e bytes (q's dtype):
forward cp - 1 messages of 2 B H L D e bytes (k and v together) and one all-gather of the positions (cp L int64);
backward cp - 1 such key/value messages plus cp messages of 2 B H L D x 4 bytes (the fp32 dk/dv accumulators).

The split of the sequence (chunk_positions): contiguous, or load-balanced as in torchtitan, where rank r holds chunks
r and 2 cp - 1 - r of 2 cp, so that every rank gets the same share of the causal mask's work.

Attention dropout draws its masks from a counter-based hash of (seed, batch, head, query position, key position),
so they do not depend on cp or on the split: a run with cp = 2 drops the same probabilities as one without.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from scalelm.parallel.layout import sequence_chunk


def chunk_positions(seq_len: int, cp_rank: int, cp_size: int, load_balance: bool) -> torch.Tensor:
    """The global positions (int64, ascending) of the tokens of a sequence that rank `cp_rank` of `cp_size` holds."""
    chunk = sequence_chunk(seq_len, cp_size, load_balance)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside 0..{cp_size - 1}")
    if not load_balance:
        return torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, dtype=torch.int64)
    tail = 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk), torch.arange(tail * chunk, (tail + 1) * chunk)]
    ).to(torch.int64)


def shard_sequence(x: torch.Tensor, dim: int, cp_rank: int, cp_size: int, load_balance: bool) -> torch.Tensor:
    """This rank's part of `x` along `dim`, the tokens at chunk_positions (a view when the split is contiguous)."""
    chunk = sequence_chunk(x.size(dim), cp_size, load_balance)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside 0..{cp_size - 1}")
    if not load_balance:
        return x.narrow(dim, cp_rank * chunk, chunk)
    tail = 2 * cp_size - 1 - cp_rank
    return torch.cat([x.narrow(dim, cp_rank * chunk, chunk), x.narrow(dim, tail * chunk, chunk)], dim)


def _size_rank(group) -> tuple[int, int]:
    """group None stands for no context parallelism: one rank, whether or not a process group exists."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def gather_sequence(part: torch.Tensor, dim: int, group, load_balance: bool) -> torch.Tensor:
    """The whole sequence along `dim` from every rank's part (shard_sequence's inverse; not differentiable)."""
    n, _ = _size_rank(group)
    if n == 1:
        return part
    parts = [torch.empty_like(part, memory_format=torch.contiguous_format) for _ in range(n)]
    dist.all_gather(parts, part.contiguous(), group=group)
    seq_len = part.size(dim) * n
    order = torch.cat([chunk_positions(seq_len, r, n, load_balance) for r in range(n)]).to(part.device)
    return torch.cat(parts, dim).index_select(dim, torch.argsort(order))


# --- dropout masks ---------------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Chris Wellons' integer hash) on values in [0, 2^32) held in int64: its multipliers are below 2^31,
    so no product leaves int64's range and the result is the same on every device and build."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def _keep_scale(
    seed: int,
    dropout_p: float,
    batch: torch.Tensor,
    heads: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The dropout factor, 0 or 1 / (1 - p), of every (batch, head, query, key): shape (B, H, Lq, Lk).

    Each coordinate is folded into the hash in turn (xor, then mix), the cheap ones on small tensors first."""
    h = _mix32(torch.tensor([(seed & _M32) ^ 0x9E3779B9], dtype=torch.int64, device=q_pos.device))
    h = _mix32(h ^ ((seed >> 32) & _M32))
    h = _mix32(h ^ batch.view(-1, 1, 1, 1))
    h = _mix32(h ^ heads.view(1, -1, 1, 1))
    h = _mix32(h ^ q_pos.view(1, 1, -1, 1))
    h = _mix32(h ^ k_pos.view(1, 1, 1, -1))
    keep = h.to(torch.float64) * 2.0**-32 >= dropout_p  # a uniform in [0, 1), exact in float64
    return keep.to(dtype) * (1.0 / (1.0 - dropout_p))


class _Dropout:
    """What a block needs to regenerate its masks (scale() is None where dropout_p is 0: no masks computed)."""

    def __init__(self, dropout_p: float, seed: int | None, batch: int, heads: int, batch_offset: int, head_offset: int):
        if not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
        if dropout_p and seed is None:
            raise ValueError("attention dropout needs a seed: its masks are a function of it, the same on every rank")
        self.p, self.seed = dropout_p, seed
        self.batch = torch.arange(batch_offset, batch_offset + batch, dtype=torch.int64)
        self.heads = torch.arange(head_offset, head_offset + heads, dtype=torch.int64)

    def scale(self, q_pos: torch.Tensor, k_pos: torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
        """The factors for a block of scores `like`, computed on its device in its dtype."""
        if not self.p:
            return None
        on = like.device
        batch, heads, q_pos, k_pos = (t.to(on) for t in (self.batch, self.heads, q_pos, k_pos))
        return _keep_scale(self.seed, self.p, batch, heads, q_pos, k_pos, like.dtype)


# --- one block -------------------------------------------------------------------------------------------------------


class _Block:
    """The part of a (query block, key block) pair that the causal mask leaves anything in: the queries from `rows`
    on (the earlier ones see none of the keys) and the keys before `cols` (no query sees the later ones).

    Positions ascend, so both are ranges. Under the load-balanced split this halves every block but a rank's own,
    and leaves the half unmasked: that, not the skipped blocks, is what evens the ranks' work out. What is left is
    unmasked, or (a rank's own block: the same positions) causal, or, for positions no split makes, a general mask."""

    def __init__(self, q_pos: torch.Tensor, k_pos: torch.Tensor):
        self.rows = int((q_pos < k_pos[0]).sum())
        self.cols = int((k_pos <= q_pos[-1]).sum())
        self.empty = self.rows == q_pos.numel() or self.cols == 0
        self.q_pos, self.k_pos = q_pos[self.rows :], k_pos[: self.cols]
        # None: every query of the part sees every key of it
        self.mask = (
            None if self.empty or self.k_pos[-1] <= self.q_pos[0] else self.q_pos.view(-1, 1) >= self.k_pos.view(1, -1)
        )
        self.causal = self.mask is not None and torch.equal(self.q_pos, self.k_pos)


def _acc(t: torch.Tensor) -> torch.Tensor:
    """`t` in the accumulation dtype: fp32 for fp32 and narrower, float64 kept (the exact tests)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    s = torch.matmul(_acc(q), _acc(k).transpose(-2, -1)) * scale
    return s if mask is None else s.masked_fill(~mask.to(s.device), float("-inf"))


def _fused(q: torch.Tensor, block: _Block, drop: _Dropout) -> bool:
    """Whether a block goes through torch's CPU flash kernel, which never holds its whole score matrix: on the CPU,
    without dropout (the kernel's masks would not be the split-independent ones), unmasked or causal."""
    return q.device.type == "cpu" and not drop.p and (block.mask is None or block.causal)


def _block_forward(q, k, v, block: _Block, scale: float, drop: _Dropout) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's attention output, normalised over its own keys, and its log-sum-exp (both in the accumulation
    dtype): what the ring merges."""
    if _fused(q, block, drop):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, block.causal, scale=scale)
        return _acc(out), _acc(lse)
    s = _scores(q, k, scale, block.mask)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1))
    z = drop.scale(block.q_pos, block.k_pos, s)
    return torch.matmul(p if z is None else p * z, _acc(v)), lse


def _block_backward(d_out, q, k, v, out, lse, delta, block: _Block, scale: float, drop: _Dropout):
    """A block's dq, dk, dv (accumulation dtype), from the whole attention's output and log-sum-exp: the
    probabilities are recomputed against the final normalisation, so the blocks' gradients add up."""
    if _fused(q, block, drop):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out.to(q.dtype), q, k, v, out, lse, 0.0, block.causal, scale=scale
        )
        return tuple(_acc(g) for g in grads)
    d_out, q, k, v = _acc(d_out), _acc(q), _acc(k), _acc(v)
    s = _scores(q, k, scale, block.mask)
    p = torch.exp(s - lse.unsqueeze(-1))  # the undropped probabilities; masked entries are exp(-inf) = 0
    z = drop.scale(block.q_pos, block.k_pos, s)
    dp = torch.matmul(d_out, v.transpose(-2, -1))
    if z is not None:
        dp = dp * z
    ds = p * (dp - delta)
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q) * scale
    dv = torch.matmul((p if z is None else p * z).transpose(-2, -1), d_out)
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, group, dropout_p, seed, batch_offset, head_offset):
        n, rank = _size_rank(group)
        batch, heads, length, dim = q.shape
        scale = 1.0 / math.sqrt(dim)
        drop = _Dropout(dropout_p, seed, batch, heads, batch_offset, head_offset)
        # the positions stay on the CPU: the block bounds are Python ints, which would otherwise sync with a GPU
        q_pos = positions.to(device="cpu", dtype=torch.int64)
        if q_pos.shape != (length,) or not bool(torch.all(q_pos[1:] > q_pos[:-1])):
            raise ValueError(f"positions must be {length} ascending integers (chunk_positions), got {positions}")
        all_pos = _all_positions(q_pos, group, n, q.device)
        ring = _Ring(group, n, rank)

        like = {"device": q.device, "dtype": _acc(q).dtype}
        out = torch.zeros((batch, heads, length, dim), **like)  # normalised over the keys seen so far
        lse = torch.full((batch, heads, length), float("-inf"), **like)  # their log-sum-exp
        kv = torch.stack([k, v])
        for step in range(n):
            nxt = ring.pass_on(kv, tag=0) if step < n - 1 else None  # the next block travels while this one computes
            block = _Block(q_pos, all_pos[(rank - step) % n])
            if not block.empty:
                rows, cols = slice(block.rows, None), slice(None, block.cols)
                out_b, lse_b = _block_forward(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], block, scale,
                                              drop)  # fmt: skip
                merged = torch.logaddexp(lse[..., rows], lse_b)  # every row of a block sees a key: lse_b is finite
                out[..., rows, :] = (out[..., rows, :] * torch.exp(lse[..., rows] - merged).unsqueeze(-1)
                                     + out_b * torch.exp(lse_b - merged).unsqueeze(-1))  # fmt: skip
                lse[..., rows] = merged
            if nxt is not None:
                kv = nxt.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, q_pos, all_pos)
        ctx.group, ctx.drop, ctx.scale = group, drop, scale
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, q_pos, all_pos = ctx.saved_tensors
        n, rank = _size_rank(ctx.group)
        ring = _Ring(ctx.group, n, rank)
        delta = (_acc(d_out) * _acc(out)).sum(-1, keepdim=True)  # D = rowsum(dO * O): the softmax's backward term

        dq = torch.zeros_like(_acc(q))
        dkv = torch.zeros((2, *k.shape), device=k.device, dtype=dq.dtype)  # the dk/dv accumulator of the block in hand
        kv = torch.stack([k, v])
        incoming = None
        for step in range(n):
            nxt = ring.pass_on(kv, tag=0) if step < n - 1 else None
            if incoming is not None:
                dkv = incoming.wait()  # the accumulator of the block that has just arrived, from the rank before
            block = _Block(q_pos, all_pos[(rank - step) % n])
            if not block.empty:
                rows, cols = slice(block.rows, None), slice(None, block.cols)
                dq_b, dk_b, dv_b = _block_backward(
                    d_out[..., rows, :], q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], out[..., rows, :],
                    lse[..., rows], delta[..., rows, :], block, ctx.scale, ctx.drop,
                )  # fmt: skip
                dq[..., rows, :] += dq_b
                dkv[0][..., cols, :] += dk_b
                dkv[1][..., cols, :] += dv_b
            if n > 1:
                incoming = ring.pass_on(dkv, tag=1)  # after the last step this hop brings each block home
            if nxt is not None:
                kv = nxt.wait()
        if incoming is not None:
            dkv = incoming.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


def _all_positions(q_pos: torch.Tensor, group, n: int, device: torch.device) -> torch.Tensor:
    """Every rank's positions, (n, L) on the CPU: one small all-gather (on the tensors' device, which NCCL needs),
    so the ring's messages carry only keys and values."""
    if n == 1:
        return q_pos.unsqueeze(0)
    # the list form: all_gather_into_tensor is deprecated in torch 2.13, and its successor absent from torch 2.6
    mine = q_pos.to(device)
    out = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(out, mine, group=group)
    return torch.stack(out).cpu()


class _Transfer:
    def __init__(self, works, buffer: torch.Tensor):
        self.works, self.buffer = works, buffer

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.buffer


class _Ring:
    """Sends to the next rank of the group and receives from the one before, by global rank as P2POp wants."""

    def __init__(self, group, n: int, rank: int):
        self.group = group
        if n > 1:
            self.to = dist.get_global_rank(group, (rank + 1) % n)
            self.frm = dist.get_global_rank(group, (rank - 1) % n)

    def pass_on(self, tensor: torch.Tensor, tag: int) -> _Transfer:
        """Start sending `tensor` on and receiving its successor; the tag keeps the key/value stream apart from the
        accumulators' when both are in flight between the same two ranks (gloo matches by peer and tag)."""
        buffer = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.to, self.group, tag),
            dist.P2POp(dist.irecv, buffer, self.frm, self.group, tag),
        ]
        return _Transfer(dist.batch_isend_irecv(ops), buffer)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    group=None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    *,
    batch_offset: int = 0,
    head_offset: int = 0,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, whose parts the ranks of `group` hold.

    q, k, v: (batch, heads, local_seq, head_dim), the tokens at global `positions` (every rank's positions have the
    same length). group None or of one rank: plain masked attention, through the same code. batch_offset and
    head_offset place this rank's batch and heads among the global ones (data or tensor parallelism), so that the
    dropout masks are those of the whole batch and all heads, whatever the split."""
    return _RingAttention.apply(q, k, v, positions, group, dropout_p, seed, batch_offset, head_offset)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    seed: int | None = None,
    *,
    batch_offset: int = 0,
    head_offset: int = 0,
) -> torch.Tensor:
    """ring_attention's result on one process with the whole sequence (positions 0..S-1), by plain autograd
    operations on the full score matrix, with the same dropout masks."""
    batch, heads, length, dim = q.shape
    drop = _Dropout(dropout_p, seed, batch, heads, batch_offset, head_offset)
    pos = torch.arange(length, device=q.device)
    s = _scores(q, k, 1.0 / math.sqrt(dim), pos.view(-1, 1) >= pos.view(1, -1))
    p = torch.softmax(s, dim=-1)
    z = drop.scale(pos, pos, s)
    if z is not None:
        p = p * z
    return torch.matmul(p, _acc(v)).to(q.dtype)


# --- context parallelism applied to a model --------------------------------------------------------------------------


class SequenceSplit:
    """This rank's part of every sequence of a context-parallel group: which tokens (`shard`) and their global
    positions (`positions`), for the model's positional table and the ring's causal mask."""

    def __init__(self, group, load_balance: bool):
        self.group, self.load_balance = group, load_balance
        self.size, self.rank = _size_rank(group)
        self._positions: dict[tuple[int, torch.device], torch.Tensor] = {}

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return shard_sequence(x, dim, self.rank, self.size, self.load_balance)

    def positions(self, local_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The global positions of this rank's `local_len` tokens of each sequence (kept per device: no copy a step)."""
        key = (local_len, torch.device(device))
        if key not in self._positions:
            whole = local_len * self.size
            self._positions[key] = chunk_positions(whole, self.rank, self.size, self.load_balance).to(key[1])
        return self._positions[key]


class RingCore:
    """Causal attention of a block's heads over the whole sequence (the model's attention calls it in place of
    scaled_dot_product_attention). The dropout masks' seed is one draw of the default CPU generator, which the ranks of
    a context-parallel group share (their RNG states are equal), so they drop the same probabilities; `tp_rank` places
    this rank's heads among all of them."""

    def __init__(self, split: SequenceSplit, tp_rank: int):
        self.split, self.tp_rank = split, tp_rank

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        seed = int(torch.randint(2**62, ())) if dropout_p else None
        positions = self.split.positions(q.shape[2])
        return ring_attention(
            q, k, v, positions, self.split.group, dropout_p, seed, head_offset=self.tp_rank * q.shape[1]
        )


def apply_cp(model, split: SequenceSplit, tp_rank: int, tp_size: int) -> None:
    """Context parallelism on a TransformerLM, in place: its attention becomes a ring over the split's group, its
    positional table is read at this rank's global positions, and its activation dropouts, each on this rank's own
    part of the sequence, draw from a stream of their own."""
    model.sequence_split = split
    for block in model.blocks.values():
        block.attn.core = RingCore(split, tp_rank)
    # streams 1.. are this rank's own across the cp x tp ranks that share the default generator (0: the shared one)
    model.split_dropout_streams(split.rank * tp_size + tp_rank + 1, sequence_parallel=True)
