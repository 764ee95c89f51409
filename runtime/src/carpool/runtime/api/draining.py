"""Ends keep-alive connections once the server drains, so that clients stop reusing them before it exits.

Without it, a client whose request was answered during the drain sends its next request on the same
connection; if the drain has just finished, the server closes that connection as it exits and the client
sees it dropped without an answer (and cannot know the request never ran). With `Connection: close` on
every response after SIGTERM, the next request opens a new connection: it is refused with 503 while the
server still listens, or not connected once it has gone, both of which a client or load balancer retries.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from carpool.runtime.api.frontend import Frontend
from carpool.runtime.wire import EngineState


class CloseWhileDraining:
    """Pure ASGI middleware: adds `Connection: close` to responses while the service drains or stops."""

    def __init__(self, app: ASGIApp, service: Frontend) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def closing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and self.service.state in (
                EngineState.DRAINING,
                EngineState.STOPPED,
            ):
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, closing_send)
