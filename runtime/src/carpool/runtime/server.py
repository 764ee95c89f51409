"""Runs the app under uvicorn with carpool's shutdown: SIGTERM drains instead of dropping work.

On the first SIGTERM or SIGINT: readiness turns 503, new requests get 503, accepted ones finish (up to
`server.drain_timeout_s`), then uvicorn stops and the process exits 0. A second SIGINT forces exit.
If the model fails to load, the process exits 1 so that the pod restarts and its logs say why.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import socket
from types import FrameType

import uvicorn

from carpool.runtime.api.app import create_app
from carpool.runtime.config import RuntimeConfig
from carpool.runtime.logs import configure
from carpool.runtime.service import ModelService, State
from carpool.runtime.tls import reload_certificates, uvicorn_tls

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: ModelService, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.service = service
        self.drain_timeout_s = drain_timeout_s
        self.exit_code = 0
        self._draining: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        watcher = asyncio.create_task(self._exit_on_failure())
        certificates = asyncio.create_task(reload_certificates(self.config))
        try:
            await super().serve(sockets)
        finally:
            watcher.cancel()
            certificates.cancel()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn's own handler, do not re-raise the signal after shutdown: a drained exit is 0.
        if self._draining is not None or self._loop is None:
            if sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        log.info("received %s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._draining = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        await self.service.drain(self.drain_timeout_s)
        self.should_exit = True

    async def _exit_on_failure(self) -> None:
        await self.service.settled.wait()
        if self.service.state is State.FAILED:
            self.exit_code = 1
            self.should_exit = True


def run(config: RuntimeConfig) -> int:
    """Serve until drained or failed; returns the process exit code."""
    configure(config.server.log_level, config.server.log_format)
    service = ModelService(config)
    app = create_app(service)
    uv_config = uvicorn.Config(
        app,
        host=config.server.host,
        port=config.server.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=max(1, math.ceil(config.server.drain_timeout_s)),
        timeout_keep_alive=30,
        **uvicorn_tls(config.server),
    )
    server = DrainingServer(uv_config, service, config.server.drain_timeout_s)
    server.run()
    return server.exit_code
