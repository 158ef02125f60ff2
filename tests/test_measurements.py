"""What the speed figures rest on: steady state after warm-up, isolation of timed runs, peak FLOP/s and MFU."""

import copy
import json
import mmap
import os
import re
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from torch import nn

from conftest import board_scalars, run_dir_of, run_train
from scalelm.config import ModelConfig, MoEConfig
from scalelm.data.prepared import load_prepared
from scalelm.measure import peak
from scalelm.measure.comm import CommProfile, clip, union_seconds, without_profiler_notices
from scalelm.measure.experts import ExpertLoad
from scalelm.measure.hostload import HostLoad
from scalelm.measure.instruments import Instruments
from scalelm.model.architecture import flops_per_token, parameter_counts
from scalelm.model.moe import MoE
from scalelm.plan.machine import MachineBaseline
from scalelm.report.timing import default_warmup, overlapping_runs, steady_state, straggler
from scalelm.report.utilisation import device_series, summarise
from scalelm.train.record import read_metrics


def intervals(times: list[float], every: int = 3) -> list[dict]:
    return [
        {"step": every * (i + 1), "step_time_s": t, "tokens_per_step": 1000, "world_size": 2, "data_share": t / 100}
        for i, t in enumerate(times)
    ]


def test_the_profiler_prints_nothing_between_the_step_lines(capfd):
    """Kineto announces each profile's start and stop on stderr (`USDT: ... profiler_start`), which landed in the
    middle of a training's step lines (issue 69): the communication profile runs without them, and what else was
    written to stderr meanwhile is kept."""
    profiled = CommProfile(2, 2, 0, torch.device("cpu"), True)
    for step in (1, 2):
        with profiled.step(step):
            torch.ones(8) @ torch.ones(8)
    with without_profiler_notices():
        os.write(2, b"USDT: a notice\na warning of another thread\n")
    err = capfd.readouterr().err
    assert "USDT" not in err and "profiler_st" not in err and err == "a warning of another thread\n", err
    assert profiled.result is not None


def test_steady_state_leaves_out_the_warmup_and_reports_the_median_and_its_spread():
    assert default_warmup(12) == 5 and default_warmup(200) == 20
    # steps 1-3 and 4-6 begin before step 5: left out; 7-9, 10-12, 13-15 count
    figures = steady_state(intervals([9.0, 5.0, 1.0, 1.2, 0.8]))
    assert figures["warmup_steps"] == 5 and figures["steady_intervals"] == 3
    assert (figures["step_time_s"], figures["step_time_s_min"], figures["step_time_s_max"]) == (1.0, 0.8, 1.2)
    assert figures["tokens_per_s"] == 1000.0 and figures["tokens_per_s_per_device"] == 500.0
    assert figures["data_share"] == 0.01  # the steady intervals' median
    assert steady_state(intervals([9.0, 5.0, 1.0]), warmup_steps=0)["step_time_s"] == 5.0
    # a run that ends inside its warm-up is measured on its last interval, and says so
    short = steady_state(intervals([9.0, 5.0]))
    assert short["steady_intervals"] == 0 and short["step_time_s"] == 5.0


def test_collective_time_counts_overlapping_collectives_once_and_only_inside_the_steps():
    collectives = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (9.0, 12.0)]  # two overlap; one falls between the steps
    steps = [(0.5, 4.0), (8.0, 10.0)]
    assert union_seconds(collectives) == 7.0
    assert clip(collectives, steps) == [(0.5, 2.0), (1.0, 3.0), (9.0, 10.0)]
    assert union_seconds(clip(collectives, steps)) == 3.5


def profiled_event(name, start_us, end_us, device="CPU", id=0, linked=0, parent=None):
    """One of the profiler's events, as scalelm.measure.comm reads them."""
    return SimpleNamespace(
        name=name,
        is_async=False,
        time_range=SimpleNamespace(start=start_us, end=end_us),
        device_type=SimpleNamespace(name=device),
        id=id,
        linked_correlation_id=linked,
        cpu_parent=parent,
    )


def test_the_all_to_all_is_counted_apart_on_gloo_and_on_nccl():
    """gloo names it; NCCL's all-to-all runs in the send and receive kernel a pipeline's transfers use too, told
    apart by the collective that launched it."""
    steps = [profiled_event("scalelm:train_step", 0, 1000), profiled_event("scalelm:train_step", 2000, 3000)]
    gloo = CommProfile(2, 2, 0, torch.device("cpu"), True).summarise(
        [
            *steps,
            profiled_event("gloo:all_to_all", 100, 300),
            profiled_event("gloo:all_to_all", 2100, 2200),
            profiled_event("gloo:all_reduce", 200, 500),
        ]
    )
    assert gloo["share"] == pytest.approx(0.25) and gloo["all_to_all_share"] == pytest.approx(0.15)
    assert gloo["all_to_all_s_per_step"] == pytest.approx(150e-6)
    assert set(gloo["ops_s_per_step"]) == {"gloo:all_to_all", "gloo:all_reduce"}

    exchange = profiled_event("nccl:all_to_all", 90, 95, id=7)
    launch = profiled_event("record_param_comms", 91, 94, id=8, parent=exchange)
    send = profiled_event("nccl:send 0->1", 2050, 2060, id=9)
    kernel = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
    nccl = CommProfile(2, 2, 0, torch.device("cuda"), True).summarise(
        [
            *steps,
            exchange,
            launch,
            send,
            profiled_event(kernel, 100, 400, "CUDA", linked=8),
            profiled_event(kernel, 2100, 2300, "CUDA", linked=9),
        ]
    )
    assert set(nccl["ops_s_per_step"]) == {"nccl:all_to_all", kernel}
    assert nccl["share"] == pytest.approx(0.25) and nccl["all_to_all_share"] == pytest.approx(0.15)


def test_a_cuda_runtime_event_sharing_an_ops_id_moves_no_kernel_into_or_out_of_the_all_to_all():
    """Review 3 finding 12: kernels link to torch's own (frontend) operations, whose ids count apart from the CUDA
    runtime's events' (CUPTI's correlation ids, CPU events too, linked to the operation that made the call): a
    runtime event with an operation's id must not take its place, whichever collective it was launched in."""
    steps = [profiled_event("scalelm:train_step", 0, 1000), profiled_event("scalelm:train_step", 2000, 3000)]
    exchange = profiled_event("nccl:all_to_all", 90, 95, id=7)
    launch = profiled_event("record_param_comms", 91, 94, id=8, parent=exchange)
    send = profiled_event("nccl:send 0->1", 2050, 2060, id=9)
    kernel = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
    runtime = [  # cudaLaunchKernel with CUPTI ids 8 and 9, each inside the other collective
        profiled_event("cudaLaunchKernel", 2055, 2056, id=8, linked=9, parent=send),
        profiled_event("cudaLaunchKernel", 92, 93, id=9, linked=8, parent=launch),
    ]
    events = [*steps, exchange, launch, send, *runtime]
    events += [profiled_event(kernel, 100, 400, "CUDA", linked=8), profiled_event(kernel, 2100, 2300, "CUDA", linked=9)]
    nccl = CommProfile(2, 2, 0, torch.device("cuda"), True).summarise(events)
    assert nccl["ops_s_per_step"] == {"nccl:all_to_all": pytest.approx(150e-6), kernel: pytest.approx(100e-6)}
    assert nccl["all_to_all_share"] == pytest.approx(0.15)


def stage_of(config: ModelConfig, blocks: list[int]) -> nn.Module:
    """A pipeline stage's mixtures, each knowing its block's index in the whole model."""
    stage = nn.Module()
    stage.blocks = nn.ModuleDict({str(i): nn.Module() for i in blocks})
    for i in blocks:
        stage.blocks[str(i)].ffn = MoE(config, i)
    return stage


def test_the_experts_load_and_aux_loss_are_summed_over_stages_and_counted_once_per_tensor_parallel_group():
    """Four ranks in one reduction: a pipeline's two stages (blocks 0-1, block 2), each on a tensor-parallel group of
    two, whose ranks route the same tokens; the sum of their `take` is what the engine's all-reduce gives. The load
    balance is each step's, averaged over the logged interval: two steps that each send every row of block 1 to
    one expert, another each time, are as unbalanced as one such step (their sum would look even)."""
    config = ModelConfig(d_model=8, n_heads=2, n_layers=3, d_ff=16, moe=MoEConfig(experts=4, top_k=2))
    assert ExpertLoad.of(stage_of(config, [0]), ModelConfig(n_layers=1), 1, {}) is None  # dense: nothing measured
    cpu = torch.device("cpu")
    totals = [{} for _ in range(4)]  # each rank's TrainerState.experts
    ranks = [ExpertLoad.of(stage_of(config, b), config, 2, t) for b, t in zip(([0, 1], [0, 1], [2], [2]), totals)]

    def step(micro_batches: dict[int, list[tuple[list[int], float]]]) -> None:
        """One optimizer step on every rank: per block, each micro-batch's tokens per expert and aux loss."""
        for rank in ranks:
            for layer, moe in rank.local.items():
                for counts, aux in micro_batches[layer]:
                    moe.count(torch.tensor(counts, dtype=torch.float), torch.tensor(aux))
            rank.end_step(cpu)

    def interval() -> dict:
        taken = [rank.take(cpu) for rank in ranks]
        assert len({len(t) for t in taken}) == 1  # one length on every rank, whichever blocks it holds
        summed = torch.stack(taken).sum(dim=0).tolist()
        return [rank.interval(summed) for rank in ranks][0]

    even = ([2, 2, 2, 2], 1.0)
    step({0: [even, even], 1: [([4, 0, 0, 0], 2.0), ([4, 0, 0, 0], 2.2)], 2: [even, even]})
    step({0: [even, even], 1: [([0, 0, 0, 4], 1.8), ([0, 0, 0, 4], 2.0)], 2: [([3, 1, 3, 1], 1.1), even]})
    first = interval()
    assert first["aux_loss"] == pytest.approx((1.0 * 4 + 2.0 + 2.2) / 6 / 2 + (1.0 * 3 + 1.8 + 2.0 + 1.1) / 6 / 2)
    assert first["expert_load_max_over_mean"] == pytest.approx(4.0)  # each step's worst layer: block 1's 8 / 2
    # each layer's MaxVio, each step's averaged: block 2's second step is 5, 3, 5, 3 (max 5 over mean 4)
    vio = {key: value for key, value in first.items() if key.startswith("expert_max_vio_")}
    assert vio == pytest.approx({"expert_max_vio_0": 0.0, "expert_max_vio_1": 3.0, "expert_max_vio_2": 0.125})
    assert all(rank.take(cpu).numel() == 0 for rank in ranks)  # taken: counted once
    step({0: [even, even], 1: [even, even], 2: [even, even]})
    assert interval()["expert_load_max_over_mean"] == pytest.approx(1.0)

    results = ranks[0].results()
    assert results["layers"] == [0, 1, 2] and results["experts"] == 4 and results["steps"] == 3
    assert results["aux_loss"] == pytest.approx(1.0)  # the last interval's
    assert results["expert_max_vio_end"] == {"0": 0.0, "1": 0.0, "2": 0.0}  # and its balance, layer by layer
    assert results["expert_load_max_over_mean"] == pytest.approx((4.0 + 4.0 + 1.0) / 3)  # over the steps
    # tokens per expert over the run, the TP copies counted once
    assert totals[0]["counts"] == [[12.0] * 4, [12.0, 4.0, 4.0, 12.0], [13.0, 11.0, 13.0, 11.0]]
    assert results["expert_token_share_per_layer"]["1"] == pytest.approx([12 / 32, 4 / 32, 4 / 32, 12 / 32])
    assert results["expert_token_share"] == pytest.approx([37 / 128, 27 / 128, 29 / 128, 35 / 128])
    # a resumed run starts from its checkpointed totals (the state's, as torch.save keeps them): the run's whole
    resumed = ExpertLoad.of(stage_of(config, [0, 1]), config, 2, copy.deepcopy(totals[0]))
    assert resumed.results() == results


def test_runs_overlap_only_when_they_share_a_host_at_the_same_time():
    def run(start, end, *hosts, machines=()):
        return SimpleNamespace(
            start_time=f"2026-11-25T10:{start:02d}:00+0000",
            end_time=f"2026-11-25T10:{end:02d}:00+0000",
            nodes=list(hosts),
            machines=list(machines),
        )

    records = {
        "a": run(0, 10, "n1"),
        "b": run(5, 15, "n1", "n2"),  # overlaps a on n1
        "c": run(15, 20, "n2"),  # starts when b ends: not an overlap
        "d": run(0, 30, "n3"),  # at the same time as all, on a host of its own
        # two "nodes" of one machine (the test cluster's n1 and n2 share a kernel): they share its cores
        "e": run(40, 50, "n1", machines=["boot1"]),
        "f": run(45, 55, "n2", machines=["boot1", "boot1"]),
    }
    assert overlapping_runs(records) == {"a": ["b"], "b": ["a"], "c": [], "d": [], "e": ["f"], "f": ["e"]}


def test_gpu_peaks_come_from_the_table_and_an_unknown_gpu_leaves_mfu_empty(capsys):
    assert peak.cuda_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peak.cuda_peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak.cuda_peak_flops("NVIDIA A100-SXM4-40GB", "fp32") == 156e12
    assert peak.cuda_peak_flops("NVIDIA GH200 480GB", "bf16") == 989e12
    assert peak.cuda_peak_flops("Some Future GPU", "bf16") is None
    message = capsys.readouterr().out
    assert "'Some Future GPU'" in message and "train.peak_tflops" in message
    assert peak.peak_flops(torch.device("cpu"), "fp32", 2.5) == (2.5e12, "configured (train.peak_tflops)")


def test_cpu_peak_is_measured_once_per_host_and_leaves_training_random_streams_alone(tmp_path, monkeypatch):
    cache = tmp_path / "cpu_peak.json"
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    measured = peak.cpu_peak_flops(cache)
    assert torch.equal(torch.rand(3), expected)  # the calibration drew from its own generator
    assert 1e8 < measured < 1e13
    assert json.loads(cache.read_text())[peak.cpu_cache_key()]["flops"] == measured

    # a calibration beside other work serves its run only: the next run measures again; the best rate is kept
    cache.unlink()
    for rate, quiet in ((1e11, False), (3e11, True)):
        monkeypatch.setattr(peak, "calibrate", lambda r=rate, q=quiet: (r, q))
        assert peak.cpu_peak_flops(cache) == rate
    monkeypatch.setattr(peak, "calibrate", lambda: pytest.fail("measured again despite a quiet calibration"))
    assert peak.cpu_peak_flops(cache) == 3e11
    assert json.loads(cache.read_text()) == {peak.cpu_cache_key(): {"flops": 3e11, "quiet": True}}


def test_host_load_counts_other_work_on_the_host_apart_from_the_run():
    own_before, children_before = time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.monotonic()
    load = HostLoad()
    other = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"])
    deadline = time.time() + 1.5
    while time.time() < deadline:  # this process works too
        sum(range(10_000))
    other.wait()
    (host, figures), *more = HostLoad.per_host([load.reading()]).items()
    wall = time.monotonic() - began
    own = time.process_time() - own_before
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    child = children.ru_utime + children.ru_stime - children_before.ru_utime - children_before.ru_stime
    assert not more and host == socket.gethostname() and figures["cpus"] >= 1
    # this process's CPU time is the run's; the other process's (and whatever else ran) is other work
    assert figures["run_cores"] * wall == pytest.approx(own, rel=0.1, abs=0.05), (figures, own, wall)
    assert figures["other_cores"] * wall >= 0.9 * child - 0.05, (figures, child, wall)
    assert child > 0.1 and figures["busy_cores"] >= figures["run_cores"]


def test_the_data_time_is_the_host_time_spent_producing_batches(monkeypatch):
    """What `data_share` divides: the time inside the batch iterator, not the time the caller spends between items
    (on a clock the test moves, so a loaded machine cannot change the figure)."""
    from scalelm.measure import instruments

    now = [0.0]
    monkeypatch.setattr(instruments, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    holder = SimpleNamespace(data_seconds=0.0)

    def slow(n):
        for i in range(n):
            now[0] += 0.02
            yield i

    items = []
    for item in Instruments.batches(holder, slow(3)):
        items.append(item)
        now[0] += 0.05  # the step: not data time
    assert items == [0, 1, 2]
    assert holder.data_seconds == pytest.approx(0.06)


def test_the_cpu_peak_memory_is_each_intervals_own():
    """As on CUDA, a reset starts a new peak: what an earlier interval (the start-up, an evaluation) held does not
    count in the next one's (Linux's VmHWM, reset through /proc/self/clear_refs)."""
    from scalelm.measure.device import peak_memory_mb, reset_peak_memory

    cpu = torch.device("cpu")
    held = mmap.mmap(-1, 256 * 2**20)  # mapped apart from malloc, whose heap this process may keep (hostmemory)
    held.write(b"x" * len(held))  # touched: resident
    with_it = peak_memory_mb(cpu)[0]
    held.close()
    reset_peak_memory(cpu)
    assert peak_memory_mb(cpu)[0] < with_it - 200  # MiB: the freed 256 no longer counts


def test_the_rank_the_others_wait_for_is_named_a_straggler(tiny_config, tmp_path):
    """Rank 1 of two sleeps 0.2 s in each step (a slow node): its step takes no longer than rank 0's, which waits for
    it in the gradients' all-reduce, but rank 0 spends most of its profiled steps in collectives and rank 1 little,
    so the summary names rank 1 with its host; two ranks alike name none."""
    import drills

    config = tiny_config("slow", parallel__strategy="ddp", train__max_steps=8, checkpoint__every=None)
    ran = drills.run(config, procs=2, env=drills.slowed_rank(tmp_path / "site", 1, 1, 10**6, 0.2))
    assert ran.returncode == 0, ran.stderr[-3000:]
    record = json.loads((run_dir_of(config) / "run.json").read_text())
    shares = record["results"]["comm"]["share_per_rank"]
    assert shares[0] > 0.5 > shares[1], shares
    assert straggler(record["results"]["comm"], record["hostnames"]) == f"rank 1 ({record['hostnames'][1]})"
    assert straggler({"share_per_rank": [0.31, 0.28]}, ["a", "b"]) == "" and straggler(None, []) == ""
    assert straggler({"share_per_rank": [0.4, 0.41, 0.05, 0.39]}, []) == "rank 2"


def test_training_reports_mfu_against_the_device_peak_in_metrics_and_run_json(tiny_config):
    config = tiny_config(train__max_steps=6, train__log_every=2, train__peak_tflops=0.001)
    run_train(config)
    run_dir = run_dir_of(config)
    record = json.loads((run_dir / "run.json").read_text())
    results = record["results"]
    assert results["peak_flops_per_device"] == 1e9 and results["peak_flops_source"] == "configured (train.peak_tflops)"
    settings = record["config"]
    vocab = load_prepared(settings["data"]["prepared_dir"]).vocab_size
    per_token = flops_per_token(ModelConfig(**settings["model"]), vocab, settings["data"]["seq_len"])
    assert results["flops_per_token"] == per_token
    for line in (m for m in read_metrics(run_dir) if m["kind"] == "train"):
        assert line["mfu"] == pytest.approx(per_token * line["tokens_per_s"] / 1e9)
        assert 0 < line["data_share"] < 1  # host time producing batches, a share of the interval's training time
        assert "aux_loss" not in line and "expert_load_max_over_mean" not in line  # a dense model: no experts
    assert results["experts"] is None
    assert results["parameters"] == parameter_counts(ModelConfig(**settings["model"]), vocab)  # total == active
    assert results["mfu"] == pytest.approx(per_token * results["tokens_per_s"] / 1e9)
    assert [step for step, _ in board_scalars(run_dir, "train/mfu")] == [2, 4, 6]
    assert [step for step, _ in board_scalars(run_dir, "validation/loss")]  # evaluations too
    (host, load), *_ = record["host_load"].items()
    assert host == record["nodes"][0] and load["run_cores"] > 0 and load["other_cores"] >= 0


def test_one_monitor_per_node_samples_every_training_process_and_ends_with_the_training(tiny_config):
    """Also: the monitor's readings in TensorBoard, and the collectives timed on the steps after the warm-up."""
    config = tiny_config(train__max_steps=40, train__monitor_interval_s=0.1, parallel__strategy="ddp")
    run_train(config, 2, launcher="torchrun")  # the training processes as torchrun starts them
    run_dir = run_dir_of(config)
    assert [p.name for p in (run_dir / "monitor").iterdir()] == ["node0.jsonl"]  # one node: one sampler
    records = [json.loads(line) for line in (run_dir / "monitor/node0.jsonl").read_text().splitlines()]
    samples, end = records[:-1], records[-1]
    assert len(samples) >= 3 and all(r["kind"] == "sample" for r in samples)
    assert all(sorted(p["rank"] for p in r["procs"]) == [0, 1] for r in samples[:-1])
    assert all(p["rss_mb"] > 50 and p["cpu_percent"] >= 0 for r in samples for p in r["procs"])
    assert max(p["cpu_percent"] for r in samples for p in r["procs"]) > 20  # training keeps its ranks busy
    assert end["kind"] == "end" and end["wall_s"] > 0 and end["cpu_s"] >= 0
    times = [r["time"] for r in samples]
    assert times == sorted(times)
    # ticks at least an interval apart (a late one is not caught up with a burst): not more samples than fit
    assert len(samples) <= end["wall_s"] / 0.1 + 1
    leftover = [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert not leftover  # the sampler ended with the training
    series, cost = device_series(run_dir / "monitor")
    summary = summarise(series, cost)
    assert set(series) == {"rank 0", "rank 1"} and summary["util_mean_percent"] > 0
    assert 0 <= summary["monitor_cpu_percent"] < 100
    cpu = board_scalars(run_dir, "utilisation/rank1_cpu_percent", "tensorboard/node0")
    assert [step for step, _ in cpu] == list(range(len(samples)))
    assert [value for _, value in cpu] == pytest.approx([r["procs"][1]["cpu_percent"] for r in samples])
    assert board_scalars(run_dir, "memory/rank0_rss_mb", "tensorboard/node0")[0][1] > 50

    # the last two steps ran under the profiler: DDP's all-reduces took part of them
    comm = json.loads((run_dir / "run.json").read_text())["results"]["comm"]
    assert comm["steps"] == [39, 40] and 0 < comm["share"] <= comm["share_max"] <= 1
    # (comm_s_per_step: the ranks' mean, each within its own steps, which share_max bounds; step_s: rank 0's)
    assert comm["comm_s_per_step"] > 0 and comm["step_s"] > 0
    assert set(comm["ops_s_per_step_rank0"]) == {"gloo:all_reduce"}
    train = [m for m in read_metrics(run_dir) if m["kind"] == "train"]
    assert [m["step"] for m in train if m["profiled"]] == [39, 40] and all(m["peak_reserved_mb"] is None for m in train)
    assert steady_state(train)["steady_intervals"] == len(train) - 7  # warm-up and profiled steps left out


def test_the_monitor_without_nvml_samples_cpu_and_memory_and_says_why(tmp_path):
    out = tmp_path / "node0.jsonl"
    command = [sys.executable, "-m", "scalelm.measure.sampler", "--out", str(out), "--interval", "0.05"]
    sampler = subprocess.Popen(
        [*command, "--proc", f"0:{os.getpid()}", "--gpu", "0"], stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60  # its first samples, however long its start takes (a second on a busy host)
    while not (out.exists() and len(out.read_text().splitlines()) >= 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    sampler.stdin.close()  # what the training does when it ends
    assert sampler.wait(timeout=10) == 0
    assert "no GPU readings" in sampler.stderr.read()  # this machine has no NVIDIA driver
    *samples, end = [json.loads(line) for line in out.read_text().splitlines()]
    assert samples and all(r["procs"][0]["rank"] == 0 and "gpus" not in r for r in samples)
    assert end["kind"] == "end"


def test_weights_and_biases_offline_holds_every_logged_step(tiny_config):
    config = tiny_config(train__max_steps=6, train__log_every=2, train__wandb=True)
    run_train(config)
    run_dir = run_dir_of(config)
    [offline] = (run_dir / "wandb").glob("offline-run-*")  # one attempt, one offline run: `wandb sync` uploads it
    [events] = offline.glob("run-*.wandb")
    content = events.read_bytes()  # wandb's own binary log (read by wandb-core); the tags and values are plain text
    losses = [m["loss"] for m in read_metrics(run_dir) if m["kind"] == "train"]
    assert len(losses) == 3 and b"train/loss" in content and b"validation/perplexity" in content
    assert all(json.dumps(loss).encode() in content for loss in losses), losses


@pytest.mark.slow
def test_the_baseline_times_products_and_collectives_within_and_across_nodes(tiny_config, tmp_path):
    """Two local "nodes" of two processes (two torchruns meeting at one rendezvous, as the launcher starts them): the
    model's matrix products per rank, and every collective over message sizes in the whole job and within each node,
    the bus bandwidth in nccl-tests' convention."""
    from scalelm.launch.launcher import free_port
    from scalelm.site import OPS

    config, out, port = tiny_config("baseline"), tmp_path / "baseline.json", free_port()
    rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=baseline-{port}"]
    experts = json.dumps({"experts": 4, "top_k": 2})  # an expert-parallel experiment's mixture
    options = [f"--out={out}", f"--config={config}", f"--moe={experts}", "--min-bytes=4096"]
    options += [f"--max-bytes={2**18}", "--iterations=3"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", *rendezvous]
    command = [*torchrun, "-m", "scalelm.measure.baseline", *options]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    result = json.loads(out.read_text())
    assert MachineBaseline.from_json(result).to_json() == result  # the record holds all of it, and writes it back
    assert result["world_size"] == 4 and result["procs_per_node"] == 2 and result["backend"] == "gloo"
    assert [r["rank"] for r in result["per_rank"]] == [0, 1, 2, 3]
    products = result["per_rank"][0]["matmul"]["products"]
    assert set(products) == {"qkv", "attention_out", "ffn_up", "ffn_down", "output"}
    assert products["ffn_up"]["shape"] == [16 * 16, 32, 64] and result["matmul_tflops_min"] > 0  # TINY's shapes
    assert result["elementwise_gbps_min"] > 0  # at the logits' size, for the step-time model
    # the model's own step alone and with all four ranks at once, on what is one machine (its boot id)
    assert len({r["machine"] for r in result["per_rank"]}) == 1 and result["model_step"]["ranks_per_host"] == 4
    assert result["model_step"]["tokens"] == 16 * 16 and result["model_step"]["host_speedup"] > 0
    low, high = result["model_step"]["host_speedup_spread"]  # the ranks' slowest and fastest runs together
    assert low <= result["model_step"]["host_speedup"] <= high
    assert all((r["threads"], r["cpus"]) == (1, len(os.sched_getaffinity(0))) for r in result["per_rank"])
    rows = {(r["scope"], r["op"], r["bytes"]): r for r in result["collectives"]}
    assert {(scope, op) for scope, op, _ in rows} == {(s, op) for s in ("job", "node") for op in OPS}
    assert {size for *_, size in rows} == {4096, 16384, 65536, 262144}
    for (scope, op, size), row in rows.items():
        assert row["ranks"] == (4 if scope == "job" else 2) and row["time_s"] > 0
        factor = {"all_reduce": 2 * (row["ranks"] - 1) / row["ranks"], "send_recv": 1.0}.get(
            op, (row["ranks"] - 1) / row["ranks"]
        )
        assert row["algbw_gbps"] == pytest.approx(size / row["time_s"] / 1e9)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factor)
        # the repetitions' spread: the median within it, the bandwidths the times' inverse
        assert row["time_s_min"] <= row["time_s"] <= row["time_s_max"]
        assert row["busbw_gbps_min"] == pytest.approx(size / row["time_s_max"] / 1e9 * factor)
        assert row["busbw_gbps_min"] <= row["busbw_gbps"] <= row["busbw_gbps_max"]
    step = result["model_step"]
    assert step["seconds_spread"][0] <= step["seconds_max"] <= step["seconds_spread"][1]
    # the first rank's step again with each layout's machinery in its one process: what each costs more, never less
    overheads, spreads = step["layout_overhead_s"], step["layout_overhead_s_spread"]
    assert set(overheads) == set(spreads) == {"tp", "cp", "ep", "fsdp"}  # (runs paired with the plain step's: noisy)
    assert all(0 <= spreads[name][0] <= seconds <= spreads[name][1] for name, seconds in overheads.items())
    # a small collective inside the step, every rank at work (each node's two ranks at once): the last rank's latency
    # and the others' wait for it, a share of their compute
    for name in ("in_step_latency_s", "drift_share"):
        low, high = result[f"{name}_spread"]
        assert 0 < low <= result[name] <= high
    assert result["drift_share"] < 1 and "a small collective inside a step, every rank at work:" in "".join(outputs)
    assert [bool(r.get("layout_overhead_s")) for r in result["per_rank"]] == [True, False, False, False]
    assert step["small_seconds_spread"][0] <= step["small_seconds_max"] <= step["small_seconds_spread"][1]
    assert "all_reduce      job  4 ranks" in "".join(outputs) and f"written to {out}" in "".join(outputs)


@pytest.mark.parametrize(
    "moe, message",
    [
        ('{"experts": 0}', r"model.moe.experts must be a positive integer, got 0"),
        ('{"experts": 4, "d_ff": 0}', r"model.moe.d_ff must be positive or null \(model.d_ff\), got 0"),
        ('{"experts": 4, "bias_rate": -1}', r"model.moe.bias_rate must be positive .*, got -1"),
        ('{"experts": 4, "top_k": 5}', r"model.moe.top_k=5 exceeds model.moe.experts=4: .*lower top_k or add experts"),
        ('{"experts": 4, "every": 3}', r"model.moe.every=3 leaves all of model.n_layers=2 blocks dense"),  # --config's
        ('{"experts": 4, "z_loss_coef": 1e30}', r"model.moe.z_loss_coef must be at most 1000, got 1e\+30"),
    ],
)
def test_the_baseline_refuses_a_mixture_that_training_refuses_naming_the_setting_before_measuring(
    tiny_config, tmp_path, capsys, monkeypatch, moe, message
):
    """Issue 66: the baseline's --moe goes through training's own checks in --config's model (in one process too),
    and a mixture training refuses is refused by name, before anything is measured (it once measured for 27 s on 2
    ranks, then crashed on a shape and wrote nothing)."""
    from scalelm.measure.baseline import __main__ as baseline

    monkeypatch.setattr(baseline, "measure", lambda args: pytest.fail("measured a mixture training refuses"))
    out = tmp_path / "baseline.json"
    with pytest.raises(SystemExit) as exit_:
        baseline.main([f"--out={out}", f"--config={tiny_config()}", f"--moe={moe}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"error: --moe {moe}: " in err and re.search(message, err), err
    assert not out.exists()


def test_the_baseline_in_one_process_says_its_mixture_is_unused(tiny_config, tmp_path, capsys, monkeypatch):
    """Issue 66: one process measures no layout's overheads, the mixture's dispatch among them: it says so."""
    from scalelm.measure.baseline import __main__ as baseline
    from scalelm.measure.baseline import job

    def stop(*args, **kwargs):
        raise RuntimeError("stop before measuring")

    monkeypatch.setattr(job, "measure_alone", stop)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    options = [f"--out={tmp_path / 'baseline.json'}", f"--config={tiny_config()}", '--moe={"experts": 4}']
    with pytest.raises(RuntimeError, match="stop before measuring"):
        baseline.main(options)
    assert "note: --moe is unused in one process: " in capsys.readouterr().out


def test_the_baselines_all_to_all_sends_uneven_splits_that_every_rank_agrees_on():
    """As a mixture's dispatch sends them: each rank's busiest destination gets 1 + LOAD_SKEW times the mean, its
    quietest 1 - LOAD_SKEW, every rank sends and receives its whole buffer, and what a rank sends to another is what
    that one expects from it."""
    from scalelm.measure.baseline.collectives import LOAD_SKEW, uneven_splits

    for ranks in (2, 3, 4, 8):
        splits = [uneven_splits(1000 * ranks, ranks, me) for me in range(ranks)]
        for me, (sent, received) in enumerate(splits):
            assert sum(sent) == sum(received) == 1000 * ranks
            assert max(sent) == pytest.approx(1000 * (1 + LOAD_SKEW), abs=ranks)
            assert min(sent) == pytest.approx(1000 * (1 - LOAD_SKEW), abs=1)
            assert all(received[other] == splits[other][0][me] for other in range(ranks))
    assert uneven_splits(7, 1, 0) == ([7], [7])


def test_the_baseline_reads_the_gpus_health_and_the_network_nccl_chose(monkeypatch):
    """On CPU with a fake NVML and NCCL logs: a GPU held back by a thermal slowdown or with uncorrected ECC errors is
    unhealthy (idle is not); the network NCCL chose is read from its INFO log, and sockets on a site with InfiniBand
    are a warning."""
    from scalelm.measure import monitor
    from scalelm.measure.baseline.__main__ import report
    from scalelm.measure.baseline.gpu_health import gpu_health
    from scalelm.measure.baseline.nccl_network import nccl_debug_env, nccl_network

    class FakeNvml:
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, NVML_CLOCK_SM = 1, 0, 1

        def __init__(self, reasons, ecc):
            self.reasons, self.ecc = reasons, ecc

        def nvmlInit(self):
            pass

        def nvmlDeviceGetHandleByUUID(self, uuid):
            return uuid

        def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
            return self.reasons

        def nvmlDeviceGetTotalEccErrors(self, handle, kind, counter):
            return self.ecc

        def nvmlDeviceGetClockInfo(self, handle, clock):
            return 1200

        def nvmlDeviceGetMaxClockInfo(self, handle, clock):
            return 1980

    monkeypatch.setattr(monitor, "device_uuid", lambda device: "GPU-1")
    gpu = torch.device("cuda", 0)
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(reasons=0x1, ecc=0))
    assert gpu_health(gpu) == {
        "ecc_uncorrected": 0,
        "sm_clock_mhz": 1200,
        "sm_clock_max_mhz": 1980,
        "held_back_by": ["gpu idle"],
        "healthy": True,
    }
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(reasons=0x40 | 0x4, ecc=3))
    health = gpu_health(gpu)
    assert health["held_back_by"] == ["sw power cap", "hw thermal slowdown"] and not health["healthy"]
    assert gpu_health(torch.device("cpu")) is None

    logs = [
        "node1:4242:4250 [0] NCCL INFO NET/Plugin: no plugin found\nnode1:4242:4250 [0] NCCL INFO Using network Socket\n"
    ]
    assert nccl_network(logs) == "Socket" and nccl_network(["NCCL INFO Using network IB"]) == "IB"
    result = {
        "world_size": 8,
        "procs_per_node": 4,
        "hosts": ["n1", "n2"],
        "device": "NVIDIA H100",
        "matmul_tflops_min": 700.0,
        "elementwise_gbps_min": 3000.0,
        "model_step": {"tokens": 8192, "seconds_max": 0.05},
        "collectives": [],
        "per_rank": [{"rank": 5, "host": "n2", "gpu": health}],
        "nccl_network": "Socket",
    }
    lines = "\n".join(report(MachineBaseline.from_json(result), "infiniband"))
    assert "WARNING: rank 5 on n2: GPU not healthy" in lines
    assert "WARNING: the site has InfiniBand but NCCL uses Socket" in lines
    assert nccl_debug_env(Path("/r"))["NCCL_DEBUG_FILE"] == "/r/nccl.%h.%p.log"


def test_mfu_counts_gpt2_smalls_flops_under_both_conventions_against_the_h200s_peak():
    """Issue 50: gpt2_small (12 blocks of width 768, FFN 3,072, 1,024-token sequences, WikiText-2's 33,278 words,
    tied weights) makes 6 x 110,492,160 matmul weights = 662,952,960 FLOPs per token, plus attention: over the whole
    sequence 12 L s d = 113,246,208 (scalelm's and torchtitan's count, `mfu`), causal at half 56,623,104 (llm.c's,
    `mfu_causal`). Against the H200's datasheet bf16 peak of 989 TFLOP/s, the 554,000 tokens/s of batch 32 are 43.5%
    and 40.3%."""
    gpt2 = ModelConfig(d_model=768, n_heads=12, n_layers=12, d_ff=3072, dropout=0.0, norm="pre", tie_weights=True)
    full = flops_per_token(gpt2, 33278, 1024)
    causal = peak.causal_flops_per_token(full, gpt2.n_layers, gpt2.d_model, 1024)
    assert (full, causal) == (776_199_168, 719_576_064)
    h200 = peak.cuda_peak_flops("NVIDIA H200", "bf16")
    assert h200 == 989e12 and peak.cuda_peak_flops("NVIDIA H200 NVL", "bf16") == 835e12
    assert round(peak.mfu(full, 554_000, 1, h200), 3) == 0.435
    assert round(peak.mfu(causal, 554_000, 1, h200), 3) == 0.403
