"""The Slurm profile on a real Slurm (Debian's slurm-wlm, slurmdbd accounting, two nodes n1/n2 with their own
hostnames and addresses, fake GPUs), brought up by .ci/slurm/. Runs as root; under CI it must run."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

import drills
from conftest import REPO
from scalelm.train.record import read_metrics
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
    # 4 fake GPUs a node: a 1x2 and a 2x1 job (gres gpu:2 and gpu:1 per node) can run side by side
    script("start.sh", "--nodes", "2", "--gpus-per-node", "4", "--cpus-per-node", "4", "--state-dir", str(STATE_DIR))
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
        "exclusive": False,  # the two test nodes run several small jobs at once (the stop drill signals two)
    }
    (tmp_path / "test-site.yaml").write_text(yaml.safe_dump(site))

    def tiny(config):
        local = config["local"]
        local["training"]["train"].update(max_steps=8, log_every=2, eval_every=4)
        local["training"]["checkpoint"]["every"] = 4
        # the nodes' GPUs are fake (gres only): train on their CPUs, as asked explicitly (a GPU site would ask for cuda)
        local["training"]["device"] = "cpu"
        # valid at parse time, fails at run time: the batch is larger than the sample's train split
        local["experiments"]["pp"] = {"nodes": 2, "procs_per_node": 1}  # a stage on each node
        local["experiments"]["broken"] = {
            "strategy": "single",
            "nodes": 1,
            "procs_per_node": 1,
            "training": {"batch": {"size": 100000}},
        }

    # hsdp and tp run the code of fsdp_tp on fewer dimensions, ddp_spawn ddp's, cp, the mixtures and the llama block
    # one node's (tests/test_training.py), ddp_lightning Lightning's DDP (tests/test_lightning.py)
    def fewer(config):
        for name in ("hsdp", "tp", "pp_gpipe", "ddp_spawn", "ddp_lightning", "cp", "moe", "moe_ep", "llama_small"):
            config.get("local", config)["experiments"].pop(name)

    edit_yaml(tmp_path / "config/local.yaml", tiny)
    edit_yaml(tmp_path / "config/local.yaml", fewer)
    edit_yaml(tmp_path / "config/config.yaml", fewer)
    return tmp_path


def snakemake_on_slurm(project: Path, *args: str, run: bool = True):
    command = [
        # snakemake, its Slurm executor's status checks at most a few seconds apart (tests/slurm_snakemake.py)
        "timeout",
        "-k",
        "10",
        "900",
        sys.executable,
        str(REPO / "tests/slurm_snakemake.py"),
        "--profile",
        "profiles/slurm",
        # test overlay: the tiny matrix (config/local.yaml) on the test cluster's site settings
        "--configfile",
        "config/local.yaml",
        "--config",
        "site=test-site.yaml",
        "--slurm-init-seconds-before-status-checks",
        "1",
        "--latency-wait",
        "5",
        *args,
    ]
    if not run:
        return command
    return subprocess.run(command, cwd=project, capture_output=True, text=True, timeout=960)


def submitted_rules(since: dict[str, str]) -> Counter:
    """The Slurm jobs accounted after those of `since` (`submissions()`), counted by the rule the Snakemake plugin
    names in each job's comment (rule_<rule>_wildcards_...; stored with AccountingStoreFlags=job_comment)."""
    return Counter(re.match(r"rule_(\w+?)(?:_wildcards_|$)", c)[1] for j, c in submissions().items() if j not in since)


def submissions() -> dict[str, str]:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID,Comment"], capture_output=True, text=True).stdout
    return dict(line.split("|", 1) for line in out.splitlines() if line)


def test_matrix_runs_on_slurm_across_two_nodes_and_failures_are_reported(project):
    before = submissions()
    result = snakemake_on_slurm(project)
    output = result.stdout + result.stderr
    # a job per training (the broken one's resubmissions too), one per model to consolidate and evaluate, one per
    # node count's machine baseline; the settings files and memory plans are written by Snakemake itself
    jobs = submitted_rules(before)
    assert set(jobs) == {"train", "evaluate", "machine_baseline"} and jobs["train"] >= 7, jobs
    assert jobs["evaluate"] == 6 and jobs["machine_baseline"] == 2, jobs
    # the broken experiment fails (keep-going lets the others finish); everything else completes
    assert result.returncode != 0
    assert "Error in rule train" in output and "experiment=broken" in output
    assert "slurm_logs/rule_train" in output, output[-4000:]  # the job's Slurm log is named
    broken_log = project / "results/local/logs/train/broken/seed1.log"
    assert "too small for one global batch" in broken_log.read_text()
    assert not (project / "results/local/runs/broken/seed1/run.json").exists()

    runs = project / "results/local/runs"
    for name in ("single_gpu", "ddp", "ddp_multinode", "fsdp", "fsdp_tp", "pp"):
        assert (runs / name / "seed1/test.json").is_file(), (name, output[-4000:])
    for name in ("ddp_multinode", "fsdp", "pp"):
        record = json.loads((runs / name / "seed1/run.json").read_text())
        # one torchrun per node, both ranks in one process group (the hostnames were all-gathered through it)
        assert record["world_size"] == 2 and sorted(record["hostnames"]) == ["n1", "n2"], record["hostnames"]
        assert record["launch"] == {"nodes": 2, "procs_per_node": 1}
        assert record["environment"]["SLURM_JOB_ID"]
    # FSDP x TP on 2 nodes of 2: each TP group on one host, each data-parallel group across both
    record = json.loads((runs / "fsdp_tp/seed1/run.json").read_text())
    hosts, groups = record["hostnames"], record["parallel"]["groups"]
    assert record["results"]["layout"] == "1x2x2x1" and sorted(hosts) == ["n1", "n1", "n2", "n2"], hosts
    assert all(len({hosts[r] for r in group}) == 1 for group in groups["tp"]), (hosts, groups)
    assert all({hosts[r] for r in group} == {"n1", "n2"} for group in groups["dp"]), (hosts, groups)
    # a pipeline of 2 stages across the nodes: activations and their gradients cross between n1 and n2
    record = json.loads((runs / "pp/seed1/run.json").read_text())
    assert record["results"]["layout"] == "1x1x1x2" and record["parallel"]["groups"]["pp"] == [[0, 1]]
    assert 0 < record["results"]["pipeline"]["measured_bubble"] < 1
    assert {"gloo:send", "gloo:recv"} <= set(record["results"]["comm"]["ops_s_per_step_rank0"])
    single = json.loads((runs / "ddp/seed1/run.json").read_text())
    assert len(set(single["hostnames"])) == 1 and single["world_size"] == 2
    # the launcher's step asks for the job's GPUs (a step gets none it did not ask for) and binds none to its task
    launched = (project / "results/local/logs/train/ddp/seed1.log").read_text()
    assert "--gres=gpu:2 --gpu-bind=none" in launched, launched[:2000]

    # the matrix without the broken experiment aggregates: summary and plots
    edit_yaml(project / "config/local.yaml", lambda c: c["local"]["experiments"].pop("broken"))
    final = snakemake_on_slurm(project)
    assert final.returncode == 0, (final.stdout + final.stderr)[-4000:]
    with (project / "results/local/summary.csv").open() as handle:
        rows = {r["experiment"]: r for r in csv.DictReader(handle)}
    assert set(rows) == {"single_gpu", "ddp", "ddp_multinode", "fsdp", "fsdp_tp", "pp"}
    assert (project / "results/local/scaling.png").is_file()
    # every layout timed by the step-time model with its node count's baseline (docs/plan.md has the errors)
    assert all(float(r["planned_step_time_s"]) > 0 for r in rows.values()), rows
    # the machine's baseline: a job per node count, the 2-node one across n1 and n2 (gloo over TCP between them)
    with (project / "results/local/machine.csv").open() as handle:
        machine = list(csv.DictReader(handle))
    assert {(r["nodes"], r["hosts"]) for r in machine} == {("1", "n1"), ("2", "n1 n2")} or {
        (r["nodes"], r["hosts"]) for r in machine
    } == {("1", "n2"), ("2", "n1 n2")}, machine
    assert {(r["scope"], r["ranks"]) for r in machine if r["nodes"] == "2"} == {("job", "4"), ("node", "2")}
    accounting = subprocess.run(["sacct", "-X", "-n", "-o", "JobName%40,State"], capture_output=True, text=True)
    assert "COMPLETED" in accounting.stdout and "FAILED" in accounting.stdout


def long_runs(project: Path, max_steps: int, checkpoint_every: int, **resources) -> None:
    def change(config):
        local = config["local"]
        local["training"]["train"].update(epochs=1000, max_steps=max_steps, log_every=10, eval_every=100000)
        local["training"]["checkpoint"]["every"] = checkpoint_every
        local["resources"].update(resources)
        local["experiments"].pop("broken")
        local["machine"] = {"enabled": False}  # the drills stop trainings; the baseline ran in the matrix's test

    edit_yaml(project / "config/local.yaml", change)


def start_workflow(project: Path, *targets: str) -> subprocess.Popen:
    command = snakemake_on_slurm(project, *targets, run=False)
    return subprocess.Popen(command, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_steps(workflow: subprocess.Popen, project: Path, step: int, *experiments: str, timeout: int = 300):
    """Until every experiment has logged `step`; returns {experiment: (its running Slurm job id, its nodes)}."""
    deadline = time.monotonic() + timeout
    metrics = [project / f"results/local/runs/{e}/seed1/metrics.jsonl" for e in experiments]
    while not all(drills.last_step(m) >= step for m in metrics):
        assert workflow.poll() is None and time.monotonic() < deadline, f"no step {step} in {metrics}"
        time.sleep(0.5)
    jobs = subprocess.run(["squeue", "-h", "-t", "R", "-o", "%i %k %N"], capture_output=True, text=True).stdout
    running = {}
    for line in jobs.splitlines():  # the plugin puts "rule_train_wildcards_<experiment>_1" in the job's comment
        job_id, comment, nodes = line.split()
        running.update({e: (job_id, nodes) for e in experiments if comment.endswith(f"wildcards_{e}_1")})
    assert set(running) == set(experiments), jobs
    return running


def stop_each_at_step(workflow: subprocess.Popen, project: Path, step: int, *experiments: str):
    """Send each experiment's job the stop signal as soon as it has logged `step`, not when all have: a job on one
    node may otherwise run past the next periodic checkpoint while the other waits to start."""
    jobs: dict[str, tuple[str, str]] = {}
    deadline = time.monotonic() + 300
    while len(jobs) < len(experiments):
        assert workflow.poll() is None and time.monotonic() < deadline, f"not all of {experiments} reached {step}"
        for e in experiments:
            if e not in jobs and drills.last_step(project / f"results/local/runs/{e}/seed1/metrics.jsonl") >= step:
                jobs.update(wait_for_steps(workflow, project, step, e))
                subprocess.run(["scancel", "--signal=USR1", jobs[e][0]], check=True)
        time.sleep(0.2)
    return jobs


def resumed_step(project: Path, experiment: str) -> int:
    log = (project / f"results/local/logs/train/{experiment}/seed1.log").read_text()
    assert "resumed from step " in log, log[-3000:]
    return int(log.split("resumed from step ")[-1].split(" ")[0])


def slurm_states(job_id: str) -> list[tuple[str, str, str]]:
    """(step, state, exit code) of every step of the job and of every earlier run of it (requeued jobs)."""
    out = subprocess.run(
        ["sacct", "-j", job_id, "--duplicates", "-n", "-P", "-o", "JobID,State,ExitCode"],
        capture_output=True,
        text=True,
    )
    return [tuple(line.split("|")) for line in out.stdout.splitlines()]


def test_jobs_stopped_by_slurm_checkpoint_exit_75_and_their_resubmissions_resume(project):
    """`scancel --signal=USR1` is what Slurm's --signal (before the time limit) and preemption deliver: to the
    processes of the job's steps, which are the launcher's srun step, on one node and on two."""
    long_runs(project, max_steps=300, checkpoint_every=250, retries=1)
    targets = [f"results/local/runs/{e}/seed1/run.json" for e in ("ddp", "ddp_multinode")]
    workflow = start_workflow(project, *targets)
    jobs = stop_each_at_step(workflow, project, 30, "ddp", "ddp_multinode")
    output, _ = workflow.communicate(timeout=600)

    assert workflow.returncode == 0, output[-4000:]
    for experiment, (job_id, _) in jobs.items():
        # the training step of the stopped job exited 75 after its checkpoint (the periodic ones come every 250
        # steps); the resubmitted job resumed from that checkpoint and ran to the end
        assert (f"{job_id}.0", "FAILED", "75:0") in slurm_states(job_id), slurm_states(job_id)
        assert 30 <= resumed_step(project, experiment) < 250
        record = json.loads((project / f"results/local/runs/{experiment}/seed1/run.json").read_text())
        assert record["results"]["steps"] == 300 and record["results"]["tokens_seen"] == 300 * 32 * 32
        steps = [
            r["step"] for r in read_metrics(project / f"results/local/runs/{experiment}/seed1") if r["kind"] == "train"
        ]
        assert steps == sorted(set(steps)), steps  # the stopped attempt's records past its checkpoint were dropped
    stopped_job = (
        project / f".snakemake/slurm_logs/rule_train/ddp_multinode_1/{jobs['ddp_multinode'][0]}.log"
    ).read_text()
    assert "stopped by SIGUSR1 on n1" in stopped_job and "stopped by SIGUSR1 on n2" in stopped_job, stopped_job[-3000:]


def test_a_job_that_hits_its_time_limit_is_reported_as_timeout_with_a_checkpoint_to_resume_from(project):
    """No stop signal ahead of the limit (stop_signal_s 0): Slurm's SIGTERM at the limit still gets a checkpoint.
    The training is longer than a one-minute attempt, so it times out whatever this machine's speed. One attempt:
    that a resubmission resumes from such a checkpoint is the test above's (a second timed-out attempt cost two
    minutes of CI, most of it the executor's growing wait between status checks)."""
    long_runs(project, max_steps=1_000_000, checkpoint_every=1_000_000, runtime_min=1, stop_signal_s=0, retries=0)
    workflow = start_workflow(project, "results/local/runs/ddp_multinode/seed1/run.json")
    [(job_id, _)] = wait_for_steps(workflow, project, 10, "ddp_multinode").values()
    output, _ = workflow.communicate(timeout=600)

    assert workflow.returncode != 0
    timed_out = re.findall(r"SLURM-job '(\d+)' failed, SLURM status is: 'TIMEOUT'", output)
    assert timed_out == [job_id], output[-4000:]
    assert [state for _, state, _ in slurm_states(job_id)][0] == "TIMEOUT", slurm_states(job_id)
    # the checkpoint written on Slurm's SIGTERM (the periodic ones come every million steps), the run not finished
    run = project / "results/local/runs/ddp_multinode/seed1"
    checkpoints = sorted(run.glob("checkpoints/step_*"))
    assert checkpoints and int(checkpoints[-1].name.split("_")[1]) > 10, checkpoints
    assert not (run / "run.json").exists()


def test_a_job_whose_node_fails_is_requeued_by_slurm_and_resumes(project):
    """The node is set DOWN under the running job, as Slurm does when it loses one (this cluster's ReturnToService
    lets it rejoin at once; the requeued job may run on either node)."""
    long_runs(project, max_steps=600, checkpoint_every=50, retries=0)  # Slurm requeues it, not Snakemake
    workflow = start_workflow(project, "results/local/runs/single_gpu/seed1/run.json")
    [(job_id, node)] = wait_for_steps(workflow, project, 120, "single_gpu").values()
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=scalelm-test"], check=True)
    try:
        output, _ = workflow.communicate(timeout=600)
    finally:  # back in service (an error if it already is)
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)

    assert workflow.returncode == 0, output[-4000:]
    assert any(state == "NODE_FAIL" for _, state, _ in slurm_states(job_id)), slurm_states(job_id)
    log = (project / "results/local/logs/train/single_gpu/seed1.log").read_text()
    assert f"Slurm requeued job {job_id} (1 time(s))" in log, log[-3000:]
    assert 100 <= resumed_step(project, "single_gpu") < 600
    record = json.loads((project / "results/local/runs/single_gpu/seed1/run.json").read_text())
    assert record["results"]["steps"] == 600


def test_more_nodes_than_the_partition_has_is_refused_before_any_job(project):
    """Slurm would accept the job and leave it pending for ever (PartitionNodeLimit); the workflow asks sinfo."""
    # 4 nodes: their batch of 32 splits over them (3 would be refused first, for the batch)
    edit_yaml(project / "config/local.yaml", lambda c: c["local"]["experiments"]["ddp_multinode"].update(nodes=4))
    submitted = subprocess.run(["sacct", "-X", "-n", "-o", "JobID"], capture_output=True, text=True).stdout.split()
    result = snakemake_on_slurm(project, "results/local/runs/ddp_multinode/seed1/run.json")
    assert result.returncode != 0
    message = "experiment ddp_multinode asks for 4 nodes but partition scalelm has 2 (sinfo)"
    assert message in result.stdout + result.stderr, (result.stdout + result.stderr)[-3000:]
    assert (
        subprocess.run(["sacct", "-X", "-n", "-o", "JobID"], capture_output=True, text=True).stdout.split() == submitted
    )
    assert not (project / "results").exists()

    edit_yaml(project / "test-site.yaml", lambda site: site.update(partition="gpus"))
    result = snakemake_on_slurm(project, "results/local/runs/single_gpu/seed1/run.json")
    assert result.returncode != 0 and not (project / "results").exists()
    message = "partition 'gpus' does not exist on this cluster (sinfo lists scalelm); fix partition in the site file"
    assert message in result.stdout + result.stderr, (result.stdout + result.stderr)[-3000:]
