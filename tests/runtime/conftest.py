"""Fixtures that run a front (the real app under uvicorn on a loopback port) and the engine core, each in
a thread of the test process, over the same ZeroMQ wire as the real processes (as vLLM's in-process
client does): tests reach into the engine (its fake model's gate, its queue) while every request still
crosses the wire. `tests/runtime/test_processes.py` runs the real processes."""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from carpool.runtime.api.app import create_app
from carpool.runtime.api.client import EngineClient
from carpool.runtime.api.frontdoor import FrontDoor
from carpool.runtime.api.frontend import Frontend
from carpool.runtime.api.process import DrainingServer, uvicorn_config
from carpool.runtime.config import RuntimeConfig
from carpool.runtime.engine.core import EngineCore
from carpool.runtime.engine.process import EngineFactory, build_core
from carpool.runtime.metrics import RuntimeMetrics
from carpool.runtime.wire import Addresses, EngineState
from tests.runtime.factories import runtime_config
from tests.runtime.fakes import ScriptedEngine, factory

ANSWER_S = 10.0
"""How long a test waits for an answer the server owes at once (a deadline passing, an engine failing): a
regression then fails in seconds, by name, instead of after the HTTP client's own timeout. Pass it as the
request's `timeout` too, so that no worker thread outlives the test waiting for the stuck call."""


def answered(future: Future[httpx.Response], what: str, within: float = ANSWER_S) -> httpx.Response:
    """The response of a request sent in a worker thread; fails naming `what` was owed if none came."""
    try:
        return future.result(timeout=within)
    except (TimeoutError, httpx.TimeoutException):
        raise AssertionError(f"no answer within {within:.0f} s: {what}") from None


def wait_for(condition: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll a condition (never a fixed sleep): fails the test if it does not hold in time."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@contextmanager
def stream_then_leave(url: str, body: dict[str, Any], timeout: float = 60) -> Iterator[bytes]:
    """POST a streaming completion on a raw socket and read until its first server-sent event (the
    headers may come in a packet of their own); leaving the block closes the socket mid-stream, as a
    client that goes away does."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data
        )
        raw.settimeout(timeout)
        received = b""
        while b"data: " not in received:
            chunk = raw.recv(65536)
            assert chunk, f"connection closed before the first event: {received!r}"
            received += chunk
        yield received


class Running:
    def __init__(
        self, url: str, service: Frontend, core: EngineCore, server: uvicorn.Server, app: FrontDoor
    ) -> None:
        self.url = url
        self.service = service
        self.core = core
        self.server = server
        self.app = app
        self.grpc_target = f"127.0.0.1:{service.config.server.grpc_port}"
        """host:port of the gRPC server (when the config serves gRPC)."""
        # Generous timeout: a loaded CI machine is slow. HTTPS servers have test certificates.
        self.client = httpx.Client(base_url=url, timeout=300, verify=False)

    def waiting(self) -> int:
        """Inputs (or sequences) in the engine's queue."""
        task: Any = self.core.task
        return int(task.scheduler.waiting) if task is not None else 0

    def metric(self, name: str, **labels: str) -> float:
        """Value of one sample from /metrics, matched by name and labels (0 if absent)."""
        for family in text_string_to_metric_families(self.client.get("/metrics").text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return float(sample.value)
        return 0.0


@contextmanager
def serve(
    config: RuntimeConfig,
    engine_factory: EngineFactory,
    wait_ready: bool = True,
    as_front: bool = False,
    bare: bool = False,
    heartbeat_timeout_s: float = 10.0,
) -> Iterator[Running]:
    """`as_front`: under a front process's server (`api.process`: its drain, `server.tls` and certificate
    reloads); `bare`: the FastAPI app alone, without its front door; `heartbeat_timeout_s`: how long the
    front waits for word from the engine before it counts it dead (here the engine is a thread of this
    process, so the front cannot watch it exit). gRPC is served only where the config names
    `server.grpc_port` (a test that wants it picks a free port): its default, 8001, is one port for the
    whole machine."""
    if "grpc_port" not in config.server.model_fields_set:
        config = config.model_copy(deep=True)
        config.server.grpc_port = 0
    folder = tempfile.mkdtemp(prefix="carpool-test-")
    addresses = Addresses.in_folder(folder, 1)
    metrics = RuntimeMetrics(config.served_name())
    core = build_core(config, addresses, engine_factory, metrics)
    engine = threading.Thread(target=core.run, name="engine-core", daemon=True)
    engine.start()
    service = Frontend(config, EngineClient(addresses, 0, heartbeat_timeout_s), metrics)
    app = create_app(service)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    served: Any = app.app if bare else app
    server: uvicorn.Server
    if as_front:
        server = DrainingServer(uvicorn_config(served, config), service)
    else:
        server = uvicorn.Server(uvicorn.Config(served, log_config=None, access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    scheme = "https" if as_front and config.server.tls is not None else "http"
    running = Running(f"{scheme}://127.0.0.1:{port}", service, core, server, app)
    try:
        wait_for(lambda: server.started, what="server start")
        if wait_ready:
            wait_for(lambda: service.state in (EngineState.READY, EngineState.FAILED), 600, "model ready")
            assert service.state is EngineState.READY, service.failure
        yield running
    finally:
        running.client.close()
        core.request_drain()
        server.should_exit = True  # the front says goodbye on shutdown: the engine then stops
        thread.join(timeout=30)
        engine.join(timeout=30)
        sock.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def fake_engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
def fake_config() -> RuntimeConfig:
    return runtime_config(
        model={"name": "fake"},
        batching={"max_batch_size": 8, "max_queue_size": 16, "batch_window_ms": 0},
        warmup={"batch_sizes": [1, 8], "sequence_lengths": [4]},
    )


@pytest.fixture
def fake_server(fake_engine: ScriptedEngine, fake_config: RuntimeConfig) -> Iterator[Running]:
    with serve(fake_config, factory(fake_engine)) as running:
        yield running
