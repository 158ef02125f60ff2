"""The hang watchdog on every backend a group may have: NCCL's Flight Recorder read beside the generic one (gloo's),
sequence numbers per backend under `cuda:nccl,cpu:gloo`, a watchdog thread that outlives what it cannot read, and a
hang in a send or recv (which NCCL counts apart from its collectives) named from the dumps."""

import json
import pickle
import time

import pytest
import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from scalelm.hang import flight_recorder, watchdog
from scalelm.hang.flight_recorder import FR_PREFIX, GENERIC_DUMP, GENERIC_FR_PREFIX, NCCL_DUMP
from scalelm.hang.watchdog import KEY, NONE_BEHIND, Watchdog

OFFLOAD = "cuda:nccl,cpu:gloo"  # scalelm.parallel.env.backend_for with parallel.cpu_offload


@pytest.fixture
def gloo_group():
    """A one-rank `cpu:gloo` group in this process that has issued two all-reduces."""
    dist.init_process_group("cpu:gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for _ in range(2):
            dist.all_reduce(torch.ones(2))
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def entry(record_id, name, state="completed", group=("0", "default_pg"), seq=0, p2p_seq=0, sizes=((4,),)):
    """A Flight Recorder entry as torch's recorder writes it (torch/distributed/flight_recorder's fields); NCCL's
    sends, recvs and their batch's closing "coalesced" entry are point-to-point."""
    sizes = [list(s) for s in sizes]
    times = {
        "time_created_ns": 1000 + record_id,
        "time_discovered_started_ns": None,
        "time_discovered_completed_ns": None,
    }
    return {
        "record_id": record_id,
        "pg_id": int(group[0]),
        "process_group": group,
        "collective_seq_id": seq,
        "p2p_seq_id": p2p_seq,
        "op_id": record_id + 1,
        "profiling_name": name,
        **times,
        "input_sizes": sizes,
        "input_dtypes": ["Float"],
        "output_sizes": sizes,
        "output_dtypes": ["Float"],
        "state": state,
        "retired": state == "completed",
        "timeout_ms": 600000,
        "frames": [],
        "is_p2p": name.split(":")[1].split(" ")[0] in ("send", "recv", "coalesced"),
    }


def nccl_dump(*entries):
    """A dump as NCCL's recorder writes it: its groups' global ranks in `pg_config` (the generic one's has none)."""
    groups = {"0": ("default_pg", "[0, 1, 2, 3]"), "1": ("mesh_pp", "[2, 3]")}
    config = {name: {"name": name, "desc": desc, "ranks": ranks} for name, (desc, ranks) in groups.items()}
    return {
        "version": "2.10",
        "comm_lib_version": "2.27.3",
        "entries": list(entries),
        "pg_status": {},
        "pg_config": config,
    }


def test_the_autopsy_reads_nccls_recorder_beside_the_generic_one(gloo_group, tmp_path, monkeypatch):
    """Finding 5: NCCL writes to its own recorder (`_dump_nccl_trace`), gloo to the generic one (`_dump_fr_trace`);
    a CUDA build has both. NCCL in use: NCCL's dump where torch's analyser and NCCL's own dump on a timeout look,
    the generic one beside it, and the autopsy reads both, each entry labelled by its backend."""
    assert watchdog.parse_backends(OFFLOAD) == {"cuda": "nccl", "cpu": "gloo"}
    assert watchdog.parse_backends("nccl") == {"": "nccl"}
    both, generic_only, nccl_only = (
        {GENERIC_DUMP: True, NCCL_DUMP: True},
        {GENERIC_DUMP: True, NCCL_DUMP: False},
        {NCCL_DUMP: True},
    )
    plan = flight_recorder.dump_plan
    assert plan({"nccl", "gloo"}, both) == [(FR_PREFIX, NCCL_DUMP), (GENERIC_FR_PREFIX, GENERIC_DUMP)]
    assert plan({"nccl"}, both) == [(FR_PREFIX, NCCL_DUMP)]  # nothing writes to the generic one
    assert plan({"gloo"}, both) == [(FR_PREFIX, GENERIC_DUMP)]
    assert plan({"nccl", "gloo"}, nccl_only) == [(FR_PREFIX, NCCL_DUMP)]  # torch < 2.8: one recorder
    assert plan({"nccl", "gloo"}, generic_only) == [(FR_PREFIX, GENERIC_DUMP)]  # a build without NCCL
    assert plan({"gloo"}, {}) == []

    # gloo alone: the generic dump, as before
    assert watchdog.backends_in_use() == {"gloo"} and flight_recorder.dump_functions()[GENERIC_DUMP]
    gloo_dir = tmp_path / "gloo"
    gloo_dir.mkdir()
    assert flight_recorder.dump_flight_recorder(gloo_dir, 0, watchdog.backends_in_use()) == [gloo_dir / f"{FR_PREFIX}0"]
    gloo_last = "rank 0's last collective gloo:all_reduce #2 of group default_pg (inputs [[2]], scheduled)"
    assert flight_recorder.recorded(gloo_dir) == [gloo_last]
    assert not (tmp_path / "for_job").exists() and Watchdog.for_job(0, tmp_path / "for_job", 0, 10).world_size == 1

    # NCCL beside gloo, with a build that has NCCL's recorder
    monkeypatch.setattr(watchdog, "backend_string", lambda group: OFFLOAD)
    ours = nccl_dump(entry(0, "nccl:all_reduce", seq=1), entry(1, "nccl:all_reduce", "scheduled", seq=2))
    monkeypatch.setattr(c10d, NCCL_DUMP, lambda: pickle.dumps(ours), raising=False)
    assert watchdog.backends_in_use() == {"nccl", "gloo"}
    assert flight_recorder.dump_functions() == {GENERIC_DUMP: True, NCCL_DUMP: True}
    Watchdog.for_job(0, tmp_path / "for_job", 0, 10)
    assert (tmp_path / "for_job").is_dir()  # where NCCL's own dump on a timeout goes: "cuda:nccl,cpu:gloo" is NCCL
    both_dir = tmp_path / "both"
    both_dir.mkdir()
    (both_dir / f"{FR_PREFIX}1.partial").write_bytes(b"half")  # another rank's, being written: not read
    written = flight_recorder.dump_flight_recorder(both_dir, 0, watchdog.backends_in_use())
    assert written == [both_dir / f"{FR_PREFIX}0", both_dir / f"{GENERIC_FR_PREFIX}0"]
    assert pickle.loads(written[0].read_bytes()) == ours  # NCCL's under the analyser's prefix
    dumps = flight_recorder.read_dumps(both_dir)
    assert list(dumps) == [0] and {e["backend"] for e in dumps[0]} == {"nccl", "gloo"}
    assert flight_recorder.recorded(both_dir) == [
        gloo_last,
        "rank 0's last collective nccl:all_reduce #2 of group default_pg (inputs [[4]], scheduled)",
    ]
    entries = flight_recorder.recorder_entries()
    assert entries[NCCL_DUMP] == ours["entries"] and entries[GENERIC_DUMP][-1]["profiling_name"] == "gloo:all_reduce"

    def broken():
        raise RuntimeError("no trace buffer")

    monkeypatch.setattr(c10d, NCCL_DUMP, broken)
    broken_dir = tmp_path / "broken"
    broken_dir.mkdir()
    assert flight_recorder.dump_flight_recorder(broken_dir, 0, watchdog.backends_in_use()) == [
        broken_dir / f"{GENERIC_FR_PREFIX}0"
    ]
    assert flight_recorder.recorder_entries()[NCCL_DUMP] == "no dump (no trace buffer?)"


def test_sequence_numbers_are_read_per_backend(gloo_group, tmp_path, monkeypatch, capsys):
    """Finding 6: under `cuda:nccl,cpu:gloo` a group holds two backends, each with its own sequence number (the
    group's `_get_sequence_number_for_group` reads one, and raises for a group whose type is not gloo, NCCL or UCC):
    each is read apart, what cannot be read is said once and the watchdog's turn goes on; the ranks behind are named
    per backend."""
    store = dist.distributed_c10d._get_default_store()
    dog = Watchdog(0, tmp_path, factor=0, floor_s=10, store=store)  # factor 0: no thread, its turns taken here
    dog.tick()
    assert json.loads(store.get(KEY.format(0)))["groups"] == {"0": {"desc": "default_pg", "issued": {"gloo": 2}}}
    assert dog.notes == []

    monkeypatch.setattr(watchdog, "backend_string", lambda group: OFFLOAD)  # this CPU has no NCCL backend to read
    dog.tick()
    dog.tick()
    assert json.loads(store.get(KEY.format(0)))["groups"]["0"]["issued"] == {"gloo": 2}
    assert len(dog.notes) == 1 and "default_pg's sequence number on cuda nccl backend" in dog.notes[0], dog.notes
    assert capsys.readouterr().err.count("watchdog: cannot read") == 1  # said once

    class Backend:
        def __init__(self, issued):
            self.issued = issued

        def _get_sequence_number_for_group(self):
            return self.issued

    class Group:  # two backends, no default one
        group_desc = "default_pg"
        backends = {"cuda": Backend(7), "cpu": Backend(3)}

        def _get_backend(self, device):
            return self.backends[device.type]

        def _get_sequence_number_for_group(self):
            raise RuntimeError("ProcessGroup custom does not yet support sequence numbers.")

    assert watchdog.issued_per_backend(Group()) == {"nccl": 7, "gloo": 3}

    def progress(nccl, gloo):
        groups = {"0": {"desc": "default_pg", "issued": {"nccl": nccl, "gloo": gloo}}}
        return {"step": 9, "in_step_s": 30.0, "groups": groups, "time": 1000.0, "host": "node7", "pid": 42}

    assert watchdog.behind({0: progress(7, 3), 1: progress(6, 3)}, 1000.0) == [
        "rank 1 is behind in process group default_pg on nccl (ranks 0, 1): it issued 6 collectives, rank(s) 0 "
        "issued 7 and wait for it in collective #7 (rank 1 is in step 9 since 30 s, on node7)"
    ]


def test_the_watchdog_thread_outlives_what_it_cannot_read(tmp_path, monkeypatch, capsys):
    """Finding 6: a backend without sequence numbers (the fake one here; a group whose backend type is none of
    gloo, NCCL, UCC) raised in the thread's first turn and ended it, the hang detection with it."""
    monkeypatch.setattr(watchdog, "PUBLISH_EVERY_S", 0.02)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        dog = Watchdog(0, tmp_path, factor=2, floor_s=10, world_size=4)
        time.sleep(0.2)
        assert dog._thread.is_alive() and len(dog.notes) == 1 and "fake" in dog.notes[0], dog.notes

        def fails():
            raise OSError("a turn that fails")

        monkeypatch.setattr(dog, "overdue", fails)
        time.sleep(0.2)
        assert dog._thread.is_alive() and dog.notes[1] == "a turn failed (OSError: a turn that fails)", dog.notes
        dog.close()
        assert not dog._thread.is_alive()
    finally:
        dist.destroy_process_group()
    assert capsys.readouterr().err.count("watchdog: a turn failed") == 1


def test_a_hang_in_a_send_or_recv_is_named_from_the_flight_recorder(tmp_path):
    """Finding 7: NCCL counts sends and recvs apart from its collectives, so the sequence numbers of a job hung in
    pipeline or context parallelism's point-to-point agree, and the summary said "none is behind". The Flight
    Recorder's dumps name the rank in a recv and whether its peer is in the matching send: here pipeline stages on
    ranks 2 and 3 (group ranks 0 and 1), rank 3 waiting for activations rank 2 never sent; then a batch
    (batch_isend_irecv) both sides posted."""
    pp = ("1", "mesh_pp")
    activations = {"group": pp, "sizes": [(2, 8)]}
    stage0 = nccl_dump(entry(0, "nccl:all_reduce", seq=5), entry(1, "nccl:send 0->1", p2p_seq=1, **activations))
    stage1 = nccl_dump(
        entry(0, "nccl:all_reduce", seq=5),
        entry(1, "nccl:recv 1<-0", p2p_seq=1, **activations),
        entry(2, "nccl:recv 1<-0", "scheduled", p2p_seq=2, **activations),
    )
    for rank, dump in ((2, stage0), (3, stage1)):
        (tmp_path / f"{FR_PREFIX}{rank}").write_bytes(pickle.dumps(dump))
    dumps = flight_recorder.read_dumps(tmp_path)
    progress = {
        r: {
            "step": 4,
            "in_step_s": 30.0,
            "groups": {"0": {"desc": "default_pg", "issued": {"nccl": 5}}},
            "time": 1000.0,
            "host": "node7",
            "pid": 40 + r,
        }
        for r in (2, 3)
    }
    assert watchdog.behind(progress, 1000.0) == []  # the collectives agree
    assert watchdog.diagnosis(progress, dumps, 1000.0) == [
        "rank 3 is in recv from rank 2, p2p op #2 of group mesh_pp (nccl:recv 1<-0, inputs [[2, 8]], scheduled); "
        "rank 2 is not in the matching send to rank 3: it is behind, in its last op "
        "nccl:send 0->1 (send to rank 3) p2p op #1 of group mesh_pp (inputs [[2, 8]], completed)"
    ]
    assert flight_recorder.recorded(tmp_path) == [
        "rank 2's last collective nccl:all_reduce #5 of group default_pg (inputs [[4]], completed)",
        "rank 2's last p2p op nccl:send 0->1 (send to rank 3) p2p op #1 of group mesh_pp (inputs [[2, 8]], completed)",
        "rank 3's last collective nccl:all_reduce #5 of group default_pg (inputs [[4]], completed)",
        "rank 3's last p2p op nccl:recv 1<-0 (recv from rank 2) p2p op #2 of group mesh_pp (inputs [[2, 8]], "
        "scheduled)",
    ]

    def batch(*ops):  # batch_isend_irecv: its sends and recvs, then the "coalesced" entry that holds their state
        closing = entry(3, "nccl:coalesced", "started", group=pp, p2p_seq=3)
        issued = [entry(i, name, "scheduled", group=pp, p2p_seq=3) for i, name in enumerate(ops, 1)]
        return pickle.dumps(nccl_dump(entry(0, "nccl:all_reduce", seq=5), *issued, closing))

    (tmp_path / f"{FR_PREFIX}2").write_bytes(batch("nccl:send 0->1", "nccl:recv 0<-1"))
    (tmp_path / f"{FR_PREFIX}3").write_bytes(batch("nccl:recv 1<-0", "nccl:send 1->0"))
    waits = watchdog.diagnosis(progress, flight_recorder.read_dumps(tmp_path), 1000.0)
    where = [w.split(",")[0] for w in waits]
    assert where == [
        f"rank {r} is in {d} rank {5 - r}"
        for r, d in ((2, "send to"), (2, "recv from"), (3, "recv from"), (3, "send to"))
    ]
    assert waits[0].endswith(
        "; rank 3 is in the matching recv from rank 2 (p2p op #3, scheduled): both wait, the transfer does not complete"
    )
    (tmp_path / f"{FR_PREFIX}3").unlink()
    assert flight_recorder.p2p_waits(flight_recorder.read_dumps(tmp_path))[0].endswith(
        "; rank 3 wrote no Flight Recorder dump (stopped, or gone)"
    )

    # gloo tracks no completion: a rank is in its last operation; no send or recv there, none is behind
    gloo = {0: [{**entry(0, "gloo:all_reduce", "scheduled", seq=1), "backend": "gloo", "group_ranks": []}]}
    assert flight_recorder.waiting_in(gloo[0]) == gloo[0]
    assert watchdog.diagnosis({0: progress[2]}, gloo, 1000.0) == [NONE_BEHIND]
