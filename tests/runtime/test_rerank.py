"""`POST /v1/rerank` on a real cross-encoder: a small BERT `CrossEncoder` built here with random weights
(numbers are compared, not quality), saved by sentence-transformers as users' folders are, served by the
real engine, and checked against `CrossEncoder.predict` on the same pairs; Cohere's Python client against
the running server; validation, limits and the other routes."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cohere
import httpx
import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder

from carpool.runtime.config import ConfigError, Task
from carpool.runtime.models.loader import load_engine
from tests.runtime.conftest import Running, serve
from tests.runtime.cross_encoder import build_cross_encoder
from tests.runtime.factories import runtime_config

pytestmark = pytest.mark.slow  # servers on loopback, a real (small) model

QUERY = "how do requests share a ride"
DOCUMENTS = [
    "The runtime groups concurrent requests into batches.",
    "Paris is the capital of France.",
    "A carpool shares one car among several people going the same way, and the batcher does the same "
    "for inputs going through one model.",
    "ok",
    "Requests share a ride.",
]


@pytest.fixture(scope="module")
def sigmoid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_cross_encoder(tmp_path_factory.mktemp("sigmoid"))


@pytest.fixture(scope="module")
def reranker(sigmoid_model: Path) -> Iterator[Running]:
    config = runtime_config(
        # float32: held to CrossEncoder.predict (float32) to 1e-5; bfloat16 (auto on bf16 CPUs) is not.
        model={
            "source": str(sigmoid_model),
            "name": "ce",
            "task": "rerank",
            "max_input_tokens": 64,
            "dtype": "float32",
        },
        batching={"max_batch_size": 4, "max_batch_tokens": 256, "batch_window_ms": 0, "max_queue_size": 64},
        warmup={"batch_sizes": [1, 4], "sequence_lengths": [8, 32]},
    )
    with serve(config, load_engine) as running:
        yield running


def predicted(folder: Path, pairs: list[tuple[str, str]]) -> np.ndarray:
    return np.asarray(CrossEncoder(str(folder), device="cpu").predict(pairs), dtype=np.float32)


def scored_as_cross_encoder(answer: httpx.Response, folder: Path, query: str = QUERY) -> np.ndarray:
    """Asserts each document's `relevance_score` is `CrossEncoder.predict`'s for (query, document); returns
    those scores, by document."""
    assert answer.status_code == 200, answer.text
    scores = {r["index"]: r["relevance_score"] for r in answer.json()["results"]}
    expected = predicted(folder, [(query, d) for d in DOCUMENTS])
    np.testing.assert_allclose([scores[i] for i in range(len(DOCUMENTS))], expected, atol=1e-5)
    return expected


def test_scores_equal_sentence_transformers_cross_encoder(reranker: Running, sigmoid_model: Path) -> None:
    answer = reranker.client.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})
    expected = scored_as_cross_encoder(answer, sigmoid_model)
    assert float(expected.max() - expected.min()) > 0.05  # the random model tells the documents apart
    body = answer.json()
    results = body["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCUMENTS)))
    assert [r["index"] for r in results] == np.argsort(-expected, kind="stable").tolist()  # best first
    assert "document" not in results[0]
    assert body["model"] == "ce" and body["usage"]["total_tokens"] > len(DOCUMENTS)


def test_documents_as_objects_top_n_and_return_documents(reranker: Running, sigmoid_model: Path) -> None:
    body = {
        "query": QUERY,
        "documents": [{"text": d, "id": f"doc-{i}"} for i, d in enumerate(DOCUMENTS)],
        "top_n": 2,
        "return_documents": True,
        "model": "ce",
    }
    answer = reranker.client.post("/v1/rerank", json=body)
    assert answer.status_code == 200, answer.text
    expected = predicted(sigmoid_model, [(QUERY, d) for d in DOCUMENTS])
    best = np.argsort(-expected, kind="stable")[:2].tolist()
    results = answer.json()["results"]
    assert [r["index"] for r in results] == best
    assert [r["document"] for r in results] == [{"text": DOCUMENTS[i]} for i in best]
    wide = reranker.client.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS[:2], "top_n": 10})
    assert len(wide.json()["results"]) == 2


def test_pairs_batched_with_other_requests_get_their_own_scores(
    reranker: Running, sigmoid_model: Path
) -> None:
    """Concurrent requests share batches (padded to the longest pair of the batch): each still gets the
    scores of its own pairs, so padding and token types stay per row."""
    queries = ["ride", "what is the capital of france", QUERY, "batches"]
    with ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(
                lambda q: reranker.client.post("/v1/rerank", json={"query": q, "documents": DOCUMENTS}),
                queries,
            )
        )
    for query, answer in zip(queries, answers, strict=True):
        scored_as_cross_encoder(answer, sigmoid_model, query)


def test_cohere_python_client(reranker: Running, sigmoid_model: Path) -> None:
    """Cohere's own client (`cohere.Client`, which posts to /v1/rerank) reads carpool's answer."""
    client = cohere.Client(api_key="unused", base_url=reranker.url, timeout=60)
    response = client.rerank(model="ce", query=QUERY, documents=DOCUMENTS, top_n=3, return_documents=True)
    expected = predicted(sigmoid_model, [(QUERY, d) for d in DOCUMENTS])
    best = np.argsort(-expected, kind="stable")[:3].tolist()
    assert [r.index for r in response.results] == best
    np.testing.assert_allclose([r.relevance_score for r in response.results], expected[best], atol=1e-5)
    assert [r.document.text for r in response.results if r.document] == [DOCUMENTS[i] for i in best]
    with pytest.raises(cohere.BadRequestError) as refused:
        client.rerank(query="", documents=DOCUMENTS)
    assert "query" in str(refused.value.body)


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"documents": ["a"]}, "query", "Field required"),
        ({"query": "q", "documents": []}, "documents", "at least 1 item"),
        ({"query": "", "documents": ["a"]}, "query", "empty string"),
        ({"query": "q", "documents": ["a", ""]}, "documents[1]", "empty string"),
        ({"query": "q", "documents": ["a", 3]}, "documents[1]", "a valid string or a JSON object"),
        ({"query": "q", "documents": [{"title": "no text"}]}, "documents[0].text", "Field required"),
        ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n", "greater than or equal to 1"),
        ({"query": "q", "documents": ["a"], "rank_fields": ["x"]}, "rank_fields", "not permitted"),
    ],
)
def test_bad_bodies_get_400_naming_the_field(
    reranker: Running, body: dict[str, object], field: str, words: str
) -> None:
    answer = reranker.client.post("/v1/rerank", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert field in error["message"] and words in error["message"], error


def test_limits_other_models_and_metrics(reranker: Running) -> None:
    before = reranker.metric("carpool_requests_total", model="ce", status="400")
    long = " ".join(["ride"] * 70)  # the pair (query and document) over the 64-token limit
    answer = reranker.client.post("/v1/rerank", json={"query": "q", "documents": ["short", long]})
    assert answer.status_code == 400
    assert "documents[1] has" in answer.json()["error"]["message"]
    assert "with the query" in answer.json()["error"]["message"]
    assert reranker.metric("carpool_requests_total", model="ce", status="400") == before + 1
    many = reranker.client.post("/v1/rerank", json={"query": "q", "documents": ["x"] * 300})
    assert many.status_code == 400 and "too many inputs" in many.json()["error"]["message"]
    unknown = reranker.client.post("/v1/rerank", json={"query": "q", "documents": ["x"], "model": "other"})
    assert unknown.status_code == 404
    ok = reranker.metric("carpool_requests_total", model="ce", status="200")
    assert reranker.client.post("/v1/rerank", json={"query": "q", "documents": ["x"]}).status_code == 200
    assert reranker.metric("carpool_requests_total", model="ce", status="200") == ok + 1
    # the other routes say where to go
    embeddings = reranker.client.post("/v1/embeddings", json={"input": "x"})
    assert embeddings.status_code == 400 and "/v1/rerank" in embeddings.json()["error"]["message"]
    v2 = reranker.client.post(
        "/v2/models/ce/infer",
        json={"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["x"]}]},
    )
    assert v2.status_code == 400 and "/v1/rerank" in v2.json()["error"]
    metadata = reranker.client.get("/v2/models/ce").json()
    assert metadata["parameters"]["task"] == "rerank"
    paths = reranker.client.get("/openapi.json").json()["paths"]
    assert "/v1/rerank" in paths and "/v1/embeddings" not in paths and "/v2/models/{name}/infer" not in paths


def test_a_classify_folder_saved_as_a_cross_encoder_is_served_as_rerank_with_its_activation(
    tmp_path: Path,
) -> None:
    """`task: classify` on a sentence-transformers CrossEncoder of one label (here declaring Identity: raw
    logits) serves rerank with the declared activation; a plain one-label classifier folder (no
    CrossEncoder files) stays classify."""
    folder = build_cross_encoder(tmp_path, activation=torch.nn.Identity())
    config = runtime_config(
        model={"source": str(folder), "name": "ce", "task": "classify", "dtype": "float32"},
        warmup={"enabled": False},
    )
    with serve(config, load_engine) as running:
        answer = running.client.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})
        expected = scored_as_cross_encoder(answer, folder)
        assert float(np.abs(expected).max()) > 1.0 or float(expected.min()) < 0.0  # raw logits, not sigmoid
        assert "/v1/rerank" in running.client.get("/openapi.json").json()["paths"]
    plain = runtime_config(model={"source": str(tmp_path / "raw"), "task": "classify"})
    assert load_engine(plain).info.task is Task.CLASSIFY


def test_task_rerank_on_a_plain_classifier_folder_scores_with_a_sigmoid(tmp_path: Path) -> None:
    """A one-label classifier saved by transformers alone declares no activation: the score is the
    logit's sigmoid, sentence-transformers' default for one label."""
    build_cross_encoder(tmp_path)
    raw = tmp_path / "raw"  # the folder before sentence-transformers saved it: no CrossEncoder files
    config = runtime_config(
        model={"source": str(raw), "name": "ce", "task": "rerank", "dtype": "float32"},
        warmup={"enabled": False},
    )
    with serve(config, load_engine) as running:
        answer = running.client.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})
    scored_as_cross_encoder(answer, raw)


def test_rerank_needs_a_model_with_one_output(tmp_path: Path) -> None:
    folder = build_cross_encoder(tmp_path, labels=3)
    with pytest.raises(ConfigError, match="num_labels 1"):
        load_engine(runtime_config(model={"source": str(folder), "task": "rerank"}))


def test_the_null_engine_serves_rerank_with_the_models_tokenizer() -> None:
    """`model.engine: zeros` (for measuring the front) takes task rerank too: one zero score per pair,
    pairs tokenized and limited as the model's tokenizer does."""
    config = runtime_config(
        model={"engine": "zeros", "task": "rerank", "max_input_tokens": 16}, warmup={"enabled": False}
    )
    with serve(config, load_engine) as running:
        answer = running.client.post("/v1/rerank", json={"query": "q", "documents": ["a", "b c"]})
        assert answer.status_code == 200, answer.text
        assert [r["relevance_score"] for r in answer.json()["results"]] == [0.0, 0.0]
        long = running.client.post("/v1/rerank", json={"query": "q", "documents": ["word " * 20]})
        assert long.status_code == 400 and "documents[0] has" in long.json()["error"]["message"]
