"""Plan a training's layout before anything is queued: per-GPU memory and per-step communication of every layout
the machine can hold, whether each fits, and which to choose.

    python -m scalelm.plan --config FILE [--set KEY=VALUE ...] [--vocab-size V] --nodes N --gpus-per-node G
        --gpu-memory-gb M [--site profiles/slurm/site.yaml] [--activation-checkpointing] [--json]

The vocabulary size comes from the prepared data (data.prepared_dir) unless given. The machine comes from the flags,
or for what they leave out from the site file (gpus_per_node, gpu_memory_gb). Exit status 2, with the reason, when
no layout fits (naming the smallest machine that would do) or the config's own layout cannot run on the machine.
"""

from __future__ import annotations

import argparse
import json
import sys

from scalelm.config import load_config
from scalelm.data.manifest import read_manifest
from scalelm.errors import ConfigError, DataError, friendly_errors
from scalelm.model.architecture import parameters
from scalelm.plan.comm import INTER, INTRA, totals
from scalelm.plan.layouts import LayoutPlan, Machine, gb, plan_machine, smallest_fsdp, smallest_machine
from scalelm.plan.memory import PARTS, Workload
from scalelm.site import load_site


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scalelm.plan", description=__doc__.split("\n\n")[0])
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
        "--activation-checkpointing", nargs="?", const="full", choices=("none", "full", "selective"),
        help="full (the default of the bare flag): blocks keep only their inputs; selective: their products' outputs "
        "too; default: the config's train.activation_checkpointing",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="a JSON list of the layouts instead of a table")
    return parser.parse_args(argv)


def machine_of(args: argparse.Namespace) -> Machine:
    site = load_site(args.site)
    gpus = args.gpus_per_node or site.gpus_per_node
    memory = args.gpu_memory_gb or site.gpu_memory_gb
    if not gpus:
        raise ConfigError("the machine's GPUs per node are unknown: pass --gpus-per-node, or --site with gpus_per_node")
    if not memory:
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


def table(plans: list[LayoutPlan]) -> str:
    head = ["layout", "strategy", "degrees", *PARTS, "total", "fits", f"{INTRA} GB/step", f"{INTER} GB/step"]
    rows = []
    for plan in plans:
        traffic = totals(plan.flows)
        rows.append([
            plan.name + (" *" if plan.recommended else ""), plan.strategy or "-", plan.dims.layout,
            *(gb(plan.memory.bytes[part]) for part in PARTS), gb(plan.memory.total), "yes" if plan.fits else "no",
            gb(traffic[INTRA]), gb(traffic[INTER]),
        ])  # fmt: skip
    widths = [max(len(str(row[i])) for row in [head, *rows]) for i in range(len(head))]

    def line(row: list) -> str:  # names left-aligned, figures right-aligned
        return "  ".join(str(c).ljust(w) if i < 3 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([line(head), *(line(row) for row in rows)])


def print_plan(work: Workload, machine: Machine, plans: list[LayoutPlan], impossible: list[tuple[str, str]]) -> None:
    config, model, vocab = work.config, work.config.model, work.vocab_size
    count = sum(t.numel() for t in parameters(model, vocab))
    print(
        f"model: {count / 1e6:,.1f} M parameters (d_model {model.d_model}, {model.n_layers} layers, "
        f"{model.n_heads} heads, d_ff {model.d_ff}, vocabulary {vocab:,}), seq_len {config.data.seq_len}, "
        f"batch {config.batch.size} ({config.batch.mode}), {work.precision}, AdamW"
    )
    print(f"machine: {machine.describe()}, {gb(machine.usable_bytes)} GB usable per GPU; GB = 1e9 bytes, per GPU\n")
    print(table(plans))
    print(f"  activations: {plans[0].memory.activation_formula} ({plans[0].name}; docs/plan.md)")
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
        hint = (f"the smallest machine of such nodes that would hold it: {nodes} nodes, with {plan.name} "
                f"({gb(plan.memory.total)} GB per GPU)")  # fmt: skip
    else:
        hint = "no number of such nodes would: lower batch.micro_size (with accumulation) or data.seq_len"
    return ConfigError(
        f"no layout fits {machine.describe()} ({gb(best.memory.total)} GB per GPU at best ({best.name})); {hint}"
    )


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = load_config(args.config, args.set)
    machine = machine_of(args)
    work = Workload(config, vocab_size_of(args, config.data.prepared_dir), args.device, args.activation_checkpointing)
    plans, impossible = plan_machine(work, machine)
    if args.json:
        json.dump([plan.to_dict() for plan in plans], sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print_plan(work, machine, plans, impossible)
    if not any(plan.recommended for plan in plans):
        raise nothing_fits(work, machine, plans)


if __name__ == "__main__":
    main()
