"""The binary tensor data extension's codec (pure), checked against what tritonclient itself sends and
reads, so that the wire format is the protocol's and not our idea of it."""

from __future__ import annotations

import struct

import numpy as np
import orjson
import pytest
from tritonclient.http import InferInput, InferRequestedOutput, InferResult
from tritonclient.http._utils import _get_inference_request
from tritonclient.utils import serialize_byte_tensor

from carpool.runtime.api.v2_binary import (
    binary_outputs,
    decode_bytes,
    encode_bytes,
    encode_response,
    read_request,
)
from carpool.runtime.errors import InvalidInput


def triton_request(
    *inputs: InferInput, outputs: list[InferRequestedOutput] | None = None
) -> tuple[bytes, str]:
    body, json_size = _get_inference_request(list(inputs), "", outputs, 0, False, False, 0, None, None)
    return body, str(json_size)


def test_binary_inputs_as_tritonclient_sends_them_are_read_into_data() -> None:
    text = InferInput("text", [2], "BYTES")
    text.set_data_from_numpy(np.array(["héllo".encode(), b""], dtype=np.object_))
    ids = InferInput("ids", [2, 2], "INT64")
    ids.set_data_from_numpy(np.array([[1, -2], [3, 2**40]], dtype=np.int64))
    body, header_length = triton_request(text, ids)
    request = read_request(body, header_length)
    assert request["inputs"][0]["data"] == ["héllo", ""]
    assert request["inputs"][1]["data"] == [1, -2, 3, 2**40]
    assert "binary_data_size" not in request["inputs"][0]["parameters"]
    assert request["parameters"] == {"binary_data_output": True}


def test_a_json_body_without_the_header_is_read_as_json() -> None:
    assert read_request(b'{"inputs": []}', None) == {"inputs": []}


@pytest.mark.parametrize(
    ("mutate", "says"),
    [
        (lambda body, n: (body + b"\x00", n), "belong to no input"),
        (lambda body, n: (body[:-1], n), "only"),
        (lambda body, n: (body, "abc"), "must be an integer"),
        (lambda body, n: (body, str(len(body) + 1)), "but the body has"),
        (lambda body, n: (body, str(int(n) - 1)), "not valid JSON"),
    ],
)
def test_malformed_binary_bodies_are_refused_with_what_is_wrong(mutate: object, says: str) -> None:
    text = InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hello"], dtype=np.object_))
    body, header_length = mutate(*triton_request(text))  # type: ignore[operator]
    with pytest.raises(InvalidInput, match=says):
        read_request(body, header_length)


def test_bytes_elements_are_length_prefixed_little_endian_as_tritonclient_serializes_them() -> None:
    values = [b"a", b"", "€".encode()]
    assert encode_bytes(values) == serialize_byte_tensor(np.array(values, dtype=np.object_)).item()
    assert encode_bytes(values)[:4] == struct.pack("<I", 1)
    assert decode_bytes(encode_bytes(values)) == values
    with pytest.raises(InvalidInput, match="runs past"):
        decode_bytes(struct.pack("<I", 9) + b"abc")


def test_binary_outputs_follow_the_request_level_default_and_per_output_choices() -> None:
    names = ["probabilities", "label"]
    assert binary_outputs({}, names) == set()
    assert binary_outputs({"parameters": {"binary_data_output": True}}, names) == set(names)
    request = {
        "parameters": {"binary_data_output": True},
        "outputs": [{"name": "label", "parameters": {"binary_data": False}}],
    }
    assert binary_outputs(request, names) == {"probabilities"}


def test_a_binary_response_reads_back_in_tritonclient() -> None:
    matrix = np.array([[0.25, 0.75], [1.0, 0.0]], dtype=np.float32)
    response = {
        "model_name": "m",
        "outputs": [
            {"name": "probabilities", "datatype": "FP32", "shape": [2, 2], "data": matrix.ravel()},
            {"name": "label", "datatype": "BYTES", "shape": [2], "data": ["b", "a"]},
        ],
    }
    body, header_length = encode_response(response, {"probabilities", "label"})
    assert header_length is not None
    assert orjson.loads(body[:header_length])["outputs"][0]["parameters"] == {"binary_data_size": 16}
    result = InferResult.from_response_body(body, header_length=header_length)
    assert np.array_equal(result.as_numpy("probabilities"), matrix)
    assert result.as_numpy("label").tolist() == [b"b", b"a"]
    plain, none = encode_response(response, set())
    assert none is None and orjson.loads(plain)["outputs"][1]["data"] == ["b", "a"]
