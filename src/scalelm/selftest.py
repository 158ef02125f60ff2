"""A tiny CPU training from a synthetic corpus: checks an installation (the image's %test) in seconds.

python -m scalelm.selftest
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch

from scalelm.config import from_dict
from scalelm.data.prepared import SPLITS, write_prepared
from scalelm.train.run import run


def write_corpus(path: Path, vocab_size: int = 64) -> None:
    """A repetitive token stream (a learnable pattern), in the layout `scalelm.data.prepare` writes."""
    path.mkdir(parents=True)
    pattern = torch.arange(2, vocab_size, dtype=torch.int32)
    tokens = {split: pattern.repeat(repeats) for split, repeats in zip(SPLITS, (40, 4, 4))}
    write_prepared(path, tokens, ["<unk>", "<eos>", *map(str, range(2, vocab_size))], {"selftest": "pattern"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalelm.selftest", description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        write_corpus(Path(tmp) / "prepared")
        config = from_dict(
            {
                "run_dir": f"{tmp}/run",
                "device": "cpu",
                "data": {"prepared_dir": f"{tmp}/prepared", "seq_len": 16},
                "model": {"d_model": 32, "n_heads": 2, "n_layers": 1, "d_ff": 64, "dropout": 0.0},
                "batch": {"size": 8},
                "train": {"epochs": 1, "max_steps": 20, "log_every": 10},
                "checkpoint": {"every": None},
            }
        )
        record = run(config)
    loss = record.results.final_train_loss
    if not math.isfinite(loss) or loss > math.log(64):
        raise SystemExit(f"selftest failed: final train loss {loss} (a learnable pattern should fall below log(64))")
    print(f"selftest passed: torch {torch.__version__}, final train loss {loss:.3f}")


if __name__ == "__main__":
    main()
