"""Fixed-length windows over a token stream: shuffled training batches split across ranks, and exact evaluation.

Training: window i covers tokens [i*stride, i*stride + seq_len] (inputs and their next-token targets). Every epoch
draws one permutation of the windows from (seed, epoch) alone, identical on all ranks; optimizer step s takes the
global batch perm[s*G:(s+1)*G], and rank r its contiguous share. The order is therefore a pure function of
(seed, epoch, step), which is all a checkpoint needs to resume mid-epoch. The incomplete last global batch is dropped.

Evaluation: the split is read with an <eos> in front (the split starts at a line boundary), cut into consecutive
windows of seq_len targets, the last one partial; windows are divided into contiguous blocks per rank, and every
rank yields the same number of batches (missing rows are padding with target -100), because sharded models
need every rank in every forward. Each token of the split is thus predicted, and counted, exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from scalelm import seeds
from scalelm.data.vocab import EOS_ID
from scalelm.errors import DataError
from scalelm.model.loss import IGNORE_INDEX


def num_windows(n_tokens: int, seq_len: int, stride: int) -> int:
    return max(0, (n_tokens - seq_len - 1) // stride + 1)


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seeds.epoch_order(seed, epoch))
    return torch.randperm(n, generator=generator)


@dataclass
class TrainBatches:
    tokens: torch.Tensor
    seq_len: int
    stride: int
    global_batch: int  # sequences per optimizer step, all ranks together
    micro_batch: int  # sequences per forward/backward on one data-parallel rank
    rank: int  # data-parallel rank (the ranks of a tensor-parallel group share their batches)
    world_size: int  # data-parallel ranks
    seed: int

    def __post_init__(self) -> None:
        # the batch splits evenly over the ranks and micro-batches: scalelm.config.BatchConfig.sizes
        self.windows = num_windows(self.tokens.numel(), self.seq_len, self.stride)
        if self.steps_per_epoch == 0:
            raise DataError(
                f"the train split ({self.tokens.numel():,} tokens, {self.windows:,} windows of "
                f"{self.seq_len}) is too small for one global batch of {self.global_batch}; lower batch.size"
            )
        self._offsets = torch.arange(self.seq_len + 1, device=self.tokens.device)

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.world_size

    @property
    def accumulation(self) -> int:
        return self.per_rank // self.micro_batch

    @property
    def steps_per_epoch(self) -> int:
        return self.windows // self.global_batch

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Yields, for each optimizer step from start_step on, this rank's micro-batches (inputs, targets)."""
        perm = epoch_permutation(self.windows, self.seed, epoch).to(self.tokens.device)
        for step in range(start_step, self.steps_per_epoch):
            first = step * self.global_batch + self.rank * self.per_rank
            starts = perm[first : first + self.per_rank] * self.stride
            rows = self.tokens[starts[:, None] + self._offsets].long()
            yield [(chunk[:, :-1], chunk[:, 1:]) for chunk in rows.split(self.micro_batch)]

    def from_position(self, epoch: int, step_in_epoch: int) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Every step's micro-batches from this position on, epoch after epoch, without end (the caller stops)."""
        while True:
            yield from self.epoch(epoch, step_in_epoch)
            epoch, step_in_epoch = epoch + 1, 0


@dataclass
class EvalBatches:
    tokens: torch.Tensor
    seq_len: int
    batch_size: int
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if self.tokens.numel() == 0:
            raise DataError("cannot evaluate an empty split")
        n = self.tokens.numel()
        self.n_windows = -(-n // self.seq_len)
        bounds = [r * self.n_windows // self.world_size for r in range(self.world_size + 1)]
        self.first, self.last = bounds[self.rank], bounds[self.rank + 1]
        largest = max(hi - lo for lo, hi in zip(bounds, bounds[1:]))
        self.num_batches = max(1, -(-largest // self.batch_size))

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n, L = self.tokens.numel(), self.seq_len
        # inputs[j] = stream[j] with stream = [<eos>] + tokens; targets[j] = tokens[j]
        inputs = torch.full((self.n_windows * L,), EOS_ID, dtype=torch.long)
        inputs[0] = EOS_ID
        inputs[1:n] = self.tokens[: n - 1].long()
        targets = torch.full((self.n_windows * L,), IGNORE_INDEX, dtype=torch.long)
        targets[:n] = self.tokens.long()
        inputs, targets = inputs.view(-1, L), targets.view(-1, L)
        for b in range(self.num_batches):
            lo = min(self.first + b * self.batch_size, self.last)
            hi = min(lo + self.batch_size, self.last)
            if hi > lo:
                yield inputs[lo:hi], targets[lo:hi]
            else:  # this rank has run out of windows: a padding row keeps it in step with the others
                yield torch.full((1, L), EOS_ID), torch.full((1, L), IGNORE_INDEX)
