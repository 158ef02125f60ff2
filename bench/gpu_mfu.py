"""What lifts gpt2_small's MFU on one GPU: the experiment of config/config.yaml trained through the CLI in a few
variants (batch size, inductor's tuning switches), one after the other, each run's steady tokens/s and MFU printed
as bench/gpu_smoke_report.py measures them, and OUTDIR/mfu.json.

    PYTHONPATH=src:. python3 bench/gpu_mfu.py OUTDIR [--cpu] [--only NAME ...]

--cpu: a tiny model for a dry run of the script itself (the GPU-only variants left out). Each variant runs under its
own time limit (inductor's autotuning compiles for minutes), so a slow one costs its own figure only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from bench.argtypes import count, output_dir, positive
from bench.gpu_smoke_report import describe, steady
from bench.throughput import make_prepared

# name: (settings, environment); the first is the experiment as configured, each other one lever changed from it
# (docs/benchmarks.md names each lever's expected gain)
VARIANTS = {
    "configured": ([], {}),
    "cudnn_attention": (["train.attention_kernels=auto"], {}),
    "bf16_params": (["train.precision=bf16_params"], {}),
    "compiled_optimizer": (["train.compile_optimizer=true"], {}),
    "batch16": (["batch.size=16"], {}),
    "coordinate_descent": ([], {"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1"}),
    "max_autotune": (["train.compile_mode=max-autotune-no-cudagraphs"], {}),
}
GPU_ONLY = {"bf16_params", "max_autotune"}  # refused on a CPU: bf16 there, and a compile mode without compile
TINY = ["device=cpu", "train.precision=fp32", "model.d_model=64", "model.n_heads=2", "model.n_layers=1",
        "model.d_ff=128", "batch.size=4", "data.seq_len=32", "train.compile=false"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=output_dir)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--steps", type=count(6), default=60)  # logged 6 times
    parser.add_argument("--timeout", type=positive, default=240.0, help="seconds per variant")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    make_prepared(args.out / "prepared")
    config = yaml.safe_load(Path("config/config.yaml").read_text())["experiments"]["gpt2_small"]["training"]
    (args.out / "gpt2_small.yaml").write_text(yaml.safe_dump(config))
    device = TINY if args.cpu else ["device=cuda"]
    results = {}
    for name in args.only:
        if args.cpu and name in GPU_ONLY:
            continue
        settings, environment = VARIANTS[name]
        run = args.out / "runs" / name
        command = [sys.executable, "-m", "scalelm.train", "--config", str(args.out / "gpt2_small.yaml")]
        for setting in [
            f"run_dir={run}", f"data.prepared_dir={args.out / 'prepared'}", f"train.max_steps={args.steps}",
            f"train.log_every={args.steps // 6}", "train.comm_profile_steps=0", "checkpoint.every=null",
            *device, *settings,
        ]:  # fmt: skip
            command += ["--set", setting]
        with (args.out / f"{name}.log").open("w") as log:
            try:
                code = subprocess.run(
                    command, stdout=log, stderr=subprocess.STDOUT, env=os.environ | environment, timeout=args.timeout
                ).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        if code == 0:
            figures = steady(run)
            results[name] = {k: figures[k] for k in ("tokens_per_s", "step_time_s", "mfu", "peak_mem_mb", "data_share")}
            print(f"{name:<20} {describe(figures)}", flush=True)
        else:
            results[name] = {"exit": code}
            print(f"{name:<20} exit {code} (see {name}.log)", flush=True)
    (args.out / "mfu.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all("exit" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
