"""Failures during training: a killed rank fails the whole job fast, naming it, and the rerun resumes."""

import json
import os
import signal
import subprocess
import time

import psutil
from conftest import run_dir_of, run_train, train_command


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
