"""LoRA adapter management with vLLM's routes and bodies: `POST /v1/load_lora_adapter`
(`{"lora_name", "lora_path"}`) and `POST /v1/unload_lora_adapter` (`{"lora_name"}`).

The front forwards each to the engine, which owns the adapters (`engine.lora`) and answers once the
adapter is read and checked, or refused: 400 naming why (`InvalidAdapter`: missing files, another base
model, a rank over `lora.max_rank`, an unsupported PEFT feature, a name taken), 404 for unloading a name
not loaded. Requests then name an adapter in `model` (OpenAI) or the path (`/v2/models/{adapter}/infer`)
through any front, and `GET /v1/models` lists it with its `parent` on every front (the engine's status
carries the list).
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from carpool.runtime.api.frontend import Frontend
from carpool.runtime.api.responses import JSONBody

router = APIRouter(tags=["lora"])


class LoadAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: StrictStr = Field(min_length=1, max_length=256)
    """The name requests will put in `model`."""
    lora_path: StrictStr = Field(min_length=1)
    """A PEFT adapter folder on the server, `pkg:<package>`, or a hub repo id (where a hub is reachable)."""
    load_inplace: Literal[False] = False
    """vLLM's field: replace an adapter of the same name. Only false: unload it first."""


class UnloadAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: StrictStr = Field(min_length=1)
    lora_int_id: int | None = None
    """vLLM's field, ignored: adapters are named."""


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadAdapter, request: Request) -> JSONBody:
    """Read a LoRA adapter and serve it under `lora_name` (400 saying why it cannot be)."""
    service: Frontend = request.app.state.service
    await service.load_adapter(body.lora_name, body.lora_path)
    return JSONBody({"object": "lora_adapter", "lora_name": body.lora_name, "status": "loaded"})


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadAdapter, request: Request) -> JSONBody:
    """Stop serving an adapter; requests already running with it finish."""
    service: Frontend = request.app.state.service
    await service.unload_adapter(body.lora_name)
    return JSONBody({"object": "lora_adapter", "lora_name": body.lora_name, "status": "unloaded"})
