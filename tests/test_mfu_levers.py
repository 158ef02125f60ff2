"""The levers of gpt2_small's MFU on one GPU (issue 40, docs/benchmarks.md), each checked on CPU: cuDNN attention first
on Hopper, bf16 parameters through FSDP's policy on a mesh of one, batch 32 within the plan, a compiled AdamW step,
and torch.compile's mode with Inductor's persistent caches. How fast each makes a GPU is bench/gpu_paths.py's
question, not a test's."""

from __future__ import annotations

import contextlib
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.attention import SDPBackend

import drills
from conftest import REPO, run_dir_of, train_here, train_losses
from scalelm import optim
from scalelm.config import Config, from_dict, load_config, resolve_precision
from scalelm.data.prepared import load_prepared
from scalelm.errors import ConfigError
from scalelm.model.transformer import TransformerLM
from scalelm.optim import build_optimizer, build_scheduler, optimizer_step
from scalelm.parallel import compile as compile_module
from scalelm.parallel import data as data_module
from scalelm.parallel import numerics, runtime
from scalelm.parallel.dims import MESH_DIMS, ParallelDims
from scalelm.parallel.env import DistEnv
from scalelm.parallel.expert import apply_ep
from scalelm.parallel.layout import check_bf16_params, resolve_layout
from scalelm.plan.memory import Workload, plan_memory
from scalelm.site import SiteConfig
from scalelm.train.checkpoint import complete_checkpoints
from scalelm.train.record import read_metrics

TINY_MODEL = {"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "dropout": 0.0}
VOCAB = 50
QUIET = {"train__monitor_interval_s": 0, "train__comm_profile_steps": 0}


def tiny(**train) -> Config:
    return from_dict({"model": TINY_MODEL, "data": {"seq_len": 8}, "batch": {"size": 4}, "train": train})


def cpu_env() -> DistEnv:
    return DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def test_each_lever_is_a_typed_setting_refused_by_name_where_it_cannot_act(monkeypatch):
    """Every new setting loads with its type, acts, or is refused naming itself: compile_mode without compile,
    Lightning's engine for what its loop does not run through scalelm's step, bf16_params on CPU or beside a layout
    without FSDP, a site's cache directory that is not absolute. The gpt2_small experiment runs batch 32 and its plan
    fits a 40 GB GPU; DDP takes DDP_OPTIONS (which Lightning's DDP strategy shares)."""
    levers = [
        "train.compile_mode=max-autotune-no-cudagraphs",
        "train.compile_optimizer=true",
        "train.attention_kernels=auto",
    ]
    train = load_config(None, ["train.compile=true", *levers]).train
    assert (train.compile_mode, train.compile_optimizer, train.attention_kernels) == (
        "max-autotune-no-cudagraphs",
        True,
        "auto",
    )
    refusals = {
        ("train.compile_mode=max-autotune-no-cudagraphs",): "train.compile_mode=max-autotune-no-cudagraphs tunes",
        ("train.compile_mode=reduce-overhead",): "'reduce-overhead' is not one of",
        ("train.engine=lightning", "train.compile_optimizer=true"): "train.compile_optimizer=true is scalelm's engine",
        ("train.engine=lightning", "train.precision=bf16_params"): "train.precision=bf16_params is scalelm's engine",
        ("train.engine=lightning", "train.attention_kernels=auto"): "train.attention_kernels=auto is scalelm's engine",
    }
    for overrides, message in refusals.items():  # at load, or where layouts are checked (an engine's refusals)
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            resolve_layout(load_config(None, list(overrides)), 1, 1)
    with pytest.raises(ConfigError, match="train.precision=bf16_params is for CUDA devices"):
        resolve_precision("bf16_params", "cpu")
    assert resolve_precision("bf16_params", "cuda") == "bf16"  # its compute precision: MFU's peak, the plan's bytes
    with pytest.raises(ConfigError, match="bf16_params casts the parameters through FSDP's policy, and the ddp"):
        check_bf16_params("bf16_params", ParallelDims(dp_replicate=2))
    check_bf16_params("bf16_params", ParallelDims(dp_shard=2))
    check_bf16_params("bf16_params", ParallelDims())

    study = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    gpt2 = from_dict(study["experiments"]["gpt2_small"]["training"])
    assert gpt2.batch.size == 32 and gpt2.batch.micro_size is None and gpt2.batch.sizes(1) == (32, 32)
    planned = plan_memory(Workload(gpt2, vocab_size=33278, device="cuda"), ParallelDims())
    assert planned.total < 0.9 * 40e9, planned.mb()  # the plan's headroom on an A100 40GB

    site = SiteConfig(inductor_cache_dir="/scratch/inductor cache")
    assert "export TORCHINDUCTOR_CACHE_DIR='/scratch/inductor cache'" in site.prelude()
    assert "TORCHINDUCTOR" not in SiteConfig().prelude()
    with pytest.raises(ConfigError, match="inductor_cache_dir must be an absolute path"):
        SiteConfig(inductor_cache_dir="~/inductor")

    assert data_module.DDP_OPTIONS == {"gradient_as_bucket_view": True, **data_module.no_buffer_sync_per_forward()}
    made = {}
    monkeypatch.setattr(data_module, "DistributedDataParallel", lambda model, **options: made.update(options))
    mesh = type("Mesh", (), {"get_group": lambda self: "group"})()
    data_module.apply_ddp(torch.nn.Linear(2, 2), mesh, torch.device("cpu"))
    assert made == {"device_ids": None, "process_group": "group", **data_module.DDP_OPTIONS}


def test_cudnn_attention_goes_first_on_hopper_around_every_forward(monkeypatch):
    """attention_kernels=auto: on compute capability 9.0 the forward passes run under sdpa_kernel with cuDNN's
    attention first (set_priority) where torch's own order does not already start with it (torch 2.9 on, and from
    2.10 only with a cuDNN above 9.15.0: torch 2.11's CUDA 13 wheels) and its cuDNN is 9.9 or later; elsewhere, with
    torch's own switches against cuDNN, and with `default`, under torch's own order. With a cuDNN older than 9.15.1 a
    sequence length that is not a multiple of 128 is refused. The training and the evaluation forward both call SDPA
    inside that context, and the order is torch's again after them."""
    torch_prefers_cudnn = numerics.torch_prefers_cudnn  # asks torch: its order after a choice of backend
    assert not torch_prefers_cudnn(torch.device("cpu"))
    with monkeypatch.context() as changed:
        changed.setattr(torch._C, "_get_sdp_priority_order", lambda: [int(b) for b in numerics.CUDNN_FIRST])
        assert torch_prefers_cudnn(torch.device("cpu"))
    probe = {"capability": (9, 0), "cudnn": 91002, "torch_prefers": False}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: probe["capability"])
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: probe["cudnn"])
    monkeypatch.setattr(numerics, "torch_prefers_cudnn", lambda device: probe["torch_prefers"])
    for variable in ("TORCH_CUDNN_SDPA_DEPRIORITIZED", "TORCH_CUDNN_SDPA_PREFERRED"):
        monkeypatch.delenv(variable, raising=False)
    cuda = torch.device("cuda", 0)
    assert numerics.attention_backends("auto", cuda) == [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    assert numerics.attention_backends("default", cuda) is None
    assert numerics.attention_backends("auto", torch.device("cpu")) is None
    for name, value in (("torch_prefers", True), ("cudnn", 90701), ("capability", (8, 0))):
        with monkeypatch.context() as changed:
            changed.setitem(probe, name, value)
            assert numerics.attention_backends("auto", cuda) is None, name
    for variable, value in (("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1"), ("TORCH_CUDNN_SDPA_PREFERRED", "0")):
        with monkeypatch.context() as changed:
            changed.setenv(variable, value)
            assert numerics.attention_backends("auto", cuda) is None, variable

    def lengths(seq_len: int, kernels: str = "auto") -> Config:
        return from_dict({"model": TINY_MODEL, "data": {"seq_len": seq_len}, "train": {"attention_kernels": kernels}})

    with pytest.raises(ConfigError, match=r"cuDNN 91002, older than 9.15.1, .* data.seq_len=100 is not one: set"):
        runtime.check_on_device(lengths(100), cuda)
    runtime.check_on_device(lengths(128), cuda)
    runtime.check_on_device(lengths(100, "default"), cuda)
    with monkeypatch.context() as changed:
        changed.setitem(probe, "cudnn", 91900)
        runtime.check_on_device(lengths(100), cuda)

    asked = []
    monkeypatch.setattr(
        numerics, "attention_backends", lambda setting, device: asked.append(setting) or numerics.CUDNN_FIRST
    )
    entered = []
    real_kernel = numerics.sdpa_kernel

    @contextlib.contextmanager
    def recording_kernel(backends, set_priority=False):
        entered.append((list(backends), set_priority))
        with real_kernel(backends, set_priority=set_priority):
            yield

    monkeypatch.setattr(numerics, "sdpa_kernel", recording_kernel)
    first_in_order = []
    real_sdpa = F.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        first_in_order.append(SDPBackend(torch._C._get_sdp_priority_order()[0]))
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    torch_order = torch._C._get_sdp_priority_order()
    parallel = runtime.Parallel.start(tiny(attention_kernels="auto"), cpu_env(), VOCAB)
    model = parallel.build(lambda: TransformerLM(tiny().model, VOCAB), seed=1)
    inputs, targets = batch()
    loss = parallel.forward_backward(model, inputs, targets, 1.0, step=1)
    logits = parallel.forward(model, inputs)
    assert asked == ["auto"] and torch.isfinite(loss) and logits.shape == (4, 8, VOCAB)
    assert entered == [(numerics.CUDNN_FIRST, True)] * 2
    assert first_in_order == [SDPBackend.CUDNN_ATTENTION] * 4  # two blocks, two forwards
    assert torch._C._get_sdp_priority_order() == torch_order


def test_bf16_params_on_one_process_casts_through_fsdp_on_a_mesh_of_one(monkeypatch):
    """train.precision=bf16_params in one process: refused on CPU before any process group starts; forced (the
    precision check monkeypatched), a group and mesh of one rank, FSDP's policy over the seed's weights (those of the
    plain single process), activations in bf16 at every block and norm (the residual stream included), while the
    parameters AdamW holds, their gradients and its state stay fp32, and no autocast runs on top. One rank keeps its
    gathered weights from forward to backward: resharding would free nothing."""
    with pytest.raises(ConfigError, match="train.precision=bf16_params is for CUDA devices"):
        runtime.Parallel.start(tiny(precision="bf16_params"), cpu_env(), VOCAB)
    assert not dist.is_initialized()
    monkeypatch.setattr(numerics, "resolve_precision", lambda precision, device_type: "bf16")
    sharded = []
    real_fsdp = runtime.apply_fsdp
    monkeypatch.setattr(
        runtime, "apply_fsdp", lambda *args, **kwargs: sharded.append(args[2:4]) or real_fsdp(*args, **kwargs)
    )
    try:
        parallel = runtime.Parallel.start(tiny(precision="bf16_params"), cpu_env(), VOCAB)
        assert dist.get_world_size() == 1 and parallel.meshes is not None and parallel.uses_fsdp
        assert parallel.compute_dtype == torch.bfloat16 and isinstance(parallel.autocast(), contextlib.nullcontext)
        model = parallel.build(lambda: TransformerLM(tiny().model, VOCAB), seed=1)
        assert sharded == [(torch.bfloat16, False)]  # the policy's dtype; no resharding after the forward
        torch.manual_seed(1)
        plain = TransformerLM(tiny().model, VOCAB)
        for (name, param), (_, reference) in zip(model.named_parameters(), plain.named_parameters()):
            assert isinstance(param, DTensor) and param.dtype == torch.float32, name
            assert torch.equal(param.full_tensor(), reference), name
        seen = []
        for module in (*model.blocks.values(), model.blocks["0"].norm1, model.blocks["1"].norm2, model.norm):
            module.register_forward_hook(lambda mod, args, out: seen.append((args[0].dtype, out.dtype)))
        optimizer = build_optimizer(model, tiny().optim, lr=1e-3)
        inputs, targets = batch()
        loss = parallel.forward_backward(model, inputs, targets, 1.0, step=1)
        assert torch.isfinite(loss) and len(seen) == 5 and set(seen) == {(torch.bfloat16, torch.bfloat16)}, seen
        grads = [p.grad for p in model.parameters()]
        assert all(isinstance(g, DTensor) and g.dtype == torch.float32 for g in grads)
        optimizer.step()
        held = [p for group in optimizer.param_groups for p in group["params"]]
        assert {p.dtype for p in held} == {torch.float32} and len(held) == len(list(model.parameters()))
        states = [v for state in optimizer.state.values() for v in state.values() if v.dim()]
        assert states and {v.dtype for v in states} == {torch.float32}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_compiled_optimizer_step_equals_fused_adamw_and_resumes_bitwise(tiny_config, prepared, tmp_path):
    """train.compile_optimizer: AdamW's step through torch.compile (with the tensor learning rate the schedule fills)
    gives fused AdamW's parameters within 1e-6 over 10 steps of warm-up and cosine decay, both fed the same gradients;
    the schedule reports plain numbers. A compiled run resumed from its step-5 checkpoint ends bitwise where it ended
    straight; an optimizer's state loaded into the other kind keeps the loading run's implementation."""
    from torch._dynamo.utils import counters

    settings = dict(
        model__n_layers=1,
        train__max_steps=10,
        checkpoint__every=5,
        optim__schedule="cosine",
        optim__warmup_steps=3,
        optim__weight_decay=0.1,
        **QUIET,
    )
    config = load_config(tiny_config("parity", **settings))
    torch.manual_seed(1)
    models = [TransformerLM(config.model, load_prepared(prepared).vocab_size) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [build_optimizer(m, config.optim, 2e-3, compiled=c) for m, c in zip(models, (False, True))]
    schedules = [build_scheduler(o, config.optim, 10) for o in optimizers]
    steps = [optimizer_step(o, c) for o, c in zip(optimizers, (False, True))]
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(10):
        tokens = torch.randint(0, 100, (4, 17))
        models[0](tokens[:, :-1], tokens[:, 1:]).backward()
        for a, b in zip(*(m.parameters() for m in models)):
            b.grad = a.grad.clone()
        for step, schedule, optimizer in zip(steps, schedules, optimizers):
            step(), schedule.step(), optimizer.zero_grad()
    assert counters["stats"]["unique_graphs"] > graphs  # the step was compiled
    gaps = [(a - b).abs().max().item() for a, b in zip(*(m.parameters() for m in models))]
    assert max(gaps) <= 1e-6 and any(gaps), gaps
    assert optimizers[0].param_groups[0]["fused"] and torch.is_tensor(optimizers[1].param_groups[0]["lr"])
    assert schedules[1].get_last_lr() == pytest.approx(schedules[0].get_last_lr()) and schedules[1].get_last_lr()
    assert all(type(lr) is float for lr in schedules[1].get_last_lr())
    kind = ("fused", "foreach", "capturable")
    for source, target in ((1, 0), (0, 1)):  # a run resumes the other kind's state with its own step
        before = {k: optimizers[target].param_groups[0][k] for k in kind}
        optimizers[target].load_state_dict(optimizers[source].state_dict())
        group = optimizers[target].param_groups[0]
        assert {k: group[k] for k in kind} == before and torch.is_tensor(group["lr"]) == (target == 1)

    compiled = tiny_config("compiled", train__compile_optimizer=True, **settings)
    train_here(compiled)
    logged = [r["lr"] for r in read_metrics(run_dir_of(compiled)) if r["kind"] == "train"]
    assert len(logged) == 10 and all(type(lr) is float for lr in logged)
    step5 = complete_checkpoints(run_dir_of(compiled) / "checkpoints")[0]
    assert step5.name.endswith("05")
    resumed = tiny_config("resumed", train__compile_optimizer=True, **settings)
    shutil.copytree(step5, run_dir_of(resumed) / "checkpoints" / step5.name)
    train_here(resumed)
    assert train_losses(run_dir_of(resumed)) == train_losses(run_dir_of(compiled))[5:]
    a, b = drills.final_weights(compiled, tmp_path / "a.pt"), drills.final_weights(resumed, tmp_path / "b.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_compiled_optimizers_cuda_form_steps_dtensors_of_two_meshes_as_fused_adamw(monkeypatch):
    """train.compile_optimizer's CUDA form (foreach, capturable, a tensor learning rate: `compiled_implementation` on
    a device in CAPTURABLE_DEVICES, the CPU here, whose capturable device asserts torch.compile skips) over an
    expert-parallel model of one gloo rank: FSDP's DTensors on one mesh, the experts' on the ep mesh, one parameter
    group per mesh (in one group the compiled foreach step fails: "different meshes"). Six steps of warm-up and cosine
    decay give fused AdamW's parameters within fp32 rounding from the same gradients, all from the first step's
    graph."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(optim, "CAPTURABLE_DEVICES", ("cpu",))
    config = from_dict(
        {
            "model": {**TINY_MODEL, "n_layers": 1, "moe": {"experts": 2, "top_k": 1}},
            "optim": {"weight_decay": 0.1, "warmup_steps": 2, "schedule": "cosine"},
        }
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:

        def expert_parallel_model() -> torch.nn.Module:
            torch.manual_seed(1)
            model = TransformerLM(config.model, VOCAB)
            world = init_device_mesh("cpu", (1,) * len(MESH_DIMS), mesh_dim_names=MESH_DIMS)
            split = world._unflatten("dp_shard", (1, 1), ("efsdp", "ep"))  # as runtime.Meshes cuts it, with ep 1
            apply_ep(model, split["ep"])
            return data_module.apply_fsdp(model, world["dp_shard"], torch.float32, False, False, split["efsdp"], 1)

        models = [expert_parallel_model() for _ in range(2)]
        optimizers = [build_optimizer(m, config.optim, 2e-3, compiled=c) for m, c in zip(models, (False, True))]
        group = optimizers[1].param_groups[0]
        assert group["foreach"] and group["capturable"] and torch.is_tensor(group["lr"]) and not group["fused"]
        assert optimizers[0].param_groups[0]["fused"]
        schedules = [build_scheduler(o, config.optim, 6) for o in optimizers]
        steps = [optimizer_step(o, c) for o, c in zip(optimizers, (False, True))]
        graphs = []
        for seed in range(6):
            generator = torch.Generator().manual_seed(seed)
            for a, b in zip(*(m.parameters() for m in models)):
                gradient = torch.randn(a.shape, generator=generator)
                a.grad = distribute_tensor(gradient, a.device_mesh, a.placements)
                b.grad = distribute_tensor(gradient.clone(), b.device_mesh, b.placements)
            for step, schedule, optimizer in zip(steps, schedules, optimizers):
                step(), schedule.step(), optimizer.zero_grad()
            graphs.append(counters["stats"]["unique_graphs"])
        assert graphs[0] > 0 and set(graphs) == {graphs[0]}, graphs  # compiled at the first step, never again
        gaps = [
            (a.full_tensor() - b.full_tensor()).abs().max().item() for a, b in zip(*(m.parameters() for m in models))
        ]
        assert max(gaps) <= 1e-6 and any(gaps), gaps
        assert all(isinstance(p, DTensor) for p in models[1].parameters())
        meshes = [{p.device_mesh for p in group["params"]} for group in optimizers[1].param_groups]
        assert len(meshes) == 2 and all(len(mesh) == 1 for mesh in meshes) and meshes[0] != meshes[1]
    finally:
        dist.destroy_process_group()


def test_a_schedule_resumes_into_an_optimizer_grouped_otherwise():
    """A checkpoint's schedule loads whatever the writer's parameter groups were (one per mesh: a layout of its own,
    or a checkpoint from before the experts had a group of their own), every group then following it."""
    optim_config = from_dict({"optim": {"schedule": "cosine", "warmup_steps": 2}}).optim

    def grouped(groups: int) -> torch.optim.Optimizer:
        return torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)], lr=1.0)

    written = build_scheduler(grouped(1), optim_config, 10)
    for _ in range(4):
        written.optimizer.step(), written.step()
    for groups in (2, 1):
        optimizer = grouped(groups)
        resumed = build_scheduler(optimizer, optim_config, 10)
        resumed.load_state_dict(written.state_dict())
        optimizer.step(), resumed.step()
        assert resumed.get_last_lr() == [resumed.lr_lambdas[0](5)] * groups
        assert [g["lr"] for g in optimizer.param_groups] == resumed.get_last_lr()


def test_compile_mode_reaches_torch_compile_and_keeps_inductor_caches(monkeypatch):
    """train.compile_mode is the mode every compiled module gets (through Parallel, as both engines apply it);
    max-autotune turns Inductor's FX graph and autotuning caches on, unless the environment says otherwise."""
    import torch._inductor.config as inductor

    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: calls.append((type(self).__name__, kwargs)))
    for variable in ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOTUNE_LOCAL_CACHE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(inductor, "fx_graph_cache", False)
    monkeypatch.setattr(inductor, "autotune_local_cache", False)
    config = tiny(compile=True, compile_mode="max-autotune-no-cudagraphs")
    parallel = runtime.Parallel.start(config, cpu_env(), VOCAB)
    parallel.build(lambda: TransformerLM(config.model, VOCAB), 1, runtime.ModelOptions.of(config.train))
    assert calls == [("Block", {"mode": "max-autotune-no-cudagraphs"})] * 2  # the CPU's head keeps its fused loss
    assert inductor.fx_graph_cache and inductor.autotune_local_cache

    calls.clear()
    monkeypatch.setattr(inductor, "fx_graph_cache", False)
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    model = TransformerLM(config.model, VOCAB)
    monkeypatch.setattr(compile_module, "check_c_compiler", lambda: None)
    compile_module.apply_compile(model, torch.device("cuda"), "max-autotune-no-cudagraphs")
    assert [name for name, _ in calls] == ["Block", "Block", "OutputHead"] and not inductor.fx_graph_cache
    calls.clear()
    compile_module.apply_compile(model, torch.device("cpu"))
    assert calls == [("Block", {"mode": "default"})] * 2
