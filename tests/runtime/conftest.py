"""Fixtures that run the real app under uvicorn on a loopback port, in a thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from carpool.runtime.api.app import create_app
from carpool.runtime.config import RuntimeConfig
from carpool.runtime.service import ModelService, State
from tests.runtime.factories import runtime_config
from tests.runtime.fakes import ScriptedEngine, factory


def wait_for(condition: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll a condition (never a fixed sleep): fails the test if it does not hold in time."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class Running:
    def __init__(self, url: str, service: ModelService, server: uvicorn.Server) -> None:
        self.url = url
        self.service = service
        self.server = server
        self.client = httpx.Client(base_url=url, timeout=300)  # generous: a loaded CI machine is slow

    def metric(self, name: str, **labels: str) -> float:
        """Value of one sample from /metrics, matched by name and labels (0 if absent)."""
        for family in text_string_to_metric_families(self.client.get("/metrics").text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return float(sample.value)
        return 0.0


@contextmanager
def serve(config: RuntimeConfig, engine_factory: Any, wait_ready: bool = True) -> Iterator[Running]:
    service = ModelService(config, engine_factory=engine_factory)
    app = create_app(service)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    running = Running(f"http://127.0.0.1:{port}", service, server)
    try:
        wait_for(lambda: server.started, what="server start")
        if wait_ready:
            wait_for(lambda: service.state in (State.READY, State.FAILED), 120, "model ready")
            assert service.state is State.READY, service.failure
        yield running
    finally:
        running.client.close()
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


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
