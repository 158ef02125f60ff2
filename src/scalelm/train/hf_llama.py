"""A consolidated llama-family model (model.family: llama) as Hugging Face transformers' LlamaForCausalLM.

    python -m scalelm.train.hf_llama --model results/runs/llama_small/seed1/model.pt --out hf/llama_small

reads a model file of `python -m scalelm.train.consolidate` (its sha256 checked against its record) and writes a
directory that `LlamaForCausalLM.from_pretrained` loads (config.json and safetensors weights; the vocabulary stays
scalelm's, data/prepared's vocab): the same logits, to float rounding (tests/test_hf_llama.py). Needs transformers
(pip install 'scalelm[hf]').

The weights map one to one but for the qkv projection, whose rows scalelm groups by key/value head (the query heads of
a group, then its key, then its value: scalelm.model.llama) and Hugging Face keeps as three matrices; both rotate the
pairs (i, i + head_dim / 2) of a head (no permutation of the query and key rows). The course's block (family gpt2)
and a mixture of experts (Llama has none) are refused by name.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from scalelm.config import ModelConfig
from scalelm.errors import ConfigError, friendly_errors
from scalelm.model.llama import RMS_EPS
from scalelm.model.transformer import TransformerLM


def check_convertible(config: ModelConfig) -> None:
    if config.family != "llama":
        raise ConfigError(
            f"model.family={config.family}: LlamaForCausalLM computes the llama block only; train with "
            "model.family=llama to convert"
        )
    if config.moe is not None:
        raise ConfigError("model.moe: LlamaForCausalLM has no mixture of experts; convert a dense llama model")


def hf_config(config: ModelConfig, vocab_size: int):
    """The LlamaConfig of a model of `config` (checked: `check_convertible`)."""
    from transformers import LlamaConfig

    check_convertible(config)
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.d_ff,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=RMS_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        tie_word_embeddings=config.tie_weights,
    )


def hf_state_dict(model: TransformerLM) -> dict[str, torch.Tensor]:
    """`model`'s weights under LlamaForCausalLM's names (the qkv rows split into q, k and v)."""
    config, state = model.config, model.state_dict()
    check_convertible(config)
    group, head = config.n_heads // config.kv_heads, config.head_dim
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"]}
    for i in range(config.n_layers):
        block, hf = f"blocks.{i}", f"model.layers.{i}"
        qkv = state[f"{block}.attn.qkv.weight"].view(config.kv_heads, group + 2, head, config.d_model)
        out[f"{hf}.self_attn.q_proj.weight"] = qkv[:, :group].reshape(-1, config.d_model)
        out[f"{hf}.self_attn.k_proj.weight"] = qkv[:, group].reshape(-1, config.d_model)
        out[f"{hf}.self_attn.v_proj.weight"] = qkv[:, group + 1].reshape(-1, config.d_model)
        out[f"{hf}.self_attn.o_proj.weight"] = state[f"{block}.attn.out.weight"]
        for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            out[f"{hf}.mlp.{theirs}.weight"] = state[f"{block}.ffn.{ours}.weight"]
        out[f"{hf}.input_layernorm.weight"] = state[f"{block}.norm1.weight"]
        out[f"{hf}.post_attention_layernorm.weight"] = state[f"{block}.norm2.weight"]
    out["lm_head.weight"] = state["head.weight"] if not config.tie_weights else state["embed.weight"]
    return {name: tensor.contiguous().clone() for name, tensor in out.items()}


def to_hf_llama(model: TransformerLM):
    """`model` (model.family llama, dense) as a LlamaForCausalLM in eval mode, on the CPU in fp32."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM(hf_config(model.config, model.vocab_size)).float()
    hf.load_state_dict(hf_state_dict(model), strict=True)
    return hf.eval()


def convert(model_file: Path, out: Path) -> dict[str, Any]:
    """The consolidated model file (checked against its record) as a LlamaForCausalLM directory `out`."""
    from scalelm.train.consolidate import load_consolidated

    model, info = load_consolidated(model_file)
    to_hf_llama(model).save_pretrained(out)
    return {"out": str(out), "step": info["step"], "sha256": info["sha256"]}


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalelm.train.hf_llama", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a consolidated model file (model.pt)")
    parser.add_argument("--out", type=Path, required=True, help="directory to write (LlamaForCausalLM.save_pretrained)")
    args = parser.parse_args(argv)
    done = convert(args.model, args.out)
    print(f"wrote LlamaForCausalLM of step {done['step']} of {args.model} (sha256 {done['sha256'][:12]}) to {args.out}")


if __name__ == "__main__":
    main()
