"""A consolidated llama-family model loads into Hugging Face transformers' LlamaForCausalLM with the same logits."""

import pytest
import torch

from conftest import run_dir_of, train_here
from scalelm.config import ModelConfig, MoEConfig
from scalelm.errors import ConfigError
from scalelm.model.transformer import TransformerLM
from scalelm.train.consolidate import consolidate, load_consolidated
from scalelm.train.hf_llama import hf_state_dict, main
from scalelm.train.rundir import RunDir

transformers = pytest.importorskip("transformers")

LLAMA = {"model__family": "llama", "model__n_heads": 4, "model__n_kv_heads": 2, "model__rope_theta": 500.0}


@pytest.mark.parametrize("tie_weights", [False, True])
def test_a_consolidated_llama_model_gives_llamaforcausallms_logits(tiny_config, tmp_path, capsys, tie_weights):
    """Trained 3 steps (grouped-query attention, rotary base 500, untied or tied head), consolidated, converted by
    `python -m scalelm.train.hf_llama` and loaded by LlamaForCausalLM.from_pretrained: the same logits within 1e-5
    at every position of a sequence."""
    config = tiny_config(f"llama_{tie_weights}", **LLAMA, model__tie_weights=tie_weights, train__max_steps=3)
    train_here(config)
    meta = consolidate(RunDir(run_dir_of(config)), tmp_path / "model.pt")
    main(["--model", meta["model"], "--out", str(tmp_path / "hf")])
    assert "wrote LlamaForCausalLM of step 3" in capsys.readouterr().out
    ours, _ = load_consolidated(tmp_path / "model.pt")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, ours.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = ours(tokens), theirs(tokens).logits
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    assert theirs.config.tie_word_embeddings == tie_weights and theirs.config.num_key_value_heads == 2


def test_the_course_block_and_a_mixture_are_refused_by_name():
    gpt2 = TransformerLM(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_ff=32), 20)
    with pytest.raises(ConfigError, match="model.family=gpt2: LlamaForCausalLM computes the llama block only"):
        hf_state_dict(gpt2)
    moe = ModelConfig(family="llama", d_model=16, n_heads=2, n_layers=1, d_ff=32, moe=MoEConfig(experts=2))
    with pytest.raises(ConfigError, match="model.moe: LlamaForCausalLM has no mixture of experts"):
        hf_state_dict(TransformerLM(moe, 20))
