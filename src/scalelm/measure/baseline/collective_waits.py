"""What a collective costs inside a training step on CPUs: every rank's model step at once with a small all-reduce
after each part of each block, the latency of the last rank to arrive and how far the ranks drift apart between
collectives."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from scalelm.measure.baseline.model_step import model_step
from scalelm.measure.baseline.timing import MODEL_STEP_SAMPLE_S, calls_agreed, per_call, spread, timed

if TYPE_CHECKING:  # torch is imported where the measuring starts: the workflow reads this module without it
    import torch
    import torch.distributed as dist


LATENCY_PROBE_ELEMENTS = 1024  # 4 KiB of fp32: latency, not bandwidth
WAIT_RUNS = 5  # runs of the synchronised step, each about MODEL_STEP_SAMPLE_S: the spread


def collective_waits(
    config, vocab: int, tokens: int, device: torch.device, group: dist.ProcessGroup | None
) -> dict[str, Any]:
    """What a collective costs inside a training step, from every rank's model step for `tokens` tokens at once with
    a 4 KiB all-reduce over `group` (default the job; consecutive ranks) after each part of each block
    with weights (attention, feed-forward, norms), forward and backward, each call timed on every rank. In each
    collective the rank that arrives last waits only for the collective itself: the latency of a collective inside
    a step (`in_step_latency_s`, the mean over a run's collectives), which on a CPU includes waking a rank whose
    core others compute on. The others waited for it as well: between two collectives the ranks drift apart, and
    the step moves at the pace of the last at each (`drift_share`: their mean wait over the run's compute). Each
    figure's median over WAIT_RUNS runs and its spread (min, max)."""
    import torch
    import torch.distributed as dist

    buffer, durations = torch.ones(LATENCY_PROBE_ELEMENTS, device=device), []

    def synchronise(*_: Any) -> None:
        start = time.perf_counter()
        dist.all_reduce(buffer, group=group)
        durations.append(time.perf_counter() - start)

    def prepare(model: torch.nn.Module) -> None:
        for block in model.blocks.values():
            for part in block.children():
                if any(True for _ in part.parameters()):
                    part.register_forward_hook(synchronise)
                    part.register_full_backward_hook(synchronise)

    step = model_step(config, vocab, tokens, device, prepare=prepare)
    agreed = calls_agreed(step, device, MODEL_STEP_SAMPLE_S)  # every rank as many steps: as many collectives
    runs = []
    for _ in range(WAIT_RUNS):
        durations.clear()
        dist.barrier()
        seconds = per_call(step, device, agreed) * agreed
        runs.append([seconds, *durations])
    mine = torch.tensor(runs, dtype=torch.float64, device=device)  # runs x (seconds, each collective's)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    group_size = dist.get_world_size(group)
    latencies, drifts = [], []
    for run in torch.stack(everyone).transpose(0, 1):  # ranks x (seconds, collectives) per run
        calls = run[:, 1:].reshape(-1, group_size, run.shape[1] - 1)  # groups x ranks x collectives
        last = calls.min(dim=1).values  # the last rank to arrive: the collective alone
        waited = (calls.mean(dim=1) - last).sum(dim=1)  # a group's mean rank's wait for the last, over the run
        compute = run[:, 0].reshape(-1, group_size).max(dim=1).values - calls.mean(dim=1).sum(dim=1)
        latencies.append(last.mean().item())
        drifts.append((waited / compute).mean().item())
    return timed("in_step_latency_s", spread(latencies)) | timed("drift_share", spread(drifts))
