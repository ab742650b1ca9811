"""A tiny DistilBERT classifier with two integer inputs (``input_ids``, ``attention_mask``), exported with
``torch.onnx.export(dynamo=True)``: the text model every command that runs a file must take."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

VOCAB, SEQ, BATCH = 100, 8, 2


class DistilBertClassifier(nn.Module):
    """``DistilBertForSequenceClassification`` (2 layers, width 32, random weights) returning its logits."""

    def __init__(self):
        super().__init__()
        from transformers import DistilBertConfig, DistilBertForSequenceClassification

        torch.manual_seed(0)
        config = DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                  max_position_embeddings=16, num_labels=3)
        self.model = DistilBertForSequenceClassification(config)

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def token_data(n: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` samples keyed by input name: int32 ids (cast to the file's int64 by the loader), masks whose
    last tokens are padding."""
    rng = np.random.default_rng(seed)
    mask = np.ones((n, SEQ), np.int64)
    mask[:, SEQ - 2:] = rng.integers(0, 2, (n, 2))
    return {"input_ids": rng.integers(0, VOCAB, (n, SEQ)).astype(np.int32), "attention_mask": mask}


def export_distilbert(folder: Path) -> tuple[DistilBertClassifier, Path]:
    """The model in eval mode and its float ONNX file (one file, batch ``BATCH`` x ``SEQ`` tokens)."""
    model = DistilBertClassifier().eval()
    path = Path(folder) / "distilbert.onnx"
    example = (torch.randint(0, VOCAB, (BATCH, SEQ)), torch.ones(BATCH, SEQ, dtype=torch.int64))
    torch.onnx.export(model, example, str(path), dynamo=True, input_names=["input_ids", "attention_mask"],
                      external_data=False, verbose=False)
    return model, path
