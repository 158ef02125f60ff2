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
from pathlib import Path

from scalelm.errors import friendly_errors
from scalelm.files import atomic_write_text, check_file_output
from scalelm.measure.baseline.job import measure
from scalelm.measure.baseline.layout_overheads import with_mixture
from scalelm.plan.machine import MachineBaseline


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
