"""The Snakemake workflow, run for real on the embedded local default (CPU, gloo, shipped sample)."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from conftest import REPO, board_scalars
from scalelm.train.record import read_metrics

WORKFLOW_PARTS = ("workflow", "config", "profiles", "resources")


@pytest.fixture
def project(tmp_path) -> Path:
    """A scratch copy of the workflow, so runs write nowhere near the repository."""
    for part in WORKFLOW_PARTS:
        shutil.copytree(REPO / part, tmp_path / part)
    return tmp_path


def snakemake(project: Path, *args: str, timeout: int = 600, env=None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    return subprocess.run(["snakemake", *args], cwd=project, capture_output=True, text=True, timeout=timeout, env=env)


def edit_yaml(path: Path, change) -> None:
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def planned_jobs(result: subprocess.CompletedProcess) -> dict[str, int]:
    """Job counts from the 'Job stats' table of a dry run."""
    table = result.stdout.split("Job stats:")[1].split("Reasons:")[0] if "Job stats:" in result.stdout else ""
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m[1] != "total"}


def dry_run_jobs(result: subprocess.CompletedProcess) -> list[dict]:
    """Each job a dry run prints: its rule, inputs, wildcards and shell command."""
    jobs = []
    for block in re.split(r"^\[[^\]\n]+\]$", result.stdout, flags=re.M)[1:]:
        rule = re.search(r"^(?:local)?rule (\w+):$", block, re.M)
        inputs = re.search(r"^\s+input: (.*)$", block, re.M)
        wildcards = re.search(r"^\s+wildcards: (.*)$", block, re.M)
        shell = re.search(r"^Shell command: (.*)$", block, re.M)
        jobs.append(
            {
                "rule": rule[1],
                "input": inputs[1].split(", ") if inputs else [],
                "wildcards": dict(pair.split("=", 1) for pair in wildcards[1].split(", ")) if wildcards else {},
                "shell": shell[1] if shell else "",
            }
        )
    return jobs


def test_dry_run_of_the_real_config_lists_the_course_matrix(project):
    """What a user runs on a login node: the real matrix, jobs sized from each experiment and the site file."""
    site = dict(account="proj1", partition="dc-gpu", reservation="course", host_suffix="i", network_interface="ib0")
    edit_yaml(project / "profiles/slurm/site.yaml", lambda c: c.update(site))

    def strict(config):  # reference values that fail the workflow when missed: one more (local) job, the check
        config.update(expect_strict=True)
        config["experiments"]["ddp"]["expect"] = {"min_scaling_efficiency": 0.8}

    edit_yaml(project / "config/config.yaml", strict)
    # a login node of that site, not this machine: sinfo must not answer for the Slurm tier's test cluster. An empty
    # slurm.conf makes it fail at once (the partition is then the scheduler's to judge); a missing one would make it
    # look for a controller until the planner's 30 s timeout, in each of the three dry runs
    no_cluster = {"SLURM_CONF": str(project / "no-cluster.conf")}
    (project / "no-cluster.conf").write_text("")
    result = snakemake(project, "-n", "--profile", "profiles/slurm", env=no_cluster)
    assert result.returncode == 0, result.stderr
    jobs = planned_jobs(result)
    assert jobs["prefetch"] == 1 and jobs["prepare"] == 1
    assert jobs["plan"] == jobs["train"] == jobs["evaluate"] == 19  # plan: memory, before the queue
    assert "consolidate" not in jobs  # evaluate consolidates the model first: one job, one process
    assert jobs["aggregate"] == jobs["check_expectations"] == 1
    assert "--baseline single_gpu --expect ddp.min_scaling_efficiency=0.8 --expect ddp.tolerance=0.05" in result.stdout
    assert "--history results/history.sqlite" in result.stdout  # every aggregation appends to the results history
    commands = [line for line in result.stdout.splitlines() if "scalelm.launch" in line]
    launched = {
        re.search(r"runs/(\w+)/seed1", c)[1]: re.search(r"--nodes (\d+) --procs-per-node (\d+)", c).groups()
        for c in commands
    }
    assert launched == {
        "single_gpu": ("1", "1"),
        "ddp": ("1", "4"),
        "ddp_multinode": ("2", "4"),
        "fsdp": ("2", "4"),
        "hsdp": ("2", "4"),
        "tp": ("1", "4"),
        "fsdp_tp": ("2", "4"),
        "pp": ("1", "4"),
        "pp_gpipe": ("1", "4"),
        "3d": ("4", "4"),
        "gpt2_small": ("1", "1"),
        "gpt2_small_accum": ("1", "1"),
        "llama_small": ("1", "1"),
        "ddp_spawn": ("1", "4"),
        "cp": ("1", "4"),
        "cp_long": ("1", "4"),
        "ddp_lightning": ("1", "4"),
        "moe": ("1", "1"),
        "moe_ep": ("1", "4"),
    }
    # the lecture's launcher for ddp_spawn (its run against torchrun's: tests/test_training.py), torchrun elsewhere
    assert [c for c in commands if "--launcher spawn" in c] == [c for c in commands if "runs/ddp_spawn/" in c]
    assert "--dataset Salesforce/wikitext --name wikitext-2-raw-v1" in result.stdout
    found = re.findall(r"wildcards: experiment=(\w+).*\n(?:\s+threads: .*\n)?\s+resources: (.*)", result.stdout)
    resources = {name: line for name, line in found if "nodes=" in line}  # the train jobs
    # one task per node (the launcher's srun step), never --ntasks-per-gpu (tasks_per_gpu=0)
    assert "nodes=2, tasks=2, mpi=srun, tasks_per_gpu=0, gres=gpu:4" in resources["ddp_multinode"]
    # every training job runs in the batch shell (an "mpi" key) and starts its own srun step, which --signal reaches
    assert "nodes=1, tasks=1, mpi=, tasks_per_gpu=0, gres=gpu:4" in resources["ddp"]
    assert "gres=gpu:1" in resources["single_gpu"]
    assert "nodes=4, tasks=4, mpi=srun, tasks_per_gpu=0, gres=gpu:4" in resources["3d"]  # 16 GPUs
    for line in resources.values():
        # whole nodes for timed jobs; no local one-training-at-a-time limit on a cluster
        assert "slurm_extra=--reservation=course --exclusive --signal=USR1@300" in line, line
        assert "training_run=0" in line, line
        assert "slurm_account=proj1, slurm_partition=dc-gpu" in line, line
    assert "export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0 && python -m scalelm.launch" in result.stdout
    assert "--host-suffix i" in result.stdout
    # measuring again as docs/usage.md says (issue 66): a --config of one's own replaces the profile's whole list, so
    # the local default would be planned for the cluster; refused, naming the pairs to repeat, and with them it plans
    # the real matrix
    again = snakemake(project, "-n", "--profile", "profiles/slurm", "--config", "study=r2", env=no_cluster)
    assert again.returncode != 0 and "Repeat its pairs: --config local=null site=profiles/slurm/site.yaml study=r2" in (
        again.stdout + again.stderr
    )
    pairs = ["local=null", "site=profiles/slurm/site.yaml", "study=r2"]
    again = snakemake(project, "-n", "--profile", "profiles/slurm", "--config", *pairs, env=no_cluster)
    assert again.returncode == 0 and planned_jobs(again)["train"] == 19, again.stderr[-3000:]


# config/local.yaml's matrix: nodes x processes per node of each experiment (their layouts, as the study resolves them:
# tests/test_study.py::test_the_local_default_resolves_to_the_course_matrix_scaled_down)
LOCAL_MATRIX = {
    "single_gpu": (1, 1),
    "ddp": (1, 2),
    "ddp_multinode": (2, 1),
    "fsdp": (2, 1),
    "hsdp": (2, 2),
    "tp": (1, 2),
    "fsdp_tp": (2, 2),
    "pp": (1, 2),
    "pp_gpipe": (1, 2),
    "ddp_spawn": (1, 2),
    "cp": (1, 2),
    "ddp_lightning": (1, 2),
    "moe": (1, 1),
    "moe_ep": (1, 2),
    "llama_small": (1, 1),
}


def test_dry_run_of_the_local_default_plans_every_experiment_and_the_wiring_check_of_every_layout(project):
    """The whole embedded local matrix, unmodified, with the wiring check (`snakemake -n all preflight`): every
    experiment trained, consolidated and evaluated after its memory plan, each launched on its geometry; every one of
    several processes checked on one node against a one-process reference per model (the dense one, Lightning's engine,
    the mixture). The local workflow test below trains only a few of them."""
    result = snakemake(project, "-n", "all", "preflight")
    assert result.returncode == 0, result.stderr[-3000:]
    several = {name for name, (nodes, procs) in LOCAL_MATRIX.items() if nodes * procs > 1}  # one process: no wiring
    per_run = {rule: len(LOCAL_MATRIX) for rule in ("train_config", "plan", "train", "evaluate")}
    preflight = {"preflight_data": 1, "preflight_config": len(several) + 3, "preflight_run": len(several) + 3}
    assert planned_jobs(result) == {
        "prefetch": 1,
        "prepare": 1,
        **per_run,
        "machine_baseline": 2,
        **preflight,
        "preflight": 1,
        "aggregate": 1,
        "all": 1,
    }, result.stdout
    jobs = dry_run_jobs(result)
    for rule in per_run:
        assert {(j["wildcards"]["experiment"], j["wildcards"]["seed"]) for j in jobs if j["rule"] == rule} == {
            (name, "1") for name in LOCAL_MATRIX
        }, rule
    geometry = lambda shell: tuple(int(n) for n in re.search(r"--nodes (\d+) --procs-per-node (\d+)", shell).groups())
    launched = {j["wildcards"]["experiment"]: geometry(j["shell"]) for j in jobs if j["rule"] == "train"}
    assert launched == LOCAL_MATRIX
    # the machine's baseline once per node count, on the geometry of the widest experiment there (2 x 2 on two "nodes")
    baselines = {j["wildcards"]["nodes"]: j["shell"] for j in jobs if j["rule"] == "machine_baseline"}
    assert set(baselines) == {"1", "2"} and geometry(baselines["1"]) == (1, 2) and geometry(baselines["2"]) == (2, 2)
    assert "--config results/local/runs/hsdp/seed1/train.yaml" in baselines["2"]  # the first 2 x 2 of the matrix
    # after the data is prepared: its model has the study's vocabulary (before, WikiText-2's stood in)
    assert all("data/local/prepared" in j["input"] for j in jobs if j["rule"] == "machine_baseline"), jobs
    # and the mixture of the first expert-parallel experiment, whose dispatch it times
    assert all('--moe \'{"aux_loss_coef": 0.3, ' in shell for shell in baselines.values()), baselines
    # the wiring check: each experiment of several processes on one node, each one-process reference alone
    checked = {j["wildcards"]["run"]: geometry(j["shell"]) for j in jobs if j["rule"] == "preflight_run"}
    references = {f"reference.{i}": (1, 1) for i in range(3)}
    assert checked == {name: (1, math.prod(LOCAL_MATRIX[name])) for name in several} | references
    (compare,) = [j["shell"] for j in jobs if j["rule"] == "preflight"]
    pairs = dict(re.findall(r"--run (\w+)=results/local/preflight/runs/\1:results/local/preflight/runs/(\S+)", compare))
    # another engine and a mixture of experts: a reference each (which settings get one: tests/test_plan.py)
    assert pairs == {name: "reference.0" for name in several - {"ddp_lightning", "moe_ep"}} | {
        "ddp_lightning": "reference.1",
        "moe_ep": "reference.2",
    }


# What the local workflow test trains (parity of every layout with one process: tests/test_training.py; the whole
# matrix's jobs: the dry run above), each for the rules and summary columns the others leave out: the baseline
# (speedups, the expectation), two "nodes" that stage their data (nodes, staging, the 2-node machine baseline, a
# data-parallel group across nodes), a pipeline (its bubble) and an ep mixture (the experts; also the one rerun after
# a change: no machine baseline stands on its geometry, so nothing else reruns)
TRAINED = ("single_gpu", "ddp_multinode", "pp", "moe_ep")
# the wiring check on two of them: a dense model on two "nodes" (checked on one) and a mixture, a reference each;
# the study's preflight checks every experiment of several processes of its matrix, so it runs on a study of these
# two (and single_gpu, config/config.yaml's baseline) before pp is added
PREFLIGHT = ("ddp_multinode", "moe_ep")


@pytest.mark.slow
def test_local_default_runs_the_matrix_reruns_nothing_then_only_what_changed(project):
    original = (project / "config/local.yaml").read_text()
    every = yaml.safe_load((project / "config/config.yaml").read_text())["experiments"]

    def study_of(names):  # config/local.yaml with only these experiments (null drops one), each trained faster
        def faster(config):
            config.update(yaml.safe_load(original))
            config["local"]["experiments"].update({name: None for name in every if name not in names})
            training = config["local"]["training"]
            training["train"].update(max_steps=12, log_every=3, eval_every=6)
            training["checkpoint"]["every"] = 6

        edit_yaml(project / "config/local.yaml", faster)

    results = project / "results/local"

    def stamps() -> dict[str, float]:
        return {p.parent.parent.name: p.stat().st_mtime for p in results.glob("runs/*/seed1/run.json")}

    # the wiring check and the trainings of its study in one Snakemake, sharing the one training slot; then the study
    # grown by an experiment, which alone is trained. The limits: guards against a hang
    study_of(("single_gpu", *PREFLIGHT))
    runs = [f"results/local/runs/{name}/seed1/test.json" for name in ("single_gpu", *PREFLIGHT)]
    first = snakemake(project, "preflight", *runs, timeout=900)
    assert first.returncode == 0, first.stderr[-5000:]
    before = stamps()
    study_of(TRAINED)
    grown = snakemake(project, timeout=900)
    assert grown.returncode == 0, grown.stderr[-5000:]
    grown_stamps = stamps()
    assert sorted(before) == sorted(("single_gpu", *PREFLIGHT)) and sorted(grown_stamps) == sorted(TRAINED)
    assert [n for n in before if grown_stamps[n] != before[n]] == []  # pp alone trained

    with (results / "summary.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    layouts = {r["experiment"]: r["layout"] for r in rows}  # dp_replicate x dp_shard x tp x pp (x cp where > 1)
    # every other layout's string: the study's (tests/test_study.py) and its training's (tests/test_training.py)
    assert layouts == {"single_gpu": "1x1x1x1", "ddp_multinode": "2x1x1x1", "pp": "1x1x1x2", "moe_ep": "1x2[ep2]x1x1"}
    for row in rows:
        for key in ("final_train_loss", "validation_loss", "test_loss", "test_perplexity", "tokens_per_s"):
            assert math.isfinite(float(row[key])), (row["experiment"], key)
        assert row["steps"] == "12" and len(row["sha256"]) == 64
        # steady-state speed, MFU against this host's measured peak, state and host load for every run
        for key in (
            "step_time_s",
            "mfu",
            "state_mb_per_rank",
            "peak_mem_mb_per_rank",
            "other_cpu_cores",
            "util_mean_percent",
            "util_min_percent",
            "monitor_cpu_percent",
            "comm_share",
        ):
            assert math.isfinite(float(row[key])), (row["experiment"], key)
        assert float(row["step_time_s_min"]) <= float(row["step_time_s"]) <= float(row["step_time_s_max"])
        # steps 7-9 and 10-12; under several processes step 12 ran under the profiler for the communication share
        assert row["warmup_steps"] == "5" and row["steady_intervals"] == ("2" if row["world_size"] == "1" else "1")
        assert 0 < float(row["mfu"]) < 1 and row["overlapped_by"] == "", row
        assert (float(row["comm_share"]) == 0) == (row["world_size"] == "1"), row  # collectives in every layout
        assert row["peak_reserved_mb_per_rank"] == ""  # CUDA's caching allocator only
        # scalelm.plan's state bytes beside the measured ones (the same to 5%), its peak an estimate beside them
        assert float(row["planned_state_mb_per_rank"]) == pytest.approx(float(row["state_mb_per_rank"]), rel=0.05), row
        assert float(row["planned_peak_mb_per_rank"]) > float(row["planned_state_mb_per_rank"]), row
    # the plan of every run, written before its training (a site with GPU memory would refuse one that cannot fit)
    for run in results.glob("runs/*/seed1"):
        plan = json.loads((run / "plan.json").read_text())
        assert plan["device"] == "cpu" and plan["total_bytes"] > 0, run
        # every process on this machine: planned against its memory (plan_check.host_plan)
        assert plan["fits"] and 0 < plan["host_needed_bytes"] <= plan["host_usable_bytes"], run
    # the wiring check: each layout's first steps on a data slice, without dropout, against one process
    with (results / "preflight/preflight.csv").open() as handle:
        checked = {r["experiment"]: r for r in csv.DictReader(handle)}
    assert set(checked) == set(PREFLIGHT) and all(
        r["matches"] == "True" and r["steps"] == "3" for r in checked.values()
    )
    assert {r["layout"] for r in checked.values()} == {layouts[name] for name in PREFLIGHT}
    # the dense model and the mixture: a one-process reference each (every layout's: the dry run above)
    assert checked["ddp_multinode"]["reference"] != checked["moe_ep"]["reference"]
    # one training at a time on this machine (profiles/default: training_run=1): no two trained side by side
    spans = sorted(
        (datetime.fromisoformat(r["start_time"]), datetime.fromisoformat(r["end_time"]))
        for r in (
            json.loads(p.read_text())
            for p in [*results.glob("runs/*/seed1/run.json"), *results.glob("preflight/runs/*/run.json")]
        )
    )
    # 4 runs; the preflight's 2 layouts and their one-process references of the dense model and of the mixture
    assert len(spans) == 4 + 4 and all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    # TensorBoard event files per run, with every logged step's loss (`tensorboard --logdir results/local/runs`)
    for run in results.glob("runs/*/seed1"):
        logged = [(r["step"], r["loss"]) for r in read_metrics(run) if r["kind"] == "train"]
        board = board_scalars(run, "train/loss")
        assert [s for s, _ in board] == [s for s, _ in logged] == [3, 6, 9, 12], run
        assert all(abs(a - b) <= 1e-6 * abs(b) for (_, a), (_, b) in zip(board, logged)), run
    by_name = {r["experiment"]: r for r in rows}
    assert (by_name["ddp_multinode"]["nodes"], by_name["ddp_multinode"]["world_size"]) == ("2", "2")
    assert by_name["single_gpu"]["speedup"] == "1.0"
    # ddp_multinode staged its data in /dev/shm on each "node" (config/local.yaml), kept apart from training time
    assert float(by_name["ddp_multinode"]["staging_s"]) > 0 and by_name["pp"]["staging_s"] == ""
    staging = json.loads((results / "runs/ddp_multinode/seed1/run.json").read_text())["results"]["staging"]
    assert staging["mode"] == "shm" and not Path(staging["dir"]).exists()
    # energy where the machine lets it be read (RAPL here), else none, with the reason
    for run in results.glob("runs/*/seed1"):
        energy = json.loads((run / "run.json").read_text())["results"]["energy"]
        assert energy["joules"] > 0 if energy["joules"] is not None else energy["unknown"], (run, energy)
    # the pipeline: the bubble its schedule predicts ((pp - 1) / (m + pp - 1), m = 4) beside the measured one (GPipe's
    # too: tests/test_training.py::test_every_layout_trains_like_one_process_and_its_checkpoints_load_into_the_others)
    row = by_name["pp"]
    assert (row["pp_schedule"], row["pp_microbatches"], row["bubble_predicted"]) == ("1f1b", "4", "0.2"), row
    assert 0 < float(row["bubble_measured"]) < 1 and len(row["peak_mem_mb_per_pp_rank"].split(" / ")) == 2, row
    assert by_name["moe_ep"]["pp_schedule"] == by_name["moe_ep"]["bubble_measured"] == ""
    # the machine's baseline, once per node count, on the widest experiment's geometry there: 1 x 2 here, and 2 x 1,
    # whose one process per node has no collective within a node (2 x 2, within and across: tests/test_measurements.py::
    # test_the_baseline_times_products_and_collectives_within_and_across_nodes; the choice: tests/test_study.py)
    with (results / "machine.csv").open() as handle:
        machine = list(csv.DictReader(handle))
    assert {(r["nodes"], r["procs_per_node"]) for r in machine} == {("1", "2"), ("2", "1")}
    assert {(r["scope"], r["op"]) for r in machine if r["nodes"] == "2"} == {
        ("job", op) for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all")
    }
    assert {r["scope"] for r in machine if r["nodes"] == "1"} == {"job"}  # one node: the job is the node
    assert all(0 < float(r["busbw_gbps_min"]) <= float(r["busbw_gbps"]) <= float(r["busbw_gbps_max"]) for r in machine)
    # each timed the study's model after its data was prepared (a fresh clone once timed WikiText-2's vocabulary)
    vocabulary = json.loads((project / "data/local/prepared/manifest.json").read_text())["vocab_size"]
    for nodes in (1, 2):
        step = json.loads((results / f"machine/nodes{nodes}.json").read_text())["model_step"]
        assert (step["vocab_size"], step["prepared"]) == (vocabulary, True), nodes
    summary = (results / "summary.md").read_text()
    assert "## The machine" in summary and "## Step time: measured and planned" in summary
    # every layout timed by the step-time model with its node count's baseline (docs/plan.md has the errors)
    assert all(float(r["planned_step_time_s"]) > 0 and float(r["planned_compute_s"]) > 0 for r in rows), rows
    assert float(by_name["pp"]["planned_bubble_s"]) > 0 and float(by_name["ddp_multinode"]["planned_comm_s"]) > 0
    for plot in ("loss_vs_tokens", "loss_vs_time", "scaling", "utilisation", "pipeline", "experts", "trend"):
        assert (results / f"{plot}.png").read_bytes()[:4] == b"\x89PNG"
    provenance = yaml.safe_load((results / "runs/pp/seed1/run.json").read_text())
    assert provenance["world_size"] == 2 and provenance["versions"]["torch"] and provenance["start_time"]
    # the software: each package scalelm needs at its installed version, and the lock this environment holds
    versions = provenance["versions"]
    assert versions["packages"]["torch"] == versions["torch"] and "numpy" in versions["packages"]
    assert versions["lock"]["file"].endswith("requirements/dev.txt") and versions["lock"]["differs"] == {}
    # two local "nodes" of one: the data-parallel group across both (each TP group inside one node, two of two:
    # tests/test_slurm.py on two hosts; a TP group across nodes refused: tests/test_parallel.py)
    multinode = json.loads((results / "runs/ddp_multinode/seed1/run.json").read_text())["parallel"]
    assert multinode["node_of_rank"] == [0, 1] and multinode["groups"]["dp"] == [[0, 1]], multinode
    # the final losses of every layout agree: the same model on the same data (dropout differs per layout)
    losses = [float(r["validation_loss"]) for r in rows]
    assert max(losses) - min(losses) < 0.1 * min(losses), losses

    again = snakemake(project, "-n")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr

    trained = stamps()
    edit_yaml(
        project / "config/local.yaml",
        lambda c: c["local"]["experiments"]["moe_ep"]["training"].update(optim={"lr": 1e-3}),
    )
    plan = snakemake(project, "-n")
    assert planned_jobs(plan) == {
        "train_config": 1,
        "plan": 1,
        "train": 1,
        "evaluate": 1,
        "aggregate": 1,
        "all": 1,
    }, plan.stdout
    planned = set(re.findall(r"wildcards: experiment=(\w+)", plan.stdout))
    assert planned == {"moe_ep"}, plan.stdout
    rerun = snakemake(project)
    assert rerun.returncode == 0, rerun.stderr[-5000:]
    after = stamps()
    assert [n for n in trained if after[n] != trained[n]] == ["moe_ep"]
    assert (results / "runs/moe_ep/seed1/previous/checkpoints").is_dir()  # the old attempt is kept, not mixed in

    report = snakemake(project, "--report", "report.html")
    assert report.returncode == 0, report.stderr[-3000:]
    assert (project / "report.html").stat().st_size > 10_000

    # the local default's one expectation was met; one that cannot be met fails a strict study, and keeps the summary
    (check,) = csv.DictReader((results / "expectations.csv").open())
    assert (check["experiment"], check["expectation"], check["status"]) == ("single_gpu", "max_test_perplexity", "met")
    edit_yaml(
        project / "config/local.yaml",
        lambda c: c["local"].update(
            expect_strict=True,
            experiments={**c["local"]["experiments"], "single_gpu": {"expect": {"max_test_perplexity": 1.0}}},
        ),
    )
    strict = snakemake(project)
    assert strict.returncode != 0
    assert (
        "error: 1 of 1 expectations missed (expect_strict): single_gpu: test_perplexity "
        in strict.stdout + strict.stderr
    )
    assert "above the maximum 1 (1.05 with the 5% tolerance): missed" in strict.stdout + strict.stderr
    assert "**missed**" in (results / "summary.md").read_text() and (results / "scaling.png").is_file()
    assert not (results / "expectations.met").exists()

    # a deleted model is made again, with its test result, from the run's last checkpoint: nothing is trained
    trained, tested = stamps(), (results / "runs/pp/seed1/test.json").stat().st_mtime
    (results / "runs/pp/seed1/model.pt").unlink()
    model = "results/local/runs/pp/seed1/model.pt"
    dry = snakemake(project, "-n", model)
    assert planned_jobs(dry) == {"evaluate": 1}, (dry.stdout[-3000:], dry.stderr[-3000:])
    assert snakemake(project, model).returncode == 0 and stamps() == trained
    assert (results / "runs/pp/seed1/test.json").stat().st_mtime > tested
    # a new study trains afresh, the earlier attempt set aside
    single = "results/local/runs/single_gpu/seed1"
    again = snakemake(project, f"{single}/test.json", "--config", "study=again")  # (--config takes what follows)
    assert again.returncode == 0, again.stderr[-5000:]
    assert json.loads((project / single / "identity.json").read_text())["settings"]["study"] == "again"
    assert stamps()["single_gpu"] != trained["single_gpu"] and (project / single / "previous/checkpoints").is_dir()


@pytest.mark.slow
def test_two_workflow_runs_with_their_own_result_directories_run_side_by_side(project):
    """Two studies at once in one checkout: both complete, each writes only its own directories, and their
    multi-node experiments (local torchrun rendezvous) do not meet each other.

    `--nolock`: Snakemake (9.27) removes the whole .snakemake/locks directory when it exits, the locks of another
    instance in the same directory included, and fails when both exit at once (seen here). docs/usage.md says so.
    """
    local = yaml.safe_load((project / "config/local.yaml").read_text())
    runs = []
    for name in ("study_a", "study_b"):
        overlay = local["local"]
        overlay["results"] = f"results/{name}"
        overlay["data"].update(raw_dir=f"data/{name}/raw", prepared_dir=f"data/{name}/prepared")
        overlay["training"]["train"].update(max_steps=6, log_every=3, eval_every=6)
        overlay["training"]["checkpoint"]["every"] = 6
        (project / f"{name}.yaml").write_text(yaml.safe_dump(local))
        targets = [f"results/{name}/runs/ddp_multinode/seed1/test.json"]  # two "nodes": a local rendezvous each
        command = ["snakemake", "--configfile", f"{name}.yaml", "--cores", "1", "--nolock", *targets]
        runs.append(subprocess.Popen(command, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [run.communicate(timeout=600)[0] for run in runs]
    for name, run, output in zip(("study_a", "study_b"), runs, outputs):
        assert run.returncode == 0, output[-4000:]
        record = json.loads((project / f"results/{name}/runs/ddp_multinode/seed1/run.json").read_text())
        assert record["config"]["run_dir"] == f"results/{name}/runs/ddp_multinode/seed1"
        assert record["config"]["data"]["prepared_dir"] == f"data/{name}/prepared"
        assert record["results"]["steps"] == 6 and record["world_size"] == 2
    assert sorted(p.name for p in (project / "results").iterdir()) == ["study_a", "study_b"]


def test_an_invalid_config_fails_before_any_job(project):
    """A bad value in one experiment of the embedded default: nothing runs, the message names the key (every such
    check is unit-tested in tests/test_study.py; this shows that Snakemake stops on one)."""
    edit_yaml(
        project / "config/local.yaml", lambda c: c["local"]["experiments"]["ddp"].update(training={"optim": {"lrr": 1}})
    )
    result = snakemake(project, "--cores", "1")
    assert result.returncode != 0
    assert "experiments.ddp: unknown setting 'optim.lrr'; did you mean 'optim.lr'" in result.stdout + result.stderr
    assert not (project / "results").exists() and not (project / "data").exists()


def test_snakemakes_own_command_line_reaches_the_study_over_the_local_overlay(project):
    """`snakemake --config KEY=VALUE` on the local default reaches the study over config/local.yaml's overlay, its
    list typed: the run of seed 2 under results=elsewhere is planned (the merge is unit-tested in tests/test_study.py).
    """
    target = "elsewhere/runs/ddp/seed2/train.yaml"
    result = snakemake(project, "-n", target, "--config", "results=elsewhere", "seeds=[1,2]")
    assert result.returncode == 0, result.stderr[-3000:]
    assert planned_jobs(result) == {"train_config": 1}


SLURM_TOOLS = ("sbatch", "srun", "squeue", "sacct", "sinfo", "scontrol", "scancel")


@pytest.mark.parametrize(
    "where, change, key",
    [
        # one each through Snakemake; more keys in tests/test_study.py
        ("config/config.yaml", lambda c, marker: c.update(results=f"res$(touch {marker})"), "results"),
        ("profiles/slurm/site.yaml", lambda c, marker: c.update(account=f"proj;touch {marker}"), "site file: account"),
    ],
)
def test_a_value_that_would_reach_the_login_nodes_shell_is_refused_before_any_submission(
    project, tmp_path, monkeypatch, where, change, key
):
    """The Slurm executor submits `sbatch ... --wrap="<job>"` through a shell on the login node: a `$(...)` in a path
    would run there. Stand-ins for Slurm's commands record every call: no job may be submitted, nothing may run."""
    stand_ins, calls, marker = tmp_path / "bin", tmp_path / "slurm-calls.log", tmp_path / "code-ran"
    stand_ins.mkdir()
    for tool in SLURM_TOOLS:
        (stand_ins / tool).write_text(f'#!/bin/sh\necho "$0 $*" >> {calls}\n')
        (stand_ins / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{stand_ins}:{os.environ['PATH']}")
    edit_yaml(project / where, lambda c: change(c, marker))
    result = snakemake(project, "--profile", "profiles/slurm", timeout=120)
    assert result.returncode != 0
    assert f"invalid config: {key}: " in result.stderr and "would hand to the shell" in result.stderr, result.stderr
    made = calls.read_text().splitlines() if calls.exists() else []  # the executor asks `scontrol show config`
    assert not [call for call in made if call.split()[0].endswith(("/sbatch", "/srun"))], made
    assert not marker.exists()


def test_lint_and_format_are_clean(project):
    lint = snakemake(project, "--lint")  # the embedded default: without a site the real matrix exceeds this machine
    assert lint.returncode == 0 and "Lints for" not in lint.stdout + lint.stderr, lint.stdout + lint.stderr
    fmt = subprocess.run(["snakefmt", "--check", "workflow"], cwd=project, capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stderr
    # the package, its tests and benchmarks: ruff's formatter and linter, as configured in pyproject.toml
    for command in (["format", "--check"], ["check"]):
        ruff = subprocess.run(
            [sys.executable, "-m", "ruff", *command, "src", "tests", "bench"], cwd=REPO, capture_output=True, text=True
        )
        assert ruff.returncode == 0, ruff.stdout[-3000:] + ruff.stderr[-2000:]
