"""The OpenAI routes of a model on vLLM's engine: relayed, as the client sent them, to vLLM's own OpenAI
server in this front's surface process (`carpool.runtime.vllm.surface`), and its answer relayed back.

The front keeps carpool's parts: the API key (the front door's `ApiKeyAuth` around this endpoint), the
body limit, drain and readiness (503), the priority and timeout headers (400 on a malformed one; the
deadline and the priority travel with the request to the engine), in-flight accounting for the drain,
the request counts by status (499 for a client that left), and a client that leaves mid-answer (vLLM's
server sees the disconnect and aborts the request in the engine). Everything inside the request body is
vLLM's server's to accept or refuse, with vLLM's statuses and messages.

For a model on carpool's own engine the same paths go to the FastAPI app (`api.completions`,
`api.tokens`), unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from carpool.runtime.api.errors import BODY_REFUSED, error_payload, retry_after, status_of
from carpool.runtime.api.frontend import Frontend
from carpool.runtime.api.openai import header_options, read_body
from carpool.runtime.errors import Cancelled, CarpoolError
from carpool.runtime.wire import OpenAIReply

log = logging.getLogger(__name__)

ROUTES = (
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
)
"""What vLLM's server answers for a model on vLLM's engine (`/v1/models` stays carpool's: it lists the
engine, device and adapters as the other routes see them)."""

_SKIPPED_HEADERS = frozenset({"authorization", "host", "content-length", "connection"})


class SurfaceEndpoint:
    """Relays one of `ROUTES` to vLLM's server when the model is on vLLM's engine, else hands it to
    `app` (carpool's own routes)."""

    def __init__(self, service: Frontend, app: ASGIApp) -> None:
        self.service = service
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        service = self.service
        if not service.on_vllm:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 499
        replies: AsyncGenerator[OpenAIReply, None] | None = None
        try:
            try:
                body = await read_body(receive)
                priority, timeout = header_options(scope["headers"])
                headers = [
                    (name.decode("latin-1"), value.decode("latin-1"))
                    for name, value in scope["headers"]
                    if name.decode("latin-1").lower() not in _SKIPPED_HEADERS
                ]
                replies = service.relay(scope["method"], scope["path"], headers, body, priority, timeout)
                first = await _or_gone(receive, anext(replies))
            except CarpoolError as exc:
                status = status_of(exc)
                if isinstance(exc, Cancelled):
                    status = 499
                    return
                await _error(scope, send, status, exc)
                return
            status = first.status
            await send(
                {
                    "type": "http.response.start",
                    "status": first.status,
                    "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in first.headers],
                }
            )
            await send({"type": "http.response.body", "body": first.body, "more_body": first.more})
            if first.more:
                finished = await _stream(receive, send, replies)
                if not finished:
                    status = 499
        finally:
            if replies is not None:
                await replies.aclose()  # a client gone mid-answer: vLLM's server sees it disconnect
            if not scope.get(BODY_REFUSED):
                service.metrics.count_request(status)
            if status == 200:
                service.metrics.request_duration.observe(time.perf_counter() - started)


async def _or_gone(receive: Receive, work: Awaitable[OpenAIReply]) -> OpenAIReply:
    """The first piece of the answer, unless the client goes away first (then Cancelled)."""
    task: asyncio.Future[OpenAIReply] = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        waiting: list[asyncio.Future[Any]] = [task, watcher]
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise Cancelled("the client disconnected before the answer was ready")
    return task.result()


async def _disconnected(receive: Receive) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _stream(receive: Receive, send: Send, replies: AsyncGenerator[OpenAIReply, None]) -> bool:
    """The rest of a streamed answer; False when the client went away before its end."""
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        while True:
            piece = asyncio.ensure_future(anext(replies))
            waiting: list[asyncio.Future[Any]] = [piece, watcher]
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if not piece.done():
                piece.cancel()
                await asyncio.gather(piece, return_exceptions=True)
                return False
            try:
                reply = piece.result()
            except CarpoolError as exc:  # the engine or the surface went away mid-answer
                event = {
                    "error": {"message": exc.message, "type": type(exc).__name__, "code": status_of(exc)}
                }
                await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(event) + b"\n\n"})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return True
            await send({"type": "http.response.body", "body": reply.body, "more_body": reply.more})
            if not reply.more:
                return True
    finally:
        watcher.cancel()


async def _error(scope: Scope, send: Send, status: int, exc: CarpoolError) -> None:
    payload = orjson.dumps(error_payload(scope["path"], status, exc.message, getattr(exc, "param", None)))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    wait = retry_after(exc.retry_after_s)
    if wait:
        headers.append((b"retry-after", wait.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
