"""No warning on an ordinary run (issue 41): scalelm asks torch for what it wants under the names the installed torch
reads, so a newcomer's first training prints no deprecation of ours."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from conftest import run_train
from scalelm.hang.flight_recorder import buffer_size_variable, flight_recorder_env
from scalelm.parallel.data import apply_ddp

RECORDER_BUFFER_NAMES = {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_replicate",))
    finally:
        dist.destroy_process_group()


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.register_buffer("table", torch.ones(4), persistent=False)


def test_a_tiny_ddp_training_prints_no_warning(tiny_config):
    """Two processes under torchrun with a process group (the Flight Recorder's environment is read when it starts)
    and DDP with scalelm's options: stderr holds no warning (torch 2.13 warned of both)."""
    result = run_train(tiny_config("ddp"), 2, "parallel.strategy=ddp", "train.max_steps=2", launcher="torchrun")
    warned = [line for line in result.stderr.splitlines() if re.search(r"warn|deprecat", line, re.IGNORECASE)]
    assert warned == [], "\n".join(warned)


def test_ddp_options_skip_the_buffer_broadcast_before_each_forward_without_a_deprecation(one_rank_group):
    """DDP_OPTIONS under the name this torch reads (`forward_sync_buffers` from 2.13, `broadcast_buffers` before):
    no FutureWarning, and no broadcast of the buffers before a forward, which DDP's default does."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = apply_ddp(WithBuffer(), one_rank_group, torch.device("cpu"))
    assert [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))] == []
    assert ours.will_sync_module_buffers() is False and ours.gradient_as_bucket_view is True
    assert DistributedDataParallel(WithBuffer(), process_group=one_rank_group.get_group()).will_sync_module_buffers()


def test_flight_recorder_sizes_its_buffer_under_the_name_this_torch_reads(tmp_path):
    """TORCH_FR_BUFFER_SIZE from torch 2.8 on (the older name still works there, with a warning on every run), the
    older TORCH_NCCL_TRACE_BUFFER_SIZE before; never both."""
    assert buffer_size_variable("2.7.1+cu126") == "TORCH_NCCL_TRACE_BUFFER_SIZE"
    assert buffer_size_variable("2.8.0") == buffer_size_variable("2.13.0+cpu") == "TORCH_FR_BUFFER_SIZE"
    env = flight_recorder_env(tmp_path)
    assert RECORDER_BUFFER_NAMES & set(env) == {buffer_size_variable(torch.__version__)}
    assert int(env[buffer_size_variable()]) > 0
