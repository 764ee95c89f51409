"""A front process: the HTTP app under uvicorn on the socket the supervisor bound, with carpool's drain.

On SIGTERM or SIGINT: readiness turns 503, new connections' requests get 503, a request on a keep-alive
connection open at the signal is answered with `Connection: close` (busy ones close after their response;
idle ones stay open for their client's next request up to `server.drain_keep_alive_s`, then close:
`draining`), accepted requests finish (up to `server.drain_timeout_s`),
the front tells the engine it is done, stops taking connections and lets those already queued or open
end cleanly (`draining.close_listeners_quietly`), then uvicorn stops and the process exits 0. A second SIGINT
forces exit. If the front's own connection to the engine breaks (its reader task stops on an error), the
requests it held have already failed (500) and probes answer 503; the front stops and exits 1, and the
supervisor takes the pod down.

With `server.tls` the front serves HTTPS, and a renewed certificate is loaded into its SSL context while
it runs (see `tls`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import socket
import sys
from collections.abc import Sequence
from types import FrameType

import uvicorn

from carpool.runtime import threads
from carpool.runtime.api.app import create_app
from carpool.runtime.api.client import EngineClient
from carpool.runtime.api.draining import (
    Connection,
    close_listeners_quietly,
    end_keep_alive,
    hold_idle,
    release_held,
)
from carpool.runtime.api.frontend import Frontend
from carpool.runtime.config import RuntimeConfig
from carpool.runtime.logs import configure
from carpool.runtime.tls import reload_certificates, uvicorn_tls
from carpool.runtime.wire import Addresses

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: Frontend) -> None:
        super().__init__(config)
        self.service = service
        self.drain_timeout_s = service.config.drain_timeout()
        self.keep_alive_s = min(service.config.server.drain_keep_alive_s, self.drain_timeout_s)
        """How long an idle keep-alive connection stays open after the drain begins (`draining`)."""
        self._draining: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.failed = False
        """The front's connection to the engine broke: exit non-zero."""

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        certificates = asyncio.create_task(reload_certificates(self.config))
        broken = asyncio.create_task(self._exit_when_broken())
        try:
            await super().serve(sockets)
        finally:
            certificates.cancel()
            broken.cancel()

    async def _exit_when_broken(self) -> None:
        await self.service.client.broken.wait()
        log.critical("this front can no longer reach the engine: stopping (exit 1)")
        self.failed = True
        self.should_exit = True

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
        # In one callback (no turn of the loop between): the connections are sorted and the front refuses
        # new requests at the same instant, so no request slips in between the two.
        connections = self.server_state.connections
        held: list[Connection] = []
        if self.keep_alive_s > 0:
            held = hold_idle(connections)
        else:  # idle connections close at once (a request that has begun arriving on one is answered)
            end_keep_alive(connections)
        self.service.begin_drain()
        if held:
            log.info("holding %d idle keep-alive connections for up to %.1fs", len(held), self.keep_alive_s)
        self._draining = asyncio.create_task(self._drain(held))

    async def _drain(self, held: Sequence[Connection]) -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        await release_held(held, self.server_state.connections, self.keep_alive_s)  # type: ignore[arg-type]
        await self.service.drain(max(0.0, self.drain_timeout_s - (loop.time() - began)))
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn closes the listening socket first, which resets every connection queued on it (a client
        # that reconnected as the drain ended); the front takes those in and lets each end first.
        if not self.force_exit:
            listeners = [listener for server in self.servers for listener in server.sockets]
            await close_listeners_quietly(listeners, self.server_state.connections)  # type: ignore[arg-type]
        await super().shutdown(sockets)


def uvicorn_config(app: object, config: RuntimeConfig) -> uvicorn.Config:
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=config.server.host,
        port=config.server.port,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=max(1, math.ceil(config.drain_timeout())),
        timeout_keep_alive=30,
        **uvicorn_tls(config.server),
    )


def main(config_data: dict[str, object], addresses: Addresses, front: int, sock: socket.socket) -> None:
    """Run front number `front` (the target the supervisor spawns) on its own listening socket
    (`server.bind`)."""
    threads.name_thread(threads.FRONT)
    config = RuntimeConfig.model_validate(config_data)
    configure(config.server.log_level, config.server.log_format)
    client = EngineClient(addresses, front, step_timeout_s=config.generation.step_timeout_s)
    service = Frontend(config, client)
    server = DrainingServer(uvicorn_config(create_app(service), config), service)
    server.run(sockets=[sock])
    sys.exit(0 if server.started and not server.failed else 1)
