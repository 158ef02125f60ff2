"""Checkpoints that can be trusted: damaged ones are skipped, other models are refused, NaN never overwrites."""

import json
import math
import shutil

import pytest
import torch
import yaml

import drills
import scalelm.config
from conftest import run_dir_of, run_train, train_here
from scalelm.config import ModelConfig, OptimConfig
from scalelm.errors import CheckpointError
from scalelm.model.transformer import TransformerLM
from scalelm.optim import build_optimizer, build_scheduler
from scalelm.parallel.env import DistEnv
from scalelm.train.checkpoint import FORMAT, Checkpointer, Origin, TrainerState, complete_checkpoints, verify


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
    refused = (
        r"non-finite loss or weights at step 3 on rank\(s\) \[0\]; not checkpointing, the run has no checkpoint yet"
    )
    with pytest.raises(CheckpointError, match=refused):
        checkpointer.save(model, optimizer, scheduler, TrainerState(step=3, model_shape=shape))
    model, optimizer, scheduler = parts(16)
    with pytest.raises(CheckpointError, match=refused):
        checkpointer.save(model, optimizer, scheduler, TrainerState(step=3, model_shape=shape), torch.tensor(math.nan))
    assert not any(tmp_path.iterdir())

    saved = checkpointer.save(model, optimizer, scheduler, TrainerState(step=3, model_shape=shape))
    kept = rf"non-finite loss or weights at step 4 .*, the last good checkpoint stays in {saved}\. Lower optim.lr or"
    with pytest.raises(CheckpointError, match=kept):
        checkpointer.save(model, optimizer, scheduler, TrainerState(step=4, model_shape=shape), torch.tensor(math.nan))
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


def test_a_gradient_norm_that_overflows_stops_the_run_at_its_log_line_naming_the_steps(tiny_config, monkeypatch):
    """A load-balancing loss weighted 1e30 (past the limit training refuses, lifted here) overflows the gradients'
    norm while the loss and the weights stay finite (AdamW normalises the step): a silent failure, unless every
    step's norm is checked (without a sync per step)."""
    from conftest import train_here
    from scalelm.train.engine import TrainingError

    monkeypatch.setattr(scalelm.config, "ROUTER_COEF_LIMIT", math.inf)
    config = tiny_config("overflow", model__moe={"experts": 2, "top_k": 1, "aux_loss_coef": 1e30})
    refused = r"non-finite gradient norm at 2 of the 2 steps up to step 2 \(the last: inf\): the gradients overflow;"
    with pytest.raises(TrainingError, match=rf"{refused} .* Lower optim.lr, or model.moe.aux_loss_coef \(1e\+30\)"):
        train_here(config, "train.max_steps=4", "train.log_every=2")


def test_an_overflow_names_the_router_weights_that_are_set_and_no_checkpoint_before_the_first(tiny_config, monkeypatch):
    """Issue 66: a z-loss weighted 1e30 (lifted past the limit) stops the run at its first step naming the z-loss's
    weight, not the aux loss's that its balance leaves out, and no checkpoints directory, which does not exist yet."""
    from conftest import train_here
    from scalelm.train.engine import TrainingError

    monkeypatch.setattr(scalelm.config, "ROUTER_COEF_LIMIT", math.inf)
    config = tiny_config("z", model__moe={"experts": 2, "top_k": 1, "balance": "none", "z_loss_coef": 1e30})
    with pytest.raises(TrainingError) as stopped:
        train_here(config, "train.max_steps=2")
    message = str(stopped.value)
    assert "up to step 1 (the last: inf)" in message and message.endswith(
        "; the run has no checkpoint yet. Lower optim.lr, or model.moe.z_loss_coef (1e+30)"
    )
    assert "aux_loss_coef" not in message and not (run_dir_of(config) / "checkpoints").exists()


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


def test_consolidation_builds_only_the_model_the_run_trained(run_copy):
    """consolidate builds the model config.yaml describes only once what it reads there (model, data, seed) is what
    identity.json records (which the checkpoint's lineage vouches for): an edit that changes the function (the norm's
    place) or the tensors (a width, a mixture of experts) is refused naming the setting, never built into another
    model nor called a damaged checkpoint; the other settings may differ (issue 49)."""
    from scalelm.config import set_dotted
    from scalelm.errors import ConfigError
    from scalelm.train.consolidate import consolidate
    from scalelm.train.rundir import RunDir

    run = RunDir(run_dir_of(run_copy))
    written = yaml.safe_load(run.config.read_text())
    for key, value, shown in (
        ("model.norm", "pre", "model.norm 'pre' there, 'post' in identity.json"),
        ("model.d_ff", 32, "model.d_ff 32 there, 64 in identity.json"),
        ("model.moe", {"experts": 2}, "model.moe {'experts': 2, .* there, None in identity.json"),
        ("seed", 2, "seed 2 there, 1 in identity.json"),  # not the checkpoint's fault
    ):
        edited = yaml.safe_load(yaml.safe_dump(written))
        set_dotted(edited, key, value)
        run.config.write_text(yaml.safe_dump(edited))
        with pytest.raises(
            ConfigError, match=rf"{run.config} does not describe the model this run trained \({shown}\)"
        ):
            consolidate(run)
    assert not run.model.exists()
    written["train"].update(log_every=7, precision="fp32")  # what does not build the model (fp32: auto on a CPU)
    run.config.write_text(yaml.safe_dump(written))
    assert consolidate(run)["step"] == 20


def test_a_metrics_line_without_a_step_number_stops_a_resume_naming_it(tmp_path):
    """A metrics record a resume cannot place (no step, or a step that is not a number) is a damaged line as a line
    that is no JSON is: named with the file and its number, also as the last line (a complete record is no write cut
    short), never a KeyError or TypeError (issue 49)."""
    from scalelm.errors import DataError
    from scalelm.train.metrics import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    good = json.dumps({"kind": "train", "step": 1, "loss": 5.0})
    for bad in ({"kind": "train"}, {"kind": "eval", "step": "3"}, {"kind": "train", "step": None}):
        for text in (f"{good}\n{json.dumps(bad)}\n{good}\n", f"{good}\n{json.dumps(bad)}"):
            path.write_text(text)
            damaged = rf"^{path}, line 2, is a record without a step number .*: the file is damaged; repair or delete"
            with pytest.raises(DataError, match=damaged):
                MetricsLogger(path, True, resume_step=1)
    path.write_text(f"{good}\n{good[:20]}")  # a write cut short is still dropped
    MetricsLogger(path, True, resume_step=1)
    assert path.read_text() == f"{good}\n"


def test_a_finished_run_rerun_with_other_measurement_settings_names_what_its_record_does_not_reflect(run_copy, capsys):
    """train.peak_tflops, train.comm_profile_steps and train.monitor_interval_s are outside the identity: a rerun of
    the finished run with them changed restores run.json byte for byte, says which settings it was measured with
    instead (where its files lie is none of them), and writes config.yaml with the settings of now, from which the
    report takes the peak for MFU (issue 49)."""
    from scalelm.report.aggregate import peak_now
    from scalelm.train.record import read_record
    from scalelm.train.rundir import RunDir

    run = RunDir(run_dir_of(run_copy))
    record = run.record.read_text()
    train_here(run_copy, "train.peak_tflops=50", "train.comm_profile_steps=0", "train.monitor_interval_s=2")
    out = capsys.readouterr().out
    assert "restored as it finished" in out and run.record.read_text() == record, out[-2000:]
    line = next(line for line in out.splitlines() if "was measured with" in line)
    assert line == (
        f"{run.record} was measured with train.comm_profile_steps 2 (now 0), train.monitor_interval_s 0.0 (now 2.0), "
        "train.peak_tflops null (now 50.0); the report takes MFU from train.peak_tflops 50.0: to measure with the "
        "settings of now, train the run afresh in another run_dir"
    ), line
    assert peak_now(run, read_record(run.path)) == 50e12 != read_record(run.path).results.peak_flops_per_device
