"""What lifts gpt2_small's MFU on one GPU, measured in one process: each variant of the experiment of
config/config.yaml (one lever changed, or two together) built as the training builds it and stepped by the training's
own step, then the variants interleaved, A/B/A/B: each runs `--steps` steps in turn, `--rounds` times, timed with CUDA
events, so that a lever of 0.5-2 points stands above the spread between runs (../shared/notes/gpu-review-3.md,
finding 15: separate runs of 60 steps differ by ~3%). No run directory, data loading, evaluation or checkpoint: the
figures are the steps' alone, each variant compiled once (at its warm-up), never again for an evaluation.

    PYTHONPATH=src:. python3 bench/gpu_mfu.py OUTDIR [--cpu] [--only NAME ...] [--rounds 5] [--steps 20]

OUTDIR/mfu.json is written after each variant's warm-up and after each round, so a cut-off call keeps what it measured.
--cpu: a tiny model and few steps, a dry run of the harness itself (CI); the GPU-only variants are left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml
from bench.argtypes import count, output_dir
from bench.throughput import VOCAB

from scalelm.config import Config, load_config
from scalelm.measure.peak import mfu, peak_flops
from scalelm.model.architecture import flops_per_token
from scalelm.model.transformer import TransformerLM
from scalelm.optim import build_optimizer, build_scheduler, scaled_lr
from scalelm.parallel.env import DistEnv
from scalelm.parallel.runtime import ModelOptions, Parallel
from scalelm.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]

# name: the settings changed from the experiment as configured (docs/benchmarks.md names each lever's expected gain)
VARIANTS = {
    "configured": [],
    "cudnn_attention": ["train.attention_kernels=auto"],
    "bf16_params": ["train.precision=bf16_params"],
    "compiled_optimizer": ["train.compile_optimizer=true"],
    "bf16_params+compiled_optimizer": ["train.precision=bf16_params", "train.compile_optimizer=true"],  # config.yaml's
    "chunked_loss": ["train.fused_loss=chunked"],  # on request (--only): check E's limit holds four variants
    "batch16": ["batch.size=16"],
    "max_autotune": ["train.compile_mode=max-autotune-no-cudagraphs"],  # minutes of compiling: not in check E
}
GPU_ONLY = {"bf16_params", "bf16_params+compiled_optimizer", "max_autotune"}  # bf16 is refused on a CPU
LEVERS = ["configured", "bf16_params", "compiled_optimizer", "bf16_params+compiled_optimizer"]  # check E's on a GPU
CPU_LEVERS = ["configured", "cudnn_attention"]  # two variants (the second a no-op on CPU): the harness's structure
TINY = [
    "device=cpu",
    "train.precision=fp32",
    "model.d_model=64",
    "model.n_heads=2",
    "model.n_layers=1",
    "model.d_ff=128",
    "batch.size=4",
    "data.seq_len=32",
    "train.compile=false",
]


def experiment_config(settings: list[str], work: Path, experiment: str = "gpt2_small") -> Config:
    """`experiment`'s training settings as config/config.yaml has them, with `settings` changed."""
    training = yaml.safe_load((REPO / "config" / "config.yaml").read_text())["experiments"][experiment]["training"]
    path = work / f"{experiment}.yaml"
    path.write_text(yaml.safe_dump(training))
    return load_config(path, settings)


def random_batches(config: Config, dp_size: int, vocab_size: int, device: torch.device, seed: int = 0) -> list:
    """One optimizer step's micro-batches of random tokens, on the device: the (inputs, targets) pairs of its batch."""
    global_batch, micro = config.batch.sizes(dp_size)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (global_batch, config.data.seq_len + 1), generator=generator).to(device)
    return [(rows[:, :-1], rows[:, 1:]) for rows in tokens.split(micro)]


def one_process(device: torch.device) -> DistEnv:
    """This process as a world of one (no torchrun), on `device`."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return DistEnv(rank=0, local_rank=0, world_size=1, device=device)


class Stepper(Trainer):
    """A model, optimizer and schedule built as scalelm.train.engine.Engine builds them, and the Trainer's own
    optimizer step (forward and backward of each micro-batch, clipping, the optimizer's step as the run takes it):
    training steps without the run around them (no run directory, data, evaluation, checkpoints or measurements)."""

    def __init__(self, config: Config, env: DistEnv, vocab_size: int, total_steps: int):
        # not Engine.__init__, which builds a whole run: its lines that build the model, optimizer and schedule
        self.config, self.env = config, env
        self.parallel = Parallel.start(config, env, vocab_size)
        make = lambda: TransformerLM(config.model, vocab_size)
        self.model = self.parallel.build(make, config.seed, ModelOptions.of(config.train))
        lr = scaled_lr(config.optim, config.batch, self.parallel.dims.dp_size)
        compiled = config.train.compile_optimizer
        self.optimizer = build_optimizer(self.model, config.optim, lr, compiled=compiled)
        self.scheduler = build_scheduler(self.optimizer, config.optim, total_steps)
        self.prepare_steps()
        self.state = SimpleNamespace(step=0)
        self.instruments = SimpleNamespace(note_state=lambda model, optimizer: None)

    def step(self, micro_batches: list) -> torch.Tensor:
        """One optimizer step (Trainer.train_step); its loss, on the device."""
        loss, _ = self.train_step(micro_batches)
        self.state.step += 1
        return loss


class Variant:
    """One variant's stepper, its batch, and what was measured of it."""

    def __init__(self, name: str, config: Config, env: DistEnv, total_steps: int):
        self.name, self.config, self.device = name, config, env.device
        self.stepper = Stepper(config, env, VOCAB, total_steps)
        dp_size = self.stepper.parallel.dims.dp_size
        self.batches = random_batches(config, dp_size, VOCAB, env.device)
        self.tokens_per_step = sum(inputs.numel() for inputs, _ in self.batches)
        self.flops_per_token = flops_per_token(config.model, VOCAB, config.data.seq_len)
        self.peak, _ = peak_flops(env.device, self.stepper.parallel.precision, config.train.peak_tflops)
        self.seconds: list[float] = []  # of each round's steps
        self.transient_mb: list[float] = []

    def steps(self, n: int) -> torch.Tensor:
        """n steps; their summed loss (on the device, unread)."""
        return sum(self.stepper.step(self.batches) for _ in range(n))

    def timed(self, n: int) -> float:
        """n steps timed on the device (CUDA events, after the device finished what came before), or by the host's
        clock on CPU; the loss checked finite after them."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            resident = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = self.steps(n)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
            self.transient_mb.append((torch.cuda.max_memory_allocated() - resident) / 2**20)
        else:
            began = time.perf_counter()
            loss = self.steps(n)
            seconds = time.perf_counter() - began
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"{self.name}: non-finite loss {float(loss)} after {self.stepper.state.step} steps"
            )
        self.seconds.append(seconds)
        return seconds

    def figures(self, steps: int) -> dict:
        """Tokens/s and MFU per round, their median and spread."""
        rates = [self.tokens_per_step * steps / s for s in self.seconds]
        mfus = [mfu(self.flops_per_token, rate, 1, self.peak) for rate in rates]
        known = [m for m in mfus if m is not None]
        return {
            "rounds": len(rates),
            "steps_measured": steps * len(rates),
            "tokens_per_s": statistics.median(rates) if rates else None,
            "tokens_per_s_rounds": [round(r) for r in rates],
            "mfu": statistics.median(known) if known else None,
            "mfu_spread_points": 100 * (max(known) - min(known)) if known else None,
            "step_ms": 1000 * statistics.median(s / steps for s in self.seconds) if self.seconds else None,
            "transient_peak_mb": max(self.transient_mb) if self.transient_mb else None,
        }


def measure(
    names: list[str],
    cpu: bool,
    work: Path,
    rounds: int,
    steps: int,
    warmup: int,
    on_progress: Callable[[dict], None] = lambda results: None,
) -> dict:
    """Each variant built and warmed up (its compile) in turn, then all interleaved for `rounds` rounds of `steps`
    steps; `on_progress(results)` after each warm-up and each round. A variant that fails is reported and left out."""
    env = one_process(torch.device("cpu") if cpu else torch.device("cuda", 0))
    results: dict[str, dict] = {}
    variants: dict[str, Variant] = {}
    for name in names:
        settings = VARIANTS[name] + (TINY if cpu else ["device=cuda"])
        began = time.perf_counter()
        try:
            variant = Variant(name, experiment_config(settings, work), env, warmup + rounds * steps)
            variant.steps(warmup)
            if env.device.type == "cuda":
                torch.cuda.synchronize()
            variants[name] = variant
            results[name] = {
                "settings": VARIANTS[name],
                "tokens_per_step": variant.tokens_per_step,
                "build_and_warmup_s": round(time.perf_counter() - began, 1),
            }
        except Exception as error:  # the others still measured
            results[name] = {"settings": VARIANTS[name], "error": f"{type(error).__name__}: {error}"[:2000]}
            (work / f"mfu.{name}.traceback.txt").write_text(traceback.format_exc())
        on_progress(results)
    for _ in range(rounds):
        for name, variant in list(variants.items()):
            try:
                variant.timed(steps)
            except Exception as error:
                results[name]["error"] = f"{type(error).__name__}: {error}"[:2000]
                (work / f"mfu.{name}.traceback.txt").write_text(traceback.format_exc())
                del variants[name]
                continue
            results[name].update(variant.figures(steps))
        compare(results)
        on_progress(results)
    return results


def compare(results: dict) -> None:
    """Each lever's median MFU against the configured one's, in points, and whether the difference stands above the
    spread of both (max - min over the rounds)."""
    base = results.get("configured", {})
    if base.get("mfu") is None:
        return
    for name, figures in results.items():
        if name == "configured" or figures.get("mfu") is None:
            continue
        gain = 100 * (figures["mfu"] - base["mfu"])
        figures["vs_configured_points"] = round(gain, 3)
        figures["resolved"] = abs(gain) > max(figures["mfu_spread_points"], base["mfu_spread_points"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=output_dir)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), help="variants (default: check E's levers)")
    parser.add_argument("--rounds", type=count(2), default=5, help="interleaved rounds (at least 2: a spread)")
    parser.add_argument("--steps", type=count(1), default=20, help="steps of a variant in each round")
    parser.add_argument("--warmup", type=count(1), default=5, help="steps before measuring (compilation)")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device is visible; run with --cpu for a dry run")
    names = [n for n in args.only or (CPU_LEVERS if args.cpu else LEVERS) if not (args.cpu and n in GPU_ONLY)]
    args.out.mkdir(parents=True, exist_ok=True)

    def write(results: dict) -> None:
        (args.out / "mfu.json").write_text(json.dumps(results, indent=2) + "\n")

    results = measure(names, args.cpu, args.out, args.rounds, args.steps, args.warmup, write)
    for name, figures in results.items():
        line = figures.get("error") or (
            f"{figures['tokens_per_s']:,.0f} tokens/s, MFU {100 * (figures['mfu'] or 0):.2f}% "
            f"(spread {figures['mfu_spread_points'] or 0:.2f} points over {figures['rounds']} rounds)"
        )
        print(f"{name:<32} {line}", flush=True)
    return 0 if names and all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
