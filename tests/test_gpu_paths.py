"""The CUDA/NCCL paths, tested on CPU wherever their condition can be produced: CUDA's optimizer kernels forced on a
tensor-parallel model, the process group's backend string, the container's environment, the peak table, TF32, the
evaluation batch, the device a GPU site asks for (docs/gpu.md names each finding), and bench/gpu_paths.py's checks, each
comparison shown to fail on a deliberately broken input."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tarfile
import time

import pytest
import torch
import torch.distributed as dist

from conftest import REPO, run_dir_of, train_here
from scalelm.config import ModelConfig, OptimConfig
from scalelm.errors import ConfigError
from scalelm.launch.container import passed_environment
from scalelm.measure.peak import cuda_peak_flops
from scalelm.model import gpu_ops
from scalelm.model.transformer import TransformerLM
from scalelm.optim import build_optimizer
from scalelm.parallel.data import materialise
from scalelm.parallel.env import backend_for, pick_device
from scalelm.parallel.numerics import matmul_precision
from scalelm.parallel.tensor import apply_tp
from scalelm.study.workflow import Study
from scalelm.train.evaluation import eval_rows
from test_study import local_config


@pytest.fixture
def one_rank_group():
    """A process group of one rank (gloo) in this process, as torchrun would start it."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_tp_without_fsdp_steps_with_cudas_optimizer_kernels(one_rank_group):
    """Finding 1: TP leaves the embedding, norms and head plain beside DTensor blocks; CUDA's default AdamW kernel
    (foreach) got both in one call and failed at the first step. One group per tensor type takes either kernel."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_ff=32, dropout=0.0), 40)
    apply_tp(model, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)), False, False)
    inputs = torch.randint(0, 40, (2, 8))

    def step(optimizer) -> None:
        model(inputs, inputs).backward()
        optimizer.step()
        optimizer.zero_grad()

    mixed = torch.optim.AdamW(model.parameters(), foreach=True)  # what AdamW did on CUDA before
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        step(mixed)
    optimizer = build_optimizer(model, OptimConfig(), 1e-3)
    kinds = [{type(p).__name__ for p in group["params"]} for group in optimizer.param_groups]
    assert sorted(map(sorted, kinds)) == [["DTensor"], ["Parameter"]] and optimizer.defaults["fused"]
    step(optimizer)
    for group in optimizer.param_groups:  # CUDA's default kernel, forced
        group.update(fused=False, foreach=True)
    step(optimizer)


def test_the_stop_flag_is_agreed_in_the_background_and_read_one_check_later(one_rank_group):
    """Finding 14: the ranks' agreement on a stop was a blocking all-reduce after every step (a host barrier). Each
    check now reads the previous check's all-reduce and starts its own: a signal is seen one check later."""
    import signal

    from scalelm.train.preemption import StopFlag

    flag = StopFlag()
    try:
        assert not flag.raised()  # starts the first all-reduce
        flag.signal = signal.SIGUSR1
        assert not flag.raised()  # the first all-reduce saw no signal; this one does
        assert flag.raised() and flag._pending is None  # agreed: nothing left running
        flag.signal = None
        assert not flag.raised() and flag._pending is not None
        flag.close()
        assert flag._pending is None
    finally:
        flag.restore()


def test_the_backend_string_follows_the_device_and_cpu_offload():
    """Finding 2: FSDP's CPU offload keeps gradients on the host; their norm needs a CPU backend beside NCCL."""
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 1)) == "nccl"
    assert backend_for(torch.device("cuda", 1), cpu_collectives=True) == "cuda:nccl,cpu:gloo"


def test_deterministic_training_fixes_cublas_workspace(tiny_config, monkeypatch):
    """Finding 3: cuBLAS refuses deterministic mode unless CUBLAS_WORKSPACE_CONFIG is set before it starts; and it
    reaches the container, like every NCCL_, TORCH_, CUDA_ and PYTORCH_ variable (finding 9). So does NCCL's Flight
    Recorder, on before the process group starts, dumping into the run's autopsy directory
    (scalelm.hang.flight_recorder)."""
    recorder = (
        "CUBLAS_WORKSPACE_CONFIG",
        "TORCH_FR_BUFFER_SIZE",
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "TORCH_FR_DUMP_TEMP_FILE",
    )
    for name in recorder:
        monkeypatch.setenv(name, "")  # so that the test's end removes what the training sets
        monkeypatch.delenv(name)
    config = tiny_config("deterministic", train__deterministic=True, train__max_steps=2)
    train_here(config)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(run_dir_of(config) / "autopsy" / "fr_trace_rank_")
    assert int(os.environ["TORCH_FR_BUFFER_SIZE"]) > 0 and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    host = {
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "NCCL_IB_TIMEOUT": "22",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "UCX_TLS": "rc",
        "NCCL_SOCKET_IFNAME": "ib0",
        "GLOO_SOCKET_IFNAME": "ib0",
        "OMP_NUM_THREADS": "8",
        "WANDB_API_KEY": "secret",
        "HF_TOKEN": "secret",
        "HOME": "/home/u",
        "LD_PRELOAD": "/tmp/x.so",
    }
    passed = passed_environment(host)
    assert sorted(passed) == sorted(set(host) - {"WANDB_API_KEY", "HF_TOKEN", "HOME", "LD_PRELOAD"})


@pytest.mark.parametrize(
    "name, precision, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H200", "bf16", 989.0),
        ("NVIDIA H200 NVL", "bf16", 835.0),  # once matched "H200"
        ("NVIDIA GH200 480GB", "fp32", 494.0),
        ("NVIDIA A100-SXM4-40GB", "bf16", 312.0),
        ("NVIDIA A40", "bf16", 150.0),
        ("NVIDIA RTX A4000", "bf16", None),  # once matched "A40"
        ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "bf16", None),  # a slice: once the whole GPU's peak
    ],
)
def test_the_peak_table_matches_whole_names_and_knows_no_mig_slice(name, precision, tflops):
    """Finding 16."""
    peak = cuda_peak_flops(name, precision)
    assert (peak / 1e12 if peak else None) == tflops


def test_fp32_on_cuda_runs_on_tf32_tensor_cores_and_the_cpu_keeps_ieee_fp32():
    """Finding 5: MFU divides by the TF32 peak, so the matmuls must use it; the CPU calibration measures IEEE fp32."""
    before = torch.get_float32_matmul_precision()
    try:
        assert matmul_precision(torch.device("cuda", 0), torch.float32) == "high"
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
        assert matmul_precision(torch.device("cuda", 0), torch.bfloat16) == "highest"
        assert matmul_precision(torch.device("cpu"), torch.float32) == "highest"
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


def test_an_evaluation_batch_is_bounded_in_tokens():
    """Finding 7: 256 sequences of 1024 tokens and a 33k vocabulary made logits of about 90 GB."""
    assert eval_rows(256, 32, 16384) == 256  # the course's evaluation is unchanged
    assert eval_rows(256, 1024, 16384) == 16
    assert eval_rows(8, 100_000, 16384) == 1
    assert eval_rows(256, 1024, None) == 256


def test_a_site_with_gpus_asks_every_experiment_for_cuda(tmp_path):
    """Finding 10: `device: auto` trained on the CPU, for hours, when a job saw no GPU; a GPU site asks for CUDA, so
    such a job fails at once with a clear error."""
    import yaml

    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"gpus_per_node": 4, "peak_tflops": 400.0}))
    config = local_config()
    config["site"] = str(site)
    config["experiments"]["fsdp"]["training"] = {"train": {"peak_tflops": 100.0}}
    study = Study(config, on_login_node=False)
    assert {e.config.device for e in study.matrix.values()} == {"cuda"}
    assert {e.config.device for e in Study(local_config()).matrix.values()} == {"auto"}
    # the site's peak for MFU, unless the experiment names its own
    peaks = {e.name: e.config.train.peak_tflops for e in study.matrix.values()}
    assert peaks["fsdp"] == 100.0 and {p for name, p in peaks.items() if name != "fsdp"} == {400.0}
    assert study.matrix["ddp", "1"].settings["train"]["peak_tflops"] == 400.0  # what train.yaml holds
    # finding 11: the launcher's srun step asks for the GPUs, with or without a container
    wildcards = type("Wildcards", (), {"experiment": "ddp", "seed": "1"})
    assert "--gpu" in study.launch_args(wildcards).split()
    assert "--gpu" not in Study(local_config()).launch_args(wildcards).split()
    # ... and a job without a GPU, or with a CPU-only torch (an aarch64 node's pip wheel), names what it has
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"no CUDA GPU is visible \(torch .*(CPU-only build|built for CUDA)"):
            pick_device("cuda", 0)


def test_on_cuda_each_timed_span_waits_for_its_work_and_each_peak_is_its_own(monkeypatch):
    """Findings 6 and 8: the host runs ahead of the GPU, so a clock read needs the queued work done first; and the
    CUDA peak is reset after an evaluation or checkpoint, which would otherwise be every later interval's peak."""
    from scalelm.measure.device import Stopwatch

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    clock = Stopwatch(torch.device("cuda", 0))
    with clock.paused():
        calls.append("evaluate")
    clock.lap()
    assert calls == ["sync", "evaluate", "sync", "reset", "sync"]
    calls.clear()
    with Stopwatch(torch.device("cpu")).paused():
        pass
    assert calls == []


def test_a_tp_ranks_own_dropout_stream_never_reads_a_number_back_from_the_gpu(monkeypatch):
    """Finding 4: the stream's seed was drawn on the device and read back, a GPU->host synchronisation twice per
    block. It is drawn from the CPU generator, which every rank of a TP group holds alike."""
    from scalelm.model import cpu_ops

    draws, seeds = [], []
    randint = torch.randint
    monkeypatch.setattr(torch, "randint", lambda *a, **k: draws.append(k.get("device")) or randint(*a, **k))
    monkeypatch.setattr(torch.random, "fork_rng", lambda **k: contextlib.nullcontext())  # no CUDA generator here
    monkeypatch.setattr(torch, "manual_seed", seeds.append)
    with cpu_ops.own_random_stream(2, torch.device("cuda", 0)):
        pass
    assert draws == [None] and len(seeds) == 1


class FakeNvml:
    """pynvml as a MIG slice answers it: memory yes, utilisation and power NOT_SUPPORTED."""

    class NVMLError(Exception):
        pass

    def __init__(self):
        self.opened = []

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.opened.append(uuid)
        return uuid

    def nvmlDeviceGetUtilizationRates(self, handle):
        raise self.NVMLError("Not Supported")

    def nvmlDeviceGetMemoryInfo(self, handle):
        return type("Memory", (), {"used": 3 * 2**20})()

    def nvmlDeviceGetPowerUsage(self, handle):
        raise self.NVMLError("Not Supported")


def test_the_gpu_sampler_survives_unsupported_readings_and_names_gpus_by_uuid(monkeypatch):
    """Finding 12: one unsupported reading ended the sampler for the rest of the run; and GPUs were found by CUDA
    index through CUDA_VISIBLE_DEVICES, which the container drops and Slurm's cgroups renumber."""
    import sys

    from scalelm.measure import monitor, sampler

    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    readings = sampler.GpuSampler(["GPU-5c0e", "MIG-77aa"])
    assert readings.sample() == [
        {"gpu": "GPU-5c0e", "util_percent": None, "memory_used_mb": 3.0, "power_w": None},
        {"gpu": "MIG-77aa", "util_percent": None, "memory_used_mb": 3.0, "power_w": None},
    ]
    assert fake.opened == ["GPU-5c0e", "MIG-77aa"]

    # nvidia-smi's figure: NVML's v2 query sets the driver's reserved memory apart, v1's `used` includes it
    class FakeNvmlV2(FakeNvml):
        nvmlMemory_v2 = 0x02000028

        def nvmlDeviceGetMemoryInfo(self, handle, version=None):
            reserved = 615 * 2**20 if version != self.nvmlMemory_v2 else 0
            return type("Memory", (), {"used": 3 * 2**20 + reserved})()

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvmlV2())
    assert [gpu["memory_used_mb"] for gpu in sampler.GpuSampler(["GPU-5c0e"]).sample()] == [3.0]

    properties = type("Properties", (), {"uuid": "5c0e1d2a-0000-1111-2222-333344445555"})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # whatever it says, the UUID names the device
    assert monitor.device_uuid(torch.device("cuda", 0)) == "GPU-5c0e1d2a-0000-1111-2222-333344445555"
    assert monitor.device_uuid(torch.device("cpu")) is None


def test_jobs_that_need_no_gpu_go_to_the_sites_cpu_partition(tmp_path):
    """Finding 20: consolidation and evaluation on a GPU partition are refused by some sites, charged a whole GPU
    node by others."""
    import yaml

    site = tmp_path / "site.yaml"
    site.write_text(
        yaml.safe_dump({"gpus_per_node": 4, "partition": "dc-gpu", "cpu_partition": "dc-cpu", "reservation": "course"})
    )
    config = local_config()
    config["site"] = str(site)
    study = Study(config, on_login_node=False)
    assert study.job_resources() == {"slurm_partition": "dc-cpu", "slurm_extra": ""}
    training = study.train_resources()
    assert training["slurm_partition"] == "dc-gpu" and "--reservation=course" in training["slurm_extra"]


def test_fsdp_in_a_pipeline_keeps_its_gathered_weights_unless_told_otherwise():
    """Finding 13: resharding after each forward made every micro-batch of a pipeline gather the weights again."""
    from scalelm.config import ParallelConfig

    assert ParallelConfig().reshards(1) and not ParallelConfig().reshards(2)
    assert ParallelConfig(reshard_after_forward=True).reshards(2)
    assert not ParallelConfig(reshard_after_forward=False).reshards(1)


def test_with_cpu_offload_parameters_are_materialised_on_the_host_and_buffers_on_the_device():
    """FSDP refuses CPU offload unless the parameters start on the host (found by the proof kit on an H200); the
    buffers it leaves alone must be on the device. `meta` stands in for a device that is not the CPU."""
    with torch.device("meta"):
        model = TransformerLM(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_ff=32), 50)
    materialise(model, torch.device("meta"), cpu_offload=True)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert {b.device.type for b in model.buffers()} == {"meta"}
    materialise(model, torch.device("cpu"), cpu_offload=False)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cpu"}


@pytest.mark.slow
def test_the_gpu_proof_kit_runs_on_cpu_and_reports_cuda_checks_as_not_applicable(tmp_path):
    """bench/gpu_probe.py, bench/gpu_smoke.sh and bench/gpu_paths.py in --cpu mode, as CI runs them so the kit
    cannot rot (side by side: each is mostly one core's work): every check that a CPU can run passes, every
    CUDA-only one says N/A (never PASS); gpu_paths.py runs each of its checks in its own process on tiny shapes, and
    brings back two files only (paths.json, one result per check with its figures, and logs.tgz), as the lent GPU
    machine returns at most 8 files of at most 16 MiB."""
    env = {**os.environ, "PYTHONPATH": f"src{os.pathsep}.", "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    paths_out = tmp_path / "paths"
    commands = {
        "probe": [sys.executable, "bench/gpu_probe.py", "--cpu", "--out", str(tmp_path / "probe")],
        "smoke": ["bash", "bench/gpu_smoke.sh", str(tmp_path / "smoke"), "--cpu"],
        "paths": [
            sys.executable,
            "bench/gpu_paths.py",
            "--cpu",
            "--out",
            str(paths_out),
            "--work",
            str(tmp_path / "work"),
        ],
    }
    running = {
        name: subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, command in commands.items()
    }
    outputs = {name: process.communicate(timeout=900) for name, process in running.items()}
    for name, process in running.items():
        assert process.returncode == 0, (name, outputs[name][0][-3000:] + outputs[name][1][-3000:])
    probed = {r["check"]: r["status"] for r in json.loads((tmp_path / "probe/probe.json").read_text())}
    cuda_only = {"a.ceilings", "d.sync_audit", "f.deterministic", "i.memory", "j.nvml", "l.step_profile"}
    assert {name for name, status in probed.items() if status == "N/A"} == cuda_only
    assert {name for name, status in probed.items() if status == "PASS"} == set(probed) - cuda_only
    smoked = {r["check"]: r["status"] for r in json.loads((tmp_path / "smoke/smoke.json").read_text())}
    assert smoked == {
        "course": "PASS",
        "fp32": "N/A",
        "course_compiled": "N/A",
        "stop_resume": "PASS",
        "evaluate_on_cpu": "PASS",
        "gpt2": "N/A",
        "gpt2_recompute": "N/A",
        "plan_vs_peak": "N/A",
        "monitor_vs_smi": "N/A",
        "compiled_cpu": "PASS",
    }
    for name in ("probe", "smoke"):  # one line per check, its status first
        assert all(
            line.split()[0] in ("PASS", "N/A")
            for line in outputs[name][0].splitlines()
            if line.startswith(("PASS", "N/A", "FAIL"))
        )
    returned = {path.name: path.stat().st_size for path in paths_out.rglob("*")}
    assert returned.keys() == {"paths.json", "logs.tgz"} and max(returned.values()) < 16 * 2**20
    recorded = json.loads((paths_out / "paths.json").read_text())
    results = {r["check"]: r for r in recorded["checks"]}
    assert list(results) == [
        "A.versions",
        "J.moe",
        "B.nccl",
        "C.ring",
        "F.lightning",
        "E.levers",
        "H.baseline",
        "G.world8",
        "D.stack",
        "I.share",
    ]
    assert {r["status"] for r in results.values()} == {"PASS"}, {n: r["status"] for n, r in results.items()}
    assert recorded["summary"] == "10 PASS, 0 FAIL, 0 N/A, 0 SKIPPED" and recorded["logs"]["truncated"] == {}
    with tarfile.open(paths_out / "logs.tgz") as logs:
        names = set(logs.getnames())
    assert {"C.ring.log", "I.smoke.rank1.log", "E.levers.json", "farm.stack.log", "farm.stack.json"} <= names
    assert {"farm.configured/mfu.json", "farm.bf16_params/mfu.json"} <= names
    farm = recorded["farm"]  # the compile farm beside A, J, B, C, F, through E's and D's own code (eager here)
    assert list(farm) == ["farm.configured", "farm.bf16_params", "farm.stack"]
    assert all(process["finished"] and process["exit"] == 0 for process in farm.values()), farm
    warmed = {**farm["farm.configured"]["compile"], **farm["farm.bf16_params"]["compile"]}
    assert set(warmed) == {"configured", "cudnn_attention"} and all(
        v["compile"]["configured"] is False for v in warmed.values()
    )
    assert farm["farm.stack"]["compile"]["steps"] == 3 and farm["farm.stack"]["compile"]["compiled"] is False
    assert "sdp_priority_order" in results["A.versions"]["figures"]
    ring = results["C.ring"]["figures"]
    assert ring["gpt2"]["ring_host_syncs"] == ring["cp_long"]["ring_dropout_host_syncs"] == 0
    assert not any(ring["graph_breaks"].values()) and ring["gpt2"]["ring_cp4_error"] <= 1e-5
    assert ring["gpt2"]["host_syncs_seen_by"] == "dispatch mode" and results["C.ring"]["compile"]["unique_graphs"]
    assert results["B.nccl"]["figures"]["hang"]["exit"] == 76
    stacked = results["D.stack"]["figures"]["agreement"]  # on one batch it learns: the fall, then the gradients
    assert stacked["alike"] and stacked["worst_relative"] <= 1e-4 and stacked["fall"]["reference"]["end"] > 0.5
    assert {"fsdp8_selective", "cp4_long", "pp2_stage0"} == set(results["G.world8"]["figures"])
    products = results["H.baseline"]["figures"]["output_products"]["products"]
    assert (products["output_unpadded"]["shape"][2], products["output_padded"]["shape"][2]) == (33_278, 33_280)
    assert results["J.moe"]["figures"]["worst_relative"] <= 1e-4
    engines = results["F.lightning"]["figures"]["agreement"]  # on learnable data: the loss falls
    assert engines["alike"] and engines["fall"]["reference"]["end"] > 0.5
    shared = results["I.share"]["figures"]  # several ranks (gloo here): the smoke, then a layout against one process
    assert all(
        shared["smoke"][rank][op]
        for rank in ("0", "1")
        for op in ("all_reduce", "all_to_all_single", "batch_isend_irecv")
    )
    layout = shared["moe_ep"]
    assert layout["alike"] and layout["agreement"]["worst_relative"] <= 1e-4 and len(layout["losses"]) == 4
    assert layout["agreement"]["fall"]["reference"]["end"] > 0.3 and "tokens_per_s" not in json.dumps(shared)
    levers = results["E.levers"]["figures"]  # interleaved in one process: each variant's rounds and MFU
    assert set(levers) == {"configured", "cudnn_attention"}
    assert all(v["rounds"] == 2 and v["mfu"] > 0 for v in levers.values()) and "resolved" in levers["cudnn_attention"]


def test_the_output_projection_pads_its_rows_on_cuda_and_computes_the_same(monkeypatch):
    """The vocabulary's 33,278 rows are padded to a multiple of 64 for cuBLAS's Hopper kernels (the proof kit found
    the head's matmuls on older ones); logits and every gradient are those of the plain F.linear. The padding is
    forced onto the CPU here; elsewhere it is off (so the CPU's exact parity and resume tests see no change)."""
    monkeypatch.setattr(gpu_ops, "PADDED_DEVICES", ("cpu",))
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, requires_grad=True)
    weight, bias = torch.randn(33_278 // 100, 16, requires_grad=True), torch.randn(33_278 // 100, requires_grad=True)
    padded = gpu_ops.aligned_linear(x, weight, bias)
    assert padded.shape == (3, 5, 332)
    grads = torch.autograd.grad(padded.square().sum(), (x, weight, bias))
    plain = torch.nn.functional.linear(x, weight, bias)
    expected = torch.autograd.grad(plain.square().sum(), (x, weight, bias))
    torch.testing.assert_close(padded, plain)
    for mine, theirs in zip(grads, expected):  # to fp32 rounding: the padded products sum in another order
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-4)
    # the model's head takes it for logits and for the loss
    model = TransformerLM(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_ff=32, dropout=0.0), 100).eval()
    tokens = torch.randint(0, 100, (2, 8))
    with torch.no_grad():
        logits = model(tokens)
        loss = model(tokens, tokens)
    assert logits.shape == (2, 8, 100)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()))


def test_compiling_for_cuda_without_a_c_compiler_is_a_clear_error_naming_the_devel_image(monkeypatch):
    """Triton needs a C compiler at run time, which PyTorch's -runtime image lacks: say so before training."""
    from scalelm.errors import ConfigError
    from scalelm.parallel import compile as compiling

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(compiling.shutil, "which", lambda name: None)
    with torch.device("meta"):
        model = TransformerLM(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_ff=32), 50)
    with pytest.raises(ConfigError, match=r"needs a C compiler .*cudnn9-devel"):
        compiling.apply_compile(model, torch.device("cuda"))
    compiling.apply_compile(model, torch.device("cpu"))  # torch's own check there


def test_run_json_names_the_cpu_and_the_gpu_driver(monkeypatch):
    """The results history tells two machines apart by CPU model and NVIDIA driver (NVML's answer, a fake here);
    where NVML cannot say, the fact is missing, not the run."""
    import sys

    from scalelm.train import provenance

    class FakeNvmlDriver(FakeNvml):
        def nvmlSystemGetDriverVersion(self):
            return b"580.159.04"  # older bindings answer bytes

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvmlDriver())
    assert provenance.driver_version() == "580.159.04"
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())  # no such query: an old binding
    assert provenance.driver_version() is None
    assert provenance.device_facts()["cpu"] == provenance.cpu_model() and provenance.cpu_model()
    assert provenance.device_facts()["architecture"] == platform.machine()


def test_energy_comes_from_nvmls_counter_else_integrated_power_and_rapl_packages_wrap(monkeypatch, tmp_path):
    """A GPU's energy counter (millijoules); power integrated where a GPU has no counter; a MIG slice refused (NVML
    reads its whole GPU); RAPL's package zones only (not their subzones), each wrapping at its range; and where
    nothing can be read, None with the reason."""
    import sys

    from scalelm.measure import energy

    class FakeNvmlEnergy(FakeNvml):
        def __init__(self):
            super().__init__()
            self.millijoules = 1_000_000

        def nvmlDeviceGetTotalEnergyConsumption(self, handle):
            self.millijoules += 2500
            return self.millijoules

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvmlEnergy())
    meter = energy.EnergyMeter.open("GPU-5c0e", reads_machine=False)
    assert meter.source == "nvml energy counter"
    with meter.paused():  # the counter moves 2.5 J per reading
        pass
    assert meter.lap() == pytest.approx(5.0)  # 7.5 J from the start, 2.5 J of them paused
    assert meter.lap() == pytest.approx(2.5)

    class FakeNvmlPower(FakeNvml):
        def nvmlDeviceGetTotalEnergyConsumption(self, handle):
            raise self.NVMLError("Not Supported")

        def nvmlDeviceGetPowerUsage(self, handle):
            return 300_000  # mW

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvmlPower())
    began = time.monotonic()
    meter = energy.EnergyMeter.open("GPU-5c0e", reads_machine=False)
    assert meter.source == "nvml power, integrated"
    time.sleep(0.25)
    # 300 W over the meter's span, which lies within the test's: bounds a loaded machine cannot break
    assert 300 * 0.25 <= meter.lap() <= 300 * (time.monotonic() - began)
    meter.close()

    slice_meter = energy.EnergyMeter.open("MIG-77aa", reads_machine=False)
    assert slice_meter.lap() is None and "MIG slice" in slice_meter.unknown

    root = tmp_path / "powercap"
    for zone, counter in (("intel-rapl:0", 2**20 - 100), ("intel-rapl:0:0", 5), ("intel-rapl:1", 40)):
        (root / zone).mkdir(parents=True)
        (root / zone / "max_energy_range_uj").write_text(str(2**20 - 1))
        (root / zone / "energy_uj").write_text(str(counter))
    monkeypatch.setattr(energy, "POWERCAP", root)
    assert energy.EnergyMeter.open(None, reads_machine=False).lap() == 0.0  # another rank reads the machine
    meter = energy.EnergyMeter.open(None, reads_machine=True)
    assert meter.source == "rapl packages"
    (root / "intel-rapl:0" / "energy_uj").write_text("400")  # wrapped: 100 + 400 uJ
    (root / "intel-rapl:0:0" / "energy_uj").write_text("900000")  # inside package 0: not counted again
    (root / "intel-rapl:1" / "energy_uj").write_text("1040")
    assert meter.lap() == pytest.approx(1500e-6)

    monkeypatch.setattr(energy, "POWERCAP", tmp_path / "none")
    missing = energy.EnergyMeter.open(None, reads_machine=True)
    assert missing.lap() is None and "no RAPL package zones" in missing.unknown


@pytest.fixture
def bench(monkeypatch):
    """A bench script imported as a module, as it is run: the repository and bench/ on the path."""
    import importlib

    monkeypatch.syspath_prepend(str(REPO))
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    return lambda name: importlib.import_module(f"bench.{name}")


def test_the_gpu_paths_script_refuses_an_unknown_check_and_fails_when_a_check_was_skipped(bench, tmp_path, capsys):
    """A mistyped `--only` ran nothing and reported "0 of 0 not failed"; a spent `--budget`, "8 of 8 not failed":
    both exit 0. The first is refused naming the checks and the closest; a check the budget left unrun is SKIPPED,
    the last line counts each status and the exit status is 1 (nothing starts: the budget is below a check's 10 s)."""
    gpu_paths = bench("gpu_paths")
    work = ["--work", str(tmp_path / "work")]
    with pytest.raises(SystemExit) as refused:
        gpu_paths.main(["--cpu", "--out", str(tmp_path / "typo"), "--only", "A", "C.rnig", *work])
    error = capsys.readouterr().err
    assert refused.value.code == 2 and not (tmp_path / "typo").exists() and not (tmp_path / "work").exists()
    assert "--only: unknown check 'C.rnig' (did you mean 'C.ring'?); choose from A.versions, B.nccl, C.ring" in error
    assert "(or its letter, A, B, C, D, E, F, G, H, I, J)" in error

    assert gpu_paths.main(["--cpu", "--out", str(tmp_path / "spent"), "--budget", "5", "--only", "A", "C", *work]) == 1
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == "paths on cpu: 0 PASS, 0 FAIL, 0 N/A, 2 SKIPPED; skipped: A.versions, C.ring"
    assert [line.split()[:2] for line in printed[:-1]] == [["SKIPPED", "A.versions"], ["SKIPPED", "C.ring"]]
    recorded = json.loads((tmp_path / "spent/paths.json").read_text())
    assert [(r["check"], r["status"]) for r in recorded["checks"]] == [("A.versions", "SKIPPED"), ("C.ring", "SKIPPED")]

    statuses = ["PASS", "FAIL", "N/A", "SKIPPED", "PASS"]
    results = [{"check": f"{letter}.x", "status": s} for letter, s in zip("ABCDE", statuses)]
    assert gpu_paths.tally(results) == ("2 PASS, 1 FAIL, 1 N/A, 1 SKIPPED; fail: B.x; skipped: D.x", 1)
    assert gpu_paths.tally([r for r in results if r["status"] in ("PASS", "N/A")]) == (
        "2 PASS, 0 FAIL, 1 N/A, 0 SKIPPED",
        0,
    )


def short_of_cold(checks: dict) -> dict[str, tuple[float, float]]:
    """The checks whose limit on a GPU is below their cold estimate: name: (limit, estimate)."""
    return {name: (c.seconds, c.cold.seconds) for name, c in checks.items() if c.seconds < c.cold.seconds}


def late_in_farm(farm: dict, limits: dict[str, float], beside: tuple[str, ...]) -> list[str]:
    """The farm's processes whose cold estimate does not fit the limits of the checks beside it."""
    window = sum(limits[name] for name in beside)
    return [name for name, process in farm.items() if process.cold.seconds > window]


def test_every_limit_holds_its_cold_estimate_and_the_call_fits_one_command(bench):
    """Review 4, finding 1: the limits were sized as if every compile were cached, and a test kept only their sum. Each
    check's limit holds its cold estimate on an H100: start-up, the graph sets it compiles itself at COMPILE_S each,
    those it loads from the farm at CACHED_S, the rest. Each farm process's estimate fits the limits of the checks
    beside it, so that what E, H and D load is compiled by then, and every check that loads a graph set is served by a
    farm process. The sum with the runner's margin fits one command, and the command the lease beside the machine's
    start. Shown to fail: a limit too small for its compiles, D compiling its stack itself, a farm process holding
    one more compile."""
    gpu_paths = bench("gpu_paths")
    checks, limits = gpu_paths.CHECKS, gpu_paths.plan(list(gpu_paths.RUN_ORDER), cpu=False)
    assert sorted(gpu_paths.RUN_ORDER) == sorted(checks) and limits.keys() == checks.keys()
    assert short_of_cold(checks) == {}
    levers, stack = checks["E.levers"], checks["D.stack"]
    assert levers.cold.seconds == gpu_paths.START_S + 4 * gpu_paths.CACHED_S + levers.cold.work_s
    squeezed = dataclasses.replace(levers, seconds=levers.cold.seconds - 1)
    assert short_of_cold({"E.levers": squeezed}) == {"E.levers": (squeezed.seconds, levers.cold.seconds)}
    unfarmed = dataclasses.replace(stack, cold=dataclasses.replace(stack.cold, cached=0, compiles=("stack",)))
    assert list(short_of_cold({"D.stack": unfarmed})) == ["D.stack"]

    beside, farm = gpu_paths.BESIDE_FARM, gpu_paths.FARM
    assert late_in_farm(farm, limits, beside) == []
    assert farm["farm.configured"].cold.compiles == ("gpt2_small", "adamw")
    heavier = dataclasses.replace(farm["farm.configured"].cold, compiles=("gpt2_small", "adamw", "gpt2_small"))
    assert late_in_farm({"farm.configured": dataclasses.replace(farm["farm.configured"], cold=heavier)}, limits, beside)
    served = {name for process in farm.values() for name in process.serves}
    assert {name for name, c in checks.items() if c.cold.cached} == served == {"E.levers", "H.baseline", "D.stack"}

    assert sum(limits.values()) + gpu_paths.MARGIN_S <= gpu_paths.COMMAND_S <= 600
    assert gpu_paths.COMMAND_S + gpu_paths.MACHINE_START_S <= gpu_paths.LEASE_S
    order = gpu_paths.RUN_ORDER  # the light ones beside the farm; E right after it with the most time; I last
    assert order[: len(beside)] == beside and order[len(beside)] == "E.levers" and order[-1] == "I.share"
    assert limits["E.levers"] == max(limits.values()) and limits["A.versions"] == 30 and limits["G.world8"] == 40


def test_the_cold_budget_in_the_docs_is_the_codes(bench):
    """docs/gpu.md's cold budget gives, per check and per farm process, the start-up, cold compiles, graph sets from
    the farm, the rest, the estimate and the limit: the code's figures, so that neither changes alone; and its table of
    estimates per compile is COMPILE_S's, CACHED_S's and the start-ups'."""
    gpu_paths = bench("gpu_paths")
    text = (REPO / "docs" / "gpu.md").read_text()
    section = text[text.index("**The cold budget**") : text.index("**Several ranks on one GPU**")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines() if line[:2] == "| "]
    per_check = {row[1]: row for row in rows if len(row) == 8 and row[0] != "order"}
    expected = {}
    for order, name in enumerate(gpu_paths.RUN_ORDER, 1):
        check = gpu_paths.CHECKS[name]
        expected[name.replace(".", " ")] = (str(order), check.cold, f"{check.seconds:g}")
    for name, process in gpu_paths.FARM.items():
        expected[name] = ("farm", process.cold, "within A-F's 190")
    for name, (order, cold, limit) in expected.items():
        compiles = ", ".join(cold.compiles) or "none"
        figures = [f"{cold.start_s:g}", compiles, str(cold.cached), f"{cold.work_s:g}", f"{cold.seconds:g}", limit]
        assert per_check.pop(name) == [order, name, *figures], name
    assert per_check == {}
    beside = sum(gpu_paths.CHECKS[name].seconds for name in gpu_paths.BESIDE_FARM)
    assert beside == 190 and f"{sum(c.cold.seconds for c in gpu_paths.CHECKS.values()):g} s" in section
    estimates = {row[0].split("`")[1] if "`" in row[0] else row[0]: row[1] for row in rows if len(row) == 3}
    assert estimates.pop("FIRST_IMPORT_S") == f"{gpu_paths.FIRST_IMPORT_S}"
    assert estimates.pop("START_S") == f"{gpu_paths.START_S}" and estimates.pop("CACHED_S") == f"{gpu_paths.CACHED_S}"
    compile_rows = [row for row in rows if len(row) == 3 and "(`COMPILE_S`)" in row[0]]
    assert sorted(int(row[1]) for row in compile_rows) == sorted(gpu_paths.COMPILE_S.values())


def test_the_gpu_paths_runner_ends_a_hung_check_with_its_children_and_brings_back_two_files(bench, tmp_path, capsys):
    """Review 3, findings 1 and 3: `subprocess.run(timeout=)` killed a check's process only, leaving what it started
    (a training on the GPU) running into the next check; and the call wrote hundreds of files into the machine's
    output folder, of which at most 8 come back. The rehearsal's hung check ignores SIGTERM and has a child of its
    own: both are gone after its limit (SIGKILL to its process group), the check FAILs, a check left no time is
    SKIPPED, the exit status is 1, and --out holds paths.json and logs.tgz only."""
    gpu_paths = bench("gpu_paths")
    out, work = tmp_path / "out", tmp_path / "work"
    arguments = ["--cpu", "--rehearse", "--only", "A", "Z", "--budget", "3", "--out", str(out), "--work", str(work)]
    assert gpu_paths.main(arguments) == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        "paths on cpu: 0 PASS, 1 FAIL, 0 N/A, 1 SKIPPED; fail: Z.hang; skipped: A.versions"
    )
    hung, child = map(int, (work / "call" / "Z.hang.pids").read_text().split())
    assert not _alive(hung) and not _alive(child)
    recorded = json.loads((out / "paths.json").read_text())
    ended = recorded["checks"][-1]
    assert ended["figures"].startswith("its limit of 3 s ran out") and ended["process_group"] == {
        "running": sorted([hung, child]),
        "killed": sorted([hung, child]),
        "left": [],
    }
    assert {p.name for p in out.iterdir()} == {"paths.json", "logs.tgz"}
    assert recorded["budget_s"] == 3 and recorded["limits_s"] == {"A.versions": 120, "Z.hang": 2.0}


def _alive(pid: int) -> bool:
    """A process that runs (a zombie waiting for its parent runs nothing)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_the_farm_warms_each_of_es_variants_once_through_gpu_mfu(bench, tmp_path):
    """Review 4, finding 1: the farm compiles every graph set E loads, each variant once, through bench/gpu_mfu.py's
    own --warm-only (the same build code and dynamo settings as E's, so that the caches hit), each process one of the
    pair's models first; on a CPU E's CPU levers, eager. What a process wrote is read back as its record, and a
    variant it had not finished says so. A farm starts for a chosen check it serves, beside a light check."""
    gpu_paths, gpu_mfu = bench("gpu_paths"), bench("gpu_mfu")
    for device, levers in (("cuda", gpu_mfu.LEVERS), ("cpu", gpu_mfu.CPU_LEVERS)):
        per_process = [process.variants[device] for process in gpu_paths.FARM.values() if process.variants]
        warmed = [variant for variants in per_process for variant in variants]
        assert sorted(warmed) == sorted(levers) and len(set(warmed)) == len(warmed)
        assert {variants[0] for variants in per_process} == set(levers[:2])
    call = tmp_path / "call"
    call.mkdir()
    command = gpu_paths.farm_command("farm.configured", call, tmp_path, cpu=False)
    assert command[1] == str(REPO / "bench" / "gpu_mfu.py") and command[2:] == [
        str(call / "farm.configured"),
        *["--warm-only", "--only", "configured", "--only", "compiled_optimizer", "--warmup", "2"],
    ]
    stack = gpu_paths.farm_command("farm.stack", call, tmp_path, cpu=True)
    assert stack[1:] == [str(gpu_paths.SCRIPT), "--farm-stack", "--work", str(call), "--cache", str(tmp_path), "--cpu"]

    assert gpu_mfu.main(gpu_paths.farm_command("farm.configured", call, tmp_path, cpu=True)[2:]) == 0
    configured = gpu_paths.farm_compiles("farm.configured", call, cpu=True)["configured"]
    assert configured["compile"]["configured"] is False and configured["build_and_warmup_s"] > 0
    assert gpu_paths.farm_compiles("farm.bf16_params", call, cpu=True) == {
        "cudnn_attention": "not warm when the farm ended"
    }
    assert gpu_paths.farm_compiles("farm.stack", call, cpu=True)["missing"].startswith("no readable farm.stack.json")

    assert gpu_paths.farm_for(list(gpu_paths.RUN_ORDER)) == list(gpu_paths.FARM)
    assert gpu_paths.farm_for(["A.versions", "D.stack"]) == ["farm.stack"]
    assert gpu_paths.farm_for(["E.levers"]) == gpu_paths.farm_for(["A.versions", "C.ring"]) == []


# the farm's drill: a farm process writes its pid (and, hung, its child's), then finishes or hangs ignoring SIGTERM
FAKE_FARM = """import os, signal, subprocess, sys, time
if sys.argv[2] == "hang":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pids = [os.getpid(), subprocess.Popen(["sleep", "600"]).pid]
else:
    pids = [os.getpid()]
open(sys.argv[1] + ".partial", "w").write(" ".join(map(str, pids)))
os.replace(sys.argv[1] + ".partial", sys.argv[1] + ".pids")  # whole, for a check that reads it
if sys.argv[2] == "hang":
    time.sleep(600)
"""
# ... and a check: it says which of the farm's processes were alive when it started, and the deadline it was given
FAKE_CHECK = """import json, os, sys, time
call, name = sys.argv[1], sys.argv[2]
for _ in range(100):  # the hung farm process has started and written its pids
    if os.path.exists(os.path.join(call, "farm.configured.pids")):
        break
    time.sleep(0.05)
alive = []
for entry in sorted(os.listdir(call)):
    for pid in open(os.path.join(call, entry)).read().split() if entry.endswith(".pids") else ():
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        if stat[stat.rindex(")") + 2] != "Z":
            alive.append(int(pid))
figures = {"farm_alive": alive, "began": time.time(), "deadline": float(os.environ["SCALELM_GPU_PATHS_DEADLINE"])}
json.dump({"check": name, "status": "PASS", "figures": figures}, open(os.path.join(call, name + ".json"), "w"))
"""


def test_the_farm_runs_beside_the_light_checks_and_is_ended_before_e(bench, tmp_path, monkeypatch, capsys):
    """Review 4, finding 1: the farm starts at t = 0 in process groups of its own, runs beside the light checks, may
    take the time they leave, and is ended before E, so that E times a quiet GPU: a process that finished is
    recorded so, one that hangs (ignoring SIGTERM, with a child) is killed with its child, what they wrote kept in
    logs.tgz. E is told its deadline. Shown to fail: a farm not ended before E leaves E beside it."""
    gpu_paths = bench("gpu_paths")

    def farm_command(name, call, cache, cpu):
        return [sys.executable, "-c", FAKE_FARM, str(call / name), "hang" if name == "farm.configured" else "done"]

    monkeypatch.setattr(gpu_paths, "farm_command", farm_command)
    monkeypatch.setattr(
        gpu_paths, "command_of", lambda name, call, *_: [sys.executable, "-c", FAKE_CHECK, str(call), name]
    )
    monkeypatch.setattr(gpu_paths, "CPU_FACTOR", 0.15)  # A's limit, the farm's window: 4.5 s; E's: 21.75 s
    out, work = tmp_path / "out", tmp_path / "work"
    arguments = ["--cpu", "--only", "A", "E", "--out", str(out), "--work", str(work)]
    assert gpu_paths.main(arguments) == 0
    recorded = json.loads((out / "paths.json").read_text())
    farm, results = recorded["farm"], {r["check"]: r for r in recorded["checks"]}
    hung, child = map(int, (work / "call" / "farm.configured.pids").read_text().split())
    assert not _alive(hung) and not _alive(child)
    assert farm["farm.bf16_params"]["finished"] and farm["farm.bf16_params"]["exit"] == 0
    ended = farm["farm.configured"]
    assert not ended["finished"] and ended["exit"] == "ended" and ended["wall_s"] >= 4.5
    assert ended["process_group"] == {"running": sorted([hung, child]), "killed": sorted([hung, child]), "left": []}
    assert ended["compile"] == {"configured": "not warm when the farm ended"}  # E's CPU variant
    assert hung in results["A.versions"]["figures"]["farm_alive"]  # beside the farm
    levers = results["E.levers"]["figures"]
    told = levers["deadline"] - levers["began"]
    assert levers["farm_alive"] == [] and 0 < told <= results["E.levers"]["limit_s"] + 0.05  # limit_s: rounded to 0.1 s
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in printed[:4]] == [
        ["PASS", "A.versions"],
        ["FARM", "farm.configured"],
        ["FARM", "farm.bf16_params"],
        ["PASS", "E.levers"],
    ]
    with tarfile.open(out / "logs.tgz") as logs:
        assert {"farm.configured.log", "farm.bf16_params.log"} <= set(logs.getnames())

    monkeypatch.setattr(gpu_paths.Farm, "end", lambda self: {})  # broken: the farm is not ended before E
    try:
        assert gpu_paths.main(arguments) == 0
        beside = json.loads((out / "paths.json").read_text())["checks"][-1]
        hung, child = map(int, (work / "call" / "farm.configured.pids").read_text().split())
        assert beside["check"] == "E.levers" and beside["figures"]["farm_alive"] == [hung, child]
    finally:
        for pid in map(int, (work / "call" / "farm.configured.pids").read_text().split()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


def test_e_takes_its_budget_from_its_deadline_and_fails_only_where_gpu_mfu_says(bench, tmp_path, monkeypatch):
    """E hands bench/gpu_mfu.py the time the runner gives it, less E_MARGIN_S (so that it ends on its own before the
    runner's SIGTERM), and takes its verdict from gpu_mfu.failures: a later lever the budget left out is a note and E
    passes; the pair without a measured round fails (the old verdict failed both)."""
    gpu_paths, gpu_mfu = bench("gpu_paths"), bench("gpu_mfu")
    asked, outcome = [], {}

    def measure(names, cpu, work, rounds, steps, warmup, on_progress, budget_s=None):
        asked.append(budget_s)
        return outcome

    monkeypatch.setattr(gpu_mfu, "measure", measure)
    ctx = gpu_paths.Ctx(torch.device("cpu"), tmp_path, tmp_path, "E.levers")
    ctx.deadline = time.time() + 100
    outcome.update(configured={"mfu": 0.3}, cudnn_attention={"mfu": 0.31}, later={"skipped": "not started"})
    assert gpu_paths.levers(ctx) == outcome
    assert 100 - gpu_paths.E_MARGIN_S["cpu"] - 5 < asked[-1] <= 100 - gpu_paths.E_MARGIN_S["cpu"]
    outcome["cudnn_attention"] = {"cut_short": "0 of 2 rounds: the next did not fit the budget"}
    with pytest.raises(AssertionError, match="variants cudnn_attention failed"):
        gpu_paths.levers(ctx)
    ctx.deadline = None  # run alone, without the runner: no budget
    outcome["cudnn_attention"] = {"mfu": 0.31}
    gpu_paths.levers(ctx)
    assert asked[-1] is None


def test_the_logs_that_come_back_are_capped_cutting_the_largest_first(bench, tmp_path):
    """logs.tgz must stay under the 16 MiB a returned file may have: the largest logs are cut to one common length,
    keeping their head and their tail (where a traceback ends); paths.json names each cut file; no checkpoint or
    cache goes in."""
    gpu_paths = bench("gpu_paths")
    assert gpu_paths.kept_bytes({"a": 10, "b": 100, "c": 1000, "d": 5000}, 500) == {
        "a": 10,
        "b": 100,
        "c": 195,
        "d": 195,
    }
    assert gpu_paths.kept_bytes({"a": 10, "b": 100}, 500) == {"a": 10, "b": 100}
    folder = tmp_path / "call"
    (folder / "runs" / "r" / "checkpoints").mkdir(parents=True)
    (folder / "small.log").write_text("fine\n")
    (folder / "big.log").write_text("start\n" + "x" * 60_000 + "\nTraceback: the end\n")
    (folder / "runs" / "r" / "metrics.jsonl").write_text("{}\n" * 10)
    (folder / "runs" / "r" / "checkpoints" / "model.json").write_text("{}")
    (folder / "weights.pt").write_bytes(b"0" * 100)
    logs = gpu_paths.write_logs(folder, tmp_path / "logs.tgz", cap=40_000)
    assert logs["members"] == 3 and list(logs["truncated"]) == ["big.log"]
    with tarfile.open(tmp_path / "logs.tgz") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert set(members) == {"small.log", "big.log", "runs/r/metrics.jsonl"} and members["small.log"] == b"fine\n"
    big = members["big.log"]
    assert big.startswith(b"start") and big.endswith(b"Traceback: the end\n") and b"bytes cut by" in big
    assert sum(map(len, members.values())) + 1024 * len(members) <= 40_000


def test_the_mfu_levers_are_interleaved_in_one_process(bench, tmp_path, monkeypatch):
    """Review 3, finding 15: each lever was a CLI run of 36 steps, ~3% apart run to run, above the 0.5-2 points to
    resolve. The variants are built once in one process, then take turns (A/B/A/B), each turn timed; the figures go
    out after every warm-up and every round."""
    gpu_mfu = bench("gpu_mfu")
    turns, reports = [], []
    timed = gpu_mfu.Variant.timed
    monkeypatch.setattr(gpu_mfu.Variant, "timed", lambda self, n: turns.append(self.name) or timed(self, n))
    names = ["configured", "cudnn_attention"]
    results = gpu_mfu.measure(names, True, tmp_path, 2, 1, 1, lambda r: reports.append(json.loads(json.dumps(r))))
    assert turns == names * 2
    assert [sorted(r) for r in reports] == [["configured"], names, names, names]
    assert [r["configured"].get("rounds") for r in reports] == [None, None, 1, 2]
    assert results["configured"]["steps_measured"] == 2 and results["configured"]["mfu"] > 0
    assert "vs_configured_points" in results["cudnn_attention"]


def test_every_rank_may_share_the_one_gpu_each_an_nccl_host_of_its_own(monkeypatch):
    """Review 3, finding 5: one GPU can host several NCCL ranks to test a layout's correctness only if each rank looks
    like a node of its own (NCCL_HOSTID); pick_device refused LOCAL_RANK 1 on one GPU. SCALELM_SHARE_GPU=1 puts every
    rank on cuda:0 with an NCCL host id of its own (CUDA faked here: one device)."""
    from scalelm.parallel import env as dist_env

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="LOCAL_RANK 1 has no GPU: 1 visible; .* or set SCALELM_SHARE_GPU=1"):
        pick_device("cuda", 1)
    assert pick_device("cuda", 1, share_gpu=True) == pick_device("auto", 0) == torch.device("cuda", 0)
    assert not dist_env.shares_gpu({}) and not dist_env.shares_gpu({"SCALELM_SHARE_GPU": "0"})
    assert dist_env.shares_gpu({"SCALELM_SHARE_GPU": "1"})
    with pytest.raises(ConfigError, match="SCALELM_SHARE_GPU='yes': set it to 1"):
        dist_env.shares_gpu({"SCALELM_SHARE_GPU": "yes"})
    site = {"NCCL_HOSTID": "job", "NCCL_SOCKET_IFNAME": "eth0"}
    first, second = (dist_env.shared_gpu_environment(rank, site) for rank in (0, 1))
    assert first["NCCL_HOSTID"] != second["NCCL_HOSTID"] != "job" and second["NCCL_HOSTID"].endswith("-rank1")
    assert first["NCCL_SOCKET_IFNAME"] == "eth0" and first["NCCL_IB_DISABLE"] == "1"

    # setup reads it: rank 1 of 2 on cuda:0 with its own host id, torchrun's local rank kept (one world of one here)
    devices = []
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    for name in ("NCCL_HOSTID", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_NVLS_ENABLE", "NCCL_MNNVL_ENABLE"):
        monkeypatch.setenv(name, "")  # so that the test's end removes what setup sets
        monkeypatch.delenv(name)
    for name, value in {"SCALELM_SHARE_GPU": "1", "LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    here = dist_env.setup("cuda", timeout_s=10)
    assert (here.device, here.local_rank, devices) == (torch.device("cuda", 0), 1, [torch.device("cuda", 0)])
    assert os.environ["NCCL_HOSTID"].endswith("-rank1") and os.environ["NCCL_SOCKET_IFNAME"] == "lo"


def test_patterned_data_is_learnable_each_token_a_function_of_the_one_before(bench, tmp_path):
    """Review 4, finding 2: on uniformly random ids no model beats ln V, so a broken layout's losses matched a
    working one's within 3%. The compared runs (D, F, I) train on ids that cycle through PATTERN_IDS of the
    vocabulary: each token follows from the one before, and the loss falls by several nats."""
    throughput = bench("throughput")
    from scalelm.data.prepared import load_prepared

    tokens = throughput.patterned_tokens(1000, torch.Generator().manual_seed(1))
    successors = {}
    for a, b in zip(tokens[:-1].tolist(), tokens[1:].tolist()):
        assert successors.setdefault(a, b) == b
    assert len(successors) == throughput.PATTERN_IDS and max(successors) < throughput.VOCAB
    data = load_prepared(throughput.make_prepared(tmp_path / "p", patterned=True, eval_tokens=512))
    assert data.vocab_size == throughput.VOCAB and data.manifest["source"] == {"benchmark": "patterned"}
    assert [data.splits[s].numel() for s in ("validation", "test")] == [512, 512]
    assert len(set(data.splits["train"][:10_000].tolist())) == throughput.PATTERN_IDS


def test_a_compared_run_must_fall_as_its_reference_does_with_the_same_gradient_norms(bench):
    """Review 4, finding 2: the comparison of D, F and I, fed a broken run's figures. It passes bf16-sized noise and a
    gradient-norm spike a step early; it fails a run that does not learn, one that learns at half the pace (though it
    ends where the reference does), one whose gradients are twice too large (Adam's step hides it from the loss), a
    NaN, a missing step, and any run against a reference that learnt nothing (random ids)."""
    gpu_paths = bench("gpu_paths")
    losses = [10.4, 9.9, 9.2, 8.3, 7.4, 6.6, 5.9, 5.3, 4.8, 4.5]
    norms = [1.3, 1.45, 1.44, 1.44, 1.45, 1.45, 1.43, 1.38, 1.3, 1.2]
    reference = {"losses": losses, "grad_norms": norms}

    def agreement(run_losses, run_norms=norms, against=reference, precision="bf16") -> dict:
        return gpu_paths.run_agreement({"losses": run_losses, "grad_norms": run_norms}, against, precision)

    noisy = [x * (1 + 0.004 * (-1) ** i) for i, x in enumerate(losses)]
    spiked = [*norms[:4], 1.9, 1.45, *norms[6:]]  # a spike one step off the reference's
    assert agreement(noisy, [x * 1.02 for x in norms])["alike"] and agreement(losses, spiked)["alike"]
    flat = [10.41, 10.40, 10.41, 10.40, 10.41, 10.40, 10.41, 10.40, 10.41, 10.40]  # what random ids give
    half_pace = [10.4, 10.1, 9.8, 9.5, 9.2, 8.5, 7.5, 6.5, 5.5, 4.5]
    for broken in (flat, half_pace, [*losses[:-1], float("nan")], losses[:-1]):
        verdict = agreement(broken)
        assert not verdict["fall"]["alike"] and not verdict["alike"], broken
    doubled = agreement(losses, [2 * x for x in norms])
    assert doubled["fall"]["alike"] and not doubled["grad_norms"]["alike"] and not doubled["alike"]
    assert not agreement(flat, against={"losses": flat, "grad_norms": norms})["alike"]  # nothing learnt to compare
    # fp32 on a CPU: every step's loss within 1e-4 as well, gradient norms within 1e-3
    assert agreement(losses, precision="fp32")["alike"] and not agreement(noisy, precision="fp32")["alike"]
    assert not agreement(losses, [x * 1.01 for x in norms], precision="fp32")["alike"]


@pytest.fixture
def group_of_this_test(monkeypatch):
    """A check that starts a process group in this process: its address restored and its group ended after."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "0")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_stacked_layout_fails_when_its_gradients_are_scaled_or_missing(
    bench, tmp_path, monkeypatch, group_of_this_test
):
    """Review 4, finding 2, check D: the stacked layout (selective checkpointing, FSDP2 on one rank) on one batch both
    learn agrees with the plain model; FSDP dividing its gradients wrongly (its divide factor halved) leaves the
    loss's fall and every step's loss as they were (Adam) but fails the first step's gradients, parameter by
    parameter; a block left untrained fails the fall and names the parameters without a gradient. The farm's process
    for D (`warm_stack`, review 4 finding 1) builds the same model through the same code at the same batch shape."""
    gpu_paths = bench("gpu_paths")
    ctx = gpu_paths.Ctx(torch.device("cpu"), tmp_path, tmp_path, "D.stack")
    built, stacked_model = [], gpu_paths.stacked_model

    def spied(ctx, config, initial):
        built.append((config, {name: tensor.shape for name, tensor in initial.items()}))
        return stacked_model(ctx, config, initial)

    monkeypatch.setattr(gpu_paths, "stacked_model", spied)
    assert gpu_paths.stack(ctx)["agreement"]["alike"]
    warmed = gpu_paths.warm_stack(ctx)
    assert built[0] == built[1] and warmed["steps"] == gpu_paths.STACK_WARMUP and not warmed["compiled"]

    def halved(model):
        model.set_gradient_divide_factor(0.5)

    def frozen(model):
        for parameter in model.blocks["0"].parameters():
            parameter.requires_grad_(False)

    for broken in (halved, frozen):
        with pytest.raises(AssertionError, match="trains unlike the plain model"):
            gpu_paths.stack(ctx, broken)
        verdict = ctx.last_progress["agreement"]
        assert not verdict["gradients"]["alike"] and not verdict["alike"]
        if broken is halved:
            assert verdict["fall"]["alike"] and verdict["worst_relative"] <= gpu_paths.FP32_BOUND
            assert verdict["gradients"]["worst_norm_difference"][1] == pytest.approx(1.0)
        else:
            assert not verdict["fall"]["alike"] and "blocks.0.attn.qkv.weight" in verdict["gradients"]["unmatched"]


# imported by every Python process started with this folder on PYTHONPATH: rank 1 of a layout scales its gradients
# before they are clipped (and their norm logged), as a layout that reduced them wrongly would
SCALED_RANK = """import os

from scalelm.parallel import runtime

clip = runtime.Parallel.clip_grad_norm


def scaled(self, model, max_norm):
    if os.environ.get("RANK") == "1":
        for parameter in model.parameters():
            if parameter.grad is not None:
                parameter.grad.mul_(2.0)
    return clip(self, model, max_norm)


runtime.Parallel.clip_grad_norm = scaled
"""


@pytest.mark.slow
def test_a_shared_gpu_layout_whose_rank_scales_its_gradients_fails(bench, tmp_path, monkeypatch, group_of_this_test):
    """Review 4, finding 2, check I through its real path (2 gloo ranks through the CLI against one process): rank 1
    of moe_ep doubles its gradients (a sitecustomize module in the ranks' PYTHONPATH). Adam's step hides the scale:
    the loss falls as the reference's and every step's loss stays within fp32's bound; the logged gradient norms
    do not, and the layout fails."""
    gpu_paths = bench("gpu_paths")
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SCALED_RANK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), str(REPO / "src"), str(REPO)]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    cache.mkdir()
    ctx = gpu_paths.Ctx(torch.device("cpu"), work, cache, "I.share")
    figures = {}
    gpu_paths.share_layouts(ctx, {"moe_ep": gpu_paths.SHARE_LAYOUTS["moe_ep"]}, 4, {}, figures)
    verdict = figures["moe_ep"]["agreement"]
    assert verdict["fall"]["alike"] and verdict["worst_relative"] <= gpu_paths.FP32_BOUND
    assert verdict["grad_norms"]["first"] > 0.1 and not verdict["grad_norms"]["alike"]
    assert not figures["moe_ep"]["alike"] and figures["references"]["moe"]["losses"][0] > 10


def test_the_baseline_can_time_its_compiled_step_at_one_shape(tiny_config, monkeypatch):
    """Review 4, finding 1: H timed gpt2_small's compiled step at two shapes, each a cold compile of a minute or more
    on a GPU. `small_step=False` times the one shape (what H asks for on a GPU); the default keeps both."""
    from scalelm.config import load_config
    from scalelm.measure.baseline import job
    from scalelm.measure.baseline.shapes import gemm_shapes, vocabulary_size

    timed = []

    def seconds(config, vocab, tokens, device, compiled=False):
        timed.append((tokens, compiled))
        return 1.0, 1.0, 1.0

    monkeypatch.setattr(job, "model_step_seconds", seconds)
    monkeypatch.setattr(job, "matmul_rates", lambda *args: {})
    monkeypatch.setattr(job, "elementwise_gbps", lambda *args: 1.0)
    config = load_config(tiny_config("compiled", train__compile=True))
    shapes, vocab = gemm_shapes(config, "cpu"), vocabulary_size(config)
    cpu = torch.device("cpu")
    one = job.measure_alone(config, shapes, vocab, cpu, all_cores=False, small_step=False)
    assert len(timed) == 1 and timed[0][1] and "model_step_small_s" not in one and one["model_step_s"] == 1.0
    both = job.measure_alone(config, shapes, vocab, cpu, all_cores=False)
    assert len(timed) == 3 and both["model_step_small_tokens"] == timed[-1][0] < timed[0][0]


NCCL_LOG = """training fsdp_ep on 2 x cuda
host:101:101 [0] NCCL INFO NCCL_HOSTID set by environment to host-rank0
host:101:101 [0] NCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0>
host:101:101 [0] NCCL INFO comm 0x5a1c0 rank 0 nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0
host:101:140 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
host:101:140 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0
host:101:101 [0] NCCL INFO comm 0x7f3e0 rank 0 nRanks 1 nNodes 1 localRanks 1 localRank 0 MNNVL 0
host:101:141 [0] NCCL INFO Channel 01/1 : 0[0] -> 1[0] [send] via NET/Socket/0/Shared
"""


def test_nccls_log_must_show_two_nodes_over_sockets(bench):
    """Review 4, finding 5: I proves that several ranks share the GPU as NCCL nodes of their own only if NCCL says so
    (NCCL_DEBUG=INFO): every communicator of two ranks counts two nodes, every channel goes over sockets (a group of
    one, beside, is its own node). A log without those lines, with one node, or with another transport fails."""
    gpu_paths = bench("gpu_paths")
    facts = gpu_paths.nccl_transport(NCCL_LOG)
    assert facts == {"communicators": [[1, 1], [2, 2]], "transports": ["NET/Socket"]}
    assert gpu_paths.two_nodes_over_sockets(facts)
    one_node = NCCL_LOG.replace("nRanks 2 nNodes 2 localRanks 1", "nRanks 2 nNodes 1 localRanks 2")
    over_p2p = NCCL_LOG.replace("[send] via NET/Socket/0\n", "[send] via P2P/CUMEM/read\n")
    for log in ("training fsdp_ep on 2 x cpu\nstep 1 | loss 10.4\n", one_node, over_p2p):
        assert not gpu_paths.two_nodes_over_sockets(gpu_paths.nccl_transport(log))
    assert gpu_paths.nccl_transport(over_p2p)["transports"] == ["NET/Socket", "P2P/CUMEM"]


def test_host_syncs_on_cuda_are_the_sync_debug_modes_warnings(bench, monkeypatch):
    """Review 4, finding 4: a dispatch mode cannot see inside the ring's custom operator, so C's count of 0 held by
    construction. On CUDA the count is CUDA's own sync debug mode's warnings (faked here: the mode and the warnings
    a synchronising call would give), its prototype notice not counted, the mode restored even when the body
    fails; on a CPU the dispatch mode still counts a read back."""
    import warnings

    gpu_paths = bench("gpu_paths")
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def ring_like():  # what torch warns, from inside an operator the dispatch mode cannot see into
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all synchronizing")
        for _ in range(2):
            warnings.warn("called a synchronizing CUDA operation\n  File ring_blocks.py, line 1")

    cuda = gpu_paths.Ctx(torch.device("cuda", 0), None, None)
    assert gpu_paths.host_syncs(cuda, ring_like) == 2 and modes == ["warn", "default"]
    assert gpu_paths.host_syncs(cuda, lambda: None) == 0
    with pytest.raises(RuntimeError), gpu_paths.cuda_sync_warnings():
        raise RuntimeError("the body failed")
    assert modes[-2:] == ["warn", "default"]
    cpu = gpu_paths.Ctx(torch.device("cpu"), None, None)
    assert gpu_paths.host_syncs(cpu, lambda: torch.ones(2).sum().item()) == 1
    assert gpu_paths.host_syncs(cpu, lambda: torch.ones(2).sum()) == 0


def test_a_checks_compile_figures_count_graphs_and_recompiles(bench):
    """Review 4, finding 1: each check that compiles records what torch.compile did in its process (paths.json's
    `compile`), for the next lease to size the limits; a process that compiled nothing records nothing."""
    import torch._dynamo

    gpu_paths = bench("gpu_paths")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        assert gpu_paths.compile_figures() is None
        double = torch.compile(lambda x: x * 2, backend="eager")
        double(torch.ones(3))
        double(torch.ones(5))  # another shape: compiled again
        figures = gpu_paths.compile_figures()
        assert figures["frames"] == 2 and figures["unique_graphs"] == 2 and figures["recompiles"] == 1
        assert figures["seconds"] >= 0 and figures["graph_breaks"] == 0
    finally:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()


def test_each_process_is_handed_on_as_it_lands(bench, tmp_path):
    """Review 4, finding 1: G publishes each layout as its process ends, so that a check cut off keeps those that
    finished; once one fails, the others are ended and handed on as killed."""
    gpu_paths = bench("gpu_paths")
    landed = []

    def start(seconds: float, code: int = 0) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", f"import time, sys; time.sleep({seconds}); sys.exit({code})"])

    codes = gpu_paths.wait_all({"slow": start(1.0), "quick": start(0)}, 30, lambda *a: landed.append(a))
    assert landed == [("quick", 0), ("slow", 0)] and codes == {"slow": 0, "quick": 0}
    landed.clear()
    gpu_paths.wait_all({"hung": start(60), "failed": start(0, 3)}, 30, lambda *a: landed.append(a))
    assert landed == [("failed", 3), ("hung", "killed")]


BAD_BENCH_ARGUMENTS = [  # script, its arguments ({tmp}: the test's directory, holding a_file), the error's line
    ("activation_memory", ["--repeats", "0"], "argument --repeats: 0: give a whole number at least 1"),
    (
        "activation_memory",
        ["--json", "{tmp}/a_file/out.json"],
        "a_file/out.json cannot be written: .*a_file is not a directory",
    ),
    ("fault_trials", ["--trials", "200"], "argument --trials: 200: give a whole number from 1 to 108"),
    (
        "fault_trials",
        ["--strategies", "ddp,fsdb"],
        "unknown strategy 'fsdb' \\(did you mean 'fsdp'\\?\\); choose from single",
    ),
    ("gpu_mfu", ["{tmp}/a_file", "--cpu"], "argument out: .*a_file is a file: give a directory"),
    ("gpu_mfu", ["{tmp}/mfu", "--rounds", "1"], "argument --rounds: 1: give a whole number at least 2"),
    ("gpu_mfu", ["{tmp}/mfu", "--steps", "0"], "argument --steps: 0: give a whole number at least 1"),
    ("gpu_paths", ["--cpu", "--out", "{tmp}/p", "--budget", "nan"], "argument --budget: 'nan': give a positive"),
    ("gpu_paths", ["--cpu"], "--out is required: the folder paths.json and logs.tgz go to"),
    ("gpu_paths", ["--cpu", "--out", "{tmp}/p", "--work", "{tmp}/p/work"], "--out .*/p holds --work .*/p/work"),
    ("gpu_paths", ["--out", "{tmp}/p", "--rehearse"], "--rehearse is the runner's drill for CI: use it with --cpu"),
    (
        "gpu_probe",
        ["--cpu", "--out", "{tmp}/p", "--only", "a.fats"],
        "unknown check 'a.fats' \\(did you mean 'a.facts'\\?\\)",
    ),
    ("gpu_smoke_report", ["{tmp}/missing"], "argument out: .*missing is not an existing directory"),
    ("gpu_smoke_report", ["{tmp}", "--cpu"], "holds no status file: give the directory bench/gpu_smoke.sh wrote"),
    ("history_slowdown", ["--seeds", "1"], "argument --seeds: 1: give a whole number at least 2"),
    ("history_slowdown", ["--keep", "{tmp}/a_file"], "argument --keep: .*a_file is a file: give a directory"),
    ("layouts", ["--models", "m5"], "unknown model 'm5' \\(did you mean 'm59'\\?\\)"),
    ("layouts", ["--layouts", "ddp,fdsp"], "unknown layout 'fdsp' \\(did you mean 'fsdp'\\?\\)"),
    ("moe", ["--steps", "-1"], "argument --steps: -1: give a whole number at least 1"),
    ("pipeline", ["--microbatches", "2,x"], "argument --microbatches: 'x' is not a whole number"),
    ("pipeline", ["--microbatches", "2,3"], "--batch 8 does not split into \\[3\\] micro-batches"),
    ("pipeline", ["--schedules", "1f1f"], "unknown schedule '1f1f' \\(did you mean '1f1b'\\?\\)"),
    ("staging", ["--local-dir", "{tmp}/a_file"], "argument --local-dir: .*a_file is a file: give a directory"),
    ("throughput", ["--models", "c"], "argument --models: unknown model 'c'; choose from a, b"),
    ("throughput", ["--json", "{tmp}"], "argument --json: .* is a directory: give a file path"),
]


@pytest.mark.parametrize(
    "script, arguments, message", BAD_BENCH_ARGUMENTS, ids=[f"{s} {' '.join(a)}" for s, a, _ in BAD_BENCH_ARGUMENTS]
)
def test_the_bench_scripts_refuse_bad_arguments_before_any_work(bench, tmp_path, capsys, script, arguments, message):
    """Each bad value is refused by argparse, naming it, before the script measures anything: a negative count, an
    unknown name, an output that cannot be written were tracebacks, some after minutes of measuring."""
    import re

    (tmp_path / "a_file").write_text("mine\n")
    with pytest.raises(SystemExit) as refused:
        bench(script).main([argument.format(tmp=tmp_path) for argument in arguments])
    error = capsys.readouterr().err
    assert refused.value.code == 2 and re.search(message, error.splitlines()[-1]), error
    assert (tmp_path / "a_file").read_text() == "mine\n" and {p.name for p in tmp_path.iterdir()} == {"a_file"}
