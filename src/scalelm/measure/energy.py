"""Energy a training's steps used, as the hardware counts it: each rank's GPU through NVML's energy counter (its
power, integrated, where the counter is missing), or on CPUs each machine's processor packages through RAPL
(`/sys/class/powercap`), read by one rank per machine because every rank of it shares them. Where neither can be
read the energy is unknown, with the reason, never a guess.

An `EnergyMeter` works like the trainer's clock: `lap` gives the joules since the last lap, leaving out the spans
run inside `paused()` (evaluation, checkpoints), so joules per token are those of training steps.

What each counts: NVML the whole board (a MIG slice's reading is its GPU's, so slices of one GPU would count it
more than once: the meter refuses them); RAPL the packages (cores, caches, memory controller; not the DRAM zone
some CPUs add, nor the rest of the node), whatever else runs on them.

How far a lap can be trusted: NVML's power sensor samples only part of the runtime on recent GPUs (Yang et al.,
SC24), and its power reading is an average over the last second on Ampere and later; its energy counter, preferred
wherever the GPU has one, moves in steps. A run's total is sound, but a lap shorter than its counter's
`shortest_reliable_s` is noise: `lap_reading` says so (`EnergyLap.reliable`). RAPL's counters update often enough
for any lap."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from scalelm.measure import nvml

POWERCAP = Path("/sys/class/powercap")
POWER_SAMPLE_S = 0.1  # where NVML has power but no energy counter
NVML_RELIABLE_S = 1.0  # NVML's power is a one-second average (Ampere on), its sensor sampled part of the time


class Counter(Protocol):
    source: str
    shortest_reliable_s: float  # laps shorter than this are noise

    def joules(self) -> float:
        """Energy since some fixed origin (only differences mean anything)."""


class NvmlEnergy:
    """NVML's energy counter of one GPU (Volta and later): millijoules since the driver loaded."""

    source = "nvml energy counter"
    shortest_reliable_s = NVML_RELIABLE_S

    def __init__(self, nvml, handle):
        self.nvml, self.handle = nvml, handle
        self.joules()  # refused here where the GPU does not count

    def joules(self) -> float:
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000


class NvmlPower:
    """A GPU's power (milliwatts) read every POWER_SAMPLE_S by a thread and integrated (trapezoids): for GPUs whose
    NVML answers power but not energy."""

    source = "nvml power, integrated"
    shortest_reliable_s = NVML_RELIABLE_S

    def __init__(self, nvml, handle, interval: float = POWER_SAMPLE_S):
        self.nvml, self.handle, self.interval = nvml, handle, interval
        self.total, self.last = 0.0, (time.monotonic(), self.watts())
        self.lock, self.stopped = threading.Lock(), threading.Event()
        threading.Thread(target=self.run, name="scalelm-power", daemon=True).start()

    def watts(self) -> float:
        return self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000

    def sample(self) -> None:
        now, watts = time.monotonic(), self.watts()
        with self.lock:
            then, before = self.last
            self.total += (now - then) * (watts + before) / 2
            self.last = (now, watts)

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.sample()
            except self.nvml.NVMLError:
                continue

    def joules(self) -> float:
        self.sample()
        return self.total

    def close(self) -> None:
        self.stopped.set()


class Rapl:
    """The processor packages' energy counters (microjoules, each wrapping at its `max_energy_range_uj`)."""

    source = "rapl packages"
    shortest_reliable_s = 0.0

    def __init__(self, root: Path = POWERCAP):
        self.zones = sorted(p for p in root.glob("*-rapl:*") if p.name.count(":") == 1)  # packages, not subzones
        if not self.zones:
            raise OSError(f"no RAPL package zones under {root} (a virtual machine, or a CPU without RAPL)")
        self.ranges = [int((zone / "max_energy_range_uj").read_text()) for zone in self.zones]
        self.raw = [self.read(zone) for zone in self.zones]
        self.total = 0.0

    @staticmethod
    def read(zone: Path) -> int:
        try:
            return int((zone / "energy_uj").read_text())
        except PermissionError:
            raise PermissionError(
                f"{zone / 'energy_uj'} is readable by root only (since Linux 5.10): ask the site to make it readable "
                "to jobs (a udev rule or chmod at boot), or run without energy figures"
            ) from None

    def joules(self) -> float:
        now = [self.read(zone) for zone in self.zones]
        for before, after, span in zip(self.raw, now, self.ranges):
            self.total += ((after - before) % (span + 1)) / 1e6  # at most one wrap between readings
        self.raw = now
        return self.total


def gpu_counter(uuid: str) -> Counter:
    """The counter of the GPU named by its NVML UUID: the energy counter, else power integrated."""
    if uuid.startswith("MIG-"):
        raise OSError("a MIG slice: NVML counts its whole GPU's energy, which other slices' jobs share")
    pynvml, handle = nvml.handle(uuid)
    try:
        return NvmlEnergy(pynvml, handle)
    except pynvml.NVMLError:
        return NvmlPower(pynvml, handle)


@dataclass(frozen=True)
class EnergyLap:
    """One lap: its joules (None once the energy is unknown), the seconds they were measured over (the lap's, less
    the paused spans), and whether those were long enough for the counter (`Counter.shortest_reliable_s`)."""

    joules: float | None
    seconds: float
    reliable: bool


class EnergyMeter:
    """Joules of training between laps, without the `paused()` spans; `counter` None means this rank reads
    nothing (0 J: another rank of its machine reads the packages) and `unknown` says why none could be read."""

    def __init__(self, counter: Counter | None = None, unknown: str | None = None):
        self.counter, self.unknown = counter, unknown
        self.source = counter.source if counter else None
        self.start = self.read()
        self.started = time.monotonic()
        self.paused_j = self.paused_s = 0.0

    @classmethod
    def open(cls, device_uuid: str | None, reads_machine: bool) -> EnergyMeter:
        """This rank's meter: its GPU's (`device_uuid`), or on CPU its machine's packages where `reads_machine`."""
        try:
            if device_uuid is not None:
                return cls(gpu_counter(device_uuid))
            return cls(Rapl(POWERCAP) if reads_machine else None)
        except Exception as err:
            return cls(unknown=f"{type(err).__name__}: {err}")

    def read(self) -> float:
        if self.unknown is not None:
            return 0.0
        try:
            return self.counter.joules() if self.counter else 0.0
        except Exception as err:
            self.unknown = f"{type(err).__name__}: {err}"
            return 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        start, started = self.read(), time.monotonic()
        try:
            yield
        finally:
            self.paused_j += self.read() - start
            self.paused_s += time.monotonic() - started

    def lap(self) -> float | None:
        """Joules since the last lap, outside the paused spans; None once the energy is unknown."""
        return self.lap_reading().joules

    def lap_reading(self) -> EnergyLap:
        """The lap since the last one (`lap`'s joules), with its span and whether it is long enough to trust."""
        now, ended = self.read(), time.monotonic()
        joules, seconds = now - self.start - self.paused_j, ended - self.started - self.paused_s
        self.start, self.started, self.paused_j, self.paused_s = now, ended, 0.0, 0.0
        if self.unknown is not None:
            return EnergyLap(None, seconds, False)
        shortest = self.counter.shortest_reliable_s if self.counter else 0.0  # no counter: an exact 0 J
        return EnergyLap(joules, seconds, seconds >= shortest)

    def close(self) -> None:
        if hasattr(self.counter, "close"):
            self.counter.close()
