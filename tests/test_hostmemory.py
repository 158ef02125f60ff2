import platform
import resource
import subprocess
import sys
import textwrap

from scalelm.parallel.hostmemory import keep_freed_memory, reuse_threshold, with_huge_pages

STEP = textwrap.dedent(
    """
    import resource, sys, torch
    from scalelm.parallel.env import setup
    if sys.argv[1] == "training":
        assert setup("cpu", timeout_s=60).device.type == "cpu"  # as every CPU training starts
    def step():  # four 128 MB buffers, alive together, then freed, as activations are in a training step
        buffers = [torch.empty(1 << 25).fill_(1.0) for _ in range(4)]
        del buffers
    for _ in range(5):  # glibc's heap settles within a few steps (then no faults at all on this machine)
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        step()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3)
    """
)


def faults_per_step(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", STEP, mode], capture_output=True, text=True, check=True).stdout
    return float(out)


def test_cpu_training_reuses_the_memory_a_step_freed_without_page_faults():
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        assert keep_freed_memory() is False  # nothing to tune: the call changes nothing
        return
    pages = 4 * (128 << 20) // resource.getpagesize()
    default, kept = faults_per_step("default"), faults_per_step("training")
    assert kept < 0.02 * pages, (kept, pages)
    assert default > 10 * kept + 100, (default, kept)  # glibc's default maps the buffers afresh every step


def test_fsdp_keeps_only_small_allocations_and_a_setting_overrides_the_layouts_default():
    assert reuse_threshold(None, sharded=False) == 1 << 30  # activations of large batches stay in the heap
    assert reuse_threshold(None, sharded=True) == 4 << 20  # FSDP's gather and scatter buffers go back
    assert reuse_threshold(64, sharded=True) == 64 << 20
    assert with_huge_pages(None) == "glibc.malloc.hugetlb=1"
