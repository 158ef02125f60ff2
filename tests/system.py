"""Tiers that need real system services (a Slurm cluster, an Apptainer runtime) brought up by the test machine's
harness in .ci/ (.ci/slurm, .ci/apptainer).

Under CI they must run: a missing prerequisite fails the test. Elsewhere they skip, saying why.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[1] / ".ci"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_root(tier: str) -> None:
    if os.geteuid() == 0:
        return
    message = f"the {tier} tier needs root to install and start its services (.ci/{tier}/)"
    if in_ci():
        pytest.fail(message + "; CI must run it")
    pytest.skip(message)


def run_script(tier: str, name: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """.ci/<tier>/<name>; a failure fails the test with the script's output."""
    result = subprocess.run(
        ["bash", str(HARNESS / tier / name), *args], capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise AssertionError(f".ci/{tier}/{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result
