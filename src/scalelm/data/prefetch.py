"""Fetch WikiText-2 once, on a machine with internet (the login node), into a local data directory.

    python -m scalelm.data.prefetch --out data/raw                                   # the hub
    python -m scalelm.data.prefetch --out data/raw --files train=a.txt,validation=b.txt,test=c.txt

This is the only code in scalelm that may touch the network. Local text or parquet files with a `text`
column serve mirrors and offline machines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from scalelm.data.manifest import SPLITS
from scalelm.errors import DataError, friendly_errors
from scalelm.files import atomic_path, check_apart, check_replaceable

SOURCE_FILE = "scalelm_source.json"


def parse_files(spec: str) -> dict[str, str]:
    files = {}
    for item in spec.split(","):
        split, sep, path = item.partition("=")
        if not sep or split not in SPLITS:
            raise DataError(f"--files item {item!r} is not SPLIT=PATH with SPLIT one of {', '.join(SPLITS)}")
        if not Path(path).is_file():
            raise DataError(f"--files: {split} file {path} does not exist")
        files[split] = str(Path(path).resolve())
    missing = [s for s in SPLITS if s not in files]
    if missing:
        raise DataError(f"--files lacks the split(s) {', '.join(missing)}; give train=...,validation=...,test=...")
    return files


def fetch(out: Path, dataset: str, name: str | None, files: dict[str, str] | None, file_format: str) -> dict[str, Any]:
    import datasets  # heavy; only this step and prepare need it

    check_apart(out, {f"--files {split}": Path(path) for split, path in (files or {}).items()})
    check_replaceable(out, SOURCE_FILE, "a prefetched dataset")
    if files:
        source = {"format": file_format, "files": files}
        data = datasets.load_dataset(file_format, data_files=files)
    else:
        source = {"dataset": dataset, "name": name}
        data = datasets.load_dataset(dataset, name)
    for split in SPLITS:
        if split not in data:
            raise DataError(f"{source} has no {split!r} split (it has {', '.join(data)})")
        if "text" not in data[split].column_names:
            raise DataError(
                f"{source}: split {split!r} has no 'text' column (columns: {', '.join(data[split].column_names)}); "
                "scalelm needs one line of text per row in a column named 'text'"
            )
    source["rows"] = {split: data[split].num_rows for split in SPLITS}
    with atomic_path(out) as partial:
        data.save_to_disk(str(partial))
        (partial / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
    return source


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalelm.data.prefetch", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write (datasets save_to_disk format)")
    parser.add_argument("--dataset", default="Salesforce/wikitext", help="hub dataset (default: %(default)s)")
    parser.add_argument("--name", default="wikitext-2-raw-v1", help="hub config (default: %(default)s)")
    parser.add_argument("--files", help="local files instead of the hub: train=PATH,validation=PATH,test=PATH")
    parser.add_argument("--format", default="text", choices=["text", "parquet"], help="format of --files")
    args = parser.parse_args(argv)
    files = parse_files(args.files) if args.files else None
    source = fetch(args.out, args.dataset, args.name, files, args.format)
    print(f"prefetched {source['rows']} rows into {args.out}")


if __name__ == "__main__":
    main()
