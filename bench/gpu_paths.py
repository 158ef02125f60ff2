"""The GPU proof kit, part 3: the paths the probe and the smoke test do not cover, in one call that fits a cold lent
GPU (../shared/notes/gpu-review-3.md, findings 1-5 and 15; docs/gpu.md gives the command and its limit).

    PYTHONPATH=src:. python3 bench/gpu_paths.py --out "$OUT"            # one CUDA GPU, no network: about 8 minutes
    PYTHONPATH=src:. python3 bench/gpu_paths.py --out DIR --cpu         # the same checks on CPU, tiny shapes (CI)
    PYTHONPATH=src:. python3 bench/gpu_paths.py --out DIR --cpu --rehearse --only A Z --budget 3   # the runner's drill

What comes back: the machine returns at most 8 files of at most 16 MiB from its output folder, so everything is
written under a working folder (--work, under /tmp: caches, data, runs, logs) and --out receives two files only,
rewritten (atomically) as the call goes: paths.json (every check's status and figures, written after each check and
after each variant inside one) and logs.tgz (the logs and tracebacks, at most 15 MiB: the largest are cut first,
keeping their head and tail, and paths.json says which). A call cut off keeps both as they were.

It fits cold: the checks run cheapest proof first (RUN_ORDER), each in its own process group under a limit from its
cold estimate on an H200 (CHECKS; their sum, with a minute's margin, within 9 minutes: --budget), and a check that
ends early leaves its time to the later ones. At its limit a check's whole group is ended (SIGTERM, then SIGKILL), so
no training of it goes on beside the next one; so is anything it left running when it ended. A check that cannot get
its time is SKIPPED. The last line counts each status; the exit status is 1 when any check failed or was skipped.

    A versions     torch, CUDA, cuDNN, NCCL, SDPA's priority order; which Flight Recorder dump functions exist
    J moe          config.yaml's one-GPU `moe` experiment, 10 steps on the GPU against the same on the CPU in fp32
    B nccl         a 1-rank NCCL group beside gloo: each recorder's entries, sequence numbers under
                   cuda:nccl,cpu:gloo, the watchdog ending a hung step (exit 76) and naming the collective
    F lightning    Lightning against scalelm's engine through the CLI: losses, tokens/s, run.json
    C ring         ring attention on one device against SDPA: error, time, peak memory, host syncs, dropout,
                   selective vs no checkpointing, graph breaks under compile
    H baseline     the machine baseline on the gpt2 shapes: output product unpadded vs padded, health
    G world8       one rank of 8-rank layouts through the fake backend: peak memory against the plan
    D stack        selective checkpointing -> compile -> FSDP2 on a 1-rank mesh against eager autocast
    I share        several NCCL ranks on the one GPU (SCALELM_SHARE_GPU): a 2-rank smoke of all_reduce, uneven
                   all_to_all_single and batch_isend_irecv, then moe_ep, cp, ddp and fsdp over 2 ranks against one
                   process, 10 eager steps each
    E levers       the MFU levers interleaved in one process (bench/gpu_mfu.py), CUDA events, 100 steps each

No compiled run evaluates: E, D and H step without evaluating, and the CLI runs (F, I) are eager (an evaluation
compiles nothing more since scalelm.train.evaluation runs the blocks eagerly). No run writes a gpt2_small checkpoint:
the CLI runs train the course model, whose final checkpoint stays in --work.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import time
import traceback
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

WINDOW_S = 540  # what one call may take: a 15-minute lease less 2-4 minutes of start-up, and room for one rerun
MARGIN_S = 60  # of WINDOW_S, for the runner itself (start-up, ending process groups, writing what comes back)
CPU_FACTOR = 4  # a check's limit on a CPU (CI, beside other work), against its GPU estimate
MIN_START_S = 10  # no check starts with less than this left (or its own limit, if smaller)
KILL_GRACE_S = {"cuda": 5.0, "cpu": 1.0}  # between SIGTERM and SIGKILL to a check's process group
POLL_S = {"cuda": 2.0, "cpu": 0.5}  # how often a running check's progress is copied into paths.json
LOGS_CAP = 15 * 2**20  # logs.tgz's members at most (headers included), under the machine's 16 MiB per file
LOG_SUFFIXES = (".log", ".json", ".jsonl", ".txt", ".yaml")
MARKER = ".scalelm-gpu-paths"  # in --work: a folder this script may clear
DEFAULT_WORK = Path("/tmp/scalelm-gpu-paths")
BF16_BOUND, FP32_BOUND = 3e-2, 1e-4  # worst relative difference of step losses: bf16 on a GPU (docs/gpu.md), fp32


@dataclass(frozen=True)
class Check:
    run: Callable[[Ctx], dict]
    seconds: float  # its limit: a cold estimate on one H200 (the review's table), first compile included


CHECKS: dict[str, Check] = {}
# cheapest proof first; H before E and G before D, so that their first compiles fill the shared Inductor cache
RUN_ORDER = (
    "A.versions",
    "J.moe",
    "B.nccl",
    "F.lightning",
    "C.ring",
    "H.baseline",
    "G.world8",
    "D.stack",
    "I.share",
    "E.levers",
)


def check(name: str, seconds: float):
    def register(fn):
        CHECKS[name] = Check(fn, seconds)
        return fn

    return register


class NotApplicable(Exception):
    """The check needs what this run does not have (a CUDA device, a library)."""


class Ctx:
    """A check's device, this call's folder for its files (`work`), the folder kept across calls (`cache`)."""

    def __init__(self, device: torch.device, work: Path, cache: Path, name: str = ""):
        self.device, self.work, self.cache, self.name = device, work, cache, name
        self.last_progress: dict | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cuda else torch.float32

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
        """Random WikiText-2-sized prepared data, made once and kept across calls."""
        from bench.throughput import make_prepared

        final = self.cache / "prepared"
        if not final.exists():
            with atomic_path(final) as partial:  # a check cut off while writing leaves no half of it
                make_prepared(partial)
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


def wait_all(processes: dict[str, subprocess.Popen], timeout: float) -> dict[str, int | str]:
    """Each process's exit status ("timeout" past `timeout` s); once one fails, the others are killed (a rank whose
    peer died would wait for it until the process group's timeout)."""
    deadline, codes = time.monotonic() + timeout, {}
    while len(codes) < len(processes):
        for name, process in processes.items():
            if name not in codes and process.poll() is not None:
                codes[name] = process.returncode
        failed = any(code != 0 for code in codes.values())
        if failed or time.monotonic() > deadline:
            for name, process in processes.items():
                if name not in codes:
                    process.kill()
                    process.wait()
                    codes[name] = "killed" if failed else "timeout"
        if len(codes) < len(processes):
            time.sleep(0.1)
    return codes


# --- A ---------------------------------------------------------------------------------------------------------------


@check("A.versions", 15)
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


@check("B.nccl", 35)
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


@check("J.moe", 30)
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
        with HostSyncs() as syncs:
            stepper.step(batches)
        runs[label] = {
            "losses": losses,
            "seconds": round(seconds, 2),
            "peak_mb": ctx.peak_mb() if label == "device" else None,
            "host_syncs_per_step": syncs.count,
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


def train_losses(run: Path) -> list[float]:
    from scalelm.train.record import read_metrics

    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


@check("F.lightning", 35)
def lightning(ctx: Ctx) -> dict:
    """Lightning's engine against scalelm's through the CLI: the same losses, run.json, tokens/s."""
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
            "losses": [r["loss"] for r in train],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "mfu": [r.get("mfu") for r in steady][-1],
            "peak_mem_mb": max(r["peak_mem_mb"] or 0 for r in train),
            "run_json": (run / "run.json").exists(),
        }
    figures["worst_relative"] = worst_relative(figures["lightning"]["losses"], figures["scalelm"]["losses"])
    if not figures["worst_relative"] <= ctx.bound or not figures["lightning"]["run_json"]:
        raise AssertionError(f"Lightning's run differs from scalelm's: {figures}")
    return figures


# --- C ---------------------------------------------------------------------------------------------------------------


def ring_shapes(ctx: Ctx) -> dict[str, tuple[int, int, int, int]]:
    """(batch, heads, length, head_dim) of one rank's attention: gpt2_small's, and cp_long's (cp 4 of 8192)."""
    if ctx.cuda:
        return {"gpt2": (16, 12, 1024, 64), "cp_long": (8, 16, 2048, 64)}
    return {"gpt2": (2, 2, 64, 16), "cp_long": (1, 2, 128, 16)}


class HostSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operations that read a number back to the host or copy between devices."""

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


@check("C.ring", 45)
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
        with HostSyncs() as syncs:
            steps[label]()
        figures[f"{label}_host_syncs"] = syncs.count
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


@check("H.baseline", 45)
def machine_baseline(ctx: Ctx) -> dict:
    """scalelm.measure.baseline's one-rank part on gpt2_small's shapes and batch (32): the output product unpadded and
    padded (the padded one is what training runs), the model step compiled as the experiment is (the compile E's
    configured variant then finds in the shared cache), and the GPU's health sampled during the work against an idle
    reading."""
    from scalelm.config import load_config
    from scalelm.measure import baseline

    config = load_config(None)
    config.model = gpt2_config(ctx)
    config.data.seq_len, config.batch.size = (1024, 32) if ctx.cuda else (64, 4)
    config.data.prepared_dir = str(ctx.work / "no-prepared-data")  # no manifest: WikiText-2's vocabulary
    config.train.compile = ctx.cuda
    outputs = baseline.matmul_rates(baseline.output_shapes(config), ctx.device, ctx.dtype)
    alone = baseline.measure_alone(
        config, baseline.gemm_shapes(config, ctx.device.type), VOCAB, ctx.device, all_cores=False
    )
    return {"output_products": outputs, "alone": alone, "idle_health": baseline.gpu_health(ctx.device)}


# --- D ---------------------------------------------------------------------------------------------------------------


def gpt2_config(ctx: Ctx, dropout: float = 0.0):
    from scalelm.config import ModelConfig

    if ctx.cuda:
        return ModelConfig(
            d_model=768,
            n_heads=12,
            n_layers=12,
            d_ff=3072,
            dropout=dropout,
            max_seq_len=1024,
            norm="pre",
            tie_weights=True,
        )
    return ModelConfig(
        d_model=32, n_heads=2, n_layers=2, d_ff=64, dropout=dropout, max_seq_len=64, norm="pre", tie_weights=True
    )


def batches(ctx: Ctx, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rows, seq = (16, 1024) if ctx.cuda else (4, 64)
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, VOCAB, (rows, seq + 1), generator=generator).to(ctx.device) for _ in range(steps)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def train_losses_of(ctx: Ctx, model, data, autocast: bool) -> list[float]:
    from scalelm.config import OptimConfig
    from scalelm.optim import build_optimizer

    optimizer = build_optimizer(model, OptimConfig(), 3e-4)
    losses = []
    for inputs, targets in data:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast and ctx.cuda):
            loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return [float(x) for x in torch.stack(losses).cpu()]


@check("D.stack", 45)
def stack(ctx: Ctx) -> dict:
    """gpt2_small's blocks as Parallel.parallelize builds them for FSDP: selective checkpointing, then compile, then
    FSDP2 on a 1-rank mesh, against the plain model under autocast (eager: one compile in the check, which G's
    already made for the shared cache), over the same batches."""
    import torch._dynamo
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from scalelm.model.transformer import TransformerLM
    from scalelm.parallel.activation_checkpoint import apply_activation_checkpointing
    from scalelm.parallel.compile import apply_compile
    from scalelm.parallel.data import apply_fsdp, materialise

    compile_too = ctx.cuda  # inductor's C++ compile of every graph would double the CPU run in CI
    config, steps = gpt2_config(ctx), 20 if ctx.cuda else 3
    data = batches(ctx, steps)
    torch.manual_seed(0)
    initial = TransformerLM(config, VOCAB).state_dict()

    reference = TransformerLM(config, VOCAB).to(ctx.device)
    reference.load_state_dict(initial)
    ctx.reset_peak()
    expected = train_losses_of(ctx, reference, data, autocast=True)
    reference_peak = ctx.peak_mb()
    del reference
    ctx.progress({"expected": expected, "reference_peak_mb": reference_peak})

    start_group(ctx)
    mesh = init_device_mesh(ctx.device.type, (1,), mesh_dim_names=("dp_shard",))
    with torch.device("meta"):
        model = TransformerLM(config, VOCAB)
    apply_activation_checkpointing(model, "selective")
    if compile_too:
        apply_compile(model, ctx.device)
    model = apply_fsdp(model, mesh, ctx.dtype, True, False)
    materialise(model, ctx.device, False)
    model.init_buffers()
    set_model_state_dict(model, initial, options=StateDictOptions(full_state_dict=True))
    torch._dynamo.utils.counters.clear()
    ctx.reset_peak()
    losses = train_losses_of(ctx, model, data, autocast=False)
    worst = worst_relative(losses, expected)
    figures = {
        "compiled": compile_too,
        "steps": steps,
        "losses": losses,
        "expected": expected,
        "worst_relative": worst,
        "peak_mb": ctx.peak_mb(),
        "reference_peak_mb": reference_peak,
        "graphs": dict(torch._dynamo.utils.counters["stats"]),
        "graph_breaks": dict(torch._dynamo.utils.counters["graph_break"]),
    }
    if not worst <= ctx.bound:
        raise AssertionError(f"losses differ by {worst:.2e} (> {ctx.bound}): {figures}")
    return figures


# --- G ---------------------------------------------------------------------------------------------------------------


WORLD8 = {  # name: (strategy, settings of the training config)
    "fsdp8_compile_selective": ("fsdp", {"train": {"compile": True, "activation_checkpointing": "selective"}}),
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


@check("G.world8", 55)
def world8(ctx: Ctx) -> dict:
    """Each layout in a process of its own, as rank 0 of 8 on the fake backend (its collectives do nothing), the three
    side by side (each process's peak is its own): the memory of one training step on this rank, against the plan's."""
    commands = {
        f"G.{name}": ([sys.executable, str(SCRIPT), "--world8", name, *child_arguments(ctx)], {}) for name in WORLD8
    }
    run_processes(ctx, commands, 50 if ctx.cuda else 150)
    return {name: json.loads((ctx.work / f"G.{name}.json").read_text()) for name in WORLD8}


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
        if "train" in changes:
            changes = {**changes, "train": {**changes["train"], "compile": False}}
    for section in ("model", "data", "batch", "train", "parallel"):
        values[section] = {**base.get(section, {}), **values.get(section, {}), **changes.get(section, {})}
    values["train"].setdefault("precision", "bf16" if not cpu else "fp32")
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


def share_settings(ctx: Ctx, reference: str, steps: int) -> list[str]:
    """A layout's run, and its reference's: the course model (a mixture of experts for moe_ep) with dropout off, one
    global batch (16 x 128 tokens on a GPU) whatever the ranks, eager, its loss logged at every step."""
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


def ranks(ctx: Ctx, name: str, command: list[str]) -> dict[str, tuple[list[str], dict[str, str]]]:
    """`command` as the SHARE_RANKS ranks of one job."""
    from scalelm.launch.launcher import free_port

    port = free_port()
    return {f"{name}.rank{r}": (command, rank_environment(r, SHARE_RANKS, port, ctx.cuda)) for r in range(SHARE_RANKS)}


@check("I.share", 60)
def share(ctx: Ctx) -> dict:
    """Several NCCL ranks on the one GPU (review 3, finding 5: each rank an NCCL "node" of its own through
    NCCL_HOSTID, which SCALELM_SHARE_GPU sets; unsupported by NVIDIA, time-sliced: never timed). First a 2-rank smoke
    of the collectives scalelm's layouts use, which fails fast; then each layout over 2 ranks through the CLI, all
    side by side, against one process (in this one) on the same global batch: 10 eager steps, the losses within the
    bound. On a CPU the same with gloo, for one layout."""
    from scalelm.config import load_config
    from scalelm.train.run import run

    smoke = ranks(ctx, "I.smoke", [sys.executable, str(SCRIPT), "--share-smoke", *child_arguments(ctx)])
    finish_processes(ctx, start_processes(ctx, smoke), 45 if ctx.cuda else 120)
    figures = {"smoke": {r: json.loads((ctx.work / f"I.smoke.rank{r}.json").read_text()) for r in range(SHARE_RANKS)}}
    ctx.progress(figures)
    steps, prepared = 10 if ctx.cuda else 4, ctx.prepared()
    layouts = SHARE_LAYOUTS if ctx.cuda else {name: SHARE_LAYOUTS[name] for name in SHARE_LAYOUTS_CPU}
    started = {}
    for name, (settings, reference) in layouts.items():
        command = cli_command(
            ctx, ctx.work / "runs" / f"share_{name}", [*share_settings(ctx, reference, steps), *settings]
        )
        started[name] = start_processes(ctx, ranks(ctx, f"I.{name}", command))
    expected = {}
    for reference in sorted({reference for _, reference in layouts.values()}):  # in this process meanwhile
        run_dir = ctx.work / "runs" / f"share_reference_{reference}"
        settings = [*share_settings(ctx, reference, steps), f"run_dir={run_dir}", f"data.prepared_dir={prepared}"]
        run(load_config(None, settings))
        expected[reference] = train_losses(run_dir)
    figures["references"] = expected
    ctx.progress(figures)
    failed = []
    for name, processes in started.items():
        try:
            finish_processes(ctx, processes, 120 if ctx.cuda else 240)
        except AssertionError as error:
            figures[name], failed = {"error": str(error)[-2000:]}, [*failed, name]
            continue
        losses = train_losses(ctx.work / "runs" / f"share_{name}")
        worst = worst_relative(losses, expected[layouts[name][1]])
        figures[name] = {"losses": losses, "worst_relative": worst, "bound": ctx.bound}
        failed += [] if worst <= ctx.bound else [name]
        ctx.progress(figures)
    if failed:
        raise AssertionError(f"on one GPU {', '.join(failed)} failed or differ from one process: {figures}")
    return figures


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


@check("E.levers", 115)
def levers(ctx: Ctx) -> dict:
    """gpt2_small's MFU levers (bf16_params, the compiled optimizer, both together as config.yaml suggests) against the
    experiment as configured, in this one process (bench/gpu_mfu.py): each built and compiled once, then interleaved
    for 5 rounds of 20 steps, timed with CUDA events; every variant's figures in paths.json as they come."""
    from bench import gpu_mfu

    names = gpu_mfu.LEVERS if ctx.cuda else gpu_mfu.CPU_LEVERS
    rounds, steps, warmup = (5, 20, 5) if ctx.cuda else (2, 2, 1)
    results = gpu_mfu.measure(names, not ctx.cuda, ctx.work, rounds, steps, warmup, ctx.progress)
    failed = [name for name, figures in results.items() if "error" in figures or "mfu" not in figures]
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


def finish_processes(ctx: Ctx, started: dict[str, subprocess.Popen], timeout: float) -> None:
    """Wait for all (`wait_all`); a failure raises with the end of its log."""
    codes = wait_all(started, timeout)
    for name, code in codes.items():
        if code != 0:
            tail = (ctx.work / f"{name}.log").read_text(errors="replace")[-1500:]
            raise AssertionError(f"{name} ended with {code} ({codes}); the end of {name}.log:\n{tail}")


def run_processes(ctx: Ctx, commands: dict[str, tuple[list[str], dict[str, str]]], timeout: float) -> None:
    finish_processes(ctx, start_processes(ctx, commands), timeout)


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
    if status == "FAIL" and ctx.last_progress is not None:
        result["partial"] = ctx.last_progress  # what it measured before it failed
    return result


def child(name: str, work: Path, cache: Path, cpu: bool) -> int:
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    result = run_one(name, Ctx(device, work, cache, name))
    (work / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip teardown: process groups and compile workers left as they are cost nothing here


# --- process groups --------------------------------------------------------------------------------------------------


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

    def add(self, result: dict) -> None:
        self.results.append(result)
        self.logs = write_logs(self.call, self.out / "logs.tgz")
        self.write()

    def running(self, name: str, figures: dict, limit: float) -> None:
        self.write([{"check": name, "status": "RUNNING", "figures": figures, "limit_s": round(limit, 1)}])

    def write(self, extra: list[dict] = ()) -> None:
        line, _ = tally(self.results)
        document = {**self.header, "summary": line, "checks": [*self.results, *extra], "logs": self.logs}
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
    with (call / f"{name}.log").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
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
    report = Report(out, call, header)
    report.write()
    began = time.monotonic()
    for i, name in enumerate(names):
        left = budget - (time.monotonic() - began)
        if left < min(limits[name], MIN_START_S):
            result = {"check": name, "status": "SKIPPED", "figures": f"{left:.0f} s of --budget {budget:g} s left"}
            print(f"SKIPPED {name:<12} {result['figures']}", flush=True)
            report.add(result)
            continue
        reserved = sum(limits[later] for later in names[i + 1 :])  # the later checks' own time
        limit = min(left, max(limits[name], left - reserved))  # its own, and what earlier checks did not use
        result = run_check(name, limit, command_of(name, call, cache, args.cpu), env, call, report, kind)
        report.add(result)
        print(f"{result['status']:<7} {name:<12} {result['wall_s']:>6.1f} s  {_short(result['figures'])}", flush=True)
    line, code = tally(report.results)
    print(f"paths on {kind}: {line}")
    return code


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
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hang:
        return hang(args.hang, args.cpu)
    if args.world8:
        return world8_layout(args.world8, args.work, args.cpu)
    if args.share_smoke:
        return share_smoke(args.work, args.cpu)
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
