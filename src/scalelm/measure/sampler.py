"""Live utilisation, the course's monitoring page built in: one sampler process per node beside the training.

Every `interval` seconds it appends one JSON line to `<run_dir>/monitor/node<k>.jsonl`: for each training process
of the node its CPU use (percent of one core) and RSS (psutil), and for each of the node's GPUs its utilisation,
memory used and power (NVML, through nvidia-ml-py). It runs as its own process, so the training's ranks do no
sampling work; its last line records its own CPU time, which is what it cost the node. It stops when its standard
input closes: the training closes it when it ends, and the system does when the training dies. The sampler imports
neither torch nor the rest of scalelm, so it starts in a fraction of a second.

With `--board DIR` the same readings go to TensorBoard event files in DIR (tensorboard's own event writer, the one
torch's SummaryWriter uses), numbered by sample across the attempts of a run: `utilisation/rank<r>_cpu_percent`,
`memory/rank<r>_rss_mb`, `gpu<id>/util_percent`, `gpu<id>/memory_used_mb`, `gpu<id>/power_w`.

    python -m scalelm.measure.sampler --out FILE --interval 1 --proc RANK:PID ... [--gpu INDEX_OR_UUID ...]
        [--board DIR] < pipe
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from scalelm.measure import nvml


class GpuSampler:
    """NVML readings of the node's GPUs, by UUID (each rank's `device_uuid`) or NVML index."""

    def __init__(self, devices: list[str]):
        self.nvml = nvml.binding()
        self.handles = [nvml.handle(d)[1] for d in devices]
        self.devices = devices

    def sample(self) -> list[dict[str, Any]]:
        """One reading per GPU; a reading the GPU does not support (a MIG slice has no utilisation or power, some
        GPUs no power) is null, and the others go on."""
        nvml = self.nvml
        readers = {
            "util_percent": lambda handle: float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            "memory_used_mb": lambda handle: self.memory_used(handle) / 2**20,
            "power_w": lambda handle: nvml.nvmlDeviceGetPowerUsage(handle) / 1000,
        }
        readings = []
        for device, handle in zip(self.devices, self.handles):
            reading: dict[str, Any] = {"gpu": device}
            for key, read in readers.items():
                try:
                    reading[key] = read(handle)
                except nvml.NVMLError:
                    reading[key] = None
            readings.append(reading)
        return readings

    def memory_used(self, handle) -> int:
        """Bytes in use as nvidia-smi counts them: NVML's v2 query sets the driver's reserved memory apart, while
        v1's `used` (total - free) includes it; v1 where the driver or the binding lacks v2."""
        nvml = self.nvml
        try:
            return nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2).used
        except (nvml.NVMLError, AttributeError, TypeError):
            return nvml.nvmlDeviceGetMemoryInfo(handle).used


def sample_processes(processes: dict[int, psutil.Process]) -> list[dict[str, Any]]:
    readings = []
    for rank, process in processes.items():
        try:
            with process.oneshot():
                readings.append(
                    {
                        "rank": rank,
                        "cpu_percent": process.cpu_percent(None),
                        "rss_mb": process.memory_info().rss / 2**20,
                    }
                )
        except psutil.Error:  # the process has ended
            continue
    return readings


def stop_requested(timeout: float) -> bool:
    """Wait up to `timeout` seconds for the end of standard input (the training closed it, or is gone)."""
    ready, _, _ = select.select([sys.stdin], [], [], max(0.0, timeout))
    return bool(ready) and not os.read(sys.stdin.fileno(), 4096)


class TensorBoardWriter:
    """A sample's readings as TensorBoard scalars, numbered on from the samples earlier attempts wrote to `out`."""

    def __init__(self, directory: Path, out: Path):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.event, self.summary = Event, Summary
        self.writer = EventFileWriter(str(directory))
        earlier = out.read_text().splitlines() if out.is_file() else []
        self.step = sum(1 for line in earlier if line and json.loads(line)["kind"] == "sample")

    def add(self, record: dict[str, Any]) -> None:
        values = {}
        for proc in record["procs"]:
            values[f"utilisation/rank{proc['rank']}_cpu_percent"] = proc["cpu_percent"]
            values[f"memory/rank{proc['rank']}_rss_mb"] = proc["rss_mb"]
        for gpu in record.get("gpus", []):
            values |= {f"gpu{gpu['gpu']}/{k}": v for k, v in gpu.items() if k != "gpu" and v is not None}
        summary = self.summary(value=[self.summary.Value(tag=tag, simple_value=v) for tag, v in values.items()])
        self.writer.add_event(self.event(wall_time=record["time"], step=self.step, summary=summary))
        self.writer.flush()
        self.step += 1

    def close(self) -> None:
        self.writer.close()


def run(out: Path, interval: float, ranks: dict[int, int], gpus: list[str], board_dir: Path | None = None) -> None:
    processes = {rank: psutil.Process(pid) for rank, pid in ranks.items()}
    for process in processes.values():
        process.cpu_percent(None)  # the first call only starts the measurement
    gpu = None
    if gpus:
        try:
            gpu = GpuSampler(gpus)
        except Exception as err:  # no NVML here (a container without --nv, a driver without it): CPU samples only
            print(
                f"scalelm monitor: no GPU readings ({type(err).__name__}: {err}); sampling CPU and memory only",
                file=sys.stderr,
                flush=True,
            )
    me, began = psutil.Process(), time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    tensorboard = TensorBoardWriter(board_dir, out) if board_dir else None
    with out.open("a") as handle:
        tick = time.monotonic()
        while True:
            tick = max(tick + interval, time.monotonic())  # late (a starved core): no burst of samples to catch up
            if stop_requested(tick - time.monotonic()):
                break
            record = {"kind": "sample", "time": time.time(), "procs": sample_processes(processes)}
            if gpu:
                record["gpus"] = gpu.sample()
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            if tensorboard:
                tensorboard.add(record)
        if tensorboard:
            tensorboard.close()
        cost = me.cpu_times()
        wall = time.monotonic() - began
        handle.write(
            json.dumps({"kind": "end", "time": time.time(), "wall_s": wall, "cpu_s": cost.user + cost.system}) + "\n"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalelm.measure.sampler", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--proc", action="append", default=[], help="RANK:PID of a training process (repeatable)")
    parser.add_argument("--gpu", action="append", default=[], help="NVML index or UUID of a GPU (repeatable)")
    parser.add_argument("--board", type=Path, help="also write the readings as TensorBoard event files here")
    args = parser.parse_args(argv)
    ranks = {int(rank): int(pid) for rank, pid in (p.split(":") for p in args.proc)}
    run(args.out, args.interval, ranks, args.gpu, args.board)


if __name__ == "__main__":
    main()
