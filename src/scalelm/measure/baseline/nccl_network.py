"""The network NCCL chose, read from NCCL's INFO log of its start, which the baseline forces over the site's
NCCL_DEBUG for its own run and restores afterwards."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

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
