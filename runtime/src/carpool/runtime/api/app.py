"""Builds the app around a `ModelService`: the FastAPI app (routers, error mapping, lifecycle) behind the
front door (body limit, connection close while draining, the hot routes; see `api.frontdoor`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from carpool.runtime.api import completions, errors, health, openai, v2
from carpool.runtime.api.frontdoor import FrontDoor
from carpool.runtime.service import ModelService


def create_app(service: ModelService) -> FrontDoor:
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
    return FrontDoor(
        app,
        service,
        service.config.server.max_body_bytes,
        {("POST", "/v1/embeddings"): openai.EmbeddingsEndpoint(service)},
    )
