"""The numerics policy of a run on its device: the precision it computes in, TF32 for fp32 matrix products on CUDA,
the order of the attention kernels, and autocast around forward passes (`Numerics`, held by
scalelm.parallel.runtime.Parallel).

One of the single-GPU levers of docs/benchmarks.md lives here: `train.attention_kernels: auto` puts cuDNN's attention
first around every forward on Hopper where torch does not already (`attention_backends`, `Numerics.attention`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import ContextManager

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from scalelm.config import Config, TrainConfig, resolve_precision
from scalelm.errors import ConfigError

# train.attention_kernels: auto, cuDNN's fused attention first on the GPUs where it beats flash attention for training
# shapes (Hopper), where torch's own order does not already put it first (torch_prefers_cudnn) and its cuDNN is one
# torch itself has put first: 9.9 and later (torch 2.9's rule); before 9.15.1, which fixed sequence lengths that are
# not a multiple of 128 (pytorch#169849: the reason torch 2.10 stopped preferring older versions), only for those
CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
CUDNN_FIRST_CAPABILITIES = ((9, 0),)
CUDNN_TRUSTED = 90900
CUDNN_ANY_LENGTH = 91501
CUDNN_LENGTH_MULTIPLE = 128


def attention_backends(setting: str, device: torch.device) -> list[SDPBackend] | None:
    """The SDPA backends, in priority order, that forward passes run under for train.attention_kernels; None: torch's
    own order, which `auto` keeps where it already starts with cuDNN, where the environment tells torch not to prefer
    cuDNN, and with a cuDNN older than 9.9."""
    if setting != "auto" or device.type != "cuda" or cudnn_deprioritized():
        return None
    if torch.cuda.get_device_capability(device) not in CUDNN_FIRST_CAPABILITIES:
        return None
    if (torch.backends.cudnn.version() or 0) < CUDNN_TRUSTED or torch_prefers_cudnn(device):
        return None
    return CUDNN_FIRST


def cudnn_deprioritized() -> bool:
    """torch's own switches against cuDNN's attention first: TORCH_CUDNN_SDPA_DEPRIORITIZED=1 (torch 2.10 on) and
    TORCH_CUDNN_SDPA_PREFERRED=0 (2.9)."""
    return (
        os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED") == "1" or os.environ.get("TORCH_CUDNN_SDPA_PREFERRED") == "0"
    )


def torch_prefers_cudnn(device: torch.device) -> bool:
    """Whether torch's own SDPA order on `device` starts with cuDNN's attention (sdp_utils.cpp,
    check_prefer_cudnn_attention): in torch 2.9 on sm90 and sm100 with a cuDNN of 9.9 or later, from 2.10 on only with
    a cuDNN above 9.15.0 at run time (so with the cuDNN 9.19 of torch 2.11's CUDA 13 wheels), never before 2.9. Torch
    settles that order at its first choice of a backend (for the current device: scalelm.parallel.env sets it), which
    this makes on a tiny input before reading it."""
    q = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16, device=device)
    torch._fused_sdp_choice(q, q, q)
    return SDPBackend(torch._C._get_sdp_priority_order()[0]) == SDPBackend.CUDNN_ATTENTION


def check_attention_lengths(config: Config, device: torch.device) -> None:
    """train.attention_kernels=auto with a cuDNN older than 9.15.1 only for sequences of a multiple of 128 tokens."""
    seq_len, cudnn = config.data.seq_len, torch.backends.cudnn.version() or 0
    if device.type != "cuda" or seq_len % CUDNN_LENGTH_MULTIPLE == 0 or cudnn >= CUDNN_ANY_LENGTH:
        return
    if attention_backends(config.train.attention_kernels, device) is not None:
        raise ConfigError(
            f"train.attention_kernels=auto would put cuDNN's attention first with cuDNN {cudnn}, older than 9.15.1, "
            f"which fixed sequence lengths that are not a multiple of 128 (pytorch#169849), and data.seq_len="
            f"{seq_len} is not one: set train.attention_kernels=default, or data.seq_len to a multiple of 128"
        )


def matmul_precision(device: torch.device, compute_dtype: torch.dtype) -> str:
    """fp32 on CUDA runs its matmuls on TF32 tensor cores ("high"), the rate its MFU is measured against (IEEE fp32
    is much slower); the CPU keeps IEEE fp32, which its calibrated peak measures. Returns the setting."""
    setting = "high" if device.type == "cuda" and compute_dtype == torch.float32 else "highest"
    torch.set_float32_matmul_precision(setting)
    torch.backends.cudnn.allow_tf32 = setting == "high"
    return setting


@dataclass(frozen=True)
class Numerics:
    """What a run computes in on its device: `precision` resolved (fp32, bf16, bf16_params), the dtype of its
    activations, and the attention kernels' order (None: torch's own)."""

    precision: str
    compute_dtype: torch.dtype
    attention_backends: list[SDPBackend] | None

    @classmethod
    def of(cls, train: TrainConfig, device: torch.device) -> Numerics:
        """The policy of `train` on `device`, with torch's matmul precision set for it."""
        precision = resolve_precision(train.precision, device.type)
        compute_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        matmul_precision(device, compute_dtype)
        return cls(precision, compute_dtype, attention_backends(train.attention_kernels, device))

    def attention(self) -> ContextManager:
        """SDPA's backends in train.attention_kernels' order; a compiled block takes its kernel when it is traced,
        inside this context, at the first step."""
        if self.attention_backends is None:
            return contextlib.nullcontext()
        return sdpa_kernel(self.attention_backends, set_priority=True)

    def autocast(self, device: torch.device, cast_by_fsdp: bool) -> ContextManager:
        """Mixed precision around forward passes, unless FSDP's policy already casts (`cast_by_fsdp`)."""
        if self.compute_dtype == torch.float32 or cast_by_fsdp:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute_dtype)
