"""Metrics: one JSON object per line in the run's metrics.jsonl, and readable progress lines, on rank 0 only."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from scalelm.files import append_text, atomic_write_text
from scalelm.train.record import metrics_lines


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics line's numbers as tagged scalars: train/loss, validation/perplexity, ..."""
    group = record["kind"] if record["kind"] == "train" else record.get("split", record["kind"])
    return {
        f"{group}/{key}": value
        for key, value in record.items()
        if key not in ("time", "step", "epoch") and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


class MetricsLogger:
    """metrics.jsonl, the progress line, TensorBoard event files (`tensorboard --logdir results/runs`) and, where
    asked for, an offline Weights & Biases run (scalelm.train.wandb_offline)."""

    def __init__(
        self,
        path: Path,
        enabled: bool,
        resume_step: int | None = None,
        board_dir: Path | None = None,
        wandb=None,
        evaluations_redone: bool = False,
    ):
        """`resume_step`: the step training goes on from (0 for a run starting afresh), whose evaluations are kept
        unless `evaluations_redone` (a run resumed at its end evaluates it again)."""
        self.path = Path(path)
        self.enabled = enabled
        self.start = time.time()
        self.board = None
        self.wandb = wandb if enabled else None
        if enabled and resume_step is not None:
            self._truncate_after(resume_step, evaluations_redone)
        if enabled and board_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only where it writes

            # a resumed run redoes the steps after its checkpoint: TensorBoard drops their old events
            self.board = SummaryWriter(str(board_dir), purge_step=None if resume_step is None else resume_step + 1)

    def _truncate_after(self, step: int, evaluations_redone: bool) -> None:
        """On resume, drop the records of what will be redone: the steps the restored checkpoint has not seen, and a
        torn last line (a write cut short)."""
        if not self.path.is_file():
            return
        lines, torn = metrics_lines(self.path)
        if torn:
            print(f"dropped the incomplete last line of {self.path} (a write cut short, as on a full disk)", flush=True)

        def redone(record: dict[str, Any]) -> bool:
            evaluation_redone = evaluations_redone and record.get("kind") == "eval"
            return record["step"] > step or (record["step"] == step and evaluation_redone)

        atomic_write_text(self.path, "".join(line.text + "\n" for line in lines if not redone(line.record)))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time() - self.start, 3), **record}
        append_text(self.path, json.dumps(record) + "\n")
        if self.board is not None:
            for tag, value in scalars(record).items():
                self.board.add_scalar(tag, value, record["step"])
            self.board.flush()  # readable while training runs, and complete if the job is killed
        if self.wandb is not None:
            self.wandb.log(scalars(record), record["step"])
        print(progress_line(record), flush=True, file=sys.stdout)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
        if self.wandb is not None:
            self.wandb.close()


def progress_line(record: dict[str, Any]) -> str:
    if record["kind"] == "train":
        return (
            f"step {record['step']:>7} | epoch {record['epoch']} | loss {record['loss']:.4f} | "
            f"lr {record['lr']:.2e} | grad norm {record['grad_norm']:.3f} | "
            f"{record['tokens_per_s']:,.0f} tok/s ({record['tokens_per_s_per_device']:,.0f}/device) | "
            f"{record['step_time_s'] * 1000:.0f} ms/step | mem {record['peak_mem_mb']:,.0f} MB"
        )
    return (
        f"step {record['step']:>7} | {record['split']} loss {record['loss']:.4f} | "
        f"ppl {record['perplexity']:.2f} | {record['tokens']:,} tokens"
    )


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf
