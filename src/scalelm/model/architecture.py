"""The model's parameters as data, without torch: each one's name, shape and FSDP unit, the model's tensor-parallel
plan (how each of a block's matrices is split), which are experts (split over expert-parallel ranks), the parameters
in all and those a token uses (`parameter_counts`), its training FLOPs per token, and the fused CPU loss's chunk.
scalelm.model.transformer builds exactly these parameters (tests/test_plan.py compares a built model with them),
scalelm.parallel.tensor applies the plan, scalelm.plan counts their bytes, and MFU (scalelm.measure.peak) divides the
FLOPs: one declaration for all, importable where torch is not (the workflow's planning, the report).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from scalelm.config import ModelConfig

Split = Literal["colwise", "rowwise"]

# Megatron's pairs: the first matrix split by output rows (its weight's dim 0, its bias too), the second by input
# columns (dim 1; its bias is added once, after the sum). The qkv rows are grouped by head: whole heads per rank.
BLOCK_TP_PLAN: dict[str, Split] = {
    "attn.qkv": "colwise",
    "attn.out": "rowwise",
    "ffn.up": "colwise",
    "ffn.down": "rowwise",
}
# model.family llama: the qkv rows grouped by key/value head (whole groups per rank), SwiGLU's w1 and w3 by rows
LLAMA_TP_PLAN: dict[str, Split] = {
    "attn.qkv": "colwise",
    "attn.out": "rowwise",
    "ffn.w1": "colwise",
    "ffn.w3": "colwise",
    "ffn.w2": "rowwise",
}
QKV_WEIGHT = "attn.qkv.weight"  # one per block
# tokens per chunk of the fused CPU loss (scalelm.model.cpu_ops.LinearCrossEntropy): its logits workspace holds
# (vocab x this) floats, which the memory plan counts
CPU_LOSS_CHUNK_ROWS = 1024
# tokens per chunk of the chunked GPU loss (train.fused_loss: chunked; scalelm.model.gpu_ops): a chunk's logits and
# their gradient live at once (the plan counts them); fewer, larger chunks sum the fp32 weight gradient fewer times
GPU_LOSS_CHUNK_ROWS = 8192


@dataclass(frozen=True)
class Parameter:
    """One parameter: its shape, the FSDP unit it belongs to, the dimension tensor parallelism splits (or None)."""

    name: str
    shape: tuple[int, ...]
    unit: str  # "embed", "blocks.<i>", "root" (the final norm), "head"
    tp_dim: int | None
    expert: bool = False  # one slice per expert along dim 0, which expert parallelism splits

    def numel(self, tp: int = 1, shard: int = 1, ep: int = 1) -> int:
        """Elements on one rank: split by `tp` along tp_dim, an expert's by `ep` along its experts, then FSDP's first
        dimension by `shard` (rounded up)."""
        shape = list(self.shape)
        if tp > 1 and self.tp_dim is not None:
            shape[self.tp_dim] //= tp
        if self.expert:
            shape[0] //= ep
        shape[0] = -(-shape[0] // shard)
        return math.prod(shape)


def block_tp_plan(model: ModelConfig) -> dict[str, Split]:
    """How tensor parallelism splits a block's matrices, for the model's family."""
    return LLAMA_TP_PLAN if model.family == "llama" else BLOCK_TP_PLAN


def linear(name: str, out_features: int, in_features: int, unit: str, llama: bool = False) -> list[Parameter]:
    """A linear layer's weight and bias (llama: no bias), split as the block's TP plan says."""
    split = (LLAMA_TP_PLAN if llama else BLOCK_TP_PLAN).get(name)
    weight_dim = {"colwise": 0, "rowwise": 1, None: None}[split]
    bias_dim = 0 if split == "colwise" else None
    prefix = f"{unit}.{name}"
    weight = [Parameter(f"{prefix}.weight", (out_features, in_features), unit, weight_dim)]
    return weight if llama else weight + [Parameter(f"{prefix}.bias", (out_features,), unit, bias_dim)]


def norm(name: str, d: int, unit: str, llama: bool = False) -> list[Parameter]:
    """A LayerNorm's weight and bias; llama's RMSNorm: its weight."""
    prefix = f"{unit}.{name}" if unit != "root" else name
    weight = [Parameter(f"{prefix}.weight", (d,), unit, None)]
    return weight if llama else weight + [Parameter(f"{prefix}.bias", (d,), unit, None)]


def mixture(model: ModelConfig, unit: str) -> list[Parameter]:
    """A mixture of experts' parameters (scalelm.model.moe.MoE): the router, then every expert's FFN stacked along
    dim 0; tensor parallelism leaves them whole (each rank of a group computes the layer alike)."""
    d, f, experts = model.d_model, model.expert_width(), model.moe.experts
    prefix = f"{unit}.ffn"
    router = Parameter(f"{prefix}.router.weight", (experts, d), unit, None)
    if model.family == "llama":  # SwiGLU experts, no biases
        shapes = {"w1": (experts, f, d), "w3": (experts, f, d), "w2": (experts, d, f)}
        return [router] + [Parameter(f"{prefix}.experts.{n}", s, unit, None, expert=True) for n, s in shapes.items()]
    return [
        router,
        Parameter(f"{prefix}.experts.up_weight", (experts, f, d), unit, None, expert=True),
        Parameter(f"{prefix}.experts.up_bias", (experts, f), unit, None, expert=True),
        Parameter(f"{prefix}.experts.down_weight", (experts, d, f), unit, None, expert=True),
        Parameter(f"{prefix}.experts.down_bias", (experts, d), unit, None, expert=True),
    ]


def is_moe_block(model: ModelConfig, index: int) -> bool:
    return model.moe is not None and model.moe.is_moe_block(index)


def parameters(model: ModelConfig, vocab_size: int, loss_parallel: bool = False) -> list[Parameter]:
    """Every parameter of scalelm.model.transformer.TransformerLM, in its order, with the split tensor parallelism
    gives it (the head's by vocabulary with loss_parallel; the embedding's by vocabulary unless tied to a whole head:
    scalelm.parallel.tensor)."""
    d, f, llama = model.d_model, model.d_ff, model.family == "llama"
    vocab_split = 0 if loss_parallel else None
    embed_split = vocab_split if model.tie_weights else 0
    tensors = [Parameter("embed.weight", (vocab_size, d), "embed", embed_split)]
    for i in range(model.n_layers):
        unit = f"blocks.{i}"
        tensors += linear("attn.qkv", qkv_rows(model), d, unit, llama) + linear("attn.out", d, d, unit, llama)
        if is_moe_block(model, i):
            tensors += mixture(model, unit)
        elif llama:
            tensors += linear("ffn.w1", f, d, unit, llama) + linear("ffn.w3", f, d, unit, llama)
            tensors += linear("ffn.w2", d, f, unit, llama)
        else:
            tensors += linear("ffn.up", f, d, unit) + linear("ffn.down", d, f, unit)
        tensors += norm("norm1", d, unit, llama) + norm("norm2", d, unit, llama)
    tensors += norm("norm", d, "root", llama)
    if not model.tie_weights:
        tensors.append(Parameter("head.weight", (vocab_size, d), "head", vocab_split))
    if not llama:
        tensors.append(Parameter("head.bias", (vocab_size,), "head", vocab_split))
    return tensors


def qkv_rows(model: ModelConfig) -> int:
    """The qkv projection's outputs: a query per head, a key and a value per key/value head (grouped-query
    attention's fewer under llama; the course's block has one per head)."""
    return (model.n_heads + 2 * model.kv_heads) * model.head_dim


def parameter_counts(model: ModelConfig, vocab_size: int) -> dict[str, int]:
    """The model's parameters in all, and those one token uses (`active`): a mixture's router and its top_k experts,
    not the others (a dense model's are all of them)."""
    tensors = parameters(model, vocab_size)
    total = sum(t.numel() for t in tensors)
    idle = 0
    if model.moe is not None:
        unused = model.moe.experts - model.moe.top_k
        idle = sum(t.numel() // model.moe.experts * unused for t in tensors if t.expert)
    return {"total": total, "active": total - idle}


def ffn_matmul_params(config: ModelConfig, index: int) -> int:
    """The weights of block `index`'s feed-forward products one token goes through: the dense FFN's, or a
    mixture's router and top_k experts."""
    d, matrices = config.d_model, 3 if config.family == "llama" else 2  # SwiGLU's w1, w3, w2
    if not is_moe_block(config, index):
        return matrices * d * config.d_ff
    return d * config.moe.experts + config.moe.top_k * matrices * d * config.expert_width()


def flops_per_token(config: ModelConfig, vocab_size: int, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward = 3x forward), matmuls only, as in the PaLM/nanoGPT estimate; a
    mixture counts the experts a token goes through (its active parameters). MFU's numerator (scalelm.measure.peak),
    attention over the whole sequence (`attention_flops_per_token`)."""
    d, layers = config.d_model, config.n_layers
    ffn = sum(ffn_matmul_params(config, i) for i in range(layers))
    attention = qkv_rows(config) * d + d * d  # qkv and out: 4 d^2, less under grouped-query attention
    matmul_params = layers * attention + ffn + d * vocab_size
    return 6 * matmul_params + attention_flops_per_token(layers, d, seq_len)


def attention_flops_per_token(n_layers: int, d_model: int, seq_len: int) -> int:
    """Attention's QK^T and AV per token in training, over the full (unmasked) sequence: 12 L s d, as nanoGPT, PaLM and
    torchtitan count them. A causal mask leaves half of those products to compute: llm.c counts 6 L s d
    (scalelm.measure.peak.causal_flops_per_token)."""
    return 12 * n_layers * seq_len * d_model
