"""Outputs never replace what is not theirs: a file output never replaces a directory or an input of its command, a
directory output replaces only a directory scalelm wrote for it, and data staging names the file at fault and leaves
no half copy behind (issue 38)."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import run_dir_of
from scalelm.data import stage
from scalelm.errors import DataError, ScaleLMError
from scalelm.files import atomic_path, atomic_write_text, partial_of
from scalelm.parallel.env import DistEnv


def tree(path: Path) -> dict[str, bytes | None]:
    """Every file and directory under `path` with its contents (None: a directory), to show nothing changed."""
    return {str(p.relative_to(path)): None if p.is_dir() else p.read_bytes() for p in sorted(path.rglob("*"))}


def foreign_directory(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "thesis.tex").write_text("years of work")
    return path


def refused(main, argv: list[str], capsys) -> str:
    """The one error line of a command-line entry point that refused its arguments (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def test_a_file_never_replaces_a_directory_nor_a_directory_a_file(tmp_path):
    """The rule at the root (scalelm.files), for every writer: a file written whole is refused where a directory
    stands (or where its `.partial` is a directory, which is not scalelm's), before anything is written; a file or
    directory built in `.partial` replaces only its own kind, and the refused `.partial` goes."""
    mine = foreign_directory(tmp_path / "mine")
    before = tree(mine)
    with pytest.raises(
        ScaleLMError,
        match=rf"^{mine} is a directory: writing a file in its place would delete it; "
        "choose a file path",
    ):
        atomic_write_text(mine, "{}")
    held = foreign_directory(tmp_path / "out.json.partial")
    with pytest.raises(ScaleLMError, match=rf"^{held} is a directory, not a file scalelm left: .*move it"):
        atomic_write_text(tmp_path / "out.json", "{}")
    assert not (tmp_path / "out.json").exists()
    with pytest.raises(ScaleLMError, match=rf"^{mine} is a directory: writing a file in its place would delete it"):
        with atomic_path(mine) as partial:  # a file built first (an image, an autopsy): refused when it is put there
            partial.write_bytes(b"model")
    assert not partial_of(mine).exists()
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ScaleLMError, match=rf"^{tmp_path / 'notes.txt'} is a file: writing a directory in its place"):
        with atomic_path(tmp_path / "notes.txt") as partial:
            partial.mkdir()
    assert tree(mine) == before and (tmp_path / "notes.txt").read_text() == "mine"
    assert not partial_of(tmp_path / "notes.txt").exists() and (held / "thesis.tex").is_file()
    # their own kind is still replaced: a file by a file, a directory by a directory
    atomic_write_text(tmp_path / "notes.txt", "new")
    with atomic_path(tmp_path / "built") as partial:
        partial.mkdir()
    with atomic_path(tmp_path / "built") as partial:
        partial.mkdir()
        (partial / "second").write_text("2")
    assert (tmp_path / "notes.txt").read_text() == "new" and tree(tmp_path / "built") == {"second": b"2"}


def test_consolidate_and_evaluate_refuse_an_out_that_is_a_directory_or_an_input(run_copy, prepared, capsys):
    """`consolidate --out` the run directory (or a file of the run: its record, its settings, the `.json` beside
    the model) and `evaluate --out` a directory, the model, its record or a file of the data: each refused by name,
    before any work, and the run and the data are intact."""
    from scalelm.train.consolidate import main as consolidate
    from scalelm.train.evaluation import main as evaluate

    run = run_dir_of(run_copy)
    (run / "results").mkdir()
    before, data_before = tree(run), tree(prepared)
    for out, reason in [
        (run, rf"--out {run} is the run directory {run}"),
        (run.parent, rf"--out {run.parent} holds the run directory {run}"),
        (run / "config.yaml", rf"--out {run / 'config.yaml'} is the run's config.yaml"),
        (run / "run", rf"{run / 'run.json'} is the run's run.json"),  # the model's record beside it: `<out>.json`
        (run / "checkpoints" / "model.pt", rf"lies inside the run's checkpoints {run / 'checkpoints'}"),
    ]:
        err = refused(consolidate, ["--run-dir", str(run), "--out", str(out)], capsys)
        assert re.search(reason, err), err
        assert "choose another --out" in err
    assert tree(run) == before

    consolidate(["--run-dir", str(run), "--out", str(run / "results" / "model.pt")])
    model = run / "results" / "model.pt"
    capsys.readouterr()
    before = tree(run)
    for out, reason in [
        (run / "results", rf"{run / 'results'} is a directory: writing a file in its place would delete it"),
        (model, rf"--out {model} is --model {model}"),
        (Path(f"{model}.json"), rf"--out {model}.json is the model's record {model}.json"),
        (prepared, rf"{prepared} is a directory"),
        (prepared / "manifest.json", rf"--out {prepared / 'manifest.json'} lies inside --data {prepared}"),
    ]:
        args = ["--model", str(model), "--data", str(prepared), "--out", str(out)]
        err = refused(evaluate, args, capsys)
        assert re.search(reason, err), err
    assert tree(run) == before and tree(prepared) == data_before
    evaluate(["--model", str(model), "--data", str(prepared), "--out", str(run / "results" / "test.json")])
    assert json.loads((run / "results" / "test.json").read_text())["tokens"] > 0
    for _ in range(2):  # the default, the run's model.pt, and again: an earlier model.pt is its own
        consolidate(["--run-dir", str(run)])
    assert json.loads((run / "model.pt.json").read_text())["model"] == str(run / "model.pt")


def test_an_evaluation_writes_over_no_run_file_no_data_and_no_other_runs_model(run_copy, prepared, capsys):
    """Issue 66: the evaluation's outputs (--out, and --model where it consolidates) land on none of a run's own
    files (identity, record, log, checkpoints, what is set aside), inside the data, or in another run's place; each
    refused by name before any work, everything intact. A run whose model.pt.json names another run's checkpoint, or
    whose test.json scored another model, is refused by the aggregation."""
    from scalelm.report.aggregate import read_run
    from scalelm.train.evaluation import main as evaluate
    from scalelm.train.rundir import RunDir

    run = RunDir(run_dir_of(run_copy))
    other = RunDir(run.path.parent / "other")
    shutil.copytree(run.path, other.path, symlinks=True)
    evaluate(
        [
            "--consolidate",
            str(run.path),
            "--model",
            str(run.model),
            "--data",
            str(prepared),
            "--out",
            str(run.test_result),
        ]
    )
    (run.path / "previous").mkdir()
    (run.path / "previous" / "identity.json").write_text("{}")
    capsys.readouterr()
    before, data_before, other_before = tree(run.path), tree(prepared), tree(other.path)
    step = sorted(run.checkpoints.glob("step_*"))[-1]
    consolidating = ["--consolidate", str(run.path), "--model", str(run.model), "--data", str(prepared)]
    for args, reason in [
        (
            [*consolidating, "--out", str(run.record)],
            rf"--out {run.record} is the run's run.json {run.record}: writing it would replace it",
        ),
        ([*consolidating, "--out", str(run.identity)], rf"--out {run.identity} is the run's identity.json"),
        ([*consolidating, "--out", str(run.metrics)], rf"--out {run.metrics} is the run's metrics.jsonl"),
        ([*consolidating, "--out", str(run.model_meta)], rf"is the model's record {run.model_meta}"),
        ([*consolidating, "--out", str(step / "test.json")], rf"lies inside the run's checkpoints {run.checkpoints}"),
        ([*consolidating, "--out", str(run.path / "previous/t.json")], r"lies inside the run's previous "),
        (
            ["--model", str(run.model), "--data", str(prepared), "--out", str(run.metrics)],
            rf"--out {run.metrics} is the run's metrics.jsonl",
        ),
        (
            [
                "--consolidate",
                str(run.path),
                "--model",
                str(prepared / "train.pt"),
                "--data",
                str(prepared),
                "--out",
                str(run.path / "t.json"),
            ],
            rf"--model {prepared / 'train.pt'} lies inside --data {prepared}: writing it would change it",
        ),
        (
            [
                "--consolidate",
                str(run.path),
                "--model",
                str(prepared / "model.pt"),
                "--data",
                str(prepared),
                "--out",
                str(run.path / "t.json"),
            ],
            rf"--model {prepared / 'model.pt'} lies inside --data {prepared}",
        ),
        (  # finding 4: run A's model in run B's place
            [
                "--consolidate",
                str(run.path),
                "--model",
                str(other.model),
                "--data",
                str(prepared),
                "--out",
                str(other.test_result),
            ],
            rf"--model {other.model} is the run {other.path}'s model.pt, but it would hold run {run.path}'s model",
        ),
        (
            ["--model", str(run.model), "--data", str(prepared), "--out", str(other.test_result)],
            rf"--out {other.test_result} is the run {other.path}'s test.json, but it would hold run {run.path}'s",
        ),
    ]:
        err = refused(evaluate, args, capsys)
        assert re.search(reason, err), err
    assert tree(run.path) == before and tree(prepared) == data_before and tree(other.path) == other_before
    assert read_run(run).figures["test_loss"] > 0  # the run's own model and test result: reported

    # what the checks refuse, done by hand: the aggregation refuses to report it
    for path in (run.model_meta, run.test_result):
        shutil.copy(path, other.path / path.name)
    with pytest.raises(DataError, match=rf"{other.model_meta} records a model consolidated from {step}, which is not"):
        read_run(other)
    run.test_result.write_text(json.dumps({"loss": 1.0, "perplexity": 2.7, "model_sha256": "f" * 64}))
    with pytest.raises(DataError, match=rf"{run.test_result} scored a model of sha256 ffffffffffff, but "):
        read_run(run)


def test_evaluate_refuses_batches_of_no_sequences_or_tokens(tmp_path, capsys):
    """--batch-size and --batch-tokens below 1 are refused by argparse, naming the option and the value, before any
    model is loaded (issue 49)."""
    from scalelm.train.evaluation import main as evaluate

    for option, value in (("--batch-size", "0"), ("--batch-tokens", "-5")):
        with pytest.raises(SystemExit) as exit_info:
            evaluate(
                [
                    "--model",
                    str(tmp_path / "none.pt"),
                    "--data",
                    str(tmp_path / "data"),
                    "--out",
                    str(tmp_path / "t.json"),
                    option,
                    value,
                ]
            )
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and f"error: {option} must be 1 or more, got {value}\n" in err, err
        assert "Traceback" not in err and not (tmp_path / "t.json").exists()


def test_the_machine_baseline_refuses_a_directory_before_measuring(tmp_path, monkeypatch, capsys):
    from scalelm.measure.baseline import __main__ as baseline

    monkeypatch.setattr(baseline, "measure", lambda args: pytest.fail("measured before the --out was checked"))
    mine = foreign_directory(tmp_path / "mine")
    err = refused(baseline.main, ["--out", str(mine)], capsys)
    assert f"{mine} is a directory: writing a file in its place would delete it; choose a file path" in err
    assert (mine / "thesis.tex").read_text() == "years of work"
    # a mixture that is not one, named before anything is measured
    err = refused(baseline.main, ["--out", str(tmp_path / "b.json"), "--moe", '{"expert": 4}'], capsys)
    assert "unknown setting '--moe.expert'; did you mean '--moe.experts'?" in err
    with pytest.raises(SystemExit):
        baseline.main(["--out", str(tmp_path / "b.json"), "--moe", "{bad"])
    assert "--moe must be a JSON mapping of model.moe's settings" in capsys.readouterr().err


def test_slice_replaces_only_a_slice(tmp_path, prepared, capsys):
    """`slice --out` its own --data, a directory inside it, a directory of other files or a file: refused by name,
    nothing changed; an earlier slice is replaced."""
    from scalelm.data.prepared import load_prepared
    from scalelm.data.slice import main as slice_main

    data = tmp_path / "prepared"
    shutil.copytree(prepared, data)
    before = tree(data)
    mine = foreign_directory(tmp_path / "mine")
    (tmp_path / "notes.txt").write_text("mine")
    for out, reason in [
        (data, rf"--out {data} is --data {data}: writing it would replace it; choose another --out"),
        (data / "small", rf"--out {data / 'small'} lies inside --data {data}"),
        (tmp_path, rf"--out {tmp_path} holds --data {data}"),
        (mine, rf"{mine} is a directory with files and no manifest.json: it does not hold the prepared data"),
        (tmp_path / "notes.txt", rf"{tmp_path / 'notes.txt'} exists and is not a directory"),
    ]:
        err = refused(slice_main, ["--data", str(data), "--out", str(out), "--tokens", "100"], capsys)
        assert re.search(reason, err), err
    assert tree(data) == before and tree(mine) == {"thesis.tex": b"years of work"}
    assert (tmp_path / "notes.txt").read_text() == "mine"
    for tokens in (100, 50):  # the second replaces the first: it is a slice
        slice_main(["--data", str(data), "--out", str(tmp_path / "small"), "--tokens", str(tokens)])
        assert load_prepared(tmp_path / "small").splits["train"].numel() == tokens
    assert not partial_of(tmp_path / "small").exists()


def test_prepare_and_prefetch_refuse_an_out_that_is_or_holds_their_input(tmp_path, raw_data):
    """A prepared directory (its manifest: scalelm's) that holds the prefetched data, or a prefetched directory
    that holds the --files it reads, would be deleted by the very step that reads it: refused by name."""
    from scalelm.data.prefetch import fetch
    from scalelm.data.prepare import prepare

    raw = tmp_path / "prepared" / "raw"
    shutil.copytree(raw_data, raw)
    (tmp_path / "prepared" / "manifest.json").write_text("{}")
    with pytest.raises(ScaleLMError, match=rf"^--out {raw.parent} holds --raw {raw}: writing it would delete it"):
        prepare(raw, raw.parent, False, 2)
    with pytest.raises(ScaleLMError, match=rf"^--out {raw} is --raw {raw}"):
        prepare(raw, raw, False, 2)
    text = raw / "train.txt"
    text.write_text("the words\n")
    with pytest.raises(ScaleLMError, match=rf"^--out {raw} holds --files train {text}"):
        fetch(raw, "", None, {split: str(text) for split in ("train", "validation", "test")}, "text")
    assert tree(raw) == {**tree(raw_data), "train.txt": b"the words\n"}


def test_staging_names_a_damaged_source_and_leaves_no_partial_copy(tmp_path, prepared):
    """A source whose file does not match its manifest is named as the prepared data's fault (not the stage
    directory's); a stage target that is not a staged copy (a file, a directory of other files) is refused, left as
    it was, and no `.partial` copy stays behind."""
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), node_rank=0)
    source = tmp_path / "prepared"
    shutil.copytree(prepared, source)
    train = source / "train.pt"
    train.write_bytes(train.read_bytes()[:-8] + bytes(8))
    scratch = tmp_path / "scratch"
    with pytest.raises(
        DataError,
        match=rf"^{train} does not match the checksum in {source / 'manifest.json'} .*run "
        "the prepare step again",
    ):
        with stage.staged(source, "local", str(scratch), env, "run"):
            pass
    assert list(scratch.iterdir()) == []
    (source / "test.pt").unlink()
    with pytest.raises(DataError, match=rf"prepared data at {source} is incomplete: {source / 'test.pt'} is missing"):
        with stage.staged(source, "local", str(scratch), env, "run"):
            pass

    with stage.staged(prepared, "local", str(scratch), env, "run") as staging:
        target = staging.path
    target.write_text("mine")
    with pytest.raises(DataError, match=rf"{target} exists and is not a directory; choose another directory"):
        with stage.staged(prepared, "local", str(scratch), env, "run"):
            pass
    assert target.read_text() == "mine" and list(scratch.iterdir()) == [target]
    target.unlink()
    foreign_directory(target)
    with pytest.raises(DataError, match=rf"{target} is a directory with files and no manifest.json"):
        with stage.staged(prepared, "local", str(scratch), env, "run"):
            pass
    assert tree(target) == {"thesis.tex": b"years of work"} and list(scratch.iterdir()) == [target]
    (tmp_path / "a-file").write_text("mine")
    with pytest.raises(DataError, match=rf"{tmp_path / 'a-file'} is not a directory; set data.stage_dir to a dir"):
        with stage.staged(prepared, "local", str(tmp_path / "a-file"), env, "run"):
            pass
    assert (tmp_path / "a-file").read_text() == "mine"
    # a copy a killed attempt left (its manifest says it is one) is replaced
    shutil.rmtree(target)
    shutil.copytree(prepared, target)
    (target / "train.pt").write_bytes(b"half")
    with stage.staged(prepared, "local", str(scratch), env, "run") as staging:
        assert (staging.path / "train.pt").read_bytes() == (prepared / "train.pt").read_bytes()
    assert list(scratch.iterdir()) == []
