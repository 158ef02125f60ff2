import json
import shutil

import pytest
import torch

from conftest import SAMPLE
from scalelm.data.prepared import load_prepared
from scalelm.data.vocab import EOS_ID, UNK_ID
from scalelm.data.windows import EvalBatches, TrainBatches, num_windows
from scalelm.errors import ConfigError, DataError, ScaleLMError
from scalelm.files import sha256
from scalelm.model.loss import IGNORE_INDEX


def test_prepare_keeps_every_word(prepared):
    data = load_prepared(prepared)
    manifest = json.loads((prepared / "manifest.json").read_text())
    vocab = (prepared / "vocab.txt").read_text(encoding="utf-8").split("\n")[: data.vocab_size]
    assert vocab[:2] == ["<unk>", "<eos>"] and len(vocab) == data.vocab_size == manifest["vocab_size"]
    for split in ("train", "validation", "test"):
        lines = [line.split() for line in (SAMPLE / f"{split}.txt").read_text().splitlines() if line.split()]
        tokens = data.splits[split]
        assert tokens.numel() == sum(len(words) + 1 for words in lines)  # every word, plus <eos> per line
        assert int((tokens == EOS_ID).sum()) == len(lines)
        assert manifest["splits"][split]["tokens"] == tokens.numel()
        assert manifest["splits"][split]["unk"] == int((tokens == UNK_ID).sum())
    # decode the first train line back to its words (min_freq 2 -> rare words are <unk>)
    first = (SAMPLE / "train.txt").read_text().splitlines()
    words = next(line.split() for line in first if line.split())
    decoded = [vocab[i] for i in data.splits["train"][: len(words)].tolist()]
    assert all(d == w or d == "<unk>" for d, w in zip(decoded, words))


def test_missing_prepared_data_names_the_step(tmp_path):
    with pytest.raises(DataError, match=r"prepared data not found.*run on the login node|login node"):
        load_prepared(tmp_path / "nowhere")


def test_training_windows_and_stride():
    tokens = torch.arange(100, dtype=torch.int32)
    assert num_windows(100, 10, 10) == 9 and num_windows(100, 10, 1) == 90
    batches = TrainBatches(tokens, seq_len=10, stride=1, global_batch=8, micro_batch=2, rank=1, world_size=2, seed=3)
    step = next(batches.epoch(0))
    assert len(step) == 2 and step[0][0].shape == (2, 10)
    for inputs, targets in step:
        assert torch.equal(targets[:, :-1], inputs[:, 1:])  # targets are inputs shifted by one
        assert torch.equal(inputs[:, 1:] - inputs[:, :-1], torch.ones(2, 9, dtype=torch.long))


def test_ranks_split_the_global_batch_without_overlap():
    tokens = torch.arange(1000, dtype=torch.int32)
    make = lambda rank, world: TrainBatches(tokens, 8, 8, 12, 12 // world, rank, world, seed=1)
    single = [torch.cat([x for x, _ in step]) for step in make(0, 1).epoch(2)]
    for world in (2, 3):
        per_rank = [list(make(r, world).epoch(2)) for r in range(world)]
        for s, reference in enumerate(single):
            together = torch.cat([torch.cat([x for x, _ in per_rank[r][s]]) for r in range(world)])
            assert torch.equal(together, reference)
    assert not torch.equal(single[0], next(iter(make(0, 1).epoch(3)))[0][0])  # reshuffled each epoch


@pytest.mark.parametrize("world", [1, 2, 3])
def test_exact_evaluation_counts_every_token_once(world):
    tokens = torch.arange(2, 1003, dtype=torch.int32)  # 1001 tokens: the last window is partial
    seen = []
    lengths = set()
    for rank in range(world):
        batches = EvalBatches(tokens, seq_len=16, batch_size=5, rank=rank, world_size=world)
        lengths.add(len(list(batches)))
        for inputs, targets in batches:
            mask = targets != IGNORE_INDEX
            seen.append(targets[mask])
            # each target's input is the token before it (<eos> before the first)
            previous = torch.cat([torch.tensor([EOS_ID]), tokens.long()])[targets[mask] - 2]
            assert torch.equal(inputs[mask], previous)
    assert len(lengths) == 1  # every rank runs the same number of forward passes
    assert torch.equal(torch.sort(torch.cat(seen)).values, tokens.long())


def test_batch_not_divisible_by_world_size_is_a_clear_error():
    from scalelm.config import BatchConfig

    with pytest.raises(ConfigError, match="global batch of 16 sequences is not divisible by the 3 data-parallel ranks"):
        BatchConfig(mode="global", size=16).sizes(3)
    with pytest.raises(ConfigError, match="global batch of 1 sequences is not divisible by the 2 data-parallel ranks"):
        BatchConfig(mode="global", size=1).sizes(2)  # fewer sequences than ranks: once a division by zero
    with pytest.raises(ConfigError, match="micro_size 3 does not divide"):
        BatchConfig(mode="global", size=16, micro_size=3).sizes(2)
    assert BatchConfig(mode="per_device", size=4, micro_size=2).sizes(3) == (12, 2)
    with pytest.raises(DataError, match="too small for one global batch"):
        TrainBatches(torch.arange(100), 8, 8, 64, 64, 0, 1, seed=1)


def test_prefetch_rejects_data_without_text_column(tmp_path):
    from scalelm.data.prefetch import main as prefetch

    files = {}
    for split in ("train", "validation", "test"):
        files[split] = tmp_path / f"{split}.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    for path in files.values():
        pq.write_table(pa.table({"sentence": ["a b c"]}), path)
    spec = ",".join(f"{k}={v}" for k, v in files.items())
    with pytest.raises(SystemExit) as exit_info:
        prefetch(["--out", str(tmp_path / "raw"), "--files", spec, "--format", "parquet"])
    assert exit_info.value.code == 2
    assert not (tmp_path / "raw").exists()


def test_prepare_errors(tmp_path, raw_data, capsys):
    from scalelm.data.prepare import main as prepare

    with pytest.raises(SystemExit):
        prepare(["--raw", str(tmp_path / "none"), "--out", str(tmp_path / "p")])
    assert "run the prefetch step" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prepare(["--raw", str(raw_data), "--out", str(tmp_path / "p"), "--min-freq", "10000000"])
    assert "leaves no word in the vocabulary" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_an_empty_split_is_refused_naming_it(tmp_path, capsys):
    from scalelm.data.prefetch import main as prefetch
    from scalelm.data.prepare import main as prepare

    texts = {"train": " = Title = \n the cat sat \n", "validation": "\n \n", "test": " the dog \n"}
    for split, text in texts.items():
        (tmp_path / f"{split}.txt").write_text(text)
    prefetch(["--out", str(tmp_path / "raw"), "--files", ",".join(f"{s}={tmp_path / s}.txt" for s in texts)])
    with pytest.raises(SystemExit) as exit_info:
        prepare(["--raw", str(tmp_path / "raw"), "--out", str(tmp_path / "prepared")])
    assert exit_info.value.code == 2
    assert "split 'validation'" in capsys.readouterr().err
    assert not (tmp_path / "prepared").exists()


def test_prepare_and_prefetch_never_replace_a_directory_that_is_not_theirs(tmp_path, raw_data):
    from scalelm.data.prefetch import fetch
    from scalelm.data.prepare import prepare

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    with pytest.raises(
        ScaleLMError,
        match=rf"{foreign} is a directory with files and no manifest.json: it does not hold "
        "the prepared data scalelm wrote",
    ):
        prepare(raw_data, foreign, False, 2)
    files = {split: str(SAMPLE / f"{split}.txt") for split in ("train", "validation", "test")}
    with pytest.raises(ScaleLMError, match=rf"{foreign} is a directory with files and no scalelm_source.json"):
        fetch(foreign, "", None, files, "text")
    with pytest.raises(ScaleLMError, match=rf"{foreign / 'thesis.tex'} exists and is not a directory"):
        prepare(raw_data, foreign / "thesis.tex", False, 2)
    assert [p.name for p in foreign.iterdir()] == ["thesis.tex"] and (
        foreign / "thesis.tex"
    ).read_text() == "years of work"


def test_damaged_prepared_data_is_named_with_what_to_do(tmp_path, prepared):
    copy = tmp_path / "prepared"
    shutil.copytree(prepared, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    with (copy / "validation.pt").open("r+b") as handle:  # a copy cut short
        handle.truncate(100)
    with pytest.raises(
        DataError,
        match=rf"{copy / 'validation.pt'} does not match the checksum in {copy / 'manifest.json'} "
        r"\(truncated or changed since it was prepared\); run the prepare step again",
    ):
        load_prepared(copy)

    torch.save(torch.tensor([5, manifest["vocab_size"], 7], dtype=torch.int32), copy / "validation.pt")
    manifest["splits"]["validation"]["sha256"] = sha256(copy / "validation.pt")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    message = rf"validation.pt holds token ids outside the vocabulary of {manifest['vocab_size']:,} \(from 5 to "
    with pytest.raises(DataError, match=message):
        load_prepared(copy)

    (copy / "manifest.json").write_text('{"vocab_size": 50')
    with pytest.raises(DataError, match=rf"{copy / 'manifest.json'} is not a readable manifest .*run the prepare step"):
        load_prepared(copy)


def test_every_writer_of_prepared_data_writes_what_load_prepared_checks(tmp_path):
    """prepare, the self-test's corpus and the benchmarks' random data all go through write_prepared: each loads, its
    token files checked against their manifest."""
    import sys

    from conftest import REPO
    from scalelm.selftest import write_corpus

    sys.path.insert(0, str(REPO / "bench"))
    try:
        from throughput import VOCAB, make_prepared
    finally:
        sys.path.remove(str(REPO / "bench"))
    assert load_prepared(make_prepared(tmp_path / "bench")).vocab_size == VOCAB
    write_corpus(tmp_path / "selftest", vocab_size=64)
    data = load_prepared(tmp_path / "selftest")
    assert data.vocab_size == 64 and data.manifest["splits"]["train"]["tokens"] == 62 * 40


def test_staging_copies_checks_and_removes_the_data_and_refuses_a_full_file_system(tmp_path, prepared, monkeypatch):
    """data.stage: local rank 0 copies the prepared data (every file against the manifest), the training reads the
    copy, and the copy goes when the block ends however it ends; no room, or a damaged copy, is a clear error
    before any training (a training staged through a stop and a resume: tests/test_training.py)."""
    from scalelm.data import stage
    from scalelm.parallel.env import DistEnv

    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), node_rank=1)
    with stage.staged(prepared, "local", str(tmp_path / "scratch"), env, str(tmp_path / "run")) as staging:
        assert staging.path.parent == tmp_path / "scratch" and staging.path.name.endswith("-node1")
        assert load_prepared(staging.path).checksums() == load_prepared(prepared).checksums()
        assert staging.record() == {
            "mode": "local",
            "dir": str(staging.path),
            "seconds": staging.seconds,
            "bytes": sum(p.stat().st_size for p in prepared.iterdir()),
        }
    assert not staging.path.exists()
    with pytest.raises(RuntimeError), stage.staged(prepared, "local", str(tmp_path), env, "run") as staging:
        raise RuntimeError("the training failed")
    assert not staging.path.exists() and list(tmp_path.glob("scalelm-*")) == []
    monkeypatch.setenv("TMPDIR", str(tmp_path / "job-tmp"))
    assert stage.stage_root("local", None) == tmp_path / "job-tmp" and stage.stage_root("shm", None) == stage.SHM
    with stage.staged(prepared, "none", None, env, "run") as staging:
        assert staging.path == prepared and staging.record() is None

    monkeypatch.setattr(stage.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(DataError, match=r"data staging: .*scratch has 0.0 MiB free, the prepared data needs"):
        with stage.staged(prepared, "local", str(tmp_path / "scratch"), env, "run"):
            pass
    assert list((tmp_path / "scratch").iterdir()) == []  # nothing copied
    monkeypatch.undo()

    copyfile = shutil.copyfile

    def damaging(source, target):
        copyfile(source, target)
        if target.name == "train.pt":
            target.write_bytes(target.read_bytes()[:-8])

    monkeypatch.setattr(stage.shutil, "copyfile", damaging)
    with pytest.raises(DataError, match=r"the copy of .*train.pt in .* does not match the manifest's checksum"):
        with stage.staged(prepared, "local", str(tmp_path / "scratch"), env, "run"):
            pass
    assert list((tmp_path / "scratch").iterdir()) == []
