"""OpenAI-compatible routes: `POST /v1/embeddings`, `GET /v1/models`."""

from __future__ import annotations

import base64
import time
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from carpool.runtime.api.common import request_options, serve
from carpool.runtime.api.frontend import Frontend
from carpool.runtime.api.responses import JSONBody
from carpool.runtime.config import Task
from carpool.runtime.errors import InvalidInput, ModelNotFound

router = APIRouter(tags=["openai"])
_STARTED = int(time.time())


NonEmpty = Annotated[StrictStr, Field(min_length=1)]
"""An input text: an empty one is refused (400), and the schema says so."""


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    input: NonEmpty | Annotated[list[NonEmpty], Field(min_length=1)]
    """One text or a list of texts (token-id arrays are not accepted: send text)."""
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: StrictStr | None = None


def _service(request: Request) -> Frontend:
    service: Frontend = request.app.state.service
    return service


def check_model(service: Frontend, requested: str | None) -> None:
    if requested is not None and requested != service.name:
        raise ModelNotFound(f"model {requested!r} is not served here; this server serves {service.name!r}")


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request) -> JSONBody:
    service = _service(request)
    check_model(service, body.model)
    info = service.info
    if info.task is not Task.EMBED:
        raise InvalidInput(
            f"model {service.name!r} does {info.task.value}, not embed; "
            f"use POST /v2/models/{service.name}/infer"
        )
    if body.dimensions is not None and body.dimensions != info.dimensions:
        raise InvalidInput(
            f"dimensions {body.dimensions} not available: this model's embeddings have {info.dimensions}"
        )
    texts = [body.input] if isinstance(body.input, str) else body.input
    priority, timeout = request_options(request)
    result = await serve(request, service, service.infer(texts, priority, timeout))
    data = []
    for index, row in enumerate(result.outputs):
        vector = row.astype(np.float32, copy=False)
        embedding: object = (
            base64.b64encode(vector.tobytes()).decode() if body.encoding_format == "base64" else vector
        )
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    return JSONBody(
        {
            "object": "list",
            "data": data,
            "model": service.name,
            "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
        }
    )


@router.get("/v1/models")
async def list_models(request: Request) -> JSONBody:
    service = _service(request)
    return JSONBody(
        {
            "object": "list",
            "data": [{"id": service.name, "object": "model", "created": _STARTED, "owned_by": "carpool"}],
        }
    )
