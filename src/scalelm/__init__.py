"""scalelm: a causal Transformer LM on WikiText-2, trained on one GPU and in every layout a distributed-training course
teaches (DDP, FSDP2, HSDP, tensor, sequence and context parallelism, pipeline schedules, their 2D and 3D combinations,
a mixture of experts with expert parallelism), by scalelm's own loop or Lightning's, as a reproducible experiment
matrix on any Slurm cluster. The module map: docs/design.md."""

__version__ = "0.1.0"
