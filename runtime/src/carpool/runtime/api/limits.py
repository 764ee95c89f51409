"""Request bodies over `server.max_body_bytes` get 413 with a JSON body, before they are read into memory.

A declared `Content-Length` over the limit is refused before any of the body reaches the application. A
body without one (`Transfer-Encoding: chunked`) is counted as it arrives: once it passes the limit the 413
is sent, the connection is closed, and the application is told that the client disconnected, so whatever
it was doing with the body stops and nothing it sends afterwards reaches the client (before, the error
surfaced inside FastAPI's body parsing as 400 "There was an error parsing the body").

Before answering, the rest of the body is read and dropped (a lingering close, as nginx does), up to
`LINGER_BYTES`, for at most `LINGER_SECONDS` in all and `LINGER_IDLE_SECONDS` without a byte arriving
(nginx's `lingering_time` and `lingering_timeout`, same defaults): closing a socket with unread data makes
the kernel reset the connection, and the reset destroys the 413 before the client reads it (found by
bench.soak: a 4 MiB body sent whole got no answer at all). A slow client is followed as long as it keeps
sending; one that stops mid-body gets its 413 after the idle bound. A client that sent
`Expect: 100-continue` has not sent its body, so it is answered at once. Bodies beyond the linger
bounds are still cut off: the limit is there to bound work.
"""

from __future__ import annotations

import asyncio
import contextlib

import orjson
from starlette.types import Message, Receive, Scope, Send

from carpool.runtime.api.errors import BODY_REFUSED, error_payload

_DISCONNECT: Message = {"type": "http.disconnect"}

LINGER_BYTES = 64 * 1024 * 1024
"""At most this much of a refused body is read and dropped before the 413 (more is cut off)."""
LINGER_SECONDS = 30.0
"""At most this long reading a refused body before the 413."""
LINGER_IDLE_SECONDS = 5.0
"""Stop reading a refused body once nothing of it has arrived for this long."""


def expects_continue(scope: Scope) -> bool:
    return any(name == b"expect" and value.lower() == b"100-continue" for name, value in scope["headers"])


async def linger(
    receive: Receive,
    budget_bytes: int = LINGER_BYTES,
    seconds: float = LINGER_SECONDS,
    idle_seconds: float = LINGER_IDLE_SECONDS,
) -> None:
    """Read and drop the rest of a request body, within the budget, so that closing the connection after
    the answer does not reset it."""

    async def drain() -> None:
        seen = 0
        while seen <= budget_bytes:
            message = await asyncio.wait_for(receive(), idle_seconds)
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            seen += len(message.get("body", b""))

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(drain(), seconds)


def declared_length(scope: Scope) -> tuple[int | None, bool]:
    """(Content-Length if given and well formed, whether the body is chunked) from the raw headers."""
    length: int | None = None
    chunked = False
    for name, value in scope["headers"]:
        if name == b"content-length":
            length = int(value) if value.isdigit() else None
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
    return length, chunked


async def refuse(scope: Scope, send: Send, max_bytes: int) -> None:
    """Send the 413 answer and ask for the connection to be closed (the rest of the body is not read)."""
    message = f"request body larger than the limit of {max_bytes} bytes (server.max_body_bytes)"
    payload = orjson.dumps(error_payload(scope.get("path", ""), 413, message))
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


class CountedBody:
    """Wraps `receive` and `send` for a body of unknown length: counts its bytes; past the limit, answers
    413 itself (if the application has not started answering), then feeds the application a disconnect
    and drops what it sends."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, max_bytes: int) -> None:
        self._scope = scope
        self._receive = receive
        self._send = send
        self._max_bytes = max_bytes
        self._seen = 0
        self.refused = False
        self.started = False

    async def receive(self) -> Message:
        if self.refused:
            return _DISCONNECT
        message = await self._receive()
        if message["type"] == "http.request":
            self._seen += len(message.get("body", b""))
            if self._seen > self._max_bytes:
                self.refused = True
                self._scope[BODY_REFUSED] = True
                if not self.started:
                    self.started = True
                    if message.get("more_body", False):
                        await linger(self._receive)
                    await refuse(self._scope, self._send, self._max_bytes)
                return _DISCONNECT
        return message

    async def send(self, message: Message) -> None:
        if self.refused:
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)
