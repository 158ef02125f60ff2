"""The summary's figures, in one place: every column of summary.csv (one row per run), whether an experiment's seeds
share it or are summarised by it (mean, sample standard deviation, min and max in summary_by_experiment.csv), and the
bound an `expect:` may set on its mean (a key `min_<figure>` or `max_<figure>`). A new figure is one line here and
its value in `aggregate.read_run`; the tables, the statistics, the expectations and the workflow's schema follow
(tests/test_study.py checks the schema against LIMITS)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from scalelm.train.record import RunRecord


@dataclass(frozen=True)
class Figure:
    name: str
    seeds: Literal["shared", "spread"] | None = None  # in summary_by_experiment.csv: as is, or its spread
    expect: Literal["min", "max"] | None = None  # the bound an `expect:` may set on the mean


FIGURES = (
    Figure("experiment", "shared"),
    Figure("strategy", "shared"),
    Figure("layout", "shared"),  # dp_replicate x dp_shard x tp x pp (x cp where > 1)
    Figure("seed"),
    Figure("nodes", "shared"),
    Figure("procs_per_node", "shared"),
    Figure("world_size", "shared"),
    Figure("global_batch_sequences", "shared"),
    Figure("global_batch_tokens", "shared"),
    Figure("scaling", "shared"),  # strong: the global batch fixed; weak: the per-device batch fixed
    Figure("steps"),
    Figure("wall_time_s"),
    Figure("train_time_s"),
    Figure("staging_s"),  # copying the data to memory or node-local disk first (scalelm.data.stage), not training
    # steady state after warm-up (report.timing), against the baseline (report.scaling)
    Figure("warmup_steps"),
    Figure("steady_intervals"),
    Figure("tokens_per_s", "spread"),
    Figure("tokens_per_s_per_device", "spread", "min"),
    Figure("step_time_s", "spread", "max"),
    Figure("step_time_s_min"),
    Figure("step_time_s_max"),
    # what the step-time model (scalelm.plan.steptime) gives the layout with the machine's baseline (report.steptime)
    Figure("planned_step_time_s", "shared"),
    Figure("planned_compute_s", "shared"),
    Figure("planned_comm_s", "shared"),
    Figure("planned_bubble_s", "shared"),
    Figure("baseline", "shared"),
    Figure("speedup", "spread"),
    Figure("scaling_efficiency", "spread", "min"),
    Figure("mfu", "spread", "min"),
    Figure("comm_share", "spread"),  # the profiled steps' share with a collective running (train.comm)
    Figure("straggler"),  # the rank the others waited for, if one stands out (report.timing)
    Figure("data_share", "spread", "max"),  # the steady intervals' host time producing batches, their median share
    # pipelines (report.bubble): schedule, micro-batches, the bubble's share of a step
    Figure("pp_schedule"),
    Figure("pp_microbatches"),
    Figure("bubble_predicted"),
    Figure("bubble_measured"),
    # memory: measured beside what scalelm.plan predicts for the layout (state exact; peak an upper estimate)
    Figure("state_mb_per_rank", "spread", "max"),
    Figure("planned_state_mb_per_rank", "shared"),
    Figure("peak_mem_mb_per_rank", "spread", "max"),
    Figure("planned_peak_mb_per_rank", "shared"),
    Figure("peak_mem_mb_per_pp_rank"),
    Figure("peak_reserved_mb_per_rank"),
    # utilisation and isolation
    Figure("util_mean_percent"),
    Figure("util_min_percent"),
    Figure("monitor_cpu_percent"),
    Figure("other_cpu_cores"),
    Figure("overlapped_by"),
    # energy in training steps, every attempt's (scalelm.measure.energy): empty where it could not be read
    Figure("energy_j", "spread"),
    Figure("joules_per_token", "spread", "max"),
    # results
    Figure("final_train_loss"),
    Figure("validation_loss"),
    Figure("test_loss", "spread", "max"),
    Figure("test_perplexity", "spread", "max"),
    Figure("checkpoint"),
    Figure("sha256"),
)

COLUMNS = [figure.name for figure in FIGURES]  # summary.csv
SHARED = tuple(figure.name for figure in FIGURES if figure.seeds == "shared")
STATISTICS = tuple(figure.name for figure in FIGURES if figure.seeds == "spread")
LIMITS = tuple(f"{figure.expect}_{figure.name}" for figure in FIGURES if figure.expect)


@dataclass
class RunSummary:
    """One run as the report reads it: its row of summary.csv (`figures`, keyed by COLUMNS), and what the plots
    draw besides: its metrics lines, its run record, each device's utilisation samples (time, percent)."""

    figures: dict[str, Any]
    metrics: list[dict[str, Any]] = field(default_factory=list)
    record: RunRecord | None = None
    utilisation: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    identity: dict[str, Any] = field(default_factory=dict)  # identity.json: what determines the trained model
    vocab_size: int | None = None  # the consolidated model's

    @property
    def label(self) -> str:
        return f"{self.figures['experiment']} {self.figures['layout']} (seed {self.figures['seed']})"
