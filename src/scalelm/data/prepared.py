"""The prepared token ids that every training job reads (never the raw text): written in one layout by
`write_prepared` (scalelm.data.prepare, the self-test and the benchmarks' synthetic data alike), loaded and checked
by `load_prepared`."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scalelm.data.manifest import FILES, MANIFEST, SPLITS, read_manifest, recorded_checksums
from scalelm.data.vocab import SPECIALS, UNK_ID
from scalelm.errors import DataError
from scalelm.files import atomic_path, load_tensors, sha256


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
        recorded = recorded_checksums(self.manifest)
        return {name: digest or sha256(self.path / FILES[name]) for name, digest in recorded.items()}


def write_prepared(
    directory: Path,
    tokens: dict[str, torch.Tensor],
    vocab: list[str],
    source: dict[str, Any],
    options: dict[str, Any] | None = None,
    lines: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Write the token ids of every split (int32), `vocab.txt` (id = line number) and the manifest (source, options,
    token and <unk> counts, vocabulary size, sha256 of every file) into the existing `directory`; return the
    manifest."""
    splits = {}
    for split in SPLITS:
        file = directory / f"{split}.pt"
        torch.save(tokens[split].to(torch.int32), file)
        splits[split] = {"tokens": tokens[split].numel(), "unk": int((tokens[split] == UNK_ID).sum())}
        splits[split] |= {"lines": lines[split]} if lines else {}
        splits[split]["sha256"] = sha256(file)
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    manifest = {
        "format": 1,
        "source": source,
        "options": options or {},
        "vocab_size": len(vocab),
        "specials": list(SPECIALS),
        "vocab_sha256": sha256(directory / "vocab.txt"),
        "splits": splits,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def load_prepared(path: str | Path) -> PreparedData:
    """The prepared data at `path`, each token file checked against the manifest's checksum and the vocabulary's
    range before it is used: a damaged directory is named, with what to do, instead of failing deep in training."""
    path = Path(path)
    manifest = read_manifest(path)
    splits = {}
    for name in SPLITS:
        file = path / f"{name}.pt"
        if not file.is_file():
            raise DataError(f"prepared data at {path} is incomplete: {file} is missing; run the prepare step again")
        expected = manifest["splits"][name].get("sha256")
        if expected is not None and sha256(file) != expected:
            raise DataError(
                f"{file} does not match the checksum in {path / MANIFEST} (truncated or changed since it was "
                "prepared); run the prepare step again"
            )
        splits[name] = load_tensors(file, mmap=True)
        check_tokens(splits[name], int(manifest["vocab_size"]), file)
    return PreparedData(path=path, manifest=manifest, splits=splits)


def slice_prepared(source: Path, out: Path, tokens: int) -> None:
    """A prepared data directory with the first `tokens` ids of each split and the same vocabulary."""
    data = load_prepared(source)
    manifest = data.manifest | {"sliced_from": {"path": str(source), "tokens_per_split": tokens}}
    with atomic_path(out) as partial:
        partial.mkdir(parents=True)
        shutil.copy(source / "vocab.txt", partial / "vocab.txt")
        for split in SPLITS:
            torch.save(data.splits[split][:tokens].clone(), partial / f"{split}.pt")
            manifest["splits"][split] |= {
                "tokens": min(tokens, data.splits[split].numel()),
                "sha256": sha256(partial / f"{split}.pt"),
            }
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def check_tokens(tokens: Any, vocab_size: int, file: Path) -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.is_floating_point():
        raise DataError(f"{file} does not hold a list of token ids; run the prepare step again")
    if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab_size:
        raise DataError(
            f"{file} holds token ids outside the vocabulary of {vocab_size:,} (from {int(tokens.min())} to "
            f"{int(tokens.max())}); run the prepare step again"
        )
