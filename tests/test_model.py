import torch

from scalelm.config import ModelConfig
from scalelm.model import TransformerLM, count_parameters


def test_causal_future_tokens_do_not_change_the_past():
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, dropout=0.0), vocab_size=50).eval()
    tokens = torch.randint(0, 50, (3, 24))
    t = 10
    changed = tokens.clone()
    changed[:, t + 1 :] = torch.randint(0, 50, (3, 24 - t - 1))
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])  # the later positions do see the change


def test_parameter_count_matches_the_course_formula_without_tying():
    # The course model has 257 * V + 1,186,304 parameters (embedding, layers, final norm, head).
    vocab = 1000
    model = TransformerLM(ModelConfig(), vocab)
    assert count_parameters(model) == 257 * vocab + 1_186_304


def test_weight_tying_and_pre_norm():
    config = ModelConfig(d_model=16, n_heads=2, n_layers=1, d_ff=32, tie_weights=True, norm="pre")
    model = TransformerLM(config, 100)
    assert model.head.weight is model.embed.weight
    assert model(torch.randint(0, 100, (2, 8))).shape == (2, 8, 100)
