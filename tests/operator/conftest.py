"""Fixtures for the operator tests: the real operator process running against kmock's Kubernetes
emulator over HTTP.

The operator runs in its own thread and event loop, as `kopf.testing.KopfRunner` does it: kopf treats
every task created in its loop after start-up as its own and cancels it on exit, so it must not share
the test's loop (which serves kmock).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest

from tests.operator.emulator import ServerSideApplyEmulator
from tests.operator.factories import Cluster, serve_kinds


@kopf.on.startup(id="tests-short-exit")
async def _short_exit(settings: kopf.OperatorSettings, **_: Any) -> None:
    """When a test ends, the operator's reconciles still in flight are cancelled after 0.1 s instead of
    kopf's 2 s (`queueing.exit_timeout`): the test has asserted what it needed, and 2 s per test was a
    minute of the suite. Registered in kopf's default registry, so only operators this process runs."""
    settings.queueing.exit_timeout = 0.1


@pytest.fixture
def kmock_options(kmock_options: dict[str, Any]) -> dict[str, Any]:
    """kmock with server-side apply creating absent objects, as a real API server does."""
    return {**kmock_options, "cls": ServerSideApplyEmulator}


@pytest.fixture
def missing_apis() -> tuple[str, ...]:
    """Resources (`group/version/plural`) the emulator does not serve, as on a cluster without that
    API installed. A test parametrizes it to override: `parametrize("missing_apis", [(...,)])`."""
    return ()


@pytest.fixture
def slow_retry_s() -> float | None:
    """The operator's `--slow-retry-period` (None: its default); parametrize it to override."""
    return None


@pytest.fixture
async def cluster(
    kmock: Any, missing_apis: tuple[str, ...], slow_retry_s: float | None
) -> AsyncIterator[Cluster]:
    """kmock serving the resources the operator watches and writes, and the operator running on it."""
    from carpool.operator.run import OperatorOptions, run_operator

    serve_kinds(kmock)
    for resource in missing_apis:
        del kmock.resources[resource]
    kmock.unserved = frozenset(missing_apis)
    stop, ready = threading.Event(), threading.Event()
    options = OperatorOptions(standalone=True, liveness_port=None, metrics_port=None)
    if slow_retry_s is not None:
        options = dataclasses.replace(options, slow_retry_s=slow_retry_s)
    connection = kopf.ConnectionInfo(server=str(kmock.url), insecure=True)
    failures: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(run_operator(options, connection=connection, stop_flag=stop, ready_flag=ready))
        except BaseException as exc:  # reported to the test below
            failures.append(exc)
            ready.set()

    thread = threading.Thread(target=target, name="operator", daemon=True)
    thread.start()
    assert await asyncio.to_thread(ready.wait, 10), "the operator did not start within 10 s"
    try:
        yield Cluster(kmock)
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 10)
        assert not thread.is_alive(), "the operator did not stop within 10 s"
        assert not failures, f"the operator crashed: {failures[0]!r}"
