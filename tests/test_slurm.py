"""The Slurm profile on a real Slurm (Debian's slurm-wlm, slurmdbd accounting, two nodes n1/n2 with their own
hostnames and addresses, fake GPUs), brought up by scripts/slurm/. Runs as root; under CI it must run."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
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


def snakemake_on_slurm(project: Path, *args: str) -> subprocess.CompletedProcess:
    command = [
        "timeout", "-k", "10", "900", "snakemake", "--profile", "profiles/slurm",
        # test overlay: the tiny matrix (config/local.yaml) on the test cluster's site settings
        "--configfile", "config/local.yaml", "--config", "site=test-site.yaml",
        "--slurm-init-seconds-before-status-checks", "1", "--latency-wait", "5", *args,
    ]  # fmt: skip
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
