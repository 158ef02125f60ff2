"""What the machinery of each layout that one process can run (tensor parallelism's DTensor weights, FSDP's units, a
simulated context-parallel ring, an expert-parallel mixture's dispatch) adds to the model's step, against the plain
step's."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from scalelm.measure.baseline.model_step import model_step
from scalelm.measure.baseline.timing import excess_seconds
from scalelm.plan.steptime import RING_RANKS

if TYPE_CHECKING:  # torch is imported where the measuring starts: the workflow reads this module without it
    import torch


def layout_overheads(config, vocab: int, tokens: int, device: torch.device, mesh, compiled: bool, moe=None) -> dict:
    """What a step of one micro-batch of `tokens` costs more with a layout's machinery, run in this one process, than
    the plain model's (eager), in seconds (0 where it costs less): the median of `excess_seconds` by name in
    `layout_overhead_s`, its (min, max) in `layout_overhead_s_spread`. `tp`, the blocks' weights DTensors on
    `mesh` (this rank alone) as tensor parallelism makes them: DTensor's dispatch, which a tensor-parallel step pays
    whatever its degree (not where training compiles: traced away); `cp`, every attention a RING_RANKS-way ring
    simulated here (scalelm.parallel.context.simulated_ring_attention: a real ring's blocks, kernels and merges,
    every rank's), a rank's share; `ep`, with the mixture `moe` (an expert-parallel experiment's, where the study
    has one) in the blocks, its experts split over `mesh` and their rows sent there (the dispatch's counts, host
    read, permutations and all-to-alls, the experts as DTensors), against the same mixture without; `fsdp`, each
    block and the model FSDP units over `mesh` as training shards them: the hooks, DTensors and copies in and out of
    the gathered weights that a sharded step pays beside its collectives (those over one rank: copies)."""
    import torch

    from scalelm.parallel.data import apply_fsdp
    from scalelm.parallel.expert import apply_ep
    from scalelm.parallel.tensor import apply_tp

    def excess(prepare, settings=config, share: float = 1.0) -> tuple[float, float, float]:
        plain, machinery = (model_step(settings, vocab, tokens, device, prepare=p) for p in (None, prepare))
        return tuple(max(seconds * share, 0.0) for seconds in excess_seconds(plain, machinery, device))

    overheads = {"cp": excess(simulate_ring(config.parallel.cp_load_balance), share=1 / RING_RANKS)}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the compute dtype, as training's FSDP casts
    sharding = config.parallel.reshards(pp=1)
    overheads["fsdp"] = excess(lambda m: apply_fsdp(m, mesh, dtype, sharding, cpu_offload=False))
    if not compiled:
        overheads["tp"] = excess(lambda m: apply_tp(m, mesh, loss_parallel=False, sequence_parallel=False))
    if moe is not None:
        overheads["ep"] = excess(lambda m: apply_ep(m, mesh), with_mixture(config, moe))
    return {
        "layout_overhead_s": {name: median for name, (_, median, _) in sorted(overheads.items())},
        "layout_overhead_s_spread": {name: [low, high] for name, (low, _, high) in sorted(overheads.items())},
    }


def simulate_ring(load_balance: bool) -> Callable[[torch.nn.Module], None]:
    """Makes every attention of a model a RING_RANKS-way ring run in this process."""
    import torch

    from scalelm.parallel.context import simulated_ring_attention

    def ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        seed = torch.randint(2**62, (), dtype=torch.int64) if dropout_p else None  # as RingCore draws it
        return simulated_ring_attention(q, k, v, RING_RANKS, load_balance, dropout_p, seed)

    def prepare(model: torch.nn.Module) -> None:
        for block in model.blocks.values():
            block.attn.core = ring

    return prepare


def with_mixture(config, moe):
    """`config` with the mixture `moe` in its model: the expert-parallel experiment's model whose dispatch is timed."""
    from dataclasses import replace

    return replace(config, model=replace(config.model, moe=moe))
