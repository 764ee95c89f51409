"""The front's one door to the engine process: send requests, abort them, receive their outputs.

After vLLM's `AsyncMPClient` (`v1/engine/core_client.py`): a PUSH socket into the engine (which binds)
and a PULL socket out of it (which this front binds), on zmq.asyncio, and one task that decodes outputs
and hands each to the request waiting for it. The same task follows the engine's `Status` messages
(state, model facts, tokenizer). The tokenizer (`Status.text`) comes once, with the first status that
carries it, and again only when it changes: heartbeats leave it out and the client keeps the last one.

Requests go to the engine in frames of several: a message is queued and the queue is sent, as one list,
once the event loop has run every callback that was ready with it (`loop.call_soon`). Under load the
requests that arrive together share one send, one wake-up of each side's ZeroMQ I/O thread and one
wake-up of the engine's loop, instead of one each; alone, a request waits for nothing (the flush runs
in the loop's next turn). The order of messages (a request, then its abort) is kept. The PUSH socket is a
plain one, never awaited: with no high-water mark a send always queues at once.

With several engine processes (`model.processes`, encoder tasks) the front holds a PUSH socket to each
and sends each encoder request to the one with the fewest of this front's inputs outstanding (ties in
turn), as vLLM's data-parallel client balances its engines; an abort goes where its request went, a
goodbye to every engine. The engines push into the same PULL socket. The front's view of "the engine"
is then all of them: ready when every one is, failed when any has failed or died.

The client also decides whether the engine is alive. It watches the engine's process (a pidfd: readable the
moment the process ends), its heartbeat (a `Status` at least every half second) and the age of the step it
runs (`Status.step_age_s`: a step hung in a collective leaves the heartbeat going); when the engine dies,
fails, falls silent or hangs past `generation.step_timeout_s`, every request it held fails at once with 500
(the engine failed while serving it), every new one is refused with 503, and `dead` says why, so no request
hangs on an engine that will never answer. The client's own tasks are watched the same way: if the task that
reads the engine's outputs (or the heartbeat watch) stops on an error, the front can no longer answer
anything, so it counts as dead too, and `broken` tells the front process to exit non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from carpool.runtime.errors import BatchFailed, CarpoolError, NotReady
from carpool.runtime.wire import (
    Abort,
    AdapterDone,
    Addresses,
    Codec,
    EncodeOutput,
    EncodeRequest,
    EngineState,
    ErrorOutput,
    FrontMessage,
    GenerateRequest,
    Goodbye,
    LoadAdapter,
    OpenAIAbort,
    OpenAIReply,
    OpenAIRequest,
    Status,
    TokenOutput,
    UnloadAdapter,
    error_from,
)

log = logging.getLogger(__name__)

MAX_FRONTS = 4096
"""Request ids are `n * MAX_FRONTS + front`: unique across the fronts of one engine."""


class EngineClient:
    """One front's connection to the engine."""

    def __init__(
        self,
        addresses: Addresses,
        front: int,
        heartbeat_timeout_s: float = 10.0,
        step_timeout_s: float | None = None,
    ) -> None:
        self.addresses = addresses
        self.front = front
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.step_timeout_s = step_timeout_s
        """`generation.step_timeout_s`: a step older than this means a hung engine (None: never)."""
        self.status: Status | None = None
        self.dead: str | None = None
        """Why the engine is gone (None while it runs)."""
        self.broken = asyncio.Event()
        """Set when one of this client's own tasks stopped on an error: the front must exit."""
        self.changed = asyncio.Event()
        """Set on every new engine state (tests and the lifecycle wait on it)."""
        self._codec = Codec.create()
        self._engines = addresses.engines
        self._statuses: list[Status | None] = [None] * self._engines
        """Each engine process's last status (`status` combines them)."""
        self._heard = [time.monotonic()] * self._engines
        self._outstanding = [0] * self._engines
        """Inputs this front has sent to each engine and not yet had answered."""
        self._routes: dict[int, tuple[int, int]] = {}
        """Request id -> (its engine, its inputs), for encoder requests in flight."""
        self._turn = 0
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[EncodeOutput]] = {}
        self._controls: dict[int, asyncio.Future[AdapterDone]] = {}
        self._streams: dict[int, asyncio.Queue[TokenOutput | CarpoolError]] = {}
        self._replies: dict[int, asyncio.Queue[OpenAIReply | CarpoolError]] = {}
        """Answers of vLLM's surface to this front's relayed OpenAI requests, by request id."""
        self._surface: zmq.Socket[bytes] | None = None
        """A PUSH socket to this front's vLLM surface process (a model on vLLM's engine), once used."""
        self._context: zmq.asyncio.Context | None = None
        self._pushes: list[zmq.Socket[bytes]] = []
        """One PUSH socket per engine process."""
        self._outboxes: list[list[FrontMessage]] = [[] for _ in range(self._engines)]
        """Messages for each engine, sent together at the loop's next turn (`_flush`)."""
        self._flushing = False
        self._pull: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pidfds: dict[int, int] = {}
        """Engine process id -> a pidfd watched for its exit."""

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        for engine in range(self._engines):
            push: zmq.Socket[bytes] = zmq.Context.shadow(self._context).socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.setsockopt(zmq.LINGER, 2000)
            push.connect(self.addresses.engine_input(engine))
            self._pushes.append(push)
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(self.addresses.outputs[self.front])
        self._heard = [time.monotonic()] * self._engines
        self._tasks = [
            asyncio.create_task(self._receive(), name="carpool-engine-outputs"),
            asyncio.create_task(self._watch_heartbeat(), name="carpool-engine-heartbeat"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._task_ended)

    async def heard(self, timeout_s: float) -> bool:
        """Wait until every engine process has sent this front a status (the engine's state is known:
        the statuses each engine sent before this front bound its socket wait for it, and a heartbeat
        follows every half second), the engine is lost, or `timeout_s` has passed; True if known."""
        deadline = time.monotonic() + timeout_s
        while self.status is None and self.dead is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), remaining)
        return self.status is not None

    async def close(self, goodbye: bool = True) -> None:
        """Stop listening; with `goodbye`, tell the engine this front will send nothing more."""
        engine_there = self.dead is None or self.broken.is_set()  # a broken front's engine still runs
        if goodbye and engine_there and self._pushes:
            for outbox in self._outboxes:
                outbox.append(Goodbye(self.front))
            self._flush()
        for task in self._tasks:
            task.remove_done_callback(self._task_ended)
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._forget_pidfds()
        if self._context is not None:
            for sock in [*self._pushes, self._pull, self._surface]:
                if sock is not None:
                    sock.close()
            self._pushes, self._pull, self._surface = [], None, None
            self._context.term()
            self._context = None
        self._fail_all(NotReady("the server stopped", 1.0))

    @property
    def state(self) -> EngineState:
        if self.dead is not None:
            return EngineState.FAILED
        return self.status.state if self.status is not None else EngineState.LOADING

    # -- requests -------------------------------------------------------------------------------

    def next_rid(self) -> int:
        return next(self._ids) * MAX_FRONTS + self.front

    async def encode(self, request: EncodeRequest) -> EncodeOutput:
        """Send an encoder request and wait for its rows; cancelling the wait withdraws the request."""
        future: asyncio.Future[EncodeOutput] = asyncio.get_running_loop().create_future()
        self._waiting[request.rid] = future
        try:
            self._send(request, self._route(request.rid, len(request.tokens)))
            return await future
        except asyncio.CancelledError:
            self.abort([request.rid])
            raise
        finally:
            self._waiting.pop(request.rid, None)
            route = self._routes.pop(request.rid, None)
            if route is not None:
                self._outstanding[route[0]] -= route[1]

    def _route(self, rid: int, inputs: int) -> int:
        """The engine process for an encoder request: the one with the fewest of this front's inputs
        outstanding, ties taken in turn."""
        engine = 0
        if self._engines > 1:
            turn, self._turn = self._turn, self._turn + 1
            outstanding = self._outstanding
            engine = min(range(self._engines), key=lambda k: (outstanding[k], (k - turn) % self._engines))
        self._routes[rid] = (engine, inputs)
        self._outstanding[engine] += inputs
        return engine

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenOutput, None]:
        """Send a generation request; its token outputs, up to the one with a finish reason. Leaving the
        iteration early aborts the sequence in the engine."""
        outputs: asyncio.Queue[TokenOutput | CarpoolError] = asyncio.Queue()
        self._streams[request.rid] = outputs
        finished = False
        try:
            self._send(request)
            while True:
                item = await outputs.get()
                if isinstance(item, CarpoolError):
                    finished = True  # the engine has dropped it already
                    raise item
                finished = item.finish is not None
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request.rid, None)
            if not finished:
                self.abort([request.rid])

    async def relay(self, request: OpenAIRequest) -> AsyncGenerator[OpenAIReply, None]:
        """Hand an OpenAI request to this front's vLLM surface; the pieces of its answer, up to the last
        (`more` false). Leaving the iteration early tells the surface the client went away."""
        if self.dead is not None:
            raise NotReady(f"the model engine is not running ({self.dead}); retry on another replica", 1.0)
        if self._surface is None:
            assert self._context is not None, "start() first"
            surface: zmq.Socket[bytes] = zmq.Context.shadow(self._context).socket(zmq.PUSH)
            surface.setsockopt(zmq.SNDHWM, 0)
            surface.setsockopt(zmq.LINGER, 0)
            surface.connect(self.addresses.surface_input(self.front))
            self._surface = surface
        replies: asyncio.Queue[OpenAIReply | CarpoolError] = asyncio.Queue()
        self._replies[request.rid] = replies
        finished = False
        try:
            self._surface.send(self._codec.encoder.encode([request]), zmq.NOBLOCK)
            while True:
                item = await replies.get()
                if isinstance(item, CarpoolError):
                    finished = True
                    raise item
                finished = not item.more
                yield item
                if finished:
                    return
        finally:
            self._replies.pop(request.rid, None)
            if not finished and self._surface is not None and self.dead is None:
                self._surface.send(self._codec.encoder.encode([OpenAIAbort(request.rid)]), zmq.NOBLOCK)

    async def control(self, request: LoadAdapter | UnloadAdapter) -> AdapterDone:
        """Send a LoRA control and wait for the engine's answer (its domain error is raised)."""
        future: asyncio.Future[AdapterDone] = asyncio.get_running_loop().create_future()
        self._controls[request.rid] = future
        try:
            self._send(request)
            return await future
        finally:
            self._controls.pop(request.rid, None)

    def abort(self, rids: list[int]) -> None:
        """Withdraw requests (sent after anything queued before, so never ahead of the request), each to
        the engine process it went to."""
        if self.dead is not None or not self._pushes:
            return
        if self._engines == 1:
            self._post(Abort(rids), 0)
            return
        by_engine: dict[int, list[int]] = {}
        for rid in rids:
            route = self._routes.get(rid)
            by_engine.setdefault(route[0] if route is not None else 0, []).append(rid)
        for engine, some in by_engine.items():
            self._post(Abort(some), engine)

    def _send(self, message: FrontMessage, engine: int = 0) -> None:
        if self.dead is not None:
            raise NotReady(f"the model engine is not running ({self.dead}); retry on another replica", 1.0)
        assert self._pushes, "start() first"
        self._post(message, engine)

    def _post(self, message: FrontMessage, engine: int) -> None:
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)
        self._outboxes[engine].append(message)

    def _flush(self) -> None:
        """Send each engine's queued messages as one frame. A send that fails (the socket closed under it)
        fails the requests it carried, so none waits for an answer the engine never got."""
        self._flushing = False
        for engine, messages in enumerate(self._outboxes):
            if not messages:
                continue
            self._outboxes[engine] = []
            if engine >= len(self._pushes):
                continue
            try:
                self._pushes[engine].send(self._codec.encoder.encode(messages), zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                error = NotReady(f"could not reach the model engine ({exc}); retry", 1.0)
                for message in messages:
                    if isinstance(message, (EncodeRequest, GenerateRequest, LoadAdapter, UnloadAdapter)):
                        self._fail(message.rid, error)

    # -- outputs --------------------------------------------------------------------------------

    async def _receive(self) -> None:
        assert self._pull is not None
        decoder = self._codec.engine_decoder
        while True:
            frame = await self._pull.recv(copy=False)
            heard = time.monotonic()
            for message in decoder.decode(frame.buffer):
                if isinstance(message, Status):
                    self._heard[message.engine] = heard
                    self._on_status(message)
                elif isinstance(message, TokenOutput):
                    stream = self._streams.get(message.rid)
                    if stream is not None:
                        stream.put_nowait(message)
                elif isinstance(message, OpenAIReply):
                    replies = self._replies.get(message.rid)
                    if replies is not None:
                        replies.put_nowait(message)
                elif isinstance(message, EncodeOutput):
                    future = self._waiting.get(message.rid)
                    if future is not None and not future.done():
                        future.set_result(message)
                elif isinstance(message, AdapterDone):
                    control = self._controls.get(message.rid)
                    if control is not None and not control.done():
                        control.set_result(message)
                elif isinstance(message, ErrorOutput):
                    self._fail(message.rid, error_from(message))

    def _fail(self, rid: int, error: CarpoolError) -> None:
        """Hand `error` to whoever waits for request `rid`."""
        future: asyncio.Future[Any] | None = self._waiting.get(rid) or self._controls.get(rid)
        if future is not None and not future.done():
            future.set_exception(error)
        stream = self._streams.get(rid)
        if stream is not None:
            stream.put_nowait(error)

    def _on_status(self, status: Status) -> None:
        before = self.status.state if self.status is not None else None
        prior = self._statuses[status.engine]
        if status.text is None and prior is not None and prior.text is not None:
            status = msgspec.structs.replace(status, text=prior.text)  # a heartbeat: the spec stays
        self._statuses[status.engine] = status
        self.status = combined(self._statuses)
        if status.pid not in self._pidfds and status.pid != os.getpid():
            self._watch_process(status.pid, status.engine)
        if status.state is EngineState.FAILED:
            self._die(status.failure or "the engine failed")
        if self.status is not None and self.status.state is not before:
            self.changed.set()
            self.changed = asyncio.Event()

    def _watch_process(self, pid: int, engine: int) -> None:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # already gone, or no pidfd (kernel < 5.3): the heartbeat still tells
            return
        self._pidfds[pid] = pidfd
        asyncio.get_running_loop().add_reader(pidfd, self._engine_exited, pid, engine)

    def _engine_exited(self, pid: int, engine: int) -> None:
        """An engine process has exited: the engine is gone unless that one had drained and stopped
        while others still finish their work."""
        self._forget_pidfd(pid)
        mine = self._statuses[engine]
        if mine is not None and mine.state is EngineState.STOPPED and self.state is not EngineState.STOPPED:
            return
        self._die(f"the engine process {pid} exited")

    def _forget_pidfd(self, pid: int) -> None:
        pidfd = self._pidfds.pop(pid, None)
        if pidfd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(pidfd)
            os.close(pidfd)

    def _forget_pidfds(self) -> None:
        for pid in list(self._pidfds):
            self._forget_pidfd(pid)

    async def _watch_heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_timeout_s / 4)
            now = time.monotonic()
            for status, heard in zip(self._statuses, self._heard, strict=True):
                if status is None or status.state is EngineState.STOPPED:
                    continue  # still starting (importing torch can take a while), or done
                silent = now - heard
                if silent > self.heartbeat_timeout_s:
                    self._die(f"no word from the engine for {silent:.0f}s")
                hung = hung_step(status, self.step_timeout_s)
                if hung is not None:
                    self._die(hung)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        """Both tasks run until `close` cancels them: ending any other way leaves this front deaf."""
        error = None if task.cancelled() else task.exception()
        what = f"{type(error).__name__}: {error}" if error is not None else "it returned"
        log.critical("this front's task %s stopped (%s)", task.get_name(), what, exc_info=error)
        self._die(f"this front's task {task.get_name()} stopped ({what})")
        self.broken.set()

    def _die(self, reason: str) -> None:
        stopped = self.status is not None and self.status.state is EngineState.STOPPED
        if self.dead is None:
            if stopped:
                reason = "the engine has stopped"
            else:
                log.error("engine lost: %s; failing every waiting request with 500", reason)
            self.dead = reason
            self.changed.set()
        self._forget_pidfds()
        if stopped:  # a drained engine has answered everything: nothing should be waiting
            error: CarpoolError = NotReady("the model engine has stopped; retry on another replica", 1.0)
        else:
            error = BatchFailed(f"the model engine failed while serving this request: {self.dead}")
        self._fail_all(error)

    def _fail_all(self, error: CarpoolError) -> None:
        futures: list[asyncio.Future[Any]] = [*self._waiting.values(), *self._controls.values()]
        for future in futures:
            if not future.done():
                future.set_exception(error)
        for stream in self._streams.values():
            stream.put_nowait(error)
        for replies in self._replies.values():
            replies.put_nowait(error)

    def pending(self) -> dict[str, Any]:
        return {"encode": len(self._waiting), "generate": len(self._streams), "relayed": len(self._replies)}


_ORDER = {
    EngineState.LOADING: 0,
    EngineState.WARMING: 1,
    EngineState.READY: 2,
    EngineState.DRAINING: 3,
    EngineState.STOPPED: 4,
}


def hung_step(status: Status, timeout_s: float | None) -> str | None:
    """Why an engine whose heartbeat still comes counts as hung: its oldest running step is older than
    `timeout_s` (`generation.step_timeout_s`); None while it makes progress."""
    if timeout_s is None or status.step_age_s <= timeout_s:
        return None
    return (
        f"engine process {status.engine}: a step has run {status.step_age_s:.0f}s without finishing "
        f"(generation.step_timeout_s={timeout_s:g}): a hung collective or device"
    )


def combined(statuses: list[Status | None]) -> Status | None:
    """The engine as a front sees it, from each engine process's last status: a failed one if any has
    failed, else the one furthest behind (loading, warming, ready, draining, stopped); None until every
    process has spoken (one not yet heard from counts as loading)."""
    known = [status for status in statuses if status is not None]
    failed = [status for status in known if status.state is EngineState.FAILED]
    if failed:
        return failed[0]
    if len(known) < len(statuses):
        return None
    return min(known, key=lambda status: _ORDER[status.state])
