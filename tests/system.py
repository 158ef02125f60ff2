"""Tiers that need real system services (a Slurm cluster, an Apptainer runtime) brought up by scripts/.

Under CI they must run: a missing prerequisite fails the test. Elsewhere they skip, saying why.
"""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_root(tier: str) -> None:
    if os.geteuid() == 0:
        return
    message = f"the {tier} tier needs root to install and start its services (scripts/{tier}/)"
    if in_ci():
        pytest.fail(message + "; CI must run it")
    pytest.skip(message)
