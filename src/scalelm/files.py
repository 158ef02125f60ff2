"""scalelm's files: written whole or not at all, checksummed, and read back without ever running code from them."""

from __future__ import annotations

import hashlib
import pickle
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from scalelm.errors import ScaleLMError


class UnsafeFileError(ScaleLMError):
    pass


def sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def remove(path: Path) -> None:
    """Remove a file or a directory tree, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def partial_of(final: str | Path) -> Path:
    """Where `final` is written before it is complete: a reader never takes `<name>.partial` for the real thing."""
    final = Path(final)
    return final.with_name(final.name + ".partial")


def publish(partial: Path, final: Path) -> None:
    """Put a completely written `partial` (file or directory) in place of `final`, replacing what was there."""
    remove(final)
    partial.rename(final)


@contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """A fresh `<final>.partial` (file or directory) to write; it becomes `final` only if the block completes."""
    final = Path(final)
    partial = partial_of(final)
    remove(partial)
    try:
        yield partial
    except BaseException:
        remove(partial)
        raise
    publish(partial, final)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as partial:
        partial.write_text(text, encoding="utf-8")


def load_tensors(path: Path, **kwargs: Any) -> Any:
    """torch.load with weights_only=True (tensors, containers and plain values only); a file that holds anything
    else (a pickled object could run code when loaded) is refused with the file named."""
    import torch  # late: the settings and the workflow's parsing use this module without torch

    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise UnsafeFileError(
            f"{path} holds more than tensors and plain values and was not loaded, as loading it could run code "
            f"({reason}); use a file written by scalelm, or regenerate it"
        ) from err
