"""KServe v2 gRPC messages to and from what `api.v2_infer` takes and gives. Pure: messages in, messages out.

Inputs arrive in `raw_input_contents` (what tritonclient and KServe's client send by default: one bytes
field per input, a BYTES tensor as 4-byte little-endian lengths each followed by the element, numbers
little-endian and row-major, as the HTTP binary extension has them) or in each input's typed `contents`
(`bytes_contents` for BYTES). Outputs go back the way the inputs came, as KServe's own servers answer:
raw when the request was raw (the bytes of the float32 rows, one copy), else typed `contents`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from carpool.runtime.api.grpc import grpc_predict_v2_pb2 as pb
from carpool.runtime.api.v2_binary import decode_bytes, encode_tensor
from carpool.runtime.api.v2_infer import V2Call, text_values
from carpool.runtime.errors import InvalidInput


def parameter_values(parameters: Any) -> dict[str, Any]:
    """A protobuf map of `InferParameter` as the Python values a JSON body would carry."""
    values: dict[str, Any] = {}
    for key, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        if choice is None:
            raise InvalidInput(f"parameters.{key} has no value")
        values[key] = getattr(parameter, choice)
    return values


def set_parameters(target: Any, values: dict[str, Any]) -> None:
    """Write Python values into a protobuf map of `InferParameter` (bool, int, float, text)."""
    for key, value in values.items():
        parameter = target[key]
        if isinstance(value, bool):
            parameter.bool_param = value
        elif isinstance(value, int):
            parameter.int64_param = value
        elif isinstance(value, float):
            parameter.double_param = value
        else:
            parameter.string_param = str(value)


def _texts(name: str, elements: list[bytes]) -> list[str]:
    try:
        return [element.decode() for element in elements]
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"input {name!r}: an element is not UTF-8 text ({exc.reason})") from None


def call_of(request: pb.ModelInferRequest) -> V2Call:
    """The decoded call: the one BYTES input's texts, parameters, requested outputs and id."""
    if len(request.inputs) != 1:
        raise InvalidInput(f"expected one input tensor of texts, got {len(request.inputs)}")
    tensor = request.inputs[0]
    raw = request.raw_input_contents
    if raw:
        if len(raw) != 1:
            raise InvalidInput(f"raw_input_contents has {len(raw)} entries for 1 input: send one per input")
        if tensor.HasField("contents"):
            raise InvalidInput(
                f"input {tensor.name!r} has contents while the request has raw_input_contents: send one"
            )
        if tensor.datatype != "BYTES":  # named before the bytes are read as texts
            raise InvalidInput(f"input {tensor.name!r} has datatype {tensor.datatype}; text inputs are BYTES")
        elements = decode_bytes(raw[0], tensor.name)
    else:
        elements = list(tensor.contents.bytes_contents)
    texts = text_values(tensor.name, tensor.datatype, list(tensor.shape), _texts(tensor.name, elements))
    outputs = [output.name for output in request.outputs] or None
    return V2Call(
        request.model_name, texts, parameter_values(request.parameters), outputs, request.id or None
    )


def response_of(answer: dict[str, Any], raw: bool) -> pb.ModelInferResponse:
    """The gRPC response of `api.v2_infer.infer`'s answer; tensors in `raw_output_contents` if `raw`."""
    response = pb.ModelInferResponse(
        model_name=answer["model_name"], model_version=answer["model_version"], id=answer.get("id", "")
    )
    set_parameters(response.parameters, answer["parameters"])
    for output in answer["outputs"]:
        tensor = response.outputs.add(name=output["name"], datatype=output["datatype"], shape=output["shape"])
        data = output["data"]
        if raw:
            response.raw_output_contents.append(encode_tensor(output["datatype"], data))
        elif output["datatype"] == "BYTES":
            tensor.contents.bytes_contents.extend(value.encode() for value in data)
        else:
            tensor.contents.fp32_contents.extend(np.asarray(data, dtype=np.float32).tolist())
    return response


def metadata_of(metadata: dict[str, Any]) -> pb.ModelMetadataResponse:
    """`api.v2_infer.model_metadata` as the gRPC message (which has no field for its parameters)."""
    response = pb.ModelMetadataResponse(
        name=metadata["name"], versions=metadata["versions"], platform=metadata["platform"]
    )
    for field in ("inputs", "outputs"):
        for tensor in metadata[field]:
            getattr(response, field).add(
                name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"]
            )
    return response
