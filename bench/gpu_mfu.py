"""What lifts gpt2_small's MFU on one GPU, measured in one process: each variant of the experiment of
config/config.yaml (one lever changed, or two together) built as the training builds it and stepped by the training's
own step, then the variants interleaved, A/B/A/B: each runs `--steps` steps in turn, `--rounds` times, timed with CUDA
events, so that a lever of 0.5-2 points stands above the spread between runs (separate runs of 60 steps of the same
experiment have differed by ~3% in tokens/s). No run directory, data loading, evaluation or checkpoint: the figures
are the steps' alone, each variant compiled once (at its warm-up), never again for an evaluation.

    PYTHONPATH=src:. python3 bench/gpu_mfu.py OUTDIR [--cpu] [--only NAME ...] [--rounds 5] [--steps 20] [--budget-s S]
    PYTHONPATH=src:. python3 bench/gpu_mfu.py OUTDIR --warm-only --only NAME [--only NAME ...] [--cpu] [--warmup 2]

The variants are built in turn, and a round is played after each warm-up from the second on, so that the first two
(the experiment as configured and its first lever) are compared as soon as both are warm and a call cut off keeps
A/B rounds; then rounds until every variant has `--rounds`. With `--budget-s` no build and no round starts that its
estimate (from the builds and turns measured so far) says cannot end in the time left: a variant left out says
`skipped`, one whose rounds were cut says `cut_short`. OUTDIR/mfu.json is written after each warm-up, skip and round,
so a cut-off call keeps what it measured.

--warm-only (a compile farm's process: the Inductor and AOT-autograd caches it fills are the ones a later call hits)
builds and warms up the named variants exactly as a measuring call does, and times nothing: mfu.json holds their
compile figures. A variant configured to compile whose step ran uncompiled (dynamo made no graph for it, or ran its
frames eagerly past the recompile limit) is an error, not a slow lever. --cpu: a tiny model and few steps, a dry run
of the harness itself (CI), uncompiled; the GPU-only variants are left out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml
from bench.argtypes import count, output_dir, positive
from bench.throughput import VOCAB

from scalelm.config import Config, load_config
from scalelm.measure.baseline.gpu_health import HealthSampler, open_health_reader, worst_health
from scalelm.measure.peak import causal_flops_per_token, mfu, peak_flops
from scalelm.model.architecture import flops_per_token
from scalelm.model.transformer import TransformerLM
from scalelm.optim import build_optimizer, build_scheduler, scaled_lr
from scalelm.parallel.env import DistEnv
from scalelm.parallel.runtime import ModelOptions, Parallel
from scalelm.train.provenance import cpu_model, driver_version
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
TINY = [  # the --cpu base, under each variant's own settings
    "device=cpu",
    "train.precision=fp32",
    "model.d_model=64",
    "model.n_heads=2",
    "model.n_layers=1",
    "model.d_ff=128",
    "batch.size=4",
    "data.seq_len=32",
    "train.compile=false",  # Inductor's C++ build of even this model takes a minute: the dry run runs eagerly
]
MARGIN = 1.2  # on every estimate of a build or a round: a build that hits the caches varies by ~10-20%
clock = time.perf_counter  # the host's clock of builds, turns and the budget (a test's fake one)
HEALTH_SAMPLE_S = 0.1  # NVML's clock read on a thread during each turn: often enough for a 1-2 s turn, cheap
# the profiler's ranges around each run of dynamo's compiled code, and of AOT autograd's compiled forward (either one
# proves that compiled code ran: two names, so that a torch that renames one does not fail every compiled variant)
COMPILED_RANGES = ("Torch-Compiled Region", "CompiledFunction")
COMPILE_PHASES = {  # compile_times()' entries, per phase: dynamo with the forward's backend, the backward's backend
    "dynamo_and_forward_s": "_compile.compile_inner",
    "backward_s": "compile_fx.<locals>.bw_compiler",
}


def experiment_config(settings: list[str], work: Path, experiment: str = "gpt2_small") -> Config:
    """`experiment`'s training settings as config/config.yaml has them, with `settings` changed."""
    training = yaml.safe_load((REPO / "config" / "config.yaml").read_text())["experiments"][experiment]["training"]
    path = work / f"{experiment}.yaml"
    path.write_text(yaml.safe_dump(training))
    return load_config(path, settings)


def variant_settings(name: str, cpu: bool) -> list[str]:
    """The variant's settings on the device: on CPU over the tiny base, so that a variant's own setting wins."""
    return TINY + VARIANTS[name] if cpu else ["device=cuda", *VARIANTS[name]]


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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


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


# --- compilation -----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def compile_guard(variants: int) -> Iterator[None]:
    """Dynamo as a training process has it, for `variants` variants in this one process: every compiled module shares
    one code object (nn.Module._call_impl), so each variant's guards add entries where a training process has one
    variant's, and the recompile limit is scaled to match; a variant past it fails (fail_on_recompile_limit_hit)
    instead of running its frames eagerly and reading as a slow lever; a shape another variant compiled first is
    compiled again for this one's shape, as a training process compiles it, not made dynamic. All three are
    runtime settings, outside the FX-graph and AOT-autograd caches' keys: a farm's entries still hit."""
    import torch._dynamo.config as dynamo

    limit = dynamo.recompile_limit * variants
    with dynamo.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True, automatic_dynamic_shapes=False):
        yield


def dynamo_tally() -> dict[str, float]:
    """Dynamo's process-wide counts and compile seconds so far (a variant's figures are their difference over its
    build and warm-up); a counter this torch does not keep reads 0."""
    from torch._dynamo import convert_frame, utils

    counters = utils.counters  # name: Counter, both made on first use
    attempts = getattr(convert_frame, "FRAME_COMPILE_COUNTER", {})  # frame: its compiles so far
    try:
        headers, values = utils.compile_times("csv", aggregate=True)
        seconds = dict(zip(headers, map(float, values)))
    except Exception:  # a torch whose compile_times answers otherwise: the wall seconds still stand
        seconds = {}
    return {
        "unique_graphs": counters["stats"]["unique_graphs"],
        "recompiles": sum(attempts.values()) - len(attempts),  # compiles of a frame after its first
        "frames_eager": counters["frames"]["total"] - counters["frames"]["ok"],  # frames dynamo gave up on
        "fx_graph_cache_hits": counters["inductor"]["fxgraph_cache_hit"],
        "fx_graph_cache_misses": counters["inductor"]["fxgraph_cache_miss"],
        "aot_autograd_cache_hits": counters["aot_autograd"]["autograd_cache_hit"],
        "aot_autograd_cache_misses": counters["aot_autograd"]["autograd_cache_miss"],
        **{phase: seconds.get(key, 0.0) for phase, key in COMPILE_PHASES.items()},
    }


def frames_converted() -> int:
    """The frames dynamo has tried to compile in this process so far."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def compiled_regions(step: Callable[[], object]) -> int | None:
    """How many times compiled code ran in `step` (the profiler's ranges around it); None where the profiler cannot
    start (the step then runs unprofiled)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        profiler = profile(activities=[ProfilerActivity.CPU])
        profiler.start()
    except Exception:
        step()
        return None
    try:
        step()
    finally:
        profiler.stop()
    return sum(event.name.startswith(COMPILED_RANGES) for event in profiler.events())


def describe(error: Exception) -> str:
    """An error as mfu.json records it; dynamo's bare recompile-limit failure said in full."""
    if type(error).__name__ == "FailOnRecompileLimitHit":
        import torch._dynamo.config as dynamo

        return (
            f"ran uncompiled: dynamo hit its recompile limit ({dynamo.recompile_limit} in this process), past which "
            f"it runs the step's frames eagerly ({error})"
        )
    return f"{type(error).__name__}: {error}"[:2000]


# --- a variant -------------------------------------------------------------------------------------------------------


class Variant:
    """One variant's stepper, its batch, and what was measured of it."""

    def __init__(self, name: str, config: Config, env: DistEnv, total_steps: int):
        self.name, self.config, self.device = name, config, env.device
        self.stepper = Stepper(config, env, VOCAB, total_steps)
        dp_size = self.stepper.parallel.dims.dp_size
        self.batches = random_batches(config, dp_size, VOCAB, env.device)
        self.tokens_per_step = sum(inputs.numel() for inputs, _ in self.batches)
        self.flops_per_token = flops_per_token(config.model, VOCAB, config.data.seq_len)
        model = config.model
        self.causal_flops_per_token = causal_flops_per_token(
            self.flops_per_token, model.n_layers, model.d_model, config.data.seq_len
        )
        self.peak, _ = peak_flops(env.device, self.stepper.parallel.precision, config.train.peak_tflops)
        self.compiles = config.train.compile or config.train.compile_optimizer
        self.warmup_s: list[float] = []  # of each warm-up step
        self.regions: int | None = None  # compiled code run in the last warm-up step
        self.seconds: list[float] = []  # of each round's steps
        self.turn_s: list[float] = []  # the same turns by the host's clock, synchronised: what a round costs
        self.transient_mb: list[float] = []
        self.health: list[dict] = []  # NVML's samples during its turns
        self.compiles_in_turns = 0  # frames dynamo compiled inside a timed turn (a guard a later build broke)

    def steps(self, n: int) -> torch.Tensor:
        """n steps; their summed loss (on the device, unread)."""
        return sum(self.stepper.step(self.batches) for _ in range(n))

    def warm_up(self, n: int) -> None:
        """n steps (the first compiles), each timed; a compiled variant's last one under the profiler, which sees
        whether compiled code ran, so it takes at least two (the first's compilation is no step to probe)."""
        n = max(n, 2) if self.compiles else n
        for i in range(n):
            began = clock()
            if self.compiles and i == n - 1:
                self.regions = compiled_regions(lambda: self.steps(1))
            else:
                self.steps(1)
            sync(self.device)
            self.warmup_s.append(clock() - began)

    def turn_estimate(self, steps: int) -> float:
        """A turn of `steps` steps: its last one's, else from the fastest warm-up step after the first."""
        return self.turn_s[-1] if self.turn_s else steps * min(self.warmup_s[1:] or self.warmup_s)

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

    def compile_figures(self, tally: dict[str, float]) -> dict:
        """Its compilation: `tally` (dynamo_tally's difference over its build and warm-up) and the probe's count."""
        if not self.compiles:
            return {"configured": False, "eager_because": "train.compile and train.compile_optimizer are off"}
        return {
            "configured": True,
            "compile_s": round(sum(tally[phase] for phase in COMPILE_PHASES), 2),
            **{k: round(v, 2) if isinstance(v, float) else v for k, v in tally.items()},
            "compiled_regions_in_a_step": self.regions,
        }

    def uncompiled(self, tally: dict[str, float]) -> str | None:
        """Why the variant ran its last warm-up step uncompiled, where it is configured to compile; None if not (or
        if the profiler could not say)."""
        if self.compiles and self.regions == 0:
            return (
                f"ran a step uncompiled: compile is configured, but no compiled code ran in its last warm-up step "
                f"({tally['unique_graphs']} new graphs, {tally['frames_eager']} frames left to eager): its "
                f"figures would be eager's, not the lever's"
            )
        return None

    def figures(self, steps: int) -> dict:
        """Tokens/s and MFU per round (both FLOP conventions), their median and spread, the GPU's clock meanwhile."""
        rates = [self.tokens_per_step * steps / s for s in self.seconds]
        mfus = [mfu(self.flops_per_token, rate, 1, self.peak) for rate in rates]
        known = [m for m in mfus if m is not None]
        causal = [m * self.causal_flops_per_token / self.flops_per_token for m in known]
        return {
            "rounds": len(rates),
            "steps_measured": steps * len(rates),
            "tokens_per_s": statistics.median(rates) if rates else None,
            "tokens_per_s_rounds": [round(r) for r in rates],
            "mfu": statistics.median(known) if known else None,
            "mfu_causal": statistics.median(causal) if causal else None,  # llm.c's count: causal attention at half
            "mfu_spread_points": 100 * (max(known) - min(known)) if known else None,
            "step_ms": 1000 * statistics.median(s / steps for s in self.seconds) if self.seconds else None,
            "transient_peak_mb": max(self.transient_mb) if self.transient_mb else None,
            "gpu_during_rounds": gpu_during(self.health),
            "compiles_during_rounds": self.compiles_in_turns,  # each one's seconds are in its round's time
        }


def gpu_during(samples: list[dict]) -> dict | None:
    """NVML's view of the GPU over a variant's turns: the worst (gpu_health.worst_health) and the median SM clock;
    None without samples (a CPU, no NVML)."""
    if not samples:
        return None
    clocks = [s["sm_clock_mhz"] for s in samples if s.get("sm_clock_mhz") is not None]
    return worst_health(samples) | {"sm_clock_mhz_median": statistics.median(clocks) if clocks else None}


def machine(device: torch.device, reader: Callable[[], dict] | None) -> dict:
    """What the figures were measured on, so that one card's are never read as another's: the card, its driver and
    power limit (NVML), the kernel (4.4.0 is gVisor's), torch and CUDA; None where there is no such thing."""
    sample = reader() if reader else {}
    cuda = device.type == "cuda"
    return {
        "card": torch.cuda.get_device_name(device) if cuda else cpu_model(),
        "driver": driver_version() if cuda else None,
        "power_limit_w": sample.get("power_limit_w"),
        "sm_clock_max_mhz": sample.get("sm_clock_max_mhz"),
        "kernel": platform.release(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
    }


def health_reader(device: torch.device) -> tuple[Callable[[], dict] | None, str | None]:
    """The GPU's NVML reader (gpu_health.open_health_reader), or why there is none; (None, None) off CUDA."""
    try:
        return open_health_reader(device), None
    except Exception as error:  # no NVML: the clocks go unrecorded, the figures stand
        return None, f"{type(error).__name__}: {error}"


def start_variant(name: str, env: DistEnv, cpu: bool, work: Path, warmup: int, total_steps: int) -> tuple:
    """The variant built and warmed up (its compile), and its figures: build and warm-up seconds, its compilation
    (an error where a variant configured to compile ran uncompiled). Both a measuring call and a farm's warm-only
    call build through here, so that the caches one fills are the ones the other hits. (None, figures) if it failed."""
    figures: dict = {"settings": VARIANTS[name]}
    before, began = dynamo_tally(), clock()
    variant = None
    try:
        variant = Variant(name, experiment_config(variant_settings(name, cpu), work), env, total_steps)
        figures["build_s"] = round(clock() - began, 1)
        variant.warm_up(warmup)
        figures["tokens_per_step"] = variant.tokens_per_step
        figures["warmup_s"] = round(sum(variant.warmup_s), 1)
        figures["build_and_warmup_s"] = round(clock() - began, 1)
    except Exception as error:  # the others still built
        figures["error"] = describe(error)
        (work / f"mfu.{name}.traceback.txt").write_text(traceback.format_exc())
    after = dynamo_tally()
    tally = {key: after[key] - before[key] for key in after}
    if variant is not None:
        figures["compile"] = variant.compile_figures(tally)
        figures["error"] = figures.get("error") or variant.uncompiled(tally)
    if not figures.get("error"):
        figures.pop("error", None)
        return variant, figures
    return None, figures


# --- measuring -------------------------------------------------------------------------------------------------------


class Budget:
    """The seconds left of a budget (None: no limit) and whether an estimate fits them, with MARGIN."""

    def __init__(self, seconds: float | None):
        self.deadline = None if seconds is None else clock() + seconds

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - clock()

    def fits(self, seconds: float) -> bool:
        return MARGIN * seconds <= self.left()


class Levers:
    """One measuring call's state, shared by its builds and rounds: the variants warm so far (`live`), every
    variant's figures (`results`), the budget, and the GPU's NVML reader for the clocks during each turn."""

    def __init__(self, env: DistEnv, cpu: bool, work: Path, steps: int, on_progress, budget_s: float | None):
        self.env, self.cpu, self.work, self.steps, self.on_progress = env, cpu, work, steps, on_progress
        self.budget = Budget(budget_s)
        self.reader, self.unread = health_reader(env.device)
        self.machine = machine(env.device, self.reader)
        self.results: dict[str, dict] = {}
        self.live: dict[str, Variant] = {}

    def turns(self) -> list[float]:
        return [variant.turn_estimate(self.steps) for variant in self.live.values()]

    def start(self, name: str, warmup: int, total_steps: int) -> None:
        """The variant built and warmed up, unless its build and a round with it cannot end within the budget
        (estimated from the slowest build so far: the first is always tried)."""
        built = [f["build_and_warmup_s"] for f in self.results.values() if "build_and_warmup_s" in f]
        build = max(built, default=0.0)
        round_with_it = sum(self.turns()) + max(self.turns(), default=0.0)
        if self.budget.left() <= 0:
            self.results[name] = {"settings": VARIANTS[name], "skipped": "not started: the budget is spent"}
        elif built and not self.budget.fits(build + round_with_it):
            self.results[name] = {
                "settings": VARIANTS[name],
                "skipped": f"not started: its build (~{build:.0f} s, the slowest so far) and a round with it "
                f"(~{round_with_it:.0f} s) do not fit the {self.budget.left():.0f} s left of the budget",
            }
        else:
            variant, self.results[name] = start_variant(name, self.env, self.cpu, self.work, warmup, total_steps)
            self.results[name]["machine"] = self.machine
            if variant is not None:
                self.live[name] = variant
        self.on_progress(self.results)

    def play_round(self) -> bool:
        """One round, each live variant's turn of timed steps (NVML's clocks sampled meanwhile), if its estimate fits
        the budget; whether it was played. A variant whose turn fails is reported and left out."""
        if not self.budget.fits(sum(self.turns())):
            return False
        for name, variant in list(self.live.items()):
            began, frames = clock(), frames_converted()
            try:
                with HealthSampler(self.reader, HEALTH_SAMPLE_S, self.unread) as sampler:
                    variant.timed(self.steps)
            except Exception as error:
                self.results[name]["error"] = describe(error)
                (self.work / f"mfu.{name}.traceback.txt").write_text(traceback.format_exc())
                del self.live[name]
                continue
            variant.turn_s.append(clock() - began)
            variant.health += sampler.samples
            variant.compiles_in_turns += frames_converted() - frames
            self.results[name].update(variant.figures(self.steps))
        compare(self.results)
        self.on_progress(self.results)
        return True


def measure(
    names: list[str],
    cpu: bool,
    work: Path,
    rounds: int,
    steps: int,
    warmup: int,
    on_progress: Callable[[dict], None] = lambda results: None,
    budget_s: float | None = None,
) -> dict:
    """Each variant built and warmed up (its compile) in turn, a round of all warm ones after each warm-up from the
    second on, then rounds until each has `rounds` rounds of `steps` steps; `on_progress(results)` after each
    warm-up, skip and round. Within `budget_s` seconds (None: no limit) no build or round starts that its estimate
    says cannot end in time: a variant left out says `skipped`, one short of its rounds `cut_short`. A variant that
    fails (or ran uncompiled) is reported with its `error` and left out; `failures` says which fail check E."""
    levers = Levers(one_process(device_of(cpu)), cpu, work, steps, on_progress, budget_s)
    total_steps = warmup + (rounds + len(names)) * steps  # the schedule's length: beyond any variant's steps
    with compile_guard(len(names)):
        for name in names:
            levers.start(name, warmup, total_steps)
            if name in levers.live and len(levers.live) >= 2:  # the pair, then each lever, timed once it is warm
                levers.play_round()
        while levers.live and min(len(v.seconds) for v in levers.live.values()) < rounds:
            if not levers.play_round():
                break
    short = {name: len(v.seconds) for name, v in levers.live.items() if len(v.seconds) < rounds}
    for name, played in short.items():
        levers.results[name]["cut_short"] = f"{played} of {rounds} rounds: the next did not fit the budget"
    if short:
        on_progress(levers.results)
    return levers.results


def warm(
    names: list[str], cpu: bool, work: Path, warmup: int, on_progress: Callable[[dict], None] = lambda results: None
) -> dict:
    """A compile farm's call: each variant built and warmed up as `measure` does it (start_variant, under the same
    compile_guard), so that the FX-graph and AOT-autograd caches it fills are those a measuring process hits; its
    compile figures, and no timing. `on_progress(results)` after each."""
    env = one_process(device_of(cpu))
    facts = machine(env.device, health_reader(env.device)[0])
    results: dict[str, dict] = {}
    with compile_guard(len(names)):
        for name in names:
            _, results[name] = start_variant(name, env, cpu, work, warmup, warmup)
            results[name]["machine"] = facts
            on_progress(results)
    return results


def device_of(cpu: bool) -> torch.device:
    return torch.device("cpu") if cpu else torch.device("cuda", 0)


def compare(results: dict) -> None:
    """Each lever's median MFU against the configured one's, in points, and whether the difference stands above the
    spread of both (max - min over the rounds; a single round has none to stand above)."""
    base = results.get("configured", {})
    if base.get("mfu") is None:
        return
    for name, figures in results.items():
        if name == "configured" or figures.get("mfu") is None:
            continue
        gain = 100 * (figures["mfu"] - base["mfu"])
        figures["vs_configured_points"] = round(gain, 3)
        spread = max(figures["mfu_spread_points"], base["mfu_spread_points"])
        figures["resolved"] = min(figures["rounds"], base["rounds"]) >= 2 and abs(gain) > spread


def failures(results: dict) -> list[str]:
    """The variants that fail check E: one with an error (a failed build or step, a step run uncompiled), and one of
    the first two (the pair the check is for) without a measured round. A later lever the budget left out or cut is
    a note (`skipped`, `cut_short`), not a failure."""
    pair = list(results)[:2]
    return [name for name, f in results.items() if "error" in f or (name in pair and "mfu" not in f)]


def summary(name: str, figures: dict) -> str:
    """A variant's line: its figures, its compile figures alone (warm-only), or why it has none."""
    compiled = figures.get("compile", {})
    if "error" in figures or "skipped" in figures:
        line = figures.get("error") or figures["skipped"]
    elif "mfu" in figures:
        line = (
            f"{figures['tokens_per_s']:,.0f} tokens/s, MFU {100 * (figures['mfu'] or 0):.2f}% "
            f"(causal {100 * (figures['mfu_causal'] or 0):.2f}%; spread {figures['mfu_spread_points'] or 0:.2f} "
            f"points over {figures['rounds']} rounds)"
        )
    elif compiled.get("configured"):
        line = (
            f"warm in {figures['build_and_warmup_s']} s: compiled {compiled['compile_s']} s, "
            f"{compiled['unique_graphs']} graphs, {compiled['recompiles']} recompiles"
        )
    else:
        line = f"warm in {figures.get('build_and_warmup_s')} s, eager ({compiled.get('eager_because')})"
    return f"{name:<32} {line}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=output_dir)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument(
        "--only", nargs="+", action="extend", choices=list(VARIANTS), help="variants (default: check E's levers)"
    )
    parser.add_argument("--rounds", type=count(2), default=5, help="interleaved rounds (at least 2: a spread)")
    parser.add_argument("--steps", type=count(1), default=20, help="steps of a variant in each round")
    parser.add_argument("--warmup", type=count(1), default=5, help="steps before measuring (compilation)")
    parser.add_argument("--budget-s", type=positive, help="seconds for the whole call (default: no limit)")
    parser.add_argument("--warm-only", action="store_true", help="build and warm up only (a compile farm)")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device is visible; run with --cpu for a dry run")
    if args.warm_only and not args.only:
        parser.error("--warm-only builds the variants named by --only: name them")
    names = [n for n in args.only or (CPU_LEVERS if args.cpu else LEVERS) if not (args.cpu and n in GPU_ONLY)]
    names = list(dict.fromkeys(names))  # --only a --only a: once
    args.out.mkdir(parents=True, exist_ok=True)

    def write(results: dict) -> None:
        (args.out / "mfu.json").write_text(json.dumps(results, indent=2) + "\n")

    if args.warm_only:
        results = warm(names, args.cpu, args.out, args.warmup, write)
        failed = [name for name, figures in results.items() if "error" in figures]
    else:
        results = measure(names, args.cpu, args.out, args.rounds, args.steps, args.warmup, write, args.budget_s)
        failed = failures(results)
    for name, figures in results.items():
        print(summary(name, figures), flush=True)
    return 0 if names and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
