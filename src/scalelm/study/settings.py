"""The workflow's settings (config/config.yaml after the `local:` overlay), typed and loaded like the training and
site settings (scalelm.settings_yaml.from_mapping): an unknown key is refused naming the closest known one, a value of
the wrong type naming its key. Snakemake validates the same file against workflow/schemas/config.schema.yaml first;
this is what the package reads. The training settings of each experiment are typed by resolving them
(scalelm.study.experiments); here they are the mappings the config gives."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from scalelm.config import check_study_name
from scalelm.errors import ConfigError
from scalelm.report.disturbance import DEFAULT_SHARE
from scalelm.settings_yaml import from_mapping


@dataclass(frozen=True)
class DataSource:
    """A hub dataset (`dataset`, `name`) or local files (`files`: train, validation, test; in `format`)."""

    dataset: str | None = None
    name: str | None = None
    files: dict[str, str] | None = None
    format: Literal["text", "parquet"] = "text"


@dataclass(frozen=True)
class DataSettings:
    source: DataSource
    raw_dir: str
    prepared_dir: str
    lowercase: bool = False
    min_freq: int = 1


@dataclass(frozen=True)
class ContainerSettings:
    mode: Literal["none", "build", "image"]
    definition: str = "containers/scalelm.def"  # mode build
    base_image: str = ""  # mode build: the definition's default where empty
    image: str | None = None  # mode image: a file or a URI to pull
    build_options: list[str] = field(default_factory=list)
    architecture: str = ""  # mode build: amd64, arm64 (a GH200 cluster's); empty: the building machine's
    allow_emulation: bool = False  # run an image of another architecture under QEMU (to prove it, never to time)


@dataclass(frozen=True)
class Resources:
    cpus_per_proc: int
    mem_mb_per_proc: int
    runtime_min: int
    stop_signal_s: int | None = None  # None: scalelm.study.workflow.DEFAULT_STOP_SIGNAL_S
    retries: int = 0


@dataclass(frozen=True)
class MachineSettings:
    """The machine's baseline (rule machine_baseline, scalelm.measure.baseline): once per node count of the matrix,
    on the geometry of its widest experiment, before the trainings' figures are compared with it."""

    enabled: bool = True
    max_mb: float = 64  # the largest message of the collectives (MiB)
    iterations: int = 5  # timed repetitions per collective and size

    def __post_init__(self) -> None:
        if not 0 < self.max_mb <= 4096 or self.iterations < 1:
            raise ConfigError(
                f"machine: max_mb must be in (0, 4096] and iterations 1 or more, got {self.max_mb} "
                f"and {self.iterations}"
            )


@dataclass(frozen=True)
class ExperimentSpec:
    strategy: Literal["single", "ddp", "fsdp", "hsdp", "tp", "fsdp_tp", "pp", "cp", "ep"]
    nodes: int
    procs_per_node: int
    training: dict[str, Any] = field(default_factory=dict)
    check_memory: bool = True
    expect: dict[str, Any] | None = None  # checked by scalelm.report.expectations
    launcher: Literal["torchrun", "spawn"] = "torchrun"  # spawn: the lecture's torch.multiprocessing.spawn, one node


@dataclass(frozen=True)
class StudySettings:
    results: str
    data: DataSettings
    container: ContainerSettings
    training: dict[str, Any]
    experiments: dict[str, ExperimentSpec]
    resources: Resources
    seeds: list[int] = field(default_factory=lambda: [1])
    site: str | None = None  # the site file (profiles/slurm/site.yaml), set by the Slurm profile
    warmup_steps: int | None = None
    baseline: str | None = None
    # other work on a run's hosts beyond this share of the cores it was given marks it disturbed (the schema's
    # default repeats it)
    disturbed_share: float = DEFAULT_SHARE
    expect_strict: bool = False
    # the results history (SQLite); None: <results>/history.sqlite. Never among the study's outputs nor in a directory
    # the workflow replaces (scalelm.study.workflow.Study.check_history_location)
    history: str | None = None
    # the study name, a name for this measurement of the matrix: a new one trains every run afresh and adds a study to
    # the history (whose study id ends in it)
    # (docs/usage.md, "Measuring again"); None: the runs of the results directory as they are
    study: str | None = None
    machine: MachineSettings = field(default_factory=MachineSettings)
    local: dict[str, Any] | None = None  # the embedded default's overlay, applied before (or switched off)


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # workflow/schemas/config.schema.yaml says the same
# Snakemake refuses a wildcard value ending in a part repeated 20 or more times (PeriodicWildcardError)
PERIODIC = re.compile(r"(.+)\1{19,}$")


def check_name(name: Any) -> None:
    """An experiment's name becomes a directory and a wildcard: refused now, not in a later rule."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ConfigError(
            f"experiments: the name {name!r} must be 1 to 64 letters, digits, '_' or '-', starting with a letter "
            "or digit; rename the experiment"
        )
    if PERIODIC.search(name):
        raise ConfigError(
            f"experiments: the name {name!r} ends in a part repeated 20 or more times, which Snakemake refuses as a "
            "wildcard value; rename the experiment"
        )


def load_study(config: dict[str, Any]) -> StudySettings:
    for name in config.get("experiments") or {}:
        check_name(name)
    if type(config.get("study")) is int:  # YAML and Snakemake read a name of digits (study=2027) as a number
        config = {**config, "study": str(config["study"])}
    settings = from_mapping(StudySettings, config)
    check_study_name(settings.study)
    if not settings.results.strip():
        raise ConfigError("results is empty: name the directory for runs, summary, plots and the image")
    if not settings.experiments:
        raise ConfigError("experiments: the config defines no experiment; add one under `experiments:`")
    if not 0 < settings.disturbed_share < float("inf"):
        raise ConfigError(
            f"disturbed_share must be a positive share of the cores a run was given (0.1: a tenth), got "
            f"{settings.disturbed_share!r}"
        )
    for name, spec in settings.experiments.items():
        for key in ("nodes", "procs_per_node"):
            if getattr(spec, key) <= 0:
                raise ConfigError(f"experiments.{name}.{key} must be a positive integer, got {getattr(spec, key)}")
    return settings
