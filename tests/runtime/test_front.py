"""The lean front: the null engine over real HTTP, the msgspec body validation and its messages, the
413 for a chunked body over the limit, the OpenAPI document of the embeddings request, and the FastAPI
route that serves the same request when the app runs without its front door."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import jsonschema  # type: ignore[import-untyped]
import pytest

from carpool.runtime.api.bodies import BodyDecoder, InvalidBody, describe
from carpool.runtime.api.frontend import INLINE_CHARACTERS
from carpool.runtime.api.limits import linger
from carpool.runtime.api.openai import EmbeddingRequest
from carpool.runtime.config import ConfigError, RuntimeConfig, Task
from carpool.runtime.models import null as null_module
from carpool.runtime.models.loader import load_engine
from carpool.runtime.models.null import NullEngine
from carpool.runtime.sources import resolve_source
from tests.runtime.conftest import Running, serve
from tests.runtime.factories import runtime_config
from tests.runtime.fakes import ScriptedEngine, factory

# -- the null engine -------------------------------------------------------------------------------


@pytest.fixture
def null_config() -> RuntimeConfig:
    return runtime_config(
        model={"engine": "zeros", "name": "null"},
        batching={"max_batch_size": 8, "max_queue_size": 16, "batch_window_ms": 0},
        warmup={"batch_sizes": [1, 8], "sequence_lengths": [8]},
    )


@pytest.fixture
def null_server(null_config: RuntimeConfig) -> Iterator[Running]:
    with serve(null_config, load_engine) as running:
        yield running


def test_the_null_engine_answers_zeros_of_the_models_width_with_its_token_counts(
    null_server: Running,
) -> None:
    response = null_server.client.post(
        "/v1/embeddings", json={"input": ["hello world", "a longer text here"]}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert [len(d["embedding"]) for d in body["data"]] == [384, 384]  # MiniLM's hidden size
    assert all(value == 0.0 for d in body["data"] for value in d["embedding"])
    # Tokenized by MiniLM's own tokenizer: [CLS] hello world [SEP] and [CLS] a longer text here [SEP].
    assert body["usage"] == {"prompt_tokens": 4 + 6, "total_tokens": 10}
    v2 = null_server.client.post(
        "/v2/models/null/infer",
        json={"inputs": [{"name": "text", "shape": [3], "datatype": "BYTES", "data": ["a", "b", "c"]}]},
    )
    assert v2.status_code == 200, v2.text
    (output,) = v2.json()["outputs"]
    assert output["shape"] == [3, 384] and set(output["data"]) == {0.0}
    # Limits are the model's: MiniLM's sentence-transformers config accepts 256 tokens.
    long = null_server.client.post("/v1/embeddings", json={"input": "word " * 300})
    assert long.status_code == 400 and "this model accepts at most 256" in long.json()["error"]["message"]


def test_the_null_engine_tokenizes_as_the_transformers_tokenizer(null_config: RuntimeConfig) -> None:
    from transformers import AutoTokenizer

    engine = NullEngine(null_config.model, "null")
    reference = AutoTokenizer.from_pretrained(resolve_source(null_config.model.source).location)
    texts = ["Hello, World!", "unbelievably tokenized café", "x " * 600, "ok"]
    expected = reference(texts, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
    assert engine.tokenize(texts) == expected
    assert engine.tokenize(texts[:1]) == expected[:1]
    assert len(engine.dummy_input(8)) == 8 and engine.forward([[1, 2], [3]])[1].shape == (384,)


def test_the_null_engine_serves_classification_shapes_and_refuses_generation(
    null_config: RuntimeConfig,
) -> None:
    classify = null_config.model.model_copy(update={"task": Task.CLASSIFY})
    engine = NullEngine(classify, "null")
    assert engine.info.labels == ["LABEL_0", "LABEL_1"] and engine.forward([[1]])[0].shape == (2,)
    with pytest.raises(ConfigError, match=r"task generate needs model\.engine carpool, vllm or auto"):
        NullEngine(null_config.model.model_copy(update={"task": Task.GENERATE}), "null")


def test_the_null_engine_stands_in_for_a_device_of_the_cost_its_environment_names(
    null_config: RuntimeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`NULL_ENGINE_COST="FIXED,PER_TOKEN"`: each batch sleeps its cost (the autoscaling bench's device);
    without it a batch costs nothing; a malformed value is refused naming the variable."""
    slept: list[float] = []
    monkeypatch.setattr(null_module, "time", SimpleNamespace(sleep=slept.append))
    NullEngine(null_config.model, "null").forward([[1, 2], [3]])
    monkeypatch.setenv("NULL_ENGINE_COST", "0.05,0.001")
    NullEngine(null_config.model, "null").forward([[1, 2], [3]])
    assert slept == [pytest.approx(0.05 + 0.001 * 3)]
    monkeypatch.setenv("NULL_ENGINE_COST", "fast")
    with pytest.raises(ConfigError, match="NULL_ENGINE_COST='fast': expected two numbers"):
        NullEngine(null_config.model, "null")


def test_loading_the_null_engine_never_imports_torch(null_config: RuntimeConfig, tmp_path: Path) -> None:
    import subprocess

    code = (
        "import sys\n"
        "from carpool.runtime.config import load_config\n"
        "from carpool.runtime.models.loader import load_engine\n"
        "from carpool.runtime.api.app import create_app\n"
        "from carpool.runtime.api.client import EngineClient\n"
        "from carpool.runtime.api.frontend import Frontend\n"
        "from carpool.runtime.wire import Addresses\n"
        "config = load_config(model={'engine': 'zeros'})\n"
        "client = EngineClient(Addresses.in_folder(sys.argv[1], 1), 0)\n"
        "create_app(Frontend(config, client)); load_engine(config).text_spec()\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]"


def test_short_inputs_are_tokenized_inline_and_long_ones_in_the_tokenizer_thread(
    fake_config: RuntimeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = ScriptedEngine(max_input_tokens=INLINE_CHARACTERS)
    batching = fake_config.batching.model_copy(update={"max_batch_tokens": INLINE_CHARACTERS})
    with serve(fake_config.model_copy(update={"batching": batching}), factory(engine)) as running:
        codec = running.service._codec()
        threads: list[str] = []
        encode_batch = codec.encode_batch

        def recording(texts: Sequence[str]) -> list[list[int]]:
            threads.append(threading.current_thread().name)
            return encode_batch(texts)

        monkeypatch.setattr(codec, "encode_batch", recording)
        # A short input on the event loop (the server's thread): no hop to the tokenizer thread and back.
        assert post(running, {"input": "short"}).status_code == 200
        # One longer than the inline limit in the tokenizer thread, so the loop keeps serving meanwhile.
        long = post(running, {"input": "w " * (INLINE_CHARACTERS // 2 + 1)})
        assert long.status_code == 200, long.text
        assert long.json()["usage"]["prompt_tokens"] == INLINE_CHARACTERS // 2 + 3
    assert not threads[0].startswith("carpool-tokenize") and threads[1].startswith("carpool-tokenize")


# -- request bodies --------------------------------------------------------------------------------


def post(running: Running, payload: Any) -> httpx.Response:
    return running.client.post("/v1/embeddings", json=payload)


@pytest.mark.parametrize(
    ("payload", "message", "param"),
    [
        ({}, "input: Field required", "input"),
        ({"model": "fake"}, "input: Field required", "input"),
        ({"input": ["ok", 5]}, "input[1]: Input should be a valid string, got int", "input[1]"),
        ({"input": 3}, "input: Input should be a valid string or an array, got int", "input"),
        ({"input": ""}, "input is an empty string", "input"),
        ({"input": ["ok", "fine", ""]}, "input[2] is an empty string", "input[2]"),
        ({"input": []}, "input: should have at least 1 item", "input"),
        ({"input": "x", "dimension": 2}, "dimension: Extra inputs are not permitted", "dimension"),
        (
            {"input": "x", "dimensions": 0},
            "dimensions: Input should be greater than or equal to 1",
            "dimensions",
        ),
        (
            {"input": "x", "dimensions": "2"},
            "dimensions: Input should be a valid integer or null, got str",
            "dimensions",
        ),
        (
            {"input": "x", "encoding_format": "hex"},
            "encoding_format: Input should be one of 'base64', 'float', got 'hex'",
            "encoding_format",
        ),
        (["x"], "body: Input should be a JSON object, got array", "body"),
    ],
)
def test_invalid_bodies_get_400_naming_the_field(
    fake_server: Running, payload: Any, message: str, param: str
) -> None:
    response = post(fake_server, payload)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] == message
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"] == 400


def test_too_many_inputs_and_unparseable_bodies(fake_server: Running) -> None:
    many = post(fake_server, {"input": ["w"] * 17})
    assert many.status_code == 400
    assert many.json()["error"]["message"] == "too many inputs: 17 in one request, the limit is 16"
    for raw, says in [
        (b"", "the request body is empty"),
        (b'{"input": "x"', "not valid JSON"),
        (b'{"input": "x"} and more', "not valid JSON"),
        (b'{"input": "\xff"}', "not valid UTF-8"),
    ]:
        response = fake_server.client.post("/v1/embeddings", content=raw)
        assert response.status_code == 400, raw
        assert says in response.json()["error"]["message"], raw
    assert fake_server.metric("carpool_requests_total", model="fake", status="400") == 5.0


def test_describe_turns_msgspec_errors_into_field_messages() -> None:
    assert describe("Expected `str`, got `int` - at `$.input[0]`") == (
        "input[0]: Input should be a valid string, got int",
        "input[0]",
    )
    assert describe("Object contains unknown field `b` - at `$.a`") == (
        "a.b: Extra inputs are not permitted",
        "a.b",
    )
    assert describe("Expected `array` of length <= 3 - at `$.x`") == ("x: should have at most 3 items", "x")
    assert describe("Expected `int` < 10 - at `$.n`") == ("n: Input should be less than 10", "n")
    with pytest.raises(InvalidBody) as raised:
        BodyDecoder(EmbeddingRequest).decode(b'{"input": "x", "encoding_format": 3}')
    assert raised.value.param == "encoding_format"


# -- body limit ------------------------------------------------------------------------------------


def chunks(total: int, size: int = 64 * 1024) -> Iterator[bytes]:
    sent = 0
    while sent < total:
        yield b"x" * min(size, total - sent)
        sent += size


def _raw_post(url: str, head: bytes, body: bytes) -> bytes:
    """Send a request in one go, as a client that does not wait for an early answer does, and read the
    whole answer (a reset connection raises). The client keeps its side open, as HTTP clients do (one that
    half-closes is taken by uvicorn for one that left, and its answer is dropped)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_sent_whole_still_gets_its_413(fake_server: Running, chunked: bool) -> None:
    # Closing a connection whose body was left unread resets it, and the reset destroys the 413 before
    # the client reads it: the server reads the rest of the body before it answers and closes.
    limit = fake_server.service.config.server.max_body_bytes
    size = limit + 2 * 1024 * 1024
    if chunked:
        head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        piece = b"x" * 65536
        body = (f"{len(piece):x}\r\n".encode() + piece + b"\r\n") * (size // len(piece)) + b"0\r\n\r\n"
    else:
        head = f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n".encode()
        body = b"x" * size
    for _ in range(3):
        answer = _raw_post(fake_server.url, head, body)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b"server.max_body_bytes" in answer


def test_a_refused_body_is_read_to_its_end_from_a_slow_client_and_a_stalled_one_is_let_go() -> None:
    """The lingering read before a 413 (`api.limits.linger`) follows a client that keeps sending, however
    long the body takes within the overall bound, and gives up on one that stops sending."""

    async def run() -> tuple[int, float]:
        chunks = 40
        sent = 0

        async def slow() -> dict[str, Any]:
            nonlocal sent
            await asyncio.sleep(0.02)
            sent += 1
            return {"type": "http.request", "body": b"x" * 1024, "more_body": sent < chunks}

        await asyncio.wait_for(linger(slow, seconds=60, idle_seconds=1.0), 30)
        read = sent

        async def stalled() -> dict[str, Any]:
            await asyncio.Event().wait()  # never a byte more
            raise AssertionError("unreachable")

        started = time.monotonic()
        await asyncio.wait_for(linger(stalled, seconds=60, idle_seconds=0.1), 30)
        return read, time.monotonic() - started

    read, stalled_for = asyncio.run(run())
    assert read == 40  # the whole body, about 0.8 s of it, though no single wait may exceed 1 s
    assert stalled_for < 30  # let go after the idle bound, not after the 60 s bound (nor never)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v2/models/fake/infer", "/v1/completions"])
def test_a_chunked_body_over_the_limit_gets_413_with_a_json_body(fake_server: Running, path: str) -> None:
    limit = fake_server.service.config.server.max_body_bytes
    with httpx.Client(base_url=fake_server.url, timeout=60) as client:  # a connection of its own
        response = client.post(path, content=chunks(limit + 1), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.headers["connection"] == "close"
    body = response.json()
    message = body["error"] if path.startswith("/v2") else body["error"]["message"]
    assert f"larger than the limit of {limit} bytes (server.max_body_bytes)" in message
    # Counted once, as what the client got.
    assert fake_server.metric("carpool_requests_total", model="fake", status="413") == 1.0
    assert (
        sum(fake_server.metric("carpool_requests_total", model="fake", status=s) for s in ("400", "499")) == 0
    )
    # A chunked body within the limit is read and answered as usual, and the server still serves.
    small = fake_server.client.post("/v1/embeddings", content=iter([b'{"input": ', b'"a b"}']))
    assert small.status_code == 200 and small.json()["usage"]["prompt_tokens"] == 4


# -- the OpenAPI document --------------------------------------------------------------------------


SAMPLES: list[Any] = [
    {"input": "x"},
    {"input": ["a", "b"], "model": "fake", "encoding_format": "base64", "user": "u"},
    {"input": "x", "model": None, "dimensions": None},
    {"input": ""},
    {"input": []},
    {"input": ["a", 1]},
    {"input": "x", "extra": 1},
    {"input": "x", "encoding_format": "hex"},
    {"input": "x", "dimensions": 0},
    {"model": "fake"},
    ["x"],
]


def test_openapi_documents_the_embeddings_body_as_validation_enforces_it(fake_server: Running) -> None:
    document = fake_server.client.get("/openapi.json").json()
    operation = document["paths"]["/v1/embeddings"]["post"]
    body_schema = operation["requestBody"]["content"]["application/json"]["schema"]
    if "$ref" in body_schema:  # a named component (api.openapi), so the server's limits can reach it
        body_schema = document["components"]["schemas"][body_schema["$ref"].rsplit("/", 1)[1]]
    assert operation["requestBody"]["required"] is True
    assert body_schema["required"] == ["input"] and body_schema["additionalProperties"] is False
    assert set(body_schema["properties"]) == {"input", "model", "encoding_format", "dimensions", "user"}
    for sample in SAMPLES:
        documented = jsonschema.Draft202012Validator(body_schema).is_valid(sample)
        status = post(fake_server, sample).status_code
        assert documented == (status == 200), (sample, status)


# -- the FastAPI route, where the app runs without its front door -----------------------------------


@pytest.fixture
def bare_app_server(fake_config: RuntimeConfig) -> Iterator[str]:
    with serve(fake_config, factory(ScriptedEngine()), bare=True) as running:
        yield running.url


def test_the_fastapi_route_answers_as_the_front_door_does(bare_app_server: str, fake_server: Running) -> None:
    with httpx.Client(base_url=bare_app_server, timeout=60) as client:
        for payload in (
            {"input": ["a b", "c"]},
            {"input": ["ok", 5]},
            {"inputs": "x"},
            {"input": "x", "model": "no"},
        ):
            alone = client.post("/v1/embeddings", json=payload)
            door = post(fake_server, payload)
            assert (alone.status_code, alone.json()) == (door.status_code, door.json()), payload
