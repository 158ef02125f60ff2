"""The causal Transformer language model (transformer.py) and its CPU fast paths (cpu_ops.py)."""

from scalelm.model.transformer import TransformerLM, count_parameters, flops_per_token

__all__ = ["TransformerLM", "count_parameters", "flops_per_token"]
