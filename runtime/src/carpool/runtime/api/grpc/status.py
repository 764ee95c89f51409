"""Domain errors as gRPC status codes, in one place, as `api.errors` maps them to HTTP statuses.

Each error keeps its HTTP status (`api.errors.status_of`), which is also what `carpool_requests_total`
counts it as whatever the protocol, and the gRPC code is the one that status stands for (the mapping
grpc-gateway and Google's APIs use): 400 INVALID_ARGUMENT, 401 UNAUTHENTICATED, 403 PERMISSION_DENIED,
404 NOT_FOUND, 429 RESOURCE_EXHAUSTED, 499 CANCELLED, 500 INTERNAL, 503 UNAVAILABLE, 504
DEADLINE_EXCEEDED. A suggested wait (queue full, not ready, draining) travels as a `google.rpc.RetryInfo`
in the status details (`grpc-status-details-bin`, what gRPC's rich error model reads) and as a
`retry-after` trailer in whole seconds, as the HTTP answer's Retry-After header.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from carpool.runtime.api.errors import retry_after, status_of
from carpool.runtime.errors import CarpoolError

CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


@dataclass(frozen=True)
class Failure:
    """What a failed call answers: its HTTP-equivalent status (for the metrics) and its gRPC status."""

    http_status: int
    status: grpc.Status


class _Status(grpc.Status):  # type: ignore[misc]
    def __init__(
        self, code: grpc.StatusCode, details: str, trailing_metadata: tuple[tuple[str, object], ...]
    ):
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata


def rich_status(code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> grpc.Status:
    """A status with `message`, and with a suggested wait in its details and trailers when given."""
    wait = retry_after(retry_after_s)
    if wait is None:
        return _Status(code, message, ())
    info = any_pb2.Any()
    info.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=int(wait))))
    status = rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=[info]))
    return _Status(code, message, (*status.trailing_metadata, ("retry-after", wait)))


def failure(exc: CarpoolError) -> Failure:
    http = status_of(exc)
    code = CODES.get(http, grpc.StatusCode.INTERNAL)
    return Failure(http, rich_status(code, exc.message, exc.retry_after_s))
