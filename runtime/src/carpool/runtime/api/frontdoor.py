"""The outermost ASGI layer: body limit, `Connection: close` while draining, and the hot routes.

Every request passes here first. One pure ASGI object does what two middlewares did (`limits`,
`draining`), and hands the routes where per-request cost decides throughput (POST /v1/embeddings) straight
to their endpoint, without FastAPI's middleware stack, routing, dependency solving and request objects,
which cost about as much as the rest of the request together. Those routes are still declared on the
FastAPI app, so /openapi.json documents them, and the app serves them itself when it runs without this
layer. Everything else goes to the FastAPI app.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from carpool.runtime.api.draining import is_draining, with_connection_close
from carpool.runtime.api.errors import BODY_REFUSED
from carpool.runtime.api.frontend import REQUEST, Frontend
from carpool.runtime.api.limits import (
    LINGER_BYTES,
    CountedBody,
    declared_length,
    expects_continue,
    linger,
    refuse,
)

Endpoint = Callable[[Scope, Receive, Send], Awaitable[None]]


class FrontDoor:
    """Pure ASGI: refuses oversized bodies (413), closes connections while draining, routes hot paths."""

    def __init__(
        self,
        app: ASGIApp,
        service: Frontend,
        max_body_bytes: int,
        endpoints: Mapping[tuple[str, str], Endpoint] | None = None,
    ) -> None:
        self.app = app
        self.service = service
        self.max_body_bytes = max_body_bytes
        self.endpoints = dict(endpoints or {})
        """(method, path) -> endpoint, for the routes that skip the FastAPI app."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length, chunked = declared_length(scope)
        if length is not None and length > self.max_body_bytes:
            if length <= LINGER_BYTES and not expects_continue(scope):
                await linger(receive)
            await refuse(scope, send, self.max_body_bytes)
            self._count_refused(scope)
            return
        if length is None and chunked:
            # No length to check up front: count the body as it comes (a declared length binds the
            # HTTP parser, which never hands the application more than it).
            counted = CountedBody(scope, receive, send, self.max_body_bytes)
            receive, send = counted.receive, counted.send
        service = self.service
        inner_send = send

        async def closing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and is_draining(service):
                message = with_connection_close(message)
            await inner_send(message)

        endpoint = self.endpoints.get((scope["method"], scope["path"]))
        serving = REQUEST.set(scope)  # the drain marks a request it found read (`READ_BEFORE_DRAIN`)
        try:
            if endpoint is not None:
                await endpoint(scope, receive, closing_send)
            else:
                await self.app(scope, receive, closing_send)
        finally:
            REQUEST.reset(serving)
            if scope.get(BODY_REFUSED):
                self._count_refused(scope)

    def _count_refused(self, scope: Scope) -> None:
        if scope["method"] == "POST":  # inference requests, as `api.errors` counts them
            self.service.metrics.count_request(413)
