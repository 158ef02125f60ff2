"""Hostile resumes (issue 38): a finished run rerun for settings outside its identity keeps its record, a torn
metrics line never blocks a resume, and a checkpoint is resumed or consolidated only by the run that wrote it."""

import json
import shutil

import pytest
import torch

import drills
from conftest import run_dir_of, train_here
from scalelm.config import Devices
from scalelm.errors import CheckpointError, DataError
from scalelm.train.checkpoint import complete_checkpoints
from scalelm.train.consolidate import consolidate
from scalelm.train.metrics import MetricsLogger
from scalelm.train.record import read_metrics
from scalelm.train.rundir import RunDir

CPU = Devices(used="cpu", auto="cpu")


def evaluations(run: RunDir) -> list[tuple[str, int]]:
    return [(r["split"], r["step"]) for r in read_metrics(run.path) if r["kind"] == "eval"]


def train_steps(run: RunDir) -> list[int]:
    return [r["step"] for r in read_metrics(run.path) if r["kind"] == "train"]


def test_a_finished_run_rerun_for_staging_or_logging_keeps_its_record_and_retrains_nothing(run_copy, tmp_path, capsys):
    """data.stage and data.stage_dir only copy the same data elsewhere, and compiled or recomputed checkpoints are
    interchangeable with eager ones: outside the identity, also for a run an older scalelm trained, whose
    identity.json counted them and whose checkpoints carry that identity's lineage. A rerun of the finished run with
    them or the logging cadence changed is a no-op: run.json byte for byte (its start, end, wall time and
    environment), metrics.jsonl untouched, nothing in previous/; and so when Snakemake removed run.json before
    rerunning the job. Without the kept record (a stop during the final evaluation) the end's evaluations are redone
    once, not doubled, from the older scalelm's checkpoint; it consolidates too."""
    from scalelm.train.checkpoint import TRAINER_FILE
    from scalelm.train.rundir import lineage

    run = RunDir(run_dir_of(run_copy))
    record, metrics = run.record.read_text(), run.metrics.read_text()
    identity = json.loads(run.identity.read_text())  # as an older scalelm wrote it, and its checkpoints
    identity["settings"]["data"].update(stage="shm", stage_dir="/dev/shm/elsewhere")
    identity["settings"]["train"].update(compile=False, activation_checkpointing="none", engine="scalelm")
    run.identity.write_text(json.dumps(identity))
    for checkpoint in complete_checkpoints(run.checkpoints):
        trainer = torch.load(checkpoint / TRAINER_FILE, weights_only=True)
        torch.save({**trainer, "lineage": lineage(identity)}, checkpoint / TRAINER_FILE)
        drills.reseal(checkpoint)

    # compiled and eager checkpoints are interchangeable (scalelm.parallel.compile), and so are recomputed ones
    changed = ("train.log_every=7", "train.compile=true", "train.activation_checkpointing=full")
    train_here(run_copy, "data.stage=local", f"data.stage_dir={tmp_path / 'stage'}", *changed)
    out = capsys.readouterr().out
    assert "finished at step 20" in out and "nothing to train or evaluate" in out, out[-2000:]
    assert not run.previous.exists() and json.loads(run.identity.read_text()) == identity  # its lineage kept known
    assert run.record.read_text() == record and run.metrics.read_text() == metrics

    run.record.unlink()  # what Snakemake does before it reruns a job whose settings changed
    again = train_here(run_copy, "data.stage=none", "train.eval_batch_size=64")
    assert run.record.read_text() == record and run.metrics.read_text() == metrics and not run.previous.exists()
    assert again.start_time == json.loads(record)["start_time"]

    run.record.unlink()
    run.finished.unlink()  # no record kept: the end's evaluations are redone, each once
    assert evaluations(run).count(("validation", 20)) == 1
    redone = train_here(run_copy)
    assert evaluations(run).count(("validation", 20)) == 1 and evaluations(run).count(("test", 20)) == 1
    assert train_steps(run) == list(range(1, 21)) and redone.results.test == json.loads(record)["results"]["test"]
    assert consolidate(run)["step"] == 20


def test_a_torn_metrics_line_is_dropped_on_resume_and_a_damaged_one_is_named(run_copy, capsys):
    """A short write on a full disk leaves the last line of metrics.jsonl torn: the resume drops it and says so, and
    every step is logged once. A damaged line before the last is named with its number, never a JSONDecodeError.
    A run that starts afresh (no checkpoint to resume) drops the lines of the attempt before it."""
    run = RunDir(run_dir_of(run_copy))
    shutil.rmtree(complete_checkpoints(run.checkpoints)[-1])  # resumes from step 10
    run.record.unlink()
    with run.metrics.open("a") as handle:
        handle.write('{"time": 3.1, "kind": "tra')
    train_here(run_copy)
    out = capsys.readouterr().out
    assert "resumed from step 10" in out and f"dropped the incomplete last line of {run.metrics}" in out, out[-2000:]
    assert train_steps(run) == list(range(1, 21))

    lines = run.metrics.read_text().splitlines()
    run.metrics.write_text("\n".join([*lines[:3], lines[3][:25], *lines[4:]]) + "\n")
    damaged = rf"{run.metrics}, line 4, is not a complete JSON record"
    with pytest.raises(DataError, match=damaged):
        read_metrics(run.path)
    with pytest.raises(DataError, match=damaged):
        MetricsLogger(run.metrics, True, resume_step=10)

    run.metrics.write_text("\n".join(lines[:7]) + "\n")  # steps 1 to 7 of an attempt stopped before its checkpoint
    for path in (run.checkpoints, run.record):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    train_here(run_copy)
    assert train_steps(run) == list(range(1, 21))


def test_a_checkpoint_is_consolidated_and_resumed_only_as_what_its_contents_say(run_copy, tiny_config):
    """A checkpoint directory renamed by hand, or one of another seed, is refused by name by consolidation and by
    the resume, never taken on its name; a checkpoint beyond the run's steps (one written before checkpoints
    recorded their run) is one clear error."""
    run = RunDir(run_dir_of(run_copy))
    last = complete_checkpoints(run.checkpoints)[-1]
    renamed = last.rename(run.checkpoints / "step_00000030")
    with pytest.raises(CheckpointError, match=rf"{renamed} holds step 20.*rename it step_00000020 or remove it"):
        consolidate(run)
    with pytest.raises(CheckpointError, match=rf"{renamed} holds step 20"):
        train_here(run_copy)
    last = renamed.rename(last)

    trainer = torch.load(last / "trainer.pt", weights_only=True)
    torch.save({**trainer, "seed": 2}, last / "trainer.pt")
    drills.reseal(last)
    another_seed = rf"{last} was written by a run of seed 2, not of this run's seed 1"
    with pytest.raises(CheckpointError, match=another_seed):
        consolidate(run)
    with pytest.raises(CheckpointError, match=another_seed):
        train_here(run_copy)

    legacy = {k: v for k, v in trainer.items() if k not in ("seed", "lineage")}  # as scalelm wrote them before
    torch.save(legacy, last / "trainer.pt")
    drills.reseal(last)
    shorter = tiny_config("shorter", train__max_steps=15)
    shutil.copytree(last, run_dir_of(shorter) / "checkpoints" / last.name)
    with pytest.raises(CheckpointError, match=rf"{last.name} is at step 20, beyond the 15 steps of this run"):
        train_here(shorter)


def test_every_setting_declares_whether_it_belongs_to_a_runs_identity():
    """Run identity is declared on each setting's own field (scalelm.config.setting): a field that does not say fails
    here. What is trained is identity; where a run writes or stages, how often it reports or saves, how long it
    waits, how it compiles or recomputes and which engine runs the loop are not."""
    from scalelm.config import Config, leaf_fields, load_config
    from scalelm.train.rundir import identity

    for dotted, _, item in leaf_fields(Config()):
        assert isinstance(item.metadata.get("identity"), bool), f"{dotted}: say identity=True or False (setting)"
    settings = identity(load_config(None, []), {"train": "abc"}, 1, CPU)["settings"]
    kept = set()
    for section, values in settings.items():
        kept |= {f"{section}.{key}" for key in values} if isinstance(values, dict) else {section}
    outside = {"run_dir", "data.prepared_dir", "data.stage", "data.stage_dir", "train.log_every", "train.compile"}
    outside |= {"train.activation_checkpointing", "train.engine", "checkpoint.every", "parallel.timeout_s"}
    assert not kept & outside
    assert {"seed", "device", "optim.lr", "model.d_model", "data.seq_len", "train.precision", "parallel.tp"} <= kept
    # settings added since runs were recorded leave their identity as it was at their defaults (a dense model's runs
    # from before mixtures of experts resume), and join it when set
    assert not {"model.moe", "parallel.ep"} & kept
    mixture = load_config(None, ["model.moe={experts: 4}", "parallel.ep=2"])
    added = identity(mixture, {"train": "abc"}, 1, CPU)["settings"]
    assert added["model"]["moe"]["experts"] == 4 and added["parallel"]["ep"] == 2


def test_settings_that_train_alike_on_a_machine_are_one_identity_and_older_records_of_them_resume(tmp_path):
    """device cpu where auto picks the CPU, precision fp32 on a CPU (bf16 on CUDA) and parallel.ep 1 train as their
    defaults do: the same run, never retrained. An identity.json an older scalelm wrote with them spelt out is the
    run's too, its checkpoints' lineage kept known; elsewhere they stay apart."""
    from scalelm.config import Devices, load_config
    from scalelm.train.rundir import identity, lineage

    def of(*settings: str, here: Devices = CPU) -> dict:
        return identity(load_config(None, list(settings)), {"train": "abc"}, 1, here)

    default = of()
    assert of("device=cpu", "train.precision=fp32") == default
    assert of("model.moe={experts: 4}", "parallel.ep=1") == of("model.moe={experts: 4}")
    gpu = Devices("cuda", "cuda")
    assert of("train.precision=bf16", "device=cuda", here=gpu) == of(here=gpu)
    assert of("device=cpu", here=Devices("cpu", "cuda")) != of(here=gpu)  # the CPU of a GPU machine: another run
    assert of("train.precision=bf16_params", here=gpu) != of(here=gpu)

    run = RunDir(tmp_path / "run")
    older = of()
    older["settings"].update(device="cpu")
    older["settings"]["train"]["precision"] = "fp32"
    run.path.mkdir()
    run.identity.write_text(json.dumps(older))
    run.metrics.write_text('{"kind": "train", "step": 1}\n')
    run.start(default, CPU)
    assert json.loads(run.identity.read_text()) == older and not run.previous.exists() and run.metrics.stat().st_size
    assert run.lineages(default, CPU) == {lineage(default), lineage(older)}


def test_a_checkpoints_lineage_leaves_out_the_layout_and_the_staging_but_not_the_seed():
    """Any checkpoint loads into any layout and world size (tests/test_training.py): the lineage a checkpoint records
    is the run's identity less its layout; staging is in neither; the seed, the settings and the data are."""
    from scalelm.config import load_config
    from scalelm.train.rundir import identity, lineage

    def of(world_size: int, *settings: str, data: str = "abc") -> tuple[dict, str]:
        run_identity = identity(load_config(None, list(settings)), {"train": data}, world_size, CPU)
        return run_identity, lineage(run_identity)

    single, ddp = of(1), of(2, "parallel.strategy=ddp", "data.stage=shm", "data.stage_dir=/dev/shm/x")
    assert single[0] != ddp[0] and single[1] == ddp[1]
    assert of(1, "data.stage=local")[0] == single[0]
    assert {of(1, "seed=2")[1], of(1, "optim.lr=1e-3")[1], of(1, data="abd")[1]}.isdisjoint({single[1]})


def test_a_training_aimed_at_a_directory_that_is_no_run_leaves_it_alone(tiny_config, tmp_path):
    """A directory without identity.json is someone's (a project, the current directory): if it holds a name a run
    writes, the training is refused naming them, before it writes anything there (not even its lock)."""
    from scalelm.errors import ConfigError

    mine = tmp_path / "project"
    mine.mkdir()
    files = {"config.yaml": "mine: 1\n", "metrics.jsonl": '{"step": 3}\n', "notes.txt": "keep\n"}
    for name, text in files.items():
        (mine / name).write_text(text)
    (mine / "checkpoints").mkdir()
    (mine / "checkpoints" / "model.bin").write_bytes(b"weights")
    with pytest.raises(
        ConfigError,
        match=rf"run_dir {mine} is not a scalelm run directory \(it has no identity.json\) "
        r"but holds checkpoints, metrics.jsonl, config.yaml, which a training would",
    ):
        train_here(tiny_config(), f"run_dir={mine}")
    assert sorted(p.name for p in mine.iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl", "notes.txt"]
    assert all((mine / name).read_text() == text for name, text in files.items())
    assert [p.name for p in (mine / "checkpoints").iterdir()] == ["model.bin"]
    # but a checkpoint brought into a new directory, to be resumed there (by another layout), is a run's own
    brought = RunDir(tmp_path / "brought")
    (brought.checkpoints / "step_00000010").mkdir(parents=True)
    brought.start({"settings": {}})
    (brought.checkpoints / "mine.txt").write_text("not a checkpoint\n")
    brought.identity.unlink()
    with pytest.raises(ConfigError, match=r"but holds checkpoints, which a training would replace"):
        brought.start({"settings": {}})
