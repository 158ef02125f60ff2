"""The levers of gpt2_small's MFU on one GPU (issue 40, docs/benchmarks.md), each checked on CPU: cuDNN attention first
on Hopper, bf16 parameters through FSDP's policy on a mesh of one, batch 32 within the plan, a compiled AdamW step,
and torch.compile's mode with Inductor's persistent caches. How fast each makes a GPU is bench/gpu_paths.py's
question (check E, through bench/gpu_mfu.py), not a test's; that harness's structure is checked here on CPU (issue
67): a compile farm's warm-only call, the pair timed first within a budget, a variant run uncompiled failing, and the
figures that say which card and which FLOP convention."""

from __future__ import annotations

import contextlib
import json
import platform
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


# --- the harness that measures the levers (bench/gpu_mfu.py, check E of bench/gpu_paths.py), on CPU ---------------


@pytest.fixture
def gpu_mfu(monkeypatch):
    """bench/gpu_mfu.py as a module, with a variant that compiles on CPU through dynamo alone (Inductor's C++ build of
    even the tiny model takes a minute): what the checks of compilation read is dynamo's, whatever the backend."""
    import importlib

    monkeypatch.syspath_prepend(str(REPO))
    module = importlib.import_module("bench.gpu_mfu")
    monkeypatch.setitem(module.VARIANTS, "compiled", ["train.compile=true"])
    real_compile = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: real_compile(self, backend="eager"))
    torch._dynamo.reset()  # no graph of another test's blocks to reuse
    yield module
    torch._dynamo.reset()


def test_a_compile_farm_warms_variants_up_and_times_nothing(gpu_mfu, tmp_path, capsys):
    """--warm-only (review 4, finding 1: a farm compiles E's variants before E, filling the caches E then hits)
    builds each named variant through the path a measuring call takes and writes its compile figures: seconds,
    graphs, recompiles, the caches' hits, whether compiled code ran; no tokens/s, MFU or rounds. The CPU's tiny
    variants run eagerly, and say so; --only repeats; --warm-only names its variants."""
    with pytest.raises(SystemExit):
        gpu_mfu.main([str(tmp_path / "none"), "--cpu", "--warm-only"])
    assert "--warm-only builds the variants named by --only" in capsys.readouterr().err
    argv = [str(tmp_path), "--cpu", "--warm-only", "--only", "configured", "--only", "compiled", "--warmup", "1"]
    assert gpu_mfu.main(argv) == 0
    warmed = json.loads((tmp_path / "mfu.json").read_text())
    assert list(warmed) == ["configured", "compiled"]
    timing = {"rounds", "tokens_per_s", "mfu", "mfu_causal", "step_ms", "tokens_per_s_rounds"}
    assert all(not timing & set(figures) and figures["build_and_warmup_s"] > 0 for figures in warmed.values())
    assert warmed["configured"]["compile"] == {
        "configured": False,
        "eager_because": "train.compile and train.compile_optimizer are off",
    }
    compiled = warmed["compiled"]["compile"]
    assert compiled["configured"] and compiled["unique_graphs"] >= 1 and compiled["recompiles"] == 0
    assert compiled["compiled_regions_in_a_step"] >= 1 and compiled["compile_s"] > 0 and compiled["frames_eager"] == 0
    assert {"fx_graph_cache_hits", "aot_autograd_cache_misses"} <= set(compiled)
    assert warmed["compiled"]["machine"]["card"] and warmed["compiled"]["machine"]["driver"] is None
    lines = capsys.readouterr().out.splitlines()
    assert "eager (train.compile" in lines[0] and f"{compiled['unique_graphs']} graphs, 0 recompiles" in lines[1]


def test_a_variant_configured_to_compile_that_ran_uncompiled_fails(gpu_mfu, tmp_path, monkeypatch):
    """Review 4, finding 6: past dynamo's recompile limit the frames run eagerly with a log line only, and an eager
    variant would read as a lever costing 30%. A variant that compiles is a FAIL (its `error`) when it hits the limit
    (fail_on_recompile_limit_hit) or when its last warm-up step ran no compiled code (dynamo disabled: no graph at
    all); the others are still measured. The limit is scaled by the variants sharing the process, which a training
    process does not, and a shape is compiled for itself as a training process compiles it, never made dynamic by
    another variant's: three shapes compile once each within a limit of one. A compile inside a timed turn is
    counted (its seconds are in that round's)."""
    limit = torch._dynamo.config.recompile_limit
    good = gpu_mfu.warm(["compiled"], True, tmp_path, 1)["compiled"]
    assert "error" not in good and good["compile"]["compiled_regions_in_a_step"] >= 1

    torch._dynamo.reset()  # three shapes in one process, each compiled once, static: within the limit scaled for three
    for batch in (8, 16):
        monkeypatch.setitem(gpu_mfu.VARIANTS, f"compiled_batch{batch}", ["train.compile=true", f"batch.size={batch}"])
    with torch._dynamo.config.patch(recompile_limit=1):
        shared = gpu_mfu.warm(["compiled", "compiled_batch8", "compiled_batch16"], True, tmp_path, 1)
    assert [figures["compile"]["recompiles"] for figures in shared.values() if "error" not in figures] == [0, 1, 1]

    torch._dynamo.reset()  # a compile inside a timed turn (a guard a later build broke: here every cache dropped)
    real_timed = gpu_mfu.Variant.timed
    with monkeypatch.context() as dropped:
        dropped.setattr(gpu_mfu.Variant, "timed", lambda self, n: torch._dynamo.reset() or real_timed(self, n))
        recompiled = gpu_mfu.measure(["compiled"], True, tmp_path, 2, 1, 1)["compiled"]
    assert recompiled["rounds"] == 2 and recompiled["compiles_during_rounds"] == 2

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=0):
        results = gpu_mfu.measure(["configured", "compiled"], True, tmp_path, 2, 1, 1)
    assert "dynamo hit its recompile limit (0 in this process)" in results["compiled"]["error"]
    assert results["configured"]["rounds"] == 2 and "rounds" not in results["compiled"]
    assert gpu_mfu.failures(results) == ["compiled"]

    torch._dynamo.reset()
    with torch._dynamo.config.patch(disable=True):
        silent = gpu_mfu.warm(["compiled"], True, tmp_path, 1)["compiled"]
    assert silent["error"].startswith("ran a step uncompiled: compile is configured, but no compiled code ran")
    assert silent["compile"]["unique_graphs"] == 0 and silent["compile"]["compiled_regions_in_a_step"] == 0
    assert torch._dynamo.config.recompile_limit == limit and not torch._dynamo.config.fail_on_recompile_limit_hit


def causal_share(config: Config, vocab: int) -> float:
    """mfu_causal over mfu: llm.c's FLOPs per token (causal attention at half) over scalelm's."""
    from scalelm.measure.peak import causal_flops_per_token
    from scalelm.model.architecture import flops_per_token

    model, seq_len = config.model, config.data.seq_len
    whole = flops_per_token(model, vocab, seq_len)
    return causal_flops_per_token(whole, model.n_layers, model.d_model, seq_len) / whole


def test_the_pair_is_timed_first_and_a_budget_leaves_later_levers_out(gpu_mfu, tmp_path, monkeypatch):
    """Review 4, finding 1: E built all four variants before its first round, so an E cut off had no figure. The
    first two are timed as soon as both are warm (a round after each warm-up from the second on); within --budget-s
    a build or round that its estimate (the slowest build so far, the last turns) says cannot end is not started,
    and the JSON says which (`skipped`, `cut_short`). A later lever left out is a note; the pair left unmeasured is a
    failure. Every variant carries the machine it ran on and both MFU conventions; the GPU's NVML clocks during the
    turns (a fake reader here) go with each variant."""
    monkeypatch.setitem(gpu_mfu.VARIANTS, "later", [])
    now = [0.0]  # the budget's clock: only a build said slow moves it, so that the estimates are exact
    monkeypatch.setattr(gpu_mfu, "clock", lambda: now[0])
    real_init = gpu_mfu.Variant.__init__

    def slow_build(seconds: float, name: str):
        def init(self, *args):
            now[0] += seconds if args[0] == name else 0
            real_init(self, *args)

        return init

    def reader() -> dict:
        return {"ecc_uncorrected": 0, "sm_clock_mhz": 1755, "sm_clock_max_mhz": 1980, "reasons": 0}

    monkeypatch.setattr(gpu_mfu, "health_reader", lambda device: (lambda: reader() | {"power_limit_w": 700.0}, None))
    monkeypatch.setattr(gpu_mfu.Variant, "__init__", slow_build(2.0, "cudnn_attention"))
    reports, names = [], ["configured", "cudnn_attention", "later"]
    results = gpu_mfu.measure(names, True, tmp_path, 2, 1, 1, lambda r: reports.append(json.loads(json.dumps(r))), 4.0)
    played = [{name: f.get("rounds") for name, f in r.items()} for r in reports]
    assert played == [
        {"configured": None},
        {"configured": None, "cudnn_attention": None},
        {"configured": 1, "cudnn_attention": 1},  # the pair's first round, before the third build is weighed
        {"configured": 1, "cudnn_attention": 1, "later": None},
        {"configured": 2, "cudnn_attention": 2, "later": None},
    ], played
    assert results["later"]["skipped"].startswith("not started: its build (~2 s, the slowest so far)")
    assert gpu_mfu.failures(results) == [] and reports[-1] == json.loads(json.dumps(results))
    configured = results["configured"]
    assert 0 < configured["mfu_causal"] < configured["mfu"]  # the tiny model's attention is a small share
    tiny, gpt2 = (gpu_mfu.experiment_config(gpu_mfu.variant_settings("configured", cpu), tmp_path) for cpu in (1, 0))
    assert configured["mfu_causal"] / configured["mfu"] == pytest.approx(causal_share(tiny, gpu_mfu.VOCAB))
    assert causal_share(gpt2, gpu_mfu.VOCAB) == pytest.approx(719.6 / 776.2, abs=1e-3)  # gpt2_small's: x0.927
    machine = configured["machine"]
    assert machine["kernel"] == platform.release() and machine["power_limit_w"] == 700.0 and machine["cuda"] is None
    assert configured["compiles_during_rounds"] == 0
    clocks = configured["gpu_during_rounds"]
    assert clocks["sm_clock_mhz_median"] == 1755 and clocks["power_limit_w"] == 700.0 and clocks["healthy"]

    monkeypatch.setattr(gpu_mfu.Variant, "__init__", slow_build(2.0, "configured"))
    now[0] = 0.0
    spent = gpu_mfu.measure(names, True, tmp_path, 2, 1, 1, budget_s=1.0)
    assert "rounds" not in spent["configured"] and spent["configured"]["cut_short"].startswith("0 of 2 rounds")
    assert [spent[name]["skipped"] for name in names[1:]] == ["not started: the budget is spent"] * 2
    assert gpu_mfu.failures(spent) == ["configured", "cudnn_attention"]


def test_the_card_and_its_power_limit_come_through_the_one_nvml_reader(gpu_mfu, monkeypatch):
    """Review 4, finding 7: E's figures name the card they were measured on, its driver, power limit and kernel, so
    that an H100's are never read as an H200's. The power limit comes through the baseline's NVML reader
    (scalelm.measure.baseline.gpu_health; no NVML opened another way): its samples carry the enforced limit, and the
    worst of them the lowest (a card capped lower clocks lower); a binding or GPU without the query leaves it out.
    CUDA faked here."""
    import sys

    from scalelm.measure import monitor
    from scalelm.measure.baseline.gpu_health import open_health_reader, worst_health

    class FakeNvml:
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0, 1, 0
        limits = [700_000, 650_000]

        def __getattr__(self, name):  # every other query answers a number
            return lambda *args: 0 if "Reasons" in name else 1200

        def nvmlDeviceGetEnforcedPowerLimit(self, handle):
            return self.limits.pop(0)

    monkeypatch.setattr(monitor, "device_uuid", lambda device: "GPU-1")
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    reader = open_health_reader(torch.device("cuda", 0))
    samples = [reader(), reader()]
    assert [s["power_limit_w"] for s in samples] == [700.0, 650.0]
    assert worst_health(samples)["power_limit_w"] == 650.0
    assert "power_limit_w" not in worst_health([{**samples[0], "power_limit_w": None}])

    FakeNvml.limits = [700_000]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(gpu_mfu, "driver_version", lambda: "580.95.05")
    facts = gpu_mfu.machine(torch.device("cuda", 0), gpu_mfu.health_reader(torch.device("cuda", 0))[0])
    assert facts["card"] == "NVIDIA H100 80GB HBM3" and facts["driver"] == "580.95.05"
    assert facts["power_limit_w"] == 700.0 and facts["sm_clock_max_mhz"] == 1200
    assert facts["kernel"] == platform.release() and facts["torch"] == torch.__version__
