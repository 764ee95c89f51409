"""`POST /tokenize` and `POST /detokenize` in the shapes of vLLM's OpenAI server, for a model on
carpool's own engine (a model on vLLM's engine gets vLLM's own, see `api.surface`): the served model's
tokenizer and chat template, as the generation routes use them. What vLLM's routes take that this one
does not (tools, chat_template, multimodal keywords) is refused by name (400)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from carpool.runtime.api.completions import Message, NonNegative, plain_messages
from carpool.runtime.api.frontend import Frontend
from carpool.runtime.api.openai import check_model
from carpool.runtime.api.responses import JSONBody
from carpool.runtime.config import Task
from carpool.runtime.errors import InvalidInput

router = APIRouter(tags=["openai"])


class TokenizePrompt(BaseModel):
    """A prompt to token ids (vLLM's `TokenizeCompletionRequest`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = False


class TokenizeChat(BaseModel):
    """Chat messages rendered with the model's chat template, to token ids (vLLM's `TokenizeChatRequest`:
    the template writes the special tokens, so none are added by default)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: StrictStr | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool | None = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: StrictStr | None = None
    tokens: list[NonNegative]


def _service(request: Request) -> Frontend:
    service: Frontend = request.app.state.service
    return service


def _text_model(service: Frontend, model: str | None) -> None:
    check_model(service, model)
    if service.info.task is not Task.GENERATE:
        raise InvalidInput(
            f"model {service.name!r} does {service.info.task.value}: it has no text to tokenize"
        )


@router.post("/tokenize")
async def tokenize(body: TokenizePrompt | TokenizeChat, request: Request) -> JSONBody:
    service = _service(request)
    _text_model(service, body.model)
    if isinstance(body, TokenizeChat):
        messages = plain_messages(body.messages)
        ids, strings, context = service.tokenize(None, messages, False, body.add_generation_prompt)
    else:
        ids, strings, context = service.tokenize(body.prompt, None, body.add_special_tokens, True)
    answer: dict[str, object] = {
        "count": len(ids),
        "max_model_len": context,
        "tokens": ids,
        "token_strs": None,
    }
    if body.return_token_strs:
        answer["token_strs"] = strings
    return JSONBody(answer)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONBody:
    service = _service(request)
    _text_model(service, body.model)
    return JSONBody({"prompt": service.detokenize(body.tokens)})
