"""Rule `plan`, before every training: scalelm.plan predicts the experiment's per-GPU memory on the site's GPUs
(site.gpu_memory_gb); one that cannot fit is refused by name with the predicted figures, and no training is submitted,
unless the experiment sets `check_memory: false`. The plan is written beside the run (plan.json)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from scalelm.data.manifest import read_manifest
from scalelm.errors import ConfigError
from scalelm.files import atomic_write_text
from scalelm.plan.layouts import Candidate, Machine, gb, plan_layout
from scalelm.plan.memory import PARTS, Workload
from scalelm.site import SiteConfig
from scalelm.study.experiments import Experiment


def plan_experiment(experiment: Experiment, site: SiteConfig, vocab_size: int) -> dict[str, Any]:
    """The experiment's plan on the site's GPUs (CPU nodes without a site: nothing to check against)."""
    work = Workload(experiment.config, vocab_size, "cuda" if site.gpus_per_node else "cpu")
    memory_gb = site.gpu_memory_gb if site.gpus_per_node else None
    machine = Machine(experiment.nodes, experiment.procs_per_node, memory_gb or math.inf)
    plan = plan_layout(work, Candidate(experiment.name, experiment.dims, experiment.strategy), machine)
    record = plan.to_dict() | {"device": work.device, "gpu_memory_gb": memory_gb}
    if memory_gb is None:
        return record | {"fits": None, "usable_bytes": None}  # unknown: the site names no GPU memory
    return record | {"usable_bytes": machine.usable_bytes}


def check_fits(experiment: Experiment, plan: dict[str, Any], check: bool = True) -> None:
    if plan["fits"] is not False or not check:
        return
    parts = ", ".join(f"{part} {gb(plan['bytes'][part])}" for part in PARTS)
    raise ConfigError(
        f"experiment {experiment.name} ({experiment.nodes} x {experiment.procs_per_node} GPUs, layout "
        f"{experiment.dims.layout}) does not fit the site's GPUs of {plan['gpu_memory_gb']:g} GB: scalelm.plan "
        f"predicts {gb(plan['total_bytes'])} GB per GPU ({parts}) against {gb(plan['usable_bytes'])} GB usable. "
        "Shard more or lower the batch (`python -m scalelm.plan --config <its training config> --nodes N "
        f"--gpus-per-node G --gpu-memory-gb M` lists the layouts that fit), or set "
        f"experiments.{experiment.name}.check_memory: false to submit it anyway"
    )


def write_plan(experiment: Experiment, site: SiteConfig, prepared_dir: str | Path, out: str | Path) -> None:
    """The rule `plan`: refuse an experiment that cannot fit, else write its plan."""
    plan = plan_experiment(experiment, site, read_manifest(prepared_dir)["vocab_size"])
    check_fits(experiment, plan, experiment.check_memory)
    atomic_write_text(out, json.dumps(plan, indent=1) + "\n")
