"""KServe v2 Open Inference Protocol: model metadata, readiness and inference for text models.

Text goes in as one BYTES tensor; outputs are `embedding` (FP32 [n, dim]) for embedding models, and
`probabilities` (FP32 [n, labels]) plus `label` (BYTES [n]) for classifiers. Tensors travel as JSON or
with the binary tensor data extension (`api.v2_binary`), in both directions, as the client asks; the body
is read whatever its Content-Type, as Triton's and KServe's clients send it.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError
from starlette.responses import Response

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
from carpool.runtime.config import Task
from carpool.runtime.errors import InvalidInput, ModelNotFound
from carpool.runtime.sampling import SamplingParams

router = APIRouter(tags=["v2"])


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


def _texts(body: InferRequest) -> list[str]:
    if len(body.inputs) != 1:
        raise InvalidInput(f"expected one input tensor of texts, got {len(body.inputs)}")
    tensor = body.inputs[0]
    if tensor.datatype != "BYTES":
        raise InvalidInput(f"input {tensor.name!r} has datatype {tensor.datatype}; text inputs are BYTES")
    values = _flatten(tensor.data)
    if any(dim < 0 for dim in tensor.shape) or math.prod(tensor.shape) != len(values):
        raise InvalidInput(f"input {tensor.name!r} has shape {tensor.shape} but {len(values)} elements")
    for index, value in enumerate(values):
        if not isinstance(value, str):
            raise InvalidInput(
                f"input {tensor.name!r} element {index} is {type(value).__name__}, not a string"
            )
    return values


def _options(request: Request, parameters: dict[str, Any] | None) -> tuple[int | None, float | None]:
    priority, timeout = request_options(request)
    parameters = parameters or {}
    if "priority" in parameters:
        if not isinstance(parameters["priority"], int) or isinstance(parameters["priority"], bool):
            raise InvalidInput(f"parameters.priority must be an integer, got {parameters['priority']!r}")
        priority = parameters["priority"]
    if "timeout" in parameters:
        if not isinstance(parameters["timeout"], int | float) or isinstance(parameters["timeout"], bool):
            raise InvalidInput(f"parameters.timeout must be seconds, got {parameters['timeout']!r}")
        timeout = float(parameters["timeout"])
    return priority, timeout


def _service(request: Request, name: str) -> Frontend:
    service: Frontend = request.app.state.service
    check_model(service, name)
    return service


_SAMPLING_KEYS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int}


def _sampling(service: Frontend, parameters: dict[str, Any]) -> tuple[SamplingParams, bool]:
    values: dict[str, Any] = {}
    for key, kind in _SAMPLING_KEYS.items():
        if key in parameters:
            value = parameters[key]
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or (kind is int and value != int(value))
            ):
                raise InvalidInput(f"parameters.{key} must be {kind.__name__}, got {value!r}")
            values[key] = kind(value)
    stop = parameters.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidInput("parameters.stop must be a string or a list of strings")
    given = "max_tokens" in values
    values.setdefault("max_tokens", service.config.generation.default_max_tokens)
    try:
        return SamplingParams(stop=tuple(s for s in stop if s), **values), given
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"invalid sampling parameters: {exc}") from exc


async def _generate(
    request: Request,
    service: Frontend,
    body: InferRequest,
    texts: list[str],
    priority: int | None,
    timeout_s: float | None,
    adapter: str | None = None,
) -> dict[str, Any]:
    """Text generation over v2: one `text_input` BYTES [1] in, one `text_output` BYTES [1] out; a LoRA
    `adapter` is addressed by its name in the path."""
    if len(texts) != 1:
        raise InvalidInput(f"text generation takes one prompt per request, got {len(texts)}")
    unknown = {output.name for output in body.outputs or []} - {"text_output"}
    if unknown:
        raise InvalidInput(f"unknown outputs requested: {sorted(unknown)}; this model outputs text_output")
    params, given = _sampling(service, body.parameters or {})
    if params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0 or params.max_tokens < 1:
        raise InvalidInput(
            "parameters out of range: temperature >= 0, 0 < top_p <= 1, top_k >= 0, max_tokens >= 1"
        )

    async def run() -> tuple[str, str, int, int]:
        generation = await service.generate(
            params,
            prompt=texts[0],
            priority=priority,
            timeout_s=timeout_s,
            max_tokens_given=given,
            adapter=adapter,
        )
        parts, finish = [], None
        try:
            async for delta in generation.deltas:
                parts.append(delta.text)
                finish = delta.finish_reason
        finally:
            await generation.deltas.aclose()
        return "".join(parts), finish or "cancelled", generation.prompt_tokens, generation.completion_tokens

    text, finish, prompt_tokens, completion_tokens = await serve(request, service, run())
    response: dict[str, Any] = {
        "model_name": adapter or service.name,
        "model_version": "1",
        "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [1], "data": [text]}],
        "parameters": {
            "finish_reason": finish,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
        },
    }
    if body.id is not None:
        response["id"] = body.id
    return response


def _check_version(version: str) -> None:
    if version != "1":
        raise ModelNotFound(f"model version {version!r} is not served here; the only version is '1'")


@router.get("/v2")
async def server_metadata() -> JSONBody:
    from importlib.metadata import version

    return JSONBody({"name": "carpool", "version": version("carpool"), "extensions": [BINARY_EXTENSION]})


@router.get("/v2/models/{name}")
async def model_metadata(name: str, request: Request) -> JSONBody:
    info = _service(request, name).info
    if info.task is Task.GENERATE:
        outputs = [{"name": "text_output", "datatype": "BYTES", "shape": [1]}]
    elif info.task is Task.EMBED:
        outputs = [{"name": "embedding", "datatype": "FP32", "shape": [-1, info.dimensions]}]
    else:
        outputs = [
            {"name": "probabilities", "datatype": "FP32", "shape": [-1, len(info.labels)]},
            {"name": "label", "datatype": "BYTES", "shape": [-1]},
        ]
    parameters: dict[str, Any] = {
        "task": info.task.value,
        "max_input_tokens": info.max_input_tokens,
        "labels": info.labels,
        "device": info.device,
        "dtype": info.dtype,
        "quantization": info.quantization,
    }
    if name != info.name:  # a LoRA adapter of the served model
        parameters["parent"] = info.name
    return JSONBody(
        {
            "name": name,
            "versions": ["1"],
            "platform": "pytorch_transformers",
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
            "outputs": outputs,
            "parameters": parameters,
        }
    )


@router.get("/v2/models/{name}/versions/{version}")
async def model_version_metadata(name: str, version: str, request: Request) -> JSONBody:
    _check_version(version)
    return await model_metadata(name, request)


@router.get("/v2/models/{name}/versions/{version}/ready")
async def model_version_ready(name: str, version: str, request: Request) -> JSONBody:
    _check_version(version)
    return await model_ready(name, request)


@router.get("/v2/models/{name}/ready")
async def model_ready(name: str, request: Request) -> JSONBody:
    service = _service(request, name)
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
    _check_version(version)
    return await infer(name, request)


@router.post("/v2/models/{name}/infer", openapi_extra=_INFER_BODY)
async def infer(name: str, request: Request) -> Response:
    service: Frontend = request.app.state.service
    adapter = service.resolve(name)  # the engine answers 404 for an adapter it does not serve
    raw = read_request(await request.body(), request.headers.get(HEADER_LENGTH))
    body = _request(raw)
    info = service.info
    texts = _texts(body)
    priority, timeout = _options(request, body.parameters)
    if info.task is Task.GENERATE:
        return _respond(await _generate(request, service, body, texts, priority, timeout, adapter), raw)
    result = await serve(request, service, service.infer(texts, priority, timeout))
    matrix = result.outputs.astype(np.float32, copy=False)
    if info.task is Task.EMBED:
        outputs: list[dict[str, Any]] = [
            {"name": "embedding", "datatype": "FP32", "shape": list(matrix.shape), "data": matrix.ravel()}
        ]
    else:
        labels = [info.labels[int(i)] for i in matrix.argmax(axis=1)]
        outputs = [
            {
                "name": "probabilities",
                "datatype": "FP32",
                "shape": list(matrix.shape),
                "data": matrix.ravel(),
            },
            {"name": "label", "datatype": "BYTES", "shape": [len(labels)], "data": labels},
        ]
    if body.outputs:
        wanted = {output.name for output in body.outputs}
        unknown = wanted - {output["name"] for output in outputs}
        if unknown:
            raise InvalidInput(f"unknown outputs requested: {sorted(unknown)}")
        outputs = [output for output in outputs if output["name"] in wanted]
    response: dict[str, Any] = {
        "model_name": info.name,
        "model_version": "1",
        "outputs": outputs,
        "parameters": {"prompt_tokens": result.prompt_tokens},
    }
    if body.id is not None:
        response["id"] = body.id
    return _respond(response, raw)
