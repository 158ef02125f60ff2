"""Exact evaluation: every token of a split is predicted and counted once, whatever the layout. The trainer calls
`evaluate` on its validation and test splits; the workflow scores every consolidated model the same way, in one
process, on the test split, consolidating the run's final checkpoint into that model first (`--consolidate`: one
job and one process per run, scalelm.train.consolidate):

    python -m scalelm.train.evaluation --consolidate results/runs/ddp/seed1 --model results/runs/ddp/seed1/model.pt \
        --data data/prepared --split test --out results/runs/ddp/seed1/test.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from scalelm.data.prepared import PreparedData, load_prepared
from scalelm.data.windows import EvalBatches
from scalelm.errors import DataError, friendly_errors
from scalelm.files import atomic_write_text, check_apart, check_file_output
from scalelm.model.dtensors import local_shard
from scalelm.model.loss import IGNORE_INDEX, lm_loss
from scalelm.train.consolidate import check_out, consolidate, consolidated, load_consolidated, model_source
from scalelm.train.metrics import perplexity
from scalelm.train.preemption import StopRequested
from scalelm.train.rundir import RunDir, check_run_output

if TYPE_CHECKING:
    from scalelm.config import TrainConfig
    from scalelm.parallel.runtime import Parallel


def eval_rows(batch_size: int, seq_len: int, max_tokens: int | None) -> int:
    """Sequences per evaluation batch: `batch_size`, fewer where they would exceed `max_tokens` (at least one)."""
    return batch_size if max_tokens is None else max(1, min(batch_size, max_tokens // seq_len))


# Compiled blocks (and CUDA's compiled head) run their eager code here: grad mode and the training flag are guards of
# the graphs the training compiled, so a compiled evaluation would compile every block and the head again, and once
# more for a shorter last batch (dynamic shapes): 15-40 s of a GPU run's start-up for splits that take seconds eagerly.
@torch.no_grad()
@torch.compiler.set_stance("force_eager")
def evaluate(
    model: nn.Module,
    tokens: torch.Tensor,
    seq_len: int,
    batch_size: int,
    device: torch.device,
    parallel: Parallel | None = None,
    should_stop: Callable[[], bool] | None = None,
    max_tokens: int | None = None,
) -> dict[str, float]:
    """Mean loss, perplexity and token count over `tokens`, in one process or across the data-parallel ranks of
    `parallel` (the ranks of a tensor-parallel group score the same windows together, those of a context-parallel
    group each its part of every window), `batch_size` sequences at a time, or fewer where they would hold more than
    `max_tokens` tokens (the logits of a batch are tokens x vocabulary). `should_stop` (a collective: every rank runs
    the same number of batches) is asked between batches; when it says yes, StopRequested is raised on every rank."""
    batch_size = eval_rows(batch_size, seq_len, max_tokens)
    rank, ranks = (parallel.dp_rank, parallel.dims.dp_size) if parallel else (0, 1)
    forward = (lambda inputs: parallel.forward(model, inputs)) if parallel else model
    loss_context = parallel.loss_context if parallel else contextlib.nullcontext
    part = parallel.sequence_part if parallel else (lambda tokens: tokens)  # of each sequence: context parallelism
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, token count
    try:
        for inputs, targets in EvalBatches(tokens, seq_len, batch_size, rank, ranks):
            if should_stop is not None and should_stop():
                raise StopRequested("stop signal during evaluation")
            inputs, targets = inputs.to(device), part(targets.to(device))
            logits = forward(inputs)
            if logits is None:  # a pipeline stage before the last: it handed its activations on
                continue
            with loss_context():  # logits split by vocabulary (loss parallel): the loss without gathering them
                loss = lm_loss(logits, targets, reduction="sum")
            totals[0] += local_shard(loss).double()  # vocabulary-split logits: a DTensor
            totals[1] += (targets != IGNORE_INDEX).sum()
    finally:
        model.train(was_training)
    if parallel is not None:
        parallel.reduce_eval(totals)
    loss = (totals[0] / totals[1]).item()
    return {"loss": loss, "perplexity": perplexity(loss), "tokens": int(totals[1].item())}


class Validator:
    """A training's exact evaluation of its splits (`evaluate`, on every rank) and when validation is due: every
    `train.eval_every` steps, at each epoch's end and at the last step."""

    def __init__(
        self,
        model: nn.Module,
        data: PreparedData,
        train: TrainConfig,
        seq_len: int,
        device: torch.device,
        parallel: Parallel,
        should_stop: Callable[[], bool],
        total_steps: int,
    ):
        self.model, self.data, self.train, self.seq_len = model, data, train, seq_len
        self.device, self.parallel, self.should_stop, self.total_steps = device, parallel, should_stop, total_steps

    def due(self, step: int, epoch_ended: bool) -> bool:
        every = self.train.eval_every
        return step == self.total_steps or epoch_ended or bool(every) and step % every == 0

    def evaluate(self, split: str) -> dict[str, float]:
        return evaluate(
            self.model,
            self.data.splits[split],
            self.seq_len,
            self.train.eval_batch_size,
            self.device,
            self.parallel,
            should_stop=self.should_stop,
            max_tokens=self.train.eval_batch_tokens,
        )


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m scalelm.train.evaluation",
        description="Score a consolidated model on a split with the exact evaluation, in one process.",
    )
    parser.add_argument("--model", type=Path, required=True, help="consolidated model file (scalelm.train.consolidate)")
    parser.add_argument(
        "--consolidate", type=Path, metavar="RUN_DIR", help="make --model from this run's checkpoint first"
    )
    parser.add_argument("--data", type=Path, required=True, help="prepared data directory")
    parser.add_argument("--split", default="test", choices=["validation", "test"])
    parser.add_argument("--batch-size", type=int, default=256, help="sequences per batch (default: %(default)s)")
    parser.add_argument("--batch-tokens", type=int, default=16384, help="at most this many tokens per batch")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    for option, value in (("--batch-size", args.batch_size), ("--batch-tokens", args.batch_tokens)):
        if value < 1:
            parser.error(f"{option} must be 1 or more, got {value}")
    # before any work: every output has somewhere to go and replaces nothing the command reads, nor a run's files
    check_file_output(args.out)
    check_apart(
        args.out, {"--model": args.model, "the model's record": Path(f"{args.model}.json"), "--data": args.data}
    )
    source = RunDir(args.consolidate) if args.consolidate is not None else model_source(args.model)
    if args.consolidate is not None:  # --model is written too
        check_out(source, args.model, "--model")
        for written in (args.model, Path(f"{args.model}.json")):
            check_apart(written, {"--data": args.data}, "--model")
    check_run_output(args.out, "--out", "test_result", source)
    if args.consolidate is not None:
        print(consolidated(consolidate(RunDir(args.consolidate), args.model)))
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
