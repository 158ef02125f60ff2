"""Host memory: keep what a CPU training step frees for the next step instead of giving it back to the kernel."""

from __future__ import annotations

import ctypes
import platform
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
REUSE_BELOW = 1 << 30  # allocations up to 1 GiB come from (and go back to) malloc's heap
# With FSDP, larger allocations are mapped afresh and unmapped when freed: FSDP's per-unit gather and scatter buffers
# (tens of MB each, freed every layer) would otherwise be split up by the small activations allocated after them,
# which live until backward, and the heap would grow every step by about the unsharded model (docs/benchmarks.md).
REUSE_BELOW_SHARDED = 4 << 20


HUGE_PAGES = "glibc.malloc.hugetlb=1"


def with_huge_pages(tunables: str | None) -> str:
    """GLIBC_TUNABLES for a training process: malloc asks for transparent huge pages (madvise) on what it maps, so a
    buffer mapped afresh costs one page fault per 2 MiB instead of per 4 KiB (glibc >= 2.35; older ones ignore it).
    Read when a process starts, so the launcher sets it for the processes it starts. A choice already made stays."""
    if not tunables:
        return HUGE_PAGES
    if "glibc.malloc.hugetlb=" in tunables:
        return tunables
    return f"{tunables}:{HUGE_PAGES}"


def reuse_threshold(setting_mb: float | None, sharded: bool) -> int:
    """Bytes below which freed host memory is kept for reuse: the setting, or the default for the layout."""
    if setting_mb is not None:
        return int(setting_mb * 2**20)
    return REUSE_BELOW_SHARDED if sharded else REUSE_BELOW


def keep_freed_memory(threshold: int = REUSE_BELOW) -> bool:
    """Ask glibc's malloc to serve allocations below `threshold` from its heap and to keep freed memory mapped.

    By default glibc maps every allocation above 32 MB afresh and unmaps it when freed, so the activations and
    gradients a CPU training step frees are page-faulted and zeroed by the kernel again on the next step, a visible
    share of the course model's CPU step time (docs/benchmarks.md). The price is that the process keeps its peak memory
    until it exits, a peak a training process reaches every step anyway.
    Returns whether the setting took effect: glibc on Linux only; elsewhere nothing changes.
    """
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL("libc.so.6").mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    keep = min(2 * threshold, 2**31 - 1)  # free memory at the top of the heap is trimmed above this
    return bool(mallopt(M_MMAP_THRESHOLD, threshold)) and bool(mallopt(M_TRIM_THRESHOLD, keep))
