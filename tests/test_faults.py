"""Failures during training: a killed rank fails the whole job fast, naming it, and the rerun resumes."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from conftest import run_dir_of, run_train, train_command

from scalelm.checkpoint import complete_checkpoints
from scalelm.preemption import EXIT_PREEMPTED


def test_a_killed_rank_fails_the_job_within_a_minute_naming_it_and_the_rerun_resumes(tiny_config):
    config = tiny_config("crash", parallel__strategy="ddp", train__max_steps=200, checkpoint__every=5)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(train_command(config, 2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = run_dir_of(config) / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (
        metrics.is_file() and any(json.loads(l)["step"] >= 7 for l in metrics.read_text().splitlines() if l)
    ):
        time.sleep(0.1)
    workers = [p for p in psutil.Process(launcher.pid).children(recursive=True) if "scalelm.train" in " ".join(p.cmdline())]
    assert len(workers) == 2
    victim = next(p for p in workers if p.environ().get("RANK") == "1")
    killed_at = time.time()
    victim.send_signal(signal.SIGKILL)
    _, stderr = launcher.communicate(timeout=90)
    elapsed = time.time() - killed_at
    assert launcher.returncode != 0
    assert elapsed < 60, elapsed
    assert "rank: 1" in stderr and "SIGKILL" in stderr, stderr[-3000:]
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers)

    result = run_train(config, 2)
    assert "resumed from step" in result.stdout


def launch_command(config, nodes: int, procs: int) -> list[str]:
    return [sys.executable, "-m", "scalelm.launch", "--nodes", str(nodes), "--procs-per-node", str(procs), "--", "--config", str(config)]


@pytest.mark.parametrize("nodes, procs", [(1, 2), (2, 1)])
def test_slurm_style_signal_to_the_whole_job_checkpoints_exits_75_and_resumes_bitwise(tiny_config, nodes, procs):
    """Slurm's --signal=USR1 reaches every process of the job step: launcher, torchrun(s) and workers."""
    # two local "nodes" may take ranks in either order from one run to the next: dropout would then differ
    dropout = 0.1 if nodes == 1 else 0.0
    settings = dict(model__dropout=dropout, parallel__strategy="ddp", train__max_steps=40, checkpoint__every=100)
    straight, broken = tiny_config("straight", **settings), tiny_config("broken", **settings)
    assert subprocess.run(launch_command(straight, nodes, procs), capture_output=True).returncode == 0
    job = subprocess.Popen(launch_command(broken, nodes, procs), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = run_dir_of(broken) / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (
        metrics.is_file() and any(json.loads(l)["step"] >= 5 for l in metrics.read_text().splitlines() if l)
    ):
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGUSR1)
    output, _ = job.communicate(timeout=120)
    assert job.returncode == EXIT_PREEMPTED, output[-3000:]
    assert "stopped by a signal at step" in output
    rerun = subprocess.run(launch_command(broken, nodes, procs), capture_output=True, text=True)
    assert rerun.returncode == 0 and "resumed from step" in rerun.stdout, rerun.stdout[-3000:]
    a, b = (torch.load(complete_checkpoints(run_dir_of(c) / "checkpoints")[-1] / "state.pt", weights_only=True)["model"] for c in (straight, broken))
    assert all(torch.equal(a[k], b[k]) for k in a)
