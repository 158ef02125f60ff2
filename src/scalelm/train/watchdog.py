"""Hang autopsy: a thread in every rank notices a step that runs far longer than the steps before it and, instead of
letting the job hang until the collective timeout or the Slurm limit, says which rank is behind and stops the job.

Every second the thread publishes this rank's progress in the job's rendezvous store (torchrun's TCPStore, which
answers while the collectives hang): the step it is in, since when, and per process group how many collectives it
has issued (the group's sequence number). A step is overdue after max(hang_factor x the median step so far,
hang_floor_s) seconds. The thread then

- writes this rank's Python stacks (faulthandler) to <run_dir>/autopsy/rank<r>.txt, and PyTorch's Flight Recorder's
  trace of its last collectives beside it (recording since the start: `flight_recorder_env`);
- reads every rank's last progress and names the ranks behind: in a group, those that issued fewer collectives
  than the others (who wait for them in the next one), and those whose progress stopped coming (a stopped process,
  a dead node);
- prints that, with what the ranks' Flight Recorder traces say (the collective each issued last, by name, sequence
  number and sizes), appends it to <run_dir>/autopsy/summary.txt, and ends the process with EXIT_HUNG; torchrun
  then stops the other ranks.

Checkpoints are written whole or not at all (scalelm.train.checkpoint): the last complete one stays and the rerun
resumes from it. The watchdog arms after the first step (which may compile, or wait for the other ranks' start) and
watches steps only: a hang in an evaluation or a checkpoint ends at the collective timeout (parallel.timeout_s).
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

from scalelm.errors import EXIT_HUNG
from scalelm.files import append_text, atomic_path

PUBLISH_EVERY_S = 1.0
FR_PREFIX = "fr_trace_rank_"  # the Flight Recorder's dump of a rank, by rank number
SILENT_AFTER_S = 5.0  # a rank whose progress is older than this has stopped publishing it
KEY = "scalelm/watchdog/rank{}"


def flight_recorder_env(autopsy_dir: Path) -> dict[str, str]:
    """PyTorch's Flight Recorder keeps every rank's last collectives (NCCL's, and gloo's where the torch records
    them) for the autopsy to read, and NCCL dumps them itself on a timeout (the environment is read when a process
    group starts; the trainer sets it)."""
    return {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # the name before torch 2.8
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(autopsy_dir / FR_PREFIX),
    }


def recorded(autopsy_dir: Path) -> list[str]:
    """What the ranks' Flight Recorder dumps in `autopsy_dir` say: the last collective each rank issued, by name,
    sequence number, group and input sizes, with its state where the backend tracks it (NCCL: completed or not;
    gloo leaves every entry `scheduled`). Read with torch's own loader, the one its analyser `fr_trace` uses."""
    try:
        from torch.distributed.flight_recorder.components.loader import read_dump
    except ImportError:  # a torch without the Flight Recorder's tools: the stacks and sequence numbers still tell
        return []
    findings = []
    for path in sorted(autopsy_dir.glob(FR_PREFIX + "*"), key=lambda p: int(p.name[len(FR_PREFIX) :])):
        try:
            dump = read_dump(FR_PREFIX, str(path))
        except Exception:  # a dump being written, or of another format
            continue
        collectives = [e for e in dump["entries"] if not e.get("is_p2p")] or dump["entries"]
        if not collectives:
            continue
        last = max(collectives, key=lambda e: e.get("record_id") or 0)  # the latest, whatever its group
        findings.append(f"rank {dump['rank']}'s last collective {last['profiling_name']} "
                        f"#{last.get('collective_seq_id')} of group {last['process_group'][1]} "
                        f"(inputs {last.get('input_sizes')}, {last.get('state')})")  # fmt: skip
    return findings


def sequence_numbers() -> dict[str, dict[str, Any]]:
    """How many collectives this rank has issued in each of its process groups: {group name: {desc, issued}}."""
    if not (dist.is_available() and dist.is_initialized()):
        return {}
    world = dist.distributed_c10d._world
    return {
        world.pg_names.get(group, "?"): {
            "desc": group.group_desc,
            "issued": int(group._get_sequence_number_for_group()),
        }
        for group in world.pg_map
        if dist.get_rank(group) >= 0  # a member
    }


def behind(progress: dict[int, dict[str, Any] | None], now: float) -> list[str]:
    """The ranks the others wait for, in words: in each process group the members that issued fewer collectives
    than the most advanced one, and the ranks whose progress is missing or stale."""
    findings = []
    silent = sorted(r for r, p in progress.items() if p is None or now - p["time"] > SILENT_AFTER_S)
    for rank in silent:
        last = progress[rank]
        when = "never published its progress" if last is None else (
            f"stopped publishing its progress {now - last['time']:.0f} s ago, in step {last['step']}")  # fmt: skip
        findings.append(f"rank {rank} {when} (a stopped or dead process, or a lost node)")
    groups: dict[str, dict[int, int]] = {}
    descs: dict[str, str] = {}
    for rank, p in progress.items():
        for name, group in (p or {}).get("groups", {}).items():
            if rank not in silent:
                groups.setdefault(name, {})[rank] = group["issued"]
                descs[name] = group["desc"]
    for name, counts in sorted(groups.items()):
        ahead = max(counts.values())
        waiting = sorted(r for r, n in counts.items() if n == ahead)
        for rank in sorted(r for r, n in counts.items() if n < ahead):
            p = progress[rank]
            findings.append(
                f"rank {rank} is behind in process group {descs[name]} (ranks {', '.join(map(str, sorted(counts)))}): "
                f"it issued {counts[rank]} collectives, rank(s) {', '.join(map(str, waiting))} issued {ahead} and "
                f"wait for it in collective #{counts[rank] + 1} (rank {rank} is in step {p['step']} since "
                f"{p['in_step_s']:.0f} s, on {p['host']})"
            )
    return findings


class Watchdog:
    def __init__(self, rank: int, autopsy_dir: Path, factor: float, floor_s: float, store: Any = None):
        self.rank, self.autopsy_dir, self.factor, self.floor_s = rank, autopsy_dir, factor, floor_s
        self.store = store
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.durations: deque[float] = deque(maxlen=200)
        self.step = 0
        self.started: float | None = None  # the running step's start (monotonic); None between steps
        self.host = socket.gethostname()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="scalelm-watchdog", daemon=True)
        if factor > 0:
            self._thread.start()

    @classmethod
    def for_job(cls, rank: int, autopsy_dir: Path, factor: float, floor_s: float) -> Watchdog:
        store = None
        if dist.is_available() and dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
            if dist.get_backend() == "nccl":  # where NCCL dumps its trace on a timeout (flight_recorder_env)
                autopsy_dir.mkdir(parents=True, exist_ok=True)
        return cls(rank, autopsy_dir, factor, floor_s, store)

    @contextmanager
    def watching(self, step: int) -> Iterator[None]:
        self.step, self.started = step, time.monotonic()
        try:
            yield
            self.durations.append(time.monotonic() - self.started)
        finally:
            self.started = None  # a step that raised is no longer running: nothing to watch while the job ends

    def threshold(self) -> float | None:
        """Seconds after which the running step is overdue; None before the first step ended."""
        if not self.durations:
            return None
        return max(self.factor * statistics.median(self.durations), self.floor_s)

    def progress(self) -> dict[str, Any]:
        in_step = time.monotonic() - self.started if self.started is not None else 0.0
        return {"step": self.step, "in_step_s": in_step, "groups": sequence_numbers(), "time": time.time(),
                "host": self.host, "pid": os.getpid()}  # fmt: skip

    def close(self) -> None:
        """Stop watching; back once the thread is done with the process groups, before they are shut down."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10 * PUBLISH_EVERY_S)  # a store that no longer answers: not forever

    # ---------------------------------------------------------------------------------------- the thread
    def _watch(self) -> None:
        while not self._done.wait(PUBLISH_EVERY_S):
            self._publish(self.progress())
            started, limit = self.started, self.threshold()
            if started is not None and limit is not None and time.monotonic() - started > limit:
                self._autopsy(limit)

    def _publish(self, progress: dict[str, Any]) -> None:
        if self.store is not None:
            try:
                self.store.set(KEY.format(self.rank), json.dumps(progress))
            except Exception:  # the store's host is gone: the job is ending anyway
                pass

    def _read(self) -> dict[int, dict[str, Any] | None]:
        if self.store is None:
            return {self.rank: self.progress()}
        progress: dict[int, dict[str, Any] | None] = {}
        for rank in range(self.world_size):
            key = KEY.format(rank)
            try:
                progress[rank] = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except Exception:
                progress[rank] = None
        return progress

    def _autopsy(self, limit: float) -> None:
        """Write what this rank knows, name the ranks behind, end the process."""
        self.autopsy_dir.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.autopsy_dir / f"rank{self.rank}.txt") as partial, open(partial, "w") as stacks:
            stacks.write(f"rank {self.rank} on {self.host}, step {self.step} overdue (> {limit:.1f} s):\n")
            stacks.flush()
            faulthandler.dump_traceback(stacks, all_threads=True)
        self._dump_flight_recorder()
        time.sleep(2 * PUBLISH_EVERY_S)  # the other ranks' latest progress, before reading it
        findings = behind(self._read(), time.time()) or [
            "every rank that answers has issued as many collectives as the others: none is behind in one (a "
            "step that is slow everywhere, or a collective the network does not complete)"
        ]
        message = (
            f"scalelm: step {self.step} has run for over {limit:.0f} s (hang_factor {self.factor:g} x the median "
            f"step, at least hang_floor_s {self.floor_s:g}); stopping the job. "
            + "; ".join(findings)
            + f". Stacks: {self.autopsy_dir}/rank*.txt. The last complete checkpoint is kept: rerun to resume."
        )
        message += self._flight_recorder_findings()  # every rank waits for the dumps: none ends the job before
        if self._first_to_tell():
            append_text(self.autopsy_dir / "summary.txt", message + "\n")
            sys.stderr.write(message + "\n")
        else:
            sys.stderr.write(f"scalelm: [rank {self.rank}] step {self.step} overdue; stacks in {self.autopsy_dir}\n")
        sys.stderr.flush()
        os._exit(EXIT_HUNG)  # the main thread is stuck in a collective: no exception would reach it

    def _flight_recorder_findings(self) -> str:
        """The Flight Recorder's view, once every rank's dump is there (the other watchdogs fire within a second or
        two of this one; a rank that stopped writes none)."""
        if not (dist.is_available() and dist.is_initialized()):
            return ""  # one process: no collective to wait in
        deadline = time.monotonic() + 3 * PUBLISH_EVERY_S
        while len(list(self.autopsy_dir.glob(FR_PREFIX + "*"))) < self.world_size and time.monotonic() < deadline:
            time.sleep(0.2)
        findings = recorded(self.autopsy_dir)
        if not findings:
            return ""
        text = f" Flight Recorder: {'; '.join(findings)}"
        if "nccl" in str(dist.get_backend()):  # torch's analyser matches NCCL's dumps (gloo's lack its groups table)
            analyser = "python -m torch.distributed.flight_recorder.fr_trace"
            text += f" (all of it: {analyser} {self.autopsy_dir} --prefix {FR_PREFIX})"
        return text

    def _first_to_tell(self) -> bool:
        """Whether this rank is the first whose watchdog fired (the others' would only repeat its findings)."""
        if self.store is None:
            return True
        try:
            return self.store.add(KEY.format("told"), 1) == 1
        except Exception:
            return True

    def _dump_flight_recorder(self) -> None:
        """The Flight Recorder's trace of this rank's last collectives (flight_recorder_env), where it records."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        import torch._C._distributed_c10d as c10d

        dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)  # torch < 2.8
        try:
            trace = dump() if dump else None
        except Exception:  # no trace buffer
            return
        if trace:
            with atomic_path(self.autopsy_dir / f"{FR_PREFIX}{self.rank}") as partial:
                partial.write_bytes(trace)
