"""Builds a front's app around its `Frontend`: the FastAPI app (routers, error mapping, lifecycle) behind
the front door (body limit, connection close while draining, the hot routes; see `api.frontdoor`), and
the front's gRPC server (`api.grpc`), which lives as long as the app."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from carpool.runtime.api import (
    completions,
    errors,
    health,
    lora,
    openai,
    openapi,
    rerank,
    surface,
    tokens,
    v2,
)
from carpool.runtime.api.auth import ApiKeyAuth
from carpool.runtime.api.frontdoor import FrontDoor
from carpool.runtime.api.frontend import Frontend
from carpool.runtime.api.grpc.server import GrpcFront
from carpool.runtime.api.keys import load_keys
from carpool.runtime.api.metrics_port import MetricsPort

METRICS_FRONT = 0
"""The front that serves `server.metrics_port` (the exposition covers every process of the pod, see
`metrics`): one listener per pod, never one per front."""


def create_app(service: Frontend) -> FrontDoor:
    """The app connects to the engine on start-up and says goodbye to it on shutdown; with
    `server.grpc_port` it also serves KServe v2 over gRPC for that time (stopped before the goodbye)."""
    server = service.config.server
    keys = load_keys(server)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        grpc_front = GrpcFront(service, keys) if server.grpc_port else None
        try:
            if grpc_front is not None:
                await grpc_front.start()
            app.state.grpc = grpc_front
            yield
        finally:
            if grpc_front is not None:
                await grpc_front.stop()
            await service.close()

    # strict_content_type=False: a JSON body is parsed even without a JSON content type (curl -d).
    app = FastAPI(title="carpool runtime", version="1", lifespan=lifespan, strict_content_type=False)
    app.state.service = service
    errors.install(app)
    app.include_router(health.router)
    app.include_router(openai.router)
    app.include_router(completions.router)
    app.include_router(tokens.router)
    app.include_router(rerank.router)
    app.include_router(lora.router)
    app.include_router(v2.router)
    openapi.install(app, service)
    count, refused = service.metrics.count_request, service.metrics.count_auth_refusal
    app.add_middleware(ApiKeyAuth, server=server, keys=keys, count=count, refused=refused)
    if service.client.front == METRICS_FRONT:
        app.add_middleware(MetricsPort, server=server, exposition=service.metrics.exposition)
    # The hot routes skip the FastAPI app and its middlewares: each gets the same key check.
    embeddings = ApiKeyAuth(
        openai.EmbeddingsEndpoint(service), server=server, keys=keys, count=count, refused=refused
    )
    endpoints = {("POST", "/v1/embeddings"): embeddings}
    # A model on vLLM's engine answers its OpenAI routes with vLLM's own server (`api.surface`); the
    # FastAPI app answers them for a model on carpool's engine (its key check passes again there).
    relay = ApiKeyAuth(
        surface.SurfaceEndpoint(service, app), server=server, keys=keys, count=count, refused=refused
    )
    endpoints.update(dict.fromkeys(surface.ROUTES, relay))
    return FrontDoor(app, service, server.max_body_bytes, endpoints)
