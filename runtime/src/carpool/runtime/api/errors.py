"""Maps domain errors to HTTP status codes, in one place, with bodies in each protocol's shape.

OpenAI routes answer `{"error": {"message", "type", "param", "code"}}`; KServe v2 routes answer
`{"error": "<message>"}` as the Open Inference Protocol says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from carpool.runtime import errors
from carpool.runtime.api.responses import JSONBody

STATUS: dict[type[errors.CarpoolError], int] = {
    errors.InvalidInput: 400,
    errors.ModelNotFound: 404,
    errors.QueueFull: 429,
    errors.Cancelled: 499,
    errors.BatchFailed: 500,
    errors.OutOfMemory: 500,
    errors.NotReady: 503,
    errors.DeadlineExceeded: 504,
}

_OPENAI_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
    504: "timeout",
}


def status_of(exc: errors.CarpoolError) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def error_response(
    request: Request,
    status: int,
    message: str,
    retry_after_s: float | None = None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONBody:
    headers = dict(headers or {})
    if retry_after_s:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    if request.url.path.startswith("/v2"):
        body: dict[str, object] = {"error": message}
    else:
        body = {
            "error": {
                "message": message,
                "type": _OPENAI_TYPES.get(status, "server_error"),
                "param": param,
                "code": status,
            }
        }
    return JSONBody(body, status_code=status, headers=headers)


def _describe(error: dict[str, object]) -> tuple[str, str | None]:
    location = [str(part) for part in error.get("loc", ()) if part != "body"]  # type: ignore[attr-defined]
    where = ".".join(location) or "body"
    return f"{where}: {error.get('msg', 'invalid')}", where


def _count(request: Request, status: int) -> None:
    if request.method == "POST":  # inference requests; probes and scrapes are not counted
        request.app.state.service.metrics.count_request(status)


def install(app: FastAPI) -> None:
    """Register the handlers that turn every error into a JSON body (never an HTML page or a crash),
    and count each failed inference request by its status."""

    @app.exception_handler(errors.CarpoolError)
    async def _domain(request: Request, exc: errors.CarpoolError) -> JSONBody:
        status = status_of(exc)
        _count(request, status)
        return error_response(request, status, exc.message, exc.retry_after_s)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONBody:
        problems = [_describe(error) for error in exc.errors()]
        message = "; ".join(text for text, _ in problems[:5]) or "invalid request body"
        _count(request, 400)
        return error_response(request, 400, message, param=problems[0][1] if problems else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONBody:
        _count(request, exc.status_code)
        # exc.headers carries Starlette's Allow on 405
        return error_response(request, exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONBody:
        _count(request, 500)
        return error_response(request, 500, f"internal error: {type(exc).__name__}: {exc}")
