"""What scalelm writes and reads: secrets in the environment stay out of every file and log; a file that would run
code when loaded (a model, a checkpoint's metadata or entries) is refused, by name, and its code never runs; a
checkpoint or model that is not what its seal or record says is refused; nothing is written through a link."""

import json
import pickle
import re
import subprocess
import sys
from pathlib import Path, PosixPath

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import drills
from conftest import train_here
from scalelm.config import ModelConfig, OptimConfig
from scalelm.errors import CheckpointError, ConfigError
from scalelm.files import UnsafeFileError, append_text, sha256
from scalelm.model.transformer import TransformerLM
from scalelm.optim import build_optimizer
from scalelm.settings_yaml import from_mapping
from scalelm.train.checkpoint import FLAT, complete_checkpoints, load_weights, read_trainer_state, verify
from scalelm.train.consolidate import consolidate, load_consolidated
from scalelm.train.evaluation import main as evaluate
from scalelm.train.rundir import RunDir

SECRETS = {"WANDB_API_KEY": "wandb-key-0f3a9c", "HF_TOKEN": "hf_token_7d21e8", "AWS_SECRET_ACCESS_KEY": "aws-5b6c4d"}


def test_secrets_in_the_environment_are_never_written(tiny_config, monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    config = tiny_config("secret", parallel__strategy="ddp", train__max_steps=6, checkpoint__every=3)
    result = drills.run(config)
    assert result.returncode == 0, result.stdout[-3000:]
    run_dir = drills.run_dir_of(config)
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"run.json", "metrics.jsonl", "trainer.pt", ".metadata"}
    for path in files:
        content = path.read_bytes()
        for value in SECRETS.values():
            assert value.encode() not in content, (path, value)
    for value in SECRETS.values():
        assert value not in result.stdout + result.stderr


class RunsCode:
    """A pickled object whose loading would create a file: what a malicious model file could do."""

    def __init__(self, proof: Path):
        self.proof = proof

    def __reduce__(self):
        return (Path.touch, (self.proof,))


def test_a_model_file_holding_a_pickled_object_is_refused_and_not_run(tmp_path, prepared):
    proof = tmp_path / "code-ran"
    model = tmp_path / "model.pt"
    torch.save({"model": {}, "extra": RunsCode(proof)}, model)
    # its record's checksum matches: what is refused is the content
    (tmp_path / "model.pt.json").write_text(json.dumps({"sha256": sha256(model)}))
    out = tmp_path / "test.json"
    command = [
        sys.executable,
        "-m",
        "scalelm.train.evaluation",
        "--model",
        str(model),
        "--data",
        str(prepared),
        "--out",
        str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"error: {model} holds more than tensors and plain values and was not loaded" in result.stderr
    assert "Traceback" not in result.stderr
    assert not proof.exists() and not out.exists()


# ------------------------------------------------------------------------------------------- checkpoints
def model_of(checkpoint: Path):
    shape = dict(read_trainer_state(checkpoint).model_shape)
    config = from_mapping(ModelConfig, {k: v for k, v in shape.items() if k != "vocab_size"})  # (model.moe a section)
    model = TransformerLM(config, shape["vocab_size"])
    return model, build_optimizer(model, OptimConfig(), 1e-3)


def code_in_metadata(checkpoint: Path, proof: Path) -> None:
    (checkpoint / ".metadata").write_bytes(pickle.dumps(RunsCode(proof)))
    drills.reseal(checkpoint)


def code_in_an_entry(checkpoint: Path, proof: Path) -> None:
    """One parameter's learning rate replaced by an object: DCP stores non-tensor values as pickled entries."""
    model, optimizer = model_of(checkpoint)
    load_weights(checkpoint, model, optimizer)
    optim = get_optimizer_state_dict(model, optimizer, options=FLAT)
    optim[next(k for k in optim if k.endswith(".lr"))] = RunsCode(proof)
    for old in [*checkpoint.glob("*.distcp"), checkpoint / ".metadata"]:
        old.unlink()
    dcp.save({"model": get_model_state_dict(model), "optim": optim}, checkpoint_id=checkpoint, no_dist=True)
    drills.reseal(checkpoint)


def truncated(checkpoint: Path, proof: Path) -> None:
    [shard] = checkpoint.glob("*.distcp")
    with shard.open("r+b") as handle:
        handle.truncate(1000)


@pytest.mark.parametrize(
    "tamper, problem",
    [
        (code_in_metadata, r"\.metadata is damaged or holds more than it may .*pathlib\.Path\.touch is not among"),
        (code_in_an_entry, r"entry optim\.param_groups\.\S+\.lr of __0_0\.distcp holds more than plain values"),
        (truncated, r"__0_0\.distcp does not match its checksum \(truncated or corrupted\)"),
    ],
)
def test_a_tampered_checkpoint_is_refused_by_name_everywhere_and_its_code_never_runs(run_copy, tamper, problem, capsys):
    run_dir = drills.run_dir_of(run_copy)
    earlier, last = complete_checkpoints(run_dir / "checkpoints")
    proof = run_dir.parent / "code-ran"
    tamper(last, proof)
    assert re.search(problem, verify(last))
    # consolidation refuses it by name
    with pytest.raises(CheckpointError, match=rf"checkpoint {last} cannot be used: .*{problem}.*remove .*run.json"):
        consolidate(RunDir(run_dir))
    # read anyway, without the check, it still cannot run its code (or it is refused for being damaged)
    with pytest.raises((UnsafeFileError, CheckpointError, RuntimeError)):
        load_weights(last, *model_of(earlier))
    # training skips it, naming why, resumes from the one before and finishes
    capsys.readouterr()
    assert train_here(run_copy).results.steps == 20
    out = capsys.readouterr().out
    assert re.search(rf"skipping checkpoint {last}: .*{problem}", out) and "resumed from step 10" in out, out[-2000:]
    assert verify(last) is None  # written anew by the resumed run
    assert not proof.exists()


# ------------------------------------------------------------------------------------- the run directory
@pytest.mark.parametrize("name", [".write-test", "metrics.jsonl"])
def test_a_link_in_the_run_directory_is_refused_and_its_target_left_alone(run_copy, tmp_path, name):
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's file\n")
    link = drills.run_dir_of(run_copy) / name
    link.unlink(missing_ok=True)
    link.symlink_to(victim)
    with pytest.raises(ConfigError, match=rf"{link} is a symbolic link: scalelm writes nothing through links"):
        train_here(run_copy)
    assert victim.read_text() == "someone else's file\n"
    with pytest.raises(UnsafeFileError, match="is a symbolic link"):  # and the logger's own appends never follow one
        append_text(link, "{}\n")
    assert victim.read_text() == "someone else's file\n"


def test_evaluation_refuses_a_model_that_is_not_the_one_its_record_names(run_copy, prepared, capsys):
    run = RunDir(drills.run_dir_of(run_copy))
    consolidate(run)
    payload = torch.load(run.model, weights_only=True)
    payload["model"]["embed.weight"] += 1  # another model in the same place: its loss would go with the old checksum
    torch.save(payload, run.model)
    with pytest.raises(SystemExit) as exited:
        evaluate(["--model", str(run.model), "--data", str(prepared), "--out", str(run.test_result)])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert f"error: {run.model} does not match its record {run.model_meta} (sha256 " in error
    assert "consolidate the run again" in error and not run.test_result.exists()
    run.model_meta.unlink()
    with pytest.raises(CheckpointError, match=rf"{run.model_meta}, the record of model.pt's checksum, is missing"):
        load_consolidated(run.model)


class Reduces:
    """A pickled call: what a pickle may hold in place of any object."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return (self.call, self.args)

    def __call__(self, *args):  # pickle wants the call's function to be callable; it is never called here
        raise AssertionError("not to be called")


def test_metadata_may_name_an_enum_member_by_getattr_and_nothing_else_through_it(tmp_path):
    """Python pickles an enum member as getattr(Enum, name) (DCP's metadata holds one): that getattr is admitted
    for the members of an allowed enum only; a general one reaches any method of any class, and runs it."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from scalelm.files import load_pickle
    from scalelm.train.checkpoint import metadata_global

    path = tmp_path / "meta"
    member = _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    path.write_bytes(pickle.dumps([Reduces(getattr, _MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")]))
    assert load_pickle(path, metadata_global) == [member]
    victim = tmp_path / "victim.txt"
    writes = Reduces(Reduces(getattr, PosixPath, "write_text"), victim, "overwritten")  # an allowed class's method
    path.write_bytes(pickle.dumps(writes))
    with pytest.raises(UnsafeFileError, match="is not a member of an allowed enum"):
        load_pickle(path, metadata_global)
    assert not victim.exists()
