"""Training settings: typed dataclasses, loaded from YAML plus ``key=value`` overrides.

Every setting has a default that mirrors the course (see docs/); a file only names what it changes.
Unknown keys and wrong types fail at load time with the dotted key and a suggestion, before any work starts.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from scalelm.errors import ConfigError
from scalelm.files import atomic_write_text
from scalelm.settings_yaml import dump_settings, from_mapping, load_error, parse_settings, plain, read_settings, shown

SEED_LIMIT = 2**32  # the streams derived from a seed (seed x 1,000,003 + epoch, ...) stay within 64 bits
# The most a router coefficient (model.moe's aux_loss_coef, z_loss_coef, bias_rate) may be. A loss weight multiplies
# its loss's gradients, which AdamW's second moment and the gradient norm square in fp32 (finite below about 1.8e19;
# bf16 has fp32's range): 1,000 times the language model's own weight is far beyond any use (Switch weighs its
# aux loss 0.01, ST-MoE its z-loss 0.001) and far below where a step overflows (1e30 does at the first step, 1e300
# is not even a float32). A bias moved by as much each step stays finite too.
ROUTER_COEF_LIMIT = 1e3
BALANCE_OF = {"aux_loss_coef": "aux", "bias_rate": "bias"}  # the one model.moe.balance that uses each coefficient
# a study's name: part of a directory's name in each run directory (scalelm.train.rundir) and a key of the history
STUDY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_study_name(name: str | None) -> None:
    if name is not None and not (isinstance(name, str) and STUDY_NAME.fullmatch(name)):
        raise ConfigError(
            f"study {name!r} is not a study name: letters, digits, '.', '_' and '-', at most 64 "
            "(--config study=2027-01-rerun)"
        )


@dataclass(frozen=True)
class Bound:
    """The values a setting takes (`holds`), declared on its field (`setting(bound=...)`) and checked for every
    setting by `check_bounds`; `says` what it must be, in the error's words ("positive", "in [0, 1)")."""

    holds: Callable[[Any], bool]
    says: str


POSITIVE = Bound(lambda value: value > 0, "positive")
POSITIVE_INTEGER = Bound(lambda value: value > 0, "a positive integer")
NOT_NEGATIVE = Bound(lambda value: value >= 0, "0 or positive")


def setting(
    default: Any,
    *,
    identity: bool,
    lightning_refuses: tuple[Any, str] | None = None,
    added: bool = False,
    bound: Bound | None = None,
) -> Any:
    """A setting's field, declaring what it is beside its default. `identity`: whether it changes what is trained,
    and so belongs to a run's identity (`identity_settings`): a run rerun with other values of the rest (where it
    writes, stages, reports, checkpoints, waits; how it compiles or recomputes, whose results are interchangeable)
    resumes or restores its end instead of training afresh. `lightning_refuses`: the value train.engine=lightning
    refuses by name, and why (`refusals`); every other train.* setting acts in both engines (tests/test_engines.py).
    A layout's options act with their degree (parallel.sequence_parallel with tp, ...). `added`: a setting added
    after runs were recorded, whose default changes nothing they trained: left out of the identity at its default,
    so that those runs keep theirs and resume. `bound`: the values it takes (`Bound`); a setting whose default is None
    may also be null."""
    metadata: dict[str, Any] = {"identity": identity}
    if added:
        metadata["added"] = True
    if bound is not None:
        metadata["bound"] = bound
    if lightning_refuses is not None:
        metadata["refused_by"] = {"lightning": lightning_refuses}
    return field(default=default, metadata=metadata)


BIAS_RATE = Bound(
    lambda value: value > 0,
    "positive (each step's move of an expert's routing bias under model.moe.balance=bias, e.g. 0.001)",
)
MIN_LR_RATIO = Bound(lambda value: 0.0 <= value <= 1.0, "in [0, 1] (the cosine floor as a fraction of the peak rate)")
GRAD_CLIP = Bound(lambda value: value > 0, "a positive gradient norm, or null for no clipping")
HANG_FACTOR = Bound(
    lambda value: value == 0 or value >= 2,
    "0 (no watchdog) or at least 2 (a step that long over the median is overdue)",
)


@dataclass
class DataConfig:
    prepared_dir: str = setting("data/prepared", identity=False)  # written by `python -m scalelm.data.prepare`
    seq_len: int = setting(32, identity=True, bound=POSITIVE)
    # distance between training windows; None = seq_len, 1 = the course's overlap
    stride: int | None = setting(None, identity=True, bound=POSITIVE)
    # copy the prepared data to memory (shm: /dev/shm) or node-local disk (local: stage_dir, else $TMPDIR) before
    # training (scalelm.data.stage); None: the site's choice (site.yaml `stage`), none without one
    stage: Literal["none", "shm", "local"] | None = setting(None, identity=False)
    stage_dir: str | None = setting(None, identity=False)


@dataclass
class MoEConfig:
    """A mixture of experts in place of the feed-forward network of some blocks (scalelm.model.moe): a router sends
    each token to its top_k experts (equal scores to the lower index, in every layout) and every token is computed
    (dropless: no capacity limit), so that every layout computes the same function."""

    experts: int = setting(
        dataclasses.MISSING, identity=True, bound=POSITIVE_INTEGER
    )  # required: a mixture's shape is never defaulted
    top_k: int = setting(2, identity=True, bound=POSITIVE_INTEGER)
    every: int = setting(
        1, identity=True, bound=POSITIVE_INTEGER
    )  # block i is a mixture where (i + 1) % every == 0: 1 every block, 2 odd
    d_ff: int | None = setting(
        None, identity=True, bound=Bound(lambda v: v > 0, "positive or null (model.d_ff)")
    )  # each expert's hidden width; None: model.d_ff
    # how the router is kept balanced (scalelm.model.moe): aux, the load-balancing loss in the training loss with
    # aux_loss_coef; bias, DeepSeek-V3's auxiliary-loss-free per-expert bias moved by bias_rate after every step;
    # none. The balance is measured in every case
    balance: Literal["aux", "bias", "none"] = setting("aux", identity=True, added=True)
    aux_loss_coef: float = setting(
        0.01, identity=True, bound=Bound(lambda v: v >= 0, "0 (no load-balancing loss) or positive")
    )  # the load-balancing loss's weight under balance: aux
    bias_rate: float = setting(
        1e-3, identity=True, added=True, bound=BIAS_RATE
    )  # under balance: bias, each step's move of a bias
    # the router z-loss's weight (ST-MoE: the mean squared log-sum-exp of the router's scores); 0: none
    z_loss_coef: float = setting(
        0.0, identity=True, added=True, bound=Bound(lambda v: v >= 0, "0 (no router z-loss) or positive")
    )

    def is_moe_block(self, index: int) -> bool:
        return (index + 1) % self.every == 0

    def loss_weights(self) -> dict[str, float]:
        """The router's losses that join the training loss, their coefficients by name: aux_loss_coef under
        balance: aux, z_loss_coef; those that are 0 left out."""
        weights = {
            "aux_loss_coef": self.aux_loss_coef if self.balance == "aux" else 0.0,
            "z_loss_coef": self.z_loss_coef,
        }
        return {key: weight for key, weight in weights.items() if weight}


FAMILY_ONLY = {"norm": "gpt2", "n_kv_heads": "llama", "rope_theta": "llama"}  # the one model.family using each


@dataclass
class ModelConfig:
    # the block (scalelm.model.transformer): gpt2, the course's (LayerNorm, ReLU FFN, sinusoidal positions, biases);
    # llama, today's (RMSNorm before attention and FFN, SwiGLU FFN of width d_ff, rotary positions, grouped-query
    # attention with n_kv_heads key/value heads, no biases)
    family: Literal["gpt2", "llama"] = setting("gpt2", identity=True, added=True)
    d_model: int = setting(128, identity=True, bound=POSITIVE)
    n_heads: int = setting(4, identity=True, bound=POSITIVE)
    n_layers: int = setting(2, identity=True, bound=POSITIVE)
    d_ff: int = setting(2048, identity=True, bound=POSITIVE)
    dropout: float = setting(0.1, identity=True, bound=Bound(lambda v: 0.0 <= v < 1.0, "in [0, 1)"))
    max_seq_len: int = setting(
        1024, identity=True, bound=POSITIVE
    )  # size of the positional table; data.seq_len must not exceed it
    norm: Literal["post", "pre"] = setting("post", identity=True)
    tie_weights: bool = setting(False, identity=True)
    moe: MoEConfig | None = setting(None, identity=True, added=True)  # None: every block dense
    # llama: key/value heads of grouped-query attention, dividing n_heads (1: multi-query); None: n_heads
    n_kv_heads: int | None = setting(None, identity=True, added=True, bound=POSITIVE_INTEGER)
    rope_theta: float = setting(10000.0, identity=True, added=True, bound=POSITIVE)  # llama: rotary base

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads under grouped-query attention, else one per query head."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def expert_width(self) -> int:
        return (self.moe.d_ff or self.d_ff) if self.moe else self.d_ff


@dataclass
class OptimConfig:
    lr: float = setting(2e-3, identity=True, bound=POSITIVE)
    weight_decay: float = setting(0.01, identity=True, bound=NOT_NEGATIVE)
    betas: tuple[float, float] = setting((0.9, 0.999), identity=True)
    schedule: Literal["constant", "cosine"] = setting("constant", identity=True)
    warmup_steps: int = setting(0, identity=True, bound=Bound(lambda v: v >= 0, "0 (no warm-up) or a number of steps"))
    min_lr_ratio: float = setting(
        0.0, identity=True, bound=MIN_LR_RATIO
    )  # cosine floor, as a fraction of the peak learning rate
    # max global gradient norm; None logs the norm without clipping
    grad_clip: float | None = setting(None, identity=True, bound=GRAD_CLIP)


@dataclass
class BatchConfig:
    # per_device: `size` sequences per device per step, the global batch grows with the world size (the course).
    # global: `size` sequences per optimizer step whatever the world size, split across ranks.
    mode: Literal["per_device", "global"] = setting("per_device", identity=True)
    size: int = setting(512, identity=True, bound=POSITIVE)
    # per-device micro-batch; smaller than the per-device share -> accumulation
    micro_size: int | None = setting(None, identity=True, bound=POSITIVE)
    # per_device mode: scale lr with the world size
    lr_scaling: Literal["none", "linear", "sqrt"] = setting("none", identity=True)

    def sizes(self, dp_size: int) -> tuple[int, int]:
        """(global batch, sequences per forward/backward on a data-parallel rank) for `dp_size` ranks; the one
        place the batch's rules live: a batch that does not split evenly is refused, saying what to change."""
        global_batch = self.size * dp_size if self.mode == "per_device" else self.size
        if global_batch % dp_size:  # a global batch smaller than the ranks too
            raise ConfigError(
                f"global batch of {global_batch} sequences is not divisible by the {dp_size} data-parallel ranks; "
                f"choose batch.size as a multiple of {dp_size}"
            )
        per_rank = global_batch // dp_size
        micro = self.micro_size or per_rank
        if per_rank % micro:
            raise ConfigError(
                f"batch.micro_size {micro} does not divide the per-rank share of {per_rank} sequences; "
                f"choose a divisor of {per_rank}"
            )
        return global_batch, micro


@dataclass
class TrainConfig:
    epochs: int = setting(10, identity=True, bound=POSITIVE)
    # stop after this many optimizer steps (smoke runs, benchmarks)
    max_steps: int | None = setting(None, identity=True, bound=POSITIVE)
    log_every: int = setting(50, identity=False, bound=POSITIVE)
    # steps between validation runs; validation also runs after every epoch
    eval_every: int | None = setting(None, identity=False, bound=POSITIVE)
    # sequences per evaluation batch, at most eval_batch_tokens tokens
    eval_batch_size: int = setting(256, identity=False, bound=POSITIVE)
    # an evaluation batch's logits are tokens x vocabulary: long sequences take fewer sequences per batch
    eval_batch_tokens: int = setting(16384, identity=False, bound=POSITIVE)
    # auto: bf16 on CUDA, fp32 on CPU. bf16 on one GPU is autocast: its matrix products in bf16, the residual stream
    # and norms in fp32. bf16_params (CUDA): the parameters cast to bf16 for the forward by FSDP's policy (on one GPU
    # a mesh of one rank), so every activation is bf16, over fp32 master weights, gradients and AdamW state (what
    # FSDP layouts do with bf16 anyway); less element-wise traffic (docs/benchmarks.md)
    precision: Literal["auto", "fp32", "bf16", "bf16_params"] = setting(
        "auto", identity=True, lightning_refuses=("bf16_params", "Lightning's bf16 is its autocast plugin")
    )
    # one device's dense peak TFLOP/s for MFU; None: the table for known GPUs, a measurement on CPU
    # (scalelm.measure.peak)
    peak_tflops: float | None = setting(None, identity=False, bound=POSITIVE)
    # seconds between samples of CPU, RSS and GPU utilisation (scalelm.measure.sampler, one sampler per node); 0: none
    monitor_interval_s: float = setting(
        1.0, identity=False, bound=Bound(lambda v: v >= 0, "0 (no monitor) or a number of seconds")
    )
    # the last steps run under torch's profiler to time the collectives (scalelm.measure.comm); 0: none
    comm_profile_steps: int = setting(
        2, identity=False, bound=Bound(lambda v: v >= 0, "0 (no profile) or a number of steps")
    )
    # also log to Weights & Biases, offline, in <run_dir>/wandb (scalelm.train.wandb_offline)
    wandb: bool = setting(False, identity=False)
    deterministic: bool = setting(False, identity=False)
    # blocks keep less of the forward pass and recompute the rest in the backward: less memory for more compute; full:
    # their inputs only, selective: their matrix products' and attention's outputs
    # (scalelm.parallel.activation_checkpoint)
    activation_checkpointing: Literal["none", "full", "selective"] = setting("none", identity=False)
    # torch.compile each block (and on CUDA the head with its loss): fewer kernel launches, fused element-wise work;
    # the first steps pay the compilation (scalelm.parallel.compile)
    compile: bool = setting(False, identity=False)
    # torch.compile's mode: default, or max-autotune-no-cudagraphs (at the first step, benchmarks matrix-product kernels
    # and tunes the fused ones by coordinate descent: minutes of compiling, whose results the persistent Inductor cache,
    # site.yaml's inductor_cache_dir, keeps for later runs). No CUDA graphs: the GPU is already busy through the step
    compile_mode: Literal["default", "max-autotune-no-cudagraphs"] = setting("default", identity=False)
    # AdamW's step under torch.compile: its element-wise passes fused into a few kernels (scalelm.optim)
    compile_optimizer: bool = setting(
        False, identity=False, lightning_refuses=(True, "Lightning calls the optimizer's step itself")
    )
    # the output projection with its cross-entropy, one function by three paths: auto, fused on CPU in fp32
    # (scalelm.model.cpu_ops), plain elsewhere (on CUDA compiled with the head); chunked, on GPUs chunk by chunk of
    # tokens, each chunk's loss and gradients in the forward (compiled with train.compile), the logits never kept for
    # the backward (scalelm.model.gpu_ops; docs/benchmarks.md); plain, the logits then the cross-entropy everywhere
    fused_loss: Literal["auto", "chunked", "plain"] = setting("auto", identity=False)
    # scaled-dot-product attention's kernels: default, torch's own order; auto, cuDNN's first on Hopper (compute
    # capability 9.0, where it is the faster one) where torch's own order does not already start with it and the cuDNN
    # is 9.9 or later: torch 2.6-2.8, and 2.10 on with a cuDNN older than 9.15.1 (CUDA 12 wheels); with a cuDNN older
    # than 9.15.1 only for a data.seq_len multiple of 128. With torch 2.9, or a cuDNN of 9.15.1 on (torch 2.11+cu130),
    # a no-op: torch already puts cuDNN first (scalelm.parallel.numerics.attention_backends; docs/benchmarks.md)
    attention_kernels: Literal["default", "auto"] = setting(
        "default", identity=False, lightning_refuses=("auto", "Lightning runs the forward outside scalelm's step")
    )
    # a step running longer than max(hang_factor x the median step, hang_floor_s) stops the job with an autopsy of
    # its ranks (scalelm.hang.watchdog) instead of hanging; hang_factor 0: no watchdog
    hang_factor: float = setting(20.0, identity=False, bound=HANG_FACTOR)
    hang_floor_s: float = setting(120.0, identity=False, bound=Bound(lambda v: v > 0, "a positive number of seconds"))
    # what runs the loop: scalelm's trainer, or PyTorch Lightning's Trainer with its DDP strategy over the same
    # model, data order, optimizer and records (scalelm.train.lightning_engine; pip install 'scalelm[lightning]')
    engine: Literal["scalelm", "lightning"] = setting("scalelm", identity=False)


@dataclass
class CheckpointConfig:
    # steps between checkpoints; one is also written after every epoch and at the end
    every: int | None = setting(500, identity=False, bound=POSITIVE)
    keep: int = setting(2, identity=False, bound=POSITIVE)


@dataclass
class ParallelConfig:
    # The layout: degrees whose product is the world size, one of them may be -1 (the rest); see scalelm.parallel.dims.
    # A strategy name is a shorthand for degrees not set here: single, ddp (dp_replicate -1), fsdp (dp_shard -1),
    # hsdp (dp_replicate = nodes, dp_shard = processes per node), tp (tp -1), fsdp_tp (tp = processes per node,
    # dp_shard -1), pp (pp -1), cp (cp -1). Nothing set: one process.
    strategy: str | None = setting(None, identity=True)
    dp_replicate: int | None = setting(None, identity=True)
    dp_shard: int | None = setting(None, identity=True)
    tp: int | None = setting(None, identity=True)
    pp: int | None = setting(None, identity=True)  # pipeline stages: the blocks split into groups on successive ranks
    # context parallelism: every sequence split across cp ranks, attention by a ring
    cp: int | None = setting(None, identity=True)
    # expert parallelism: model.moe's experts split over ep ranks, borrowed from dp_shard (as torchtitan), tokens sent
    # to their experts' ranks and back by all-to-all; None: 1
    ep: int | None = setting(None, identity=True, added=True)
    # cp: each rank holds chunks r and 2 cp - 1 - r of 2 cp (the causal mask's work even across ranks); False: one
    # contiguous part each (the last rank then does most of the attention's work)
    cp_load_balance: bool = setting(True, identity=True)
    # pp: gpipe (all forwards, then all backwards), 1f1b (one forward, one backward in the steady state),
    # interleaved_1f1b (pp_virtual_stages stages per rank, a smaller bubble for more point-to-point traffic)
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = setting("1f1b", identity=True)
    # pp: the pieces each replica's batch is pipelined in; None: 2 x pp
    pp_microbatches: int | None = setting(None, identity=True, bound=POSITIVE)
    pp_virtual_stages: int = setting(
        1, identity=True, bound=POSITIVE
    )  # pp: stages per rank, 2 or more for interleaved_1f1b
    # tp: norms, residual dropout and additions split along the sequence
    sequence_parallel: bool = setting(False, identity=True)
    loss_parallel: bool = setting(False, identity=True)  # tp: output projection and cross-entropy split by vocabulary
    # fsdp: False keeps gathered weights from forward to backward (ZeRO-2); None: True, but False with a pipeline,
    # whose every micro-batch would gather them again
    reshard_after_forward: bool | None = setting(None, identity=True)
    cpu_offload: bool = setting(False, identity=True)  # fsdp, CUDA only
    # CPU: freed allocations below this many MiB stay in malloc's heap for the next step (fewer page faults), larger
    # ones go back to the system; None: 1024, with FSDP 4 (its buffers would fragment the heap: parallel/hostmemory.py)
    host_reuse_below_mb: float | None = setting(None, identity=False, bound=POSITIVE)
    timeout_s: int = setting(
        600, identity=False, bound=POSITIVE
    )  # collective timeout: a lost rank fails the job instead of hanging it

    def reshards(self, pp: int) -> bool:
        """Whether FSDP frees gathered weights after each forward in a layout with `pp` pipeline stages."""
        return self.reshard_after_forward if self.reshard_after_forward is not None else pp == 1


@dataclass
class Config:
    run_dir: str = setting("runs/default", identity=False)
    # the study name the run measures for (the workflow's `study`): a run trained for another is trained afresh, its
    # earlier attempt set aside in previous/, never restored or resumed (scalelm.train.rundir): a measurement again
    study: str | None = setting(None, identity=True, added=True)
    seed: int = setting(
        1, identity=True, bound=Bound(lambda v: 0 <= v < SEED_LIMIT, f"an integer from 0 to {SEED_LIMIT - 1}")
    )
    device: Literal["auto", "cpu", "cuda"] = setting("auto", identity=True)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict[str, Any]:
        return plain(dataclasses.asdict(self))


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `dotted` (a.b.c) in `tree`; a mapping merges into the section it names, key by key, as dotted sets would."""
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if child is None:  # a section given as null (every key commented out)
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set '{dotted}': '{part}' is not a section")
        node = child
    merge_setting(node, leaf, value, dotted)


def merge_setting(node: dict[str, Any], key: str, value: Any, dotted: str) -> None:
    """node[key] = value, but a mapping merges into the section there, and a value of another kind replaces none (the
    rule of `--set` overrides; the study's layers replace sections: scalelm.study.experiments.deep_merge)."""
    current = node.get(key)
    if value is None and optional_section(dotted):  # null is such a section's default: off
        node[key] = None
    elif isinstance(current, dict) and isinstance(value, dict):
        for name, item in value.items():
            merge_setting(current, name, item, f"{dotted}.{name}")
    elif isinstance(current, dict) and current:  # a value in place of a section would drop the section's settings
        keys = ", ".join(str(name)[:40] for name in list(current)[:8]) + (", ..." if len(current) > 8 else "")
        raise ConfigError(
            f"cannot set '{dotted}' to {shown(value)}: it is a section of settings ({keys}); set its "
            f"keys ({dotted}.KEY=VALUE) or merge a mapping into it ({dotted}={{KEY: VALUE}})"
        )
    else:
        node[key] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` -> ('a.b', value), the value read as YAML (so 1e-3, true, null, [1, 2] work); a text setting (a
    path, a name) keeps its text as given (`as_text`)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {shown(text)} is not of the form key=value (e.g. optim.lr=1e-3)")
    if takes_text(key):
        return key, as_text(raw)
    try:
        return key, parse_settings(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise load_error(err, f"override {shown(text)}") from None


def as_text(raw: str) -> str | None:
    """A text setting's value as given on a command line: YAML would end it at ' #', fold its lines and read 2 as a
    number, so only null and a quoted string are read as YAML."""
    if raw.strip() in ("null", "Null", "NULL", "~"):
        return None
    if raw.strip()[:1] in ("'", '"'):
        try:
            quoted = parse_settings(raw)
        except yaml.YAMLError:
            return raw
        return quoted if isinstance(quoted, str) else raw
    return raw


def field_hint(dotted: str) -> Any:
    """The type annotation of the setting `dotted` names, as its field declares it; None for no setting."""
    hint: Any = Config
    for part in dotted.split("."):
        sections = [arg for arg in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(arg)]
        if not sections:
            return None
        hint = typing.get_type_hints(sections[0]).get(part)
    return hint


def optional_args(hint: Any) -> tuple[Any, ...]:
    """What `hint` allows besides None, if it allows None (X | None); () otherwise."""
    args = typing.get_args(hint)
    is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return tuple(arg for arg in args if arg is not type(None)) if is_union and type(None) in args else ()


def takes_text(dotted: str) -> bool:
    """Whether the setting `dotted` is free text (str, or str or null): a path or a name."""
    hint = field_hint(dotted)
    return hint is str or optional_args(hint) == (str,)


def optional_section(dotted: str) -> bool:
    """Whether `dotted` is a section that null switches off (model.moe)."""
    return any(dataclasses.is_dataclass(arg) for arg in optional_args(field_hint(dotted)))


def from_dict(values: dict[str, Any]) -> Config:
    config = from_mapping(Config, values)
    validate(config)
    return config


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    values = read_settings(path) if path else {}
    for text in overrides:
        set_dotted(values, *parse_override(text))
    return from_dict(values)


def validate(config: Config) -> None:
    """Checks across settings that the types alone cannot express."""
    check_study_name(config.study)
    for key, value in {"run_dir": config.run_dir, "data.prepared_dir": config.data.prepared_dir}.items():
        if not value.strip():  # it would mean the current directory, and never on purpose
            raise ConfigError(
                f"{key} is empty (an unset variable in --set {key}=$VAR?): give the directory, e.g. {key}=runs/trial"
            )
    check_bounds(config)
    if config.model.d_model % config.model.n_heads:
        raise ConfigError(
            f"model.d_model ({config.model.d_model}) must be divisible by model.n_heads ({config.model.n_heads})"
        )
    if config.data.seq_len > config.model.max_seq_len:
        raise ConfigError(
            f"data.seq_len ({config.data.seq_len}) exceeds model.max_seq_len ({config.model.max_seq_len}); "
            "lower data.seq_len or raise model.max_seq_len"
        )
    check_family(config.model)
    check_optim(config.optim)
    if config.model.moe is not None:
        check_moe(config.model.moe, config.model.n_layers)
    if config.batch.mode == "global" and config.batch.lr_scaling != "none":
        raise ConfigError(
            "batch.lr_scaling applies to batch.mode=per_device only: with a global batch the learning rate "
            "needs no scaling; set batch.lr_scaling=none"
        )
    check_speed_settings(config.train)


def check_bounds(settings: Any, prefix: str = "") -> None:
    """Every setting against the bound its field declares (`setting(bound=...)`), sections unfolded (a mixture's
    too): the first outside it refused by name."""
    for item in dataclasses.fields(settings):
        value, dotted = getattr(settings, item.name), f"{prefix}{item.name}"
        if dataclasses.is_dataclass(value):
            check_bounds(value, f"{dotted}.")
            continue
        bound = item.metadata.get("bound")
        if bound is None or value is None or bound.holds(value):
            continue
        nullable = item.default is None and "null" not in bound.says
        raise ConfigError(f"{dotted} must be {bound.says}{' or null' if nullable else ''}, got {value}")


def check_moe(moe: MoEConfig, n_layers: int) -> None:
    """A mixture of experts' settings against each other and the model's blocks."""
    if moe.top_k > moe.experts:
        raise ConfigError(
            f"model.moe.top_k={moe.top_k} exceeds model.moe.experts={moe.experts}: a token goes to top_k distinct "
            "experts; lower top_k or add experts"
        )
    if moe.every > n_layers:
        raise ConfigError(
            f"model.moe.every={moe.every} leaves all of model.n_layers={n_layers} blocks dense (block i is a mixture "
            "where (i + 1) % every == 0); lower every, or drop model.moe"
        )
    for key in ("aux_loss_coef", "z_loss_coef", "bias_rate"):
        if getattr(moe, key) > ROUTER_COEF_LIMIT:
            raise ConfigError(
                f"model.moe.{key} must be at most {ROUTER_COEF_LIMIT:g}, got {getattr(moe, key)}: more is far beyond "
                "any use (usual values: aux_loss_coef 0.01, z_loss_coef 0.001, bias_rate 0.001) and, far enough, "
                "overflows float32 in the training; lower it"
            )
    check_balance(moe)


def unused_settings(section: Any, owner_of: dict[str, str], chosen: str) -> Iterator[tuple[str, Any, Any, str]]:
    """(key, value, default, its choice) of each setting of `section` that only another choice than `chosen` uses
    (`owner_of`: a setting's choice) and that is set away from its default: it would change nothing trained, yet
    tell the run apart from the same run without it (a run's identity holds it)."""
    defaults = type(section).__dataclass_fields__
    for key, owner in owner_of.items():
        value, default = getattr(section, key), defaults[key].default
        if owner != chosen and value != default:
            yield key, value, default, owner


def check_balance(moe: MoEConfig) -> None:
    """A coefficient that model.moe.balance does not use, refused unless at its default (`unused_settings`)."""
    for key, value, default, balance in unused_settings(moe, BALANCE_OF, moe.balance):
        raise ConfigError(
            f"model.moe.{key}={value} acts under model.moe.balance={balance} only, and the balance is "
            f"{moe.balance}: remove {key} (or leave it at its default, {default}), or set model.moe.balance={balance}"
        )


def check_family(model: ModelConfig) -> None:
    """A setting of the other family's block refused unless at its default (`unused_settings`), and grouped-query
    attention's heads against the query heads."""
    for key, value, default, family in unused_settings(model, FAMILY_ONLY, model.family):
        raise ConfigError(
            f"model.{key}={value} applies to model.family={family} only, and the family is {model.family}: "
            f"remove {key} (or leave it at its default, {default})"
            + (" (a llama block is always pre-norm, with RMSNorm)" if key == "norm" else "")
        )
    if model.n_kv_heads is not None and model.n_heads % model.n_kv_heads:
        raise ConfigError(
            f"model.n_kv_heads ({model.n_kv_heads}) must divide model.n_heads ({model.n_heads}): each key/value "
            "head serves a group of query heads"
        )
    if model.family == "llama" and model.head_dim % 2:
        raise ConfigError(
            f"model.d_model / model.n_heads ({model.head_dim}) must be even for rotary positions (pairs of features)"
        )


def check_speed_settings(train: TrainConfig) -> None:
    """compile_mode without compile, refused by name (an engine's refusals are its settings' fields': `refusals`)."""
    if train.compile_mode != "default" and not train.compile:
        raise ConfigError(
            f"train.compile_mode={train.compile_mode} tunes what torch.compile builds, and train.compile is off: "
            "set train.compile=true, or leave train.compile_mode at default"
        )


def refusals(config: Config, engine: str) -> list[str]:
    """What `engine` refuses of `config`: a sentence per setting whose field declares it (`setting`), naming the
    value, why, and what to do."""
    found = []
    for dotted, section, item in leaf_fields(config):
        refused = item.metadata.get("refused_by", {}).get(engine)
        if refused is not None and getattr(section, item.name) == refused[0]:
            value, why = refused
            found.append(
                f"{dotted}={as_yaml(value)} is scalelm's engine only ({why}); set train.engine=scalelm, or leave "
                f"{dotted} at {as_yaml(item.default)}"
            )
    return found


def leaf_fields(config: Config) -> list[tuple[str, Any, dataclasses.Field]]:
    """(dotted key, the section holding it, its field) of every setting of `config`, sections unfolded."""
    leaves = []
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        if dataclasses.is_dataclass(value):
            leaves += [(f"{item.name}.{leaf.name}", value, leaf) for leaf in dataclasses.fields(value)]
        else:
            leaves.append((item.name, config, item))
    return leaves


def identity_settings(settings: dict[str, Any], cls: type | None = None) -> dict[str, Any]:
    """`settings` (Config.to_dict(), or an identity.json's) less those whose field says they are not identity
    (`setting`); a key no field declares (an older scalelm's) stays, so that it still tells runs apart."""
    cls = cls or Config
    hints = typing.get_type_hints(cls)
    fields = {item.name: item for item in dataclasses.fields(cls)}
    kept = {}
    for key, value in settings.items():
        item = fields.get(key)
        nested = dataclass_of(hints[key]) if item is not None else None
        if nested is not None and isinstance(value, dict):
            kept[key] = identity_settings(value, nested)
        elif item is None or item.metadata.get("identity", True):
            if not (item is not None and item.metadata.get("added") and value == item.default):
                kept[key] = value
    if cls is ModelConfig:  # the other family's settings shape nothing here (check_family refuses them set)
        for key, family in FAMILY_ONLY.items():
            if settings.get("family", "gpt2") != family:
                kept.pop(key, None)
    return kept


def dataclass_of(hint: Any) -> type | None:
    """The dataclass a field holds: its type, or the X of `X | None` (model.moe); None for any other."""
    candidates = [hint, *typing.get_args(hint)]
    return next((c for c in candidates if isinstance(c, type) and dataclasses.is_dataclass(c)), None)


@dataclass(frozen=True)
class Devices:
    """The device type a run trains on, and the one device=auto picks on its machine: what tells which settings
    train alike there (`equivalent_settings`)."""

    used: str
    auto: str


def equivalent_settings(settings: dict[str, Any], here: Devices) -> dict[str, Any]:
    """Identity settings (`identity_settings`) with a value that trains as its default does `here` written as that
    default, so that spelling the default out is the same run: device cpu where auto picks the CPU, precision fp32
    on a CPU (bf16 on CUDA), parallel.ep 1."""
    settings = json.loads(json.dumps(settings))  # a copy, in identity.json's form
    if settings.get("device") == here.auto:
        settings["device"] = "auto"
    train, parallel = settings.get("train"), settings.get("parallel")
    if isinstance(train, dict) and train.get("precision") in ("fp32", "bf16"):
        if train["precision"] == ("bf16" if here.used == "cuda" else "fp32"):
            train["precision"] = "auto"
    if isinstance(parallel, dict) and parallel.get("ep") == 1:
        del parallel["ep"]  # unset: an added setting at its default is left out (`setting`)
    return settings


def as_yaml(value: Any) -> str:
    """A setting's value as one writes it in YAML or --set (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def resolve_precision(precision: str, device_type: str) -> str:
    """train.precision on a device, its compute precision "bf16" or "fp32": auto is bf16 on CUDA and fp32 elsewhere,
    bf16_params computes in bf16 (how its parameters get there is the layout's: scalelm.parallel.runtime); bf16 on
    a CPU is refused (its matmuls are emulated there, far slower than fp32)."""
    if precision == "auto":
        return "bf16" if device_type == "cuda" else "fp32"
    if precision in ("bf16", "bf16_params") and device_type != "cuda":
        raise ConfigError(f"train.precision={precision} is for CUDA devices; use fp32 (or auto) on CPU")
    return "bf16" if precision == "bf16_params" else precision


def check_optim(optim: OptimConfig) -> None:
    """AdamW's and the schedule's constraints, here rather than at the first step of a run."""
    for i, beta in enumerate(optim.betas):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"optim.betas[{i}] must be in [0, 1), got {beta} (AdamW's usual values: [0.9, 0.999])")


def dump_config(config: Config, path: str | Path) -> None:
    write_settings(config.to_dict(), path)


def write_settings(settings: dict[str, Any], path: str | Path) -> None:
    """Settings as the YAML file a training reads (`--config`), written whole or not at all."""
    atomic_write_text(path, dump_settings(settings))
