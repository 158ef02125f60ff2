"""A mixture of experts' figures (model.moe): its load-balancing loss, and how evenly its experts get the tokens.

Each mixture counts on its rank the rows (token, choice) routed to each expert and its aux loss, once per trained
micro-batch (scalelm.model.moe.MoE.take_load). After each optimizer step `end_step` sets that step's counts aside
(on the rank, no communication); at a log line `take` hands over the interval's steps as one vector, which the
engine sums over every rank in the all-reduce it runs anyway (the loss's), and `interval` reads the sum, step by
step:

    counts      a (MoE layers x experts) block, by block index; the rows of the layers another pipeline stage holds
                are zero on this rank. The ranks of a tensor-parallel group route the same tokens (a mixture stays
                whole under TP, scalelm.parallel.tensor; context parallelism is refused with it), so the sum counts
                each token tp times: divided by tp. The data-parallel ranks' tokens differ: summed, they are the
                global batch's.
    aux         the aux losses' sum and their count (one per micro-batch, MoE layer and holding rank): their ratio is
                the mean over the interval's micro-batches and MoE layers, which the TP copies, counted in both,
                leave as it is

    aux_loss                    the interval's mean aux loss, before its coefficient (1 when balanced)
    expert_load_max_over_mean   a step's tokens per expert, the largest over the mean, of its least balanced layer
                                (1 when even, experts / top_k when the same top_k experts get every token): the
                                mean over the interval's steps (with train.log_every 1, each step's own)
    expert_max_vio_<layer>      each layer's MaxVio (DeepSeek-V3's measure: its max over mean, less 1; 0 when
                                even), the mean over the interval's steps

Over the run `results` keeps the last interval's aux loss and MaxVio per layer (how balanced the run ends), the
steps' load balance averaged, the share of the tokens each expert got, per layer and over all, and the experts'
product (`product`: torch's grouped product, or a product per expert where it does not run): totals kept in the
trainer's state, which its checkpoints hold, so that a resumed run's count what its log lines count (the steps
between a checkpoint and the log line before it are in neither, as for the loss).
A dense model has none of these: `ExpertLoad.of` gives None, and nothing is added to the logs or the reduction.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scalelm.config import ModelConfig
from scalelm.model.moe import MoE, mixtures


def max_over_mean(counts: list[float]) -> float | None:
    """How unevenly `counts` are spread: the largest over the mean (1: even); None without any."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total > 0 else None


def shares(counts: list[float]) -> list[float] | None:
    """Each count's share of their sum; None without any."""
    total = sum(counts)
    return [count / total for count in counts] if total > 0 else None


class ExpertLoad:
    """A model's mixtures as the logs measure them (module docstring); `tp`: the tensor-parallel degree."""

    def __init__(self, local: dict[int, MoE], layers: list[int], experts: int, tp: int, totals: dict[str, Any]):
        self.local, self.layers, self.experts, self.tp = local, layers, experts, tp
        self.steps_taken: list[torch.Tensor] = []  # this rank's counts of each step since the last log line
        # the run's (a checkpointed TrainerState.experts): tokens per expert per layer, the steps' load balance
        # summed, the steps measured, the last interval's aux loss
        totals.setdefault("counts", [[0.0] * experts for _ in layers])
        totals.setdefault("balance_sum", 0.0)
        totals.setdefault("steps", 0)
        totals.setdefault("aux_loss", None)
        totals.setdefault("max_vio", None)  # the last interval's, by layer
        self.totals = totals

    @classmethod
    def of(cls, model: nn.Module, config: ModelConfig, tp: int, totals: dict[str, Any]) -> ExpertLoad | None:
        """The measurements of `model` (this rank's part of it), their run totals kept in `totals` (filled in where
        empty); None for a dense model."""
        if config.moe is None:
            return None
        layers = [i for i in range(config.n_layers) if config.moe.is_moe_block(i)]
        return cls(mixtures(model), layers, config.moe.experts, tp, totals)

    @property
    def size(self) -> int:
        """The length of a step's counts: the same on every rank, whichever layers it holds."""
        return 2 + len(self.layers) * self.experts

    def end_step(self, device: torch.device) -> None:
        """Set this rank's counts of the step just done aside (its mixtures' counters start again):
        [aux sum, aux count, counts by layer and expert]."""
        step = torch.zeros(self.size, device=device)
        counts = step[2:].view(len(self.layers), self.experts)
        for row, layer in enumerate(self.layers):
            if layer in self.local:
                load, aux_sum, aux_count = self.local[layer].take_load()
                counts[row] = load.float()
                step[0] += aux_sum.float()
                step[1] += aux_count
        self.steps_taken.append(step)

    def take(self, device: torch.device) -> torch.Tensor:
        """The steps set aside since the last call, one after the other, to be summed over every rank."""
        taken = torch.cat(self.steps_taken).to(device) if self.steps_taken else torch.zeros(0, device=device)
        self.steps_taken = []
        return taken

    def interval(self, summed: list[float]) -> dict[str, float | None]:
        """The metrics line's figures of an interval, from `take`'s vectors summed over every rank; the run's totals
        take them in."""
        totals, aux_sum, aux_count, balances = self.totals, 0.0, 0.0, []
        violations: list[list[float]] = []  # per step, each layer's max over mean less 1
        for start in range(0, len(summed), self.size):
            step = summed[start : start + self.size]
            aux_sum, aux_count = aux_sum + step[0], aux_count + step[1]
            flat = step[2:]
            per_layer = [
                [c / self.tp for c in flat[i * self.experts : (i + 1) * self.experts]] for i in range(len(self.layers))
            ]
            for total, counts in zip(totals["counts"], per_layer):
                total[:] = [t + c for t, c in zip(total, counts)]
            layer_balances = [max_over_mean(counts) for counts in per_layer]
            present = [b for b in layer_balances if b is not None]
            if present:
                balances.append(max(present))
            if len(present) == len(layer_balances):
                violations.append([b - 1 for b in present])
        totals["balance_sum"] += sum(balances)
        totals["steps"] += len(balances)
        totals["aux_loss"] = aux_sum / aux_count if aux_count else None
        balance = sum(balances) / len(balances) if balances else None
        figures = {"aux_loss": totals["aux_loss"], "expert_load_max_over_mean": balance}
        if violations:
            means = [sum(layer) / len(violations) for layer in zip(*violations)]
            totals["max_vio"] = {str(layer): mean for layer, mean in zip(self.layers, means)}
            figures |= {f"expert_max_vio_{layer}": mean for layer, mean in zip(self.layers, means)}
        return figures

    @property
    def product(self) -> str | None:
        """The experts' product this rank's mixtures ran (scalelm.model.moe.grouped_product's choice): grouped_mm or
        per_expert_loop; None where it holds no mixture or none has run."""
        products = {moe.experts.product for moe in self.local.values()} - {None}
        return ", ".join(sorted(products)) or None

    def results(self) -> dict[str, Any]:
        """run.json's figures of the run's experts (module docstring)."""
        totals = self.totals
        overall = [sum(column) for column in zip(*totals["counts"])]
        steps = totals["steps"]
        return {
            "experts": self.experts,
            "layers": self.layers,
            "aux_loss": totals["aux_loss"],
            "expert_load_max_over_mean": totals["balance_sum"] / steps if steps else None,
            "expert_max_vio_end": totals["max_vio"],  # the last interval's, by layer
            "product": self.product,
            "expert_token_share": shares(overall),
            "expert_token_share_per_layer": {str(i): shares(c) for i, c in zip(self.layers, totals["counts"])},
            "steps": steps,
        }
