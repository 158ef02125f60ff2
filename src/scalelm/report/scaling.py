"""How each run scales against the baseline experiment.

Strong scaling holds the global batch fixed (`batch.mode: global`), weak scaling the batch per device
(`batch.mode: per_device`). Both are measured in total tokens per second, where ideal scaling is linear in the
number of devices either way: speedup = a run's tokens/s / the baseline's tokens/s (the baseline run of the same
seed, else the mean of the baseline's seeds), scaling efficiency = speedup / (world size / the baseline's world
size), 1 being ideal. A speedup against a baseline run that other work disturbed, and an efficiency too far above 1
to be real, are flagged (`scaling_flag`: scalelm.report.disturbance), never printed as if they were figures.

The baseline is `baseline:` in the study config; by default the experiment with the fewest devices (the
single-device one), the first by name among several.
"""

from __future__ import annotations

import difflib
import statistics
from typing import Any

from scalelm.errors import ConfigError
from scalelm.report.disturbance import scaling_flag

SCALING = {"global": "strong", "per_device": "weak"}  # batch.mode -> the scaling it measures


def choose_baseline(world_sizes: dict[str, int], named: str | None = None) -> str:
    """The baseline among the experiments (name -> world size): `named`, or the one with the fewest devices."""
    if named is None:
        return min(world_sizes, key=lambda name: (world_sizes[name], name))
    if named not in world_sizes:
        close = difflib.get_close_matches(str(named), world_sizes, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"baseline: {named!r} names no experiment{hint} (experiments: {', '.join(world_sizes)}); set it to one "
            "of them, or leave it out to compare with the experiment with the fewest devices"
        )
    return named


def add_scaling(rows: list[dict[str, Any]], baseline: str) -> None:
    """Set `baseline`, `speedup`, `scaling_efficiency` and `scaling_flag` of every summary row (one per experiment x
    seed)."""
    base = [r for r in rows if r["experiment"] == baseline and r.get("tokens_per_s")]
    by_seed = {r["seed"]: r for r in base}
    for row in rows:
        row["baseline"] = baseline
        row["speedup"] = row["scaling_efficiency"] = None
        row["scaling_flag"] = ""
        if not base or not row.get("tokens_per_s"):
            continue
        compared = [by_seed[row["seed"]]] if row["seed"] in by_seed else base
        tokens = statistics.fmean(r["tokens_per_s"] for r in compared)
        row["speedup"] = row["tokens_per_s"] / tokens
        row["scaling_efficiency"] = row["speedup"] / (row["world_size"] / base[0]["world_size"])
        row["scaling_flag"] = scaling_flag(row, compared)
