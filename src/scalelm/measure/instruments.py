"""What a training measures besides its loss, in one place, behind the few calls the trainer makes: `start`, `step`
around each optimizer step (the communication profile of the last steps), `note_state` once the state exists (this
rank's parameters, gradients and optimizer state), `batches` around the batch iterator (the host time spent
producing batches), `paused` around evaluations and checkpoints, `interval` at a log line (the peak memory, the
data time, the energy, and whether the profiler ran), `mfu`, and at the end the hosts' load and `results` (what
run.json records beside the plan). Nothing here changes the training; its collectives run on every rank in the
same order."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from scalelm.config import Config
from scalelm.measure.comm import CommProfile
from scalelm.measure.device import peak_memory_mb
from scalelm.measure.energy import EnergyMeter
from scalelm.measure.hostload import HostLoad, machine_id
from scalelm.measure.monitor import device_uuid
from scalelm.measure.peak import mfu, peak_flops
from scalelm.model.architecture import flops_per_token
from scalelm.parallel.env import DistEnv, all_gather_object, global_reduce
from scalelm.parallel.pipeline import Pipeline
from scalelm.parallel.runtime import Parallel
from scalelm.plan.memory import Workload, plan_memory

STATE_KINDS = ("params", "grads", "optimizer")
T = TypeVar("T")


class Instruments:
    def __init__(
        self,
        config: Config,
        env: DistEnv,
        parallel: Parallel,
        pipeline: Pipeline | None,
        workload: Workload,
        total_steps: int,
        start_step: int,
    ):
        self.env, self.parallel, self.pipeline, self.workload = env, parallel, pipeline, workload
        self.flops_per_token = flops_per_token(config.model, workload.vocab_size, config.data.seq_len)
        # one device's peak, from rank 0: on CPU its calibration runs while the other ranks wait, sharing no core
        mine = peak_flops(env.device, parallel.precision, config.train.peak_tflops) if env.is_main else None
        self.peak_flops, self.peak_source = all_gather_object(mine)[0]
        # the collectives timed on the last steps (the profiler's records would distort every figure after them)
        self.comm = CommProfile(
            config.train.comm_profile_steps, total_steps, start_step, env.device, env.world_size > 1
        )
        self.state_bytes: dict[str, int] | None = None  # this rank's, from this attempt's first step
        self.steady_peak_mb = math.nan  # this rank's, from the last interval without the profiler
        self.host_load: HostLoad | None = None
        self.data_seconds = 0.0  # since the last log line
        machines = all_gather_object(machine_id())  # on CPUs the machine's first rank reads its packages
        self.energy = EnergyMeter.open(device_uuid(env.device), machines.index(machines[env.rank]) == env.rank)

    def start(self) -> None:
        """At the start of training: the hosts' CPU load is measured from here to `results`, the energy from here."""
        self.host_load = HostLoad()
        self.energy.lap()

    def step(self, step: int) -> AbstractContextManager:
        return self.comm.step(step)

    def paused(self) -> AbstractContextManager:
        """Around what is not training (evaluation, checkpoints), inside the clock's pause: its energy is left out."""
        return self.energy.paused()

    def note_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Once, after an optimizer step and before zero_grad: every tensor of the state exists then."""
        if self.state_bytes is None:
            self.state_bytes = self.parallel.state_bytes(model, optimizer)

    def batches(self, batches: Iterable[T]) -> Iterator[T]:
        """`batches`, timing how long the host takes to produce each: what data loading costs a step at most (on
        a GPU the host runs ahead of the device, which may hide it)."""
        iterator = iter(batches)
        while True:
            start = time.perf_counter()
            item = next(iterator, None)
            self.data_seconds += time.perf_counter() - start
            if item is None:
                return
            yield item

    def interval(self, first_step: int, last_step: int, seconds: float, tokens: int) -> dict[str, Any]:
        """At a log line (a collective), the interval's figures of the metrics line: the largest rank's peak
        memory and reserved memory (MiB; None on CPU), its largest share of the `seconds` spent producing batches,
        the job's energy in its steps and per token of its `tokens` (None where a rank could not measure it; not
        `energy_reliable` where a rank's interval was shorter than its counter resolves), and whether the profiler ran
        in it (its time is then no steady-state figure)."""
        peak, reserved = peak_memory_mb(self.env.device)
        profiled = any(self.comm.covers(step) for step in range(first_step, last_step + 1))
        if not profiled:
            self.steady_peak_mb = peak  # before the profiler's records and the final evaluation
        lap = self.energy.lap_reading()
        mine = [
            peak,
            reserved if reserved is not None else -1.0,
            self.data_seconds / seconds if seconds else 0.0,
            0.0 if lap.reliable else 1.0,
        ]
        self.data_seconds = 0.0
        largest = global_reduce(torch.tensor(mine, device=self.env.device), dist.ReduceOp.MAX)
        peak, reserved, data_share, unreliable = largest.tolist()
        joules = lap.joules
        joules = global_reduce(torch.tensor(math.nan if joules is None else joules, device=self.env.device)).item()
        joules = None if math.isnan(joules) else joules
        return {
            "peak_mem_mb": peak,
            "peak_reserved_mb": reserved if reserved >= 0 else None,  # CUDA's caching allocator; None on CPU
            "data_share": data_share,
            "energy_j": joules,
            "joules_per_token": joules / tokens if joules is not None and tokens else None,
            # an NVML interval under its sensor's averaging window is noise; run totals are not (docs/gpu.md, 12)
            "energy_reliable": joules is not None and not unreliable,
            "profiled": profiled,
        }

    def mfu(self, tokens_per_s: float) -> float | None:
        return mfu(self.flops_per_token, tokens_per_s, self.env.world_size, self.peak_flops)

    def host_loads(self) -> dict[str, dict[str, Any]]:
        """Each host's CPU use since `start`, by the run and by other work (a collective)."""
        return HostLoad.per_host(all_gather_object(self.host_load.reading()))

    def results(self, tokens_seen: int, train_seconds: float, energy_j: float | None) -> dict[str, Any]:
        """The measured figures of run.json's results (a collective), beside scalelm.plan's for the layout."""
        return {
            "energy": self.energy_summary(tokens_seen, energy_j),
            "state_mb_per_rank": self.state_mb_per_rank(),
            # scalelm.plan's figures for this layout, the measured ones' reference (MiB, the fullest rank)
            "plan_mb_per_rank": plan_memory(self.workload, self.parallel.dims).mb(),
            **self.pipeline_measurements(),
            "comm": self.comm_summary(),
            "mfu": self.mfu(tokens_seen / train_seconds) if train_seconds else None,
            "flops_per_token": self.flops_per_token,
            "peak_flops_per_device": self.peak_flops,
            "peak_flops_source": self.peak_source,
        }

    def energy_summary(self, tokens_seen: int, energy_j: float | None) -> dict[str, Any]:
        """The run's energy in training steps (every attempt's, the job's devices together) and per token, what
        counted it, and why it is unknown where it is (a collective)."""
        self.energy.close()
        readings = all_gather_object((self.energy.source, self.energy.unknown))
        unknown = sorted({f"rank {rank}: {why}" for rank, (_, why) in enumerate(readings) if why})
        if energy_j is None and not unknown:
            unknown = ["an earlier attempt of this run could not measure it"]
        known = not unknown and energy_j is not None
        return {
            "joules": energy_j if known else None,
            "joules_per_token": energy_j / tokens_seen if known and tokens_seen else None,
            "source": ", ".join(sorted({source for source, _ in readings if source})) or None,
            "unknown": "; ".join(unknown[:4]) or None,
        }

    def pipeline_measurements(self) -> dict[str, Any]:
        """A pipeline's bubble, timeline and per-stage memory (scalelm.parallel.pipeline); nothing without one."""
        if self.pipeline is None:
            return {}
        return {"pipeline": self.pipeline.measurements(self.comm.covers, self.steady_peak_mb)}

    def state_mb_per_rank(self) -> dict[str, float] | None:
        """The largest rank's parameters, gradients and optimizer state (MiB), measured on this attempt's first step."""
        mine = [float(self.state_bytes[k]) if self.state_bytes else -1.0 for k in STATE_KINDS]
        largest = global_reduce(torch.tensor(mine, device=self.env.device), dist.ReduceOp.MAX).tolist()
        if min(largest) < 0:  # no step ran in this attempt (it resumed at the end)
            return None
        return {k: v / 2**20 for k, v in zip(STATE_KINDS, largest)} | {"total": sum(largest) / 2**20}

    def comm_summary(self) -> dict[str, Any] | None:
        """The share of the profiled steps during which a collective ran, and an all-to-all (expert parallelism's):
        mean and largest over the ranks, with rank 0's time per collective. None if this attempt ended before its
        profiled steps."""
        if self.env.world_size == 1:
            return {
                "share": 0.0,
                "comm_s_per_step": 0.0,
                "all_to_all_share": 0.0,
                "all_to_all_s_per_step": 0.0,
                "note": "one process: no communication",
            }
        results = all_gather_object(self.comm.result)
        if any(r is None for r in results):
            return None
        shares = [r["share"] for r in results]
        exchanges = [r["all_to_all_share"] for r in results]
        return {
            "steps": results[0]["steps"],
            "share": sum(shares) / len(shares),
            "share_max": max(shares),
            "share_per_rank": shares,  # the rank that waits least is the one the others wait for
            "comm_s_per_step": sum(r["comm_s_per_step"] for r in results) / len(results),
            "all_to_all_share": sum(exchanges) / len(exchanges),
            "all_to_all_share_max": max(exchanges),
            "all_to_all_s_per_step": sum(r["all_to_all_s_per_step"] for r in results) / len(results),
            "step_s": results[0]["step_s"],
            "ops_s_per_step_rank0": results[0]["ops_s_per_step"],
        }
