"""`scalelm COMMAND [ARGS]`: one command for every step of the flow, each the module it names (`python -m MODULE
ARGS` works the same, and is what the workflow's rules and torchrun call).

    scalelm prepare --raw data/raw --out data/prepared
    scalelm plan --config config/train.yaml --nodes 2 --gpus-per-node 4 --gpu-memory-gb 80
    scalelm train --config config/train.yaml --set train.max_steps=100
    scalelm COMMAND --help
"""

from __future__ import annotations

import difflib
import importlib
import sys

# name -> (module with main(argv), what it does); in the order of the flow
COMMANDS = {
    "prefetch": ("scalelm.data.prefetch", "fetch WikiText-2 (the only network access: the login node)"),
    "prepare": ("scalelm.data.prepare", "the vocabulary and token ids, once"),
    "slice": ("scalelm.data.slice", "prepared data cut to the first tokens of each split"),
    "plan": ("scalelm.plan.__main__", "per-GPU memory and traffic of each layout on a machine, and the one to choose"),
    "container": ("scalelm.launch.container", "build or pull the Apptainer image"),
    "launch": ("scalelm.launch.launcher", "start a training with torchrun: standalone, in a Slurm job, in the image"),
    "train": ("scalelm.train.run", "train one process of a run (what torchrun starts)"),
    "monitor": ("scalelm.measure.sampler", "sample a node's CPU, memory and GPUs during a run"),
    "selftest": ("scalelm.selftest", "a tiny CPU training: check an installation in seconds"),
    "consolidate": ("scalelm.train.consolidate", "a run's final checkpoint as one state dict"),
    "evaluate": ("scalelm.train.evaluation", "the test loss of a consolidated model"),
    "hf-llama": ("scalelm.train.hf_llama", "a consolidated llama model as Hugging Face's LlamaForCausalLM"),
    "preflight": ("scalelm.study.preflight", "compare the wiring check's losses with one process's"),
    "aggregate": ("scalelm.report.aggregate", "the summary tables, figures and report of a study"),
    "expectations": ("scalelm.report.expectations", "check a summary against its `expect:` values"),
    "history": ("scalelm.report.history", "the results history: list studies, compare two, export and import"),
}
# commands that may hold a process group: the process ends at once after them (scalelm.parallel.env.exit_after)
ENDS_PROCESS = {"train"}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "usage: scalelm COMMAND [ARGS]   (scalelm COMMAND --help)\n\ncommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if argv else 2)
    name, args = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        sys.exit(f"error: scalelm: unknown command {name!r}{hint}\n{usage()}")
    command = importlib.import_module(COMMANDS[name][0]).main
    if name in ENDS_PROCESS:
        from scalelm.parallel.env import exit_after

        exit_after(lambda: command(args))
    command(args)


if __name__ == "__main__":
    main()
