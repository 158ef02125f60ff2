"""The memory of one GPU under a layout, from the model's shapes alone: what `python -m scalelm.plan` prints, the
workflow checks before it submits a training, and every run records beside what it measured.

Each rank holds, in bytes (the figures are those of the rank holding the most, a pipeline's busiest stage):

    params       the weights in fp32, the optimizer's master copy (bf16 compute casts from it): 4 B each
    grads        their gradients in fp32: 4 B each
    optimizer    AdamW's two moments in fp32: 8 B each, so 16 B per parameter in all (the course's rule of thumb)
    activations  what the forward pass keeps for the backward, for the micro-batches in flight
    buffers      FSDP's gathered weights and gradients of the units at work, a pipeline's send and receive buffers,
                 the positional table, the fused CPU loss's workspace

FSDP's buffers hold each unit's weights gathered in the compute precision, the next unit's prefetched (without
resharding after the forward: every unit's, kept to the backward), and a unit's gradients before they are reduced, in
the compute precision and in fp32; `train.precision: bf16_params` in one process is FSDP on a mesh of one rank, which
keeps every unit's bf16 copy (scalelm.parallel.runtime).

Sharding divides the first three as scalelm.parallel applies it: tensor parallelism (tp) splits the four matrices of
a block (and the head with loss_parallel) along the dimension it cuts, FSDP (dp_shard x cp) cuts every tensor's first
dimension, its first rank taking the rounded-up share, and a pipeline rank keeps only its stages' tensors. Context
parallelism (cp) divides every activation: a rank holds 1/cp of each sequence's tokens. A mixture's experts
(model.moe) are parameters like the others where ep = 1 (FSDP shards them with their block); under expert parallelism
(ep > 1) a rank's share is experts / ep of them, which FSDP shards as a unit of their own over the ranks holding the
same experts (dp_shard / ep; scalelm.parallel.expert), and tensor parallelism never splits them. The plan counts the
experts' share of the state apart (`expert_bytes`).

Activations, per token of a micro-batch and per block, in bytes; d = d_model, f = d_ff, a = heads, s = seq_len,
e = 2 in bf16 (4 in fp32), k = a dropout mask's bytes per element (1 on GPUs, 4 for scalelm's CPU dropout, 0
without dropout), t = tp, u = tp with sequence parallelism (1 without):

    e (2d + 2d/u + (4d + 2f)/t) + k (2d/u + f/t)         [+ a s (2e + k) / t where attention keeps its scores]

2d: the inputs of the qkv and FFN-in matrices (whole on every TP rank); 2d/u: the two norms' inputs; 4d/t: q, k, v
and the attention's output; 2f/t: the FFN's hidden activation before and after its dropout; the masks of the two
residual dropouts and the FFN's. Attention keeps its (a x s) scores only on CPU with dropout (the math kernel); the
fused kernels keep a few numbers per row. A mixture's block (c = top_k, g = an expert's width, n = experts) keeps,
in place of the FFN's 2f/t and its mask, the routed rows into its experts and their outputs back (under expert
parallelism the rows each rank received and those it sends back), the experts' hidden activation, the router's fp32
probabilities and the routing's int64 indices and fp32 weights (ROUTE_BYTES a route); tensor parallelism leaves it
whole:

    e (2d + 2d/u + 4d/t + c (2d + g)) + k 2d/u + 4n + 32c

Under expert parallelism the buffers hold the all-to-all's rows of the mixture at work, sent and received
(2 c d e per token), and FSDP gathers a mixture's experts (their ep share) as a unit of its own. With full activation
checkpointing a block keeps only its input (e d/u), with selective the outputs of its products and attention as well,
e (d/u + (4d + f)/t + 2d) (q, k, v and the attention's output, the FFN's hidden activation, the two products whose sum
the residual adds); one block at a time is recomputed. A mixture's block never recomputes its exchange
(scalelm.parallel.activation_checkpoint): with full checkpointing it keeps its formula less its attention's and experts'
insides, recomputed (4d/t and c g), with selective all of it. Under context parallelism attention is a ring
(scalelm.parallel.context) that keeps only its fp32 log-sum-exp (4a/t per token) and recomputes its scores block by
block, and the buffers hold two key/value blocks and backward's fp32 dk/dv accumulators (4e + 16 bytes per token and
d/t) and the working memory of the block at work (ring_transient_bytes): through a fused kernel (no dropout; bf16 on
GPUs with a head size that is a multiple of 8 up to 256, any precision on CPU) its fp32 output accumulator and, the
larger, backward's fp32 dq accumulator with the block's three gradients and cuDNN's contiguous copies of its queries,
keys, values, output and output gradient ((4 + 8e) bytes per token and d/t); through matrix products (dropout, or fp32
on GPUs) a score block of the rank's L = s/cp queries and keys (L a/t scores per token) in fp32 with one live temporary
(8 bytes a score), with dropout the probabilities and the mask's int64 hash with its shifted temporary (20 bytes a
score), and the fp32 dq accumulator with the block's three fp32 gradients, in bf16 also its fp32 copies of q, k, v and
the output gradient (16, in bf16 32 bytes per token and d/t): what a bf16 run with dropout pays, its blocks in IEEE
fp32. The embedding adds its dropout's mask, the last stage the final norm's and the head's inputs and the loss: on GPUs
the fp32 log-probabilities (4V/t_v per token, t_v = t with loss_parallel), and beside them the larger of the forward's
logits with their fp32 copy ((e + 4) V) and the backward's two fp32 gradients, of the log-probabilities and of the
logits (8V: the peak of a bf16 step, measured on an H200); on CPU in fp32 the fused loss keeps its gradients
(scalelm.model.cpu_ops), as does the chunked GPU loss (train.fused_loss: chunked, scalelm.model.gpu_ops), whose chunk at
work holds its fp32 logits and their exponentials with their gradient, (8 + e) V per token of the chunk, beside the
chunk's fp32 weight gradient. A pipeline rank keeps one micro-batch per schedule slot in flight: all m with GPipe,
pp - rank with 1F1B (the first rank the most), and for interleaved 1F1B Megatron's count of warm-up chunks.

The llama block (model.family: llama; scalelm.model.llama) keeps, in place of the course block's 4d/t for attention,
its rotated queries (d) and keys (h = n_kv_heads x head size: fewer under grouped-query attention), the qkv
projection's output, of which the values are a view (d + 2h), and attention's output (d), all over t (the rotation
keeps only the small cos and sin tables); for its SwiGLU of width f four hidden activations (w1's and w3's outputs,
silu's, and the product w2 takes: 4f/t) in place of two; and its RMSNorms their inputs and their normalised copies
(torch's RMSNorm multiplies by its weight apart: 4d/u). Exact for a block on the CPU in fp32 without dropout, to its
few numbers per row (its saved tensors counted; the course block's formula is an upper estimate there):

    e (2d + 4d/u + (3d + 3h + 4f)/t) + k (2d/u + f/t)

selective keeps e (d/u + (2d + 2h + 2f)/t + 2d) (the qkv, w1 and w3 outputs, attention's, out's and w2's), a
mixture's SwiGLU experts 4g where the course's keep g, and without a positional table the buffers hold none.

The sum of all five parts is the plan's peak: an upper estimate, as a step never holds all activations and all
gradients at once (the backward frees one as it fills the other). Buffers and activations are estimates; params,
grads and optimizer state are exact to the byte for a whole-tensor layout (tests compare them with the bytes each
run measures).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from scalelm.config import Config, resolve_precision
from scalelm.model.architecture import (
    CPU_LOSS_CHUNK_ROWS,
    GPU_LOSS_CHUNK_ROWS,
    QKV_WEIGHT,
    Parameter,
    is_moe_block,
    parameters,
)
from scalelm.parallel.dims import ParallelDims
from scalelm.parallel.layout import Layout, fsdp_of_one

PARTS = ("params", "grads", "optimizer", "activations", "buffers")
STATE_PARTS = PARTS[:3]
STATE_BYTES = {"params": 4, "grads": 4, "optimizer": 8}  # per parameter: fp32 weights, gradients, AdamW's moments
BLOCK_FORMULA = "e (2d + 2d/u + (4d + 2f)/t) + k (2d/u + f/t)"  # activation bytes per token and block
SCORES_FORMULA = " + a s (2e + k)/t"  # where attention keeps its scores
RING_FORMULA = " + 4a/t"  # context parallelism's ring attention: its log-sum-exp
RING_SCORE_BYTES = 8  # a ring block's fp32 score and one temporary (logsumexp's, the backward's dp)
RING_SCORE_BYTES_DROPOUT = 20  # with dropout: the probability, and the mask's int64 hash and its shifted temporary
RING_PRODUCT_WIDTH_BYTES = 16  # per token and d/t: the products' fp32 dq accumulator and a block's three gradients
SELECTIVE_FORMULA = "e (d/u + (4d + f)/t + 2d)"  # what a block keeps under selective activation checkpointing
MOE_FORMULA = "e (2d + 2d/u + 4d/t + c (2d + g)) + k 2d/u + 4n + 32c"  # a mixture's block (model.moe)
# model.family llama (module docstring): h = n_kv_heads x head size, the keys' (and the values') width
LLAMA_BLOCK_FORMULA = "e (2d + 4d/u + (3d + 3h + 4f)/t) + k (2d/u + f/t)"
LLAMA_SELECTIVE_FORMULA = "e (d/u + (2d + 2h + 2f)/t + 2d)"
LLAMA_MOE_FORMULA = "e (2d + 4d/u + (3d + 3h)/t + c (2d + 4g)) + k 2d/u + 4n + 32c"
ROUTE_BYTES = 32  # per route (a token's choice): three int64 indices (choice, order, token) and two fp32 weights


@dataclass(frozen=True)
class Workload:
    """What the memory of a step depends on besides the layout: the model, the tokens, the numbers' widths."""

    config: Config
    vocab_size: int
    device: str = "cuda"  # "cuda" or "cpu": the kernels (and so the activations) differ
    activation_checkpointing: str | None = None  # none, full or selective; None: the config's

    @property
    def checkpointing(self) -> str:
        return self.activation_checkpointing or self.config.train.activation_checkpointing

    @property
    def precision(self) -> str:
        return resolve_precision(self.config.train.precision, self.device)

    @property
    def compute_bytes(self) -> int:
        """Bytes of an activation, and of a weight FSDP gathers (in the compute precision)."""
        return 2 if self.precision == "bf16" else 4

    def layout(self, dims: ParallelDims) -> Layout:
        """`dims` with the config's pipeline options: its micro-batches, virtual stages and stages' blocks."""
        return Layout.of(dims, self.config.parallel)

    @property
    def mask_bytes(self) -> int:
        if not self.config.model.dropout:
            return 0
        return 1 if self.device == "cuda" else 4

    @property
    def fused_cpu_loss(self) -> bool:
        on_cpu = self.device == "cpu" and self.precision == "fp32"
        return on_cpu and self.whole_head and self.config.train.fused_loss != "plain"

    @property
    def chunked_loss(self) -> bool:
        """The chunked loss (train.fused_loss: chunked), where the CPU's fused one does not apply."""
        return self.config.train.fused_loss == "chunked" and self.whole_head and not self.fused_cpu_loss

    @property
    def whole_head(self) -> bool:
        """The head's weight whole on each rank (not split by vocabulary: parallel.loss_parallel), as the fused and
        chunked losses need it."""
        return not self.config.parallel.loss_parallel


@dataclass
class MemoryPlan:
    """Per-GPU bytes of one layout, on its fullest rank."""

    dims: ParallelDims
    bytes: dict[str, int]  # PARTS -> bytes
    pp_rank: int  # the pipeline rank those bytes are of (0 without a pipeline)
    micro_batch_tokens: int  # tokens of one forward pass on a rank (a pipeline's micro-batch)
    in_flight: int  # micro-batches whose activations that rank keeps at once
    activation_bytes_per_token_per_block: float
    activation_formula: str  # the formula with this layout's values
    largest_state: int = 0  # params + grads + optimizer of the rank holding the most of them (a run's measurement)
    expert_bytes: dict[str, int] | None = None  # STATE_PARTS -> the experts' share of them; None for a dense model

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    @property
    def state(self) -> int:
        return sum(self.bytes[part] for part in STATE_PARTS)

    def to_dict(self) -> dict:
        return {
            "bytes": dict(self.bytes),
            "total_bytes": self.total,
            "state_bytes": self.state,
            "largest_state_bytes": self.largest_state,
            "pp_rank": self.pp_rank,
            "micro_batch_tokens": self.micro_batch_tokens,
            "in_flight": self.in_flight,
            "activation_bytes_per_token_per_block": self.activation_bytes_per_token_per_block,
            "activation_formula": self.activation_formula,
        } | ({"expert_bytes": dict(self.expert_bytes)} if self.expert_bytes is not None else {})

    @property
    def expert_state(self) -> int:
        """The experts' params, grads and optimizer state on the fullest rank (0 for a dense model)."""
        return sum((self.expert_bytes or {}).values())

    def mb(self) -> dict[str, float]:
        """MiB by part and in total, on the fullest rank, with the state (params + grads + optimizer) of the rank
        holding the most of it, as runs measure it: what run.json records; a mixture's also its experts' state."""
        parts = {part: value / 2**20 for part, value in self.bytes.items()}
        experts = {"expert_state": self.expert_state / 2**20} if self.expert_bytes is not None else {}
        return parts | experts | {"state": self.largest_state / 2**20, "total": self.total / 2**20}


def stage_of(tensor: Parameter, blocks: list[range]) -> int:
    if tensor.unit == "embed":
        return 0
    if tensor.unit.startswith("blocks."):
        index = int(tensor.unit.split(".")[1])
        return next(s for s, stage in enumerate(blocks) if index in stage)
    return len(blocks) - 1  # the final norm and the head


def rank_tensors(work: Workload, dims: ParallelDims) -> list[list[Parameter]]:
    """The parameters of each pipeline rank (one list without a pipeline)."""
    tensors = parameters(work.config.model, work.vocab_size, work.config.parallel.loss_parallel and dims.tp > 1)
    stages = work.layout(dims).stage_blocks(work.config.model.n_layers)
    of_rank: list[list[Parameter]] = [[] for _ in range(dims.pp)]
    for tensor in tensors:
        of_rank[stage_of(tensor, stages) % dims.pp].append(tensor)
    return of_rank


def held(tensor: Parameter, dims: ParallelDims) -> int:
    """Elements of `tensor` on one rank of `dims`: an expert under expert parallelism split by ep, then sharded by FSDP
    over the ranks holding the same experts (scalelm.parallel.expert); every other tensor (experts where ep = 1
    included) sharded by FSDP where the layout shards."""
    if tensor.expert and dims.ep > 1:
        return tensor.numel(dims.tp, dims.expert_shards, dims.ep)
    return tensor.numel(dims.tp, dims.shard_size if dims.sharded else 1)


def gathered(tensor: Parameter, dims: ParallelDims) -> int:
    """Elements of `tensor` once FSDP has gathered it: the layout's whole tensor, an expert's ep share."""
    return tensor.numel(dims.tp, 1, dims.ep if tensor.expert else 1)


def fsdp_unit(tensor: Parameter, dims: ParallelDims) -> str:
    """The FSDP unit gathering `tensor`: its block's, the embedding, ...; a mixture's experts under expert
    parallelism are one of their own."""
    return f"{tensor.unit}.experts" if tensor.expert and dims.ep > 1 else tensor.unit


def fsdp_reshards(work: Workload, dims: ParallelDims) -> bool | None:
    """Whether FSDP frees a unit's gathered weights after its forward, as scalelm.parallel.runtime applies it; None
    without FSDP. train.precision=bf16_params in one process is FSDP on a mesh of one rank, which reshards only where
    parallel.reshard_after_forward says so (freeing nothing, it would gather again for the backward)."""
    options = work.config.parallel
    if dims.sharded:
        return options.reshards(dims.pp)
    if fsdp_of_one(work.config.train.precision, dims.world_size):
        return bool(options.reshard_after_forward)
    return None


def block_indices(tensors: Iterable[Parameter]) -> list[int]:
    """The blocks whose parameters are among `tensors` (a pipeline rank's), in order."""
    return [int(t.unit.split(".")[1]) for t in tensors if t.name.endswith(QKV_WEIGHT)]


def in_flight(schedule: str, pp: int, rank: int, micro: int, virtual: int) -> int:
    """Micro-batches (interleaved: stage chunks) whose activations pipeline rank `rank` keeps at once."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return micro
    if schedule == "1f1b":
        return min(micro, pp - rank)
    return min(micro * virtual, 2 * (pp - rank - 1) + (virtual - 1) * pp + 1)


def block_bytes_per_token(work: Workload, dims: ParallelDims) -> tuple[float, str]:
    """Activation bytes a block keeps per token (the module docstring's formula), and the formula with its values."""
    model, e, k = work.config.model, work.compute_bytes, work.mask_bytes
    d, f, t, a, s = model.d_model, model.d_ff, dims.tp, model.n_heads, work.config.data.seq_len
    u = t if work.config.parallel.sequence_parallel else 1
    if model.family == "llama":
        h = kv_width(model)
        kept = e * (2 * d + 4 * d / u + (3 * d + 3 * h + 4 * f) / t) + k * (2 * d / u + f / t)
        formula, values = LLAMA_BLOCK_FORMULA, f"e={e}, k={k}, d={d}, h={h}, f={f}, t={t}, u={u}"
    else:
        kept = e * (2 * d + 2 * d / u + (4 * d + 2 * f) / t) + k * (2 * d / u + f / t)
        formula, values = BLOCK_FORMULA, f"e={e}, k={k}, d={d}, f={f}, t={t}, u={u}"
    if dims.cp > 1:  # ring attention keeps its log-sum-exp (fp32) beside the output, and recomputes the rest
        kept += 4 * a / t
        formula, values = formula + RING_FORMULA, values + f", a={a}"
    elif work.device == "cpu" and model.dropout:  # the math attention kernel keeps its scores
        kept += a * s * (2 * e + k) / t
        formula, values = formula + SCORES_FORMULA, values + f", a={a}, s={s}"
    return kept, f"{formula} with {values}: {kept:,.0f} B per token and block"


def kv_width(model) -> int:
    """The keys' (and the values') width: n_kv_heads x head size."""
    return model.kv_heads * model.head_dim


def attention_width(model) -> int:
    """What a block's attention keeps per token and TP rank, times tp: q, k, v and the output (4d), or llama's
    rotated q and k, the qkv output the values are a view of, and the output (3d + 3h)."""
    return 3 * model.d_model + 3 * kv_width(model) if model.family == "llama" else 4 * model.d_model


def moe_block_bytes_per_token(work: Workload, dims: ParallelDims) -> tuple[float, str]:
    """Activation bytes a mixture's block keeps per token (the module docstring's MOE_FORMULA; llama's
    LLAMA_MOE_FORMULA), and the formula with its values."""
    model, e, k = work.config.model, work.compute_bytes, work.mask_bytes
    d, t, c, g, n = model.d_model, dims.tp, model.moe.top_k, model.expert_width(), model.moe.experts
    u = t if work.config.parallel.sequence_parallel else 1
    llama = model.family == "llama"
    hidden = 4 * g if llama else g  # SwiGLU's four hidden activations (module docstring)
    norms = (4 if llama else 2) * d / u  # RMSNorm's inputs and normalised copies, LayerNorm's inputs
    attention = attention_width(model) / t
    kept = e * (2 * d + norms + attention + c * (2 * d + hidden)) + k * 2 * d / u + 4 * n + ROUTE_BYTES * c
    values = f"e={e}, k={k}, d={d}, t={t}, u={u}, c={c}, g={g}, n={n}"
    formula = MOE_FORMULA
    if model.family == "llama":
        formula, values = LLAMA_MOE_FORMULA, values + f", h={kv_width(model)}"
    return kept, f"{formula} with {values}: {kept:,.0f} B per token and mixture's block"


def checkpointed_bytes_per_token(work: Workload, dims: ParallelDims, mixture: bool) -> float:
    """What a block keeps per token under the workload's activation checkpointing (full or selective): a dense block
    its input (full), or its products' and attention's outputs (selective); a mixture's block, whose exchange is
    never recomputed (scalelm.parallel.activation_checkpoint), what it keeps without checkpointing less, under full,
    its attention's and its experts' insides (4d/t and c g), which it recomputes."""
    model, e, t = work.config.model, work.compute_bytes, dims.tp
    d = model.d_model
    u = t if work.config.parallel.sequence_parallel else 1
    full, llama = work.checkpointing == "full", model.family == "llama"
    if mixture:
        kept, _ = moe_block_bytes_per_token(work, dims)
        hidden = (4 if llama else 1) * model.expert_width()
        return kept - e * (attention_width(model) / t + model.moe.top_k * hidden) if full else kept
    if full:
        return e * d / u
    if llama:
        return e * (d / u + (2 * d + 2 * kv_width(model) + 2 * model.d_ff) / t + 2 * d)
    return e * (d / u + (4 * d + model.d_ff) / t + 2 * d)


def blocks_bytes_per_token(work: Workload, dims: ParallelDims, blocks: Iterable[int]) -> list[float]:
    """The activation bytes per token each of `blocks` keeps (a mixture's block by its own formula; context
    parallelism, which refuses mixtures, changes only the dense one)."""
    dense, _ = block_bytes_per_token(work, dims)
    mixture = moe_block_bytes_per_token(work, dims)[0] if work.config.model.moe else dense
    return [mixture if is_moe_block(work.config.model, i) else dense for i in blocks]


def ring_fused(work: Workload) -> bool:
    """Whether the ring runs its blocks through a fused attention kernel (scalelm.parallel.ring_blocks.KERNELS)."""
    model = work.config.model
    head = model.d_model // model.n_heads
    fits_gpu = work.precision == "bf16" and head % 8 == 0 and head <= 256
    return not model.dropout and (work.device == "cpu" or fits_gpu)


def ring_transient_bytes(work: Workload, dims: ParallelDims, tokens: int) -> float:
    """Bytes the ring attention of one block holds while it runs, on a rank with `tokens` tokens of a micro-batch
    (the module docstring's terms; the blocks' keys, values and dk/dv accumulators are counted apart)."""
    model, e, t = work.config.model, work.compute_bytes, dims.tp
    if ring_fused(work):
        return tokens * model.d_model / t * (4 + 8 * e)
    scores = tokens * (work.config.data.seq_len // dims.cp) * model.n_heads / t
    per_score = RING_SCORE_BYTES_DROPOUT if model.dropout else RING_SCORE_BYTES
    per_width = RING_PRODUCT_WIDTH_BYTES * (2 if e < 4 else 1)  # below fp32: and the blocks' fp32 copies
    return scores * per_score + tokens * model.d_model / t * per_width


def blocks_activation_bytes(work: Workload, dims: ParallelDims, blocks: list[int], count: int, tokens: int) -> float:
    """What a rank's `blocks` keep for the backward with `count` micro-batches (interleaved: chunks) of `tokens` in
    flight, under the workload's activation checkpointing (one block recomputed at a time)."""
    model, virtual = work.config.model, work.layout(dims).virtual_stages
    per_block = blocks_bytes_per_token(work, dims, blocks)
    if work.checkpointing in ("full", "selective"):  # what each block keeps, and one block recomputed at a time
        kept = sum(checkpointed_bytes_per_token(work, dims, is_moe_block(model, i)) for i in blocks)
        return count * tokens * kept / virtual + tokens * max(per_block)
    return count * tokens * sum(per_block) / virtual


def dispatch_buffer_bytes(work: Workload, dims: ParallelDims, mixtures: int, tokens: int) -> float:
    """Under expert parallelism, the all-to-all's rows of the mixture at work, sent and received."""
    if dims.ep == 1 or not mixtures:
        return 0.0
    return 2 * tokens * work.config.model.moe.top_k * work.config.model.d_model * work.compute_bytes


def plan_memory(work: Workload, dims: ParallelDims) -> MemoryPlan:
    """Bytes per GPU by part for `dims`, on the rank that needs the most."""
    config = work.config
    options, model = config.parallel, config.model
    _, micro = config.batch.sizes(dims.dp_size)  # sequences of one forward/backward on a data-parallel rank
    layout = work.layout(dims)
    chunks, virtual, stages = layout.microbatches, layout.virtual_stages, layout.stage_blocks(model.n_layers)
    tokens = max(1, micro // chunks) * config.data.seq_len // dims.cp  # a context-parallel rank's part
    per_block, formula = block_bytes_per_token(work, dims)
    if model.moe is not None:
        formula += f"; {moe_block_bytes_per_token(work, dims)[1]}"
    e, k, d, vocab = work.compute_bytes, work.mask_bytes, model.d_model, work.vocab_size
    u = dims.tp if options.sequence_parallel else 1
    vocab_split = dims.tp if options.loss_parallel else 1

    plans = []
    for rank, tensors in enumerate(rank_tensors(work, dims)):
        my_stages = [s for s in range(len(stages)) if s % dims.pp == rank]
        first, last = 0 in my_stages, len(stages) - 1 in my_stages
        count = in_flight(options.pp_schedule, dims.pp, rank, chunks, virtual)
        blocks = block_indices(tensors)
        mixtures = sum(is_moe_block(model, i) for i in blocks)
        state = sum(held(t, dims) for t in tensors)
        sizes = {part: state * STATE_BYTES[part] for part in STATE_PARTS}
        experts = sum(held(t, dims) for t in tensors if t.expert)
        expert_bytes = {part: experts * STATE_BYTES[part] for part in STATE_PARTS} if model.moe else None

        act = blocks_activation_bytes(work, dims, blocks, count, tokens)
        if first:
            act += count * tokens * k * d / u  # the embedding's dropout mask
        if last:
            last_count = chunks if options.pp_schedule == "gpipe" and dims.pp > 1 else 1
            act += last_count * tokens * e * d * (1 / u + 1)  # the final norm's and the head's inputs
            if work.fused_cpu_loss or work.chunked_loss:  # its gradients, computed in the forward pass
                act += last_count * 4 * (tokens * d + vocab * (d + 1))
            else:  # the log-probabilities kept; the logits with their fp32 copy, or the backward's two gradients
                act += last_count * tokens * 4 * vocab / vocab_split + tokens * max(e + 4, 8) * vocab / vocab_split

        buffers = config.model.max_seq_len * d * 4 if model.family == "gpt2" else 0  # the positional table
        reshards = fsdp_reshards(work, dims)
        if reshards is not None:
            units: dict[str, int] = {}
            for tensor in tensors:
                unit = fsdp_unit(tensor, dims)
                units[unit] = units.get(unit, 0) + gathered(tensor, dims)
            largest = max(units.values())
            in_hand = 2 * largest if reshards else sum(units.values())  # + the prefetched
            buffers += in_hand * e + largest * (e + 4)  # + a unit's gradients, reduced in fp32
        if dims.pp > 1:
            buffers += len(my_stages) * 4 * tokens * d * e  # activations and gradients, sent and received
        if dims.cp > 1:  # the ring's key/value blocks in hand and in flight, and backward's fp32 dk/dv accumulators
            buffers += tokens * d / dims.tp * (4 * e + 16) + ring_transient_bytes(work, dims, tokens)
        buffers += dispatch_buffer_bytes(work, dims, mixtures, tokens)
        if last and work.fused_cpu_loss:
            columns = -(-(d + 2) // 8) * 8
            buffers += vocab * (2 * columns + min(tokens, CPU_LOSS_CHUNK_ROWS) + 32) * 4
        if last and work.chunked_loss:
            buffers += vocab * (min(tokens, GPU_LOSS_CHUNK_ROWS) * (8 + e) + 4 * d)
        sizes |= {"activations": int(act), "buffers": int(buffers)}
        plans.append(MemoryPlan(dims, sizes, rank, tokens, count, per_block, formula, expert_bytes=expert_bytes))
    fullest = max(plans, key=lambda plan: plan.total)
    fullest.largest_state = max(plan.state for plan in plans)
    return fullest
