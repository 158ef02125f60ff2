import pytest
import torch
import torch.nn.functional as F

from scalelm.config import ModelConfig, MoEConfig
from scalelm.model.architecture import parameter_counts, parameters
from scalelm.model.cpu_ops import Dropout, LinearCrossEntropy, linear_cross_entropy
from scalelm.model.loss import IGNORE_INDEX
from scalelm.model.moe import mixtures
from scalelm.model.transformer import TransformerLM, count_parameters


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


@pytest.mark.parametrize("tie_weights", [False, True])
def test_training_loss_is_the_cross_entropy_of_the_logits_with_the_same_gradients(monkeypatch, tie_weights):
    """model(tokens, targets), fused with the output projection on CPU, equals F.cross_entropy over model(tokens)."""
    monkeypatch.setattr(LinearCrossEntropy, "CHUNK_ROWS", 7)  # several chunks, the last one partial and padded
    torch.manual_seed(0)
    config = ModelConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, dropout=0.0, tie_weights=tie_weights)
    model = TransformerLM(config, vocab_size=300)
    tokens, targets = torch.randint(0, 300, (3, 20)), torch.randint(0, 300, (3, 20))
    targets[0, ::3] = IGNORE_INDEX

    loss = model(tokens, targets)
    assert "LinearCrossEntropy" in type(loss.grad_fn).__name__  # the fused path was taken
    (loss * 0.25).backward()  # as with 4 accumulated micro-batches
    fused = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    reference = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    (reference * 0.25).backward()

    assert torch.allclose(loss, reference, rtol=1e-6, atol=0)
    for name, p in model.named_parameters():
        assert torch.allclose(fused[name], p.grad, rtol=1e-4, atol=1e-8), name
    with torch.no_grad():  # evaluation keeps the plain path
        assert torch.allclose(model(tokens, targets), reference, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("case", "weight_scale", "bias_value"),
    [
        ("ordinary logits", 1.0, 0.0),
        ("logits above exp's fp32 range (overflow)", 40.0, 0.0),
        ("every logit far below zero (underflow)", 1.0, -150.0),
        ("no bias", 1.0, None),
    ],
)
def test_fused_loss_equals_f_cross_entropy_also_where_exp_leaves_fp32_range(
    monkeypatch, case, weight_scale, bias_value
):
    """The fused loss takes exp without the max shift; out-of-range sums must fall back to the shift, chunk by chunk."""
    monkeypatch.setattr(LinearCrossEntropy, "CHUNK_ROWS", 16)
    torch.manual_seed(0)
    hidden = torch.randn(40, 24)
    hidden[16:32] *= weight_scale  # only the second of three chunks leaves the range
    weight = torch.randn(97, 24) * 0.5
    bias = None if bias_value is None else torch.full((97,), bias_value) + 0.1 * torch.randn(97)
    targets = torch.randint(0, 97, (40,))
    targets[::5] = IGNORE_INDEX
    logits = F.linear(hidden, weight, bias)
    if weight_scale > 1:
        assert logits.max() > 89  # exp overflows in fp32
    if bias_value is not None and bias_value < -100:
        assert logits.max() < -100  # exp underflows for every word

    inputs = [t for t in (hidden, weight, bias) if t is not None]
    leaves, plain = ([t.clone().requires_grad_() for t in inputs] for _ in range(2))
    fused = linear_cross_entropy(leaves[0], leaves[1], None if bias is None else leaves[2], targets)
    fused.backward()
    reference = F.cross_entropy(F.linear(*plain), targets, ignore_index=IGNORE_INDEX)
    reference.backward()

    assert torch.isfinite(fused), case
    assert torch.allclose(fused, reference, rtol=1e-6, atol=0), case
    for mine, theirs in zip(leaves, plain):
        assert torch.allclose(mine.grad, theirs.grad, rtol=1e-4, atol=1e-7), case


def test_dropout_keeps_each_element_with_probability_1_minus_p_scaled_as_f_dropout():
    drop = Dropout(0.25)
    x = torch.randn(400, 500, requires_grad=True)
    torch.manual_seed(0)
    a = drop(x)
    torch.manual_seed(0)
    assert torch.equal(drop(x), a)  # the masks follow torch's seed (and so the RNG state in checkpoints)
    kept = a != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.005  # 5 standard deviations for 200,000 draws
    scale = F.dropout(torch.ones(1000), 0.25, training=True).max()  # torch's own 1 / (1 - p), in fp32
    assert torch.equal(a[kept], x[kept] * scale)
    a.sum().backward()
    assert torch.equal(x.grad, kept * scale)
    drop.eval()
    assert torch.equal(drop(x), x)


# ----------------------------------------------------------------------------------------- mixture of experts
MOE = ModelConfig(d_model=32, n_heads=2, n_layers=2, d_ff=64, dropout=0.0, moe=MoEConfig(experts=4, top_k=2))


def test_a_mixture_is_causal_routes_ties_to_the_lower_expert_and_declares_its_parameters():
    """The future changes no earlier output beyond float rounding (a changed token reroutes later rows, which changes
    how the experts' rows are batched, not what any earlier row computes); equal router scores go to the lower
    experts; the built parameters are those scalelm.model.architecture declares, total and active."""
    torch.manual_seed(0)
    model = TransformerLM(MOE, vocab_size=50).eval()
    tokens = torch.randint(0, 50, (2, 12))
    changed = tokens.clone()
    changed[:, 8] = (changed[:, 8] + 1) % 50
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[:, :8], model(changed)[:, :8], rtol=0, atol=1e-5)
    assert [name for name, _ in model.named_parameters()] == [p.name for p in parameters(MOE, 50)]
    counts = parameter_counts(MOE, 50)
    expert = sum(p.numel() for p in model.blocks["0"].ffn.experts.parameters()) // 4
    assert counts["total"] == count_parameters(model) and counts["active"] == counts["total"] - 2 * 2 * expert

    moe = model.blocks["0"].ffn
    with torch.no_grad():
        moe.router.weight.zero_()  # every score equal
    seen = []
    moe.dispatch = lambda rows, counts, experts: seen.append(counts.tolist()) or experts(rows, counts.tolist())
    with torch.no_grad():
        moe(torch.randn(1, 5, 32))
    assert seen == [[5, 5, 0, 0]]


def _imbalance_after_training(aux_loss_coef: float) -> float:
    """Tokens per expert, max over mean, over the last 10 of 40 AdamW steps of a mixture on random tokens."""
    torch.manual_seed(0)
    config = ModelConfig(
        d_model=32,
        n_heads=2,
        n_layers=1,
        d_ff=64,
        dropout=0.0,
        moe=MoEConfig(experts=8, top_k=1, aux_loss_coef=aux_loss_coef),
    )
    model = TransformerLM(config, vocab_size=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 64, (40, 8, 17), generator=torch.Generator().manual_seed(1)) % 16  # a skewed vocabulary
    load = torch.zeros(8)
    for step, batch in enumerate(data):
        model(batch[:, :-1], batch[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
        counts, _, _ = mixtures(model)[0].take_load()
        if step >= 30:
            load += counts
    return (load.max() / load.mean()).item()


def test_the_load_balancing_loss_evens_the_tokens_per_expert():
    """Against coefficient 0, a coefficient of 0.1 measurably evens the tokens the experts get."""
    unbalanced, balanced = _imbalance_after_training(0.0), _imbalance_after_training(0.1)
    assert balanced < unbalanced - 0.3 and balanced < 1.5, (balanced, unbalanced)
