"""Score a consolidated model on a split with the exact evaluation, in one process: every layout, the same code.

    python -m scalelm.study.evaluate --model results/runs/ddp/seed1/model.pt --data data/prepared --split test \
        --out results/runs/ddp/seed1/test.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from scalelm.data.prepared import load_prepared
from scalelm.errors import DataError, friendly_errors
from scalelm.files import atomic_write_text
from scalelm.study.consolidate import load_consolidated
from scalelm.train.evaluation import evaluate


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalelm.study.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="consolidated model file (scalelm.study.consolidate)")
    parser.add_argument("--data", type=Path, required=True, help="prepared data directory")
    parser.add_argument("--split", default="test", choices=["validation", "test"])
    parser.add_argument("--batch-size", type=int, default=256, help="sequences per batch (default: %(default)s)")
    parser.add_argument("--batch-tokens", type=int, default=16384, help="at most this many tokens per batch")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    model, meta = load_consolidated(args.model)
    data = load_prepared(args.data)
    if data.vocab_size != model.vocab_size:
        raise DataError(
            f"{args.model} has a vocabulary of {model.vocab_size:,} but {args.data} has {data.vocab_size:,}: "
            "evaluate with the prepared data the model was trained on"
        )
    split = data.splits[args.split]
    result = evaluate(model, split, meta["seq_len"], args.batch_size, torch.device("cpu"), max_tokens=args.batch_tokens)
    result.update(split=args.split, model=str(args.model), model_sha256=meta["sha256"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")
    print(
        f"{args.split}: loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}, {result['tokens']:,} tokens"
    )


if __name__ == "__main__":
    main()
