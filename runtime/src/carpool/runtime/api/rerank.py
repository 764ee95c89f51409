"""`POST /v1/rerank`: a cross-encoder scores query-document pairs, in the shape Cohere's and Jina's rerank
APIs (and the clients and retrieval stacks written for them) send and read.

Request: `query`, `documents` (strings, or objects with `text`), optional `top_n`, `return_documents`
and `model`. Response: `results`, one per document (the `top_n` best when given), sorted by
`relevance_score`, highest first, each with the document's `index` in the request and, when
`return_documents` is true, the `document` itself (`{"text": ...}`); plus `id`, `model` and `usage`.
TEI's own `/rerank` (`texts` in, a bare list of `index` and `score` out) is the same operation in
another shape; the common ground of both (an index into the request and a score per result, best first)
is what this route answers.

Each pair is one input to the engine, tokenized as a text pair (token type 1 for the document where the
model uses token types), and batched with every other request's inputs under the same token budget.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import msgspec
import numpy as np
import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from carpool.runtime.api.bodies import BodyDecoder
from carpool.runtime.api.common import request_options, serve
from carpool.runtime.api.frontend import Frontend
from carpool.runtime.api.openai import check_model

router = APIRouter(tags=["rerank"])

Text = Annotated[str, msgspec.Meta(min_length=1)]


class Document(msgspec.Struct):
    """A document as an object (Cohere's form): its `text` is ranked; other keys are ignored."""

    text: Annotated[Text, msgspec.Meta(description="The text to score against the query.")]


class RerankRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Score each document's relevance to the query (Cohere / Jina `POST /v1/rerank`)."""

    query: Annotated[Text, msgspec.Meta(description="The query every document is scored against.")]
    documents: Annotated[
        list[Text | Document],
        msgspec.Meta(min_length=1, description="The documents: strings, or objects with `text`."),
    ]
    top_n: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        msgspec.Meta(description="Return only the best n results (all when unset or larger)."),
    ] = None
    return_documents: Annotated[
        bool, msgspec.Meta(description='Include each result\'s document (`{"text": ...}`).')
    ] = False
    model: Annotated[
        str | None, msgspec.Meta(description="The served model's name (any other is 404); optional.")
    ] = None


_DECODER = BodyDecoder(RerankRequest)
SCHEMAS = msgspec.json.schema_components([RerankRequest], ref_template="#/components/schemas/{name}")[1]
"""The request's JSON schema and the ones it refers to, for /openapi.json's components."""


def ranked(body: RerankRequest, texts: list[str], scores: np.ndarray[Any, Any]) -> list[dict[str, object]]:
    """The results, best first (ties in request order), cut to `top_n`."""
    order = np.argsort(-scores, kind="stable")[: body.top_n]
    results: list[dict[str, object]] = []
    for index in order.tolist():
        result: dict[str, object] = {"index": index, "relevance_score": float(scores[index])}
        if body.return_documents:
            result["document"] = {"text": texts[index]}
        results.append(result)
    return results


@router.post(
    "/v1/rerank",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RerankRequest"}}},
        }
    },
)
async def rerank(request: Request) -> Response:
    """Score documents against a query with the served cross-encoder (Cohere / Jina rerank)."""
    service: Frontend = request.app.state.service
    body = _DECODER.decode(await request.body())
    check_model(service, body.model)
    priority, timeout = request_options(request)
    texts = [document if isinstance(document, str) else document.text for document in body.documents]
    result = await serve(request, service, service.rerank(body.query, texts, priority, timeout))
    scores = result.outputs[:, 0].astype(np.float32, copy=False)
    tokens = result.prompt_tokens
    answer = {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": service.name,
        "results": ranked(body, texts, scores),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return Response(orjson.dumps(answer), media_type="application/json")
