"""End-to-end training on CPU with gloo: parity across layouts, determinism, resume, checkpoints across layouts."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import drills
from conftest import board_scalars, run_dir_of, run_train, train_command, train_here, train_losses
from scalelm.config import load_config
from scalelm.data.prepared import load_prepared
from scalelm.errors import EXIT_PREEMPTED
from scalelm.model.moe import mixtures
from scalelm.model.transformer import TransformerLM, count_parameters
from scalelm.train.checkpoint import complete_checkpoints
from scalelm.train.consolidate import consolidate, load_consolidated
from scalelm.train.record import read_metrics
from scalelm.train.rundir import RunDir


def relative_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


MOE = {"model__moe": {"experts": 4, "top_k": 2}}
# the auxiliary-loss-free balance and the router z-loss, on the layouts of the mixture's TP and pipeline
BIASED = {"model__moe": {"experts": 4, "top_k": 2, "balance": "bias", "bias_rate": 0.01, "z_loss_coef": 0.001}}
# model.family llama: 4 query heads over 2 key/value heads (grouped-query attention; tp 2 divides both)
LLAMA = {"model__family": "llama", "model__n_heads": 4, "model__n_kv_heads": 2}
IN_PROCESS = (
    "single",
    "accumulate",
    "moe",
    "moe_bias",
    "llama",
    "llama_moe",
)  # trained in this process: no interpreter or torch start-up
TORCHRUN = ("fsdp_tp",)  # the real launcher for one layout; the rest are forked from a preloaded server (forked.py)
# target: source. The target resumes from the source's step-10 checkpoint and trains steps 11-20 in its own layout (the
# loaded optimizer state, data position and RNG trained on); every other layout trains steps 1-20. A target named
# "<source>_into_<layout>" is an extra one-process run in this process.
RESUMES_FROM = {
    "tp": "fsdp",
    "ddp": "fsdp_tp",
    "fsdp_pp": "hsdp",
    "pp_gpipe": "single",
    "pp_into_single": "pp",
    "cp_tp": "fsdp_tp_sp",
    "tp_pp": "cp",
    "cp_pp": "pp",
    "hsdp_cp": "fsdp_cp",
    "hsdp_ep": "ep",
    "ep_pp": "ep_tp",
    "fsdp_ep_into_moe": "fsdp_ep",
    "llama_tp_pp": "llama_cp_tp",
    "llama_ddp": "llama",
}


def layout_of(name: str) -> str:
    return name.split("_into_")[1] if "_into_" in name else name


def reference_of(name: str) -> str:
    """The one-process run a layout must match: the mixture of its settings, or the dense model, of its family."""
    settings = LAYOUTS[layout_of(name)][1]
    moe = settings.get("model__moe")
    if settings.get("model__family") == "llama":
        return "llama" if moe is None else "llama_moe"
    if moe is None:
        return "single"
    return "moe_bias" if moe.get("balance") == "bias" else "moe"


# name: (nproc, settings); TINY has 2 heads and an FFN of 64: tp 2 divides both
LAYOUTS = {
    "single": (1, {}),
    "accumulate": (1, {"batch__micro_size": 4}),
    "ddp": (2, {"parallel__strategy": "ddp"}),
    "fsdp": (2, {"parallel__strategy": "fsdp"}),
    "hsdp": (4, {"parallel__dp_replicate": 2, "parallel__dp_shard": 2}),
    "tp": (2, {"parallel__strategy": "tp", "parallel__loss_parallel": True}),  # without SP: fsdp_tp_sp has both
    "fsdp_tp": (4, {"parallel__strategy": "fsdp", "parallel__tp": 2}),
    "fsdp_tp_sp": (
        4,
        {
            "parallel__strategy": "fsdp",
            "parallel__tp": 2,
            "parallel__sequence_parallel": True,
            "parallel__loss_parallel": True,
        },
    ),
    # pipelines of TINY's two blocks, one per stage, 4 micro-batches (2 x pp)
    "pp": (2, {"parallel__pp": 2}),
    "pp_gpipe": (2, {"parallel__pp": 2, "parallel__pp_schedule": "gpipe"}),
    "fsdp_pp": (4, {"parallel__pp": 2, "parallel__dp_shard": 2}),
    "tp_pp": (
        4,
        {"parallel__pp": 2, "parallel__tp": 2, "parallel__sequence_parallel": True, "parallel__loss_parallel": True},
    ),
    # context parallelism: each sequence of 16 split in 2 contiguous parts, or in 4 chunks (2 per rank, balanced)
    "cp": (2, {"parallel__cp": 2, "parallel__cp_load_balance": False}),
    "fsdp_cp": (4, {"parallel__dp_shard": 2, "parallel__cp": 2}),
    "cp_tp": (
        4,
        {"parallel__cp": 2, "parallel__tp": 2, "parallel__sequence_parallel": True, "parallel__loss_parallel": True},
    ),
    "cp_pp": (4, {"parallel__cp": 2, "parallel__pp": 2}),
    "hsdp_cp": (4, {"parallel__dp_replicate": 2, "parallel__cp": 2}),
    # a mixture of 4 experts, top 2, in both blocks: one process, the experts split over 2 ranks (ep, FSDP over the
    # dense parts), over pairs of 4 shards (each block recomputed in the backward: selective activation
    # checkpointing, under which a mixture still counts its load once), over the 2 shards of each of 2 replicas,
    # with TP 2 (SP and loss parallel: the mixture gathers the sequence), and with a pipeline of 2 stages
    "moe": (1, MOE),
    "moe_bias": (1, BIASED),
    "ep": (2, {**MOE, "parallel__strategy": "ep"}),
    "fsdp_ep": (4, {**MOE, "parallel__dp_shard": 4, "parallel__ep": 2, "train__activation_checkpointing": "selective"}),
    "hsdp_ep": (4, {**MOE, "parallel__dp_replicate": 2, "parallel__dp_shard": 2, "parallel__ep": 2}),
    "ep_tp": (
        4,
        {
            **BIASED,
            "parallel__ep": 2,
            "parallel__tp": 2,
            "parallel__dp_shard": 2,
            "parallel__sequence_parallel": True,
            "parallel__loss_parallel": True,
        },
    ),
    "ep_pp": (4, {**BIASED, "parallel__ep": 2, "parallel__dp_shard": 2, "parallel__pp": 2}),
    # the llama block (a layout group each): one process, whose checkpoint DDP resumes; HSDP 2x2, each block
    # recomputed (selective); load-balanced CP x TP with SP and loss parallelism (rotary positions at each rank's
    # tokens' true places), whose checkpoint a pipeline with TP resumes; its SwiGLU experts over ep 2 x TP 2 with full
    # activation checkpointing. FSDP x TP x PP: the 3D test below.
    "llama": (1, LLAMA),
    "llama_ddp": (2, {**LLAMA, "parallel__strategy": "ddp"}),
    "llama_hsdp": (
        4,
        {**LLAMA, "parallel__dp_replicate": 2, "parallel__dp_shard": 2, "train__activation_checkpointing": "selective"},
    ),
    "llama_cp_tp": (
        4,
        {
            **LLAMA,
            "parallel__cp": 2,
            "parallel__tp": 2,
            "parallel__sequence_parallel": True,
            "parallel__loss_parallel": True,
        },
    ),
    "llama_tp_pp": (4, {**LLAMA, "parallel__pp": 2, "parallel__tp": 2, "parallel__loss_parallel": True}),
    "llama_moe": (1, {**LLAMA, **MOE}),
    "llama_ep_tp": (
        4,
        {
            **LLAMA,
            **MOE,
            "parallel__ep": 2,
            "parallel__tp": 2,
            "parallel__dp_shard": 2,
            "parallel__sequence_parallel": True,
            "train__activation_checkpointing": "full",
        },
    ),
}


@pytest.mark.slow
def test_every_layout_trains_like_one_process_and_its_checkpoints_load_into_the_others(tiny_config, tmp_path):
    """Same model, same data, global batch 16: one process, 4-way accumulation, DDP, FSDP, HSDP 2x2, TP 2 with the
    vocabulary-parallel loss, FSDP x TP 2x2 (with and without sequence and loss parallelism), pipelines of 2 stages
    (1F1B, GPipe, with FSDP 2 and with TP 2), context parallelism 2 (alone with contiguous parts, and load-balanced
    with FSDP 2, with TP 2, with a pipeline of 2 and with 2 replicas) give the same loss at every step and the same
    exact evaluation; so do a mixture of experts' layouts against its one process (expert parallelism 2 alone, with
    FSDP 4, HSDP 2x2, TP 2 and a pipeline of 2), and the llama block's against its own (DDP, HSDP 2x2, CP x TP
    load-balanced with SP, TP x PP, its SwiGLU experts over ep x TP). Half the layouts start from another layout's
    step-10 checkpoint (RESUMES_FROM) and match one process over steps 11-20: checkpoints load across layouts and
    train on."""
    runs = [*(name for name in LAYOUTS if name not in RESUMES_FROM), *RESUMES_FROM]  # sources first
    configs = {name: tiny_config(name, **LAYOUTS[layout_of(name)][1]) for name in runs}
    losses, evals, records = {}, {}, {}
    for name in runs:
        nproc = LAYOUTS[layout_of(name)][0]
        if name in RESUMES_FROM:
            checkpoint = run_dir_of(configs[RESUMES_FROM[name]]) / "checkpoints" / "step_00000010"
            shutil.copytree(checkpoint, run_dir_of(configs[name]) / "checkpoints" / checkpoint.name)
        if layout_of(name) in IN_PROCESS:
            train_here(configs[name])
        else:
            launcher = "torchrun" if name in TORCHRUN else "forked"
            out = run_train(configs[name], nproc, launcher=launcher).stdout
            assert ("resumed from step 10" in out) == (name in RESUMES_FROM), name
        losses[name] = train_losses(run_dir_of(configs[name]))
        evals[name] = [r for r in read_metrics(run_dir_of(configs[name])) if r["kind"] == "eval"]
        records[name] = json.loads((run_dir_of(configs[name]) / "run.json").read_text())
    assert len(losses["single"]) == 20
    assert losses["single"][-1] < losses["single"][0] - 0.5 and losses["moe"][-1] < losses["moe"][0] - 0.5  # it learns
    for name in runs:  # a resumed layout: steps 11-20
        reference = reference_of(name)
        assert relative_gap(losses[name], losses[reference][-len(losses[name]) :]) <= 1e-5, name
        assert len(losses[name]) == (10 if name in RESUMES_FROM else 20), name
        for mine, ref in zip(evals[name], evals[reference], strict=True):  # every token counted once
            assert mine["tokens"] == ref["tokens"]
            assert abs(mine["loss"] - ref["loss"]) / ref["loss"] <= 1e-5, name
    assert records["hsdp"]["parallel"]["groups"] == {
        "tp": [[0], [1], [2], [3]],
        "dp": [[0, 1, 2, 3]],
        "pp": [[0], [1], [2], [3]],
        "cp": [[0], [1], [2], [3]],
    }
    assert records["fsdp_tp"]["results"]["layout"] == "1x2x2x1"
    assert records["fsdp_tp"]["parallel"]["groups"] == {
        "tp": [[0, 1], [2, 3]],
        "dp": [[0, 2], [1, 3]],
        "pp": [[0], [1], [2], [3]],
        "cp": [[0], [1], [2], [3]],
    }
    assert records["fsdp_cp"]["results"]["layout"] == "1x2x1x1x2"
    assert records["fsdp_cp"]["parallel"]["groups"]["cp"] == [[0, 1], [2, 3]]  # cp inside dp_shard, outside tp
    assert records["fsdp_cp"]["parallel"]["groups"]["dp"] == [[0, 2], [1, 3]]
    assert records["cp_tp"]["parallel"]["groups"]["cp"] == [[0, 2], [1, 3]]
    # the collectives each layout is made of, timed on two steps after the warm-up
    comm = {name: record["results"]["comm"] for name, record in records.items()}
    assert comm["single"]["share"] == 0.0 and comm["accumulate"]["share"] == 0.0
    assert set(comm["ddp"]["ops_s_per_step_rank0"]) == {"gloo:all_reduce"}
    assert {"gloo:all_gather", "gloo:all_reduce"} <= set(comm["fsdp"]["ops_s_per_step_rank0"])
    assert "gloo:all_reduce" in comm["tp"]["ops_s_per_step_rank0"]
    assert all(0 < c["share"] <= 1 for name, c in comm.items() if LAYOUTS[layout_of(name)][0] > 1)
    # the exact state bytes: a single process (and each DDP rank) holds every parameter, its gradient and AdamW's
    # two moments in fp32; an FSDP rank half of them
    settings = load_config(configs["single"])
    parameters = count_parameters(TransformerLM(settings.model, load_prepared(settings.data.prepared_dir).vocab_size))
    state = {name: records[name]["results"]["state_mb_per_rank"]["total"] for name in ("single", "ddp", "fsdp")}
    assert state["single"] == pytest.approx(parameters * 4 * 4 / 2**20, rel=1e-12) and state["ddp"] == state["single"]
    assert state["fsdp"] == pytest.approx(state["single"] / 2, rel=0.01)
    # scalelm.plan's state bytes, from the shapes alone, against those measured on every layout
    for name, record in records.items():
        planned, measured = record["results"]["plan_mb_per_rank"], record["results"]["state_mb_per_rank"]
        assert planned["state"] == pytest.approx(measured["total"], rel=0.05), name
        assert planned["total"] > planned["state"] and planned["activations"] > 0, name
    # a pipeline: its groups, the bubble its schedule predicts beside the one measured, one step's timeline
    assert records["fsdp_pp"]["parallel"]["groups"]["pp"] == [[0, 2], [1, 3]]
    for name in ("pp", "pp_gpipe", "fsdp_pp", "tp_pp"):
        pipeline = records[name]["results"]["pipeline"]
        assert pipeline["predicted_bubble"] == pytest.approx(1 / 5)  # (pp - 1) / (m + pp - 1), m = 4
        assert 0 < pipeline["measured_bubble"] < 1 and pipeline["timed_steps"] == list(
            range(13, 19)
        )  # 19, 20: profiled
        assert all(mb > 0 for mb in pipeline["peak_mem_mb_per_pp_rank"])
        pp_rank = {rank: group.index(rank) for group in records[name]["parallel"]["groups"]["pp"] for rank in group}
        for rank in pipeline["timeline"]:  # every micro-batch forward and backward once, in the rank's own stage
            work = sorted((c["kind"], c["mb"]) for c in rank["chunks"] if c["kind"] != "L")
            assert work == sorted((kind, mb) for kind in "BF" for mb in range(4))
            assert {c["stage"] for c in rank["chunks"]} == set(pipeline["stages_of_pp_rank"][pp_rank[rank["rank"]]])
            assert all(0 <= c["start"] <= c["end"] <= rank["span_s"] for c in rank["chunks"])
    first_stage = lambda name: "".join(c["kind"] for c in records[name]["results"]["pipeline"]["timeline"][0]["chunks"])
    assert first_stage("pp_gpipe") == "FFFFBBBB" and first_stage("pp") == "FFBFBFBB"  # 1F1B: 2 in flight at most
    # the pipeline's point-to-point traffic is part of its communication
    assert {"gloo:send", "gloo:recv"} <= set(comm["pp"]["ops_s_per_step_rank0"])
    for name in ("cp", "fsdp_cp", "cp_tp"):  # the ring's key/value blocks, FSDP's gathers over dp_shard x cp
        assert {"gloo:send", "gloo:recv", "gloo:all_gather"} <= set(comm[name]["ops_s_per_step_rank0"]), name
    # a mixture: its aux loss and load balance logged on every line, alike in every layout (the pipeline's included),
    # the experts' token shares over the run; its tokens sent by all-to-all, counted apart; a dense run has none
    moe_layouts = [name for name, (_, settings) in LAYOUTS.items() if "model__moe" in settings]
    lines = {name: [r for r in read_metrics(run_dir_of(configs[name])) if r["kind"] == "train"] for name in moe_layouts}
    experts = {name: records[name]["results"]["experts"] for name in moe_layouts}
    for name in moe_layouts:  # (each layer's MaxVio as max / mean, which is never 0)
        for key, shift in (
            ("aux_loss", 0),
            ("expert_load_max_over_mean", 0),
            ("expert_max_vio_0", 1),
            ("expert_max_vio_1", 1),
        ):
            reference = [r[key] + shift for r in lines[reference_of(name)]][-len(lines[name]) :]
            assert relative_gap([r[key] + shift for r in lines[name]], reference) <= 1e-5, (name, key)
        if name not in RESUMES_FROM:  # the shares of the run's own steps
            share = experts[reference_of(name)]["expert_token_share"]
            assert experts[name]["expert_token_share"] == pytest.approx(share, rel=1e-6)
    assert sum(experts["moe"]["expert_token_share"]) == pytest.approx(1.0)
    assert all(1 <= r["expert_load_max_over_mean"] <= 4 / 2 for r in lines["moe"])  # experts / top_k at worst
    assert experts["moe"]["expert_max_vio_end"].keys() == {"0", "1"}
    assert {experts[name]["product"] for name in moe_layouts} == {"grouped_mm"}  # torch 2.9+ groups on the CPU
    balance = {name: [r["expert_load_max_over_mean"] for r in lines[name]] for name in ("moe", "moe_bias")}
    assert balance["moe_bias"] != balance["moe"]  # the bias routes otherwise (its mechanics: tests/test_model.py)
    parameters = records["moe"]["results"]["parameters"]
    assert parameters["active"] < parameters["total"]
    dense = [r for r in read_metrics(run_dir_of(configs["single"])) if r["kind"] == "train"]
    assert not any("aux_loss" in r for r in dense) and records["single"]["results"]["experts"] is None
    for name in ("ep", "fsdp_ep", "hsdp_ep", "ep_tp", "ep_pp"):
        assert "gloo:all_to_all" in comm[name]["ops_s_per_step_rank0"], name
        assert 0 < comm[name]["all_to_all_share"] <= comm[name]["share"], name
    # an ep run's sharded checkpoint consolidated into one model file, which loads as one process's mixture
    meta = consolidate(RunDir(run_dir_of(configs["ep"])), tmp_path / "ep.pt")
    model, info = load_consolidated(Path(meta["model"]))
    assert info["step"] == 20 and [i for i, moe in mixtures(model).items() if moe.experts.up_weight.shape[0] == 4] == [
        0,
        1,
    ]


@pytest.mark.slow
def test_an_interleaved_pipeline_and_3d_train_like_one_process(tiny_config):
    """Four blocks. Interleaved 1F1B on 2 ranks of 2 virtual stages each (rank 0 holds blocks 0 and 2) over 20 steps,
    and 3D (pp 2 x dp_shard 2 x tp 2, eight ranks) over 4 steps, give the single process's losses; so does the llama
    block's 3D against its own single process (in this process, 4 steps)."""
    four = {"model__n_layers": 4}
    single = tiny_config("single4", **four)
    interleaved = tiny_config(
        "interleaved", **four, parallel__pp=2, parallel__pp_schedule="interleaved_1f1b", parallel__pp_virtual_stages=2
    )
    three_d = tiny_config("3d", **four, parallel__pp=2, parallel__dp_shard=2, parallel__tp=2, train__max_steps=4)
    llama_single = tiny_config("llama_single4", **four, **LLAMA, train__max_steps=4)
    llama_3d = tiny_config(
        "llama_3d", **four, **LLAMA, parallel__pp=2, parallel__dp_shard=2, parallel__tp=2, train__max_steps=4
    )
    for config, nproc in ((single, 1), (interleaved, 2), (three_d, 8), (llama_3d, 8)):
        run_train(config, nproc, timeout=240)
    train_here(llama_single)
    reference = train_losses(run_dir_of(single))
    assert relative_gap(train_losses(run_dir_of(interleaved)), reference) <= 1e-5
    assert relative_gap(train_losses(run_dir_of(three_d)), reference[:4]) <= 1e-5
    assert relative_gap(train_losses(run_dir_of(llama_3d)), train_losses(run_dir_of(llama_single))) <= 1e-5
    record = json.loads((run_dir_of(interleaved) / "run.json").read_text())
    pipeline = record["results"]["pipeline"]
    assert pipeline["stages_of_pp_rank"] == [[0, 2], [1, 3]] and pipeline["predicted_bubble"] == pytest.approx(1 / 9)
    assert {c["stage"] for c in pipeline["timeline"][0]["chunks"]} == {0, 2}
    three = json.loads((run_dir_of(three_d) / "run.json").read_text())
    assert three["results"]["layout"] == "1x2x2x2" and three["results"]["strategy"] == "fsdp_tp_pp"
    assert three["parallel"]["groups"]["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert three["parallel"]["groups"]["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_same_seed_same_metrics_other_seed_other_metrics(tiny_config):
    a, b, c = tiny_config("a", model__dropout=0.1), tiny_config("b", model__dropout=0.1), tiny_config("c", seed=2)
    for config in (a, b, c):
        train_here(config, "train.max_steps=8")
    assert train_losses(run_dir_of(a)) == train_losses(run_dir_of(b))
    assert train_losses(run_dir_of(a)) != train_losses(run_dir_of(c))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["single", "ddp_spawn", "tp", "cp_tp", "pp", "llama_cp_tp"])
def test_interrupted_and_resumed_equals_uninterrupted_bitwise(tiny_config, tmp_path, layout):
    """Dropout on, mid-epoch interruption; the resumed run restores weights, optimizer, schedule, data position, RNG
    (under TP alone: the masks a TP group shares on its replicated activations and its ranks' own on their heads and
    FFN columns; under CP x TP with SP: those on each rank's part of the sequence too, and the ring attention's masks,
    from the seed its group shares; and the llama block's under CP x TP, its rotary positions and grouped key and
    value heads split). The most sharded checkpoint, a mixture's under expert parallelism, is stopped ten times in
    tests/test_faults.py. The straight run is forked (tests/forked.py); the interrupted and resumed one is started by
    torchrun, or for ddp_spawn by `scalelm.launch --launcher spawn` (torch.multiprocessing.spawn, the stop signal
    passed on by the supervisor and the spawning process)."""
    nproc, layout_settings = LAYOUTS[layout.removesuffix("_spawn")]
    settings = dict(model__dropout=0.1, optim__schedule="cosine", optim__warmup_steps=3, **layout_settings)
    straight, broken = tiny_config("straight", **settings), tiny_config("broken", **settings)
    run_train(straight, nproc)
    command = train_command(broken, nproc)
    if layout.endswith("_spawn"):
        command = [
            sys.executable,
            "-m",
            "scalelm.launch",
            "--launcher",
            "spawn",
            "--procs-per-node",
            str(nproc),
            "--",
            "--config",
            str(broken),
        ]
    status, stderr = drills.interrupt_after_step(command, run_dir_of(broken), step=6)
    # torchrun forwards SIGTERM to its workers, which checkpoint and exit 75; torchrun itself then reports failure
    assert status == EXIT_PREEMPTED if nproc == 1 or "_spawn" in layout else status != 0, (status, stderr[-2000:])
    assert "stopped by a signal" in stderr
    assert not (run_dir_of(broken) / "run.json").exists()
    resumed = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert resumed.returncode == 0 and "resumed from step" in resumed.stdout, resumed.stderr[-3000:]
    a, b = drills.final_weights(straight, tmp_path / "a.pt"), drills.final_weights(broken, tmp_path / "b.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert train_losses(run_dir_of(broken)) == train_losses(run_dir_of(straight))
    # TensorBoard holds every logged step once, across the interruption (fp32 events: 1e-6 of the loss)
    logged = [(r["step"], r["loss"]) for r in read_metrics(run_dir_of(broken)) if r["kind"] == "train"]
    board = board_scalars(run_dir_of(broken), "train/loss")
    assert [step for step, _ in board] == [step for step, _ in logged]
    assert all(abs(a - b) <= 1e-6 * abs(b) for (_, a), (_, b) in zip(board, logged))


@pytest.mark.parametrize(
    "overrides, nproc, message",
    [
        (["parallel.strategy=pipeline"], 1, "unknown strategy 'pipeline'"),
        (
            ["batch.size=15", "parallel.strategy=ddp"],
            2,
            "] global batch of 15 sequences is not divisible by the 2 data-parallel ranks",
        ),
        (
            ["parallel.dp_shard=2", "parallel.tp=2"],
            2,
            "] parallel: dp_replicate 1 x dp_shard 2 x tp 2 x pp 1 = 4 processes, but the world size is 2",
        ),
        (["data.prepared_dir=/nonexistent/prepared"], 1, "prepared data not found"),
        (["train.epoch=3"], 1, "unknown setting 'train.epoch'; did you mean 'train.epochs'"),
        ([], 2, "started with WORLD_SIZE=2, but the config sets no parallel layout"),
        (["run_dir=/proc/version/run"], 1, "run_dir /proc/version/run is not writable (Not a directory)"),
        (
            ["parallel.pp=2", "parallel.pp_microbatches=3"],
            2,
            "] parallel.pp_microbatches=3 does not divide the batch of 16 sequences",
        ),
    ],
)
def test_bad_input_fails_with_a_clear_message(tiny_config, overrides, nproc, message):
    config = tiny_config("bad")
    result = run_train(config, nproc, *overrides, check=False)
    assert result.returncode != 0
    assert message in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    if nproc == 1:
        assert len(errors) == 1 and errors[0].startswith("error: ") and "Traceback" not in result.stderr
    else:  # one line per rank, each whole: the ranks share stderr
        assert sorted(line.split("]")[0] for line in errors) == ["error: [rank 0", "error: [rank 1"], errors
        assert all(line.count("error:") == 1 for line in errors), errors
    assert not (run_dir_of(config) / "run.json").exists()


def test_whole_epochs_are_counted_and_a_moved_run_resumes_instead_of_starting_afresh(
    tiny_config, prepared, tmp_path, capsys
):
    """Two whole epochs and no max_steps (the default): the run ends on an epoch boundary. Moving the finished run
    directory and the prepared data elsewhere, and changing how often it logs, changes nothing that was trained."""
    config = tiny_config("epochs", batch__size=512, train__max_steps=None, train__epochs=2, checkpoint__every=None)
    results = train_here(config).results
    steps_per_epoch = results.steps // 2
    assert steps_per_epoch > 1 and results.steps == 2 * steps_per_epoch
    assert results.epochs_completed == 2
    identity = json.loads((run_dir_of(config) / "identity.json").read_text())
    assert "run_dir" not in identity["settings"] and "prepared_dir" not in identity["settings"]["data"]

    moved = tmp_path / "moved"
    shutil.copytree(run_dir_of(config), moved / "run")
    shutil.copytree(prepared, moved / "prepared")
    capsys.readouterr()
    again = train_here(
        config, f"run_dir={moved / 'run'}", f"data.prepared_dir={moved / 'prepared'}", "train.log_every=7"
    )
    assert f"finished at step {results.steps}" in capsys.readouterr().out
    assert not (moved / "run" / "previous").exists()
    assert again.results.validation == results.validation and again.results.epochs_completed == 2

    changed = train_here(config, f"run_dir={moved / 'run'}", "optim.lr=1e-3", "train.epochs=1")  # another model
    assert (moved / "run" / "previous" / "checkpoints").is_dir() and changed.results.steps == steps_per_epoch


def test_a_stop_signal_during_evaluation_checkpoints_and_stops_within_the_evaluation(
    tiny_config, monkeypatch, tmp_path
):
    """The signal comes while the first validation runs (step 5): the evaluation stops between batches, the step
    is checkpointed, Preempted (exit 75) is raised; the rerun resumes from that step and finishes. Its energy,
    from a fake RAPL tree of two packages drawing 5 W each, is that of its training time in both attempts:
    evaluations and checkpoints left out, the first attempt's carried by the checkpoint. Both attempts train from
    a staged copy of the data (data.stage: local), removed after the stop as after the end."""
    from scalelm.measure import energy
    from scalelm.train.preemption import Preempted

    for package in ("intel-rapl:0", "intel-rapl:1"):
        (tmp_path / "powercap" / package).mkdir(parents=True)
        (tmp_path / "powercap" / package / "max_energy_range_uj").write_text(str(2**40))
    monkeypatch.setattr(energy, "POWERCAP", tmp_path / "powercap")
    monkeypatch.setattr(energy.Rapl, "read", staticmethod(lambda zone: int(time.monotonic() * 5e6)))
    scratch = tmp_path / "scratch"
    config = tiny_config(
        "evalstop",
        train__eval_every=5,
        train__eval_batch_size=2,
        checkpoint__every=None,
        data__stage="local",
        data__stage_dir=str(scratch),
    )
    evaluated = []
    forward = TransformerLM.forward

    def forward_and_signal(model, tokens, targets=None):
        if not model.training:
            evaluated.append(tokens.shape[0])
            if len(evaluated) == 3:
                os.kill(os.getpid(), signal.SIGUSR1)
        return forward(model, tokens, targets)

    monkeypatch.setattr(TransformerLM, "forward", forward_and_signal)
    with pytest.raises(Preempted, match="stopped by a signal at step 5") as stopped:
        train_here(config)
    assert stopped.value.exit_code == EXIT_PREEMPTED
    assert len(evaluated) == 3  # of the validation split's hundreds of batches
    assert [p.name for p in complete_checkpoints(run_dir_of(config) / "checkpoints")] == ["step_00000005"]
    assert not [r for r in read_metrics(run_dir_of(config)) if r["kind"] == "eval"]
    assert list(scratch.iterdir()) == []

    monkeypatch.setattr(TransformerLM, "forward", forward)
    results = train_here(config, "train.eval_batch_size=256").results  # not the run's identity: it resumes, faster
    assert results.steps == 20
    assert results.energy["source"] == "rapl packages" and results.energy["unknown"] is None
    assert results.energy["joules"] == pytest.approx(10 * results.train_time_s, rel=0.05, abs=0.02)
    assert results.energy["joules_per_token"] == results.energy["joules"] / results.tokens_seen
    assert results.staging["mode"] == "local" and results.staging["seconds"] > 0 and list(scratch.iterdir()) == []
    lines = [r for r in read_metrics(run_dir_of(config)) if r["kind"] == "train"]
    assert sum(r["energy_j"] for r in lines) == pytest.approx(results.energy["joules"])
    assert lines[-1]["joules_per_token"] == pytest.approx(lines[-1]["energy_j"] / lines[-1]["tokens_per_step"])


COMPILED = ("single", "ddp", "fsdp", "tp")


@pytest.mark.slow
def test_compiled_training_matches_eager_in_every_data_and_tensor_layout_and_resumes(tiny_config):
    """train.compile (each block compiled with the layout, scalelm.parallel.compile): one process, DDP, FSDP and TP
    compiled train like the eager single process to within 1e-4 per step (the compiled kernels sum fp32 in another
    order); a compiled run resumes its own checkpoint and continues exactly as it went."""
    eager = tiny_config("eager")
    run_train(eager)
    reference = train_losses(run_dir_of(eager))
    compiled = {}
    for name in COMPILED:
        nproc, settings = LAYOUTS[name]
        compiled[name] = tiny_config(f"compiled_{name}", train__compile=True, **settings)
        run_train(compiled[name], nproc, timeout=240)
        assert relative_gap(train_losses(run_dir_of(compiled[name])), reference) <= 1e-4, name
    resumed = tiny_config("compiled_resumed", train__compile=True)
    checkpoint = complete_checkpoints(run_dir_of(compiled["single"]) / "checkpoints")[0]  # step 10
    shutil.copytree(checkpoint, run_dir_of(resumed) / "checkpoints" / checkpoint.name)
    assert "resumed from step 10" in run_train(resumed).stdout
    assert train_losses(run_dir_of(resumed)) == train_losses(run_dir_of(compiled["single"]))[10:]


def test_activation_checkpointing_trains_the_same_model_and_the_plan_counts_its_saving(tiny_config):
    """train.activation_checkpointing: full recomputes what the blocks did not keep, with the dropout masks drawn
    again alike, so every step's loss is the plain run's, bit for bit; the plan's activations, beside the measured
    peak in run.json, fall. (How far the measured peak falls against the plan: bench/activation_memory.py, figures
    in docs/plan.md; a measured memory figure is no test. Selective checkpointing: the parity test's
    fsdp_ep, and the plan's unit test.)"""
    settings = dict(
        model__n_layers=4, model__dropout=0.1, train__max_steps=3, checkpoint__every=None, train__monitor_interval_s=0
    )
    losses, peaks, planned = {}, {}, {}
    for mode in ("none", "full"):
        config = tiny_config(mode, train__activation_checkpointing=mode, **settings)
        train_here(config)
        losses[mode] = train_losses(run_dir_of(config))
        peaks[mode] = [r for r in read_metrics(run_dir_of(config)) if r["kind"] == "train"][-1]["peak_mem_mb"]
        record = json.loads((run_dir_of(config) / "run.json").read_text())
        planned[mode] = record["results"]["plan_mb_per_rank"]["activations"]
    assert len(losses["full"]) == 3 and losses["full"] == losses["none"]
    assert planned["full"] < planned["none"], planned
    assert all(peak > 0 for peak in peaks.values()), peaks  # measured and recorded; its size is bench's question
