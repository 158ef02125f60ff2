"""scalelm.plan: the memory and communication math, the layouts of a machine and the choice among them, the command
line, and the workflow's check before the queue (scalelm.study.preflight). That the planned state bytes equal the
measured ones on every layout is shown by tests/test_training.py, on the runs it makes anyway."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import yaml
from snakemake.utils import validate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from conftest import REPO
from scalelm.config import Config, MoEConfig, from_dict, load_config
from scalelm.errors import ConfigError
from scalelm.model.architecture import BLOCK_TP_PLAN, block_tp_plan, flops_per_token, parameter_counts, parameters
from scalelm.model.transformer import TransformerLM, count_parameters
from scalelm.parallel.data import apply_fsdp
from scalelm.parallel.dims import MESH_DIMS, ParallelDims
from scalelm.parallel.expert import apply_ep
from scalelm.parallel.layout import resolve_layout
from scalelm.parallel.runtime import Meshes
from scalelm.plan.__main__ import main as plan_main
from scalelm.plan.comm import INTER, INTRA, traffic
from scalelm.plan.host import HostContention
from scalelm.plan.layouts import Machine, candidates, smallest_fsdp
from scalelm.plan.machine import ENDS, Figure, MachineBaseline
from scalelm.plan.memory import (
    Workload,
    block_bytes_per_token,
    checkpointed_bytes_per_token,
    held,
    in_flight,
    moe_block_bytes_per_token,
    plan_memory,
)
from scalelm.plan.steptime import DRIFT, Speeds, efficiency, predict, stage_work
from scalelm.selftest import write_corpus
from scalelm.site import SiteConfig
from scalelm.study import plan_check, preflight
from scalelm.study.experiments import Experiment, apply_local_overlay, load_matrix
from scalelm.study.plan_check import check_fits, plan_experiment
from scalelm.study.settings import load_study
from scalelm.study.workflow import Study
from scalelm.train.record import Results, RunRecord, write_record
from test_study import SCHEMA, local_config

COURSE = ["--set", "model.n_layers=4", "--vocab-size", "28785"]  # config/config.yaml's model, WikiText-2's words


def settings(*assignments: str) -> list[str]:
    """One `--set` flag per assignment."""
    return [word for assignment in assignments for word in ("--set", assignment)]


MIXTURE = "model.moe={experts: 8, top_k: 2, d_ff: 1024}"  # config/config.yaml's moe experiment


def mixture_work(*changes: str, device: str = "cuda") -> Workload:
    """The course model with a mixture of 8 experts in every block (`changes`: more settings)."""
    return Workload(load_config(None, ["model.n_layers=4", MIXTURE, *changes]), 28785, device)


SEVEN_B = [
    "--vocab-size",
    "32000",
    *settings("model.d_model=4096", "model.n_layers=32", "model.n_heads=32", "model.d_ff=16384"),
    *settings("data.seq_len=2048", "model.max_seq_len=2048", "batch.size=1"),
]
JURECA = ["--nodes", "2", "--gpus-per-node", "4", "--gpu-memory-gb", "40"]
SPEEDS = ["--matmul-tflops", "150", "--busbw-intra-gbps", "80", "--busbw-inter-gbps", "20"]  # + --elementwise-gbps


def plan_json(capsys, *args: str) -> dict[str, dict]:
    plan_main([*args, "--json"])
    return {layout["name"]: layout for layout in json.loads(capsys.readouterr().out)}


LLAMA = {"family": "llama", "n_heads": 8, "n_kv_heads": 2}  # grouped-query attention: 4 query heads a key/value head


@pytest.mark.parametrize(
    "changes",
    [{}, {"tie_weights": True}, {"n_layers": 3, "d_ff": 96}, LLAMA, {**LLAMA, "tie_weights": True, "n_kv_heads": 8}],
)
def test_the_model_builds_the_parameters_its_architecture_declares(changes):
    """scalelm.model.architecture, which the planner and tensor parallelism read, is the built model's list: the
    same names, in the same order, with the same shapes; and the TP plan names the block's linear layers (the
    llama block's too: no biases, a qkv of n_heads + 2 n_kv_heads heads, SwiGLU's three matrices). Its parameters
    and MFU's FLOPs count those matrices."""
    config = Config()
    model = replace(config.model, **changes)
    built = TransformerLM(model, 1000)
    declared = parameters(model, 1000)
    assert [(p.name, p.shape) for p in declared] == [(n, tuple(p.shape)) for n, p in built.named_parameters()]
    assert sum(p.numel() for p in declared) == count_parameters(built)
    assert sum(p.numel() for p in declared) == sum(p.numel() for p in parameters(model, 1000, loss_parallel=True))
    linears = {name for name, module in built.blocks["0"].named_modules() if isinstance(module, torch.nn.Linear)}
    assert set(block_tp_plan(model)) == linears
    assert set(BLOCK_TP_PLAN) == linears or model.family == "llama"
    matrices = sum(m.weight.numel() for m in built.modules() if isinstance(m, torch.nn.Linear) and m is not built.head)
    attention = 12 * model.n_layers * model.d_model * 32  # (seq_len 32)
    assert flops_per_token(model, 1000, 32) == 6 * (matrices + 1000 * model.d_model) + attention


def test_sharding_divides_the_state_and_schedules_and_options_change_the_activations():
    work = Workload(load_config(None, ["model.n_layers=4"]), 28785)
    single = plan_memory(work, ParallelDims())
    params = count_parameters(TransformerLM(work.config.model, 28785))
    assert single.bytes["params"] == 4 * params and single.state == 16 * params  # fp32 weights, grads, AdamW
    fsdp = plan_memory(work, ParallelDims(dp_shard=8))
    assert fsdp.state == pytest.approx(single.state / 8, rel=0.01) and fsdp.bytes["buffers"] > single.bytes["buffers"]
    tp = plan_memory(work, ParallelDims(tp=4))
    assert tp.bytes["activations"] < single.bytes["activations"] and tp.state < single.state

    def pipeline(schedule: str):
        config = load_config(None, ["model.n_layers=4", f"parallel.pp_schedule={schedule}"])
        return plan_memory(replace(work, config=config), ParallelDims(pp=4))

    gpipe, one_f_one_b = pipeline("gpipe"), pipeline("1f1b")
    assert gpipe.in_flight == 8 and one_f_one_b.pp_rank == 3  # 1F1B: the last stage, with the loss, is the fullest
    assert [in_flight("1f1b", 4, rank, 8, 1) for rank in range(4)] == [4, 3, 2, 1]  # pp - rank micro-batches
    assert gpipe.bytes["activations"] > one_f_one_b.bytes["activations"]
    checkpointed = plan_memory(replace(work, activation_checkpointing="full"), ParallelDims())
    selective = plan_memory(replace(work, activation_checkpointing="selective"), ParallelDims())
    assert checkpointed.bytes["activations"] < selective.bytes["activations"] < single.bytes["activations"]
    sp = replace(work, config=load_config(None, ["model.n_layers=4", "parallel.sequence_parallel=true"]))
    assert plan_memory(sp, ParallelDims(tp=4)).bytes["activations"] < tp.bytes["activations"]
    # CPU: fp32, the fused loss keeps no logits; CPU dropout's masks are fp32
    assert (
        plan_memory(replace(work, device="cpu"), ParallelDims()).bytes["activations"] < single.bytes["activations"] * 2
    )


@pytest.mark.parametrize("family", [{}, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("moe", [MoEConfig(experts=4, top_k=2), MoEConfig(experts=6, top_k=1, every=2, d_ff=48)])
def test_a_mixtures_parameters_are_those_its_architecture_declares(moe, family):
    """A mixture's router and stacked experts (llama's SwiGLU experts: w1, w3, w2, no biases), built as declared
    (names, order, shapes); in all as many as the model has, and per token its router and top_k experts."""
    model = replace(Config().model, **{"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "moe": moe} | family)
    built = TransformerLM(model, 100)
    assert [(p.name, p.shape) for p in parameters(model, 100)] == [
        (n, tuple(p.shape)) for n, p in built.named_parameters()
    ]
    counts = parameter_counts(model, 100)
    experts = sum(p.numel() for n, p in built.named_parameters() if ".experts." in n)
    assert counts["total"] == count_parameters(built)
    assert counts["active"] == counts["total"] - experts * (moe.experts - moe.top_k) // moe.experts


@pytest.fixture
def fake_world():
    """Rank 0 of four, all in this process (the fake backend: collectives do nothing, shapes are real)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "dims",
    [
        ParallelDims(dp_shard=4, ep=2),
        ParallelDims(dp_shard=4, ep=4),
        ParallelDims(dp_shard=4),
        ParallelDims(dp_replicate=2, dp_shard=2, ep=2),
    ],
)
@pytest.mark.parametrize("family", [[], ["model.family=llama", "model.n_heads=4", "model.n_kv_heads=2"]])
def test_the_plan_holds_what_expert_parallelism_and_fsdp_leave_on_a_rank(fake_world, dims, family):
    """Split as scalelm.parallel.runtime splits it (the experts over ep, then FSDP over the ranks holding the same
    experts, the rest over dp_shard; with ep 1 FSDP shards the experts with their block), a rank's tensors have the
    elements the plan counts, tensor by tensor, and its state is 16 bytes each. The meshes, cut from the one world
    mesh, group rank 0 with the ranks ParallelDims says."""
    config = load_config(
        None, ["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.moe={experts: 4}", *family]
    )
    world = init_device_mesh("cpu", tuple(getattr(dims, d) for d in MESH_DIMS), mesh_dim_names=MESH_DIMS)
    meshes = Meshes.of(world, dims)
    with torch.device("meta"):
        model = TransformerLM(config.model, 100)
    if dims.ep > 1:
        assert meshes.ep.mesh.flatten().tolist() == dims.groups("ep")[0]
        assert meshes.expert_dp.mesh.flatten().tolist() == dims.groups("expert_dp")[0]
        apply_ep(model, meshes.ep)
    else:
        assert meshes.ep is None and meshes.expert_dp is None
    model = apply_fsdp(model, meshes.fsdp, torch.float32, True, False, meshes.expert_dp, dims.dp_size)
    local = {n: (p.to_local() if isinstance(p, DTensor) else p).numel() for n, p in model.named_parameters()}
    declared = {t.name: held(t, dims) for t in parameters(config.model, 100)}
    assert local == declared
    assert plan_memory(Workload(config, 100), dims).state == 16 * sum(local.values())


def test_expert_parallelism_splits_the_experts_and_the_dispatch_adds_its_rows():
    """FSDP over 8 with ep 1 shards the experts 8 ways; with ep 4 a rank's quarter of them is sharded over the 2 ranks
    holding the same ones (8 ways again) and the dense parameters as before; ep 8 leaves a rank one expert whole; a
    mixture's block keeps its routed rows, the experts' hidden activation and the router's probabilities in place of
    the FFN's; the all-to-all's rows in flight come on top (FSDP frees the gathered experts as it frees the rest)."""
    work = mixture_work()
    model = work.config.model
    experts = sum(t.numel() for t in parameters(model, 28785) if t.expert)
    fsdp, ep = plan_memory(work, ParallelDims(dp_shard=8)), plan_memory(work, ParallelDims(dp_shard=8, ep=4))
    assert ep.expert_bytes["params"] == 4 * experts // 8 and ep.expert_bytes["optimizer"] == 8 * experts // 8
    assert fsdp.expert_bytes["params"] == 4 * experts // 8  # 8 experts, 1 per FSDP rank
    assert plan_memory(work, ParallelDims(dp_shard=8, ep=8)).expert_bytes == ep.expert_bytes  # one whole expert
    assert ep.state - ep.expert_state == fsdp.state - fsdp.expert_state  # the dense parameters alike
    assert ep.to_dict()["expert_bytes"] == ep.expert_bytes and ep.mb()["expert_state"] == ep.expert_state / 2**20
    tokens, d, c, g, n, e = fsdp.micro_batch_tokens, 128, 2, 1024, 8, 2
    moe, _ = moe_block_bytes_per_token(work, ParallelDims())
    assert moe == e * (2 * d + 2 * d + 4 * d + c * (2 * d + g)) + 2 * d + 4 * n + 32 * c  # a GPU's dropout masks
    # checkpointed, a mixture's block recomputes its attention's and experts' insides (full), or nothing (selective)
    kept = {
        mode: checkpointed_bytes_per_token(replace(work, activation_checkpointing=mode), ParallelDims(), mixture=True)
        for mode in ("full", "selective")
    }
    assert kept == {"full": moe - e * (4 * d + c * g), "selective": moe}
    dense = plan_memory(replace(work, config=load_config(None, ["model.n_layers=4"])), ParallelDims(dp_shard=8))
    per_block, _ = block_bytes_per_token(work, ParallelDims())
    assert fsdp.bytes["activations"] - dense.bytes["activations"] == int(4 * tokens * (moe - per_block))
    assert ep.bytes["activations"] == fsdp.bytes["activations"]
    # the all-to-all's rows in flight (FSDP's largest unit, the head, the same in both)
    assert ep.bytes["buffers"] == fsdp.bytes["buffers"] + 2 * tokens * c * d * e
    assert dense.expert_bytes is None and "expert_bytes" not in dense.to_dict() and "expert_state" not in dense.mb()


def test_expert_parallelisms_all_to_alls_and_gradients():
    """Per mixture and pass: the counts, then the rows there and back; backward their gradients; (ep - 1)/ep of every
    row leaves the rank (uniform routing). FSDP gathers a rank's experts and reduce-scatters their gradients over the
    ranks holding the same experts (efsdp), HSDP all-reduces their shards over the replicas, and the dense FSDP rows
    leave the experts out; checkpointing runs none of the forward's all-to-alls again."""
    work = mixture_work("batch.size=16")
    tokens, d, c, e, blocks, ep = 16 * 32, 128, 2, 2, 4, 2
    flows = {f.collective: f for f in traffic(work, ParallelDims(dp_shard=4, ep=ep), gpus_per_node=4)}
    counts, there, back = (
        flows[f"all-to-all {name}"]
        for name in ("row counts (EP)", "dispatch and combine (EP, forward)", "gradients (EP, backward)")
    )
    rows = blocks * tokens * c * d * e  # every mixture's routed rows, one way
    assert there.bytes == back.bytes == 2 * rows * (ep - 1) // ep and there.messages == back.messages == 2 * blocks
    assert (counts.bytes, counts.messages) == (blocks * 8 * 8 // 2, blocks)  # 8 experts' int64 counts
    assert {there.op, there.dim, there.link, there.overlaps} == {"all_to_all", "ep", INTRA, None}
    every_expert = sum(t.numel() for t in parameters(work.config.model, 28785) if t.expert)
    share, passes = every_expert // ep, there.messages // (2 * blocks)  # a rank's experts, gathered
    gather, reduce = flows["all-gather experts (EP FSDP forward)"], flows["reduce-scatter expert gradients (EP FSDP)"]
    assert (gather.bytes, gather.messages, gather.dim, gather.overlaps) == (
        passes * share * e // 2,
        blocks * passes,
        "efsdp",
        "forward",
    )
    assert (reduce.bytes, reduce.messages, reduce.overlaps) == (share * 4 // 2, blocks, "backward")
    dense = {f.collective: f for f in traffic(work, ParallelDims(dp_shard=4), gpus_per_node=4)}
    gathered = "all-gather weights (FSDP forward)"
    assert flows[gathered].bytes == pytest.approx(dense[gathered].bytes - 3 / 4 * every_expert * e, abs=2)  # none
    assert not any("EP" in name for name in dense)
    whole = {f.collective for f in traffic(work, ParallelDims(dp_shard=4, ep=4), gpus_per_node=4)}
    assert not any("EP FSDP" in name or "EP replicas" in name for name in whole)  # every rank's experts its own
    hsdp = {f.collective: f for f in traffic(work, ParallelDims(dp_replicate=2, dp_shard=2, ep=2), gpus_per_node=2)}
    replicas = hsdp["all-reduce expert gradient shards (EP replicas)"]
    assert (replicas.bytes, replicas.dim, replicas.link) == (share * 4, "dp_replicate", INTER)  # 2 (n-1)/n of all
    assert not any("EP FSDP" in name for name in hsdp)  # efsdp of one rank
    recomputed = replace(work, activation_checkpointing="full")
    again = {f.collective: f for f in traffic(recomputed, ParallelDims(dp_shard=4, ep=ep), gpus_per_node=4)}
    assert again["all-to-all gradients (EP, backward)"].bytes == back.bytes
    assert again["all-to-all row counts (EP)"].messages == blocks


def test_the_step_time_prices_a_mixtures_experts_and_all_to_alls():
    """The matrix products of the experts a token goes through (MFU's FLOPs), and each all-to-all waited for at the
    baseline's all-to-all figures, else its all-gather's."""
    work = mixture_work("batch.mode=global", "batch.size=64")
    config, tokens = work.config, 64 * work.config.data.seq_len
    flops, _, _ = stage_work(work, ParallelDims())[0]
    assert flops == flops_per_token(config.model, 28785, config.data.seq_len) * tokens
    curves = {"all_reduce": [(4096, 1.0), (2**26, 20.0)], "all_gather": [(4096, 0.5), (2**26, 10.0)]}
    speeds = Speeds(100.0, 1000.0, {INTRA: curves})
    assert speeds.bus_gbps(INTRA, "all_to_all", 2**26) == 10.0
    dims = ParallelDims(dp_shard=4, ep=4)
    step = predict(work, dims, 4, speeds)
    exchanged = [f for f in traffic(work, dims, 4) if f.op == "all_to_all"]
    seconds = sum(f.bytes / (speeds.bus_gbps(INTRA, "all_gather", f.message_bytes) * 1e9) for f in exchanged)
    assert len(exchanged) == 3 and step.all_to_all_s == pytest.approx(seconds) and step.to_dict()["all_to_all_s"] > 0
    assert predict(work, ParallelDims(dp_shard=4), 4, speeds).all_to_all_s == 0.0


def test_the_ladder_has_expert_parallelism_for_a_mixture_only(capsys):
    """ep as wide as a node's GPUs and the experts allow, FSDP over every GPU; none for a dense model or where no ep
    above 1 divides both; the config's own ep planned beside."""
    machine = Machine(2, 4, 40)
    assert [c for c in candidates(machine) if c.name == "ep"] == []
    assert [c.dims for c in candidates(machine, 6) if c.name == "ep"] == [ParallelDims(dp_shard=8, ep=2)]
    assert [c for c in candidates(machine, 3) if c.name == "ep"] == []
    layouts = plan_json(
        capsys, *COURSE, "--set", MIXTURE, *JURECA, "--set", "parallel.dp_shard=-1", "--set", "parallel.ep=2"
    )
    assert layouts["ep"]["layout"] == "1x8[ep4]x1x1" and layouts["ep"]["strategy"] is None
    assert layouts["configured"]["layout"] == "1x8[ep2]x1x1"
    assert layouts["ep"]["expert_bytes"]["params"] < layouts["single"]["expert_bytes"]["params"]
    assert "cp" not in layouts  # refused with a mixture, by check_layout
    plan_main([*COURSE, "--set", MIXTURE, "--nodes", "1", "--gpus-per-node", "4", "--gpu-memory-gb", "40"])
    out = capsys.readouterr().out
    assert "(expert state)" in out and "ep: expert parallelism's all-to-alls send" in out
    assert re.search(r"ep +ep +1x4\[ep4\]x1x1", out) and "M active per token; 8 experts of width 1024" in out
    # without speeds, where one GPU is too small: ep where it sends fewer bytes than FSDP's gathers of every expert
    # (large experts, few tokens), FSDP where the routed rows outweigh the experts (the course model's 16,384 tokens)
    wide = ["--set", "model.d_model=1024", "--set", "model.n_heads=8", "--set", "model.d_ff=4096"]
    few = ["--set", "data.seq_len=256", "--set", "model.max_seq_len=256", "--set", "batch.size=1"]
    node = ["--nodes", "1", "--gpus-per-node", "8", "--gpu-memory-gb", "16"]
    many = plan_json(capsys, "--vocab-size", "32000", *wide, "--set", "model.moe={experts: 64}", *few, *node)
    assert many["ep"]["recommended"] and not many["single"]["fits"] and "fewer bytes" in many["ep"]["reason"]
    course = plan_json(
        capsys, *COURSE, "--set", MIXTURE, "--nodes", "1", "--gpus-per-node", "4", "--gpu-memory-gb", "7"
    )
    assert not course["single"]["fits"] and course["ep"]["fits"] and course["fsdp_no_reshard"]["recommended"]


def test_a_mixtures_experiment_is_planned_and_wired_like_any_other():
    """An ep experiment: planned on its GPUs with its experts' share, and checked before the queue against one
    process of the same mixture with its degrees (ep included) spelt out."""
    config = load_config(None, ["model.n_layers=4", MIXTURE, "parallel.strategy=ep"])
    layout = resolve_layout(config, 2, 2)
    moe_ep = Experiment("moe_ep", "ep", 1, 2, 1, config, layout)
    plan = plan_experiment(moe_ep, SiteConfig(gpus_per_node=2, gpu_memory_gb=40), 28785)
    assert plan["fits"] and plan["layout"] == "1x2[ep2]x1x1" and plan["expert_bytes"]["params"] > 0
    # a site that names its GPU in the catalogue (gpu:) and not its memory is planned against the catalogue's
    named = plan_experiment(moe_ep, SiteConfig(gpus_per_node=2, gpu="a100-40gb"), 28785)
    assert named["gpu_memory_gb"] == 40 and named["fits"] and named["usable_bytes"] == plan["usable_bytes"]
    assert (
        plan_experiment(moe_ep, SiteConfig(gpus_per_node=2, gpu="a100-40gb", gpu_memory_gb=80), 28785)["gpu_memory_gb"]
        == 80
    )  # the site's own figure wins
    dense = load_config(None, ["model.n_layers=4", "parallel.strategy=ddp"])
    runs = preflight.preflight_runs(
        [Experiment("ddp", "ddp", 1, 2, 1, dense, resolve_layout(dense, 2, 2)), moe_ep], "r"
    )
    checked, reference = runs["moe_ep"], runs[runs["moe_ep"]["reference"]]
    assert runs["moe_ep"]["reference"] != runs["ddp"]["reference"]  # another model: a reference of its own
    assert "strategy" not in checked["settings"]["parallel"] and checked["settings"]["parallel"]["ep"] == 2
    assert resolve_layout(from_dict(checked["settings"]), 2, 2).dims == layout.dims
    assert reference["settings"]["model"]["moe"] == checked["settings"]["model"]["moe"] and reference["world_size"] == 1


def test_communication_by_collective_and_link():
    work = Workload(load_config(None, ["model.n_layers=4"]), 28785)
    params = count_parameters(TransformerLM(work.config.model, 28785))
    ddp = traffic(work, ParallelDims(dp_replicate=8), gpus_per_node=4)
    assert [(f.dim, f.link) for f in ddp] == [("dp_replicate", INTER)]
    assert ddp[0].bytes == int(2 * 7 / 8 * params * 4)  # a ring all-reduce of the fp32 gradients
    hsdp = {f.collective: f for f in traffic(work, ParallelDims(dp_replicate=2, dp_shard=4), gpus_per_node=4)}
    assert hsdp["all-reduce gradient shards (HSDP replicas)"].link == INTER
    assert hsdp["reduce-scatter gradients (FSDP)"].link == INTRA
    assert (
        hsdp["all-gather weights (FSDP backward)"].bytes < hsdp["all-gather weights (FSDP forward)"].bytes
    )  # head kept
    tp = {f.collective: f for f in traffic(work, ParallelDims(tp=4), gpus_per_node=4)}
    assert {(f.dim, f.link) for f in tp.values()} == {("tp", INTRA)}
    # the blocks' sums and the vocabulary-split embedding's rows, forward only (the weight's fp32 without FSDP)
    tokens = work.config.batch.size * work.config.data.seq_len
    embedding = tp.pop("all-reduce embedding rows (TP, vocabulary-split)")
    assert embedding.bytes == int(2 * 3 / 4 * tokens * work.config.model.d_model * 4) and list(tp) == [
        "all-reduce activations (TP, 4 per block, 2 per mixture's)"
    ]
    pp = traffic(work, ParallelDims(pp=8), gpus_per_node=4)
    assert [(f.dim, f.link) for f in pp] == [("pp", INTER)]


def test_context_parallelism_divides_the_activations_and_sends_the_ring_its_blocks():
    """cp 4 on a 2048-token workload: a quarter of the tokens per rank, the ring's log-sum-exp instead of attention's
    scores, FSDP over the cp group (the state a quarter), and the ring's key/value traffic to the byte."""
    config = load_config(None, ["model.n_layers=4", "data.seq_len=2048", "model.max_seq_len=2048", "batch.size=8"])
    work = Workload(config, 28785)
    d, a, blocks, tokens = config.model.d_model, config.model.n_heads, 4, 8 * 2048
    single, cp = plan_memory(work, ParallelDims()), plan_memory(work, ParallelDims(cp=4))
    assert cp.micro_batch_tokens == single.micro_batch_tokens // 4 and cp.state == pytest.approx(
        single.state / 4, rel=0.01
    )
    assert cp.activation_bytes_per_token_per_block == single.activation_bytes_per_token_per_block + 4 * a  # fp32 lse
    assert cp.bytes["activations"] < single.bytes["activations"] / 3
    flows = {f.collective: f for f in traffic(work, ParallelDims(cp=4), gpus_per_node=4)}
    forward, backward = (
        flows[f"send key/value blocks{x} (CP ring, {y})"]
        for x, y in (("", "forward"), (" and their gradients", "backward"))
    )
    block = 2 * tokens // 4 * d  # a rank's keys and values, bf16 on a GPU
    assert forward.bytes == blocks * 3 * block * 2 and forward.messages == blocks * 3 and forward.link == INTRA
    assert backward.bytes == blocks * (3 * block * 2 + 4 * block * 4) and backward.messages == blocks * 7
    assert flows["reduce-scatter gradients (FSDP)"].dim == "dp_shard_cp"
    assert {
        f.dim for f in traffic(work, ParallelDims(dp_shard=2, cp=4), gpus_per_node=4) if "FSDP" in f.collective
    } == {"dp_shard_cp"}


def test_the_step_time_model_adds_its_parts_as_docs_plan_md_says():
    """Compute from the FLOPs MFU divides and the bytes of the memory plan, each collective at its message size and
    link, hidden behind its pass on a GPU and not on a CPU, the pipeline's fill and drain, an oversubscribed CPU."""
    work = Workload(load_config(None, ["model.n_layers=4", "batch.mode=global", "batch.size=64"]), 28785)
    config, tokens = work.config, 64 * work.config.data.seq_len
    curve = [(4096, 0.5), (2**20, 8.0), (2**26, 20.0)]
    speeds = Speeds(100.0, 1000.0, {INTRA: {"all_reduce": curve}, INTER: {"all_reduce": [(4096, 0.1), (2**26, 5.0)]}})
    # the bus bandwidth: the smallest message's time below it, log-log between sizes, the largest's above
    assert speeds.bus_gbps(INTRA, "all_reduce", 2048) == pytest.approx(0.25)
    assert speeds.bus_gbps(INTRA, "all_reduce", 2**16) == pytest.approx(2.0)  # halfway in log size and bandwidth
    assert speeds.bus_gbps(INTRA, "all_gather", 2**30) == 20.0  # an op not measured takes all_reduce's figures

    single = predict(work, ParallelDims(), 4, speeds)
    flops, no_attention, moved = stage_work(work, ParallelDims())[0]
    assert flops == flops_per_token(config.model, 28785, config.data.seq_len) * tokens  # MFU's FLOPs, every token
    per_block, _ = block_bytes_per_token(work, ParallelDims())
    weights = count_parameters(TransformerLM(config.model, 28785))
    # the passes over what a block keeps, which a measured baseline's efficiency is calibrated against
    assert no_attention == 0 and moved == 3 * tokens * 4 * per_block + 4 * tokens * 4 * 28785 + 28 * weights
    # these speeds have no model step to calibrate them: a GPU's step is counted op by op (scalelm.plan.elementwise),
    # attention as its causal kernel computes it, 7 s d per token and block, at the products' rate (none given)
    products, attention, counted = stage_work(work, ParallelDims(), by_operation=True)[0]
    s, d = config.data.seq_len, config.model.d_model
    assert products == flops - 12 * 4 * s * d * tokens and attention == 7 * 4 * s * d * tokens
    assert single.matmul_s == pytest.approx(products / 100e12)
    assert single.attention_s == pytest.approx(attention / 100e12)
    assert single.elementwise_s == pytest.approx(counted / 1e12) and counted > moved
    assert single.total_s == single.compute_s and single.communication_s == {} and single.bubble_s == 0

    # DDP on 8 GPUs of two nodes: each rank computes an eighth; its two buckets of gradients (25 MiB at most) cross
    # the network, hidden behind the backward on a GPU beyond what it covers, and never the last bucket
    ddp = predict(work, ParallelDims(dp_replicate=8), 4, speeds)
    (flow,) = traffic(work, ParallelDims(dp_replicate=8), 4)
    wire = flow.bytes / (speeds.bus_gbps(INTER, "all_reduce", flow.message_bytes) * 1e9)
    assert (flow.messages, flow.message_bytes, flow.overlaps) == (2, weights * 4 // 2, "backward")
    halved = replace(work, config=replace(config, batch=replace(config.batch, size=32)))
    per_parameter = 2 * stage_work(halved, ParallelDims(), True)[0].moved - counted  # what no token count changes
    assert per_parameter > 28 * weights  # every replica casts and updates every parameter
    compute = (products + attention) / 8 / 100e12 + ((counted - per_parameter) / 8 + per_parameter) / 1e12
    assert ddp.compute_s == pytest.approx(compute)
    uncovered = max(wire - ddp.compute_s * 2 / 3, wire / 2)
    assert ddp.communication_s == {flow.collective: pytest.approx(uncovered)} and uncovered < wire
    # tensor parallelism's all-reduces are waited for, 4 per block and pass, and the split embedding's one forward
    tp = predict(work, ParallelDims(tp=4), 4, speeds)
    blocks, embedding = traffic(work, ParallelDims(tp=4), 4)
    assert (blocks.messages, embedding.messages) == (16, 1)
    for flow in (blocks, embedding):
        assert flow.overlaps is None and flow.link == INTRA
        assert tp.communication_s[flow.collective] == pytest.approx(
            flow.bytes / (speeds.bus_gbps(INTRA, "all_reduce", flow.message_bytes) * 1e9)
        )
    # FSDP on a GPU hides its gathers behind the passes, beyond one unit's message
    fsdp = predict(work, ParallelDims(dp_shard=8), 4, speeds)
    assert all(seconds > 0 for seconds in fsdp.communication_s.values())
    # a pipeline of 2 stages and 4 micro-batches: the busiest stage waits one slot of the other
    pp_work = replace(work, config=replace(config, parallel=replace(config.parallel, pp_microbatches=4)))
    pp = predict(pp_work, ParallelDims(pp=2), 4, speeds)
    stages = [(m + a) / 100e12 + b / 1e12 for m, a, b in stage_work(pp_work, ParallelDims(pp=2), True)]
    assert pp.compute_s == pytest.approx(max(stages)) and pp.bubble_s == pytest.approx(min(stages) / 4)

    # a CPU: rates per thread (measured with 1 of 2 cores), nothing hidden, collectives slower on a crowded host
    cpu = replace(speeds, threads=1, cpus=2)
    assert predict(work, ParallelDims(), 1, cpu).compute_s == pytest.approx(single.compute_s / 2)  # both cores
    alone = predict(work, ParallelDims(dp_replicate=2), 2, cpu)  # 2 ranks of 1 thread on 2 cores
    crowded = predict(work, ParallelDims(dp_replicate=4), 2, cpu, threads=1, ranks_on_host=4)
    assert alone.communication_s == {
        f.collective: pytest.approx(f.bytes / speeds.bus_gbps(f.link, f.op, f.message_bytes) / 1e9)
        for f in traffic(work, ParallelDims(dp_replicate=2), 2)
    }  # all waited for
    ((name, seconds),) = crowded.communication_s.items()
    assert crowded.matmul_s == pytest.approx(single.matmul_s / 2)  # a quarter of the tokens each at half a core
    assert seconds > 2 * alone.communication_s[name] * 0.99  # 4 ranks on 2 cores: twice as long, a larger group
    # with the baseline's measured speedups: one process gains what its threads gained there, several processes
    # share the machine's throughput
    measured = replace(cpu, thread_speedup=1.4, host_speedup=1.8)
    assert (measured.per_rank(2, 1), measured.per_rank(1, 1)) == (pytest.approx(1.4), 1.0)
    assert measured.per_rank(1, 2) == pytest.approx(0.9) and measured.per_rank(1, 4) == pytest.approx(0.45)
    # what a small collective costs inside a step, where the baseline measured it: each message's latency in place of
    # the curve's back-to-back one (the smallest size's time), bandwidth on top; crowded as the curves are
    floor, smallest = 0.003, {INTRA: curve[0], INTER: (4096, 0.1)}  # (bytes, bus GB/s) of each link's smallest
    waits = replace(cpu, in_step_latency_s=floor)
    for dims, ranks in ((ParallelDims(dp_replicate=2), 2), (ParallelDims(tp=2), 2), (ParallelDims(dp_replicate=4), 4)):
        plain, latent = (predict(work, dims, 2, s, threads=1, ranks_on_host=ranks) for s in (cpu, waits))
        for f in traffic(work, dims, 2):
            size, bus = smallest[f.link]
            back_to_back = size * f.bytes / f.messages / f.message_bytes / (bus * 1e9)
            extra = f.messages * (floor - back_to_back) * cpu.crowding(1, ranks)
            assert extra > 0
            assert latent.communication_s[f.collective] == pytest.approx(plain.communication_s[f.collective] + extra)
    assert predict(work, ParallelDims(), 1, waits).communication_s == {}  # nothing to wait for alone
    # and the ranks drift apart between collectives: each waits for the last, a share of the compute
    drifting = replace(waits, drift_share=0.1)
    ddp = predict(work, ParallelDims(dp_replicate=2), 2, drifting)
    assert ddp.communication_s[DRIFT] == pytest.approx(0.1 * ddp.compute_s)
    without = predict(work, ParallelDims(dp_replicate=2), 2, waits)
    assert ddp.total_s == pytest.approx(without.total_s + 0.1 * ddp.compute_s)
    assert predict(work, ParallelDims(), 1, drifting).communication_s == {}
    four = predict(work, ParallelDims(dp_replicate=4), 2, drifting, threads=1, ranks_on_host=4)  # 2 cores: twice
    assert four.communication_s[DRIFT] == pytest.approx(2 * 0.1 * four.compute_s)


def speeds_of(baseline: dict, source: str = "", at: str = "median") -> Speeds:
    """The speeds of a baseline's JSON (scalelm.measure.baseline's), read as the plan reads it."""
    return Speeds.from_baseline(MachineBaseline.from_json(baseline), source, at)


def test_with_the_machines_speeds_the_plan_recommends_the_fastest_layout(capsys, tmp_path):
    """From the flags or a baseline file: each layout's step time and tokens/s, the recommendation the most
    tokens per second among the layouts that fit the whole machine."""
    layouts = plan_json(capsys, *COURSE, *JURECA, *SPEEDS, "--elementwise-gbps", "1500")
    fitting = [layout for layout in layouts.values() if layout["fits"] and layout["gpus"] == 8]
    best = max(fitting, key=lambda layout: layout["tokens_per_s"])
    assert best["recommended"] and "should train the most tokens per second" in best["reason"]
    assert all(layout["step_time"]["total_s"] > 0 for layout in layouts.values())
    # a baseline of two nodes of four GPUs: the job's collectives are inter-node, the node's intra-node; the model's
    # own step took twice what its products and bytes explain: an efficiency of 1/2 doubles every layout's compute
    work = Workload(load_config(None, ["model.n_layers=4"]), 28785)
    explained = efficiency(work, Speeds(150.0, 1500.0, {}, model_step=(16384, 1.0)))
    baseline = {
        "world_size": 8,
        "procs_per_node": 4,
        "hosts": ["n1", "n2"],
        "device": "NVIDIA H100",
        "matmul_tflops_min": 150.0,
        "elementwise_gbps_min": 1500.0,
        "per_rank": [{"rank": 0}],
        "model_step": {"tokens": 16384, "seconds_max": 2 * explained},
        "collectives": [
            {"scope": scope, "op": "all_reduce", "bytes": 2**26, "busbw_gbps": bw}
            for scope, bw in (("job", 20.0), ("node", 80.0))
        ],
    }
    (tmp_path / "nodes2.json").write_text(json.dumps(baseline))
    from_file = plan_json(capsys, *COURSE, *JURECA, "--baseline", str(tmp_path / "nodes2.json"))
    older = {key: value for key, value in baseline.items() if key != "model_step"}  # a baseline of an older scalelm
    with pytest.raises(ConfigError, match="nodes2.json lacks the step-time model's figures .* rerun the workflow's"):
        speeds_of(older, "nodes2.json")
    assert from_file["tp"]["step_time"]["efficiency"] == pytest.approx(0.5)
    # a baseline whose step had another vocabulary (made before the data was prepared: WikiText-2's) is priced with
    # it: the same efficiency, where the study's vocabulary would have made its output layer another size
    other = replace(work, vocab_size=4 * work.vocab_size)
    ideal = efficiency(other, Speeds(150.0, 1500.0, {}, model_step=(16384, 1.0)))  # its products' and bytes' seconds
    timed_other = {"seconds_max": 2 * ideal, "vocab_size": other.vocab_size}
    measured = speeds_of(baseline | {"model_step": baseline["model_step"] | timed_other})
    assert measured.model_vocab == other.vocab_size and efficiency(work, measured) == pytest.approx(0.5)
    assert efficiency(work, replace(measured, model_vocab=None)) < 0.45  # as the study's: a slower machine than it is
    # the ends of the baseline's spread: its fastest and slowest repetitions give the plan's spread
    baseline["model_step"]["seconds_spread"] = [1.5 * explained, 3 * explained]
    baseline["collectives"] = [
        row | {"busbw_gbps_min": row["busbw_gbps"] / 2, "busbw_gbps_max": row["busbw_gbps"] * 2}
        for row in baseline["collectives"]
    ]
    dims, work = ParallelDims(dp_shard=4, tp=2), Workload(load_config(None, ["model.n_layers=4"]), 28785, "cuda")
    steps = {at: predict(work, dims, 4, speeds_of(baseline, at=at)) for at in ("fast", "median", "slow")}
    assert steps["fast"].compute_s < steps["median"].compute_s < steps["slow"].compute_s
    assert steps["fast"].total_s < steps["median"].total_s < steps["slow"].total_s
    comm = {at: sum(step.communication_s.values()) for at, step in steps.items()}
    assert comm["fast"] < comm["median"] < comm["slow"]
    # on a CPU the machine's throughput with every rank at work moves most: its spread is the plan's too
    step = baseline["model_step"] | {"host_speedup": 1.5, "host_speedup_spread": [1.2, 1.8]}
    cpu = baseline | {"device": "cpu", "per_rank": [{"rank": 0, "threads": 1, "cpus": 2}], "model_step": step}
    assert [speeds_of(cpu, at=at).host_speedup for at in ("fast", "median", "slow")] == [1.8, 1.5, 1.2]
    # a small collective inside a step, measured with the baseline's ranks at work: 4 on 2 cores, twice what a host
    # they do not crowd sees; a GPU's baseline has none (its curves alone)
    measured = {"in_step_latency_s": 0.006, "in_step_latency_s_spread": [0.004, 0.01]}
    measured |= {"drift_share": 0.1, "drift_share_spread": [0.05, 0.2]}  # the ranks' wait: crowded likewise
    latent = cpu | measured | {"model_step": step | {"ranks_per_host": 4}}
    ends = [speeds_of(latent, at=at) for at in ("fast", "median", "slow")]
    assert [s.in_step_latency_s for s in ends] == [0.002, 0.003, 0.005]
    assert [s.drift_share for s in ends] == [0.025, 0.05, 0.1]
    gpu = speeds_of(baseline | measured)
    assert gpu.in_step_latency_s is None and gpu.drift_share is None
    # a layout's overheads, per pass: DTensor's dispatch for tp, the ring for cp (its steps grow with cp: the
    # baseline's ring has 2 ranks), the mixture's dispatch for ep, FSDP's units wherever parameters are sharded; each
    # layout's compute pays its own, none other's
    baseline["model_step"]["layout_overhead_s"] = {"tp": 0.01, "cp": 0.02, "ep": 0.03, "fsdp": 0.004}
    baseline["model_step"]["layout_overhead_s_spread"] = {
        "tp": [0.0, 0.02],
        "cp": [0.01, 0.03],
        "ep": [0.02, 0.05],
        "fsdp": [0.001, 0.006],
    }
    overheads = speeds_of(baseline)
    slow = {"tp": 0.02, "cp": 0.03, "ep": 0.05, "fsdp": 0.006}
    assert speeds_of(baseline, at="slow").layout_overhead_s == slow
    tp_step = predict(work, dims, 4, overheads)  # dp_shard 4 x tp 2
    passes = tp_step.overhead_s["tp"] / 0.01  # forward and backward passes of a step (a GPU: no CPU sharing)
    assert passes >= 1 and passes == pytest.approx(round(passes))
    assert tp_step.overhead_s == {"tp": pytest.approx(0.01 * passes), "fsdp": pytest.approx(0.004 * passes)}
    assert tp_step.compute_s == pytest.approx(steps["median"].compute_s + sum(tp_step.overhead_s.values()))
    assert predict(work, ParallelDims(dp_shard=8), 4, overheads).overhead_s == {"fsdp": pytest.approx(0.004 * passes)}
    assert predict(work, ParallelDims(dp_replicate=8), 4, overheads).overhead_s == {}  # DDP: no layout's machinery
    assert predict(work, ParallelDims(), 4, overheads).overhead_s == {}
    cast = Workload(load_config(None, ["train.precision=bf16_params"]), 28785, "cuda")  # FSDP on a mesh of one rank
    assert set(predict(cast, ParallelDims(), 4, overheads).overhead_s) == {"fsdp"}
    assert predict(work, ParallelDims(dp_shard=2, cp=4), 4, overheads).overhead_s == {
        "cp": pytest.approx(0.04 * passes),
        "fsdp": pytest.approx(0.004 * passes),
    }
    moe = Workload(load_config(None, ["model.n_layers=4", "model.moe.experts=8"]), 28785, "cuda")
    assert predict(moe, ParallelDims(dp_shard=8, ep=4), 4, overheads).overhead_s == {
        "ep": pytest.approx(0.03 * passes),
        "fsdp": pytest.approx(0.004 * passes),
    }
    # against the same baseline at an efficiency of 1 (its step all explained): twice the compute; the flags' speeds,
    # which no model step calibrates, count a GPU's step op by op instead (stage_work's by_operation): more than that
    explained_step = {"model_step": {"tokens": 16384, "seconds_max": explained}}
    (tmp_path / "explained.json").write_text(json.dumps(baseline | explained_step))
    all_explained = plan_json(capsys, *COURSE, *JURECA, "--baseline", str(tmp_path / "explained.json"))
    assert from_file["tp"]["step_time"]["compute_s"] == pytest.approx(2 * all_explained["tp"]["step_time"]["compute_s"])
    assert layouts["tp"]["step_time"]["compute_s"] > all_explained["tp"]["step_time"]["compute_s"]
    tp_comm = from_file["tp"]["step_time"]["communication_s"]  # smaller messages than the baseline's 64 MiB
    assert set(tp_comm) == set(layouts["tp"]["step_time"]["communication_s"]) and len(tp_comm) == 2
    assert sum(tp_comm.values()) > sum(layouts["tp"]["step_time"]["communication_s"].values())  # each takes its time
    plan_main([*COURSE, *JURECA, "--baseline", str(tmp_path / "nodes2.json")])
    out = capsys.readouterr().out
    assert "step s" in out and "tokens/s" in out and f"the machine's speeds from {tmp_path / 'nodes2.json'}" in out


def collective_rows(scope: str, ranks: int, scale: float) -> list[dict]:
    """Every op at three sizes as measure.baseline.collectives.time_collectives writes them, `scale` x a slow
    network's."""
    rows = []
    for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all"):
        factor = {"all_reduce": 2 * (ranks - 1) / ranks, "send_recv": 1.0}.get(op, (ranks - 1) / ranks)
        for size, bus in ((4096, 0.2 * scale), (2**20, 6.0 * scale), (2**26, 18.0 * scale)):
            seconds = size / (bus / factor) / 1e9
            rows.append(
                {
                    "scope": scope,
                    "op": op,
                    "ranks": ranks,
                    "bytes": size,
                    "time_s": seconds,
                    "time_s_min": seconds * 0.8,
                    "time_s_max": seconds * 1.5,
                    "algbw_gbps": bus / factor,
                    "busbw_gbps": bus,
                    "busbw_gbps_min": bus / 1.5,
                    "busbw_gbps_max": bus / 0.8,
                }
            )
    return rows


def written_baseline(device: str) -> dict:
    """A baseline as measure.baseline writes it today, every key it writes: on two nodes of four GPUs ("gpu"), or
    on one 2-core host of two ranks ("cpu": its speedups and waits besides)."""
    gpu = device == "gpu"
    world, procs = (8, 4) if gpu else (2, 2)
    load = {"cpus": 2, "busy_cores": 1.0, "run_cores": 1.0, "other_cores": 0.0}
    overheads = {
        "cp": (0.01, 0.005, 0.02),
        "ep": (0.02, 0.01, 0.03),
        "fsdp": (0.003, 0.001, 0.004),
        "tp": (0.006, 0.004, 0.01),
    }
    overhead_figures = {
        "layout_overhead_s": {name: median for name, (median, _, _) in overheads.items()},
        "layout_overhead_s_spread": {name: [low, high] for name, (_, low, high) in overheads.items()},
    }

    def rank(r: int) -> dict:
        together = {} if gpu else {"model_step_together_s_spread": [0.14, 0.2]}
        return {
            "rank": r,
            "host": f"n{r // procs}",
            "machine": f"boot-{r // procs}",
            "model_step_all_cores_s": None if gpu or r else 0.08,
            "matmul": {"products": {"qkv": {"shape": [256, 32, 96], "tflops": 0.05}}, "tflops": 0.05, "dtype": "x"},
            "elementwise_gbps": 12.0 + r,
            "model_step_s": 0.1,
            "model_step_s_spread": [0.09, 0.13],
            "model_step_small_s": 0.04,
            "model_step_small_s_spread": [0.035, 0.05],
            "model_step_small_tokens": 256,
            **(overhead_figures if r == 0 else {}),
            "model_step_compiled": False,
            "gpu": {"healthy": True, "held_back_by": [], "samples": 3} if gpu else None,
            "model_step_together_s": None if gpu else 0.16,
            **together,
            "threads": 1,
            "cpus": 64 if gpu else 2,
            "load": load,
        }

    step = {"tokens": 1024, "seconds_max": 0.1, "seconds_spread": [0.09, 0.13], "small_tokens": 256}
    step |= {"small_seconds_max": 0.04, "small_seconds_spread": [0.035, 0.05], **overhead_figures}
    if not gpu:
        step |= {"cores": 2, "thread_speedup": 1.25, "together_seconds_max": 0.16, "ranks_per_host": 2}
        step |= {"host_speedup": 1.25, "host_speedup_spread": [1.0, 1.4285714285714286]}
    step |= {"compiled": False, "vocab_size": 5018, "prepared": True}
    hosts = sorted({f"n{r // procs}" for r in range(world)})
    result = {
        "world_size": world,
        "procs_per_node": procs,
        "hosts": hosts,
        "device": "NVIDIA H100 80GB HBM3" if gpu else "cpu",
        "backend": "nccl" if gpu else "gloo",
        "torch": "2.10.0",
        "matmul_tflops_min": 300.0 if gpu else 0.05,
        "elementwise_gbps_min": 2500.0 if gpu else 12.0,
        "model_step": step,
        "per_rank": [rank(r) for r in range(world)],
        "collectives": collective_rows("job", world, 5.0 if gpu else 1.0)
        + (collective_rows("node", procs, 20.0) if gpu else []),
    }
    if not gpu:
        result |= {"in_step_latency_s": 0.002, "in_step_latency_s_spread": [0.0015, 0.003]}
        result |= {"drift_share": 0.08, "drift_share_spread": [0.05, 0.12]}
    return result | {"nccl_network": "IB" if gpu else None, "host_load": {host: load for host in hosts}}


# each layout: degrees, ranks per node, threads per rank, ranks on a host (None: the plan's defaults)
LAYOUTS = {
    "cuda": {
        "single": ({}, 4, None, None),
        "ddp": ({"dp_replicate": 8}, 4, None, None),
        "fsdp_tp": ({"dp_shard": 4, "tp": 2}, 4, None, None),
        "ddp_pp": ({"dp_replicate": 4, "pp": 2}, 4, None, None),
        "fsdp_cp": ({"dp_shard": 4, "cp": 2}, 4, None, None),
        "fsdp_ep": ({"dp_shard": 8, "ep": 4}, 4, None, None),
    },
    "cpu": {
        "single": ({}, 1, None, None),
        "ddp": ({"dp_replicate": 2}, 2, None, None),
        "tp": ({"tp": 2}, 2, None, None),
        "ddp_crowded": ({"dp_replicate": 4}, 2, 1, 4),
        "pp": ({"pp": 2}, 2, None, None),
        "fsdp_threads": ({"dp_shard": 2}, 2, 2, 1),
    },
}
# each layout's step (median, fast, slow) planned from written_baseline before the baseline became a record and the
# host's terms moved to scalelm.plan.host (issue 68): the plan must give them to the last bit (the TP layouts' since
# tensor parallelism splits the embedding by vocabulary: its share of the state, and its rows' all-reduce)
PLANNED_BEFORE = {
    ("cuda", "single"): (0.1, 0.09000000000000001, 0.13),
    ("cuda", "ddp"): (0.040271512770743235, 0.03523196655682773, 0.0503861886700675),
    ("cuda", "fsdp_tp"): (0.046134211674070794, 0.03736384509744883, 0.060192066427974464),
    ("cuda", "ddp_pp"): (0.07851478248932359, 0.06429913967068918, 0.0963617256207992),
    ("cuda", "fsdp_cp"): (0.04307368518443917, 0.03189383416107871, 0.060774976328762484),
    ("cuda", "fsdp_ep"): (0.05390098990820879, 0.037647393682916926, 0.07188491092467046),
    ("cpu", "single"): (0.07999999999999999, 0.07199999999999998, 0.10399999999999998),
    ("cpu", "ddp"): (0.10767438297508637, 0.08146318162920924, 0.1780904522564987),
    ("cpu", "tp"): (0.1888201341073476, 0.14160231808013693, 0.3152861937073208),
    ("cpu", "ddp_crowded"): (0.15881881380578045, 0.11566784043320152, 0.26496051897079936),
    ("cpu", "pp"): (0.2153737329626142, 0.16193153628930573, 0.3488185367526252),
    ("cpu", "fsdp_threads"): (0.09547668465799447, 0.07647574772639557, 0.13384436032032504),
}
SMALL = ["model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.d_ff=256", "data.seq_len=64"]
SMALL += ["batch.mode=global", "batch.size=16"]


def test_a_baseline_read_as_its_record_plans_every_layout_as_before():
    """Issue 68: the same baseline plans the same step on every layout, at the median and either end of its
    spread, on GPUs and on a CPU host whose cores its ranks share, as it did before the record and plan/host.py."""
    for device, layouts in LAYOUTS.items():
        record = MachineBaseline.from_json(written_baseline("gpu" if device == "cuda" else "cpu"))
        ends = [Speeds.from_baseline(record, at=at) for at in ENDS]
        for name, (degrees, per_node, threads, ranks) in layouts.items():
            config = load_config(None, SMALL + (["model.moe.experts=4"] if "ep" in degrees else []))
            work, dims = Workload(config, 5018, device), ParallelDims(**degrees)
            planned = tuple(predict(work, dims, per_node, speeds, threads, ranks).total_s for speeds in ends)
            assert planned == PLANNED_BEFORE[device, name], (device, name)


def test_the_machine_baseline_is_one_record_read_from_any_scalelms_file_and_written_back_unchanged():
    """Issue 68: measure.baseline's JSON read into MachineBaseline and written back is the same JSON, on GPUs and on
    a CPU; its figures at either end of their spread; older files (no spreads, no model step, no elementwise rate,
    no host load, rows without times) still read, and still plan where they have the model's figures."""
    for device in ("gpu", "cpu"):
        assert MachineBaseline.from_json(written_baseline(device)).to_json() == written_baseline(device)
    gpu, cpu = (MachineBaseline.from_json(written_baseline(device)) for device in ("gpu", "cpu"))
    assert (gpu.nodes, cpu.nodes, gpu.on_cpu, cpu.on_cpu) == (2, 1, False, True)
    assert gpu.waits is None and gpu.model_step.host_speedup is None and gpu.model_step.thread_speedup is None
    step = cpu.model_step
    assert (step.seconds.at("fast"), step.seconds.at("slow")) == (0.09, 0.13)  # a time: fast at its low end
    assert (step.host_speedup.at("fast"), step.host_speedup.at("slow")) == (1.4285714285714286, 1.0)  # a rate: high
    assert cpu.waits.drift_share == Figure(0.08, 0.05, 0.12) and step.layout_overhead_s["tp"].at("slow") == 0.01
    assert gpu.largest()["node_all_reduce"].busbw_gbps.at("fast") == 360.0 / 0.8
    assert [rank.host for rank in gpu.per_rank] == ["n0"] * 4 + ["n1"] * 4 and gpu.per_rank[0].gpu["healthy"]

    row = {"scope": "job", "op": "all_reduce", "bytes": 2**26, "busbw_gbps": 10.0}  # before repetitions were timed
    older = {"world_size": 2, "procs_per_node": 1, "hosts": ["a", "b"], "device": "cpu", "matmul_tflops_min": 1.0}
    older |= {"per_rank": [{"rank": 0, "threads": 1, "cpus": 2}], "collectives": [row]}
    record = MachineBaseline.from_json(older)
    assert record.model_step is None and record.elementwise_gbps is None and record.host_load is None
    assert record.collectives[0].busbw_gbps.at("fast") == 10.0 and record.collectives[0].to_json() == row
    with pytest.raises(ConfigError, match="lacks the step-time model's figures"):
        Speeds.from_baseline(record)
    timed = {"tokens": 1024, "seconds_max": 0.1}  # a model step without spreads, vocabulary, speedups or waits
    record = MachineBaseline.from_json(older | {"elementwise_gbps_min": 12.0, "model_step": timed})
    median, fast, slow = (Speeds.from_baseline(record, at=at) for at in ENDS)
    assert median == fast == slow  # no spread: its medians at either end
    work = Workload(load_config(None, SMALL), 5018, "cpu")
    assert predict(work, ParallelDims(dp_replicate=2), 1, Speeds.from_baseline(record)).total_s > 0
    with pytest.raises(ValueError, match="no machine baseline"):
        MachineBaseline.from_json({"world_size": 2})


def test_a_cpu_hosts_terms_are_the_hosts_and_a_gpu_plan_has_none():
    """Issue 68: plan/host.py prices what ranks sharing a CPU host's cores do to a step; a GPU's plan has none of
    it."""
    cpu, gpu = (Speeds.from_baseline(MachineBaseline.from_json(written_baseline(d))) for d in ("cpu", "gpu"))
    assert HostContention.of(gpu, None, 4) == HostContention.none()
    assert HostContention.none().drift(1.0) == 0.0 and HostContention.none().overlaps
    crowded = HostContention.of(cpu, 1, 4)  # 4 ranks of a thread on 2 cores: the host's throughput shared out
    assert (crowded.speedup, crowded.collective_factor, crowded.overlaps) == (1.25 / 4, 2.0, False)
    assert crowded.drift(1.0) == pytest.approx(0.08 * 2) and crowded.in_step_latency_s == 0.002
    assert HostContention.of(cpu, None, 1).speedup == 1.25  # one process: both cores as threads, as the baseline's


def test_the_plan_stays_torch_free():
    """The plan runs where torch is not installed (a login node): its modules import none."""
    modules = "scalelm.plan.steptime, scalelm.plan.machine, scalelm.plan.host"
    code = f"import sys; import {modules}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_course_model_on_jureca_dc_is_data_parallel(capsys):
    layouts = plan_json(capsys, *COURSE, *JURECA)
    assert set(layouts) == {
        "single",
        "ddp",
        "fsdp_no_reshard",
        "fsdp",
        "hsdp",
        "tp",
        "fsdp_tp",
        "3d",
        "cp",
    }  # pp: 4 blocks, 8 GPUs
    assert all(layout["fits"] for layout in layouts.values())
    assert layouts["cp"]["degrees"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1, "cp": 4, "ep": 1}
    assert [name for name, layout in layouts.items() if layout["recommended"]] == ["ddp"]
    ddp = layouts["ddp"]
    assert ddp["strategy"] == "ddp" and ddp["degrees"] == {
        "dp_replicate": 8,
        "dp_shard": 1,
        "tp": 1,
        "pp": 1,
        "cp": 1,
        "ep": 1,
    }
    assert set(ddp["bytes"]) == {"params", "grads", "optimizer", "activations", "buffers"}
    assert ddp["total_bytes"] == sum(ddp["bytes"].values())
    assert ddp["activation_formula"].endswith(
        "d=128, f=2048, t=1, u=1: 12,544 B per token and block"
    )  # 2 (8d+2f) + 2d+f
    assert layouts["fsdp_no_reshard"]["options"] == {"reshard_after_forward": False}
    assert layouts["3d"]["degrees"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 2, "cp": 1, "ep": 1}
    plan_main([*COURSE, *JURECA])
    table = capsys.readouterr().out
    assert "recommended: ddp (8x1x1x1)" in table and "pp: not possible here: model.n_layers=4 blocks" in table
    assert "(gpt2 block, d_model 128, 4 layers, 4 heads, d_ff 2048," in table  # the model planned, its family first
    plan_main([*COURSE, *JURECA, "--set", "model.family=llama", "--set", "model.n_kv_heads=2"])
    assert "(llama block, d_model 128, 4 layers, 4 heads over 2 key/value heads, d_ff 2048," in capsys.readouterr().out


def test_a_7b_model_needs_fsdp_over_several_a100s(capsys):
    layouts = plan_json(capsys, *SEVEN_B, *JURECA)
    assert not layouts["single"]["fits"] and not layouts["ddp"]["fits"]
    assert layouts["single"]["state_bytes"] / 6.7e9 == pytest.approx(16, rel=0.01)  # 16 bytes per parameter
    assert layouts["fsdp"]["fits"] and layouts["fsdp"]["recommended"]
    plan_main([*SEVEN_B, *JURECA])
    out = capsys.readouterr().out
    assert "DDP does not fit (118.36 GB per GPU); FSDP fits over at least 8 GPUs" in out
    work = Workload(load_config(None, [arg for arg in SEVEN_B[2:] if arg != "--set"]), 32000)
    assert smallest_fsdp(work, Machine(2, 4, 40)) == 8
    assert smallest_fsdp(work, Machine(2, 4, 80)) == 2  # 53.7 GB of state + 12.9 GB each on H100s


@pytest.mark.parametrize(
    "args, message",
    [
        ([*COURSE, "--gpus-per-node", "4"], r"memory per GPU is unknown: pass --gpu-memory-gb"),
        (
            [*SEVEN_B, "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "40"],
            r"no layout fits 1 node\(s\) x 1 GPU\(s\) of 40 GB \(118.36 GB per GPU at best \(single\)\); the smallest "
            r"machine of such nodes that would hold it: \d+ nodes, with fsdp",
        ),
        (
            [*COURSE, *JURECA, "--set", "parallel.tp=8", "--set", "model.n_heads=8"],
            r"the config's layout cannot run on 2 node\(s\) x 4 GPU\(s\) of "
            r"40 GB: .*parallel.tp=8 does not divide the 4 processes of a node",
        ),
        (
            [*COURSE, *JURECA, "--set", "parallel.strategy=pp"],
            r"the config's layout 1x1x1x8 .*n_layers=4 blocks cannot fill 8",
        ),
        (["--config", "missing.yaml", *JURECA], "config file missing.yaml does not exist"),
        ([*COURSE, *JURECA, "--headroom", "1"], r"--headroom must be a share of a GPU's memory in \[0, 1\), got 1.0"),
        (
            [*COURSE, "--nodes", "0", "--gpus-per-node", "4", "--gpu-memory-gb", "40"],
            r"the machine's nodes must be at least 1 \(--nodes\), got 0",
        ),
        (["--set", "data.prepared_dir=/nonexistent", *JURECA], "prepared data not found.*Or pass --vocab-size"),
        (
            [*COURSE, *JURECA, "--matmul-tflops", "100"],
            "the step time needs --elementwise-gbps, --busbw-intra-gbps, --busbw-inter-gbps too",
        ),
        (
            [*COURSE, *JURECA, "--baseline", "/nonexistent.json"],
            "--baseline /nonexistent.json is not a machine baseline",
        ),
        ([*COURSE, *JURECA, *SPEEDS, "--elementwise-gbps", "0"], "the machine's elementwise_gbps must be positive"),
    ],
)
def test_bad_input_is_a_clear_error(capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        plan_main(args)
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def refused(capsys, args: list[str]) -> str:
    """The planner's one error line for `args` (exit status 2)."""
    with pytest.raises(SystemExit) as exit_:
        plan_main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    return err


@pytest.mark.parametrize(
    "machine, message",
    [
        (
            ["--gpus-per-node", str(10**9)],
            r"--gpus-per-node 1,000,000,000 is not one node's: a node \(one host\) holds at most 1,024 GPUs or "
            "processes here; give one node's count, and the nodes as --nodes",
        ),
        (["--gpus-per-node", "2000"], r"--gpus-per-node 2,000 is not one node's"),
        (
            ["--nodes", "40000", "--gpus-per-node", "8"],
            r"the machine's 40,000 nodes x 8 GPUs = 320,000 GPUs \(--nodes x --gpus-per-node\) exceed the 262,144 the "
            r"planner plans for \(more than the largest machines built\); give the machine the job runs on",
        ),
        (
            ["--nodes", str(10**9), "--gpus-per-node", "4"],
            r"the machine's 1,000,000,000 nodes x 4 GPUs = 4,000,000,000 GPUs \(--nodes x --gpus-per-node\) exceed",
        ),
    ],
)
def test_an_absurd_gpu_count_is_refused_by_name_not_planned(capsys, machine, message):
    """Issue 66: a node of more GPUs than any host, or a machine beyond the largest built, is refused naming the
    flags and the count, at once: not planned for minutes (or for ever) and then blamed on memory."""
    assert re.fullmatch(f"error: {message}.*\n", refused(capsys, [*COURSE, *machine, "--gpu-memory-gb", "40"]))


@pytest.mark.parametrize(
    "speeds, name, value",
    [
        (
            ["--matmul-tflops", "1e308", "--elementwise-gbps", "1e308", "--busbw-intra-gbps", "1e308"],
            "matmul_tflops",
            "1e+308",
        ),
        (
            ["--matmul-tflops", "1e-300", "--elementwise-gbps", "1000", "--busbw-intra-gbps", "80"],
            "matmul_tflops",
            "1e-300",
        ),
        (
            ["--matmul-tflops", "150", "--elementwise-gbps", "2e6", "--busbw-intra-gbps", "80"],
            "elementwise_gbps",
            "2000000.0",
        ),
        (
            ["--matmul-tflops", "150", "--elementwise-gbps", "1000", "--busbw-intra-gbps", "1e-4"],
            "busbw_intra_gbps",
            "0.0001",
        ),
    ],
)
def test_a_hand_typed_speed_outside_any_machines_range_is_refused_by_its_flag(capsys, speeds, name, value):
    """Issue 66: every speed 1e308 ended in a ZeroDivisionError traceback, a matmul rate of 1e-300 recommended a layout
    at 0 tokens/s: a speed flag outside SPEED_RANGE is refused, naming the flag, its value and the range."""
    unit = "TFLOP/s" if name == "matmul_tflops" else "GB/s"
    flag = "--" + name.replace("_", "-")
    message = rf"the machine's {name} must be positive, from 0.001 to 1,000,000 {unit} per GPU \({flag}\), got {re.escape(value)}"
    assert re.fullmatch(
        f"error: {message}\n", refused(capsys, [*COURSE, "--gpus-per-node", "4", "--gpu-memory-gb", "80", *speeds])
    )


def test_a_slow_machines_recommendation_never_shows_0_tokens_per_second(capsys):
    """Issue 66: at the slow end of the speeds' range a large model trains under a token a second: the table and the
    recommendation show it (two significant digits), not 0."""
    model = [
        "--set",
        "model.n_layers=48",
        "--set",
        "model.d_model=2048",
        "--set",
        "model.n_heads=16",
        "--vocab-size",
        "1000",
    ]
    speeds = ["--matmul-tflops", "0.001", "--elementwise-gbps", "0.001", "--busbw-intra-gbps", "0.001"]
    plan_main([*model, "--gpus-per-node", "4", "--gpu-memory-gb", "80", *speeds])
    out = capsys.readouterr().out
    shown = re.search(r"recommended: .* on this machine \(([\d.,]+);", out).group(1)
    assert 0 < float(shown) < 1, out
    chosen = next(line for line in out.splitlines() if " * " in line)
    assert chosen.split()[-1] == shown  # the table's tokens/s column


def test_a_configured_layout_is_planned_beside_the_ladder(capsys):
    layouts = plan_json(capsys, *COURSE, *JURECA, "--set", "parallel.strategy=fsdp_tp", "--set", "parallel.tp=2")
    assert layouts["configured"]["layout"] == "1x4x2x1" and layouts["configured"]["strategy"] == "fsdp_tp"


# ------------------------------------------------------------------------------------ the workflow's check
def real_matrix(tmp_path, gpu_memory_gb, check_memory=True):
    """config/config.yaml on a site of 4-GPU nodes of `gpu_memory_gb`, and prepared data of WikiText-2's vocabulary
    size."""
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"gpus_per_node": 4, "gpu_memory_gb": gpu_memory_gb}))
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config.update(site=str(site), local=None)
    config["experiments"]["single_gpu"]["check_memory"] = check_memory
    prepared = tmp_path / "prepared"
    if not prepared.exists():
        write_corpus(prepared, vocab_size=28785)
    config = apply_local_overlay(config)
    validate(config, SCHEMA)
    # not the login node's check of node counts against sinfo: the Slurm tier's cluster may be up, with 2 nodes
    return Study(config, on_login_node=False), prepared


def test_an_experiment_that_cannot_fit_the_sites_gpus_is_refused_before_the_queue(tmp_path):
    study, prepared = real_matrix(tmp_path, 40)
    single = SimpleNamespace(experiment="single_gpu", seed=1)
    study.write_plan(single, str(prepared), tmp_path / "plan.json")
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["fits"] and plan["device"] == "cuda" and plan["layout"] == "1x1x1x1" and plan["gpu_memory_gb"] == 40

    study, prepared = real_matrix(tmp_path, 4)
    with pytest.raises(
        ConfigError,
        match=r"experiment single_gpu \(1 x 1 GPUs, layout 1x1x1x1\) does not fit the "
        r"site's GPUs of 4 GB: scalelm.plan predicts 6.65 GB per GPU \(params 0.04, grads 0.04, "
        r"optimizer 0.08, activations 6.49, buffers 0.00\) against 3.60 GB usable.*"
        r"experiments.single_gpu.check_memory: false",
    ):
        study.write_plan(single, str(prepared), tmp_path / "refused.json")
    assert not (tmp_path / "refused.json").exists()
    # the 3D experiment's 16 GPUs hold the same model in far less
    study.write_plan(SimpleNamespace(experiment="3d", seed=1), str(prepared), tmp_path / "3d.json")

    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["experiments"]["single_gpu"]["check_memory"] = "no"  # the package's own check, behind the schema's
    with pytest.raises(ConfigError, match="experiments.single_gpu.check_memory: expected true or false, got 'no'"):
        load_matrix(load_study(config))

    study, prepared = real_matrix(tmp_path, 4, check_memory=False)
    study.write_plan(single, str(prepared), tmp_path / "anyway.json")
    assert json.loads((tmp_path / "anyway.json").read_text())["fits"] is False


def test_an_experiment_too_large_for_this_machines_memory_is_refused_on_the_local_default(tmp_path, monkeypatch):
    """Issue 49: the plan checked GPU sites only, and on the local default a mixture too large for the machine's
    memory failed at allocation with a traceback. There every process runs on this machine: the plan's fullest rank
    and a process's runtime, times the processes, against 90 % of its memory, refused before the queue naming the
    experiment, the figures and what to change. A cluster's CPU nodes (a site file) are not this machine."""
    moe = load_config(None, ["model.n_layers=4", "model.moe={experts: 64, d_ff: 4096}", "parallel.strategy=ddp"])
    large = Experiment("moe", "ddp", 1, 2, 1, moe, resolve_layout(moe, 2, 2))
    plan = plan_experiment(large, SiteConfig(), 28785, host_bytes=12 * 2**30)
    per_process = (plan["total_bytes"] + plan_check.PROCESS_RUNTIME_BYTES) / 2**30
    assert plan["device"] == "cpu" and plan["fits"] is False and plan["host_processes"] == 2 and per_process > 6
    with pytest.raises(
        ConfigError,
        match=rf"experiment moe \(1 x 2 = 2 processes on this machine, layout 2x1x1x1\) does not fit its memory of "
        rf"12.0 GiB: scalelm.plan predicts {per_process:,.2f} GiB per process \(params [\d.]+, .*, the interpreter and "
        rf"torch 0.29\) x 2 = {2 * per_process:,.2f} GiB against 10.8 GiB usable \(10% left to the system\)\. "
        r"Shard more .*experiments.moe.check_memory: false to run it anyway",
    ):
        check_fits(large, plan)
    check_fits(large, plan, check=False)  # check_memory: false
    assert plan_experiment(large, SiteConfig(), 28785, host_bytes=2**40)["fits"]
    assert plan_experiment(large, SiteConfig(), 28785)["fits"] is None  # a cluster's CPU nodes: not this machine

    # the rule on the local default plans against this machine; a site's GPUs as before
    study, prepared = Study(local_config()), tmp_path / "prepared"
    write_corpus(prepared, vocab_size=28785)
    ddp = SimpleNamespace(experiment="ddp", seed=1)
    study.write_plan(ddp, str(prepared), tmp_path / "plan.json")
    written = json.loads((tmp_path / "plan.json").read_text())
    assert written["fits"] and written["host_memory_bytes"] == plan_check.host_memory_bytes()
    monkeypatch.setattr(plan_check, "host_memory_bytes", lambda: 2**29)  # 512 MiB: two processes' runtime is more
    with pytest.raises(ConfigError, match="experiment ddp .* does not fit its memory of 0.5 GiB"):
        study.write_plan(ddp, str(prepared), tmp_path / "refused.json")
    assert not (tmp_path / "refused.json").exists()


def test_the_wiring_check_runs_each_layout_against_one_process_and_names_a_mismatch(tmp_path):
    study, _ = real_matrix(tmp_path, 40)
    runs = study.preflight
    assert runs["reference.0"]["world_size"] == 1 and runs["3d"]["world_size"] == 16
    batch = runs["3d"]["settings"]["batch"]["size"]
    assert batch == 8 == preflight.preflight_batch(list(study.matrix.values()))  # 3d: dp 2 x m 4; ddp 8; pp m 8
    three = runs["3d"]["settings"]
    assert {k: three["parallel"][k] for k in ("dp_replicate", "dp_shard", "tp", "pp")} == {
        "dp_replicate": 1,
        "dp_shard": 2,
        "tp": 4,
        "pp": 2,
    }
    assert "strategy" not in three["parallel"]  # explicit degrees: all its processes on one node
    assert three["model"]["dropout"] == 0.0 and three["device"] == "cpu" and three["train"]["max_steps"] == 3
    # a wider model (cp_long), another engine (ddp_lightning) and a mixture of experts: references of their own;
    # cp_long's 8192-token sequences checked at 64 (8 chunks of 8 for cp 4), the others at their 32
    mixtures = {e.name for e in study.matrix.values() if e.config.model.moe and e.name in runs}
    apart = {"cp_long", "ddp_lightning"} | mixtures
    assert len({runs[name]["reference"] for name in apart} | {"reference.0"}) == len(apart) + 1
    long_reference = runs[runs["cp_long"]["reference"]]
    assert runs["cp_long"]["settings"]["data"]["seq_len"] == long_reference["settings"]["data"]["seq_len"] == 64
    assert runs["3d"]["settings"]["data"]["seq_len"] == 32
    others = {run["reference"] for name, run in runs.items() if not name.startswith("reference.") and name not in apart}
    assert others == {"reference.0"}
    assert "single_gpu" not in runs and "gpt2_small" not in runs  # one process: no wiring to check
    # an experiment that trains with other settings gets a single process of its own to compare with
    faster = lambda e: replace(e, config=replace(e.config, optim=replace(e.config.optim, lr=1e-3)))
    other = [faster(e) if e.name == "ddp" else e for e in study.matrix.values()]
    again = preflight.preflight_runs(other, "results")
    own, shared = again["ddp"]["reference"], again["fsdp"]["reference"]
    assert own != shared and {own, shared} == {"reference.0", "reference.1"}
    assert again[own]["settings"]["optim"]["lr"] == 1e-3 and again[own]["world_size"] == 1

    def fake_run(name, losses):
        run = tmp_path / name
        run.mkdir()
        lines = [{"kind": "train", "step": step, "loss": x} for step, x in enumerate(losses, 1)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        results = Results("ddp", "2x1x1x1", len(losses), 2, 64, 1.0, losses[-1], {}, {}, 1000)
        write_record(run, RunRecord({}, 2, {"nodes": 1, "procs_per_node": 2}, ["n1"], "", "", 1.0, results))
        return run

    reference = fake_run("reference", [5.0, 4.0, 3.0])
    good, bad = fake_run("good", [5.0, 4.0000001, 3.0]), fake_run("bad", [5.0, 4.1, 3.0])
    assert preflight.compare({"good": (good, reference)}, tmp_path / "ok.csv")[0]["matches"]
    with pytest.raises(
        preflight.PreflightError, match=r"the loss of bad \(layout 2x1x1x1: 3 steps, largest gap 2.50e-02\)"
    ):
        preflight.compare({"good": (good, reference), "bad": (bad, reference)}, tmp_path / "out.csv")


def test_bf16_params_plans_fsdps_bf16_copies_and_the_chunked_loss_its_gradients_and_one_chunk():
    """Issue 50: train.precision=bf16_params in one process is FSDP on a mesh of one rank, which keeps every unit's
    bf16 weights from forward to backward (2 bytes a parameter) and holds a unit's gradients in bf16 and fp32 (6
    bytes a parameter of the largest unit, the head's), beyond bf16 autocast's plan, to the byte; resharding after
    the forward keeps two units' instead. train.fused_loss=chunked keeps the loss's fp32 gradients in place of the
    log-probabilities and logits, and holds one chunk's fp32 logits, exponentials and bf16 gradient at a time."""
    vocab, d, tokens = 1000, 32, 8 * 16
    shape = ["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "data.seq_len=16", "batch.size=8"]

    def plan(*changes: str):
        return plan_memory(Workload(load_config(None, [*shape, *changes]), vocab), ParallelDims())

    autocast, one_rank_fsdp = plan("train.precision=bf16"), plan("train.precision=bf16_params")
    params = count_parameters(TransformerLM(load_config(None, shape).model, vocab))
    head = vocab * d + vocab
    assert one_rank_fsdp.state == autocast.state and one_rank_fsdp.bytes["activations"] == autocast.bytes["activations"]
    assert one_rank_fsdp.bytes["buffers"] - autocast.bytes["buffers"] == 2 * params + 6 * head
    resharded = plan("train.precision=bf16_params", "parallel.reshard_after_forward=true")
    assert resharded.bytes["buffers"] - autocast.bytes["buffers"] == 2 * 2 * head + 6 * head

    chunked = plan("train.precision=bf16", "train.fused_loss=chunked")
    logits = tokens * 4 * vocab + tokens * 8 * vocab  # the log-probabilities, and the backward's two fp32 gradients
    gradients = 4 * (tokens * d + vocab * (d + 1))
    assert autocast.bytes["activations"] - chunked.bytes["activations"] == logits - gradients
    assert chunked.bytes["buffers"] - autocast.bytes["buffers"] == vocab * (tokens * (8 + 2) + 4 * d)
    cpu = {
        path: plan_memory(
            Workload(load_config(None, [*shape, f"train.fused_loss={path}"]), vocab, "cpu"), ParallelDims()
        )
        for path in ("auto", "chunked", "plain")
    }
    assert cpu["auto"].bytes == cpu["chunked"].bytes != cpu["plain"].bytes  # fp32 on a CPU: its own fused loss


def test_gpt2_small_accum_steps_a_quarter_million_tokens_through_gpt2_smalls_micro_batches():
    """Issue 50: gpt2_small_accum is gpt2_small's model, data and optimizer at 256 sequences of 1,024 tokens per
    optimizer step (262,144 tokens, as llm.c and nanoGPT measure MFU), accumulated in gpt2_small's micro-batches of
    32: the same plan per GPU."""
    experiments = yaml.safe_load((REPO / "config" / "config.yaml").read_text())["experiments"]
    small, accum = (from_dict(experiments[name]["training"]) for name in ("gpt2_small", "gpt2_small_accum"))
    assert (accum.model, accum.data, accum.optim) == (small.model, small.data, small.optim)
    assert accum.batch.sizes(1) == (256, small.batch.sizes(1)[1]) == (256, 32)
    assert 256 * accum.data.seq_len >= 250_000 and accum.train.compile
    planned = [plan_memory(Workload(config, vocab_size=33278), ParallelDims()).bytes for config in (small, accum)]
    assert planned[0] == planned[1]


def test_llama_small_is_gpt2_smalls_workload_with_todays_block_and_the_plan_counts_it():
    """Issue 70: llama_small trains gpt2_small's data, batch and optimizer on one GPU, with the llama block of GPT-2
    small's width and depth: its FFN as many parameters (SwiGLU's three matrices of 8/3 d), fewer for attention
    (4 key/value heads for 12 query heads) and none for biases, no positional table; the plan counts those (as
    built), and MFU's FLOPs with them."""
    experiments = yaml.safe_load((REPO / "config" / "config.yaml").read_text())["experiments"]
    small, llama = (from_dict(experiments[name]["training"]) for name in ("gpt2_small", "llama_small"))
    assert (llama.data, llama.batch, llama.optim, llama.train) == (small.data, small.batch, small.optim, small.train)
    assert experiments["llama_small"]["procs_per_node"] == experiments["gpt2_small"]["procs_per_node"] == 1
    assert llama.model.family == "llama" and llama.model.kv_heads == 4
    vocab, d = 33278, 768
    counts = {
        name: parameter_counts(config.model, vocab)["total"] for name, config in (("gpt2", small), ("llama", llama))
    }
    with torch.device("meta"):
        assert counts["llama"] == count_parameters(TransformerLM(llama.model, vocab))
    attention_saved = 12 * (2 * d * d - 2 * 4 * 64 * d)  # keys and values of 4 heads, not 12
    biases = 12 * (3 * d + d + 3072 + d + 2 * d) + d + vocab  # linears', LayerNorms', head's (the FFNs' weights equal)
    assert counts["gpt2"] - counts["llama"] == attention_saved + biases
    flops = {name: flops_per_token(config.model, vocab, 1024) for name, config in (("gpt2", small), ("llama", llama))}
    assert flops["gpt2"] - flops["llama"] == 6 * attention_saved
    plans = {name: plan_memory(Workload(c, vocab), ParallelDims()) for name, c in (("gpt2", small), ("llama", llama))}
    assert plans["llama"].state == 16 * counts["llama"] and plans["llama"].total < 40e9  # an A100 of 40 GB


def test_the_llama_blocks_planned_activations_are_the_tensors_it_keeps_on_the_cpu():
    """The llama block's formula (scalelm.plan.memory: RMSNorm's inputs and normalised copies, the rotated queries
    and keys, the qkv output its values are a view of, SwiGLU's four hidden activations) against the bytes of the
    tensors its forward keeps for the backward, fp32 on the CPU without dropout: within 1% (the rest: a few numbers
    per row, the rotation's cos and sin)."""
    config = load_config(
        None,
        ["model.d_model=256", "model.n_heads=8", "model.n_layers=1", "data.seq_len=64"]
        + ["model.family=llama", "model.n_kv_heads=2", "model.d_ff=1344", "model.dropout=0.0"],
    )
    model = TransformerLM(config.model, 100)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.blocks["0"](torch.randn(4, 64, 256, requires_grad=True))
    planned, formula = block_bytes_per_token(Workload(config, 100, "cpu"), ParallelDims())
    assert sum(kept.values()) / (4 * 64) == pytest.approx(planned, rel=0.01)
    assert formula.startswith("e (2d + 4d/u + (3d + 3h + 4f)/t)")
