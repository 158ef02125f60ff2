"""Exact evaluation: every token of a split is predicted and counted once, whatever the world size.

    python -m scalelm.evaluate --model results/ddp/seed1/model.pt --data data/prepared --split test --out eval.json

The command form runs one process on a consolidated model, so every strategy is scored by the same code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scalelm.data import EvalBatches, load_prepared
from scalelm.data.windows import IGNORE_INDEX
from scalelm.errors import friendly_errors
from scalelm.metrics import perplexity
from scalelm.parallel.env import DistEnv


@torch.no_grad()
def evaluate(
    model: nn.Module,
    tokens: torch.Tensor,
    seq_len: int,
    batch_size: int,
    env: DistEnv,
    autocast=contextlib.nullcontext,
) -> dict[str, float]:
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=env.device)  # loss sum, token count
    for inputs, targets in EvalBatches(tokens, seq_len, batch_size, env.rank, env.world_size):
        inputs, targets = inputs.to(env.device), targets.to(env.device)
        with autocast():
            logits = model(inputs)
        loss = F.cross_entropy(
            logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        totals[0] += loss.double()
        totals[1] += (targets != IGNORE_INDEX).sum()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
    model.train(was_training)
    loss = (totals[0] / totals[1]).item()
    return {"loss": loss, "perplexity": perplexity(loss), "tokens": int(totals[1].item())}


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    from scalelm.consolidate import load_consolidated

    parser = argparse.ArgumentParser(prog="python -m scalelm.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="consolidated model file (scalelm.consolidate)")
    parser.add_argument("--data", type=Path, required=True, help="prepared data directory")
    parser.add_argument("--split", default="test", choices=["validation", "test"])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    model, meta = load_consolidated(args.model)
    data = load_prepared(args.data)
    if data.vocab_size != model.vocab_size:
        from scalelm.errors import DataError

        raise DataError(
            f"{args.model} has a vocabulary of {model.vocab_size:,} but {args.data} has {data.vocab_size:,}: "
            "evaluate with the prepared data the model was trained on"
        )
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    result = evaluate(model, data.splits[args.split], meta["seq_len"], args.batch_size, env)
    result.update(split=args.split, model=str(args.model), model_sha256=meta["sha256"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.split}: loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}, {result['tokens']:,} tokens")


if __name__ == "__main__":
    main()
