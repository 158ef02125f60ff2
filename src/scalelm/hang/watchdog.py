"""Hang autopsy: a thread in every rank notices a step that runs far longer than the steps before it and, instead of
letting the job hang until the collective timeout or the Slurm limit, says which rank is behind and stops the job.

Every second the thread publishes this rank's progress in the job's rendezvous store (torchrun's TCPStore, which
answers while the collectives hang; under the spawn launcher, rank 0's): the step it is in, since when, and per
process group and backend how many operations it has issued (each backend's sequence number: a group started as
`cuda:nccl,cpu:gloo` counts its NCCL and its gloo operations apart). A step is overdue after
max(hang_factor x the median step so far, hang_floor_s) seconds: the limit. So is a rank that has not ended a step
for the limit (it waits in a collective between steps: the log's, an evaluation's, a checkpoint's) while another
rank's progress stopped coming for as long, or the store has not answered for as long (each call is waited for
STORE_TIMEOUT_S at most): a process that makes no progress at all, its threads included (stopped, a hung file system
or driver, a node that stops answering), publishes nothing, and only the ranks that wait for it can tell. What the
thread cannot read (a backend without sequence numbers, such as the fake one) it says once and watches the rest. The
thread then

- writes this rank's Python stacks (faulthandler) to <run_dir>/autopsy/rank<r>.txt, and its Flight Recorder dumps
  (its last operations, per backend: scalelm.hang.flight_recorder) beside them;
- reads every rank's last progress and names the ranks behind: in a group, those that issued fewer operations
  than the others (who wait for them in the next one), and those whose progress stopped coming (a stopped process,
  a dead node); failing that, from every rank's Flight Recorder dumps, a rank waiting in a point-to-point operation
  (NCCL counts them apart from its collectives: pipeline and context parallelism's send/recv) and whether its peer is
  in the matching one;
- prints that, with what the ranks' Flight Recorder traces say (per backend, the collective and the point-to-point
  operation each issued last, by name, sequence number and sizes), appends it to <run_dir>/autopsy/summary.txt, and
  ends the process with EXIT_HUNG; torchrun then stops the other ranks. A rank that is a stopped process beside this
  one (same launcher) is killed first: torchrun's SIGTERM would reach it only once continued, and its SIGKILL comes
  30 s later. The autopsy waits for no other rank longer than a few seconds: one that stopped writes no dump and
  answers nothing.

Checkpoints are written whole or not at all (scalelm.train.checkpoint): the last complete one stays and the rerun
resumes from it. A step is overdue only once one has ended (the first may compile, or wait for the other ranks'
start); before, and between steps, the watchdog acts on a silent rank or store only, with hang_floor_s as the limit
until a step has ended: a rank that compiles for minutes keeps publishing, one frozen before its first step does not.
A rank alive but stuck in an evaluation or a checkpoint ends at the collective timeout (parallel.timeout_s).

A rank that leaves the job early (exit 0 included, which torchrun does not count as a failure) makes the others fail
in their next collective; the watchdog of a rank that such an error ends (closed while it is under way) names the
ranks that left (left_early), in the log and <run_dir>/autopsy/summary.txt.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from scalelm.errors import EXIT_HUNG
from scalelm.files import append_text, atomic_path
from scalelm.hang.flight_recorder import (
    FR_PREFIX,
    dump_flight_recorder,
    dumped_ranks,
    first_line,
    last_operations,
    p2p_waits,
    read_dumps,
)

PUBLISH_EVERY_S = 1.0
SILENT_AFTER_S = 5.0  # a rank whose progress is older than this has stopped publishing it
STORE_TIMEOUT_S = 5.0  # a call to the store unanswered for this long: the process that holds it is stopped or gone
KEY = "scalelm/watchdog/rank{}"
NONE_BEHIND = (
    "every rank that answers has issued as many collectives as the others: none is behind in one (a step that is "
    "slow everywhere, or a collective the network does not complete)"
)


# ------------------------------------------------------------------------------------- backends and sequence numbers
def parse_backends(text: str) -> dict[str, str]:
    """A process group's backend string by device type: "cuda:nccl,cpu:gloo" -> {"cuda": "nccl", "cpu": "gloo"}; a
    bare name ("nccl") has no device: {"": "nccl"}."""
    backends = {}
    for part in str(text).lower().replace(" ", "").split(","):
        device, _, name = part.rpartition(":")
        if name:
            backends[device] = name
    return backends


def backend_string(group: Any) -> str:
    """The group's backends by device ("cpu:gloo,cuda:nccl"): torch's record of them where it keeps one, else the
    string `get_backend` returns (a comparison with "nccl" fails on "cuda:nccl,cpu:gloo")."""
    world = dist.distributed_c10d._world
    config = getattr(world, "pg_backend_config", {}).get(group)
    return str(config) if config else str(world.pg_map[group][0])


def _groups() -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return []
    return list(dist.distributed_c10d._world.pg_map)


def backends_in_use() -> set[str]:
    """The backends of this rank's process groups: {"nccl", "gloo"} under `cuda:nccl,cpu:gloo`."""
    names: set[str] = set()
    for group in _groups():
        with contextlib.suppress(Exception):  # a group being destroyed meanwhile
            names |= set(parse_backends(backend_string(group)).values())
    return names


def issued_per_backend(group: Any, errors: list[str] | None = None) -> dict[str, int]:
    """How many operations this rank issued in `group`, per backend ({"nccl": 12, "gloo": 3}): each backend's own
    sequence number. The group's `_get_sequence_number_for_group` reads its default backend only, and raises for
    a group whose backend is not gloo, NCCL or UCC (the fake one). What cannot be read is left out and said in
    `errors`."""
    counts: dict[str, int] = {}
    seen: list[Any] = []
    for device, name in parse_backends(backend_string(group)).items():
        try:
            backend = group._get_backend(torch.device(device)) if device else group
            if any(backend is other for other in seen):  # one backend serving several devices (gloo: CPU and CUDA)
                continue
            seen.append(backend)
            counts[f"{device}:{name}" if name in counts else name] = int(backend._get_sequence_number_for_group())
        except Exception as error:  # a backend without sequence numbers, or absent for that device
            if errors is not None:
                errors.append(
                    f"cannot read process group {getattr(group, 'group_desc', '?')}'s sequence number "
                    f"on {device or 'its'} {name} backend ({first_line(error)})"
                )
    return counts


def sequence_numbers(errors: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """How many operations this rank has issued in each of its process groups, per backend:
    {group name: {"desc": ..., "issued": {backend: n}}}; what cannot be read is said in `errors`."""
    world = dist.distributed_c10d._world
    numbers = {}
    for group in _groups():
        try:
            if dist.get_rank(group) < 0:  # not a member
                continue
            name, desc = world.pg_names.get(group, "?"), group.group_desc
        except Exception as error:  # a group being destroyed meanwhile
            if errors is not None:
                errors.append(f"cannot read a process group ({first_line(error)})")
            continue
        numbers[name] = {"desc": desc, "issued": issued_per_backend(group, errors)}
    return numbers


def _counts(group: dict[str, Any]) -> dict[str, int]:
    issued = group["issued"]
    return issued if isinstance(issued, dict) else {"": issued}  # one number: progress written before backends


def silent_ranks(progress: dict[int, dict[str, Any] | None], now: float, after_s: float = SILENT_AFTER_S) -> list[int]:
    """The ranks whose progress is missing, or older than `after_s` seconds at `now` (time.time()); not those whose
    watchdog was closed (their training is over: they publish no more)."""
    return sorted(r for r, p in progress.items() if p is None or not p.get("closed") and now - p["time"] > after_s)


def in_step(progress: dict[str, Any]) -> str:
    """Where a rank's published progress says it is: "in step 8", or before the first step of this attempt."""
    return f"in step {progress['step']}" if progress["step"] else "before its first step"


def behind(progress: dict[int, dict[str, Any] | None], now: float, found_silent: Iterable[int] = ()) -> list[str]:
    """The ranks the others wait for, in words: in each process group and backend the members that issued fewer
    operations than the most advanced one, and the ranks whose progress is missing or stale (older than
    SILENT_AFTER_S, or `found_silent`: those the watchdog's decision found so, over its own limit)."""
    findings = []
    silent = sorted(set(silent_ranks(progress, now)) | set(found_silent))
    for rank in silent:
        last = progress[rank]
        when = "never published its progress"
        if last is not None:
            when = (
                f"stopped publishing its progress {now - last['time']:.0f} s ago, {in_step(last)}, "
                f"on {last['host']} (pid {last.get('pid', '?')})"
            )
        findings.append(f"rank {rank} {when} (a stopped or dead process, or a lost node)")
    return findings + [finding for _, finding in shortfalls(progress, silent)]


def shortfalls(progress: dict[int, dict[str, Any] | None], silent: list[int]) -> list[tuple[int, str]]:
    """In each process group and backend, each member that issued fewer operations than the most advanced one, with
    the finding in words: (rank, finding). The `silent` ranks' counts are left out (they may have issued more than
    they published); a rank whose training ended (its watchdog closed) and issued fewer left the job before the
    others' next operation."""
    counters: dict[tuple[str, str], dict[int, int]] = {}
    descs: dict[str, str] = {}
    for rank, p in progress.items():
        for name, group in (p or {}).get("groups", {}).items():
            if rank not in silent:
                for backend, issued in _counts(group).items():
                    counters.setdefault((name, backend), {})[rank] = issued
                descs[name] = group["desc"]
    found = []
    for (name, backend), counts in sorted(counters.items()):
        ahead = max(counts.values())
        waiting = ", ".join(str(r) for r, n in sorted(counts.items()) if n == ahead)
        several = len({b for n, b in counters if n == name}) > 1  # the group has several backends: say which
        where = f"process group {descs[name]}" + (f" on {backend}" if several else "")
        members = ", ".join(map(str, sorted(counts)))
        for rank in sorted(r for r, n in counts.items() if n < ahead):
            p, issued = progress[rank], counts[rank]
            waits = f"rank(s) {waiting} issued {ahead} and wait for it in collective #{issued + 1}"
            if p.get("closed"):
                finding = (
                    f"rank {rank} left the job: its training ended {in_step(p)}, on {p['host']} (pid "
                    f"{p.get('pid', '?')}), after it issued {issued} collectives in {where} (ranks {members}); {waits}"
                )
            else:
                finding = (
                    f"rank {rank} is behind in {where} (ranks {members}): it issued {issued} collectives, {waits} "
                    f"(rank {rank} is {in_step(p)} since {p['in_step_s']:.0f} s, on {p['host']})"
                )
            found.append((rank, finding))
    return found


def left_early(progress: dict[int, dict[str, Any] | None], host: str) -> list[str]:
    """The ranks that left the job before this rank's collective failed, in words: those whose training ended (their
    watchdog closed) having issued fewer operations than the others, and those on `host` (where their process can be
    looked at) whose process is gone without ending its training. Not a rank that is only late in publishing."""
    found = [finding for rank, finding in shortfalls(progress, []) if progress[rank].get("closed")]
    for rank, p in sorted(progress.items()):
        if p and not p.get("closed") and p["host"] == host and process_gone(p.get("pid")):
            found.append(
                f"rank {rank}'s process (pid {p['pid']}, on {host}) ended {in_step(p)} without ending its training"
            )
    return found


def process_gone(pid: int | None) -> bool:
    """Whether the process `pid` of this host has ended (gone, or a zombie its launcher has not reaped yet)."""
    if pid is None or pid == os.getpid():
        return False
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # not ours to look at: alive
        return False


def diagnosis(
    progress: dict[int, dict[str, Any] | None],
    dumps: dict[int, list[dict[str, Any]]],
    now: float,
    found_silent: Iterable[int] = (),
) -> list[str]:
    """Who the others wait for: from the published progress (behind), else from the Flight Recorder's sends and
    recvs (p2p_waits), else that none is behind."""
    return behind(progress, now, found_silent) or p2p_waits(dumps) or [NONE_BEHIND]


def stopped_beside() -> list[psutil.Process]:
    """The node's other ranks that are stopped (SIGSTOP, not a debugger's stop): the processes the same launcher
    started as this one (its children, by the same command). torchrun would end them with SIGTERM, which waits for a
    SIGCONT, and kill them only after its shutdown timeout (30 s)."""
    me = psutil.Process()
    stopped = []
    try:
        command, siblings = me.cmdline()[:2], me.parent().children()
    except (psutil.Error, AttributeError):  # no parent left
        return []
    for process in siblings:
        try:
            if (
                process.pid != me.pid
                and process.status() == psutil.STATUS_STOPPED
                and process.cmdline()[:2] == command
                and process.exe() == me.exe()
            ):
                stopped.append(process)
        except psutil.Error:  # gone meanwhile, or not ours to look at
            continue
    return stopped


def named(processes: list[psutil.Process], progress: dict[int, dict[str, Any] | None] | None) -> str:
    """The ranks of `processes`, by the pids their progress gave, else their pids."""
    ranks = {p["pid"]: r for r, p in (progress or {}).items() if p and "pid" in p}
    return ", ".join(f"rank {ranks[p.pid]} (pid {p.pid})" if p.pid in ranks else f"pid {p.pid}" for p in processes)


class Unanswered(Exception):
    """The job's store did not answer in time, or still has not answered an earlier call."""


class BoundedStore:
    """The job's store, each call waited for `timeout_s` at most, made in a thread of its own: the store may live in
    the process that is stopped (rank 0's under the spawn launcher, torchrun's otherwise), and a call to it would
    wait for the store's own timeout (the collectives': minutes). While a call is unanswered no other is made (one
    connection serves its calls in turn); once it is answered, the store is back."""

    def __init__(self, store: Any, timeout_s: float = STORE_TIMEOUT_S):
        self.store, self.timeout_s = store, timeout_s
        self.failing_since: float | None = None  # since when (monotonic) no call was answered
        self._call: threading.Thread | None = None

    def unanswered_s(self) -> float:
        return 0.0 if self.failing_since is None else time.monotonic() - self.failing_since

    def ask(self, method: str, *args: Any) -> Any:
        if self._call is not None and self._call.is_alive():
            raise Unanswered(f"the store has not answered for {self.unanswered_s():.0f} s")
        outcome: dict[str, Any] = {}
        asked = time.monotonic()

        def call() -> None:
            try:
                outcome["value"] = getattr(self.store, method)(*args)
                self.failing_since = None
            except Exception as error:  # its host gone, or its own timeout
                outcome["error"] = error

        self._call = threading.Thread(target=call, name="scalelm-watchdog-store", daemon=True)
        self._call.start()
        self._call.join(self.timeout_s)
        if "value" in outcome:
            return outcome["value"]
        self.failing_since = self.failing_since or asked
        raise Unanswered(f"the store did not answer {method} in {self.timeout_s:g} s") from outcome.get("error")


class Watchdog:
    def __init__(
        self,
        rank: int,
        autopsy_dir: Path,
        factor: float,
        floor_s: float,
        store: Any = None,
        world_size: int | None = None,
    ):
        self.rank, self.autopsy_dir, self.factor, self.floor_s = rank, autopsy_dir, factor, floor_s
        self.store = BoundedStore(store) if store is not None else None
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.world_size = world_size
        self.durations: deque[float] = deque(maxlen=200)
        self.step = 0
        self.started: float | None = None  # the running step's start (monotonic); None between steps
        self.ended = time.monotonic()  # the last step's end, or the watchdog's start (monotonic)
        self.peers_read = 0.0  # when _silent_peers last read the others' progress (monotonic)
        # the ranks `overdue` found silent: its reason names them, so the findings do (a rank that publishes again
        # by the autopsy's read, or one a few seconds short of SILENT_AFTER_S, would otherwise be named otherwise)
        self.found_silent: list[int] = []
        self.host = socket.gethostname()
        self.notes: list[str] = []  # what the thread could not do, said once each
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="scalelm-watchdog", daemon=True)
        if factor > 0:
            self._thread.start()

    @classmethod
    def for_job(cls, rank: int, autopsy_dir: Path, factor: float, floor_s: float) -> Watchdog:
        store = None
        if dist.is_available() and dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
            if "nccl" in backends_in_use():  # where NCCL dumps its trace on a timeout (flight_recorder_env)
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
            self.ended = time.monotonic()

    def threshold(self) -> float | None:
        """Seconds after which the running step is overdue; None before the first step ended."""
        if not self.durations:
            return None
        return max(self.factor * statistics.median(self.durations), self.floor_s)

    def rule(self) -> str:
        """How the limit is set, in words, for the autopsy."""
        if not self.durations:
            return f"hang_floor_s {self.floor_s:g} until a step has ended"
        return f"hang_factor {self.factor:g} x the median step, at least hang_floor_s {self.floor_s:g}"

    def progress(self) -> dict[str, Any]:
        in_step_s = time.monotonic() - self.started if self.started is not None else 0.0
        unread: list[str] = []
        groups = sequence_numbers(unread)
        for what in unread:
            self.note(what)
        return {
            "step": self.step,
            "in_step_s": in_step_s,
            "groups": groups,
            "time": time.time(),
            "host": self.host,
            "pid": os.getpid(),
        }

    def note(self, what: str) -> None:
        """Say once what the watchdog cannot do; it goes on with the rest."""
        if what not in self.notes:
            self.notes.append(what)
            sys.stderr.write(f"scalelm: [rank {self.rank}] watchdog: {what}; it watches what it can\n")

    def close(self, error: BaseException | None = None) -> None:
        """Stop watching; back once the thread is done with the process groups, before they are shut down. `error`:
        what ends the training, if anything; by default the exception under way (the engine closes its watchdog in
        a `finally`). A collective's failure (a RuntimeError) names the ranks that left the job before it."""
        error = error if error is not None else sys.exc_info()[1]
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10 * PUBLISH_EVERY_S)  # a store that no longer answers: not forever
            if not self._thread.is_alive():  # silent from now on, and not stopped: the others are told so
                self._publish({**self.progress(), "closed": True})
                if isinstance(error, RuntimeError):  # torch's collectives raise one when a peer is gone
                    self._survive(self._tell_left)

    def overdue(self) -> str | None:
        """Why the job is to stop now, or None: this rank's step is overdue, or this rank has ended no step for the
        limit while another rank published no progress for as long (it waits for a rank that is stopped or gone) or
        the store has not answered for as long. Until a step has ended there is no median: the first step is never
        overdue (it may compile for minutes), and the silence's limit is the floor."""
        started, limit, now = self.started, self.threshold(), time.monotonic()
        if started is not None and limit is not None:  # in a step: its own limit only
            return f"step {self.step} has run for over {limit:.0f} s" if now - started > limit else None
        limit = self.floor_s if limit is None else limit
        if now - self.ended <= limit:
            return None
        if self.durations:
            waited = f"rank {self.rank} has waited {now - self.ended:.0f} s since step {self.step} ended"
        else:  # since the watchdog started, just before the training loop
            waited = f"rank {self.rank} has ended no step in the {now - self.ended:.0f} s since its training started"
        waited += f" (limit {limit:.0f} s)"
        if self.store is not None and self.store.unanswered_s() > limit:
            return f"{waited}, and the job's store has not answered for {self.store.unanswered_s():.0f} s"
        silent = self.found_silent = self._silent_peers(limit)
        if silent:
            return f"{waited}, and rank(s) {', '.join(map(str, silent))} published no progress for as long"
        return None

    def _silent_peers(self, limit: float) -> list[int]:
        """The other ranks whose progress is older than `limit`; read every limit / 4 seconds at most (each read asks
        the store for every rank's progress: not each second from every rank of a large job)."""
        if self.store is None or time.monotonic() - self.peers_read < max(PUBLISH_EVERY_S, limit / 4):
            return []
        self.peers_read = time.monotonic()
        progress = self._read()
        return [r for r in silent_ranks(progress, time.time(), after_s=limit) if r != self.rank] if progress else []

    # ---------------------------------------------------------------------------------------- the thread
    def tick(self) -> None:
        """One turn of the thread: publish this rank's progress; stop the job if it is overdue."""
        self._publish(self.progress())
        reason = self.overdue()
        if reason:
            self._autopsy(reason)

    def _watch(self) -> None:
        # at once: a rank stopped before its first second is then not "never started"
        self._survive(lambda: self._publish(self.progress()))
        while not self._done.wait(PUBLISH_EVERY_S):
            self._survive(self.tick)

    def _survive(self, turn: Callable[[], None]) -> None:
        try:
            turn()
        except Exception as error:  # what fails now may work at the next turn; a dead thread would watch nothing
            self.note(f"a turn failed ({first_line(error)})")

    def _publish(self, progress: dict[str, Any]) -> None:
        if self.store is not None:
            with contextlib.suppress(Unanswered):  # told by overdue() once it has lasted
                self.store.ask("set", KEY.format(self.rank), json.dumps(progress))

    def _read(self) -> dict[int, dict[str, Any] | None] | None:
        """Every rank's last progress (None: never published); None where the store does not answer."""
        if self.store is None:
            return {self.rank: self.progress()}
        keys = [KEY.format(rank) for rank in range(self.world_size)]
        try:
            published = self.store.ask("check", keys)
            if published and hasattr(self.store.store, "multi_get"):  # every rank has: one call for all
                values = self.store.ask("multi_get", keys)
            else:
                values = [
                    self.store.ask("get", key) if published or self.store.ask("check", [key]) else None for key in keys
                ]
        except Unanswered:
            return None
        return {rank: None if value is None else json.loads(value) for rank, value in enumerate(values)}

    def _autopsy(self, reason: str) -> None:
        """Write what this rank knows, name the ranks behind, end the process (whatever fails on the way)."""
        try:
            self._tell(reason)
        except Exception as error:  # a full disk, a store gone: the job still ends, not hangs
            sys.stderr.write(f"scalelm: [rank {self.rank}] {reason}; the autopsy failed ({first_line(error)})\n")
        finally:
            sys.stderr.flush()
            os._exit(EXIT_HUNG)  # the main thread is stuck in a collective: no exception would reach it

    def _tell(self, reason: str) -> None:
        self.autopsy_dir.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.autopsy_dir / f"rank{self.rank}.txt") as partial, open(partial, "w") as stacks:
            stacks.write(f"rank {self.rank} on {self.host}: {reason}:\n")
            stacks.flush()
            faulthandler.dump_traceback(stacks, all_threads=True)
        dump_flight_recorder(self.autopsy_dir, self.rank, backends_in_use())
        time.sleep(2 * PUBLISH_EVERY_S)  # the other ranks' latest progress, before reading it
        progress, now = self._read(), time.time()
        stopped = stopped_beside() if self.world_size > 1 else []  # one process: its launcher's children are not ranks
        frozen = {
            r
            for r, p in (progress or {}).items()
            if p and p["host"] == self.host and p.get("pid") in {s.pid for s in stopped}
        }
        found = {r for r in self.found_silent if progress and not (progress[r] or {}).get("closed")}  # not ended since
        silent = sorted(set(silent_ranks(progress, now)) | found | frozen) if progress else []
        # every rank that answers waits for the others' dumps: none ends the job before
        dumps = self._flight_recorder(self.world_size - max(len(silent), len(stopped)))
        findings = self._unanswered() if progress is None else diagnosis(progress, dumps, now, silent)
        message = (
            f"scalelm: {reason} ({self.rule()}); stopping the job. "
            + "; ".join(findings)
            + f". Stacks: {self.autopsy_dir}/rank*.txt. The last complete checkpoint is kept: rerun to resume."
        )
        if stopped:
            message += (
                f" Stopped beside rank {self.rank}, killed (SIGKILL; torchrun's SIGTERM would reach it only "
                f"once continued): {named(stopped, progress)}."
            )
        message += self._flight_recorder_text(dumps)
        if self._first_to_tell("hang"):
            append_text(self.autopsy_dir / "summary.txt", message + "\n")
            sys.stderr.write(message + "\n")
        else:
            sys.stderr.write(f"scalelm: [rank {self.rank}] {reason}; stacks in {self.autopsy_dir}\n")
        sys.stderr.flush()
        for process in stopped:  # told first: the job ends as soon as its launcher sees them gone
            with contextlib.suppress(psutil.Error):
                process.kill()

    def _flight_recorder(self, dumps: int) -> dict[int, list[dict[str, Any]]]:
        """The ranks' Flight Recorder entries, once the `dumps` expected are there (the ranks that still publish their
        progress: their watchdogs fire within a second or two of this one; a rank that stopped writes none), or a
        few seconds passed."""
        if not (dist.is_available() and dist.is_initialized()):
            return {}  # one process: no collective to wait in
        deadline = time.monotonic() + 3 * PUBLISH_EVERY_S
        while len(dumped_ranks(self.autopsy_dir)) < dumps and time.monotonic() < deadline:
            time.sleep(0.2)
        return read_dumps(self.autopsy_dir)

    def _flight_recorder_text(self, dumps: dict[int, list[dict[str, Any]]]) -> str:
        findings = last_operations(dumps)
        if not findings:
            return ""
        text = f" Flight Recorder: {'; '.join(findings)}"
        if "nccl" in backends_in_use():  # torch's analyser matches NCCL's dumps (gloo's lack its groups table)
            analyser = "python -m torch.distributed.flight_recorder.fr_trace"
            text += f" (all of it: {analyser} {self.autopsy_dir} --prefix {FR_PREFIX})"
        return text

    def _unanswered(self) -> list[str]:
        unanswered = self.store.unanswered_s() if self.store is not None else 0.0
        return [
            f"the job's store (torchrun's; rank 0's under the spawn launcher) has not answered for "
            f"{unanswered:.0f} s: the process that holds it is stopped, or its node lost"
        ]

    def _tell_left(self) -> None:
        """Name the ranks that left the job before this rank's collective failed, in the log and the autopsy's
        summary: torchrun names the first rank that failed, which is this one where the rank that left exited 0."""
        progress = self._read()
        found = left_early(progress, self.host) if progress else []
        if not found or not self._first_to_tell("left"):
            return
        message = (
            f"scalelm: rank {self.rank} failed in a collective: " + "; ".join(found) + ". Its error and the root cause "
            "torchrun names (the first rank that failed; a rank that exits 0 has not) follow from that: the output of "
            "the rank that left says why it ended. The last complete checkpoint is kept: rerun to resume."
        )
        self.autopsy_dir.mkdir(parents=True, exist_ok=True)
        append_text(self.autopsy_dir / "summary.txt", message + "\n")
        sys.stderr.write(message + "\n")
        sys.stderr.flush()

    def _first_to_tell(self, event: str) -> bool:
        """Whether this rank is the first to tell of `event` (the others' would only repeat its findings)."""
        if self.store is None:
            return True
        try:
            return self.store.ask("add", KEY.format(f"told-{event}"), 1) == 1
        except Unanswered:
            return True
