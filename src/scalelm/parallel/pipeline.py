"""Pipeline parallelism over the mesh's "pp" dimension, with torch.distributed.pipelining's schedules.

The model's blocks are split into `pp x pp_virtual_stages` stages, as evenly as possible (earlier stages take one
more where they do not divide); the first stage also holds the embedding, the last the final norm, the output
projection and the loss. The last stage's forward ends with the norm and the schedule's loss function runs the head
with the loss (TransformerLM.head_loss), the whole model's path: fused on CPU, one compiled graph on CUDA. Stage s
runs on pipeline rank s % pp, so with virtual stages rank 0 holds stages 0 and pp (the interleaved schedule's loop).
Each stage is the whole TransformerLM without the other stages' parts (`stage_part`), so tensor parallelism and FSDP
apply to it unchanged, and its parameters keep the whole model's names (blocks.3.attn.qkv.weight): a rank's stages
together (`StageParts`) are what the optimizer, clipping and checkpoints see, and a checkpoint of any pipeline layout
loads into any other layout.

A training step runs the schedule: each replica's batch is cut into `pp_microbatches` micro-batches that flow
forward through the stages and back (`Pipeline.step`); the last stage computes the loss of each, the schedule
divides the gradients by their number. Evaluation runs forward only, whole batches handed from stage to stage
(`Pipeline.forward`), so every token is scored once whatever the micro-batching.

While training, every rank notes when each of its stages works on which micro-batch (`StageTimeline`, the last
TIMED_STEPS steps but an attempt's first): the idle share of a step, against the bubble the schedule predicts, and
the picture of one step that the report draws.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from scalelm.model.dtensors import local_shard
from scalelm.model.moe import mixtures, shapes_only
from scalelm.parallel.env import all_gather_object
from scalelm.parallel.layout import Layout

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what a stage may hand on, by index in a shape message
HIDDEN_DIMS = 3  # what a stage hands on: hidden states (batch, sequence, d_model); the shape message holds them
# the methods of torch's (prototype) PipelineStage that the schedules call per micro-batch: StageTimeline wraps them
TIMED_METHODS = {"F": "forward_one_chunk", "B": "backward_one_chunk"}
# the methods with which its first step infers the stages' shapes by running them (torch 2.13's, and earlier ones'):
# run with a mixture of experts' `shapes_only`, which neither routes on placeholder values nor counts them
SHAPE_INFERENCE_METHODS = ("_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference")
TIMED_STEPS = 8  # the last steps whose timelines are kept


def _with_shapes_only(method: Callable) -> Callable:
    def inferring(*args, **kwargs):
        with shapes_only():
            return method(*args, **kwargs)

    return inferring


# ------------------------------------------------------------------------------------------------ stages
def stage_part(model: nn.Module, blocks: range, first: bool, last: bool) -> nn.Module:
    """`model` (a TransformerLM, best on the meta device) reduced to one stage, in place: the blocks outside
    `blocks` removed, the embedding unless first, final norm and head unless last."""
    for name in [n for n in model.blocks if int(n) not in blocks]:
        del model.blocks[name]
    if not first:
        model.embed = None
    if not last:
        model.norm = None
        model.head = None
    return model


class StageParts(nn.Module):
    """A rank's stages as one module under the whole model's names: embed, blocks.N, norm, head (those it holds).
    Training runs through the pipeline's schedule, not through this module."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleDict({name: block for part in parts for name, block in part.blocks.items()})
        self.embed = parts[0].embed
        self.norm = parts[-1].norm
        self.head = parts[-1].head
        self.__dict__["parts"] = parts  # not submodules: their blocks are registered above, once
        self.pipeline: Pipeline | None = None  # their schedule, set once the weights are in (Parallel.build)

    def train(self, mode: bool = True) -> StageParts:
        super().train(mode)
        for part in self.parts:  # a stage's own dropout (after the embedding) is not among the modules above
            part.train(mode)
        return self

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline stage runs through its schedule (scalelm.parallel.pipeline.Pipeline)")


class StageTimeline:
    """When each of this rank's stages worked in a step. On CUDA the marks are events on the stream, read after the
    step (no synchronisation in the hot loop); on CPU the work is done when a call returns."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.steps: deque[tuple[int, list]] = deque(maxlen=TIMED_STEPS)  # (step number, its start and chunks)
        self.step_number = 0
        self.marks: list | None = None

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, begin, mark) -> float:
        return begin.elapsed_time(mark) / 1000 if self.cuda else mark - begin

    def begin(self, step: int) -> None:
        self.step_number = step
        self.marks = [self.mark()]

    def end(self) -> None:
        """After the last backward chunk: the gradient reduction that follows is not pipeline work."""
        self.steps.append((self.step_number, self.marks))
        self.marks = None

    def wrap(self, stage: int, kind: str, call: Callable) -> Callable:
        """`call`, timed in the steps this timeline records; its micro-batch: the first argument (the schedule's
        chunk id) or, for the loss, which has none, the count of losses so far in the step."""

        def timed(*args, **kwargs):
            if self.marks is None:
                return call(*args, **kwargs)
            start = self.mark()
            result = call(*args, **kwargs)
            mb = args[0] if kind != "L" else sum(mark[1] == "L" for mark in self.marks[1:])
            self.marks.append((stage, kind, mb, start, self.mark()))
            return result

        return timed

    def chunks(self, skip: Callable[[int], bool]) -> list[dict]:
        """Every kept step not skipped: its number, its pipeline span and chunks, each one piece of a stage's work
        (kind F forward, L the head and loss, B backward, of micro-batch `mb`; start and end in seconds since the step
        began)."""
        if self.cuda:
            torch.cuda.synchronize()
        result = []
        for step, marks in self.steps:
            if skip(step):
                continue
            begin, chunks = marks[0], marks[1:]
            timed = [
                {"stage": s, "kind": k, "mb": mb, "start": self.seconds(begin, a), "end": self.seconds(begin, b)}
                for s, k, mb, a, b in chunks
            ]
            span = max((c["end"] for c in timed), default=0.0)
            result.append({"step": step, "span_s": span, "chunks": timed})
        return result


# ---------------------------------------------------------------------------------------------- pipeline
class Pipeline:
    """This rank's stages, their schedule, and forward-only evaluation across stages."""

    def __init__(
        self,
        parts: list[nn.Module],
        stage_ids: list[int],
        layout: Layout,
        pp_group: dist.ProcessGroup,
        device: torch.device,
    ):
        self.parts, self.stage_ids, self.layout = parts, stage_ids, layout
        self.num_stages, self.pp, self.n_microbatches = layout.num_stages, layout.dims.pp, layout.microbatches
        self.group, self.device = pp_group, device
        self.holds_loss = stage_ids[-1] == self.num_stages - 1
        if self.holds_loss:  # the last stage hands its normed hidden states to `loss`, which runs the head
            parts[-1].head_in_loss = True
        self.scale = 1.0  # the loss's weight in the optimizer step (gradient accumulation)
        self.steps_run = 0
        self.timeline = StageTimeline(device)
        stages = []
        for part, index in zip(parts, stage_ids):
            stage = PipelineStage(part, index, self.num_stages, device, group=pp_group)
            for kind, method in TIMED_METHODS.items():
                if not callable(getattr(stage, method, None)):  # a torch whose prototype API moved on
                    raise RuntimeError(
                        f"torch {torch.__version__}'s PipelineStage has no {method}, which scalelm's stage timeline "
                        "wraps: use the torch version of the image or requirements, or update "
                        "scalelm.parallel.pipeline.TIMED_METHODS"
                    )
                setattr(stage, method, self.timeline.wrap(index, kind, getattr(stage, method)))
            infers = [name for name in SHAPE_INFERENCE_METHODS if callable(getattr(stage, name, None))]
            if mixtures(part) and not infers:
                raise RuntimeError(
                    f"torch {torch.__version__}'s PipelineStage has none of {', '.join(SHAPE_INFERENCE_METHODS)}, "
                    "which scalelm runs without a mixture of experts' routing: use the torch version of the image "
                    "or requirements, or update scalelm.parallel.pipeline.SHAPE_INFERENCE_METHODS"
                )
            for name in infers:
                setattr(stage, name, _with_shapes_only(getattr(stage, name)))
            stages.append(stage)
        kind = SCHEDULES[layout.schedule]
        loss = self.timeline.wrap(stage_ids[-1], "L", self.loss)
        interleaved = layout.schedule == "interleaved_1f1b"
        self.schedule = kind(stages if interleaved else stages[0], layout.microbatches, loss_fn=loss)

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch from its normed hidden states: the head with the mean
        cross-entropy, as the whole model computes them (`head_loss`), weighted for accumulation."""
        return self.parts[-1].head_loss(hidden, targets) * self.scale

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, scale: float, step: int) -> torch.Tensor:
        """Forward and backward of one batch through every stage; the mean loss of its micro-batches (times `scale`)
        on the ranks of the last stage, zero on the others."""
        self.scale = scale
        timed = self.steps_run > 0  # an attempt's first step also infers every stage's shapes: not timed
        if timed:
            self.timeline.begin(step)
        losses: list[torch.Tensor] = []
        first = self.stage_ids[0] == 0
        self.schedule.step(
            *((inputs,) if first else ()),
            target=targets if self.holds_loss else None,
            losses=losses if self.holds_loss else None,
            return_outputs=False,
        )
        if timed:
            self.timeline.end()
        self.steps_run += 1
        if not self.holds_loss:
            return torch.zeros((), device=self.device)
        # (from vocabulary-split logits the loss is a DTensor, replicated on the tensor-parallel group)
        return torch.stack([local_shard(loss).detach() for loss in losses]).sum() / self.n_microbatches

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The logits of a whole batch on the last stage's ranks (None elsewhere), stage after stage."""
        x = inputs
        for part, index in zip(self.parts, self.stage_ids):
            if index > 0:
                x = self._receive(index - 1)
            x = part(x)
            if index < self.num_stages - 1:
                self._send(x, index + 1)
        return self.parts[-1].logits(x) if self.holds_loss else None

    def _send(self, tensor: torch.Tensor, stage: int) -> None:
        if tensor.dim() != HIDDEN_DIMS:
            raise ValueError(f"a stage hands on {HIDDEN_DIMS}-d hidden states, got shape {tuple(tensor.shape)}")
        peer = stage % self.pp
        shape = torch.tensor([*tensor.shape, DTYPES.index(tensor.dtype)], dtype=torch.int64, device=self.device)
        dist.send(shape, group=self.group, group_dst=peer)
        dist.send(tensor.contiguous(), group=self.group, group_dst=peer)

    def _receive(self, stage: int) -> torch.Tensor:
        peer = stage % self.pp
        shape = torch.empty(HIDDEN_DIMS + 1, dtype=torch.int64, device=self.device)
        dist.recv(shape, group=self.group, group_src=peer)
        *size, dtype = shape.tolist()
        tensor = torch.empty(size, dtype=DTYPES[dtype], device=self.device)
        dist.recv(tensor, group=self.group, group_src=peer)
        return tensor

    def measurements(self, skip: Callable[[int], bool], peak_mem_mb: float) -> dict:
        """The pipeline as run.json records it (a collective): its bubble, predicted and measured on the kept steps
        not in `skip`, every rank's timeline of the latest such step, and the peak memory (this rank's:
        `peak_mem_mb`) of each pipeline rank's stages."""
        steps = self.timeline.chunks(skip)
        everyone = all_gather_object({"stages": self.stage_ids, "steps": steps, "peak_mem_mb": peak_mem_mb})
        per_pp_rank: list[float | None] = [None] * self.pp  # the largest of the ranks holding the same stages
        for rank in everyone:
            if math.isfinite(rank["peak_mem_mb"]):  # NaN: no step of this attempt was logged unprofiled
                pp_rank = rank["stages"][0]
                per_pp_rank[pp_rank] = max(per_pp_rank[pp_rank] or 0.0, rank["peak_mem_mb"])
        latest = [rank["steps"][-1] if rank["steps"] else None for rank in everyone]
        return {
            **self.describe(),
            **bubble([rank["steps"] for rank in everyone]),
            "timed_steps": [step["step"] for step in everyone[0]["steps"]],
            "stages_of_pp_rank": [self.layout.stages_of(r) for r in range(self.pp)],
            "peak_mem_mb_per_pp_rank": per_pp_rank,
            "timeline": [{"rank": r, **step} for r, step in enumerate(latest) if step is not None],
        }

    def describe(self) -> dict:
        return {
            "schedule": self.layout.schedule,
            "microbatches": self.layout.microbatches,
            "virtual_stages": self.layout.virtual_stages,
            "stages": self.layout.num_stages,
            "predicted_bubble": self.layout.predicted_bubble,
        }


def bubble(timelines: list[list[dict]]) -> dict:
    """The measured idle share from every rank's kept steps (lists of StageTimeline.chunks): per rank, the time
    within its pipeline span (from its step's start to its last backward) in which none of its stages worked,
    averaged over steps; the mean and largest over ranks."""
    per_rank = []
    for steps in timelines:
        shares = []
        for step in steps:
            busy = sum(c["end"] - c["start"] for c in step["chunks"])
            shares.append(1.0 - busy / step["span_s"] if step["span_s"] > 0 else 0.0)
        per_rank.append(sum(shares) / len(shares) if shares else None)
    measured = [s for s in per_rank if s is not None]
    return {
        "measured_bubble": sum(measured) / len(measured) if measured else None,
        "measured_bubble_max": max(measured) if measured else None,
        "idle_share_per_rank": per_rank,
    }
