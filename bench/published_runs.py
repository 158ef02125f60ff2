"""The planner against published runs at scale: each run planned from its model, layout, batch and machine (the
catalogue's figures, scalelm.plan.catalogue: one model, no constant fitted to a row), its predicted step time and
memory printed beside the published ones, with the error. docs/plan.md ("Against published runs") has the table.

    PYTHONPATH=src python bench/published_runs.py [--markdown]

Every published figure is typed here with its source. A run whose figure could not be found is left out (the
docstring of RUNS says which); a row whose model the planner cannot represent exactly says what differs.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from scalelm.config import load_config
from scalelm.plan.catalogue import catalogue, machine_record
from scalelm.plan.layouts import Machine, configured, feasible, plan_layout
from scalelm.plan.memory import Workload
from scalelm.plan.steptime import Speeds

GIB = 2**30


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    settings: tuple[str, ...]  # scalelm's --set of the run's model, batch and layout
    vocab: int
    gpu: str  # catalogue names
    network: str | None
    nodes: int
    gpus_per_node: int
    step_s: float  # the published step time, or the one its published throughput implies (`derived` says how)
    derived: str = ""
    memory_gb: float | None = None  # published peak per GPU, GB (1e9 bytes)
    differs: str = ""  # what the planner cannot represent


GPT2_124M = (
    "model.d_model=768",
    "model.n_heads=12",
    "model.n_layers=12",
    "model.d_ff=3072",
    "model.dropout=0.0",
    "model.norm=pre",
)
GPT2_TIED = (*GPT2_124M, "model.tie_weights=true", "data.seq_len=1024", "model.max_seq_len=1024")


def megatron_deepspeed_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool) -> float:
    """FLOPs per iteration as Megatron-DeepSpeed's throughput_calculator (megatron/utils.py) counts them for the TFLOPs
    BigScience reported: 24 x (4 with activation checkpointing, else 3) x B s l h^2 (1 + s/6h + V/16lh)."""
    factor = 4 if recompute else 3
    return 24 * factor * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


BLOOM_TFLOPS = 150  # "training throughput: about 150 TFLOPs" per GPU (the BigScience 176B model page, below)


def korthikanti_sequences(seconds: float, mfu: float, gpus: int) -> float:
    """The global batch (sequences) that Korthikanti et al.'s 530B model at `mfu` of the A100's 312 TFLOP/s on `gpus`
    GPUs computes in `seconds`, by the paper's model FLOPs per sequence (its Appendix A, with Narayanan et al.'s
    count): 72 L s h^2 (1 + s/6h + V/12hL), L 105, s 2048, h 20480, V 51200."""
    layers, seq, hidden, vocab = 105, 2048, 20480, 51200
    per_sequence = 72 * layers * seq * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * hidden * layers))
    return seconds * mfu * 312e12 * gpus / per_sequence


KORTHIKANTI_530B_S = 39.15  # seconds per iteration on 2240 A100s at 54.2% MFU (the paper's section 6.3, below)

RUNS = [
    # Left out, figures not found with the search tool: the rest of Korthikanti et al. 2022's tables (its Table 3's
    # configurations and Table 5's iteration times for 22B, 175B and 1T; only the 530B run's time on 2240 GPUs and MFU
    # were found, in notes citing the paper, and its Table 4's per-layer times without their micro-batch), llm.c's
    # GPT-2 1.5B on 8 H100s (its tokens per step), nanoGPT's own README figures.
    PublishedRun(
        "BLOOM-176B, 384 A100 80GB, tp 4 pp 12 dp 8",
        "BigScience 176B model page (https://bigscience.notion.site/BigScience-176B-Model-ad073ca07cdf479398d5f95d88e218c4):"
        " ~150 TFLOPs per GPU, 60 GB per GPU; layout, batch and shape: bigscience-workshop/bigscience "
        "train/tr11-176B-ml/tr11-176B-ml.slurm (TP 4, PP 12, micro-batch 2, global 2048, 14336 x 70, 112 heads, "
        "seq 2048, vocabulary padded to 250,880, --checkpoint-activations, bf16)",
        (
            "model.d_model=14336",
            "model.n_heads=112",
            "model.n_layers=70",
            "model.d_ff=57344",
            "model.dropout=0.0",
            "data.seq_len=2048",
            "model.max_seq_len=2048",
            "batch.mode=global",
            "batch.size=2048",
            "parallel.pp_microbatches=128",  # a replica's 256 sequences in micro-batches of 2
            "parallel.tp=4",
            "parallel.pp=12",
            "parallel.dp_shard=8",  # scalelm has no ZeRO-1: the state sharded over the replicas is FSDP's
            "train.activation_checkpointing=full",
            "parallel.loss_parallel=true",  # Megatron splits the vocabulary over tp
        ),
        250880,
        "a100-80gb",
        "omnipath-4x",
        48,
        8,
        megatron_deepspeed_flops(2048, 2048, 70, 14336, 250880, True) / (BLOOM_TFLOPS * 1e12 * 384),
        "from ~150 TFLOP/s per GPU by Megatron-DeepSpeed's FLOP count",
        60.0,
        "ALiBi for learned positions and an embedding layer norm (negligible); ZeRO-1 (DeepSpeed's bf16 optimizer: "
        "bf16 weights and gradients, the fp32 state sharded over dp 8) planned as FSDP over the 8 replicas, which "
        "also shards the weights and gradients that ZeRO-1 keeps whole (so less memory planned than published), and "
        "the step has FSDP's weight gathers (3 s) that ZeRO-1 has not (as plain data parallelism: 84 s, -19%, and "
        "98 GB); the embedding and output layer untied (scalelm ties none across pipeline "
        "stages; Megatron keeps a copy on the last stage and all-reduces their gradients, as much memory); Megatron's stages split 70 blocks and the embedding as 72 layers",
    ),
    PublishedRun(
        "Korthikanti et al. 530B, 2240 A100 80GB, tp 8 pp 35 dp 8, selective + sequence parallel",
        "Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer Models' (arXiv:2205.05198): "
        "the 530B GPT on 2240 A100s with selective recomputation and sequence parallelism, 54.2% MFU (abstract), "
        "39.15 s per iteration (section 6.3, as transcribed with the paper's ar5iv HTML cited in public notes found "
        "with the search tool); tensor parallelism 8, 8-way data parallelism of a 280-GPU replica (so pipeline 35); "
        "the shape is MT-NLG's (105 layers: the Microsoft/NVIDIA MT-NLG blog; h 20480, 128 heads, s 2048: the paper's "
        "section 5); vocabulary 51,200 (Megatron-LM's GPT models, its README); Selene's DGX A100 80GB nodes with HDR "
        "InfiniBand (the MT-NLG blog)",
        (
            "model.d_model=20480",
            "model.n_heads=128",
            "model.n_layers=105",
            "model.d_ff=81920",
            "model.dropout=0.0",
            "model.norm=pre",
            "data.seq_len=2048",
            "model.max_seq_len=2048",
            "batch.mode=global",
            "batch.size=2240",
            "parallel.pp_microbatches=280",  # a replica's 280 sequences in micro-batches of 1 (assumed)
            "parallel.dp_replicate=8",
            "parallel.tp=8",
            "parallel.pp=35",
            "parallel.sequence_parallel=true",
            "parallel.loss_parallel=true",
            "train.activation_checkpointing=selective",
        ),
        51200,
        "a100-80gb",
        "hdr-8x",
        280,
        8,
        KORTHIKANTI_530B_S,
        f"as published; its global batch of 2240 sequences from the MFU (the paper's FLOP count gives "
        f"{korthikanti_sequences(KORTHIKANTI_530B_S, 0.542, 2240):,.0f} in 39.15 s)",
        None,
        "Megatron-LM's selective recomputation recomputes attention's core (QK^T, softmax, dropout, AV: the paper's "
        "section 5), scalelm's the pointwise work between the products; the micro-batch of 1, the 1F1B schedule, "
        "dropout (planned without) and plain data parallelism (planned as HSDP's replicas, whose bf16 policy is "
        "Megatron's) are assumptions: the paper's Table 3 was not found; no memory figure published; the weights' "
        "casts and gradient accumulation over 280 micro-batches (5 s of the plan) are scalelm's, which Megatron's "
        "bf16 weights and fused accumulation into fp32 do not pay",
    ),
    PublishedRun(
        "llm.c GPT-2 124M, 8 A100 80GB SXM",
        "karpathy/llm.c discussion #481 ('Reproducing GPT-2 (124M) in llm.c in 90 minutes for $20'): 10B tokens in "
        "about 90 minutes on one 8X A100 80GB SXM node (found through a news summary of it, edworking.com, "
        "28 May 2024)",
        (*GPT2_TIED, "batch.size=64", "parallel.strategy=ddp", "train.compile=true"),
        50304,
        "a100-80gb",
        None,
        1,
        8,
        8 * 64 * 1024 / (10e9 / (90 * 60)),
        "from 10B tokens in ~90 minutes (evaluations included), at 8 x 64 x 1024 tokens per step",
        None,
        "llm.c's fused C/CUDA kernels (no framework dispatch), planned as compiled (train.compile's fused regions, "
        "the nearest scalelm has), with bf16 activations where the plan keeps autocast's fp32 residual stream; the "
        "batch of 64 x 1024 per GPU is assumed (as nanoGPT's)",
    ),
    PublishedRun(
        "llm.c GPT-2 124M, 8 H100 SXM",
        "KellerJordan/modded-nanogpt records/101324_llmc/README.md: llm.c as of 13 October 2024 run on a node of 8 "
        "H100 HBM3 by the instructions of karpathy/llm.c discussion #481, median step 139 ms, 10.26B tokens "
        "(19,570 steps of 524,288 tokens: 64 x 1024 per GPU)",
        (*GPT2_TIED, "batch.size=64", "parallel.strategy=ddp", "train.compile=true"),
        50304,
        "h100-sxm",
        None,
        1,
        8,
        0.139,
        "as published (the median step)",
        None,
        "as the A100 row: llm.c's fused C/CUDA kernels planned as compiled, its bf16 activations as autocast's",
    ),
    PublishedRun(
        "nanoGPT-style GPT-2 124M (build-nanogpt), 8 A100 SXM4",
        "debtirthasaha.github.io/blog/2026/gpt2-124m ('Eight A100s, $61, and 124M parameters'): 19,073 steps over "
        "10B FineWeb-Edu tokens, sustained 1.1M tokens/s",
        (*GPT2_TIED, "batch.size=64", "parallel.strategy=ddp", "train.compile=true"),
        50304,
        "a100-80gb",
        None,
        1,
        8,
        8 * 64 * 1024 / 1.1e6,
        "from 1.1M tokens/s at 524,288 tokens per step (10B / 19,073)",
        None,
        "the A100s' memory is not stated (planned as 80 GB); torch.compile and flash attention",
    ),
    PublishedRun(
        "scalelm gpt2_small, 1 H200, compiled",
        "docs/benchmarks.md, 'One GPU: the proof kit on an NVIDIA H200': 512,742 tokens/s, 32.0 ms at batch 16",
        (*GPT2_TIED, "batch.size=16", "parallel.strategy=single", "train.compile=true"),
        33278,
        "h200",
        None,
        1,
        1,
        0.0320,
        "",
        None,
        "compiled: the plan's memory models eager kernels, so no memory is compared",
    ),
    PublishedRun(
        "scalelm gpt2_small, 1 H200, eager",
        "docs/benchmarks.md (the second round's table): eager 350,543 tokens/s at batch 16; peak 11,922 MiB "
        "(max_memory_allocated)",
        (*GPT2_TIED, "batch.size=16", "parallel.strategy=single"),
        33278,
        "h200",
        None,
        1,
        1,
        16 * 1024 / 350543,
        "from 350,543 tokens/s at 16 x 1024 tokens per step",
        11922 * 2**20 / 1e9,
        "",
    ),
]


@dataclass(frozen=True)
class Prediction:
    run: PublishedRun
    step_s: float
    memory_gb: float
    fits: bool

    @property
    def step_error(self) -> float:
        return self.step_s / self.run.step_s - 1

    @property
    def memory_error(self) -> float | None:
        return self.memory_gb / self.run.memory_gb - 1 if self.run.memory_gb else None


def plan_run(run: PublishedRun) -> Prediction:
    """The run's own layout planned on its catalogue machine: its step time, memory per GPU and whether it fits."""
    config = load_config(None, list(run.settings))
    work = Workload(config, run.vocab)
    gpu = catalogue().accelerator(run.gpu)
    machine = Machine(run.nodes, run.gpus_per_node, gpu.memory_gb)
    speeds = Speeds.from_baseline(machine_record(work, run.nodes, run.gpus_per_node, run.gpu, run.network))
    own = configured(work, machine)
    feasible(work, own.dims)
    plan = plan_layout(work, own, machine, speeds)
    return Prediction(run, plan.step.total_s, plan.memory.total / 1e9, plan.fits)


def percent(value: float | None) -> str:
    return f"{value:+.0%}" if value is not None else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="docs/plan.md's table")
    args = parser.parse_args()
    predictions = [plan_run(run) for run in RUNS]
    head = ["run", "published s", "predicted s", "error", "published GB", "predicted GB", "error", "fits"]
    rows = [
        [
            p.run.name,
            f"{p.run.step_s:.4g}",
            f"{p.step_s:.4g}",
            percent(p.step_error),
            f"{p.run.memory_gb:.1f}" if p.run.memory_gb else "-",
            f"{p.memory_gb:.1f}",
            percent(p.memory_error),
            "yes" if p.fits else "no",
        ]
        for p in predictions
    ]
    mean = sum(abs(p.step_error) for p in predictions) / len(predictions)
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        for row in [head, *rows]:
            print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    print(f"\nmean absolute step-time error {mean:.0%} over {len(predictions)} runs")
    for p in predictions:
        print(f"- {p.run.name}: {p.run.source}" + (f"; step {p.run.derived}" if p.run.derived else ""))
        if p.run.differs:
            print(f"  differs: {p.run.differs}")


if __name__ == "__main__":
    main()
