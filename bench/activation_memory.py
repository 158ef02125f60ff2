"""Activation checkpointing's memory on CPU: does the process's peak fall by what the plan predicts?

    python bench/activation_memory.py [--repeats 3] [--json OUT]

A model whose activations dominate (8 blocks, d_model 64, d_ff 2048, 4,096 tokens a step, dropout 0.1) trained 3
steps with `train.activation_checkpointing` none and full, each run in a process of its own, `repeats` times in
turn. Freed host memory goes back to the system (`parallel.host_reuse_below_mb: 1`) in 4 KiB pages (no huge pages),
so the last step's peak is its live peak. Prints the measured and planned saving of each pair and their ratio.

A measured memory figure depends on the allocator and what else runs: this is a measurement, not a test
(tests/test_training.py checks that both modes train the same model and that the plan counts the saving).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from argtypes import count, output_file
from scalelm.data.prefetch import main as prefetch
from scalelm.data.prepare import main as prepare
from scalelm.train.record import read_metrics

SAMPLE = Path(__file__).resolve().parents[1] / "resources" / "wikitext-2-sample"
SETTINGS = {
    "data": {"seq_len": 128},
    "model": {"d_model": 64, "n_heads": 2, "n_layers": 8, "d_ff": 2048, "dropout": 0.1},
    "batch": {"mode": "global", "size": 32},
    "train": {
        "epochs": 1,
        "max_steps": 3,
        "log_every": 1,
        "eval_batch_size": 128,
        "eval_batch_tokens": 1024,
        "monitor_interval_s": 0,
    },
    "checkpoint": {"every": None},
    "parallel": {"host_reuse_below_mb": 1},
}


def train(root: Path, prepared: Path, mode: str, repeat: int) -> tuple[float, float]:
    """The last step's measured peak (MiB) and the plan's activations (MiB) of one run."""
    settings = yaml.safe_load(yaml.safe_dump(SETTINGS))
    settings["data"]["prepared_dir"] = str(prepared)
    settings["train"]["activation_checkpointing"] = mode
    settings["run_dir"] = str(root / f"{mode}{repeat}")
    config = root / f"{mode}{repeat}.yaml"
    config.write_text(yaml.safe_dump(settings))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    subprocess.run(
        [sys.executable, "-m", "scalelm.train", "--config", str(config)], check=True, env=env, capture_output=True
    )
    peak = [r for r in read_metrics(root / f"{mode}{repeat}") if r["kind"] == "train"][-1]["peak_mem_mb"]
    record = json.loads((root / f"{mode}{repeat}" / "run.json").read_text())
    return peak, record["results"]["plan_mb_per_rank"]["activations"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=count(1), default=3)
    parser.add_argument("--json", type=output_file)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        files = ",".join(f"{split}={SAMPLE / f'{split}.txt'}" for split in ("train", "validation", "test"))
        prefetch(["--out", str(root / "raw"), "--files", files])
        prepare(["--raw", str(root / "raw"), "--out", str(root / "prepared"), "--min-freq", "2"])
        for repeat in range(args.repeats):
            (peak_none, plan_none), (peak_full, plan_full) = (
                train(root, root / "prepared", mode, repeat) for mode in ("none", "full")
            )
            saved, planned = peak_none - peak_full, plan_none - plan_full
            rows.append(
                {
                    "peak_none_mb": peak_none,
                    "peak_full_mb": peak_full,
                    "saved_mb": saved,
                    "planned_saving_mb": planned,
                    "ratio": saved / planned,
                }
            )
            print(
                f"repeat {repeat}: peak none {peak_none:.0f} MiB, full {peak_full:.0f} MiB; saved {saved:.0f} "
                f"MiB, planned {planned:.0f} MiB (ratio {saved / planned:.2f})"
            )
    ratios = [r["ratio"] for r in rows]
    print(
        f"measured / planned saving: median {statistics.median(ratios):.2f}, min {min(ratios):.2f}, "
        f"max {max(ratios):.2f}"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
