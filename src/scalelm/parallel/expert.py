"""Expert parallelism: a mixture's experts split over `ep` ranks borrowed from the data-parallel shards (torchtitan's
choice), each token sent to its experts' ranks and back by all-to-all.

    ranks       dp_shard's ranks in groups of ep consecutive ones; a group holds every expert once, a rank
                experts / ep of them (a DTensor sharded along the experts over the `ep` mesh), and each rank's
                tokens go to whichever rank of its group holds their experts
    dispatch    every rank tells each rank of its group how many rows it sends to each of that rank's experts (an
                all-to-all of counts), then sends the rows (an all-to-all with those splits), which the receiver
                groups by expert, runs through them, and sends back in the order they came (the same splits swapped);
                the host reads the counts sent and received once, together (the one sync of a mixture's forward),
                the backward reuses those splits, and activation checkpointing never runs the exchange again
    gradients   the all-to-all's backward carries the gradients back, so an expert's gradient on its rank sums the
                group's tokens; FSDP shards each rank's experts over the ranks holding the same ones (`expert_dp`:
                the other groups of dp_shard, and the replicas), reduce-scatters their gradients during the backward
                and divides them by every data-parallel rank, as it averages the rest (scalelm.parallel.data)
    meshes      `ep` and `expert_dp` are cut from the world mesh with dp_shard unflattened into (efsdp, ep)
                (scalelm.parallel.dims.EXPERT_MESH_DIMS, scalelm.parallel.runtime.Meshes): FSDP combines the experts'
                two meshes into one, which it can only do for meshes of one root

Every row is computed by its expert alone and a token's outputs are summed in the order of its choices, so the
layout changes only how rows are batched: an ep run computes what one process does (tests/test_training.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from scalelm.model.moe import GroupedExperts, mixtures


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits, differentiable: the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, received: list[int], sent: list[int], group) -> torch.Tensor:
        ctx.received, ctx.sent, ctx.group = received, sent, group
        out = rows.new_empty((sum(received), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), received, sent, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.sent, ctx.received, ctx.group), None, None, None


def all_to_all(rows: torch.Tensor, received: list[int], sent: list[int], group) -> torch.Tensor:
    """Send sent[r] rows (in order) to rank r of `group`, receive received[r] from each."""
    return _AllToAll.apply(rows, received, sent, group)


@dataclass
class ExpertDispatch:
    """A mixture's `dispatch` under expert parallelism: the routed rows of every expert to the rank holding it."""

    group: dist.ProcessGroup
    ranks: int  # ep
    local_experts: int  # experts / ep

    def __call__(self, routed: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        # counts[e]: rows of this rank for expert e; rank r of the group holds experts r x local_experts, ...
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts, group=self.group)
        sent, received, per_expert = self.splits(torch.cat([counts, incoming]).tolist())  # the one host read
        rows = all_to_all(routed, received, sent, self.group)
        # the rows came by source rank, each source's by expert: regroup them by expert, in source order
        expert_of_row = torch.arange(self.local_experts, device=rows.device).repeat(self.ranks)
        by_expert = expert_of_row.repeat_interleave(incoming, output_size=rows.shape[0]).argsort(stable=True)
        local_counts = incoming.view(self.ranks, self.local_experts).sum(dim=0)
        out = experts(rows[by_expert], local_counts, per_expert)
        back = torch.empty_like(out).index_copy_(0, by_expert, out)
        return all_to_all(back, sent, received, self.group)

    def splits(self, counts: list[int]) -> tuple[list[int], list[int], list[int]]:
        """From this rank's counts per expert and, after them, the counts it receives ([source rank, local expert]):
        the rows it sends to each rank, receives from each, and gets for each of its experts."""
        mine, incoming = counts[: len(counts) // 2], counts[len(counts) // 2 :]
        experts = self.local_experts
        sent = [sum(mine[r * experts : (r + 1) * experts]) for r in range(self.ranks)]
        received = [sum(incoming[r * experts : (r + 1) * experts]) for r in range(self.ranks)]
        per_expert = [sum(incoming[e::experts]) for e in range(experts)]
        return sent, received, per_expert


def apply_ep(model: nn.Module, ep: DeviceMesh) -> None:
    """Split every mixture's experts over the `ep` mesh (a model or pipeline stage on the meta device) and send their
    rows there."""
    ranks = ep.size()
    for moe in mixtures(model).values():
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        moe.dispatch = ExpertDispatch(ep.get_group(), ranks, moe.experts_count // ranks)
