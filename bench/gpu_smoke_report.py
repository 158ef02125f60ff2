"""The checks of bench/gpu_smoke.sh, read from what its runs left: one `PASS|FAIL|N/A  name  figure` line each,
OUTDIR/smoke.json with them all; exit status 1 if any failed.

    python3 bench/gpu_smoke_report.py OUTDIR [--cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from bench.argtypes import existing_dir

from scalelm.errors import EXIT_PREEMPTED
from scalelm.train.record import read_metrics, read_record


class NotApplicable(Exception):
    pass


def steady(run: Path) -> dict:
    """Median step figures of a run's logged intervals, the first (start-up, compilation) and profiled ones left
    out; with the run's own results."""
    train = [r for r in read_metrics(run) if r["kind"] == "train"]
    kept = [r for r in train[1:] if not r.get("profiled")] or train[-1:]
    record = asdict(read_record(run))
    figures = {
        k: statistics.median(r[k] for r in kept) for k in ("tokens_per_s", "step_time_s", "peak_mem_mb", "data_share")
    }
    mfu = [r["mfu"] for r in kept if r.get("mfu") is not None]
    return {**figures, "mfu": statistics.median(mfu) if mfu else None, "record": record, "train": train}


def describe(figures: dict) -> str:
    mfu = f", MFU {figures['mfu']:.1%}" if figures["mfu"] is not None else ", MFU n/a"
    return (
        f"{figures['tokens_per_s']:,.0f} tokens/s, {figures['step_time_s'] * 1e3:.1f} ms/step{mfu}, "
        f"peak {figures['peak_mem_mb']:,.0f} MiB, data loading {figures['data_share']:.2%} of the step"
    )


def smi_samples(path: Path) -> list[tuple[float, int, dict]]:
    """nvidia-smi's CSV (timestamp, index, utilisation %, memory used MiB, power W) as (time, index, readings)."""
    samples = []
    for line in path.read_text().splitlines():
        fields = [f.strip() for f in line.split(",")]
        try:
            when = datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            util, memory, power = (float(f) for f in fields[2:5])
        except (ValueError, IndexError):  # a partial last line, "[N/A]"
            continue
        samples.append((when, int(fields[1]), {"util_percent": util, "memory_used_mb": memory, "power_w": power}))
    return samples


class Report:
    def __init__(self, out: Path, cpu: bool):
        self.out, self.cpu, self.runs = out, cpu, out / "runs"
        self.status = {}
        for line in (out / "status").read_text().splitlines():
            name, code, seconds = line.split()
            self.status[name] = (int(code), int(seconds))
        self.results: list[dict] = []

    def exited(self, name: str, expected: int = 0) -> None:
        if name not in self.status:
            raise AssertionError(f"step {name} did not run")
        code, _ = self.status[name]
        if code != expected:
            log = self.out / f"{name}.log"
            tail = log.read_text().strip().splitlines()[-1:] if log.exists() else ["(no log)"]
            raise AssertionError(f"{name} exited {code}, expected {expected}: {tail[0][:200]}")

    def gpu_only(self) -> None:
        if self.cpu:
            raise NotApplicable("GPU only")

    def gpu_runs(self, *names: str) -> list[dict]:
        """The steady figures of runs the GPU mode alone makes, each checked to have finished."""
        self.gpu_only()
        for name in names:
            self.exited(name)
        return [steady(self.runs / name) for name in names]

    def check(self, name: str, check: Callable[[], str]) -> None:
        try:
            status, figure = "PASS", check()
        except NotApplicable as why:
            status, figure = "N/A", str(why)
        except Exception as error:
            status, figure = "FAIL", f"{type(error).__name__}: {error}"[:400]
        self.results.append({"check": name, "status": status, "figure": figure})
        print(f"{status:<4}  {name:<22} {figure}", flush=True)

    # ------------------------------------------------------------------------------------------- checks
    def course(self) -> str:
        """The course model in the device's precision: MFU against a named peak, the plan beside the measured
        state, the monitor's GPU readings, the peak after an evaluation no higher than before it."""
        self.exited("course")
        figures = steady(self.runs / "course")
        results = figures["record"]["results"]
        source = results["peak_flops_source"]
        assert results["mfu"] is not None, f"no MFU (peak source: {source})"
        if not self.cpu:
            assert source.startswith("datasheet"), f"peak not from the GPU table: {source}"
            samples = [json.loads(line) for line in (self.runs / "course/monitor/node0.jsonl").open()]
            gpus = [s["gpus"] for s in samples if s.get("gpus")]
            assert gpus, "the monitor recorded no GPU readings"
        plan, state = results["plan_mb_per_rank"], results["state_mb_per_rank"]
        return (
            f"{describe(figures)}; peak source {source}; state {state['total']:.0f} MiB vs plan "
            f"{plan['state']:.0f} MiB; test loss {results['test']['loss']:.4f}"
        )

    def fp32(self) -> str:
        fp32, bf16 = self.gpu_runs("fp32", "course")
        device = fp32["record"]["device"]
        assert device.get("float32_matmul_precision") == "high", f"fp32 without TF32: {device}"
        return f"{describe(fp32)}; bf16/fp32 tokens/s {bf16['tokens_per_s'] / fp32['tokens_per_s']:.2f}x"

    def course_compiled(self) -> str:
        """The course model compiled (train.compile) beside eager, both bf16."""
        compiled, eager = self.gpu_runs("course_compiled", "course")
        return f"{describe(compiled)}; compiled/eager tokens/s {compiled['tokens_per_s'] / eager['tokens_per_s']:.2f}x"

    def stop_resume(self) -> str:
        """SIGUSR1 -> a checkpoint and exit 75; the rerun resumes from it and finishes."""
        self.exited("stop", EXIT_PREEMPTED)
        self.exited("resume")
        log = (self.out / "resume.log").read_text()
        resumed = [line for line in log.splitlines() if line.startswith("resumed from step")]
        assert resumed, "the rerun did not resume"
        steps = read_record(self.runs / "stop").results.steps
        return f"stopped with exit {EXIT_PREEMPTED}; {resumed[0].split(' in ')[0]}; finished {steps} steps"

    def evaluate_on_cpu(self) -> str:
        """The device-trained model consolidated and evaluated on the CPU: the same test loss as the run's own
        (bf16 evaluation on the GPU against fp32 here: within 1e-2 relative; fp32 on both: 1e-4)."""
        self.exited("consolidate")
        self.exited("evaluate")
        mine = json.loads((self.out / "evaluate_test.json").read_text())["loss"]
        record = json.loads((self.runs / "course/run.json").read_text())
        theirs = record["results"]["test"]["loss"]
        relative = abs(mine - theirs) / theirs
        tolerance = 1e-4 if self.cpu else 1e-2
        assert relative < tolerance, f"CPU evaluation {mine:.5f} vs the run's {theirs:.5f}: {relative:.1e}"
        return f"test loss on CPU {mine:.5f}, in the run {theirs:.5f} ({relative:.1e} relative)"

    def gpt2(self) -> str:
        """The gpt2_small experiment, compiled (as configured) and eager: tokens/s and MFU of each."""
        compiled, eager = self.gpu_runs("gpt2_compiled", "gpt2_eager")
        first = compiled["train"][0]["step_time_s"] * compiled["train"][0]["step"]
        return (
            f"compiled: {describe(compiled)} (first interval {first:.0f} s with compilation); eager: "
            f"{describe(eager)}; compiled/eager {compiled['tokens_per_s'] / eager['tokens_per_s']:.2f}x"
        )

    def gpt2_recompute(self) -> str:
        """gpt2_small compiled with selective activation checkpointing: the memory it saves, the time it costs."""
        recompute, compiled = self.gpu_runs("gpt2_recompute", "gpt2_compiled")
        planned = recompute["record"]["results"]["plan_mb_per_rank"]["total"]
        return (
            f"{describe(recompute)} (plan {planned:,.0f} MiB); against compiled without: peak "
            f"{recompute['peak_mem_mb'] / compiled['peak_mem_mb']:.2f}x, tokens/s "
            f"{recompute['tokens_per_s'] / compiled['tokens_per_s']:.2f}x"
        )

    def plan_vs_peak(self) -> str:
        """scalelm.plan's peak beside the largest allocation CUDA measured (steady intervals), for the eager runs
        of one process (within 30%); the compiled ones reported, not checked (the plan does not model
        compilation). On one GPU every layout is one process: DDP and FSDP need two ranks or more."""
        self.gpu_only()
        figures, failed = [], []
        for name, checked in (
            ("course", 1),
            ("fp32", 1),
            ("gpt2_eager", 1),
            ("course_compiled", 0),
            ("gpt2_compiled", 0),
            ("gpt2_recompute", 0),
        ):
            self.exited(name)
            run = steady(self.runs / name)
            planned = run["record"]["results"]["plan_mb_per_rank"]["total"]
            ratio = planned / run["peak_mem_mb"]
            figures.append(f"{name} {planned:,.0f}/{run['peak_mem_mb']:,.0f} MiB ({ratio:.2f})")
            if checked and not 0.7 <= ratio <= 1.3:
                failed.append(name)
        assert not failed, f"plan off by more than 30% for {failed}: " + "; ".join(figures)
        return "planned/measured: " + "; ".join(figures)

    def monitor_vs_smi(self) -> str:
        """The monitor's GPU readings (NVML through nvidia-ml-py) beside nvidia-smi's nearest sample (within
        0.25 s): memory within 2% or 256 MiB, power and utilisation reported by their median difference."""
        self.gpu_only()
        smi = smi_samples(self.out / "nvidia_smi.csv")
        assert smi, "nvidia-smi recorded nothing"
        pairs = []
        for path in sorted(self.runs.glob("*/monitor/node*.jsonl")):
            for sample in map(json.loads, path.open()):
                for index, gpu in enumerate(sample.get("gpus") or []):
                    near = min(smi, key=lambda s: abs(s[0] - sample["time"]) + (s[1] != index) * 1e9)
                    if abs(near[0] - sample["time"]) <= 0.25 and near[1] == index:
                        pairs.append((gpu, near[2]))
        assert len(pairs) >= 10, f"only {len(pairs)} monitor samples near an nvidia-smi sample"

        def median_difference(key: str) -> float:
            return statistics.median(
                abs(mine[key] - theirs[key]) for mine, theirs in pairs if mine.get(key) is not None
            )

        memory = [abs(m["memory_used_mb"] - t["memory_used_mb"]) / max(t["memory_used_mb"], 1) for m, t in pairs]
        within = sum(
            d <= 0.02 or abs(m["memory_used_mb"] - t["memory_used_mb"]) <= 256 for d, (m, t) in zip(memory, pairs)
        )
        assert within >= 0.9 * len(pairs), f"memory agrees in {within} of {len(pairs)} pairs"
        return (
            f"{len(pairs)} pairs: memory within 2% or 256 MiB in {within}; median |difference| memory "
            f"{median_difference('memory_used_mb'):.0f} MiB, power {median_difference('power_w'):.0f} W, "
            f"utilisation {median_difference('util_percent'):.0f} points"
        )

    def compiled_cpu(self) -> str:
        """On CPU: the tiny model trained compiled end to end, its loss beside the eager course run's."""
        if not self.cpu:
            raise NotApplicable("CPU mode only (the GPU runs gpt2_small compiled)")
        self.exited("compiled")
        compiled, eager = steady(self.runs / "compiled"), steady(self.runs / "course")
        a, b = compiled["record"]["results"]["final_train_loss"], eager["record"]["results"]["final_train_loss"]
        return f"{describe(compiled)}; final train loss {a:.4f} (eager run with evaluations and checkpoints: {b:.4f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=existing_dir, help="the directory bench/gpu_smoke.sh wrote")
    parser.add_argument("mode", nargs="?", choices=["gpu"], help="the GPU's checks (the default)")
    parser.add_argument("--cpu", action="store_true", help="the CPU mode's checks")
    args = parser.parse_args(argv)
    out, cpu = args.out, args.cpu
    if not (out / "status").is_file():
        parser.error(f"{out} holds no status file: give the directory bench/gpu_smoke.sh wrote its steps into")
    report = Report(out, cpu)
    for name in (
        "course",
        "fp32",
        "course_compiled",
        "stop_resume",
        "evaluate_on_cpu",
        "gpt2",
        "gpt2_recompute",
        "plan_vs_peak",
        "monitor_vs_smi",
        "compiled_cpu",
    ):
        report.check(name, getattr(report, name))
    (out / "smoke.json").write_text(json.dumps(report.results, indent=2) + "\n")
    counts = {s: sum(r["status"] == s for r in report.results) for s in ("PASS", "FAIL", "N/A")}
    print(f"smoke ({'cpu' if cpu else 'gpu'}): {counts['PASS']} passed, {counts['FAIL']} failed, {counts['N/A']} n/a")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
