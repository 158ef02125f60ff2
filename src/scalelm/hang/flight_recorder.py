"""PyTorch's Flight Recorder as the hang autopsy (scalelm.hang.watchdog) uses it. Every rank records its last
operations from the start (`flight_recorder_env`, read when a process group starts; NCCL then dumps its own on a
timeout too). On a hang each rank writes its dumps into <run_dir>/autopsy: NCCL's recorder where NCCL is a backend
(fr_trace_rank_<r>, where NCCL's own dump goes and torch's analyser reads), and the generic one, where gloo records,
beside it (fr_trace_generic_rank_<r>) or alone. Every rank's dumps, read and merged with each entry labelled by its
backend, say per backend the collective and the point-to-point operation each rank issued last (by name, sequence
number and sizes), and which rank waits in a send or recv and whether its peer is in the matching one: NCCL counts
these apart from its collectives, so the sequence numbers the watchdog publishes do not show them.
"""

from __future__ import annotations

import ast
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scalelm.files import atomic_path

FR_PREFIX = "fr_trace_rank_"  # a rank's Flight Recorder dump, by rank number: NCCL's where NCCL is a backend
GENERIC_FR_PREFIX = "fr_trace_generic_rank_"  # the generic recorder's (gloo's) beside NCCL's
NCCL_DUMP, GENERIC_DUMP = "_dump_nccl_trace", "_dump_fr_trace"  # torch._C._distributed_c10d's; the generic from 2.8


def buffer_size_variable(torch_version: str = torch.__version__) -> str:
    """The variable that sizes the Flight Recorder's buffer: TORCH_FR_BUFFER_SIZE from torch 2.8 on, which still reads
    the older name but warns on every run that it is deprecated; TORCH_NCCL_TRACE_BUFFER_SIZE before."""
    major, minor = (int(part) for part in re.match(r"(\d+)\.(\d+)", torch_version).groups())
    return "TORCH_FR_BUFFER_SIZE" if (major, minor) >= (2, 8) else "TORCH_NCCL_TRACE_BUFFER_SIZE"


def flight_recorder_env(autopsy_dir: Path) -> dict[str, str]:
    """PyTorch's Flight Recorder keeps every rank's last collectives (NCCL's, and gloo's where the torch records
    them) for the autopsy to read, and NCCL dumps them itself on a timeout (the environment is read when a process
    group starts; scalelm.train.run sets it). The buffer is sized explicitly: before torch 2.11 it is empty unless
    told."""
    return {
        buffer_size_variable(): "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(autopsy_dir / FR_PREFIX),
    }


def first_line(error: BaseException) -> str:
    """An error in one line: its type and its message's first line."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def dump_functions() -> dict[str, bool]:
    """Which of torch's Flight Recorder dumps this build has: NCCL's (CUDA builds) and the generic one (torch 2.8
    on, where gloo records)."""
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:  # a torch without distributed support
        return {GENERIC_DUMP: False, NCCL_DUMP: False}
    return {name: callable(getattr(c10d, name, None)) for name in (GENERIC_DUMP, NCCL_DUMP)}


def dump_plan(backends: set[str], functions: dict[str, bool]) -> list[tuple[str, str]]:
    """Which dumps to write, as (file prefix, dump function): NCCL writes to its own recorder, gloo to the generic
    one, so with NCCL in use NCCL's (under FR_PREFIX, where NCCL's own dump on a timeout goes and torch's analyser
    reads) and, when another backend is in use too, the generic one beside it; else the generic one (before torch
    2.8 NCCL's was the only one)."""
    nccl, generic = functions.get(NCCL_DUMP), functions.get(GENERIC_DUMP)
    if "nccl" in backends and nccl:
        return [(FR_PREFIX, NCCL_DUMP)] + (
            [(GENERIC_FR_PREFIX, GENERIC_DUMP)] if generic and backends - {"nccl"} else []
        )
    if generic or nccl:
        return [(FR_PREFIX, GENERIC_DUMP if generic else NCCL_DUMP)]
    return []


def _dump(function: str) -> bytes | None:
    import torch._C._distributed_c10d as c10d

    try:
        return getattr(c10d, function)()
    except Exception:  # no trace buffer, or a recorder that cannot dump now
        return None


def dump_flight_recorder(autopsy_dir: Path, rank: int, backends: set[str]) -> list[Path]:
    """Write this rank's Flight Recorder dumps (dump_plan for the `backends` in use) into `autopsy_dir`; the files
    written."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    written = []
    for prefix, function in dump_plan(backends, dump_functions()):
        trace = _dump(function)
        if trace:
            with atomic_path(autopsy_dir / f"{prefix}{rank}") as partial:
                partial.write_bytes(trace)
            written.append(autopsy_dir / f"{prefix}{rank}")
    return written


def recorder_entries() -> dict[str, list[dict[str, Any]] | str]:
    """What each of this build's Flight Recorder dumps holds now, whatever the backends in use: {dump function:
    its entries, or why there are none}. For a device check; the autopsy writes dump_plan's."""
    entries: dict[str, list[dict[str, Any]] | str] = {}
    for function, present in dump_functions().items():
        if not present:
            continue
        trace = _dump(function)
        try:
            entries[function] = pickle.loads(trace)["entries"] if trace else "no dump (no trace buffer?)"
        except Exception as error:  # a format this code does not know
            entries[function] = f"unreadable: {first_line(error)}"
    return entries


def dumped_ranks(autopsy_dir: Path) -> dict[int, list[Path]]:
    """The Flight Recorder dumps in `autopsy_dir`, by rank (not the `.partial` of one being written)."""
    pattern = re.compile(rf"^(?:{re.escape(FR_PREFIX)}|{re.escape(GENERIC_FR_PREFIX)})(\d+)$")
    ranks: dict[int, list[Path]] = {}
    for path in sorted(autopsy_dir.glob("fr_trace_*")):
        match = pattern.match(path.name)
        if match:
            ranks.setdefault(int(match.group(1)), []).append(path)
    return ranks


def backend_of(entry: dict[str, Any]) -> str:
    return str(entry.get("profiling_name", "?")).split(":")[0]


def _op(entry: dict[str, Any]) -> str:
    """The operation's type: "all_reduce", "send", "recv", "coalesced"."""
    return str(entry.get("profiling_name", "")).partition(":")[2].split(" ")[0]


def is_p2p(entry: dict[str, Any]) -> bool:
    return bool(entry.get("is_p2p")) or _op(entry) in ("send", "recv")


def _group_ranks(pg_config: Any, pg_name: str) -> list[int]:
    """The global ranks of a group, where its dump lists them (NCCL's does; gloo's has no groups table)."""
    try:
        return [int(r) for r in ast.literal_eval(pg_config[pg_name]["ranks"])]  # "[0, 1]", as torch's analyser reads it
    except Exception:
        return []


def read_dumps(autopsy_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """Every rank's Flight Recorder entries, its dumps merged (an entry in both kept once), in the order issued;
    each entry labelled with its backend ("backend") and its group's global ranks ("group_ranks", [] if unknown)."""
    dumps: dict[int, list[dict[str, Any]]] = {}
    for rank, paths in dumped_ranks(autopsy_dir).items():
        merged: dict[tuple, dict[str, Any]] = {}
        for path in paths:
            try:
                dump = pickle.loads(path.read_bytes())  # written by torch's recorder; read as its analyser does
                entries, pg_config = dump["entries"], dump.get("pg_config", {})
            except Exception:  # a dump being written, or of another format
                continue
            for entry in entries:
                group = tuple(entry.get("process_group") or ("?", "?"))
                labelled = {**entry, "backend": backend_of(entry), "group_ranks": _group_ranks(pg_config, group[0])}
                numbers = (
                    entry.get(name) for name in ("record_id", "profiling_name", "collective_seq_id", "p2p_seq_id")
                )
                merged.setdefault((labelled["backend"], group, *numbers), labelled)
        if merged:
            dumps[rank] = sorted(
                merged.values(), key=lambda e: (e.get("time_created_ns") or 0, e.get("record_id") or 0)
            )
    return dumps


def peer_of(entry: dict[str, Any]) -> tuple[str, int | None, str]:
    """A send's or recv's direction and peer: ("send to", 1, "rank 1") from "nccl:send 0->1" ("recv from" for
    "nccl:recv 1<-0"); the name holds group ranks, told as global ranks where the dump lists the group's."""
    _, _, meta = str(entry.get("profiling_name", "")).partition(" ")
    direction = "send to" if _op(entry) == "send" else "recv from"
    parts = meta.split("->" if direction == "send to" else "<-")
    try:
        local = int(parts[1])
    except (IndexError, ValueError):
        return direction, None, "its peer"
    ranks = entry.get("group_ranks") or []
    if local < len(ranks):
        return direction, ranks[local], f"rank {ranks[local]}"
    if entry.get("process_group", ("", ""))[1] == "default_pg":
        return direction, local, f"rank {local}"
    return direction, None, f"rank {local} of its group"


def describe(entry: dict[str, Any]) -> str:
    """An entry in words: its name, number, group, sizes and state (NCCL tracks completion; gloo leaves every entry
    `scheduled`)."""
    group = (entry.get("process_group") or ("?", "?"))[1]
    more = f"(inputs {entry.get('input_sizes')}, {entry.get('state')})"
    if not is_p2p(entry):
        return f"{entry.get('profiling_name')} #{entry.get('collective_seq_id')} of group {group} {more}"
    what = "a batch of sends and recvs" if _op(entry) == "coalesced" else " ".join(peer_of(entry)[::2])
    return f"{entry.get('profiling_name')} ({what}) p2p op #{entry.get('p2p_seq_id')} of group {group} {more}"


def last_operations(dumps: dict[int, list[dict[str, Any]]]) -> list[str]:
    """Per rank and backend, the collective and the point-to-point operation it issued last."""
    findings = []
    for rank, entries in sorted(dumps.items()):
        for backend in sorted({e["backend"] for e in entries}):
            mine = [e for e in entries if e["backend"] == backend]
            collectives = [e for e in mine if not is_p2p(e)]
            p2p = [e for e in mine if is_p2p(e) and _op(e) != "coalesced"] or [e for e in mine if is_p2p(e)]
            if collectives:
                findings.append(f"rank {rank}'s last collective {describe(collectives[-1])}")
            if p2p:
                findings.append(f"rank {rank}'s last p2p op {describe(p2p[-1])}")
    return findings


def waiting_in(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operations a rank waits in, per backend: where the recorder tracks completion (NCCL), the earliest one
    not completed after the last completed one of its group and kind (collective or p2p); where it does not (gloo),
    the last one issued. With the rest of its batch (the entries of its sequence number)."""
    found = []
    for backend in sorted({e["backend"] for e in entries}):
        mine = [e for e in entries if e["backend"] == backend]
        if not any(e.get("state") in ("started", "completed") for e in mine):
            first = mine[-1]
        else:
            pending = []
            for key in {(tuple(e.get("process_group") or ()), is_p2p(e)) for e in mine}:
                lane = [e for e in mine if (tuple(e.get("process_group") or ()), is_p2p(e)) == key]
                done = [i for i, e in enumerate(lane) if e.get("state") == "completed"]
                pending += [e for e in lane[(done[-1] + 1 if done else 0) :] if e.get("state") != "completed"][:1]
            if not pending:
                continue
            first = min(pending, key=mine.index)
        number = "p2p_seq_id" if is_p2p(first) else "collective_seq_id"
        found += [
            e
            for e in mine
            if e.get("process_group") == first.get("process_group")
            and is_p2p(e) == is_p2p(first)
            and e.get(number) == first.get(number)
        ]
    return found


def p2p_waits(dumps: dict[int, list[dict[str, Any]]]) -> list[str]:
    """The ranks waiting in a send or recv, from their Flight Recorder dumps, and whether their peer is in the
    matching one: NCCL counts these apart from its collectives, so the sequence numbers do not show them."""
    findings = []
    for rank, entries in sorted(dumps.items()):
        for entry in (e for e in waiting_in(entries) if is_p2p(e) and _op(e) != "coalesced"):
            direction, peer, who = peer_of(entry)
            group, number = (entry.get("process_group") or ("?", "?"))[1], entry.get("p2p_seq_id")
            what = f"{entry.get('profiling_name')}, inputs {entry.get('input_sizes')}, {entry.get('state')}"
            finding = f"rank {rank} is in {direction} {who}, p2p op #{number} of group {group} ({what})"
            if peer is not None and peer not in dumps:
                finding += f"; rank {peer} wrote no Flight Recorder dump (stopped, or gone)"
            elif peer is not None:
                finding += "; " + _peer_side(rank, peer, direction, entry, dumps[peer])
            findings.append(finding)
    return findings


def _peer_side(rank: int, peer: int, direction: str, entry: dict[str, Any], peer_entries: list[dict[str, Any]]) -> str:
    """Whether `peer` is in the operation matching `entry` of `rank`'s, in words."""
    opposite = "recv from" if direction == "send to" else "send to"
    group = (entry.get("process_group") or ("?", "?"))[1]
    peer_in = waiting_in(peer_entries)
    for other in peer_in:
        if (
            is_p2p(other)
            and _op(other) != "coalesced"
            and (other.get("process_group") or ("?", "?"))[1] == group
            and peer_of(other)[0] == opposite
            and peer_of(other)[1] == rank
        ):
            return (
                f"rank {peer} is in the matching {opposite} rank {rank} (p2p op #{other.get('p2p_seq_id')}, "
                f"{other.get('state')}): both wait, the transfer does not complete"
            )
    where = describe(peer_in[0]) if peer_in else f"its last op {describe(peer_entries[-1])}"
    return f"rank {peer} is not in the matching {opposite} rank {rank}: it is behind, in {where}"


def recorded(autopsy_dir: Path) -> list[str]:
    """What the ranks' Flight Recorder dumps in `autopsy_dir` say: per rank and backend the collective and the
    point-to-point operation it issued last, by name, sequence number, group and input sizes, with its state where
    the backend tracks it (NCCL: completed or not; gloo leaves every entry `scheduled`)."""
    return last_operations(read_dumps(autopsy_dir))
