"""The aggregation on hand-made run directories: repeats (mean, std, min, max over seeds), scaling against the
baseline, and expectations met or missed (with expect_strict, the check command fails)."""

from __future__ import annotations

import concurrent.futures
import csv
import json
import math
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from scalelm.errors import ConfigError, DataError
from scalelm.plan.machine import MachineBaseline
from scalelm.report import expectations, history, history_compare, history_store
from scalelm.report.aggregate import ReportOptions, aggregate, check_out_dir, read_run
from scalelm.report.aggregate import main as aggregate_main
from scalelm.report.expectations import Expectation, from_arguments, parse_expectations, to_arguments
from scalelm.report.figures import COLUMNS, RunSummary
from scalelm.report.plots import across_seeds, experts_figure
from scalelm.report.scaling import choose_baseline
from scalelm.train.record import RECORD_FORMAT, RunRecord, write_record
from scalelm.train.rundir import RunDir


def fake_run(
    results,
    experiment,
    seed,
    *,
    world_size=1,
    mode="global",
    step_time=0.1,
    tokens_per_step=512,
    test_loss=5.0,
    peak_mem_mb=100.0,
    hour=10,
    numpy="2.4.6",
    threads="2",
    other_cores=None,
    moe=False,
    study=None,
):
    """A finished run as training, consolidation and evaluation leave it: 20 steps logged every 2, all steps
    `step_time` long, validation at steps 10 and 20; with `other_cores`, its host's load: 2 CPUs, the run's ranks
    busy on 1.9 of them, other work on `other_cores`; with `moe`, a mixture of 4 experts whose load evens out (from
    3 to 1.2 times the mean, tokens per expert), its all-to-all a fifth of the profiled steps."""
    run = RunDir.of(results, experiment, seed)
    run.path.mkdir(parents=True)
    lines = []
    for step in range(2, 21, 2):
        lines.append(
            {
                "kind": "train",
                "step": step,
                "tokens": step * tokens_per_step,
                "time": step * step_time,
                "loss": 8.0 - 0.1 * step - 0.01 * seed,
                "step_time_s": step_time,
                "tokens_per_step": tokens_per_step,
                "world_size": world_size,
                "peak_mem_mb": peak_mem_mb,
            }
        )
        if step % 10 == 0:
            lines.append(
                {
                    "kind": "eval",
                    "split": "validation",
                    "step": step,
                    "time": step * step_time,
                    "loss": 7.0 - 0.1 * step,
                }
            )
    if moe:
        for line in (line for line in lines if line["kind"] == "train"):
            line |= {
                "aux_loss": 1.0 + 0.1 / line["step"],
                "expert_load_max_over_mean": 1.0 + 4.0 / line["step"],
                "expert_max_vio_0": 3.0 / line["step"],
                "expert_max_vio_1": 4.0 / line["step"],
            }
    run.metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run.identity.write_text(json.dumps({"settings": {"seed": seed, "batch": {"mode": mode}}, "world_size": world_size}))
    record = {
        "config": {
            "seed": seed,
            "batch": {"mode": mode},
            "model": {"n_layers": 2, "d_model": 10},
            "data": {"seq_len": 8},
        },
        "world_size": world_size,
        "launch": {"nodes": 1, "procs_per_node": world_size},
        "nodes": [f"{experiment}-{seed}"],  # a host of its own: no overlaps
        "start_time": f"2026-11-25T{hour:02d}:00:00+0000",
        "end_time": f"2026-11-25T{hour:02d}:01:00+0000",
        "wall_time_s": 60.0,
        "versions": {"torch": "2.13.0", "packages": {"numpy": numpy, "torch": "2.13.0"}},
        "environment": {"OMP_NUM_THREADS": threads},
        "hostnames": [f"{experiment}-{seed}"] * world_size,
        "results": {
            "strategy": "single" if world_size == 1 else "ddp",
            "layout": f"{world_size}x1x1x1",
            "global_batch": 16,
            "tokens_per_step": tokens_per_step,
            "steps": 20,
            "train_time_s": 20 * step_time,
            "state_mb_per_rank": {"total": 12.5},
            "plan_mb_per_rank": {"state": 12.5, "total": 20.0},
            "peak_flops_per_device": None,
            "flops_per_token": 6000,
            "final_train_loss": 6.0,
            "validation": {"loss": 5.5},
        },
    }
    if moe:
        record["config"]["model"]["moe"] = {"experts": 4, "top_k": 2}
        record["results"] |= {
            "parameters": {"total": 3000, "active": 2000},
            "experts": {
                "aux_loss": 1.005,
                "expert_load_max_over_mean": 1.5,
                "expert_token_share": [0.25] * 4,
                "expert_max_vio_end": {"0": 0.15, "1": 0.2},
            },
            "comm": {"share": 0.5, "all_to_all_share": 0.2},
        }
    if study:
        record["config"]["study"] = study
    if other_cores is not None:
        record["host_load"] = {
            f"{experiment}-{seed}": {
                "cpus": 2,
                "busy_cores": 1.9 + other_cores,
                "run_cores": 1.9,
                "other_cores": other_cores,
            }
        }
    write_record(run.path, RunRecord.from_dict(record | {"format": RECORD_FORMAT}))
    checkpoint = str(run.checkpoints / "step_00000010")
    run.model_meta.write_text(json.dumps({"model": str(run.model), "sha256": "0" * 64, "checkpoint": checkpoint}))
    run.test_result.write_text(json.dumps({"loss": test_loss, "perplexity": math.exp(test_loss)}))
    return run.path


def read_csv(path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


@pytest.fixture
def two_seeds(tmp_path):
    """`single` (1 device, global batch: strong) and `ddp` (2 devices, batch per device: weak), seeds 1 and 2."""
    return [
        fake_run(tmp_path, "single", 1, step_time=0.1, test_loss=5.0),  # 5120 tokens/s
        fake_run(tmp_path, "single", 2, step_time=0.125, test_loss=5.2),  # 4096 tokens/s
        fake_run(tmp_path, "ddp", 1, world_size=2, mode="per_device", tokens_per_step=1024, peak_mem_mb=90.0),
        fake_run(tmp_path, "ddp", 2, world_size=2, mode="per_device", tokens_per_step=1024, peak_mem_mb=110.0),
    ]  # ddp: 10240 tokens/s, both seeds


def test_two_seeds_give_one_row_per_run_and_mean_std_min_max_per_experiment(tmp_path, two_seeds):
    out = tmp_path / "summary"
    runs = aggregate(two_seeds, out)
    # every figure of a run is one report.figures names, and each one it names is there: none vanishes from the CSV
    assert all(set(run.figures) == set(COLUMNS) for run in runs)
    runs = {(r["experiment"], r["seed"]): r for r in read_csv(out / "summary.csv")}
    assert sorted(runs) == [("ddp", "1"), ("ddp", "2"), ("single", "1"), ("single", "2")]
    assert {r["experiment"]: (r["scaling"], r["baseline"]) for r in runs.values()} == {
        "single": ("strong", "single"),
        "ddp": ("weak", "single"),
    }
    # speedup against the baseline run of the same seed; efficiency = speedup / (2 devices / 1)
    assert float(runs["ddp", "1"]["speedup"]) == pytest.approx(10240 / 5120)
    assert float(runs["ddp", "2"]["speedup"]) == pytest.approx(10240 / 4096)
    assert float(runs["ddp", "2"]["scaling_efficiency"]) == pytest.approx(1.25)

    by_name = {r["experiment"]: r for r in read_csv(out / "summary_by_experiment.csv")}
    single, ddp = by_name["single"], by_name["ddp"]
    assert single["seeds"] == ddp["seeds"] == "2"
    assert float(single["tokens_per_s_mean"]) == pytest.approx(4608.0)
    assert float(single["tokens_per_s_std"]) == pytest.approx(1024 / math.sqrt(2))  # sample std of 5120, 4096
    assert (float(single["tokens_per_s_min"]), float(single["tokens_per_s_max"])) == (4096.0, 5120.0)
    assert float(single["test_loss_mean"]) == pytest.approx(5.1)
    assert float(single["test_loss_std"]) == pytest.approx(statistics.stdev([5.0, 5.2]))
    assert float(single["test_perplexity_mean"]) == pytest.approx((math.exp(5.0) + math.exp(5.2)) / 2)
    assert float(ddp["speedup_mean"]) == pytest.approx(2.25)
    assert float(ddp["speedup_std"]) == pytest.approx(0.5 / math.sqrt(2))
    assert float(ddp["scaling_efficiency_mean"]) == pytest.approx(1.125)
    assert float(ddp["tokens_per_s_per_device_mean"]) == 5120.0 and float(ddp["tokens_per_s_std"]) == 0.0
    assert float(ddp["peak_mem_mb_per_rank_mean"]) == 100.0 and float(ddp["peak_mem_mb_per_rank_std"]) > 0
    summary = (out / "summary.md").read_text()
    assert "## Per experiment" in summary and "against `single` (1 device(s))" in summary
    assert "| single | strong | 1 | 2 | 4608 ± 724.1 (4096–5120) |" in summary
    for png in ("loss_vs_tokens.png", "loss_vs_time.png", "scaling.png", "utilisation.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_a_mixture_of_experts_shows_its_load_balance_and_all_to_all_beside_the_dense_runs(tmp_path):
    dense, moe = fake_run(tmp_path, "dense", 1), fake_run(tmp_path, "moe_ep", 1, world_size=2, moe=True)
    aggregate([dense], tmp_path / "dense")
    assert "## Mixture of experts" not in (tmp_path / "dense/summary.md").read_text()  # no mixture, no section

    out = tmp_path / "summary"
    aggregate([dense, moe], out)
    rows = {r["experiment"]: r for r in read_csv(out / "summary.csv")}
    figures = (
        "experts",
        "params_total",
        "params_active",
        "aux_loss",
        "expert_load_max_over_mean",
        "all_to_all_share",
        "max_vio_end",
    )
    assert [rows["moe_ep"][f] for f in figures] == ["4", "3000", "2000", "1.005", "1.5", "0.2", "0.2"]  # worst layer
    assert [rows["dense"][f] for f in figures] == [""] * 7  # an older run.json: no parameters recorded either
    by_name = {r["experiment"]: r for r in read_csv(out / "summary_by_experiment.csv")}
    assert float(by_name["moe_ep"]["expert_load_max_over_mean_mean"]) == 1.5 and by_name["moe_ep"]["experts"] == "4"
    summary = (out / "summary.md").read_text()
    section = summary.split("## Mixture of experts")[1].split("\n## ")[0]
    assert "| moe_ep | 1 | 2x1x1x1 | 2 | 4 | 3000 | 2000 | 5120 | 0.5 | 0.2 | 1.5 | 0.2 | 1.005 | 5 |" in section
    assert "| dense | 1 | 1x1x1x1 | 1 |  |  |  | 5120 |  |  |  |  |  | 5 |" in section
    assert (out / "experts.png").read_bytes()[:4] == b"\x89PNG"
    # experts.png: a curve per layer, max / mean (MaxVio + 1), and the aux loss beside them
    balance, aux = experts_figure([read_run(RunDir(moe))]).axes[:2]
    assert [line.get_label() for line in balance.lines if not line.get_label().startswith("_")] == [
        "moe_ep 2x1x1x1 (seed 1), layer 0",
        "moe_ep 2x1x1x1 (seed 1), layer 1",
    ]
    assert balance.lines[1].get_ydata()[-1] == pytest.approx(1 + 4.0 / 20) and len(aux.lines) == 2  # and y = 1


def test_one_seed_leaves_the_standard_deviation_empty(tmp_path):
    out = tmp_path / "summary"
    aggregate([fake_run(tmp_path, "single", 1)], out)
    (row,) = read_csv(out / "summary_by_experiment.csv")
    assert row["seeds"] == "1" and row["tokens_per_s_mean"] == row["tokens_per_s_min"] == "5120.0"
    assert row["tokens_per_s_std"] == "" and row["speedup_mean"] == "1.0"
    # a run record of another format (a later scalelm's, say) is refused by name, never misread
    record = json.loads(RunDir.of(tmp_path, "single", 1).record.read_text())
    RunDir.of(tmp_path, "single", 1).record.write_text(json.dumps(record | {"format": 2}))
    with pytest.raises(DataError, match=r"run.json is a run record of format 2; this scalelm reads format 1"):
        aggregate([RunDir.of(tmp_path, "single", 1).path], out)


def test_loss_curves_of_several_seeds_are_their_mean_and_range(tmp_path, two_seeds):
    runs = [
        RunSummary({"global_batch_tokens": 512}, [json.loads(line) for line in (p / "metrics.jsonl").open()])
        for p in two_seeds[:2]
    ]
    x, mean, low, high = across_seeds(runs, "tokens", "train")
    assert x[:2] == [1024, 2048] and len(x) == 10
    assert mean[0] == pytest.approx(8.0 - 0.2 - 0.015) and (low[0], high[0]) == (8.0 - 0.2 - 0.02, 8.0 - 0.2 - 0.01)
    x, mean, _, _ = across_seeds(runs, "time", "validation")
    assert x == pytest.approx([1.125, 2.25]) and mean == pytest.approx([6.0, 5.0])  # mean time of the seeds


def test_the_baseline_is_named_or_the_experiment_with_fewest_devices(tmp_path):
    assert choose_baseline({"ddp": 2, "single_b": 1, "single_a": 1}) == "single_a"  # the first by name
    assert choose_baseline({"fsdp": 8, "ddp": 4}) == "ddp"  # no single-device experiment: the smallest
    assert choose_baseline({"fsdp": 8, "ddp": 4}, "fsdp") == "fsdp"
    with pytest.raises(ConfigError, match=r"baseline: 'dpp' names no experiment; did you mean 'ddp'\?"):
        choose_baseline({"fsdp": 8, "ddp": 4}, "dpp")

    # a baseline of 2 devices without the seed of the run: its mean; efficiency relative to its 2 devices
    runs = [
        fake_run(tmp_path, "single", 1),  # 5120 tokens/s
        fake_run(tmp_path, "single", 2),
        fake_run(tmp_path, "ddp", 1, world_size=2, tokens_per_step=1024),  # 10240 tokens/s
    ]
    out = tmp_path / "summary"
    aggregate(runs, out, ReportOptions(baseline="ddp"))
    rows = {(r["experiment"], r["seed"]): r for r in read_csv(out / "summary.csv")}
    assert float(rows["single", "2"]["speedup"]) == pytest.approx(0.5)
    assert float(rows["single", "2"]["scaling_efficiency"]) == pytest.approx(1.0)  # half the speed on half the devices
    assert {r["baseline"] for r in rows.values()} == {"ddp"} and rows["ddp", "1"]["speedup"] == "1.0"


def test_a_missed_expectation_is_reported_and_fails_the_strict_check(tmp_path, two_seeds, capsys):
    out = tmp_path / "summary"
    aggregate_main(
        [
            *(arg for run in two_seeds for arg in ("--run", str(run))),
            "--out-dir",
            str(out),
            "--expect",
            "ddp.min_tokens_per_s_per_device=6000",
            "--expect",
            "ddp.max_test_perplexity=200",
            "--expect",
            "single.max_step_time_s=0.1",
            "--expect",
            "single.tolerance=0.2",
        ]
    )
    checks = {(c["experiment"], c["expectation"]): c for c in read_csv(out / "expectations.csv")}
    missed = checks["ddp", "min_tokens_per_s_per_device"]  # 5120 per device < 6000 x 0.95
    assert (missed["value"], missed["limit"], missed["threshold"], missed["status"]) == (
        "5120.0",
        "6000.0",
        "5700.0",
        "missed",
    )
    assert checks["ddp", "max_test_perplexity"]["status"] == "met"  # e^5 = 148
    assert checks["single", "max_step_time_s"]["status"] == "met"  # mean 0.1125 <= 0.1 x 1.2
    assert checks["single", "max_step_time_s"]["seeds"] == "2"
    summary = (out / "summary.md").read_text()
    assert "## Expectations" in summary and "2 met, 1 missed" in summary
    assert "| missed min_tokens_per_s_per_device |" in summary  # flagged in the lead table too
    assert "| ddp | min_tokens_per_s_per_device | 5120 | 6000 |  | 0.05 | 5700 | 2 | **missed** |" in summary
    capsys.readouterr()

    with pytest.raises(SystemExit) as failed:
        expectations.main([str(out / "expectations.csv")])
    assert failed.value.code == 1
    message = capsys.readouterr().err
    assert message.startswith("error: 1 of 3 expectations missed (expect_strict): ")
    assert (
        "ddp: tokens_per_s_per_device 5120 (mean of 2 seeds) is below the minimum 6000 (5700 with the 5% tolerance)"
        in message
    )
    assert "max_test_perplexity" not in message  # only the misses
    for kept in ("summary.csv", "summary_by_experiment.csv", "summary.md", "scaling.png"):
        assert (out / kept).is_file()  # the check reads, and deletes nothing

    met = tmp_path / "met"
    aggregate(two_seeds, met, expected=[Expectation("ddp", "max_test_loss", 5.0)])
    expectations.main([str(met / "expectations.csv")])
    assert "all 1 expectations met" in capsys.readouterr().out


@pytest.mark.parametrize(
    "expect, message",
    [
        (
            {"min_tokens_per_sec": 1},
            r"experiments.ddp.expect: unknown key 'min_tokens_per_sec'; did you mean "
            r"'min_tokens_per_s_per_device'\? \(known: min_tokens_per_s_per_device, .*tolerance\)",
        ),
        ({"max_test_loss": 0}, r"experiments.ddp.expect.max_test_loss must be a positive number or .*, got 0"),
        ({"min_mfu": True}, r"experiments.ddp.expect.min_mfu must be a positive number or .*, got True"),
        ({"min_mfu": float("nan")}, r"experiments.ddp.expect.min_mfu must be a positive number or .*, got nan"),
        ({"tolerence": 0.1}, r"experiments.ddp.expect: unknown key 'tolerence'; did you mean 'tolerance'\?"),
        ({"min_mfu": 0.3, "tolerance": 1.5}, r"experiments.ddp.expect.tolerance must be a fraction from 0 to below 1"),
        ([1], r"experiments.ddp.expect: expected a mapping such as \{max_test_perplexity: 200\}, got \[1\]"),
        ({"min_mfu": {"history": "mean"}}, r"experiments.ddp.expect.min_mfu.history must be one of median_of_last"),
        ({"min_mfu": {"history": "median_of_last", "n": 0}}, r"experiments.ddp.expect.min_mfu.n must be a whole"),
        ({"min_mfu": {"history": "median_of_last", "last": 3}}, r"min_mfu: unknown key\(s\) 'last' \(known: history"),
        ({"min_mfu": {"history": "median_of_last", "tolerance": 2}}, r"expect.min_mfu.tolerance must be a fraction"),
    ],
)
def test_bad_expectations_are_refused_naming_the_key(expect, message):
    with pytest.raises(ConfigError, match=message):
        parse_expectations({"ddp": {"strategy": "ddp", "expect": expect}})


def test_expectations_travel_to_the_aggregate_command_unchanged():
    parsed = parse_expectations(
        {
            "single": {"expect": {"max_test_perplexity": 5000}},
            "ddp": {
                "expect": {
                    "min_mfu": 0.25,
                    "max_peak_mem_mb_per_rank": 4000,
                    "tolerance": 0.1,
                    "min_tokens_per_s_per_device": {"history": "median_of_last", "n": 3, "tolerance": 0.2},
                    "max_step_time_s": {"history": "median_of_last"},
                }
            },
        }
    )
    assert [(e.figure, e.is_minimum, e.threshold, e.tolerance, e.history_n) for e in parsed] == [
        ("test_perplexity", False, pytest.approx(5250), 0.05, None),
        ("mfu", True, pytest.approx(0.225), 0.1, None),
        ("peak_mem_mb_per_rank", False, pytest.approx(4400), 0.1, None),
        ("tokens_per_s_per_device", True, None, 0.2, 3),
        ("step_time_s", False, None, 0.1, 5),
    ]
    assert from_arguments(to_arguments(parsed)) == parsed
    assert shlex.split(shlex.join(to_arguments(parsed))) == to_arguments(parsed)  # through the rule's shell
    with pytest.raises(ConfigError, match=r"ddp.min_mfu take their limit from the results history: give the"):
        expectations.resolve(from_arguments(["ddp.min_mfu={history: median_of_last}"]), None)
    with pytest.raises(ConfigError, match=r"--expect 'ddp=3': expected EXPERIMENT.KEY=VALUE"):
        from_arguments(["ddp=3"])
    with pytest.raises(ConfigError, match=r"expect.min_mfu must be a positive number or .*, got .high."):
        from_arguments(["ddp.min_mfu=high"])


# ------------------------------------------------------------------------------------------ the results history
def history_row(study, experiment, seed, figures, torch_version="2.13.0"):
    return {
        "key": f"{study}|{experiment}|{seed}",
        "study": study,
        "recorded": "2026-11-25T10:00:00.000000+00:00",
        "experiment": experiment,
        "seed": seed,
        "layout": "1x1x1x1",
        "settings_hash": "s",
        "start_time": None,
        "end_time": None,
        "figures": figures,
        "environment": {"device": "cpu", "torch": torch_version},
    }


def write_history(db, worker):
    """One of several writers at once: 25 runs of its own and 5 every writer adds."""
    rows = [history_row("A", f"w{worker}", seed, {}) for seed in range(25)]
    return history_store.insert(db, rows + [history_row("A", "shared", seed, {}) for seed in range(5)])


def test_the_history_records_each_run_once_and_parallel_writers_lose_nothing(tmp_path, two_seeds, capsys):
    db = tmp_path / "shared" / "history.sqlite"
    # limits from the history: ddp's speed and test loss against the median of its last 3 earlier studies
    drift = [
        "--expect",
        "ddp.min_tokens_per_s_per_device={history: median_of_last, n: 3, tolerance: 0.1}",
        "--expect",
        "ddp.max_test_loss={history: median_of_last, n: 3}",
    ]
    arguments = [arg for run in two_seeds for arg in ("--run", str(run))] + [*drift, "--history", str(db)]
    aggregate_main([*arguments, "--out-dir", str(tmp_path / "first")])
    aggregate_main([*arguments, "--out-dir", str(tmp_path / "again")])  # the same attempts: recorded once
    assert "0 new run(s) of 4" in capsys.readouterr().out
    # the first study has nothing earlier to compare with: no reference, which only the strict check refuses
    first = {c["expectation"]: c for c in read_csv(tmp_path / "again/expectations.csv")}
    assert {c["status"] for c in first.values()} == {"no reference"} and first["max_test_loss"]["limit"] == ""
    assert "0 met, 0 missed, 2 without a reference" in (tmp_path / "again/summary.md").read_text()
    with pytest.raises(SystemExit):
        expectations.main([str(tmp_path / "again/expectations.csv")])
    message = capsys.readouterr().err
    assert "error: 2 of 2 expectations missed (expect_strict): ddp: tokens_per_s_per_device 5120 (mean of 2 seeds) "
    "has no minimum from the history: no earlier study of ddp with these settings on this site and device in " in message
    assert "so the next study has the reference it lacked; a first study passes with expect_strict: false" in message
    rows = history_store.read_rows(db)
    assert len(rows) == 4 and len({r["study"] for r in rows}) == 1
    assert {(r["experiment"], r["seed"]) for r in rows} == {("single", 1), ("single", 2), ("ddp", 1), ("ddp", 2)}
    assert rows[0]["figures"]["tokens_per_s"] and rows[0]["environment"]["site"] == "local"

    parallel = tmp_path / "parallel.sqlite"
    with concurrent.futures.ProcessPoolExecutor(4) as pool:
        added = list(pool.map(write_history, [parallel] * 4, range(4)))
    assert sum(added) == 4 * 25 + 5 and len(history_store.read_rows(parallel)) == 105

    exported = tmp_path / "runs.jsonl"
    with exported.open("w") as out:
        assert history.export_rows(db, out) == 4
    merged = tmp_path / "merged.sqlite"
    assert history.import_rows(merged, [exported]) == 4 and history.import_rows(merged, [exported]) == 0
    # a week later the ddp runs are slower (a new torch, say): the summary says so first
    later = tmp_path / "later"
    slower = [fake_run(later, "single", seed, hour=12) for seed in (1, 2)] + [
        fake_run(
            later,
            "ddp",
            seed,
            world_size=2,
            mode="per_device",
            tokens_per_step=1024,
            step_time=0.2,
            hour=12,
            numpy="2.5.0",
            threads="1",
            study="week2",  # trained again for a study of that name (the workflow's `study`)
        )
        for seed in (1, 2)
    ]
    capsys.readouterr()
    aggregate_main(
        [arg for run in slower for arg in ("--run", str(run))]
        + [*drift, "--history", str(db), "--out-dir", str(tmp_path / "week2")]
    )
    summary = (tmp_path / "week2/summary.md").read_text()
    assert "## Since the previous study" in summary and "first" in summary
    assert history_store.studies(db)[-1].endswith(f"{tmp_path / 'week2'} (week2)")  # the history names it
    flagged = "| missed min_tokens_per_s_per_device, regression tokens_per_s_per_device, regression step_time_s |"
    assert flagged in summary  # the lead table's flags
    # beside each regression, what changed: the package version and the thread count
    assert '| regression | package numpy: "2.4.6" -> "2.5.0"; threads: "2" -> "1" |' in summary
    week2 = {c["expectation"]: c for c in read_csv(tmp_path / "week2/expectations.csv")}
    assert (week2["min_tokens_per_s_per_device"]["limit"], week2["min_tokens_per_s_per_device"]["status"]) == (
        "5120.0",
        "missed",
    )
    assert week2["max_test_loss"]["status"] == "met" and week2["max_test_loss"]["threshold"] == "5.25"
    assert week2["max_test_loss"]["reference"] == "median of the last 1 study (n 3)"
    # the trend: every study of these settings, one point each, coloured by environment
    trend = history_compare.trend(history_store.read_rows(db), [read_run(RunDir(Path(run))) for run in slower])
    assert [p.values["tokens_per_s_per_device"] for p in trend["ddp"]] == [[5120.0] * 2, [2560.0] * 2]
    assert {p.environment for p in trend["ddp"]} == {"local, cpu, torch 2.13.0"} and len(trend["single"]) == 2
    assert (tmp_path / "week2/trend.png").read_bytes()[:4] == b"\x89PNG"
    lead = summary.split("\n\n")[2]  # the lead table: a few columns, every figure in summary.csv
    assert (
        lead.startswith("| experiment | seed | layout | world_size | tokens_per_s_per_device |")
        and "sha256" not in lead
    )

    (tmp_path / "not.sqlite").write_text("a text file")
    with pytest.raises(DataError, match=r"not.sqlite is not a scalelm results history, or a damaged one \(file is not"):
        history_store.read_rows(tmp_path / "not.sqlite")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1 is not a JSON line of a history export"):
        history.import_rows(merged, [tmp_path / "bad.jsonl"])


KILLED_WRITER = """
import sys, time
from scalelm.report import history_store
connect = history_store.connect

def stalling(db):  # the writer stops for good after its third row, inside its transaction
    connection, rows = connect(db), []
    def trace(statement):
        rows.append(statement) if statement.startswith("INSERT") else None
        if len(rows) == 3:
            print("writing", flush=True)
            time.sleep(600)
    connection.set_trace_callback(trace)
    return connection

history_store.connect = stalling
history_store.insert(sys.argv[1], [{**row, "key": f"k{i}"} for i, row in enumerate([%r] * 10)])
"""


def test_a_writer_killed_mid_study_leaves_no_partial_study(tmp_path):
    db = tmp_path / "history.sqlite"
    history_store.insert(db, [history_row("A", "ddp", 1, {"tokens_per_s_per_device": 1.0})])
    row = history_row("B", "ddp", 2, {"tokens_per_s_per_device": 2.0})
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER % row, str(db)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline() == "writing\n"
    writer.kill()  # SIGKILL: no handler, no rollback of its own; SQLite's journal undoes it at the next open
    writer.wait()
    assert [r["study"] for r in history_store.read_rows(db)] == ["A"]
    assert history_store.insert(db, [row]) == 1  # and the lock died with it


def test_a_regression_is_flagged_only_beyond_the_tolerance_and_significant(tmp_path, capsys):
    db = tmp_path / "history.sqlite"
    before = {
        "tokens_per_s_per_device": [100, 102, 98, 101],
        "test_loss": [5.0, 5.01, 4.99, 5.0],
        "step_time_s": [1.0, 1.5, 0.5, 1.2],
    }
    after = {
        "tokens_per_s_per_device": [80, 82, 79, 81],
        "test_loss": [5.02, 5.0, 5.01, 4.99],
        "step_time_s": [1.3, 0.6, 1.9, 1.0],
    }
    rows = []
    for study, values, version in (("2026-11-01 a", before, "2.9.0"), ("2026-11-02 b", after, "2.13.0")):
        rows += [history_row(study, "ddp", seed, {k: v[seed] for k, v in values.items()}, version) for seed in range(4)]
        rows.append(history_row(study, "one", 0, {"tokens_per_s_per_device": 100 if version == "2.9.0" else 70}))
    history_store.insert(db, rows)
    with pytest.raises(SystemExit) as exit_status:
        history.main(["--db", str(db), "compare", "--out", str(tmp_path / "cmp"), "--json"])
    assert exit_status.value.code == 1  # a regression fails the command (a weekly job can stop on it)
    changes = {(c["experiment"], c["figure"]): c for c in json.loads(capsys.readouterr().out)["changes"]}
    slower = changes["ddp", "tokens_per_s_per_device"]
    assert (
        slower["verdict"] == "regression"
        and slower["p_value"] < 0.01
        and slower["relative"] == pytest.approx(80.5 / 100.25 - 1)
    )
    assert slower["low"] < 80.5 - 100.25 < slower["high"] < 0  # the difference of the means, its 95% interval
    assert slower["environment"] == {"torch": [['"2.9.0"'], ['"2.13.0"']]}  # what changed beside it
    assert changes["ddp", "test_loss"]["verdict"] == "within tolerance"
    assert changes["ddp", "step_time_s"]["verdict"] == "not significant"  # 5% slower, but noise of that order
    assert changes["one", "tokens_per_s_per_device"]["verdict"] == (  # one seed a side, no machine spread recorded
        "regression (not tested, beyond the assumed spread of 20%, no machine spread recorded)"
    )
    assert "regression" in (tmp_path / "cmp/compare.md").read_text()
    assert len(read_csv(tmp_path / "cmp/compare.csv")) == len(changes)
    with pytest.raises(ConfigError, match="'2026-12' names 0 studies"):
        history.choose(db, "2026-12", None)


def test_the_history_flags_a_slowdown_and_no_rerun(tmp_path):
    """Three studies of one experiment, three seeds each, their figures set by the test (a measured speed would make
    the test as flaky as the machine it runs on: bench/history_slowdown.py shows the same with real trainings). The
    second study reruns the first, its step times within noise of the first's; the third, on one thread instead of
    two, takes twice as long a step: a regression beyond the tolerance and significant, the thread count named as
    what changed. The test loss is the same in all three: no change."""
    db = tmp_path / "history.sqlite"
    step_times = {"first": (0.100, 0.102, 0.098), "rerun": (0.101, 0.099, 0.100), "one_thread": (0.2, 0.205, 0.195)}
    summaries = {}
    for hour, (study, times) in enumerate(step_times.items(), 10):
        threads = "1" if study == "one_thread" else "2"
        runs = [
            fake_run(tmp_path / study, "tiny", seed, step_time=time, hour=hour, threads=threads)
            for seed, time in enumerate(times, 1)
        ]
        aggregate(runs, tmp_path / study / "summary", history_db=db)
        summaries[study] = (tmp_path / study / "summary/summary.md").read_text()
    rows = history_store.read_rows(db)
    first, rerun, one_thread = sorted({r["study"] for r in rows})
    by_study = {s: [r for r in rows if r["study"] == s] for s in (first, rerun, one_thread)}
    assert [len(runs) for runs in by_study.values()] == [3, 3, 3]
    same = {c.figure: c for c in history_compare.compare(by_study[first], by_study[rerun])}
    assert not [c for c in same.values() if c.verdict.startswith("regression")], same
    assert same["test_loss"].relative == 0 and same["test_loss"].verdict == "within tolerance"
    assert "0 regression(s)" in summaries["rerun"] and "regression tokens_per_s_per_device" not in summaries["rerun"]
    slower = {c.figure: c for c in history_compare.compare(by_study[rerun], by_study[one_thread])}
    slower = slower["tokens_per_s_per_device"]
    assert slower.verdict == "regression" and slower.p_value < 0.05 and slower.relative < -0.05, slower
    assert slower.environment["threads"] == (['"2"'], ['"1"']), slower.environment
    assert "regression tokens_per_s_per_device" in summaries["one_thread"]


def test_a_damaged_run_is_refused_naming_its_file_and_what_to_do(tmp_path, capsys):
    """A file of a run directory of another shape than its writer gives it, or a figure that is not a finite number:
    one line naming the file (and the figure), and how to write it anew; never a KeyError, nor a NaN in the means."""
    run = RunDir(fake_run(tmp_path, "single", 1))
    files = {path: path.read_text() for path in (run.record, run.test_result, run.model_meta, run.metrics)}
    record = json.loads(files[run.record])
    again = "remove run.json and run the training again: it resumes from its last checkpoint"
    broken = "the run is broken"
    cases = [
        (run.record, "[]", f"{run.record} is not a run record this scalelm reads .*: {again}"),
        (run.record, "{", f"{run.record} is not a run record this scalelm reads .*: {again}"),
        (
            run.record,
            json.dumps(record | {"config": {"batch": {"mode": "global"}}}),
            f"{run.record} is not a run record this scalelm reads \\(KeyError: 'seed'\\): {again}",
        ),
        (run.record, json.dumps(record | {"launch": "1x1"}), f"{run.record} is not a run record this scalelm reads"),
        (
            run.record,
            json.dumps(record | {"results": record["results"] | {"validation": [5.5]}}),
            f"{run.record} is not a run record",
        ),
        (
            run.record,
            json.dumps(record | {"results": record["results"] | {"final_train_loss": math.nan}}),
            f"{run.record} gives final_train_loss = nan: {broken}",
        ),
        (run.record, json.dumps(record | {"wall_time_s": math.inf}), f"{run.record} gives wall_time_s = inf"),
        (
            run.test_result,
            json.dumps({"loss": math.nan, "perplexity": math.nan}),
            f"{run.test_result} gives test_loss = nan: {broken} .*train it again .*or aggregate without it",
        ),
        (
            run.test_result,
            json.dumps({"loss": 900.0, "perplexity": math.inf}),
            f"{run.test_result} gives test_perplexity = inf",
        ),
        (
            run.test_result,
            json.dumps({"loss": "low", "perplexity": 3.0}),
            f"{run.test_result} is not a test evaluation this scalelm reads .*: remove it and evaluate the model again",
        ),
        (run.test_result, "[5.0]", f"{run.test_result} is not a test evaluation this scalelm reads"),
        (
            run.model_meta,
            "{}",
            f"{run.model_meta} is not a model record this scalelm reads .*: remove it and consolidate the run again",
        ),
        (run.metrics, files[run.metrics] + "{cut short\n", f"{run.metrics}, line 13, is not a complete JSON record"),
        (
            run.metrics,
            files[run.metrics].replace('"step_time_s"', '"step_s"'),
            f"{run.metrics}, line 1, is not a "
            "metrics record this scalelm reads \\(no step_time_s\\) \\(and 9 more lines\\): remove that line",
        ),
    ]
    for path, text, message in cases:
        path.write_text(text)
        with pytest.raises(SystemExit) as failed:
            aggregate_main(["--run", str(run.path), "--out-dir", str(tmp_path / "summary")])
        error = capsys.readouterr().err
        assert failed.value.code == 2 and error.count("\n") == 1 and re.match(f"error: {message}", error), error
        path.write_text(files[path])
        assert not (tmp_path / "summary").exists()  # nothing summarised from a damaged run
    aggregate([run.path], tmp_path / "summary")  # each file restored: summarised


def test_a_finished_runs_unreadable_metrics_line_is_named_and_removing_it_gets_past(tmp_path, capsys):
    """A metrics line the report cannot read is named with what to do: remove it. Training the finished run again
    would not help (a rerun restores its run.json and keeps the log), so the advice is never to: following the
    advice given, the aggregation goes through (issue 49)."""
    run = RunDir(fake_run(tmp_path, "single", 1))
    lines = run.metrics.read_text().splitlines()
    without_time = {k: v for k, v in json.loads(lines[2]).items() if k != "step_time_s"}
    for number, bad, message in (
        (
            3,
            json.dumps(without_time),
            "is not a metrics record this scalelm reads \\(no step_time_s\\): remove "
            "that line \\(the summary then leaves it out; training the run again would "
            "keep its log as it is\\)",
        ),
        (
            5,
            json.dumps({"kind": "eval", "split": "validation", "step": 10, "time": 1.0, "loss": "low"}),
            "is not a metrics record this scalelm reads \\(loss 'low', not a finite number\\): remove that line",
        ),
        (
            2,
            json.dumps({"kind": "train", "loss": 3.0}),
            "is a record without a step number .*: the file is damaged; repair or delete that line",
        ),
        (4, "{cut short", "is not a complete JSON record: the file is damaged; repair or delete that line"),
    ):
        damaged = [*lines[: number - 1], bad, *lines[number - 1 :]]
        run.metrics.write_text("\n".join(damaged) + "\n")
        with pytest.raises(SystemExit):
            aggregate_main(["--run", str(run.path), "--out-dir", str(tmp_path / "summary")])
        error = capsys.readouterr().err
        assert re.match(f"error: {run.metrics}, line {number}, {message}", error) and error.count("\n") == 1, error
        del damaged[number - 1]  # as the error says
        run.metrics.write_text("\n".join(damaged) + "\n")
        assert read_run(run).figures["step_time_s"] == 0.1


def test_the_mfu_follows_the_peak_the_run_is_configured_with_now(tmp_path, capsys):
    """A configured peak (train.peak_tflops in the run's config.yaml, which a rerun that restored its record writes
    with the settings of now) wins over the recorded one, as in training; without it the recorded peak counts; an
    unreadable one is named (issue 49)."""
    run = RunDir(fake_run(tmp_path, "single", 1))  # no peak recorded (an unknown GPU's)
    assert read_run(run).figures["mfu"] is None
    run.config.write_text("train:\n  peak_tflops: 0.002\n")
    assert read_run(run).figures["mfu"] == pytest.approx(6000 * 5120 / 2e9)
    run.config.write_text("train:\n  peak_tflops: null\n")
    record = json.loads(run.record.read_text())
    record["results"]["peak_flops_per_device"] = 1e9
    run.record.write_text(json.dumps(record))
    assert read_run(run).figures["mfu"] == pytest.approx(6000 * 5120 / 1e9)
    run.config.write_text("train:\n  peak_tflops: fast\n")
    with pytest.raises(DataError, match=rf"{run.config} is not the settings of a run .*train.peak_tflops is 'fast'"):
        read_run(run)


def test_the_aggregation_refuses_an_out_dir_in_a_run_directory(tmp_path, two_seeds, capsys):
    """Like every command's outputs apart from its inputs, the summary is refused in a run directory or inside one
    (its checkpoints/), before anything is read or written; the directory above the runs is where it belongs."""
    runs = [arg for run in two_seeds for arg in ("--run", str(run))]
    for out, where in ((two_seeds[0], "is"), (two_seeds[1] / "checkpoints", "lies inside")):
        with pytest.raises(SystemExit):
            aggregate_main([*runs, "--out-dir", str(out)])
        error = capsys.readouterr().err
        run = two_seeds[0] if where == "is" else two_seeds[1]
        assert (
            error == f"error: --out-dir {out} {where} the run directory {run}: the summary would be written "
            "among the run's files; choose another --out-dir\n"
        ), error
        assert not (out / "summary.csv").exists() and not (two_seeds[1] / "checkpoints").exists()
    check_out_dir(tmp_path, two_seeds)  # the results directory, above the runs


def test_a_run_given_twice_is_refused_not_counted_as_two_seeds(tmp_path):
    runs = [fake_run(tmp_path, "single", 1), fake_run(tmp_path, "single", 2)]
    with pytest.raises(DataError, match=f"{runs[0]} is given twice: each run counts once; give it once"):
        aggregate([runs[0], runs[1], tmp_path / "runs/single/../single/seed1"], tmp_path / "summary")
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "runs", copy / "runs")
    with pytest.raises(
        DataError,
        match=f"{runs[1]} and {copy}/runs/single/seed2 are both seed 2 of single: one "
        "seed would count twice; give one of them",
    ):
        aggregate([*runs, copy / "runs/single/seed2"], tmp_path / "summary")
    assert not (tmp_path / "summary").exists()


def test_the_aggregation_refuses_a_history_among_what_it_writes_or_replaces(tmp_path, two_seeds, capsys):
    out = tmp_path / "summary"
    out.mkdir()
    (out / "summary.csv").write_text("the previous summary")
    for db, message in (
        (out / "summary.csv", f"--history {out}/summary.csv is {out}/summary.csv, which the study writes"),
        (out / "trend.png", f"--history {out}/trend.png is {out}/trend.png, which the study writes"),
        (
            two_seeds[0] / "history.sqlite",
            f"--history {two_seeds[0]}/history.sqlite lies in {two_seeds[0]}, which the workflow replaces whole",
        ),
    ):
        with pytest.raises(SystemExit) as failed:
            aggregate_main(
                [
                    *(arg for run in two_seeds for arg in ("--run", str(run))),
                    "--out-dir",
                    str(out),
                    "--history",
                    str(db),
                ]
            )
        error = capsys.readouterr().err
        assert failed.value.code == 2 and error.startswith(f"error: {message}") and error.count("\n") == 1, error
        assert "choose a file apart from them" in error
    assert (out / "summary.csv").read_text() == "the previous summary" and not (
        two_seeds[0] / "history.sqlite"
    ).exists()
    assert sorted(p.name for p in out.iterdir()) == ["summary.csv"]


def machine_record(**fields) -> MachineBaseline:
    """A machine baseline of one node of two ranks (on host vm), with `fields` of its JSON over those."""
    least = {"world_size": 2, "procs_per_node": 2, "hosts": ["vm"], "device": "cpu", "matmul_tflops_min": 0.05}
    return MachineBaseline.from_json(least | fields)


def fake_baseline(path, nodes, procs, job_all_reduce, node_all_reduce=None, tflops=0.05):
    """A machine baseline as scalelm.measure.baseline writes it: two sizes of all_reduce over the job (and within a
    node), the second `job_all_reduce` GB/s of bus bandwidth."""
    world = nodes * procs
    rows = []
    for scope, busbw, ranks in (("job", job_all_reduce, world), ("node", node_all_reduce, procs)):
        for size, share in ((2**20, 0.5), (2**22, 1.0)):
            if busbw is not None:
                rows.append(
                    {
                        "scope": scope,
                        "op": "all_reduce",
                        "ranks": ranks,
                        "bytes": size,
                        "time_s": 0.01,
                        "algbw_gbps": busbw * share / 1.5,
                        "busbw_gbps": busbw * share,
                        "busbw_gbps_min": busbw * share * 0.5,  # the repetitions' spread
                        "busbw_gbps_max": busbw * share * 1.5,
                    }
                )
    path.write_text(
        json.dumps(
            {
                "world_size": world,
                "procs_per_node": procs,
                "hosts": [f"n{i}" for i in range(nodes)],
                "device": "cpu",
                "matmul_tflops_min": tflops,
                "per_rank": [],
                "collectives": rows,
                "nccl_network": None,
            }
        )
    )
    return path


def test_the_machine_baseline_sits_beside_the_runs_on_its_nodes(tmp_path, two_seeds):
    """Each node count's baseline in summary.md and machine.csv, against the site's references: the network of one
    node delivered 22% of its reference, flagged beside every run on one node."""
    from scalelm.site import MachineReferences

    one = fake_baseline(tmp_path / "nodes1.json", 1, 2, job_all_reduce=2.2, node_all_reduce=None)
    references = MachineReferences(matmul_tflops=0.04, busbw_gbps={"job_all_reduce": 10.0}, tolerance=0.1)
    out = tmp_path / "summary"
    aggregate(two_seeds, out, machine_files=[one], references=references)
    summary = (out / "summary.md").read_text()
    assert "## The machine" in summary and "| 1 | 2 | n0 | 0.05 |  | 2.2 (1.1-3.3) |" in summary  # no model step
    assert "| 1 | job_all_reduce_busbw_gbps | 2.2 | 10 | 22% | 9 | **missed** |" in summary
    assert "| 1 | matmul_tflops | 0.05 | 0.04 | 125% | 0.036 | **met** |" in summary
    flagged = [
        line for line in summary.splitlines() if "machine below reference (job_all_reduce_busbw_gbps 22%)" in line
    ]
    assert [line.split(" | ")[0] for line in flagged] == ["| single", "| single", "| ddp", "| ddp"]  # one node each
    rows = read_csv(out / "machine.csv")
    assert [(r["nodes"], r["scope"], r["bytes"], r["busbw_gbps"]) for r in rows] == [
        ("1", "job", "1048576", "1.1"),
        ("1", "job", "4194304", "2.2"),
    ]
    with pytest.raises(ConfigError, match=r"references.busbw_gbps: unknown key 'all_reduce' \(known: job_all_reduce"):
        MachineReferences(busbw_gbps={"all_reduce": 1.0})
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(DataError, match=r"broken.json is not a machine baseline"):
        aggregate(two_seeds, out, machine_files=[tmp_path / "broken.json"])


# ------------------------------------------------------------------------------------------ disturbed runs
def test_other_work_beyond_a_share_of_the_cores_a_run_was_given_disturbs_it():
    """The rule (scalelm.report.disturbance), on host loads as run.json records them."""
    from scalelm.report.disturbance import (
        baseline_disturbance,
        disturbance,
        figure_caveat,
        run_disturbance,
        scaling_flag,
    )

    def load(cpus, run, other, busy=True):
        return {"cpus": cpus, "run_cores": run, "other_cores": other} | ({"busy_cores": run + other} if busy else {})

    # the run: 1 process of 2 threads on 2 cores, other work on 1.04 of them; 0.15 is within a tenth of 2
    assert disturbance({"vm": load(2, 0.9, 1.04)}, {"vm": 1}, 2, {}) == (
        "other work took 1.04 of the 2 cores it was given on vm"
    )
    assert disturbance({"vm": load(2, 1.8, 0.15)}, {"vm": 1}, 2, {}) == ""
    assert disturbance({"vm": load(2, 1.8, 0.15)}, {"vm": 1}, 2, {}, share=0.05)  # the share is a setting
    # the cores given: ranks x threads, at most the CPUs; without a thread count, the CPUs
    given = "other work took 1.00 of the 8 cores it was given on n"
    assert disturbance({"n": load(64, 7.0, 1.0)}, {"n": 2}, 4, {}) == given
    assert disturbance({"n": load(64, 7.0, 1.0)}, {"n": 2}, None, {}) == ""  # 1 of 64
    assert disturbance({"n": load(2, 1.0, 1.0, busy=False)}, {"n": 1}, None, {})  # a record without busy_cores
    # two "nodes" on one machine: each one's ranks are the run's, not the other's other work
    twins = {"n1": load(2, 0.95, 1.0), "n2": load(2, 0.95, 1.0)}
    assert disturbance(twins, {"n1": 1, "n2": 1}, 1, {"n1": "boot-a", "n2": "boot-a"}) == ""
    assert disturbance(twins, {"n1": 1, "n2": 1}, 1, {}) != ""  # two machines, each beside other work
    assert disturbance({}, {}, 2, {}) == ""  # nothing recorded: nothing to judge
    baseline = machine_record(
        per_rank=[{"host": "vm", "machine": "boot-a", "threads": 2}], host_load={"vm": load(2, 1, 0.9)}
    )
    assert baseline_disturbance(baseline) == "other work took 0.90 of the 2 cores it was given on vm"
    assert baseline_disturbance(machine_record(per_rank=[], collectives=[])) == ""  # an older baseline: not judged
    # a run in another architecture's image under QEMU (issue 55) measured the emulator, whatever else ran
    emulated = SimpleNamespace(
        host_load={"vm": load(2, 1.8, 0.15)},
        hostnames=["vm"],
        machines=["boot-a"],
        environment={"OMP_NUM_THREADS": "2", "SCALELM_EMULATED": "arm64 on x86_64"},
    )
    assert run_disturbance(emulated) == "run under QEMU emulation (arm64 on x86_64)"
    emulated.host_load = {"vm": load(2, 0.9, 1.04)}
    assert run_disturbance(emulated) == (
        "other work took 1.04 of the 2 cores it was given on vm; run under QEMU emulation (arm64 on x86_64)"
    )

    # what it taints: figures of time, not the loss; speedups also through the baseline run they compare with
    run = {"experiment": "single", "seed": 1, "disturbed": "other work took ...", "overlapped_by": ""}
    assert figure_caveat(run, "tokens_per_s") == "other work took ..." and figure_caveat(run, "test_loss") == ""
    shared = {"disturbed": "", "overlapped_by": "ddp/seed1"}
    assert figure_caveat(shared, "step_time_s") == "not isolated (with ddp/seed1)"
    ddp = {"experiment": "ddp", "seed": 1, "scaling_efficiency": 16.9}
    assert scaling_flag(ddp, [run]) == (
        "baseline disturbed (single seed 1); implausible efficiency (above 1.25): likely its disturbed baseline"
    )
    slow = "implausible efficiency (above 1.25): likely a baseline run slower than its machine allows"
    assert scaling_flag(ddp, [{**run, "disturbed": ""}]).startswith(slow)
    assert scaling_flag({**ddp, "scaling_efficiency": 0.9}, [{**run, "disturbed": ""}]) == ""
    assert figure_caveat({**ddp, "scaling_flag": "baseline disturbed (single seed 1)"}, "speedup") == (
        "baseline disturbed (single seed 1)"
    )
    assert figure_caveat({**ddp, "scaling_flag": "baseline disturbed (single seed 1)"}, "tokens_per_s") == ""


def table_cells(table: str) -> list[list[str]]:
    """The cells of each row of a Markdown table, below its header."""
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]


def disturbed_study(root):
    """`single` (the baseline) seed 1 beside a CPU hog, 10x slower than seed 2; `ddp` (2 devices, strong scaling)
    seeds 1 and 2; `fsdp` seed 2 only. Only `single` seed 1, and ddp seed 1's speedup against it, are disturbed."""
    return [
        fake_run(root, "single", 1, step_time=1.0, other_cores=1.04),  # 512 tokens/s
        fake_run(root, "single", 2, step_time=0.1, other_cores=0.05),  # 5120 tokens/s
        fake_run(root, "ddp", 1, world_size=2, step_time=0.05, other_cores=0.1),  # 10240 tokens/s: 20x seed 1
        fake_run(root, "ddp", 2, world_size=2, step_time=0.05, other_cores=0.1),
        fake_run(root, "fsdp", 2, world_size=2, step_time=0.06),
    ]


def test_a_disturbed_run_is_flagged_wherever_its_figures_go(tmp_path, capsys):
    out, db = tmp_path / "summary", tmp_path / "history.sqlite"
    runs = disturbed_study(tmp_path)
    expect = [
        "single.min_tokens_per_s_per_device=5000",
        "ddp.min_scaling_efficiency=0.5",
        "fsdp.max_test_loss=6",
        "fsdp.min_tokens_per_s_per_device=100",
    ]
    aggregate_main(
        [
            *(a for run in runs for a in ("--run", str(run))),
            *(a for e in expect for a in ("--expect", e)),
            "--out-dir",
            str(out),
            "--history",
            str(db),
        ]
    )
    rows = {(r["experiment"], r["seed"]): r for r in read_csv(out / "summary.csv")}
    disturbed = "other work took 1.04 of the 2 cores it was given on single-1"
    assert {key: r["disturbed"] for key, r in rows.items() if r["disturbed"]} == {("single", "1"): disturbed}
    flag = "baseline disturbed (single seed 1); implausible efficiency (above 1.25): likely its disturbed baseline"
    assert float(rows["ddp", "1"]["scaling_efficiency"]) == pytest.approx(10.0)  # printed, and flagged
    assert {key: r["scaling_flag"] for key, r in rows.items() if r["scaling_flag"]} == {("ddp", "1"): flag}
    by_name = {r["experiment"]: r for r in read_csv(out / "summary_by_experiment.csv")}
    assert {name: (r["disturbed_seeds"], r["scaling_flag"]) for name, r in by_name.items()} == {
        "single": ("1", ""),
        "ddp": ("0", flag),
        "fsdp": ("0", ""),
    }

    summary = (out / "summary.md").read_text()
    lead = {tuple(cells[:2]): cells[-1] for cells in table_cells(summary.split("\n\n")[2])}
    assert lead["single", "1"] == "disturbed, missed min_tokens_per_s_per_device (disturbed)"
    assert lead["ddp", "1"] == f"{flag}, met min_scaling_efficiency (disturbed)"
    # the others: only their experiment's checks, which take the mean over the disturbed seed too
    assert [lead[key] for key in (("single", "2"), ("ddp", "2"), ("fsdp", "2"))] == [
        "missed min_tokens_per_s_per_device (disturbed)",
        "met min_scaling_efficiency (disturbed)",
        "",
    ]
    assert "**Disturbed**: other work on their hosts took more than 0.1 of the cores they were given " in summary
    assert f"`single` seed 1 ({disturbed})" in summary and f"`ddp` seed 1 ({flag})" in summary
    per_experiment = table_cells(summary.split("## Per experiment")[1].split("\n\n")[2])
    assert [cells[-1] for cells in per_experiment] == ["1 of 2 seed(s) disturbed", flag, ""]
    checks = {(c["experiment"], c["expectation"]): c for c in read_csv(out / "expectations.csv")}
    assert {key: (c["status"], c["disturbed"]) for key, c in checks.items()} == {
        ("single", "min_tokens_per_s_per_device"): ("missed", "1 of 2 seed(s) disturbed"),
        ("ddp", "min_scaling_efficiency"): ("met", flag),
        ("fsdp", "max_test_loss"): ("met", ""),  # the loss is the run's own, disturbed or not
        ("fsdp", "min_tokens_per_s_per_device"): ("met", ""),
    }
    assert "2 on disturbed runs (`disturbed`)" in summary
    with pytest.raises(SystemExit):
        expectations.main([str(out / "expectations.csv")])
    assert "(on disturbed runs: 1 of 2 seed(s) disturbed)" in capsys.readouterr().err

    # the history keeps the flags; a later study's limits leave the disturbed run out, and its comparison says so
    recorded = {(r["experiment"], r["seed"]): r["figures"] for r in history_store.read_rows(db)}
    assert recorded["single", 1]["disturbed"] == disturbed and recorded["ddp", 1]["scaling_flag"] == flag
    later = tmp_path / "later"
    again = [fake_run(later, "single", seed, step_time=0.1, hour=12) for seed in (1, 2)]
    aggregate_main(
        [
            *(a for run in again for a in ("--run", str(run))),
            "--expect",
            "single.min_tokens_per_s_per_device={history: median_of_last, n: 3}",
            "--out-dir",
            str(later / "summary"),
            "--history",
            str(db),
        ]
    )
    (check,) = read_csv(later / "summary/expectations.csv")
    assert check["limit"] == "5120.0"  # seed 2's alone: seed 1's 512 is no reference
    assert check["reference"] == "median of the last 1 study (n 3) (1 disturbed run(s) left out)"
    since = (later / "summary/summary.md").read_text().split("## Since the previous study")[1]
    assert "| single | tokens_per_s_per_device | 2816 | 5120 | +81.8% |" in since and "| before: seed 1 |" in since
    trend = history_compare.trend(history_store.read_rows(db), [read_run(RunDir(Path(run))) for run in again])
    assert [p.disturbed for p in trend["single"]] == [1, 0]

    # the share is the study's: at 0.6 of the cores, 1.04 of 2 is no disturbance
    aggregate_main(
        [
            *(a for run in runs for a in ("--run", str(run))),
            "--out-dir",
            str(tmp_path / "lenient"),
            "--disturbed-share",
            "0.6",
        ]
    )
    assert not any(r["disturbed"] for r in read_csv(tmp_path / "lenient/summary.csv"))
    with pytest.raises(SystemExit):
        aggregate_main(["--run", str(runs[0]), "--out-dir", str(tmp_path / "x"), "--disturbed-share", "0"])
    assert "--disturbed-share must be a positive share of the cores" in capsys.readouterr().err


def test_a_machine_baseline_beside_other_work_flags_the_step_times_planned_from_it(tmp_path, two_seeds):
    from scalelm.report.steptime import error_cell

    baseline = json.loads(fake_baseline(tmp_path / "nodes1.json", 1, 2, job_all_reduce=2.2).read_text())
    baseline["per_rank"] = [{"host": "n0", "machine": "boot-a", "threads": 1}] * 2
    baseline["host_load"] = {"n0": {"cpus": 2, "busy_cores": 2.0, "run_cores": 1.1, "other_cores": 0.9}}
    (tmp_path / "nodes1.json").write_text(json.dumps(baseline))
    out = tmp_path / "summary"
    aggregate(two_seeds, out, machine_files=[tmp_path / "nodes1.json"])
    summary = (out / "summary.md").read_text()
    assert "**Disturbed baseline**: measured beside other work" in summary
    assert "on 1 node(s) other work took 0.90 of the 2 cores it was given on n0" in summary
    rows = read_csv(out / "summary.csv")
    assert {r["machine_disturbed"] for r in rows} == {"other work took 0.90 of the 2 cores it was given on n0"}
    assert all(cells[-1] == "machine baseline disturbed" for cells in table_cells(summary.split("\n\n")[2]))
    # the step-time error says what disturbed it
    planned = {"step_time_s": 0.3, "planned_step_time_s": 0.1}
    assert error_cell(planned) == "+200%"
    assert error_cell(planned | {"machine_disturbed": "other work ..."}) == "+200% (machine baseline disturbed)"
    assert error_cell(planned | {"machine_disturbed": "x", "disturbed": "y"}) == (
        "+200% (machine baseline and run disturbed)"
    )


def test_a_baseline_slower_than_every_run_found_the_machine_is_doubted(monkeypatch):
    """Issue 53: a baseline whose model step was far slower than every one of its runs took (each below 75% of the
    step planned at its fast end) did not measure the machine they ran on (a slow minute of a VM's host, which the
    CPU readings cannot see): it is flagged as a disturbed one is (its `disturbed`, which the machine's section
    shows, and every run's error planned from it)."""
    from scalelm.report import steptime
    from scalelm.report.disturbance import baseline_unlike_its_runs

    def plan(total_s, fast=0.8):  # the step the model plans, at the baseline's median and either end of its spread
        ends = {"fast": fast * total_s, "median": total_s, "slow": 1.2 * total_s}
        monkeypatch.setattr(steptime.Speeds, "from_baseline", staticmethod(lambda baseline, at: at))
        monkeypatch.setattr(
            steptime,
            "planned_step",
            lambda run, vocab, at: SimpleNamespace(
                total_s=ends[at], compute_s=ends[at], communication_s={}, bubble_s=0.0, all_to_all_s=0.0
            ),
        )

    def runs(*steps, nodes=1):
        return [SimpleNamespace(vocab_size=5018, figures={"nodes": nodes, "step_time_s": s}) for s in steps]

    plan(0.2)  # fast end 0.16 s: runs of 0.05-0.1 s took at most 50% of the planned step, below the fast end
    baselines, disturbed = [machine_record(), machine_record(world_size=4)], {2: "other work took 0.90 of ..."}
    found = runs(0.05, 0.08, 0.1) + runs(0.05, 0.06, nodes=2)
    verdicts = steptime.add_planned(found, baselines, disturbed)
    reason = (
        "slower than the machine its 3 runs found: each took at most 50% of its planned step, less than the fast end "
        "of the spread"
    )
    assert verdicts[1] == reason + "; measure it again (`snakemake --forcerun machine_baseline`)"
    assert verdicts[2] == "other work took 0.90 of ..."  # two runs: too few to doubt it
    assert disturbed == {2: "other work took 0.90 of ..."}  # the verdicts beside the records, the given ones kept
    assert [run.figures["machine_disturbed"] for run in found] == [verdicts[1]] * 3 + [verdicts[2]] * 2
    assert steptime.error_cell(found[0].figures) == "-75% (machine baseline disturbed)"
    for near, fast in ((0.16, 0.8), (0.145, 0.7)):  # one run within 25% of the plan, or (a wider spread) its fast end
        plan(0.2, fast)
        found = runs(0.05, 0.08, near)
        assert steptime.add_planned(found, [machine_record()], {}) == {1: ""}
        assert {run.figures["machine_disturbed"] for run in found} == {""}

    # the rule alone: rows without a plan do not count
    slow = {"step_time_s": 0.05, "planned_step_time_s": 0.25, "planned_step_time_s_min": 0.2}
    assert baseline_unlike_its_runs([slow] * 3, 0.25).startswith("slower than the machine its 3 runs found")
    assert baseline_unlike_its_runs([slow] * 2 + [{"step_time_s": 0.05}], 0.25) == ""


def test_a_step_beyond_its_goal_and_its_baselines_spread_blames_the_part_furthest_from_its_profile():
    from scalelm.report.steptime import blame, within

    planned = {
        "planned_step_time_s": 0.100,
        "planned_compute_s": 0.080,
        "planned_comm_s": 0.020,
        "planned_bubble_s": 0.0,
        "planned_all_to_all_s": 0.0,
        "planned_step_time_s_min": 0.090,
        "planned_step_time_s_max": 0.140,
    }
    assert within(planned | {"step_time_s": 0.124}) and within(planned | {"step_time_s": 0.139})  # goal; spread
    # 0.2 s: 0.1 s with a collective running (0.08 more than planned), 0.1 s of compute (0.02 more)
    slow_comm = planned | {"step_time_s": 0.2, "comm_share": 0.5}
    assert not within(slow_comm) and blame(slow_comm) == "communication +80.0 ms"
    assert blame(slow_comm | {"all_to_all_share": 0.45, "planned_all_to_all_s": 0.01}) == "all-to-all +80.0 ms"
    assert blame(planned | {"step_time_s": 0.2, "comm_share": 0.1}) == "compute +100.0 ms"
    assert blame(planned | {"step_time_s": 0.2, "comm_share": 0.1, "bubble_measured": 0.5}) == "bubble +100.0 ms"
    assert blame(planned | {"step_time_s": 0.05, "comm_share": 0.1}) == "compute -35.0 ms"  # faster than planned
    assert blame(planned | {"step_time_s": 0.2}) == ""  # unprofiled: its collectives' time unknown
    assert blame(planned | {"step_time_s": 0.12, "comm_share": 0.9}) == ""  # within its goal


def test_mfu_is_reported_under_both_conventions_beside_the_peak(tmp_path):
    """Issue 50: `mfu` counts attention over the whole sequence (the run's recorded flops_per_token, 6,000 here),
    `mfu_causal` the causal half of it as llm.c does: 12 L s d = 1,920 of the model of 2 blocks of width 10 on
    8-token sequences, so 6,000 - 960 = 5,040 FLOPs per token; both at 5,120 tokens/s over the peak, which
    summary.csv names and summary.md states with the conventions."""
    run = RunDir(fake_run(tmp_path, "single", 1))
    run.config.write_text("train:\n  peak_tflops: 0.002\n")
    figures = read_run(run).figures
    assert figures["mfu"] == pytest.approx(6000 * 5120 / 2e9)
    assert figures["mfu_causal"] == pytest.approx(5040 * 5120 / 2e9)
    assert figures["peak_tflops"] == pytest.approx(0.002)
    aggregate([run.path], tmp_path / "summary")
    (row,) = read_csv(tmp_path / "summary" / "summary.csv")
    assert float(row["mfu_causal"]) == pytest.approx(5040 * 5120 / 2e9) and float(row["peak_tflops"]) == 0.002
    text = (tmp_path / "summary" / "summary.md").read_text()
    assert "| mfu | mfu_causal |" in text and "(0.002 TFLOP/s per device;" in text and "`mfu_causal` the causal" in text
    run.config.write_text("train:\n  peak_tflops: null\n")  # an unknown GPU's: neither convention, no note
    figures = read_run(run).figures
    assert figures["mfu"] is figures["mfu_causal"] is figures["peak_tflops"] is None
