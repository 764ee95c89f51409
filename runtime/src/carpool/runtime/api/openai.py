"""OpenAI-compatible routes: `POST /v1/embeddings`, `GET /v1/models`.

The embeddings route is the hot path. Its body is decoded and validated by msgspec (`api.bodies`) and its
answer encoded by orjson straight to bytes, float32 rows included. `EmbeddingsEndpoint` serves it as a
bare ASGI endpoint that `api.frontdoor` dispatches to without FastAPI; the FastAPI route below runs the
same code when the app is served without the front door, and documents the request in /openapi.json
with the schema msgspec validates against.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Awaitable, Iterable
from typing import Annotated, Literal, TypeVar

import msgspec
import numpy as np
import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from carpool.runtime.api.bodies import BodyDecoder, schema
from carpool.runtime.api.common import parse_options, request_options, serve
from carpool.runtime.api.errors import BODY_REFUSED, error_payload, retry_after, status_of
from carpool.runtime.api.frontend import Frontend
from carpool.runtime.api.responses import JSONBody
from carpool.runtime.config import Task
from carpool.runtime.errors import Cancelled, CarpoolError, InvalidInput, ModelNotFound

log = logging.getLogger(__name__)
router = APIRouter(tags=["openai"])
_STARTED = int(time.time())
T = TypeVar("T")

Text = Annotated[str, msgspec.Meta(min_length=1)]


class EmbeddingRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Embed one text or a list of texts (OpenAI `POST /v1/embeddings`)."""

    input: Annotated[
        Text | Annotated[list[Text], msgspec.Meta(min_length=1)],
        msgspec.Meta(
            description="One text or a list of texts, none empty (token-id arrays are not accepted)."
        ),
    ]
    model: Annotated[
        str | None, msgspec.Meta(description="The served model's name (any other is 404); optional.")
    ] = None
    encoding_format: Annotated[
        Literal["float", "base64"],
        msgspec.Meta(description="`float`: lists of numbers; `base64`: little-endian float32 bytes."),
    ] = "float"
    dimensions: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        msgspec.Meta(description="When given, must equal the model's embedding width (no truncation)."),
    ] = None
    user: Annotated[str | None, msgspec.Meta(description="An end-user id; accepted and ignored.")] = None


_DECODER = BodyDecoder(EmbeddingRequest)
_NUMPY = orjson.OPT_SERIALIZE_NUMPY
_JSON_HEADERS = (b"content-type", b"application/json")


def check_model(service: Frontend, requested: str | None) -> None:
    """404 unless `requested` names the served model or one of its LoRA adapters (or nothing)."""
    if requested is not None and not service.serves(requested):
        adapters = [adapter.name for adapter in service.adapters]
        also = f" and the LoRA adapters {adapters}" if adapters else ""
        raise ModelNotFound(
            f"model {requested!r} is not served here; this server serves {service.name!r}{also}"
        )


async def embed(
    service: Frontend, body: EmbeddingRequest, priority: int | None, timeout_s: float | None
) -> bytes:
    """The answer to one validated request, as JSON bytes; raises the domain errors."""
    check_model(service, body.model)
    info = service.info
    if info.task is not Task.EMBED:
        route = "/v1/rerank" if info.task is Task.RERANK else f"/v2/models/{service.name}/infer"
        raise InvalidInput(f"model {service.name!r} does {info.task.value}, not embed; use POST {route}")
    if body.dimensions is not None and body.dimensions != info.dimensions:
        raise InvalidInput(
            f"dimensions {body.dimensions} not available: this model's embeddings have {info.dimensions}"
        )
    texts = [body.input] if isinstance(body.input, str) else body.input
    result = await service.infer(texts, priority, timeout_s)
    as_base64 = body.encoding_format == "base64"
    data = []
    for index, row in enumerate(result.outputs):
        vector = row.astype(np.float32, copy=False)
        embedding: object = base64.b64encode(vector.tobytes()).decode() if as_base64 else vector
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = result.prompt_tokens
    answer = {
        "object": "list",
        "data": data,
        "model": service.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return orjson.dumps(answer, option=_NUMPY)


# -- the bare ASGI endpoint --------------------------------------------------------------------------


def header_options(headers: Iterable[tuple[bytes, bytes]]) -> tuple[int | None, float | None]:
    """(priority, timeout) from raw ASGI headers, with `api.common.request_options`'s messages."""
    priority: str | None = None
    timeout: str | None = None
    for name, value in headers:
        if name == b"x-carpool-priority":
            priority = value.decode("latin-1")
        elif name == b"x-carpool-timeout":
            timeout = value.decode("latin-1")
    return parse_options(priority, timeout)


async def read_body(receive: Receive) -> bytes:
    message = await receive()
    body: bytes = message.get("body", b"")
    more = message.get("more_body", False)
    if message["type"] == "http.request" and not more:
        return body  # the common case: the whole body in one message
    parts = [body]
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break
        parts.append(message.get("body", b""))
        more = message.get("more_body", False)
    if message["type"] == "http.disconnect":
        raise Cancelled("the client disconnected before sending its whole body")
    return b"".join(parts)


async def until_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work` in this task unless the client goes away first: then this task is cancelled, which
    withdraws the request's queued inputs (see `Frontend.infer`), and `Cancelled` is raised. One
    watcher task per request, instead of a task for the work, one for the watch and a wait on both."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    def on_message(watch: asyncio.Future[dict[str, object]]) -> None:
        nonlocal gone
        if (
            not watch.cancelled()
            and watch.exception() is None
            and watch.result()["type"] == "http.disconnect"
        ):
            gone = True
            task.cancel()

    watcher: asyncio.Future[dict[str, object]] = asyncio.ensure_future(receive())  # type: ignore[arg-type]
    watcher.add_done_callback(on_message)
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()
        raise Cancelled("the client disconnected before the answer was ready") from None
    finally:
        watcher.remove_done_callback(on_message)
        watcher.cancel()


class EmbeddingsEndpoint:
    """POST /v1/embeddings as a bare ASGI endpoint (errors, accounting and disconnects included)."""

    def __init__(self, service: Frontend) -> None:
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        service = self.service
        headers = [_JSON_HEADERS]
        try:
            body = _DECODER.decode(await read_body(receive))
            priority, timeout = header_options(scope["headers"])
            payload = await until_disconnected(receive, embed(service, body, priority, timeout))
        except CarpoolError as exc:
            status = status_of(exc)
            if isinstance(exc, Cancelled):
                if not scope.get(BODY_REFUSED):  # else the front door counts it as 413
                    service.tally.answered(status)
                return  # nobody to answer
            service.tally.answered(status)
            payload = orjson.dumps(
                error_payload(scope["path"], status, exc.message, getattr(exc, "param", None))
            )
            wait = retry_after(exc.retry_after_s)
            if wait:
                headers.append((b"retry-after", wait.encode()))
        except Exception as exc:
            log.exception("POST %s failed", scope["path"])
            status = 500
            service.tally.answered(status)
            message = f"internal error: {type(exc).__name__}: {exc}"
            payload = orjson.dumps(error_payload(scope["path"], status, message))
        else:
            status = 200
            service.tally.answered(200, time.perf_counter() - started)
        headers.append((b"content-length", str(len(payload)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


# -- FastAPI routes ----------------------------------------------------------------------------------


def _service(request: Request) -> Frontend:
    service: Frontend = request.app.state.service
    return service


@router.post(
    "/v1/embeddings",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": schema(EmbeddingRequest)}},
        }
    },
)
async def create_embeddings(request: Request) -> Response:
    """Embed one text or a list of texts with the served model (OpenAI-compatible)."""
    # Behind the front door `EmbeddingsEndpoint` answers this route; this function serves it where the
    # FastAPI app runs alone, with the same decoding and answer.
    service = _service(request)
    body = _DECODER.decode(await request.body())
    priority, timeout = request_options(request)
    payload = await serve(request, service, embed(service, body, priority, timeout))
    return Response(payload, media_type="application/json")


@router.get("/v1/models")
async def list_models(request: Request) -> JSONBody:
    service = _service(request)
    info = service.info
    data: list[dict[str, object]] = [
        {
            "id": service.name,
            "object": "model",
            "created": _STARTED,
            "owned_by": "carpool",
            # beyond OpenAI's fields (as vLLM adds max_model_len): what the engine serves the model as
            "task": info.task.value,
            "device": info.device,
            "dtype": info.dtype,
            "quantization": info.quantization,
            "engine": info.engine,
        }
    ]
    for adapter in service.adapters:  # vLLM's shape: an adapter names its base model as `parent`
        data.append(
            {
                "id": adapter.name,
                "object": "model",
                "created": _STARTED,
                "owned_by": "carpool",
                "root": adapter.source,
                "parent": adapter.parent,
            }
        )
    return JSONBody({"object": "list", "data": data})
