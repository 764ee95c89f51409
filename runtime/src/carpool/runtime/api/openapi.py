"""The OpenAPI document, made true in one place rather than route by route.

FastAPI derives the document from the routes; this module then corrects what it cannot know:
- every error a route can answer is documented with its JSON body (OpenAI routes and v2 routes carry
  different shapes, see `api.errors`), and FastAPI's 422 is replaced by the 400 the server really sends;
- only the routes of the served task are listed (an embedding server does not advertise completions;
  the routes of other tasks still answer, with a 400 that names the route to use);
- the v2 infer body, which the route reads itself (JSON or the binary extension), is described;
- the server's own limits (inputs per request, the context) bound the request schemas, so that the schema
  admits what validation admits;
- for a model on vLLM's engine, the OpenAI routes that vLLM's own server answers (`api.surface.ROUTES`)
  are described by vLLM's own document, asked of that server once the model is ready: its request
  bodies (every field it takes) and success answers, beside carpool's error answers (`with_vllm_routes`).

`create_app` calls `install(app)`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from typing import Any

import orjson
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from carpool.runtime.api import rerank, surface
from carpool.runtime.api.frontend import Frontend
from carpool.runtime.api.v2 import InferRequest
from carpool.runtime.config import RuntimeConfig, Task
from carpool.runtime.errors import CarpoolError
from carpool.runtime.wire import EngineInfo

log = logging.getLogger(__name__)

_SCHEMAS = "#/components/schemas/"

_V2_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string", "description": "What is wrong, for a person to read."}},
}
_OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["integer", "null"]},
            },
        }
    },
}

_WHY = {
    400: "The request is malformed or over a limit (types, an empty input, too many inputs, an input over "
    "the token limit, prompt plus max_tokens over the context or the KV cache); the body says which.",
    404: "The model (or model version) named is not served here.",
    405: "The method is not allowed on this path; the Allow header lists those that are.",
    413: "The body is larger than server.max_body_bytes.",
    429: "The queue is full; retry after Retry-After seconds.",
    500: "The model failed on the batch holding this request.",
    503: "The model is loading, warming up or draining; retry after Retry-After seconds.",
    504: "The request waited past its deadline and was never run.",
}
_RETRY_AFTER = {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait."}}

# Routes that serve one task only, and the tasks they serve.
_V2_INFER_TASKS = {Task.EMBED, Task.CLASSIFY, Task.GENERATE}
_TASK_ROUTES = {
    "/v1/embeddings": {Task.EMBED},
    "/v1/completions": {Task.GENERATE},
    "/v1/chat/completions": {Task.GENERATE},
    "/tokenize": {Task.GENERATE},
    "/detokenize": {Task.GENERATE},
    "/v1/rerank": {Task.RERANK},
    "/v2/models/{name}/infer": _V2_INFER_TASKS,
    "/v2/models/{name}/versions/{version}/infer": _V2_INFER_TASKS,
}
_LORA_ROUTES = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
"""Documented only where the server serves LoRA adapters and allows loading them at run time."""


def _errors_for(path: str, method: str) -> list[int]:
    if method == "post":
        return [400, 404, 405, 413, 429, 500, 503, 504]
    if "{name}" in path:
        return [404, 405, 503]
    if path == "/v2/health/ready":
        return [405, 503]
    return [405]


def _response(status: int, path: str) -> dict[str, Any]:
    schema = "V2Error" if path.startswith("/v2") else "OpenAIError"
    response: dict[str, Any] = {
        "description": _WHY[status],
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
    }
    if status in (429, 503):
        response["headers"] = _RETRY_AFTER
    if status == 405:
        response["headers"] = {"Allow": {"schema": {"type": "string"}, "description": "Allowed methods."}}
    return response


def build(
    app: FastAPI, config: RuntimeConfig, info: EngineInfo | None = None, vocabulary: int | None = None
) -> dict[str, Any]:
    """The corrected document for `app` serving `config`'s task (and, once loaded, `info`'s model, whose
    tokenizer has `vocabulary` ids)."""
    infer_schema = InferRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    task = info.task if info is not None else config.model.task  # a classify folder may serve rerank
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas["V2Error"] = _V2_ERROR
    schemas["OpenAIError"] = _OPENAI_ERROR
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    defs = infer_schema.pop("$defs", {})
    schemas.update(defs)
    schemas["InferRequest"] = infer_schema
    schemas.update(rerank.SCHEMAS)
    paths: dict[str, dict[str, Any]] = document["paths"]
    for path in list(paths):
        updates = config.lora.active and config.lora.runtime_updates
        if task not in _TASK_ROUTES.get(path, {task}) or (path in _LORA_ROUTES and not updates):
            del paths[path]
            continue
        for method, operation in paths[path].items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status in _errors_for(path, method):
                responses[str(status)] = _response(status, path)
            if path.endswith("/infer"):
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok["content"] = {
                    "application/json": {"schema": {"type": "object"}},
                    "application/octet-stream": {
                        "schema": {"type": "string", "format": "binary"},
                        "description": "Outputs asked for in binary: a JSON header of "
                        "Inference-Header-Content-Length bytes, then their data.",
                    },
                }
    embeddings = paths.get("/v1/embeddings", {}).get("post", {}).get("requestBody", {})
    body = embeddings.get("content", {}).get("application/json", {})
    if "schema" in body and "$ref" not in body["schema"]:
        # The route's body is msgspec's schema, inline (api.openai): a component of its own, as the
        # pydantic bodies are, so that the server's limits below find it by name.
        schemas["EmbeddingRequest"] = body["schema"]
        body["schema"] = {"$ref": "#/components/schemas/EmbeddingRequest"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        if path in paths:
            ok = paths[path]["post"]["responses"]["200"]
            ok["content"]["text/event-stream"] = {
                "schema": {  # one server-sent event: a JSON chunk, or [DONE] at the end
                    "type": "object",
                    "required": ["data"],
                    "properties": {"data": {"type": "string"}},
                },
                "description": "With stream: true, server-sent events ending in `data: [DONE]`.",
            }
    if "/metrics" in paths:
        paths["/metrics"]["get"]["responses"]["200"]["content"] = {
            "text/plain": {"schema": {"type": "string"}}
        }
    _bound(schemas, config, info, task)
    tokens = schemas.get("DetokenizeRequest", {}).get("properties", {}).get("tokens", {})
    if vocabulary is not None and "items" in tokens:
        tokens["items"]["maximum"] = vocabulary - 1  # an id the model does not have is refused (400)
    return document


def _bound(schemas: dict[str, Any], config: RuntimeConfig, info: EngineInfo | None, task: Task) -> None:
    """Put the server's limits (configured, and the loaded model's) into the request schemas."""
    dimensions = schemas.get("EmbeddingRequest", {}).get("properties", {}).get("dimensions")
    if dimensions is not None and info is not None and info.dimensions is not None:
        dimensions["anyOf"] = [{"type": "integer", "enum": [info.dimensions]}, {"type": "null"}]
    limit = config.batching.items_limit
    embedding = schemas.get("EmbeddingRequest", {}).get("properties", {}).get("input")
    for option in (embedding or {}).get("anyOf", []):
        if option.get("type") == "array":
            option["maxItems"] = limit
    documents = schemas.get("RerankRequest", {}).get("properties", {}).get("documents")
    if documents is not None:
        documents["maxItems"] = limit
    outputs = {
        Task.EMBED: ["embedding"],
        Task.CLASSIFY: ["probabilities", "label"],
        Task.GENERATE: ["text_output"],
    }.get(task)
    if outputs is not None:  # a rerank server has no v2 infer route
        schemas.get("RequestedOutput", {}).get("properties", {}).get("name", {})["enum"] = outputs
    context = config.generation.max_model_len
    for name in ("CompletionRequest", "ChatRequest"):
        properties = schemas.get(name, {}).get("properties", {})
        for key in ("max_tokens", "max_completion_tokens"):
            for option in properties.get(key, {}).get("anyOf", []):
                if option.get("type") == "integer" and context is not None:
                    option["maximum"] = context - 1
        for key in ("logprobs", "top_logprobs"):
            for option in properties.get(key, {}).get("anyOf", []):
                if option.get("type") == "integer":
                    option["maximum"] = config.generation.max_logprobs
        if "n" in properties:
            properties["n"]["maximum"] = limit  # n choices are n sequences in the queue (api.completions)


def with_vllm_routes(document: dict[str, Any], vllm: dict[str, Any]) -> dict[str, Any]:
    """`document` with the routes of `api.surface.ROUTES` as vLLM's own server documents them (`vllm`, its
    /openapi.json): the request body and the success answer of each, and any answer vLLM documents that
    carpool's do not (its 501); carpool's error answers stay (the fronts answer 429, 503 and 504 with
    Retry-After before vLLM's server sees the request, in the same error shape). The schemas vLLM's parts
    refer to come along under their own names (prefixed `vllm.` where carpool has another of that name),
    and carpool's own request schemas for those routes, now unused, go."""
    document = copy.deepcopy(document)
    paths: dict[str, dict[str, Any]] = document["paths"]
    schemas: dict[str, Any] = document.setdefault("components", {}).setdefault("schemas", {})
    theirs: dict[str, Any] = vllm.get("components", {}).get("schemas", {})
    taken: dict[tuple[str, str], dict[str, Any]] = {}
    streams: dict[tuple[str, str], Any] = {}
    for method, path in surface.ROUTES:
        key = (path, method.lower())
        ours = paths.get(path, {}).get(key[1])
        operation = vllm.get("paths", {}).get(path, {}).get(key[1])
        if ours is None or operation is None:
            continue
        responses = ours.setdefault("responses", {})
        parts: dict[str, Any] = {"requestBody": operation.get("requestBody"), "responses": {}}
        for status, answer in operation.get("responses", {}).items():
            if status == "200" or (status not in responses and status != "422"):
                parts["responses"][status] = answer
        taken[key] = parts
        ours.pop("requestBody", None)
        ok = responses.pop("200", {})
        streams[key] = ok.get("content", {}).get("text/event-stream")
    kept = _reachable(_refs(paths), schemas)
    for name in list(schemas):
        if name not in kept:
            del schemas[name]
    needed = _reachable(_refs(taken), theirs)
    names = {
        name: f"vllm.{name}" if name in schemas and schemas[name] != theirs[name] else name for name in needed
    }
    for name in needed:
        schemas[names[name]] = _renamed(theirs[name], names)
    for (path, method), parts in taken.items():
        operation = paths[path][method]
        parts = _renamed(parts, names)
        operation["requestBody"] = parts["requestBody"]
        operation["responses"].update(parts["responses"])
        stream = streams[(path, method)]
        if stream is not None:  # carpool's description of the events; vLLM's has none
            operation["responses"]["200"].setdefault("content", {})["text/event-stream"] = stream
        operation["description"] = (
            "Answered by vLLM's own OpenAI server (the model is on vLLM's engine): the request body is "
            "vLLM's, with every field it takes."
        )
    return document


def _refs(node: object) -> Iterator[str]:
    """The component names that `$ref`s under `node` point to."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(_SCHEMAS):
            yield ref.removeprefix(_SCHEMAS)
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _reachable(roots: Iterator[str], schemas: dict[str, Any]) -> set[str]:
    """`roots` and every component they refer to, however deep."""
    seen: set[str] = set()
    todo = [name for name in roots if name in schemas]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(ref for ref in _refs(schemas[name]) if ref in schemas)
    return seen


def _renamed(node: Any, names: dict[str, str]) -> Any:
    """A copy of `node` whose `$ref`s point to the components' new names."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(_SCHEMAS):
            name = ref.removeprefix(_SCHEMAS)
            node = {**node, "$ref": _SCHEMAS + names.get(name, name)}
        return {key: value if key == "$ref" else _renamed(value, names) for key, value in node.items()}
    if isinstance(node, list):
        return [_renamed(value, names) for value in node]
    return node


async def vllm_document(service: Frontend) -> dict[str, Any] | None:
    """vLLM's own /openapi.json, asked of this front's surface process (None, logged, if it cannot
    answer)."""
    body = b""
    try:
        async for reply in service.relay("GET", "/openapi.json", [], b"", None, None):
            if reply.status != 200:
                log.warning("vLLM's server answered %s for its /openapi.json", reply.status)
                return None
            body += reply.body
    except CarpoolError as exc:
        log.warning("vLLM's /openapi.json could not be read: %s", exc.message)
        return None
    document: dict[str, Any] = orjson.loads(body)
    return document


def install(app: FastAPI, service: Frontend) -> None:
    """Serve the corrected document; it is kept once the model is loaded (its limits are known then, and
    for a model on vLLM's engine, vLLM's own document)."""
    vllm: list[dict[str, Any]] = []

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        info = service.info if service.ready else None
        vocabulary = service.vocabulary if info is not None and info.task is Task.GENERATE else None
        document = build(app, service.config, info, vocabulary)
        if info is not None and service.on_vllm:
            if not vllm:
                return document  # vLLM's part comes with a later request (`serve` asks for it first)
            document = with_vllm_routes(document, vllm[0])
        if info is not None:
            app.openapi_schema = document
        return document

    async def serve(request: Request) -> JSONResponse:
        if app.openapi_schema is None and not vllm and service.ready and service.on_vllm:
            theirs = await vllm_document(service)
            if theirs is not None:
                vllm.append(theirs)
        return JSONResponse(app.openapi())

    app.openapi = openapi  # type: ignore[method-assign]
    # FastAPI's own route calls `openapi()` from a synchronous function: this one may first ask vLLM.
    url = app.openapi_url
    app.router.routes[:] = [r for r in app.router.routes if not (isinstance(r, Route) and r.path == url)]
    if url is not None:
        app.add_route(url, serve, include_in_schema=False)
