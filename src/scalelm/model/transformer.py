"""A causal Transformer language model.

Shape of the course model (embedding, sinusoidal positions, N blocks, final LayerNorm, output projection),
with the defect fixed: attention is causal, through scaled_dot_product_attention(is_causal=True), which also gives
GPUs the fused flash/memory-efficient kernels. Each block is its own module so FSDP can shard block by block.
With model.family llama the blocks are today's (scalelm.model.llama: RMSNorm, SwiGLU, rotary grouped-query attention,
no biases), under the same names and hooks, so that every layout applies to both; the model then has no positional
table and its head no bias.

Training calls `model(inputs, targets)`, which returns the mean next-token cross-entropy instead of the logits.
On CPU in fp32 that loss goes through `LinearCrossEntropy`, which fuses the output projection with the loss and
its gradient, chunk by chunk, and so never materialises the (tokens x vocabulary) logits, their log-softmax and
its gradient as separate tensors (see docs/benchmarks.md); elsewhere it is the plain
`lm_loss(head(x), targets)` (scalelm.model.loss), or with train.fused_loss: chunked the chunked GPU loss
(scalelm.model.gpu_ops). All compute the same function.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from scalelm.config import ModelConfig
from scalelm.model.architecture import is_moe_block
from scalelm.model.cpu_ops import Dropout, cpu_fusable, linear_cross_entropy, stream_attention
from scalelm.model.gpu_ops import (
    ChunkLoss,
    aligned_linear,
    chunked_linear_cross_entropy,
    chunked_loss_applies,
    loss_chunk,
)
from scalelm.model.llama import GroupedQueryAttention, SwiGLU, rms_norm
from scalelm.model.loss import lm_loss
from scalelm.model.moe import MoE


def sinusoidal_positions(max_len: int, d_model: int) -> torch.Tensor:
    position = torch.arange(max_len, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(max_len, d_model)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq[: d_model // 2])
    return table


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. The qkv projection's output rows are grouped by head ([q k v] of head 0,
    then of head 1, ...), so a column-wise split across tensor-parallel ranks gives each rank whole heads."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = dropout
        self.dropout_stream = 0  # nonzero: this rank's heads are its own (tensor parallel), so are their masks
        # (q, k, v, dropout_p) -> attention, in place of SDPA: context parallelism's ring over the whole sequence
        self.core = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.qkv(x)  # under tensor parallelism: this rank's heads only
        q, k, v = qkv.view(batch, seq, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        p = self.dropout if self.training else 0.0
        if self.core is not None:
            y = self.core(q, k, v, p)
        elif p and self.dropout_stream:  # this rank's heads' own masks (tensor parallelism)
            y = stream_attention(q, k, v, p, self.dropout_stream)
        else:  # no context manager on the common path: nothing for torch.compile to trace through
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.up = nn.Linear(d_model, d_ff)
        self.drop = Dropout(dropout)
        self.down = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(F.relu(self.up(x))))


class Block(nn.Module):
    """The course's block (LayerNorm, ReLU FFN, post- or pre-norm) or, with model.family llama, today's
    (scalelm.model.llama: pre-norm RMSNorm, SwiGLU, rotary grouped-query attention); the same names and hooks."""

    def __init__(self, config: ModelConfig, index: int):
        super().__init__()
        llama = config.family == "llama"
        self.pre_norm = llama or config.norm == "pre"
        if llama:
            self.attn = GroupedQueryAttention(config)
        else:
            self.attn = CausalSelfAttention(config.d_model, config.n_heads, config.dropout)
        if is_moe_block(config, index):
            self.ffn = MoE(config, index)
        elif llama:
            self.ffn = SwiGLU(config.d_model, config.d_ff, config.dropout)
        else:
            self.ffn = FeedForward(config.d_model, config.d_ff, config.dropout)
        self.norm1 = norm_of(config)
        self.norm2 = norm_of(config)
        self.drop = Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.drop(self.attn(self.norm1(x)))
            return x + self.drop(self.ffn(self.norm2(x)))
        x = self.norm1(x + self.drop(self.attn(x)))
        return self.norm2(x + self.drop(self.ffn(x)))


def norm_of(config: ModelConfig) -> nn.Module:
    return rms_norm(config.d_model) if config.family == "llama" else nn.LayerNorm(config.d_model)


class OutputHead(nn.Linear):
    """The output projection; given targets, it returns the mean cross-entropy of its logits instead of them, by the
    path train.fused_loss (`fused_loss`, set with the model's options) chooses: auto, fused with the projection on CPU
    in fp32 (scalelm.model.cpu_ops), the plain composition elsewhere (on CUDA compiled with the head); chunked, chunk
    by chunk where the CPU's fused loss does not apply (scalelm.model.gpu_ops: the logits never kept for the
    backward); plain, the plain composition everywhere. All compute the same function. Its own forward, so that FSDP
    can shard it as a unit."""

    fused_loss = "auto"
    chunk: ChunkLoss = staticmethod(loss_chunk)  # one chunk of the chunked loss; compiled by `compile`

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return aligned_linear(x, self.weight, self.bias)
        hidden, targets = x.flatten(0, -2), targets.flatten()
        if self.fused_loss == "plain":
            return lm_loss(aligned_linear(hidden, self.weight, self.bias), targets)
        chunked = self.fused_loss == "chunked" and not cpu_fusable(hidden, self.weight, self.bias)
        if chunked and chunked_loss_applies(hidden, self.weight, self.bias):
            return chunked_linear_cross_entropy(hidden, self.weight, self.bias, targets, self.chunk)
        return linear_cross_entropy(hidden, self.weight, self.bias, targets)

    def compile(self, **options) -> None:
        """nn.Module.compile, and the chunked loss's chunk function compiled with the same `options`: the chunked
        loss runs outside the compiled forward (a loop over chunks), each chunk through one compiled graph."""
        super().compile(**options)
        self.chunk = torch.compile(loss_chunk, **options)


class TransformerLM(nn.Module):
    def __init__(self, config: ModelConfig, vocab_size: int):
        super().__init__()
        self.config = config
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, config.d_model)
        # the course's sinusoidal table; a llama block rotates its queries and keys instead (no table, no scaling)
        self.positional = config.family == "gpt2"
        if self.positional:
            self.register_buffer("positions", torch.empty(config.max_seq_len, config.d_model), persistent=False)
        self.drop = Dropout(config.dropout)
        # keyed by index: a pipeline stage keeps its own blocks under their names (blocks.3.attn...), so every
        # stage's checkpoint speaks the whole model's names
        self.blocks = nn.ModuleDict({str(i): Block(config, i) for i in range(config.n_layers)})
        self.norm = norm_of(config)
        self.head = OutputHead(config.d_model, vocab_size, bias=self.positional)  # llama: no biases
        self.loss_parallel = False  # set by tensor parallelism: the head's logits are split by vocabulary
        # set on the last stage of a pipeline (scalelm.parallel.pipeline.Pipeline): its forward ends with the final
        # norm, and the schedule's loss function runs `head_loss`, so the head and its loss stay the whole model's
        # one fused (on CUDA compiled) path
        self.head_in_loss = False
        # set by context parallelism: this rank holds part of every sequence (parallel.context.SequenceSplit)
        self.sequence_split = None
        self.init_buffers()
        self.reset_parameters()
        if config.tie_weights:
            self.head.weight = self.embed.weight

    def split_dropout_streams(self, stream: int, sequence_parallel: bool) -> None:
        """Under tensor parallelism, the dropouts on activations split across the group (a rank's heads, its FFN
        columns, with sequence parallelism its part of the sequence) draw from `stream`, this rank's own; the others
        keep the stream the group shares, and so the same masks on every rank."""
        for block in self.blocks.values():
            block.attn.dropout_stream = stream
            if isinstance(block.ffn, FeedForward | SwiGLU):  # (a mixture's experts have no inner dropout)
                block.ffn.drop.stream = stream
            if sequence_parallel:
                block.drop.stream = stream
        if sequence_parallel and self.embed is not None:
            self.drop.stream = stream

    def init_buffers(self) -> None:
        """Values that are not parameters: recomputed after a model built on the meta device is materialised."""
        if self.positional:
            self.positions.copy_(sinusoidal_positions(self.config.max_seq_len, self.config.d_model))

    def reset_parameters(self) -> None:
        mixtures = [m for m in self.modules() if isinstance(m, MoE)]
        own = {id(p) for m in mixtures for p in m.parameters()}  # (initialised by their mixture, below)
        for name, param in self.named_parameters():
            if id(param) in own:
                continue
            if param.dim() > 1:
                nn.init.xavier_uniform_(param)
            elif name.endswith("bias"):
                nn.init.zeros_(param)
        for module in mixtures:
            module.reset_parameters()

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab); position t sees tokens 0..t only.

        With targets (batch, seq): the mean cross-entropy of those logits against the targets (entries equal to
        IGNORE_INDEX left out): `lm_loss(logits, targets)`, fused with the output projection on CPU.

        A pipeline stage (scalelm.parallel.pipeline) lacks the parts of other stages: without the embedding it takes
        the previous stage's hidden states instead of tokens, without the head it returns its own; the last stage
        returns them after the final norm (`head_in_loss`), for its loss function's `head_loss`. Under context
        parallelism the tokens are this rank's part of each sequence (`sequence_split`), read at their global
        positions.
        """
        if self.embed is not None:
            seq = tokens.shape[1]
            split = self.sequence_split
            whole = seq if split is None else seq * split.size
            if whole > self.config.max_seq_len:
                raise ValueError(f"sequence of {whole} tokens exceeds model.max_seq_len={self.config.max_seq_len}")
            if not self.positional:  # (rotary positions: in each block's attention)
                x = self.drop(self.embed(tokens))
            else:
                at = self.positions[:seq] if split is None else self.positions[split.positions(seq, tokens.device)]
                x = self.drop(self.embed(tokens) * math.sqrt(self.config.d_model) + at)
        else:
            x = tokens
        for block in self.blocks.values():
            x = block(x)
        if self.head is None:
            return x
        x = self.norm(x)
        if targets is not None:
            return self.head_loss(x, targets)
        return x if self.head_in_loss else self.logits(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head's logits of `x` (after the final norm), split by vocabulary under loss_parallel."""
        # (no targets, but an argument for them: under sequence parallelism the head's input hook takes two)
        return self.head(x) if self.loss_parallel else self.head(x, None)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of the head's logits of `x` (after the final norm) against `targets`: the head's
        own fused path (scalelm.model.cpu_ops on CPU; the head compiled with its loss on CUDA). Under tensor
        parallelism's loss_parallel the logits are split by vocabulary, and the caller runs this under torch's
        loss_parallel()."""
        if self.loss_parallel:
            return lm_loss(self.head(x), targets)
        return self.head(x, targets)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
