"""Keeps kopf's watch streams alive through API errors (installed by `run.run_operator`).

kopf restarts a watch stream that ends (a disconnect, a server timeout, `410 Gone` after etcd compacted
past its resource version: it lists again). But an API error while listing (a 403 while RBAC is being
rolled out, a 5xx from an API server that is starting, a 401 past kopf's re-authentication) and an
`ERROR` event other than 410 in the stream (`WatchingError`) escape the stream: kopf logs "Watcher for
... has failed" and never starts that watcher again, so the operator lives on, deaf to that resource
until its pod restarts. controller-runtime's informers instead retry with back-off for ever.

`guard_watches` wraps kopf's `continuous_watch` (the function its `infinite_watch` loop calls for
each stream) so that such an error ends only that stream: counted in
`carpool_operator_watch_errors_total{reason}`, logged once per stream, and followed by a back-off
(doubling from 1 s to 30 s per resource while the errors go on) before `infinite_watch` lists afresh.
This reaches into kopf's internals (`kopf._cogs.clients.watching`, stable since kopf 1.30); a test
(tests/operator/test_watchguard.py) fails if the function moves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from kopf._cogs.clients import errors as kopf_errors
from kopf._cogs.clients import watching as kopf_watching

from carpool.operator.metrics import WATCH_ERRORS

logger = logging.getLogger("carpool.operator.watch")

FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0

_ORIGINAL = "_carpool_original"


def watch_error_reason(exc: BaseException) -> str:
    """The metric label of a watch failure."""
    if isinstance(exc, kopf_watching.WatchingError):
        return "WatchErrorEvent"
    status = getattr(exc, "status", None)
    return {401: "Unauthorized", 403: "Forbidden", 429: "TooManyRequests"}.get(
        status or 0, "ApiServerError" if (status or 0) >= 500 else "ApiError"
    )


def guarded(
    watch: Callable[..., AsyncIterator[Any]], sleep: Callable[[float], Any] = asyncio.sleep
) -> Callable[..., AsyncIterator[Any]]:
    """`watch` (kopf's `continuous_watch`) ending on API errors instead of raising them."""
    failures: dict[str, int] = {}

    async def continuous_watch(**kwargs: Any) -> AsyncIterator[Any]:
        resource = str(kwargs.get("resource"))
        try:
            async for event in watch(**kwargs):
                failures.pop(resource, None)
                yield event
        except (kopf_errors.APIError, kopf_watching.WatchingError) as exc:
            count = failures[resource] = failures.get(resource, 0) + 1
            delay = min(FIRST_BACKOFF_SECONDS * 2 ** (count - 1), MAX_BACKOFF_SECONDS)
            reason = watch_error_reason(exc)
            WATCH_ERRORS.labels(reason).inc()
            logger.warning(f"Watch of {resource} failed ({reason}: {exc}); listing again in {delay:g} s")
            await sleep(delay)

    setattr(continuous_watch, _ORIGINAL, watch)
    return continuous_watch


def guard_watches() -> None:
    """Install the guard on kopf (once; idempotent)."""
    current = kopf_watching.continuous_watch
    if not hasattr(current, _ORIGINAL):
        kopf_watching.continuous_watch = guarded(current)
