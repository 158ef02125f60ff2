"""Today's block beside the course's (model.family: llama): RMSNorm before attention and before the feed-forward
network, a SwiGLU feed-forward network (w2(silu(w1 x) * w3 x)), rotary position embeddings in place of a positional
table, grouped-query attention (n_kv_heads key/value heads, each serving n_heads / n_kv_heads query heads), and no
biases anywhere (the head's neither). Hugging Face's LlamaForCausalLM computes the same function
(scalelm.train.hf_llama converts a consolidated model).

The qkv projection is one matrix whose output rows are grouped by key/value head: for each, its query heads, then its
key, then its value ([q q k v] of group 0, then of group 1, ... with two query heads a group), so that a column-wise
split across tensor-parallel ranks gives each rank whole groups (tp must divide n_kv_heads). Rotary positions are the
tokens' true positions in the sequence: under context parallelism this rank's (`sequence_split`, set by
scalelm.parallel.context.apply_cp), which load balancing takes from both ends of the sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scalelm.config import ModelConfig
from scalelm.model.cpu_ops import Dropout, stream_attention

RMS_EPS = 1e-5  # RMSNorm's epsilon (Llama 2's and 3's; the Hugging Face conversion passes it on)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (tokens, head_dim) of the rotation at `positions`, in fp32, as Hugging Face's Llama computes them:
    frequency i of head_dim / 2 is theta^(-2i / head_dim), and its two features are i and i + head_dim / 2."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim)
    )
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (batch, heads, tokens, head_dim) rotated by (cos, sin) of its tokens: each pair (i, i + head_dim / 2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class GroupedQueryAttention(nn.Module):
    """Causal self-attention with rotary positions and `kv_heads` key/value heads (rows grouped as the module
    docstring says); the same hooks as the course's CausalSelfAttention (`core`, `dropout_stream`)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim, self.theta = config.head_dim, config.rope_theta
        self.group = config.n_heads // config.kv_heads  # query heads per key/value head
        self.qkv = nn.Linear(config.d_model, (config.n_heads + 2 * config.kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(config.d_model, config.d_model, bias=False)
        self.dropout = config.dropout
        self.dropout_stream = 0
        self.core = None  # context parallelism's ring, as CausalSelfAttention's
        self.sequence_split = None  # context parallelism: this rank's tokens' positions

    def positions(self, seq: int, device: torch.device) -> torch.Tensor:
        split = self.sequence_split
        return torch.arange(seq, device=device) if split is None else split.positions(seq, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.qkv(x).view(batch, seq, -1, self.group + 2, self.head_dim)  # (.., this rank's groups, ..)
        q = qkv[:, :, :, : self.group].flatten(2, 3).transpose(1, 2)  # (batch, heads, seq, head_dim)
        k, v = qkv[:, :, :, self.group].transpose(1, 2), qkv[:, :, :, self.group + 1].transpose(1, 2)
        cos, sin = rotary_tables(self.positions(seq, x.device), self.head_dim, self.theta)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        p = self.dropout if self.training else 0.0
        if self.core is not None or (p and self.dropout_stream):  # those take as many key/value heads as queries
            k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
            y = self.core(q, k, v, p) if self.core is not None else stream_attention(q, k, v, p, self.dropout_stream)
        else:  # the fused kernels read each key/value head for its group of queries
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, enable_gqa=self.group > 1)
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x), of hidden width d_ff; w1 and w3 split column-wise, w2 row-wise under tensor
    parallelism; the dropout on the hidden activation as the course's FFN's."""

    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)
        self.drop = Dropout(dropout)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.drop(F.silu(self.w1(x)) * self.w3(x)))


def rms_norm(d_model: int) -> nn.RMSNorm:
    return nn.RMSNorm(d_model, eps=RMS_EPS)
