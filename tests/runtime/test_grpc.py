"""KServe v2 over gRPC against a real front on loopback (the app's `grpc.aio` server, the engine core over
the wire, scripted engines): Triton's `tritonclient.grpc`, sync and asyncio, with its defaults (tensors in
`raw_input_contents`, read back from `raw_output_contents`), and gRPC's own stubs for what tritonclient
does not send (`contents`, metadata, deadlines). Each answer is checked against the HTTP route's for the
same request, and each error against the status code the protocol promises."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from bench.server import free_port
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from tritonclient.utils import InferenceServerException

from carpool.runtime.api.client import EngineClient
from carpool.runtime.api.frontend import Frontend
from carpool.runtime.api.grpc import grpc_predict_v2_pb2 as pb
from carpool.runtime.api.grpc import grpc_predict_v2_pb2_grpc as pb_grpc
from carpool.runtime.api.grpc.server import GrpcFront
from carpool.runtime.config import RuntimeConfig
from carpool.runtime.wire import Addresses
from tests.runtime.conftest import Running, serve, wait_for
from tests.runtime.factories import runtime_config
from tests.runtime.fakes import ScriptedEngine, ScriptedGenerator, expected_embedding, factory

pytestmark = pytest.mark.slow  # servers on loopback

TEXTS = ["hello world", "the quick brown fox", "x"]


def grpc_config(**sections: dict[str, Any]) -> RuntimeConfig:
    server = {"grpc_port": free_port(), **sections.pop("server", {})}
    sections.setdefault("model", {"name": "fake"})
    sections.setdefault("warmup", {"enabled": False})
    return runtime_config(server=server, **sections)


@pytest.fixture(scope="module")
def embedder() -> Iterator[tuple[Running, ScriptedEngine]]:
    engine = ScriptedEngine()
    config = grpc_config(batching={"max_batch_size": 8, "max_queue_size": 4, "batch_window_ms": 0})
    with serve(config, factory(engine)) as running:
        yield running, engine


def text_input(texts: list[str], name: str = "text") -> triton.InferInput:
    tensor = triton.InferInput(name, [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    return tensor


def http_v2_embedding(running: Running, texts: list[str]) -> list[list[float]]:
    body = {"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}]}
    output = running.client.post("/v2/models/fake/infer", json=body).json()["outputs"][0]
    rows: list[list[float]] = np.array(output["data"], dtype=np.float32).reshape(output["shape"]).tolist()
    return rows


def code_of(error: InferenceServerException) -> str:
    return str(error.status())


def stub(running: Running) -> tuple[grpc.Channel, pb_grpc.GRPCInferenceServiceStub]:
    channel = grpc.insecure_channel(running.grpc_target)
    return channel, pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]


def raw_request(texts: list[str], **fields: Any) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="fake", **fields)
    request.inputs.add(name="text", datatype="BYTES", shape=[len(texts)])
    request.raw_input_contents.append(
        b"".join(len(t.encode()).to_bytes(4, "little") + t.encode() for t in texts)
    )
    return request


# -- tritonclient.grpc with its defaults ------------------------------------------------------------------


def test_tritonclient_grpc_with_its_defaults_gets_the_http_routes_embedding(
    embedder: tuple[Running, ScriptedEngine],
) -> None:
    running, _ = embedder
    client = triton.InferenceServerClient(running.grpc_target)
    try:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("fake")
        assert client.is_model_ready("fake", "1")
        assert client.get_server_metadata().name == "carpool"
        metadata = client.get_model_metadata("fake")
        assert [(o.name, o.datatype, list(o.shape)) for o in metadata.outputs] == [
            ("embedding", "FP32", [-1, 2])
        ]
        result = client.infer("fake", [text_input(TEXTS)], request_id="r1")
        embedding = result.as_numpy("embedding")
        assert embedding is not None and embedding.dtype == np.float32 and embedding.shape == (3, 2)
        assert (
            embedding.tolist() == http_v2_embedding(running, TEXTS) == [expected_embedding(t) for t in TEXTS]
        )
        http = running.client.post("/v1/embeddings", json={"input": TEXTS}).json()["data"]
        assert embedding.tolist() == [row["embedding"] for row in http]
        response = result.get_response()
        assert response.id == "r1" and response.model_name == "fake" and response.model_version == "1"
        assert len(response.raw_output_contents) == 1  # binary, as tritonclient reads by default
        assert response.parameters["prompt_tokens"].int64_param == sum(len(t.split()) + 2 for t in TEXTS)
        # The model version of the path, and a requested output by name.
        named = client.infer(
            "fake", [text_input(["x"])], model_version="1", outputs=[triton.InferRequestedOutput("embedding")]
        )
        assert named.as_numpy("embedding").tolist() == [expected_embedding("x")]
    finally:
        client.close()


def test_tritonclient_grpc_asyncio_with_its_defaults(embedder: tuple[Running, ScriptedEngine]) -> None:
    running, _ = embedder

    async def call() -> list[list[float]]:
        client = triton_aio.InferenceServerClient(running.grpc_target)
        try:
            assert await client.is_server_ready() and await client.is_model_ready("fake")
            results = await asyncio.gather(*(client.infer("fake", [text_input([t])]) for t in TEXTS))
            return [r.as_numpy("embedding")[0].tolist() for r in results]
        finally:
            await client.close()

    assert asyncio.run(call()) == http_v2_embedding(running, TEXTS)


def test_tensors_in_contents_are_answered_in_contents(embedder: tuple[Running, ScriptedEngine]) -> None:
    running, _ = embedder
    request = pb.ModelInferRequest(model_name="fake")
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=[2, 1])
    tensor.contents.bytes_contents.extend([b"hello world", b"x"])
    channel, inference = stub(running)
    with channel:
        response = inference.ModelInfer(request, timeout=60)
    assert not response.raw_output_contents
    output = response.outputs[0]
    assert (output.name, output.datatype, list(output.shape)) == ("embedding", "FP32", [2, 2])
    assert list(output.contents.fp32_contents) == [
        v for t in ("hello world", "x") for v in expected_embedding(t)
    ]


def test_errors_arrive_as_status_codes_naming_what_is_wrong(embedder: tuple[Running, ScriptedEngine]) -> None:
    running, _ = embedder
    client = triton.InferenceServerClient(running.grpc_target)
    cases: list[tuple[Any, str, str]] = [
        (lambda: client.infer("other", [text_input(TEXTS)]), "StatusCode.NOT_FOUND", "not served here"),
        (lambda: client.infer("fake", [text_input(TEXTS)], model_version="2"), "StatusCode.NOT_FOUND", "'2'"),
        (lambda: client.is_model_ready("other"), "StatusCode.NOT_FOUND", "not served here"),
        (lambda: client.get_model_metadata("other"), "StatusCode.NOT_FOUND", "not served here"),
        (lambda: client.infer("fake", [text_input(["fine", ""])]), "StatusCode.INVALID_ARGUMENT", "input[1]"),
        (
            lambda: client.infer("fake", [text_input(TEXTS), text_input(TEXTS, "more")]),
            "StatusCode.INVALID_ARGUMENT",
            "one input tensor",
        ),
        (
            lambda: client.infer("fake", [text_input(TEXTS)], outputs=[triton.InferRequestedOutput("nope")]),
            "StatusCode.INVALID_ARGUMENT",
            "unknown outputs requested: ['nope']",
        ),
        (
            lambda: client.infer("fake", [text_input(TEXTS)], headers={"x-carpool-priority": "7"}),
            "StatusCode.INVALID_ARGUMENT",
            "priority 7 is outside 0..2",
        ),
        (
            lambda: client.infer("fake", [text_input(["a " * 70])]),
            "StatusCode.INVALID_ARGUMENT",
            "at most 64",
        ),
    ]
    numbers = triton.InferInput("text", [2], "FP32")
    numbers.set_data_from_numpy(np.zeros(2, dtype=np.float32))
    cases.append((lambda: client.infer("fake", [numbers]), "StatusCode.INVALID_ARGUMENT", "datatype FP32"))
    try:
        for call, code, words in cases:
            with pytest.raises(InferenceServerException) as caught:
                call()
            assert code_of(caught.value) == code, caught.value
            assert words in str(caught.value.message()), caught.value
    finally:
        client.close()
    channel, inference = stub(running)
    with channel:
        broken = raw_request(["a"])
        broken.raw_input_contents[0] = b"\x09\x00\x00\x00abc"  # claims 9 bytes, holds 3
        with pytest.raises(grpc.RpcError) as failed:
            inference.ModelInfer(broken, timeout=60)
        assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "input 'text'" in failed.value.details()
        priority = raw_request(["a"])
        priority.parameters["priority"].string_param = "high"
        with pytest.raises(grpc.RpcError) as failed:
            inference.ModelInfer(priority, timeout=60)
        assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "parameters.priority must be an integer, got 'high'" in failed.value.details()
        shape = raw_request(["a", "b"])
        shape.inputs[0].shape[:] = [3]
        with pytest.raises(grpc.RpcError) as failed:
            inference.ModelInfer(shape, timeout=60)
        assert "input 'text' has shape [3] but 2 elements" in failed.value.details()


def test_grpc_calls_are_counted_with_their_protocol(embedder: tuple[Running, ScriptedEngine]) -> None:
    running, _ = embedder

    def counted(status: str, protocol: str) -> float:
        return running.metric("carpool_requests_total", model="fake", status=status, protocol=protocol)

    before = {(s, p): counted(s, p) for s in ("200", "404") for p in ("grpc", "http")}
    client = triton.InferenceServerClient(running.grpc_target)
    try:
        client.infer("fake", [text_input(["x"])])
        with pytest.raises(InferenceServerException):
            client.infer("other", [text_input(["x"])])
    finally:
        client.close()
    assert counted("200", "grpc") == before["200", "grpc"] + 1
    assert counted("404", "grpc") == before["404", "grpc"] + 1
    assert counted("200", "http") == before["200", "http"]  # the HTTP routes' series are their own
    assert running.metric("carpool_request_duration_seconds_count", model="fake", protocol="grpc") >= 1


# -- the queue: priorities, deadlines, overload -----------------------------------------------------------


def hold(engine: ScriptedEngine, running: Running, pool: ThreadPoolExecutor) -> Future[httpx.Response]:
    """One HTTP request whose batch stays inside forward until `engine.gate` is set."""
    engine.entered.release()  # whatever warm-up left, drained below
    while engine.entered.acquire(blocking=False):
        pass
    engine.gate.clear()
    first = pool.submit(running.client.post, "/v1/embeddings", json={"input": "first"})
    assert engine.entered.acquire(timeout=10)
    return first


def test_priority_from_a_parameter_or_metadata_orders_the_queue() -> None:
    engine = ScriptedEngine()
    config = grpc_config(batching={"max_batch_size": 1, "batch_window_ms": 0})
    with serve(config, factory(engine)) as running, ThreadPoolExecutor(4) as pool:
        client = triton.InferenceServerClient(running.grpc_target)
        try:
            first = hold(engine, running, pool)
            low = pool.submit(
                client.infer, "fake", [text_input(["low"])], headers={"x-carpool-priority": "0"}
            )
            wait_for(lambda: running.waiting() == 1, what="low queued")
            mid = pool.submit(client.infer, "fake", [text_input(["mid"])], priority=1)  # as uint64_param
            wait_for(lambda: running.waiting() == 2, what="mid queued")
            high = pool.submit(
                client.infer, "fake", [text_input(["high"])], headers={"x-carpool-priority": "2"}
            )
            wait_for(lambda: running.waiting() == 3, what="high queued")
            engine.gate.set()
            assert first.result(timeout=60).status_code == 200
            for future in (low, mid, high):
                future.result(timeout=60)
        finally:
            client.close()
    order = [batch[0] for batch in engine.served_batches()]
    assert order[1:] == engine.tokenize(["high", "mid", "low"])


def test_a_full_queue_answers_resource_exhausted_with_retry_info() -> None:
    engine = ScriptedEngine()
    config = grpc_config(batching={"max_batch_size": 8, "max_queue_size": 4, "batch_window_ms": 0})
    with serve(config, factory(engine)) as running, ThreadPoolExecutor(4) as pool:
        channel, inference = stub(running)
        with channel:
            first = hold(engine, running, pool)
            queued = pool.submit(inference.ModelInfer, raw_request(["a", "b", "c"]), timeout=60)
            wait_for(lambda: running.waiting() == 3, what="3 queued")
            with pytest.raises(grpc.RpcError) as refused:
                inference.ModelInfer(raw_request(["d", "e"]), timeout=60)
            engine.gate.set()
            assert first.result(timeout=60).status_code == 200
            assert queued.result(timeout=60).outputs[0].name == "embedding"
        error = refused.value
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in error.details()
        trailers = dict(error.trailing_metadata())
        assert int(trailers["retry-after"]) >= 1
        status = rpc_status.from_call(error)
        assert status is not None
        info = error_details_pb2.RetryInfo()
        assert status.details[0].Unpack(info) and info.retry_delay.seconds >= 1
        assert running.metric("carpool_requests_total", model="fake", status="429", protocol="grpc") == 1


def test_the_calls_deadline_becomes_the_requests_deadline_in_the_queue() -> None:
    """A call with a 3 s deadline is queued with a deadline 3 s from its arrival (not the 30 s default),
    and a `timeout` parameter shorter than that is answered DEADLINE_EXCEEDED by the engine, never run."""
    engine = ScriptedEngine()
    config = grpc_config(batching={"max_batch_size": 1, "batch_window_ms": 0})
    with serve(config, factory(engine)) as running, ThreadPoolExecutor(4) as pool:
        channel, inference = stub(running)
        with channel:
            first = hold(engine, running, pool)
            late = pool.submit(inference.ModelInfer, raw_request(["late"]), timeout=3.0)
            wait_for(lambda: running.waiting() == 1, what="queued")
            task: Any = running.core.task
            (item,) = task.scheduler.queue.candidates(10)
            assert item.deadline - item.arrival == pytest.approx(3.0, abs=0.5)
            with pytest.raises(grpc.RpcError) as expired:
                late.result(timeout=60)
            assert expired.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            wait_for(lambda: running.waiting() == 0, what="the expired call withdrawn")
            request = raw_request(["short"])
            request.parameters["timeout"].double_param = 0.2
            short = pool.submit(inference.ModelInfer, request, timeout=60)
            wait_for(lambda: running.waiting() == 1, what="short queued")
            with pytest.raises(grpc.RpcError) as expired:
                short.result(timeout=60)  # the engine expires it while the first batch holds the model
            engine.gate.set()
            assert first.result(timeout=60).status_code == 200
        assert expired.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        # The short one for sure; the first too when the engine's expiry beat the client's own deadline.
        assert running.metric("carpool_requests_total", model="fake", status="504", protocol="grpc") >= 1
    ran = [batch[0] for batch in engine.served_batches()]
    assert engine.tokenize(["late"])[0] not in ran and engine.tokenize(["short"])[0] not in ran


# -- classification and generation ------------------------------------------------------------------------


def test_a_classifiers_probabilities_and_labels_over_grpc() -> None:
    config = grpc_config(model={"name": "fake", "task": "classify"})
    with serve(config, factory(ScriptedEngine(labels=["few", "many"]))) as running:
        client = triton.InferenceServerClient(running.grpc_target)
        try:
            result = client.infer("fake", [text_input(["a b c d e f", "z"])])
            metadata = client.get_model_metadata("fake")
        finally:
            client.close()
        assert [o.name for o in metadata.outputs] == ["probabilities", "label"]
        assert result.as_numpy("label").tolist() == [b"many", b"many"]
        assert result.as_numpy("probabilities").tolist() == http_v2_embedding_of(
            running, ["a b c d e f", "z"]
        )


def http_v2_embedding_of(running: Running, texts: list[str]) -> list[list[float]]:
    body = {"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}]}
    outputs = running.client.post("/v2/models/fake/infer", json=body).json()["outputs"]
    (probabilities,) = [o for o in outputs if o["name"] == "probabilities"]
    rows: list[list[float]] = (
        np.array(probabilities["data"], dtype=np.float32).reshape(probabilities["shape"]).tolist()
    )
    return rows


def test_generation_over_grpc_takes_the_http_routes_parameters() -> None:
    engine = ScriptedGenerator()
    config = grpc_config(
        model={"name": "fake", "task": "generate"},
        generation={"max_running_sequences": 1, "max_step_tokens": 64, "default_max_tokens": 5},
    )
    with serve(config, factory(engine)) as running:
        client = triton.InferenceServerClient(running.grpc_target)
        try:
            prompt = text_input(["tell me"], "text_input")
            # tritonclient sends an int as int64_param and a float as double_param.
            result = client.infer("fake", [prompt], parameters={"max_tokens": 3, "temperature": 0.0})
            default = client.infer("fake", [prompt])
            with pytest.raises(InferenceServerException) as caught:
                client.infer("fake", [prompt], parameters={"top_p": 1.5})
        finally:
            client.close()
    assert result.as_numpy("text_output").tolist() == [b"t0 t1 t2"]
    parameters = result.get_response().parameters
    assert parameters["finish_reason"].string_param == "length"
    assert parameters["completion_tokens"].int64_param == 3
    assert default.get_response().parameters["completion_tokens"].int64_param == 5
    assert code_of(caught.value) == "StatusCode.INVALID_ARGUMENT" and "top_p" in str(caught.value.message())


# -- health and the lifecycle -----------------------------------------------------------------------------


def health_of(running: Running, service: str = "") -> int:
    with grpc.insecure_channel(running.grpc_target) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
        return int(answer.status)


def test_health_is_serving_only_while_ready_and_calls_are_refused_unavailable_while_draining() -> None:
    engine = ScriptedEngine()
    config = grpc_config(server={"drain_timeout_s": 60})
    with serve(config, factory(engine), wait_ready=False, as_front=True) as running:
        wait_for(lambda: running.service.ready, what="ready")
        wait_for(lambda: health_of(running) == health_pb2.HealthCheckResponse.SERVING, what="SERVING")
        assert health_of(running, "inference.GRPCInferenceService") == health_pb2.HealthCheckResponse.SERVING
        client = triton.InferenceServerClient(running.grpc_target)
        with ThreadPoolExecutor(2) as pool:
            engine.gate.clear()
            accepted = pool.submit(client.infer, "fake", [text_input(["accepted before the drain"])])
            wait_for(lambda: running.service._inflight == 1, what="in flight")
            front: Any = running.server
            front.handle_exit(15, None)  # SIGTERM, as the front process gets it
            wait_for(
                lambda: health_of(running) == health_pb2.HealthCheckResponse.NOT_SERVING, what="NOT_SERVING"
            )
            assert not client.is_server_ready()
            assert client.is_server_live()
            with pytest.raises(InferenceServerException) as refused:
                client.infer("fake", [text_input(["late"])])
            assert code_of(refused.value) == "StatusCode.UNAVAILABLE"
            assert "shutting down" in str(refused.value.message())
            assert not front.should_exit, "the drain ended with a gRPC call in flight"
            engine.gate.set()
            assert accepted.result(timeout=60).as_numpy("embedding").tolist() == [
                expected_embedding("accepted before the drain")
            ]
        client.close()
        wait_for(lambda: front.should_exit, what="the drain finishing")


def test_a_port_taken_without_reuseport_fails_the_start_naming_it(tmp_path: Any) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = grpc_config(server={"grpc_port": port, "host": "127.0.0.1"})
        service = Frontend(config, EngineClient(Addresses.in_folder(str(tmp_path), 1), 0))
        with pytest.raises(RuntimeError, match=f"server.grpc_port {port}: cannot listen on 127.0.0.1:{port}"):
            asyncio.run(GrpcFront(service, None).start())


# -- API keys and TLS: the HTTP port's files --------------------------------------------------------------

KEY = "sk-carpool-0123456789abcdef"


def test_a_key_is_required_where_configured_and_health_stays_open(tmp_path: Any) -> None:
    (tmp_path / "keys").write_text(KEY + "\n")
    config = grpc_config(server={"api_keys_file": str(tmp_path / "keys")})
    with serve(config, factory(ScriptedEngine())) as running:
        client = triton.InferenceServerClient(running.grpc_target)
        good = {"authorization": f"Bearer {KEY}"}
        try:
            # Health needs no key (the kubelet's probes carry none), as /v2/health/* on HTTP.
            assert client.is_server_live() and client.is_server_ready()
            assert health_of(running) == health_pb2.HealthCheckResponse.SERVING
            result = client.infer("fake", [text_input(["a b"])], headers=good)
            assert result.as_numpy("embedding").tolist() == [expected_embedding("a b")]
            assert client.get_model_metadata("fake", headers=good).name == "fake"
            for headers, words in (
                (None, "missing API key"),
                ({"authorization": "Bearer sk-wrong"}, "invalid API key"),
                ({"authorization": KEY}, "missing API key"),  # no Bearer scheme
            ):
                calls: list[Callable[[], object]] = [
                    partial(client.infer, "fake", [text_input(["a b"])], headers=headers),
                    partial(client.get_model_metadata, "fake", headers=headers),
                    partial(client.is_model_ready, "fake", headers=headers),
                ]
                for call in calls:
                    with pytest.raises(InferenceServerException) as refused:
                        call()
                    assert code_of(refused.value) == "StatusCode.UNAUTHENTICATED", refused.value
                    assert words in str(refused.value.message())
        finally:
            client.close()
        assert running.metric("carpool_requests_total", model="fake", status="401", protocol="grpc") == 3
        refusals = running.metric(
            "carpool_auth_refusals_total", model="fake", reason="missing_key", protocol="grpc"
        )
        assert refusals == 6


def test_tls_with_the_http_ports_certificate_and_a_renewal_served_without_a_restart(tmp_path: Any) -> None:
    from tests.runtime.test_auth import renew_certificate, tls_secret_volume

    volume, first = tls_secret_volume(tmp_path / "tls")
    tls = {"cert_file": str(volume / "tls.crt"), "key_file": str(volume / "tls.key")}
    config = grpc_config(server={"tls": tls})
    with serve(config, factory(ScriptedEngine()), as_front=True) as running:
        trusted = first.read_text()
        client = triton.InferenceServerClient(running.grpc_target, ssl=True, root_certificates=str(first))
        try:
            assert client.infer("fake", [text_input(["x"])]).as_numpy("embedding").tolist() == [
                expected_embedding("x")
            ]
        finally:
            client.close()
        plain = triton.InferenceServerClient(running.grpc_target)
        with pytest.raises(InferenceServerException):
            plain.is_server_live(client_timeout=5)  # plain text to the TLS port gets no answer
        plain.close()
        renewed = renew_certificate(volume)

        def presented() -> str:
            host, port = running.grpc_target.split(":")
            return ssl.get_server_certificate((host, int(port)), timeout=10)

        wait_for(lambda: presented().strip() == renewed.read_text().strip(), 10, "the renewed certificate")
        assert presented().strip() != trusted.strip()


def test_before_ready_calls_are_unavailable_with_retry_info_and_health_not_serving() -> None:
    engine = ScriptedEngine()
    engine.gate.clear()  # the warm-up's first forward pass waits here
    config = grpc_config(warmup={"batch_sizes": [1], "sequence_lengths": [4]})
    with serve(config, factory(engine), wait_ready=False) as running:
        assert engine.entered.acquire(timeout=60), "warm-up never started"
        channel, inference = stub(running)
        with channel:
            assert not inference.ServerReady(pb.ServerReadyRequest(), timeout=60).ready
            assert inference.ServerLive(pb.ServerLiveRequest(), timeout=60).live
            assert health_of(running) == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as refused:
                inference.ModelInfer(raw_request(["x"]), timeout=60)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "retry shortly" in refused.value.details()  # loading or warming up
            assert int(dict(refused.value.trailing_metadata())["retry-after"]) >= 1
            engine.gate.set()
            wait_for(lambda: health_of(running) == health_pb2.HealthCheckResponse.SERVING, what="SERVING")
            answer = inference.ModelInfer(raw_request(["x"]), timeout=60)
        assert np.frombuffer(answer.raw_output_contents[0], "<f4").tolist() == expected_embedding("x")
