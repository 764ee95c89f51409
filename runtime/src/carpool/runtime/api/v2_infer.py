"""KServe v2 inference whatever the transport: what `api.v2` (HTTP) and `api.grpc` (gRPC) both do between
a decoded request and the answer's tensors, so the two protocols validate, queue and answer alike.

The transports decode their own bodies (JSON or binary tensors over HTTP; `contents` or
`raw_input_contents` over gRPC) into a `V2Call`, read priority and timeout from their own headers or
metadata, and encode the answer `infer` returns (the v2 response as a dict whose tensors hold numpy
arrays or lists of text). Errors are the domain errors of `carpool.runtime.errors`; each transport maps
them to its status codes.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from carpool.runtime.api.frontend import Frontend
from carpool.runtime.api.openai import check_model
from carpool.runtime.config import Task
from carpool.runtime.errors import InvalidInput, ModelNotFound
from carpool.runtime.sampling import SamplingParams

T = TypeVar("T")
Guard = Callable[[Awaitable[Any]], Awaitable[Any]]
"""How a transport awaits the work of one request: withdrawing it if the client leaves, counting it."""

PLATFORM = "pytorch_transformers"


@dataclass
class V2Call:
    """One decoded inference request."""

    model: str
    """The model named in the path (HTTP) or in `model_name` (gRPC): the served model or a LoRA adapter."""
    texts: list[str]
    """The elements of the one BYTES input tensor, in row-major order (see `text_values`)."""
    parameters: dict[str, Any]
    """The request's parameters: priority, timeout, sampling."""
    outputs: list[str] | None = None
    """Names of the requested outputs; None for all."""
    id: str | None = None


def text_values(name: str, datatype: str, shape: list[int], values: list[Any]) -> list[str]:
    """The texts of an input tensor: BYTES, as many elements as its shape says, each a string."""
    if datatype != "BYTES":
        raise InvalidInput(f"input {name!r} has datatype {datatype}; text inputs are BYTES")
    if any(dim < 0 for dim in shape) or math.prod(shape) != len(values):
        raise InvalidInput(f"input {name!r} has shape {shape} but {len(values)} elements")
    for index, value in enumerate(values):
        if not isinstance(value, str):
            raise InvalidInput(f"input {name!r} element {index} is {type(value).__name__}, not a string")
    return values


def check_version(version: str) -> None:
    if version != "1":
        raise ModelNotFound(f"model version {version!r} is not served here; the only version is '1'")


def options(
    parameters: dict[str, Any], priority: int | None, timeout: float | None
) -> tuple[int | None, float | None]:
    """Priority and timeout: the request's parameters override what its headers (or metadata) said."""
    if "priority" in parameters:
        if not isinstance(parameters["priority"], int) or isinstance(parameters["priority"], bool):
            raise InvalidInput(f"parameters.priority must be an integer, got {parameters['priority']!r}")
        priority = parameters["priority"]
    if "timeout" in parameters:
        if not isinstance(parameters["timeout"], int | float) or isinstance(parameters["timeout"], bool):
            raise InvalidInput(f"parameters.timeout must be seconds, got {parameters['timeout']!r}")
        timeout = float(parameters["timeout"])
    return priority, timeout


def model_metadata(service: Frontend, name: str) -> dict[str, Any]:
    """The v2 model metadata of the served model, or of one of its LoRA adapters (`name`)."""
    check_model(service, name)
    info = service.info
    if info.task is Task.GENERATE:
        outputs = [{"name": "text_output", "datatype": "BYTES", "shape": [1]}]
    elif info.task is Task.EMBED:
        outputs = [{"name": "embedding", "datatype": "FP32", "shape": [-1, info.dimensions]}]
    elif info.task is Task.RERANK:
        outputs = []  # a cross-encoder scores text pairs through POST /v1/rerank, not v2 infer
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
        "engine": info.engine,
    }
    if name != info.name:  # a LoRA adapter of the served model
        parameters["parent"] = info.name
    return {
        "name": name,
        "versions": ["1"],
        "platform": PLATFORM,
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
        "outputs": outputs,
        "parameters": parameters,
    }


async def infer(
    service: Frontend,
    call: V2Call,
    priority: int | None,
    timeout_s: float | None,
    guard: Guard,
    limit_s: float | None = None,
) -> dict[str, Any]:
    """The v2 response to `call`: `priority` and `timeout_s` as the transport read them (parameters
    override them), the timeout at most `limit_s` (a gRPC call's deadline); `guard` awaits the work."""
    adapter = service.resolve(call.model)  # the engine answers 404 for an adapter it does not serve
    priority, timeout_s = options(call.parameters, priority, timeout_s)
    if limit_s is not None:
        timeout_s = limit_s if timeout_s is None else min(timeout_s, limit_s)
    info = service.info
    if info.task is Task.GENERATE:
        return await _generate(service, call, priority, timeout_s, adapter, guard)
    result = await guard(service.infer(call.texts, priority, timeout_s))
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
    if call.outputs:
        wanted = set(call.outputs)
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
    if call.id is not None:
        response["id"] = call.id
    return response


_SAMPLING_KEYS = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "seed": int,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
    "min_tokens": int,
}


_NOT_OFFERED = ("logprobs", "top_logprobs")
"""Sampling options of the OpenAI routes that v2 does not offer: refused, rather than ignored."""

_OTHER_KEYS = frozenset({"stop", "priority", "timeout"})
_CLIENT_KEYS = frozenset({"binary_data_output", "sequence_id", "sequence_start", "sequence_end"})
"""Request parameters the Open Inference Protocol's client libraries add (tritonclient): not sampling."""


def _sampling(service: Frontend, parameters: dict[str, Any]) -> tuple[SamplingParams, bool]:
    for key in _NOT_OFFERED:
        if key in parameters:
            raise InvalidInput(
                f"parameters.{key} is not offered by v2 inference, which returns text_output only: "
                "ask POST /v1/completions (logprobs) or /v1/chat/completions (logprobs, top_logprobs)"
            )
    unknown = sorted(set(parameters) - set(_SAMPLING_KEYS) - _OTHER_KEYS - _CLIENT_KEYS)
    if unknown:
        offered = ", ".join([*_SAMPLING_KEYS, *sorted(_OTHER_KEYS)])
        raise InvalidInput(
            f"parameters.{unknown[0]} is not a sampling parameter of v2 generation (offered: {offered}); "
            "the OpenAI routes take the rest"
        )
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
    for key, default in service.sampling_defaults.items():  # the model's generation config, as vLLM
        values.setdefault(key, _SAMPLING_KEYS[key](default))
    try:
        return SamplingParams(stop=tuple(s for s in stop if s), **values), given
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"invalid sampling parameters: {exc}") from exc


async def _generate(
    service: Frontend,
    call: V2Call,
    priority: int | None,
    timeout_s: float | None,
    adapter: str | None,
    guard: Guard,
) -> dict[str, Any]:
    """Text generation over v2: one `text_input` BYTES [1] in, one `text_output` BYTES [1] out; a LoRA
    `adapter` is addressed by its name in the path."""
    texts = call.texts
    if len(texts) != 1:
        raise InvalidInput(f"text generation takes one prompt per request, got {len(texts)}")
    unknown = set(call.outputs or []) - {"text_output"}
    if unknown:
        raise InvalidInput(f"unknown outputs requested: {sorted(unknown)}; this model outputs text_output")
    params, given = _sampling(service, call.parameters)
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

    text, finish, prompt_tokens, completion_tokens = await guard(run())
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
    if call.id is not None:
        response["id"] = call.id
    return response
