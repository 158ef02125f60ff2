"""Evaluation of a compiled model (train.compile): eager, so that it never compiles again (review 3, finding 10)."""

from __future__ import annotations

import copy

import torch
from torch._dynamo.utils import counters

from scalelm.config import from_dict
from scalelm.model.transformer import TransformerLM
from scalelm.parallel.compile import apply_compile
from scalelm.train.evaluation import evaluate

VOCAB = 50


def test_evaluating_a_compiled_model_compiles_nothing_and_scores_as_eager(monkeypatch):
    """After the training forward compiled the blocks, evaluating (no grad, the training flag off: guards of those
    graphs; a shorter last batch: a new shape) compiles no graph, and neither does the training forward after it. The
    scores are the eager model's exactly, every token counted once, and the model is left in training mode. (Dynamo's
    eager backend: what recompiles is dynamo's decision, whatever the backend; Inductor would add seconds per graph.)"""
    real_compile = torch.nn.Module.compile
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, **kwargs: real_compile(self, backend="eager", **kwargs)
    )
    config = from_dict({"model": {"d_model": 32, "n_heads": 2, "n_layers": 1, "d_ff": 64, "dropout": 0.0}})
    torch.manual_seed(1)
    compiled = TransformerLM(config.model, VOCAB)
    eager = copy.deepcopy(compiled)
    apply_compile(compiled, torch.device("cpu"))
    tokens = torch.randint(0, VOCAB, (5 * 8 - 3,), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:32].view(4, 8), tokens[1:33].view(4, 8)
    before = counters["stats"]["unique_graphs"]
    compiled(inputs, targets)  # the training forward: grad on, training on
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > before

    scores = evaluate(compiled, tokens, seq_len=8, batch_size=2, device=torch.device("cpu"))  # batches of 2, 2, 1
    assert counters["stats"]["unique_graphs"] == graphs
    assert scores == evaluate(eager, tokens, seq_len=8, batch_size=2, device=torch.device("cpu"))
    assert scores["tokens"] == tokens.numel() and compiled.training
    compiled(inputs, targets)
    assert counters["stats"]["unique_graphs"] == graphs  # the training graphs, still valid
