"""Single-process training throughput (tokens/s) and model-FLOPs utilisation (MFU) on this machine.

    python bench/throughput.py [--steps N] [--warmup W] [--threads T] [--models a,b] [--json OUT] [--profile OUT]

1. Measures the fp32 matrix-multiply rate of this machine, now, in this process: the best of several timed square
   matmuls (FLOP = 2mnk) over a few sizes. That rate is the MFU denominator. The rates of the model's own GEMM
   shapes (output projection forward, and both of its backward products) are reported alongside, for reference.
2. Trains each model for W warm-up plus N timed steps through scalelm's real code path: a `Trainer` (the
   single-device layout, TransformerLM, AdamW + the LR scheduler, cross-entropy) built over a temporary prepared
   data set of random token ids of the right vocabulary, fed by `scalelm.data.TrainBatches` and stepped with
   `Trainer.train_step`. Producing each batch (the data loading) is timed separately from the step.
3. Reports tokens/s, step time, the data-loading share of step time, model FLOPs per token
   (`scalelm.model.architecture.flops_per_token`: 6 x matmul parameters + the attention term, as nanoGPT and PaLM count
   them), the achieved FLOP/s and MFU = achieved / measured matmul rate.

Models: (a) d_model 200, 2 heads, 2 layers, d_ff 200, dropout 0.2, seq_len 35, batch 20: the shape of
pytorch/examples word_language_model's Transformer (emsize = nhid = 200, nhead 2, bptt 35); (b) the course
defaults (d_model 128, 4 heads, 2 layers, d_ff 2048, dropout 0.1, seq_len 32, batch 512). Both use the WikiText-2
vocabulary size, 33,278. On a shared machine, check `uptime` first: other processes lower every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from scalelm.config import BatchConfig, CheckpointConfig, Config, DataConfig, ModelConfig, TrainConfig
from scalelm.data.prepared import load_prepared, write_prepared
from scalelm.model.architecture import flops_per_token
from scalelm.model.cpu_ops import LinearCrossEntropy
from scalelm.model.transformer import count_parameters
from scalelm.parallel.env import setup, teardown
from scalelm.parallel.runtime import Parallel
from scalelm.train.engine import train_batches
from scalelm.train.trainer import Trainer

VOCAB = 33_278  # WikiText-2 (raw, min-freq 1) vocabulary, as prepared by scalelm.data.prepare
TRAIN_TOKENS = 2_088_628  # the size of WikiText-2's train split

MODELS: dict[str, dict[str, Any]] = {
    "a": {
        "label": "(a) d200 L2 T35 B20",
        "model": {"d_model": 200, "n_heads": 2, "n_layers": 2, "d_ff": 200, "dropout": 0.2},
        "seq_len": 35,
        "batch": 20,
    },
    "b": {
        "label": "(b) course d128 L2 T32 B512",
        "model": {"d_model": 128, "n_heads": 4, "n_layers": 2, "d_ff": 2048, "dropout": 0.1},
        "seq_len": 32,
        "batch": 512,
    },
}


# ----------------------------------------------------------------------------------------------- matmul rate
def _best_seconds(fn, reps: int, min_time: float = 0.0) -> float:
    best, total, n = float("inf"), 0.0, 0
    while n < reps or total < min_time:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, total, n = min(best, took), total + took, n + 1
    return best


def gemm_rate(m: int, n: int, k: int, reps: int, a_t: bool = False, b_t: bool = False, ld: int = 0) -> float:
    """FLOP/s of the best of `reps` timed (m x k) @ (k x n) products, operands optionally transposed views,
    the result optionally written with row stride `ld` > n (as the fused loss's padded workspace is)."""
    a = torch.randn(k, m).t() if a_t else torch.randn(m, k)
    b = torch.randn(n, k).t() if b_t else torch.randn(k, n)
    out = torch.empty(m, max(ld, n))[:, :n]
    for _ in range(2):
        torch.mm(a, b, out=out)
    return 2 * m * n * k / _best_seconds(lambda: torch.mm(a, b, out=out), reps, min_time=0.5)


def square_rates(reps: int) -> dict[str, float]:
    return {str(s): gemm_rate(s, s, s, reps) for s in (512, 1024, 2048, 3072)}


def matmul_rates(reps: int) -> dict[str, Any]:
    square = square_rates(reps)
    d, n = MODELS["a"]["model"]["d_model"], MODELS["a"]["batch"] * MODELS["a"]["seq_len"]
    k = LinearCrossEntropy.columns(d)  # the fused loss's operands carry the bias and a column of ones
    shapes = {  # model (a)'s output projection, the bulk of its FLOPs: m x n result, inner dimension k
        f"logits x.W^T {n}x{VOCAB} k={d} (autograd's layout)": gemm_rate(n, VOCAB, d, reps, b_t=True),
        f"logits W.x^T {VOCAB}x{n} k={d} (contiguous)": gemm_rate(VOCAB, n, d, reps, b_t=True),
        f"logits A.X^T {VOCAB}x{n} k={k} (fused, ld {n + 4})": gemm_rate(VOCAB, n, k, reps, b_t=True, ld=n + 4),
        f"input grad e^T.A {n}x{k} k={VOCAB} (fused)": gemm_rate(n, k, VOCAB, reps, a_t=True),
        f"weight grad e.X {VOCAB}x{k} k={n} (fused)": gemm_rate(VOCAB, k, n, reps),
    }
    return {"peak_flops": max(square.values()), "square": square, "model_shapes": shapes}


class CpuMeter:
    """CPU time other processes (and the hypervisor, as steal) took while we measured, as a share of all CPUs."""

    def __init__(self) -> None:
        self.start = self._read()

    @staticmethod
    def _read() -> tuple[float, list[int], float] | None:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        except (OSError, ValueError):
            return None
        return time.perf_counter(), fields, time.process_time()

    def shares(self) -> dict[str, float] | None:
        end = self._read()
        if self.start is None or end is None:
            return None
        hz, cpus = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
        (t0, f0, p0), (t1, f1, p1) = self.start, end
        delta = [b - a for a, b in zip(f0, f1)]
        user, nice, system, _idle, _iowait, irq, softirq, steal = delta
        busy = (user + nice + system + irq + softirq) / hz
        capacity = (t1 - t0) * cpus
        return {"others": max(0.0, busy - (p1 - p0)) / capacity, "steal": steal / hz / capacity}


# ----------------------------------------------------------------------------------------------- training
def make_prepared(directory: Path, seed: int = 0, patterned: bool = False, eval_tokens: int = 10_000) -> Path:
    """A prepared-data directory as scalelm.data.prepare writes it, holding ids of the WikiText-2 vocabulary:
    uniformly random, or `patterned` (`patterned_tokens`: learnable); `eval_tokens` in each evaluation split."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    sizes = {"train": TRAIN_TOKENS, "validation": eval_tokens, "test": eval_tokens}
    draw = patterned_tokens if patterned else lambda n, g: torch.randint(0, VOCAB, (n,), generator=g, dtype=torch.int32)
    tokens = {split: draw(n, generator).to(torch.int32) for split, n in sizes.items()}
    source = {"benchmark": "patterned" if patterned else "random"}
    write_prepared(directory, tokens, [f"w{i}" for i in range(VOCAB)], source)
    return directory


PATTERN_IDS = 64  # the ids patterned data uses: a model learns to predict only these within a few steps


def patterned_tokens(n: int, generator: torch.Generator) -> torch.Tensor:
    """`n` ids in which each is a fixed function of the one before: a random cycle through PATTERN_IDS ids of the
    vocabulary, entered at a random point. Uniformly random ids cannot be learnt (every model, broken or not, stays
    near ln V); on these the loss falls by several nats in 10-20 steps (to ln PATTERN_IDS, then towards 0), so a
    run whose gradients are wrong falls differently."""
    ids = torch.randperm(VOCAB, generator=generator)[:PATTERN_IDS]  # in cycle order
    start = int(torch.randint(0, PATTERN_IDS, (1,), generator=generator))
    return ids[(start + torch.arange(n)) % PATTERN_IDS]


def build_config(spec: dict[str, Any], prepared: Path, run_dir: Path, steps: int) -> Config:
    return Config(
        run_dir=str(run_dir),
        device="cpu",
        data=DataConfig(prepared_dir=str(prepared), seq_len=spec["seq_len"]),
        model=ModelConfig(**spec["model"]),
        batch=BatchConfig(size=spec["batch"]),
        train=TrainConfig(epochs=1, max_steps=steps, precision="fp32"),
        checkpoint=CheckpointConfig(every=None),
    )


def bench_model(name: str, prepared: Path, workdir: Path, warmup: int, steps: int, profile: Path | None) -> dict:
    spec = MODELS[name]
    config = build_config(spec, prepared, workdir / f"run-{name}", warmup + steps)
    env = setup("cpu", timeout_s=60)
    data = load_prepared(prepared)
    parallel = Parallel.start(config, env, data.vocab_size)
    trainer = Trainer(config, env, parallel, data, train_batches(config, parallel, data))
    trainer.stop.restore()
    batches = trainer.batches.epoch(0)
    data_s, step_s, losses = [], [], []
    faults = 0
    profiler = None
    for i in range(warmup + steps):
        if profile is not None and i == warmup:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
            profiler.__enter__()
        if i == warmup:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            meter = CpuMeter()
        start = time.perf_counter()
        micro_batches = next(batches)
        loaded = time.perf_counter()
        loss, _ = trainer.train_step(micro_batches)
        losses.append(loss.item())  # the CPU is synchronous: .item() only reads the finished value
        done = time.perf_counter()
        if i >= warmup:
            data_s.append(loaded - start)
            step_s.append(done - start)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    interference = meter.shares()
    if profiler is not None:
        profiler.__exit__(None, None, None)
        table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)
        profile.write_text(table + "\n")
        print(f"profile of {steps} steps of model ({name}) written to {profile}")

    tokens = spec["batch"] * spec["seq_len"]
    step_median = statistics.median(step_s)
    fpt = flops_per_token(config.model, VOCAB, spec["seq_len"])
    return {
        "model": name,
        "label": spec["label"],
        "config": {**spec["model"], "seq_len": spec["seq_len"], "batch": spec["batch"], "vocab": VOCAB},
        "parameters": count_parameters(trainer.model),
        "tokens_per_step": tokens,
        "steps": steps,
        "warmup": warmup,
        "step_s_median": step_median,
        "step_s_min": min(step_s),
        "step_s_max": max(step_s),
        "data_s_median": statistics.median(data_s),
        "data_share": sum(data_s) / sum(step_s),
        "page_faults_per_step": faults / steps,
        "cpu_taken_by_others": interference,
        "tokens_per_s": tokens / step_median,
        "flops_per_token": fpt,
        "flops_per_s": fpt * tokens / step_median,
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()),
    }


def report(result: dict[str, Any]) -> str:
    m, rates = result["machine"], result["matmul"]

    def rates_line(measured: dict[str, float]) -> str:
        return ", ".join(f"{size}^3 {rate / 1e9:.1f}" for size, rate in measured.items())

    lines = [
        (
            f"machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['threads']} threads; torch {m['torch']}; "
            f"load average at start {m['load_average'][0]:.2f}"
        ),
        f"fp32 square matmuls, best of several (GFLOP/s): {rates_line(rates['square'])}",
        *(
            f"  again after model {i + 1}: {rates_line(again)}"
            for i, again in enumerate(rates["square_after_each_model"])
        ),
        f"  -> peak {rates['peak_flops'] / 1e9:.1f} GFLOP/s, the best of the run: the MFU denominator",
        "model (a)'s output-projection GEMMs (GFLOP/s):",
        *(f"  {name:<48}{rate / 1e9:>7.1f}" for name, rate in rates["model_shapes"].items()),
        "",
        (
            f"{'model':<30}{'tokens/s':>10}{'step ms':>9}{'min ms':>8}{'data %':>8}{'faults':>8}{'others %':>9}"
            f"{'MFLOP/tok':>11}{'GFLOP/s':>9}{'MFU':>7}{'best':>7}"
        ),
    ]
    for r in result["models"]:
        others = r["cpu_taken_by_others"]
        others = f"{100 * (others['others'] + others['steal']):>8.1f}%" if others else f"{'?':>9}"
        lines.append(
            f"{r['label']:<30}{r['tokens_per_s']:>10,.0f}{r['step_s_median'] * 1e3:>9.1f}{r['step_s_min'] * 1e3:>8.1f}"
            f"{100 * r['data_share']:>7.2f}%{r['page_faults_per_step']:>8.0f}{others}"
            f"{r['flops_per_token'] / 1e6:>11.2f}{r['flops_per_s'] / 1e9:>9.1f}{100 * r['mfu']:>6.1f}%"
            f"{100 * r['mfu_best_step']:>6.1f}%"
        )
    first = result["models"][0]
    lines += [
        f"step ms: median of {first['steps']} steps after {first['warmup']} warm-up; tokens/s, GFLOP/s and MFU use it.",
        "min ms / best: the fastest step, and the MFU it would give. data %: share of step time spent producing the",
        "batch. faults: minor page faults per step. others %: CPU time other processes and the hypervisor (steal)",
        "took during the timed steps, as a share of all CPUs: above a few % the figures are pessimistic; repeat.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from argtypes import count, names, output_file  # here: the module is imported as bench.throughput too

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=count(1), default=20, help="timed steps per model (default: %(default)s)")
    parser.add_argument("--warmup", type=count(0), default=3, help="untimed steps first (default: %(default)s)")
    parser.add_argument("--threads", type=count(1), help="torch intra-op threads (default: torch's choice)")
    parser.add_argument(
        "--models",
        type=names(MODELS, "model"),
        default="a,b",
        help="comma-separated subset of: a, b (default: %(default)s)",
    )
    parser.add_argument("--matmul-reps", type=count(1), default=5, help="timed repetitions per matmul size")
    parser.add_argument("--json", type=output_file, help="also write the results here")
    parser.add_argument(
        "--profile", type=output_file, help="write a torch.profiler table of model (a)'s timed steps here"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    result: dict[str, Any] = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "machine": machine()}
    result["matmul"] = matmul_rates(args.matmul_reps)
    with tempfile.TemporaryDirectory(prefix="scalelm-bench-") as tmp:
        prepared = make_prepared(Path(tmp) / "prepared")
        try:
            models = []
            for name in args.models:
                profile = args.profile if name == "a" else None
                models.append(bench_model(name, prepared, Path(tmp), args.warmup, args.steps, profile))
                # the machine's speed drifts: measure again, and divide by the best rate seen in the whole run
                again = square_rates(max(2, args.matmul_reps // 2))
                result["matmul"].setdefault("square_after_each_model", []).append(again)
                result["matmul"]["peak_flops"] = max(result["matmul"]["peak_flops"], *again.values())
        finally:
            teardown()
    for r in models:
        r["mfu"] = r["flops_per_s"] / result["matmul"]["peak_flops"]
        r["mfu_best_step"] = (
            r["flops_per_token"] * r["tokens_per_step"] / r["step_s_min"] / result["matmul"]["peak_flops"]
        )
    result["models"] = models
    result["machine"]["load_average_end"] = list(os.getloadavg())
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
