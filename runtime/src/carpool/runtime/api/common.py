"""What every inference route shares: request options from headers, accounting, and disconnects."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from carpool.runtime.api.frontend import Frontend
from carpool.runtime.errors import Cancelled, InvalidInput

T = TypeVar("T")

PRIORITY_HEADER = "x-carpool-priority"
TIMEOUT_HEADER = "x-carpool-timeout"


def parse_options(priority_raw: str | None, timeout_raw: str | None) -> tuple[int | None, float | None]:
    """(priority, timeout in seconds) from the raw values of the priority and timeout headers (HTTP) or
    metadata (gRPC); InvalidInput naming the header on a malformed value."""
    priority: int | None = None
    timeout: float | None = None
    if priority_raw is not None:
        try:
            priority = int(priority_raw)
        except ValueError:
            raise InvalidInput(f"header {PRIORITY_HEADER} must be an integer, got {priority_raw!r}") from None
    if timeout_raw is not None:
        try:
            timeout = float(timeout_raw)
        except ValueError:
            raise InvalidInput(
                f"header {TIMEOUT_HEADER} must be a number of seconds, got {timeout_raw!r}"
            ) from None
    return priority, timeout


def request_options(request: Request) -> tuple[int | None, float | None]:
    """(priority, timeout in seconds) from the request headers; 400 on a malformed value."""
    return parse_options(request.headers.get(PRIORITY_HEADER), request.headers.get(TIMEOUT_HEADER))


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def serve(request: Request, service: Frontend, work: Awaitable[T], count: bool = True) -> T:
    """Await `work` unless the client goes away first: then its inputs are withdrawn from the queue
    before they run. Successes are counted here, errors where they become responses (`api.errors`)."""
    started = time.perf_counter()
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()  # cancelling withdraws the request's inputs from the queue
        await asyncio.gather(task, return_exceptions=True)
        raise Cancelled("the client disconnected before the answer was ready")
    result = task.result()
    if count:
        service.tally.answered(200, time.perf_counter() - started)
    return result
