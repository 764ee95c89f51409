"""The HTTP API over real loopback HTTP, with the scripted engine: protocols, errors, batching mechanics."""

from __future__ import annotations

import base64
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import httpx
import pytest

from carpool.runtime.config import RuntimeConfig
from carpool.runtime.metrics import STARTUP_PHASES
from carpool.runtime.wire import EngineState
from tests.runtime.conftest import Running, serve, wait_for
from tests.runtime.fakes import ScriptedEngine, expected_embedding, factory

LOAD_HELD_S = 0.2
"""How long the start-up test holds the model's load."""


def post_embeddings(running: Running, payload: Any, **headers: str) -> httpx.Response:
    return running.client.post("/v1/embeddings", json=payload, headers=headers)


def in_background(pool: ThreadPoolExecutor, call: Callable[[], httpx.Response]) -> Future[httpx.Response]:
    return pool.submit(call)


# -- protocols -------------------------------------------------------------------------------------


def test_openai_embeddings_for_a_string_and_a_list(fake_server: Running) -> None:
    one = post_embeddings(fake_server, {"input": "hello world", "model": "fake"})
    assert one.status_code == 200
    body = one.json()
    assert body["object"] == "list" and body["model"] == "fake"
    assert body["data"] == [
        {"object": "embedding", "index": 0, "embedding": expected_embedding("hello world")}
    ]
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    texts = ["a", "b c", "d e f"]
    many = post_embeddings(fake_server, {"input": texts}).json()
    assert [d["embedding"] for d in many["data"]] == [expected_embedding(t) for t in texts]
    assert [d["index"] for d in many["data"]] == [0, 1, 2]


def test_forward_passes_run_on_the_thread_that_warmed_the_model_up(
    fake_engine: ScriptedEngine, fake_server: Running
) -> None:
    # torch's CPU thread pools are per calling thread: forward passes from a second thread left a
    # third of two cores idle (bench/RESULTS.md), so the engine runs every batch where warm-up ran.
    with httpx.Client(base_url=fake_server.url) as client:
        for text in ("one", "two words", "and three words"):
            assert client.post("/v1/embeddings", json={"input": text}).status_code == 200
    assert len(fake_engine.served_batches()) >= 1
    assert len(set(fake_engine.threads)) == 1, "warm-up and serving ran forward passes on different threads"


def test_base64_encoding_carries_little_endian_float32(fake_server: Running) -> None:
    body = post_embeddings(fake_server, {"input": "x y", "encoding_format": "base64"}).json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert list(struct.unpack("<2f", raw)) == expected_embedding("x y")


def test_models_list_and_v2_metadata(fake_server: Running) -> None:
    listed = fake_server.client.get("/v1/models").json()["data"][0]
    assert listed["id"] == "fake"
    # what the engine serves the model as (model.dtype auto resolves per machine; say which)
    assert (listed["dtype"], listed["quantization"], listed["task"]) == ("float32", "none", "embed")
    meta = fake_server.client.get("/v2/models/fake").json()
    assert (meta["parameters"]["dtype"], meta["parameters"]["quantization"]) == ("float32", "none")
    assert listed["engine"] == meta["parameters"]["engine"] == "carpool"  # which engine serves it
    assert meta["name"] == "fake" and meta["outputs"][0] == {
        "name": "embedding",
        "datatype": "FP32",
        "shape": [-1, 2],
    }
    assert fake_server.client.get("/v2/models/fake/ready").status_code == 200
    assert fake_server.client.get("/v2/models/other/ready").status_code == 404
    assert fake_server.client.get("/v2").json()["name"] == "carpool"


def test_v2_infer_returns_a_row_per_text(fake_server: Running) -> None:
    payload = {
        "id": "r1",
        "inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["a b", "c"]}],
    }
    response = fake_server.client.post("/v2/models/fake/infer", json=payload)
    assert response.status_code == 200
    body = response.json()
    assert body["id"] == "r1" and body["model_name"] == "fake"
    (output,) = body["outputs"]
    assert output["shape"] == [2, 2] and output["datatype"] == "FP32"
    assert output["data"] == expected_embedding("a b") + expected_embedding("c")


def test_health_and_metrics_paths(fake_server: Running) -> None:
    assert fake_server.client.get("/v2/health/live").status_code == 200
    assert fake_server.client.get("/v2/health/ready").json() == {"ready": True, "state": "ready", "front": 0}
    assert fake_server.client.get("/v2/health/live").json() == {"live": True, "front": 0}
    assert fake_server.metric("carpool_ready", model="fake") == 1.0
    assert fake_server.metric("carpool_warmup_batches_total", model="fake") == 2.0


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "status", "says"),
    [
        ({"input": 3}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": ["ok", ""]}, 400, "input[1] is an empty string"),
        ({"input": [1, 2, 3]}, 400, "valid string"),
        ({"inputs": "typo"}, 400, "inputs: Extra inputs are not permitted"),
        ({"input": "x", "model": "gpt-9"}, 404, "'gpt-9' is not served here"),
        ({"input": " ".join(["w"] * 80)}, 400, "has 82 tokens; this model accepts at most 64"),
        ({"input": ["w"] * 17}, 400, "too many inputs: 17 in one request, the limit is 16"),
        ({"input": "x", "dimensions": 3}, 400, "dimensions 3"),
    ],
)
def test_bad_openai_input_gets_a_json_error_that_says_what_is_wrong(
    fake_server: Running, payload: Any, status: int, says: str
) -> None:
    response = post_embeddings(fake_server, payload)
    assert response.status_code == status
    assert says in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("tensor", "says"),
    [
        ({"name": "text", "shape": [1], "datatype": "FP32", "data": [1.0]}, "datatype FP32"),
        ({"name": "text", "shape": [3], "datatype": "BYTES", "data": ["a"]}, "shape [3] but 1 elements"),
        ({"name": "text", "shape": [1], "datatype": "BYTES", "data": [7]}, "element 0 is int"),
    ],
)
def test_bad_v2_input_gets_a_json_error(fake_server: Running, tensor: dict[str, Any], says: str) -> None:
    response = fake_server.client.post("/v2/models/fake/infer", json={"inputs": [tensor]})
    assert response.status_code == 400
    assert says in response.json()["error"]


def test_malformed_json_and_oversized_bodies_are_refused(fake_server: Running) -> None:
    broken = fake_server.client.post(
        "/v1/embeddings", content=b'{"input": "x"', headers={"content-type": "application/json"}
    )
    assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]
    huge = fake_server.client.post("/v1/embeddings", content=b"x" * (5 * 1024 * 1024))
    assert huge.status_code == 413 and "max_body_bytes" in huge.json()["error"]["message"]
    assert fake_server.metric("carpool_requests_total", model="fake", status="400") == 1.0


def test_bad_priority_and_timeout_headers(fake_server: Running) -> None:
    assert post_embeddings(fake_server, {"input": "x"}, **{"x-carpool-priority": "high"}).status_code == 400
    assert post_embeddings(fake_server, {"input": "x"}, **{"x-carpool-priority": "7"}).status_code == 400
    assert post_embeddings(fake_server, {"input": "x"}, **{"x-carpool-timeout": "-1"}).status_code == 400


# -- batching mechanics ----------------------------------------------------------------------------


def hold_executor(
    engine: ScriptedEngine, running: Running, pool: ThreadPoolExecutor
) -> Future[httpx.Response]:
    """Start one request and keep its batch inside forward until `engine.gate` is set."""
    engine.entered = threading.Semaphore(0)  # forget warm-up's passes
    engine.gate.clear()
    first = in_background(pool, lambda: post_embeddings(running, {"input": "first"}))
    assert engine.entered.acquire(timeout=10)
    return first


def test_requests_arriving_during_a_batch_share_the_next_one(
    fake_server: Running, fake_engine: ScriptedEngine
) -> None:
    with ThreadPoolExecutor(8) as pool:
        first = hold_executor(fake_engine, fake_server, pool)
        texts = [f"text number {k}" for k in range(6)]
        futures = [in_background(pool, partial(post_embeddings, fake_server, {"input": t})) for t in texts]
        wait_for(lambda: fake_server.waiting() == 6, what="6 queued")
        fake_engine.gate.set()
        assert first.result().status_code == 200
        for text, future in zip(texts, futures, strict=True):
            assert future.result().json()["data"][0]["embedding"] == expected_embedding(text)
    sizes = [len(b) for b in fake_engine.served_batches()]
    assert sizes == [1, 6]


def test_full_queue_answers_429_with_retry_after(
    fake_engine: ScriptedEngine, fake_config: RuntimeConfig
) -> None:
    fake_config.batching.max_items_per_request = 4
    fake_config.batching.max_queue_size = 4
    with serve(fake_config, factory(fake_engine)) as running, ThreadPoolExecutor(8) as pool:
        first = hold_executor(fake_engine, running, pool)
        queued = in_background(pool, lambda: post_embeddings(running, {"input": ["a", "b", "c"]}))
        wait_for(lambda: running.waiting() == 3, what="3 queued")
        refused = post_embeddings(running, {"input": ["d", "e"]})
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert "queue full" in refused.json()["error"]["message"]
        fake_engine.gate.set()
        assert first.result().status_code == 200 and queued.result().status_code == 200
        assert running.metric("carpool_requests_total", model="fake", status="429") == 1.0


def test_a_failing_batch_fails_only_its_requests(fake_server: Running, fake_engine: ScriptedEngine) -> None:
    failed = post_embeddings(fake_server, {"input": ["fine", "boom"]})
    assert failed.status_code == 500
    assert "the model exploded on purpose" in failed.json()["error"]["message"]
    assert post_embeddings(fake_server, {"input": "still serving"}).status_code == 200


def test_out_of_memory_batches_are_split_and_every_request_answered(fake_config: RuntimeConfig) -> None:
    engine = ScriptedEngine(oom_above=2)
    fake_config.warmup.enabled = False
    with serve(fake_config, factory(engine)) as running, ThreadPoolExecutor(8) as pool:
        first = hold_executor(engine, running, pool)
        texts = [f"t {k}" for k in range(5)]
        futures = [in_background(pool, partial(post_embeddings, running, {"input": t})) for t in texts]
        wait_for(lambda: running.waiting() == 5, what="5 queued")
        engine.gate.set()
        assert first.result().status_code == 200
        for text, future in zip(texts, futures, strict=True):
            assert future.result().json()["data"][0]["embedding"] == expected_embedding(text)
        # The 5 queued inputs were tried together, ran out of memory, and were split until each part
        # fitted: every input then ran exactly once, in batches the device could hold.
        tried = [len(batch) for batch in engine.attempts[1:]]  # after the held first request
        served = [ids for batch in engine.served_batches() for ids in batch]
        assert tried == [5, 2, 3, 1, 2]  # halves: 5 -> 2 + 3, 3 -> 1 + 2
        assert sorted(served) == sorted(engine.tokenize(["first", *texts]))
        assert running.metric("carpool_oom_splits_total", model="fake") == 2


def test_a_request_past_its_deadline_gets_504_and_never_runs(
    fake_server: Running, fake_engine: ScriptedEngine
) -> None:
    with ThreadPoolExecutor(4) as pool:
        first = hold_executor(fake_engine, fake_server, pool)
        late = post_embeddings(fake_server, {"input": "too late"}, **{"x-carpool-timeout": "0.2"})
        assert late.status_code == 504
        fake_engine.gate.set()
        assert first.result().status_code == 200
    assert all(
        ids != fake_engine.tokenize(["too late"])[0] for b in fake_engine.served_batches() for ids in b
    )


def test_higher_priority_requests_run_first(fake_engine: ScriptedEngine, fake_config: RuntimeConfig) -> None:
    fake_config.batching.max_batch_size = 1
    fake_config.warmup.enabled = False
    with serve(fake_config, factory(fake_engine)) as running, ThreadPoolExecutor(4) as pool:
        first = hold_executor(fake_engine, running, pool)
        low = in_background(
            pool, lambda: post_embeddings(running, {"input": "low"}, **{"x-carpool-priority": "0"})
        )
        wait_for(lambda: running.waiting() == 1, what="low queued")
        high = in_background(
            pool, lambda: post_embeddings(running, {"input": "high"}, **{"x-carpool-priority": "2"})
        )
        wait_for(lambda: running.waiting() == 2, what="high queued")
        fake_engine.gate.set()
        assert first.result().status_code == low.result().status_code == high.result().status_code == 200
    order = [b[0] for b in fake_engine.served_batches()]
    assert order[1:] == fake_engine.tokenize(["high", "low"])


def test_a_disconnected_client_is_dropped_before_its_input_runs(
    fake_server: Running, fake_engine: ScriptedEngine
) -> None:
    with ThreadPoolExecutor(4) as pool:
        first = hold_executor(fake_engine, fake_server, pool)
        host, port = fake_server.url.removeprefix("http://").split(":")
        body = b'{"input": "gone away"}'
        with socket.create_connection((host, int(port))) as raw:
            raw.sendall(
                b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            wait_for(lambda: fake_server.waiting() == 1, what="queued")
        # The socket is closed: the server notices and withdraws the input.
        wait_for(lambda: fake_server.waiting() == 0, what="withdrawn")
        fake_engine.gate.set()
        assert first.result().status_code == 200
    assert fake_server.metric("carpool_requests_total", model="fake", status="499") == 1.0
    gone = fake_engine.tokenize(["gone away"])[0]
    assert all(ids != gone for b in fake_engine.served_batches() for ids in b)


# -- lifecycle -------------------------------------------------------------------------------------


def test_live_at_once_ready_only_after_warm_up(fake_config: RuntimeConfig) -> None:
    engine = ScriptedEngine()
    loading = threading.Event()

    def slow_factory(config: RuntimeConfig) -> ScriptedEngine:
        loading.wait(timeout=30)
        return engine

    with serve(fake_config, slow_factory, wait_ready=False) as running:
        assert running.client.get("/v2/health/live").status_code == 200
        not_ready = running.client.get("/v2/health/ready")
        assert not_ready.status_code == 503 and not_ready.json()["state"] == "loading"
        refused = post_embeddings(running, {"input": "early"})
        assert refused.status_code == 503 and "retry-after" in refused.headers
        time.sleep(LOAD_HELD_S)  # the load phase lasts at least this long: the factory is waiting
        loading.set()
        wait_for(lambda: running.client.get("/v2/health/ready").status_code == 200, what="ready")
        # Each phase of the start observed once; the load held by the factory counted as load.
        for phase in STARTUP_PHASES:
            assert running.metric("carpool_startup_duration_seconds_count", model="fake", phase=phase) == 1
        assert (
            running.metric("carpool_startup_duration_seconds_sum", model="fake", phase="load") >= LOAD_HELD_S
        )
        assert running.metric("carpool_startup_duration_seconds_sum", model="fake", phase="warmup") > 0
        # Before ready: the two warm-up shapes (1 x 4, 8 x 4), then five timed passes that measure the
        # padding slack (no slack configured).
        assert [len(b) for b in engine.batches] == [1, 8, 1, 8, 1, 8, 1]
        assert running.metric("carpool_warmup_batches_total", model="fake") == 2
        assert running.metric("carpool_warmup_seconds", model="fake") > 0


def test_a_model_that_fails_to_load_is_reported_not_ready(fake_config: RuntimeConfig) -> None:
    def broken(config: RuntimeConfig) -> ScriptedEngine:
        raise ValueError("no such model folder")

    with serve(fake_config, broken, wait_ready=False) as running:
        wait_for(lambda: running.service.state is EngineState.FAILED, what="start-up failed")
        ready = running.client.get("/v2/health/ready")
        assert ready.status_code == 503 and "no such model folder" in ready.json()["error"]
        # The engine is not running: liveness fails too, so the pod restarts.
        live = running.client.get("/v2/health/live")
        assert live.status_code == 503 and "no such model folder" in live.json()["error"]


def test_responses_close_the_connection_once_draining(fake_server: Running) -> None:
    # While serving, connections stay open for the next request; once draining, every response says
    # `Connection: close`, so no client reuses a connection that the exiting server would drop unanswered.
    served = fake_server.client.post("/v1/embeddings", json={"input": "a"})
    assert served.status_code == 200 and served.headers.get("connection") != "close"
    fake_server.service.draining = True
    refused = fake_server.client.post("/v1/embeddings", json={"input": "b"})
    assert refused.status_code == 503 and refused.headers["connection"] == "close"
    assert fake_server.client.get("/v2/health/live").headers["connection"] == "close"


def test_metrics_count_what_happened(fake_config: RuntimeConfig) -> None:
    """Each metric moves by what the traffic did (not merely exists): in-flight requests while held,
    requests by status, one queue wait per input, batch sizes summing to the inputs run."""
    engine = ScriptedEngine()
    fake_config.warmup.enabled = False
    with serve(fake_config, factory(engine)) as running, ThreadPoolExecutor(4) as pool:

        def value(name: str, **labels: str) -> float:
            return running.metric(name, model="fake", **labels)

        first = hold_executor(engine, running, pool)
        others = [
            in_background(pool, partial(post_embeddings, running, {"input": ["a", "b c"]})) for _ in range(2)
        ]
        wait_for(lambda: running.waiting() == 4, what="4 inputs queued")
        assert value("carpool_inflight_requests") == 3
        assert value("carpool_queue_depth") == 4
        assert post_embeddings(running, {"input": ""}).status_code == 400
        engine.gate.set()
        assert [f.result().status_code for f in (first, *others)] == [200, 200, 200]
        wait_for(lambda: value("carpool_inflight_requests") == 0, what="nothing in flight")
        assert value("carpool_queue_depth") == 0
        assert value("carpool_requests_total", status="200") == 3
        assert value("carpool_requests_total", status="400") == 1
        assert value("carpool_request_duration_seconds_count") == 3
        assert value("carpool_queue_wait_seconds_count") == 5  # one per input
        assert value("carpool_batch_size_sum") == 5 and value("carpool_batch_size_count") == 2
        assert value("carpool_batch_duration_seconds_count") == 2
