"""A front's gRPC server (`grpc.aio`, on the front's event loop): KServe v2 and `grpc.health.v1.Health` on
`server.grpc_port`, started and stopped with the front's app (`api.app` runs it in the app's lifespan).

Every front serves the port. The supervisor binds the HTTP port once per front with SO_REUSEPORT and
hands each front its socket; gRPC's Python server cannot take a socket it did not bind, so each front
binds the gRPC port itself with SO_REUSEPORT (gRPC sets it on Linux), and the kernel spreads new
connections over the fronts as it spreads them over the HTTP sockets. A port another process holds
without SO_REUSEPORT fails the front's start-up, and so the pod's.

Health answers SERVING (for the server, "", and for `inference.GRPCInferenceService`) only while the
front is ready, as `GET /v2/health/ready` answers 200, and turns NOT_SERVING when the engine fails and
when the drain starts. On shutdown the app has already drained (every accepted call answered, new calls
refused with UNAVAILABLE); the server then stops, telling clients to go elsewhere (HTTP/2 GOAWAY).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from carpool.runtime.api.frontend import Frontend
from carpool.runtime.api.grpc import grpc_predict_v2_pb2_grpc as pb_grpc
from carpool.runtime.api.grpc.security import ApiKeyInterceptor, server_credentials
from carpool.runtime.api.grpc.service import InferenceService
from carpool.runtime.api.keys import KeyFile

log = logging.getLogger(__name__)

SERVICE_NAME = "inference.GRPCInferenceService"
STOP_GRACE_S = 1.0
"""How long calls still open when the server stops may take (the drain has answered every accepted one)."""


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class GrpcFront:
    """One front's gRPC server over its `Frontend`."""

    def __init__(self, service: Frontend, keys: KeyFile | None) -> None:
        self.service = service
        self.keys = keys
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        """The port bound (the configured one)."""
        self._follower: asyncio.Task[None] | None = None

    async def start(self) -> None:
        config = self.service.config.server
        metrics = self.service.metrics
        interceptors = []
        if self.keys is not None:
            interceptors.append(
                ApiKeyInterceptor(self.keys, metrics.count_request, metrics.count_auth_refusal)
            )
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.so_reuseport", 1),
                # Bigger messages get RESOURCE_EXHAUSTED from gRPC itself, as bigger bodies get 413.
                ("grpc.max_receive_message_length", config.max_body_bytes),
            ],
        )
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(self.service), server)  # type: ignore[no-untyped-call]
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        where = address(config.host, config.grpc_port)
        try:
            if config.tls is not None:
                self.port = server.add_secure_port(where, server_credentials(config.tls))
            else:
                self.port = server.add_insecure_port(where)
        except RuntimeError as exc:
            raise RuntimeError(
                f"server.grpc_port {config.grpc_port}: cannot listen on {where} ({exc})"
            ) from exc
        await self._set_health()
        await server.start()
        self.server = server
        self._follower = asyncio.create_task(self._follow(), name="carpool-grpc-health")
        log.info("KServe v2 over gRPC on %s%s", where, " (TLS)" if config.tls is not None else "")

    async def stop(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower
        if self.server is not None:
            await self.health.enter_graceful_shutdown()
            await self.server.stop(STOP_GRACE_S)
            self.server = None

    async def _set_health(self) -> None:
        serving = health_pb2.HealthCheckResponse
        status = serving.SERVING if self.service.ready else serving.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def _follow(self) -> None:
        """Keep the health status in step with readiness: at every engine state change, and at the drain."""
        service = self.service
        while True:
            await self._set_health()
            if service.draining:
                return  # not ready again before the process exits
            changed = asyncio.ensure_future(service.client.changed.wait())
            drained = asyncio.ensure_future(service.drain_started.wait())
            try:
                await asyncio.wait({changed, drained}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
                drained.cancel()
