"""Exact evaluation: every token of a split is predicted and counted once, whatever the world size."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scalelm.data import EvalBatches
from scalelm.data.windows import IGNORE_INDEX
from scalelm.parallel.env import DistEnv, is_distributed
from scalelm.train.metrics import perplexity
from scalelm.train.preemption import StopRequested


@torch.no_grad()
def evaluate(
    model: nn.Module,
    tokens: torch.Tensor,
    seq_len: int,
    batch_size: int,
    env: DistEnv,
    autocast=contextlib.nullcontext,
    should_stop: Callable[[], bool] | None = None,
) -> dict[str, float]:
    """Mean loss, perplexity and token count over `tokens`. `should_stop` (a collective: every rank runs the same
    number of batches) is asked between batches; when it says yes, StopRequested is raised on every rank."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=env.device)  # loss sum, token count
    try:
        for inputs, targets in EvalBatches(tokens, seq_len, batch_size, env.rank, env.world_size):
            if should_stop is not None and should_stop():
                raise StopRequested("stop signal during evaluation")
            inputs, targets = inputs.to(env.device), targets.to(env.device)
            with autocast():
                logits = model(inputs)
            loss = F.cross_entropy(
                logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
            totals[0] += loss.double()
            totals[1] += (targets != IGNORE_INDEX).sum()
    finally:
        model.train(was_training)
    if is_distributed():
        dist.all_reduce(totals)
    loss = (totals[0] / totals[1]).item()
    return {"loss": loss, "perplexity": perplexity(loss), "tokens": int(totals[1].item())}
