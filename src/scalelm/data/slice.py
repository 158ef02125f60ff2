"""A prepared data directory cut to the first tokens of each split, with the same vocabulary: the data of the
workflow's wiring check (`snakemake preflight`), a few steps per layout.

    python -m scalelm.data.slice --data results/prepared --out results/preflight/data --tokens 20000
"""

from __future__ import annotations

import argparse
from pathlib import Path

from scalelm.data.manifest import MANIFEST
from scalelm.data.prepared import slice_prepared
from scalelm.errors import ConfigError, friendly_errors
from scalelm.files import check_apart, check_replaceable


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalelm.data.slice", description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="the prepared data directory")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, required=True, help="tokens kept of each split")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        raise ConfigError(f"--tokens must be positive, got {args.tokens}")
    check_apart(args.out, {"--data": args.data})
    check_replaceable(args.out, MANIFEST, "the prepared data")  # a slice is prepared data: prepare's rule
    slice_prepared(args.data, args.out, args.tokens)
    print(f"sliced {args.data} to the first {args.tokens:,} tokens of each split in {args.out}")


if __name__ == "__main__":
    main()
