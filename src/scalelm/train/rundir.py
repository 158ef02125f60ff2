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
      previous/        the last attempt made with other settings that got anywhere (previous-<study>/: one
                       of a named study, so that measuring again under a new name never costs an earlier study's)
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

from scalelm.config import STUDY_NAME, Config, Devices, equivalent_settings, identity_settings
from scalelm.errors import ConfigError
from scalelm.files import OutputError, atomic_write_text, check_apart, remove

IDENTITY = "identity.json"
PARKED = ".previous-returning"  # previous/ while `start` swaps it with the attempt here
SET_ASIDE = "previous"  # previous/ (no study name) and previous-<study>/, where `start` sets attempts aside
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
        is marked unfinished again. An attempt with another identity is set aside (`set_aside`) if it got anywhere
        (a checkpoint, a logged step, a result), else dropped, so that an attempt that failed before its first step
        never costs the one before it; and an attempt set aside with this identity comes back, to be resumed rather
        than retrained. An identity.json recorded with settings that train alike `here` (written out by an older
        scalelm) is this run's."""
        self.refuse_foreign()
        self._make_writable()
        self._refuse_links([self.path / ".lock", *self.attempt, *self.set_aside_dirs()])
        current = read_identity(self.identity, here)
        if current is not None and current != run_identity:
            self.set_aside(current, run_identity, here)
        if read_identity(self.identity, here) != run_identity:  # the same run's, as recorded, keeps its lineage
            atomic_write_text(self.identity, json.dumps(run_identity, indent=1) + "\n")
        self.record.unlink(missing_ok=True)

    def set_aside(self, current: dict[str, Any], run_identity: dict[str, Any], here: Devices | None) -> None:
        """The attempt here (of identity `current`) makes way for one of `run_identity`: it moves to the set-aside
        directory of its study (`previous_of`), replacing only the attempt of that study set aside before, so that
        a new study name keeps every earlier study's attempt; the attempt of `run_identity` comes back from its
        study's, where it is there."""
        returning = self.previous_of(study_of(run_identity))
        earlier = read_identity(returning / IDENTITY, here) == run_identity
        parked = self.path / PARKED
        if earlier:
            remove(parked)
            returning.rename(parked)
        if self.holds_work():
            target = self.previous_of(study_of(current))
            if target.exists():
                print(f"{target} held an attempt set aside earlier ({describe_attempt(target)}): it is replaced")
            remove(target)
            target.mkdir()
            for path in self.attempt:
                if path.exists():
                    path.rename(target / path.name)
            print(f"settings changed since the last attempt in {self.path}: its results moved to {target}")
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
            print(f"the attempt with these settings is back from {returning}: it resumes")

    def previous_of(self, study: str | None) -> Path:
        """Where an attempt of `study` is set aside: previous/ with no study name, previous-<study>/ with one (a
        name the config checked; any other, from a hand-edited identity.json, by its digest)."""
        if study is None:
            return self.previous
        if not STUDY_NAME.fullmatch(str(study)):
            study = hashlib.sha256(str(study).encode()).hexdigest()[:16]
        return self.path / f"{SET_ASIDE}-{study}"

    def set_aside_dirs(self) -> list[Path]:
        """Every directory an attempt is set aside in (`previous_of`), those there are."""
        return [self.previous, *sorted(p for p in self.path.glob(f"{SET_ASIDE}-*") if p.is_dir())]

    def entries(self) -> list[Path]:
        """Every path of the run directory that scalelm writes (the attempt, the workflow's files, what is set
        aside, the lock): what no other command's output may be."""
        return [
            self.train_config,
            self.plan,
            *self.attempt,
            *self.set_aside_dirs(),
            self.path / PARKED,
            self.path / ".lock",
        ]

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
            p.is_file() for p in (self.identity, *(d / IDENTITY for d in self.set_aside_dirs()), parked / IDENTITY)
        ):
            return
        brought = self.checkpoints.is_dir() and all(holds_checkpoint(p) for p in self.checkpoints.iterdir())
        names = [p.name for p in (*self.attempt, *self.set_aside_dirs(), parked) if os.path.lexists(p)]
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


def study_of(run_identity: Any) -> str | None:
    """The study name an identity was trained for (None: no name, or an identity no run has)."""
    settings = run_identity.get("settings") if isinstance(run_identity, dict) else None
    return settings.get("study") if isinstance(settings, dict) else None


def describe_attempt(path: Path) -> str:
    """An attempt set aside, in a few words: its study and how far it got."""
    study = study_of(recorded_identity(path / IDENTITY))
    named = f"study {study}" if study is not None else "no study name"
    finished = "finished" if (path / "run.json").is_file() else "unfinished"
    return f"{named}, {finished}"


def runs_holding(path: Path) -> list[RunDir]:
    """The run directories `path` lies in: every folder above it that holds an identity.json or a train.yaml."""
    return [
        RunDir(folder)
        for folder in Path(path).absolute().parents
        if (folder / IDENTITY).is_file() or (folder / "train.yaml").is_file()
    ]


def check_run_output(out: Path, option: str, entry: str, source: RunDir | None) -> None:
    """An output of the consolidation or the evaluation (`option`, the run's `entry` it is: model, model_meta or
    test_result) replaces or changes nothing of any run it lies in but that entry, and that entry only in the run
    its model comes from (`source`; None: a model of no run): a run's record, identity, log, checkpoints and
    set-aside attempts are never written over, and no run reports another's model as its own."""
    target = Path(out).absolute()
    runs = runs_holding(out)
    if source is not None and source.path.absolute() in target.parents and source not in runs:
        runs.append(source)  # a run directory without identity.json (checkpoints brought in): its files all the same
    for run in runs:
        own = getattr(run, entry)
        mine = source is not None and run.path.absolute() == source.path.absolute()
        whose = "the run's" if mine else f"the run {run.path}'s"
        check_apart(out, {f"{whose} {p.name}": p for p in run.entries() if p != own}, option)
        if target == own.absolute() and not mine:
            model = f"run {source.path}'s model" if source is not None else "a model of no run"
            raise OutputError(
                f"{option} {out} is the run {run.path}'s {own.name}, but it would hold {model}: the run would report "
                f"it as its own; choose another {option}"
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
