"""Rule `plan`, before every training: scalelm.plan predicts the experiment's per-GPU memory on the site's GPUs
(site.gpu_memory_gb, else the memory of the catalogue's site.gpu), or on the local default, where every process runs
on this machine's CPUs, the memory of all its processes against this machine's; one that cannot fit is refused by name
with the predicted figures, and no training is submitted, unless the experiment sets `check_memory: false`. The plan
is written beside the run (plan.json)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import psutil

from scalelm.data.manifest import read_manifest
from scalelm.errors import ConfigError
from scalelm.files import atomic_write_text
from scalelm.plan.catalogue import gpu_memory_gb
from scalelm.plan.layouts import Candidate, Machine, gb, plan_layout
from scalelm.plan.memory import PARTS, Workload
from scalelm.site import SiteConfig
from scalelm.study.experiments import Experiment

GIB = 2**30
# what a CPU training process holds beside the tensors the plan counts: a process that has only imported torch and
# scalelm's trainer (docs/plan.md, "Plan against measurement")
PROCESS_RUNTIME_BYTES = 301 * 2**20


def host_memory_bytes() -> int:
    """This machine's memory: all of it, not what is free now (other trainings of the study may hold the rest)."""
    return psutil.virtual_memory().total


def plan_experiment(
    experiment: Experiment, site: SiteConfig, vocab_size: int, host_bytes: int | None = None
) -> dict[str, Any]:
    """The experiment's plan on the site's GPUs; on CPUs, against `host_bytes` where every process runs on one
    machine with that much memory (the local default); else (a cluster's CPU nodes) nothing to check against."""
    work = Workload(experiment.config, vocab_size, "cuda" if site.gpus_per_node else "cpu")
    memory_gb = gpu_memory_gb(site.gpu_memory_gb, site.gpu) if site.gpus_per_node else None
    machine = Machine(experiment.nodes, experiment.procs_per_node, memory_gb or math.inf)
    plan = plan_layout(work, Candidate(experiment.name, experiment.dims, experiment.strategy), machine)
    record = plan.to_dict() | {"device": work.device, "gpu_memory_gb": memory_gb}
    if memory_gb is not None:
        return record | {"usable_bytes": machine.usable_bytes}
    record |= {"fits": None, "usable_bytes": None}  # unknown: the site names no GPU memory
    if work.device != "cpu" or host_bytes is None:
        return record
    return record | host_plan(plan.memory.total, experiment.world_size, host_bytes, machine.headroom)


def host_plan(process_bytes: int, processes: int, host_bytes: int, headroom: float) -> dict[str, Any]:
    """`processes` of `process_bytes` each (the plan's fullest rank) and their runtime, on one machine of `host_bytes`
    of which `headroom` is left to the system."""
    needed = processes * (process_bytes + PROCESS_RUNTIME_BYTES)
    usable = host_bytes * (1 - headroom)
    return {
        "host_memory_bytes": host_bytes,
        "host_processes": processes,
        "host_needed_bytes": needed,
        "host_usable_bytes": usable,
        "fits": needed <= usable,
    }


def check_fits(experiment: Experiment, plan: dict[str, Any], check: bool = True) -> None:
    if plan["fits"] is not False or not check:
        return
    if "host_memory_bytes" in plan:
        raise ConfigError(host_refusal(experiment, plan))
    parts = ", ".join(f"{part} {gb(plan['bytes'][part])}" for part in PARTS)
    raise ConfigError(
        f"experiment {experiment.name} ({experiment.nodes} x {experiment.procs_per_node} GPUs, layout "
        f"{experiment.dims.layout}) does not fit the site's GPUs of {plan['gpu_memory_gb']:g} GB: scalelm.plan "
        f"predicts {gb(plan['total_bytes'])} GB per GPU ({parts}) against {gb(plan['usable_bytes'])} GB usable. "
        "Shard more or lower the batch (`python -m scalelm.plan --config <its training config> --nodes N "
        f"--gpus-per-node G --gpu-memory-gb M` lists the layouts that fit), or set "
        f"experiments.{experiment.name}.check_memory: false to submit it anyway"
    )


def host_refusal(experiment: Experiment, plan: dict[str, Any]) -> str:
    """Why an experiment's processes cannot fit this machine's memory, and what to change (GiB: 2^30 bytes)."""
    parts = ", ".join(f"{part} {plan['bytes'][part] / GIB:,.2f}" for part in PARTS)
    per_process = plan["total_bytes"] + PROCESS_RUNTIME_BYTES
    share = 1 - plan["host_usable_bytes"] / plan["host_memory_bytes"]
    return (
        f"experiment {experiment.name} ({experiment.nodes} x {experiment.procs_per_node} = {plan['host_processes']} "
        f"processes on this machine, layout {experiment.dims.layout}) does not fit its memory of "
        f"{plan['host_memory_bytes'] / GIB:,.1f} GiB: scalelm.plan predicts {per_process / GIB:,.2f} GiB per process "
        f"({parts}, the interpreter and torch {PROCESS_RUNTIME_BYTES / GIB:,.2f}) x {plan['host_processes']} = "
        f"{plan['host_needed_bytes'] / GIB:,.2f} GiB against {plan['host_usable_bytes'] / GIB:,.1f} GiB usable "
        f"({share:.0%} left to the system). Shard more (fsdp), lower the batch or the model (a mixture's experts), "
        "run fewer processes (nodes, procs_per_node in config/local.yaml) or run it on a cluster "
        f"(--profile profiles/slurm), or set experiments.{experiment.name}.check_memory: false to run it anyway"
    )


def write_plan(
    experiment: Experiment, site: SiteConfig, prepared_dir: str | Path, out: str | Path, on_this_machine: bool = False
) -> None:
    """The rule `plan`: refuse an experiment that cannot fit, else write its plan. `on_this_machine`: every process
    of the experiment runs here (the local default), and its memory is planned against this machine's."""
    host_bytes = host_memory_bytes() if on_this_machine else None
    plan = plan_experiment(experiment, site, read_manifest(prepared_dir)["vocab_size"], host_bytes)
    check_fits(experiment, plan, experiment.check_memory)
    atomic_write_text(out, json.dumps(plan, indent=1) + "\n")
