"""The GPU proof kit, part 3: the paths the probe and the smoke test do not cover, in one call of about 8 minutes
(../shared/notes/gpu-review-2.md, table A-H; docs/gpu.md).

    PYTHONPATH=src:. python3 bench/gpu_paths.py --out DIR          # one CUDA GPU, no network
    PYTHONPATH=src:. python3 bench/gpu_paths.py --out DIR --cpu    # the same checks on CPU, tiny shapes (CI)

Each check runs in its own process under its own time limit (a hang or a crash costs that check only), and its
result is added to DIR/paths.json as soon as it ends, so what a cut-off call brings back is complete up to there.
All checks share one Inductor cache (DIR/inductor), so a graph compiled once is not compiled again. --budget stops
starting checks once the call has run that long: those it leaves unrun are SKIPPED. The last line counts each status;
the exit status is 1 when any check failed, timed out or was skipped.

    A versions     torch, CUDA, cuDNN, NCCL; which Flight Recorder dump functions exist; lightning
    B nccl         a 1-rank NCCL group beside gloo: each recorder's entries, sequence numbers under
                   cuda:nccl,cpu:gloo, the watchdog ending a hung step (exit 76) and naming the collective
    C ring         ring attention on one device against SDPA: error, time, peak memory, host syncs, dropout,
                   selective vs no checkpointing, graph breaks under compile
    D stack        selective checkpointing -> compile -> FSDP2 on a 1-rank mesh against compiled autocast
    E levers       the MFU levers A/B through the CLI (bench/gpu_mfu.py's variants)
    F lightning    Lightning against scalelm's engine through the CLI: losses, tokens/s, run.json
    G world8       one rank of 8-rank layouts through the fake backend: peak memory against the plan
    H baseline     the machine baseline on the gpt2 shapes: output product unpadded vs padded, health
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from bench.argtypes import output_dir, positive, unknown
from bench.gpu_mfu import TINY
from bench.throughput import VOCAB

REPO = Path(__file__).resolve().parents[1]

CHECKS: dict[str, tuple[Callable, float]] = {}  # name: (check, seconds it may take on a GPU)


def check(name: str, seconds: float):
    def register(fn):
        CHECKS[name] = (fn, seconds)
        return fn

    return register


class NotApplicable(Exception):
    """The check needs what this run does not have (a CUDA device, a library)."""


class Ctx:
    def __init__(self, device: torch.device, out: Path):
        self.device, self.out = device, out

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cuda else torch.float32

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


# --- A ---------------------------------------------------------------------------------------------------------------


@check("A.versions", 30)
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
        "flight_recorder": {
            name: hasattr(c10d, name) for name in ("_dump_fr_trace", "_dump_nccl_trace", "_dump_fr_trace_json")
        },
        "lightning": _version_of("lightning"),
        "triton": _version_of("triton"),
    }
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


@check("B.nccl", 60)
def nccl(ctx: Ctx) -> dict:
    """A 1-rank group with NCCL for CUDA tensors and gloo for host ones (what parallel.cpu_offload starts; gloo
    alone on CPU): each Flight Recorder's entries, the sequence numbers per backend, then a hung step ended by the
    watchdog (exit 76) with the collective named, in a process of its own."""
    import torch.distributed as dist

    from scalelm.train import flight_recorder, watchdog

    autopsy = ctx.out / "B.autopsy"
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
    hung = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--hang", str(ctx.out / "B.hang"), "--out", str(ctx.out)]
                          + ([] if ctx.cuda else ["--cpu"]), capture_output=True, text=True, timeout=90)  # fmt: skip
    summary = ctx.out / "B.hang" / "summary.txt"
    figures["hang"] = {
        "exit": hung.returncode,
        "summary": summary.read_text()[-1500:] if summary.exists() else None,
        "files": sorted(p.name for p in (ctx.out / "B.hang").glob("*")),
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

    from scalelm.train import flight_recorder, watchdog

    ctx = Ctx(torch.device("cpu") if cpu else torch.device("cuda", 0), autopsy)
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


@check("C.ring", 90)
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
    config = ModelConfig(d_model=d_model, n_heads=heads, n_layers=2, d_ff=4 * d_model, dropout=dropout,
                         max_seq_len=length)  # fmt: skip
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


# --- D ---------------------------------------------------------------------------------------------------------------


def gpt2_config(ctx: Ctx, dropout: float = 0.0):
    from scalelm.config import ModelConfig

    if ctx.cuda:
        return ModelConfig(d_model=768, n_heads=12, n_layers=12, d_ff=3072, dropout=dropout, max_seq_len=1024,
                           norm="pre", tie_weights=True)  # fmt: skip
    return ModelConfig(d_model=32, n_heads=2, n_layers=2, d_ff=64, dropout=dropout, max_seq_len=64, norm="pre",
                       tie_weights=True)  # fmt: skip


def batches(ctx: Ctx, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rows, seq = (16, 1024) if ctx.cuda else (4, 64)
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, VOCAB, (rows, seq + 1), generator=generator).to(ctx.device) for _ in range(steps)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def train_losses_of(ctx: Ctx, model, data, autocast: bool) -> list[float]:
    from scalelm.config import OptimConfig
    from scalelm.train.optim import build_optimizer

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


@check("D.stack", 100)
def stack(ctx: Ctx) -> dict:
    """gpt2_small's blocks as Parallel.parallelize builds them for FSDP: selective checkpointing, then compile, then
    FSDP2 on a 1-rank mesh, against the compiled model under autocast, over the same batches."""
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
    if compile_too:
        apply_compile(reference, ctx.device)
    ctx.reset_peak()
    expected = train_losses_of(ctx, reference, data, autocast=True)
    reference_peak = ctx.peak_mb()
    del reference

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
    tolerance = 3e-2 if ctx.cuda else 1e-4
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
    figures = {
        "compiled": compile_too, "steps": steps, "losses": losses, "expected": expected, "worst_relative": worst,
        "peak_mb": ctx.peak_mb(), "reference_peak_mb": reference_peak,
        "graphs": dict(torch._dynamo.utils.counters["stats"]), "graph_breaks": dict(torch._dynamo.utils.counters["graph_break"]),
    }  # fmt: skip
    if not worst <= tolerance:
        raise AssertionError(f"losses differ by {worst:.2e} (> {tolerance}): {figures}")
    return figures


# --- E ---------------------------------------------------------------------------------------------------------------

LEVERS_GPU = ["configured", "cudnn_attention", "bf16_params", "compiled_optimizer", "batch16"]
LEVERS_CPU = ["configured"]  # the script's dry run: the levers' CPU tests are in tests/test_mfu_levers.py


@check("E.levers", 240)
def levers(ctx: Ctx) -> dict:
    """gpt2_small's MFU with each lever changed alone from the experiment as configured, one after the other on this
    card (bench/gpu_mfu.py, each variant under its own limit; max-autotune left out: minutes of compiling)."""
    from bench import gpu_mfu

    out = ctx.out / "E.mfu"
    names = LEVERS_GPU if ctx.cuda else LEVERS_CPU
    argv = [str(out), "--only", *names, "--steps", "36" if ctx.cuda else "6", "--timeout", "75" if ctx.cuda else "60"]
    code = gpu_mfu.main(argv + ([] if ctx.cuda else ["--cpu"]))
    results = json.loads((out / "mfu.json").read_text())
    if code or set(results) != set(names):
        raise AssertionError(f"a variant failed: {results}")
    return results


# --- F ---------------------------------------------------------------------------------------------------------------


def train_cli(ctx: Ctx, name: str, settings: list[str], steps: int, timeout: float) -> Path:
    """One training run through scalelm's CLI on random WikiText-2-sized data; its run directory."""
    from bench.throughput import make_prepared

    prepared = ctx.out / "prepared"
    if not prepared.exists():  # written once, for every run of the check
        make_prepared(prepared)
    run = ctx.out / "runs" / name
    device = TINY if not ctx.cuda else ["device=cuda"]
    command = [sys.executable, "-m", "scalelm.train"]
    for setting in [f"run_dir={run}", f"data.prepared_dir={prepared}", f"train.max_steps={steps}",
                    f"train.log_every={max(1, steps // 6)}", "train.comm_profile_steps=0", "checkpoint.every=null",
                    *device, *settings]:  # fmt: skip
        command += ["--set", setting]
    with (ctx.out / f"{name}.train.log").open("w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=True)
    return run


@check("F.lightning", 90)
def lightning(ctx: Ctx) -> dict:
    if importlib.util.find_spec("lightning") is None:
        raise NotApplicable("lightning is not installed")
    from scalelm.train.record import read_metrics

    steps = 60 if ctx.cuda else 6
    figures = {}
    for engine in ("scalelm", "lightning"):
        run = train_cli(ctx, f"engine_{engine}", [f"train.engine={engine}"], steps, 40 if ctx.cuda else 60)
        train = [r for r in read_metrics(run) if r["kind"] == "train"]
        steady = train[1:] or train  # the first interval pays start-up and compilation
        figures[engine] = {
            "losses": [r["loss"] for r in train],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "mfu": [r.get("mfu") for r in steady][-1],
            "peak_mem_mb": max(r["peak_mem_mb"] or 0 for r in train),
            "run_json": (run / "run.json").exists(),
        }
    mine, theirs = figures["scalelm"]["losses"], figures["lightning"]["losses"]
    figures["worst_relative"] = max(abs(a - b) / abs(a) for a, b in zip(mine, theirs))
    tolerance = 3e-2 if ctx.cuda else 1e-4
    if len(mine) != len(theirs) or not figures["worst_relative"] <= tolerance or not figures["lightning"]["run_json"]:
        raise AssertionError(f"Lightning's run differs from scalelm's: {figures}")
    return figures


# --- G ---------------------------------------------------------------------------------------------------------------


WORLD8 = {  # name: (strategy, settings of the training config)
    "fsdp8_compile_selective": ("fsdp", {"train": {"compile": True, "activation_checkpointing": "selective"}}),
    "cp4_long": ("cp", {"parallel": {"cp": 4, "dp_shard": 2}, "data": {"seq_len": 8192},
                        "model": {"max_seq_len": 8192, "d_model": 1024, "n_heads": 16, "d_ff": 4096}}),
    "pp2_stage0": ("pp", {"parallel": {"pp": 2, "dp_shard": 4}}),
}  # fmt: skip


@check("G.world8", 90)
def world8(ctx: Ctx) -> dict:
    """Each layout in a process of its own, as rank 0 of 8 on the fake backend (its collectives do nothing): the
    memory of one training step on this rank, against the plan's."""
    figures = {}
    for name in WORLD8:
        command = [sys.executable, str(Path(__file__).resolve()), "--world8", name, "--out", str(ctx.out)]
        command += [] if ctx.cuda else ["--cpu"]
        subprocess.run(command, check=True, timeout=60 if ctx.cuda else 90, env=os.environ,
                       stdout=(ctx.out / f"G.{name}.log").open("w"), stderr=subprocess.STDOUT)  # fmt: skip
        figures[name] = json.loads((ctx.out / f"G.{name}.json").read_text())
    return figures


def world8_layout(name: str, out: Path, cpu: bool) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from scalelm.config import from_dict
    from scalelm.model.transformer import TransformerLM
    from scalelm.parallel.dims import MESH_DIMS
    from scalelm.parallel.env import DistEnv
    from scalelm.parallel.layout import resolve_layout
    from scalelm.parallel.runtime import Meshes, ModelOptions, Parallel
    from scalelm.plan.memory import Workload, plan_memory
    from scalelm.train.optim import build_optimizer

    ctx = Ctx(torch.device("cpu") if cpu else torch.device("cuda", 0), out)
    strategy, changes = WORLD8[name]
    values = {"device": ctx.device.type, "parallel": {"strategy": strategy}, "model": {}, "data": {}, "train": {}}
    base = {"model": {"d_model": 768, "n_heads": 12, "n_layers": 12, "d_ff": 3072, "dropout": 0.0, "max_seq_len": 1024},
            "data": {"seq_len": 1024}, "batch": {"size": 16}}  # fmt: skip
    if cpu:
        base = {"model": {"d_model": 32, "n_heads": 2, "n_layers": 4, "d_ff": 64, "dropout": 0.0, "max_seq_len": 256},
                "data": {"seq_len": 64}, "batch": {"size": 8}}  # fmt: skip
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
    parallel = Parallel(env, layout, meshes, [(env.hostname, 0)] * 8, config.parallel, config.train)
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
    result = {"layout": layout.dims.name, "stepped": stepped, "built_mb": built_mb, "peak_mb": ctx.peak_mb(),
              "plan_mb": plan.mb()}  # fmt: skip
    (out / f"G.{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    sys.stdout.flush()
    os._exit(0)


# --- H ---------------------------------------------------------------------------------------------------------------


@check("H.baseline", 60)
def machine_baseline(ctx: Ctx) -> dict:
    """scalelm.measure.baseline's one-rank part on gpt2_small's shapes: the output product unpadded and padded (the
    padded one is what training runs), the model step compiled as the experiment is, and the GPU's health sampled
    during the work against an idle reading."""
    from scalelm.config import load_config
    from scalelm.measure import baseline

    config = load_config(None)
    config.model = gpt2_config(ctx)
    config.data.seq_len, config.batch.size = (1024, 16) if ctx.cuda else (64, 4)
    config.data.prepared_dir = str(ctx.out / "no-prepared-data")  # no manifest: WikiText-2's vocabulary
    config.train.compile = ctx.cuda
    outputs = baseline.matmul_rates(baseline.output_shapes(config), ctx.device, ctx.dtype)
    alone = baseline.measure_alone(config, baseline.gemm_shapes(config, ctx.device.type), VOCAB, ctx.device,
                                   all_cores=False)  # fmt: skip
    return {"output_products": outputs, "alone": alone, "idle_health": baseline.gpu_health(ctx.device)}


# --- the runner ------------------------------------------------------------------------------------------------------


def run_one(name: str, ctx: Ctx) -> dict:
    fn, _ = CHECKS[name]
    began = time.perf_counter()
    try:
        status, figures = "PASS", fn(ctx)
    except NotApplicable as why:
        status, figures = "N/A", str(why)
    except Exception as error:
        status, figures = "FAIL", f"{type(error).__name__}: {error}"[:2000]
        (ctx.out / f"{name}.traceback.txt").write_text(traceback.format_exc())
    return {"check": name, "status": status, "figures": figures, "seconds": round(time.perf_counter() - began, 2)}


def child(name: str, out: Path, cpu: bool) -> int:
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    result = run_one(name, Ctx(device, out))
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip teardown: process groups and compile workers left as they are cost nothing here


def parent(args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    env = os.environ | {
        "TORCHINDUCTOR_CACHE_DIR": str((out / "inductor").resolve()),
        "TRITON_CACHE_DIR": str((out / "triton").resolve()),
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
    }
    results, began = [], time.monotonic()
    for name, (_, seconds) in CHECKS.items():
        if args.only and name not in args.only and name.split(".")[0] not in args.only:
            continue
        left = args.budget - (time.monotonic() - began)
        if left < 10:
            results.append({"check": name, "status": "SKIPPED", "figures": f"--budget {args.budget:g} s was spent"})
            print(f"SKIPPED {name:<12} {results[-1]['figures']}", flush=True)
            continue
        limit = min(seconds * (args.slack if not args.cpu else 3), left)
        command = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--out", str(out)]
        command += ["--cpu"] if args.cpu else []
        started = time.perf_counter()
        with (out / f"{name}.log").open("w") as log:
            try:
                code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=limit).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        record = out / f"{name}.json"
        if code == 0 and record.exists():
            result = json.loads(record.read_text())
        else:
            tail = (out / f"{name}.log").read_text(errors="replace")[-1500:]
            result = {"check": name, "status": "FAIL", "figures": f"exit {code}: {tail}"}
        result["wall_s"] = round(time.perf_counter() - started, 1)
        results.append(result)
        (out / "paths.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"{result['status']:<7} {name:<12} {result['wall_s']:>6.1f} s  {_short(result['figures'])}", flush=True)
    (out / "paths.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    line, code = tally(results)
    print(f"paths on {'cpu' if args.cpu else 'cuda'}: {line}")
    return code


STATUSES = ("PASS", "FAIL", "N/A", "SKIPPED")


def tally(results: list[dict]) -> tuple[str, int]:
    """The last line's counts of each status, the checks that failed or were skipped named, and the exit status: 1
    when any check failed or was skipped (a call that left checks unrun proved nothing about them)."""
    counts = ", ".join(f"{sum(r['status'] == s for r in results)} {s}" for s in STATUSES)
    unproven = {s: [r["check"] for r in results if r["status"] == s] for s in ("FAIL", "SKIPPED")}
    named = "".join(f"; {s.lower()}: {', '.join(checks)}" for s, checks in unproven.items() if checks)
    return counts + named, 1 if any(unproven.values()) else 0


def only_checks(asked: list[str]) -> str | None:
    """Why `--only` cannot be run as given: a name that is no check's, nor the letter of one (None: it can)."""
    letters = {name.split(".")[0] for name in CHECKS}
    for name in asked:
        if name not in CHECKS and name not in letters:
            return f"--only: {unknown(name, CHECKS, 'check')} (or its letter, {', '.join(sorted(letters))})"
    return None


def _short(figures) -> str:
    text = json.dumps(figures, default=str) if not isinstance(figures, str) else figures
    return text if len(text) < 160 else text[:157] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_dir, required=True)
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on CPU; CUDA-only figures are null")
    parser.add_argument("--only", nargs="+", help="checks to run, by name or letter (default: all)")
    parser.add_argument("--budget", type=positive, default=470.0, help="seconds after which no check starts")
    parser.add_argument("--slack", type=positive, default=1.5, help="a check's limit: its planned seconds times this")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--world8", help=argparse.SUPPRESS)
    parser.add_argument("--hang", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.only and only_checks(args.only):
        parser.error(only_checks(args.only))
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device is visible; run with --cpu for the CPU checks")
    if args.hang:
        return hang(args.hang, args.cpu)
    if args.world8:
        return world8_layout(args.world8, args.out, args.cpu)
    if args.child:
        return child(args.child, args.out, args.cpu)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
