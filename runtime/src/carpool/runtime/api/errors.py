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

BODY_REFUSED = "carpool.body_refused"
"""Set in the scope of a request whose body was refused with 413 (see `api.limits`)."""

STATUS = errors.STATUS

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
    504: "timeout",
}


status_of = errors.status_of


def error_payload(path: str, status: int, message: str, param: str | None = None) -> dict[str, object]:
    """The error body in the shape of the protocol that `path` belongs to."""
    if path.startswith("/v2"):
        return {"error": message}
    return {
        "error": {
            "message": message,
            "type": _OPENAI_TYPES.get(status, "server_error"),
            "param": param,
            "code": status,
        }
    }


def retry_after(retry_after_s: float | None) -> str | None:
    """The Retry-After header value (whole seconds, at least 1) for a suggested wait, if any."""
    return str(max(1, math.ceil(retry_after_s))) if retry_after_s else None


def error_response(
    request: Request,
    status: int,
    message: str,
    retry_after_s: float | None = None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONBody:
    all_headers = dict(headers or {})
    wait = retry_after(retry_after_s)
    if wait:
        all_headers["Retry-After"] = wait
    return JSONBody(
        error_payload(request.url.path, status, message, param), status_code=status, headers=all_headers
    )


def _describe(error: dict[str, object]) -> tuple[str, str | None]:
    location = [str(part) for part in error.get("loc", ()) if part != "body"]  # type: ignore[attr-defined]
    where = ".".join(location) or "body"
    return f"{where}: {error.get('msg', 'invalid')}", where


def _count(request: Request, status: int) -> None:
    # Inference requests only (probes and scrapes are not counted); a body refused with 413 is counted
    # as that by the front door, whatever the route then made of it.
    if request.method == "POST" and not request.scope.get(BODY_REFUSED):
        request.app.state.service.metrics.count_request(status)


def install(app: FastAPI) -> None:
    """Register the handlers that turn every error into a JSON body (never an HTML page or a crash),
    and count each failed inference request by its status."""

    @app.exception_handler(errors.CarpoolError)
    async def _domain(request: Request, exc: errors.CarpoolError) -> JSONBody:
        status = status_of(exc)
        _count(request, status)
        return error_response(request, status, exc.message, exc.retry_after_s, getattr(exc, "param", None))

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
