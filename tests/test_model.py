import math
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from scalelm.config import ModelConfig, MoEConfig
from scalelm.model import moe as moe_module
from scalelm.model.architecture import parameter_counts, parameters
from scalelm.model.cpu_ops import Dropout, LinearCrossEntropy, linear_cross_entropy
from scalelm.model.loss import IGNORE_INDEX
from scalelm.model.moe import GroupedExperts, biased_mixtures, mixtures, update_expert_biases
from scalelm.model.transformer import TransformerLM, count_parameters

LLAMA = {"family": "llama", "n_kv_heads": 2}  # (with 4 heads: 2 query heads per key/value head)


@pytest.mark.parametrize("family", [{}, LLAMA], ids=["gpt2", "llama"])
def test_causal_future_tokens_do_not_change_the_past(family):
    torch.manual_seed(0)
    shape = ModelConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, dropout=0.0, **family)
    model = TransformerLM(shape, vocab_size=50).eval()
    tokens = torch.randint(0, 50, (3, 24))
    t = 10
    changed = tokens.clone()
    changed[:, t + 1 :] = torch.randint(0, 50, (3, 24 - t - 1))
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])  # the later positions do see the change


def test_grouped_query_attention_is_multi_head_attention_with_each_key_value_head_repeated_for_its_group():
    """The llama block's qkv rows, grouped by key/value head ([q q k v] per group), computed through SDPA's grouped
    kernel and through the repeated keys and values the ring and the dropout streams take, give the logits of a
    model with one key/value head per query head whose keys and values are the group's copies. No positional
    table (rotary positions), no bias."""
    torch.manual_seed(0)
    grouped = TransformerLM(ModelConfig(d_model=32, n_heads=4, n_layers=1, d_ff=64, dropout=0.0, **LLAMA), 50).eval()
    full = TransformerLM(ModelConfig(d_model=32, n_heads=4, n_layers=1, d_ff=64, dropout=0.0, family="llama"), 50)
    state = grouped.state_dict()
    qkv = state["blocks.0.attn.qkv.weight"].view(2, 4, 8, 32)  # (groups, [q q k v], head_dim, d_model)
    rows = [torch.cat([qkv[g, r], qkv[g, 2], qkv[g, 3]]) for g in range(2) for r in range(2)]  # [q k v] per head
    full.load_state_dict(state | {"blocks.0.attn.qkv.weight": torch.cat(rows)})
    tokens = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        expected = full.eval()(tokens)
        assert torch.allclose(grouped(tokens), expected, atol=1e-6)
        grouped.blocks["0"].attn.core = lambda q, k, v, p: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert torch.allclose(grouped(tokens), expected, atol=1e-6)
    assert "positions" not in dict(grouped.named_buffers()) and grouped.head.bias is None


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
    moe.dispatch = lambda rows, counts, experts: seen.append(counts.tolist()) or experts(rows, counts)
    with torch.no_grad():
        moe(torch.randn(1, 5, 32))
    assert seen == [[5, 5, 0, 0]]


def _experts_product(experts: GroupedExperts, tokens: torch.Tensor, counts: torch.Tensor) -> list[torch.Tensor]:
    """The experts' outputs, then the gradients of the tokens and of every expert parameter."""
    tokens = tokens.detach().requires_grad_()
    experts.zero_grad()
    out = experts(tokens, counts, counts.tolist())
    out.float().square().sum().backward()
    return [out.detach(), tokens.grad, *(p.grad for p in experts.parameters())]


def test_the_experts_grouped_product_computes_the_per_expert_loop(monkeypatch):
    """Review 3, finding 8: the experts' products are one grouped product per matrix (torch._grouped_mm, the rows'
    experts given by offsets on the device), where torch has it for the device and precision and the operands are
    16-byte aligned (the CPU's fp32 and bf16 here, as CUDA's bf16 on sm90); else one product per expert. Both give
    the same outputs and gradients, an expert with no rows included, in fp32 within rounding (the biases' gradients
    are summed in another order); under bf16 autocast the grouped product computes in bf16 too (its bias is added
    after the product's rounding, not inside it: bf16's rounding apart)."""
    torch.manual_seed(0)
    experts = GroupedExperts(4, 32, 64)
    experts.reset_parameters()
    with torch.no_grad():
        for bias in (experts.up_bias, experts.down_bias):
            bias.normal_()
    counts, tokens = torch.tensor([5, 0, 9, 18]), torch.randn(32, 32)
    unaligned = torch.randn(32 * 32 + 1)[1:].view(32, 32)  # 4 bytes past an aligned address
    assert experts.grouped(tokens) and not experts.grouped(unaligned)
    assert not GroupedExperts(4, 30, 64).grouped(torch.randn(8, 30))  # rows of 120 bytes

    def both_ways() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        grouped = _experts_product(experts, tokens, counts)
        with monkeypatch.context() as patched:
            patched.setattr(moe_module, "grouped_product", lambda tokens, weights: False)
            assert not experts.grouped(tokens)
            return grouped, _experts_product(experts, tokens, counts)

    grouped, looped = both_ways()
    for mine, theirs in zip(grouped, looped, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
    assert grouped[2][1].abs().sum() == 0 and grouped[4][1].abs().sum() == 0  # expert 1 had no row: no gradient
    experts(tokens, counts).sum().backward()  # an expanded gradient (a sum's), made dense for the grouped backward
    with torch.autocast("cpu", torch.bfloat16):
        grouped, looped = both_ways()
    assert grouped[0].dtype == looped[0].dtype == torch.bfloat16
    assert (grouped[0] - looped[0]).abs().max() <= 1e-2 * looped[0].abs().max()


def test_the_experts_grouped_product_meets_cudas_kernel_requirements(monkeypatch):
    """On fake CUDA tensors, as on an sm90 GPU: bf16 takes the grouped product, whose CUDA meta function checks what
    the kernel needs (bf16 operands, 16-byte strides, int32 offsets), without a host read (repeat_interleave with
    its output_size); fp32 on CUDA is no grouped kernel's (the loop)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert not moe_module._grouped_mm_runs(torch.device("cuda"), torch.float32)
    monkeypatch.setattr(moe_module, "_grouped_mm_runs", lambda device, dtype: dtype == torch.bfloat16)
    with FakeTensorMode(), torch.device("cuda"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
        experts = GroupedExperts(4, 32, 64)
        tokens, counts = torch.empty(40, 32, dtype=torch.bfloat16), torch.empty(4, dtype=torch.int64)
        assert experts.grouped(tokens) and not experts.grouped(tokens.float())
        with torch.no_grad():
            out = experts(tokens, counts)
        assert (out.shape, out.dtype, out.device.type) == ((40, 32), torch.bfloat16, "cuda")


def _imbalance_after_training(**moe) -> float:
    """Tokens per expert, max over mean, over the last 10 of 40 AdamW steps of a mixture on random tokens (`moe`: its
    balance settings), each step followed by the trainer's bias update (one process: the sum over ranks is the
    rank's own)."""
    torch.manual_seed(0)
    config = ModelConfig(d_model=32, n_heads=2, n_layers=1, d_ff=64, dropout=0.0, moe=MoEConfig(8, top_k=1, **moe))
    model = TransformerLM(config, vocab_size=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    biased = biased_mixtures(model)
    data = torch.randint(0, 64, (40, 8, 17), generator=torch.Generator().manual_seed(1)) % 16  # a skewed vocabulary
    load = torch.zeros(8)
    for step, batch in enumerate(data):
        model(batch[:, :-1], batch[:, 1:]).backward()
        optimizer.step()
        update_expert_biases(biased, lambda loads: None)
        optimizer.zero_grad()
        counts, _, _ = mixtures(model)[0].take_load()
        if step >= 30:
            load += counts
    return (load.max() / load.mean()).item()


def test_the_load_balancing_loss_and_the_expert_bias_even_the_tokens_per_expert():
    """Against no balancing (aux with coefficient 0, or none), the aux loss with coefficient 0.1, and the
    auxiliary-loss-free bias, measurably even the tokens the experts get."""
    unbalanced = _imbalance_after_training(aux_loss_coef=0.0)
    assert _imbalance_after_training(balance="none") == unbalanced  # the aux loss left out of the training loss
    for balanced in (
        _imbalance_after_training(aux_loss_coef=0.1),
        _imbalance_after_training(balance="bias", bias_rate=0.005),
    ):
        assert balanced < unbalanced - 0.3 and balanced < 1.5, (balanced, unbalanced)


def test_the_expert_bias_chooses_moves_by_its_rate_and_the_z_loss_trains_the_router_alone():
    """balance=bias: a buffer of zeros (in the state, so checkpointed; no other mixture has one), which moves by
    bias_rate towards the mean load from the counts summed over the ranks, and chooses experts without weighting
    them: a bias of 1 on expert 3 sends every token there, at the router's probability. The z-loss adds to the
    router's gradient (and through the router's input to the blocks before); the language-model loss and the last
    mixture's experts' gradients stay as they are."""
    config = ModelConfig(
        d_model=16,
        n_heads=2,
        n_layers=1,
        d_ff=32,
        dropout=0.0,
        moe=MoEConfig(4, top_k=1, balance="bias", bias_rate=0.5),
    )
    torch.manual_seed(0)
    model = TransformerLM(config, vocab_size=32)
    moe = mixtures(model)[0]
    assert "blocks.0.ffn.expert_bias" in model.state_dict() and torch.equal(moe.expert_bias, torch.zeros(4))
    aux_model = TransformerLM(MOE, vocab_size=32)
    assert not any("expert_bias" in k for k in aux_model.state_dict()) and biased_mixtures(aux_model) == []
    tokens = torch.randint(0, 32, (2, 8))
    model(tokens, tokens).backward()
    summed = []
    update_expert_biases(
        biased_mixtures(model), lambda loads: (summed.append(loads.clone()), loads.mul_(3))
    )  # 3 ranks' alike
    assert summed[0].sum() == 16  # this step's 16 tokens, top 1
    load = summed[0][0] * 3
    assert torch.equal(moe.expert_bias, 0.5 * torch.sign(load.mean() - load)) and moe.step_load is None
    moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 1.0]))
    routed = []
    moe.dispatch = lambda rows, counts, experts: (routed.append(counts.clone()), rows)[1]
    with torch.no_grad():
        model(tokens)
    assert routed[0].tolist() == [0, 0, 0, 16]

    def router_and_expert_grads(z_loss_coef: float):
        torch.manual_seed(0)
        plain = TransformerLM(replace(MOE, moe=MoEConfig(4, top_k=2, z_loss_coef=z_loss_coef)), vocab_size=32)
        loss = plain(tokens, tokens)
        loss.backward()
        ffn = mixtures(plain)[1]
        return loss.detach(), ffn.router.weight.grad, ffn.experts.up_weight.grad

    (loss, router, experts), (z_loss, z_router, z_experts) = map(router_and_expert_grads, (0.0, 0.1))
    assert torch.equal(loss, z_loss) and torch.equal(experts, z_experts) and not torch.allclose(router, z_router)


# ------------------------------------------------------------------- the head's loss paths (issue 50)
HEAD_MODEL = ModelConfig(d_model=32, n_heads=4, n_layers=1, d_ff=64, dropout=0.0, tie_weights=True)
SPLIT_MODEL = ModelConfig(d_model=32, n_heads=4, n_layers=1, d_ff=64, dropout=0.0)  # the course's: an untied head


def _loss_and_grads(model: TransformerLM, tokens: torch.Tensor, targets: torch.Tensor, path: str, autocast: bool):
    """The training loss of `model` with its head's loss on `path` (train.fused_loss), scaled by 0.25 in the backward
    as one of 4 accumulated micro-batches, and every parameter's gradient."""
    model.zero_grad()
    model.head.fused_loss = path
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = model(tokens, targets)
    (loss * 0.25).backward()
    return loss.detach(), type(loss.grad_fn).__name__, {name: p.grad.clone() for name, p in model.named_parameters()}


def test_the_chunked_loss_is_the_cross_entropy_of_the_logits_and_the_cpu_paths_stay_as_they_were(monkeypatch):
    """train.fused_loss=chunked: the head and its loss chunk by chunk (3 chunks of 7 here, the last one partial),
    every gradient computed in the forward and scaled in the backward. Under bf16 autocast on the CPU (where the CPU's
    fused loss does not apply, as on a GPU) it equals the plain composition within bf16's rounding of the weight
    gradient's sum over chunks; in fp32 F.cross_entropy's to rounding. On the CPU in fp32 `auto` and `chunked` keep
    the CPU's fused loss, bit for bit; `plain` is lm_loss on the logits, bit for bit; no_grad takes the plain path."""
    from scalelm.model.gpu_ops import ChunkedLinearCrossEntropy, chunked_linear_cross_entropy
    from scalelm.model.loss import lm_loss

    monkeypatch.setattr(ChunkedLinearCrossEntropy, "CHUNK_ROWS", 7)
    torch.manual_seed(0)
    model = TransformerLM(HEAD_MODEL, vocab_size=97)
    tokens, targets = torch.randint(0, 97, (3, 7)), torch.randint(0, 97, (3, 7))
    targets[0, ::3] = IGNORE_INDEX

    chunked, kind, grads = _loss_and_grads(model, tokens, targets, "chunked", autocast=True)
    plain, _, reference = _loss_and_grads(model, tokens, targets, "plain", autocast=True)
    assert kind == "ChunkedLinearCrossEntropyBackward" and chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        assert grad.dtype == torch.float32, name
        assert (grad - reference[name]).abs().max() <= 1e-2 * reference[name].abs().max(), name

    hidden, weight, bias, words = torch.randn(20, 16), torch.randn(50, 16), torch.randn(50), torch.randint(0, 50, (20,))
    words[::4] = IGNORE_INDEX
    leaves, plain_leaves = ([t.clone().requires_grad_() for t in (hidden, weight, bias)] for _ in range(2))
    loss = chunked_linear_cross_entropy(*leaves, words)
    expected = F.cross_entropy(F.linear(*plain_leaves), words, ignore_index=IGNORE_INDEX)
    (loss + expected).backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for mine, theirs in zip(leaves, plain_leaves, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7)

    auto, fused = (_loss_and_grads(model, tokens, targets, path, autocast=False) for path in ("auto", "chunked"))
    assert auto[1] == fused[1] == "LinearCrossEntropyBackward" and torch.equal(auto[0], fused[0])
    assert all(torch.equal(auto[2][name], fused[2][name]) for name in auto[2])
    loss, kind, _ = _loss_and_grads(model, tokens, targets, "plain", autocast=False)
    assert kind != "LinearCrossEntropyBackward" and torch.equal(loss, lm_loss(model(tokens), targets).detach())
    model.head.fused_loss = "chunked"
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        torch.testing.assert_close(model(tokens, targets), lm_loss(model(tokens), targets), rtol=0, atol=0)


def test_the_chunked_loss_runs_its_products_on_the_padded_vocabulary_and_computes_the_unpadded_loss(monkeypatch):
    """Issue 67 (review 4, finding 3): where aligned_linear pads the head's rows (forced on the CPU here), the chunked
    loss's chunks get the weight padded to a multiple of 64 rows, the padding's bias -inf (made where the head has no
    bias); the loss and the gradients of the input, the weight and the bias are F.cross_entropy's over the unpadded
    F.linear in fp32, ignored targets included, and the gradients keep the vocabulary's shapes."""
    from scalelm.model import gpu_ops

    assert gpu_ops.PADDED_DEVICES == ("cuda",)
    monkeypatch.setattr(gpu_ops, "PADDED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(gpu_ops.ChunkedLinearCrossEntropy, "CHUNK_ROWS", 7)  # 20 tokens: chunks of 7, 7 and 6
    seen = []

    def spy(x, weight, bias, targets, scale):  # what reaches the chunk's F.linear
        seen.append((tuple(weight.shape), bias.detach().clone()))
        return gpu_ops.loss_chunk(x, weight, bias, targets, scale)

    torch.manual_seed(0)
    for vocab, padded, with_bias in ((50, 64, True), (100, 128, False), (64, 64, True)):
        hidden, weight, bias = torch.randn(20, 16), torch.randn(vocab, 16), torch.randn(vocab)
        words = torch.randint(0, vocab, (20,))
        words[::4] = IGNORE_INDEX
        leaves, plain_leaves = ([t.clone().requires_grad_() for t in (hidden, weight, bias)] for _ in range(2))
        if not with_bias:
            leaves[2] = plain_leaves[2] = None
        seen.clear()
        loss = gpu_ops.chunked_linear_cross_entropy(*leaves, words, spy)
        expected = F.cross_entropy(F.linear(*plain_leaves), words, ignore_index=IGNORE_INDEX)
        (loss + expected).backward()

        assert [shape for shape, _ in seen] == [(padded, 16)] * 3, vocab
        assert all(torch.equal(b[:vocab], bias if with_bias else torch.zeros(vocab)) for _, b in seen)
        assert all(b[vocab:].eq(-torch.inf).all() for _, b in seen)
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
        for mine, theirs in zip(leaves, plain_leaves, strict=True):
            if theirs is not None:
                assert mine.grad.shape == theirs.shape
                torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7)


def test_the_chunked_loss_compiles_its_chunk_once_and_computes_what_it_computes_eagerly(monkeypatch):
    """train.compile with train.fused_loss=chunked: the head's compile also compiles the chunk function with the same
    options (the loop over chunks stays outside every graph); two equal chunks make one graph, which later steps
    reuse; the compiled chunks (dynamo alone here: inductor's CPU kernels take long to build) give the eager loss and
    gradients."""
    from torch._dynamo.testing import CompileCounter

    from scalelm.model.gpu_ops import ChunkedLinearCrossEntropy

    monkeypatch.setattr(ChunkedLinearCrossEntropy, "CHUNK_ROWS", 16)  # 24 tokens: two chunks of 12
    torch.manual_seed(0)
    model = TransformerLM(HEAD_MODEL, vocab_size=50)
    tokens = torch.randint(0, 50, (3, 8))
    eager = _loss_and_grads(model, tokens, tokens.roll(-1, 1), "chunked", autocast=True)
    counter = CompileCounter()
    model.head.compile(backend=counter)
    frames = []
    for _ in range(3):
        compiled = _loss_and_grads(model, tokens, tokens.roll(-1, 1), "chunked", autocast=True)
        frames.append(counter.frame_count)
    assert frames[0] > 0 and frames == [frames[0]] * 3  # compiled at the first step, never again
    assert compiled[1] == "ChunkedLinearCrossEntropyBackward" and torch.equal(compiled[0], eager[0])
    assert all(torch.equal(compiled[2][name], grad) for name, grad in eager[2].items())


def _vocabulary_parallel_runs(state: dict, tokens: torch.Tensor, targets: torch.Tensor, vocab: int) -> list[dict]:
    """Both ranks of a tensor-parallel group of 2 with loss_parallel, as threads of this process (torch's threaded
    process group): each rank's loss, its local logits' row stride, its state dict's shapes, and the whole gradients."""
    import threading

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

    from scalelm.parallel.tensor import apply_tp

    results: list[dict | BaseException] = [{}, {}]
    store = dist.HashStore()

    def rank(r: int) -> None:
        dist.init_process_group("threaded", rank=r, world_size=2, store=store)
        try:
            with torch.device("meta"):
                model = TransformerLM(SPLIT_MODEL, vocab)
            apply_tp(model, init_device_mesh("cpu", (2,)), loss_parallel=True, sequence_parallel=False)
            model.to_empty(device="cpu")
            model.init_buffers()
            set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True))  # (it fills it)
            loss = model(tokens, targets)
            loss.backward()
            full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t
            results[r] = {
                "loss": loss.detach(),
                "stride": model.logits(model.norm(torch.zeros(1, 2, SPLIT_MODEL.d_model))).to_local().stride(-2),
                "shapes": {k: tuple(v.shape) for k, v in model.state_dict().items()},
                "grads": {name: full(p.grad) for name, p in model.named_parameters()},
            }
        except BaseException as error:
            results[r] = error
        finally:
            dist.destroy_process_group()

    _install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    try:
        with loss_parallel():  # (torch's vocabulary-parallel cross-entropy: a switch of the whole process)
            threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _uninstall_threaded_pg()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def test_a_vocabulary_split_head_pads_each_ranks_rows_and_computes_the_unsplit_loss(monkeypatch):
    """Review 3, finding 13: under loss_parallel the head's weight is split by vocabulary rows, unevenly where tp does
    not divide it into multiples of 64 (51 words over tp 2: 26 and 25 here, 8,320/8,319 of WikiText-2's 33,278 over
    tp 4 on a GPU), and the rows went unpadded to the GPU's matrix products. Where the padding applies (forced on the
    CPU here) each rank pads its own rows: its logits come from rows of 64 (their row stride), the loss and every
    gradient equal one process's within fp32 rounding, and the state dict keeps the vocabulary's shape, so that
    checkpoints load across layouts."""
    from scalelm.model import gpu_ops

    torch.manual_seed(0)
    vocab = 51
    plain = TransformerLM(SPLIT_MODEL, vocab)
    tokens, targets = torch.randint(0, vocab, (2, 6)), torch.randint(0, vocab, (2, 6))
    expected = plain(tokens, targets)
    expected.backward()
    state = plain.state_dict()

    assert gpu_ops.PADDED_DEVICES == ("cuda",)  # the CPU's layouts compute as before (tests/test_training.py)
    monkeypatch.setattr(gpu_ops, "PADDED_DEVICES", ("cuda", "cpu"))
    padded = _vocabulary_parallel_runs(state, tokens, targets, vocab)

    assert [r["stride"] for r in padded] == [64, 64]  # 26 and 25 unpadded
    for result in padded:
        torch.testing.assert_close(result["loss"], expected.detach(), rtol=1e-6, atol=0)
        assert result["shapes"] == {k: tuple(v.shape) for k, v in state.items()}
        assert result["shapes"]["head.bias"] == (vocab,)
        for name, param in plain.named_parameters():
            torch.testing.assert_close(result["grads"][name], param.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_chunked_loss_under_fsdps_bf16_policy_gives_the_plain_loss_and_fp32_gradients(monkeypatch):
    """train.fused_loss=chunked with train.precision=bf16_params (the combination config.yaml suggests for
    gpt2_small): FSDP's policy on a mesh of one rank (forced on the CPU) hands the head bf16 weights; the chunked loss
    computes in bf16, its gradients reach FSDP, which reduces them into the fp32 parameters' gradients, as the plain
    composition's do, within bf16 rounding."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from scalelm.config import from_dict
    from scalelm.model import transformer
    from scalelm.parallel import numerics, runtime
    from scalelm.parallel.env import DistEnv

    monkeypatch.setattr(numerics, "resolve_precision", lambda precision, device_type: "bf16")
    chunked_calls = []
    chunked_loss = transformer.chunked_linear_cross_entropy
    monkeypatch.setattr(
        transformer,
        "chunked_linear_cross_entropy",
        lambda *args: chunked_calls.append(args[1].dtype) or chunked_loss(*args),
    )
    settings = {"model": {**vars(HEAD_MODEL), "moe": None}, "data": {"seq_len": 8}, "batch": {"size": 4}}
    config = from_dict(settings | {"train": {"precision": "bf16_params", "fused_loss": "chunked"}})
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    tokens = torch.randint(0, 50, (4, 9), generator=torch.Generator().manual_seed(0))
    try:
        parallel = runtime.Parallel.start(config, env, 50)
        model = parallel.build(lambda: TransformerLM(config.model, 50), 1, runtime.ModelOptions.of(config.train))
        assert model.head.fused_loss == "chunked" and parallel.uses_fsdp
        results = {}
        for path in ("chunked", "plain"):
            model.zero_grad()
            model.head.fused_loss = path
            loss = parallel.forward_backward(model, tokens[:, :-1], tokens[:, 1:], 1.0, step=1)
            results[path] = loss, {name: p.grad.full_tensor() for name, p in model.named_parameters()}
            assert all(isinstance(p.grad, DTensor) and p.grad.dtype == torch.float32 for p in model.parameters())
        assert chunked_calls == [torch.bfloat16]  # the chunked step's head: FSDP's bf16 weights
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    (chunked, grads), (plain, reference) = results["chunked"], results["plain"]
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        assert (grad - reference[name]).abs().max() <= 2e-2 * reference[name].abs().max(), name


def test_router_coefficients_at_their_limit_train_finitely():
    """Issue 66: ROUTER_COEF_LIMIT, the most training accepts for a router's loss weight, keeps every step's
    gradients and their norm finite in fp32 (AdamW squares them), where 1e30, which training refuses, overflows."""
    from scalelm.config import ROUTER_COEF_LIMIT

    def norms(coefficient: float) -> list[float]:
        torch.manual_seed(0)
        moe = MoEConfig(4, top_k=2, aux_loss_coef=coefficient, z_loss_coef=coefficient)
        model = TransformerLM(replace(MOE, moe=moe), vocab_size=32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        found = []
        for batch in torch.randint(0, 32, (10, 4, 9), generator=torch.Generator().manual_seed(1)):
            model(batch[:, :-1], batch[:, 1:]).backward()
            found.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
            optimizer.step()
            optimizer.zero_grad()
        return found

    assert all(math.isfinite(norm) for norm in norms(ROUTER_COEF_LIMIT))
    assert not math.isfinite(norms(1e30)[0])
