"""The OpenAPI document describes the server: a property-based run (schemathesis, every check, the
stateful phase included) against a real embedding server, a real generation server and a real rerank
server (a small cross-encoder) on loopback finds nothing; and the document's promises a client reads are
checked directly."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from carpool.runtime.api import openapi
from carpool.runtime.models.loader import load_engine
from tests.runtime.conftest import Running, serve
from tests.runtime.cross_encoder import build_cross_encoder
from tests.runtime.factories import runtime_config
from tests.runtime.fakes import ScriptedEngine, ScriptedGenerator, factory

pytestmark = pytest.mark.slow  # servers on loopback and a schemathesis process

# Path parameters pinned to the served model, so that generated requests reach the model rather than
# stopping at 404 (unknown names are covered in test_api and test_clients).
CONFIG = """
[parameters]
name = "fake"
version = "1"

# A v2 tensor's shape must agree with its number of elements (shape [2] holds two texts): JSON Schema
# cannot tie one field to another, so a schema-valid body may still get that 400. Only there.
[[operations]]
include-path-regex = "/infer$"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "404", "429", "5xx"]

# Likewise the prompt's tokens plus max_tokens must fit the context, and chat's max_tokens and
# max_completion_tokens must agree when both are sent.
[[operations]]
include-path-regex = "completions$"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "404", "429", "5xx"]

# And a query-document pair's tokens must fit the model's limit.
[[operations]]
include-path-regex = "rerank$"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "404", "429", "5xx"]
"""


@pytest.fixture(scope="module")
def embedder() -> Iterator[Running]:
    config = runtime_config(model={"name": "fake"}, warmup={"enabled": False})
    with serve(config, factory(ScriptedEngine(max_input_tokens=4096))) as running:
        yield running


@pytest.fixture(scope="module")
def generator() -> Iterator[Running]:
    config = runtime_config(
        model={"name": "fake", "task": "generate"},
        generation={"max_model_len": 256, "default_max_tokens": 4},
        warmup={"enabled": False},
    )
    with serve(config, factory(ScriptedGenerator())) as running:
        yield running


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    folder = build_cross_encoder(tmp_path_factory.mktemp("cross-encoder"))
    config = runtime_config(
        model={"source": str(folder), "name": "fake", "task": "rerank"}, warmup={"enabled": False}
    )
    with serve(config, load_engine) as running:
        yield running


def schemathesis(running: Running, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(config),
        "run",
        f"{running.url}/openapi.json",
        "--checks",
        "all",
        "--phases",
        "examples,coverage,fuzzing,stateful",
        "--max-examples",
        "10",
        "--seed",
        "20261123",
        "--workers",
        "1",
        "--no-color",
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path, check=False)


@pytest.mark.parametrize("server", ["embedder", "generator", "reranker"])
def test_a_property_based_run_with_every_check_finds_nothing(
    server: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    running: Running = request.getfixturevalue(server)
    result = schemathesis(running, tmp_path)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert "Stateful" in result.stdout


def test_only_the_served_tasks_routes_are_documented_with_every_error(
    embedder: Running, generator: Running, reranker: Running
) -> None:
    embedding = embedder.client.get("/openapi.json").json()
    generation = generator.client.get("/openapi.json").json()
    reranking = reranker.client.get("/openapi.json").json()
    assert "/v1/embeddings" in embedding["paths"] and "/v1/completions" not in embedding["paths"]
    assert "/v1/completions" in generation["paths"] and "/v1/embeddings" not in generation["paths"]
    assert "/v1/rerank" not in embedding["paths"] and "/v1/rerank" not in generation["paths"]
    assert "/v1/rerank" in reranking["paths"] and "/v1/embeddings" not in reranking["paths"]
    rerank = reranking["paths"]["/v1/rerank"]["post"]
    assert {"400", "404", "413", "429", "503", "504"} <= set(rerank["responses"])
    schemas = generation["components"]["schemas"]
    counts = [
        schemas["CompletionRequest"]["properties"]["logprobs"],
        schemas["ChatRequest"]["properties"]["top_logprobs"],
    ]  # bounded by generation.max_logprobs
    assert [[o.get("maximum") for o in c["anyOf"] if o["type"] == "integer"] for c in counts] == [[20], [20]]
    documents = reranking["components"]["schemas"]["RerankRequest"]["properties"]["documents"]
    assert documents["minItems"] == 1 and documents["maxItems"] == 256
    responses = embedding["paths"]["/v1/embeddings"]["post"]["responses"]
    assert {"400", "404", "413", "429", "503", "504"} <= set(responses) and "422" not in responses
    assert responses["429"]["headers"]["Retry-After"]
    error = responses["400"]["content"]["application/json"]["schema"]["$ref"]
    assert embedding["components"]["schemas"][error.rsplit("/", 1)[1]]["required"] == ["error"]
    v2 = embedding["paths"]["/v2/models/{name}/infer"]["post"]["responses"]["400"]
    assert v2["content"]["application/json"]["schema"]["$ref"].endswith("/V2Error")
    text = embedding["components"]["schemas"]["EmbeddingRequest"]["properties"]["input"]["anyOf"][0]
    assert text["minLength"] == 1  # an empty input is refused, and the schema says so


def test_a_wrong_method_gets_405_with_allow(embedder: Running) -> None:
    response = embedder.client.delete("/v1/embeddings")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert "error" in response.json()


def test_vllms_routes_bring_their_schemas_and_carpools_of_the_same_name_stay_where_still_used() -> None:
    """For a model on vLLM's engine the OpenAI routes take vLLM's request bodies and success answers with
    the schemas those refer to; carpool's own schemas that only those routes used go, and where carpool
    still uses another schema of a name vLLM's uses too, vLLM's is renamed (`vllm.`), never overwritten.
    (A two-route document in vLLM's shape: the vLLM tier compares the real one, tests/vllm/test_surface.)"""
    ours: dict[str, Any] = {
        "paths": {
            "/v1/completions": {
                "post": {
                    "requestBody": {
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Own"}}}
                    },
                    "responses": {
                        "200": {"content": {"text/event-stream": {"description": "events"}}},
                        "429": {},
                    },
                }
            },
            "/v2/models/{name}/infer": {
                "post": {
                    "requestBody": {
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Shared"}}}
                    }
                }
            },
        },
        "components": {"schemas": {"Own": {"type": "object"}, "Shared": {"type": "string"}}},
    }
    vllm: dict[str, Any] = {
        "paths": {
            "/v1/completions": {
                "post": {
                    "requestBody": {
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Req"}}}
                    },
                    "responses": {
                        "200": {"content": {"application/json": {"schema": {}}}},
                        "422": {},
                        "501": {},
                    },
                }
            }
        },
        "components": {
            "schemas": {
                "Req": {"properties": {"x": {"$ref": "#/components/schemas/Shared"}}},
                "Shared": {"type": "integer"},
                "Unused": {},
            }
        },
    }
    merged = openapi.with_vllm_routes(ours, vllm)
    operation = merged["paths"]["/v1/completions"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Req"
    }
    assert set(operation["responses"]) == {"200", "429", "501"}
    assert operation["responses"]["200"]["content"]["text/event-stream"] == {"description": "events"}
    assert merged["components"]["schemas"] == {
        "Shared": {"type": "string"},  # carpool's, still used by the v2 route
        "vllm.Shared": {"type": "integer"},
        "Req": {"properties": {"x": {"$ref": "#/components/schemas/vllm.Shared"}}},
    }
    assert ours["components"]["schemas"]["Own"] == {"type": "object"}, "the input was changed"
