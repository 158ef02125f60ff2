"""Which software runs: scalelm's version (scalelm.__version__) and the git commit of its source, the installed
versions of everything it needs, and whether they are those of the lock (uv.lock, exported to requirements/ by
scripts/lock.sh)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

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


# ------------------------------------------------------------------------------ the software around it, and the lock
def installed() -> dict[str, Any]:
    """Every installed distribution by its canonical name (one scan of the path, not one per name)."""
    from importlib import metadata

    from packaging.utils import canonicalize_name

    found: dict[str, Any] = {}
    for distribution in metadata.distributions():
        found.setdefault(canonicalize_name(distribution.metadata["Name"] or ""), distribution)  # the first wins
    return found


def installed_closure(root: str = "scalelm", distributions: dict[str, Any] | None = None) -> dict[str, str]:
    """The installed version of every distribution `root` needs to run, its dependencies' dependencies included
    (torch's CUDA libraries too): what a run's figures may depend on besides the settings. Extras are left out."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    distributions = installed() if distributions is None else distributions
    found: dict[str, str] = {}
    pending = [root]
    while pending:
        name = canonicalize_name(pending.pop())
        if name in found or name not in distributions:
            continue
        found[name] = distributions[name].version
        for line in distributions[name].requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return dict(sorted(found.items()))


def lock_file() -> Path | None:
    """The lock export this environment was installed from: SCALELM_LOCK (the image's), else the source checkout's
    requirements/dev.txt (scripts/setup.sh's), else None (an installation of the site's own)."""
    if os.environ.get("SCALELM_LOCK"):
        return Path(os.environ["SCALELM_LOCK"])
    checkout = Path(scalelm.__file__).resolve().parents[2] / "requirements" / "dev.txt"
    return checkout if checkout.is_file() else None


def read_lock(path: Path) -> dict[str, str]:
    """name -> version of a lock export (pip's requirements format, `name==version ; marker` with --hash options),
    for this interpreter and platform."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for line in path.read_text().replace("\\\n", " ").splitlines():
        line = line.split("--hash")[0].split("#")[0].strip()
        if not line or line.startswith("-"):
            continue
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        (spec,) = requirement.specifier
        pins[canonicalize_name(requirement.name)] = spec.version
    return pins


def lock_facts(distributions: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The lock export's path and checksum, and every pin the environment does not hold: {name: [locked, installed
    or None]} (empty when it matches)."""
    from scalelm.files import sha256

    path = lock_file()
    if path is None or not path.is_file():
        return None
    distributions = installed() if distributions is None else distributions
    differs = {}
    for name, version in read_lock(path).items():
        held = distributions[name].version if name in distributions else None
        if held != version:
            differs[name] = [version, held]
    return {"file": str(path), "sha256": sha256(path), "differs": differs}
