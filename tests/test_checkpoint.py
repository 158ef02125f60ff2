"""Checkpoints that can be trusted: damaged ones are skipped, other models are refused, NaN never overwrites."""

import math
import shutil

import pytest
import torch

import drills
from conftest import run_dir_of, run_train
from scalelm.config import ModelConfig, OptimConfig
from scalelm.errors import CheckpointError
from scalelm.model.transformer import TransformerLM
from scalelm.parallel.env import DistEnv
from scalelm.train.checkpoint import FORMAT, Checkpointer, Origin, TrainerState, complete_checkpoints, verify
from scalelm.train.optim import build_optimizer, build_scheduler


def test_damaged_latest_checkpoint_is_skipped_and_the_run_redone_identically(tiny_config, tmp_path):
    config = tiny_config("run", model__dropout=0.1)
    run_train(config)
    run_dir = run_dir_of(config)
    steps = complete_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in steps] == ["step_00000010", "step_00000020"]
    reference = drills.final_weights(config, tmp_path / "reference.pt")
    [shard] = steps[-1].glob("*.distcp")
    with shard.open("r+b") as handle:  # a write cut short
        handle.truncate(1000)
    result = run_train(config)
    assert "skipping checkpoint" in result.stdout and "does not match its checksum" in result.stdout
    assert "resumed from step 10" in result.stdout
    redone = drills.final_weights(config, tmp_path / "redone.pt")
    assert all(torch.equal(reference[k], redone[k]) for k in reference)

    # killed between the marker and the rename: the .partial copy, marker and all, is not a checkpoint
    shutil.copytree(steps[-1], run_dir / "checkpoints/step_00000030.partial")
    assert [p.name for p in complete_checkpoints(run_dir / "checkpoints")] == ["step_00000010", "step_00000020"]


ENV = DistEnv(0, 0, 1, torch.device("cpu"))
ORIGIN = Origin(seed=1, lineage="0123456789abcdef")


def parts(d_model):
    model = TransformerLM(ModelConfig(d_model=d_model, n_heads=2, n_layers=1, d_ff=16), 50)
    optimizer = build_optimizer(model, OptimConfig(), 1e-3)
    return model, optimizer, build_scheduler(optimizer, OptimConfig(), 10)


def test_checkpoint_of_another_model_is_refused_naming_the_setting(tmp_path):
    checkpointer = Checkpointer(tmp_path, ENV, keep=2, origin=ORIGIN)
    model, optimizer, scheduler = parts(16)
    checkpointer.save(model, optimizer, scheduler, TrainerState(step=3, model_shape={"d_model": 16, "vocab_size": 50}))
    with pytest.raises(CheckpointError, match=r"d_model: checkpoint 16, config 32"):
        checkpointer.resume(*parts(32), {"d_model": 32, "vocab_size": 50})
    # a checkpoint of another format (a later scalelm's, say) is refused by name, never skipped and overwritten
    [saved] = complete_checkpoints(tmp_path)
    trainer = torch.load(saved / "trainer.pt", weights_only=True)
    torch.save({**trainer, "format": FORMAT + 1}, saved / "trainer.pt")
    drills.reseal(saved)
    refused = rf"step_00000003 is of checkpoint format {FORMAT + 1}; this scalelm reads format {FORMAT}"
    with pytest.raises(CheckpointError, match=refused):
        checkpointer.resume(*parts(16), {"d_model": 16, "vocab_size": 50})


def test_a_checkpoint_is_resumed_only_by_its_run_and_never_holds_non_finite_weights(tmp_path):
    """The checkpointer itself (both engines save through it) refuses non-finite weights, or a non-finite loss not yet
    logged, writing nothing. A checkpoint records its step, seed and lineage (the run's identity less its layout):
    one whose directory was renamed, of another seed or of other settings is refused by name, never resumed; so is
    a trainer.pt without its keys."""
    model, optimizer, scheduler = parts(16)
    shape = {"d_model": 16, "vocab_size": 50}
    checkpointer = Checkpointer(tmp_path, ENV, keep=2, origin=ORIGIN)
    with torch.no_grad():
        next(model.parameters())[0] = float("inf")
    refused = r"non-finite loss or weights at step 3 on rank\(s\) \[0\]; not checkpointing, the last good checkpoint"
    with pytest.raises(CheckpointError, match=refused):
        checkpointer.save(model, optimizer, scheduler, TrainerState(step=3, model_shape=shape))
    model, optimizer, scheduler = parts(16)
    with pytest.raises(CheckpointError, match=refused):
        checkpointer.save(model, optimizer, scheduler, TrainerState(step=3, model_shape=shape), torch.tensor(math.nan))
    assert not any(tmp_path.iterdir())

    saved = checkpointer.save(model, optimizer, scheduler, TrainerState(step=3, model_shape=shape))
    renamed = saved.rename(tmp_path / "step_00000009")
    with pytest.raises(CheckpointError, match=rf"{renamed} holds step 3, not the step its name says"):
        checkpointer.resume(*parts(16), shape)
    renamed.rename(saved)
    for seed, lineage, refused in (
        (2, ORIGIN.lineage, rf"{saved} was written by a run of seed 1, not of this run's seed 2"),
        (1, "fedcba9876543210", rf"{saved} was written by a run of other settings or data"),
    ):
        with pytest.raises(CheckpointError, match=refused):
            Checkpointer(tmp_path, ENV, keep=2, origin=Origin(seed, lineage)).resume(*parts(16), shape)
    assert checkpointer.resume(*parts(16), shape).step == 3

    torch.save({"format": FORMAT, "state": {"step": 3}}, saved / "trainer.pt")
    drills.reseal(saved)
    with pytest.raises(CheckpointError, match=rf"{saved / 'trainer.pt'} lacks rng, scheduler: it is damaged"):
        checkpointer.resume(*parts(16), shape)


def test_non_finite_weights_are_never_checkpointed_and_the_good_run_is_kept(tiny_config, tmp_path):
    config = tiny_config("nan", checkpoint__every=1)
    run_train(config, 1, "train.max_steps=5")
    run_dir = run_dir_of(config)
    # a learning rate near float32's limit: the weights explode within two steps
    result = run_train(config, 1, "train.max_steps=5", "optim.lr=1e37", check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "non-finite" in result.stderr and "on rank(s) [0]" in result.stderr, result.stderr[-2000:]
    for checkpoint in complete_checkpoints(run_dir / "checkpoints"):
        weights = drills.checkpoint_weights(checkpoint)
        assert all(w.isfinite().all() for w in weights.values()), checkpoint
    # the earlier run (other settings) was moved aside, not lost
    kept = complete_checkpoints(run_dir / "previous" / "checkpoints")
    assert kept and verify(kept[-1]) is None


def test_yaml_style_numbers_are_accepted():
    from scalelm.config import load_config

    assert load_config(None, ["optim.lr=1e-3"]).optim.lr == 1e-3
