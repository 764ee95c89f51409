"""The generated gRPC code is what grpcio-tools makes of the committed proto, as the chart's generated
files are checked in tests/chart/test_generated.py."""

from __future__ import annotations

from carpool.runtime.api.grpc import generate


def test_the_generated_grpc_code_is_up_to_date() -> None:
    problems = generate.stale()
    assert problems == [], (
        "run `python -m carpool.runtime.api.grpc.generate` and commit the result:\n" + "\n".join(problems)
    )


def test_the_messages_live_in_a_pool_of_their_own_beside_tritonclients() -> None:
    """tritonclient's generated code registers the same `inference.*` names in protobuf's default pool."""
    import tritonclient.grpc.service_pb2 as triton

    from carpool.runtime.api.grpc import grpc_predict_v2_pb2 as ours

    request = ours.ModelInferRequest(model_name="m", raw_input_contents=[b"\x01\x00\x00\x00a"])
    request.parameters["temperature"].double_param = 0.5
    theirs = triton.ModelInferRequest.FromString(request.SerializeToString())
    assert theirs.model_name == "m" and theirs.parameters["temperature"].double_param == 0.5
