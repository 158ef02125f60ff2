"""torch.compile with activation checkpointing: every layout's block is one graph (a graph break inside a checkpoint
would run the whole block eagerly, silently), and a pipeline's last stage takes the head's fused head + loss path."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from scalelm.config import ModelConfig
from scalelm.model import transformer
from scalelm.model.transformer import TransformerLM
from scalelm.parallel.activation_checkpoint import apply_activation_checkpointing, graph_breaks
from scalelm.parallel.dims import ParallelDims
from scalelm.parallel.layout import Layout
from scalelm.parallel.pipeline import Pipeline, stage_part
from scalelm.parallel.tensor import apply_tp

TP = 2
MODES = ("none", "full", "selective")


def tiny_block_model(dropout: float, n_layers: int = 1) -> TransformerLM:
    return TransformerLM(ModelConfig(d_model=16, n_heads=2, n_layers=n_layers, d_ff=32, dropout=dropout), 50)


@pytest.fixture
def fake_tp_mesh():
    """Rank 0 of a tensor-parallel group of TP ranks, all in this process (the fake backend: collectives do
    nothing, which tracing does not mind)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    try:
        yield init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def layout_block(layout: str, dropout: float, mode: str, mesh, dtype: torch.dtype) -> torch.nn.Module:
    """Block 0 of the model as `layout` builds it (plain, tp, tp_sp), checkpointed in `mode`."""
    torch.manual_seed(0)
    model = tiny_block_model(dropout)
    if layout != "plain":
        apply_tp(model, mesh, loss_parallel=False, sequence_parallel=layout == "tp_sp")
    apply_activation_checkpointing(model, mode)
    return model.blocks["0"].to(dtype)


def test_every_layouts_block_compiles_whole_in_every_checkpointing_mode(fake_tp_mesh, monkeypatch):
    """Finding 4: plain, TP and TP with sequence parallelism, dropout 0 and 0.1, checkpointing none/full/selective:
    dynamo traces each block as one graph. fp32 on the CPU draws dropout masks with numpy, bf16 with torch's sampler
    as a GPU does; under TP a rank's own heads, FFN columns and (SP) sequence part draw them in a stream of their own,
    which once broke the graph (fork_rng/manual_seed) and so, checkpointed, ran the whole block eagerly."""
    breaks = {}
    for layout in ("plain", "tp", "tp_sp"):
        seq = 8 // TP if layout == "tp_sp" else 8  # under SP a block takes this rank's part of the sequence
        for dropout in (0.0, 0.1):
            for dtype in (torch.float32, torch.bfloat16) if dropout else (torch.float32,):
                for mode in MODES:
                    block = layout_block(layout, dropout, mode, fake_tp_mesh, dtype)
                    x = torch.randn(2, seq, 16, dtype=dtype, requires_grad=True)
                    breaks[layout, mode, dropout, str(dtype)] = graph_breaks(block, x)
    assert len(breaks) == 27
    assert {key: reasons for key, reasons in breaks.items() if reasons} == {}
    # the check sees a break: the stream's eager path (fork_rng) traced, as before the fix
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    block = layout_block("tp", 0.1, "full", fake_tp_mesh, torch.bfloat16)
    assert graph_breaks(block, torch.randn(2, 8, 16, dtype=torch.bfloat16)) == [
        "no graph: dynamo traced nothing, the block runs eagerly"
    ]


def test_compiled_dropout_streams_draw_the_eager_masks_through_every_checkpointing_mode():
    """The dynamo-opaque dropout ops are the eager functions: a block whose dropouts all draw in a stream of their
    own (as under TP with SP), compiled whole (fullgraph) without inductor, which would draw its own seeds, gives the
    eager block's output and gradients bit for bit, checkpointed or not; the attention's backward runs it again
    under the saved seed."""
    for dtype in (torch.float32, torch.bfloat16):
        for mode in MODES if dtype == torch.float32 else ("selective",):
            results = []
            for compiled in (False, True):
                torch.manual_seed(0)
                model = tiny_block_model(dropout=0.3).to(dtype)
                model.split_dropout_streams(2, sequence_parallel=True)
                apply_activation_checkpointing(model, mode)
                block = model.blocks["0"]
                if compiled:
                    torch._dynamo.reset()
                    block.compile(backend="aot_eager", fullgraph=True)
                x = torch.randn(2, 8, 16, dtype=dtype, requires_grad=True)
                y = block(x)
                y.float().square().sum().backward()
                results.append([y.detach(), x.grad, *(p.grad for p in block.parameters())])
            eager, compiled_block = results
            assert all(torch.equal(a, b) for a, b in zip(eager, compiled_block, strict=True)), (dtype, mode)
            assert eager[1].abs().sum() > 0


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_a_pipelines_last_stage_computes_its_loss_through_the_heads_fused_path(one_rank_group, monkeypatch):
    """Finding 13: the last stage hands its normed hidden states to the schedule's loss function, which calls the
    head with the targets, the path the whole model takes (fused with the projection on CPU; compiled with the head
    on CUDA), not a loss on the head's logits: same loss and gradients as the plain model. One stage, 2 micro-batches
    on a group of one rank; evaluation still gets the logits."""
    torch.manual_seed(0)
    plain = tiny_block_model(dropout=0.0, n_layers=2)
    stage = stage_part(tiny_block_model(dropout=0.0, n_layers=2), range(2), first=True, last=True)
    stage.load_state_dict(plain.state_dict())
    layout = Layout(ParallelDims(), schedule="gpipe", microbatches=2)
    pipeline = Pipeline([stage], [0], layout, one_rank_group, torch.device("cpu"))
    calls = []
    fused = transformer.linear_cross_entropy

    def recorded(hidden, weight, bias, targets):
        calls.append(tuple(hidden.shape))
        return fused(hidden, weight, bias, targets)

    monkeypatch.setattr(transformer, "linear_cross_entropy", recorded)
    tokens = torch.randint(0, 50, (4, 8))
    pipeline.step(tokens, tokens.roll(-1, 1), scale=1.0, step=0)  # (torch's first step also infers the stage's shapes)
    stage.zero_grad()
    calls.clear()
    loss = pipeline.step(tokens, tokens.roll(-1, 1), scale=1.0, step=1)
    assert calls == [(16, 16), (16, 16)]  # each micro-batch's 2 x 8 tokens through the head's fused loss
    expected = plain(tokens, tokens.roll(-1, 1))
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    for (name, mine), theirs in zip(stage.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6, msg=name)
    stage.eval()
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipeline.forward(tokens), plain(tokens))
