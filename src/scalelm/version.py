"""Which software runs: scalelm's version (scalelm.__version__) and the git commit of its source, the installed
versions of everything it needs, and whether they are those of the lock (uv.lock, exported to requirements/ by
scripts/lock.sh)."""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import scalelm
from scalelm.errors import ConfigError
from scalelm.settings_yaml import shown


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
@dataclass(frozen=True)
class Installed:
    """An installed distribution's version and requirements, from its metadata."""

    version: str
    requires: tuple[str, ...]


@functools.cache
def installed() -> Mapping[str, Installed]:
    """Every installed distribution by its canonical name: one scan of the path, each metadata file parsed once
    (its parse is most of the cost), once per process (what is installed does not change under a running one)."""
    from importlib import metadata

    from packaging.utils import canonicalize_name

    found: dict[str, Installed] = {}
    for distribution in metadata.distributions():
        fields = distribution.metadata
        name = canonicalize_name(fields["Name"] or "")
        if name not in found:  # the first on the path wins, as the import system's
            found[name] = Installed(fields["Version"], tuple(fields.get_all("Requires-Dist") or ()))
    return MappingProxyType(found)  # cached for the process: read-only, so no caller changes it for the others


def installed_closure(root: str = "scalelm", distributions: Mapping[str, Installed] | None = None) -> dict[str, str]:
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
        for line in distributions[name].requires:
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
    for this interpreter and platform. A line that is not an exact pin (a range, no version, not a requirement) is
    refused naming it: a lock that allows several versions cannot say which one a run had."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for number, line in lock_lines(path):
        try:
            requirement = Requirement(line)
        except InvalidRequirement as err:
            raise lock_error(path, number, line, f"is not a requirement ({err})") from None
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        specs = list(requirement.specifier)
        if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
            raise lock_error(path, number, line, "is not an exact pin (name==version)")
        pins[canonicalize_name(requirement.name)] = specs[0].version
    return pins


def lock_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, requirement) of each requirement in a lock export: its continuations joined, options (--hash,
    -e, -r) and comments left out."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"the lock file {path} cannot be read ({err}); point SCALELM_LOCK at a lock "
            "export (scripts/lock.sh: requirements/*.txt) or unset it"
        ) from None
    found, start, joined = [], 1, ""
    for number, raw in enumerate([*text.splitlines(), ""], 1):  # "": the end of a last line continued
        joined += raw.removesuffix("\\") + " "
        if raw.endswith("\\"):
            continue
        line = joined.split("--hash")[0].split("#")[0].strip()
        if line and not line.startswith("-"):
            found.append((start, line))
        start, joined = number + 1, ""
    return found


def lock_error(path: Path, number: int, line: str, problem: str) -> ConfigError:
    return ConfigError(
        f"the lock file {path}, line {number}: {shown(line)} {problem}; a lock holds exact pins, as "
        "scripts/lock.sh exports them (requirements/*.txt): point SCALELM_LOCK at one, or unset it"
    )


def check_lock() -> None:
    """Refuse a lock file run.json could not compare the environment with: called before a run's directory is
    touched, so that the error comes first rather than after the run has started."""
    path = lock_file()
    if path is not None and path.is_file():
        read_lock(path)


def lock_facts(distributions: Mapping[str, Installed] | None = None) -> dict[str, Any] | None:
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
