"""Data staging, the course's advice for I/O: before training, copy the prepared data from the shared file system
to memory (`/dev/shm`, `data.stage: shm`) or to node-local disk (`local`: `data.stage_dir`, else $TMPDIR, else
/tmp), train from the copy, and remove it at the end.

One process per node (local rank 0) copies and checks every file against the manifest's checksums while the node's
others wait; any node's failure (no room, a damaged copy) stops every rank with its message before training. The
copy is removed when the training ends, however it ends (finished, stopped by a signal, failed); a process killed
outright leaves it behind, and the next attempt replaces it. The time it took is kept apart from the training time
(MLPerf HPC's convention): `staging` in run.json, `staging_s` in the summary.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalelm.data.manifest import FILES, MANIFEST, read_manifest, recorded_checksums
from scalelm.errors import DataError, ScaleLMError
from scalelm.files import atomic_path, check_replaceable, partial_of, remove, sha256
from scalelm.parallel.env import DistEnv, all_gather_object

SHM = Path("/dev/shm")
ROOM_MARGIN = 1.1  # free space asked for beyond the data's size


@dataclass(frozen=True)
class Staged:
    """Where the training reads its data from, and what staging cost (the slowest node's seconds)."""

    path: Path
    mode: str = "none"
    seconds: float = 0.0
    bytes: int = 0

    def record(self) -> dict[str, Any] | None:
        if self.mode == "none":
            return None
        return {"mode": self.mode, "dir": str(self.path), "seconds": self.seconds, "bytes": self.bytes}


def stage_root(mode: str, stage_dir: str | None) -> Path:
    if mode == "shm":
        return Path(stage_dir) if stage_dir else SHM
    return Path(stage_dir or os.environ.get("TMPDIR") or "/tmp")


def expected_files(source: Path) -> dict[str, str | None]:
    """The prepared directory's files and the sha256 its manifest records for each (None: the manifest itself)."""
    recorded = recorded_checksums(read_manifest(source))
    return {MANIFEST: None, **{FILES[name]: digest for name, digest in recorded.items()}}


def copy_checked(source: Path, target: Path) -> int:
    """Copy the prepared data to `target` (replacing a copy an earlier attempt left, never anything else), each file
    checked against the manifest; the bytes copied. Refused before anything is copied where the file system lacks
    room; a copy that fails leaves no `.partial` behind."""
    files = expected_files(source)
    size = sum(source_size(source, name) for name in files)
    if target.parent.exists() and not target.parent.is_dir():
        raise DataError(f"data staging: {target.parent} is not a directory; set data.stage_dir to a directory")
    check_replaceable(target, MANIFEST, "a staged copy of the prepared data")
    for stale in (target, partial_of(target)):  # what a killed attempt left, gone before its room is counted
        remove(stale)
    target.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(target.parent).free
    if free < size * ROOM_MARGIN:
        raise DataError(
            f"data staging: {target.parent} has {free / 2**20:,.1f} MiB free, the prepared data needs "
            f"{size / 2**20:,.1f} MiB (and 10% to spare); free space there, set data.stage_dir to a larger file "
            "system, or set data.stage: none"
        )
    with atomic_path(target) as partial:
        partial.mkdir()
        for name, digest in files.items():  # the manifest first: a copy cut short is still recognisably scalelm's
            shutil.copyfile(source / name, partial / name)
            if digest is not None and sha256(partial / name) != digest:
                raise DataError(mismatch(source, name, digest, partial))
    return size


def source_size(source: Path, name: str) -> int:
    try:
        return (source / name).stat().st_size
    except FileNotFoundError:
        raise DataError(
            f"prepared data at {source} is incomplete: {source / name} is missing; run the prepare step again"
        ) from None


def mismatch(source: Path, name: str, digest: str, partial: Path) -> str:
    """Whose fault a copy that does not match the manifest is: the source's, if it does not match either (read a
    second time only then), else the stage directory's."""
    if sha256(source / name) != digest:
        return (
            f"{source / name} does not match the checksum in {source / MANIFEST} (truncated or changed since it was "
            "prepared); run the prepare step again"
        )
    return (
        f"data staging: the copy of {source / name} in {partial} does not match the manifest's checksum "
        f"(a full or failing {partial.parent}?); set data.stage_dir elsewhere or data.stage: none"
    )


@contextlib.contextmanager
def staged(source: str | Path, mode: str, stage_dir: str | None, env: DistEnv, run_dir: str) -> Iterator[Staged]:
    """The prepared data at `source`, staged as `mode` asks (a collective: every rank enters it together)."""
    source = Path(source)
    if mode == "none":
        yield Staged(source)
        return
    job = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]  # one copy per run and node
    target = stage_root(mode, stage_dir) / f"scalelm-{job}-node{env.node_rank}"
    began, copied, failure = time.perf_counter(), 0, None
    if env.local_rank == 0:
        try:
            copied = copy_checked(source, target)
        except (OSError, ScaleLMError) as err:
            failure = str(err) if isinstance(err, ScaleLMError) else f"data staging to {target} failed: {err}"
    outcomes = all_gather_object((failure, time.perf_counter() - began, copied))  # the node's others wait here
    try:
        failures = [f for f, _, _ in outcomes if f]
        if failures:
            raise DataError(failures[0])
        yield Staged(target, mode, max(s for _, s, _ in outcomes), max(b for _, _, b in outcomes))
    finally:
        if env.local_rank == 0 and failure is None:  # the copy is ours; the others may still map its files: Linux
            shutil.rmtree(target, ignore_errors=True)  # keeps them until they unmap
