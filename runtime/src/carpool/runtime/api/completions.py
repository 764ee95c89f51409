"""OpenAI-compatible text generation: `POST /v1/completions` and `POST /v1/chat/completions`, with
`stream: true` as server-sent events ending in `data: [DONE]`.

The response starts only once the first token is out, so a request that waits past its deadline or is
refused still gets a proper status code (504, 503) instead of a broken stream.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Annotated, Any, Literal, Self, TypeVar

import orjson
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from starlette.responses import Response, StreamingResponse

from carpool.runtime.api.common import request_options, serve
from carpool.runtime.api.errors import status_of
from carpool.runtime.api.frontend import Delta, Frontend, Generation, TokenLogprob
from carpool.runtime.api.responses import JSONBody
from carpool.runtime.errors import CarpoolError
from carpool.runtime.sampling import SamplingParams

NonEmpty = Annotated[StrictStr, Field(min_length=1)]
"""A prompt text: an empty one is refused (400), and the schema says so."""

router = APIRouter(tags=["openai"])
T = TypeVar("T")

GREEDY_TEMPERATURE = 1e-5
"""Below this temperature vLLM samples greedily (its `_SAMPLING_EPS`)."""


def _whole(value: Any) -> Any:
    # JSON Schema counts 3.0 as an integer; strict mode alone would refuse it.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _only_false(value: Any) -> Any:
    if value is not False:
        raise ValueError("only false is supported")
    return value


def _count_or_false(value: Any) -> Any:
    # /v1/completions' logprobs: a count of top tokens (as OpenAI's legacy API and vLLM); false is none.
    if value is False:
        return None
    if isinstance(value, bool):
        raise ValueError("logprobs is the number of most likely tokens to return per token (0..N), not true")
    return _whole(value)


Whole = Annotated[int, BeforeValidator(_whole)]
"""An integer, also when written 3.0; never a string (the models are strict)."""
Positive = Annotated[
    int, BeforeValidator(_whole), Field(ge=1), WithJsonSchema({"type": "integer", "minimum": 1})
]
NonNegative = Annotated[
    int, BeforeValidator(_whole), Field(ge=0), WithJsonSchema({"type": "integer", "minimum": 0})
]
Count = Annotated[
    int,
    BeforeValidator(_whole),
    Field(ge=0, le=2**31 - 1),
    WithJsonSchema({"type": "integer", "minimum": 0, "maximum": 2**31 - 1}),
]
"""A token id or a token count (never past what the wire's integers carry)."""
OnlyFalse = Annotated[
    StrictBool, BeforeValidator(_only_false), WithJsonSchema({"type": "boolean", "enum": [False]})
]
"""A flag this server accepts only as false (0 is not false here: the models are strict)."""
LogprobsCount = Annotated[
    Annotated[int, Field(ge=0)] | None,
    BeforeValidator(_count_or_false),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 0},
                {"type": "boolean", "enum": [False]},
                {"type": "null"},
            ],
            "description": "Log-probabilities of each generated token and of the N most likely tokens at "
            "each position (at most generation.max_logprobs, 20 by default); false or null: none.",
        }
    ),
]


def _token_ids(value: Any) -> Any:
    # OpenAI's logit_bias: JSON object keys are strings; vLLM reads each as an integer token id (int()),
    # and clamps each bias to [-100, 100]. The vocabulary is checked once the model's is known (the front).
    if not isinstance(value, dict):
        return value
    biases: dict[int, Any] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"keys are token ids (integers written as strings), got {key!r}") from None
        if isinstance(bias, int | float) and not isinstance(bias, bool):
            bias = min(100.0, max(-100.0, float(bias)))
        biases[token] = bias
    return biases


LogitBias = Annotated[
    dict[int, float],
    BeforeValidator(_token_ids),
    Field(max_length=1024),
    WithJsonSchema(
        {
            "type": "object",
            "additionalProperties": {"type": "number"},
            "propertyNames": {"pattern": "^\\s*[+-]?[0-9]+\\s*$"},
            "description": "Token id (as a string) -> bias added to its logit before sampling, clamped to "
            "[-100, 100]; ids outside the model's vocabulary are refused.",
        }
    ),
]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class _GenerationRequest(BaseModel):
    # strict: the schema says boolean/number/integer, so "true" or "1.0" are refused, not coerced
    model_config = ConfigDict(extra="forbid", strict=True)

    model: StrictStr | None = None
    max_tokens: Positive | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    """Unset: the model's generation-config default, else 1."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    """Unset: the model's generation-config default, else 1."""
    top_k: NonNegative | None = None
    """Unset: the model's generation-config default, else 0 (no top-k filter)."""
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    """vLLM's: keep the tokens at least min_p times as likely as the most likely one (after temperature).
    Unset: the model's generation-config default, else 0 (none)."""
    seed: Annotated[Whole, WithJsonSchema({"type": "integer"})] | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=8)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Positive = 1
    """Independent choices of the same prompt (at most batching.max_items_per_request)."""
    logit_bias: LogitBias | None = None
    """Token id -> bias added to its logit before sampling (clamped to [-100, 100], as OpenAI and vLLM)."""
    user: StrictStr | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    """Subtracted from a token's logit for each time the output already holds it (OpenAI's, vLLM's)."""
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    """Subtracted from the logit of every token the output already holds."""
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    """vLLM's: a positive logit of a token in the prompt or the output divided by it, a negative one
    multiplied. Unset: the model's generation-config default, else 1 (none)."""
    min_tokens: Count = 0
    """Tokens generated before an end-of-text or stop token may come and stop strings are looked for."""
    stop_token_ids: Annotated[list[Count], Field(max_length=64)] | None = None
    """Token ids that end the answer as the end-of-text token does (vLLM's)."""
    ignore_eos: bool = False
    """Go on past the end-of-text token, to max_tokens (vLLM's)."""

    @model_validator(mode="after")
    def _min_within_max(self) -> Self:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be less than or equal to max_tokens ({self.max_tokens})"
            )
        return self

    def top_logprobs_asked(self) -> tuple[str, int] | None:
        """(field, N) where the request asks for logprobs with the N most likely tokens each."""
        return None

    def sampling(
        self, default_max_tokens: int, defaults: Mapping[str, float] | None = None
    ) -> tuple[SamplingParams, bool]:
        """The sampling settings; where the request is silent, the model's generation-config `defaults`
        (as vLLM's server applies them), else carpool's."""
        defaults = defaults or {}
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        given = self.max_tokens is not None
        temperature = self.temperature if self.temperature is not None else defaults.get("temperature", 1.0)
        top_p = self.top_p if self.top_p is not None else defaults.get("top_p", 1.0)
        top_k = self.top_k if self.top_k is not None else int(defaults.get("top_k", 0))
        min_p = self.min_p if self.min_p is not None else defaults.get("min_p", 0.0)
        repetition = self.repetition_penalty
        repetition = repetition if repetition is not None else defaults.get("repetition_penalty", 1.0)
        params = SamplingParams(
            max_tokens=self.max_tokens or default_max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=max(top_k, 0),
            min_p=min_p,
            seed=self.seed,
            stop=tuple(s for s in stop if s),
            logprobs=asked[1] if (asked := self.top_logprobs_asked()) is not None else None,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=repetition,
            min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logit_bias=dict(self.logit_bias or {}),
        )
        return params, given


class CompletionRequest(_GenerationRequest):
    prompt: NonEmpty | Annotated[list[NonEmpty], Field(min_length=1, max_length=1)]
    """The prompt (a list holds exactly one)."""
    echo: OnlyFalse = False
    suffix: None = None
    logprobs: LogprobsCount = None

    def top_logprobs_asked(self) -> tuple[str, int] | None:
        return None if self.logprobs is None else ("logprobs", self.logprobs)


class TextPart(BaseModel):
    """A content part of type text (OpenAI's `{"type": "text", "text": ...}`); other types are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "developer"]
    content: StrictStr | Annotated[list[TextPart], Field(min_length=1)]
    """A text, or content parts of type text (joined with newlines, as vLLM joins them for a chat
    template that takes a string)."""
    name: StrictStr | None = None
    """Passed to the chat template as the message's `name` (templates that know it use it)."""


def plain_messages(messages: list[Message]) -> list[dict[str, str]]:
    """The messages as the chat template sees them (`developer` is `system` to templates)."""
    plain = []
    for message in messages:
        content = message.content
        text = content if isinstance(content, str) else "\n".join(part.text for part in content)
        entry = {"role": message.role if message.role != "developer" else "system", "content": text}
        if message.name is not None:
            entry["name"] = message.name
        plain.append(entry)
    return plain


class ChatRequest(_GenerationRequest):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Positive | None = None
    logprobs: Annotated[
        StrictBool | None,
        Field(description="Return the log-probability of each generated token (choices[].logprobs.content)."),
    ] = None
    top_logprobs: Annotated[
        NonNegative | None,
        Field(
            description="With logprobs: true, also the N most likely tokens at each position (at most "
            "generation.max_logprobs, 20 by default)."
        ),
    ] = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError(f"top_logprobs ({value}) needs logprobs: true")
        return value

    def top_logprobs_asked(self) -> tuple[str, int] | None:
        return ("top_logprobs", self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _merge_max(self) -> ChatRequest:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError(
                    f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                    f"({self.max_completion_tokens}) differ: send one of them"
                )
            self.max_tokens = self.max_completion_tokens
        return self


def _service(request: Request) -> Frontend:
    service: Frontend = request.app.state.service
    return service


async def _start(
    request: Request, body: _GenerationRequest, prompt: str | None, messages: list[dict[str, str]] | None
) -> tuple[Frontend, list[Generation], list[Delta], str]:
    """The request's `n` generations started, each one's first delta, and the model name it answers as
    (an adapter's, or the served model's). A refusal of any choice (429, 504, ...) refuses the request:
    the other choices are withdrawn."""
    service = _service(request)
    asked, limit = body.top_logprobs_asked(), service.config.generation.max_logprobs
    if asked is not None and asked[1] > limit:
        problem = {"loc": ("body", asked[0]), "msg": f"at most {limit} on this server, got {asked[1]}"}
        raise RequestValidationError([{**problem, "type": "less_than_equal"}])
    most = service.config.batching.items_limit
    if body.n > most:  # as many sequences as an encoder request may hold inputs (one queue, one bound)
        problem = {"loc": ("body", "n"), "msg": f"at most {most} on this server, got {body.n}"}
        raise RequestValidationError([{**problem, "type": "less_than_equal"}])
    adapter = service.resolve(body.model)
    params, given = body.sampling(service.config.generation.default_max_tokens, service.sampling_defaults)
    if body.n > 1 and params.temperature < GREEDY_TEMPERATURE:
        # vLLM's `_verify_greedy_sampling`: n identical choices are not worth n sequences. (Greedy by
        # top_k 1, at a temperature above it, passes there too, and gives n identical choices.)
        problem = {"loc": ("body", "n"), "msg": f"must be 1 when using greedy sampling, got {body.n}"}
        raise RequestValidationError([{**problem, "type": "value_error"}])
    priority, timeout = request_options(request)

    async def first() -> tuple[list[Generation], list[Delta]]:
        generations = await service.generate_many(
            params,
            body.n,
            prompt=prompt,
            messages=messages,
            priority=priority,
            timeout_s=timeout,
            max_tokens_given=given,
            adapter=adapter,
        )
        try:
            return generations, await _together([anext(g.deltas) for g in generations])
        except BaseException:
            await _close(generations)
            raise

    generations, deltas = await serve(request, service, first(), count=False)
    return service, generations, deltas, adapter or service.name


async def _together(works: list[Awaitable[T]]) -> list[T]:
    """Await every one of `works` at once (each choice's sequence is in the engine's queue at the same
    time); the first failure, or a cancellation, cancels the others, which have ended when this raises."""
    if len(works) == 1:
        return [await works[0]]
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _close(generations: list[Generation]) -> None:
    for generation in generations:
        await generation.close()


Chunk = Callable[[int, str, "str | None", "list[TokenLogprob] | None"], dict[str, Any]]
"""One streamed (or the whole) answer of choice `index`: (index, text, finish reason, logprobs)."""


def _include_usage(body: _GenerationRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _usage(generations: list[Generation]) -> dict[str, int]:
    """vLLM's usage for `n` choices: the prompt counted once, every choice's tokens."""
    prompt = generations[0].prompt_tokens
    completion = sum(generation.completion_tokens for generation in generations)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# -- logprobs, in the shapes of vLLM's OpenAI server (which clamps -inf to OpenAI's -9999.0) -------------


def _floor(logprob: float) -> float:
    return max(logprob, -9999.0)


def _completion_logprobs(entries: list[TokenLogprob], top: int, offset: int) -> tuple[dict[str, Any], int]:
    """Legacy completions' `logprobs`: `top_logprobs` holds up to N+1 texts per position (the sampled
    token and the N most likely, by text), `text_offset` counts the tokens' texts from `offset`; and
    the offset after them (where the next chunk's tokens start)."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    logprobs = {
        "tokens": [entry.token for entry in entries],
        "token_logprobs": [_floor(entry.logprob) for entry in entries],
        "top_logprobs": [{text: _floor(value) for text, value in entry.top[: top + 1]} for entry in entries],
        "text_offset": offsets,
    }
    return logprobs, offset


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def _chat_logprobs(entries: list[TokenLogprob], top: int) -> dict[str, Any]:
    """Chat's `logprobs`: one item per token, with its N first alternatives (sampled token first)."""
    return {
        "content": [
            {
                "token": entry.token,
                "logprob": _floor(entry.logprob),
                "bytes": _utf8(entry.token),
                "top_logprobs": [
                    {"token": text, "logprob": _floor(value), "bytes": _utf8(text)}
                    for text, value in entry.top[:top]
                ],
            }
            for entry in entries
        ]
    }


async def _collect(generation: Generation, first: Delta) -> tuple[str, str, list[TokenLogprob]]:
    parts = [first.text]
    logprobs = list(first.logprobs or ())
    finish = first.finish_reason
    try:
        while finish is None:
            delta = await anext(generation.deltas, None)
            if delta is None:
                break
            parts.append(delta.text)
            logprobs.extend(delta.logprobs or ())
            finish = delta.finish_reason
    finally:
        await generation.close()
    return "".join(parts), finish or "cancelled", logprobs


async def _collect_all(
    generations: list[Generation], firsts: list[Delta]
) -> list[tuple[str, str, list[TokenLogprob]]]:
    """Every choice's (text, finish reason, logprobs); an error in one ends them all (and is raised)."""
    try:
        return await _together([_collect(g, first) for g, first in zip(generations, firsts, strict=True)])
    finally:
        await _close(generations)  # choices whose collection never began


async def _merged(
    generations: list[Generation], firsts: list[Delta]
) -> AsyncGenerator[tuple[int, Delta], None]:
    """Every choice's deltas as (index, delta) in the order they come, each up to its finish reason; an
    error in one is raised here and ends the others."""
    if len(generations) == 1:
        delta: Delta | None = firsts[0]
        while delta is not None:
            yield 0, delta
            if delta.finish_reason is not None:
                return
            delta = await anext(generations[0].deltas, None)
        return
    arrived: asyncio.Queue[tuple[int, Delta | None] | Exception] = asyncio.Queue()

    async def pump(index: int, generation: Generation, delta: Delta | None) -> None:
        try:
            while delta is not None:
                arrived.put_nowait((index, delta))
                if delta.finish_reason is not None:
                    break
                delta = await anext(generation.deltas, None)
            arrived.put_nowait((index, None))
        except Exception as exc:
            arrived.put_nowait(exc)

    pumps = [
        asyncio.ensure_future(pump(g.index, g, first)) for g, first in zip(generations, firsts, strict=True)
    ]
    try:
        going = len(pumps)
        while going:
            item = await arrived.get()
            if isinstance(item, Exception):
                raise item
            index, piece = item
            if piece is None:
                going -= 1
            else:
                yield index, piece
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def _sse(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _stream(
    service: Frontend,
    generations: list[Generation],
    firsts: list[Delta],
    chunk: Chunk,
    include_usage: bool,
    openings: list[dict[str, Any]] | None = None,
) -> StreamingResponse:
    async def events() -> AsyncIterator[bytes]:
        status: int | None = None
        deltas = _merged(generations, firsts)
        try:
            for opening in openings or ():
                yield _sse(opening)
            async for index, delta in deltas:
                # A delta may carry logprobs and no text yet (held back for a stop string): sent as is,
                # as vLLM sends each step's tokens.
                if delta.text or delta.finish_reason or delta.logprobs:
                    yield _sse(chunk(index, delta.text, delta.finish_reason, delta.logprobs))
            if include_usage:
                yield _sse({**chunk(0, "", None, None), "choices": [], "usage": _usage(generations)})
            status = 200
        except CarpoolError as exc:
            status = status_of(exc)
            yield _sse({"error": {"message": exc.message, "type": type(exc).__name__, "code": None}})
        finally:
            # Left without an answer of ours: the client went away mid-stream (Starlette cancels the
            # stream on disconnect; closing the deltas aborts every choice's sequence in the engine).
            service.metrics.count_request(499 if status is None else status)
            await deltas.aclose()
            await _close(generations)
        yield b"data: [DONE]\n\n"

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    service, generations, firsts, model = await _start(request, body, prompt, None)
    ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    top = body.logprobs
    offsets = [0] * body.n  # where each choice's next chunk's tokens start in its text (vLLM's text_offset)

    def choice(
        index: int, text: str, finish: str | None, entries: list[TokenLogprob] | None
    ) -> dict[str, Any]:
        logprobs = None
        if top is not None:
            logprobs, offsets[index] = _completion_logprobs(entries or [], top, offsets[index])
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}

    def answer(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": ident,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
        }

    def chunk(
        index: int, text: str, finish: str | None, entries: list[TokenLogprob] | None
    ) -> dict[str, Any]:
        return answer([choice(index, text, finish, entries)])

    if body.stream:
        return _stream(service, generations, firsts, chunk, _include_usage(body))
    results = await serve(request, service, _collect_all(generations, firsts))
    choices = [choice(index, *result) for index, result in enumerate(results)]
    return JSONBody({**answer(choices), "usage": _usage(generations)})


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    messages = plain_messages(body.messages)
    service, generations, firsts, model = await _start(request, body, None, messages)
    ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    asked = body.top_logprobs_asked()

    def logprobs_of(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        return None if asked is None else _chat_logprobs(entries or [], asked[1])

    def chat(
        index: int,
        text: str,
        finish: str | None,
        entries: list[TokenLogprob] | None,
        delta: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        delta = delta if delta is not None else ({"content": text} if text else {})
        logprobs = logprobs_of(entries) if entries is not None or finish is not None else None
        return {
            "id": ident,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
        }

    if body.stream:
        # vLLM opens each choice with its role, then streams them as their tokens come.
        openings = [
            chat(index, "", None, None, {"role": "assistant", "content": ""}) for index in range(body.n)
        ]
        return _stream(service, generations, firsts, chat, _include_usage(body), openings)
    results = await serve(request, service, _collect_all(generations, firsts))
    return JSONBody(
        {
            "id": ident,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                    "logprobs": logprobs_of(entries),
                }
                for index, (text, finish, entries) in enumerate(results)
            ],
            "usage": _usage(generations),
        }
    )
