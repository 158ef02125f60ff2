"""One run directory: every path of a run, and what happens to the directory before training starts.

    <results>/runs/<experiment>/seed<seed>/
      train.yaml       the experiment's settings, written by the workflow: the training's --config
      config.yaml      the resolved settings the training ran with
      identity.json    what determines the trained model (see `identity`)
      metrics.jsonl    one JSON line per logging interval and per evaluation
      tensorboard/     the same as TensorBoard event files; node<k>/ the monitor's readings of node k
      wandb/           with train.wandb: the same as offline Weights & Biases runs, one per attempt
      monitor/         node<k>.jsonl: CPU, RSS and GPU utilisation of node k's training processes, every second
      checkpoints/     step_<N>/ (scalelm.train.checkpoint); finished.json, run.json kept beside the last one
      run.json         provenance and results, written last: its presence means the training finished
      model.pt         the consolidated model, and model.pt.json with its sha256 (scalelm.train.consolidate)
      test.json        the common test evaluation (scalelm.train.evaluation)
      previous/        the last attempt made with other settings that got anywhere
      .lock            held by the training running here (rank 0), so that no second one writes beside it

scalelm writes nothing through a symbolic link inside a run directory: `start` refuses one (the run directory
itself, or the results directory above it, may be a link).

Three words for what a run is:
- identity: everything that determines the trained model (settings, data checksums, layout): another identity is
  another run, and its attempt is set aside (`identity`, identity.json);
- lineage: a digest of the identity less its layout: a checkpoint of the same lineage may resume in any layout
  (`lineage`);
- origin: what a checkpoint records of its run (seed, lineage, steps) and what a run accepts of those it resumes
  (scalelm.train.checkpoint.Origin).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalelm.config import Config, Devices, equivalent_settings, identity_settings
from scalelm.errors import ConfigError
from scalelm.files import atomic_write_text, remove

IDENTITY = "identity.json"
PARKED = ".previous-returning"  # previous/ while `start` swaps it with the attempt here
CHECKPOINT_PREFIX = "step_"  # checkpoints/step_00000420/ (scalelm.train.checkpoint)

# What says how the ranks share the work, not what they train: a checkpoint loads into any layout and world size.
LAYOUT = ("world_size", "settings.parallel")


def identity(config: Config, data_checksums: dict[str, str], world_size: int, here: Devices) -> dict[str, Any]:
    """What determines the trained model: the settings that say they do (scalelm.config.setting), those that train
    alike `here` written one way, the data's content and the world size."""
    settings = equivalent_settings(identity_settings(config.to_dict()), here)
    return {"settings": settings, "data": data_checksums, "world_size": world_size}


def without(tree: dict[str, Any], dotted_keys: tuple[str, ...]) -> dict[str, Any]:
    """A copy of `tree` without the (dotted) keys, those it has."""
    tree = json.loads(json.dumps(tree))  # a deep copy, in the form identity.json holds it
    for dotted in dotted_keys:
        *parents, leaf = dotted.split(".")
        node = tree
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return tree


def lineage(run_identity: dict[str, Any]) -> str:
    """What a checkpoint records of the run that wrote it (scalelm.train.checkpoint.Origin): a digest of the run's
    identity less its LAYOUT, so that a checkpoint of other settings, data or seed is never resumed on its name."""
    trained = without(run_identity, LAYOUT)
    return hashlib.sha256(json.dumps(trained, sort_keys=True).encode()).hexdigest()[:16]


def _entry(name: str) -> property:
    return property(lambda self: self.path / name, doc=f"<run_dir>/{name}")


@dataclass(frozen=True)
class RunDir:
    path: Path

    train_config = _entry("train.yaml")
    # scalelm.plan's figures for the layout, written before the training (scalelm.study.preflight)
    plan = _entry("plan.json")
    config = _entry("config.yaml")
    identity = _entry(IDENTITY)
    metrics = _entry("metrics.jsonl")
    tensorboard = _entry("tensorboard")
    wandb = _entry("wandb")
    monitor = _entry("monitor")
    autopsy = _entry("autopsy")  # what each rank was doing when its watchdog stopped the job (scalelm.hang.watchdog)
    checkpoints = _entry("checkpoints")
    # run.json as the training wrote it at its end, kept with the checkpoint it names: a rerun with nothing left to
    # train restores it (Snakemake removes run.json before it reruns a job whose settings changed)
    finished = _entry("checkpoints/finished.json")
    record = _entry("run.json")
    model = _entry("model.pt")
    model_meta = _entry("model.pt.json")
    test_result = _entry("test.json")
    previous = _entry("previous")

    @classmethod
    def of(cls, results: str | Path, experiment: str, seed: int | str) -> RunDir:
        """The run directory of one experiment and seed of a study (the workflow's wildcards work as well)."""
        return cls(Path(results) / "runs" / str(experiment) / f"seed{seed}")

    @property
    def experiment(self) -> str:
        return self.path.parent.name

    # what one attempt writes: set aside together when the settings change
    @property
    def attempt(self) -> tuple[Path, ...]:
        return (
            self.checkpoints,
            self.metrics,
            self.tensorboard,
            self.wandb,
            self.monitor,
            self.autopsy,
            self.config,
            self.identity,
            self.record,
            self.model,
            self.model_meta,
            self.test_result,
        )

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Held by the training that writes here (rank 0) from before `start` to its end; a second training in the
        same directory is refused, naming the first, instead of crashing it mid-checkpoint."""
        self.refuse_foreign()
        self._make_writable()
        path = self.path / ".lock"
        self._refuse_links([path])
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                raise ConfigError(
                    f"another training is running in {self.path} ({holder}): wait for it to end or stop it; two "
                    "trainings in one run directory would overwrite each other's checkpoints"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)  # releases the lock

    def start(self, run_identity: dict[str, Any], here: Devices | None = None) -> None:
        """Before training (rank 0, under `lock`): the directory exists, is writable and holds no link; a finished run
        is marked unfinished again. An attempt with another identity is set aside in previous/ (replacing an older
        one) if it got anywhere (a checkpoint, a logged step, a result), else dropped, so that an attempt that
        failed before its first step never costs the one before it; and an attempt in previous/ with this identity
        comes back, to be resumed rather than retrained. An identity.json recorded with settings that train alike
        `here` (written out by an older scalelm) is this run's."""
        self.refuse_foreign()
        self._make_writable()
        self._refuse_links([self.path / ".lock", *self.attempt, self.previous])
        current = read_identity(self.identity, here)
        if current is not None and current != run_identity:
            earlier = read_identity(self.previous / self.identity.name, here) == run_identity
            parked = self.path / PARKED
            if earlier:
                remove(parked)
                self.previous.rename(parked)
            if self.holds_work():
                remove(self.previous)
                self.previous.mkdir()
                for path in self.attempt:
                    if path.exists():
                        path.rename(self.previous / path.name)
                print(f"settings changed since the last attempt in {self.path}: its results moved to {self.previous}")
            else:
                for path in self.attempt:
                    remove(path)
                print(
                    f"settings changed since the last attempt in {self.path}, which stopped before its first step: "
                    "it was dropped"
                )
            if earlier:
                for path in parked.iterdir():
                    path.rename(self.path / path.name)
                remove(parked)
                print(f"the attempt with these settings is back from {self.previous}: it resumes")
        if read_identity(self.identity, here) != run_identity:  # the same run's, as recorded, keeps its lineage
            atomic_write_text(self.identity, json.dumps(run_identity, indent=1) + "\n")
        self.record.unlink(missing_ok=True)

    def lineages(self, run_identity: dict[str, Any], here: Devices | None = None) -> frozenset[str]:
        """The lineages this run's checkpoints may carry: its identity's, and that of the identity.json recorded here
        when it is this run's under an older rule of what identity holds (checkpoints an older scalelm wrote)."""
        recorded = recorded_identity(self.identity)
        known = {lineage(run_identity)}
        if isinstance(recorded, dict) and read_identity(self.identity, here) == run_identity:
            known.add(lineage(recorded))
        return frozenset(known)

    def refuse_foreign(self) -> None:
        """A directory that holds no identity.json (nor one set aside by `start`) is no run's: if it holds any name a
        run writes, it is someone's files (a project, the current directory), which `start` would replace, set aside
        or write beside; refused. But checkpoints/ holding checkpoints only is a run's checkpoint brought here to be
        resumed (by another layout, say: its lineage says whether it may be)."""
        parked = self.path / PARKED
        if not self.path.is_dir() or any(
            p.is_file() for p in (self.identity, self.previous / IDENTITY, parked / IDENTITY)
        ):
            return
        brought = self.checkpoints.is_dir() and all(holds_checkpoint(p) for p in self.checkpoints.iterdir())
        names = [p.name for p in (*self.attempt, self.previous, parked) if os.path.lexists(p)]
        names = [name for name in names if not (brought and name == self.checkpoints.name)]
        if names:
            raise ConfigError(
                f"run_dir {self.path} is not a scalelm run directory (it has no {IDENTITY}) but holds "
                f"{', '.join(names)}, which a training would replace: choose a new or empty run_dir, or move those "
                "files elsewhere first"
            )

    def holds_work(self) -> bool:
        """Whether the attempt here got anywhere: a checkpoint, a logged step or a result."""
        logged = self.metrics.is_file() and self.metrics.stat().st_size > 0
        checkpoints = self.checkpoints.is_dir() and any(self.checkpoints.iterdir())
        return logged or checkpoints or self.record.exists() or self.model.exists()

    def _make_writable(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=self.path)  # O_EXCL: never through a link
            os.close(fd)
            os.unlink(probe)
        except OSError as err:
            raise ConfigError(f"run_dir {self.path} is not writable ({err.strerror}); choose another run_dir") from None

    def _refuse_links(self, paths) -> None:
        inside = [Path(root) / name for root, dirs, files in os.walk(self.path) for name in dirs + files]
        links = [p for p in [*paths, *inside] if p.is_symlink()]
        if links:
            raise ConfigError(
                f"{links[0]} is a symbolic link: scalelm writes nothing through links inside a run directory "
                f"({self.path}); replace it with what it points to, or remove it"
            )


def holds_checkpoint(path: Path) -> bool:
    """Whether `path` is named as scalelm.train.checkpoint names a checkpoint (step_N, step_N.partial)."""
    step = path.name.removeprefix(CHECKPOINT_PREFIX).removesuffix(".partial")
    return path.is_dir() and not path.is_symlink() and path.name.startswith(CHECKPOINT_PREFIX) and step.isdigit()


def recorded_identity(path: Path) -> Any:
    """A run's identity.json as written; an unreadable one is an identity no run has."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"unreadable": str(path)}


def read_identity(path: Path, here: Devices | None = None) -> dict[str, Any] | None:
    """A run's identity.json, less the settings an older scalelm counted in it that are not identity today (staging,
    compile, ...), and with those that train alike `here` written as `identity` writes them; an unreadable one is
    an identity no run has."""
    recorded = recorded_identity(path)
    if not isinstance(recorded, dict) or not isinstance(recorded.get("settings"), dict):
        return recorded
    settings = identity_settings(recorded["settings"])
    return {**recorded, "settings": equivalent_settings(settings, here) if here else settings}
