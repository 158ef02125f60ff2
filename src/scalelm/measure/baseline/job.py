"""One job's baseline measured: each rank's figures alone on its device, one rank at a time (the matrix products, the
elementwise bandwidth, the model's steps, the layouts' overheads, its GPU's health), then the ranks' together (a
host's throughput, the collectives), gathered on the first rank into the baseline's JSON, with NCCL logging at INFO
for the run."""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scalelm.measure.baseline.collective_waits import collective_waits
from scalelm.measure.baseline.collectives import message_sizes, node_group, time_collectives
from scalelm.measure.baseline.gpu_health import health_sampler
from scalelm.measure.baseline.layout_overheads import layout_overheads
from scalelm.measure.baseline.model_step import model_step_figures, model_step_seconds
from scalelm.measure.baseline.nccl_network import forced_environment, nccl_debug_env, nccl_network
from scalelm.measure.baseline.rates import elementwise_gbps, matmul_rates
from scalelm.measure.baseline.shapes import gemm_shapes, output_shape, prepared_vocabulary
from scalelm.measure.baseline.timing import timed
from scalelm.site import SCOPES

if TYPE_CHECKING:  # torch is imported where the measuring starts: the workflow reads this module without it
    import torch


def measure(args: argparse.Namespace) -> dict[str, Any] | None:
    """The baseline of this job (None on every rank but the first). On CUDA NCCL logs at INFO whatever the site
    set (its WARN would hide the network it chose), for this run only, the site's setting restored afterwards. NCCL
    reads it once per process, when first used: in a process that used NCCL before, the network stays unknown."""
    import torch

    logs = args.out.parent / f"{args.out.stem}.nccl"
    detection: dict[str, str] = {}
    if torch.cuda.is_available():
        logs.mkdir(parents=True, exist_ok=True)
        detection = nccl_debug_env(logs)
    with forced_environment(detection):
        return measure_job(args, logs)


def measure_alone(
    config,
    shapes: dict[str, tuple[int, int, int]],
    vocab: int,
    device: torch.device,
    all_cores: bool,
    mesh=None,
    moe=None,
    small_step: bool = True,
) -> dict[str, Any]:
    """This rank's products, elementwise bandwidth and model steps, alone on its device, with its GPU's health
    sampled while they run; with `all_cores` (a CPU's first rank) also the step with every core as a thread; with
    `mesh` (this rank alone: the first rank's) also the layouts' overheads (`layout_overheads`, with `moe`). Without
    `small_step`, no step at a quarter of the tokens: compiled, that is a second cold compile (a minute or more of
    gpt2_small on a GPU)."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    compiled = bool(config.train.compile)
    m = shapes["output"][0]
    small = max(config.data.seq_len, m // 4)  # a quarter of the tokens: what a step costs regardless
    figures: dict[str, Any] = {"model_step_all_cores_s": None}
    with health_sampler(device) as health:
        figures |= {
            "matmul": matmul_rates(shapes, device, dtype),
            "elementwise_gbps": elementwise_gbps(m * vocab, device),
        }
        figures |= timed("model_step_s", model_step_seconds(config, vocab, m, device, compiled))
        if small_step:
            figures |= timed("model_step_small_s", model_step_seconds(config, vocab, small, device, compiled))
            figures["model_step_small_tokens"] = small
        if mesh is not None:
            figures |= layout_overheads(config, vocab, m, device, mesh, compiled, moe)
        if all_cores:
            threads = torch.get_num_threads()
            torch.set_num_threads(len(os.sched_getaffinity(0)))
            figures["model_step_all_cores_s"] = model_step_seconds(config, vocab, m, device, compiled)[1]
            torch.set_num_threads(threads)
    return figures | {"model_step_compiled": compiled, "gpu": health.result()}


def measure_job(args: argparse.Namespace, logs: Path) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from scalelm.config import load_config
    from scalelm.measure.hostload import HostLoad, machine_id
    from scalelm.parallel.env import all_gather_object, barrier, setup, teardown

    env = setup("auto", 600)
    load = HostLoad()  # other work beside the baseline lowers its rates: the report marks it (report.disturbance)
    try:
        device = env.device
        config = load_config(args.config)
        shapes = gemm_shapes(config, device.type)
        m, _, vocab = output_shape(config)
        prepared = prepared_vocabulary(config) is not None  # else the stand-in's vocabulary: the log says so
        alone: dict[str, Any] = {}
        mesh = None
        if dist.is_initialized():  # each rank's mesh of itself alone, for the layouts' overheads (every rank makes it)
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(dist.new_subgroups(group_size=1)[0], device.type)
        elif args.moe is not None:
            print(
                "note: --moe is unused in one process: its mixture's dispatch is timed among the layouts' overheads, "
                "which only a baseline of two processes or more measures (torchrun --nproc-per-node=2 or more)",
                flush=True,
            )
        for rank in range(env.world_size):  # one at a time: no two share a device or a core
            if dist.is_initialized():
                dist.barrier()
            if rank == env.rank:  # on CPU rank 0 also runs one process with every core as a thread
                first = rank == 0
                alone = measure_alone(
                    config, shapes, vocab, device, device.type == "cpu" and first, mesh if first else None, args.moe
                )
        crowded = None
        if device.type == "cpu" and env.world_size > 1:  # every rank at once, as in training: the host's throughput
            dist.barrier()
            crowded = timed(
                "model_step_together_s", model_step_seconds(config, vocab, m, device, alone["model_step_compiled"])
            )
        collectives, latency = [], {}
        if env.world_size > 1:
            within = node_group(env.procs_per_node, env.world_size)
            if device.type == "cpu":  # a node's ranks at once, as a layout's groups within nodes run
                latency = collective_waits(config, vocab, m, device, within)
            sizes = message_sizes(args.min_bytes, args.max_bytes)
            collectives = time_collectives(SCOPES[0], dist.group.WORLD, sizes, device, args.iterations)
            if within is not None:
                collectives += time_collectives(SCOPES[1], within, sizes, device, args.iterations)
        per_rank = all_gather_object(
            {
                "rank": env.rank,
                "host": socket.gethostname(),
                "machine": machine_id(),
                **alone,
                **(crowded or {"model_step_together_s": None}),
                "threads": torch.get_num_threads(),
                "cpus": len(os.sched_getaffinity(0)),
                "load": load.reading(),
            }
        )
        barrier()  # every rank done with every collective before any shuts its process groups down
        if not env.is_main:
            return None
        network = nccl_network([p.read_text(errors="replace") for p in logs.glob("*.log")]) if logs.is_dir() else None
        return {
            "world_size": env.world_size,
            "procs_per_node": env.procs_per_node,
            "hosts": sorted({r["host"] for r in per_rank}),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "torch": torch.__version__,
            "matmul_tflops_min": min(r["matmul"]["tflops"] for r in per_rank),
            "elementwise_gbps_min": min(r["elementwise_gbps"] for r in per_rank),
            "model_step": model_step_figures(m, per_rank)
            | {
                "compiled": alone["model_step_compiled"],
                "vocab_size": vocab,
                "prepared": prepared,
            },
            "per_rank": per_rank,
            "collectives": collectives,
            **latency,
            "nccl_network": network,
            "host_load": HostLoad.per_host([r["load"] for r in per_rank]),  # per host: its and other work's cores
        }
    finally:
        teardown()
