"""What a device computes per second at the model's shapes: the matrix products' TFLOP/s in the training dtype, and
the bytes an elementwise addition reads and writes per second."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scalelm.measure.baseline.timing import median_seconds

if TYPE_CHECKING:  # torch is imported where the measuring starts: the workflow reads this module without it
    import torch


def matmul_rates(shapes: dict[str, tuple[int, int, int]], device: torch.device, dtype: torch.dtype) -> dict:
    """TFLOP/s of each product and over all of them."""
    import torch

    rates, flops_total, seconds_total = {}, 0.0, 0.0
    for name, (m, k, n) in shapes.items():
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        c = torch.empty(m, n, device=device, dtype=dtype)  # not a fresh output each time: the allocator's page faults
        seconds = median_seconds(lambda: torch.matmul(a, b, out=c), device)  # would be timed with the product
        flops = 2.0 * m * k * n
        rates[name] = {"shape": [m, k, n], "tflops": flops / seconds / 1e12}
        flops_total, seconds_total = flops_total + flops, seconds_total + seconds
    return {"products": rates, "tflops": flops_total / seconds_total / 1e12, "dtype": str(dtype).removeprefix("torch.")}


def elementwise_gbps(elements: int, device: torch.device) -> float:
    """GB/s an fp32 addition of two `elements`-long tensors into a third reads and writes."""
    import torch

    a, b = torch.rand(elements, device=device), torch.rand(elements, device=device)
    out = torch.empty_like(a)
    return 3 * elements * 4 / median_seconds(lambda: torch.add(a, b, out=out), device) / 1e9
