"""The workflow's view of a study: the config resolved and checked once, at parse time, before any job, and every
value a rule needs (its job's arguments and resources). workflow/rules/*.smk only wire these to files.

    STUDY = Study(config, on_login_node=workflow.is_main_process)   # workflow/rules/common.smk
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shlex
from typing import Any

import psutil

from scalelm.errors import ConfigError
from scalelm.launch.container import check_image, exec_prefix, find_runtime, is_uri
from scalelm.launch.slurm import check_node_counts
from scalelm.plan.catalogue import check_site
from scalelm.report import aggregate, history_store
from scalelm.report.expectations import parse_expectations, to_arguments
from scalelm.report.scaling import choose_baseline
from scalelm.settings_yaml import shown
from scalelm.site import load_site
from scalelm.study import plan_check, preflight
from scalelm.study.experiments import Experiment, load_matrix
from scalelm.study.settings import ContainerSettings, Resources, load_study
from scalelm.train.rundir import RunDir

DEFAULT_STOP_SIGNAL_S = 300
# What the Slurm executor would hand to a shell: it submits `sbatch ... --wrap="<job command>"` through `sh -c`,
# escaping only double quotes, so `$(...)` in a path would run on the login node. Braces are Snakemake's wildcards.
SHELL_META = "$`;|&'\"\\<>{}\n\r"
PROCS_PER_CORE = 4  # the local default: more processes than this per core would only queue for the cores
MIB_PER_PROC = 512  # and each training process needs at least this much memory (docs/benchmarks.md)


class Study:
    def __init__(self, config: dict[str, Any], on_login_node: bool = True):
        """`config`: the workflow's config as Snakemake holds it (after the `local:` overlay), typed here once."""
        check_command_line_values(config)
        settings = self.settings = load_study(config)
        self.results = settings.results
        self.site = load_site(settings.site)
        check_site(self.site.gpu, self.site.network)
        check_command_line_values(dataclasses.asdict(self.site), "site file: ")
        self.resources = settings.resources
        self.stop_signal_s = stop_signal_seconds(self.resources)
        self.matrix = {(e.name, str(e.seed)): e for e in load_matrix(settings, self.site)}
        if not settings.site:
            check_local_capacity(self.matrix.values())
        for e in self.matrix.values():
            self.site.check_fits(e.name, e.procs_per_node)
        # what the aggregation compares with and checks, refused now rather than after the training
        self.baseline = choose_baseline({e.name: e.world_size for e in self.matrix.values()}, settings.baseline)
        self.expectations = parse_expectations(config["experiments"])
        self.expect_strict = settings.expect_strict
        if settings.site and on_login_node:  # before any job is submitted; jobs need not ask again
            check_node_counts({e.name: e.nodes for e in self.matrix.values()}, self.site.partition)
        container = settings.container
        self.image = image_file(container, self.results)
        self.runtime = find_runtime() if self.image else None
        # what the container rules need: the definition to build from (mode build), the URI to pull (an image URI)
        self.image_definition = container.definition if container.mode == "build" else None
        self.image_uri = container.image if container.mode == "image" and is_uri(container.image) else None
        self.history = settings.history or f"{self.results}/history.sqlite"
        self.check_history_location()

    def check_history_location(self) -> None:
        """The results history outlives every study that appends to it: refused among the files the workflow writes
        over (the summary, the machine's baselines, the image) or in a directory it replaces whole (the data, a run
        directory, the preflight's), where a later rule would overwrite or delete it."""
        written = [f"{self.results}/{name}" for name in (*aggregate.OUTPUTS, "expectations.met")]
        written += [self.baseline_file(nodes) for nodes in self.baselines]
        written += [self.image] if self.image_definition or self.image_uri else []  # built or pulled here
        data = self.settings.data
        replaced = [data.raw_dir, data.prepared_dir, f"{self.results}/preflight", *(run.path for run in self.runs)]
        default = f"{self.results}/history.sqlite (the default)"
        history_store.check_location(self.history, written, replaced, "history:", default)

    # ---------------------------------------------------------------------------------------- the runs
    def experiment(self, wildcards) -> Experiment:
        return self.matrix[(wildcards.experiment, str(wildcards.seed))]

    @functools.cached_property
    def baselines(self) -> dict[int, Experiment]:
        """Per node count of the matrix, the experiment with the most processes per node: the geometry, settings and
        job the machine's baseline takes there (rule machine_baseline, scalelm.measure.baseline); none when
        `machine.enabled` is false."""
        found: dict[int, Experiment] = {}
        if not self.settings.machine.enabled:
            return found
        for e in self.matrix.values():
            if e.nodes not in found or e.procs_per_node > found[e.nodes].procs_per_node:
                found[e.nodes] = e
        return dict(sorted(found.items()))

    def baseline_file(self, nodes: int | str) -> str:
        return f"{self.results}/machine/nodes{nodes}.json"

    def geometry(self, wildcards) -> Experiment:
        """The experiment whose nodes and processes a job takes: its run's, or for a baseline (wildcard `nodes`) the
        one it stands in for."""
        nodes = getattr(wildcards, "nodes", None)
        return self.baselines[int(nodes)] if nodes is not None else self.experiment(wildcards)

    def run(self, wildcards) -> RunDir:
        return RunDir.of(self.results, wildcards.experiment, wildcards.seed)

    @property
    def run_pattern(self) -> RunDir:
        """The run directory with the rules' wildcards in it: its paths are the rules' inputs and outputs."""
        return RunDir.of(self.results, "{experiment}", "{seed}")

    @property
    def runs(self) -> list[RunDir]:
        return [RunDir.of(self.results, e.name, e.seed) for e in self.matrix.values()]

    # ----------------------------------------------------------------------------------- before the queue
    def write_plan(self, wildcards, prepared_dir: str, out: str) -> None:
        """The experiment's memory plan on the site's GPUs (on the local default, this machine's memory); an
        experiment that cannot fit is refused (rule plan)."""
        on_this_machine = not self.settings.site  # the local default: every process runs here
        plan_check.write_plan(self.experiment(wildcards), self.site, prepared_dir, out, on_this_machine)

    @functools.cached_property
    def preflight(self) -> dict[str, dict[str, Any]]:
        """The wiring check's runs (scalelm.study.preflight.preflight_runs), by name."""
        return preflight.preflight_runs(list(self.matrix.values()), self.results)

    def preflight_tokens(self) -> int:
        """Tokens per split of the preflight's data slice: every step's batch, and one more window to spare."""
        runs = [run["settings"] for run in self.preflight.values()]
        return (
            max((preflight.PREFLIGHT_STEPS + 1) * s["batch"]["size"] * s["data"]["seq_len"] + 1 for s in runs)
            if runs
            else 1
        )

    def preflight_args(self) -> str:
        """`compare`'s arguments: each experiment's run directory with its reference's."""
        run_dir = {name: run["settings"]["run_dir"] for name, run in self.preflight.items()}
        pairs = [
            f"{name}={run_dir[name]}:{run_dir[run['reference']]}"
            for name, run in self.preflight.items()
            if run["reference"]
        ]
        return shlex.join([arg for pair in pairs for arg in ("--run", pair)])

    # ------------------------------------------------------------------------------ command arguments
    def prefetch_args(self) -> str:
        source = self.settings.data.source
        if source.files:
            files = ",".join(f"{split}={path}" for split, path in source.files.items())
            return shlex.join(["--files", files, "--format", source.format])
        return shlex.join(["--dataset", source.dataset, "--name", source.name])

    def prepare_args(self) -> str:
        data = self.settings.data
        return shlex.join([*(["--lowercase"] if data.lowercase else []), "--min-freq", str(data.min_freq)])

    def launch_args(self, wildcards) -> str:
        e = self.geometry(wildcards)
        args = ["--nodes", str(e.nodes), "--procs-per-node", str(e.procs_per_node)]
        args += ["--launcher", e.launcher] if e.launcher != "torchrun" else []
        if self.image:
            args += ["--container", self.image, "--container-runtime", self.runtime]
            args += ["--allow-emulation"] if self.settings.container.allow_emulation else []
            args += [arg for bind in self.binds() for arg in ("--bind", bind)]
        args += ["--gpu"] if self.site.gpus_per_node else []
        return shlex.join([*args, *self.site.launch_flags()])

    def baseline_args(self, wildcards) -> str:
        """The baseline's options: the settings of the experiment it stands in for (its matrix products)."""
        machine = self.settings.machine
        config, max_bytes = self.baseline_config(wildcards), int(machine.max_mb * 2**20)
        args = ["--config", config, "--max-bytes", str(max_bytes), "--iterations", str(machine.iterations)]
        mixture = self.expert_mixture()
        args += ["--moe", json.dumps(mixture, sort_keys=True)] if mixture else []
        return shlex.join([*args, *(["--interconnect", self.site.interconnect] if self.site.interconnect else [])])

    def baseline_config(self, wildcards) -> str:
        """The training settings of the experiment a baseline stands in for (the matrix products it times)."""
        e = self.baselines[int(wildcards.nodes)]
        return str(RunDir.of(self.results, e.name, e.seed).train_config)

    def expert_mixture(self) -> dict[str, Any] | None:
        """model.moe of the study's first expert-parallel experiment, whose dispatch the machine baseline times
        (layout_overheads); None without one. A value, not its train.yaml: another setting of that experiment (its
        learning rate) leaves the baselines as they are."""
        for e in self.matrix.values():
            if e.dims.ep > 1:
                return e.settings["model"]["moe"]
        return None

    def aggregate_args(self) -> str:
        args = [arg for run in self.runs for arg in ("--run", str(run.path))]
        args += [arg for nodes in self.baselines for arg in ("--machine", self.baseline_file(nodes))]
        if self.settings.warmup_steps is not None:
            args += ["--warmup-steps", str(self.settings.warmup_steps)]
        args += ["--disturbed-share", str(self.settings.disturbed_share), "--baseline", self.baseline]
        args += [arg for expect in to_arguments(self.expectations) for arg in ("--expect", expect)]
        args += ["--site", self.settings.site] if self.settings.site else []  # the machine's references
        args += ["--history", self.history]
        return shlex.join(args)

    def build_image_args(self) -> str:
        """`scalelm.launch.container build`'s base image and build options (container.mode: build)."""
        container = self.settings.container
        options = [f"--build-option={option}" for option in container.build_options]
        options += ["--arch", container.architecture] if container.architecture else []
        return shlex.join(["--base-image", container.base_image, *options])

    def in_container(self) -> str:
        """Prefix that runs a single-process command inside the image (empty without a container)."""
        if not self.image:
            return ""
        return shlex.join(exec_prefix(self.runtime, self.image, self.binds())) + " "

    def binds(self) -> list[str]:
        return [os.path.abspath(p) for p in (self.settings.data.prepared_dir, self.results)]

    # -------------------------------------------------------------------------------------- resources
    def job_resources(self) -> dict[str, Any]:
        """The sbatch options of a job that needs no GPU (consolidation, evaluation), from the site file."""
        return {**self.site.sbatch_resources(gpus=False), "slurm_extra": self.site.slurm_extra(gpus=False)}

    def train_threads(self, wildcards, cores: int) -> int:
        """A training job's Snakemake threads: its processes per node on a cluster; without a site, all of this
        machine's cores, so that no consolidation or evaluation runs beside a timed training either."""
        return self.geometry(wildcards).procs_per_node if self.settings.site else max(1, cores)

    def train_resources(self) -> dict[str, Any]:
        """A training job: one task per node, sized from its experiment, stopped by USR1 before its time limit.

        With an "mpi" key the job runs its shell in the batch shell, which Slurm's --signal does not reach; the
        launcher starts the training in an srun step of its own, which it does reach (scalelm.launch.supervise).
        The plugin refuses mpi jobs of one task, so one node gets "": the key still counts, sbatch sees a plain job.
        """
        experiment, per_proc = self.geometry, self.resources
        return {
            **self.site.sbatch_resources(),
            "nodes": lambda wildcards: experiment(wildcards).nodes,
            "tasks": lambda wildcards: experiment(wildcards).nodes,
            "mpi": lambda wildcards: "srun" if experiment(wildcards).nodes > 1 else "",
            "tasks_per_gpu": 0,  # else the plugin asks for --ntasks-per-gpu=<tasks>: tasks x GPUs tasks
            "cpus_per_task": lambda wildcards: per_proc.cpus_per_proc * experiment(wildcards).procs_per_node,
            "mem_mb": lambda wildcards: per_proc.mem_mb_per_proc * experiment(wildcards).procs_per_node,
            "runtime": per_proc.runtime_min,
            "gres": lambda wildcards: self.site.gres(experiment(wildcards).procs_per_node),
            "slurm_extra": self.site.slurm_extra(self.stop_signal_s, training=True),
            # Without a site (this machine, not a cluster) one training at a time (profiles/default: training_run=1):
            # timings that shared cores with another training mean nothing. On a cluster, whole nodes (exclusive).
            "training_run": 0 if self.settings.site else 1,
        }


def check_command_line_values(values: Any, prefix: str = "") -> None:
    """Refuse any string in the config that a job's command line would hand to a shell as more than a word.

    Linear in the config's size: each list and mapping is checked once however often the config holds it (a YAML
    alias that Snakemake's loader made one shared object), without recursion (a deeply nested config), and a value's
    dotted key is only spelt out for the error."""
    pending: list[tuple[Any, tuple | None]] = [(values, None)]  # (value, its key path: (parent path, key) or None)
    checked: set[int] = set()
    while pending:
        value, path = pending.pop()
        if isinstance(value, (dict, list, tuple)):
            if id(value) in checked:
                continue
            checked.add(id(value))
        if isinstance(value, dict):
            pending += [(item, (path, str(key))) for key, item in value.items()]
            pending += [(key, path) for key in value]
        elif isinstance(value, (list, tuple)):
            pending += [(item, (path, f"[{i}]")) for i, item in enumerate(value)]
        elif isinstance(value, str):
            check_command_line_word(value, prefix + dotted_key(path))


def dotted_key(path: tuple | None, limit: int = 200) -> str:
    """`(((None, "a"), "b"), "[2]")` -> "a.b[2]"; of a deeply nested value, its last `limit` characters."""
    parts = []
    while path is not None:
        path, part = path
        parts.append(part)
    key = "".join(part if part.startswith("[") or i == 0 else f".{part}" for i, part in enumerate(reversed(parts)))
    return key if len(key) <= limit else f"...{key[-limit:]}"


def check_command_line_word(value: str, where: str) -> None:
    found = sorted(set(value) & set(SHELL_META))
    if found:
        characters = " ".join(repr(c)[1:-1] for c in found)
        raise ConfigError(
            f"{where or 'config'}: {shown(value)} holds {characters}, which a job's command line would hand to the "
            "shell (on a cluster, the login node's: the Slurm executor submits through `sh -c`); use a value without "
            "shell metacharacters ($ ` ; | & quotes \\ < > { } newlines)"
        )


def check_local_capacity(experiments) -> None:
    """Without a site every process of an experiment runs on this machine: refuse what it cannot hold."""
    cores = os.cpu_count() or 1
    memory_mib = psutil.virtual_memory().total // 2**20
    limit = max(1, min(PROCS_PER_CORE * cores, memory_mib // MIB_PER_PROC))
    for e in experiments:
        if e.world_size > limit:
            raise ConfigError(
                f"experiments.{e.name}: {e.nodes} x {e.procs_per_node} = {e.world_size} processes, but this machine "
                f"({cores} cores, {memory_mib / 1024:.0f} GiB) holds at most {limit} ({PROCS_PER_CORE} per core, "
                f"{MIB_PER_PROC} MiB each); lower nodes or procs_per_node in the local overlay (config/local.yaml), "
                "or run the study on a cluster (--profile profiles/slurm)"
            )


def stop_signal_seconds(resources: Resources) -> int:
    """Seconds before the time limit at which Slurm sends USR1 to a training job: it checkpoints and exits 75, and
    Snakemake resubmits it (retries), which resumes. 0 sends none (Slurm's SIGTERM at the limit still checkpoints)."""
    ahead = DEFAULT_STOP_SIGNAL_S if resources.stop_signal_s is None else resources.stop_signal_s
    runtime = resources.runtime_min
    if ahead >= runtime * 60:
        raise ConfigError(
            f"resources.stop_signal_s ({ahead} s) must be less than resources.runtime_min ({runtime} min = "
            f"{runtime * 60} s), or the stop signal would come at the job's start; lower stop_signal_s (0 sends "
            "none) or raise runtime_min"
        )
    return ahead


def image_file(container: ContainerSettings, results: str) -> str | None:
    """The .sif every job runs in: built here, pulled here (a URI), or given (a path); None without a container."""
    mode, image = container.mode, container.image
    for setting, value, modes in (
        ("architecture", container.architecture, ("build",)),
        ("allow_emulation", container.allow_emulation, ("build", "image")),
    ):
        if value and mode not in modes:  # it would change nothing: said, not ignored
            raise ConfigError(
                f"container.{setting} is {value!r} but container.mode is {mode}: it applies to mode "
                f"{' or '.join(modes)} only; remove it or change the mode"
            )
    if mode == "none":
        return None
    if not image:
        raise ConfigError(f"container.mode is {mode}: set container.image (a .sif path or an oras:// URI)")
    if mode == "image" and is_uri(image):
        return f"{results}/image/scalelm.sif"  # rule pull_image fetches it on the login node
    if mode == "image":
        check_image(image)
    return image
