"""The model's own training step (forward with the loss, backward, AdamW) alone on one device, compiled as training
compiles it or eager, ready to call and timed; and the step's figures over the ranks (the slowest rank's, at a
quarter of its tokens, with every core of a host at work)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from scalelm.measure.baseline.timing import MODEL_STEP_SAMPLE_S, seconds_spread

if TYPE_CHECKING:  # torch is imported where the measuring starts: the workflow reads this module without it
    import torch


COMPILED_WARMUP = 3  # untimed calls of a compiled step before its timing


def model_step_seconds(
    config, vocab: int, tokens: int, device: torch.device, compiled: bool = False
) -> tuple[float, float, float]:
    """Seconds (min, median, max over its timed runs) of one training step of the model alone on this device
    (`model_step`), compiled as training compiles it where `compiled`: what the step-time model's matrix products and
    elementwise bytes leave out (dispatch, cold caches, the softmax's transcendental work) shows as its efficiency
    (scalelm.plan.steptime)."""
    step = model_step(config, vocab, tokens, device, compiled)
    # compiling happens in the first calls (forward and backward, then the optimizer's first step): untimed
    return seconds_spread(step, device, sample_s=MODEL_STEP_SAMPLE_S, warmup=COMPILED_WARMUP if compiled else 0)


def model_step(
    config,
    vocab: int,
    tokens: int,
    device: torch.device,
    compiled: bool = False,
    prepare: Callable[[torch.nn.Module], None] | None = None,
) -> Callable[[], None]:
    """One training step of the model (forward with the loss, backward, AdamW) for `tokens` tokens, ready to call:
    its blocks (and on CUDA its head) compiled as training compiles them (train.compile_mode) where `compiled`;
    `prepare` changes the model before its optimizer is made (`layout_overheads`)."""
    import torch

    from scalelm.model.transformer import TransformerLM
    from scalelm.optim import build_optimizer  # training's own AdamW
    from scalelm.parallel import compile as compiling

    torch.manual_seed(0)
    model = TransformerLM(config.model, vocab).to(device)
    if prepare is not None:
        prepare(model)
    if compiled:
        torch._dynamo.reset()  # a training compiles one shape: a second one here would be compiled shape-generic
        compiling.apply_compile(model, device, config.train.compile_mode)
    optimizer = build_optimizer(model, config.optim, config.optim.lr)
    shape = (max(1, tokens // config.data.seq_len), config.data.seq_len)
    inputs, targets = (torch.randint(0, vocab, shape, device=device) for _ in range(2))

    def step() -> None:
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def model_step_figures(tokens: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The model's step alone (the slowest rank's), for one micro-batch and for a quarter of its tokens on the same
    rank (a step's fixed cost is what a line through the two leaves at no tokens), and, on CPUs, how much more a
    machine does with every core at work: as threads of one process (`thread_speedup`, rank 0's), and as every rank
    of the job at once (`host_speedup`: the machine's throughput over one rank's alone; near the cores where they
    are real, less where they share caches or a physical core)."""
    slowest = max(per_rank, key=lambda r: r["model_step_s"])
    alone = slowest["model_step_s"]
    # the slowest rank's runs' fastest and slowest: the model's own spread
    figures: dict[str, Any] = {"tokens": tokens, "seconds_max": alone, "seconds_spread": slowest["model_step_s_spread"]}
    first = per_rank[0]
    if slowest.get("model_step_small_s") and slowest["model_step_small_tokens"] < tokens:
        # the same rank's: a line through two ranks' steps would take their difference for a fixed cost
        figures |= {
            "small_tokens": slowest["model_step_small_tokens"],
            "small_seconds_max": slowest["model_step_small_s"],
            "small_seconds_spread": slowest["model_step_small_s_spread"],
        }
    if first.get("layout_overhead_s"):
        figures |= {key: first[key] for key in ("layout_overhead_s", "layout_overhead_s_spread")}
    if first.get("model_step_all_cores_s"):
        figures |= {"cores": first["cpus"], "thread_speedup": first["model_step_s"] / first["model_step_all_cores_s"]}
    together = [r for r in per_rank if r.get("model_step_together_s")]
    if together:
        ranks_per_host = max(Counter(r["machine"] for r in per_rank).values())  # several "nodes" may be one
        slowest_together = max(r["model_step_together_s"] for r in together)
        figures |= {
            "together_seconds_max": slowest_together,
            "ranks_per_host": ranks_per_host,
            "host_speedup": ranks_per_host * alone / slowest_together,
        }
        # with every rank at work a machine's throughput moves most: the ranks' slowest run, and the best run of
        # the rank whose best was slowest (all ranks are needed for the machine's throughput)
        longest = max(r["model_step_together_s_spread"][1] for r in together)
        shortest = max(r["model_step_together_s_spread"][0] for r in together)
        figures["host_speedup_spread"] = [ranks_per_host * alone / longest, ranks_per_host * alone / shortest]
    return figures
