"""train.engine: lightning (scalelm.train.lightning_engine): Lightning's DDP trains like scalelm's, with scalelm's DDP
options, checkpointing, compilation, watchdog and measurements; it resumes after a stop signal, and the run it leaves
reads like any other; clear errors without the extra or with another layout."""

import builtins
import re

import pytest
import torch
import torch.distributed as dist

import drills
from conftest import run_dir_of, run_train, train_command, train_here, train_losses
from scalelm.config import load_config
from scalelm.errors import ConfigError
from scalelm.parallel.layout import resolve_layout
from scalelm.train.record import read_metrics, read_record

DDP = {"parallel__strategy": "ddp"}
LIGHTNING = {**DDP, "train__engine": "lightning"}
# both engines with gradient accumulation (2 micro-batches per rank), clipping and dropout
PARITY = {"batch__micro_size": 4, "optim__grad_clip": 0.5, "model__dropout": 0.1}
TOLERANCE = 1e-5  # relative, per logged step: measured 0 (bitwise) on CPU with gloo, see docs/benchmarks.md


def relative_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def evals(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r["kind"] == "eval"]


@pytest.mark.slow
def test_lightning_ddp_trains_like_scalelm_ddp_and_its_run_reads_like_one(tiny_config, tmp_path):
    """2 processes, 20 steps of the tiny model with 2 micro-batches per rank, clipping and dropout: the same loss at
    every step and the same exact evaluations; run.json is a scalelm record, the last checkpoint consolidates to
    model.pt, and the report reads the run."""
    from scalelm.report.aggregate import read_run
    from scalelm.train.consolidate import consolidate
    from scalelm.train.evaluation import main as evaluate_main
    from scalelm.train.rundir import RunDir

    ddp, lightning = tiny_config("ddp", **DDP, **PARITY), tiny_config("lightning", **LIGHTNING, **PARITY)
    run_train(ddp, 2)
    run_train(lightning, 2, launcher="torchrun")  # Lightning reads torchrun's environment
    theirs, ours = train_losses(run_dir_of(lightning)), train_losses(run_dir_of(ddp))
    assert len(theirs) == 20
    assert relative_gap(theirs, ours) <= TOLERANCE
    for mine, ref in zip(evals(run_dir_of(lightning)), evals(run_dir_of(ddp)), strict=True):
        assert (mine["split"], mine["step"], mine["tokens"]) == (ref["split"], ref["step"], ref["tokens"])
        assert abs(mine["loss"] - ref["loss"]) / ref["loss"] <= TOLERANCE

    record = read_record(run_dir_of(lightning))
    assert record.world_size == 2 and record.results.steps == 20 and record.results.layout == "2x1x1x1"
    assert record.parallel["engine"].startswith("lightning ")
    assert record.results.mfu > 0 and record.results.comm["steps"] == [19, 20]  # profiled around Lightning's steps
    assert record.results.test["tokens"] == read_record(run_dir_of(ddp)).results.test["tokens"]

    run = RunDir(run_dir_of(lightning))
    meta = consolidate(run)
    assert meta["step"] == 20
    evaluate_main(
        [
            "--model",
            str(run.model),
            "--data",
            str(load_config(lightning).data.prepared_dir),
            "--out",
            str(run.test_result),
        ]
    )
    row = read_run(run).figures
    assert row["strategy"] == "ddp" and row["steps"] == 20 and row["tokens_per_s"] > 0
    assert row["test_loss"] == pytest.approx(record.results.test["loss"], rel=1e-5)


@pytest.mark.slow
def test_lightning_run_stopped_by_a_signal_resumes_to_the_same_end(tiny_config, tmp_path):
    """Dropout on, cosine schedule: a stop signal after step 6 (torchrun passes SIGTERM on, as scalelm's supervisor
    passes Slurm's SIGUSR1): the ranks agree on a step, checkpoint and exit 75; the same command resumes and ends
    bitwise where an uninterrupted run ends (weights and every logged loss)."""
    settings = dict(LIGHTNING, model__dropout=0.1, optim__schedule="cosine", optim__warmup_steps=3)
    straight, broken = tiny_config("straight", **settings), tiny_config("broken", **settings)
    run_train(straight, 2, launcher="torchrun")
    status, stderr = drills.interrupt_after_step(train_command(broken, 2), run_dir_of(broken), step=6)
    # torchrun passes SIGTERM on to its workers, which checkpoint and exit 75; torchrun then reports the failure
    assert status != 0 and "stopped by a signal" in stderr, stderr[-3000:]
    assert not (run_dir_of(broken) / "run.json").exists()
    resumed = run_train(broken, 2, launcher="torchrun")
    assert "resumed from step" in resumed.stdout
    a, b = drills.final_weights(straight, tmp_path / "a.pt"), drills.final_weights(broken, tmp_path / "b.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert train_losses(run_dir_of(broken)) == train_losses(run_dir_of(straight))


def test_lightning_errors_are_clear(tiny_config, monkeypatch):
    """Without the extra: the value and the fix; with a layout that is not DDP: the degree and what to do."""
    from scalelm.train.run import engine_for as engine

    real_import = builtins.__import__

    def no_lightning(name, *args, **kwargs):
        if name == "lightning" or name.startswith("lightning."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_lightning)
    with pytest.raises(
        ConfigError, match=r"train.engine=lightning needs the optional extra: pip install 'scalelm\[lightning\]'"
    ):
        engine(load_config(tiny_config("missing", **LIGHTNING)))
    monkeypatch.setattr(builtins, "__import__", real_import)
    for settings, world, name in ((["parallel.tp=2"], 2, "tp (tp 2)"), (["parallel.strategy=fsdp"], 2, "fsdp")):
        config = load_config(None, ["train.engine=lightning", *settings])
        with pytest.raises(ConfigError, match=rf"train.engine=lightning runs DDP only, not {re.escape(name)}"):
            resolve_layout(config, world, world)  # where every layout is checked: the trainer, the workflow, the plan
    # several at once are named at once, not one per attempt
    settings = [
        "parallel.tp=2",
        "model.moe={experts: 2}",
        "train.compile_optimizer=true",
        "train.attention_kernels=auto",
    ]
    with pytest.raises(ConfigError) as refused:
        resolve_layout(load_config(None, ["train.engine=lightning", *settings]), 2, 2)
    message = str(refused.value)
    assert message.startswith("train.engine=lightning refuses 4 things in these settings: (1) train.engine=lightning")
    for named in (
        "(1) train.engine=lightning runs DDP only, not tp",
        "(2) model.moe is",
        "(3) train.compile_optimizer",
        "(4) train.attention_kernels=auto",
    ):
        assert named in message, message


def test_lightning_never_checkpoints_non_finite_weights(tiny_config):
    """A learning rate that diverges, a checkpoint every step, logging too rare to see the loss: the checkpoint's own
    check (the one scalelm's engine goes through) refuses the first non-finite weights, naming the step and rank; every
    checkpoint left is finite, so the rerun never resumes from NaN."""
    from scalelm.train.checkpoint import complete_checkpoints

    config = tiny_config("nan", train__engine="lightning", checkpoint__every=1, checkpoint__keep=2)
    result = run_train(
        config, 1, "train.max_steps=5", "train.log_every=10", "optim.lr=1e37", check=False, launcher="torchrun"
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "non-finite loss or weights at step" in result.stderr and "on rank(s) [0]" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    for checkpoint in complete_checkpoints(run_dir_of(config) / "checkpoints"):
        assert all(w.isfinite().all() for w in drills.checkpoint_weights(checkpoint).values()), checkpoint


@pytest.fixture
def one_rank_group(monkeypatch):
    """A process group of one rank (gloo) in this process, with torchrun's environment as Lightning reads it."""
    for name, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29599",
    }.items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_lightning_ddp_has_scalelms_ddp_options(one_rank_group):
    """Review 2, finding 8: the DDP Lightning wraps the model in is the one scalelm.parallel.data.apply_ddp builds: no
    buffer broadcast before each forward, gradients as views into the buckets, the same buckets and graph options."""
    import lightning as L
    from lightning.pytorch.plugins.environments import TorchElasticEnvironment
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from scalelm.parallel.data import apply_ddp
    from scalelm.train.lightning_engine import ddp_strategy

    wrappers = []

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
            self.register_buffer("table", torch.ones(4))

        def training_step(self, batch, batch_idx):
            wrappers.append(self.trainer.strategy.model)  # Lightning unwraps the model when the fit ends
            return self.layer(batch * self.table).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ddp_strategy(torch.device("cpu")),
        max_steps=1,
        plugins=[TorchElasticEnvironment()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), train_dataloaders=iter([torch.ones(2, 4)]))
    (theirs,) = wrappers
    ours = apply_ddp(
        torch.nn.Linear(4, 1), init_device_mesh("cpu", (1,), mesh_dim_names=("dp_replicate",)), torch.device("cpu")
    )
    assert isinstance(theirs, DistributedDataParallel)
    assert theirs.broadcast_buffers is False and theirs.gradient_as_bucket_view is True
    options = (
        "broadcast_buffers",
        "gradient_as_bucket_view",
        "bucket_bytes_cap",
        "find_unused_parameters",
        "static_graph",
        "mixed_precision",
    )
    assert {o: getattr(theirs, o) for o in options} == {o: getattr(ours, o) for o in options}


def test_lightning_trains_scalelms_model_watched_and_measured(tiny_config, monkeypatch):
    """Review 2, finding 9: Lightning trains the model scalelm's trainer would: activation checkpointing wraps every
    block (the loss unchanged) and compile reaches apply_compile after it (recorded, not compiled: CPU compiles
    are slow); every optimizer step runs under the hang watchdog; the metrics and run.json have MFU and energy."""
    from scalelm.hang.watchdog import Watchdog
    from scalelm.parallel import activation_checkpoint, runtime

    compiled, checkpoints, watched = [], [], []
    monkeypatch.setattr(runtime, "apply_compile", lambda model, device, mode="default": compiled.append(model))
    real_checkpoint, real_watching = activation_checkpoint.checkpoint, Watchdog.watching

    def counted_checkpoint(*args, **kwargs):
        checkpoints.append(1)
        return real_checkpoint(*args, **kwargs)

    def recorded_watching(self, step):
        watched.append(step)
        return real_watching(self, step)

    monkeypatch.setattr(activation_checkpoint, "checkpoint", counted_checkpoint)
    monkeypatch.setattr(Watchdog, "watching", recorded_watching)
    short = {"train__engine": "lightning", "train__max_steps": 4, "batch__micro_size": 8}  # 2 micro-batches a step
    plain = tiny_config("plain", **short)
    wrapped = tiny_config("wrapped", **short, train__activation_checkpointing="full", train__compile=True)
    train_here(plain)
    assert (compiled, checkpoints, watched) == ([], [], [1, 2, 3, 4])
    watched.clear()
    record = train_here(wrapped)

    (model,) = compiled
    blocks = list(model.blocks.values())
    assert blocks and all(b.activation_checkpointing == "full" for b in blocks)
    assert len(checkpoints) >= 4 * 2 * len(blocks)  # every block of every micro-batch went through checkpoint
    assert watched == [1, 2, 3, 4]
    assert train_losses(run_dir_of(wrapped)) == train_losses(run_dir_of(plain))
    train = [r for r in read_metrics(run_dir_of(wrapped)) if r["kind"] == "train"]
    assert len(train) == 4 and all(r["mfu"] > 0 and "energy_j" in r and r["data_share"] >= 0 for r in train)
    results = record.results
    assert results.mfu > 0 and results.peak_flops_per_device > 0 and results.flops_per_token > 0
    assert results.energy is not None and {"joules", "source", "unknown"} <= results.energy.keys()
    assert results.state_mb_per_rank["total"] > 0 and results.plan_mb_per_rank and record.host_load
