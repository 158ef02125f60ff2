"""The CUDA/NCCL paths, tested on CPU wherever their condition can be produced: CUDA's optimizer kernels forced on a
tensor-parallel model, the process group's backend string, the container's environment, the peak table, TF32, the
evaluation batch, the device a GPU site asks for (../shared/notes/gpu-review.md names each finding)."""

from __future__ import annotations

import contextlib
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
        "F.lightning",
        "C.ring",
        "H.baseline",
        "G.world8",
        "D.stack",
        "I.share",
        "E.levers",
    ]
    assert {r["status"] for r in results.values()} == {"PASS"}, {n: r["status"] for n, r in results.items()}
    assert recorded["summary"] == "10 PASS, 0 FAIL, 0 N/A, 0 SKIPPED" and recorded["logs"]["truncated"] == {}
    with tarfile.open(paths_out / "logs.tgz") as logs:
        assert {"C.ring.log", "I.smoke.rank1.log", "E.levers.json"} <= set(logs.getnames())
    assert "sdp_priority_order" in results["A.versions"]["figures"]
    ring = results["C.ring"]["figures"]
    assert ring["gpt2"]["ring_host_syncs"] == ring["cp_long"]["ring_dropout_host_syncs"] == 0
    assert not any(ring["graph_breaks"].values()) and ring["gpt2"]["ring_cp4_error"] <= 1e-5
    assert results["B.nccl"]["figures"]["hang"]["exit"] == 76
    assert results["D.stack"]["figures"]["worst_relative"] <= 1e-4
    assert {"fsdp8_compile_selective", "cp4_long", "pp2_stage0"} == set(results["G.world8"]["figures"])
    products = results["H.baseline"]["figures"]["output_products"]["products"]
    assert (products["output_unpadded"]["shape"][2], products["output_padded"]["shape"][2]) == (33_278, 33_280)
    assert results["J.moe"]["figures"]["worst_relative"] <= 1e-4
    shared = results["I.share"]["figures"]  # several ranks (gloo here): the smoke, then a layout against one process
    assert all(
        shared["smoke"][rank][op]
        for rank in ("0", "1")
        for op in ("all_reduce", "all_to_all_single", "batch_isend_irecv")
    )
    assert shared["moe_ep"]["worst_relative"] <= 1e-4 and len(shared["moe_ep"]["losses"]) == 4
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


def test_the_gpu_paths_checks_fit_a_cold_lease_cheapest_first(bench):
    """Review 3, finding 2: the planned seconds summed to 760 against a budget of 470, so a cold call ran out of time
    in the levers and skipped the rest. Each check's limit is its cold estimate on an H200; their sum with a minute's
    margin fits the 9 minutes one call may take of a 15-minute lease; the levers, the costliest, run last (and take
    what the others left)."""
    gpu_paths = bench("gpu_paths")
    limits = gpu_paths.plan(list(gpu_paths.RUN_ORDER), cpu=False)
    assert sorted(gpu_paths.RUN_ORDER) == sorted(gpu_paths.CHECKS) and limits.keys() == gpu_paths.CHECKS.keys()
    assert sum(limits.values()) + gpu_paths.MARGIN_S <= gpu_paths.WINDOW_S <= 9 * 60
    assert gpu_paths.RUN_ORDER[-1] == "E.levers" and limits["E.levers"] == max(limits.values())
    order = gpu_paths.RUN_ORDER.index  # a first compile fills the shared cache before the check that reuses it
    assert order("H.baseline") < order("E.levers") and order("G.world8") < order("D.stack")


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
    assert recorded["budget_s"] == 3 and recorded["limits_s"] == {"A.versions": 60, "Z.hang": 2.0}


def _alive(pid: int) -> bool:
    """A process that runs (a zombie waiting for its parent runs nothing)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


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
