"""What the summary's speed figures may be trusted for: steady-state throughput after warm-up, whether a timed
run shared its host with another training or with other work, and which rank, if any, the others waited for.

Steady state: the logging intervals that start after the warm-up steps (default the first 10 percent of the run or
5 steps, whichever is more: allocator growth, caches, first collectives) and ran without the profiler (the last
steps, which time the collectives: scalelm.measure.comm); their median step time, its spread (min and max over the
intervals), and the tokens/s of the median. A run too short to have such an interval is measured on its last
interval, and says so.
"""

from __future__ import annotations

import statistics
from datetime import datetime
from typing import Any

from scalelm.train.record import RunRecord

MIN_WARMUP_STEPS = 5
WARMUP_FRACTION = 0.1


def default_warmup(steps: int) -> int:
    return max(MIN_WARMUP_STEPS, round(steps * WARMUP_FRACTION))


def steady_state(train: list[dict[str, Any]], warmup_steps: int | None = None) -> dict[str, Any]:
    """Median step time, its spread and tokens/s over the intervals of `train` (metrics.jsonl's train records,
    each the mean of the steps since the previous one) that begin after the warm-up."""
    if not train:
        return {}
    steps = train[-1]["step"]
    warmup = default_warmup(steps) if warmup_steps is None else warmup_steps
    intervals, previous = [], 0
    for record in train:
        if previous >= warmup and not record.get("profiled"):
            intervals.append(record)
        previous = record["step"]
    after_warmup = bool(intervals)
    intervals = intervals or train[-1:]
    times = [r["step_time_s"] for r in intervals]
    median = statistics.median(times)
    tokens = train[-1]["tokens_per_step"]
    world = train[-1]["world_size"]
    data = [r["data_share"] for r in intervals if r.get("data_share") is not None]
    return {
        "warmup_steps": warmup,
        "steady_intervals": len(intervals) if after_warmup else 0,  # 0: the run ended within its warm-up
        "step_time_s": median,
        "step_time_s_min": min(times),
        "step_time_s_max": max(times),
        "tokens_per_s": tokens / median,
        "tokens_per_s_per_device": tokens / median / world,
        "data_share": statistics.median(data) if data else None,
    }


def _interval(record: RunRecord) -> tuple[datetime, datetime] | None:
    try:
        return datetime.fromisoformat(record.start_time), datetime.fromisoformat(record.end_time)
    except (TypeError, ValueError):
        return None


def overlapping_runs(records: dict[str, RunRecord]) -> dict[str, list[str]]:
    """For each run (name -> its record), the other runs that trained on one of its machines at the same time (its
    hosts where the record predates machine ids)."""
    spans = {name: (_interval(r), set(r.machines or r.nodes)) for name, r in records.items()}
    found: dict[str, list[str]] = {name: [] for name in records}
    for name, (span, hosts) in spans.items():
        for other, (other_span, other_hosts) in spans.items():
            if other == name or span is None or other_span is None or not hosts & other_hosts:
                continue
            if span[0] < other_span[1] and other_span[0] < span[1]:
                found[name].append(other)
    return found


STRAGGLER_GAP = 0.1  # the others spend this much more of their profiled steps in collectives than the rank


def straggler(comm: dict[str, Any] | None, hostnames: list[str]) -> str:
    """The rank the others wait for, with its host, e.g. `rank 2 (node7)`: in a synchronous job every rank's step
    takes as long as the slowest rank's, but the others spend the difference waiting in collectives, so the rank
    with the smallest share of its profiled steps in collectives (scalelm.measure.comm) is behind, when the others'
    mean share is at least STRAGGLER_GAP above its own. Empty when no rank stands out, or there is no profile."""
    shares = (comm or {}).get("share_per_rank") or []
    if len(shares) < 2:
        return ""
    least = min(range(len(shares)), key=shares.__getitem__)
    others = statistics.fmean(s for rank, s in enumerate(shares) if rank != least)
    if others - shares[least] < STRAGGLER_GAP:
        return ""
    host = f" ({hostnames[least]})" if least < len(hostnames) else ""
    return f"rank {least}{host}"
