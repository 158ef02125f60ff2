"""The summary's figures, in one place: every column of summary.csv (one row per run), whether an experiment's seeds
share it or are summarised by it (mean, sample standard deviation, min and max in summary_by_experiment.csv), and the
bound an `expect:` may set on its mean (a key `min_<figure>` or `max_<figure>`), and whether it is a figure of time,
which other work on a run's hosts disturbs (scalelm.report.disturbance). A new figure is one line here and
its value in `aggregate.run_figures`; the tables, the statistics, the expectations and the workflow's schema follow
(tests/test_study.py checks the schema against LIMITS)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from scalelm.train.record import RunRecord


@dataclass(frozen=True)
class Figure:
    name: str
    seeds: Literal["shared", "spread"] | None = None  # in summary_by_experiment.csv: as is, or its spread
    expect: Literal["min", "max"] | None = None  # the bound an `expect:` may set on the mean
    timed: bool = False  # measured by the clock: other work beside the run changes it


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
    Figure("experts", "shared"),  # the number of a mixture's experts (in each of its layers); empty for a dense model
    # the model's parameters in all and those one token uses (a mixture's: its router and top_k experts)
    Figure("params_total", "shared"),
    Figure("params_active", "shared"),
    Figure("steps"),
    Figure("wall_time_s", timed=True),
    Figure("train_time_s", timed=True),
    # copying the data to memory or node-local disk first (scalelm.data.stage), not training
    Figure("staging_s", timed=True),
    # steady state after warm-up (report.timing), against the baseline (report.scaling)
    Figure("warmup_steps"),
    Figure("steady_intervals"),
    Figure("tokens_per_s", "spread", timed=True),
    Figure("tokens_per_s_per_device", "spread", "min", timed=True),
    Figure("step_time_s", "spread", "max", timed=True),
    Figure("step_time_s_min", timed=True),
    Figure("step_time_s_max", timed=True),
    # what the step-time model (scalelm.plan.steptime) gives the layout with the machine's baseline (report.steptime)
    Figure("planned_step_time_s", "shared"),
    Figure("planned_compute_s", "shared"),
    Figure("planned_comm_s", "shared"),
    Figure("planned_bubble_s", "shared"),
    Figure("planned_all_to_all_s", "shared"),  # expert parallelism's all-to-alls among planned_comm_s
    Figure("planned_step_time_s_min", "shared"),  # planned at the fast end of the baseline's spread
    Figure("planned_step_time_s_max", "shared"),  # ... at its slow end
    Figure("steptime_blame"),  # a step beyond the model's goal: the plan's part furthest from the profiled steps
    Figure("machine_disturbed"),  # why the machine's baseline the plan used was disturbed (report.disturbance)
    Figure("baseline", "shared"),
    Figure("speedup", "spread", timed=True),
    Figure("scaling_efficiency", "spread", "min", timed=True),
    Figure("scaling_flag"),  # a disturbed baseline run, an implausible efficiency (report.disturbance)
    # model FLOPs utilisation of the steady state: attention over the whole sequence (scalelm's and torchtitan's
    # count), and causal attention at half (llm.c's), over one device's peak (scalelm.measure.peak)
    Figure("mfu", "spread", "min", timed=True),
    Figure("mfu_causal", "spread", timed=True),
    Figure("peak_tflops"),
    Figure("comm_share", "spread", timed=True),  # the profiled steps' share with a collective running (train.comm)
    Figure("all_to_all_share", "spread", timed=True),  # ... with an all-to-all running (expert parallelism's)
    Figure("straggler"),  # the rank the others waited for, if one stands out (report.timing)
    # the steady intervals' host time producing batches, their median share
    Figure("data_share", "spread", "max", timed=True),
    # pipelines (report.bubble): schedule, micro-batches, the bubble's share of a step
    Figure("pp_schedule"),
    Figure("pp_microbatches"),
    Figure("bubble_predicted"),
    Figure("bubble_measured", timed=True),
    # memory: measured beside what scalelm.plan predicts for the layout (state exact; peak an upper estimate)
    Figure("state_mb_per_rank", "spread", "max"),
    Figure("planned_state_mb_per_rank", "shared"),
    Figure("peak_mem_mb_per_rank", "spread", "max"),
    Figure("planned_peak_mb_per_rank", "shared"),
    Figure("peak_mem_mb_per_pp_rank"),
    Figure("peak_reserved_mb_per_rank"),
    # utilisation and isolation
    Figure("util_mean_percent", timed=True),
    Figure("util_min_percent", timed=True),
    Figure("monitor_cpu_percent"),
    Figure("other_cpu_cores"),
    Figure("overlapped_by"),
    Figure("disturbed"),  # why other work on its hosts disturbed the run's timing, or empty (report.disturbance)
    # energy in training steps, every attempt's (scalelm.measure.energy): empty where it could not be read
    Figure("energy_j", "spread", timed=True),
    Figure("joules_per_token", "spread", "max", timed=True),
    # a mixture's experts (scalelm.measure.experts): empty for a dense model
    Figure("expert_load_max_over_mean", "spread"),  # tokens per expert, max / mean of the worst layer, over the run
    Figure("max_vio_end", "spread"),  # the worst layer's max / mean less 1 over the last logged interval
    Figure("aux_loss", "spread"),  # the load-balancing loss of the last logged interval
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
TIMED = frozenset(figure.name for figure in FIGURES if figure.timed)
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


def finite_number(value: Any) -> bool:
    """A figure's value that can be compared and averaged: an int or float (not a bool), neither NaN nor infinite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
