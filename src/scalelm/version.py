"""Which scalelm runs: the package's version (scalelm.__version__) and the git commit of its source."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import scalelm


def git_commit() -> str | None:
    """The commit of the source tree scalelm runs from; inside the image (no .git) the one it was built from."""
    if os.environ.get("SCALELM_GIT_COMMIT"):  # the image's, "unknown" when it was built without one
        return None if os.environ["SCALELM_GIT_COMMIT"] == "unknown" else os.environ["SCALELM_GIT_COMMIT"]
    source = Path(scalelm.__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None
