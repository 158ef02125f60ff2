"""A GPU's health from NVML (uncorrected ECC errors, SM clock against its maximum, temperature, power limit, the
reasons the clock is held back), sampled on a thread while work runs (an idle GPU is not throttled), and the worst
seen."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from scalelm.measure import nvml

if TYPE_CHECKING:  # torch is imported where the measuring starts: the workflow reads this module without it
    import torch


THROTTLE_REASONS = {  # NVML's clocks-event reasons (nvmlClocksEventReason*), as nvidia-smi names them
    0x1: "gpu idle",
    0x2: "applications clocks setting",
    0x4: "sw power cap",
    0x8: "hw slowdown",
    0x10: "sync boost",
    0x20: "sw thermal slowdown",
    0x40: "hw thermal slowdown",
    0x80: "hw power brake slowdown",
    0x100: "display clock setting",
}
HARMLESS_REASONS = {"gpu idle", "applications clocks setting", "sync boost", "display clock setting"}
HEALTH_SAMPLE_S = 0.05  # how often the health thread reads NVML while the products and steps run
IDLE_REASON = 0x1  # THROTTLE_REASONS' "gpu idle": a clock lowered for want of work, not held back


def open_health_reader(device: torch.device) -> Callable[[], dict[str, Any]] | None:
    """A function reading one sample of the health of this rank's GPU from NVML (the clock's reasons as NVML's bit
    mask, each figure None where NVML does not answer it); None off CUDA. Raises where NVML cannot be opened."""
    if device.type != "cuda":
        return None
    from scalelm.measure.monitor import device_uuid

    pynvml, handle = nvml.handle(device_uuid(device))
    read = nvml.read

    def reasons() -> int:  # "clocks event reasons" in newer bindings, "throttle reasons" in older ones
        query = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        return (query or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons)(handle)

    def sample() -> dict[str, Any]:
        return {
            "ecc_uncorrected": read(
                lambda: pynvml.nvmlDeviceGetTotalEccErrors(
                    handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
                )
            ),
            "sm_clock_mhz": read(lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
            "sm_clock_max_mhz": read(lambda: pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)),
            "reasons": read(reasons),
            "temperature_c": read(lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
            "power_limit_w": read(lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000),
        }

    return sample


def worst_health(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The worst of `samples` (open_health_reader's): the most uncorrected ECC errors since the driver loaded, the
    lowest SM clock among the samples of a busy GPU (an idle one lowers its clock by design) against its maximum,
    every reason the clock was held back, the highest temperature and the lowest power limit enforced (each absent
    where NVML reports none)."""

    def known(key: str, among: list[dict[str, Any]] = samples) -> list[Any]:
        return [sample[key] for sample in among if sample.get(key) is not None]

    busy = [sample for sample in samples if not (sample["reasons"] or 0) & IDLE_REASON] or samples
    reasons = 0
    for sample in samples:
        reasons |= sample["reasons"] or 0
    named = [name for bit, name in THROTTLE_REASONS.items() if reasons & bit]
    ecc = max(known("ecc_uncorrected"), default=None)
    health = {
        "ecc_uncorrected": ecc,
        "sm_clock_mhz": min(known("sm_clock_mhz", busy), default=None),
        "sm_clock_max_mhz": max(known("sm_clock_max_mhz"), default=None),
        "held_back_by": named,
        "healthy": not ecc and not set(named) - HARMLESS_REASONS,
    }
    if known("temperature_c"):
        health["temperature_c_max"] = max(known("temperature_c"))
    if known("power_limit_w"):  # a card capped below its rating clocks lower under the same work
        health["power_limit_w"] = min(known("power_limit_w"))
    return health


def gpu_health(device: torch.device) -> dict[str, Any] | None:
    """NVML's view of this rank's GPU now, in one sample (`worst_health`'s fields); None off CUDA. The baseline
    samples while it works instead (`health_sampler`): after the work the GPU is idle and no longer throttled."""
    try:
        reader = open_health_reader(device)
    except Exception as err:  # no NVML: a missing fact, not a failed baseline
        return {"error": str(err)}
    return None if reader is None else worst_health([reader()])


class HealthSampler:
    """Samples a GPU's health (`reader`) on a thread while the code inside `with` runs: at its start, then every
    `interval` seconds (default HEALTH_SAMPLE_S). `result()` is the worst seen (`worst_health`) with the number of
    samples; None without a
    reader (off CUDA); the reason where none could be read."""

    def __init__(
        self, reader: Callable[[], dict[str, Any]] | None, interval: float | None = None, error: str | None = None
    ):
        self.reader, self.interval, self.error = reader, interval or HEALTH_SAMPLE_S, error
        self.samples: list[dict[str, Any]] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, name="scalelm-gpu-health", daemon=True)

    def run(self) -> None:
        while True:
            try:
                self.samples.append(self.reader())
            except Exception as err:  # a GPU that stops answering: the samples so far stand
                self.error = f"{type(err).__name__}: {err}"
            if self.stopped.wait(self.interval):
                return

    def __enter__(self) -> HealthSampler:
        if self.reader is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.reader is not None:
            self.stopped.set()
            self.thread.join()

    def result(self) -> dict[str, Any] | None:
        if self.samples:
            return worst_health(self.samples) | {"samples": len(self.samples)}
        return None if self.error is None else {"error": self.error}


def health_sampler(device: torch.device) -> HealthSampler:
    """The sampler of this rank's GPU (one that reads nothing off CUDA or without NVML, saying why)."""
    try:
        return HealthSampler(open_health_reader(device))
    except Exception as err:  # no NVML: a missing fact, not a failed baseline
        return HealthSampler(None, error=str(err))
