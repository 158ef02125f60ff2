"""A mixture of experts in place of a block's feed-forward network (model.moe; torchtitan's token-choice MoE).

    router      a linear map to one score per expert; softmax; each token goes to its top_k experts, equal scores to
                the lower index (a stable sort), whatever the layout (scores apart by rounding alone may still go
                either way: layouts batch the router's product differently)
    experts     top_k feed-forward networks per token, every routed token computed (dropless: no capacity, no token
                dropped), weighted by its router probabilities renormalised over its top_k
    aux loss    Switch's load-balancing loss per sequence, experts x sum_e (share of the sequence's choices that went
                to e) x (mean router probability of e), 1 when balanced; per sequence, so that it is the same function
                whichever ranks hold the sequences. It joins the training loss through scalelm.model.loss

The experts hold their FFNs stacked along dim 0 (`GroupedExperts`): expert parallelism (scalelm.parallel.expert)
splits them there and replaces `dispatch`, which runs the routed tokens through their experts, by an all-to-all to
the experts' ranks and back. The layer counts the tokens each expert got and its aux loss once per trained
micro-batch (in the backward: a recomputed forward would count twice, an evaluation not at all); scalelm's
instruments read and reset them (`take_load`). While a pipeline infers its stages' shapes (`shapes_only`: torch runs
the stage on placeholder or meta tensors) a mixture routes nothing, sends nothing and counts nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from scalelm.config import ModelConfig
from scalelm.model.loss import join_auxiliary_loss


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (a mixture's experts under expert parallelism, FSDP's or
    tensor parallelism's shards), else all of it."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class GroupedExperts(nn.Module):
    """`experts` FFNs (up, ReLU, down, as FeedForward, without its inner dropout: a token's place in its expert's
    batch depends on the layout) stacked along dim 0; a rank holds all of them, or its share under expert
    parallelism."""

    def __init__(self, experts: int, d_model: int, d_ff: int):
        super().__init__()
        self.up_weight = nn.Parameter(torch.empty(experts, d_ff, d_model))
        self.up_bias = nn.Parameter(torch.empty(experts, d_ff))
        self.down_weight = nn.Parameter(torch.empty(experts, d_model, d_ff))
        self.down_bias = nn.Parameter(torch.empty(experts, d_model))

    def reset_parameters(self) -> None:
        """Each expert as a dense FFN's layers are initialised (TransformerLM.reset_parameters)."""
        for weight in (self.up_weight, self.down_weight):
            for matrix in weight:
                nn.init.xavier_uniform_(matrix)
        nn.init.zeros_(self.up_bias)
        nn.init.zeros_(self.down_bias)

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """tokens (rows, d) grouped by expert, counts[e] rows for this rank's expert e -> their outputs, in order."""
        weights = [local(p).to(tokens.dtype) for p in (self.up_weight, self.up_bias, self.down_weight, self.down_bias)]
        outputs = []
        for e, rows in enumerate(tokens.split(counts)):
            up_w, up_b, down_w, down_b = (w[e] for w in weights)
            outputs.append(F.linear(F.relu(F.linear(rows, up_w, up_b)), down_w, down_b))
        return torch.cat(outputs)


def local_dispatch(routed: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
    """Every expert on this rank: the routed rows (grouped by expert, counts[e] for expert e) through their experts."""
    return experts(routed, counts.tolist())


_shapes_only = False


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Forwards (and their backwards) inside only tell shapes: a mixture returns zeros of its output's shape."""
    global _shapes_only
    before, _shapes_only = _shapes_only, True
    try:
        yield
    finally:
        _shapes_only = before


class _CountOnBackward(torch.autograd.Function):
    """Passes `output` through; `count()` runs once, in the backward."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, count: Callable[[], None]) -> torch.Tensor:
        ctx.count = count
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.count()
        return grad, None


class MoE(nn.Module):
    """Router, experts and the load-balancing loss of one block (module docstring)."""

    def __init__(self, model: ModelConfig, block: int):
        super().__init__()
        config, d_model = model.moe, model.d_model
        self.block = block  # its index in the whole model (a pipeline stage's blocks keep theirs)
        self.experts_count, self.top_k = config.experts, config.top_k
        self.router = nn.Linear(d_model, config.experts, bias=False)
        self.experts = GroupedExperts(config.experts, d_model, model.expert_width())
        # the aux loss's weight in the training loss: the coefficient, shared by the model's mixtures
        self.aux_weight = config.aux_loss_coef / sum(config.is_moe_block(i) for i in range(model.n_layers))
        self.dispatch = local_dispatch  # expert parallelism sends the rows to the experts' ranks instead
        self.load: torch.Tensor | None = None  # tokens each expert got since `take_load`
        self.aux_sum: torch.Tensor | None = None  # the aux losses since `take_load`, and their count
        self.aux_count = 0

    # the routing's sizes depend on the data (a split per expert, an all-to-all's counts): torch.compile would
    # recompile it at every step; the rest of a compiled block compiles, this runs eagerly
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _shapes_only:
            return x * 0
        batch, seq, d = x.shape
        tokens = x.reshape(-1, d)
        probs = self.router(tokens).float().softmax(dim=-1)  # (tokens, experts)
        chosen = probs.argsort(dim=-1, descending=True, stable=True)[:, : self.top_k]  # ties: the lower index
        weights = probs.gather(1, chosen)
        weights = weights / weights.sum(dim=1, keepdim=True)

        # rows (token, choice) grouped by expert, in token order within each: the order does not depend on the layout
        flat = chosen.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.experts_count)
        routed = self.dispatch(tokens[order // self.top_k], counts, self.experts)
        unsorted = torch.empty_like(routed).index_copy_(0, order, routed)
        y = (unsorted.view(-1, self.top_k, d) * weights.unsqueeze(-1).to(unsorted.dtype)).sum(dim=1)

        aux = self.balance_loss(probs.view(batch, seq, -1), chosen.view(batch, seq, -1))
        y = join_auxiliary_loss(y, aux, self.aux_weight)
        if torch.is_grad_enabled():
            counted = counts.detach().float()
            y = _CountOnBackward.apply(y, lambda: self.count(counted, aux.detach()))
        return y.view(batch, seq, d)

    def balance_loss(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Switch's load-balancing loss, per sequence, averaged over the sequences: probs (batch, seq, experts),
        chosen (batch, seq, top_k)."""
        choices = F.one_hot(chosen, self.experts_count).sum(dim=(1, 2)).float()  # (batch, experts)
        share = choices / (chosen.shape[1] * self.top_k)
        return self.experts_count * (share * probs.mean(dim=1)).sum(dim=-1).mean()

    def count(self, counts: torch.Tensor, aux: torch.Tensor) -> None:
        self.load = counts if self.load is None else self.load + counts
        self.aux_sum = aux if self.aux_sum is None else self.aux_sum + aux
        self.aux_count += 1

    def take_load(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Tokens per expert, the sum of the aux losses and their count since the last call; zeros where none."""
        device = self.router.weight.device
        load = self.load if self.load is not None else torch.zeros(self.experts_count, device=device)
        aux = self.aux_sum if self.aux_sum is not None else torch.zeros((), device=device)
        taken = (load, aux, self.aux_count)
        self.load, self.aux_sum, self.aux_count = None, None, 0
        return taken


def mixtures(model: nn.Module) -> dict[int, MoE]:
    """The model's mixtures by their block's index in the whole model (a pipeline stage's blocks keep theirs)."""
    return {module.block: module for module in model.modules() if isinstance(module, MoE)}
