"""Build the vocabulary and token ids once; training jobs read only what this writes.

    python -m scalelm.data.prepare --raw data/raw --out data/prepared [--lowercase] [--min-freq 1]

Writes `{train,validation,test}.pt` (int32 token ids), `vocab.txt` (one token per line, id = line number) and
`manifest.json` (source, options, token and <unk> counts, vocabulary size, sha256 of every file):
scalelm.data.prepared.write_prepared.
Words outside the vocabulary become <unk> and every non-blank line ends with <eos>: no word is dropped.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from scalelm.data.manifest import MANIFEST, SPLITS
from scalelm.data.prefetch import SOURCE_FILE
from scalelm.data.prepared import write_prepared
from scalelm.data.vocab import SPECIALS, UNK_ID, build_vocab, words_of
from scalelm.errors import DataError, friendly_errors
from scalelm.files import atomic_path, check_apart, check_replaceable


def offline_hub() -> None:
    """Keep Hugging Face's libraries off the network (unless the environment says otherwise): only the prefetch step
    goes online; the preparation and training run on compute nodes without internet, where a library trying it would
    wait for its retries."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def read_splits(raw: Path) -> dict[str, list[str]]:
    offline_hub()
    import datasets

    if not (raw / "dataset_dict.json").is_file():
        raise DataError(
            f"no prefetched dataset at {raw}: run the prefetch step on a machine with internet first "
            f"(`snakemake prefetch` or `python -m scalelm.data.prefetch --out {raw}`)"
        )
    data = datasets.load_from_disk(str(raw))
    texts = {}
    for split in SPLITS:
        if split not in data:
            raise DataError(f"prefetched dataset {raw} has no {split!r} split; prefetch it again")
        if "text" not in data[split].column_names:
            raise DataError(f"prefetched dataset {raw}, split {split!r}, has no 'text' column")
        texts[split] = data[split]["text"]
    return texts


def prepare(raw: Path, out: Path, lowercase: bool, min_freq: int) -> dict[str, Any]:
    if min_freq < 1:
        raise DataError(f"--min-freq must be at least 1, got {min_freq}")
    check_apart(out, {"--raw": raw})
    check_replaceable(out, MANIFEST, "the prepared data")
    texts = read_splits(raw)
    tokenized = {split: list(words_of(lines, lowercase)) for split, lines in texts.items()}
    for split, lines in tokenized.items():
        if not lines:
            raise DataError(f"split {split!r} of {raw} holds no words: check the source data")
    counts = Counter(word for line in tokenized["train"] for word in line)
    vocab = build_vocab(counts, min_freq)
    if len(vocab) <= len(SPECIALS):
        raise DataError(
            f"--min-freq {min_freq} leaves no word in the vocabulary (only the special tokens "
            f"{', '.join(SPECIALS)}); lower --min-freq"
        )
    ids = {word: i for i, word in enumerate(vocab)}

    source_file = raw / SOURCE_FILE
    source = json.loads(source_file.read_text()) if source_file.is_file() else {"path": str(raw)}
    tokens = {
        split: torch.tensor([ids.get(w, UNK_ID) for line in lines for w in line], dtype=torch.int32)
        for split, lines in tokenized.items()
    }
    options = {"lowercase": lowercase, "min_freq": min_freq}
    line_counts = {split: len(lines) for split, lines in tokenized.items()}
    with atomic_path(out) as partial:
        partial.mkdir(parents=True)
        manifest = write_prepared(partial, tokens, vocab, source, options, line_counts)
    return manifest


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalelm.data.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("--raw", type=Path, required=True, help="output directory of the prefetch step")
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    parser.add_argument("--lowercase", action="store_true", help="lower-case the text before building the vocabulary")
    parser.add_argument("--min-freq", type=int, default=1, help="rarer train words become <unk> (default: %(default)s)")
    args = parser.parse_args(argv)
    manifest = prepare(args.raw, args.out, args.lowercase, args.min_freq)
    counts = ", ".join(f"{s} {i['tokens']:,} tokens ({i['unk']:,} <unk>)" for s, i in manifest["splits"].items())
    print(f"prepared {args.out}: vocabulary {manifest['vocab_size']:,}; {counts}")


if __name__ == "__main__":
    main()
