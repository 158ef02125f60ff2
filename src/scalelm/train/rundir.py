"""One run directory: every path of a run, and what happens to the directory before training starts.

    <results>/runs/<experiment>/seed<seed>/
      train.yaml       the experiment's settings, written by the workflow: the training's --config
      config.yaml      the resolved settings the training ran with
      identity.json    what determines the trained model (see `identity`)
      metrics.jsonl    one JSON line per logging interval and per evaluation
      tensorboard/     the same as TensorBoard event files; node<k>/ the monitor's readings of node k
      wandb/           with train.wandb: the same as offline Weights & Biases runs, one per attempt
      monitor/         node<k>.jsonl: CPU, RSS and GPU utilisation of node k's training processes, every second
      checkpoints/     step_<N>/ (scalelm.train.checkpoint)
      run.json         provenance and results, written last: its presence means the training finished
      model.pt         the consolidated model, and model.pt.json with its sha256 (scalelm.study.consolidate)
      test.json        the common test evaluation (scalelm.study.evaluate)
      previous/        the last attempt made with other settings
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalelm.config import Config
from scalelm.errors import ConfigError
from scalelm.files import atomic_write_text, remove

# Settings that change where a run writes, how often it reports or saves, or how long it waits, but never what it
# trains: a run moved to another directory, or rerun with other such settings, resumes instead of starting afresh.
NOT_IDENTITY = (
    "run_dir",
    "data.prepared_dir",  # the data's checksums stand for it
    "train.log_every",
    "train.eval_every",
    "train.eval_batch_size",
    "train.peak_tflops",
    "train.monitor_interval_s",
    "train.comm_profile_steps",
    "train.wandb",
    "checkpoint.every",
    "checkpoint.keep",
    "parallel.timeout_s",
    "parallel.host_reuse_below_mb",
)


def identity(config: Config, data_checksums: dict[str, str], world_size: int) -> dict[str, Any]:
    """What determines the trained model: the settings (less NOT_IDENTITY), the data's content and the world size."""
    settings = config.to_dict()
    for dotted in NOT_IDENTITY:
        *parents, leaf = dotted.split(".")
        node = settings
        for part in parents:
            node = node[part]
        del node[leaf]
    return {"settings": settings, "data": data_checksums, "world_size": world_size}


def _entry(name: str) -> property:
    return property(lambda self: self.path / name, doc=f"<run_dir>/{name}")


@dataclass(frozen=True)
class RunDir:
    path: Path

    train_config = _entry("train.yaml")
    plan = _entry("plan.json")  # scalelm.plan's figures for the layout, written before the training (scalelm.study.preflight)
    config = _entry("config.yaml")
    identity = _entry("identity.json")
    metrics = _entry("metrics.jsonl")
    tensorboard = _entry("tensorboard")
    wandb = _entry("wandb")
    monitor = _entry("monitor")
    checkpoints = _entry("checkpoints")
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

    def start(self, run_identity: dict[str, Any]) -> None:
        """Before training (rank 0): the directory exists and is writable; a finished run is marked unfinished
        again; an attempt with another identity is moved to previous/ (replacing an older one), so training starts
        afresh instead of resuming another experiment's checkpoint."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            raise ConfigError(f"run_dir {self.path} is not writable ({err.strerror}); choose another run_dir") from None
        if self.identity.is_file() and json.loads(self.identity.read_text()) != run_identity:
            remove(self.previous)
            self.previous.mkdir()
            kept = (self.checkpoints, self.metrics, self.tensorboard, self.wandb, self.monitor, self.config, self.identity)
            for path in kept:
                if path.exists():
                    path.rename(self.previous / path.name)
            print(f"settings changed since the last attempt in {self.path}: its results moved to {self.previous}")
        atomic_write_text(self.identity, json.dumps(run_identity, indent=1) + "\n")
        self.record.unlink(missing_ok=True)
