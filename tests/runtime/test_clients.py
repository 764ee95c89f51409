"""The client libraries users already have, with their defaults, against a real server on loopback:
Triton's `tritonclient.http` (sync and asyncio; binary tensor data on by default) and the `openai` SDK.
Scripted engines keep it fast; each answer is checked against what the engine must have computed."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio
from tritonclient.utils import InferenceServerException

from tests.runtime.conftest import Running, serve, wait_for
from tests.runtime.factories import runtime_config
from tests.runtime.fakes import ScriptedEngine, ScriptedGenerator, expected_embedding, factory

pytestmark = pytest.mark.slow  # servers on loopback

TEXTS = ["hello world", "the quick brown fox", "x"]


@pytest.fixture(scope="module")
def embedder() -> Iterator[tuple[Running, ScriptedEngine]]:
    engine = ScriptedEngine()
    config = runtime_config(
        model={"name": "fake"},
        batching={"max_batch_size": 8, "max_queue_size": 4, "batch_window_ms": 0},
        warmup={"enabled": False},
    )
    with serve(config, factory(engine)) as running:
        yield running, engine


@pytest.fixture(scope="module")
def classifier() -> Iterator[Running]:
    config = runtime_config(model={"name": "fake", "task": "classify"}, warmup={"enabled": False})
    with serve(config, factory(ScriptedEngine(labels=["few", "many"]))) as running:
        yield running


@pytest.fixture(scope="module")
def generator() -> Iterator[tuple[Running, ScriptedGenerator]]:
    engine = ScriptedGenerator()
    config = runtime_config(
        model={"name": "fake", "task": "generate"},
        batching={"max_queue_size": 2},
        generation={"max_running_sequences": 1, "max_step_tokens": 64, "default_max_tokens": 5},
        warmup={"enabled": False},
    )
    with serve(config, factory(engine)) as running:
        yield running, engine


def hostport(running: Running) -> str:
    return running.url.removeprefix("http://")


def text_tensor(texts: list[str], binary: bool = True) -> triton.InferInput:
    tensor = triton.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_), binary_data=binary)
    return tensor


# -- tritonclient --------------------------------------------------------------------------------


def test_tritonclient_sync_with_its_defaults_gets_each_text_its_embedding(
    embedder: tuple[Running, ScriptedEngine],
) -> None:
    running, _ = embedder
    client = triton.InferenceServerClient(hostport(running))
    try:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("fake")
        assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
        assert client.get_model_metadata("fake")["outputs"][0]["name"] == "embedding"
        result = client.infer("fake", [text_tensor(TEXTS)])  # binary input and, by default, binary output
        embedding = result.as_numpy("embedding")
        assert embedding is not None and embedding.dtype == np.float32
        assert embedding.tolist() == [expected_embedding(t) for t in TEXTS]
        # JSON input, and the output asked for as JSON explicitly: the same numbers.
        json_result = client.infer(
            "fake",
            [text_tensor(TEXTS, binary=False)],
            outputs=[triton.InferRequestedOutput("embedding", binary_data=False)],
            request_id="r1",
        )
        assert json_result.get_response()["id"] == "r1"
        assert json_result.get_output("embedding")["data"] == np.ravel(embedding).tolist()
        with pytest.raises(InferenceServerException, match="not served here"):
            client.infer("other", [text_tensor(TEXTS)])
        with pytest.raises(InferenceServerException, match="empty string"):
            client.infer("fake", [text_tensor(["fine", ""])])
    finally:
        client.close()


def test_tritonclient_asyncio_with_its_defaults(embedder: tuple[Running, ScriptedEngine]) -> None:
    running, _ = embedder

    async def call() -> np.ndarray:
        client = triton_aio.InferenceServerClient(hostport(running))
        try:
            assert await client.is_server_ready()
            result = await client.infer("fake", [text_tensor(TEXTS)], model_version="1")
            embedding: np.ndarray = result.as_numpy("embedding")
            return embedding
        finally:
            await client.close()

    assert asyncio.run(call()).tolist() == [expected_embedding(t) for t in TEXTS]


def test_tritonclient_gets_a_classifiers_labels_as_binary_bytes(classifier: Running) -> None:
    client = triton.InferenceServerClient(hostport(classifier))
    try:
        result = client.infer("fake", [text_tensor(["a b c d e f", "z"])])
        labels = result.as_numpy("label")
        probabilities = result.as_numpy("probabilities")
    finally:
        client.close()
    assert labels is not None and probabilities is not None
    # The scripted "probabilities" are [tokens, sum of ids]: the second is the larger, "many".
    assert labels.tolist() == [b"many", b"many"]
    assert probabilities.tolist() == [expected_embedding("a b c d e f"), expected_embedding("z")]


def test_tritonclient_generates_text_over_v2(generator: tuple[Running, ScriptedGenerator]) -> None:
    running, _ = generator
    client = triton.InferenceServerClient(hostport(running))
    try:
        tensor = triton.InferInput("text_input", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([b"tell me"], dtype=np.object_))
        result = client.infer("fake", [tensor], parameters={"max_tokens": 3, "temperature": 0})
        output = result.as_numpy("text_output")
    finally:
        client.close()
    assert output is not None and output.tolist() == [b"t0 t1 t2"]


# -- openai SDK ----------------------------------------------------------------------------------


def sdk(running: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_sdk_embeddings_as_floats_and_as_base64(embedder: tuple[Running, ScriptedEngine]) -> None:
    running, _ = embedder
    client = sdk(running)
    floats = client.embeddings.create(model="fake", input=TEXTS, encoding_format="float")
    assert [d.embedding for d in floats.data] == [expected_embedding(t) for t in TEXTS]
    assert floats.usage.prompt_tokens == sum(len(t.split()) + 2 for t in TEXTS)
    raw = client.embeddings.with_raw_response.create(model="fake", input="x y", encoding_format="base64")
    data = raw.http_response.json()["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(data), "<f4").tolist() == expected_embedding("x y")
    # The SDK's default (no encoding_format) asks for base64 and decodes it itself.
    assert client.embeddings.create(model="fake", input="x y").data[0].embedding == expected_embedding("x y")


def test_openai_sdk_completions_chat_and_streaming(generator: tuple[Running, ScriptedGenerator]) -> None:
    running, _ = generator
    client = sdk(running)
    completion = client.completions.create(model="fake", prompt="say something", max_tokens=3)
    assert completion.choices[0].text == "t0 t1 t2" and completion.choices[0].finish_reason == "length"
    assert (
        completion.usage is not None and completion.usage.prompt_tokens == 2 + 2
    )  # [CLS] say something [SEP]
    default = client.completions.create(model="fake", prompt="go")
    assert default.usage is not None and default.usage.completion_tokens == 5  # default_max_tokens
    chat = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "say bye"}], max_completion_tokens=8
    )
    assert chat.choices[0].message.content == "t0 t1" and chat.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "t0 t1 t2 t3"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    streamed = client.completions.create(model="fake", prompt="a", max_tokens=2, stream=True, stop=["t1"])
    assert "".join(c.choices[0].text for c in streamed) == "t0 "


def test_openai_sdk_raises_its_own_exception_for_each_error(
    generator: tuple[Running, ScriptedGenerator],
) -> None:
    running, engine = generator
    client = sdk(running)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="other", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_model_len is 256"):
        client.completions.create(model="fake", prompt="hi", max_tokens=1000)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="fake", messages=[], max_tokens=1)
    # One sequence runs (held by the gate), two wait: the queue (2) is full, the next gets 429. The first
    # runs before the others are sent: three arriving together would fill the queue before one ran.
    engine.gate.clear()
    with ThreadPoolExecutor(3) as pool:
        try:
            held = [pool.submit(client.completions.create, model="fake", prompt="hold", max_tokens=1)]
            wait_for(lambda: running.metric("carpool_running_sequences", model="fake") == 1, what="running")
            held += [
                pool.submit(client.completions.create, model="fake", prompt="hold", max_tokens=1)
                for _ in range(2)
            ]
            wait_for(lambda: running.waiting() == 2, what="two sequences queued")
            with pytest.raises(openai.RateLimitError, match="queue full") as refused:
                client.completions.create(model="fake", prompt="one more", max_tokens=1)
            assert refused.value.response.headers["retry-after"]
        finally:
            engine.gate.set()
        assert all(f.result().choices[0].text == "t0" for f in held)
