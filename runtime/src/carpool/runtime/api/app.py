"""Builds the FastAPI app around a `ModelService`: routers, error mapping, body limit, lifecycle."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from carpool.runtime.api import completions, errors, health, openai, v2
from carpool.runtime.api.auth import ApiKeyAuth
from carpool.runtime.api.draining import CloseWhileDraining
from carpool.runtime.api.keys import load_keys
from carpool.runtime.api.limits import BodyLimit
from carpool.runtime.api.metrics_port import MetricsPort
from carpool.runtime.service import ModelService


def create_app(service: ModelService) -> FastAPI:
    """The app starts the service's background load on start-up and closes it on shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        try:
            yield
        finally:
            await service.close()

    # strict_content_type=False: a JSON body is parsed even without a JSON content type (curl -d).
    app = FastAPI(title="carpool runtime", version="1", lifespan=lifespan, strict_content_type=False)
    app.state.service = service
    errors.install(app)
    app.include_router(health.router)
    app.include_router(openai.router)
    app.include_router(completions.router)
    app.include_router(v2.router)
    app.add_middleware(BodyLimit, max_bytes=service.config.server.max_body_bytes)
    app.add_middleware(ApiKeyAuth, server=service.config.server, keys=load_keys(service.config.server))
    app.add_middleware(MetricsPort, server=service.config.server, exposition=service.metrics.exposition)
    app.add_middleware(CloseWhileDraining, service=service)
    return app
