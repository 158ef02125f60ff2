"""The experiment matrix of the workflow config: experiments x seeds, each resolved to one training config.

The workflow calls `load_matrix` at parse time (scalelm.study.workflow), so a bad setting in any experiment
fails before a single job runs, naming the experiment and the key. An experiment's training config is resolved once,
the site's defaults included (`with_site_defaults`), and typed from then on.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from scalelm.config import SEED_LIMIT, Config, from_dict
from scalelm.errors import ConfigError
from scalelm.launch.launcher import check_launcher
from scalelm.parallel.dims import ParallelDims
from scalelm.parallel.layout import Layout, resolve_layout
from scalelm.settings_yaml import parse_settings
from scalelm.site import SiteConfig
from scalelm.study.settings import StudySettings
from scalelm.train.rundir import RunDir


@dataclass(frozen=True)
class Experiment:
    name: str
    strategy: str
    nodes: int
    procs_per_node: int
    seed: int
    config: Config = field(compare=False, hash=False)  # the resolved training settings
    layout: Layout = field(default=Layout(ParallelDims()), compare=False, hash=False)  # resolved and checked
    check_memory: bool = field(default=True, compare=False)  # refused before the queue if it cannot fit (plan)
    launcher: str = field(default="torchrun", compare=False)  # what starts a node's processes (scalelm.launch)

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def dims(self) -> ParallelDims:
        return self.layout.dims

    @property
    def geometry(self) -> str:
        """Nodes x processes per node, and the layout on them."""
        return f"{self.nodes}x{self.procs_per_node} {self.dims.layout}"

    @property
    def key(self) -> str:
        return f"{self.name}/seed{self.seed}"

    @property
    def settings(self) -> dict[str, Any]:
        """The training settings as the run's train.yaml holds them (and the rules' params compare them)."""
        return self.config.to_dict()


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """The study's layering of settings (its training defaults, an experiment's changes, the `local:` overlay, the
    command line), as a copy: mappings merge key by key and any other value of `update` replaces what `base` holds, a
    whole section included (`3d: null` drops an experiment). A training override is stricter
    (scalelm.config.merge_setting: a value in place of a section is refused, since it would drop its settings)."""
    merged = copy.deepcopy(base)
    for key, value in (update or {}).items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def apply_local_overlay(config: dict[str, Any], command_line: dict[str, Any] | None = None) -> dict[str, Any]:
    """`local:` holds the embedded default's changes; the Slurm profile switches it off (local=null). An experiment
    set to null there (`experiments: {3d: null}`) is left out of the local matrix. What `command_line` gives
    (`snakemake --config KEY=VALUE`, typed by `command_line_values`) comes after the overlay, so that it wins over
    it as over config/config.yaml; `--config 'local={...}'` changes the overlay itself."""
    command_line = command_line or {}
    config = deep_merge(config, command_line)
    overlay = config.get("local")
    base = {k: v for k, v in config.items() if k != "local"}
    if isinstance(overlay, dict):
        merged = deep_merge(deep_merge(base, overlay), {k: v for k, v in command_line.items() if k != "local"})
        if isinstance(merged.get("experiments"), dict):
            merged["experiments"] = {name: spec for name, spec in merged["experiments"].items() if spec is not None}
        return merged
    if overlay in (None, "", "null", "none", "None", False):
        return base
    raise ConfigError(f"local: expected a mapping of settings or null, got {overlay!r}")


def check_snakemake_command(config: dict[str, Any], command_line: dict[str, Any], cluster_jobs: int | None) -> None:
    """What `snakemake --config` cannot mean: an empty study name (`study=`, an unset variable's), and the local
    default's matrix planned for a cluster (`cluster_jobs`: Snakemake's --jobs, which remote execution needs). A
    `--config` of the user's replaces a profile's whole `config:` list, the Slurm profile's `local=null` and `site=`
    with it: such a command would queue the local default's tiny runs on the cluster with no site's settings."""
    if "study" in command_line and command_line["study"] in (None, ""):
        raise ConfigError(
            "study= names no study: give the name (--config study=2027-rerun), or leave study out for the runs of "
            "no name"
        )
    merged = deep_merge(config, command_line)
    if cluster_jobs is not None and isinstance(merged.get("local"), dict) and not merged.get("site"):
        pairs = " ".join(f"{key}={value}" for key, value in command_line.items() if not isinstance(value, dict))
        raise ConfigError(
            f"--jobs {cluster_jobs} sends jobs to a cluster, but the config is the local default (config/local.yaml's "
            "overlay, on) with no site file: a --config of your own replaces the Slurm profile's whole config: list. "
            f"Repeat its pairs: --config local=null site=profiles/slurm/site.yaml {pairs}".rstrip()
            + "; for a run on this machine, give --cores instead of --jobs"
        )


def command_line_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """`snakemake --config KEY=VALUE`'s values as a config file would hold them. Snakemake types a plain value (an
    integer, a number, True or False) but reads a mapping or a list with YAML's BaseLoader, every item in it a string
    (seeds=[1,2] gives ['1', '2']): such a string that YAML reads as a number, true/false or null is that value; any
    other is kept as written (a path with ' #' in it stays whole)."""
    return {key: typed_value(value) for key, value in values.items()}


def typed_value(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: typed_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [typed_value(item) for item in value]
    if isinstance(value, str):
        try:
            read = parse_settings(value)
        except yaml.YAMLError:
            return value
        return read if read is None or isinstance(read, (bool, int, float)) else value
    return value


def training_config(settings: StudySettings, name: str, seed: int, run_dir: str) -> Config:
    spec = settings.experiments[name]
    merged = deep_merge(settings.training, spec.training)
    merged = deep_merge(
        merged,
        {
            "run_dir": run_dir,
            "study": settings.study,
            "seed": seed,
            "data": {"prepared_dir": settings.data.prepared_dir},
            "parallel": {"strategy": spec.strategy},
        },
    )
    try:
        return from_dict(merged)
    except ConfigError as err:
        raise ConfigError(f"experiments.{name}: {err}") from None


def with_site_defaults(config: Config, site: SiteConfig) -> Config:
    """What the site decides unless the experiment does: the GPU's peak for MFU where scalelm's table lacks it, the
    device on a GPU site (a job that sees no GPU then fails with a clear error instead of training for hours on
    the CPU), and where the data is staged."""
    if site.peak_tflops and not config.train.peak_tflops:
        config = replace(config, train=replace(config.train, peak_tflops=site.peak_tflops))
    if site.stage and config.data.stage is None:
        config = replace(
            config, data=replace(config.data, stage=site.stage, stage_dir=config.data.stage_dir or site.stage_dir)
        )
    if site.gpus_per_node and config.device == "auto":
        config = replace(config, device="cuda")
    return config


def layout_of(name: str, training: Config, nodes: int, procs_per_node: int) -> Layout:
    """The experiment's layout on its nodes, checked: a layout, batch or model it cannot run is refused before any
    job is queued."""
    try:
        return resolve_layout(training, nodes * procs_per_node, procs_per_node)
    except ConfigError as err:
        raise ConfigError(f"experiments.{name} ({nodes} x {procs_per_node} processes): {err}") from None


def check_seeds(seeds: Any) -> list[int]:
    """The study's seeds: a list of distinct integers within the range every layout can derive its streams from."""
    if not isinstance(seeds, list) or not seeds:
        raise ConfigError(f"seeds must be a non-empty list of integers, got {seeds!r}")
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
            raise ConfigError(f"seeds: {seed!r} is not an integer from 0 to {SEED_LIMIT - 1}")
    repeated = sorted({seed for seed in seeds if seeds.count(seed) > 1})
    if repeated:
        raise ConfigError(f"seeds: {', '.join(map(str, repeated))} listed more than once; list each seed once")
    return seeds


def model_settings(training: dict[str, Any]) -> dict[str, Any]:
    model = training.get("model")
    return model if isinstance(model, dict) else {}


def check_shared_mixture(settings: StudySettings) -> None:
    """A `model.moe` in the study-wide `training:` makes a mixture of every experiment that does not give its own
    (a mapping, or null to stay dense). Without the mixture's shape (experts) it is a tuning of the mixtures that
    would turn the dense experiments, the baseline among them, into mixtures of a defaulted shape: refused, naming
    them."""
    shared = model_settings(settings.training).get("moe")
    if not isinstance(shared, dict) or "experts" in shared:
        return
    converted = [name for name, spec in settings.experiments.items() if "moe" not in model_settings(spec.training)]
    if converted:
        keys = ", ".join(map(str, shared)) or "{}"
        raise ConfigError(
            f"training: model.moe ({keys}) would make every experiment without its own model.moe a mixture of "
            f"experts of no given shape: {', '.join(converted)}; set model.moe in the mixtures' own training:, "
            "model.moe: null in those meant to stay dense, or model.moe.experts in training: if every experiment "
            "is meant to be a mixture"
        )


def load_matrix(settings: StudySettings, site: SiteConfig | None = None) -> list[Experiment]:
    matrix = []
    seeds = check_seeds(settings.seeds)
    check_shared_mixture(settings)
    for name, spec in settings.experiments.items():
        for seed in seeds:
            run_dir = str(RunDir.of(settings.results, name, seed).path)
            training = with_site_defaults(training_config(settings, name, seed, run_dir), site or SiteConfig())
            layout = layout_of(name, training, spec.nodes, spec.procs_per_node)
            try:
                check_launcher(spec.launcher, spec.nodes, keys=("launcher", "nodes"))
            except ConfigError as err:
                raise ConfigError(f"experiments.{name}: {err}") from None
            geometry = (spec.strategy, spec.nodes, spec.procs_per_node)
            matrix.append(Experiment(name, *geometry, seed, training, layout, spec.check_memory, spec.launcher))
    return matrix
