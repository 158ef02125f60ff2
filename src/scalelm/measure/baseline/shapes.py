"""The model's training shapes as the baseline times them: its matrix products' (M, K, N) for one micro-batch (the
output layer's rows padded as training pads them on the device), and the vocabulary they have (the prepared data's,
or WikiText-2's where none is prepared)."""

from __future__ import annotations

import json
from pathlib import Path


def gemm_shapes(config, device_type: str) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of the model's training matrix products on `device_type` for one micro-batch of tokens: the output
    layer's N is its rows as training computes them (padded where scalelm.model.gpu_ops pads them)."""
    m, d, vocab = output_shape(config)
    ff = config.model.d_ff
    return {
        "qkv": (m, d, 3 * d),
        "attention_out": (m, d, d),
        "ffn_up": (m, d, ff),
        "ffn_down": (m, ff, d),
        "output": (m, d, padded_rows(vocab, device_type)),
    }


def output_shape(config) -> tuple[int, int, int]:
    """(M, K, N) of the output layer's product as the model defines it: one micro-batch's tokens (one device's,
    without data parallelism), the model's width, the vocabulary."""
    m = config.data.seq_len * (config.batch.micro_size or config.batch.size)
    return m, config.model.d_model, vocabulary_size(config)


def output_shapes(config) -> dict[str, tuple[int, int, int]]:
    """The output layer's product unpadded and as training pads it on CUDA, for `matmul_rates` to set side by
    side (the padding is there because the unpadded shape gets slower kernels)."""
    m, d, vocab = output_shape(config)
    return {"output_unpadded": (m, d, vocab), "output_padded": (m, d, padded_rows(vocab, "cuda"))}


def padded_rows(rows: int, device_type: str) -> int:
    """`rows` of a weight as scalelm.model.gpu_ops.aligned_linear multiplies it on `device_type`."""
    from scalelm.model.gpu_ops import PADDED_DEVICES, ROW_MULTIPLE  # imports torch: not at the module's import

    return rows + (-rows % ROW_MULTIPLE if device_type in PADDED_DEVICES else 0)


WIKITEXT2_VOCABULARY = 33278  # WikiText-2's with the course's preparation: the stand-in where none is prepared


def prepared_vocabulary(config) -> int | None:
    """The vocabulary of the prepared data the config names; None where none is prepared there."""
    manifest = Path(config.data.prepared_dir) / "manifest.json"
    try:
        return int(json.loads(manifest.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError):
        return None


def vocabulary_size(config) -> int:
    """The prepared data's, where it is; else WikiText-2's (the model's step then is not the study's: the plan
    prices the vocabulary the baseline measured, `model_step.vocab_size`)."""
    return prepared_vocabulary(config) or WIKITEXT2_VOCABULARY
