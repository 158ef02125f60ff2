"""torch.compile, applied with the layout: each block on its own, after tensor parallelism and before FSDP (the order
torchtitan uses), so that FSDP's hooks stay outside the compiled code and every block shares one compiled graph.

Modules are compiled in place (`nn.Module.compile`): parameter names, and so checkpoints, are those of the eager
model, and a compiled run resumes an eager one's checkpoint and the other way round. Evaluation runs them eagerly
(scalelm.train.evaluation): under no_grad and eval() they would compile again.

`train.compile_mode` is passed on as torch.compile's mode. max-autotune-no-cudagraphs benchmarks kernels at the first
step (minutes); what it found is worth keeping, so Inductor's persistent caches stay on (FX graphs and autotuning
results, under TORCHINDUCTOR_CACHE_DIR: site.yaml's inductor_cache_dir, else Inductor's default), never a per-run
directory.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from scalelm.errors import ConfigError

# a -runtime PyTorch image has no C compiler; Triton builds each kernel's launcher with one, at the first step
DEVEL_IMAGE = "docker://pytorch/pytorch:2.9.0-cuda12.8-cudnn9-devel"


def check_c_compiler(settings: tuple[str, ...] = ("train.compile",)) -> None:
    """The `settings` that compile on CUDA: Triton builds each kernel's launcher with a C compiler."""
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        raise ConfigError(
            f"{' and '.join(settings)} on CUDA needs a C compiler (Triton builds its kernels' launchers with one) and "
            f"none is on PATH: build the image from a -devel base (container.base_image: {DEVEL_IMAGE}), install gcc, "
            f"or set {', '.join(f'{s}: false' for s in settings)}"
        )


def keep_tuning_results() -> None:
    """Inductor's FX graph and autotuning caches on (torch's defaults, unless the environment turned them off), so
    that a tuned compilation is paid once per cache directory, not per run."""
    import torch._inductor.config as inductor

    for name, setting in (("FX_GRAPH_CACHE", "fx_graph_cache"), ("AUTOTUNE_LOCAL_CACHE", "autotune_local_cache")):
        if f"TORCHINDUCTOR_{name}" not in os.environ:
            setattr(inductor, setting, True)


def apply_compile(model: nn.Module, device: torch.device, mode: str = "default") -> None:
    """Compile the blocks of `model` (a whole model or a pipeline stage, on any device, meta included) and, on CUDA,
    the output head with its loss: logits, their fp32 cast and the cross-entropy fused instead of a vocabulary-wide
    tensor each, all in torch.compile's `mode` (train.compile_mode). On CPU the head keeps its hand-fused loss
    (scalelm.model.cpu_ops); inductor's C++ kernels need the compiler there too, which torch checks itself."""
    if device.type == "cuda":
        check_c_compiler()
    if mode != "default":
        keep_tuning_results()
    for block in model.blocks.values():
        block.compile(mode=mode)
    if device.type == "cuda" and model.head is not None:
        model.head.compile(mode=mode)
