"""The peak FLOP/s of one device, the denominator of model FLOPs utilisation (MFU), and MFU under two conventions:
scalelm's (`mfu`: the model's matrix products with attention over the whole sequence, torchtitan's and nanoGPT's
count) and llm.c's (`causal_flops_per_token`: causal attention counted at half).

CUDA: the vendor's dense (no sparsity) tensor-core figure for the device and precision, from `CUDA_PEAK_TFLOPS`.
CPU: there is no datasheet figure for "one process's share of a host", so it is measured: the fp32 matrix-multiply
rate of this process with its own threads, a short calibration whose result is cached per host, CPU model, thread
count and torch version (`~/.cache/scalelm/cpu_peak.json`). Other work on the host during a calibration lowers it,
and a low peak inflates every MFU after it (above 1, once seen): a calibration beside more than a quarter core of
other work serves its own run only, and the next run measures again; the cache keeps the best rate measured.
A configured value (`train.peak_tflops`) wins over both.
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from scalelm.files import atomic_write_text
from scalelm.measure.hostload import OtherWork
from scalelm.model.architecture import attention_flops_per_token

if TYPE_CHECKING:
    import torch

# Dense TFLOP/s per GPU by the device name torch reports (matched as whole words, first match wins) and precision.
# fp32 is the TF32 tensor-core rate where the GPU has one: scalelm turns TF32 on for fp32 runs on CUDA
# (scalelm.parallel.numerics.matmul_precision).
CUDA_PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("GH200", {"bf16": 989.0, "fp32": 494.0}),  # JUPITER, JEDI
    ("H200 NVL", {"bf16": 835.0, "fp32": 418.0}),
    ("H200", {"bf16": 989.0, "fp32": 494.0}),
    ("H100 NVL", {"bf16": 835.0, "fp32": 418.0}),
    ("H100 PCIe", {"bf16": 756.0, "fp32": 378.0}),
    ("H100", {"bf16": 989.0, "fp32": 494.0}),  # SXM
    ("A100", {"bf16": 312.0, "fp32": 156.0}),  # JURECA-DC, JUWELS Booster (SXM and PCIe alike)
    ("L40S", {"bf16": 362.0, "fp32": 183.0}),
    ("A40", {"bf16": 150.0, "fp32": 75.0}),
    ("V100", {"bf16": 0.0, "fp32": 15.7}),  # no bf16 tensor cores
]
CALIBRATION_SIZE = 1024  # square fp32 matmuls: large enough for the GEMM's peak, small enough for about a second
CALIBRATION_SECONDS = 1.0
QUIET_CORES = 0.25  # other work beside a calibration up to this many cores: the host counts as quiet


def cuda_peak_flops(device_name: str, precision: str) -> float | None:
    """The table's peak for this GPU and precision, or None (with the reason printed) for a GPU it does not know,
    and for a MIG slice (a share of a GPU the table cannot know)."""
    if re.search(r"\bMIG\b", device_name):
        print(
            f"scalelm: {device_name!r} is a MIG slice of a GPU: MFU is left empty. Set train.peak_tflops (the "
            "slice's share of the GPU's dense TFLOP/s) to report it",
            flush=True,
        )
        return None
    for key, peaks in CUDA_PEAK_TFLOPS:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name, re.I) and peaks.get(precision):
            return peaks[precision] * 1e12
    print(
        f"scalelm: no peak FLOP/s known for {device_name!r} in {precision}: MFU is left empty. "
        "Set train.peak_tflops (the device's dense TFLOP/s) to report it",
        flush=True,
    )
    return None


def measure_cpu_matmul_flops(size: int = CALIBRATION_SIZE, seconds: float = CALIBRATION_SECONDS) -> float:
    """fp32 matmul FLOP/s of this process with its current torch thread count (the best of several timed runs)."""
    import torch  # here and below, where it measures: the report imports `mfu` without torch

    generator = torch.Generator().manual_seed(0)  # not the global one: training's random streams stay untouched
    a, b = torch.randn(size, size, generator=generator), torch.randn(size, size, generator=generator)
    out = torch.empty(size, size)
    torch.mm(a, b, out=out)  # warm up the GEMM and its buffers
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def cpu_cache_key() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{socket.gethostname()}|{cpu}|threads={torch.get_num_threads()}|torch={torch.__version__}"


def calibrate() -> tuple[float, bool]:
    """The matmul rate, and whether the host was quiet meanwhile."""
    other = OtherWork()
    flops = measure_cpu_matmul_flops()
    return flops, other.cores() <= QUIET_CORES


def cpu_peak_flops(cache: Path | None = None) -> float:
    """This host's measured CPU peak for a process with this thread count: measured until once measured on a quiet
    host, then cached (the best rate seen)."""
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "scalelm" / "cpu_peak.json"
    key = cpu_cache_key()
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(key)
    if isinstance(entry, dict) and entry.get("quiet"):
        return entry["flops"]
    flops, quiet = calibrate()  # none yet, one from beside other work, or one of an older scalelm (not known quiet)
    best = max(flops, entry["flops"]) if isinstance(entry, dict) else flops
    known[key] = {"flops": best, "quiet": quiet}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cache, json.dumps(known, indent=2) + "\n")
    except OSError:  # a read-only home: measure again next time
        pass
    return best


def peak_flops(device: torch.device, precision: str, configured_tflops: float | None) -> tuple[float | None, str]:
    """One device's peak FLOP/s and where it came from (recorded in run.json beside the MFU it divides)."""
    import torch

    if configured_tflops:
        return configured_tflops * 1e12, "configured (train.peak_tflops)"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return cuda_peak_flops(name, precision), f"datasheet: {name}, {precision}"
    return cpu_peak_flops(), f"measured: fp32 matmul, {torch.get_num_threads()} thread(s) per process"


def mfu(flops_per_token: float, tokens_per_s: float, devices: int, peak_per_device: float | None) -> float | None:
    """Model FLOPs utilisation: the model's training FLOPs per second over the peak of all its devices."""
    if not peak_per_device:
        return None
    return flops_per_token * tokens_per_s / (devices * peak_per_device)


def causal_flops_per_token(flops_per_token: float, n_layers: int, d_model: int, seq_len: int) -> float:
    """`flops_per_token` (scalelm.model.architecture's: attention over the whole sequence, 12 L s d, as torchtitan,
    nanoGPT and PaLM count it) with causal attention counted at half, 6 L s d, as llm.c counts it: the products a
    causal kernel computes. The numerator of `mfu_causal` in the report, the figure to compare with llm.c's MFU."""
    return flops_per_token - attention_flops_per_token(n_layers, d_model, seq_len) // 2
