"""Fault drills on a running training job: stop it the way Slurm does, or kill one of its ranks, at a chosen step.

The job is `python -m scalelm.launch` in its own process group, like a Slurm job step; the stop signal (SIGUSR1, what
the Slurm profile asks for ahead of the time limit) goes to the whole group, as `scancel --signal=USR1` and Slurm's
`--signal` deliver it. Used by tests/test_faults.py and by bench/fault_trials.py for the figures in the docs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
import yaml

from scalelm.config import ModelConfig
from scalelm.errors import EXIT_PREEMPTED
from scalelm.files import sha256
from scalelm.model.transformer import TransformerLM
from scalelm.settings_yaml import from_mapping
from scalelm.train.checkpoint import MARKER, load_weights, read_trainer_state
from scalelm.train.consolidate import consolidate
from scalelm.train.rundir import RunDir


@dataclass
class Interruption:
    target: int  # the step the signal was sent at (or just after)
    exit_code: int
    stopped_at: int | None  # the step of the checkpoint the job saved
    signal_to_checkpoint_s: float | None  # from the signal to the checkpoint's completion marker
    output: str

    @property
    def survived(self) -> bool:
        return self.exit_code == EXIT_PREEMPTED and self.stopped_at is not None


@dataclass
class Crash:
    rank: int
    at_step: int
    exit_code: int
    detected_s: float  # from the kill to the whole job's exit
    survivors: int  # training processes still running after the job exited
    output: str


def launch_command(config: Path, nodes: int = 1, procs: int = 2) -> list[str]:
    geometry = ["--nodes", str(nodes), "--procs-per-node", str(procs)]
    return [sys.executable, "-m", "scalelm.launch", *geometry, "--", "--config", str(config)]


def run_dir_of(config: Path) -> Path:
    return Path(yaml.safe_load(config.read_text())["run_dir"])


def last_step(metrics: Path) -> int:
    """The last step logged in a metrics file that a running training is appending to: its complete lines only (a
    CI run read a line half written)."""
    if not metrics.is_file():
        return 0
    complete = metrics.read_text().split("\n")[:-1]  # what follows the last newline is still being written
    steps = [json.loads(line).get("step", 0) for line in complete if line.strip()]
    return max(steps, default=0)


def run(
    config: Path, nodes: int = 1, procs: int = 2, timeout: int = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        launch_command(config, nodes, procs), capture_output=True, text=True, timeout=timeout, env=env
    )


def start(config: Path, nodes: int, procs: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        launch_command(config, nodes, procs),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, like a Slurm job step
    )


def wait_for_step(job: subprocess.Popen, config: Path, step: int, timeout: int) -> None:
    metrics = run_dir_of(config) / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while job.poll() is None and last_step(metrics) < step and time.monotonic() < deadline:
        time.sleep(0.02)


def interrupt(config: Path, at_step: int, nodes: int = 1, procs: int = 2, timeout: int = 300) -> Interruption:
    """Start (or resume) the job, send SIGUSR1 to its process group once it has logged `at_step`, wait for it."""
    job = start(config, nodes, procs)
    wait_for_step(job, config, at_step, timeout)
    sent = time.time()
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGUSR1)
    output, _ = job.communicate(timeout=timeout)
    found = re.search(r"stopped by a signal at step (\d+); checkpoint (\S+);", output)
    stopped_at = took = None
    if found:
        stopped_at = int(found[1])
        took = (Path(found[2]) / MARKER).stat().st_mtime - sent
    return Interruption(at_step, job.returncode, stopped_at, took, output)


def training_workers(job: subprocess.Popen) -> list[psutil.Process]:
    return [p for p in psutil.Process(job.pid).children(recursive=True) if "scalelm.train" in " ".join(p.cmdline())]


def worker_of_rank(workers: list[psutil.Process], rank: int) -> psutil.Process:
    return next(p for p in workers if p.environ().get("RANK") == str(rank))


def kill_rank(config: Path, rank: int, at_step: int, nodes: int = 1, procs: int = 2, timeout: int = 300) -> Crash:
    """SIGKILL one training process (as the OOM killer or a lost node would) once the job has logged `at_step`."""
    job = start(config, nodes, procs)
    wait_for_step(job, config, at_step, timeout)
    workers = training_workers(job)
    victim = worker_of_rank(workers, rank)
    killed = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    output, _ = job.communicate(timeout=timeout)
    detected = time.monotonic() - killed
    survivors = sum(1 for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    return Crash(rank, at_step, job.returncode, detected, survivors, output)


@dataclass
class Freeze:
    rank: int
    at_step: int  # the step after which the rank was stopped
    exit_code: int | None  # None: the job was still running at the timeout
    detected_s: float  # from the stop to the whole job's exit (or the timeout)
    survivors: int  # processes of the job still running (or stopped) after it exited
    output: str


# Loaded by every Python process of the job (sitecustomize, first on PYTHONPATH): once rank RANK has ended step STEP,
# before the collective of that step's log line, it writes its pid to PAUSED and waits there for the drill's SIGSTOP.
# The other ranks then wait in that collective, between two steps. (The rank is known only once the training runs:
# the spawn launcher sets RANK in the process it started.)
PAUSING_SITE = """
import os, time
command = open("/proc/self/cmdline").read()
if "torchrun" not in command and ("scalelm.train" in command or "--multiprocessing-fork" in command):
    from scalelm.train import trainer

    unpaused = trainer.Trainer.log_train

    def log_train(self, *args, **kwargs):
        if os.environ.get("RANK") == "{rank}" and self.state.step == {step}:
            open("{paused}", "w").write(str(os.getpid()))
            time.sleep(3600)
        return unpaused(self, *args, **kwargs)

    trainer.Trainer.log_train = log_train
"""


def freeze_rank(
    config: Path,
    rank: int,
    at_step: int,
    site: Path,
    timeout: int = 120,
    env: dict[str, str] | None = None,
    procs: int = 2,
) -> Freeze:
    """SIGSTOP one training process once it has ended step `at_step` (train.log_every: 1): a process that makes no
    progress at all, its threads included, as with a hung file system, a driver hang or a node that stops
    answering. Wait for the job to end; whatever happens, no process of the job is left behind, stopped or running.
    `env`: variables added to the job's environment."""
    site.mkdir(parents=True, exist_ok=True)
    paused = site / "paused"
    (site / "sitecustomize.py").write_text(PAUSING_SITE.format(rank=rank, step=at_step, paused=paused))
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    job = start(config, 1, procs, {**os.environ, **(env or {}), "PYTHONPATH": path})
    workers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + timeout
        while job.poll() is None and not pid_in(paused) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not pid_in(paused):  # failed or finished first, or too slow: nothing to stop
            end_job(job, workers)
            return Freeze(rank, at_step, job.returncode, 0.0, 0, job.communicate()[0])
        victim = psutil.Process(pid_in(paused))
        workers = [*training_workers(job), victim]  # torchrun's, and the rank (spawn's workers run another command)
        victim.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            output, exit_code = job.communicate(timeout=timeout)[0], job.returncode
        except subprocess.TimeoutExpired:  # still running: its output up to here, once it is ended
            end_job(job, workers)
            output, exit_code = job.communicate()[0], None
        detected = time.monotonic() - stopped
        survivors = sum(1 for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
        return Freeze(rank, at_step, exit_code, detected, survivors, output)
    finally:
        end_job(job, workers)


def pid_in(path: Path) -> int | None:
    text = path.read_text() if path.is_file() else ""
    return int(text) if text.strip() else None


def end_job(job: subprocess.Popen, workers: list[psutil.Process]) -> None:
    """Kill what is left of a drilled job: SIGKILL ends a stopped process too (a SIGTERM would wait for a SIGCONT)."""
    if job.poll() is None:
        with contextlib.suppress(psutil.Error):
            workers = [*workers, *training_workers(job)]
    for process in workers:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    if job.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    job.wait()


@dataclass
class Stall:
    rank: int
    at_step: int
    exit_code: int
    detected_s: float  # from the start of the stall to the whole job's exit
    output: str


# Loaded by every Python process of the job (sitecustomize, first on PYTHONPATH): rank RANK sleeps SECONDS at the
# start of each step from FIRST to LAST, inside the step, as a slow node, a hung device or a deadlocked thread would.
SLOWING_SITE = """
import os, time
if os.environ.get("RANK") == "{rank}":
    from scalelm.train import trainer

    unslowed = trainer.Trainer.train_step

    def train_step(self, micro_batches):
        if {first} <= self.state.step + 1 <= {last}:
            if not os.path.exists("{started}"):
                open("{started}", "w").write(str(time.time()))
            time.sleep({seconds})
        return unslowed(self, micro_batches)

    trainer.Trainer.train_step = train_step
"""


def slowed_rank(site: Path, rank: int, first: int, last: int, seconds: float) -> dict[str, str]:
    """The environment of a job in which `rank` sleeps `seconds` in each step from `first` to `last`; the time it
    first did is in `site`/slowed-at."""
    site.mkdir(parents=True, exist_ok=True)
    started = site / "slowed-at"
    code = SLOWING_SITE.format(rank=rank, first=first, last=last, seconds=seconds, started=started)
    (site / "sitecustomize.py").write_text(code)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


def stall_rank(config: Path, rank: int, at_step: int, site: Path, procs: int = 4, timeout: int = 300) -> Stall:
    """Make one rank stall inside step `at_step` (the others wait for it in their next collective) and wait for the
    job to end: by its watchdog's autopsy, or at `timeout`."""
    job = start(config, 1, procs, slowed_rank(site, rank, at_step, at_step, 3600))
    output, _ = job.communicate(timeout=timeout)
    return Stall(rank, at_step, job.returncode, time.time() - float((site / "slowed-at").read_text()), output)


def checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model weights of one checkpoint directory (DCP), as one state dict."""
    shape = dict(read_trainer_state(checkpoint).model_shape)
    config = from_mapping(ModelConfig, {k: v for k, v in shape.items() if k != "vocab_size"})  # (model.moe a section)
    model = TransformerLM(config, shape["vocab_size"])
    load_weights(checkpoint, model)
    return model.state_dict()


def final_weights(config: Path, out: Path) -> dict[str, torch.Tensor]:
    """The newest checkpoint's model weights as one state dict, whatever the strategy wrote (file or DCP)."""
    consolidate(RunDir(run_dir_of(config)), out)
    return torch.load(out, weights_only=True)["model"]


def reseal(checkpoint: Path) -> None:
    """What whoever can write a checkpoint can also do: make its marker's checksums match again."""
    sums = {p.name: sha256(p) for p in sorted(checkpoint.iterdir()) if p.is_file() and p.name != MARKER}
    (checkpoint / MARKER).write_text(json.dumps(sums))


def interrupt_after_step(command: list[str], run_dir, step: int) -> tuple[int, str]:
    """Start training, send SIGTERM once `step` is logged; returns the exit status and stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if last_step(metrics) >= step:
            process.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    _, stderr = process.communicate(timeout=120)
    return process.returncode, stderr
