"""The bytes a GPU training step's memory-bound kernels move, operation by operation: what the step-time model
(scalelm.plan.steptime) prices at the elementwise bandwidth where nothing measured calibrates it (a catalogue's
machine, speeds typed on the command line). Torch-free, as the plan is.

Eager, each operation a step runs besides its matrix products and its attention kernel reads its inputs and writes
its output once, as PyTorch's kernels do (a reduction's extra passes over its row where it makes them: the
log-softmax's). Under train.compile Inductor fuses the chains of operations between two products into regions: each
region is counted as reading its inputs and writing its outputs once (a simplification: a region's reductions may read
an input twice, and Inductor may recompute a saved tensor rather than keep it). A block's bytes per token, on one
tensor-parallel rank, with

    r  the residual stream's element: 4 where autocast keeps it in fp32 (bf16 on one GPU, DDP), 2 where FSDP's policy
       casts the parameters to bf16 (every activation bf16), 4 in fp32
    e  an activation's element in the compute dtype (2 in bf16, 4 in fp32); c = r + e a cast between the two (0 where
       r = e); k a dropout mask's byte (1; 0 without dropout)
    D  the residual stream's width on the rank, d/u (u = tp with sequence parallelism, else 1); A = d/t
    Q  the qkv product's width over tp (3d/t; llama's (d + 2h)/t); K = h/t, llama's keys; F = f/t, the FFN's hidden

are the terms of `course_block` and `llama_block` (their keys say what each counts):

    course, eager      (24r + 4e) D + 6c D + 5e Q + 6e F               (+ (4e + 2k)(2D + F) with dropout)
    course, compiled   (14r + 12e) D + 3e Q + 6e F                     (+ 2k (2D + F))
    llama, eager       (24r + 5e) D + 6c D + 9e Q + 4e A + 18e (A + K) + 14e F
    llama, compiled    (14r + 11e) D + 2e Q + 2e (A + K) + 8e F

A mixture's block has its experts' hidden width in place of the FFN's (top_k rows of the expert width: c g, which
tensor parallelism leaves whole) and moves its routed rows to the experts and back (`ROUTED_ROW_PASSES`). The loss
over the logits (`loss_bytes`), the embedding and the final norm (`edge_bytes`), each weight's casts (`WEIGHT_CAST`)
and the optimizer's pass over the state (`optimizer_bytes_per_parameter`) complete the step. What a step does once per
table (the embedding's dense gradient zero-filled, a tied head's gradient added to the embedding's) is left out: under
1% of gpt2_small's step.
"""

from __future__ import annotations

from dataclasses import dataclass

from scalelm.model.architecture import GPU_LOSS_CHUNK_ROWS
from scalelm.parallel.dims import ParallelDims
from scalelm.parallel.layout import fsdp_of_one
from scalelm.plan.memory import Workload, kv_width

FP32 = 4
# AdamW's bytes per parameter, by the implementation scalelm's trainer runs (scalelm.optim): `fused`, one kernel per
# step reading the fp32 parameter, gradient and two moments and writing the parameter and moments back (16 + 12);
# `compiled` (train.compile_optimizer), torch's foreach step under torch.compile, whose passes Inductor fuses into one
# as the fused kernel's; `foreach`, torch's _multi_tensor_adamw as torch 2.13 runs it uncompiled and capturable, one
# pass per foreach call: the weight decay's mul_ (8), lerp_ of the first moment (12), mul_ and addcmul_ of the second
# (8 + 12), sqrt (8), its div_ by the bias correction (8), add_ of eps (8), div_ by the step size (8) and the
# parameter's addcdiv_ (16)
ADAMW_BYTES = {"fused": 28, "compiled": 28, "foreach": 88}
GRAD_NORM_BYTES = 4  # the trainer's gradient norm reads every gradient once (torch's foreach norm), every step
GRAD_CLIP_BYTES = 8  # optim.grad_clip: the gradients scaled in place (foreach mul_: read and written)
# per weight and micro-batch in bf16: autocast's (or FSDP's policy's) cast of the fp32 weight to bf16 (read 4, write
# 2) and of its bf16 gradient back to fp32 (read 2, write 4)
WEIGHT_CAST = 12
GRAD_ACCUMULATION = 12  # per parameter and micro-batch after the first: the fp32 gradient added into .grad
# a mixture's routed rows: gathered into the experts' order and their outputs scattered back weighted (each read and
# written once), forward and backward
ROUTED_ROW_PASSES = 8


@dataclass(frozen=True)
class Widths:
    """The elements' bytes and the widths per token of the module docstring, for one rank of a layout."""

    r: int
    e: int
    k: int
    D: float
    Q: float
    A: float
    K: float
    F: float

    @property
    def c(self) -> int:
        """A cast's bytes per element between the residual stream's dtype and the products' (0 where they agree)."""
        return self.r + self.e if self.r != self.e else 0

    @classmethod
    def of(cls, work: Workload, dims: ParallelDims, mixture: bool = False) -> Widths:
        model, t = work.config.model, dims.tp
        u = t if work.config.parallel.sequence_parallel else 1
        h = kv_width(model) if model.family == "llama" else model.d_model
        hidden = model.moe.top_k * model.expert_width() if mixture else model.d_ff / t
        return cls(
            r=residual_bytes(work, dims),
            e=work.compute_bytes,
            k=work.mask_bytes,
            D=model.d_model / u,
            Q=(model.d_model + 2 * h) / t,
            A=model.d_model / t,
            K=h / t,
            F=hidden,
        )


def residual_bytes(work: Workload, dims: ParallelDims) -> int:
    """The residual stream's element: the compute dtype's where FSDP's policy casts the parameters (sharded layouts,
    train.precision=bf16_params in one process), fp32 under autocast or in fp32."""
    fsdp_casts = dims.sharded or fsdp_of_one(work.config.train.precision, dims.world_size)
    return work.compute_bytes if fsdp_casts else FP32


def course_block(w: Widths, compiled: bool) -> dict[str, float]:
    """The course block's bytes per token (LayerNorm, ReLU, biases; pre- or post-norm alike), by operation or region."""
    r, e, c, D, Q, F = w.r, w.e, w.c, w.D, w.Q, w.F
    if compiled:
        return {
            "norm1 and its cast: the residual read, the product's input written": (r + e) * D,
            "residual add, norm2, its cast: stream and branch read, stream and product input written": 2 * (r + e) * D,
            "activation: read, written": 2 * e * F,
            "residual add: stream and branch read, stream written": (2 * r + e) * D,
            "backward: the output gradient cast for the FFN's products, and down's bias gradient": (r + 2 * e) * D,
            "backward: the activation's, with up's bias gradient (its gradient read again)": 4 * e * F,
            "backward: norm2's with the residual sum and the cast; its weights' gradients": (4 * r + 3 * e) * D,
            "backward: out's bias gradient": e * D,
            "backward: q, k, v gradients written into qkv's layout, and its bias gradient": 3 * e * Q,
            "backward: norm1's with the residual sum; its weights' gradients": (4 * r + 2 * e) * D,
        } | dropout(w, compiled)
    return {
        "two norms: the residual read, its normalised copy written": 2 * 2 * r * D,
        "two casts of the norms' outputs to the products' dtype (autocast)": 2 * c * D,
        "two residual adds: stream and branch read, stream written": 2 * (2 * r + e) * D,
        "activation: read, written": 2 * e * F,
        "backward: two residual branches' gradients cast to the products' dtype": 2 * c * D,
        "backward: the products' input gradients cast back for the norms": 2 * c * D,
        "backward: two norms: dY and X read, dX written; their weights' gradients read dY and X again": 2 * 5 * r * D,
        "backward: the residual gradient summed at each norm's input": 2 * 3 * r * D,
        "backward: the activation's: its gradient and output read, the gradient written": 3 * e * F,
        "backward: four biases' gradients: qkv's, out's, up's and down's output gradients read": e * (Q + 2 * D + F),
        "backward: q, k, v gradients stacked, then copied into qkv's layout": 4 * e * Q,
    } | dropout(w, compiled)


def llama_block(w: Widths, compiled: bool) -> dict[str, float]:
    """Today's block's bytes per token (RMSNorm counted as a norm kernel, SwiGLU, rotary queries and keys, no biases),
    by operation or region."""
    r, e, c, D, Q, A, K, F = w.r, w.e, w.c, w.D, w.Q, w.A, w.K, w.F
    if compiled:
        return {
            "norm1 and its cast": (r + e) * D,
            "rotary: queries and keys read out of qkv, written rotated": 2 * e * (A + K),
            "residual add, norm2 and its cast": (2 * r + 2 * e) * D,
            "SwiGLU: two read, one written": 3 * e * F,
            "residual add": (2 * r + e) * D,
            "backward: the output gradient cast for the FFN's products": (r + e) * D,
            "backward: SwiGLU's: the gradient and both factors read, two gradients written": 5 * e * F,
            "backward: norm2's, with w1's and w3's input gradients summed, the residual sum, the cast": 4 * (r + e) * D,
            "backward: rotary's, q, k, v gradients written into qkv's layout": 2 * e * Q,
            "backward: norm1's with the residual sum": (4 * r + 2 * e) * D,
        }
    return {
        "two norms": 2 * 2 * r * D,
        "two casts to the products' dtype": 2 * c * D,
        "two residual adds": 2 * (2 * r + e) * D,
        "queries copied out of qkv's grouped layout (a reshape of a strided view)": 2 * e * A,
        "rotary on queries and keys: a negation, a concatenation, two products and their sum": 10 * e * (A + K),
        "SwiGLU: silu read and written, the product's two factors read and one written": 5 * e * F,
        "backward: casts to the products' dtype and back": 4 * c * D,
        "backward: two norms": 2 * 5 * r * D,
        "backward: the residual gradient summed at each norm's input": 2 * 3 * r * D,
        "backward: SwiGLU's: the product's two gradients, silu's": 9 * e * F,
        "backward: w1's and w3's input gradients summed": 3 * e * D,
        "backward: rotary's: two products and the halves' gradients summed": 8 * e * (A + K),
        "backward: the queries' reshape": 2 * e * A,
        "backward: q, k, v slices' gradients, each a zero-filled qkv width, summed": 9 * e * Q,
    }


def dropout(w: Widths, compiled: bool) -> dict[str, float]:
    """The course block's three dropouts (two on the residual branches, one on the FFN's hidden activation): eager,
    each reads its input and writes its output and mask forward, reads the gradient and mask and writes the gradient
    backward; compiled, only the mask is written and read again."""
    if not w.k:
        return {}
    elements = 2 * w.D + w.F
    per_element = 2 * w.k if compiled else 4 * w.e + 2 * w.k
    return {"dropouts: masks written and read, with their inputs and outputs eager": per_element * elements}


def block_bytes(work: Workload, dims: ParallelDims, mixture: bool, compiled: bool) -> float:
    """A block's bytes per token on one rank of `dims` (a mixture's with its routed rows)."""
    w = Widths.of(work, dims, mixture)
    terms = llama_block(w, compiled) if work.config.model.family == "llama" else course_block(w, compiled)
    routed = ROUTED_ROW_PASSES * w.e * work.config.model.moe.top_k * w.D if mixture else 0.0
    return sum(terms.values()) + routed


def forward_share(work: Workload, dims: ParallelDims, mixture: bool, compiled: bool) -> float:
    """A block's forward bytes per token: what activation checkpointing (full or selective: scalelm's selective keeps
    the products' and attention's outputs and recomputes the rest) runs again in the backward."""
    w = Widths.of(work, dims, mixture)
    terms = llama_block(w, compiled) if work.config.model.family == "llama" else course_block(w, compiled)
    return sum(value for name, value in terms.items() if not name.startswith(("backward", "dropouts")))


def loss_bytes(work: Workload, dims: ParallelDims, tokens: int, compiled: bool) -> float:
    """The loss over the logits, per step on the last stage for `tokens` tokens: the plain loss (the default on
    CUDA; under loss_parallel each rank's share of the vocabulary) or the chunked one (train.fused_loss: chunked).
    Eager: the logits cast to fp32 (.float(): e + 4 a word, where e < 4), the log-softmax reading its row for the
    maximum, again for the sum of exponentials and a third time to write its output (16), nll's zero-filled gradient
    (4), the log-softmax's backward reading the gradient for its sum and then the gradient and output to write the
    input's gradient (16), the cast back (4 + e), the rows padded to a multiple of 64 (scalelm.model.gpu_ops: the
    padded gradient zero-filled, the vocabulary's copied in: 3e) and the head's bias gradient (e). Compiled (the head
    with its loss): the bf16 logits read twice forward (the maximum, the sum) and once backward, their gradient written
    (4e), which the bias gradient reads again. Chunked: each chunk's fp32 logits, their log-sum-exp (two reads), the
    shifted exponentials' three in-place passes and the gradient's cast (compiled: the logits read three times, the
    gradient written), beside each further chunk's fp32 weight gradient added into the sum (12 bytes a weight)."""
    model, e = work.config.model, work.compute_bytes
    split = dims.tp if work.config.parallel.loss_parallel else 1
    vocab = work.vocab_size / split
    bias = e if model.family == "gpt2" else 0
    cast = 2 * (e + FP32) if e < FP32 else 0
    if work.chunked_loss:
        chunks = -(-tokens // GPU_LOSS_CHUNK_ROWS)
        per_word = 4 * e + bias if compiled else cast + 8 + 3 * 2 * FP32 + bias
        return tokens * vocab * per_word + (chunks - 1) * GRAD_ACCUMULATION * vocab * model.d_model
    if compiled and split == 1:
        return tokens * vocab * (4 * e + bias)
    return tokens * vocab * (cast + 16 + 4 + 16 + 3 * e + bias)


def edge_bytes(work: Workload, dims: ParallelDims, first: bool, last: bool, compiled: bool) -> float:
    """The embedding's bytes per token on the first stage and the final norm's on the last. Eager, the course's
    embedding gathers its rows (read, written), scales them by sqrt(d) and adds the positions (read twice, written):
    7r, and backward the scale's gradient and the rows' scattered into the table's gradient: 5r; llama's has no scale
    nor positions (2r + 3r). Compiled, the gather, scale and positions are one region (3r, llama 2r), the backward's
    scatter 3r. The final norm is a block's norm with its cast, forward and backward."""
    w = Widths.of(work, dims)
    r, e, c, D = w.r, w.e, w.c, w.D
    course = work.config.model.family == "gpt2"
    forward, backward = ((3, 3) if course else (2, 3)) if compiled else ((7, 5) if course else (2, 3))
    embedding = (forward + backward) * r
    norm = (r + e) * D + (3 * r + 2 * e) * D if compiled else (2 * r + 5 * r) * D + 2 * c * D
    return embedding * D * first + norm * last


def optimizer_bytes_per_parameter(work: Workload) -> int:
    """AdamW's pass over a parameter's state as the trainer runs it (ADAMW_BYTES: fused, or compiled with
    train.compile_optimizer), the gradient norm the trainer takes every step, and the clipping where optim.grad_clip
    is set."""
    adamw = ADAMW_BYTES["compiled" if work.config.train.compile_optimizer else "fused"]
    return adamw + GRAD_NORM_BYTES + (GRAD_CLIP_BYTES if work.config.optim.grad_clip else 0)


def weight_pass_bytes(work: Workload, dims: ParallelDims, passes: int, computed: float, held: float) -> float:
    """The weights' bytes per step of `passes` micro-batches, where the rank computes with `computed` weights and
    holds `held` parameters. In bf16, each pass casts the fp32 weights to bf16 and their bf16 gradients back to fp32
    (WEIGHT_CAST: autocast's casts of every weight a product takes; under FSDP its policy casts the rank's shard
    before the all-gather, 6 bytes a held parameter, and the gathered gradient to fp32 for the reduce-scatter, 6 a
    computed weight); each pass after the first adds its fp32 gradient into the accumulated one (GRAD_ACCUMULATION:
    every computed weight's, FSDP's shard only)."""
    fsdp_casts = residual_bytes(work, dims) < FP32
    cast = WEIGHT_CAST // 2 if work.compute_bytes < FP32 else 0
    per_pass = cast * (held + computed) if fsdp_casts else 2 * cast * computed
    accumulated = held if dims.sharded else computed
    return per_pass * passes + GRAD_ACCUMULATION * accumulated * (passes - 1)
