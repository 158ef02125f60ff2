"""The machine's baseline: what its devices and network deliver, measured the way a site's own probes measure them,
to set beside what a layout achieved ("the network gave 22% of its reference" beside "ddp_multinode scaled 0.41").

    torchrun --nproc-per-node=N [--nnodes=M ...] -m scalelm.measure.baseline --out baseline.json [--config FILE]
    python -m scalelm.measure.baseline --out baseline.json            # one process: the matrix products only

- matrix products: the model's own (one micro-batch's tokens times the weights of the attention's projections, the
  feed-forward block and the output layer; `--config` names the training settings, default the course's), in the
  training dtype (bf16 on CUDA, fp32 on CPU) and the training shapes (the output layer's rows padded as
  scalelm.model.gpu_ops pads them on CUDA), one rank at a time so that no two share a device or a core; TFLOP/s per
  product and over all of them (their FLOPs over their time), per rank;
- the model's own training step, alone on one device for one micro-batch (forward with the loss, backward, AdamW),
  compiled where the settings compile (`train.compile`) and eager otherwise, as training runs it (the record says
  which), against which the step-time model measures how much of a step its FLOPs and bytes explain; on the first
  rank, eager, again with each layout's machinery that one process can run (`layout_overheads`: tensor parallelism's
  DTensor weights on a mesh of one rank, FSDP's units over a mesh of one rank, a context-parallel ring simulated in the
  process, an expert-parallel experiment's mixture sent to its experts over a mesh of one rank): the excess, per
  step, is what the step-time model adds to those layouts' steps (`layout_overhead_s`);
- on CPUs, what a collective costs inside a training step: every rank's model step at once with a 4 KiB all-reduce
  after each part of each block, forward and backward, each call timed (`collective_waits`): the latency of the
  last rank to arrive (`in_step_latency_s`, more than back-to-back calls measure), and how far the ranks drift apart
  between collectives (`drift_share`), both of which the step-time model adds to a step that waits for collectives;
- elementwise bandwidth: the bytes an elementwise addition reads and writes per second at the size of the model's
  logits (one micro-batch's tokens times the vocabulary, fp32: the loss's tensors), the rate of a step's memory-bound
  work (scalelm.plan.steptime);
- collectives: all_reduce, all_gather, reduce_scatter, send/recv (each rank to the next and from the previous at
  once: a pipeline's and the context-parallel ring's pattern) and all_to_all (uneven splits, as a mixture's dispatch
  sends them: `uneven_splits`) over message sizes, in the whole job (across nodes when there are several) and within
  each node; per size the time of each repetition's slowest rank (a collective ends when its last rank does; a
  repetition is the mean of calls lasting about 20 ms, as nccl-tests averages its iterations), as the median and the
  spread (min, max) over the repetitions, and the bus bandwidth in nccl-tests' convention (algorithm
  bandwidth, the message over the time, x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather, reduce_scatter and
  all_to_all, x 1 for send/recv; the message is the whole buffer: all_gather's output, reduce_scatter's input), so
  its figures compare with nccl-tests';
- on GPUs: each GPU's health from NVML, sampled on a thread while its products and steps run (an idle GPU is not
  throttled): the worst seen of uncorrected ECC errors, SM clock against its maximum, temperature, and the reasons
  the clock is held back; and the network NCCL chose (NCCL_DEBUG=INFO's "Using network ..."; the baseline forces
  NCCL's INFO logging over the site's setting for its own run and restores it after), with a warning when
  `--interconnect infiniband` says the site has InfiniBand and NCCL fell back to sockets (about a fifth of the
  bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scalelm.errors import friendly_errors
from scalelm.files import atomic_write_text, check_file_output
from scalelm.measure import nvml
from scalelm.plan.machine import MachineBaseline
from scalelm.plan.steptime import RING_RANKS
from scalelm.site import OPS, SCOPES

if TYPE_CHECKING:  # torch is imported where the measuring starts: the workflow reads this module without it
    import torch
    import torch.distributed as dist

# nccl-tests' bus bandwidth: the algorithm bandwidth times the share of the message each link carries
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n,
}
THROTTLE_REASONS = {  # NVML's clocks-event reasons (nvmlClocksEventReason*), as nvidia-smi names them
    0x1: "gpu idle",
    0x2: "applications clocks setting",
    0x4: "sw power cap",
    0x8: "hw slowdown",
    0x10: "sync boost",
    0x20: "sw thermal slowdown",
    0x40: "hw thermal slowdown",
    0x80: "hw power brake slowdown",
    0x100: "display clock setting",
}
HARMLESS_REASONS = {"gpu idle", "applications clocks setting", "sync boost", "display clock setting"}


def bus_bandwidth(op: str, size_bytes: int, seconds: float, ranks: int) -> tuple[float, float]:
    """(algorithm, bus) bandwidth in GB/s (10^9 bytes per second, as nccl-tests reports)."""
    algorithm = size_bytes / seconds / 1e9
    return algorithm, algorithm * BUS_FACTOR[op](ranks)


LOAD_SKEW = 0.3  # an all_to_all's busiest destination gets 1.3 x the mean: the local default's routers at most


def uneven_splits(elements: int, ranks: int, me: int) -> tuple[list[int], list[int]]:
    """The elements rank `me` sends to each rank and receives from each in an all_to_all of `elements` per rank,
    uneven as a mixture's dispatch is: a rank's share for the rank k places after it ramps from 1 - LOAD_SKEW to
    1 + LOAD_SKEW times the mean over k, so every rank sends and receives `elements` in all."""
    weights = [1 - LOAD_SKEW + 2 * LOAD_SKEW * k / max(ranks - 1, 1) for k in range(ranks)]
    by_offset = [int(elements * w / sum(weights)) for w in weights]
    by_offset[-1] += elements - sum(by_offset)
    sent = [by_offset[(rank - me) % ranks] for rank in range(ranks)]
    received = [by_offset[(me - rank) % ranks] for rank in range(ranks)]
    return sent, received


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


# ------------------------------------------------------------------------------------------ matrix products
def gemm_shapes(config, device_type: str) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of the model's training matrix products on `device_type` for one micro-batch of tokens: the output
    layer's N is its rows as training computes them (padded where scalelm.model.gpu_ops pads them)."""
    m, d, vocab = output_shape(config)
    ff = config.model.d_ff
    return {
        "qkv": (m, d, 3 * d),
        "attention_out": (m, d, d),
        "ffn_up": (m, d, ff),
        "ffn_down": (m, ff, d),
        "output": (m, d, padded_rows(vocab, device_type)),
    }


def output_shape(config) -> tuple[int, int, int]:
    """(M, K, N) of the output layer's product as the model defines it: one micro-batch's tokens (one device's,
    without data parallelism), the model's width, the vocabulary."""
    m = config.data.seq_len * (config.batch.micro_size or config.batch.size)
    return m, config.model.d_model, vocabulary_size(config)


def output_shapes(config) -> dict[str, tuple[int, int, int]]:
    """The output layer's product unpadded and as training pads it on CUDA, for `matmul_rates` to set side by
    side (the padding is there because the unpadded shape gets slower kernels)."""
    m, d, vocab = output_shape(config)
    return {"output_unpadded": (m, d, vocab), "output_padded": (m, d, padded_rows(vocab, "cuda"))}


def padded_rows(rows: int, device_type: str) -> int:
    """`rows` of a weight as scalelm.model.gpu_ops.aligned_linear multiplies it on `device_type`."""
    from scalelm.model.gpu_ops import PADDED_DEVICES, ROW_MULTIPLE  # imports torch: not at the module's import

    return rows + (-rows % ROW_MULTIPLE if device_type in PADDED_DEVICES else 0)


WIKITEXT2_VOCABULARY = 33278  # WikiText-2's with the course's preparation: the stand-in where none is prepared


def prepared_vocabulary(config) -> int | None:
    """The vocabulary of the prepared data the config names; None where none is prepared there."""
    manifest = Path(config.data.prepared_dir) / "manifest.json"
    try:
        return int(json.loads(manifest.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError):
        return None


def vocabulary_size(config) -> int:
    """The prepared data's, where it is; else WikiText-2's (the model's step then is not the study's: the plan
    prices the vocabulary the baseline measured, `model_step.vocab_size`)."""
    return prepared_vocabulary(config) or WIKITEXT2_VOCABULARY


def matmul_rates(shapes: dict[str, tuple[int, int, int]], device: torch.device, dtype: torch.dtype) -> dict:
    """TFLOP/s of each product and over all of them."""
    import torch

    rates, flops_total, seconds_total = {}, 0.0, 0.0
    for name, (m, k, n) in shapes.items():
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        c = torch.empty(m, n, device=device, dtype=dtype)  # not a fresh output each time: the allocator's page faults
        seconds = median_seconds(lambda: torch.matmul(a, b, out=c), device)  # would be timed with the product
        flops = 2.0 * m * k * n
        rates[name] = {"shape": [m, k, n], "tflops": flops / seconds / 1e12}
        flops_total, seconds_total = flops_total + flops, seconds_total + seconds
    return {"products": rates, "tflops": flops_total / seconds_total / 1e12, "dtype": str(dtype).removeprefix("torch.")}


def elementwise_gbps(elements: int, device: torch.device) -> float:
    """GB/s an fp32 addition of two `elements`-long tensors into a third reads and writes."""
    import torch

    a, b = torch.rand(elements, device=device), torch.rand(elements, device=device)
    out = torch.empty_like(a)
    return 3 * elements * 4 / median_seconds(lambda: torch.add(a, b, out=out), device) / 1e9


def model_step_seconds(
    config, vocab: int, tokens: int, device: torch.device, compiled: bool = False
) -> tuple[float, float, float]:
    """Seconds (min, median, max over its timed runs) of one training step of the model alone on this device
    (`model_step`), compiled as training compiles it where `compiled`: what the step-time model's matrix products and
    elementwise bytes leave out (dispatch, cold caches, the softmax's transcendental work) shows as its efficiency
    (scalelm.plan.steptime)."""
    step = model_step(config, vocab, tokens, device, compiled)
    # compiling happens in the first calls (forward and backward, then the optimizer's first step): untimed
    return seconds_spread(step, device, sample_s=MODEL_STEP_SAMPLE_S, warmup=COMPILED_WARMUP if compiled else 0)


def model_step(
    config,
    vocab: int,
    tokens: int,
    device: torch.device,
    compiled: bool = False,
    prepare: Callable[[torch.nn.Module], None] | None = None,
) -> Callable[[], None]:
    """One training step of the model (forward with the loss, backward, AdamW) for `tokens` tokens, ready to call:
    its blocks (and on CUDA its head) compiled as training compiles them (train.compile_mode) where `compiled`;
    `prepare` changes the model before its optimizer is made (`layout_overheads`)."""
    import torch

    from scalelm.model.transformer import TransformerLM
    from scalelm.optim import build_optimizer  # training's own AdamW
    from scalelm.parallel import compile as compiling

    torch.manual_seed(0)
    model = TransformerLM(config.model, vocab).to(device)
    if prepare is not None:
        prepare(model)
    if compiled:
        torch._dynamo.reset()  # a training compiles one shape: a second one here would be compiled shape-generic
        compiling.apply_compile(model, device, config.train.compile_mode)
    optimizer = build_optimizer(model, config.optim, config.optim.lr)
    shape = (max(1, tokens // config.data.seq_len), config.data.seq_len)
    inputs, targets = (torch.randint(0, vocab, shape, device=device) for _ in range(2))

    def step() -> None:
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def layout_overheads(config, vocab: int, tokens: int, device: torch.device, mesh, compiled: bool, moe=None) -> dict:
    """What a step of one micro-batch of `tokens` costs more with a layout's machinery, run in this one process, than
    the plain model's (eager), in seconds (0 where it costs less): the median of `excess_seconds` by name in
    `layout_overhead_s`, its (min, max) in `layout_overhead_s_spread`. `tp`, the blocks' weights DTensors on
    `mesh` (this rank alone) as tensor parallelism makes them: DTensor's dispatch, which a tensor-parallel step pays
    whatever its degree (not where training compiles: traced away); `cp`, every attention a RING_RANKS-way ring
    simulated here (scalelm.parallel.context.simulated_ring_attention: a real ring's blocks, kernels and merges,
    every rank's), a rank's share; `ep`, with the mixture `moe` (an expert-parallel experiment's, where the study
    has one) in the blocks, its experts split over `mesh` and their rows sent there (the dispatch's counts, host
    read, permutations and all-to-alls, the experts as DTensors), against the same mixture without; `fsdp`, each
    block and the model FSDP units over `mesh` as training shards them: the hooks, DTensors and copies in and out of
    the gathered weights that a sharded step pays beside its collectives (those over one rank: copies)."""
    import torch

    from scalelm.parallel.data import apply_fsdp
    from scalelm.parallel.expert import apply_ep
    from scalelm.parallel.tensor import apply_tp

    def excess(prepare, settings=config, share: float = 1.0) -> tuple[float, float, float]:
        plain, machinery = (model_step(settings, vocab, tokens, device, prepare=p) for p in (None, prepare))
        return tuple(max(seconds * share, 0.0) for seconds in excess_seconds(plain, machinery, device))

    overheads = {"cp": excess(simulate_ring(config.parallel.cp_load_balance), share=1 / RING_RANKS)}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the compute dtype, as training's FSDP casts
    sharding = config.parallel.reshards(pp=1)
    overheads["fsdp"] = excess(lambda m: apply_fsdp(m, mesh, dtype, sharding, cpu_offload=False))
    if not compiled:
        overheads["tp"] = excess(lambda m: apply_tp(m, mesh, loss_parallel=False, sequence_parallel=False))
    if moe is not None:
        overheads["ep"] = excess(lambda m: apply_ep(m, mesh), with_mixture(config, moe))
    return {
        "layout_overhead_s": {name: median for name, (_, median, _) in sorted(overheads.items())},
        "layout_overhead_s_spread": {name: [low, high] for name, (low, _, high) in sorted(overheads.items())},
    }


def simulate_ring(load_balance: bool) -> Callable[[torch.nn.Module], None]:
    """Makes every attention of a model a RING_RANKS-way ring run in this process."""
    import torch

    from scalelm.parallel.context import simulated_ring_attention

    def ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        seed = torch.randint(2**62, (), dtype=torch.int64) if dropout_p else None  # as RingCore draws it
        return simulated_ring_attention(q, k, v, RING_RANKS, load_balance, dropout_p, seed)

    def prepare(model: torch.nn.Module) -> None:
        for block in model.blocks.values():
            block.attn.core = ring

    return prepare


LATENCY_PROBE_ELEMENTS = 1024  # 4 KiB of fp32: latency, not bandwidth
WAIT_RUNS = 5  # runs of the synchronised step, each about MODEL_STEP_SAMPLE_S: the spread


def collective_waits(
    config, vocab: int, tokens: int, device: torch.device, group: dist.ProcessGroup | None
) -> dict[str, Any]:
    """What a collective costs inside a training step, from every rank's model step for `tokens` tokens at once with
    a 4 KiB all-reduce over `group` (default the job; consecutive ranks) after each part of each block
    with weights (attention, feed-forward, norms), forward and backward, each call timed on every rank. In each
    collective the rank that arrives last waits only for the collective itself: the latency of a collective inside
    a step (`in_step_latency_s`, the mean over a run's collectives), which on a CPU includes waking a rank whose
    core others compute on. The others waited for it as well: between two collectives the ranks drift apart, and
    the step moves at the pace of the last at each (`drift_share`: their mean wait over the run's compute). Each
    figure's median over WAIT_RUNS runs and its spread (min, max)."""
    import torch
    import torch.distributed as dist

    buffer, durations = torch.ones(LATENCY_PROBE_ELEMENTS, device=device), []

    def synchronise(*_: Any) -> None:
        start = time.perf_counter()
        dist.all_reduce(buffer, group=group)
        durations.append(time.perf_counter() - start)

    def prepare(model: torch.nn.Module) -> None:
        for block in model.blocks.values():
            for part in block.children():
                if any(True for _ in part.parameters()):
                    part.register_forward_hook(synchronise)
                    part.register_full_backward_hook(synchronise)

    step = model_step(config, vocab, tokens, device, prepare=prepare)
    agreed = calls_agreed(step, device, MODEL_STEP_SAMPLE_S)  # every rank as many steps: as many collectives
    runs = []
    for _ in range(WAIT_RUNS):
        durations.clear()
        dist.barrier()
        seconds = per_call(step, device, agreed) * agreed
        runs.append([seconds, *durations])
    mine = torch.tensor(runs, dtype=torch.float64, device=device)  # runs x (seconds, each collective's)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    group_size = dist.get_world_size(group)
    latencies, drifts = [], []
    for run in torch.stack(everyone).transpose(0, 1):  # ranks x (seconds, collectives) per run
        calls = run[:, 1:].reshape(-1, group_size, run.shape[1] - 1)  # groups x ranks x collectives
        last = calls.min(dim=1).values  # the last rank to arrive: the collective alone
        waited = (calls.mean(dim=1) - last).sum(dim=1)  # a group's mean rank's wait for the last, over the run
        compute = run[:, 0].reshape(-1, group_size).max(dim=1).values - calls.mean(dim=1).sum(dim=1)
        latencies.append(last.mean().item())
        drifts.append((waited / compute).mean().item())
    return timed("in_step_latency_s", spread(latencies)) | timed("drift_share", spread(drifts))


def model_step_figures(tokens: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The model's step alone (the slowest rank's), for one micro-batch and for a quarter of its tokens on the same
    rank (a step's fixed cost is what a line through the two leaves at no tokens), and, on CPUs, how much more a
    machine does with every core at work: as threads of one process (`thread_speedup`, rank 0's), and as every rank
    of the job at once (`host_speedup`: the machine's throughput over one rank's alone; near the cores where they
    are real, less where they share caches or a physical core)."""
    slowest = max(per_rank, key=lambda r: r["model_step_s"])
    alone = slowest["model_step_s"]
    # the slowest rank's runs' fastest and slowest: the model's own spread
    figures: dict[str, Any] = {"tokens": tokens, "seconds_max": alone, "seconds_spread": slowest["model_step_s_spread"]}
    first = per_rank[0]
    if slowest.get("model_step_small_s") and slowest["model_step_small_tokens"] < tokens:
        # the same rank's: a line through two ranks' steps would take their difference for a fixed cost
        figures |= {
            "small_tokens": slowest["model_step_small_tokens"],
            "small_seconds_max": slowest["model_step_small_s"],
            "small_seconds_spread": slowest["model_step_small_s_spread"],
        }
    if first.get("layout_overhead_s"):
        figures |= {key: first[key] for key in ("layout_overhead_s", "layout_overhead_s_spread")}
    if first.get("model_step_all_cores_s"):
        figures |= {"cores": first["cpus"], "thread_speedup": first["model_step_s"] / first["model_step_all_cores_s"]}
    together = [r for r in per_rank if r.get("model_step_together_s")]
    if together:
        ranks_per_host = max(Counter(r["machine"] for r in per_rank).values())  # several "nodes" may be one
        slowest_together = max(r["model_step_together_s"] for r in together)
        figures |= {
            "together_seconds_max": slowest_together,
            "ranks_per_host": ranks_per_host,
            "host_speedup": ranks_per_host * alone / slowest_together,
        }
        # with every rank at work a machine's throughput moves most: the ranks' slowest run, and the best run of
        # the rank whose best was slowest (all ranks are needed for the machine's throughput)
        longest = max(r["model_step_together_s_spread"][1] for r in together)
        shortest = max(r["model_step_together_s_spread"][0] for r in together)
        figures["host_speedup_spread"] = [ranks_per_host * alone / longest, ranks_per_host * alone / shortest]
    return figures


COMPILED_WARMUP = 3  # untimed calls of a compiled step before its timing
MODEL_STEP_SAMPLE_S = 0.2  # each of a model step's timed runs: several steps, one would be at the mercy of a hiccup


def median_seconds(
    call: Callable[[], Any], device: torch.device, sample_s: float = 0.01, samples: int = 5, warmup: int = 0
) -> float:
    return seconds_spread(call, device, sample_s, samples, warmup)[1]


def seconds_spread(
    call: Callable[[], Any], device: torch.device, sample_s: float = 0.01, samples: int = 5, warmup: int = 0
) -> tuple[float, float, float]:
    """Seconds per call, (min, median, max) over `samples` runs of enough calls to last about `sample_s` each,
    after `warmup` untimed calls and a timed one that sizes the runs (a single sub-millisecond kernel is at the
    mercy of one preemption)."""
    for _ in range(warmup):
        call()
    calls = calls_lasting(call, device, sample_s)
    return spread([per_call(call, device, calls) for _ in range(samples)])


def excess_seconds(
    call: Callable[[], Any], other: Callable[[], Any], device: torch.device, pairs: int = 7
) -> tuple[float, float, float]:
    """What `other` takes more than `call` per call, (min, median, max) over `pairs` runs of each timed back to back
    (the machine's drift between runs, which moves either alone by more than the difference, cancels in a pair)."""
    calls = calls_lasting(call, device, MODEL_STEP_SAMPLE_S)
    per_call(other, device, 1)  # its first call: what the runs of `call` sized above paid for it
    return spread([per_call(other, device, calls) - per_call(call, device, calls) for _ in range(pairs)])


def calls_lasting(call: Callable[[], Any], device: torch.device, seconds: float) -> int:
    """How many calls last about `seconds`, from one timed call."""
    return max(1, min(1000, int(seconds / max(per_call(call, device, 1), 1e-7))))


def calls_agreed(call: Callable[[], Any], device: torch.device, seconds: float, group: Any = None) -> int:
    """`calls_lasting` on the group's slowest rank: a collective inside `call` needs every rank to call as often."""
    import torch
    import torch.distributed as dist

    calls = torch.tensor([calls_lasting(call, device, seconds)], device=device)
    dist.all_reduce(calls, op=dist.ReduceOp.MIN, group=group)
    return int(calls.item())


def per_call(call: Callable[[], Any], device: torch.device, calls: int) -> float:
    """Seconds per call over `calls` calls, the device synchronised before and after."""
    from scalelm.measure.device import synchronize  # imports torch: not at the module's import

    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        call()
    synchronize(device)
    return (time.perf_counter() - start) / calls


# ------------------------------------------------------------------------------------------------ collectives
def run_op(op: str, size_bytes: int, group: dist.ProcessGroup, device: torch.device) -> Callable[[], None]:
    """One `op` of `size_bytes` (fp32) on `group`, ready to call."""
    import torch
    import torch.distributed as dist

    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    elements = max(size_bytes // 4 // ranks, 1) * ranks
    buffer = torch.ones(elements, device=device)
    piece = torch.ones(elements // ranks, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(buffer, group=group)
    # the same collectives under their newer names (torch >= 2.13), where there are
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if op == "all_gather":
        return lambda: gather(buffer, piece, group=group)
    if op == "reduce_scatter":
        return lambda: scatter(piece, buffer, group=group)
    if op == "all_to_all":
        sent, received = uneven_splits(elements, ranks, me)
        arrived = torch.empty(sum(received), device=device)
        return lambda: dist.all_to_all_single(arrived, buffer, received, sent, group=group)
    received = torch.empty_like(buffer)
    after = dist.get_global_rank(group, (me + 1) % ranks)
    before = dist.get_global_rank(group, (me - 1) % ranks)

    def send_recv() -> None:
        ops = [dist.P2POp(dist.isend, buffer, after, group), dist.P2POp(dist.irecv, received, before, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return send_recv


COLLECTIVE_SAMPLE_S = 0.02  # each repetition of a collective: calls enough to last about this long


def time_collectives(
    scope: str, group: dist.ProcessGroup, sizes: list[int], device: torch.device, iterations: int
) -> list[dict[str, Any]]:
    """Every op at every size on `group`: each repetition's slowest rank, the median and the spread over the
    repetitions of its time and bandwidths. A repetition is the mean of as many calls as last about
    COLLECTIVE_SAMPLE_S (at least one; the same count on every rank), as nccl-tests averages its iterations: one
    call of a small message is at the mercy of one preemption."""
    import torch
    import torch.distributed as dist

    ranks = dist.get_world_size(group)
    rows = []
    for op in OPS:
        if op == "send_recv" and ranks < 2:
            continue
        for size in sizes:
            call = run_op(op, size, group, device)
            dist.barrier(group=group)
            # its one timed call warms up (connections, buffers); every rank then calls as often
            calls = calls_agreed(call, device, COLLECTIVE_SAMPLE_S, group)
            times = []
            for _ in range(iterations):
                dist.barrier(group=group)
                times.append(per_call(call, device, calls))
            slowest = torch.tensor(times, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)  # a repetition ends with its last rank
            fastest, seconds, longest = spread(slowest.tolist())
            algorithm, bus = bus_bandwidth(op, size, seconds, ranks)
            rows.append(
                {
                    "scope": scope,
                    "op": op,
                    "ranks": ranks,
                    "bytes": size,
                    "time_s": seconds,
                    "time_s_min": fastest,
                    "time_s_max": longest,
                    "algbw_gbps": algorithm,
                    "busbw_gbps": bus,
                    "busbw_gbps_min": bus_bandwidth(op, size, longest, ranks)[1],
                    "busbw_gbps_max": bus_bandwidth(op, size, fastest, ranks)[1],
                }
            )
    return rows


def spread(values: list[float]) -> tuple[float, float, float]:
    """(min, median, max)."""
    return min(values), statistics.median(values), max(values)


def timed(name: str, seconds: tuple[float, float, float]) -> dict[str, Any]:
    """A figure's median as `name` and its (min, max) as `<name>_spread`, as the per-rank figures hold them."""
    fastest, median, longest = seconds
    return {name: median, f"{name}_spread": [fastest, longest]}


def node_group(procs_per_node: int, world_size: int) -> dist.ProcessGroup | None:
    """This rank's node (torchrun places a node's ranks together); None with one node or one process per node."""
    import torch.distributed as dist

    if procs_per_node < 2 or procs_per_node >= world_size or world_size % procs_per_node:
        return None
    mine, _ = dist.new_subgroups(group_size=procs_per_node)
    return mine


# ----------------------------------------------------------------------------------------------------- GPUs
HEALTH_SAMPLE_S = 0.05  # how often the health thread reads NVML while the products and steps run
IDLE_REASON = 0x1  # THROTTLE_REASONS' "gpu idle": a clock lowered for want of work, not held back


def open_health_reader(device: torch.device) -> Callable[[], dict[str, Any]] | None:
    """A function reading one sample of the health of this rank's GPU from NVML (the clock's reasons as NVML's bit
    mask, each figure None where NVML does not answer it); None off CUDA. Raises where NVML cannot be opened."""
    if device.type != "cuda":
        return None
    from scalelm.measure.monitor import device_uuid

    pynvml, handle = nvml.handle(device_uuid(device))
    read = nvml.read

    def reasons() -> int:  # "clocks event reasons" in newer bindings, "throttle reasons" in older ones
        query = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        return (query or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons)(handle)

    def sample() -> dict[str, Any]:
        return {
            "ecc_uncorrected": read(
                lambda: pynvml.nvmlDeviceGetTotalEccErrors(
                    handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
                )
            ),
            "sm_clock_mhz": read(lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
            "sm_clock_max_mhz": read(lambda: pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)),
            "reasons": read(reasons),
            "temperature_c": read(lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
            "power_limit_w": read(lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000),
        }

    return sample


def worst_health(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The worst of `samples` (open_health_reader's): the most uncorrected ECC errors since the driver loaded, the
    lowest SM clock among the samples of a busy GPU (an idle one lowers its clock by design) against its maximum,
    every reason the clock was held back, the highest temperature and the lowest power limit enforced (each absent
    where NVML reports none)."""

    def known(key: str, among: list[dict[str, Any]] = samples) -> list[Any]:
        return [sample[key] for sample in among if sample.get(key) is not None]

    busy = [sample for sample in samples if not (sample["reasons"] or 0) & IDLE_REASON] or samples
    reasons = 0
    for sample in samples:
        reasons |= sample["reasons"] or 0
    named = [name for bit, name in THROTTLE_REASONS.items() if reasons & bit]
    ecc = max(known("ecc_uncorrected"), default=None)
    health = {
        "ecc_uncorrected": ecc,
        "sm_clock_mhz": min(known("sm_clock_mhz", busy), default=None),
        "sm_clock_max_mhz": max(known("sm_clock_max_mhz"), default=None),
        "held_back_by": named,
        "healthy": not ecc and not set(named) - HARMLESS_REASONS,
    }
    if known("temperature_c"):
        health["temperature_c_max"] = max(known("temperature_c"))
    if known("power_limit_w"):  # a card capped below its rating clocks lower under the same work
        health["power_limit_w"] = min(known("power_limit_w"))
    return health


def gpu_health(device: torch.device) -> dict[str, Any] | None:
    """NVML's view of this rank's GPU now, in one sample (`worst_health`'s fields); None off CUDA. The baseline
    samples while it works instead (`health_sampler`): after the work the GPU is idle and no longer throttled."""
    try:
        reader = open_health_reader(device)
    except Exception as err:  # no NVML: a missing fact, not a failed baseline
        return {"error": str(err)}
    return None if reader is None else worst_health([reader()])


class HealthSampler:
    """Samples a GPU's health (`reader`) on a thread while the code inside `with` runs: at its start, then every
    `interval` seconds (default HEALTH_SAMPLE_S). `result()` is the worst seen (`worst_health`) with the number of
    samples; None without a
    reader (off CUDA); the reason where none could be read."""

    def __init__(
        self, reader: Callable[[], dict[str, Any]] | None, interval: float | None = None, error: str | None = None
    ):
        self.reader, self.interval, self.error = reader, interval or HEALTH_SAMPLE_S, error
        self.samples: list[dict[str, Any]] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, name="scalelm-gpu-health", daemon=True)

    def run(self) -> None:
        while True:
            try:
                self.samples.append(self.reader())
            except Exception as err:  # a GPU that stops answering: the samples so far stand
                self.error = f"{type(err).__name__}: {err}"
            if self.stopped.wait(self.interval):
                return

    def __enter__(self) -> HealthSampler:
        if self.reader is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.reader is not None:
            self.stopped.set()
            self.thread.join()

    def result(self) -> dict[str, Any] | None:
        if self.samples:
            return worst_health(self.samples) | {"samples": len(self.samples)}
        return None if self.error is None else {"error": self.error}


def health_sampler(device: torch.device) -> HealthSampler:
    """The sampler of this rank's GPU (one that reads nothing off CUDA or without NVML, saying why)."""
    try:
        return HealthSampler(open_health_reader(device))
    except Exception as err:  # no NVML: a missing fact, not a failed baseline
        return HealthSampler(None, error=str(err))


NETWORK = re.compile(r"Using network (\w+)")


def nccl_network(logs: list[str]) -> str | None:
    """The network NCCL chose, from NCCL_DEBUG=INFO logs: "IB", "Socket", ... (the first one named; several
    differing ones are joined)."""
    found = sorted({m for text in logs for m in NETWORK.findall(text)})
    return "/".join(found) or None


def nccl_debug_env(directory: Path) -> dict[str, str]:
    """NCCL's INFO log of its start (which names its network), one file per process, read by `nccl_network`."""
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": str(directory / "nccl.%h.%p.log")}


@contextmanager
def forced_environment(values: Mapping[str, str]) -> Iterator[None]:
    """`values` in os.environ over what is there, and what was there (or nothing) back afterwards."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ---------------------------------------------------------------------------------------------------- the run
def measure(args: argparse.Namespace) -> dict[str, Any] | None:
    """The baseline of this job (None on every rank but the first). On CUDA NCCL logs at INFO whatever the site
    set (its WARN would hide the network it chose), for this run only, the site's setting restored afterwards. NCCL
    reads it once per process, when first used: in a process that used NCCL before, the network stays unknown."""
    import torch

    logs = args.out.parent / f"{args.out.stem}.nccl"
    detection: dict[str, str] = {}
    if torch.cuda.is_available():
        logs.mkdir(parents=True, exist_ok=True)
        detection = nccl_debug_env(logs)
    with forced_environment(detection):
        return measure_job(args, logs)


def measure_alone(
    config,
    shapes: dict[str, tuple[int, int, int]],
    vocab: int,
    device: torch.device,
    all_cores: bool,
    mesh=None,
    moe=None,
    small_step: bool = True,
) -> dict[str, Any]:
    """This rank's products, elementwise bandwidth and model steps, alone on its device, with its GPU's health
    sampled while they run; with `all_cores` (a CPU's first rank) also the step with every core as a thread; with
    `mesh` (this rank alone: the first rank's) also the layouts' overheads (`layout_overheads`, with `moe`). Without
    `small_step`, no step at a quarter of the tokens: compiled, that is a second cold compile (a minute or more of
    gpt2_small on a GPU)."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    compiled = bool(config.train.compile)
    m = shapes["output"][0]
    small = max(config.data.seq_len, m // 4)  # a quarter of the tokens: what a step costs regardless
    figures: dict[str, Any] = {"model_step_all_cores_s": None}
    with health_sampler(device) as health:
        figures |= {
            "matmul": matmul_rates(shapes, device, dtype),
            "elementwise_gbps": elementwise_gbps(m * vocab, device),
        }
        figures |= timed("model_step_s", model_step_seconds(config, vocab, m, device, compiled))
        if small_step:
            figures |= timed("model_step_small_s", model_step_seconds(config, vocab, small, device, compiled))
            figures["model_step_small_tokens"] = small
        if mesh is not None:
            figures |= layout_overheads(config, vocab, m, device, mesh, compiled, moe)
        if all_cores:
            threads = torch.get_num_threads()
            torch.set_num_threads(len(os.sched_getaffinity(0)))
            figures["model_step_all_cores_s"] = model_step_seconds(config, vocab, m, device, compiled)[1]
            torch.set_num_threads(threads)
    return figures | {"model_step_compiled": compiled, "gpu": health.result()}


def measure_job(args: argparse.Namespace, logs: Path) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from scalelm.config import load_config
    from scalelm.measure.hostload import HostLoad, machine_id
    from scalelm.parallel.env import all_gather_object, barrier, setup, teardown

    env = setup("auto", 600)
    load = HostLoad()  # other work beside the baseline lowers its rates: the report marks it (report.disturbance)
    try:
        device = env.device
        config = load_config(args.config)
        shapes = gemm_shapes(config, device.type)
        m, _, vocab = output_shape(config)
        prepared = prepared_vocabulary(config) is not None  # else the stand-in's vocabulary: the log says so
        alone: dict[str, Any] = {}
        mesh = None
        if dist.is_initialized():  # each rank's mesh of itself alone, for the layouts' overheads (every rank makes it)
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(dist.new_subgroups(group_size=1)[0], device.type)
        elif args.moe is not None:
            print(
                "note: --moe is unused in one process: its mixture's dispatch is timed among the layouts' overheads, "
                "which only a baseline of two processes or more measures (torchrun --nproc-per-node=2 or more)",
                flush=True,
            )
        for rank in range(env.world_size):  # one at a time: no two share a device or a core
            if dist.is_initialized():
                dist.barrier()
            if rank == env.rank:  # on CPU rank 0 also runs one process with every core as a thread
                first = rank == 0
                alone = measure_alone(
                    config, shapes, vocab, device, device.type == "cpu" and first, mesh if first else None, args.moe
                )
        crowded = None
        if device.type == "cpu" and env.world_size > 1:  # every rank at once, as in training: the host's throughput
            dist.barrier()
            crowded = timed(
                "model_step_together_s", model_step_seconds(config, vocab, m, device, alone["model_step_compiled"])
            )
        collectives, latency = [], {}
        if env.world_size > 1:
            within = node_group(env.procs_per_node, env.world_size)
            if device.type == "cpu":  # a node's ranks at once, as a layout's groups within nodes run
                latency = collective_waits(config, vocab, m, device, within)
            sizes = message_sizes(args.min_bytes, args.max_bytes)
            collectives = time_collectives(SCOPES[0], dist.group.WORLD, sizes, device, args.iterations)
            if within is not None:
                collectives += time_collectives(SCOPES[1], within, sizes, device, args.iterations)
        per_rank = all_gather_object(
            {
                "rank": env.rank,
                "host": socket.gethostname(),
                "machine": machine_id(),
                **alone,
                **(crowded or {"model_step_together_s": None}),
                "threads": torch.get_num_threads(),
                "cpus": len(os.sched_getaffinity(0)),
                "load": load.reading(),
            }
        )
        barrier()  # every rank done with every collective before any shuts its process groups down
        if not env.is_main:
            return None
        network = nccl_network([p.read_text(errors="replace") for p in logs.glob("*.log")]) if logs.is_dir() else None
        return {
            "world_size": env.world_size,
            "procs_per_node": env.procs_per_node,
            "hosts": sorted({r["host"] for r in per_rank}),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "torch": torch.__version__,
            "matmul_tflops_min": min(r["matmul"]["tflops"] for r in per_rank),
            "elementwise_gbps_min": min(r["elementwise_gbps"] for r in per_rank),
            "model_step": model_step_figures(m, per_rank)
            | {
                "compiled": alone["model_step_compiled"],
                "vocab_size": vocab,
                "prepared": prepared,
            },
            "per_rank": per_rank,
            "collectives": collectives,
            **latency,
            "nccl_network": network,
            "host_load": HostLoad.per_host([r["load"] for r in per_rank]),  # per host: its and other work's cores
        }
    finally:
        teardown()


def report(baseline: MachineBaseline, interconnect: str | None) -> list[str]:
    """The baseline in a few lines, the slowest ranks' figures, and what looks wrong."""
    step = baseline.model_step
    lines = [
        f"baseline of {baseline.world_size} process(es) on {', '.join(baseline.hosts)} ({baseline.device}): "
        f"matrix products {baseline.matmul_tflops:.3g} TFLOP/s, elementwise "
        f"{baseline.elementwise_gbps:.3g} GB/s, the model's step {step.seconds.median:.3g} s "
        f"for {step.tokens:,} tokens (the slowest rank{', compiled' if step.compiled else ''})"
    ]
    if step.prepared is False:
        lines.append(
            f"  no prepared data where the config says: the model's step timed with WikiText-2's vocabulary "
            f"({step.vocab_size:,}); the plan prices that vocabulary for it"
        )
    if step.host_speedup:
        lines.append(
            f"  a host's throughput with its {step.ranks_per_host} ranks at work: "
            f"{step.host_speedup.median:.2f} x one rank's alone"
        )
    if baseline.waits:
        lines.append(
            f"  a small collective inside a step, every rank at work: "
            f"{baseline.waits.in_step_latency_s.median * 1e3:.3g} ms, and the ranks drift apart by "
            f"{baseline.waits.drift_share.median:.0%} of their compute between collectives"
        )
    for row in baseline.largest().values():
        lines.append(
            f"  {row.op:<15} {row.scope:<4} {row.ranks} ranks, {row.bytes / 2**20:8.2f} MiB: "
            f"{row.time_s.median * 1e3:9.3f} ms, bus bandwidth {row.busbw_gbps.median:8.3f} GB/s"
        )
    for rank in baseline.per_rank:
        if rank.gpu and not rank.gpu.get("healthy", True):
            lines.append(f"  WARNING: rank {rank.rank} on {rank.host}: GPU not healthy ({rank.gpu})")
    if baseline.nccl_network:
        lines.append(f"  NCCL network: {baseline.nccl_network}")
        if interconnect == "infiniband" and "IB" not in baseline.nccl_network:
            lines.append(
                "  WARNING: the site has InfiniBand but NCCL uses " + baseline.nccl_network + ": about a "
                "fifth of the bandwidth between nodes. Check the image's libibverbs and NCCL_IB_* settings "
                "(docs/gpu.md)"
            )
    return lines


def mixture(text: str, config_path: Path | None, parser: argparse.ArgumentParser):
    """--moe's model.moe settings (a JSON mapping), typed and checked as training types and checks them, in the model
    of the settings at `config_path` (`with_mixture`): a mixture training refuses is refused by name before anything
    is measured."""
    from scalelm.config import MoEConfig, load_config, validate
    from scalelm.errors import ConfigError
    from scalelm.settings_yaml import from_mapping

    try:
        moe = from_mapping(MoEConfig, json.loads(text), "--moe.")
    except json.JSONDecodeError as err:
        parser.error(f'--moe must be a JSON mapping of model.moe\'s settings ({{"experts": 4}}), got {text!r}: {err}')
    config = load_config(config_path)
    try:
        validate(with_mixture(config, moe))
    except ConfigError as err:
        parser.error(f"--moe {text}: {err}")
    return moe


def with_mixture(config, moe):
    """`config` with the mixture `moe` in its model: the expert-parallel experiment's model whose dispatch is timed."""
    from dataclasses import replace

    return replace(config, model=replace(config.model, moe=moe))


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalelm.measure.baseline", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the baseline's JSON file")
    parser.add_argument(
        "--config", type=Path, help="training settings whose matrix products to time (default: the course's)"
    )
    parser.add_argument(
        "--moe",
        metavar="JSON",
        help="an expert-parallel experiment's model.moe, whose dispatch is timed (layout_overheads)",
    )
    parser.add_argument("--min-bytes", type=int, default=2**12)
    parser.add_argument("--max-bytes", type=int, default=2**26, help="largest message (default 64 MiB)")
    parser.add_argument("--iterations", type=int, default=5, help="timed repetitions per op and size")
    parser.add_argument("--interconnect", choices=["infiniband", "ethernet"], help="what the site's nodes have")
    args = parser.parse_args(argv)
    if args.min_bytes < 4 or args.max_bytes < args.min_bytes or args.iterations < 1:
        parser.error("--min-bytes must be 4 or more, --max-bytes at least --min-bytes, --iterations 1 or more")
    if args.moe is not None:
        args.moe = mixture(args.moe, args.config, parser)
    check_file_output(args.out)  # before the measurements: they would be lost
    result = measure(args)
    if result is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")
        print("\n".join(report(MachineBaseline.from_json(result), args.interconnect)) + f"\nwritten to {args.out}")


if __name__ == "__main__":
    from scalelm.parallel.env import exit_after

    exit_after(main)
