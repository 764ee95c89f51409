"""API-key authentication: with `server.api_keys_file` set, every request needs `Authorization: Bearer
<key>` except the few paths the kubelet and Prometheus call.

A pure ASGI middleware rather than a FastAPI dependency on each route, so that it denies by default:
a route added later (or one FastAPI adds itself, `/docs` and `/openapi.json`) is protected without
anyone remembering to. What stays open, and why:
- `/v2/health/live` and `/v2/health/ready`: the kubelet's probes carry no credentials, and a load
  balancer's health checks neither; they tell nothing about the model beyond "up" and "ready".
- `/metrics`, unless `server.metrics_port` serves it on a port of its own: Prometheus scrapes without
  the API key, and a NetworkPolicy (the operator renders one) limits who reaches the port. With
  `metrics_port` set the API port's `/metrics` needs a key like any other path.

Refusals are 401 in the project's error shapes (OpenAI's `{"error": {...}}`, KServe v2's
`{"error": "..."}`) with `WWW-Authenticate: Bearer` (RFC 6750: `error="invalid_token"` when a key was
presented but is not accepted). The request body is never read. Same scheme as vLLM's and TEI's
`--api-key`, so the openai SDK's `api_key` and tritonclient's `headers` work unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from carpool.runtime.api.errors import error_response
from carpool.runtime.api.keys import KeyFile
from carpool.runtime.config import ServerConfig

log = logging.getLogger(__name__)

HEALTH_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})
METRICS_PATH = "/metrics"


def open_paths(server: ServerConfig) -> frozenset[str]:
    """Paths served without a key: health always, /metrics while it is on the API port."""
    return HEALTH_PATHS if server.metrics_port is not None else HEALTH_PATHS | {METRICS_PATH}


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (scheme case-insensitive), else None."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


class ApiKeyAuth:
    """Pure ASGI middleware. `keys` is `keys.load_keys(server)`, built in `create_app` so that a missing
    or empty file stops the server at start-up; None (no `server.api_keys_file`) passes everything."""

    def __init__(
        self,
        app: ASGIApp,
        server: ServerConfig,
        keys: KeyFile | None,
        count: Callable[[int], None] | None = None,
        refused: Callable[[str], None] | None = None,
    ) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths(server)
        self.count = count
        """Counts a refused inference request (a POST) by its status, as `api.errors` counts the rest."""
        self.refused = refused
        """Counts every refusal, whatever the path, by reason (`missing_key`, `invalid_key`): what an alert
        on guessing or on a client left with an old key watches."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.keys is None or scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        token = bearer_token(request.headers.get("authorization"))
        if token is not None and self.keys.accepts(token):
            await self.app(scope, receive, send)
            return
        if token is None:
            message = "missing API key: send the header 'Authorization: Bearer <key>'"
            challenge = 'Bearer realm="carpool"'
            reason = "missing_key"
        else:
            message = "invalid API key"
            challenge = 'Bearer realm="carpool", error="invalid_token"'
            reason = "invalid_key"
        client = scope.get("client")
        log.debug("401 %s %s from %s: %s", scope["method"], scope["path"], client and client[0], message)
        response = error_response(request, 401, message)
        response.headers["WWW-Authenticate"] = challenge
        if self.count is not None and scope["method"] == "POST":
            self.count(401)
        if self.refused is not None:
            self.refused(reason)
        await response(scope, receive, send)
