"""Reading scalelm's tensor files (checkpoints, models, prepared data) without ever running code from them."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from scalelm.errors import ScaleLMError


class UnsafeFileError(ScaleLMError):
    pass


def load_tensors(path: Path, **kwargs: Any) -> Any:
    """torch.load with weights_only=True (tensors, containers and plain values only); a file that holds anything
    else (a pickled object could run code when loaded) is refused with the file named."""
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise UnsafeFileError(
            f"{path} holds more than tensors and plain values and was not loaded, as loading it could run code "
            f"({reason}); use a file written by scalelm, or regenerate it"
        ) from err
