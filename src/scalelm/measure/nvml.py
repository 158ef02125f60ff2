"""NVML, opened one way for its four readers (the machine baseline's health, the energy counter, the monitor's sampler,
a run's driver version): the binding, nvidia-ml-py, imported only where a GPU is read, and a GPU's handle by its NVML
UUID or index."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def binding() -> Any:
    """nvidia-ml-py's `pynvml`, initialised (NVML counts its initialisations: each reader may call this); raises where
    the library or the driver is missing."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def handle(device: str) -> tuple[Any, Any]:
    """The binding and the handle of the GPU named by its NVML UUID ("GPU-...", "MIG-...") or its NVML index."""
    nvml = binding()
    found = nvml.nvmlDeviceGetHandleByIndex(int(device)) if device.isdigit() else nvml.nvmlDeviceGetHandleByUUID(device)
    return nvml, found


def read(query: Callable[[], Any]) -> Any:
    """A query's answer, or None where the GPU or the binding does not answer it (NotSupported on a MIG slice, a
    binding without the call): a fact missing, not a failed measurement."""
    try:
        return query()
    except Exception:
        return None
