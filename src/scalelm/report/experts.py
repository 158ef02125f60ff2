"""Mixture-of-experts runs in the study: the summary's columns of a run's experts (scalelm.measure.experts) and
the section of summary.md that puts them beside the dense layouts.

Every run has its parameters in all and per token (`params_total`, `params_active`: the same for a dense model);
the expert columns are empty for a dense model: the number of experts, the last interval's aux loss, the load
balance (tokens per expert, max over mean, of the least balanced layer, averaged over the run's steps), the worst
layer's MaxVio over the last interval (max over mean less 1: how balanced the run ends), and the share
of the profiled steps with an all-to-all running (expert parallelism's dispatch; 0 for a mixture in one process or
with its experts on every rank).
"""

from __future__ import annotations

from typing import Any

from scalelm.report.tables import fmt, markdown_table
from scalelm.train.record import RunRecord

SECTION_COLUMNS = [
    "experiment",
    "seed",
    "layout",
    "world_size",
    "experts",
    "params_total",
    "params_active",
    "tokens_per_s",
    "comm_share",
    "all_to_all_share",
    "expert_load_max_over_mean",
    "max_vio_end",
    "aux_loss",
    "test_loss",
]


def columns(record: RunRecord) -> dict[str, Any]:
    """The summary's columns of a run's model and experts (module docstring)."""
    results = record.results
    parameters = results.parameters or {}
    moe = (record.config.get("model") or {}).get("moe")
    experts = results.experts or {}
    return {
        "experts": moe["experts"] if moe else None,
        "params_total": parameters.get("total"),
        "params_active": parameters.get("active"),
        "aux_loss": experts.get("aux_loss"),
        "expert_load_max_over_mean": experts.get("expert_load_max_over_mean"),
        "max_vio_end": max(experts["expert_max_vio_end"].values()) if experts.get("expert_max_vio_end") else None,
        "all_to_all_share": (results.comm or {}).get("all_to_all_share") if moe else None,
    }


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The section of summary.md: every run, dense ones beside the mixtures; none without a mixture."""
    if not any(r.get("experts") for r in rows):
        return []
    lines = [
        "",
        "## Mixture of experts",
        "",
        "Every run, the dense ones beside the mixtures: parameters in all and per token, steady tokens/s, the share "
        "of the profiled steps with a collective running and with an all-to-all (expert parallelism's dispatch), "
        "the load balance (tokens per expert, max over mean, of the least balanced layer, over the run: 1 is even), "
        "the least balanced layer's MaxVio at the end (max over mean less 1, over the last logged interval: 0 is "
        "even) and the last interval's load-balancing loss (1 when balanced).",
        "",
    ]
    return lines + markdown_table(SECTION_COLUMNS, [[fmt(r.get(c)) for c in SECTION_COLUMNS] for r in rows])
