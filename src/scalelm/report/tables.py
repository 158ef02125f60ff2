"""The report's tables, written one way: numbers as a reader wants them, CSV files, Markdown tables."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"  # 12,345 rather than 1.234e+04
    return "" if value is None else str(value)


def write_csv(path: Path, columns: list[str], rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def markdown_table(columns: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]
