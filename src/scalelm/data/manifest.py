"""The prepared data's manifest (what `scalelm.data.prepare` wrote: splits, vocabulary size, checksums), read
without torch: the planner and the workflow need the vocabulary size, not the tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scalelm.errors import DataError

SPLITS = ("train", "validation", "test")
MANIFEST = "manifest.json"
FILES = {"vocab": "vocab.txt", **{split: f"{split}.pt" for split in SPLITS}}  # the data's files beside the manifest


def recorded_checksums(manifest: dict[str, Any]) -> dict[str, str | None]:
    """The sha256 the manifest records for each of FILES, by name (None where an older manifest has none)."""
    splits = manifest.get("splits", {})
    return {"vocab": manifest.get("vocab_sha256"), **{split: splits.get(split, {}).get("sha256") for split in SPLITS}}


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of the prepared data in `directory`; a missing or damaged one is named, with what to do."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise DataError(
            f"prepared data not found: {path} does not exist. Prepare it once on the login node "
            f"(`snakemake prepare`, or `python -m scalelm.data.prefetch --out RAW` then "
            f"`python -m scalelm.data.prepare --raw RAW --out {directory}`); compute nodes have no internet."
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        vocab_size = manifest["vocab_size"]
        if not isinstance(vocab_size, int) or vocab_size <= 0 or not all(s in manifest["splits"] for s in SPLITS):
            raise ValueError("no positive vocab_size or a split missing")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path} is not a readable manifest ({err}); run the prepare step again") from None
    return manifest
