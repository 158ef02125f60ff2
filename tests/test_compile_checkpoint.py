"""torch.compile with activation checkpointing: every layout's block is one graph (a graph break inside a checkpoint
would run the whole block eagerly, silently; a mixture's block compiles around its exchange, which no recomputation
repeats), and a pipeline's last stage takes the head's fused head + loss path."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from scalelm.config import ModelConfig, MoEConfig
from scalelm.model import transformer
from scalelm.model.moe import mixtures
from scalelm.model.transformer import TransformerLM
from scalelm.parallel.activation_checkpoint import apply_activation_checkpointing, graph_breaks
from scalelm.parallel.dims import ParallelDims
from scalelm.parallel.expert import ExpertDispatch
from scalelm.parallel.layout import Layout
from scalelm.parallel.pipeline import Pipeline, stage_part
from scalelm.parallel.tensor import apply_tp

TP = 2
MODES = ("none", "full", "selective")


LLAMA = {"family": "llama", "n_heads": 4, "n_kv_heads": 2}  # grouped-query attention: 2 query heads per key/value


def tiny_block_model(dropout: float, n_layers: int = 1, moe: MoEConfig | None = None, **family) -> TransformerLM:
    shape = {"d_model": 16, "n_heads": 2, "n_layers": n_layers, "d_ff": 32, "dropout": dropout, "moe": moe} | family
    return TransformerLM(ModelConfig(**shape), 50)


@pytest.fixture
def fake_tp_mesh():
    """Rank 0 of a tensor-parallel group of TP ranks, all in this process (the fake backend: collectives do
    nothing, which tracing does not mind)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    try:
        yield init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


MIXTURE = MoEConfig(experts=4, top_k=2)


def layout_block(
    layout: str, dropout: float, mode: str, mesh, dtype: torch.dtype, moe: MoEConfig | None = None, **family
) -> torch.nn.Module:
    """Block 0 of the model (with `moe`: a mixture's; `family`: the llama block's settings) as `layout` builds it
    (plain, tp, tp_sp), checkpointed in `mode`."""
    torch.manual_seed(0)
    model = tiny_block_model(dropout, moe=moe, **family)
    if layout != "plain":
        apply_tp(model, mesh, loss_parallel=False, sequence_parallel=layout == "tp_sp")
    apply_activation_checkpointing(model, mode)
    return model.blocks["0"].to(dtype)


@pytest.mark.slow
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


def test_a_llama_block_compiles_whole_in_every_layout_and_checkpointing_mode(fake_tp_mesh):
    """The llama block (rotary grouped-query attention, SwiGLU, RMSNorm), plain, TP and TP with SP, with dropout (its
    own heads' stream under TP: key/value heads repeated for their queries), checkpointed none/full/selective: one
    graph each."""
    breaks = {}
    for layout in ("plain", "tp", "tp_sp"):
        seq = 8 // TP if layout == "tp_sp" else 8
        for mode in MODES:
            block = layout_block(layout, 0.1, mode, fake_tp_mesh, torch.float32, **LLAMA)
            breaks[layout, mode] = graph_breaks(block, torch.randn(2, seq, 16, requires_grad=True))
    assert len(breaks) == 9 and {key: reasons for key, reasons in breaks.items() if reasons} == {}


# dynamo's reasons for a mixture's exchange (scalelm.model.moe.MoE.exchange): inlined from the block, then in the
# mixture's own frame; either side of it compiles
EXCHANGE = ["Skip inlining `torch.compiler.disable()`d function"] * 2


def test_a_mixtures_block_compiles_around_its_exchange(fake_tp_mesh):
    """Review 3, finding 7: a mixture's exchange (its rows per expert, expert parallelism's all-to-alls) is eager;
    it once sat inside the checkpointed block, so under full and selective checkpointing dynamo traced nothing and
    the whole block ran eagerly, silently. Now, with dropout, checkpointed selectively and (under TP with SP, where
    the mixture gathers the sequence) full or selectively, a mixture's block breaks only at its exchange: the
    attention, norms and router compile (plain and full: the next test)."""
    for layout, mode in (("plain", "selective"), ("tp_sp", "full"), ("tp_sp", "selective")):
        seq = 8 // TP if layout == "tp_sp" else 8
        block = layout_block(layout, 0.1, mode, fake_tp_mesh, torch.float32, moe=MIXTURE)
        assert graph_breaks(block, torch.randn(2, seq, 16, requires_grad=True)) == EXCHANGE, (layout, mode)


@torch._dynamo.config.patch(error_on_recompile=True)
@pytest.mark.parametrize("family", [{}, LLAMA], ids=["gpt2", "llama"])
def test_a_compiled_mixture_trains_as_the_eager_one_without_recompiling(family):
    """Finding 7: 2 mixtures' blocks with dropout, checkpointed full, compiled (aot_eager: inductor would draw its
    own dropout seeds) have graphs around the exchange and train 3 AdamW steps as the eager blocks do, without a
    recompilation: neither the routing, which changes from step to step, nor the second block (a checkpointed
    forward set on each module once made one per block: past dynamo's cache limit, 8, the other blocks ran
    eagerly)."""
    losses = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = tiny_block_model(dropout=0.1, n_layers=2, moe=MIXTURE, **family)
        apply_activation_checkpointing(model, "full")
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            for block in model.blocks.values():
                block.compile(backend="aot_eager")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.randint(0, 50, (3, 4, 9), generator=torch.Generator().manual_seed(1))
        losses[compiled] = []
        for batch in data:
            loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[compiled].append(loss.item())
    assert losses[True] == pytest.approx(losses[False], rel=1e-6, abs=0)
    assert counters["stats"]["unique_graphs"] > 0


class _HostReads(TorchDispatchMode):
    """What makes the host wait for a tensor's values (on a GPU, a sync): a number read back (item), the operations
    whose output's size depends on the values (bincount, nonzero, repeat_interleave without output_size, ...) and
    Tensor.tolist (which reads a CPU tensor without the dispatcher: `host_reads` counts it); all-to-alls apart."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.all_to_alls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.c10d.alltoall_base_.default:
            self.all_to_alls += 1
        elif self.reads_values(func, args, kwargs):
            self.reads.append(str(func))
        return func(*args, **kwargs)

    @staticmethod
    def reads_values(func, args, kwargs) -> bool:
        if torch.Tag.data_dependent_output in func.tags:
            return True
        if torch.Tag.dynamic_output_shape not in func.tags:
            return False
        if func is torch.ops.aten.index.Tensor:  # integer indices give their own shape, a mask a counted one
            return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        return kwargs.get("output_size") is None


@contextlib.contextmanager
def host_reads(monkeypatch):
    counter, tolist = _HostReads(), torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: counter.reads.append("tolist") or tolist(t))
    try:
        with counter:
            yield counter
    finally:
        monkeypatch.setattr(torch.Tensor, "tolist", tolist)


def test_a_mixture_reads_the_host_once_under_expert_parallelism_none_in_one_process_and_never_in_a_recompute(
    one_rank_group, monkeypatch
):
    """Review 3, finding 8: the dispatch read the host 4 times per mixture and forward (3 tolist, a repeat_interleave
    without output_size), again in every recomputed forward with its 3 all-to-alls. Now, per mixture (2 here): under
    expert parallelism (an ep group of one rank) one read in the forward, its 3 all-to-alls (counts, rows there and
    back) and 2 in the backward (the gradients); in one process (the grouped product) no read at all; nothing more
    with either checkpointing mode, whose recomputation leaves the exchange alone. The loss is the same either way.
    (No dropout, no CPU-fused loss: on the CPU they read a seed and a scalar on the host.)"""
    for mode in MODES:
        losses = []
        for ep in (False, True):
            torch.manual_seed(0)
            model = tiny_block_model(dropout=0.0, n_layers=2, moe=MIXTURE)
            apply_activation_checkpointing(model, mode)
            if ep:
                for moe in mixtures(model).values():
                    moe.dispatch = ExpertDispatch(one_rank_group, 1, MIXTURE.experts)
            tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
            with host_reads(monkeypatch) as forward:
                loss = model(tokens).square().mean()
            with host_reads(monkeypatch) as backward:
                loss.backward()
            assert forward.reads == (["tolist"] * 2 if ep else []) and backward.reads == [], (mode, ep)
            assert (forward.all_to_alls, backward.all_to_alls) == ((6, 4) if ep else (0, 0)), (mode, ep)
            losses.append(loss.item())
        assert losses[0] == losses[1], mode
    # the one read's splits in a group of 2 ranks of 2 experts each, from this rank's 4 counts and the 4 it receives
    # ([source rank, local expert]): rows sent to each rank, received from each, and for each local expert
    assert ExpertDispatch(one_rank_group, 2, 2).splits([1, 2, 3, 4, 5, 6, 7, 8]) == ([3, 7], [11, 15], [12, 14])


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
