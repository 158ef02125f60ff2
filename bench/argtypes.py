"""The bench scripts' argument types: a bad value is refused by argparse before any work starts, naming the value and
what would do (never a traceback, nor one after minutes of measuring, when the results are written)."""

from __future__ import annotations

import argparse
import difflib
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path


def count(least: int = 1, most: int | None = None) -> Callable[[str], int]:
    """A whole number from `least` to `most`: steps, repeats, seeds."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least or (most is not None and value > most):
            bounds = f"from {least} to {most}" if most is not None else f"at least {least}"
            raise argparse.ArgumentTypeError(f"{value}: give a whole number {bounds}")
        return value

    return parse


def counts(least: int = 1) -> Callable[[str], list[int]]:
    """A comma-separated list of whole numbers of at least `least`, e.g. `--microbatches 2,4,8`."""
    one = count(least)

    def parse(text: str) -> list[int]:
        values = [one(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers separated by commas")
        return values

    return parse


def positive(text: str) -> float:
    """A positive, finite number: seconds of a limit or a budget, a factor."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive number")
    return value


def unknown(name: str, known: Iterable[str], what: str) -> str:
    """`name` is none of `known`: the message naming them, and the closest if one is close."""
    known = list(known)
    close = difflib.get_close_matches(name.lower(), [k.lower() for k in known], n=1)
    guess = next((f" (did you mean {k!r}?)" for k in known if close and k.lower() == close[0]), "")
    return f"unknown {what} {name!r}{guess}; choose from {', '.join(known)}"


def names(known: Iterable[str], what: str) -> Callable[[str], list[str]]:
    """A comma-separated list of some of `known`, e.g. `--models course,m59`."""
    known = list(known)

    def parse(text: str) -> list[str]:
        chosen = [n.strip() for n in text.split(",") if n.strip()]
        if not chosen:
            raise argparse.ArgumentTypeError(f"no {what} given; choose from {', '.join(known)}")
        for name in chosen:
            if name not in known:
                raise argparse.ArgumentTypeError(unknown(name, known, what))
        return chosen

    return parse


def _writable_directory(directory: Path) -> str | None:
    """Why files cannot be made in `directory` (its nearest existing ancestor if it does not exist yet), or None."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"you may not write in {existing}"
    return None


def output_file(text: str) -> Path:
    """A file written when the work is done (`--json`): a directory there, or a place no file can be written, is
    refused now rather than after the measurements; the directories it lies in are made now."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory: give a file path")
    problem = _writable_directory(path.parent)
    if problem:
        raise argparse.ArgumentTypeError(f"{path} cannot be written: {problem}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise argparse.ArgumentTypeError(f"{path} cannot be written: {err}") from None
    return path


def output_dir(text: str) -> Path:
    """A directory the script creates if needed and writes into (`--out`)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a file: give a directory")
    problem = _writable_directory(path)
    if problem:
        raise argparse.ArgumentTypeError(f"{path} cannot be created or written: {problem}")
    return path


def existing_dir(text: str) -> Path:
    """A directory that must already exist (one a script reads, or stages into)."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is not an existing directory")
    return path
