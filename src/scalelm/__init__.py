"""scalelm: a causal Transformer LM on WikiText-2, trained single-process, with DDP and with FSDP2."""

__version__ = "0.1.0"
