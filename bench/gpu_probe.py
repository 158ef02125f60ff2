"""The GPU proof kit, part 1: scalelm's CUDA code paths, piece by piece, on one GPU (docs/gpu.md).

    PYTHONPATH=src python3 bench/gpu_probe.py --out DIR          # on a machine with one CUDA GPU
    PYTHONPATH=src python3 bench/gpu_probe.py --out DIR --cpu    # the same checks on CPU (CI), CUDA-only ones N/A

Each check prints one line, `PASS|FAIL|N/A  name  figure`, and DIR/probe.json holds them all; the exit status is 1
when any check failed. One process, one rank: NCCL (and, on CPU, gloo) groups of one and one-rank device meshes
run the same code as many ranks do, short of the traffic. The checks (a-l) follow the review of the CUDA paths
(docs/gpu.md lists them with its findings); bench/gpu_smoke.sh runs the command-line tools.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from argtypes import output_dir, unknown
from scalelm.config import ModelConfig, OptimConfig
from scalelm.measure.comm import collective_intervals
from scalelm.measure.device import peak_memory_mb, reset_peak_memory
from scalelm.measure.peak import cuda_peak_flops
from scalelm.model.architecture import flops_per_token
from scalelm.model.cpu_ops import Dropout, own_random_stream
from scalelm.model.transformer import Block, TransformerLM
from scalelm.optim import build_optimizer
from scalelm.parallel.compile import apply_compile
from scalelm.parallel.data import apply_fsdp, materialise
from scalelm.parallel.dims import MESH_DIMS
from scalelm.parallel.env import backend_for
from scalelm.parallel.numerics import matmul_precision
from scalelm.parallel.runtime import Parallel
from scalelm.parallel.tensor import apply_tp
from scalelm.train.evaluation import eval_rows

VOCAB = 33_278  # WikiText-2's


class NotApplicable(Exception):
    """The check needs what this run does not have (a CUDA device)."""


@dataclass
class Probe:
    device: torch.device
    out: Path
    results: list[dict] = field(default_factory=list)
    mesh: object = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def need_cuda(self) -> None:
        if not self.cuda:
            raise NotApplicable("needs CUDA")

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cuda else torch.float32

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cuda)

    def run(self, name: str, check: Callable[[Probe], str]) -> None:
        start = time.perf_counter()
        try:
            status, figure = "PASS", check(self)
        except NotApplicable as why:
            status, figure = "N/A", str(why)
        except Exception as error:  # a check's failure is its line, and the next check runs
            status, figure = "FAIL", f"{type(error).__name__}: {error}".splitlines()[0][:300]
            (self.out / f"{name}.traceback.txt").write_text(traceback.format_exc())
        seconds = time.perf_counter() - start
        self.results.append({"check": name, "status": status, "figure": figure, "seconds": round(seconds, 2)})
        print(f"{status:<4}  {name:<24} {figure}  ({seconds:.1f} s)", flush=True)


def small_model(device: torch.device, layers: int = 4, dropout: float = 0.1) -> TransformerLM:
    torch.manual_seed(0)
    config = ModelConfig(d_model=128, n_heads=4, n_layers=layers, d_ff=512, dropout=dropout, max_seq_len=1024)
    with torch.device(device):
        return TransformerLM(config, VOCAB)


def batch(device: torch.device, rows: int = 64, seq: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (rows, seq + 1), device=device)
    return tokens[:, :-1], tokens[:, 1:]


def record_dtype(into: dict, key: str):
    """A forward hook noting its module's output dtype (and returning None: the output stays as it is)."""

    def hook(module, args, output) -> None:
        into.setdefault(key, (output.to_local() if isinstance(output, DTensor) else output).dtype)

    return hook


def train_step(probe: Probe, model, optimizer, rows: int = 64, seq: int = 32, autocast: bool = True) -> torch.Tensor:
    """The trainer's step (scalelm.train.trainer.Trainer.train_step) for one micro-batch: forward and backward under
    the layout's autocast (none with FSDP, whose policy casts), the grouped gradient norm with clipping, AdamW,
    zero_grad."""
    inputs, targets = batch(probe.device, rows, seq)
    with probe.autocast() if autocast else contextlib.nullcontext():
        loss = model(inputs, targets)
    loss.backward()
    Parallel.clip_grad_norm(SimpleNamespace(pp_group=None, env=SimpleNamespace(device=probe.device)), model, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


# ----------------------------------------------------------------------------------------------------- checks
def facts(probe: Probe) -> str:
    """a. Versions, the device, its peak from scalelm's table, bf16 and TF32 state, NVML's driver and UUID."""
    found = {"torch": torch.__version__, "python": sys.version.split()[0], "cuda": torch.version.cuda}
    if probe.cuda:
        name = torch.cuda.get_device_name(probe.device)
        props = torch.cuda.get_device_properties(probe.device)
        found |= {
            "device": name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "sms": props.multi_processor_count,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "bf16_supported": torch.cuda.is_bf16_supported(),
            "peak_tflops_bf16": (cuda_peak_flops(name, "bf16") or 0) / 1e12,
            "peak_tflops_fp32": (cuda_peak_flops(name, "fp32") or 0) / 1e12,
            "tf32_under_fp32": matmul_precision(probe.device, torch.float32) == "high"
            and torch.backends.cuda.matmul.allow_tf32,
        }
        matmul_precision(probe.device, torch.bfloat16)
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(probe.device.index or 0)
            found |= {"driver": pynvml.nvmlSystemGetDriverVersion(), "uuid": pynvml.nvmlDeviceGetUUID(handle)}
        except Exception as error:
            found["nvml"] = f"unavailable: {error}"
        if not found["peak_tflops_bf16"]:
            raise AssertionError(f"no peak in scalelm.measure.peak's table for {name!r}: MFU would be missing; {found}")
    else:
        found |= {"device": "cpu", "threads": torch.get_num_threads()}
    (probe.out / "facts.json").write_text(json.dumps(found, indent=2) + "\n")
    return ", ".join(f"{k}={v}" for k, v in found.items())


def cuda_seconds(fn: Callable[[], object], reps: int) -> float:
    """Mean seconds of fn() on the current CUDA stream, by CUDA events, after one untimed call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def ceilings(probe: Probe) -> str:
    """The two ceilings a kernel's time is judged against: a bf16 matmul's rate and a device-to-device copy."""
    probe.need_cuda()
    n = 8192
    a, b = (torch.randn(n, n, device=probe.device, dtype=torch.bfloat16) for _ in range(2))
    src = torch.randn(2**30 // 4, device=probe.device)  # 1 GiB
    dst = torch.empty_like(src)

    tflops = 2 * n**3 / cuda_seconds(lambda: a @ b, 20) / 1e12
    tbps = 2 * src.numel() * 4 / cuda_seconds(lambda: dst.copy_(src), 20) / 1e12
    return f"bf16 matmul {n}^3: {tflops:.0f} TFLOP/s; device copy: {tbps:.2f} TB/s (read + written)"


def process_group(probe: Probe) -> str:
    """b. A one-rank group with the backend scalelm picks (NCCL beside gloo for CPU tensors, as CPU offload needs),
    a barrier, an object gather, a gloo subgroup, the four-dimensional mesh and its flattened dp dimension."""
    backend = backend_for(probe.device, cpu_collectives=True)
    dist.init_process_group(
        backend, store=dist.HashStore(), rank=0, world_size=1, device_id=probe.device if probe.cuda else None
    )
    dist.barrier()
    gathered = [None]
    dist.all_gather_object(gathered, {"rank": 0})
    gloo = dist.new_group(backend="gloo")
    ones = torch.ones(3)
    dist.all_reduce(ones, group=gloo)
    on_device = torch.ones(3, device=probe.device)
    dist.all_reduce(on_device)
    probe.mesh = init_device_mesh(probe.device.type, (1,) * len(MESH_DIMS), mesh_dim_names=MESH_DIMS)
    flat = probe.mesh["dp_replicate", "dp_shard"]._flatten("dp")
    assert gathered == [{"rank": 0}] and ones.tolist() == [1, 1, 1] and on_device.sum().item() == 3
    return f"backend {backend}, mesh {tuple(probe.mesh.shape)} {probe.mesh.mesh_dim_names}, dp size {flat.size()}"


def optimizer_tp(probe: Probe) -> str:
    """c. Finding 1: tensor parallelism without FSDP leaves plain and DTensor parameters side by side; AdamW's
    foreach kernel (CUDA's default) refused the mix in one group. Before: one group, foreach; after: scalelm's."""
    model = small_model(probe.device)
    apply_tp(model, probe.mesh["tp"], loss_parallel=False, sequence_parallel=False)
    kinds = {isinstance(p, DTensor) for p in model.parameters()}
    assert kinds == {True, False}, "TP should leave both kinds of parameters"
    before = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    train_step_loss = None
    try:
        train_step(probe, model, before)
        reproduced = "not reproduced (torch takes the mix now)"
    except Exception as error:
        reproduced = f"reproduced ({str(error).splitlines()[0][:60]})"
        model.zero_grad(set_to_none=True)
    model = small_model(probe.device)
    apply_tp(model, probe.mesh["tp"], loss_parallel=False, sequence_parallel=False)
    dtypes: dict[str, torch.dtype] = {}
    hooks = [
        model.blocks["0"].attn.qkv.register_forward_hook(record_dtype(dtypes, "qkv")),
        model.blocks["0"].register_forward_hook(record_dtype(dtypes, "residual")),
    ]
    optimizer = build_optimizer(model, OptimConfig(), 1e-3)
    for _ in range(2):
        train_step_loss = train_step(probe, model, optimizer)
    for hook in hooks:
        hook.remove()
    flags = {k: v for k, v in optimizer.defaults.items() if k in ("fused", "foreach")}
    assert torch.isfinite(train_step_loss), train_step_loss
    if probe.cuda:
        assert dtypes == {"qkv": torch.bfloat16, "residual": torch.float32}, dtypes
    return (
        f"before: {reproduced}; after: {len(optimizer.param_groups)} groups {flags}, loss "
        f"{train_step_loss.item():.3f}, dtypes {', '.join(f'{k} {v}' for k, v in dtypes.items())}"
    )


def sync_audit(probe: Probe) -> str:
    """d. Host-device synchronisations inside a training step (the second: the first creates the optimizer's
    state), for a plain model, TP's own dropout streams and FSDP: each stops the host until the GPU catches up."""
    probe.need_cuda()
    counts = {}
    for name, build in (("plain", plain_model), ("tp", tp_model), ("fsdp", fsdp_model)):
        model = build(probe)
        optimizer = build_optimizer(model, OptimConfig(), 1e-3)
        train_step(probe, model, optimizer, autocast=name != "fsdp")
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train_step(probe, model, optimizer, autocast=name != "fsdp")
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # (the mode's own notice that it is a prototype is a warning too, once)
        syncs = [str(w.message).splitlines()[0] for w in caught if "called a synchronizing" in str(w.message)]
        counts[name] = len(syncs)
        if syncs:
            (probe.out / f"syncs_{name}.txt").write_text("\n".join(syncs) + "\n")
    assert not any(counts.values()), f"synchronising calls in a step: {counts} (see syncs_*.txt)"
    return f"synchronisations per step: {counts}"


def plain_model(probe: Probe):
    return small_model(probe.device)


def tp_model(probe: Probe):
    model = small_model(probe.device)
    apply_tp(model, probe.mesh["tp"], loss_parallel=False, sequence_parallel=False)
    return model


def fsdp_model(probe: Probe, cpu_offload: bool = False):
    """As scalelm.parallel.Parallel.build makes it: on the meta device, sharded, materialised, weights from rank 0."""
    initial = small_model(torch.device("cpu")).state_dict()
    model = small_model(torch.device("meta"))
    model = apply_fsdp(model, probe.mesh["dp_shard"], probe.dtype, True, cpu_offload)
    materialise(model, probe.device, cpu_offload)
    model.init_buffers()
    set_model_state_dict(model, initial, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def fsdp(probe: Probe) -> str:
    """e. FSDP on one rank in the compute dtype: blocks compute in it, gradients and master weights stay fp32;
    then finding 2, CPU offload: the gradient norm over host-resident gradients, and the finite flags' concatenation."""
    model = fsdp_model(probe)
    seen = {}
    model.blocks["0"].register_forward_hook(record_dtype(seen, "block_out"))
    optimizer = build_optimizer(model, OptimConfig(), 1e-3)
    loss = train_step(probe, model, optimizer, autocast=False)
    inputs, targets = batch(probe.device)
    model(inputs, targets).backward()
    grads = {p.grad.dtype for p in model.parameters()}
    assert seen["block_out"] == probe.dtype and grads == {torch.float32}, (seen, grads)
    figure = f"block output {seen['block_out']}, grads {sorted(map(str, grads))}, loss {loss.item():.3f}"
    if not probe.cuda:
        return figure + "; CPU offload N/A (CUDA only)"
    offloaded = fsdp_model(probe, cpu_offload=True)
    optimizer = build_optimizer(offloaded, OptimConfig(), 1e-3)
    loss = train_step(probe, offloaded, optimizer, autocast=False)
    placed = {p.to_local().device.type for p in offloaded.parameters()}
    flags = [p.to_local().isfinite().all().reshape(1).to(probe.device) for p in offloaded.parameters()]
    assert torch.cat(flags).all() and placed == {"cpu"}, placed
    return figure + f"; CPU offload: parameters on {placed}, step ok, loss {loss.item():.3f}"


def deterministic(probe: Probe) -> str:
    """f. Finding 3: deterministic algorithms and cuBLAS, without and with CUBLAS_WORKSPACE_CONFIG (which
    scalelm.train.run sets), each in a fresh process since cuBLAS reads it once."""
    probe.need_cuda()
    code = (
        "import torch; torch.use_deterministic_algorithms(True); a = torch.randn(64, 64, device='cuda'); "
        "print((a @ a).sum().item())"
    )
    outcomes = {}
    for setting in (None, ":4096:8"):
        env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
        if setting:
            env["CUBLAS_WORKSPACE_CONFIG"] = setting
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        outcomes[setting or "unset"] = "ok" if done.returncode == 0 else "error"
    assert outcomes[":4096:8"] == "ok", outcomes
    return f"matmul under deterministic mode: {outcomes}"


def dropout_streams(probe: Probe) -> str:
    """g. Dropout on the device's path (torch's own): stream 0 is the plain mask, equal on two ranks of one seed;
    streams 1 and 2 differ; the device's default generator is untouched by a stream; SDPA's dropout runs its
    fused kernel inside a stream."""
    x = torch.ones(512, 512, device=probe.device, dtype=torch.bfloat16)  # not CPU fp32: torch's dropout
    layer = Dropout(0.5).train()

    def mask(stream: int) -> torch.Tensor:
        torch.manual_seed(7)
        layer.stream = stream
        return layer(x) != 0

    plain = (torch.manual_seed(7), F.dropout(x, 0.5, training=True) != 0)[1]
    zero, one, one_again, two = mask(0), mask(1), mask(1), mask(2)
    assert torch.equal(zero, plain) and torch.equal(one, one_again) and not torch.equal(one, two)
    figure = f"stream 0 = plain, stream 1 repeatable, 1 != 2, kept {one.float().mean().item():.3f}"
    if not probe.cuda:
        return figure
    state = torch.cuda.get_rng_state(probe.device)
    with own_random_stream(1, probe.device):
        torch.rand(10, device=probe.device)
    assert torch.equal(state, torch.cuda.get_rng_state(probe.device)), "the stream moved the default CUDA generator"
    q = torch.randn(8, 4, 256, 32, device=probe.device, dtype=torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with own_random_stream(1, probe.device):
            F.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=0.1)
        torch.cuda.synchronize()
    kernels = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
    fused = [k for k in kernels if "flash" in k.lower() or "fmha" in k.lower() or "efficient" in k.lower()]
    assert fused, f"no fused attention kernel under a dropout stream: {kernels[:8]}"
    return figure + f"; CUDA generator untouched; SDPA kernel {fused[0][:50]}"


def comm_profile(probe: Probe) -> str:
    """h. scalelm.measure.comm finds the collective's kernel (NCCL's on CUDA, gloo's op on CPU) in a profile."""
    values = torch.ones(1 << 20, device=probe.device)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if probe.cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        dist.all_reduce(values)
        if probe.cuda:
            torch.cuda.synchronize()
    found = collective_intervals(prof.events(), probe.device)
    if probe.cuda and not found:
        ops = sorted({e.name for e in prof.events() if "nccl" in e.name.lower()})
        # NCCL launches no kernel for a group of one: the device side is for a run of several GPUs to show
        raise NotApplicable(f"one rank: no NCCL kernel to find (host side: {ops[:3]})")
    assert found, "no collective found in the profile"
    return f"collectives found: {sorted(found)[:2]}"


def memory(probe: Probe) -> str:
    """i. Findings 6 and 7: the peak is reset at the clock's boundaries, so an evaluation's stays out of the next
    interval's; an evaluation batch bounded in tokens (train.eval_batch_tokens) against 256 sequences of 1024."""
    probe.need_cuda()
    model = small_model(probe.device, layers=1)
    optimizer = build_optimizer(model, OptimConfig(), 1e-3)
    train_step(probe, model, optimizer)
    reset_peak_memory(probe.device)
    train_step(probe, model, optimizer)
    step_peak = peak_memory_mb(probe.device)[0]
    peaks = {}
    model.eval()
    for rows in (eval_rows(256, 1024, 16384), 256):
        reset_peak_memory(probe.device)
        try:
            with torch.no_grad(), probe.autocast():
                inputs, targets = batch(probe.device, rows, 1024)
                F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten(), reduction="sum").item()
            peaks[rows] = peak_memory_mb(probe.device)[0]
        except torch.OutOfMemoryError:
            peaks[rows] = float("inf")
        torch.cuda.empty_cache()
    model.train()
    reset_peak_memory(probe.device)
    train_step(probe, model, optimizer)
    after = peak_memory_mb(probe.device)[0]
    bounded = eval_rows(256, 1024, 16384)
    assert after <= step_peak * 1.05 + 1, f"the peak after an evaluation ({after:.0f} MB) kept its memory"
    assert peaks[bounded] < peaks[256], peaks
    return (
        f"step peak {step_peak:.0f} MB, after evaluation {after:.0f} MB; evaluation peak at seq 1024: "
        f"{bounded} rows {peaks[bounded]:.0f} MB, 256 rows {peaks[256]:.0f} MB"
    )


def nvml(probe: Probe) -> str:
    """j. The monitor's NVML readings by index and by UUID (scalelm.measure.sampler), this process among the GPU's
    compute processes, and the energy meter of training (scalelm.measure.energy) over two seconds of products."""
    probe.need_cuda()
    from scalelm.measure.energy import EnergyMeter
    from scalelm.measure.monitor import device_uuid
    from scalelm.measure.sampler import GpuSampler

    uuid = device_uuid(probe.device)
    by_index, by_uuid = GpuSampler([str(probe.device.index or 0)]).sample(), GpuSampler([uuid]).sample()
    assert by_index[0]["memory_used_mb"] and by_uuid[0]["memory_used_mb"], (by_index, by_uuid)
    import pynvml

    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    pids = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
    mine = "listed" if os.getpid() in pids else f"not listed (pids {pids[:4]}: another PID namespace?)"
    meter, square = EnergyMeter.open(uuid, reads_machine=False), torch.randn(8192, 8192, device=probe.device)
    torch.cuda.synchronize()
    meter.lap()
    began = time.perf_counter()
    while time.perf_counter() - began < 2:
        square.bfloat16() @ square.bfloat16()
        torch.cuda.synchronize()
    joules, seconds = meter.lap(), time.perf_counter() - began
    assert joules and joules > 0, (meter.source, meter.unknown, joules)
    energy = f"energy ({meter.source}): {joules:.0f} J in {seconds:.1f} s of products, {joules / seconds:.0f} W"
    return f"uuid {uuid}: {by_uuid[0]}; this process {mine}; {energy}"


def compiled_block(probe: Probe) -> str:
    """k. torch.compile of a block (what train.compile applies): graphs and breaks in training mode on the
    device's path, and the compiled block against eager (bf16 tolerance on CUDA, fp32 on CPU)."""
    config = ModelConfig(d_model=128, n_heads=4, n_layers=1, d_ff=512, dropout=0.1, max_seq_len=64)
    with torch.device(probe.device):
        torch.manual_seed(0)
        block = Block(config, 0)
    x = torch.randn(8, 64, 128, device=probe.device)
    torch._dynamo.reset()
    with probe.autocast():
        explained = torch._dynamo.explain(block.train())(x)
    block.eval()
    with torch.no_grad(), probe.autocast():
        eager = block(x).float()
        compiled_fn = torch.compile(block)
        compiled = compiled_fn(x).float()
    error = ((compiled - eager).norm() / eager.norm()).item()
    tolerance = 1e-2 if probe.cuda else 1e-5
    assert error < tolerance, f"compiled vs eager relative error {error:.2e} >= {tolerance}"
    if probe.cuda:
        assert explained.graph_break_count == 0, f"graph breaks on the CUDA path: {explained.break_reasons}"
    return (
        f"training mode: {explained.graph_count} graph(s), {explained.graph_break_count} break(s); compiled vs "
        f"eager {error:.1e} relative"
    )


KERNEL_KINDS = (  # a kernel's kind by its name, first match; the rest is "other"
    ("matmul", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")),
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
    ("fused element-wise (triton)", ("triton",)),
    ("element-wise and reductions", ("elementwise", "reduce", "vectorized", "softmax", "layer_norm", "norm", "copy")),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in lowered for m in marks)), "other")


GPT2_SMALL = ModelConfig(d_model=768, n_heads=12, n_layers=12, d_ff=3072, dropout=0.0, norm="pre", tie_weights=True)


def step_profile(probe: Probe) -> str:
    """l. Where a training step's time goes on the device, for the course model (eager, as the matrix runs it) and
    the gpt2_small experiment's shape (compiled): wall time per step, the share of it the GPU is busy (a low share:
    the host's launches are the limit), and the kernels' time by kind."""
    probe.need_cuda()
    shapes = {
        "course": (ModelConfig(d_model=128, n_heads=4, n_layers=2, d_ff=2048, dropout=0.1), 512, 32, False),
        "gpt2_small": (GPT2_SMALL, 16, 1024, True),
        "gpt2_small batch 32": (GPT2_SMALL, 32, 1024, True),  # twice the work per step: what fixed costs weigh
    }
    lines, figures = [], {}
    for name, (config, rows, seq, compiled) in shapes.items():
        torch.manual_seed(0)
        with torch.device(probe.device):
            model = TransformerLM(config, VOCAB)
        if compiled:
            apply_compile(model, probe.device)
        optimizer = build_optimizer(model, OptimConfig(), 1e-4)
        for _ in range(3):  # compilation, the optimizer's state, the allocator's pools
            train_step(probe, model, optimizer, rows, seq)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            train_step(probe, model, optimizer, rows, seq)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / 10
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(2):
                train_step(probe, model, optimizer, rows, seq)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        by_kind: dict[str, float] = {}
        for kernel in kernels:
            kind = kernel_kind(kernel.name)
            by_kind[kind] = by_kind.get(kind, 0.0) + kernel.time_range.elapsed_us() / 2e3  # ms per step
        busy = sum(by_kind.values())
        tflops = flops_per_token(config, VOCAB, seq) * rows * seq / wall / 1e12
        top = sorted(by_kind.items(), key=lambda kv: -kv[1])[:4]
        figures[name] = {
            "wall_ms": wall * 1e3,
            "gpu_busy_ms": busy,
            "kernels": len(kernels) // 2,
            "by_kind_ms": by_kind,
        }
        lines.append(
            f"{name}: {wall * 1e3:.1f} ms/step, GPU busy {busy / (wall * 1e3):.0%} ({len(kernels) // 2} kernels), "
            f"{tflops:.0f} TFLOP/s; " + ", ".join(f"{k} {v:.1f} ms" for k, v in top)
        )
        (probe.out / f"profile_{name}.txt").write_text(
            prof.key_averages().table(sort_by="device_time_total", row_limit=25) + "\n"
        )
        del model, optimizer
        torch.cuda.empty_cache()
    (probe.out / "step_profile.json").write_text(json.dumps(figures, indent=2) + "\n")
    return "; ".join(lines)


CHECKS = [
    ("a.facts", facts),
    ("a.ceilings", ceilings),
    ("b.process_group", process_group),
    ("c.optimizer_tp", optimizer_tp),
    ("d.sync_audit", sync_audit),
    ("e.fsdp", fsdp),
    ("f.deterministic", deterministic),
    ("g.dropout_streams", dropout_streams),
    ("h.comm_profile", comm_profile),
    ("i.memory", memory),
    ("j.nvml", nvml),
    ("k.compile", compiled_block),
    ("l.step_profile", step_profile),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=output_dir, required=True, help="directory for probe.json and tracebacks")
    parser.add_argument("--cpu", action="store_true", help="run on CPU; CUDA-only checks are reported N/A")
    parser.add_argument("--only", nargs="*", help="check names to run (default: all)")
    args = parser.parse_args(argv)
    known = [name for name, _ in CHECKS]
    for asked in args.only or []:
        if asked not in known and asked not in [name.split(".")[1] for name in known]:
            parser.error(f"--only: {unknown(asked, known, 'check')} (or the part after the dot)")
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device is visible; run with --cpu for the CPU checks")
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    probe = Probe(device, args.out)
    for name, check in CHECKS:
        if not args.only or name in args.only or name.split(".")[1] in args.only:
            probe.run(name, check)
    if dist.is_initialized():
        dist.destroy_process_group()
    (args.out / "probe.json").write_text(json.dumps(probe.results, indent=2) + "\n")
    counts = {s: sum(r["status"] == s for r in probe.results) for s in ("PASS", "FAIL", "N/A")}
    print(f"probe on {device}: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['N/A']} not applicable")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
