"""`inference.GRPCInferenceService`: KServe v2 over gRPC, on the front's `Frontend` like the HTTP routes.

ModelInfer decodes the request (`tensors`), takes priority and timeout from the `x-carpool-priority` and
`x-carpool-timeout` metadata as HTTP takes them from headers, then from the request's parameters, caps
the timeout at the call's deadline, and runs `api.v2_infer.infer`: the same validation, tokenization,
admission, queue and batches as the HTTP route. A client that cancels (or whose deadline passes) cancels
the handler, which withdraws its inputs from the engine's queue. Errors become status codes in
`status`; every call is counted in `carpool_requests_total{protocol="grpc"}` as HTTP's are.

The model repository RPCs (load, unload) stay UNIMPLEMENTED, as the generated base class answers: one
model per server, loaded at start-up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from importlib.metadata import version
from typing import Any, NoReturn, TypeAlias, TypeVar

import grpc

from carpool.runtime.api import v2_infer
from carpool.runtime.api.common import PRIORITY_HEADER, TIMEOUT_HEADER, parse_options
from carpool.runtime.api.frontend import Frontend
from carpool.runtime.api.grpc import grpc_predict_v2_pb2 as pb
from carpool.runtime.api.grpc import grpc_predict_v2_pb2_grpc as pb_grpc
from carpool.runtime.api.grpc.status import failure
from carpool.runtime.api.grpc.tensors import call_of, metadata_of, response_of
from carpool.runtime.api.openai import check_model
from carpool.runtime.errors import CarpoolError, DeadlineExceeded

log = logging.getLogger(__name__)
T = TypeVar("T")
Context: TypeAlias = Any
"""grpc.aio.ServicerContext (grpc ships no types)."""


def metadata_options(metadata: Sequence[tuple[str, Any]] | None) -> tuple[int | None, float | None]:
    """(priority, timeout) from the call's metadata, with the HTTP headers' names and messages."""
    priority = timeout = None
    for key, value in metadata or ():
        if key == PRIORITY_HEADER:
            priority = str(value)
        elif key == TIMEOUT_HEADER:
            timeout = str(value)
    return parse_options(priority, timeout)


async def _abort(context: Context, exc: CarpoolError) -> NoReturn:
    status = failure(exc).status
    await context.abort(status.code, status.details, status.trailing_metadata)
    raise AssertionError("unreachable: abort raises")


async def _awaited(work: Awaitable[T]) -> T:
    return await work


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    """The servicer one front registers on its gRPC server."""

    def __init__(self, service: Frontend) -> None:
        self.service = service
        self.duration = service.metrics.request_durations["grpc"]

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.service.live)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.service.ready)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        try:
            if request.version:
                v2_infer.check_version(request.version)
            check_model(self.service, request.name)
        except CarpoolError as exc:
            await _abort(context, exc)
        return pb.ModelReadyResponse(ready=self.service.ready)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Context
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="carpool", version=version("carpool"))

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: Context
    ) -> pb.ModelMetadataResponse:
        try:
            if request.version:
                v2_infer.check_version(request.version)
            return metadata_of(v2_infer.model_metadata(self.service, request.name))
        except CarpoolError as exc:
            await _abort(context, exc)

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
        started = time.perf_counter()
        service = self.service
        try:
            if request.model_version:
                v2_infer.check_version(request.model_version)
            call = call_of(request)
            priority, timeout = metadata_options(context.invocation_metadata())
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded("the call's deadline passed before it was queued")
            answer = await v2_infer.infer(service, call, priority, timeout, _awaited, remaining)
        except CarpoolError as exc:
            found = failure(exc)
            service.metrics.count_request(found.http_status, "grpc")
            await context.abort(found.status.code, found.status.details, found.status.trailing_metadata)
        except asyncio.CancelledError:  # the client cancelled, or its deadline passed: nobody to answer
            service.metrics.count_request(499, "grpc")
            raise
        except Exception as exc:
            log.exception("ModelInfer failed")
            service.metrics.count_request(500, "grpc")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
        response = response_of(answer, raw=len(request.raw_input_contents) > 0)
        service.metrics.count_request(200, "grpc")
        self.duration.observe(time.perf_counter() - started)
        return response
