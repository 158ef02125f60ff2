"""scalelm's files: written whole or not at all, never in place of what is not theirs, checksummed, and read back
without ever running code from them.

What is not an output's own is never replaced: a file never replaces a directory (nor a directory a file), a
directory replaces only a directory that holds scalelm's marker for it (`check_replaceable`), and no output is, holds
or lies inside an input of its command (`check_apart`). `<name>.partial` is scalelm's name for a file or directory
being written: it is removed when writing starts (`check_file_output` refuses a directory there) and when
writing fails."""

from __future__ import annotations

import enum
import errno
import hashlib
import os
import pickle
import shutil
from collections.abc import Callable, Iterator
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


class OutputError(ScaleLMError):
    pass


def remove(path: Path) -> None:
    """Remove a file or a directory tree, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def is_directory(path: Path) -> bool:
    """A directory itself: a symbolic link (even to a directory) is replaced as a link, never followed."""
    return path.is_dir() and not path.is_symlink()


def partial_of(final: str | Path) -> Path:
    """Where `final` is written before it is complete: a reader never takes `<name>.partial` for the real thing."""
    final = Path(final)
    return final.with_name(final.name + ".partial")


def publish(partial: Path, final: Path) -> None:
    """Put a completely written `partial` (file or directory) in place of `final`, replacing what was there: only
    its own kind, as a file in place of a directory (or a directory in place of a file) is someone else's."""
    if is_directory(final) and not is_directory(partial):
        raise OutputError(file_over_directory(final))
    if final.exists() and is_directory(partial) and not is_directory(final):
        raise OutputError(
            f"{final} is a file: writing a directory in its place would delete it; choose a directory path"
        )
    remove(final)
    partial.rename(final)


@contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """A fresh `<final>.partial` (file or directory) to write; it becomes `final` only if the block completes, and
    goes if it does not (or if `final` may not be replaced by it)."""
    final = Path(final)
    partial = partial_of(final)
    remove(partial)
    try:
        yield partial
        publish(partial, final)
    except BaseException:
        remove(partial)
        raise


def file_over_directory(path: Path) -> str:
    return f"{path} is a directory: writing a file in its place would delete it; choose a file path"


def check_file_output(path: str | Path) -> None:
    """`path` is about to be written whole as a file: refuse a directory there, or at its `<path>.partial` (a file
    writer never leaves a directory there, so that one is not scalelm's). Call it before the work, not only after."""
    path = Path(path)
    if is_directory(path):
        raise OutputError(file_over_directory(path))
    if is_directory(partial_of(path)):
        raise OutputError(
            f"{partial_of(path)} is a directory, not a file scalelm left: it writes {path} there first and would "
            "delete it; move it, or choose another file path"
        )


def check_apart(out: str | Path, inputs: dict[str, Path], option: str = "--out") -> None:
    """Refuse an output (given as `option`) that is one of the command's `inputs` (named as the user knows them:
    '--data'), holds one, or lies inside one: writing it would replace, delete or change what the command reads."""
    target = Path(out).resolve()
    for name, path in inputs.items():
        source = Path(path).resolve()
        if target == source:
            problem = f"is {name} {path}: writing it would replace it"
        elif source in target.parents:
            problem = f"lies inside {name} {path}: writing it would change it"
        elif target in source.parents:
            problem = f"holds {name} {path}: writing it would delete it"
        else:
            continue
        raise OutputError(f"{option} {out} {problem}; choose another {option}")


def check_replaceable(path: Path, marker: str, what: str) -> None:
    """`path` is about to be replaced whole: refuse unless it is absent, empty, or holds `marker` (scalelm's own)."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise OutputError(f"{path} exists and is not a directory; choose another directory for {what}")
    if path.is_dir() and any(path.iterdir()) and not (path / marker).is_file():
        raise OutputError(
            f"{path} is a directory with files and no {marker}: it does not hold {what} scalelm wrote, and writing "
            "them would delete it; empty it, or choose another directory"
        )


def atomic_write_text(path: str | Path, text: str) -> None:
    check_file_output(path)
    with atomic_path(path) as partial:
        partial.write_text(text, encoding="utf-8")


def append_text(path: str | Path, text: str) -> None:
    """Append to a file, never through a symbolic link (O_NOFOLLOW): a link planted in a run directory would
    otherwise have its target written."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UnsafeFileError(
                f"{path} is a symbolic link: scalelm does not write through links; remove it"
            ) from None
        raise
    with os.fdopen(fd, "a", encoding="utf-8") as handle:
        handle.write(text)


class NoSpaceError(ScaleLMError):
    pass


@contextmanager
def disk_errors(where: str | Path) -> Iterator[None]:
    """A full disk or quota as one clear error naming the directory: torch's writers report it only as a short write
    ('unexpected pos', 'file write failed'), and DCP wraps every rank's error in a CheckpointException."""
    try:
        yield
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NoSpaceError(no_space_message(where)) from err
        raise
    except BaseException as err:  # RuntimeError from torch.save; DCP's CheckpointException is a BaseException
        text = str(err)
        short_write = "unexpected pos" in text or "file write failed" in text  # a full disk or quota, in practice
        if "No space left" in text or "Disk quota" in text or short_write:
            raise NoSpaceError(no_space_message(where)) from err
        raise


def no_space_message(where: str | Path) -> str:
    return (
        f"no space left on device (or quota exceeded) writing {where}: free space there or write elsewhere, then "
        "run again; complete checkpoints written before are kept and the run resumes from the last"
    )


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, handle, allowed: Callable[[str, str], bool]):
        super().__init__(handle)
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):  # how Python pickles an enum member, by name
            return self._member
        if not self.allowed(module, name):
            raise pickle.UnpicklingError(f"{module}.{name} is not among the classes this file may hold")
        return super().find_class(module, name)

    def _member(self, cls: Any, name: str) -> Any:
        """getattr restricted to a member of an allowed enum: a general getattr reaches any method of any class."""
        if not (
            isinstance(cls, type) and issubclass(cls, enum.Enum) and self.allowed(cls.__module__, cls.__qualname__)
        ):
            raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not a member of an allowed enum")
        if name not in cls.__members__:
            raise pickle.UnpicklingError(f"{cls.__qualname__} has no member {name!r}")
        return cls[name]

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent references are not allowed")


def load_pickle(path: Path, allowed: Callable[[str, str], bool]) -> Any:
    """Unpickle a file that may name only the globals `allowed(module, name)` admits: a pickle that calls anything
    else (which is how a pickle runs code) is refused, with the file named, before the call."""
    try:
        with Path(path).open("rb") as handle:
            return _AllowListUnpickler(handle, allowed).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as err:
        raise UnsafeFileError(
            f"{path} is damaged or holds more than it may and was not loaded, as loading it could run code "
            f"({type(err).__name__}: {err}); use a file written by scalelm, or regenerate it"
        ) from err


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
