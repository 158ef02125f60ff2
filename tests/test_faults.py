"""Failures during training: a killed rank fails the whole job fast, naming it, and the rerun resumes; a typo, a
second training or a full disk costs nothing already computed."""

import json
import os
import random
import re
import subprocess
import threading
import time

import pytest
import torch

import drills
from conftest import run_dir_of, run_train, train_here
from scalelm.errors import ConfigError, DataError
from scalelm.train.checkpoint import complete_checkpoints, verify
from scalelm.train.record import read_metrics
from scalelm.train.rundir import RunDir
from system import in_ci


@pytest.mark.slow
@pytest.mark.parametrize("strategy, rank", [("ddp", 1), ("fsdp", 0)])
def test_a_killed_rank_fails_the_job_within_a_minute_naming_it_and_the_rerun_resumes(tiny_config, strategy, rank):
    config = tiny_config("crash", parallel__strategy=strategy, train__max_steps=200, checkpoint__every=5)
    crash = drills.kill_rank(config, rank, at_step=7)
    assert crash.exit_code != 0
    assert crash.detected_s < 60, crash.detected_s
    assert f"rank: {rank}" in crash.output and "SIGKILL" in crash.output, crash.output[-3000:]
    assert crash.survivors == 0

    rerun = drills.run(config)
    assert rerun.returncode == 0 and "resumed from step" in rerun.stdout, rerun.stdout[-3000:]
    # the steps the crashed attempt logged past its last checkpoint were redone, not logged twice
    steps = [r["step"] for r in read_metrics(drills.run_dir_of(config)) if r["kind"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 200, steps


@pytest.mark.slow
def test_a_stalled_rank_is_named_within_the_threshold_and_the_rerun_resumes(tiny_config, tmp_path):
    """One rank of four stalls inside step 8: every rank's watchdog finds its step overdue (max(5 x the median step,
    the 4 s floor)), names rank 2 as the one the others wait for, writes the stacks and stops the job (EXIT_HUNG),
    instead of hanging until the collective timeout; the checkpoint of step 5 is whole and the rerun resumes it."""
    config = tiny_config(
        "stall",
        parallel__strategy="ddp",
        train__max_steps=12,
        checkpoint__every=5,
        train__hang_factor=5,
        train__hang_floor_s=4,
    )
    stall = drills.stall_rank(config, rank=2, at_step=8, site=tmp_path / "site", timeout=240)
    assert stall.exit_code != 0 and "exitcode  : 76" in stall.output, stall.output[-3000:]
    assert stall.detected_s < 4 + 20, stall.detected_s  # the threshold, the autopsy's wait, the job's teardown
    found = re.findall(
        r"rank 2 is behind in process group default_pg \(ranks 0, 1, 2, 3\): it issued (\d+) "
        r"collectives, rank\(s\) 0, 1, 3 issued (\d+) and wait for it",
        stall.output,
    )
    assert len(found) == 1 and int(found[0][0]) + 1 == int(found[0][1]), stall.output[-3000:]  # told once
    autopsy = RunDir(run_dir_of(config)).autopsy
    assert "in train_step" in (autopsy / "rank2.txt").read_text()  # its stack: where it stalled
    summary = (autopsy / "summary.txt").read_text()
    assert "rank 2 is behind" in summary
    # the Flight Recorder's dumps (gloo's too): the collective each rank issued last, rank 2 one behind the others
    last = dict(re.findall(r"rank (\d)'s last collective gloo:\w+ #(\d+) of group", summary))
    assert set(last) == {"0", "1", "2", "3"} and int(last["2"]) + 1 == int(last["0"]) == int(last["3"]), summary
    assert [p.name for p in complete_checkpoints(RunDir(run_dir_of(config)).checkpoints)][-1] == "step_00000005"
    rerun = drills.run(config, procs=4)
    assert rerun.returncode == 0 and "resumed from step 5" in rerun.stdout, rerun.stdout[-2000:] + rerun.stderr


def test_the_autopsy_names_late_and_silent_ranks_in_every_process_group():
    """From the progress the ranks published: a rank that issued fewer collectives in a group than its other members
    (here in the TP group of ranks 0 and 1, the world group agreeing), and ranks whose progress is stale or missing;
    not a rank whose training is over (its watchdog closed)."""
    from scalelm.hang.watchdog import behind

    def progress(issued_world, issued_tp, age=0.0, step=9, **more):
        groups = {"0": {"desc": "default_pg", "issued": issued_world}, "3": {"desc": "mesh_tp", "issued": issued_tp}}
        return {
            "step": step,
            "in_step_s": 30.0,
            "groups": groups,
            "time": 1000.0 - age,
            "host": "node7",
            "pid": 42,
            **more,
        }

    progresses = {0: progress(50, 20), 1: progress(50, 19), 2: None, 3: progress(48, 20, age=60, step=8)}
    findings = behind({**progresses, 4: progress(50, 20, age=60, closed=True, groups={})}, 1000.0)
    assert findings == [
        "rank 2 never published its progress (a stopped or dead process, or a lost node)",
        "rank 3 stopped publishing its progress 60 s ago, in step 8, on node7 (pid 42) (a stopped or dead process, "
        "or a lost node)",
        "rank 1 is behind in process group mesh_tp (ranks 0, 1): it issued 19 collectives, rank(s) 0 issued 20 and "
        "wait for it in collective #20 (rank 1 is in step 9 since 30 s, on node7)",
    ]
    assert behind({0: progress(50, 20), 1: progress(50, 20)}, 1000.0) == []  # nobody behind: a slow step everywhere
    # a rank the watchdog's own limit (hang_floor_s under SILENT_AFTER_S) found silent, or that is stopped beside it:
    # named so, whatever the age of its last progress, never as a rank "behind" with its stale counts
    assert behind({0: progress(50, 20), 1: progress(50, 19, age=3)}, 1000.0, found_silent=[1]) == [
        "rank 1 stopped publishing its progress 3 s ago, in step 9, on node7 (pid 42) (a stopped or dead process, "
        "or a lost node)"
    ]


def test_a_rank_that_left_the_job_is_named_by_the_rank_whose_collective_failed(tmp_path, monkeypatch, capsys):
    """Issue 49: a rank that exits 0 early makes the others fail in their next collective (gloo: "Connection closed by
    peer", naming no rank), and torchrun names the first of them that failed as the root cause, with no autopsy. The
    watchdog of a rank that the collective's error ends names the ranks that left: those whose training ended (their
    watchdog closed) having issued fewer collectives, and those on its host whose process is gone without ending its
    training; told once, in the log and autopsy/summary.txt. Nothing at a normal end or on an error every rank shares
    (a refusal, a preemption), nor for a rank only late in publishing."""
    from scalelm.hang import watchdog
    from scalelm.hang.watchdog import Watchdog, left_early

    def groups(issued):
        return {"0": {"desc": "default_pg", "issued": {"gloo": issued}}}

    monkeypatch.setattr(watchdog, "PUBLISH_EVERY_S", 0.02)
    monkeypatch.setattr(watchdog, "sequence_numbers", lambda errors=None: groups(4))  # in collective #4 when it failed
    ended = subprocess.Popen(["true"])
    ended.wait()
    host = watchdog.socket.gethostname()
    store = Store()
    publish(store, 1, step=7, groups=groups(3), closed=True)  # its training ended after collective #3: it left
    publish(store, 2, step=8, groups=groups(3))  # alive, only late in publishing
    publish(store, 3, step=7, groups=groups(3), host=host, pid=ended.pid)  # gone without closing (os._exit)
    left = [
        "rank 1 left the job: its training ended in step 7, on n (pid 7), after it issued 3 collectives in process "
        "group default_pg (ranks 0, 1, 2, 3); rank(s) 0 issued 4 and wait for it in collective #4",
        f"rank 3's process (pid {ended.pid}, on {host}) ended in step 7 without ending its training",
    ]
    progress = {r: json.loads(store[watchdog.KEY.format(r)]) for r in (1, 2, 3)}
    assert left_early({0: {**progress[1], "groups": groups(4), "closed": False}, **progress}, host) == left

    dog = Watchdog(0, tmp_path, factor=2, floor_s=10, store=store, world_size=4)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        try:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:30392")
        finally:
            dog.close()  # as the engine closes it: the collective's error under way
    told = f"scalelm: rank 0 failed in a collective: {'; '.join(left)}. Its error and the root cause torchrun names"
    assert (tmp_path / "summary.txt").read_text().startswith(told) and told in capsys.readouterr().err
    Watchdog(2, tmp_path, factor=2, floor_s=10, store=store, world_size=4).close(RuntimeError("Connection closed"))
    assert (tmp_path / "summary.txt").read_text().count("scalelm:") == 1  # told once

    (tmp_path / "summary.txt").unlink()
    for error in (None, ConfigError("stopped by a signal"), RuntimeError("no rank left")):
        store = Store()
        publish(store, 1, step=8, groups=groups(4), closed=True)  # ended with the others: a normal end, a preemption
        publish(store, 3, step=8, groups=groups(3))  # alive, late in publishing
        Watchdog(0, tmp_path, factor=2, floor_s=10, store=store, world_size=4).close(error)
        assert not (tmp_path / "summary.txt").exists(), error


@pytest.mark.slow
def test_a_frozen_rank_ends_the_job_naming_it_and_the_rerun_resumes(tiny_config, tmp_path):
    """Rank 1 of 2 is stopped (SIGSTOP: no thread of it runs, its watchdog's neither) after step 7, before that step's
    log line; rank 0 waits for it in that line's collective, between two steps. Its watchdog finds rank 1's progress
    as old as its own wait, over the 4 s floor: it writes the autopsy naming rank 1, kills it (torchrun's SIGTERM
    would wait for a SIGCONT, its SIGKILL for 30 s) and exits 76. The rerun resumes from step 5."""
    config = tiny_config(
        "freeze", parallel__strategy="ddp", train__max_steps=12, checkpoint__every=5, train__hang_floor_s=4
    )
    site = tmp_path / "site"
    freeze = drills.freeze_rank(config, rank=1, at_step=7, site=site, timeout=45)
    assert freeze.exit_code not in (None, 0) and "exitcode  : 76" in freeze.output, freeze.output[-3000:]
    # under torchrun's 30 s wait for a SIGTERM the stopped rank cannot receive: it was killed, not waited for
    assert freeze.detected_s < 30 and freeze.survivors == 0, (freeze.detected_s, freeze.survivors)
    run = RunDir(run_dir_of(config))
    summary = (run.autopsy / "summary.txt").read_text()
    assert re.match(
        r"scalelm: rank 0 has waited \d+ s since step 7 ended \(limit 4 s\), and rank\(s\) 1 published no "
        r"progress for as long",
        summary,
    ), summary
    pid = drills.pid_in(site / "paused")
    # where its last progress placed it: a watchdog publishes once a second, and 7 tiny steps may all fall in the
    # first second (on an idle machine), so that its last word was from before step 1
    where = r"(in step [1-7]|before its first step)"
    assert re.search(rf"rank 1 stopped publishing its progress \d+ s ago, {where}, on \S+ \(pid {pid}\)", summary), (
        summary
    )
    assert re.search(rf"Stopped beside rank 0, killed \(SIGKILL[^)]*\): rank 1 \(pid {pid}\)\.", summary), summary
    assert summary.count("scalelm:") == 1 and "scalelm: rank 0 has waited" in freeze.output  # told once, in the log
    assert "in log_train" in (run.autopsy / "rank0.txt").read_text()  # where rank 0 waited
    assert [p.name for p in complete_checkpoints(run.checkpoints)][-1] == "step_00000005"

    rerun = drills.run(config)
    assert rerun.returncode == 0 and "resumed from step 5" in rerun.stdout, rerun.stdout[-2000:] + rerun.stderr
    steps = [r["step"] for r in read_metrics(run.path) if r["kind"] == "train"]
    assert steps == list(range(1, 13)), steps  # the steps after the checkpoint redone, each logged once


class Store(dict):
    """The job's store as the watchdog uses it (torch's TCPStore's calls), in this process."""

    def set(self, key, value):
        self[key] = value

    def get(self, key):
        return self[key].encode()

    def multi_get(self, keys):
        return [self.get(key) for key in keys]

    def check(self, keys):
        return all(k in self for k in keys)

    def add(self, key, amount):
        self[key] = str(int(dict.get(self, key, 0)) + amount)
        return int(self[key])


def publish(store, rank, age=0.0, step=1, **more):
    """Rank `rank`'s progress in `store`, as its watchdog publishes it, `age` seconds ago."""
    from scalelm.hang.watchdog import KEY

    progress = {"step": step, "in_step_s": 0.0, "groups": {}, "time": time.time() - age, "host": "n", "pid": 7}
    store.set(KEY.format(rank), json.dumps({**progress, **more}))


def test_a_rank_waiting_between_steps_for_a_silent_rank_or_store_is_overdue(tmp_path):
    """The watchdog's decision, from the progress in the store: a rank that has ended no step for the limit while
    another published nothing for as long stops the job (it waits for a stopped process); not while the others are
    alive, nor for a rank whose training is over, nor before the limit. In a step, the step's limit alone. A store
    that does not answer (held by the stopped process: rank 0's under the spawn launcher) holds no call of the
    watchdog's longer than its timeout, and stops the job once it has not answered for the limit."""
    from scalelm.hang.watchdog import BoundedStore, Unanswered, Watchdog

    store = Store()
    dog = Watchdog(0, tmp_path, factor=0, floor_s=10, store=store, world_size=3)  # factor 0: no thread, asked here
    with dog.watching(1):
        pass  # one step ended: armed, the limit is the floor

    def overdue(waited_s):
        dog.ended, dog.peers_read = time.monotonic() - waited_s, 0.0  # waited that long; the store not read lately
        return dog.overdue()

    publish(store, 1, age=0)
    publish(store, 2, age=30)
    assert overdue(5) is None  # rank 0 waits less than the limit
    waited = "rank 0 has waited 30 s since step 1 ended (limit 10 s)"
    assert overdue(30) == f"{waited}, and rank(s) 2 published no progress for as long"
    assert dog.overdue() is None  # the store is read every limit / 4 at most, not every second
    publish(store, 2, age=3)
    assert overdue(30) is None  # all alive: a long evaluation or checkpoint is not a hang
    publish(store, 2, age=30, closed=True)
    assert overdue(30) is None  # rank 2's training is over
    dog.started = time.monotonic() - 11
    assert dog.overdue() == "step 1 has run for over 10 s"
    dog.started = None

    stopped = threading.Event()  # set at the end: the call's thread returns

    class StoppedStore(Store):
        def set(self, key, value):
            stopped.wait()

    dog.store = BoundedStore(StoppedStore(), timeout_s=0.2)
    try:
        asked = time.monotonic()
        with pytest.raises(Unanswered):
            dog.store.ask("set", "key", "value")
        with pytest.raises(Unanswered, match="has not answered"):  # no second call while the first is unanswered
            dog.store.ask("check", ["key"])
        assert time.monotonic() - asked < 2  # not the store's own timeout (minutes)
        assert overdue(30) is None  # not answered for less than the limit
        dog.store.failing_since -= 30
        assert overdue(30) == f"{waited}, and the job's store has not answered for 30 s"
    finally:
        stopped.set()


def test_a_rank_frozen_before_its_first_step_is_named_after_the_floor(tmp_path):
    """Issue 49: the watchdog armed only once a step had ended, so a rank frozen before its first step left the
    others waiting for the collective timeout (600 s), told by gloo's message that names no rank. Until a step has
    ended no step is overdue (the first may compile for minutes), but a silent rank or store is, after
    hang_floor_s: a rank that compiles keeps publishing its progress, a frozen one does not."""
    from scalelm.hang.watchdog import KEY, BoundedStore, Watchdog, behind

    store = Store()
    dog = Watchdog(0, tmp_path, factor=0, floor_s=10, store=store, world_size=3)  # factor 0: no thread, asked here
    assert dog.threshold() is None and dog.rule() == "hang_floor_s 10 until a step has ended"

    def overdue(waited_s, in_first_step=False):
        """Rank 0 started training `waited_s` ago, and is in its first step since then or not yet in it."""
        dog.ended, dog.peers_read = time.monotonic() - waited_s, 0.0
        dog.started = dog.ended if in_first_step else None
        return dog.overdue()

    publish(store, 1, age=0, step=1)
    publish(store, 2, age=30, step=0)  # frozen before its first step
    frozen = "rank 0 has ended no step in the 30 s since its training started (limit 10 s), and rank(s) 2 published "
    assert overdue(5) is None and overdue(5, in_first_step=True) is None  # less than the floor
    assert overdue(30) == overdue(30, in_first_step=True) == frozen + "no progress for as long"
    assert behind({0: None, 2: json.loads(store[KEY.format(2)])}, time.time())[1] == (
        "rank 2 stopped publishing its progress 30 s ago, before its first step, on n (pid 7) (a stopped or dead "
        "process, or a lost node)"
    )
    publish(store, 2, age=0, step=1)
    assert overdue(600, in_first_step=True) is None  # a first step that compiles for minutes, every rank publishing
    del store[KEY.format(2)]  # frozen before its watchdog started: it never published
    assert overdue(30, in_first_step=True) == frozen + "no progress for as long"

    class Unanswering(Store):
        def set(self, key, value):
            raise TimeoutError("no answer")

    dog.store = BoundedStore(Unanswering())
    dog.store.failing_since = time.monotonic() - 30  # rank 0 of the spawn launcher, holding the store, frozen
    assert overdue(30).endswith("(limit 10 s), and the job's store has not answered for 30 s")


@pytest.mark.slow
@pytest.mark.parametrize("nodes, procs", [(1, 2), (2, 1)])
def test_slurm_style_signal_to_the_whole_job_checkpoints_exits_75_and_resumes_bitwise(
    tiny_config, tmp_path, nodes, procs
):
    """Slurm's --signal=USR1 reaches every process of the job step: launcher, torchrun(s) and workers."""
    # two local "nodes" may take ranks in either order from one run to the next: dropout would then differ
    dropout = 0.1 if nodes == 1 else 0.0
    settings = {
        "model__dropout": dropout,
        "parallel__strategy": "ddp",
        "train__max_steps": 40,
        "checkpoint__every": 100,
    }
    straight, broken = tiny_config("straight", **settings), tiny_config("broken", **settings)
    assert drills.run(straight, nodes, procs).returncode == 0
    stop = drills.interrupt(broken, 5, nodes, procs)
    assert stop.survived, stop.output[-3000:]
    rerun = drills.run(broken, nodes, procs)
    assert rerun.returncode == 0 and f"resumed from step {stop.stopped_at}" in rerun.stdout, rerun.stdout[-3000:]
    a, b = (drills.final_weights(c, tmp_path / f"{c.stem}.pt") for c in (straight, broken))
    assert all(torch.equal(a[k], b[k]) for k in a)


TRIALS = 10


# Every layout writes and reads the same DCP checkpoint; expert parallelism's is the most sharded case: FSDP's shards
# of the dense parameters and the experts split over ep. One stop of DDP, TP and FSDP x TP each: tests/test_training.py.
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ep"])
def test_ten_preemptions_at_random_steps_end_bitwise_equal_to_an_uninterrupted_run(tiny_config, tmp_path, strategy):
    """One run stopped ten times, at random steps, by the signal Slurm sends; each restart resumes where it stopped.

    Dropout on, 2 ranks of a mixture of experts (FSDP over both, each holding 2 of the 4 experts): the weights,
    optimizer, schedule, data position and every rank's RNG must all be restored for the final weights to be bitwise
    equal. SCALELM_TRIAL_SEED replays a failing draw.
    """
    seed = int(os.environ.get("SCALELM_TRIAL_SEED", time.time_ns() % 100_000))
    targets = sorted(random.Random(seed).sample(range(2, 110), TRIALS))
    settings = {
        "model__dropout": 0.1,
        "parallel__strategy": strategy,
        "model__moe": {"experts": 4, "top_k": 2},
        "train__max_steps": 120,
        "checkpoint__every": 1000,
    }
    straight, broken = tiny_config("straight", **settings), tiny_config("broken", **settings)
    run_train(straight, 2, timeout=300)  # the reference, forked: only the stopped run's processes are under test

    stopped = 0
    for target in targets:
        stop = drills.interrupt(broken, max(target, stopped + 1))
        assert stop.survived, f"seed {seed}, signal at step {stop.target}: exit {stop.exit_code}\n{stop.output[-3000:]}"
        assert stop.stopped_at >= stop.target, stop.output[-3000:]
        assert not stopped or f"resumed from step {stopped}" in stop.output, stop.output[-3000:]
        stopped = stop.stopped_at
    rerun = drills.run(broken)
    assert rerun.returncode == 0 and f"resumed from step {stopped}" in rerun.stdout, rerun.stdout[-3000:]

    a, b = (drills.final_weights(c, tmp_path / f"{c.stem}.pt") for c in (straight, broken))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"seed {seed}: weights differ"


# --------------------------------------------------------------------------------------- nothing lost
def test_a_typo_never_costs_a_finished_run(run_copy, capsys):
    """A setting the data cannot take is refused before the run directory is touched; an attempt with other
    settings that stops before its first step leaves the finished run in previous/, and reverting brings it back."""
    run = RunDir(run_dir_of(run_copy))
    finished = json.loads(run.record.read_text())
    with pytest.raises(DataError, match="too small for one global batch of 1000000000"):
        train_here(run_copy, "batch.size=1000000000")
    assert run.record.is_file() and not run.previous.exists()

    run.start({"settings": "a typo"})  # what an attempt with other settings does first; this one then fails
    assert (run.previous / "run.json").is_file() and (run.previous / "checkpoints").is_dir()
    run.start({"settings": "another typo"})  # and a second that got no further: the finished run stays
    assert (run.previous / "run.json").is_file() and "dropped" in capsys.readouterr().out

    record = train_here(run_copy)  # the typo reverted
    out = capsys.readouterr().out
    assert "is back from" in out and "finished at step 20" in out, out[-2000:]
    assert record.results.steps == 20 and record.results.test == finished["results"]["test"]
    assert not run.previous.exists()


def test_every_study_keeps_its_own_attempt_set_aside(tmp_path, capsys):
    """Issue 66: no study name, then study=r1, then r2 kept the unnamed attempt only until r2 replaced previous/.
    Each study's attempt is set aside in its own directory (previous/ for no name, previous-<study>/), a settings
    change within a study replaces that study's alone and says so before it does, and returning to a study brings
    its attempt back."""
    run = RunDir(tmp_path / "run")

    def attempt(study, lr=0.1):
        named = {"study": study} if study else {}  # (as identity.json holds it: no name, no key)
        identity = {"settings": {**named, "optim": {"lr": lr}}, "data": {}, "world_size": 1}
        run.start(identity)
        if not run.metrics.exists():
            run.metrics.write_text(json.dumps({"study": study, "lr": lr}) + "\n")  # it got somewhere
        return identity

    def held(path):
        return json.loads((path / "metrics.jsonl").read_text())

    unnamed, r1 = attempt(None), attempt("r1")
    attempt("r2")
    assert held(run.previous) == {"study": None, "lr": 0.1} and held(run.path / "previous-r1")["study"] == "r1"
    assert held(run.path)["study"] == "r2"
    attempt("r2", lr=0.2)  # another setting within r2: r2's earlier attempt set aside, the others kept
    attempt("r2", lr=0.3)
    out = capsys.readouterr().out
    assert f"{run.path / 'previous-r2'} held an attempt set aside earlier (study r2, unfinished): it is replaced" in out
    assert held(run.path / "previous-r2")["lr"] == 0.2 and held(run.previous)["study"] is None
    run.start(unnamed)  # back to no name: its attempt returns, to be resumed
    assert held(run.path) == {"study": None, "lr": 0.1} and not run.previous.exists()
    assert f"the attempt with these settings is back from {run.previous}" in capsys.readouterr().out
    run.start(r1)
    assert held(run.path)["study"] == "r1" and held(run.previous)["study"] is None
    assert sorted(p.name for p in run.set_aside_dirs()) == ["previous", "previous-r2"]


def test_a_second_training_in_the_same_run_directory_is_refused_naming_the_first(run_copy):
    run = RunDir(run_dir_of(run_copy))
    with run.lock():  # as the training holding it does
        with pytest.raises(ConfigError, match=rf"another training is running in {run.path} \(pid {os.getpid()} on "):
            train_here(run_copy)
        assert run.record.is_file()
    assert train_here(run_copy).results.steps == 20  # the lock goes with its holder


def test_a_full_disk_is_one_clear_line_and_the_checkpoints_before_it_are_kept(tiny_config, tmp_path):
    if os.geteuid() != 0:  # mounting the small file system needs root; CI runs as root
        if in_ci():
            pytest.fail("the full-disk test needs root to mount a small tmpfs; CI must run it")
        pytest.skip("the full-disk test needs root to mount a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(disk)], check=True)
    try:
        config = tiny_config(
            "full",
            run_dir=str(disk / "run"),
            train__max_steps=20,
            checkpoint__every=2,
            checkpoint__keep=100,
            train__monitor_interval_s=0,
        )
        result = run_train(config, check=False)
        assert result.returncode == 2, result.stderr[-3000:]
        assert f"error: no space left on device (or quota exceeded) writing {disk / 'run'}" in result.stderr
        assert "Traceback" not in result.stderr and not (disk / "run" / "run.json").exists()
        kept = complete_checkpoints(disk / "run" / "checkpoints")
        assert kept and all(verify(path) is None for path in kept)
    finally:
        subprocess.run(["umount", str(disk)], check=True)
