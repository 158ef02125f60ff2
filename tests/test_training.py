"""End-to-end training on CPU with gloo: parity across strategies, determinism, resume, resharding."""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch
from conftest import run_dir_of, run_train, train_command, train_losses

from scalelm.config import load_config
from scalelm.model import TransformerLM
from scalelm.train.checkpoint import complete_checkpoints, load_weights
from scalelm.train.metrics import read_metrics
from scalelm.train.preemption import EXIT_PREEMPTED


def relative_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_single_ddp_fsdp_agree_step_by_step(tiny_config):
    """Same model, same data, global batch 16: one process, DDP on 2 ranks, FSDP on 2 ranks, and 4-way accumulation."""
    runs = {
        "single": (tiny_config("single"), 1, []),
        "accumulate": (tiny_config("accumulate", batch__micro_size=4), 1, []),
        "ddp": (tiny_config("ddp", parallel__strategy="ddp"), 2, []),
        "fsdp": (tiny_config("fsdp", parallel__strategy="fsdp"), 2, []),
    }
    losses = {}
    for name, (config, nproc, sets) in runs.items():
        run_train(config, nproc, *sets)
        losses[name] = train_losses(run_dir_of(config))
    assert len(losses["single"]) == 20
    assert losses["single"][-1] < losses["single"][0] - 0.5  # it learns
    for name in ("accumulate", "ddp", "fsdp"):
        assert relative_gap(losses[name], losses["single"]) <= 1e-5, name
    # evaluation is exact whatever the world size: same tokens, same loss
    evals = {n: [r for r in read_metrics(run_dir_of(c)) if r["kind"] == "eval"] for n, (c, _, _) in runs.items()}
    for name in ("ddp", "fsdp"):
        for mine, ref in zip(evals[name], evals["single"]):
            assert mine["tokens"] == ref["tokens"]
            assert abs(mine["loss"] - ref["loss"]) / ref["loss"] <= 1e-5


def test_same_seed_same_metrics_other_seed_other_metrics(tiny_config):
    a, b, c = tiny_config("a", model__dropout=0.1), tiny_config("b", model__dropout=0.1), tiny_config("c", seed=2)
    for config in (a, b, c):
        run_train(config, 1, "train.max_steps=8")
    assert train_losses(run_dir_of(a)) == train_losses(run_dir_of(b))
    assert train_losses(run_dir_of(a)) != train_losses(run_dir_of(c))


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    return torch.load(complete_checkpoints(run_dir / "checkpoints")[-1] / "state.pt", weights_only=True)["model"]


def interrupt_after_step(command: list[str], run_dir, step: int) -> tuple[int, str]:
    """Start training, send SIGTERM once `step` is logged; returns the exit status and stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if metrics.is_file() and any(json.loads(l)["step"] >= step for l in metrics.read_text().splitlines() if l):
            process.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    _, stderr = process.communicate(timeout=120)
    return process.returncode, stderr


@pytest.mark.parametrize("nproc, strategy", [(1, "single"), (2, "ddp")])
def test_interrupted_and_resumed_equals_uninterrupted_bitwise(tiny_config, nproc, strategy):
    """Dropout on, mid-epoch interruption; the resumed run restores weights, optimizer, schedule, data position, RNG."""
    settings = dict(model__dropout=0.1, parallel__strategy=strategy, optim__schedule="cosine", optim__warmup_steps=3)
    straight, broken = tiny_config("straight", **settings), tiny_config("broken", **settings)
    run_train(straight, nproc)
    status, stderr = interrupt_after_step(train_command(broken, nproc), run_dir_of(broken), step=6)
    # torchrun forwards SIGTERM to its workers, which checkpoint and exit 75; torchrun itself then reports failure
    assert status == EXIT_PREEMPTED if nproc == 1 else status != 0, (status, stderr[-2000:])
    assert "stopped by a signal" in stderr
    assert not (run_dir_of(broken) / "run.json").exists()
    resumed = run_train(broken, nproc)
    assert "resumed from step" in resumed.stdout
    a, b = final_weights(run_dir_of(straight)), final_weights(run_dir_of(broken))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert train_losses(run_dir_of(broken)) == train_losses(run_dir_of(straight))


def test_fsdp_checkpoint_loads_into_other_world_sizes_and_strategies(tiny_config, tmp_path):
    """A DCP checkpoint from 2 FSDP ranks: 1 plain process, 2 DDP ranks and 1 FSDP rank evaluate identically."""
    fsdp = tiny_config("fsdp", parallel__strategy="fsdp", train__max_steps=10)
    run_train(fsdp, 2)
    checkpoint = complete_checkpoints(run_dir_of(fsdp) / "checkpoints")[-1]
    assert (checkpoint / ".metadata").is_file()
    reference = json.loads((run_dir_of(fsdp) / "run.json").read_text())["results"]["validation"]["loss"]

    config = load_config(fsdp)
    from scalelm.data import load_prepared

    data = load_prepared(config.data.prepared_dir)
    model = TransformerLM(config.model, data.vocab_size)
    load_weights(checkpoint, model)
    from scalelm.parallel.env import DistEnv
    from scalelm.train.evaluation import evaluate

    env = DistEnv(0, 0, 1, torch.device("cpu"))
    plain = evaluate(model, data.splits["validation"], config.data.seq_len, 128, env)["loss"]
    assert plain == pytest.approx(reference, rel=1e-6)

    # resume the same run directory with other strategies / world sizes: it continues from step 10
    for name, nproc, strategy in (("ddp2", 2, "ddp"), ("fsdp1", 1, "fsdp")):
        other = tiny_config(name, parallel__strategy=strategy, train__max_steps=10)
        target = run_dir_of(other) / "checkpoints"
        target.mkdir(parents=True)
        import shutil

        shutil.copytree(checkpoint, target / checkpoint.name)
        result = run_train(other, nproc)
        assert "resumed from step 10" in result.stdout
        loss = json.loads((run_dir_of(other) / "run.json").read_text())["results"]["validation"]["loss"]
        assert loss == pytest.approx(reference, rel=1e-6), name


@pytest.mark.parametrize(
    "overrides, nproc, message",
    [
        (["parallel.strategy=pipeline"], 1, "unknown strategy 'pipeline'"),
        (["batch.size=15", "parallel.strategy=ddp"], 2, "] global batch of 15 sequences is not divisible by the world size 2"),
        (["data.prepared_dir=/nonexistent/prepared"], 1, "prepared data not found"),
        (["train.epoch=3"], 1, "unknown setting 'train.epoch'; did you mean 'train.epochs'"),
        ([], 2, "strategy 'single' runs one process"),
        (["run_dir=/proc/version/run"], 1, "run_dir /proc/version/run is not writable (Not a directory)"),
    ],
)
def test_bad_input_fails_with_a_clear_message(tiny_config, overrides, nproc, message):
    config = tiny_config("bad")
    result = run_train(config, nproc, *overrides, check=False)
    assert result.returncode != 0
    assert message in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    if nproc == 1:
        assert len(errors) == 1 and errors[0].startswith("error: ") and "Traceback" not in result.stderr
    else:  # one line per rank, each whole: the ranks share stderr
        assert sorted(line.split("]")[0] for line in errors) == ["error: [rank 0", "error: [rank 1"], errors
        assert all(line.count("error:") == 1 for line in errors), errors
    assert not (run_dir_of(config) / "run.json").exists()


def train_here(config_path, *overrides: str) -> dict:
    """One process, in this process: no interpreter or torch start-up to pay."""
    from scalelm.train.trainer import run

    return run(load_config(config_path, overrides))


def test_whole_epochs_are_counted_and_a_moved_run_resumes_instead_of_starting_afresh(tiny_config, prepared, tmp_path, capsys):
    """Two whole epochs and no max_steps (the default): the run ends on an epoch boundary. Moving the finished run
    directory and the prepared data elsewhere, and changing how often it logs, changes nothing that was trained."""
    config = tiny_config("epochs", batch__size=512, train__max_steps=None, train__epochs=2, checkpoint__every=None)
    results = train_here(config)["results"]
    steps_per_epoch = results["steps"] // 2
    assert steps_per_epoch > 1 and results["steps"] == 2 * steps_per_epoch
    assert results["epochs_completed"] == 2
    identity = json.loads((run_dir_of(config) / "identity.json").read_text())
    assert "run_dir" not in identity["settings"] and "prepared_dir" not in identity["settings"]["data"]

    moved = tmp_path / "moved"
    shutil.copytree(run_dir_of(config), moved / "run")
    shutil.copytree(prepared, moved / "prepared")
    capsys.readouterr()
    again = train_here(config, f"run_dir={moved / 'run'}", f"data.prepared_dir={moved / 'prepared'}", "train.log_every=7")
    assert f"resumed from step {results['steps']}" in capsys.readouterr().out
    assert not (moved / "run" / "previous").exists()
    assert again["results"]["validation"] == results["validation"] and again["results"]["epochs_completed"] == 2

    changed = train_here(config, f"run_dir={moved / 'run'}", "optim.lr=1e-3", "train.epochs=1")  # another model
    assert (moved / "run" / "previous" / "checkpoints").is_dir() and changed["results"]["steps"] == steps_per_epoch


def test_a_stop_signal_during_evaluation_checkpoints_and_stops_within_the_evaluation(tiny_config, monkeypatch):
    """The signal comes while the first validation runs (step 5): the evaluation stops between batches, the step
    is checkpointed, Preempted (exit 75) is raised; the rerun resumes from that step and finishes."""
    from scalelm.train.preemption import Preempted

    config = tiny_config("evalstop", train__eval_every=5, train__eval_batch_size=2, checkpoint__every=None)
    evaluated = []
    forward = TransformerLM.forward

    def forward_and_signal(model, tokens, targets=None):
        if not model.training:
            evaluated.append(tokens.shape[0])
            if len(evaluated) == 3:
                os.kill(os.getpid(), signal.SIGUSR1)
        return forward(model, tokens, targets)

    monkeypatch.setattr(TransformerLM, "forward", forward_and_signal)
    with pytest.raises(Preempted, match="stopped by a signal at step 5") as stopped:
        train_here(config)
    assert stopped.value.exit_code == EXIT_PREEMPTED
    assert len(evaluated) == 3  # of the validation split's hundreds of batches
    assert [p.name for p in complete_checkpoints(run_dir_of(config) / "checkpoints")] == ["step_00000005"]
    assert not [r for r in read_metrics(run_dir_of(config)) if r["kind"] == "eval"]

    monkeypatch.setattr(TransformerLM, "forward", forward)
    assert train_here(config)["results"]["steps"] == 20
