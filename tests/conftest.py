"""Shared fixtures: the shipped WikiText-2 sample, prefetched and prepared once per session, and tiny runs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from forked import run_forked

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "resources" / "wikitext-2-sample"

# A model small enough for 2 CPU cores: a step takes a few milliseconds.
TINY = {
    "data": {"seq_len": 16},
    "model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "dropout": 0.0},
    "batch": {"mode": "global", "size": 16},
    "train": {"epochs": 1, "max_steps": 20, "log_every": 1, "eval_batch_size": 128},
    "checkpoint": {"every": 10, "keep": 3},
}


def sample_files() -> str:
    return ",".join(f"{split}={SAMPLE / f'{split}.txt'}" for split in ("train", "validation", "test"))


@pytest.fixture(scope="session")
def raw_data(tmp_path_factory) -> Path:
    from scalelm.data.prefetch import main as prefetch

    out = tmp_path_factory.mktemp("data") / "raw"
    prefetch(["--out", str(out), "--files", sample_files()])
    return out


@pytest.fixture(scope="session")
def prepared(raw_data) -> Path:
    from scalelm.data.prepare import main as prepare

    out = raw_data.parent / "prepared"
    prepare(["--raw", str(raw_data), "--out", str(out), "--min-freq", "2"])
    return out


@pytest.fixture
def tiny_config(tmp_path, prepared):
    """Write a tiny training config (TINY, then `changes` as dotted keys) and return its path."""

    def make(name: str = "config", **changes) -> Path:
        from scalelm.config import set_dotted

        values = yaml.safe_load(yaml.safe_dump(TINY))
        values["data"]["prepared_dir"] = str(prepared)
        values["run_dir"] = str(tmp_path / name)
        for key, value in changes.items():
            set_dotted(values, key.replace("__", "."), value)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(values))
        return path

    return make


def train_here(config_path: Path, *overrides: str):
    """One process, in this process: no interpreter or torch start-up to pay."""
    from scalelm.config import load_config
    from scalelm.train.run import run

    return run(load_config(config_path, overrides))


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, prepared) -> Path:
    """The config of one tiny single-process run trained to its end (checkpoints at steps 10 and 20, run.json).
    Shared: copy it (`run_copy`) before changing anything."""
    root = tmp_path_factory.mktemp("finished")
    values = yaml.safe_load(yaml.safe_dump(TINY))
    values["data"]["prepared_dir"] = str(prepared)
    values["run_dir"] = str(root / "run")
    values["train"]["monitor_interval_s"] = 0
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(values))
    train_here(config)
    return config


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    """A config whose run directory is a fresh copy of `finished_run`'s (it resumes, rather than retrains, there)."""
    import shutil

    values = yaml.safe_load(finished_run.read_text())
    shutil.copytree(values["run_dir"], tmp_path / "run", symlinks=True)
    values["run_dir"] = str(tmp_path / "run")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(values))
    return config


def train_command(config: Path, nproc: int = 1, *overrides: str) -> list[str]:
    sets = [arg for o in overrides for arg in ("--set", o)]
    if nproc == 1:
        return [sys.executable, "-m", "scalelm.train", "--config", str(config), *sets]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*launcher, "-m", "scalelm.train", "--config", str(config), *sets]


def run_train(
    config: Path,
    nproc: int = 1,
    *overrides: str,
    check: bool = True,
    timeout: int = 120,
    env=None,
    launcher: str = "forked",
):
    """`python -m scalelm.train` on `nproc` ranks of this machine. `launcher`: "forked" (tests/forked.py: ranks forked
    from a server that imported torch and scalelm once) where nothing process-level is under test, or "torchrun" (the
    real launcher and interpreters, as a user starts them)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if launcher == "forked":
        sets = [arg for o in overrides for arg in ("--set", o)]
        result = run_forked(["--config", str(config), *sets], nproc, env, timeout)
    else:
        command = train_command(config, nproc, *overrides)
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if check and result.returncode != 0:
        raise AssertionError(
            f"training failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )
    return result


def run_dir_of(config: Path) -> Path:
    return Path(yaml.safe_load(config.read_text())["run_dir"])


def train_losses(run_dir: Path) -> list[float]:
    from scalelm.train.record import read_metrics

    return [r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"]


def board_scalars(run_dir: Path, tag: str, board: str = "tensorboard") -> list[tuple[int, float]]:
    """(step, value) of one scalar in the run's TensorBoard event files (in `board`), read by tensorboard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(Path(run_dir) / board))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


LONG = ("slow", "slurm", "apptainer")  # the marks of a test that takes about 30 s or more
# what trains or starts processes: a test that calls one, itself, through a fixture it uses or through a function of
# its module, is marked `trains` (`bash scripts/test.sh --fast` leaves those out)
STARTS_WORK = {"train_here", "run_train", "run_forked", "drills", "snakemake", "subprocess", "run_script", "spawn"}


def names_called(code, scope: dict, depth: int = 2) -> set[str]:
    """The global names `code` (and the functions nested in it) refers to, and those of the functions of `scope`
    (its module) it calls, `depth` calls deep."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= names_called(const, scope, depth)
    if depth:
        for name in list(names):
            function = scope.get(name)
            if callable(function) and hasattr(function, "__code__"):
                names |= names_called(function.__code__, function.__globals__, depth - 1)
    return names


def starts_work(item) -> bool:
    functions = [getattr(item, "function", None)]
    for definitions in getattr(item, "_fixtureinfo").name2fixturedefs.values():
        functions += [definition.func for definition in definitions]
    codes = [(f.__code__, f.__globals__) for f in functions if f is not None and hasattr(f, "__code__")]
    return any(STARTS_WORK & names_called(code, scope) for code, scope in codes)


def pytest_collection_modifyitems(items):
    """Each test that trains or starts processes marked `trains`. Then the files with the most long tests first, each
    file's tests in their order: scripts/test.sh runs every file whole on one of two pytest-xdist workers
    (`--dist loadfile`: a file's module fixtures, such as the Slurm tier's cluster, start once), and a long file
    started last would leave the other worker idle at the end."""
    for item in items:
        if starts_work(item):
            item.add_marker("trains")
    weight = Counter(item.path for item in items if any(item.get_closest_marker(mark) for mark in LONG))
    items.sort(key=lambda item: -weight[item.path])
