"""`/metrics` on a port of its own (`server.metrics_port`): plain HTTP, no API key, nothing else served.

Why a second port: with API keys on, Prometheus would otherwise need a key to scrape, and a
NetworkPolicy could not let the monitoring namespace scrape without also letting it call the model
(both on one port). On its own port the scrape stays open and the policy opens that port alone.

A pure ASGI middleware on the app that hooks the app's lifespan: the metrics listener starts with the
app (a port already taken fails the start-up, loudly) and stops after it, so it answers through a drain.
The listener is a second uvicorn server on the same event loop whose signal handling is left to the
main server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Generator

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from carpool.runtime.config import ServerConfig
from carpool.runtime.metrics import CONTENT_TYPE

log = logging.getLogger(__name__)


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals to the main one (which drains, then stops this one)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def metrics_app(exposition: Callable[[], bytes], content_type: str = CONTENT_TYPE) -> ASGIApp:
    """An ASGI app answering GET /metrics with `exposition()` and 404 to anything else."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            status, body, kind = 200, exposition(), content_type
        else:
            status, body, kind = 404, b'{"error": "only /metrics is served on this port"}', "application/json"
        headers = [(b"content-type", kind.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    return app


class MetricsPort:
    """Runs the metrics listener for the lifetime of the app when `server.metrics_port` is set."""

    def __init__(
        self,
        app: ASGIApp,
        server: ServerConfig,
        exposition: Callable[[], bytes],
        content_type: str = CONTENT_TYPE,
    ) -> None:
        self.app = app
        self.port = server.metrics_port
        self.host = server.host
        self.listener: ASGIApp = metrics_app(exposition, content_type)
        self.server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan" or self.port is None:
            await self.app(scope, receive, send)
            return

        async def lifespan_receive() -> Message:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self._start()
            return message

        async def lifespan_send(message: Message) -> None:
            # The app has finished shutting down (drained): the scrape port may go now.
            if message["type"] in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                await self._stop()
            await send(message)

        await self.app(scope, lifespan_receive, lifespan_send)

    async def _start(self) -> None:
        assert self.port is not None
        config = uvicorn.Config(
            self.listener, host=self.host, port=self.port, lifespan="off", log_config=None, access_log=False
        )
        self.server = _QuietServer(config)
        self._task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self._task.done():  # bind failed: uvicorn logs why and exits the task
                raise RuntimeError(f"server.metrics_port {self.port}: cannot listen (see the log above)")
            await asyncio.sleep(0.01)
        log.info("metrics on :%d/metrics", self.port)

    async def _stop(self) -> None:
        if self.server is None or self._task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
        self.server = None
