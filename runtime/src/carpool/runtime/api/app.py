"""Builds a front's FastAPI app around its `Frontend`: routers, error mapping, body limit, lifecycle."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from carpool.runtime.api import completions, errors, health, openai, openapi, v2
from carpool.runtime.api.draining import CloseWhileDraining
from carpool.runtime.api.frontend import Frontend
from carpool.runtime.api.limits import BodyLimit


def create_app(service: Frontend) -> FastAPI:
    """The app connects to the engine on start-up and says goodbye to it on shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
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
    openapi.install(app, service)
    app.add_middleware(BodyLimit, max_bytes=service.config.server.max_body_bytes)
    app.add_middleware(CloseWhileDraining, service=service)
    return app
