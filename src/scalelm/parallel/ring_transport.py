"""The ring's communication (scalelm.parallel.context schedules the ring, scalelm.parallel.ring_blocks computes its
blocks): where a rank's key/value blocks, and their dk/dv accumulators, come from at each step.

`MessageRing` is a real ring over a process group: each rank sends to rank + 1 and receives from rank - 1, the next
block in flight while this one computes. `LocalRing` hands every rank's blocks out of shared lists on one device
(simulated_ring_attention). Both answer the same three calls: `kv(step)`, `dkv(step)`, `done(step)`.

Communication per attention call on a rank, with a local block of B x H x L x D elements of e bytes (q's dtype):
forward cp - 1 messages of 2 B H L D e bytes (k and v together); backward cp - 1 such key/value messages plus cp
messages of 2 B H L D x 4 bytes (the fp32 dk/dv accumulators).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from scalelm.parallel.ring_blocks import _acc_dtype


def size_rank(group) -> tuple[int, int]:
    """group None stands for no context parallelism: one rank, whether or not a process group exists."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def group_named(name: str | None):
    """The process group an operator got by name (operators take no process groups)."""
    if name is None:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


class _Transfer:
    def __init__(self, works, buffer: torch.Tensor):
        self.works, self.buffer = works, buffer

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.buffer


class MessageRing:
    """Where a rank's blocks come from in a real ring: sends to the next rank of the group and receives from the one
    before (by global rank, as P2POp wants), the next block in flight while this one computes."""

    def __init__(self, group, n: int, rank: int, kv: torch.Tensor):
        self.group, self.n = group, n
        if n > 1:
            self.to = dist.get_global_rank(group, (rank + 1) % n)
            self.frm = dist.get_global_rank(group, (rank - 1) % n)
        self._kv, self._next, self._incoming, self._dkv = kv, None, None, None

    def _pass_on(self, tensor: torch.Tensor, tag: int) -> _Transfer:
        """Start sending `tensor` on and receiving its successor; the tag keeps the key/value stream apart from the
        accumulators' when both are in flight between the same two ranks (gloo matches by peer and tag)."""
        buffer = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.to, self.group, tag),
            dist.P2POp(dist.irecv, buffer, self.frm, self.group, tag),
        ]
        return _Transfer(dist.batch_isend_irecv(ops), buffer)

    def kv(self, step: int) -> torch.Tensor:
        """The keys and values (stacked) of step `step`'s block."""
        if step:
            self._kv = self._next.wait()
        self._next = self._pass_on(self._kv, tag=0) if step < self.n - 1 else None
        return self._kv

    def dkv(self, step: int) -> torch.Tensor:
        """The dk/dv accumulator of step `step`'s block, which arrived with it from the rank before."""
        if step:
            self._dkv = self._incoming.wait()
        elif self._dkv is None:
            self._dkv = torch.zeros(self._kv.shape, device=self._kv.device, dtype=_acc_dtype(self._kv.dtype))
        return self._dkv

    def done(self, step: int) -> None:
        """Step `step`'s block is done: its accumulator travels on (after the last step: home)."""
        if self.n > 1:
            self._incoming = self._pass_on(self._dkv, tag=1)

    def own_dkv(self) -> torch.Tensor:
        return self._incoming.wait() if self._incoming is not None else self._dkv


class LocalRing:
    """Every rank's blocks on one device (simulated_ring_attention): rank `rank`'s view of shared lists."""

    def __init__(self, kvs: list[torch.Tensor], dkvs: list[torch.Tensor] | None, rank: int):
        self.kvs, self.dkvs, self.rank, self.n = kvs, dkvs, rank, len(kvs)

    def kv(self, step: int) -> torch.Tensor:
        return self.kvs[(self.rank - step) % self.n]

    def dkv(self, step: int) -> torch.Tensor:
        return self.dkvs[(self.rank - step) % self.n]

    def done(self, step: int) -> None:
        pass
