"""A watch stream that meets an API error ends and is listed again; the watcher lives on.

Driven through kopf's own `infinite_watch` loop (the one its watchers run) with kopf's
`continuous_watch` replaced by a stand-in that fails the way the API server does (a 403 while listing,
an `ERROR` event other than 410): kopf without the guard lets the error out of the loop, which ends the
watcher for good.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest
from kopf._cogs.clients import errors as kopf_errors
from kopf._cogs.clients import watching as kopf_watching
from prometheus_client import REGISTRY

from carpool.operator import watchguard


def watch_errors(reason: str) -> float:
    return REGISTRY.get_sample_value("carpool_operator_watch_errors_total", {"reason": reason}) or 0.0


FAILURES = [
    kopf_errors.APIForbiddenError("forbidden", status=403, headers={}),
    kopf_errors.APIServerError("etcd leader changed", status=500, headers={}),
    kopf_watching.WatchingError("Error in the watch-stream: {'code': 500}"),
]


async def test_the_watch_loop_survives_api_errors_and_backs_off(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    async def flaky(**_: Any) -> AsyncIterator[Any]:
        calls.append(len(calls))
        if len(calls) <= len(FAILURES):
            raise FAILURES[len(calls) - 1]
        yield {"type": "ADDED", "object": {"metadata": {"name": "m"}}}

    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    before = [watch_errors(r) for r in ("Forbidden", "ApiServerError", "WatchErrorEvent")]
    monkeypatch.setattr(kopf_watching, "continuous_watch", watchguard.guarded(flaky, sleep=sleep))
    settings = kopf.OperatorSettings()
    settings.watching.reconnect_backoff = 0
    stream = kopf_watching.infinite_watch(
        settings=settings,
        resource=kopf.Resource("apps", "v1", "deployments"),
        namespace=None,
        _iterations=len(FAILURES) + 1,
    )
    events = [event async for event in stream]
    assert events == [{"type": "ADDED", "object": {"metadata": {"name": "m"}}}]
    assert slept == [1.0, 2.0, 4.0]  # doubling while the errors go on
    after = [watch_errors(r) for r in ("Forbidden", "ApiServerError", "WatchErrorEvent")]
    assert after == [b + 1 for b in before]


def test_the_guard_is_installed_on_kopfs_watch_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kopf_watching, "continuous_watch", kopf_watching.continuous_watch)
    watchguard.guard_watches()
    installed = kopf_watching.continuous_watch
    watchguard.guard_watches()
    assert kopf_watching.continuous_watch is installed
    assert installed.__name__ == "continuous_watch" and installed.__module__ == watchguard.__name__
