"""The machine baseline measured as training runs (padded output layer, compiled step, GPU health sampled during
the work, NCCL's network log whatever the site set), the container's environment on Slurm nodes, and how far an
energy lap can be trusted (docs/gpu.md, the second review's findings on the baseline and the energy lap)."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from scalelm.config import load_config
from scalelm.launch import container, slurm
from scalelm.launch import launcher as launch
from scalelm.measure import energy
from scalelm.measure.baseline import gpu_health, job
from scalelm.measure.baseline.__main__ import report
from scalelm.measure.baseline.shapes import (
    WIKITEXT2_VOCABULARY,
    gemm_shapes,
    output_shapes,
    padded_rows,
    prepared_vocabulary,
    vocabulary_size,
)
from scalelm.model import gpu_ops
from scalelm.parallel import compile as compiling
from scalelm.plan.machine import MachineBaseline


class MatmulShapes(TorchDispatchMode):
    """The (M, K, N) of every 2-D matrix product dispatched."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            a, b = args[-2], args[-1]
            self.shapes.append((a.shape[0], a.shape[1], b.shape[1]))
        return func(*args, **(kwargs or {}))


def test_the_baseline_times_the_output_product_on_the_rows_training_pads_it_to(tiny_config, tmp_path, monkeypatch):
    """WikiText-2's 33,278 rows are 33,280 on CUDA, as gpu_ops.aligned_linear multiplies them (not on CPU); the
    unpadded and padded products side by side for the GPU check; and the baseline's shape is the one the model's
    head dispatches where padding applies (checked on CPU by making it a padded device)."""
    course = load_config(tiny_config("course", data__prepared_dir=str(tmp_path / "unprepared")))  # no manifest
    assert gemm_shapes(course, "cuda")["output"] == (16 * 16, 32, 33280)
    assert gemm_shapes(course, "cpu")["output"] == (16 * 16, 32, 33278)
    assert output_shapes(course) == {"output_unpadded": (256, 32, 33278), "output_padded": (256, 32, 33280)}
    assert padded_rows(33280, "cuda") == 33280 and padded_rows(1, "cuda") == gpu_ops.ROW_MULTIPLE
    assert prepared_vocabulary(course) is None  # the stand-in's, which the baseline records (test_plan.py)

    config = load_config(tiny_config())  # the sample's own vocabulary
    vocab = vocabulary_size(config)
    assert vocab == prepared_vocabulary(config) != WIKITEXT2_VOCABULARY
    monkeypatch.setattr(gpu_ops, "PADDED_DEVICES", ("cpu",))
    m, d, padded = gemm_shapes(config, "cpu")["output"]
    assert padded % gpu_ops.ROW_MULTIPLE == 0 and vocab < padded < vocab + gpu_ops.ROW_MULTIPLE
    x, weight = torch.randn(m, d), torch.randn(vocab, d)
    with MatmulShapes() as seen:
        logits = gpu_ops.aligned_linear(x, weight, torch.zeros(vocab))
    assert seen.shapes == [(m, d, padded)] and logits.shape == (m, vocab)


def fake_nvml_reader(in_products: list[bool], reads: list[bool]):
    """A GPU idle at a low clock outside the products and thermally held back inside them."""

    def read():
        busy = in_products[0]
        reads.append(busy)
        return {
            "ecc_uncorrected": 0,
            "sm_clock_mhz": 1100 if busy else 300,
            "sm_clock_max_mhz": 1980,
            "reasons": 0x40 if busy else 0x1,
            "temperature_c": 84 if busy else 40,
        }

    return read


def test_the_baseline_steps_compile_as_training_does_and_the_gpus_health_is_sampled_while_they_run(
    tiny_config, monkeypatch
):
    """With train.compile the model's steps go through the trainer's apply_compile (recorded here rather than
    compiled) and the record says so; without it, none. NVML is read on a thread during the products (a fake
    reader, told whether a product runs): the worst seen is recorded, the clock of idle samples left out."""
    compiled_models = []
    monkeypatch.setattr(
        compiling, "apply_compile", lambda model, device, mode="default": compiled_models.append(device)
    )
    in_products, reads = [False], []
    timed = job.matmul_rates

    def products(*args):
        in_products[0] = True
        try:
            return timed(*args)
        finally:
            in_products[0] = False

    monkeypatch.setattr(job, "matmul_rates", products)
    monkeypatch.setattr(gpu_health, "HEALTH_SAMPLE_S", 0.005)
    real_reader = gpu_health.open_health_reader
    monkeypatch.setattr(gpu_health, "open_health_reader", lambda device: fake_nvml_reader(in_products, reads))
    cpu = torch.device("cpu")
    config = load_config(tiny_config("compiled", train__compile=True))
    shapes, vocab = gemm_shapes(config, "cpu"), vocabulary_size(config)
    figures = job.measure_alone(config, shapes, vocab, cpu, all_cores=True)
    assert figures["model_step_compiled"] and compiled_models == [cpu, cpu, cpu]  # full, a quarter, every core
    assert figures["model_step_s"] > 0 and figures["model_step_all_cores_s"] > 0
    health = figures["gpu"]
    assert any(reads) and health["samples"] == len(reads) >= 2  # some of them while a product ran
    assert health["held_back_by"] == ["gpu idle", "hw thermal slowdown"] and not health["healthy"]
    assert health["sm_clock_mhz"] == 1100 and health["temperature_c_max"] == 84  # not the idle 300 MHz

    compiled_models.clear()
    eager = load_config(tiny_config("eager"))
    figures = job.measure_alone(eager, shapes, vocab, cpu, all_cores=False)
    assert not figures["model_step_compiled"] and compiled_models == [] and figures["model_step_all_cores_s"] is None
    result = {
        "world_size": 1,
        "procs_per_node": 1,
        "hosts": ["n1"],
        "device": "cpu",
        "matmul_tflops_min": 1.0,
        "collectives": [],
        "elementwise_gbps_min": 1.0,
        "model_step": {"tokens": 256, "seconds_max": 0.01, "compiled": True},
        "per_rank": [],
        "nccl_network": None,
    }
    assert "(the slowest rank, compiled)" in report(MachineBaseline.from_json(result), None)[0]
    # timed before the data was prepared: the report says which vocabulary the step had
    result["model_step"] |= {"vocab_size": 33278, "prepared": False}
    assert "with WikiText-2's vocabulary (33,278)" in report(MachineBaseline.from_json(result), None)[1]

    def broken():
        raise RuntimeError("GPU is lost")

    with gpu_health.HealthSampler(broken, interval=0.001) as lost:
        pass
    assert lost.result() == {"error": "RuntimeError: GPU is lost"}
    monkeypatch.setattr(gpu_health, "open_health_reader", real_reader)
    with gpu_health.health_sampler(cpu) as nothing:  # the real reader off CUDA
        pass
    assert nothing.result() is None


def test_the_baseline_forces_nccls_info_log_over_the_sites_setting_and_restores_it(monkeypatch, tmp_path):
    """A site's NCCL_DEBUG=WARN (or a NCCL_DEBUG_SUBSYS without NET) would hide "Using network": the baseline's
    run sets INFO, INIT,NET and its own log file, and gives the site's settings back afterwards."""
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("NCCL_DEBUG_SUBSYS", "COLL")
    monkeypatch.delenv("NCCL_DEBUG_FILE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen = {}

    def setup(*args):  # where the process group, and with it NCCL, starts
        seen.update({name: os.environ.get(name) for name in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE")})
        raise RuntimeError("stop here")

    import scalelm.parallel.env

    monkeypatch.setattr(scalelm.parallel.env, "setup", setup)
    args = argparse.Namespace(out=tmp_path / "baseline.json", config=None)
    with pytest.raises(RuntimeError, match="stop here"):
        job.measure(args)
    assert seen == {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
        "NCCL_DEBUG_FILE": str(tmp_path / "baseline.nccl" / "nccl.%h.%p.log"),
    }
    assert (os.environ["NCCL_DEBUG"], os.environ["NCCL_DEBUG_SUBSYS"]) == ("WARN", "COLL")
    assert "NCCL_DEBUG_FILE" not in os.environ


def slurm_container_command(monkeypatch, batch_env: dict[str, str]) -> list[str]:
    """The launcher's command for 2 nodes of 2 GPUs in a container, from a batch node whose environment is
    `batch_env` (everything the launcher would pass otherwise removed, and what it sets undone after the test)."""
    for name in [n for n in os.environ if n.startswith(container.PASSED_PREFIXES) or n in container.PASSED_ENV]:
        monkeypatch.delenv(name)
    for name in (*launch.THREAD_VARIABLES, "GLIBC_TUNABLES"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in {"SLURM_JOB_ID": "77", **batch_env}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(slurm, "allocation", lambda job_id: slurm.Allocation(["c01", "c02"], 8, restarts=0))
    argv = ["--nodes", "2", "--procs-per-node", "2", "--gpu", "--container", "img.sif", "--", "--config", "t.yaml"]
    args, train = launch.parse_args(argv)
    [command] = launch.build_commands(args, train)
    return command


def test_on_slurm_each_nodes_container_gets_its_own_gpus_and_node_local_compile_caches(monkeypatch, tmp_path):
    """The batch node's CUDA_VISIBLE_DEVICES (and Slurm's other per-node variables) are not on the srun line:
    each node hands its own into its container (APPTAINERENV_*, which --cleanenv lets through; run here with a
    fake apptainer); Inductor's and Triton's settings go in, their caches default to the node's /tmp."""
    batch = {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "SLURM_LOCALID": "0",
        "SLURM_PROCID": "0",
        "USER": "alice",
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TRITON_PRINT_AUTOTUNING": "1",
        "NCCL_SOCKET_IFNAME": "ib0",
    }
    command = slurm_container_command(monkeypatch, batch)
    step = command.index("--kill-on-bad-exit=1") + 1
    forwarder = container.node_forwarder("apptainer")
    assert command[step : step + len(forwarder)] == forwarder and command[step] == "/bin/sh"
    image = command.index("img.sif")
    assert command[step + len(forwarder) : step + len(forwarder) + 4] == ["apptainer", "exec", "--cleanenv", "--nv"]
    passed = [command[i + 1] for i in range(step, image) if command[i] == "--env"]
    assert not [v for v in passed if v.split("=")[0] in container.NODE_VARIABLES]
    for setting in (
        "TORCHINDUCTOR_FX_GRAPH_CACHE=1",
        "TRITON_PRINT_AUTOTUNING=1",
        "NCCL_SOCKET_IFNAME=ib0",
        "SLURM_JOB_ID=77",
        "TRITON_CACHE_DIR=/tmp/alice/triton",
        "TORCHINDUCTOR_CACHE_DIR=/tmp/alice/torchinductor",
    ):
        assert setting in passed
    # the user's own cache directories stand; off Slurm (this node's) the GPUs pass as they are, no defaults added
    mine = {"TRITON_CACHE_DIR": "/scratch/t", "CUDA_VISIBLE_DEVICES": "3", "USER": "alice"}
    assert container.passed_environment(mine, slurm_step=True) == {
        "TORCHINDUCTOR_CACHE_DIR": "/tmp/alice/torchinductor",
        "TRITON_CACHE_DIR": "/scratch/t",
    }
    assert container.passed_environment(mine) == {"CUDA_VISIBLE_DEVICES": "3", "TRITON_CACHE_DIR": "/scratch/t"}

    # what one node runs: Slurm gave this node GPUs 2,3; a fake apptainer writes what it was given
    fake = tmp_path / "bin" / "apptainer"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\nenv > {tmp_path}/env\necho "$@" > {tmp_path}/args\n')
    fake.chmod(0o755)
    node = {
        "PATH": f"{fake.parent}:/usr/bin:/bin",
        "CUDA_VISIBLE_DEVICES": "2,3",
        "SLURM_LOCALID": "0",
        "SLURMD_NODENAME": "c02 'x'",
        "GPU_DEVICE_ORDINAL": "",
    }
    subprocess.run(command[step:], env=node, check=True, timeout=30)
    inside = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
    assert inside["APPTAINERENV_CUDA_VISIBLE_DEVICES"] == "2,3" and inside["APPTAINERENV_SLURM_LOCALID"] == "0"
    assert inside["APPTAINERENV_SLURMD_NODENAME"] == "c02 'x'" and inside["APPTAINERENV_GPU_DEVICE_ORDINAL"] == ""
    assert "APPTAINERENV_ROCR_VISIBLE_DEVICES" not in inside  # what the node does not have stays unset
    assert (tmp_path / "args").read_text().split()[:3] == ["exec", "--cleanenv", "--nv"]
    assert container.node_forwarder("/opt/bin/singularity")[2].count("SINGULARITYENV_") == 1


class SteppedCounter:
    source, shortest_reliable_s = "test counter", 1.0

    def __init__(self):
        self.total = 0.0

    def joules(self) -> float:
        self.total += 10.0
        return self.total


def test_an_nvml_energy_lap_shorter_than_a_second_is_marked_unreliable_and_the_counter_is_preferred(monkeypatch):
    """NVML's power is a one-second average of a part-time sensor: a lap (less its paused spans) shorter than its
    counter's shortest reliable span says so; RAPL's and a reading-nothing rank's laps are reliable at any length;
    an unknown energy is never reliable. The GPU's energy counter comes before integrated power."""
    now = [100.0]
    monkeypatch.setattr(energy.time, "monotonic", lambda: now[0])
    meter = energy.EnergyMeter(SteppedCounter())
    now[0] += 0.3
    assert meter.lap_reading() == energy.EnergyLap(10.0, pytest.approx(0.3), False)
    now[0] += 0.5
    with meter.paused():  # 10 J (one reading to the next) and 0.7 s left out
        now[0] += 0.7
    now[0] += 0.4
    assert meter.lap_reading() == energy.EnergyLap(20.0, pytest.approx(0.9), False)
    now[0] += 1.5
    assert meter.lap_reading() == energy.EnergyLap(10.0, pytest.approx(1.5), True)
    now[0] += 0.2
    assert meter.lap() == 10.0  # the plain figure, as before

    assert energy.EnergyMeter(None).lap_reading().reliable  # another rank reads the machine: exactly 0 J
    assert energy.Rapl.shortest_reliable_s == 0.0
    assert energy.NvmlEnergy.shortest_reliable_s == energy.NvmlPower.shortest_reliable_s == energy.NVML_RELIABLE_S
    unknown = energy.EnergyMeter(unknown="NVMLError: lost")
    now[0] += 5
    assert unknown.lap_reading() == energy.EnergyLap(None, pytest.approx(5.0), False)

    class BothNvml:
        class NVMLError(Exception):
            pass

        def nvmlInit(self):
            pass

        def nvmlDeviceGetHandleByUUID(self, uuid):
            return uuid

        def nvmlDeviceGetTotalEnergyConsumption(self, handle):
            return 5000

        def nvmlDeviceGetPowerUsage(self, handle):
            raise AssertionError("the power reading is not used where the energy counter answers")

    monkeypatch.setitem(sys.modules, "pynvml", BothNvml())
    assert isinstance(energy.gpu_counter("GPU-1"), energy.NvmlEnergy)


def test_the_baseline_module_stays_importable_without_torch_for_the_site_file():
    """The report imports the baseline's names; its new imports must not pull torch in."""
    code = "import sys; import scalelm.measure.baseline.__main__; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=Path(__file__).parent)
