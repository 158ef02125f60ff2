"""Plan a training's layout before anything is queued: per-GPU memory and per-step communication of every layout
the machine can hold, whether each fits, and which to choose; with the machine's speeds, each layout's step time.

    python -m scalelm.plan --config FILE [--set KEY=VALUE ...] [--vocab-size V] --nodes N --gpus-per-node G
        --gpu-memory-gb M [--site profiles/slurm/site.yaml] [--activation-checkpointing] [--json]
        [--baseline results/machine/nodes2.json | --gpu NAME [--network NAME] | --matmul-tflops T
         --elementwise-gbps E --busbw-intra-gbps B [--busbw-inter-gbps B]]

A cluster no one has measured, in one command, from the catalogue's figures (scalelm.plan.catalogue; --gpu and
--network, or the site file's gpu and network, also give the GPUs per node and their memory):

    python -m scalelm.plan --config FILE --vocab-size 50304 --gpu h100-sxm --network ndr-8x --nodes 4

The vocabulary size comes from the prepared data (data.prepared_dir) unless given. The machine comes from the flags,
or for what they leave out from the site file (gpus_per_node, gpu_memory_gb). Its speeds, for the step time
(scalelm.plan.steptime), from a machine baseline (the workflow's rule machine_baseline, scalelm.measure.baseline),
the flags or the catalogue (a measured baseline wins over the catalogue); with them the recommendation is the layout
that fits and should be fastest, without them the lectures' ladder. Exit status 2, with the reason, when
no layout fits (naming the smallest machine that would do) or the config's own layout cannot run on the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from scalelm.config import load_config
from scalelm.data.manifest import read_manifest
from scalelm.errors import ConfigError, DataError, friendly_errors
from scalelm.model.architecture import parameter_counts
from scalelm.plan.catalogue import catalogue, check_site, gpu_memory_gb, inter_names, machine_record
from scalelm.plan.comm import INTER, INTRA, totals
from scalelm.plan.layouts import LayoutPlan, Machine, gb, plan_machine, rate, smallest_fsdp, smallest_machine
from scalelm.plan.machine import MachineBaseline
from scalelm.plan.memory import PARTS, Workload
from scalelm.plan.steptime import Speeds
from scalelm.site import load_site


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m scalelm.plan",
        description=__doc__.split("\n\n")[0],
        epilog="Your own cluster, not yet measured (the catalogue's GPUs and networks: --gpu, --network): scalelm "
        "plan --config my.yaml --vocab-size 50304 --gpu h100-sxm --network ndr-8x --nodes 4",
    )
    parser.add_argument("--config", help="a training config (YAML); none: the defaults, the course's model")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    parser.add_argument("--vocab-size", type=int, help="default: the prepared data's vocabulary")
    parser.add_argument("--site", help="site settings to take gpus_per_node and gpu_memory_gb from")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int)
    parser.add_argument("--gpu-memory-gb", type=float, help="one GPU's memory in GB (1e9 bytes): 40 for an A100 40GB")
    parser.add_argument("--headroom", type=float, default=0.1, help="share of a GPU's memory kept free (default 0.1)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the kernels to plan for")
    parser.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="full",
        choices=("none", "full", "selective"),
        help="full (the default of the bare flag): blocks keep only their inputs; selective: their products' outputs "
        "too; default: the config's train.activation_checkpointing",
    )
    parser.add_argument("--json", action="store_true", help="a JSON list of the layouts instead of a table")
    speed = parser.add_argument_group("the machine's speeds, for the step time (per GPU)")
    speed.add_argument("--baseline", help="a machine baseline's JSON (scalelm.measure.baseline) on as many nodes")
    speed.add_argument(
        "--gpu", help=f"a catalogue GPU, for a cluster not yet measured: {', '.join(sorted(catalogue().accelerators))}"
    )
    speed.add_argument("--network", help=f"the catalogue's network between its nodes: {inter_names()}")
    speed.add_argument("--matmul-tflops", type=float, help="matrix products at the model's shapes, training dtype")
    speed.add_argument("--elementwise-gbps", type=float, help="memory bandwidth of elementwise work, GB/s")
    speed.add_argument("--busbw-intra-gbps", type=float, help="collectives' bus bandwidth within a node, GB/s")
    speed.add_argument("--busbw-inter-gbps", type=float, help="collectives' bus bandwidth across nodes, GB/s")
    return parser.parse_args(argv)


# argparse's float() also takes inf, nan and 1e999: with them every layout fits, or every time is nan. Each flag's
# range (positive, a share) is checked where it is used (Machine, Speeds).
FLOAT_FLAGS = (
    "--gpu-memory-gb",
    "--headroom",
    "--matmul-tflops",
    "--elementwise-gbps",
    "--busbw-intra-gbps",
    "--busbw-inter-gbps",
)


def check_finite(args: argparse.Namespace) -> None:
    for flag in FLOAT_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not math.isfinite(value):
            raise ConfigError(f"{flag} must be a finite number, got {value}")


def speeds_of(args: argparse.Namespace, work: Workload | None = None, machine: Machine | None = None) -> Speeds | None:
    """The machine's speeds: a measured baseline's, else the catalogue's GPU's (flag or site file), else the flags'."""
    site = load_site(args.site)
    gpu, network = args.gpu or site.gpu, args.network or site.network
    check_site(gpu, network)  # an unknown name is refused even where a baseline wins
    if network:
        if not gpu:
            raise ConfigError("--network names the catalogue's network between a catalogue GPU's nodes: give --gpu too")
    hand = any(getattr(args, name) is not None for name in HAND_TYPED)
    if args.gpu and hand:
        raise ConfigError("give the machine's speeds either as --gpu or as flags, not both")
    if gpu and not args.baseline and not hand and work is not None and machine is not None:
        return Speeds.from_baseline(machine_record(work, machine.nodes, machine.gpus_per_node, gpu, network))
    speeds = given_speeds(args)
    if speeds and args.baseline and gpu:
        return replace(speeds, source=f"{speeds.source} (measured: it wins over the catalogue's {gpu})")
    return speeds


HAND_TYPED = ("matmul_tflops", "elementwise_gbps", "busbw_intra_gbps", "busbw_inter_gbps")


def given_speeds(args: argparse.Namespace) -> Speeds | None:
    given = {
        "--matmul-tflops": args.matmul_tflops,
        "--elementwise-gbps": args.elementwise_gbps,
        "--busbw-intra-gbps": args.busbw_intra_gbps,
    }
    if args.baseline:
        if any(value is not None for value in given.values()) or args.busbw_inter_gbps is not None:
            raise ConfigError("give the machine's speeds either as --baseline or as flags, not both")
        try:
            baseline = MachineBaseline.from_json(json.loads(Path(args.baseline).read_text()))
        except (OSError, ValueError) as err:
            raise ConfigError(f"--baseline {args.baseline} is not a machine baseline ({err})") from None
        return Speeds.from_baseline(baseline, args.baseline)
    if all(value is None for value in given.values()):
        return None
    missing = [flag for flag, value in given.items() if value is None]
    if args.nodes > 1 and args.busbw_inter_gbps is None:
        missing.append("--busbw-inter-gbps")
    if missing:
        raise ConfigError(f"the step time needs {', '.join(missing)} too (or --baseline FILE)")
    return Speeds.given(args.matmul_tflops, args.elementwise_gbps, args.busbw_intra_gbps, args.busbw_inter_gbps)


def machine_of(args: argparse.Namespace) -> Machine:
    site = load_site(args.site)
    named = args.gpu or site.gpu
    gpu = catalogue().accelerator(named) if named else None  # the catalogue's, for what the flags and site leave out
    # a flag given as 0 is refused (Machine), not replaced by the site's value
    gpus = args.gpus_per_node if args.gpus_per_node is not None else site.gpus_per_node or None
    memory = gpu_memory_gb(args.gpu_memory_gb if args.gpu_memory_gb is not None else site.gpu_memory_gb, named)
    gpus = gpus if gpus is not None or gpu is None else gpu.gpus_per_node
    if gpus is None:
        raise ConfigError("the machine's GPUs per node are unknown: pass --gpus-per-node, or --site with gpus_per_node")
    if memory is None:
        raise ConfigError(
            "the machine's memory per GPU is unknown: pass --gpu-memory-gb (e.g. 40 for an A100 40GB, 80 for an "
            "H100), or --site with gpu_memory_gb set"
        )
    return Machine(args.nodes, gpus, memory, args.headroom)


def vocab_size_of(args: argparse.Namespace, prepared_dir: str) -> int:
    if args.vocab_size is not None:
        if args.vocab_size < 2:
            raise ConfigError(f"--vocab-size must be at least 2, got {args.vocab_size}")
        return args.vocab_size
    try:
        return read_manifest(prepared_dir)["vocab_size"]
    except DataError as err:
        raise DataError(f"{err} Or pass --vocab-size.") from None


EXPERTS_COLUMN = "(expert state)"  # the experts' share of params, grads and optimizer: a part of them, not beside them


def table(plans: list[LayoutPlan]) -> str:
    mixture = any(plan.memory.expert_bytes is not None for plan in plans)
    parts = [*PARTS[:3], EXPERTS_COLUMN, *PARTS[3:]] if mixture else list(PARTS)
    head = ["layout", "strategy", "degrees", *parts, "total", "fits", f"{INTRA} GB/step", f"{INTER} GB/step"]
    timed = all(plan.step for plan in plans)
    head += ["step s", "compute s", "comm s", "bubble s", "tokens/s"] if timed else []
    head += ["all-to-all s"] if timed and mixture else []
    rows = []
    for plan in plans:
        traffic = totals(plan.flows)
        sizes = plan.memory.bytes | {EXPERTS_COLUMN: plan.memory.expert_state}
        rows.append(
            [
                plan.name + (" *" if plan.recommended else ""),
                plan.strategy or "-",
                plan.dims.layout,
                *(gb(sizes[part]) for part in parts),
                gb(plan.memory.total),
                "yes" if plan.fits else "no",
                gb(traffic[INTRA]),
                gb(traffic[INTER]),
            ]
        )
        if timed:
            step = plan.step
            rows[-1] += [
                f"{step.total_s:.4g}",
                f"{step.compute_s:.4g}",
                f"{sum(step.communication_s.values()):.4g}",
                f"{step.bubble_s:.4g}",
                rate(plan.tokens_per_s),
            ]
            rows[-1] += [f"{step.all_to_all_s:.4g}"] if mixture else []
    widths = [max(len(str(row[i])) for row in [head, *rows]) for i in range(len(head))]

    def line(row: list) -> str:  # names left-aligned, figures right-aligned
        return "  ".join(str(c).ljust(w) if i < 3 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([line(head), *(line(row) for row in rows)])


def print_plan(
    work: Workload,
    machine: Machine,
    plans: list[LayoutPlan],
    impossible: list[tuple[str, str]],
    speeds_source: str = "",
) -> None:
    config, model, vocab = work.config, work.config.model, work.vocab_size
    counts = parameter_counts(model, vocab)
    mixture = ""
    if model.moe is not None:
        moe = model.moe
        mixture = (
            f", {counts['active'] / 1e6:,.1f} M active per token; {moe.experts} experts of width "
            f"{model.expert_width()}, top {moe.top_k}, every {moe.every} block(s)"
        )
    heads = f"{model.n_heads} heads" + (f" over {model.kv_heads} key/value heads" if model.family == "llama" else "")
    print(
        f"model: {counts['total'] / 1e6:,.1f} M parameters{mixture} ({model.family} block, d_model {model.d_model}, "
        f"{model.n_layers} layers, {heads}, d_ff {model.d_ff}, vocabulary {vocab:,}), seq_len {config.data.seq_len}, "
        f"batch {config.batch.size} ({config.batch.mode}), {work.precision}, AdamW"
    )
    print(f"machine: {machine.describe()}, {gb(machine.usable_bytes)} GB usable per GPU; GB = 1e9 bytes, per GPU\n")
    print(table(plans))
    if plans[0].step:
        print(f"  step time: docs/plan.md's model, the machine's speeds from {speeds_source}")
    print(f"  activations: {plans[0].memory.activation_formula} ({plans[0].name}; docs/plan.md)")
    if model.moe is not None:
        print(f"  {EXPERTS_COLUMN}: the experts' share of params, grads and optimizer (counted in them)")
    for plan in plans:
        exchanged = [flow for flow in plan.flows if flow.op == "all_to_all"]
        if exchanged:
            sent, messages = sum(f.bytes for f in exchanged), sum(f.messages for f in exchanged)
            print(
                f"  {plan.name}: expert parallelism's all-to-alls send {gb(sent)} GB per step in {messages:,} messages"
            )
    for name, reason in impossible:
        print(f"  {name}: not possible here: {reason}")
    ddp = next((plan for plan in plans if plan.name == "ddp"), None)
    if ddp is not None and not ddp.fits:
        needed = smallest_fsdp(work, machine)
        where = f"FSDP fits over at least {needed} GPUs" if needed else "FSDP alone fits on no number of GPUs"
        print(f"\nDDP does not fit ({gb(ddp.memory.total)} GB per GPU); {where}")
    chosen = next((plan for plan in plans if plan.recommended), None)
    if chosen:
        print(f"\nrecommended: {chosen.name} ({chosen.dims.layout}): {chosen.reason}")


def nothing_fits(work: Workload, machine: Machine, plans: list[LayoutPlan]) -> ConfigError:
    """The error when no layout fits: the best it came to, and the smallest machine of such nodes that would do."""
    best = min(plans, key=lambda plan: plan.memory.total)
    bigger = smallest_machine(work, machine)
    if bigger:
        nodes, plan = bigger
        hint = (
            f"the smallest machine of such nodes that would hold it: {nodes} nodes, with {plan.name} "
            f"({gb(plan.memory.total)} GB per GPU)"
        )
    else:
        hint = "no number of such nodes would: lower batch.micro_size (with accumulation) or data.seq_len"
    return ConfigError(
        f"no layout fits {machine.describe()} ({gb(best.memory.total)} GB per GPU at best ({best.name})); {hint}"
    )


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_finite(args)
    config = load_config(args.config, args.set)
    machine = machine_of(args)
    work = Workload(config, vocab_size_of(args, config.data.prepared_dir), args.device, args.activation_checkpointing)
    speeds = speeds_of(args, work, machine)
    plans, impossible = plan_machine(work, machine, speeds)
    if args.json:
        json.dump([plan.to_dict() for plan in plans], sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print_plan(work, machine, plans, impossible, speeds.source if speeds else "")
    if not any(plan.recommended for plan in plans):
        raise nothing_fits(work, machine, plans)


if __name__ == "__main__":
    main()
