"""Loading the prepared token ids that every training job reads (never the raw text)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scalelm.errors import DataError
from scalelm.files import load_tensors, sha256

SPLITS = ("train", "validation", "test")
MANIFEST = "manifest.json"


@dataclass
class PreparedData:
    path: Path
    manifest: dict[str, Any]
    splits: dict[str, torch.Tensor]  # int32 token ids, memory-mapped

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    def checksums(self) -> dict[str, str]:
        """sha256 of the vocabulary and of every split: the data's identity, wherever the directory lies."""
        splits = self.manifest.get("splits", {})
        named = {"vocab": self.manifest.get("vocab_sha256")}
        named |= {split: splits.get(split, {}).get("sha256") for split in SPLITS}
        files = {"vocab": "vocab.txt", **{split: f"{split}.pt" for split in SPLITS}}
        return {name: digest or sha256(self.path / files[name]) for name, digest in named.items()}

    def vocab(self) -> list[str]:
        return (self.path / "vocab.txt").read_text(encoding="utf-8").split("\n")[: self.vocab_size]


def load_prepared(path: str | Path) -> PreparedData:
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise DataError(
            f"prepared data not found: {manifest_path} does not exist. Prepare it once on the login node "
            f"(`snakemake prepare`, or `python -m scalelm.data.prefetch --out RAW` then "
            f"`python -m scalelm.data.prepare --raw RAW --out {path}`); compute nodes have no internet."
        )
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    splits = {}
    for name in SPLITS:
        file = path / f"{name}.pt"
        if not file.is_file():
            raise DataError(f"prepared data at {path} is incomplete: {file} is missing; run the prepare step again")
        splits[name] = load_tensors(file, mmap=True)
    return PreparedData(path=path, manifest=manifest, splits=splits)
