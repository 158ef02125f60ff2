"""CPU fast paths of the model's operations, each computing exactly the function of its plain torch counterpart.

On CPU in fp32 a training step of a small language model is dominated by the output projection with its
cross-entropy and by dropout's random masks; GPUs, autocast and evaluation take the plain torch operations.
Measurements behind each choice: docs/benchmarks.md.

Also here: the dropout streams of tensor parallelism (`own_random_stream`). Masks drawn apart from torch's own
sampler (numpy's, a stream's) take a seed drawn from torch's default CPU generator. Under torch.compile they are
drawn by two dynamo-opaque custom ops (scalelm::dropout_mask, scalelm::stream_attention) that take that seed as a
tensor: reading it as a number, numpy and the stream's fork_rng/manual_seed would each break the graph, and a break
inside a checkpointed block runs the whole block eagerly. The ops are functions of their inputs, so a checkpoint may
recompute them; eager runs call the same functions directly.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from functools import partial
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from scalelm.model.architecture import CPU_LOSS_CHUNK_ROWS
from scalelm.model.gpu_ops import aligned_linear
from scalelm.model.loss import IGNORE_INDEX, lm_loss, stored_gradients


class Dropout(nn.Dropout):
    """nn.Dropout whose keep-mask is drawn, on CPU, by numpy's PCG64 instead of torch's Bernoulli sampler.

    The same function: every element kept independently with probability 1 - p (to within 2^-24) and scaled by
    1 / (1 - p), computed exactly as F.dropout does. torch's CPU Bernoulli sampler is serial Mersenne-Twister code
    (its vectorised MKL path is taken on Intel CPUs only), much slower on the course model's feed-forward
    activations (docs/benchmarks.md). The generator is seeded from torch's default generator, so torch.manual_seed
    and the RNG states saved in checkpoints still determine every mask.

    `stream` (set by tensor parallelism) is nonzero where this rank holds its own slice of the activations: the
    ranks of a tensor-parallel group share their RNG state, and the stream makes their masks differ.
    """

    stream = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and 0.0 < self.p < 1.0):
            return x
        numpy_masks = x.device.type == "cpu" and x.dtype == torch.float32
        if not (numpy_masks or self.stream):  # torch's own dropout, which torch.compile traces into its graph
            return super().forward(x)
        if not (numpy_masks or torch.compiler.is_compiling()):
            with own_random_stream(self.stream, x.device):
                return super().forward(x)
        draw = dropout_mask_op if torch.compiler.is_compiling() else dropout_mask
        mask = draw(list(x.shape), x.dtype, x.device, draw_seed(), self.stream, self.p)
        return x.mul_(mask) if self.inplace else x * mask


def draw_seed() -> torch.Tensor:
    """One draw of the default CPU generator (which thus advances alike on every rank): the seed of masks drawn apart
    from torch's own sampler. A tensor, which torch.compile traces; reading it as a number would break the graph."""
    return torch.randint(0, 2**62, (), dtype=torch.int64)


@contextlib.contextmanager
def own_random_stream(stream: int, device: torch.device) -> Iterator[None]:
    """Random numbers drawn inside come from a stream of their own when `stream` is nonzero: seeded from one draw of
    the default CPU generator and the stream number. The draw is on the CPU whatever the device: reading a CUDA draw
    would stop the host until the GPU caught up, twice per block."""
    if not stream:
        yield
        return
    with seeded_stream(int(draw_seed()), stream, device):
        yield


@contextlib.contextmanager
def seeded_stream(seed: int, stream: int, device: torch.device) -> Iterator[None]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.manual_seed(hash((seed, stream)) & (2**63 - 1))
        yield


def dropout_mask(
    shape: list[int], dtype: torch.dtype, device: torch.device, seed: torch.Tensor, stream: int, p: float
) -> torch.Tensor:
    """Dropout's factor, 0 or 1 / (1 - p), for a tensor of `shape`: drawn by numpy's PCG64 from (seed, stream) for
    fp32 on the CPU (Dropout's fast path), by torch's sampler in stream `stream` of `seed` elsewhere."""
    if device.type == "cpu" and dtype == torch.float32:
        numel = math.prod(shape)
        values = np.random.Generator(np.random.PCG64([int(seed), stream])).random(numel, dtype=np.float32)
        keep = values >= np.float32(p)
        np.multiply(keep, np.float32(1.0) / np.float32(1.0 - p), out=values)  # F.dropout's 1/(1-p), in fp32
        return torch.from_numpy(values).view(shape)
    with seeded_stream(int(seed), stream, device):
        return F.dropout(torch.ones(shape, dtype=dtype, device=device), p)


# what torch.compile calls: the same function, opaque to dynamo (eager runs skip the custom op's dispatch overhead)
dropout_mask_op = torch.library.custom_op("scalelm::dropout_mask", dropout_mask, mutates_args=())


@dropout_mask_op.register_fake
def _(shape, dtype, device, seed, stream, p):
    return torch.empty(shape, dtype=dtype, device=device)


def stream_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, stream: int) -> torch.Tensor:
    """Causal scaled_dot_product_attention with dropout `p` drawn in stream `stream` (a tensor-parallel rank's own
    heads). Under torch.compile one opaque op whose backward runs the attention again under the same seed (the
    kernels' own saved state differs by backend): one more attention forward, instead of a block run eagerly."""
    if torch.compiler.is_compiling():
        return torch.ops.scalelm.stream_attention(q, k, v, draw_seed(), stream, p).transpose(1, 2)
    with own_random_stream(stream, q.device):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
    """(batch, heads, seq, head_dim) -> (batch, seq, heads, head_dim): the layout the heads are merged from."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p).transpose(1, 2)


# The ops' outputs are contiguous whatever the attention kernel's layout, as their fake kernels say (the compiled
# graph checks the strides). Both run SDPA with gradients tracked, as the eager path does: its choice of kernel, and so
# of masks, depends on that. (An op's kernel runs with autograd's dispatch keys excluded: the forward records no
# graph, and the backward takes its gradients with torch.func.)
@torch.library.custom_op("scalelm::stream_attention", mutates_args=())
def _stream_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seed: torch.Tensor, stream: int, p: float
) -> torch.Tensor:
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad(), seeded_stream(int(seed), stream, q.device):
        return _causal_attention(*inputs, p).detach().contiguous()


@_stream_attention.register_fake
def _(q, k, v, seed, stream, p):
    batch, heads, seq, _ = q.shape
    return q.new_empty(batch, seq, heads, v.shape[-1])


@torch.library.custom_op("scalelm::stream_attention_backward", mutates_args=())
def _stream_attention_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seed: torch.Tensor, stream: int, p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with seeded_stream(int(seed), stream, q.device):
        _, pullback = torch.func.vjp(partial(_causal_attention, p=p), q, k, v)
    dq, dk, dv = (g.contiguous() for g in pullback(grad))
    return dq, dk, dv


@_stream_attention_backward.register_fake
def _(grad, q, k, v, seed, stream, p):
    return tuple(t.new_empty(t.shape) for t in (q, k, v))


def _save_attention_inputs(ctx, inputs, output):
    q, k, v, seed, stream, p = inputs
    ctx.save_for_backward(q, k, v, seed)
    ctx.stream, ctx.p = stream, p


def _attention_backward(ctx, grad):
    q, k, v, seed = ctx.saved_tensors
    dq, dk, dv = torch.ops.scalelm.stream_attention_backward(grad, q, k, v, seed, ctx.stream, ctx.p)
    return dq, dk, dv, None, None, None


_stream_attention.register_autograd(_attention_backward, setup_context=_save_attention_inputs)
STREAM_ATTENTION_OP = torch.ops.scalelm.stream_attention.default  # what selective checkpointing keeps


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor
) -> torch.Tensor:
    """`lm_loss(F.linear(hidden, weight, bias), targets)`: the mean loss of the output projection's logits.

    hidden (tokens, d_model), weight (vocab, d_model), targets (tokens,). Fused on CPU in fp32 when gradients are
    wanted (training: `cpu_fusable`); the plain composition everywhere else (GPUs, autocast, bf16, no_grad).
    """
    if cpu_fusable(hidden, weight, bias):
        return LinearCrossEntropy.apply(hidden, weight, bias, targets)
    return lm_loss(aligned_linear(hidden, weight, bias), targets)


def cpu_fusable(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Where `LinearCrossEntropy` computes the loss: on the CPU in fp32, gradients wanted, some tokens."""
    return (
        torch.is_grad_enabled()
        and hidden.device.type == "cpu"
        and hidden.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and not torch.is_autocast_enabled("cpu")
        and (hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
        and hidden.shape[0] > 0
    )


class LinearCrossEntropy(torch.autograd.Function):
    """Output projection + mean cross-entropy, with all three gradients computed in the forward pass.

    The unfused path allocates, writes and reads several (tokens x vocabulary) tensors per step: the logits, their
    log-softmax, the loss gradient (a zero-filled one-hot) and the log-softmax gradient. Here the bias and a column
    of ones travel as extra columns of a copy of the weight, A = [W | b | 1 | 0...], and of the hidden states,
    X = [x | 1 | 0 | 0...] (zero-padded to a multiple of 8 columns: MKL is much slower on odd inner and outer
    dimensions). Per chunk of at most CHUNK_ROWS tokens:

        z = A X^T                  the logits W x^T + b, transposed (vocab x tokens), into a reused workspace
        e = exp(z)                 in place: the only pass over that buffer besides the three products
        e^T A = [e^T W | . | s]    the hidden-state gradient's product, and s = sum(e) per token with it
        e X / s = [dW | db | 0]    the weight and bias gradients in one product, summed over chunks

    so that softmax = e / s and loss = log(s) - z[target]; the one-hot terms are subtracted from the small
    (tokens x d_model) and (vocab x d_model) results. exp without the usual shift by the per-token maximum
    overflows for logits above 88 and loses precision when all of a token's logits are below -69: a chunk where
    any s falls outside [2^-100, 2^100] (inf and nan included) is recomputed with the shift. Unshifted, a token's
    loss carries the rounding of log(s), about 1e-7 of its logits' size, instead of that of the loss itself; the
    gradients are unaffected. backward() only scales the stored gradients by the incoming gradient (1 for a single
    micro-batch).
    """

    CHUNK_ROWS = CPU_LOSS_CHUNK_ROWS  # tokens per chunk: the workspace holds (vocab x CHUNK_ROWS) floats
    ALIGN = 32  # the logits' row stride is padded to a multiple of this: MKL's GEMM writes it much faster
    SAFE_SUM = (2.0**-100, 2.0**100)  # sums of unshifted exponentials trusted without the max shift
    _workspace: ClassVar[dict[tuple[str, torch.device, torch.dtype], torch.Tensor]] = {}

    @staticmethod
    def workspace(name: str, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        """A (rows x cols) buffer kept between steps: reallocating it every step costs page faults."""
        key = (name, like.device, like.dtype)
        buffer = LinearCrossEntropy._workspace.get(key)
        if buffer is None or buffer.numel() < rows * cols:
            LinearCrossEntropy._workspace.pop(key, None)
            buffer = LinearCrossEntropy._workspace[key] = like.new_empty(rows * cols)
        return buffer[: rows * cols].view(rows, cols)

    @staticmethod
    def columns(d_model: int) -> int:
        """Columns of A and X: d_model, the bias's and the sum's, zero-padded to a multiple of 8."""
        return -(-(d_model + 2) // 8) * 8

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets):
        (n, d), vocab = hidden.shape, weight.shape[0]
        valid = targets != IGNORE_INDEX
        count = valid.sum()
        safe = torch.where(valid, targets, 0)  # any in-range index: ignored rows get weight 0 below
        # d(mean loss)/d(row loss): 1/count for counted rows, 0 for ignored ones (nan if none counts, as in F)
        row_weight = valid.to(hidden.dtype) / count
        cols = LinearCrossEntropy.columns(d)
        table = LinearCrossEntropy.workspace("table", vocab, cols, hidden)  # A = [W | b | 1 | 0...]
        table[:, :d] = weight
        table[:, d] = 0 if bias is None else bias
        table[:, d + 1] = 1
        table[:, d + 2 :] = 0
        inputs = hidden.new_zeros(n, cols)  # X = [x | 1 | 0 | 0...]
        inputs[:, :d] = hidden
        inputs[:, d] = 1
        chunks = -(-n // LinearCrossEntropy.CHUNK_ROWS)
        rows = -(-n // chunks)  # balanced chunks
        width = -(-rows // LinearCrossEntropy.ALIGN) * LinearCrossEntropy.ALIGN
        if width % 256 == 0:  # a row stride of a multiple of 1 KiB slows the GEMMs (cache-set aliasing)
            width += LinearCrossEntropy.ALIGN
        logits = LinearCrossEntropy.workspace("logits", vocab, width, hidden)
        grads = LinearCrossEntropy.workspace("grads", vocab, cols, hidden)  # [dW | db | 0...], summed over chunks
        products = hidden.new_empty(n, cols)  # e^T A, row by row: [e^T W | e^T b | s | 0...]
        total = hidden.new_zeros(())
        low, high = LinearCrossEntropy.SAFE_SUM
        for first in range(0, n, rows):
            x = inputs[first : first + rows]
            c = x.shape[0]
            z, out = logits[:, :c], products[first : first + c]
            torch.mm(table, x.t(), out=z)
            target_logit = z.gather(0, safe[first : first + c][None]).squeeze(0)
            peak = 0.0
            torch.mm(z.exp_().t(), table, out=out)
            s = out[:, d + 1]
            if not bool(((s >= low) & (s <= high)).all()):  # rare: again, with the usual max shift
                torch.mm(table, x.t(), out=z)
                peak = z.amax(0)
                torch.mm(z.sub_(peak).exp_().t(), table, out=out)
            total += ((peak + s.log() - target_logit) * valid[first : first + c]).sum()
            # d loss / d logits = w (softmax - onehot(t)) = e (w / s) - w onehot(t), row by row
            scale = (row_weight[first : first + c] / s)[:, None]
            out.mul_(scale)
            if first == 0:
                torch.mm(z, x * scale, out=grads)
            else:
                grads.addmm_(z, x * scale)
        grad_hidden = products[:, :d].sub_(weight[safe] * row_weight[:, None]).contiguous()
        grad_weight = grads[:, :d].contiguous().index_add_(0, safe, hidden * row_weight[:, None], alpha=-1)
        grad_bias = None if bias is None else grads[:, d].clone().index_add_(0, safe, row_weight, alpha=-1)
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        return total / count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        return (*stored_gradients(ctx, grad_loss, "LinearCrossEntropy"), None)
