"""Turn a run's final checkpoint (one file or a sharded DCP directory) into one plain state dict file.

    python -m scalelm.train.consolidate --run-dir results/runs/fsdp/seed1 [--out FILE]

Writes the model file (default: the run's model.pt) and, beside it, `<out>.json` with its sha256, the checkpoint and
step it came from. The checkpoint's seal and contents are verified before it is read (scalelm.train.checkpoint.verify),
and the model file's sha256 against its `.json` before it is loaded (`load_consolidated`).
Runs in one process: DCP reshards the checkpoint of N ranks on load.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from scalelm.config import Config, ModelConfig, identity_settings, load_config
from scalelm.errors import CheckpointError, ConfigError, friendly_errors
from scalelm.files import atomic_path, atomic_write_text, check_file_output, load_tensors, sha256
from scalelm.model.transformer import TransformerLM
from scalelm.settings_yaml import from_mapping, shown
from scalelm.train.checkpoint import (
    Origin,
    TrainerState,
    check_origin,
    check_shape,
    complete_checkpoints,
    load_weights,
    model_shape,
    read_trainer,
    require_usable,
    trainer_state,
)
from scalelm.train.record import changed_settings, read_record
from scalelm.train.rundir import RunDir, check_run_output, lineage, read_identity, runs_holding


def consolidate(run: RunDir, out: Path | None = None) -> dict[str, Any]:
    """The newest complete checkpoint of `run` as one model file (default: the run's model.pt) and `<out>.json`."""
    out = Path(out or run.model)
    check_out(run, out)
    found = complete_checkpoints(run.checkpoints)
    if not found:
        raise CheckpointError(f"no complete checkpoint in {run.checkpoints}: train the run first")
    checkpoint = found[-1]
    try:
        require_usable(checkpoint)
    except CheckpointError as err:
        raise CheckpointError(
            f"{err}; remove {run.record} and run the training again: it resumes from the last good checkpoint"
        ) from None
    config = checked_config(run)
    state = checked_state(run, checkpoint, config.seed)
    check_shape(state.model_shape, model_shape(config, state.model_shape.get("vocab_size")), checkpoint)
    model = TransformerLM(config.model, state.model_shape["vocab_size"])
    load_weights(checkpoint, model)
    payload = {
        "model": model.state_dict(),
        "model_config": config.to_dict()["model"],
        "vocab_size": model.vocab_size,
        "seq_len": config.data.seq_len,
        "step": state.step,
    }
    with atomic_path(out) as partial:
        torch.save(payload, partial)
    meta = {
        "model": str(out),
        "sha256": sha256(out),
        "checkpoint": str(checkpoint),
        "step": state.step,
        "vocab_size": model.vocab_size,
    }
    atomic_write_text(f"{out}.json", json.dumps(meta, indent=2) + "\n")
    return meta


def check_out(run: RunDir, out: Path, option: str = "--out") -> None:
    """The model file and its `<out>.json` replace no directory and nothing of a run but the run's own earlier
    model.pt and its record (scalelm.train.rundir.check_run_output): never another run's."""
    if out.resolve() in (run.path.resolve(), *run.path.resolve().parents):
        name = "is" if out.resolve() == run.path.resolve() else "holds"
        raise CheckpointError(f"{option} {out} {name} the run directory {run.path}; choose another {option}")
    for written, entry in ((out, "model"), (Path(f"{out}.json"), "model_meta")):
        check_file_output(written)
        check_run_output(written, option, entry, source=run)


def model_source(model: Path) -> RunDir | None:
    """The run a consolidated model comes from: the run of the checkpoint its record names, where that checkpoint
    is still there, else the run whose model.pt it is; None for a model of no run."""
    try:
        checkpoint = Path(json.loads(Path(f"{model}.json").read_text())["checkpoint"])
    except (OSError, ValueError, KeyError, TypeError):
        checkpoint = None
    if checkpoint is not None and checkpoint.is_dir() and checkpoint.parent.name == "checkpoints":
        return RunDir(checkpoint.parent.parent)
    runs = [run for run in runs_holding(model) if run.model.absolute() == Path(model).absolute()]
    return runs[0] if runs else None


# what consolidation reads of config.yaml: the model it builds, the sequence length it records, the seed it checks
BUILT_FROM = ("model", "data", "seed")


def checked_config(run: RunDir) -> Config:
    """The run's config.yaml, once what consolidation reads of it (BUILT_FROM) is what identity.json records (which
    the checkpoint's lineage is checked against: `checked_state`): an edited setting would build another function
    around the trained weights (model.norm, model.moe.top_k), or one they do not fit, and a good checkpoint would be
    called damaged."""
    config = load_config(run.config)
    run_identity = read_identity(run.identity)
    if not (isinstance(run_identity, dict) and isinstance(run_identity.get("settings"), dict)):
        return config  # not a run directory scalelm trained in: the checkpoint's recorded shape is still checked
    recorded, described = (
        {key: value for key, value in settings.items() if key in BUILT_FROM}
        for settings in (run_identity["settings"], identity_settings(config.to_dict()))
    )
    differ = changed_settings(recorded, described)
    if differ:
        details = "; ".join(
            f"{key} {shown(now, 60)} there, {shown(then, 60)} in {run.identity.name}"
            for key, (then, now) in differ.items()
        )
        raise ConfigError(
            f"{run.config} does not describe the model this run trained ({details}): set it back as {run.identity} "
            "records it; consolidation builds the model config.yaml describes"
        )
    return config


def checked_state(run: RunDir, checkpoint: Path, seed: int) -> TrainerState:
    """The checkpoint's trainer state, once its contents are what its name and the run say (its step, seed and
    lineage: scalelm.train.checkpoint.check_origin) and its step is the one run.json records."""
    trainer = read_trainer(checkpoint)
    run_identity = read_identity(run.identity)
    known = isinstance(run_identity, dict) and "settings" in run_identity  # a run directory scalelm trained in
    accepts = run.lineages(run_identity) if known else frozenset()
    check_origin(checkpoint, trainer, Origin(seed, lineage(run_identity) if known else None, accepts=accepts))
    state = trainer_state(trainer, checkpoint)
    recorded = read_record(run.path).results.steps if run.record.is_file() else state.step
    if recorded != state.step:
        raise CheckpointError(
            f"{run.record} records {recorded} steps, but the newest checkpoint {checkpoint} holds step {state.step}: "
            f"the checkpoints changed after the run finished; remove {run.record} and run the training again"
        )
    return state


def load_consolidated(path: Path) -> tuple[TransformerLM, dict[str, Any]]:
    """The model of a consolidated file, once its sha256 matches the one its `.json` recorded."""
    path, sidecar = Path(path), Path(f"{path}.json")
    if not path.is_file():
        raise CheckpointError(f"consolidated model {path} does not exist: run the consolidate step first")
    try:
        recorded = json.loads(sidecar.read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{sidecar}, the record of {path.name}'s checksum, is missing or unreadable ({type(err).__name__}); "
            "consolidate the run again"
        ) from None
    digest = sha256(path)
    if digest != recorded:
        raise CheckpointError(
            f"{path} does not match its record {sidecar} (sha256 {digest[:12]}, recorded {str(recorded)[:12]}): "
            "the file was replaced or damaged after consolidation; consolidate the run again"
        )
    payload = load_tensors(path, map_location="cpu")
    model_config = from_mapping(ModelConfig, {**payload["model_config"], "dropout": 0.0})  # (sections too: model.moe)
    model = TransformerLM(model_config, payload["vocab_size"])
    model.load_state_dict(payload["model"])
    return model.eval(), {"seq_len": payload["seq_len"], "step": payload["step"], "sha256": digest}


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalelm.train.consolidate", description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, help="model file to write (default: model.pt in the run directory)")
    args = parser.parse_args(argv)
    print(consolidated(consolidate(RunDir(args.run_dir), args.out)))


def consolidated(meta: dict[str, Any]) -> str:
    """What `consolidate` made, in a line."""
    return (
        f"consolidated step {meta['step']} of {meta['checkpoint']} into {meta['model']} (sha256 {meta['sha256'][:12]})"
    )


if __name__ == "__main__":
    main()
