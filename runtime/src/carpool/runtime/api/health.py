"""Liveness, readiness and metrics: the paths the operator's probes and Prometheus use."""

from __future__ import annotations

import os

from fastapi import APIRouter, Request
from starlette.responses import Response

from carpool.runtime.api.frontend import Frontend
from carpool.runtime.api.responses import JSONBody
from carpool.runtime.metrics import CONTENT_TYPE
from carpool.runtime.wire import INSTANCE_ENV

router = APIRouter(tags=["health"])


def _service(request: Request) -> Frontend:
    service: Frontend = request.app.state.service
    return service


@router.get("/v2/health/live")
async def live(request: Request) -> JSONBody:
    """200 while the front serves and the engine runs (loading and warming up count as alive); 503 once
    the engine has died, failed or gone silent, so Kubernetes restarts the pod."""
    service = _service(request)
    if not service.live:
        return JSONBody(
            {"live": False, "front": service.client.front, "error": service.failure}, status_code=503
        )
    return JSONBody({"live": True, "front": service.client.front})


@router.get("/v2/health/ready")
async def ready(request: Request) -> JSONBody:
    """200 only once the model is loaded and warmed up; 503 before, and while draining."""
    service = _service(request)
    body = {"ready": service.ready, "state": service.state.value, "front": service.client.front}
    instance = os.environ.get(INSTANCE_ENV)
    if instance:  # which start of the runtime answers (see `wire.INSTANCE_ENV`)
        body["instance"] = instance
    if service.failure is not None:
        body["error"] = str(service.failure)
    return JSONBody(body, status_code=200 if service.ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_service(request).metrics.exposition(), media_type=CONTENT_TYPE)
