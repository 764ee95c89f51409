"""The messages that cross between the HTTP fronts and the engine process, and the types both sides share.

This is the only module that the front (`api`) and the engine (`engine`) both import for talking to each
other: every arrow runs into it (`api -> wire <- engine`). Messages are `msgspec.Struct`s encoded as
MessagePack arrays (`array_like`: no field names on the wire) and told apart by a tag, as vLLM's
`v1/engine/__init__.py` does. Token ids travel as integer lists, outputs of encoders as one raw buffer
per request (`numpy.frombuffer` on the front), never as one Python object per number.

Times are `time.monotonic()` seconds: CLOCK_MONOTONIC is one clock for every process on a Linux host, so
a deadline computed in a front means the same instant in the engine.

Front -> engine (one PUSH socket per front into the engine's PULL): `EncodeRequest`, `GenerateRequest`,
`Abort`, `Goodbye`, and the LoRA controls `LoadAdapter` and `UnloadAdapter`. Engine -> front (one PUSH
socket per front): lists of `EncodeOutput`, `TokenOutput`, `ErrorOutput`, `AdapterDone` (a control's
success), and `Status` (the engine's state and its LoRA adapters, repeated as a heartbeat, so that every
front lists the adapters that any front loaded; the tokenizer it carries goes once, not every beat).

Fields added to a message go at its end with a default: an array-like struct decodes a shorter array
with the defaults, so a message of the previous shape still decodes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from carpool.runtime import errors
from carpool.runtime.config import Task
from carpool.runtime.sampling import SamplingParams


class EngineState(enum.StrEnum):
    """The engine's lifecycle: LOADING -> WARMING -> READY -> DRAINING -> STOPPED, or FAILED."""

    LOADING = "loading"
    WARMING = "warming"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class EngineInfo(msgspec.Struct, frozen=True):
    """Facts about a loaded model that the fronts and the scheduler need."""

    name: str
    task: Task
    max_input_tokens: int
    device: str
    dtype: str
    source: str
    dimensions: int | None = None
    """Embedding width (embed)."""
    labels: list[str] = msgspec.field(default_factory=list)
    """Class names in output order (classify)."""
    quantization: str = "none"
    """Weight-only quantization of the linear layers: `none`, `int4`, `int8` or both (`int4+int8`)."""
    packed: bool = False
    """`forward` lays inputs end to end and computes no padding: a batch costs its real tokens, so the
    batcher needs no length grouping and its token budget counts real tokens."""
    engine: str = "carpool"
    """Which engine serves the model: `carpool` (its own) or `vllm` (with vLLM's version, `vllm 0.32.0`)."""


class TextSpec(msgspec.Struct, frozen=True):
    """What a front needs to tokenize and detokenize exactly as the engine's tokenizer would."""

    tokenizer_json: str
    """The fast tokenizer, serialised (`tokenizers.Tokenizer.to_str()`)."""
    chat_template: str | None = None
    """The model's Jinja chat template (generation), rendered in the front as transformers does."""
    special_tokens: dict[str, str] = msgspec.field(default_factory=dict)
    """`bos_token`, `eos_token`, ... as the chat template sees them."""
    eos_ids: list[int] = msgspec.field(default_factory=list)
    max_model_len: int = 0
    """Prompt plus output tokens (generation)."""
    cache_tokens: int = 0
    """What the whole KV cache holds, `num_blocks x block_size` (generation): the front refuses a request
    whose prompt plus `max_tokens` could never fit in it."""
    sampling_defaults: dict[str, float] = msgspec.field(default_factory=dict)
    """The model's own sampling defaults (its `generation_config.json`: `temperature`, `top_p`, `top_k`),
    which apply where a request is silent, as vLLM's server applies them."""
    vocab_size: int = 0
    """How many token ids the model's logits cover (generation; 0: not said, the tokenizer's count
    stands in): `logit_bias` naming an id at or past it is refused, as vLLM's server refuses it."""


# -- front -> engine ---------------------------------------------------------------------------------


class EncodeRequest(msgspec.Struct, tag="encode", array_like=True):
    """Embed, classify or score `tokens` (one id list per input); answered by one output for the whole
    request."""

    rid: int
    front: int
    tokens: list[list[int]]
    priority: int
    arrival: float
    deadline: float
    pairs: list[int] | None = None
    """Inputs that are text pairs (rerank: the query, then a document): for each, the index of its first
    token of the second text, from which the token type is 1 (as BERT's tokenizer marks it)."""


class GenerateRequest(msgspec.Struct, tag="generate", array_like=True):
    """Generate after `prompt`; answered by a stream of `TokenOutput`s."""

    rid: int
    front: int
    prompt: list[int]
    params: SamplingParams
    priority: int
    arrival: float
    deadline: float
    adapter: str | None = None
    """The LoRA adapter to generate with (None: the base model). The engine checks the name (404), as
    an adapter may have been unloaded since the front last heard of it."""


class LoadAdapter(msgspec.Struct, tag="load_adapter", array_like=True):
    """Read a LoRA adapter from `source` and serve it as `name`; answered by `AdapterDone` or an error."""

    rid: int
    front: int
    name: str
    source: str


class UnloadAdapter(msgspec.Struct, tag="unload_adapter", array_like=True):
    """Stop serving the adapter `name` (its running requests finish); `AdapterDone` or an error."""

    rid: int
    front: int
    name: str


class Abort(msgspec.Struct, tag="abort", array_like=True):
    """The callers went away (or a stop string ended the text): withdraw queued work, stop running work."""

    rids: list[int]


class Goodbye(msgspec.Struct, tag="goodbye", array_like=True):
    """A draining front has answered everything it accepted and will send nothing more."""

    front: int


class VllmRequest(msgspec.Struct, tag="vllm_request", array_like=True):
    """vLLM's surface -> the engine: one of vLLM's own requests (`EngineCoreRequest`, as vLLM's
    `MsgpackEncoder` writes it: its buffers), rendered and checked by vLLM's OpenAI serving classes in the
    surface process (`vllm.surface`), with carpool's priority, deadline and LoRA adapter beside it.
    Answered by `VllmOutputs` (and an `ErrorOutput` where carpool refuses or ends it: 429, 504, 404)."""

    rid: int
    front: int
    """The sender's output slot (a surface's: after the fronts', see `Addresses.surfaces`)."""
    request: list[bytes]
    priority: int
    arrival: float
    deadline: float
    adapter: str | None = None


FrontMessage = EncodeRequest | GenerateRequest | Abort | Goodbye | LoadAdapter | UnloadAdapter | VllmRequest


# -- engine -> front ---------------------------------------------------------------------------------


class EncodeOutput(msgspec.Struct, tag="rows", array_like=True):
    """One row per input of an `EncodeRequest`, as one little-endian buffer of `shape` and `dtype`."""

    rid: int
    dtype: str
    shape: tuple[int, int]
    data: bytes


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log-probabilities of generated tokens (for a request whose `SamplingParams.logprobs` asks), as two
    raw little-endian buffers of `[tokens, width]`: `ids` int32 and `values` float32. Column 0 is the
    sampled token (its id and its logprob), columns 1.. the `width - 1` most likely tokens, most likely
    first (vLLM's `LogprobsLists` layout, one row per token of the message's `ids`)."""

    width: int
    ids: bytes
    values: bytes

    @classmethod
    def of(cls, ids: np.ndarray[Any, Any], values: np.ndarray[Any, Any]) -> TokenLogprobs:
        """From `[tokens, width]` arrays (any integer and float dtypes)."""
        return cls(
            int(ids.shape[1]),
            np.ascontiguousarray(ids, dtype="<i4").tobytes(),
            np.ascontiguousarray(values, dtype="<f4").tobytes(),
        )

    def arrays(self) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """(ids, values) as `[tokens, width]` arrays (views of the buffers)."""
        ids = np.frombuffer(self.ids, dtype="<i4").reshape(-1, self.width)
        return ids, np.frombuffer(self.values, dtype="<f4").reshape(-1, self.width)

    def head(self, tokens: int, width: int | None = None) -> TokenLogprobs:
        """The first `tokens` rows, and of each the first `width` columns (all: None)."""
        ids, values = self.arrays()
        width = self.width if width is None else min(width, self.width)
        return TokenLogprobs.of(ids[:tokens, :width], values[:tokens, :width])


class TokenOutput(msgspec.Struct, tag="tokens", array_like=True):
    """New token ids of a sequence; `finish` ("stop", "length") on its last message."""

    rid: int
    ids: list[int]
    finish: str | None = None
    logprobs: TokenLogprobs | None = None
    """One row per id of `ids`, where the request asked for logprobs (None otherwise)."""


class ErrorOutput(msgspec.Struct, tag="error", array_like=True):
    """The request ended with a domain error (`kind` names a class of `carpool.runtime.errors`)."""

    rid: int
    kind: str
    message: str
    retry_after: float | None = None


class AdapterDone(msgspec.Struct, tag="adapter", array_like=True):
    """A `LoadAdapter` or `UnloadAdapter` succeeded (`action`: "loaded" or "unloaded")."""

    rid: int
    name: str
    action: str


class AdapterInfo(msgspec.Struct, frozen=True, array_like=True):
    """A LoRA adapter requests may name in `model`."""

    name: str
    parent: str
    """The base model it runs on (the served model's name)."""
    source: str
    """Where it was read from, as given (folder, `pkg:`, hub id)."""


class Status(msgspec.Struct, tag="status", array_like=True):
    """The engine's state; sent on every change and as a heartbeat."""

    state: EngineState
    pid: int
    info: EngineInfo | None = None
    text: TextSpec | None = None
    """The tokenizer and text facts: on the first status that has them and when they change, never on a
    heartbeat (None there: the front keeps what it was sent). A Llama 3 tokenizer is 9 MB."""
    failure: str | None = None
    adapters: tuple[AdapterInfo, ...] = ()
    """The LoRA adapters served, in the order they were loaded."""
    engine: int = 0
    """Which engine process sent it (`model.processes`: 0, 1, ...)."""
    step_age_s: float = 0.0
    """Seconds the oldest batch or step still running in a model thread has run (0: none runs). Sent on
    every heartbeat: the output thread beats on while a step hangs in a collective, this number does not
    stand still (`api.client` fails the engine past `generation.step_timeout_s`)."""


class VllmOutputs(msgspec.Struct, tag="vllm_outputs", array_like=True):
    """The engine -> vLLM's surface: one step's `EngineCoreOutputs` for that surface's requests, as vLLM's
    `MsgpackEncoder` writes them (request ids are carpool's rids, as text)."""

    data: list[bytes]


class OpenAIReply(msgspec.Struct, tag="openai_reply", array_like=True):
    """vLLM's surface -> a front: a piece of the HTTP answer to an `OpenAIRequest`. The first carries the
    status and headers (`status` > 0), later ones more of the body; the last has `more` false."""

    rid: int
    body: bytes
    more: bool
    status: int = 0
    headers: list[tuple[str, str]] = msgspec.field(default_factory=list)


EngineMessage = EncodeOutput | TokenOutput | ErrorOutput | AdapterDone | Status | VllmOutputs | OpenAIReply


# -- a front -> vLLM's surface ----------------------------------------------------------------------


class OpenAIRequest(msgspec.Struct, tag="openai", array_like=True):
    """An OpenAI request for a model on vLLM's engine, as the client sent it (path, headers, body), for
    vLLM's own OpenAI server in the surface process; the front has checked the key and the limits, and
    adds carpool's priority and deadline. Answered by `OpenAIReply`s."""

    rid: int
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    priority: int
    arrival: float
    deadline: float


class OpenAIAbort(msgspec.Struct, tag="openai_abort", array_like=True):
    """The client of an `OpenAIRequest` went away: vLLM's server sees the disconnect."""

    rid: int


SurfaceMessage = OpenAIRequest | OpenAIAbort


# -- encoding ----------------------------------------------------------------------------------------


@dataclass
class Codec:
    """Encoders and decoders for both directions (msgspec objects are reusable and not thread-safe to
    share across threads while in use: each thread builds its own)."""

    encoder: msgspec.msgpack.Encoder
    front_decoder: msgspec.msgpack.Decoder[list[FrontMessage]]
    engine_decoder: msgspec.msgpack.Decoder[list[EngineMessage]]
    surface_decoder: msgspec.msgpack.Decoder[list[SurfaceMessage]]

    @classmethod
    def create(cls) -> Codec:
        return cls(
            msgspec.msgpack.Encoder(),
            msgspec.msgpack.Decoder(list[FrontMessage]),
            msgspec.msgpack.Decoder(list[EngineMessage]),
            msgspec.msgpack.Decoder(list[SurfaceMessage]),
        )


_ERRORS: dict[str, type[errors.CarpoolError]] = {
    cls.__name__: cls
    for cls in (
        errors.InvalidInput,
        errors.InputTooLong,
        errors.InvalidAdapter,
        errors.ModelNotFound,
        errors.QueueFull,
        errors.NotReady,
        errors.DeadlineExceeded,
        errors.Cancelled,
        errors.OutOfMemory,
        errors.BatchFailed,
    )
}


def error_output(rid: int, exc: errors.CarpoolError) -> ErrorOutput:
    return ErrorOutput(rid, type(exc).__name__, exc.message, exc.retry_after_s)


def error_from(output: ErrorOutput) -> errors.CarpoolError:
    """The domain error an `ErrorOutput` stands for (a kind this side does not know is a BatchFailed)."""
    cls = _ERRORS.get(output.kind, errors.BatchFailed)
    if cls is errors.QueueFull or cls is errors.NotReady:
        return cls(output.message, output.retry_after or 1.0)
    return cls(output.message)


INSTANCE_ENV = "CARPOOL_INSTANCE"
"""One start of a runtime (the supervisor's, inherited by its processes): its fronts name it in their
readiness answer, where a LeaderWorkerSet worker tells its own leader from a new one (vllm/group.py)."""


@dataclass(frozen=True)
class Addresses:
    """ZeroMQ endpoints: each engine process's input (all fronts push into it) and one output per front
    (every engine process pushes into it)."""

    input: str
    """Engine process 0's input; engine `k`'s is `engine_input(k)`."""
    outputs: tuple[str, ...]
    engines: int = 1
    """Engine processes (`model.processes`)."""
    surfaces: tuple[str, ...] = ()
    """vLLM's surface processes' engine-output sockets, one per front (a model on vLLM's engine): the
    engine's output slots after the fronts' (`len(outputs) + front`)."""

    @classmethod
    def in_folder(cls, folder: str, fronts: int, engines: int = 1) -> Addresses:
        outputs = tuple(f"ipc://{folder}/front-{i}" for i in range(fronts))
        return cls(f"ipc://{folder}/engine-in", outputs, engines)

    def engine_input(self, engine: int) -> str:
        return self.input if engine == 0 else f"{self.input}-{engine}"

    def surface_input(self, front: int) -> str:
        """Where front `front` sends its OpenAI requests to its vLLM surface process."""
        return f"{self.input}-surface-{front}"

    def surface_output(self, front: int) -> str:
        """Where the engine sends front `front`'s surface its outputs."""
        return f"{self.input}-surface-{front}-out"

    def with_surfaces(self) -> Addresses:
        """These addresses with one vLLM surface per front."""
        surfaces = tuple(self.surface_output(front) for front in range(len(self.outputs)))
        return Addresses(self.input, self.outputs, self.engines, surfaces)
