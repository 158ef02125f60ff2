"""A mixture of experts in place of a block's feed-forward network (model.moe; torchtitan's token-choice MoE).

    router      a linear map to one score per expert; softmax; each token goes to its top_k experts, equal scores to
                the lower index (a stable sort), whatever the layout (scores apart by rounding alone may still go
                either way: layouts batch the router's product differently)
    experts     top_k feed-forward networks per token, every routed token computed (dropless: no capacity, no token
                dropped), weighted by its router probabilities renormalised over its top_k
    balance     model.moe.balance: `aux` adds Switch's load-balancing loss per sequence to the training loss (with
                aux_loss_coef), experts x sum_e (share of the sequence's choices that went to e) x (mean router
                probability of e), 1 when balanced; per sequence, so that it is the same function whichever ranks
                hold the sequences (computed and measured under every balance). `bias` is DeepSeek-V3's
                auxiliary-loss-free balancing: a per-expert bias, added to the scores only to choose the top_k (the
                weights stay the router's probabilities), moves by bias_rate after every optimizer step, up for the
                experts below the mean load and down for those above (`update_expert_biases`), from the step's
                tokens over every data-parallel rank, so that it is the same in every layout; a buffer, checkpointed
                with the weights. `none`: neither
    z-loss      ST-MoE's router z-loss (z_loss_coef > 0): the mean squared log-sum-exp of the router's scores, which
                keeps them small; both losses join the training loss through scalelm.model.loss

The experts hold their FFNs stacked along dim 0 (`GroupedExperts`): expert parallelism (scalelm.parallel.expert)
splits them there and replaces `dispatch`, which runs the routed tokens through their experts, by an all-to-all to
the experts' ranks and back. That exchange (`MoE.exchange`) is the routing's one data-dependent part: it runs
eagerly and once (torch.compile compiles the block around it; activation checkpointing recomputes none of it) and
reads the host at most once (expert parallelism's row counts; in one process none where the experts' product is
grouped, `grouped_product`). The layer counts the tokens each expert got and its aux loss once per trained
micro-batch (in the backward: a forward without one, an evaluation's, counts nothing); scalelm's
instruments read and reset them (`take_load`). While a pipeline infers its stages' shapes (`shapes_only`: torch runs
the stage on placeholder or meta tensors) a mixture routes nothing, sends nothing and counts nothing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from scalelm.config import ModelConfig
from scalelm.model.dtensors import local_shard
from scalelm.model.gpu_ops import compute_dtype
from scalelm.model.loss import join_auxiliary_loss

GROUPED, LOOP = "grouped_mm", "per_expert_loop"  # the experts' two products (`grouped_product` chooses)


class GroupedExperts(nn.Module):
    """`experts` FFNs (up, ReLU, down, as FeedForward, without its inner dropout: a token's place in its expert's
    batch depends on the layout) stacked along dim 0, or with `gated` (model.family llama) SwiGLU FFNs without biases
    (w2(silu(w1 x) * w3 x), as scalelm.model.llama.SwiGLU); a rank holds all of them, or its share under expert
    parallelism. Their products are one grouped product per matrix (`torch._grouped_mm`, the expert of each row
    given by offsets on the device: no host read), where `grouped_product` says it runs; elsewhere one product per
    expert, for which the caller reads the row counts to the host once."""

    def __init__(self, experts: int, d_model: int, d_ff: int, gated: bool = False):
        super().__init__()
        self.product: str | None = None  # the product the last forward ran: GROUPED or LOOP (run.json names it)
        self.gated = gated
        if gated:
            self.w1 = nn.Parameter(torch.empty(experts, d_ff, d_model))
            self.w3 = nn.Parameter(torch.empty(experts, d_ff, d_model))
            self.w2 = nn.Parameter(torch.empty(experts, d_model, d_ff))
            return
        self.up_weight = nn.Parameter(torch.empty(experts, d_ff, d_model))
        self.up_bias = nn.Parameter(torch.empty(experts, d_ff))
        self.down_weight = nn.Parameter(torch.empty(experts, d_model, d_ff))
        self.down_bias = nn.Parameter(torch.empty(experts, d_model))

    def matrices(self) -> list[nn.Parameter]:
        return [self.w1, self.w3, self.w2] if self.gated else [self.up_weight, self.down_weight]

    def reset_parameters(self) -> None:
        """Each expert as a dense FFN's layers are initialised (TransformerLM.reset_parameters)."""
        for weight in self.matrices():
            for matrix in weight:
                nn.init.xavier_uniform_(matrix)
        if not self.gated:
            nn.init.zeros_(self.up_bias)
            nn.init.zeros_(self.down_bias)

    def grouped(self, tokens: torch.Tensor) -> bool:
        """Whether `forward` runs `tokens` through one grouped product (else a product per expert: the caller passes
        the row counts on the host)."""
        return grouped_product(tokens, [local_shard(w) for w in self.matrices()])

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor, host_counts: list[int] | None = None) -> torch.Tensor:
        """tokens (rows, d) grouped by expert, counts[e] rows for this rank's expert e (on the tokens' device; where
        the product loops over the experts, `host_counts`, the same on the host) -> their outputs, in order."""
        grouped = self.grouped(tokens)
        self.product = GROUPED if grouped else LOOP
        if grouped:
            dtype = compute_dtype(tokens, tokens)  # the weights are cast to the tokens' dtype
            offsets = counts.cumsum(0, dtype=torch.int32)

            def linear(rows, weight, bias=None):
                return _grouped_linear(rows, weight, bias, counts, offsets)

            return _DenseGradient.apply(self.ffn(tokens.to(dtype), self.weights(dtype), linear))
        weights = self.weights(tokens.dtype)  # (autocast casts them for its products)
        outputs = []
        for e, rows in enumerate(tokens.split(host_counts if host_counts is not None else counts.tolist())):
            outputs.append(self.ffn(rows, [w[e] for w in weights], F.linear))
        return torch.cat(outputs)

    def ffn(self, rows: torch.Tensor, weights: list[torch.Tensor], linear: Callable) -> torch.Tensor:
        """The experts' FFN of `rows` with `weights` (`weights`' order), its products by `linear(rows, w, b)`."""
        if self.gated:
            w1, w3, w2 = weights
            return linear(F.silu(linear(rows, w1)) * linear(rows, w3), w2)
        up_w, up_b, down_w, down_b = weights
        return linear(F.relu(linear(rows, up_w, up_b)), down_w, down_b)

    def weights(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """This rank's parameters (up weight and bias, down weight and bias; gated: w1, w3, w2), in `dtype`."""
        params = self.matrices() if self.gated else [self.up_weight, self.up_bias, self.down_weight, self.down_bias]
        return [local_shard(p).to(dtype) for p in params]


def _grouped_linear(
    rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, counts: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """F.linear of each expert's rows with its weight (experts, out, in) and bias (experts, out; None: none): one
    grouped product, each row's bias gathered by its expert (as torchtitan's GPT-OSS experts; output_size: no host
    read)."""
    product = torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)
    if bias is None:
        return product
    return product + bias.repeat_interleave(counts, dim=0, output_size=rows.shape[0])


class _DenseGradient(torch.autograd.Function):
    """Passes `output` through; its gradient made contiguous, as the grouped product's backward requires (a sum's
    gradient, say, is expanded from one number)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor) -> torch.Tensor:
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


@functools.cache
def _grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch runs `torch._grouped_mm` on `device` in `dtype` without reading the offsets back to the
    host: CUDA's grouped kernel for bf16 on sm90 (elsewhere CUDA copies the offsets to the host and loops, as the
    per-expert loop does visibly; sm100's kernel failed to launch in torch 2.10 builds, so Blackwell keeps the loop
    until a GPU shows otherwise); on CPU, where the offsets already are, its loop of products (torch 2.9 and later:
    tried once)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] == 9
    if device.type != "cpu":
        return False
    rows, weights = torch.zeros(1, 8, dtype=dtype, device=device), torch.zeros(1, 8, 8, dtype=dtype, device=device)
    try:
        torch._grouped_mm(rows, weights, offs=torch.ones(1, dtype=torch.int32, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def grouped_product(tokens: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """The one place the experts' product is chosen: grouped where torch runs it for the tokens' device and the
    products' precision and every operand (the rows, the weights they multiply) meets its alignment (16 bytes, for
    addresses and rows); else the per-expert loop."""
    dtype = compute_dtype(tokens, tokens)  # the weights are cast to the tokens' dtype
    if not _grouped_mm_runs(tokens.device, dtype):
        return False
    aligned = 16 // dtype.itemsize
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 and t.shape[-1] % aligned == 0 for t in [tokens, *weights])


def local_dispatch(routed: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
    """Every expert on this rank: the routed rows (grouped by expert, counts[e] for expert e) through their experts;
    the counts read to the host only where the product loops over the experts."""
    return experts(routed, counts, None if experts.grouped(routed) else counts.tolist())


_shapes_only = False
ROUTER_INIT_STD = 0.02


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Forwards (and their backwards) inside only tell shapes: a mixture returns zeros of its output's shape."""
    global _shapes_only
    before, _shapes_only = _shapes_only, True
    try:
        yield
    finally:
        _shapes_only = before


def tally(choices: torch.Tensor, experts: int) -> torch.Tensor:
    """How many of `choices` (expert indices along the last dimension) went to each expert: torch.bincount, batched,
    in a shape known without reading the data (no host read, where bincount and one_hot make one on some devices;
    torch.compile traces it)."""
    return choices.new_zeros(*choices.shape[:-1], experts).scatter_add_(-1, choices, torch.ones_like(choices))


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
        self.experts = GroupedExperts(config.experts, d_model, model.expert_width(), gated=model.family == "llama")
        # the aux and z losses' weights in the training loss: their coefficients, shared by the model's mixtures
        count = sum(config.is_moe_block(i) for i in range(model.n_layers))
        weights = config.loss_weights()
        self.aux_weight = weights.get("aux_loss_coef", 0.0) / count
        self.z_weight = weights.get("z_loss_coef", 0.0) / count
        self.bias_rate = config.bias_rate if config.balance == "bias" else None
        if self.bias_rate is not None:  # (only then: the state of the other mixtures, their checkpoints, unchanged)
            self.register_buffer("expert_bias", torch.zeros(config.experts))
        self.step_load: torch.Tensor | None = None  # tokens each expert got in this optimizer step (balance: bias)
        self.dispatch = local_dispatch  # expert parallelism sends the rows to the experts' ranks instead
        self.load: torch.Tensor | None = None  # tokens each expert got since `take_load`
        self.aux_sum: torch.Tensor | None = None  # the aux losses since `take_load`, and their count
        self.aux_count = 0

    def reset_parameters(self) -> None:
        """The router as torchtitan's (normal, std ROUTER_INIT_STD: small scores, so every expert starts with about
        an even share; Xavier's collapse a small model's tokens onto two experts), then the experts."""
        nn.init.normal_(self.router.weight, std=ROUTER_INIT_STD)
        self.experts.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _shapes_only:
            return x * 0
        batch, seq, d = x.shape
        tokens = x.reshape(-1, d)
        scores = self.router(tokens).float()  # (tokens, experts)
        probs = scores.softmax(dim=-1)
        biased = probs + self.expert_bias if self.bias_rate is not None else probs  # to choose only
        chosen = biased.argsort(dim=-1, descending=True, stable=True)[:, : self.top_k]  # ties: the lower index
        weights = probs.gather(1, chosen)
        weights = weights / weights.sum(dim=1, keepdim=True)

        # rows (token, choice) grouped by expert, in token order within each: the order does not depend on the layout
        flat = chosen.flatten()
        order = flat.argsort(stable=True)
        counts = tally(flat, self.experts_count)
        aux = self.balance_loss(probs.view(batch, seq, -1), chosen.view(batch, seq, -1))
        z = scores.logsumexp(dim=-1).square().mean() if self.z_weight else None
        routed = self.exchange(tokens[order // self.top_k], counts, aux, z)
        unsorted = torch.empty_like(routed).index_copy_(0, order, routed)
        y = (unsorted.view(-1, self.top_k, d) * weights.unsqueeze(-1).to(unsorted.dtype)).sum(dim=1)
        return y.view(batch, seq, d)

    # the routing's data-dependent part (rows per expert; under expert parallelism all-to-alls whose sizes the host
    # must know) and what changes the layer's state: eager, run once. torch.compile compiles the rest of the block
    # around it, and activation checkpointing recomputes none of it (scalelm.parallel.activation_checkpoint)
    @torch.compiler.disable
    def exchange(
        self, routed: torch.Tensor, counts: torch.Tensor, aux: torch.Tensor, z: torch.Tensor | None
    ) -> torch.Tensor:
        """The routed rows (grouped by expert, counts[e] for expert e) through their experts, wherever they are;
        the aux loss and the z-loss (None: none) join the training loss through them, and the load is counted in
        their backward."""
        out = join_auxiliary_loss(self.dispatch(routed, counts, self.experts), aux, self.aux_weight)
        if z is not None:
            out = join_auxiliary_loss(out, z, self.z_weight)
        if torch.is_grad_enabled():
            counted = counts.detach().float()
            out = _CountOnBackward.apply(out, lambda: self.count(counted, aux.detach()))
        return out

    def balance_loss(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Switch's load-balancing loss, per sequence, averaged over the sequences: probs (batch, seq, experts),
        chosen (batch, seq, top_k)."""
        choices = tally(chosen.flatten(1), self.experts_count).float()  # (batch, experts)
        share = choices / (chosen.shape[1] * self.top_k)
        return self.experts_count * (share * probs.mean(dim=1)).sum(dim=-1).mean()

    def count(self, counts: torch.Tensor, aux: torch.Tensor) -> None:
        self.load = counts if self.load is None else self.load + counts
        if self.bias_rate is not None:
            self.step_load = counts if self.step_load is None else self.step_load + counts
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


def biased_mixtures(model: nn.Module) -> list[MoE]:
    """The mixtures of `model` under model.moe.balance=bias, in block order: found once, not every step."""
    return [moe for _, moe in sorted(mixtures(model).items()) if moe.bias_rate is not None]


def update_expert_biases(biased: list[MoE], sum_over_data: Callable[[torch.Tensor], None]) -> None:
    """After an optimizer step, the `biased` mixtures' (`biased_mixtures`) expert biases move by their rate toward
    balance (module docstring), from the step's tokens per expert summed by `sum_over_data` over every data-parallel
    rank (in place; one collective for all of a rank's mixtures). Nothing where there are none."""
    if not biased:
        return
    zeros = biased[0].expert_bias.new_zeros(biased[0].experts_count)
    loads = torch.stack([moe.step_load if moe.step_load is not None else zeros for moe in biased])
    sum_over_data(loads)
    for moe, load in zip(biased, loads):
        moe.expert_bias.add_(torch.sign(load.mean() - load), alpha=moe.bias_rate)
        moe.step_load = None


def mixtures(model: nn.Module) -> dict[int, MoE]:
    """The model's mixtures by their block's index in the whole model (a pipeline stage's blocks keep theirs)."""
    return {module.block: module for module in model.modules() if isinstance(module, MoE)}
