"""The GPU proof kit, part 3: the paths the probe and the smoke test do not cover, in one call that fits a cold lent
GPU (docs/gpu.md gives the command, its limit and what each check proves).

    PYTHONPATH=src:. python3 bench/gpu_paths.py --out "$OUT"            # one CUDA GPU, no network: at most 10 minutes
    PYTHONPATH=src:. python3 bench/gpu_paths.py --out DIR --cpu         # the same checks on CPU, tiny shapes (CI)
    PYTHONPATH=src:. python3 bench/gpu_paths.py --out DIR --cpu --rehearse --only A Z --budget 3   # the runner's drill

What comes back: the machine returns at most 8 files of at most 16 MiB from its output folder, so everything is
written under a working folder (--work, under /tmp: caches, data, runs, logs) and --out receives two files only,
rewritten (atomically) as the call goes: paths.json (every check's status and figures, written after each check and
after each variant inside one; the farm's record) and logs.tgz (the logs and tracebacks, at most 15 MiB: the largest
are cut first, keeping their head and tail, and paths.json says which). A call cut off keeps both as they were.

It fits cold. At t = 0 a compile farm starts (FARM: one process per distinct graph set, each in a process group of its
own, through the checks' own code and their Inductor cache: E's configured model then its compiled optimizer, E's
bf16_params then its compiled optimizer, D's stack), while the light checks run beside it (A, J, B, C, F); the farm
is ended (its groups killed, what it wrote kept for logs.tgz) before E, which times a quiet GPU with the most time,
loading the farm's graphs; then H, G, D; I last. Each check runs in its own process group under a limit at least its
cold estimate on an H100 (CHECKS: start-up, cold compiles and cache loads at COMPILE_S and CACHED_S, the rest; their
sum, with MARGIN_S, within one command's COMMAND_S: --budget), and a check that ends early leaves its time to the
later ones. At its limit a check's whole group is ended (SIGTERM, then SIGKILL), so no training of it goes on beside
the next one; so is anything it left running when it ended. A check that cannot get its time is SKIPPED. The last
line counts each status; the exit status is 1 when any check failed or was skipped. A check that compiled records
what torch.compile did in its process (seconds, unique graphs, recompiles, the caches' hits).

    A versions     torch, CUDA, cuDNN, NCCL, SDPA's priority order; which Flight Recorder dump functions exist
    J moe          config.yaml's one-GPU `moe` experiment, 10 steps on the GPU against the same on the CPU in fp32
    B nccl         a 1-rank NCCL group beside gloo: each recorder's entries, sequence numbers under
                   cuda:nccl,cpu:gloo, the watchdog ending a hung step (exit 76) and naming the collective
    C ring         ring attention on one device against SDPA: error, time, peak memory, host syncs (CUDA's sync
                   debug mode on a GPU, which sees inside the ring's operator), dropout, selective vs no
                   checkpointing, graph breaks under compile
    F lightning    Lightning against scalelm's engine through the CLI on learnable data: the loss's fall and the
                   gradient norms alike, tokens/s (beside the farm: a figure)
    E levers       the MFU levers interleaved in one process (bench/gpu_mfu.py), CUDA events: the pair
                   (configured, bf16_params) first, then each lever within E's budget
    H baseline     the machine baseline on the gpt2 shapes (the compiled step at one shape): output product
                   unpadded vs padded, health
    G world8       one rank of 8-rank layouts through the fake backend, eager: peak memory against the plan
    D stack        selective checkpointing -> compile -> FSDP2 on a 1-rank mesh (2 blocks of width 768) against
                   eager autocast on one batch it learns: the loss's fall and the first step's gradients alike
    I share        several NCCL ranks on the one GPU (SCALELM_SHARE_GPU): a 2-rank smoke of all_reduce, uneven
                   all_to_all_single and batch_isend_irecv, NCCL's log read for two nodes over sockets, then
                   moe_ep, cp, ddp and fsdp over 2 ranks (two layouts at a time) against one process, 10 eager
                   steps each on learnable data; never timed

No compiled run evaluates: E, D and H step without evaluating, and the CLI runs (F, I) are eager (an evaluation
compiles nothing more since scalelm.train.evaluation runs the blocks eagerly) and evaluate splits of a few windows.
No run writes a gpt2_small checkpoint: the CLI runs train the course model, whose final checkpoint stays in --work.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from bench.argtypes import output_dir, positive, unknown

from scalelm.files import OutputError, atomic_path, atomic_write_text, check_apart, check_replaceable

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
VOCAB = 33_278  # WikiText-2's (bench/throughput.py's), without importing the training stack into every process

# One call on a cold lent machine: one command after the machine's start, within the session's device time
LEASE_S = 900  # a session's device time: the machine's start, every command, every idle wait
MACHINE_START_S = 240  # the machine's start: 1-2 minutes, 2-4 when an H100's start fails over to an H200
COMMAND_S = 600  # one command's limit (the device tool's most): docs/gpu.md runs this script with it
MARGIN_S = 60  # of COMMAND_S, for the runner itself: its own cold torch import before the checks' clock starts, the
# farm's end and each killed check's (SIGTERM, grace, SIGKILL), writing what comes back
CPU_FACTOR = 4  # a check's limit on a CPU (CI, beside other work), against its GPU estimate
MIN_START_S = 10  # no check starts with less than this left (or its own limit, if smaller)
KILL_GRACE_S = {"cuda": 5.0, "cpu": 1.0}  # between SIGTERM and SIGKILL to a check's process group
# E's budget ends this long before its limit, so that it writes its record and exits on its own: its last round may
# overrun its estimate, and the runner's SIGTERM (then SIGKILL after KILL_GRACE_S) would leave only its progress
E_MARGIN_S = {"cuda": 2 * KILL_GRACE_S["cuda"], "cpu": 2 * KILL_GRACE_S["cpu"]}
DEADLINE_ENV = "SCALELM_GPU_PATHS_DEADLINE"  # a check's end by the runner's limit (seconds since the epoch)
POLL_S = {"cuda": 2.0, "cpu": 0.5}  # how often a running check's progress is copied into paths.json
LOGS_CAP = 15 * 2**20  # logs.tgz's members at most (headers included), under the machine's 16 MiB per file
LOG_SUFFIXES = (".log", ".json", ".jsonl", ".txt", ".yaml")
MARKER = ".scalelm-gpu-paths"  # in --work: a folder this script may clear
DEFAULT_WORK = Path("/tmp/scalelm-gpu-paths")
BF16_BOUND, FP32_BOUND = 3e-2, 1e-4  # worst relative difference of step losses: bf16 on a GPU (docs/gpu.md), fp32
# Runs compared (D, F, I) train on learnable data (bench/throughput.py's patterned_tokens), where the loss falls by
# several nats: on uniformly random ids every model, broken or not, stays near ln V, and 3% of it hides any layout.
# The fall must agree: |fall - reference's fall| <= FALL_RELATIVE x the reference's fall + FALL_ABSOLUTE. 5% is about
# what bf16 moves a fall of a few nats over 10-20 steps (a run whose gradients are half wrong falls 20-50% less), the
# 0.02 nats the rounding of two logged losses where the fall is small (a CPU's few steps). Adam's step is nearly blind
# to a gradient's scale, so the fall cannot see a mis-scaled layout: the gradients are compared too.
FALL_RELATIVE, FALL_ABSOLUTE = 0.05, 0.02
MIN_FALL = 0.1  # nats: a reference that falls less has learnt nothing to compare with
GRAD_NORM_BOUND = {"bf16": 0.05, "fp32": 1e-3}  # relative difference of gradient norms (logged, or per parameter)
GRAD_COSINE_BOUND = {"bf16": 0.99, "fp32": 1 - 1e-6}  # cosine of one step's gradient to the reference's, per parameter
EVAL_TOKENS = 512  # each evaluation split of the CLI runs' data: 4 windows at seq_len 128

# Cold estimates on one H100 (16 cores, nothing cached). Where they come from: review 4's table of cold estimates per
# check (finding 1: a first torch.compile of gpt2_small takes 1-3 minutes, a first torch import from a cold disk
# 10-20 s and up to 30), the H200 lease's step times (docs/benchmarks.md), and the CPU rehearsal's shape of each
# check. Estimates, not measurements: the first lease's `wall_s`, `compile` and `farm` figures in paths.json re-size
# them. docs/gpu.md's cold budget has the same figures (a test compares them).
FIRST_IMPORT_S = 20  # the machine's first torch import, CUDA context and cuDNN/NCCL load, from a cold disk (A)
START_S = 8  # a later process's start: torch from the page cache, its CUDA context
COMPILE_S = {  # one graph set compiled cold: dynamo, AOT autograd, Inductor and Triton's kernels on the machine's cores
    "gpt2_small": 90,  # its blocks and head, forward and backward (the low middle of review 4's 1-3 minutes)
    "adamw": 45,  # AdamW's step compiled over gpt2_small's 148 tensors: one foreach graph, fewer and larger kernels
    "stack": 60,  # D's checkpointed block under FSDP2 and the head, forward and backward (2 blocks of width 768)
}
CACHED_S = 15  # a graph set the farm compiled, loaded from the FX-graph and AOT caches: dynamo still traces it


@dataclass(frozen=True)
class Cold:
    """What a check or a farm process costs on a cold machine by the estimates above: its processes' start-up, the
    graph sets it compiles itself, those it loads from the farm's cache, and the rest of its work."""

    start_s: float
    compiles: tuple[str, ...] = ()
    cached: int = 0
    work_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.start_s + sum(COMPILE_S[kind] for kind in self.compiles) + self.cached * CACHED_S + self.work_s


@dataclass(frozen=True)
class Check:
    run: Callable[[Ctx], dict]
    seconds: float  # its limit on one GPU, at least its cold estimate
    cold: Cold


CHECKS: dict[str, Check] = {}
# the light checks beside the compile farm (the farm's graphs are the later checks'), then E with the most time on a
# quiet GPU, then H, G and D (H and D load the farm's graphs), I last (it takes whatever the others left)
RUN_ORDER = (
    "A.versions",
    "J.moe",
    "B.nccl",
    "C.ring",
    "F.lightning",
    "E.levers",
    "H.baseline",
    "G.world8",
    "D.stack",
    "I.share",
)
BESIDE_FARM = RUN_ORDER[:5]  # light on the GPU and its memory: they run while the farm compiles


def check(name: str, seconds: float, cold: Cold):
    def register(fn):
        CHECKS[name] = Check(fn, seconds, cold)
        return fn

    return register


class NotApplicable(Exception):
    """The check needs what this run does not have (a CUDA device, a library)."""


class Ctx:
    """A check's device, this call's folder for its files (`work`), the folder kept across calls (`cache`)."""

    def __init__(self, device: torch.device, work: Path, cache: Path, name: str = ""):
        self.device, self.work, self.cache, self.name = device, work, cache, name
        self.last_progress: dict | None = None
        self.deadline: float | None = None  # when the runner ends this check (time.time()'s clock); None: unknown

    def seconds_left(self) -> float | None:
        """Seconds until the runner ends this check, if it said (DEADLINE_ENV)."""
        return None if self.deadline is None else self.deadline - time.time()

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cuda else torch.float32

    @property
    def precision(self) -> str:
        return "bf16" if self.cuda else "fp32"

    @property
    def bound(self) -> float:
        """How far step losses may differ from their reference's: bf16 noise on a GPU, fp32's on a CPU."""
        return BF16_BOUND if self.cuda else FP32_BOUND

    def progress(self, figures: dict) -> None:
        """The figures so far, which the runner copies into paths.json while the check runs (and keeps if it is cut
        off)."""
        self.last_progress = figures
        atomic_write_text(progress_file(self.work, self.name), json.dumps(figures, default=str))

    def prepared(self) -> Path:
        """Learnable prepared data of WikiText-2's vocabulary (each token a fixed function of the one before), made
        once and kept across calls; its evaluation splits a few windows, so that a run's final evaluation costs
        nothing (no setting skips it)."""
        from bench.throughput import make_prepared

        final = self.cache / "prepared-patterned"
        if not final.exists():
            with atomic_path(final) as partial:  # a check cut off while writing leaves no half of it
                make_prepared(partial, patterned=True, eval_tokens=EVAL_TOKENS)
        return final

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak_mb(self) -> float | None:
        return torch.cuda.max_memory_allocated() / 2**20 if self.cuda else None

    def timed_ms(self, fn: Callable[[], object], reps: int) -> float:
        """Mean milliseconds of fn() after one warm-up call, with CUDA events on a GPU."""
        if self.cuda:
            from bench.gpu_probe import cuda_seconds

            return cuda_seconds(fn, reps) * 1000
        fn()
        began = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - began) * 1000 / reps


def progress_file(work: Path, name: str) -> Path:
    return work / f"{name}.progress.json"


def start_group(ctx: Ctx, backend: str | None = None) -> None:
    """A process group of one (this process), NCCL on a GPU and gloo on CPU unless `backend` says."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as free:  # a port of its own: a check's own subprocesses start groups too
        free.bind(("127.0.0.1", 0))
        os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free.getsockname()[1])}
    backend = backend or ("nccl" if ctx.cuda else "gloo")
    dist.init_process_group(backend, rank=0, world_size=1, device_id=ctx.device if ctx.cuda else None)


def worst_relative(losses: list[float], expected: list[float]) -> float:
    """The largest relative difference of two runs' step losses (infinite if they differ in length or are not
    finite)."""
    if len(losses) != len(expected) or not losses:
        return float("inf")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
    return worst if worst == worst else float("inf")  # NaN compares false: never within a bound


def train_record(run: Path) -> dict[str, list[float]]:
    """A CLI run's logged training intervals: each one's loss (the mean of its steps') and gradient norm (its last
    step's, before clipping)."""
    from scalelm.train.record import read_metrics

    train = [r for r in read_metrics(run) if r["kind"] == "train"]
    return {"losses": [r["loss"] for r in train], "grad_norms": [r["grad_norm"] for r in train]}


def falls(losses: list[float]) -> dict[str, float]:
    """How far the loss has fallen from its first value by the middle of the run and by its end."""
    return {"middle": losses[0] - losses[len(losses) // 2], "end": losses[0] - losses[-1]}


def fall_agreement(losses: list[float], expected: list[float]) -> dict:
    """The loss's fall against the reference's (FALL_RELATIVE), by the middle and by the end: a fall that saturates
    by the end cannot hide a run that fell at another pace. Alike only where the reference learnt (MIN_FALL)."""
    if len(losses) != len(expected) or len(losses) < 2:
        return {"alike": False, "why": f"{len(losses)} losses against the reference's {len(expected)}"}
    mine, theirs = falls(losses), falls(expected)
    excess = {k: abs(mine[k] - theirs[k]) - (FALL_RELATIVE * theirs[k] + FALL_ABSOLUTE) for k in mine}
    learnt = theirs["end"] >= MIN_FALL
    return {
        "fall": mine,
        "reference": theirs,
        "excess": excess,
        "alike": learnt and all(e <= 0 for e in excess.values()),
    }


def relative_differences(values: list[float], expected: list[float]) -> list[float]:
    """|a - b| / |b| of each pair (infinite where b is 0 and a is not, or either is not finite)."""
    differences = []
    for a, b in zip(values, expected):
        difference = abs(a - b) / abs(b) if b else (0.0 if a == b else float("inf"))
        differences.append(difference if difference == difference else float("inf"))  # NaN: never within a bound
    return differences


def norm_agreement(norms: list[float], expected: list[float], precision: str) -> dict:
    """The logged gradient norms against the reference's: the first (the same weights on the same batch: numerics
    only) and the median over the run (a spike a step early or late is bf16's noise; a layout's error is in every
    step), each within GRAD_NORM_BOUND."""
    bound = GRAD_NORM_BOUND[precision]
    if len(norms) != len(expected) or not norms:
        return {"alike": False, "why": f"{len(norms)} norms against the reference's {len(expected)}"}
    differences = relative_differences(norms, expected)
    first, median = differences[0], statistics.median(differences)
    return {"first": first, "median": median, "bound": bound, "alike": first <= bound and median <= bound}


def run_agreement(run: dict, reference: dict, precision: str) -> dict:
    """How a run trained against its reference (each a `train_record`): the loss's fall and the gradient norms, and in
    fp32 every step's loss within FP32_BOUND too (in bf16 the step losses' worst relative difference is a figure: 3%
    of a loss that falls towards 0 is bf16's noise)."""
    fall = fall_agreement(run["losses"], reference["losses"])
    norms = norm_agreement(run["grad_norms"], reference["grad_norms"], precision)
    worst = worst_relative(run["losses"], reference["losses"])
    steps_alike = precision == "bf16" or worst <= FP32_BOUND
    return {
        "fall": fall,
        "grad_norms": norms,
        "worst_relative": worst,
        "alike": fall["alike"] and norms["alike"] and steps_alike,
    }


def gradient_agreement(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], precision: str) -> dict:
    """One step's gradients against the reference's, parameter by parameter: the worst cosine (a direction wrong)
    and the worst relative difference of norms (a scale wrong), each named; a parameter without a gradient, or with
    one the reference lacks, is named too."""
    unmatched = sorted(set(grads) ^ set(expected))
    cosines, norms = {}, {}
    for name in sorted(set(grads) & set(expected)):
        mine, theirs = grads[name].double().flatten(), expected[name].double().flatten()
        cosine = F.cosine_similarity(mine, theirs, dim=0).item()
        cosines[name] = cosine if cosine == cosine else -1.0
        norms[name] = relative_differences([mine.norm().item()], [theirs.norm().item()])[0]
    low = min(cosines, key=cosines.get, default=None)
    far = max(norms, key=norms.get, default=None)
    cosine_bound, norm_bound = GRAD_COSINE_BOUND[precision], GRAD_NORM_BOUND[precision]
    alike = not unmatched and low is not None and cosines[low] >= cosine_bound and norms[far] <= norm_bound
    return {
        "parameters": len(cosines),
        "unmatched": unmatched,
        "worst_cosine": [low, cosines.get(low)],
        "worst_norm_difference": [far, norms.get(far)],
        "bounds": {"cosine": cosine_bound, "norm": norm_bound},
        "alike": alike,
    }


def wait_all(
    processes: dict[str, subprocess.Popen], timeout: float, landed: Callable[[str, int | str], None] | None = None
) -> dict[str, int | str]:
    """Each process's exit status ("timeout" past `timeout` s), handed to `landed` as each ends; once one fails, the
    others are killed (a rank whose peer died would wait for it until the process group's timeout)."""
    deadline, codes = time.monotonic() + timeout, {}

    def record(name: str, code: int | str) -> None:
        codes[name] = code
        if landed is not None:
            landed(name, code)

    while len(codes) < len(processes):
        for name, process in processes.items():
            if name not in codes and process.poll() is not None:
                record(name, process.returncode)
        failed = any(code != 0 for code in codes.values())
        if failed or time.monotonic() > deadline:
            for name, process in processes.items():
                if name not in codes:
                    process.kill()
                    process.wait()
                    record(name, "killed" if failed else "timeout")
        if len(codes) < len(processes):
            time.sleep(0.1)
    return codes


# --- A ---------------------------------------------------------------------------------------------------------------


@check("A.versions", 30, Cold(FIRST_IMPORT_S, work_s=5))  # the versions and one SDPA choice
def versions(ctx: Ctx) -> dict:
    import torch.distributed as dist

    c10d = torch._C._distributed_c10d if dist.is_available() else None
    facts = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if ctx.cuda else None,
        "device": torch.cuda.get_device_name() if ctx.cuda else "cpu",
        "capability": list(torch.cuda.get_device_capability()) if ctx.cuda else None,
        **sdpa_order(ctx),
        "flight_recorder": {
            name: hasattr(c10d, name) for name in ("_dump_fr_trace", "_dump_nccl_trace", "_dump_fr_trace_json")
        },
        "lightning": _version_of("lightning"),
        "triton": _version_of("triton"),
    }
    return facts


def sdpa_order(ctx: Ctx) -> dict:
    """SDPA's backend priority order as torch settles it at its first choice on this device, and that choice for a
    bf16 training shape (review 3, finding 6: on torch 2.11+cu130 cuDNN may already come first on sm90)."""
    from torch.nn.attention import SDPBackend

    def names(indices) -> list[str]:
        return [getattr(SDPBackend(i), "name", str(i)) for i in indices]

    order = getattr(torch._C, "_get_sdp_priority_order", None)
    facts = {
        "sdp_priority_order": None,
        "sdp_choice": None,
        "TORCH_CUDNN_SDPA_DEPRIORITIZED": os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED"),
    }
    if ctx.cuda and hasattr(torch, "_fused_sdp_choice"):
        q = torch.zeros(1, 12, 1024, 64, dtype=torch.bfloat16, device=ctx.device)
        facts["sdp_choice"] = names([torch._fused_sdp_choice(q, q, q, is_causal=True)])[0]
    if order is not None:
        facts["sdp_priority_order"] = names(order())
    return facts


def _version_of(package: str) -> str | None:
    if importlib.util.find_spec(package) is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "present"


# --- B ---------------------------------------------------------------------------------------------------------------


@check("B.nccl", 35, Cold(2 * START_S, work_s=15))  # it and its hung child; the watchdog's 2 s floor x 2
def nccl(ctx: Ctx) -> dict:
    """A 1-rank group with NCCL for CUDA tensors and gloo for host ones (what parallel.cpu_offload starts; gloo
    alone on CPU): each Flight Recorder's entries, the sequence numbers per backend, then a hung step ended by the
    watchdog (exit 76) with the collective named, in a process of its own."""
    import torch.distributed as dist

    from scalelm.hang import flight_recorder, watchdog

    autopsy = ctx.work / "B.autopsy"
    os.environ.update(flight_recorder.flight_recorder_env(autopsy))
    start_group(ctx, "cuda:nccl,cpu:gloo" if ctx.cuda else "cpu:gloo")
    for _ in range(3):
        dist.all_reduce(torch.ones(4, device=ctx.device))
        dist.all_reduce(torch.ones(4))
    ctx.sync()
    errors: list[str] = []
    entries = flight_recorder.recorder_entries()
    figures = {
        "backends": sorted(watchdog.backends_in_use()),
        "dump_functions": flight_recorder.dump_functions(),
        "dump_plan": flight_recorder.dump_plan(watchdog.backends_in_use(), flight_recorder.dump_functions()),
        "entries": {
            name: found
            if isinstance(found, str)
            else [
                (e.get("profiling_name"), e.get("collective_seq_id"), e.get("p2p_seq_id"), e.get("state"))
                for e in found[-4:]
            ]
            for name, found in entries.items()
        },
        "sequence_numbers": watchdog.sequence_numbers(errors),
        "sequence_errors": errors,
    }
    ctx.progress(figures)
    hung_dir = ctx.work / "B.hang"
    command = [sys.executable, str(SCRIPT), "--hang", str(hung_dir), *child_arguments(ctx)]
    hung = subprocess.run(command, capture_output=True, text=True, timeout=60)
    summary = hung_dir / "summary.txt"
    figures["hang"] = {
        "exit": hung.returncode,
        "summary": summary.read_text()[-1500:] if summary.exists() else None,
        "files": sorted(p.name for p in hung_dir.glob("*")),
    }
    expected = "nccl:all_reduce" if ctx.cuda else "all_reduce"
    if hung.returncode != 76 or not figures["hang"]["summary"] or expected not in figures["hang"]["summary"]:
        raise AssertionError(
            f"the watchdog did not end the hung step naming {expected}: {figures}\n{hung.stderr[-2000:]}"
        )
    if errors:
        raise AssertionError(f"sequence numbers unreadable: {errors}")
    return figures


def hang(autopsy: Path, cpu: bool) -> None:
    """A one-rank job whose fifth step sleeps: the watchdog (factor 2, floor 2 s) must end it with exit 76."""
    import torch.distributed as dist

    from scalelm.hang import flight_recorder, watchdog

    ctx = Ctx(torch.device("cpu") if cpu else torch.device("cuda", 0), autopsy, autopsy)
    if ctx.cuda:
        torch.cuda.set_device(ctx.device)
    autopsy.mkdir(parents=True, exist_ok=True)
    os.environ.update(flight_recorder.flight_recorder_env(autopsy))
    start_group(ctx)
    dog = watchdog.Watchdog.for_job(0, autopsy, factor=2, floor_s=2)
    for step in range(1, 5):
        with dog.watching(step):
            dist.all_reduce(torch.ones(4, device=ctx.device))
            ctx.sync()
    with dog.watching(5):
        time.sleep(60)
    os._exit(0)  # the watchdog failed to end the step


# --- J ---------------------------------------------------------------------------------------------------------------


def moe_settings(ctx: Ctx) -> list[str]:
    """config.yaml's `moe` experiment (experts in every block of the course model, 4 blocks as the study trains it),
    dropout off, on short sequences: 16 x 128 tokens a step; a tiny one on CPU."""
    if ctx.cuda:
        return [
            "model.moe={experts: 8, top_k: 2, d_ff: 1024}",
            "model.n_layers=4",
            "model.dropout=0.0",
            "data.seq_len=128",
            "batch.size=16",
        ]
    return [
        "model.moe={experts: 4, top_k: 2, d_ff: 64}",
        "model.d_model=32",
        "model.n_heads=2",
        "model.n_layers=2",
        "model.d_ff=64",
        "model.dropout=0.0",
        "data.seq_len=16",
        "batch.size=4",
    ]


@check("J.moe", 35, Cold(START_S, work_s=22))  # 11 eager steps on the GPU, 11 fp32 steps on the CPU
def moe(ctx: Ctx) -> dict:
    """The one-GPU `moe` experiment built through scalelm's own path (Parallel.build: the expert product whatever
    scalelm.model.moe implements) and stepped by the training's own step, against the same model, seed and batches
    on the CPU in fp32: every loss finite and within the bound; the host syncs of one more step (review 3, finding 8),
    a figure only."""
    from bench.gpu_mfu import Stepper, one_process, random_batches

    from scalelm.config import load_config

    steps = 10 if ctx.cuda else 3
    runs = {}
    for label, device in (("device", ctx.device), ("cpu_fp32", torch.device("cpu"))):
        settings = [
            *moe_settings(ctx),
            f"device={device.type}",
            *([] if device.type == "cuda" else ["train.precision=fp32"]),
        ]
        config = load_config(None, settings)
        stepper = Stepper(config, one_process(device), VOCAB, steps + 1)
        batches = random_batches(config, 1, VOCAB, device)
        ctx.reset_peak()
        began = time.perf_counter()
        losses = torch.stack([stepper.step(batches) for _ in range(steps)]).float().cpu().tolist()
        seconds = time.perf_counter() - began
        step_ctx = ctx if label == "device" else Ctx(device, ctx.work, ctx.cache)
        runs[label] = {
            "losses": losses,
            "seconds": round(seconds, 2),
            "peak_mb": ctx.peak_mb() if label == "device" else None,
            "host_syncs_per_step": host_syncs(step_ctx, lambda: stepper.step(batches)),
        }
    worst = worst_relative(runs["device"]["losses"], runs["cpu_fp32"]["losses"])
    figures = {**runs, "worst_relative": worst, "bound": ctx.bound, "grouped_mm": hasattr(torch, "_grouped_mm")}
    if not worst <= ctx.bound:
        raise AssertionError(
            f"the mixture's losses differ from fp32 on the CPU by {worst:.2e} (> {ctx.bound}): {figures}"
        )
    return figures


# --- F ---------------------------------------------------------------------------------------------------------------


def device_settings(ctx: Ctx) -> list[str]:
    """The device of a run through the CLI: CUDA, or a tiny model on the CPU."""
    from bench.gpu_mfu import TINY

    return ["device=cuda"] if ctx.cuda else TINY


def cli_command(ctx: Ctx, run: Path, settings: list[str]) -> list[str]:
    """`python -m scalelm.train` with `settings` on random WikiText-2-sized data, no checkpoint but the one every run
    ends with (in --work; the CLI runs of this script train the course model, never gpt2_small)."""
    command = [sys.executable, "-m", "scalelm.train"]
    for setting in [
        f"run_dir={run}",
        f"data.prepared_dir={ctx.prepared()}",
        "train.comm_profile_steps=0",
        "checkpoint.every=null",
        *settings,
    ]:
        command += ["--set", setting]
    return command


@check("F.lightning", 45, Cold(3 * START_S, work_s=20))  # it and two CLI runs of 60 eager steps, one by one
def lightning(ctx: Ctx) -> dict:
    """Lightning's engine against scalelm's through the CLI on learnable data: the loss's fall and the logged
    gradient norms alike (`run_agreement`), run.json, tokens/s."""
    if importlib.util.find_spec("lightning") is None:
        raise NotApplicable("lightning is not installed")
    from scalelm.train.record import read_metrics

    steps = 60 if ctx.cuda else 6
    runs = {engine: ctx.work / "runs" / f"engine_{engine}" for engine in ("scalelm", "lightning")}

    def settings(engine: str) -> list[str]:
        every = max(1, steps // 6)
        return [*device_settings(ctx), f"train.engine={engine}", f"train.max_steps={steps}", f"train.log_every={every}"]

    commands = {f"F.{engine}": (cli_command(ctx, run, settings(engine)), {}) for engine, run in runs.items()}
    if ctx.cuda:  # one after the other: their tokens/s are compared
        for name, command in commands.items():
            run_processes(ctx, {name: command}, 30)
    else:  # side by side: on a CPU only the structure is proven, not the speed
        run_processes(ctx, commands, 120)
    figures = {}
    for engine, run in runs.items():
        train = [r for r in read_metrics(run) if r["kind"] == "train"]
        steady = train[1:] or train  # the first interval pays start-up
        figures[engine] = {
            **train_record(run),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "mfu": [r.get("mfu") for r in steady][-1],
            "peak_mem_mb": max(r["peak_mem_mb"] or 0 for r in train),
            "run_json": (run / "run.json").exists(),
        }
    figures["agreement"] = run_agreement(figures["lightning"], figures["scalelm"], ctx.precision)
    if not figures["agreement"]["alike"] or not figures["lightning"]["run_json"]:
        raise AssertionError(f"Lightning's run differs from scalelm's: {figures}")
    return figures


# --- C ---------------------------------------------------------------------------------------------------------------


def ring_shapes(ctx: Ctx) -> dict[str, tuple[int, int, int, int]]:
    """(batch, heads, length, head_dim) of one rank's attention: gpt2_small's, and cp_long's (cp 4 of 8192)."""
    if ctx.cuda:
        return {"gpt2": (16, 12, 1024, 64), "cp_long": (8, 16, 2048, 64)}
    return {"gpt2": (2, 2, 64, 16), "cp_long": (1, 2, 128, 16)}


class HostSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operations that read a number back to the host or copy between devices, as the dispatcher sees them:
    not inside a custom operator (the ring's), whose implementation runs with the mode popped (CPU only: on CUDA
    `host_syncs` asks CUDA itself)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default):
            self.count += 1
        elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            target = kwargs.get("device") if func is torch.ops.aten._to_copy.default else args[0].device
            if target is not None and torch.is_tensor(source) and torch.device(target) != source.device:
                self.count += 1
        return func(*args, **kwargs)


SYNC_WARNING = "called a synchronizing"  # CUDA's sync debug mode's warning (c10/cuda); its prototype notice is not one


def synchronising_calls(caught: list[warnings.WarningMessage]) -> list[str]:
    """The first line of each synchronising call CUDA's sync debug mode warned of, among other warnings."""
    return [str(w.message).splitlines()[0] for w in caught if SYNC_WARNING in str(w.message)]


@contextlib.contextmanager
def cuda_sync_warnings(set_mode: Callable[[str], None] | None = None):
    """The synchronising calls made in the body, into the list it yields: CUDA's sync debug mode ("warn") sees every
    one in the CUDA runtime, inside custom operators and the backward's threads too (torch replays their warnings in
    the caller), unlike a dispatch mode. The mode is restored even if the body fails. (`set_mode`: a stand-in for
    torch.cuda.set_sync_debug_mode, for CPU tests.)"""
    set_mode = set_mode or torch.cuda.set_sync_debug_mode
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every call, not once per place
        set_mode("warn")
        try:
            yield found
        finally:
            set_mode("default")
            found += synchronising_calls(caught)


def host_syncs(ctx: Ctx, fn: Callable[[], object]) -> int:
    """How many times fn() makes the host wait for the device: on CUDA, the synchronising calls CUDA warns of (the
    queued work finished first, so that none is counted that fn did not make); on a CPU, `HostSyncs`' count."""
    if ctx.cuda:
        ctx.sync()
        with cuda_sync_warnings() as syncs:
            fn()
        return len(syncs)
    with HostSyncs() as counted:
        fn()
    return counted.count


@check("C.ring", 45, Cold(START_S, work_s=32))  # kernels at two shapes, three dynamo traces (no Inductor)
def ring(ctx: Ctx) -> dict:
    """Ring attention on one device at gpt2's and cp_long's shapes: over no group (one causal block), and the blocks
    of a load-balanced cp-4 ring computed in turn (the half blocks a real ring runs), against SDPA; on sm90 flash
    against cuDNN; dropout's product path; host syncs per call; then graph breaks and checkpointing's memory."""
    results = {name: ring_at(ctx, shape) for name, shape in ring_shapes(ctx).items()}
    shapes = list(results.values())
    results["graph_breaks"] = ring_graph_breaks(ctx)
    results["checkpointing"] = ring_checkpointing_memory(ctx)
    errors = ("ring_error", "ring_cp4_error", "ring_dq_error", "ring_cp4_dq_error")
    if not all(f[key] <= f["tolerance"] for f in shapes for key in errors):
        raise AssertionError(f"ring attention differs from SDPA: {results}")
    if any(f["ring_host_syncs"] or f["ring_dropout_host_syncs"] for f in shapes):
        raise AssertionError(f"ring attention reads back from the device: {results}")
    if any(results["graph_breaks"].values()):
        raise AssertionError(f"graph breaks in a ring block: {results['graph_breaks']}")
    return results


def ring_at(ctx: Ctx, shape: tuple[int, int, int, int]) -> dict:
    from scalelm.parallel import context, ring_blocks

    torch.manual_seed(0)
    q, k, v = (torch.randn(*shape, device=ctx.device, dtype=ctx.dtype, requires_grad=True) for _ in "qkv")
    grad = torch.randn(*shape, device=ctx.device, dtype=ctx.dtype)

    def backward(out: torch.Tensor) -> torch.Tensor:
        out.backward(grad)
        return out

    steps = {
        "sdpa": lambda: backward(F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        "ring": lambda: backward(context.ring_attention(q, k, v)),
        "ring_cp4": lambda: backward(context.simulated_ring_attention(q, k, v, cp=4, load_balance=True)),
        "ring_dropout": lambda: backward(context.ring_attention(q, k, v, None, 0.1, 7)),
    }
    expected = steps["sdpa"]().float()
    expected_dq, q.grad = q.grad.float(), None
    kernel = getattr(ring_blocks.fused_kernel(q), "name", "products")
    figures = {"kernel": kernel, "tolerance": 2e-2 if ctx.cuda else 1e-5}
    for label in ("ring", "ring_cp4"):
        out = steps[label]().float()
        figures[f"{label}_error"] = (out - expected).abs().max().item()
        dq_error = (q.grad.float() - expected_dq).abs().max() / expected_dq.abs().max()
        figures[f"{label}_dq_error"] = dq_error.item()
        q.grad = None
    for label, step in steps.items():
        ctx.reset_peak()
        figures[f"{label}_ms"] = round(ctx.timed_ms(step, 5 if ctx.cuda else 1), 3)
        figures[f"{label}_peak_mb"] = ctx.peak_mb()
    if ctx.cuda and torch.cuda.get_device_capability() == (9, 0):
        ring_blocks.PREFER_CUDNN_ON_SM90 = False
        figures["ring_cp4_flash_ms"] = round(ctx.timed_ms(steps["ring_cp4"], 5), 3)
        ring_blocks.PREFER_CUDNN_ON_SM90 = True
    for label in ("ring", "ring_dropout"):
        figures[f"{label}_host_syncs"] = host_syncs(ctx, steps[label])
    figures["host_syncs_seen_by"] = "cuda sync debug mode" if ctx.cuda else "dispatch mode"
    return figures


def ring_model(ctx: Ctx, mode: str, dropout: float, length: int):
    """A model whose attention is the ring (over no group: one rank holds the whole sequence), checkpointed."""
    from scalelm.config import ModelConfig
    from scalelm.model.transformer import TransformerLM
    from scalelm.parallel.activation_checkpoint import apply_activation_checkpointing
    from scalelm.parallel.context import SequenceSplit, apply_cp

    torch.manual_seed(0)
    d_model, heads = (768, 12) if ctx.cuda else (32, 2)
    config = ModelConfig(
        d_model=d_model, n_heads=heads, n_layers=2, d_ff=4 * d_model, dropout=dropout, max_seq_len=length
    )
    model = TransformerLM(config, 512).to(ctx.device)
    apply_cp(model, SequenceSplit(None, load_balance=False), 0, 1)
    apply_activation_checkpointing(model, mode)
    return model, d_model


def ring_graph_breaks(ctx: Ctx) -> dict[str, list[str]]:
    """Why compile would not run a ring block whole, in each checkpointing mode, dropout on (empty: one graph)."""
    from scalelm.parallel.activation_checkpoint import graph_breaks

    breaks = {}
    length = 256 if ctx.cuda else 32
    for mode in ("none", "selective", "full"):
        model, d_model = ring_model(ctx, mode, 0.1, length)
        x = torch.randn(2, length, d_model, device=ctx.device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ctx.cuda):
            breaks[mode] = graph_breaks(model.blocks["0"], x)
    return breaks


def ring_checkpointing_memory(ctx: Ctx) -> dict:
    """Peak memory of a forward and backward with the ring under no and selective checkpointing (dropout on, the
    path that holds score blocks); None on CPU, which has no allocator statistics."""
    length = 2048 if ctx.cuda else 64
    peaks = {}
    for mode in ("none", "selective"):
        model, _ = ring_model(ctx, mode, 0.1, length)
        tokens = torch.randint(0, 512, (2, length + 1), device=ctx.device)
        ctx.reset_peak()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ctx.cuda):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        peaks[mode] = ctx.peak_mb()
        del model, loss
    return peaks


# --- H ---------------------------------------------------------------------------------------------------------------


@check("H.baseline", 45, Cold(START_S, cached=1, work_s=20))  # the configured step: farm.configured's graphs
def machine_baseline(ctx: Ctx) -> dict:
    """scalelm.measure.baseline's one-rank part on gpt2_small's shapes and batch (32): the output product unpadded and
    padded (the padded one is what training runs), the model step compiled as the experiment is, at that one shape
    (the step at a quarter of the tokens would be a second cold compile; eager on a CPU, it runs there), and the GPU's
    health sampled during the work against an idle reading."""
    from scalelm.config import load_config
    from scalelm.measure.baseline.gpu_health import gpu_health
    from scalelm.measure.baseline.job import measure_alone
    from scalelm.measure.baseline.rates import matmul_rates
    from scalelm.measure.baseline.shapes import gemm_shapes, output_shapes

    config = load_config(None)
    config.model = gpt2_config(ctx)
    config.data.seq_len, config.batch.size = (1024, 32) if ctx.cuda else (64, 4)
    config.data.prepared_dir = str(ctx.work / "no-prepared-data")  # no manifest: WikiText-2's vocabulary
    config.train.compile = ctx.cuda
    outputs = matmul_rates(output_shapes(config), ctx.device, ctx.dtype)
    shapes = gemm_shapes(config, ctx.device.type)
    alone = measure_alone(config, shapes, VOCAB, ctx.device, all_cores=False, small_step=not ctx.cuda)
    return {"output_products": outputs, "alone": alone, "idle_health": gpu_health(ctx.device)}


# --- D ---------------------------------------------------------------------------------------------------------------


def gpt2_config(ctx: Ctx, dropout: float = 0.0, n_layers: int | None = None):
    """gpt2_small's model on a GPU (`n_layers` blocks of it, if given), a tiny one of the same kind on a CPU."""
    from scalelm.config import ModelConfig

    if ctx.cuda:
        return ModelConfig(
            d_model=768,
            n_heads=12,
            n_layers=n_layers or 12,
            d_ff=3072,
            dropout=dropout,
            max_seq_len=1024,
            norm="pre",
            tie_weights=True,
        )
    return ModelConfig(
        d_model=32, n_heads=2, n_layers=2, d_ff=64, dropout=dropout, max_seq_len=64, norm="pre", tie_weights=True
    )


def one_batch(ctx: Ctx, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch of learnable tokens (bench/throughput.py's patterned_tokens: rows entering one cycle at different
    points), `steps` times: the model learns it, so the loss falls by several nats (on fresh uniformly random batches
    every model, broken or not, sits near ln V)."""
    from bench.throughput import patterned_tokens

    rows, seq = (16, 1024) if ctx.cuda else (4, 64)
    generator = torch.Generator().manual_seed(0)
    tokens = patterned_tokens(rows * (seq + 1), generator).view(rows, seq + 1).to(ctx.device)
    return [(tokens[:, :-1], tokens[:, 1:])] * steps


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole (a DTensor's gathered), in fp32 on the CPU, by its name (checkpointing,
    compile and FSDP2 keep the plain model's names)."""
    found = {}
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            grad = parameter.grad
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            found[name] = grad.detach().float().cpu()
    return found


def train_losses_of(ctx: Ctx, model, data, autocast: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Each step's loss, and the first step's `gradients`. (The CPU's tiny model at gpt2_small's learning rate would
    barely move in its 3 steps.)"""
    from scalelm.config import OptimConfig
    from scalelm.optim import build_optimizer

    optimizer = build_optimizer(model, OptimConfig(), 3e-4 if ctx.cuda else 1e-2)
    losses, first = [], {}
    for step, (inputs, targets) in enumerate(data):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast and ctx.cuda):
            loss = model(inputs, targets)
        loss.backward()
        if step == 0:
            first = gradients(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return [float(x) for x in torch.stack(losses).cpu()], first


@check("D.stack", 45, Cold(START_S, cached=1, work_s=15))  # its stack from farm.stack; 2 x 20 steps
def stack(ctx: Ctx, broken: Callable[[torch.nn.Module], None] | None = None) -> dict:
    """gpt2_small's blocks (2 of them: the check proves the order and the agreement, not the scale) as
    Parallel.parallelize builds them for FSDP (`stacked_model`) against the plain model under autocast, eager, on one
    batch both learn: the loss's fall alike (and in fp32 every step's loss), the first step's gradients alike
    parameter by parameter. `broken` (tests only) changes the layout's model before it trains: a deliberately broken
    layout, which must fail."""
    import torch._dynamo

    from scalelm.model.transformer import TransformerLM

    config, steps = stack_config(ctx), 20 if ctx.cuda else 3
    data = one_batch(ctx, steps)
    initial = initial_weights(config)

    reference = TransformerLM(config, VOCAB).to(ctx.device)
    reference.load_state_dict(initial)
    ctx.reset_peak()
    expected, expected_grads = train_losses_of(ctx, reference, data, autocast=True)
    reference_peak = ctx.peak_mb()
    del reference
    ctx.progress({"expected": expected, "reference_peak_mb": reference_peak})

    model = stacked_model(ctx, config, initial)
    if broken is not None:
        broken(model)
    torch._dynamo.utils.counters.clear()
    ctx.reset_peak()
    losses, grads = train_losses_of(ctx, model, data, autocast=False)
    agreement = {
        "fall": fall_agreement(losses, expected),
        "gradients": gradient_agreement(grads, expected_grads, ctx.precision),
        "worst_relative": worst_relative(losses, expected),  # in bf16 a figure (`run_agreement`)
    }
    steps_alike = ctx.cuda or agreement["worst_relative"] <= FP32_BOUND
    agreement["alike"] = agreement["fall"]["alike"] and agreement["gradients"]["alike"] and steps_alike
    figures = {
        "compiled": ctx.cuda,
        "blocks": config.n_layers,
        "steps": steps,
        "losses": losses,
        "expected": expected,
        "agreement": agreement,
        "peak_mb": ctx.peak_mb(),
        "reference_peak_mb": reference_peak,
        "graphs": dict(torch._dynamo.utils.counters["stats"]),
        "graph_breaks": dict(torch._dynamo.utils.counters["graph_break"]),
    }
    ctx.progress(figures)
    if not agreement["alike"]:
        raise AssertionError(f"the stacked layout trains unlike the plain model: {figures}")
    return figures


def stack_config(ctx: Ctx):
    """D's model: 2 of gpt2_small's blocks on a GPU, the tiny one on a CPU."""
    return gpt2_config(ctx, n_layers=2)


def initial_weights(config) -> dict[str, torch.Tensor]:
    """The weights both of D's models start from."""
    from scalelm.model.transformer import TransformerLM

    torch.manual_seed(0)
    return TransformerLM(config, VOCAB).state_dict()


def stacked_model(ctx: Ctx, config, initial: dict[str, torch.Tensor]) -> torch.nn.Module:
    """D's layout as Parallel.parallelize builds it for FSDP, with `initial`'s weights: selective checkpointing, then
    compile (on a GPU only: Inductor's C++ compile of every graph would double the CPU run in CI), then FSDP2 on a
    1-rank mesh. The farm's process for D builds it here too (`warm_stack`), so that D loads what that compiled."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from scalelm.model.transformer import TransformerLM
    from scalelm.parallel.activation_checkpoint import apply_activation_checkpointing
    from scalelm.parallel.compile import apply_compile
    from scalelm.parallel.data import apply_fsdp, materialise

    start_group(ctx)
    mesh = init_device_mesh(ctx.device.type, (1,), mesh_dim_names=("dp_shard",))
    with torch.device("meta"):
        model = TransformerLM(config, VOCAB)
    apply_activation_checkpointing(model, "selective")
    if ctx.cuda:
        apply_compile(model, ctx.device)
    model = apply_fsdp(model, mesh, ctx.dtype, True, False)
    materialise(model, ctx.device, False)
    model.init_buffers()
    set_model_state_dict(model, initial, options=StateDictOptions(full_state_dict=True))
    return model


STACK_WARMUP = 3  # D's steps in the farm: the first compiles; FSDP2's lazy start may recompile at the second


def warm_stack(ctx: Ctx) -> dict:
    """The farm's process for D: D's stacked model built and stepped through D's own code (`stacked_model`,
    `train_losses_of`, `one_batch`'s shapes), so that the FX-graph and AOT-autograd caches hold what D compiles."""
    config = stack_config(ctx)
    began = time.perf_counter()
    model = stacked_model(ctx, config, initial_weights(config))
    losses, _ = train_losses_of(ctx, model, one_batch(ctx, STACK_WARMUP), autocast=False)
    return {"compiled": ctx.cuda, "steps": len(losses), "seconds": round(time.perf_counter() - began, 1)}


def farm_stack(work: Path, cache: Path, cpu: bool) -> int:
    """The farm's D process (--farm-stack): `warm_stack` and what torch.compile did, in farm.stack.json."""
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    figures = warm_stack(Ctx(device, work, cache, "farm.stack"))
    figures["compile"] = compile_figures()
    (work / "farm.stack.json").write_text(json.dumps(figures, indent=2, default=str) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip teardown, as a check's child does


# --- G ---------------------------------------------------------------------------------------------------------------


WORLD8 = {  # name: (strategy, settings of the training config); eager: the plan does not model compilation
    "fsdp8_selective": ("fsdp", {"train": {"activation_checkpointing": "selective"}}),
    "cp4_long": (
        "cp",
        {
            "parallel": {"cp": 4, "dp_shard": 2},
            "data": {"seq_len": 8192},
            "model": {"max_seq_len": 8192, "d_model": 1024, "n_heads": 16, "d_ff": 4096},
        },
    ),
    "pp2_stage0": ("pp", {"parallel": {"pp": 2, "dp_shard": 4}}),
}


@check("G.world8", 40, Cold(2 * START_S, work_s=20))  # it and three eager layouts side by side
def world8(ctx: Ctx) -> dict:
    """Each layout in a process of its own, as rank 0 of 8 on the fake backend (its collectives do nothing), the three
    side by side (each process's peak is its own), eager (compiled runs sit 1.8-4.2x below the plan, which models no
    compilation: against it a compiled peak measures nothing): the memory of one training step on this rank, against
    the plan's; each layout's figures in paths.json as it lands."""
    commands = {
        f"G.{name}": ([sys.executable, str(SCRIPT), "--world8", name, *child_arguments(ctx)], {}) for name in WORLD8
    }
    figures: dict[str, dict] = {}

    def landed(process: str, code: int | str) -> None:
        name = process.removeprefix("G.")
        if code == 0:
            figures[name] = json.loads((ctx.work / f"G.{name}.json").read_text())
            ctx.progress(figures)

    run_processes(ctx, commands, 35 if ctx.cuda else 150, landed)
    return figures


def world8_layout(name: str, work: Path, cpu: bool) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from scalelm.config import from_dict
    from scalelm.model.transformer import TransformerLM
    from scalelm.optim import build_optimizer
    from scalelm.parallel.dims import MESH_DIMS
    from scalelm.parallel.env import DistEnv
    from scalelm.parallel.layout import resolve_layout
    from scalelm.parallel.numerics import Numerics
    from scalelm.parallel.runtime import Meshes, ModelOptions, Parallel
    from scalelm.plan.memory import Workload, plan_memory

    ctx = Ctx(torch.device("cpu") if cpu else torch.device("cuda", 0), work, work)
    strategy, changes = WORLD8[name]
    values = {"device": ctx.device.type, "parallel": {"strategy": strategy}, "model": {}, "data": {}, "train": {}}
    base = {
        "model": {"d_model": 768, "n_heads": 12, "n_layers": 12, "d_ff": 3072, "dropout": 0.0, "max_seq_len": 1024},
        "data": {"seq_len": 1024},
        "batch": {"size": 16},
    }
    if cpu:
        base = {
            "model": {"d_model": 32, "n_heads": 2, "n_layers": 4, "d_ff": 64, "dropout": 0.0, "max_seq_len": 256},
            "data": {"seq_len": 64},
            "batch": {"size": 8},
        }
        changes = {k: v for k, v in changes.items() if k not in ("model", "data")}
        if name == "cp4_long":
            changes = {**changes, "data": {"seq_len": 128}, "model": {"max_seq_len": 128}}
    for section in ("model", "data", "batch", "train", "parallel"):
        values[section] = {**base.get(section, {}), **values.get(section, {}), **changes.get(section, {})}
    values["train"].setdefault("precision", "bf16" if not cpu else "fp32")
    values["train"]["compile"] = False
    config = from_dict(values)
    if ctx.cuda:
        torch.cuda.set_device(ctx.device)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    env = DistEnv(rank=0, local_rank=0, world_size=8, device=ctx.device, procs_per_node=8)
    layout = resolve_layout(config, 8, 8, VOCAB)
    mesh = init_device_mesh(
        ctx.device.type, tuple(getattr(layout.dims, d) for d in MESH_DIMS), mesh_dim_names=MESH_DIMS
    )
    meshes = Meshes.of(mesh, layout.dims)
    numerics = Numerics.of(config.train, ctx.device)
    parallel = Parallel(env, layout, meshes, [(env.hostname, 0)] * 8, config.parallel, config.train, numerics)
    model = parallel.build(lambda: TransformerLM(config.model, VOCAB), 1, ModelOptions.of(config.train))
    optimizer = build_optimizer(model, config.optim, 1e-4)
    rows, seq = config.batch.size, config.data.seq_len
    tokens = torch.randint(0, VOCAB, (rows, seq + 1), device=ctx.device)
    built_mb = torch.cuda.memory_allocated() / 2**20 if ctx.cuda else None
    ctx.reset_peak()
    stepped = parallel.dims.pp == 1
    if stepped:  # torch's pipelining infers shapes with recv_object_list, which the fake backend cannot answer
        with parallel.loss_context():
            parallel.forward_backward(model, tokens[:, :-1], tokens[:, 1:], 1.0, 0)
        optimizer.step()
    ctx.sync()
    plan = plan_memory(Workload(config, VOCAB, ctx.device.type), layout.dims)
    result = {
        "layout": layout.dims.name,
        "stepped": stepped,
        "built_mb": built_mb,
        "peak_mb": ctx.peak_mb(),
        "plan_mb": plan.mb(),
    }
    (work / f"G.{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    sys.stdout.flush()
    os._exit(0)


# --- I ---------------------------------------------------------------------------------------------------------------

SHARE_LAYOUTS = {  # name: (settings, its one-process reference), each over 2 ranks on the one GPU
    "moe_ep": (["parallel.strategy=ep"], "moe"),
    "cp": (["parallel.strategy=cp"], "dense"),
    "ddp": (["parallel.strategy=ddp"], "dense"),
    "fsdp": (["parallel.strategy=fsdp"], "dense"),
}
SHARE_LAYOUTS_CPU = ("moe_ep",)  # CI proves the check's structure with one
SHARE_RANKS = 2
SHARE_AT_ONCE = 2  # layouts trained together: 4 rank processes time-sliced on the GPU, not 8
# NCCL's cuMem allocations, off for a second try when NCCL fails to start: sandboxed GPUs (gVisor) have run the
# lent machines, where NCCL's cuMem paths are unverified
CUMEM_OFF = {"NCCL_CUMEM_ENABLE": "0", "NCCL_CUMEM_HOST_ENABLE": "0"}
NCCL_COMMUNICATOR = re.compile(r"NCCL INFO comm \S+ rank \d+ nRanks (\d+) nNodes (\d+)")
NCCL_CHANNEL = re.compile(r"NCCL INFO Channel .* via (\w+(?:/\w+)?)")


def share_settings(ctx: Ctx, reference: str, steps: int) -> list[str]:
    """A layout's run, and its reference's: the course model (a mixture of experts for moe_ep) with dropout off, one
    global batch (16 x 128 tokens on a GPU) whatever the ranks, eager, its loss and gradient norm logged at every
    step."""
    common = ["model.dropout=0.0", "batch.mode=global", "train.log_every=1", "train.compile=false"]
    shape = [*device_settings(ctx), *(["data.seq_len=128", "batch.size=16"] if ctx.cuda else [])]
    experts = "{experts: 8, top_k: 2, d_ff: 1024}" if ctx.cuda else "{experts: 4, top_k: 2, d_ff: 64}"
    mixture = [f"model.moe={experts}"] if reference == "moe" else []
    return [*shape, *common, *mixture, f"train.max_steps={steps}"]


def rank_environment(rank: int, world: int, port: int, cuda: bool) -> dict[str, str]:
    """What torchrun gives rank `rank` of a one-node job (as scalelm.launch.spawn does), every rank on the one GPU
    (SCALELM_SHARE_GPU: scalelm.parallel.env), NCCL saying which transport it took."""
    from scalelm.parallel.env import SHARE_GPU

    environment = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        SHARE_GPU: "1",
    }
    return environment | ({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"} if cuda else {})


def ranks(
    ctx: Ctx, name: str, command: list[str], extra: dict[str, str] | None = None
) -> dict[str, tuple[list[str], dict[str, str]]]:
    """`command` as the SHARE_RANKS ranks of one job, `extra` added to each one's environment."""
    from scalelm.launch.launcher import free_port

    port = free_port()
    return {
        f"{name}.rank{r}": (command, rank_environment(r, SHARE_RANKS, port, ctx.cuda) | (extra or {}))
        for r in range(SHARE_RANKS)
    }


def nccl_transport(log: str) -> dict[str, list]:
    """What NCCL's INFO lines (NCCL_DEBUG=INFO) in a rank's log say: each communicator's [ranks, nodes] (`nRanks 2
    nNodes 2`), and the transports its channels took (`via NET/Socket`, `via P2P/...`, `via SHM/...`)."""
    communicators = sorted({(int(r), int(n)) for r, n in NCCL_COMMUNICATOR.findall(log)})
    return {"communicators": [list(c) for c in communicators], "transports": sorted(set(NCCL_CHANNEL.findall(log)))}


def two_nodes_over_sockets(facts: dict[str, list]) -> bool:
    """Every communicator of several ranks counted a node per rank (each rank's NCCL_HOSTID its own) and every channel
    went over sockets: how SCALELM_SHARE_GPU gets past NCCL's refusal of two ranks on one device. False for a log
    without those lines."""
    shared = [(r, n) for r, n in facts["communicators"] if r > 1]
    return bool(shared) and all(n == r for r, n in shared) and facts["transports"] == ["NET/Socket"]


def nccl_of(ctx: Ctx, job: str) -> dict[str, dict]:
    """`nccl_transport` of each rank's log of `job`, and whether all show two nodes over sockets."""
    facts = {
        f"rank{r}": nccl_transport((ctx.work / f"{job}.rank{r}.log").read_text(errors="replace"))
        for r in range(SHARE_RANKS)
    }
    return facts | {"two_nodes_over_sockets": all(two_nodes_over_sockets(f) for f in facts.values())}


@check("I.share", 75, Cold(4 * START_S, work_s=40))  # it, the smoke's ranks, two waves of layouts' ranks
def share(ctx: Ctx) -> dict:
    """Several NCCL ranks on the one GPU (each rank an NCCL "node" of its own through NCCL_HOSTID, which
    SCALELM_SHARE_GPU sets; unsupported by NVIDIA, time-sliced, every collective milliseconds: never timed). First a
    2-rank smoke of the collectives scalelm's layouts use, which fails fast, retried once with NCCL's cuMem off if
    NCCL fails to start; then each layout over 2 ranks through the CLI, two layouts at a time, against one process
    (in this one) on the same global batch of learnable data: 10 eager steps, `run_agreement`. On a GPU NCCL's log
    must show two nodes over sockets, for the smoke and every layout. On a CPU the same with gloo, for one layout."""
    smoke, extra = share_smoke_ranks(ctx)
    figures = {"smoke": smoke} | ({"cumem_off": True} if extra else {})
    ctx.progress(figures)
    layouts = SHARE_LAYOUTS if ctx.cuda else {name: SHARE_LAYOUTS[name] for name in SHARE_LAYOUTS_CPU}
    share_layouts(ctx, layouts, 10 if ctx.cuda else 4, extra, figures)
    failed = [name for name in layouts if not figures[name].get("alike")]
    if ctx.cuda and not smoke["nccl"]["two_nodes_over_sockets"]:
        failed.append("the smoke (NCCL's log)")
    if failed:
        raise AssertionError(f"on one GPU {', '.join(failed)} failed or differ from one process: {figures}")
    return figures


def share_smoke_ranks(ctx: Ctx) -> tuple[dict, dict[str, str]]:
    """The smoke over SHARE_RANKS ranks, once more with CUMEM_OFF on a GPU if NCCL failed to start (a rank wrote no
    findings; the first try's logs kept beside): each rank's findings and NCCL's log, and the environment the layouts
    then take."""
    command = [sys.executable, str(SCRIPT), "--share-smoke", *child_arguments(ctx)]
    extra: dict[str, str] = {}
    for attempt in range(2):
        try:
            finish_processes(ctx, start_processes(ctx, ranks(ctx, "I.smoke", command, extra)), 45 if ctx.cuda else 120)
            break
        except AssertionError:
            started = all((ctx.work / f"I.smoke.rank{r}.json").exists() for r in range(SHARE_RANKS))
            if started or attempt or not ctx.cuda:
                raise
            for r in range(SHARE_RANKS):
                log = ctx.work / f"I.smoke.rank{r}.log"
                log.rename(log.with_suffix(".first.log"))
            extra = CUMEM_OFF
    findings = {str(r): json.loads((ctx.work / f"I.smoke.rank{r}.json").read_text()) for r in range(SHARE_RANKS)}
    return findings | {"nccl": nccl_of(ctx, "I.smoke")}, extra


def share_layouts(ctx: Ctx, layouts: dict, steps: int, extra: dict[str, str], figures: dict) -> None:
    """Each layout over SHARE_RANKS ranks through the CLI, SHARE_AT_ONCE at a time, `extra` in their environment,
    the references trained in this process while the first ones run; each layout's `run_agreement` (and NCCL's log)
    into `figures` as it lands."""
    names, references = list(layouts), {}
    for first in range(0, len(names), SHARE_AT_ONCE):
        started = {}
        for name in names[first : first + SHARE_AT_ONCE]:
            settings, reference = layouts[name]
            run = ctx.work / "runs" / f"share_{name}"
            command = cli_command(ctx, run, [*share_settings(ctx, reference, steps), *settings])
            started[name] = start_processes(ctx, ranks(ctx, f"I.{name}", command, extra))
        if not references:
            references = share_references(ctx, {reference for _, reference in layouts.values()}, steps)
            figures["references"] = references
        for name, processes in started.items():
            figures[name] = share_verdict(ctx, name, processes, references[layouts[name][1]])
            ctx.progress(figures)


def share_references(ctx: Ctx, kinds: set[str], steps: int) -> dict[str, dict]:
    """Each reference (dense, moe) trained in this process: its `train_record`."""
    from scalelm.config import load_config
    from scalelm.train.run import run

    records = {}
    for reference in sorted(kinds):
        run_dir = ctx.work / "runs" / f"share_reference_{reference}"
        settings = [*share_settings(ctx, reference, steps), f"run_dir={run_dir}", f"data.prepared_dir={ctx.prepared()}"]
        run(load_config(None, settings + ["train.comm_profile_steps=0", "checkpoint.every=null"]))
        records[reference] = train_record(run_dir)
    return records


def share_verdict(ctx: Ctx, name: str, processes: dict[str, subprocess.Popen], reference: dict) -> dict:
    """A layout's ranks waited for: its `train_record` against its reference's, and NCCL's log (which must show two
    nodes over sockets on a GPU); `alike` says whether it passed."""
    try:
        finish_processes(ctx, processes, 120 if ctx.cuda else 240)
    except AssertionError as error:
        return {"error": str(error)[-2000:], "alike": False}
    record = train_record(ctx.work / "runs" / f"share_{name}")
    agreement = run_agreement(record, reference, ctx.precision)
    nccl = nccl_of(ctx, f"I.{name}")
    alike = agreement["alike"] and (nccl["two_nodes_over_sockets"] or not ctx.cuda)
    return {**record, "agreement": agreement, "nccl": nccl, "alike": alike}


def share_smoke(work: Path, cpu: bool) -> None:
    """One rank of the smoke: all_reduce, all_to_all_single with uneven splits (one of them empty) and a ring of
    batch_isend_irecv, each checked against what it must give; the rank's findings in I.smoke.rank<r>.json, exit 1 if
    any is wrong. The process group's timeout is short: a hang fails within seconds."""
    import torch.distributed as dist

    from scalelm.parallel.env import setup

    env = setup("cpu" if cpu else "cuda", timeout_s=30)
    rank, world, device = env.rank, env.world_size, env.device
    facts = {"device": str(device), "backend": str(dist.get_backend()), "nccl_hostid": os.environ.get("NCCL_HOSTID")}
    total = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(total)
    facts["all_reduce"] = total.tolist() == [world * (world + 1) / 2] * 4

    def rows(sender: int, receiver: int) -> int:  # uneven, and nothing from the last rank to the first
        return 0 if (sender, receiver) == (world - 1, 0) else sender + receiver + 1

    sends, receives = [rows(rank, peer) for peer in range(world)], [rows(peer, rank) for peer in range(world)]
    data = torch.cat([torch.full((n, 2), 10.0 * rank + peer, device=device) for peer, n in enumerate(sends)])
    out = torch.empty(sum(receives), 2, device=device)
    dist.all_to_all_single(out, data, receives, sends)
    expected = torch.cat([torch.full((n, 2), 10.0 * peer + rank, device=device) for peer, n in enumerate(receives)])
    facts["all_to_all_single"] = torch.equal(out, expected)

    send, received = torch.full((3,), float(rank), device=device), torch.empty(3, device=device)
    operations = [
        dist.P2POp(dist.isend, send, (rank + 1) % world),
        dist.P2POp(dist.irecv, received, (rank - 1) % world),
    ]
    for work_item in dist.batch_isend_irecv(operations):
        work_item.wait()
    facts["batch_isend_irecv"] = received.tolist() == [float((rank - 1) % world)] * 3
    dist.barrier()
    (work / f"I.smoke.rank{rank}.json").write_text(json.dumps(facts) + "\n")
    print(json.dumps(facts), flush=True)
    os._exit(0 if all(facts[op] for op in ("all_reduce", "all_to_all_single", "batch_isend_irecv")) else 1)


# --- E ---------------------------------------------------------------------------------------------------------------


# 112 s by its estimate (4 variants from the farm's cache, their warm-up steps, 5 rounds of 4 x 20 steps); the rest of
# its limit, most of a compiled optimizer the farm did not finish, goes to the later levers within its budget
@check("E.levers", 145, Cold(START_S, cached=4, work_s=44))
def levers(ctx: Ctx) -> dict:
    """gpt2_small's MFU levers (bf16_params, the compiled optimizer, both together as config.yaml suggests) against the
    experiment as configured, in this one process (bench/gpu_mfu.py), each built from the farm's graphs: the pair
    (configured, bf16_params) built and timed first, then each lever and a round, in rounds of 20 steps timed with
    CUDA events, within the time the runner gives it (less E_MARGIN_S); every variant's figures in paths.json as they
    come. It fails on an error (a variant run uncompiled included) or a pair without a measured round; a later lever
    the budget left out (`skipped`) or cut short (`cut_short`) is a note (gpu_mfu.failures)."""
    from bench import gpu_mfu

    names = gpu_mfu.LEVERS if ctx.cuda else gpu_mfu.CPU_LEVERS
    rounds, steps, warmup = (5, 20, 5) if ctx.cuda else (2, 2, 1)
    left = ctx.seconds_left()
    budget_s = None if left is None else max(0.0, left - E_MARGIN_S[ctx.device.type])
    results = gpu_mfu.measure(names, not ctx.cuda, ctx.work, rounds, steps, warmup, ctx.progress, budget_s)
    failed = gpu_mfu.failures(results)
    if failed:
        raise AssertionError(f"variants {', '.join(failed)} failed: {results}")
    return results


# --- the runner ------------------------------------------------------------------------------------------------------

# rehearsal only (--rehearse, CI): a check that hangs with a child of its own and ignores SIGTERM, so that only its
# group's SIGKILL ends it; it writes its own pid and its child's first, for the test to see both gone
HANG_PROGRAM = """import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "600"])
open(sys.argv[1], "w").write(f"{os.getpid()} {child.pid}")
time.sleep(600)
"""
REHEARSAL = {"Z.hang": 2.0}  # name: its limit in seconds (not scaled for the CPU)


def start_processes(ctx: Ctx, commands: dict[str, tuple[list[str], dict[str, str]]]) -> dict[str, subprocess.Popen]:
    """Each command (name: argv, environment added), side by side, its output in <name>.log under --work."""
    started = {}
    for name, (command, environment) in commands.items():
        with (ctx.work / f"{name}.log").open("w") as log:
            started[name] = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=os.environ | environment
            )
    return started


def finish_processes(
    ctx: Ctx,
    started: dict[str, subprocess.Popen],
    timeout: float,
    landed: Callable[[str, int | str], None] | None = None,
) -> None:
    """Wait for all (`wait_all`, `landed` told of each as it ends); a failure raises with the end of its log."""
    codes = wait_all(started, timeout, landed)
    for name, code in codes.items():
        if code != 0:
            tail = (ctx.work / f"{name}.log").read_text(errors="replace")[-1500:]
            raise AssertionError(f"{name} ended with {code} ({codes}); the end of {name}.log:\n{tail}")


def run_processes(
    ctx: Ctx,
    commands: dict[str, tuple[list[str], dict[str, str]]],
    timeout: float,
    landed: Callable[[str, int | str], None] | None = None,
) -> None:
    finish_processes(ctx, start_processes(ctx, commands), timeout, landed)


def child_arguments(ctx: Ctx) -> list[str]:
    """What a process this script starts for a check needs to find its folders and device."""
    return ["--work", str(ctx.work), "--cache", str(ctx.cache), *([] if ctx.cuda else ["--cpu"])]


def run_one(name: str, ctx: Ctx) -> dict:
    began = time.perf_counter()
    try:
        status, figures = "PASS", CHECKS[name].run(ctx)
    except NotApplicable as why:
        status, figures = "N/A", str(why)
    except Exception as error:
        status, figures = "FAIL", f"{type(error).__name__}: {error}"[:2000]
        (ctx.work / f"{name}.traceback.txt").write_text(traceback.format_exc())
    result = {"check": name, "status": status, "figures": figures, "seconds": round(time.perf_counter() - began, 2)}
    compiled = compile_figures()
    if compiled is not None:
        result["compile"] = compiled
    if status == "FAIL" and ctx.last_progress is not None:
        result["partial"] = ctx.last_progress  # what it measured before it failed
    return result


def compile_figures() -> dict | None:
    """What torch.compile did in this process (None if it compiled nothing): seconds in dynamo's frame compiles
    (Inductor's inside them), frames compiled, unique graphs, recompiles (a frame compiled again: a guard failed),
    graph breaks, the caches' hits and misses. A figure torch does not keep (its counters differ between versions)
    is None, or 0 for a count."""
    if "torch._dynamo" not in sys.modules:
        return None
    from torch._dynamo import convert_frame, utils

    counters = utils.counters
    frames = counters["frames"].get("total", 0)
    if not frames:
        return None
    seconds = None
    try:
        headers, values = utils.compile_times(repr="csv", aggregate=True)
        seconds = dict(zip(headers, map(float, values))).get("_compile.compile_inner")
    except (AttributeError, TypeError, ValueError):
        pass
    per_frame = getattr(convert_frame, "FRAME_COMPILE_COUNTER", None)
    return {
        "seconds": round(seconds, 2) if seconds is not None else None,
        "frames": frames,
        "unique_graphs": counters["stats"].get("unique_graphs"),
        "recompiles": sum(max(0, n - 1) for n in per_frame.values()) if per_frame is not None else None,
        "graph_breaks": sum(counters["graph_break"].values()),
        # whether it loaded the farm's graphs: the FX-graph (Inductor) and AOT-autograd caches' hits and misses
        "fx_graph_cache_hits": counters["inductor"]["fxgraph_cache_hit"],
        "fx_graph_cache_misses": counters["inductor"]["fxgraph_cache_miss"],
        "aot_autograd_cache_hits": counters["aot_autograd"]["autograd_cache_hit"],
        "aot_autograd_cache_misses": counters["aot_autograd"]["autograd_cache_miss"],
    }


def child(name: str, work: Path, cache: Path, cpu: bool) -> int:
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = Ctx(device, work, cache, name)
    if os.environ.get(DEADLINE_ENV):
        ctx.deadline = float(os.environ[DEADLINE_ENV])
    result = run_one(name, ctx)
    (work / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip teardown: process groups and compile workers left as they are cost nothing here


# --- process groups --------------------------------------------------------------------------------------------------


def start_in_group(command: list[str], env: dict, log: Path, nice: int = 0) -> subprocess.Popen:
    """`command` in a process group (a session) of its own, its output into `log`, at `nice` (0: as this one):
    `end_group` ends it and all it started (compile workers, ranks, a training)."""
    with log.open("w") as output:
        return subprocess.Popen(
            [*(["nice", "-n", str(nice)] if nice else []), *command],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (zombies, which hold nothing, left out), from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (name)": state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return sorted(members)


def end_group(pgid: int, grace: float) -> dict[str, list[int]]:
    """End every process of group `pgid`: SIGTERM, then SIGKILL to those left after `grace` seconds. What was
    running, what needed SIGKILL, and what is left (nothing, unless a process escaped in uninterruptible sleep)."""
    running = group_members(pgid)
    if not running:
        return {"running": [], "killed": [], "left": []}
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    stubborn = group_members(pgid)
    if stubborn:
        _signal_group(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
    return {"running": running, "killed": stubborn, "left": group_members(pgid)}


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the group ended meanwhile
        pass


# --- the compile farm ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FarmProcess:
    """One process of the farm: the checks that load what it compiles, the variants of E it warms up on each device
    (bench/gpu_mfu.py --warm-only; None: D's stack, through --farm-stack), and its cold estimate."""

    serves: tuple[str, ...]
    variants: dict[str, tuple[str, ...]] | None
    cold: Cold


# One process per distinct graph set, through the checks' own code, each model's graphs first: E's configured model
# (H's compiled step is the same graphs) then its compiled optimizer (the model's graphs shared in the process);
# bf16_params' model then its compiled optimizer over DTensors; D's stack. Two gpt2_small processes at batch 32 (~25
# GB each) fit an H100 beside the light checks; four would not. On a CPU they warm up E's CPU levers, eager: the
# mechanism, cheaply.
FARM = {
    "farm.configured": FarmProcess(
        ("E.levers", "H.baseline"),
        {"cuda": ("configured", "compiled_optimizer"), "cpu": ("configured",)},
        Cold(START_S, ("gpt2_small", "adamw"), work_s=5),
    ),
    "farm.bf16_params": FarmProcess(
        ("E.levers",),
        {"cuda": ("bf16_params", "bf16_params+compiled_optimizer"), "cpu": ("cudnn_attention",)},
        Cold(START_S, ("gpt2_small", "adamw"), work_s=5),
    ),
    "farm.stack": FarmProcess(("D.stack",), None, Cold(START_S, ("stack",), work_s=5)),
}
FARM_WARMUP = 2  # steps of each of E's variants in the farm: the first compiles, the last is gpu_mfu's compiled probe
# On a CPU the farm rehearses the mechanism only (nothing compiles): niced, so that it takes the cores the checks leave
# and the rehearsal's CI time hardly grows; on a GPU its compiles are the call's long pole, at the checks' priority
FARM_NICE = {"cuda": 0, "cpu": 10}


def farm_for(names: list[str]) -> list[str]:
    """The farm's processes for these checks: each that serves one of them, if one of them runs beside the farm (a
    farm with nothing beside it would be ended as it starts)."""
    if not set(names) & set(BESIDE_FARM):
        return []
    return [name for name, process in FARM.items() if set(process.serves) & set(names)]


def farm_window(names: list[str], limits: dict[str, float], budget: float) -> float:
    """Seconds from the call's start by which the farm is ended: the limits of the checks beside it (it may take what
    they leave, never a later check's own time)."""
    beside = sum(limits[name] for name in names if name in BESIDE_FARM)
    return min(beside, budget - sum(limits[name] for name in names if name not in BESIDE_FARM))


def farm_command(name: str, call: Path, cache: Path, cpu: bool) -> list[str]:
    """A farm process's command: E's variants warmed up by bench/gpu_mfu.py (--warm-only, its mfu.json in
    call/<name>), or D's stack by this script (--farm-stack: call/farm.stack.json)."""
    device = ["--cpu"] if cpu else []
    variants = FARM[name].variants
    if variants is None:
        return [sys.executable, str(SCRIPT), "--farm-stack", "--work", str(call), "--cache", str(cache), *device]
    only = [part for variant in variants["cpu" if cpu else "cuda"] for part in ("--only", variant)]
    mfu = [sys.executable, str(REPO / "bench" / "gpu_mfu.py"), str(call / name), "--warm-only", *only]
    return [*mfu, "--warmup", str(FARM_WARMUP), *device]


def compile_threads(processes: int) -> int:
    """Inductor's compile workers in each of `processes` farm processes: the cores shared out with a share left to
    the checks beside them (compile_threads is outside the caches' keys)."""
    return max(1, (os.cpu_count() or 1) // (processes + 1))


class Farm:
    """The compile farm (review 4, finding 1), started at t = 0: its processes (FARM) each in a process group of its
    own, with the checks' environment (their TORCHINDUCTOR_CACHE_DIR: what it compiles the later checks load). `end`
    kills its groups, keeping what they wrote under call/ for logs.tgz, before E starts, so that E times a quiet
    GPU; it records each process's compiles and whether it finished before."""

    def __init__(self, names: list[str], call: Path, cache: Path, env: dict, kind: str):
        self.call, self.kind = call, kind
        self.env = env | {"TORCHINDUCTOR_COMPILE_THREADS": str(compile_threads(len(names)))}
        self.commands = {name: farm_command(name, call, cache, kind == "cpu") for name in names}
        self.processes: dict[str, subprocess.Popen] = {}
        self.exited: dict[str, float] = {}  # seconds from the farm's start to each process's exit
        self.began = time.monotonic()

    def start(self) -> None:
        self.began = time.monotonic()
        for name, command in self.commands.items():
            process = start_in_group(command, self.env, self.call / f"{name}.log", FARM_NICE[self.kind])
            self.processes[name] = process
            threading.Thread(target=self.watch, args=(name, process), daemon=True).start()

    def watch(self, name: str, process: subprocess.Popen) -> None:
        """When `process` exits, while the checks run in the foreground (its time in the farm's record)."""
        process.wait()
        self.exited[name] = time.monotonic() - self.began

    def running(self) -> list[str]:
        return [name for name in self.processes if name not in self.exited]

    def wait(self, until: float) -> None:
        """Until every process has exited or time.monotonic() reaches `until`."""
        while self.running() and time.monotonic() < until:
            time.sleep(POLL_S[self.kind])

    def status(self) -> dict[str, dict]:
        return {name: {"status": "RUNNING", "serves": list(FARM[name].serves)} for name in self.commands}

    def end(self) -> dict[str, dict]:
        """Every process's group ended (SIGTERM, then SIGKILL); each one's record."""
        exited = dict(self.exited)  # before the end
        records = {}
        for name, process in self.processes.items():
            ended = end_group(process.pid, KILL_GRACE_S[self.kind])
            process.wait()
            code = process.returncode if name in exited else None
            records[name] = {
                "serves": list(FARM[name].serves),
                "finished": code == 0,  # by itself, before the farm was ended
                "exit": code if code is not None else "ended",
                "wall_s": round(exited.get(name, time.monotonic() - self.began), 1),
                "cold_estimate_s": FARM[name].cold.seconds,
                "compile": farm_compiles(name, self.call, self.kind == "cpu"),
            }
            if ended["running"]:
                records[name]["process_group"] = ended  # what was still running when the farm was ended
        return records


def farm_compiles(name: str, call: Path, cpu: bool) -> dict:
    """What a farm process wrote of its compiles: each of E's variants' compile figures from its mfu.json (or why
    there are none), or D's stack's from farm.stack.json."""
    variants = FARM[name].variants
    written = call / (f"{name}.json" if variants is None else f"{name}/mfu.json")
    try:
        found = json.loads(written.read_text())
    except (OSError, ValueError):  # none yet, or cut off mid-write
        found = None
    if variants is None:
        return found if found is not None else {"missing": f"no readable {written.name}: the farm ended it first"}
    warmed = {}
    for variant in variants["cpu" if cpu else "cuda"]:
        figures = (found or {}).get(variant)
        keep = ("compile", "build_and_warmup_s", "error")
        warmed[variant] = {k: figures[k] for k in keep if k in figures} if figures else "not warm when the farm ended"
    return warmed


# --- what comes back -------------------------------------------------------------------------------------------------


def kept_bytes(sizes: dict[str, int], cap: int) -> dict[str, int]:
    """How many bytes of each file fit in `cap` together: all of each small file, and the largest cut to one common
    length, so that no file is cut shorter than another one that is cut."""
    kept, left = {}, cap
    ordered = sorted(sizes.items(), key=lambda item: item[1])
    for i, (name, size) in enumerate(ordered):
        share = left // (len(ordered) - i)
        if size <= share:
            kept[name], left = size, left - size
        else:
            kept.update({other: share for other, _ in ordered[i:]})
            break
    return kept


def cut(data: bytes, keep: int) -> bytes:
    """`data` cut to `keep` bytes: a quarter from its head, the rest from its tail (where a traceback ends)."""
    if len(data) <= keep:
        return data
    marker = f"\n[... {len(data) - keep} bytes cut by bench/gpu_paths.py ...]\n".encode()
    head = max(0, keep // 4)
    tail = max(0, keep - head - len(marker))
    return data[:head] + marker + data[len(data) - tail :]


def log_files(folder: Path) -> dict[str, Path]:
    """This call's logs, records and tracebacks (no checkpoints, caches or data), by their path under `folder`."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink() and path.suffix in LOG_SUFFIXES and "checkpoints" not in path.parts:
            found[str(path.relative_to(folder))] = path
    return found


def write_logs(folder: Path, target: Path, cap: int = LOGS_CAP) -> dict:
    """A gzipped tar of `folder`'s logs at `target` (atomically), its members at most `cap` bytes with their headers;
    what it holds and which files were cut."""
    files = log_files(folder)
    sizes = {}
    for name, path in files.items():
        try:
            sizes[name] = path.stat().st_size
        except OSError:  # removed meanwhile
            continue
    overhead = 1024 * len(sizes) + 10240  # a header and its padding per member, and the tar's end
    kept = kept_bytes(sizes, max(0, cap - overhead))
    truncated = {}
    with atomic_path(target) as partial, tarfile.open(partial, "w:gz") as tar:
        for name in sizes:
            try:
                data = files[name].read_bytes()
            except OSError:
                continue
            if len(data) > kept[name]:
                truncated[name] = {"bytes": len(data), "kept": kept[name]}
                data = cut(data, kept[name])
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return {"file": target.name, "members": len(sizes), "bytes": target.stat().st_size, "truncated": truncated}


class Report:
    """paths.json and logs.tgz in --out: rewritten after every check, and while a check runs whenever it reports
    progress, so that a call cut off at any point brings back what it had."""

    def __init__(self, out: Path, call: Path, header: dict):
        self.out, self.call, self.header = out, call, header
        self.results: list[dict] = []
        self.logs: dict = {}
        self.farm: dict = {}  # each farm process's record (Farm.status, then Farm.end)

    def add(self, result: dict) -> None:
        self.results.append(result)
        self.logs = write_logs(self.call, self.out / "logs.tgz")
        self.write()

    def running(self, name: str, figures: dict, limit: float) -> None:
        self.write([{"check": name, "status": "RUNNING", "figures": figures, "limit_s": round(limit, 1)}])

    def write(self, extra: list[dict] = ()) -> None:
        line, _ = tally(self.results)
        checks = [*self.results, *extra]
        document = {**self.header, "summary": line, "farm": self.farm, "checks": checks, "logs": self.logs}
        atomic_write_text(self.out / "paths.json", json.dumps(document, indent=2, default=str) + "\n")


def plan(names: list[str], cpu: bool) -> dict[str, float]:
    """Each chosen check's limit in seconds: its GPU estimate, times CPU_FACTOR on a CPU."""
    return {
        name: REHEARSAL[name] if name in REHEARSAL else CHECKS[name].seconds * (CPU_FACTOR if cpu else 1)
        for name in names
    }


def command_of(name: str, call: Path, cache: Path, cpu: bool) -> list[str]:
    if name == "Z.hang":
        return [sys.executable, "-c", HANG_PROGRAM, str(call / "Z.hang.pids")]
    return [sys.executable, str(SCRIPT), "--child", name, "--work", str(call), "--cache", str(cache)] + (
        ["--cpu"] if cpu else []
    )


def run_check(name: str, limit: float, command: list[str], env: dict, call: Path, report: Report, kind: str) -> dict:
    """One check in a process group of its own, under `limit` seconds; its progress copied into paths.json as it
    comes; its group ended when it ends or at its limit."""
    started, progress, seen = time.perf_counter(), progress_file(call, name), None
    process = start_in_group(command, env | {DEADLINE_ENV: f"{time.time() + limit:.3f}"}, call / f"{name}.log")
    while True:
        try:
            code = process.wait(timeout=POLL_S[kind])
            break
        except subprocess.TimeoutExpired:
            pass
        seen = publish_progress(progress, seen, lambda figures: report.running(name, figures, limit))
        if time.perf_counter() - started >= limit:
            code = "timeout"
            break
    ended = end_group(process.pid, KILL_GRACE_S[kind])  # at its limit, or whatever it left running
    process.wait()
    record = call / f"{name}.json"
    if code == 0 and record.exists():
        result = json.loads(record.read_text())
    else:
        why = f"its limit of {limit:.0f} s ran out" if code == "timeout" else f"exit {code}"
        tail = (call / f"{name}.log").read_text(errors="replace")[-1500:]
        result = {"check": name, "status": "FAIL", "figures": f"{why}: {tail}"}
        publish_progress(progress, None, lambda figures: result.update(partial=figures))
    result.update(wall_s=round(time.perf_counter() - started, 1), limit_s=round(limit, 1))
    if ended["running"]:
        result["process_group"] = ended  # what was still running when it ended or was stopped
    return result


def publish_progress(progress: Path, seen: float | None, publish: Callable[[dict], None]) -> float | None:
    """Hand a check's progress file to `publish` if it changed since `seen` (its modification time, returned)."""
    try:
        changed = progress.stat().st_mtime
        if changed != seen:
            publish(json.loads(progress.read_text()))
        return changed
    except (OSError, ValueError):  # none yet, or replaced meanwhile: the next poll reads it
        return seen


def prepare_work(work: Path) -> tuple[Path, Path]:
    """--work made ours (its marker), this call's folder emptied; (this call's folder, the cache kept across calls)."""
    check_replaceable(work, MARKER, "bench/gpu_paths.py's working files")
    work.mkdir(parents=True, exist_ok=True)
    (work / MARKER).write_text("bench/gpu_paths.py's working folder: it empties call/ at every call\n")
    call, cache = work / "call", work / "cache"
    shutil.rmtree(call, ignore_errors=True)
    call.mkdir()
    cache.mkdir(exist_ok=True)
    return call, cache


def parent(args: argparse.Namespace) -> int:
    out: Path = args.out
    call, cache = prepare_work(args.work)
    out.mkdir(parents=True, exist_ok=True)
    kind = "cpu" if args.cpu else "cuda"
    env = os.environ | {
        "TORCHINDUCTOR_CACHE_DIR": str((cache / "inductor").resolve()),
        "TRITON_CACHE_DIR": str((cache / "triton").resolve()),
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
    }
    names = chosen(args)
    limits = plan(names, args.cpu)
    budget = args.budget or sum(limits.values())
    header = {"mode": kind, "work": str(args.work), "budget_s": budget, "limits_s": limits}  # the device: check A
    header["cold_estimates_s"] = {name: CHECKS[name].cold.seconds for name in names if name in CHECKS}
    report = Report(out, call, header)
    report.write()
    farm = Farm(farm_for(names), call, cache, env, kind) if farm_for(names) else None
    began = time.monotonic()
    if farm is not None:  # at t = 0, beside the light checks
        farm.start()
        report.farm = farm.status()
        report.write()
    try:
        for i, name in enumerate(names):
            if farm is not None and name not in BESIDE_FARM:  # ended before E: E times a quiet GPU
                farm.wait(began + farm_window(names, limits, budget))
                end_farm(farm, report)
                farm = None
            left = budget - (time.monotonic() - began)
            limit = turn_limit(limits[name], [limits[later] for later in names[i + 1 :]], left)
            if limit is None:
                result = {"check": name, "status": "SKIPPED", "figures": f"{left:.0f} s of --budget {budget:g} s left"}
            else:
                result = run_check(name, limit, command_of(name, call, cache, args.cpu), env, call, report, kind)
            report.add(result)
            print(result_line(result), flush=True)
    finally:  # never a farm left running past the call
        if farm is not None:
            end_farm(farm, report)
    line, code = tally(report.results)
    print(f"paths on {kind}: {line}")
    return code


def turn_limit(own: float, later: list[float], left: float) -> float | None:
    """A check's limit in its turn: its own, and what earlier checks did not use of theirs (never the later checks'
    own time), within what is left; None (SKIPPED) when less is left than it or MIN_START_S needs."""
    if left < min(own, MIN_START_S):
        return None
    return min(left, max(own, left - sum(later)))


def result_line(result: dict) -> str:
    if result["status"] == "SKIPPED":
        return f"SKIPPED {result['check']:<12} {result['figures']}"
    return f"{result['status']:<7} {result['check']:<12} {result['wall_s']:>6.1f} s  {_short(result['figures'])}"


def end_farm(farm: Farm, report: Report) -> None:
    """The farm ended, its records into paths.json, a line for each process."""
    report.farm = farm.end()
    report.write()
    for name, record in report.farm.items():
        state = "finished" if record["finished"] else "ended" if record["exit"] == "ended" else f"exit {record['exit']}"
        print(f"FARM    {name:<17} {state} at {record['wall_s']:.1f} s  {_short(record['compile'])}", flush=True)


def chosen(args: argparse.Namespace) -> list[str]:
    """The checks to run, in RUN_ORDER, then the rehearsal's (--rehearse)."""
    available = [*RUN_ORDER, *(REHEARSAL if args.rehearse else ())]
    if not args.only:
        return available
    return [name for name in available if name in args.only or name.split(".")[0] in args.only]


STATUSES = ("PASS", "FAIL", "N/A", "SKIPPED")


def tally(results: list[dict]) -> tuple[str, int]:
    """The last line's counts of each status, the checks that failed or were skipped named, and the exit status: 1
    when any check failed or was skipped (a call that left checks unrun proved nothing about them)."""
    counts = ", ".join(f"{sum(r['status'] == s for r in results)} {s}" for s in STATUSES)
    unproven = {s: [r["check"] for r in results if r["status"] == s] for s in ("FAIL", "SKIPPED")}
    named = "".join(f"; {s.lower()}: {', '.join(checks)}" for s, checks in unproven.items() if checks)
    return counts + named, 1 if any(unproven.values()) else 0


def only_checks(asked: list[str], rehearse: bool = False) -> str | None:
    """Why `--only` cannot be run as given: a name that is no check's, nor the letter of one (None: it can)."""
    known = [*RUN_ORDER, *(REHEARSAL if rehearse else ())]
    letters = {name.split(".")[0] for name in known}
    for name in asked:
        if name not in known and name not in letters:
            return f"--only: {unknown(name, sorted(known), 'check')} (or its letter, {', '.join(sorted(letters))})"
    return None


def _short(figures) -> str:
    text = json.dumps(figures, default=str) if not isinstance(figures, str) else figures
    return text if len(text) < 160 else text[:157] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_dir, help="where paths.json and logs.tgz go: the machine's $OUT")
    parser.add_argument(
        "--work", type=output_dir, default=DEFAULT_WORK, help=f"working folder (default {DEFAULT_WORK})"
    )
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on CPU; CUDA-only figures are null")
    parser.add_argument("--only", nargs="+", help="checks to run, by name or letter (default: all)")
    parser.add_argument("--budget", type=positive, help="seconds for the checks (default: the sum of their limits)")
    parser.add_argument("--rehearse", action="store_true", help="with --cpu: add the runner's drill (Z: a hung check)")
    for hidden in ("--child", "--world8"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--hang", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--share-smoke", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--farm-stack", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hang:
        return hang(args.hang, args.cpu)
    if args.world8:
        return world8_layout(args.world8, args.work, args.cpu)
    if args.share_smoke:
        return share_smoke(args.work, args.cpu)
    if args.farm_stack:
        return farm_stack(args.work, args.cache, args.cpu)
    if args.child:
        return child(args.child, args.work, args.cache, args.cpu)
    problem = parent_problem(args)
    if problem:
        parser.error(problem)
    return parent(args)


def parent_problem(args: argparse.Namespace) -> str | None:
    """Why the call cannot start as asked (None: it can): before any folder is made or emptied."""
    if args.out is None:
        return "--out is required: the folder paths.json and logs.tgz go to (the machine's $OUT)"
    if args.only and only_checks(args.only, args.rehearse):
        return only_checks(args.only, args.rehearse)
    if args.rehearse and not args.cpu:
        return "--rehearse is the runner's drill for CI: use it with --cpu"
    if not args.cpu and not torch.cuda.is_available():
        return "no CUDA device is visible; run with --cpu for the CPU checks"
    try:
        check_apart(args.out, {"--work": args.work})
        check_replaceable(args.work, MARKER, "bench/gpu_paths.py's working files")
    except OutputError as error:
        return str(error)
    return None


if __name__ == "__main__":
    sys.exit(main())
