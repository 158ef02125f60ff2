"""Turn a run's final checkpoint (one file or a sharded DCP directory) into one plain state dict file.

    python -m scalelm.consolidate --run-dir results/runs/fsdp/seed1 --out results/runs/fsdp/seed1/model.pt

Writes the model file and, beside it, `<out>.json` with its sha256, the checkpoint and step it came from.
Runs in one process: DCP reshards the checkpoint of N ranks on load.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from scalelm.checkpoint import complete_checkpoints, load_weights, read_trainer_state
from scalelm.config import ModelConfig, load_config
from scalelm.errors import CheckpointError, friendly_errors
from scalelm.model import TransformerLM
from scalelm.provenance import sha256
from scalelm.serialization import load_tensors


def consolidate(run_dir: Path, out: Path) -> dict[str, Any]:
    found = complete_checkpoints(run_dir / "checkpoints")
    if not found:
        raise CheckpointError(f"no complete checkpoint in {run_dir / 'checkpoints'}: train the run first")
    checkpoint = found[-1]
    config = load_config(run_dir / "config.yaml")
    state = read_trainer_state(checkpoint)
    model = TransformerLM(config.model, state.model_shape["vocab_size"])
    load_weights(checkpoint, model)
    payload = {
        "model": model.state_dict(),
        "model_config": config.to_dict()["model"],
        "vocab_size": model.vocab_size,
        "seq_len": config.data.seq_len,
        "step": state.step,
    }
    partial = out.with_name(out.name + ".partial")
    torch.save(payload, partial)
    partial.rename(out)
    meta = {"model": str(out), "sha256": sha256(out), "checkpoint": str(checkpoint), "step": state.step}
    Path(f"{out}.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def load_consolidated(path: Path) -> tuple[TransformerLM, dict[str, Any]]:
    if not Path(path).is_file():
        raise CheckpointError(f"consolidated model {path} does not exist: run the consolidate step first")
    payload = load_tensors(path, map_location="cpu")
    model = TransformerLM(ModelConfig(**{**payload["model_config"], "dropout": 0.0}), payload["vocab_size"])
    model.load_state_dict(payload["model"])
    return model.eval(), {"seq_len": payload["seq_len"], "step": payload["step"], "sha256": sha256(Path(path))}


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalelm.consolidate", description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    meta = consolidate(args.run_dir, args.out)
    print(f"consolidated step {meta['step']} of {meta['checkpoint']} into {args.out} (sha256 {meta['sha256'][:12]})")


if __name__ == "__main__":
    main()
