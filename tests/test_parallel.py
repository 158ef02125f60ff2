"""Parallel layouts as degrees (scalelm.parallel.dims): shorthands, -1, rank placement, and every bad layout refused
with a clear message before any process group exists. Training in these layouts: tests/test_training.py."""

from __future__ import annotations

import pytest
import torch

from scalelm.config import ModelConfig, load_config
from scalelm.errors import ConfigError
from scalelm.model.cpu_ops import Dropout
from scalelm.parallel.dims import ParallelDims, resolve_dims
from scalelm.parallel.layout import check_tp, resolve_layout
from scalelm.parallel.runtime import check_groups_within_nodes

NONE = {"dp_replicate": None, "dp_shard": None, "tp": None, "pp": None}


def dims(strategy=None, world=4, per_node=2, **explicit) -> ParallelDims:
    return resolve_dims(strategy, {**NONE, **explicit}, world, per_node)


@pytest.mark.parametrize(
    "strategy, explicit, world, per_node, layout, name",
    [
        (None, {}, 1, 1, "1x1x1x1", "single"),
        ("single", {}, 1, 1, "1x1x1x1", "single"),
        ("ddp", {}, 8, 4, "8x1x1x1", "ddp"),
        ("fsdp", {}, 8, 4, "1x8x1x1", "fsdp"),
        ("hsdp", {}, 8, 4, "2x4x1x1", "hsdp"),
        ("tp", {}, 4, 4, "1x1x4x1", "tp"),
        ("fsdp_tp", {}, 8, 4, "1x2x4x1", "fsdp_tp"),
        ("fsdp_tp", {"tp": 2}, 8, 4, "1x4x2x1", "fsdp_tp"),  # the course's "try tp 1, 2, 4"
        ("fsdp", {"tp": 2}, 4, 4, "1x2x2x1", "fsdp_tp"),  # a shorthand with an explicit degree
        (None, {"dp_replicate": 2, "dp_shard": 2}, 4, 4, "2x2x1x1", "hsdp"),  # degrees alone
        (None, {"dp_shard": -1, "tp": 2}, 8, 4, "1x4x2x1", "fsdp_tp"),
        (None, {"dp_replicate": 2, "tp": 2}, 4, 2, "2x1x2x1", "ddp_tp"),
        (None, {"pp": -1}, 4, 4, "1x1x1x4", "pp"),
        ("fsdp", {"pp": 2}, 4, 2, "1x2x1x2", "fsdp_pp"),
        (None, {"pp": 2, "dp_shard": 2, "tp": 4}, 16, 4, "1x2x4x2", "fsdp_tp_pp"),  # the 3D example of config.yaml
    ],
)
def test_shorthands_and_degrees_resolve_to_a_layout(strategy, explicit, world, per_node, layout, name):
    resolved = dims(strategy, world, per_node, **explicit)
    assert (resolved.layout, resolved.name, resolved.world_size) == (layout, name, world)


def test_ranks_are_placed_with_tp_innermost_and_hsdp_shards_inside_a_node():
    """2 nodes of 4 (ranks 0-3 on the first): TP and shard groups stay inside a node, replicas cross nodes."""
    fsdp_tp = ParallelDims(dp_shard=2, tp=4)
    assert fsdp_tp.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert fsdp_tp.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    hsdp = ParallelDims(dp_replicate=2, dp_shard=4)
    assert hsdp.groups("dp_shard") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hsdp.groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [hsdp.dp_rank(r) for r in range(8)] == list(range(8))
    assert [fsdp_tp.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]  # a TP group shares its data
    # 3D on 4 nodes of 4: a node holds one TP group of 4, the stages of a replica are 8 ranks (two nodes) apart
    three = ParallelDims(dp_shard=2, tp=4, pp=2)
    assert three.groups("tp")[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert three.groups("pp")[:2] == [[0, 8], [1, 9]]
    assert [three.dp_rank(r) for r in (0, 4, 8, 12)] == [0, 1, 0, 1]  # both stages of a replica read its batches
    assert three.sharded and ParallelDims(dp_replicate=2, pp=2).sharded  # replicas beside PP: FSDP's HSDP path


def test_stages_split_the_blocks_evenly_and_the_bubble_follows_the_schedule():
    from scalelm.parallel.layout import predicted_bubble, stage_blocks
    from scalelm.parallel.pipeline import bubble

    assert stage_blocks(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_blocks(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert [len(r) for r in stage_blocks(12, 8)] == [2, 2, 2, 2, 1, 1, 1, 1]
    assert predicted_bubble("gpipe", 2, 4) == pytest.approx(1 / 5) == predicted_bubble("1f1b", 2, 4)
    assert predicted_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert predicted_bubble("interleaved_1f1b", 2, 4, virtual=2) == pytest.approx(1 / 9)
    # two ranks' kept steps: rank 0 works 3 of 4 ms, rank 1 1 of 2 then 2 of 2 ms
    step = lambda span, *busy: {"step": 1, "span_s": span, "chunks": [{"start": a, "end": b} for a, b in busy]}
    measured = bubble([[step(4e-3, (0, 1e-3), (2e-3, 4e-3))], [step(2e-3, (1e-3, 2e-3)), step(2e-3, (0, 2e-3))]])
    assert measured["idle_share_per_rank"] == pytest.approx([0.25, 0.25])
    assert measured["measured_bubble"] == pytest.approx(0.25) and measured["measured_bubble_max"] == pytest.approx(0.25)
    assert bubble([[]])["measured_bubble"] is None  # every kept step was profiled


def test_a_stage_keeps_its_blocks_under_the_whole_models_names():
    from scalelm.model.transformer import TransformerLM
    from scalelm.parallel.layout import stage_blocks
    from scalelm.parallel.pipeline import StageParts, stage_part

    config = ModelConfig(d_model=8, n_heads=2, n_layers=4, d_ff=16)
    whole = set(TransformerLM(config, 50).state_dict())
    blocks = stage_blocks(4, 4)
    parts = [stage_part(TransformerLM(config, 50), blocks[s], s == 0, s == 3) for s in range(4)]
    assert parts[0].head is None and parts[3].embed is None and list(parts[1].blocks) == ["1"]
    first_rank = StageParts([parts[0], parts[2]])  # pp 2 x 2 virtual stages: rank 0 holds stages 0 and 2
    second_rank = StageParts([parts[1], parts[3]])
    assert set(first_rank.state_dict()) | set(second_rank.state_dict()) == whole
    assert not set(first_rank.state_dict()) & set(second_rank.state_dict())
    assert "blocks.2.attn.qkv.weight" in first_rank.state_dict() and "head.weight" in second_rank.state_dict()
    first_rank.eval()
    assert not parts[0].drop.training  # the embedding's dropout, which only the stage holds, follows
    tokens = torch.randint(0, 50, (2, 5))
    assert parts[0](tokens).shape == (2, 5, 8) and parts[3](parts[0](tokens)).shape == (2, 5, 50)


@pytest.mark.parametrize(
    "strategy, explicit, world, per_node, message",
    [
        (
            None,
            {"dp_replicate": 2, "dp_shard": 2},
            8,
            4,
            "dp_replicate 2 x dp_shard 2 x tp 1 x pp 1 = 4 processes, but the world size is 8",
        ),
        (
            None,
            {"dp_shard": -1, "tp": -1},
            4,
            4,
            "only one degree may be -1 (the rest of the world size), got dp_shard and tp = -1",
        ),
        ("ddp", {"tp": -1}, 4, 4, "dp_replicate and tp would both take the rest of the world size"),
        (None, {"dp_shard": -1, "tp": 3}, 4, 4, "3 does not divide it"),
        (
            "fsdp",
            {"tp": 2},
            2,
            1,
            "parallel.tp=2 does not divide the 1 processes of a node: a tensor-parallel group would span nodes",
        ),
        ("zero3", {}, 2, 2, "unknown strategy 'zero3'"),
        ("fsdp_tpp", {}, 2, 2, "did you mean 'fsdp_tp'?"),
        ("single", {}, 2, 2, "strategy 'single' runs one process, but it was started with WORLD_SIZE=2"),
        ("single", {"tp": 2}, 2, 2, "parallel.strategy=single runs one process but sets {'tp': 2}"),
        (None, {}, 2, 2, "started with WORLD_SIZE=2, but the config sets no parallel layout (that is one process)"),
        (None, {"pp": 3, "tp": 2}, 4, 4, "parallel: dp_replicate 1 x dp_shard 1 x tp 2 x pp 3 = 6 processes"),
        (None, {"tp": 0}, 2, 2, "parallel.tp must be a positive integer or -1"),
    ],
)
def test_a_layout_that_does_not_fit_is_a_clear_error(strategy, explicit, world, per_node, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        dims(strategy, world, per_node, **explicit)


def test_tp_must_divide_heads_ffn_and_with_loss_parallel_the_vocabulary():
    model = ModelConfig(d_model=96, n_heads=6, d_ff=200)
    check_tp(2, model, 5018, loss_parallel=True)
    with pytest.raises(ConfigError, match=r"model.n_heads=6 is not divisible by parallel.tp=4"):
        check_tp(4, model, None, loss_parallel=False)
    with pytest.raises(ConfigError, match=r"model.d_ff=200 is not divisible by parallel.tp=3"):
        check_tp(3, ModelConfig(d_model=96, n_heads=3, d_ff=200), None, loss_parallel=False)
    with pytest.raises(ConfigError, match=r"vocabulary of 5019 words across parallel.tp=2"):
        check_tp(2, model, 5019, loss_parallel=True)
    with pytest.raises(ConfigError, match=r"data.seq_len=35 tokens across parallel.tp=2 ranks"):
        check_tp(2, model, None, loss_parallel=False, seq_len=35, sequence_parallel=True)
    # the same checks wherever a layout is resolved (the trainer, the workflow, the planner), before any model
    with pytest.raises(ConfigError, match=r"model.n_heads=4 is not divisible by parallel.tp=3"):
        resolve_layout(load_config(None, ["parallel.tp=3"]), 3, 3)


def test_a_tp_group_on_two_hosts_is_refused_naming_its_ranks():
    layout = ParallelDims(dp_shard=2, tp=2)
    check_groups_within_nodes(layout, [("n1", 0), ("n1", 0), ("n2", 1), ("n2", 1)])
    with pytest.raises(
        ConfigError, match=r"tensor-parallel group \[0, 1\] spans nodes \(rank 0 on n1 \(node 0\), rank 1 on n2"
    ):
        check_groups_within_nodes(layout, [("n1", 0), ("n2", 1), ("n1", 0), ("n2", 1)])


def test_dropout_masks_are_shared_within_a_tp_group_and_differ_across_streams():
    """Ranks of a TP group share their RNG state: on replicated activations (stream 0) they draw the same mask; on
    their own slices (stream = TP rank) distinct ones; either way the shared generator advances alike."""
    x = torch.ones(64, 256)

    def mask(stream: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(seed)
        dropout = Dropout(0.5)
        dropout.stream = stream
        return dropout(x) != 0, torch.get_rng_state()

    (shared, after), (again, after_again) = mask(0), mask(0)
    (own, after_own), (other_rank, _) = mask(1), mask(0, seed=8)
    assert torch.equal(shared, again) and torch.equal(after, after_again)
    assert not torch.equal(shared, own) and torch.equal(after, after_own)
    assert not torch.equal(shared, other_rank)  # another data-parallel rank (another seed)
    assert 0.45 < own.float().mean() < 0.55


MOE = ["model.moe={experts: 4, top_k: 2}"]


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (
            ["parallel.ep=2", "parallel.dp_shard=2"],
            2,
            "parallel.ep=2 splits a mixture's experts over ranks, and this model has none: set model.moe",
        ),
        ([*MOE, "parallel.ep=3", "parallel.dp_shard=4"], 4, "parallel.ep=3 does not divide parallel.dp_shard=4"),
        (
            ["model.moe={experts: 3, top_k: 1}", "parallel.strategy=ep"],
            2,
            "model.moe.experts=3 is not divisible by parallel.ep=2",
        ),
        ([*MOE, "parallel.ep=0", "parallel.dp_shard=2"], 2, "parallel.ep must be a positive integer or -1"),
        ([*MOE, "parallel.cp=2"], 2, "model.moe balances its experts' load per sequence, and parallel.cp=2"),
        ([*MOE, "parallel.strategy=ddp", "train.engine=lightning"], 2, "model.moe is scalelm's engine only"),
        (["model.moe={experts: 2, top_k: 3}"], 1, "model.moe.top_k=3 exceeds model.moe.experts=2"),
        (["model.moe={experts: 4, every: 3}"], 1, "model.moe.every=3 leaves all of model.n_layers=2 blocks dense"),
        (
            ["model.moe={experts: 4, aux_loss_coef: -0.1}"],
            1,
            "model.moe.aux_loss_coef must be 0 (no load-balancing loss) or positive",
        ),
        (["model.moe={experts: 4, balance: even}"], 1, "model.moe.balance: 'even' is not one of 'aux', 'bias', 'none'"),
        (["model.moe={experts: 4, bias_rate: 0}"], 1, "model.moe.bias_rate must be positive"),
        (
            ["model.moe={experts: 4, z_loss_coef: -1}"],
            1,
            "model.moe.z_loss_coef must be 0 (no router z-loss) or positive",
        ),
        (["model.moe={expert: 4}"], 1, "unknown setting 'model.moe.expert'; did you mean 'model.moe.experts'"),
    ],
)
def test_a_mixture_or_expert_layout_that_cannot_run_is_refused_by_name(overrides, world, message):
    """Each refused before any process group exists (the workflow resolves every experiment's layout before queueing
    a job: scalelm.study.experiments)."""
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        resolve_layout(load_config(None, overrides), world, world)


def test_fsdp_offloads_the_experts_with_the_rest_under_expert_parallelism():
    """parallel.cpu_offload with ep: FSDP owns the experts too, so nothing is refused for the layout (the device
    decides: CUDA only, scalelm.parallel.runtime.check_on_device)."""
    layout = resolve_layout(load_config(None, [*MOE, "parallel.strategy=ep", "parallel.cpu_offload=true"]), 2, 2)
    assert layout.dims.layout == "1x2[ep2]x1x1"


def test_expert_parallelism_borrows_consecutive_shard_ranks_and_says_so_in_the_layout():
    dims = resolve_dims(None, {**NONE, "dp_shard": 4, "tp": 2}, 8, 8, ep=2)
    assert (dims.layout, dims.name, dims.world_size) == ("1x4[ep2]x2x1", "fsdp_tp_ep", 8)
    assert dims.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]  # tp innermost, then ep inside dp_shard
    assert dims.groups("expert_dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]  # the same experts: the other pair
    assert dims.groups("efsdp") == dims.groups("expert_dp") and dims.expert_shards == 2
    hsdp = ParallelDims(dp_replicate=2, dp_shard=4, ep=2)
    assert hsdp.groups("expert_dp") == [[0, 2, 4, 6], [1, 3, 5, 7]] and hsdp.groups("efsdp")[0] == [0, 2]
    assert resolve_dims("ep", NONE, 2, 2).layout == "1x2[ep2]x1x1"
    assert resolve_dims(None, {**NONE, "dp_shard": 4}, 4, 4, ep=-1).ep == 4


VOCABULARY_SPLIT = r"""
import os, sys
import torch, torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel
from scalelm.config import ModelConfig
from scalelm.model.transformer import TransformerLM, count_parameters
from scalelm.parallel.data import materialise
from scalelm.parallel.tensor import apply_tp, keep_embedding_gradient_split

def rank_main(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    # (tied, loss_parallel, vocabulary): a vocabulary of 51 splits unevenly (26 + 25 rows)
    for tied, split_loss, vocab in ((False, False, 51), (True, True, 50), (True, False, 51), (False, True, 50)):
        config = ModelConfig(d_model=16, n_heads=2, n_layers=1, d_ff=32, dropout=0.0, norm="pre", tie_weights=tied)
        torch.manual_seed(0)
        whole = TransformerLM(config, vocab)
        with torch.device("meta"):  # as training builds it: on the meta device, split, then materialised
            split = TransformerLM(config, vocab)
        apply_tp(split, mesh, loss_parallel=split_loss, sequence_parallel=False)
        materialise(split, torch.device("cpu"), cpu_offload=False)
        split.init_buffers()
        set_model_state_dict(split, whole.state_dict(), options=StateDictOptions(full_state_dict=True))
        keep_embedding_gradient_split(split)
        tokens = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(1))
        targets = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(2))
        expected = whole(tokens, targets)
        expected.backward()
        with loss_parallel() if split_loss else torch.enable_grad():
            loss = split(tokens, targets)
            loss.backward()
        by_vocabulary = split_loss or not tied
        embed = split.embed.weight
        assert isinstance(embed, DTensor) == by_vocabulary, (tied, split_loss)
        if by_vocabulary:
            assert embed.placements == (Shard(0),) and embed.to_local().shape[0] == -(-vocab // 2) - rank * (vocab % 2)
        assert (split.head.weight is embed) == tied, (tied, split_loss)  # still one tensor where tied
        assert count_parameters(split) == count_parameters(whole)
        assert torch.allclose(loss, expected, rtol=1e-6), (tied, split_loss, float(loss), float(expected))
        if by_vocabulary:  # each rank holds its rows' gradient, not the whole table's
            assert embed.grad.placements == (Shard(0),) and embed.grad.to_local().shape == embed.to_local().shape
        grad = embed.grad.full_tensor() if isinstance(embed.grad, DTensor) else embed.grad
        assert torch.allclose(grad, whole.embed.weight.grad, atol=1e-7), (tied, split_loss)
    dist.destroy_process_group()
    if rank == 0:
        print("vocabulary split ok")

if __name__ == "__main__":
    torch.multiprocessing.spawn(rank_main, args=(int(sys.argv[1]),), nprocs=2)
"""


def test_tensor_parallelism_splits_the_embedding_by_vocabulary_and_keeps_tied_weights_tied(tmp_path):
    """Under TP the embedding is split by vocabulary (evenly or not) unless tied to a whole head, and a head tied to it
    stays the same tensor after the split (parallelize_module gives each module its own copy) and after the model
    built on the meta device is materialised (to_empty gives each module a new parameter: DDP's case too): the loss
    and the embedding's gradient are one process's, each rank holds its rows' gradient only, and no parameter is
    counted twice."""
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = tmp_path / "vocabulary_split.py"
    script.write_text(VOCABULARY_SPLIT)
    result = subprocess.run([sys.executable, str(script), str(port)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "vocabulary split ok" in result.stdout, result.stderr[-4000:]
