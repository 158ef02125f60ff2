"""How busy a run's hosts were with other work while it trained: the host's CPU time (psutil) against the CPU time
of the run's own processes on it. A timed run beside other work on its cores measures both; the summary marks it."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import psutil


def machine_id() -> str:
    """The machine this process runs on: its kernel's boot id, which the containers and network namespaces on one
    machine share (the test cluster's nodes n1 and n2, the local default's "nodes"), else its host name. Ranks with
    one id share that machine's cores."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8] or socket.gethostname()
    except OSError:
        return socket.gethostname()


def _busy_seconds() -> float:
    times = psutil.cpu_times()  # Linux counts guest time inside user and nice already
    return sum(getattr(times, field, 0.0) for field in ("user", "nice", "system", "irq", "softirq", "steal"))


def _own_seconds() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system  # every thread of this process


def _clocks() -> tuple[float, float, float]:
    """Wall time, the host's busy CPU time, this process's CPU time."""
    return time.monotonic(), _busy_seconds(), _own_seconds()


def _since(start: tuple[float, float, float]) -> tuple[float, float, float]:
    return tuple(now - then for now, then in zip(_clocks(), start))


class OtherWork:
    """The CPU cores this host spent on other processes since it was made (a calibration's check that it ran alone)."""

    def __init__(self) -> None:
        self.start = _clocks()

    def cores(self) -> float:
        wall, busy, own = _since(self.start)
        return max(0.0, busy - own) / wall


class HostLoad:
    """Started when training starts; `reading` gives this process's part: its host, the wall time, the host's busy
    CPU time and this process's; `per_host` of every rank's readings each host's CPU use in cores, over the run."""

    def __init__(self) -> None:
        self.start = _clocks()

    def reading(self) -> tuple[str, float, float, float]:
        return (socket.gethostname(), *_since(self.start))

    @staticmethod
    def per_host(ranks: list[tuple[str, float, float, float]]) -> dict[str, dict[str, Any]]:
        hosts: dict[str, dict[str, Any]] = {}
        for host, wall, busy, own in ranks:
            entry = hosts.setdefault(host, {"cpus": psutil.cpu_count(), "wall": wall, "busy": busy, "run": 0.0})
            entry["run"] += own
        return {
            host: {
                "cpus": h["cpus"],
                "busy_cores": h["busy"] / h["wall"],
                "run_cores": h["run"] / h["wall"],
                "other_cores": max(0.0, h["busy"] - h["run"]) / h["wall"],  # what else the host's CPUs did
            }
            for host, h in hosts.items()
        }
