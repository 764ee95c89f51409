"""vLLM's own OpenAI server, whole, as the surface of a model on vLLM's engine: a process of vLLM's
environment per front (`python -m carpool.runtime.vllm surface PAYLOAD`, started by the engine process).

vLLM's OpenAI server is an ASGI app (`vllm.entrypoints.launchers.app.build_app`, its state from
`init_app_state`): vLLM's protocol models, chat templates with tools, tool-call and reasoning parsers,
structured-output settings, `to_sampling_params` with the model's generation-config defaults, its
detokenizer and its response shapes, streamed deltas included. Here it runs unchanged, on an `AsyncLLM`
whose engine-core client (`WireCore`) speaks carpool's wire to carpool's engine process instead of
starting vLLM's `EngineCoreProc`: vLLM's `EngineCoreRequest`s go to the engine in `VllmRequest`s (with
carpool's priority, deadline and LoRA adapter beside them), and the engine's `EngineCoreOutputs` come back
in `VllmOutputs`, which vLLM's output handler turns into `RequestOutput`s as it does under `vllm serve`.

A front hands each OpenAI request to its surface as it came (`OpenAIRequest`: method, path, headers,
body) after carpool's own checks (API key, body size, drain, priority and timeout headers), and relays
the answer (`OpenAIReply`s) to its client. What carpool's engine refuses or ends (429 with Retry-After
when the queue is full, 504 past the deadline, 404 for an adapter it does not serve) reaches vLLM's server
as a `GracefulHTTPError` with that status; a streamed answer is held back until the engine has produced
its first token (or refused), so such a refusal is answered with its status, not inside a 200 stream.

Per-token Python work (detokenizing, stop strings, parsers, JSON) happens here, as in vLLM's API server
process, never in the engine process, whose interpreter lock the schedule and the model's steps need.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import pickle
import signal
import sys
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from vllm.config import VllmConfig
from vllm.entrypoints.launchers.api_server.app_state import init_app_state
from vllm.entrypoints.launchers.app import build_app
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.exceptions import GracefulHTTPError, VLLMValidationError
from vllm.lora.request import LoRARequest
from vllm.renderers import renderer_from_config
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from carpool.runtime.config import RuntimeConfig
from carpool.runtime.errors import CarpoolError, status_of
from carpool.runtime.vllm.processes import READY_LINE
from carpool.runtime.wire import (
    Abort,
    AdapterInfo,
    Codec,
    EngineMessage,
    ErrorOutput,
    FrontMessage,
    OpenAIAbort,
    OpenAIReply,
    OpenAIRequest,
    Status,
    VllmOutputs,
    VllmRequest,
    error_from,
)

log = logging.getLogger(__name__)

MAX_FRONTS = 4096
"""As the fronts' (`api.client.MAX_FRONTS`): request ids are `n * MAX_FRONTS + slot`, unique per engine."""


class CarpoolRefusal(GracefulHTTPError):  # type: ignore[misc]
    """What carpool's engine answered instead of tokens (429, 504, 404, 400, 500), for vLLM's server to
    answer with that status."""

    def __init__(self, error: CarpoolError) -> None:
        super().__init__(error.message, HTTPStatus(status_of(error)))
        self.error = error


@dataclass(eq=False)
class HttpRequest:
    """One relayed HTTP request: carpool's settings for the engine requests it makes, and what the
    engine said about them."""

    priority: int
    arrival: float
    deadline: float
    started: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the engine sent the first output of one of its requests, or refused one."""
    error: CarpoolError | None = None
    """The first refusal of carpool's engine (it decides the status of an answer not yet begun)."""


CURRENT: ContextVar[HttpRequest | None] = ContextVar("carpool_http_request", default=None)
"""The relayed HTTP request whose handling is running (vLLM's handlers run in tasks that copy it)."""


class WireCore:
    """vLLM's engine-core client, as `AsyncLLM` drives it, over carpool's wire (see the module docstring).
    Runs on the surface's event loop."""

    def __init__(self, slot: int, tasks: tuple[str, ...], send: Callable[[FrontMessage], None]) -> None:
        self.slot = slot
        self.tasks = tasks
        self.send = send
        self.resources = SimpleNamespace(engine_dead=False)
        self.engine_ranks_managed = [0]
        self.output_processor: OutputProcessor | None = None
        self._ids = itertools.count(1)
        self._request_ids: dict[int, str] = {}
        """carpool's rid -> vLLM's request id, for requests in the engine."""
        self._rids: dict[str, int] = {}
        self._http: dict[int, HttpRequest] = {}
        self._outputs: asyncio.Queue[EngineCoreOutputs] = asyncio.Queue()
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineCoreOutputs)

    # -- what AsyncLLM calls ---------------------------------------------------------------------

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        http = CURRENT.get()
        if http is None:
            raise RuntimeError("a vLLM request outside a relayed HTTP request")
        if request.priority:
            # vLLM's own field; carpool orders requests by its header instead (never silently dropped)
            if self.output_processor is not None:
                self.output_processor.abort_requests([request.request_id], internal=True)
            raise VLLMValidationError(
                "carpool orders requests by the x-carpool-priority header (higher first), not the body's "
                "priority: leave it out",
                parameter="priority",
                value=request.priority,
            )
        rid = next(self._ids) * MAX_FRONTS + self.slot
        self._request_ids[rid] = request.request_id
        self._rids[request.request_id] = rid
        self._http[rid] = http
        adapter = request.lora_request.lora_name if request.lora_request is not None else None
        buffers = [bytes(buffer) for buffer in self._encoder.encode(request)]
        self.send(VllmRequest(rid, self.slot, buffers, http.priority, http.arrival, http.deadline, adapter))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        rids = [rid for request_id in request_ids if (rid := self._rids.get(request_id)) is not None]
        for rid in rids:
            self._forget(rid)
        if rids:
            self.send(Abort(rids))

    async def get_output_async(self) -> EngineCoreOutputs:
        return await self._outputs.get()

    async def get_supported_tasks_async(self) -> tuple[str, ...]:
        return self.tasks

    async def reset_mm_cache_async(self) -> None:
        return None

    def shutdown(self, timeout: float | None = None) -> None:
        return None

    # -- what the engine sends -------------------------------------------------------------------

    def on_outputs(self, message: VllmOutputs) -> None:
        outputs: EngineCoreOutputs = self._decoder.decode(message.data)
        kept = []
        for output in outputs.outputs:
            rid = int(output.request_id)
            request_id = self._request_ids.get(rid)
            if request_id is None:
                continue  # aborted here meanwhile
            output.request_id = request_id
            self._http[rid].started.set()
            if output.finish_reason is not None:
                self._forget(rid)
            kept.append(output)
        outputs.outputs = kept
        self._outputs.put_nowait(outputs)

    def on_error(self, message: ErrorOutput) -> None:
        request_id = self._request_ids.get(message.rid)
        if request_id is None:
            return
        http = self._http[message.rid]
        self._forget(message.rid)
        error = error_from(message)
        if http.error is None:
            http.error = error
        http.started.set()
        processor = self.output_processor
        state = processor.request_states.get(request_id) if processor is not None else None
        if processor is not None and state is not None and state.queue is not None:
            queue = state.queue
            processor.abort_requests([request_id], internal=True)
            queue.put(CarpoolRefusal(error))

    def _forget(self, rid: int) -> None:
        request_id = self._request_ids.pop(rid, None)
        if request_id is not None:
            self._rids.pop(request_id, None)
        self._http.pop(rid, None)


class SurfaceLLM(AsyncLLM):  # type: ignore[misc]
    """vLLM's `AsyncLLM` over carpool's engine process: its input processor, output processor (the
    detokenizer, stop strings, logprobs, n > 1 and their output handler) and renderer, with `WireCore`
    in place of the engine-core client `AsyncLLM.__init__` would start (with its engine)."""

    def __init__(self, vllm_config: VllmConfig, core: WireCore) -> None:
        self.vllm_config = vllm_config
        self._elastic_ep_lock = asyncio.Lock()
        self.model_config = vllm_config.model_config
        self.scheduler_config = vllm_config.scheduler_config
        self.observability_config = vllm_config.observability_config
        self.log_requests = False
        self.log_stats = False
        self.renderer = renderer_from_config(vllm_config)
        self.input_processor = InputProcessor(vllm_config, self.renderer)
        self.admission_stats = None
        self.output_processor = OutputProcessor(
            self.renderer.tokenizer,
            log_stats=False,
            stream_interval=vllm_config.scheduler_config.stream_interval,
            tracing_enabled=False,
            admission_stats=None,
        )
        core.output_processor = self.output_processor
        self.engine_core = core
        self.logger_manager = None
        self._client_count = 1
        self.output_handler = None
        self.profiler = None
        self._frontend_profiler_injected = False
        self._profile_lock = asyncio.Lock()
        self._profile_session_guard_enabled = True
        self._profile_session_active = False


def server_args(model: str, served_name: str, flags: list[str]) -> Any:
    """`vllm serve`'s arguments for this model (the OpenAI server reads its own: parsers, templates)."""
    parser = make_arg_parser(FlexibleArgumentParser())
    return parser.parse_args(["--model", model, "--served-model-name", served_name, *flags])


Send = Callable[[dict[str, Any]], Awaitable[None]]


class Relay:
    """Serves the fronts' `OpenAIRequest`s with vLLM's ASGI app, answering with `OpenAIReply`s."""

    def __init__(self, app: Any, reply: Callable[[OpenAIReply], None]) -> None:
        self.app = app
        self.reply = reply
        self._gone: dict[int, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def handle(self, message: OpenAIRequest | OpenAIAbort) -> None:
        if isinstance(message, OpenAIAbort):
            gone = self._gone.get(message.rid)
            if gone is not None:
                gone.set()
            return
        task = asyncio.get_running_loop().create_task(self._serve(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, message: OpenAIRequest) -> None:
        http = HttpRequest(message.priority, message.arrival, message.deadline)
        CURRENT.set(http)  # this task's own context (a copy made when it was created)
        gone = self._gone[message.rid] = asyncio.Event()
        answer = _Answer(message.rid, http, self.reply)
        received = False

        async def receive() -> dict[str, Any]:
            nonlocal received
            if not received:
                received = True
                return {"type": "http.request", "body": message.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": message.method,
            "scheme": "http",
            "path": message.path,
            "raw_path": message.path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in message.headers],
            "client": ("127.0.0.1", 0),
            "server": ("carpool-vllm-surface", 0),
        }
        try:
            await self.app(scope, receive, answer.send)
        except Exception as exc:  # vLLM's app answers its own errors; this is a failure of ours
            log.exception("vLLM's server failed on %s %s", message.method, message.path)
            answer.fail(exc)
        finally:
            answer.finish()
            self._gone.pop(message.rid, None)


class _Answer:
    """One HTTP answer on its way to the front. A streamed one is held until the engine has produced a
    token or refused the request: a refusal then replaces it with an answer of its own status."""

    def __init__(self, rid: int, http: HttpRequest, reply: Callable[[OpenAIReply], None]) -> None:
        self.rid = rid
        self.http = http
        self.reply = reply
        self.held: list[dict[str, Any]] = []
        self.begun = False
        self.done = False
        self._start: tuple[int, list[tuple[str, str]]] | None = None
        """The status and headers, sent with the first piece of the body."""

    async def send(self, message: dict[str, Any]) -> None:
        if self.done:
            return
        if not self.begun:
            self.held.append(message)
            last = message["type"] == "http.response.body" and not message.get("more_body", False)
            if not (last or self.http.started.is_set()):
                return
            if self.http.error is not None and self._streaming():
                self._refuse(self.http.error)
                return
            self.begun = True
            held, self.held = self.held, []
            for each in held:
                self._forward(each)
            return
        self._forward(message)

    def _streaming(self) -> bool:
        start = self.held[0] if self.held else {}
        headers = dict(start.get("headers", []))
        return bool(headers.get(b"content-type", b"").startswith(b"text/event-stream"))

    def _forward(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
            error = self.http.error
            if error is not None and error.retry_after_s and message["status"] in (429, 503):
                headers.append(("retry-after", str(max(1, round(error.retry_after_s)))))
            self._start = (int(message["status"]), headers)
            return
        more = bool(message.get("more_body", False))
        body = bytes(message.get("body", b""))
        if not body and more:
            return
        start = self._start
        if start is not None:
            self._start = None
            self.reply(OpenAIReply(self.rid, body, more, start[0], start[1]))
        else:
            self.reply(OpenAIReply(self.rid, body, more))
        if not more:
            self.done = True

    def _refuse(self, error: CarpoolError) -> None:
        status = status_of(error)
        body = {
            "error": {
                "message": error.message,
                "type": HTTPStatus(status).phrase,
                "param": None,
                "code": status,
            }
        }
        headers = [("content-type", "application/json")]
        if error.retry_after_s:
            headers.append(("retry-after", str(max(1, round(error.retry_after_s)))))
        self.reply(OpenAIReply(self.rid, json.dumps(body).encode(), False, status, headers))
        self.done = True

    def fail(self, exc: Exception) -> None:
        if self.done or self.begun:
            return
        message = f"internal error: {type(exc).__name__}: {exc}"
        body = {"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}}
        headers = [("content-type", "application/json")]
        self.reply(OpenAIReply(self.rid, json.dumps(body).encode(), False, 500, headers))
        self.done = True

    def finish(self) -> None:
        """The app returned: whatever is still held goes now, and the answer ends."""
        if self.done:
            return
        if self.held:
            if self.http.error is not None and self._streaming():
                self._refuse(self.http.error)
                return
            held, self.held = self.held, []
            for each in held:
                self._forward(each)
        if not self.done:
            self.reply(OpenAIReply(self.rid, b"", False))
            self.done = True


class Outbox:
    """Messages for one socket, sent as one list once the event loop has run what was ready (as the
    fronts send theirs)."""

    def __init__(self, socket: zmq.Socket[bytes], encoder: msgspec.msgpack.Encoder) -> None:
        self.socket = socket
        self.encoder = encoder
        self.messages: list[Any] = []

    def post(self, message: Any) -> None:
        if not self.messages:
            asyncio.get_running_loop().call_soon(self.flush)
        self.messages.append(message)

    def flush(self) -> None:
        messages, self.messages = self.messages, []
        if messages:
            self.socket.send(self.encoder.encode(messages), zmq.NOBLOCK)


def sync_adapters(models: Any, adapters: tuple[AdapterInfo, ...], ids: dict[str, int]) -> None:
    """vLLM's model list (`OpenAIServingModels.lora_requests`) as carpool's engine serves its adapters
    (the engine decides which adapter a request runs with; the id here is this surface's own)."""
    wanted = {adapter.name: adapter for adapter in adapters}
    for name in list(models.lora_requests):
        if name not in wanted:
            del models.lora_requests[name]
    for name, adapter in wanted.items():
        if name not in models.lora_requests:
            ids.setdefault(name, len(ids) + 1)
            request = LoRARequest(name, ids[name], adapter.source)
            request.base_model_name = adapter.parent
            models.lora_requests[name] = request


async def serve(payload: dict[str, Any], vllm_config: VllmConfig) -> None:
    config = RuntimeConfig.model_validate(payload["config"])
    context = zmq.asyncio.Context()
    codec = Codec.create()
    to_engine: zmq.Socket[bytes] = zmq.Context.shadow(context).socket(zmq.PUSH)
    to_engine.setsockopt(zmq.SNDHWM, 0)
    to_engine.connect(payload["engine_input"])
    to_front: zmq.Socket[bytes] = zmq.Context.shadow(context).socket(zmq.PUSH)
    to_front.setsockopt(zmq.SNDHWM, 0)
    to_front.connect(payload["front_output"])
    from_front = context.socket(zmq.PULL)
    from_front.setsockopt(zmq.RCVHWM, 0)
    from_front.bind(payload["surface_input"])
    from_engine = context.socket(zmq.PULL)
    from_engine.setsockopt(zmq.RCVHWM, 0)
    from_engine.bind(payload["surface_output"])
    engine_box = Outbox(to_engine, codec.encoder)
    front_box = Outbox(to_front, codec.encoder)

    core = WireCore(int(payload["slot"]), tuple(payload["tasks"]), engine_box.post)
    llm = SurfaceLLM(vllm_config, core)
    args = server_args(payload["model"], config.served_name(), list(payload["frontend_args"]))
    # vLLM's server reads its reasoning parser from the engine's resolved structured-output settings:
    # under `vllm serve` they are one object (`EngineArgs.from_cli_args` takes the parsed section, and
    # `create_structured_outputs_config` writes `--reasoning-parser` into it, as does a model's own default,
    # gpt-oss's). Here the engine resolved them in its own process: the surface takes that result.
    args.structured_outputs_config = vllm_config.structured_outputs_config
    tasks = tuple(payload["tasks"])
    app = build_app(args, tasks, vllm_config.model_config)
    await init_app_state(llm, app.state, args, tasks)
    relay = Relay(app, front_box.post)
    lora_ids: dict[str, int] = {}
    sys.stdout.buffer.write(READY_LINE)
    sys.stdout.buffer.flush()
    log.info("vLLM's OpenAI surface for front %s serves %s", payload["front"], config.served_name())

    async def from_engine_loop() -> None:
        decoder: msgspec.msgpack.Decoder[list[EngineMessage]] = codec.engine_decoder
        adapters: tuple[AdapterInfo, ...] | None = None
        while True:
            frame = await from_engine.recv(copy=False)
            for message in decoder.decode(frame.buffer):
                if isinstance(message, VllmOutputs):
                    core.on_outputs(message)
                elif isinstance(message, ErrorOutput):
                    core.on_error(message)
                elif isinstance(message, Status) and message.adapters != adapters:
                    adapters = message.adapters
                    sync_adapters(app.state.openai_serving_models, adapters, lora_ids)

    async def from_front_loop() -> None:
        while True:
            frame = await from_front.recv(copy=False)
            for message in codec.surface_decoder.decode(frame.buffer):
                relay.handle(message)

    async def orphaned() -> None:
        # The engine process, our parent: its pidfd is readable once it has exited.
        parent = asyncio.Event()
        pidfd = os.pidfd_open(os.getppid())
        asyncio.get_running_loop().add_reader(pidfd, parent.set)
        await parent.wait()
        log.info("the engine process went away: stopping")

    loops = [asyncio.create_task(coro) for coro in (from_engine_loop(), from_front_loop(), orphaned())]
    done, pending = await asyncio.wait(loops, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    for task in done:
        task.result()


def main(payload: str) -> int:
    from carpool.runtime.logs import configure

    data = json.loads(payload)
    config = RuntimeConfig.model_validate(data["config"])
    configure(config.server.log_level, config.server.log_format)
    # The engine stops its surfaces once every front has drained; a signal to the pod's process group
    # must not end one before that.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(data["vllm_config"], "rb") as file:
        vllm_config: VllmConfig = pickle.load(file)  # written by our parent, the engine
    asyncio.run(serve(data, vllm_config))
    # The engine is gone: nothing here holds state worth a clean shutdown, and vLLM's thread pools
    # (its renderer's, its tokenizers') would keep the interpreter waiting.
    sys.stdout.flush()
    os._exit(0)
