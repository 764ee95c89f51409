"""KServe v2 Open Inference Protocol: model metadata, readiness and inference for text models.

The HTTP side of the protocol: the work between a decoded request and the answer's tensors is
`api.v2_infer`'s, which `api.grpc` shares. Text goes in as one BYTES tensor; outputs are `embedding`
(FP32 [n, dim]) for embedding models, and `probabilities` (FP32 [n, labels]) plus `label` (BYTES [n])
for classifiers. Tensors travel as JSON or
with the binary tensor data extension (`api.v2_binary`), in both directions, as the client asks; the body
is read whatever its Content-Type, as Triton's and KServe's clients send it.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError
from starlette.responses import Response

from carpool.runtime.api import v2_infer
from carpool.runtime.api.common import request_options, serve
from carpool.runtime.api.frontend import Frontend
from carpool.runtime.api.openai import check_model
from carpool.runtime.api.responses import JSONBody
from carpool.runtime.api.v2_binary import (
    BINARY_EXTENSION,
    HEADER_LENGTH,
    binary_outputs,
    encode_response,
    read_request,
)
from carpool.runtime.api.v2_infer import V2Call, check_version, text_values
from carpool.runtime.errors import InvalidInput

router = APIRouter(tags=["v2"])
T = TypeVar("T")


class InferTensor(BaseModel):
    # Keys beyond the protocol's are ignored, not refused: client libraries add their own.
    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    shape: list[Annotated[int, Field(ge=1)]] = Field(min_length=1)
    # The schema names what the server serves (non-empty texts as BYTES); validation says why otherwise.
    datatype: StrictStr = Field(json_schema_extra={"enum": ["BYTES"]})
    data: list[Any] = Field(min_length=1, json_schema_extra={"items": {"type": "string", "minLength": 1}})
    parameters: dict[str, Any] | None = None


class RequestedOutput(BaseModel):
    name: StrictStr
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[InferTensor] = Field(min_length=1, max_length=1)
    outputs: list[RequestedOutput] | None = None


def _flatten(data: list[Any]) -> list[Any]:
    flat: list[Any] = []
    for value in data:
        if isinstance(value, list):
            flat.extend(_flatten(value))
        else:
            flat.append(value)
    return flat


def _call(name: str, body: InferRequest) -> V2Call:
    if len(body.inputs) != 1:
        raise InvalidInput(f"expected one input tensor of texts, got {len(body.inputs)}")
    tensor = body.inputs[0]
    texts = text_values(tensor.name, tensor.datatype, tensor.shape, _flatten(tensor.data))
    outputs = [output.name for output in body.outputs] if body.outputs else None
    return V2Call(name, texts, body.parameters or {}, outputs, body.id)


@router.get("/v2")
async def server_metadata() -> JSONBody:
    from importlib.metadata import version

    return JSONBody({"name": "carpool", "version": version("carpool"), "extensions": [BINARY_EXTENSION]})


@router.get("/v2/models/{name}")
async def model_metadata(name: str, request: Request) -> JSONBody:
    service: Frontend = request.app.state.service
    return JSONBody(v2_infer.model_metadata(service, name))


@router.get("/v2/models/{name}/versions/{version}")
async def model_version_metadata(name: str, version: str, request: Request) -> JSONBody:
    check_version(version)
    return await model_metadata(name, request)


@router.get("/v2/models/{name}/versions/{version}/ready")
async def model_version_ready(name: str, version: str, request: Request) -> JSONBody:
    check_version(version)
    return await model_ready(name, request)


@router.get("/v2/models/{name}/ready")
async def model_ready(name: str, request: Request) -> JSONBody:
    service: Frontend = request.app.state.service
    check_model(service, name)
    return JSONBody({"name": name, "ready": service.ready}, status_code=200 if service.ready else 503)


def _request(raw: dict[str, Any]) -> InferRequest:
    try:
        return InferRequest.model_validate(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


def _respond(response: dict[str, Any], raw: dict[str, Any]) -> Response:
    binary = binary_outputs(raw, [output["name"] for output in response["outputs"]])
    content, header_length = encode_response(response, binary)
    if header_length is None:
        return Response(content, media_type="application/json")
    return Response(
        content,
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(header_length)},
    )


# The route reads its body itself (JSON, or the binary extension); the document describes the JSON form,
# which is the protocol's base, and names the extension (a binary body is only valid with its header,
# which OpenAPI cannot tie to a content type).
_INFER_BODY: dict[str, Any] = {
    "description": "Inference on the served model. Tensors may also travel with the binary tensor data "
    "extension: a JSON header of Inference-Header-Content-Length bytes, then each binary input's data "
    "(parameters.binary_data_size bytes); outputs come back in binary when the request sets "
    "parameters.binary_data_output or an output's parameters.binary_data.",
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/InferRequest"}}},
    },
}


@router.post("/v2/models/{name}/versions/{version}/infer", openapi_extra=_INFER_BODY)
async def infer_version(name: str, version: str, request: Request) -> Response:
    check_version(version)
    return await infer(name, request)


@router.post("/v2/models/{name}/infer", openapi_extra=_INFER_BODY)
async def infer(name: str, request: Request) -> Response:
    service: Frontend = request.app.state.service
    service.resolve(name)  # an unknown model is 404 before its body is read
    raw = read_request(await request.body(), request.headers.get(HEADER_LENGTH))
    call = _call(name, _request(raw))
    priority, timeout = request_options(request)

    def guard(work: Awaitable[T]) -> Awaitable[T]:
        return serve(request, service, work)

    return _respond(await v2_infer.infer(service, call, priority, timeout, guard), raw)
