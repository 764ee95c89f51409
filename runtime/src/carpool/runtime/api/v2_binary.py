"""The Open Inference Protocol's binary tensor data extension, both ways. Pure: bytes in, bytes out.

Triton's, KServe's and MLServer's client libraries send tensors this way by default: the body is a JSON
header of `Inference-Header-Content-Length` bytes, followed by the raw data of every input whose
`parameters.binary_data_size` says how many bytes it takes, in input order. Numbers are little-endian in
row-major order; a BYTES tensor is each element as a 4-byte little-endian length and then its bytes.
Responses do the same for the outputs the client asks in binary (`parameters.binary_data` on a requested
output, else `parameters.binary_data_output` on the request): their `data` is left out of the JSON and
`parameters.binary_data_size` gives the length of each one's bytes after the header.

`api.v2` decodes requests with `read_request` and encodes responses with `encode_response`.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import orjson

from carpool.runtime.errors import InvalidInput

HEADER_LENGTH = "inference-header-content-length"
BINARY_EXTENSION = "binary_tensor_data"

NUMERIC: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}


def read_request(body: bytes, header_length: str | None) -> dict[str, Any]:
    """The request as JSON, with the data of binary inputs decoded into each input's `data`."""
    if header_length is None:
        return _json(body, "the request body")
    try:
        length = int(header_length)
    except ValueError:
        raise InvalidInput(
            f"Inference-Header-Content-Length must be an integer, got {header_length!r}"
        ) from None
    if not 0 < length <= len(body):
        raise InvalidInput(f"Inference-Header-Content-Length is {length} but the body has {len(body)} bytes")
    request = _json(body[:length], "the inference header")
    rest = memoryview(body)[length:]
    offset = 0
    inputs = request.get("inputs")
    for tensor in inputs if isinstance(inputs, list) else []:
        parameters = tensor.get("parameters") if isinstance(tensor, dict) else None
        if not isinstance(parameters, dict) or "binary_data_size" not in parameters:
            continue
        size = parameters.pop("binary_data_size")
        name = tensor.get("name")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidInput(f"input {name!r}: binary_data_size must be a byte count, got {size!r}")
        if "data" in tensor:
            raise InvalidInput(f"input {name!r} has both data and binary_data_size: send one")
        if offset + size > len(rest):
            raise InvalidInput(
                f"input {name!r} claims {size} bytes of binary data at offset {offset}, but only "
                f"{len(rest) - offset} follow the header"
            )
        tensor["data"] = decode_tensor(
            str(name), tensor.get("datatype"), tensor.get("shape"), bytes(rest[offset : offset + size])
        )
        offset += size
    if offset != len(rest):
        raise InvalidInput(
            f"{len(rest) - offset} bytes after the inference header belong to no input "
            "(each binary input needs parameters.binary_data_size)"
        )
    return request


def _json(raw: bytes | memoryview, what: str) -> dict[str, Any]:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidInput(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def decode_tensor(name: str, datatype: object, shape: object, raw: bytes) -> list[Any]:
    """The flat element list of a tensor sent in binary (BYTES elements become text)."""
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise InvalidInput(f"input {name!r}: shape must be a list of non-negative integers, got {shape!r}")
    count = math.prod(shape)
    if datatype == "BYTES":
        values = decode_bytes(raw, name)
        if len(values) != count:
            raise InvalidInput(f"input {name!r} has shape {shape} but {len(values)} BYTES elements")
        try:
            return [value.decode() for value in values]
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"input {name!r}: an element is not UTF-8 text ({exc.reason})") from None
    dtype = NUMERIC.get(str(datatype))
    if dtype is None:
        raise InvalidInput(f"input {name!r}: datatype {datatype!r} is not supported in binary form")
    if len(raw) != count * dtype.itemsize:
        raise InvalidInput(
            f"input {name!r}: shape {shape} of {datatype} takes {count * dtype.itemsize} bytes, "
            f"got {len(raw)}"
        )
    numbers: list[Any] = np.frombuffer(raw, dtype=dtype).tolist()
    return numbers


def decode_bytes(raw: bytes, name: str = "tensor") -> list[bytes]:
    """Elements of a BYTES tensor: each a 4-byte little-endian length, then that many bytes."""
    values, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InvalidInput(f"input {name!r}: BYTES data ends inside an element's 4-byte length")
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise InvalidInput(f"input {name!r}: a BYTES element of {size} bytes runs past the data")
        values.append(raw[offset : offset + size])
        offset += size
    return values


def encode_bytes(values: list[str] | list[bytes]) -> bytes:
    parts = []
    for value in values:
        data = value.encode() if isinstance(value, str) else value
        parts.append(struct.pack("<I", len(data)))
        parts.append(data)
    return b"".join(parts)


def encode_tensor(datatype: str, data: Any) -> bytes:
    if datatype == "BYTES":
        return encode_bytes(list(data))
    return np.ascontiguousarray(data, dtype=NUMERIC[datatype]).tobytes()


def binary_outputs(request: dict[str, Any], names: list[str]) -> set[str]:
    """Which of the response's outputs go in binary, as the request asks."""
    parameters = request.get("parameters") or {}
    default = parameters.get("binary_data_output") is True
    wanted = dict.fromkeys(names, default)
    for output in request.get("outputs") or []:
        binary = (output.get("parameters") or {}).get("binary_data")
        if output.get("name") in wanted and isinstance(binary, bool):
            wanted[output["name"]] = binary
    return {name for name, binary in wanted.items() if binary}


def encode_response(response: dict[str, Any], binary: set[str]) -> tuple[bytes, int | None]:
    """The response body and, if any output went in binary, the length of its JSON header."""
    if not binary:
        return orjson.dumps(response, option=orjson.OPT_SERIALIZE_NUMPY), None
    chunks = []
    outputs = []
    for output in response["outputs"]:
        if output["name"] in binary:
            raw = encode_tensor(output["datatype"], output["data"])
            output = {k: v for k, v in output.items() if k != "data"}
            output["parameters"] = {**output.get("parameters", {}), "binary_data_size": len(raw)}
            chunks.append(raw)
        outputs.append(output)
    header = orjson.dumps({**response, "outputs": outputs}, option=orjson.OPT_SERIALIZE_NUMPY)
    return header + b"".join(chunks), len(header)
