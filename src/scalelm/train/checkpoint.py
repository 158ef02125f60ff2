"""Checkpoints: save, find the latest complete one, resume, and consolidate to one state dict.

Layout of one checkpoint, `<run_dir>/checkpoints/step_00000420/`:
    *.distcp + .metadata   model and optimizer state as a Distributed Checkpoint (every rank writes its shards)
    trainer.pt    the checkpoint format, step, epoch, position in the epoch, scheduler, every rank's RNG state,
                  model shape, and the run's seed and lineage (`Origin`)
    COMPLETE      sha256 of every file above, written last

A checkpoint is written into `step_N.partial/` and renamed when complete, so a crash mid-write never leaves
something that looks finished. State dicts go through torch.distributed.checkpoint.state_dict, which speaks
the same fully-qualified names for a plain, a DDP, an FSDP and a tensor-parallel model, and DCP stores every tensor
whole (its shards with their offsets): any checkpoint loads into any layout and world size. The optimizer's state
is stored flat, its hyperparameters under each parameter's name, so that pipeline stages, which hold different
parameters, each write and read their own (the nested form keeps one rank's list of parameter names). A checkpoint
of another format (FORMAT, in trainer.pt) is refused by name, never skipped: a run goes on only from what it wrote.
So is one whose contents are not what its name and its run say (`check_origin`): a directory renamed by hand, a
checkpoint of another seed or settings, one beyond the run's steps. (Checkpoints written before trainer.pt recorded
the seed and lineage are checked for their step only.) Nothing non-finite is ever saved: `Checkpointer.save`, which
both engines go through, refuses non-finite weights on any rank before it writes anything.

Nothing read from a checkpoint can run code: DCP unpickles `.metadata` with plain pickle and its non-tensor entries
(the optimizer's hyperparameters) with `torch.load(weights_only=False)`; here `.metadata` goes through an allow-list
of DCP's own metadata classes and those entries through `weights_only=True` (plain values only), and `verify`
checks both, after the seal's checksums, before the checkpoint is used (docs/faults.md, "Security").
"""

from __future__ import annotations

import enum
import importlib
import io
import json
import warnings
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from scalelm.config import Config
from scalelm.errors import CheckpointError, ScaleLMError
from scalelm.files import UnsafeFileError, load_pickle, load_tensors, partial_of, publish, remove, sha256
from scalelm.model.dtensors import local_shard
from scalelm.parallel.env import DistEnv, all_gather_object, barrier, global_reduce, is_distributed
from scalelm.train.rundir import CHECKPOINT_PREFIX

# of the files below; a change in what they hold or how is a new format. 2: the feed-forward network's matrices
# named ffn.up and ffn.down (ffn.0 and ffn.3 in 1)
FORMAT = 2
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

# one process writes and reads DCP too, on purpose: no process group to warn about
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

TRAINER_FILE = "trainer.pt"
TRAINER_KEYS = ("format", "state", "scheduler", "rng")  # and, since they were recorded, "seed" and "lineage"
METADATA_FILE = ".metadata"
MARKER = "COMPLETE"
PREFIX = CHECKPOINT_PREFIX

# What a DCP .metadata file may name: DCP's own records (the dataclasses and enums of the modules below, whatever
# the torch version that wrote them), torch.Size, dtypes and layouts, paths.
METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
METADATA_GLOBALS = {
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


def metadata_global(module: str, name: str) -> bool:
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    if module in METADATA_MODULES:
        record = getattr(importlib.import_module(module), name, None)
        own = isinstance(record, type) and record.__module__.startswith("torch.distributed.checkpoint.")
        return own and (is_dataclass(record) or issubclass(record, enum.Enum))
    return name in METADATA_GLOBALS.get(module, ())


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with `.metadata` unpickled through `metadata_global` (DCP's own uses plain pickle)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(str(self.path)) / METADATA_FILE
        metadata = load_pickle(path, metadata_global)
        if not isinstance(metadata, Metadata):
            raise UnsafeFileError(f"{path} holds a {type(metadata).__name__}, not a checkpoint's metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


def load_plain(value: io.BytesIO, where: str) -> Any:
    """A non-tensor DCP entry, read with weights_only=True: plain values and containers, never an object."""
    try:
        return torch.load(value, weights_only=True)
    except Exception as err:
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise UnsafeFileError(f"{where} holds more than plain values and was not loaded ({reason})") from err


class PlainValuePlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor entries are read as plain values (DCP: weights_only=False)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        plain = load_plain(value, f"checkpoint entry {fqn}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], plain)
        else:
            self.state_dict[fqn] = plain


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    step_in_epoch: int = 0  # optimizer steps done within `epoch`
    tokens_seen: int = 0
    train_seconds: float = 0.0  # time in training steps, excluding evaluation and checkpoints
    model_shape: dict[str, Any] = field(default_factory=dict)  # model settings + vocabulary size
    energy_j: float | None = None  # the job's, in training steps; None once an attempt could not measure it
    experts: dict[str, Any] | None = None  # a mixture of experts' run totals (scalelm.measure.experts); None: dense

    def spent(self, seconds: float, joules: float | None) -> None:
        """A logged interval's training time and energy."""
        self.train_seconds += seconds
        self.energy_j = None if self.energy_j is None or joules is None else self.energy_j + joules

    def advance(self, tokens: int, steps_per_epoch: int) -> bool:
        """One optimizer step of `tokens` done; True if it ended its epoch (the position moves to the next one)."""
        self.step += 1
        self.tokens_seen += tokens
        self.step_in_epoch += 1
        if self.step_in_epoch < steps_per_epoch:
            return False
        self.epoch, self.step_in_epoch = self.epoch + 1, 0
        return True


@dataclass(frozen=True)
class Origin:
    """The run a checkpoint belongs to: its seed and lineage (scalelm.train.rundir.lineage: a digest of its identity
    less its layout), which trainer.pt records, and its number of steps, which no checkpoint of it exceeds. None:
    unknown, not checked."""

    seed: int | None
    lineage: str | None
    steps: int | None = None
    # lineages also taken for this run's (scalelm.train.rundir.RunDir.lineages: the same run, an older scalelm's)
    accepts: frozenset[str] = frozenset()


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def ranks_where(flag: torch.Tensor, env: DistEnv) -> list[int]:
    """The ranks on which `flag` (a 0-dim bool tensor) is true; a collective."""
    flags = torch.zeros(env.world_size, device=env.device)
    flags[env.rank] = flag.float()
    return [rank for rank, value in enumerate(global_reduce(flags).tolist()) if value]


class Checkpointer:
    """A run's checkpoints: saved when due (every `every` steps, and at each epoch's end), `keep` of them kept,
    resumed from the newest that is complete, of this run's lineage and within its steps."""

    def __init__(
        self,
        directory: str | Path,
        env: DistEnv,
        keep: int,
        origin: Origin,
        every: int | None = None,
        lower: str = "optim.lr",
    ):
        self.directory = Path(directory)
        self.env = env
        self.keep = keep
        self.origin = origin
        self.every = every
        self.lower = lower  # the settings a run whose weights overflow may lower (scalelm.train.engine)
        self.latest_path: Path | None = None  # the newest checkpoint of this run, saved or resumed from
        self.latest_step = -1
        self.rng_restored = False  # each rank's generators as saved: only from a checkpoint of this world size

    # ----------------------------------------------------------------------------------------- save
    def due(self, step: int, epoch_ended: bool) -> bool:
        return epoch_ended or bool(self.every) and step % self.every == 0

    def save(self, model: nn.Module, optimizer, scheduler, state: TrainerState, pending_loss=None) -> Path:
        """A checkpoint of `state.step` (a collective), refused if the weights or `pending_loss` (a loss not yet
        logged, hence not yet checked) are not finite on some rank."""
        self.refuse_non_finite(model, state.step, pending_loss)
        final = self.directory / f"{PREFIX}{state.step:08d}"
        partial = partial_of(final)
        if self.env.is_main:
            remove(partial)
            partial.mkdir(parents=True)
        barrier()
        rngs = all_gather_object(rng_state(self.env.device))
        dcp.save(
            {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer, options=FLAT)},
            checkpoint_id=partial,
            no_dist=not is_distributed(),
        )
        if self.env.is_main:
            trainer = {
                "format": FORMAT,
                "state": asdict(state),
                "scheduler": scheduler.state_dict(),
                "rng": rngs,
                "seed": self.origin.seed,
                "lineage": self.origin.lineage,
            }
            torch.save(trainer, partial / TRAINER_FILE)
        barrier()  # every shard is on disk before the marker says so
        if self.env.is_main:
            sums = {p.name: sha256(p) for p in sorted(partial.iterdir()) if p.is_file()}
            (partial / MARKER).write_text(json.dumps(sums, indent=1) + "\n")
            publish(partial, final)
            self._prune()
        barrier()
        self.latest_path, self.latest_step = final, state.step
        return final

    def refuse_non_finite(self, model: nn.Module, step: int, pending_loss: torch.Tensor | None) -> None:
        """An error naming the ranks whose weights or `pending_loss` are not finite; a collective."""
        tensors = [] if pending_loss is None else [pending_loss.detach().reshape(1)]
        tensors += [local_shard(p).detach().reshape(-1) for p in model.parameters()]
        # one flag per tensor, on the device: with FSDP's CPU offload the parameters live on the host
        flags = [t.isfinite().all().reshape(1).to(self.env.device) for t in tensors]
        bad = ranks_where(~torch.cat(flags).all() if flags else torch.tensor(False), self.env)
        if bad:
            raise CheckpointError(
                f"non-finite loss or weights at step {step} on rank(s) {bad}; not checkpointing, {self.kept()}. "
                f"Lower {self.lower} or set optim.grad_clip"
            )

    def kept(self) -> str:
        """What a run stopped now keeps: its last good checkpoint, where it has one (saved or resumed from)."""
        if self.latest_path is None:
            return "the run has no checkpoint yet"
        return f"the last good checkpoint stays in {self.latest_path}"

    def _prune(self) -> None:
        for old in complete_checkpoints(self.directory)[: -self.keep]:
            remove(old)

    # ----------------------------------------------------------------------------------------- load
    def latest(self) -> Path | None:
        """The newest checkpoint whose files match the checksums of its marker; damaged ones are reported and
        skipped."""
        for path in reversed(complete_checkpoints(self.directory)):
            problem = verify(path)
            if problem is None:
                return path
            if self.env.is_main:
                print(f"warning: skipping checkpoint {path}: {problem}", flush=True)
        return None

    def resume(self, model: nn.Module, optimizer, scheduler, expected_shape: dict[str, Any]) -> TrainerState | None:
        path = self.latest()
        if path is None:
            return None
        trainer = read_trainer(path)
        check_origin(path, trainer, self.origin)
        state = trainer_state(trainer, path)
        check_shape(state.model_shape, expected_shape, path)
        load_weights(path, model, optimizer)
        scheduler.load_state_dict(trainer["scheduler"])
        rngs = trainer["rng"]
        self.rng_restored = len(rngs) == self.env.world_size
        if self.rng_restored:
            set_rng_state(rngs[self.env.rank], self.env.device)
        self.latest_path, self.latest_step = path, state.step
        return state


def step_of(path: Path) -> int:
    """The step a checkpoint's directory name says."""
    return int(path.name[len(PREFIX) :])


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints (marker present) in step order. A `.partial` directory is never one, even with its
    marker: a job killed between writing the marker and the rename leaves it so."""
    if not directory.is_dir():
        return []
    named = [p for p in directory.glob(f"{PREFIX}*") if p.name[len(PREFIX) :].isdigit()]
    found = [p for p in named if p.is_dir() and (p / MARKER).is_file()]
    return sorted(found, key=step_of)


def verify(path: Path) -> str | None:
    """None if the checkpoint can be used, else what is wrong: every file its marker lists present with its checksum
    (the seal), checked first; then nothing in it that loading could run: `.metadata` and trainer.pt hold only what
    they may, every non-tensor entry only plain values (the seal alone proves nothing: whoever alters a file can
    rewrite the marker)."""
    try:
        expected = json.loads((path / MARKER).read_text())
    except (OSError, ValueError) as err:
        return f"unreadable {MARKER} marker ({err})"
    if not isinstance(expected, dict) or not all(isinstance(v, str) for v in expected.values()):
        return f"{MARKER} marker is not a table of checksums"
    for name, digest in expected.items():
        file = path / name
        if "/" in name or name.startswith(".."):
            return f"{MARKER} marker names a file outside the checkpoint ({name!r})"
        if not file.is_file():
            return f"{name} is missing"
        if sha256(file) != digest:
            return f"{name} does not match its checksum (truncated or corrupted)"
    unsealed = sorted(p.name for p in path.iterdir() if p.is_file() and p.name != MARKER and p.name not in expected)
    if unsealed:
        return f"{', '.join(unsealed)} not covered by its {MARKER} marker"
    try:
        if (path / TRAINER_FILE).is_file():
            load_tensors(path / TRAINER_FILE)
        metadata = SafeReader(path).read_metadata()
        for index, info in metadata.storage_data.items():
            if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                with (path / info.relative_path).open("rb") as handle:
                    handle.seek(info.offset)
                    load_plain(io.BytesIO(handle.read(info.length)), f"entry {index.fqn} of {info.relative_path}")
    except (UnsafeFileError, OSError) as err:
        return str(err)
    return None


def require_usable(path: Path) -> None:
    """`verify`, as an error naming the checkpoint."""
    problem = verify(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} cannot be used: {problem}")


def model_shape(config: Config, vocab_size: int) -> dict[str, Any]:
    """The settings a checkpoint's tensors depend on; resuming with others is an error, not a silent mismatch."""
    keys = ("d_model", "n_heads", "n_layers", "d_ff", "max_seq_len", "norm", "tie_weights")
    shape = {**{k: getattr(config.model, k) for k in keys}, "vocab_size": vocab_size}
    if config.model.moe is not None:  # (absent for a dense model, as in the checkpoints from before mixtures)
        moe = config.model.moe
        shape["moe"] = {"experts": moe.experts, "every": moe.every, "d_ff": config.model.expert_width()}
    if config.model.family != "gpt2":  # (absent for the course's block, as in the checkpoints from before families)
        shape["family"] = config.model.family
        shape["n_kv_heads"] = config.model.kv_heads
    return shape


def check_shape(saved: dict[str, Any], expected: dict[str, Any], path: Path) -> None:
    differ = [k for k in sorted(set(saved) | set(expected)) if saved.get(k) != expected.get(k)]
    if differ:
        details = "; ".join(f"{k}: checkpoint {saved.get(k)!r}, config {expected.get(k)!r}" for k in differ)
        raise CheckpointError(
            f"checkpoint {path} was written for another model ({details}); "
            "use the settings it was trained with, or another run directory"
        )


def load_weights(path: Path, model: nn.Module, optimizer=None) -> None:
    """Load a checkpoint into a model of any layout (and its optimizer)."""
    if not (path / METADATA_FILE).is_file():
        raise CheckpointError(f"{path} holds no Distributed Checkpoint ({METADATA_FILE} is missing)")
    target = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        target["optim"] = get_optimizer_state_dict(model, optimizer, options=FLAT)
    try:  # reshards to this layout
        dcp.load(target, storage_reader=SafeReader(path), planner=PlainValuePlanner(), no_dist=not is_distributed())
    except CheckpointException as err:  # DCP wraps every rank's error: ours say what is wrong with the file
        errors = [failure[0] for failure in err.failures.values()]
        ours = [error for error in errors if isinstance(error, ScaleLMError)]
        if ours:
            raise ours[0] from None
        reason = str(errors[0]).strip().splitlines()[-1] if errors and str(errors[0]).strip() else "unreadable"
        raise CheckpointError(f"checkpoint {path} could not be read ({reason}); it is damaged") from None
    set_model_state_dict(model, target["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, target["optim"], options=FLAT)


def read_trainer(path: Path) -> dict[str, Any]:
    """trainer.pt of the checkpoint at `path`, of this scalelm's checkpoint format with every key it must have
    (refused by name otherwise)."""
    file = Path(path) / TRAINER_FILE
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} has no {TRAINER_FILE}: {damaged(path)}")
    trainer = load_tensors(file)
    if not isinstance(trainer, dict):
        raise CheckpointError(f"{file} holds a {type(trainer).__name__}, not a trainer state: {damaged(path)}")
    if trainer.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {path} is of checkpoint format {trainer.get('format')!r}; this scalelm reads format {FORMAT}: "
            "continue the run with the scalelm that wrote it, or start it afresh in another run directory"
        )
    missing = sorted(key for key in TRAINER_KEYS if key not in trainer)
    if missing:
        raise CheckpointError(f"{file} lacks {', '.join(missing)}: {damaged(path)}")
    trainer_state(trainer, path)
    return trainer


def damaged(path: Path) -> str:
    return f"it is damaged or was not written by scalelm; remove {path} (a training resumes from the one before)"


def trainer_state(trainer: dict[str, Any], path: Path) -> TrainerState:
    """The TrainerState trainer.pt holds, refused by name if it holds none."""
    try:
        state = TrainerState(**trainer["state"])
    except TypeError as err:
        raise CheckpointError(f"{Path(path) / TRAINER_FILE} holds no trainer state ({err}): {damaged(path)}") from None
    if not isinstance(state.step, int):
        raise CheckpointError(f"{Path(path) / TRAINER_FILE} holds step {state.step!r}, not a number: {damaged(path)}")
    return state


def read_trainer_state(path: Path) -> TrainerState:
    return trainer_state(read_trainer(path), path)


def check_origin(path: Path, trainer: dict[str, Any], origin: Origin) -> None:
    """Refuse, naming it, a checkpoint that is not what its name and its run say: its step against its directory's
    name and the run's steps, its seed and lineage (where trainer.pt records them) against the run's."""
    step = trainer_state(trainer, path).step
    if step != step_of(path):
        raise CheckpointError(
            f"checkpoint {path} holds step {step}, not the step its name says (renamed by hand?): rename it "
            f"{PREFIX}{step:08d} or remove it"
        )
    if origin.steps is not None and step > origin.steps:
        raise CheckpointError(
            f"checkpoint {path} is at step {step}, beyond the {origin.steps} steps of this run (train.max_steps, "
            f"train.epochs): it was written by another run; move it out of {path.parent}"
        )
    seed = trainer.get("seed")
    if None not in (seed, origin.seed) and seed != origin.seed:
        raise CheckpointError(
            f"checkpoint {path} was written by a run of seed {seed}, not of this run's seed {origin.seed}: move it "
            f"out of {path.parent} (to the run directory of seed {seed})"
        )
    written_by = trainer.get("lineage")
    if None not in (written_by, origin.lineage) and written_by not in {origin.lineage, *origin.accepts}:
        raise CheckpointError(
            f"checkpoint {path} was written by a run of other settings or data (lineage {written_by}, this run's "
            f"{origin.lineage}): move it out of {path.parent}, or run with the settings it was written with"
        )
