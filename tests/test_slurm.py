"""The Slurm profile on a real Slurm (Debian's slurm-wlm, slurmdbd accounting, two nodes n1/n2 with their own
hostnames and addresses, fake GPUs), brought up by scripts/slurm/. Runs as root; under CI it must run."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from system import require_root, run_script
from test_workflow import WORKFLOW_PARTS, edit_yaml

pytestmark = pytest.mark.slurm
STATE_DIR = Path(os.environ.get("SCALELM_SLURM_STATE_DIR", "/tmp/scalelm-slurm-tests"))


def script(name: str, *args: str):
    return run_script("slurm", name, *args)


@pytest.fixture(scope="module")
def cluster():
    require_root("slurm")
    script("install.sh")
    script("start.sh", "--nodes", "2", "--gpus-per-node", "2", "--cpus-per-node", "4", "--state-dir", str(STATE_DIR))
    env = dict(line.split("=", 1) for line in (STATE_DIR / "cluster.env").read_text().split("\n") if "=" in line)
    try:
        yield env
    finally:
        script("stop.sh", "--state-dir", str(STATE_DIR))


@pytest.fixture
def project(tmp_path, cluster) -> Path:
    """A copy of the workflow whose site file points at the test cluster, with a deliberately failing experiment."""
    for part in WORKFLOW_PARTS:
        shutil.copytree(REPO / part, tmp_path / part)
    site = {
        "account": cluster["SCALELM_SLURM_ACCOUNT"],
        "partition": cluster["SCALELM_SLURM_PARTITION"],
        "gpus_per_node": int(cluster["SCALELM_SLURM_GPUS_PER_NODE"]),
        "port_range": [29500, 29999],
        "modules": [],
    }
    (tmp_path / "test-site.yaml").write_text(yaml.safe_dump(site))

    def tiny(config):
        local = config["local"]
        local["training"]["train"].update(max_steps=8, log_every=2, eval_every=4)
        local["training"]["checkpoint"]["every"] = 4
        # valid at parse time, fails at run time: the batch is larger than the sample's train split
        local["experiments"]["broken"] = {
            "strategy": "single", "nodes": 1, "procs_per_node": 1, "training": {"batch": {"size": 100000}}
        }  # fmt: skip

    edit_yaml(tmp_path / "config/local.yaml", tiny)
    return tmp_path


def snakemake_on_slurm(project: Path, *args: str, run: bool = True):
    command = [
        "timeout", "-k", "10", "900", "snakemake", "--profile", "profiles/slurm",
        # test overlay: the tiny matrix (config/local.yaml) on the test cluster's site settings
        "--configfile", "config/local.yaml", "--config", "site=test-site.yaml",
        "--slurm-init-seconds-before-status-checks", "1", "--latency-wait", "5", *args,
    ]  # fmt: skip
    if not run:
        return command
    return subprocess.run(command, cwd=project, capture_output=True, text=True, timeout=960)


def test_matrix_runs_on_slurm_across_two_nodes_and_failures_are_reported(project):
    result = snakemake_on_slurm(project)
    output = result.stdout + result.stderr
    # the broken experiment fails (keep-going lets the others finish); everything else completes
    assert result.returncode != 0
    assert "Error in rule train" in output and "experiment=broken" in output
    assert "slurm_logs/rule_train" in output, output[-4000:]  # the job's Slurm log is named
    broken_log = project / "results/local/logs/train/broken/seed1.log"
    assert "too small for one global batch" in broken_log.read_text()
    assert not (project / "results/local/runs/broken/seed1/run.json").exists()

    runs = project / "results/local/runs"
    for name in ("single_gpu", "ddp", "ddp_multinode", "fsdp"):
        assert (runs / name / "seed1/test.json").is_file(), (name, output[-4000:])
    for name in ("ddp_multinode", "fsdp"):
        record = json.loads((runs / name / "seed1/run.json").read_text())
        # one torchrun per node, both ranks in one process group (the hostnames were all-gathered through it)
        assert record["world_size"] == 2 and sorted(record["hostnames"]) == ["n1", "n2"], record["hostnames"]
        assert record["launch"] == {"nodes": 2, "procs_per_node": 1}
        assert record["environment"]["SLURM_JOB_ID"]
    single = json.loads((runs / "ddp/seed1/run.json").read_text())
    assert len(set(single["hostnames"])) == 1 and single["world_size"] == 2

    # the matrix without the broken experiment aggregates: summary and plots
    edit_yaml(project / "config/local.yaml", lambda c: c["local"]["experiments"].pop("broken"))
    final = snakemake_on_slurm(project)
    assert final.returncode == 0, (final.stdout + final.stderr)[-4000:]
    with (project / "results/local/summary.csv").open() as handle:
        rows = {r["experiment"]: r for r in csv.DictReader(handle)}
    assert set(rows) == {"single_gpu", "ddp", "ddp_multinode", "fsdp"}
    assert (project / "results/local/scaling.png").is_file()
    accounting = subprocess.run(["sacct", "-X", "-n", "-o", "JobName%40,State"], capture_output=True, text=True)
    assert "COMPLETED" in accounting.stdout and "FAILED" in accounting.stdout


def test_a_job_stopped_by_slurm_checkpoints_exits_75_and_its_resubmission_resumes(project):
    """`scancel --signal=USR1` is what Slurm's --signal (before the time limit) and preemption deliver.

    Known limit: Snakemake's job-step process shares the srun step with the training and dies of USR1, so the job
    ends FAILED by a signal rather than with exit 75 and the checkpoint races the end of the step (docs/faults.md).
    """

    def long_run(config):
        local = config["local"]
        local["training"]["train"].update(epochs=100, max_steps=1500, log_every=10, eval_every=10000)
        local["training"]["checkpoint"]["every"] = 500
        local["experiments"].pop("broken")

    edit_yaml(project / "config/local.yaml", long_run)
    target = "results/local/runs/ddp/seed1/run.json"
    command = snakemake_on_slurm(project, target, "--retries", "1", run=False)
    workflow = subprocess.Popen(command, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = project / "results/local/runs/ddp/seed1/metrics.jsonl"
    deadline = time.monotonic() + 300
    while workflow.poll() is None and time.monotonic() < deadline and not (
        metrics.is_file() and any(json.loads(line)["step"] >= 50 for line in metrics.read_text().splitlines() if line)
    ):
        time.sleep(0.5)
    running = subprocess.run(["squeue", "-h", "-t", "R", "-o", "%i"], capture_output=True, text=True).stdout.split()
    assert len(running) == 1, running  # the training job
    subprocess.run(["scancel", "--signal=USR1", running[0]], check=True)
    output, _ = workflow.communicate(timeout=600)

    assert workflow.returncode == 0, output[-4000:]
    # the stop saved a checkpoint (the periodic ones come every 500 steps) and the resubmitted job resumed from it
    log = (project / "results/local/logs/train/ddp/seed1.log").read_text()
    resumed = int(log.split("resumed from step ")[1].split(" ")[0])
    assert 50 <= resumed < 500, log[-3000:]
    slurm_logs = "".join(p.read_text() for p in (project / ".snakemake/slurm_logs/rule_train").rglob("*.log"))
    assert "User defined signal 1" in slurm_logs or "stopped by a signal" in slurm_logs, slurm_logs[-3000:]
    record = json.loads((project / target).read_text())
    assert record["results"]["steps"] == 1500 and record["results"]["tokens_seen"] == 1500 * 32 * 32
