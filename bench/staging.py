"""What data staging (`data.stage`, scalelm.data.stage) costs a training before its first step: the prepared data of
WikiText-2's size (random token ids in its split sizes and vocabulary) copied and checked against the manifest into
memory (/dev/shm) and onto local disk, each alone and several times, through the trainer's own `staged`.

    python bench/staging.py [--repeats 5] [--local-dir /tmp] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from argtypes import count, output_dir, output_file
from scalelm.data.prepared import write_prepared
from scalelm.data.stage import staged
from scalelm.parallel.env import DistEnv

SPLIT_TOKENS = {"train": 2_088_628, "validation": 217_646, "test": 245_569}  # WikiText-2's, with <eos>
VOCAB = 33_278


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=count(1), default=5)
    parser.add_argument(
        "--local-dir", type=output_dir, default="/tmp", help="the node-local disk to stage to (default /tmp)"
    )
    parser.add_argument("--json", type=output_file)
    args = parser.parse_args(argv)
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "prepared"
        source.mkdir()
        generator = torch.Generator().manual_seed(0)
        tokens = {split: torch.randint(0, VOCAB, (n,), generator=generator) for split, n in SPLIT_TOKENS.items()}
        write_prepared(source, tokens, [f"w{i}" for i in range(VOCAB)], {"benchmark": "random"})
        for mode, where in (("shm", None), ("local", args.local_dir)):
            seconds = []
            for _ in range(args.repeats):
                with staged(source, mode, where, env, tmp) as staging:
                    seconds.append(staging.seconds)
                    size = staging.bytes
            median = statistics.median(seconds)
            rows.append(
                {
                    "mode": mode,
                    "dir": str(staging.path.parent),
                    "mib": size / 2**20,
                    "seconds": median,
                    "min_s": min(seconds),
                    "max_s": max(seconds),
                    "mib_per_s": size / 2**20 / median,
                }
            )
            print(
                f"{mode:<6} {rows[-1]['dir']:<10} {rows[-1]['mib']:.1f} MiB: median {median * 1e3:.1f} ms "
                f"({min(seconds) * 1e3:.1f}-{max(seconds) * 1e3:.1f}), {rows[-1]['mib_per_s']:.0f} MiB/s "
                "copied and checked",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
