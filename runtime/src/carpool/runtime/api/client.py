"""The front's one door to the engine process: send requests, abort them, receive their outputs.

After vLLM's `AsyncMPClient` (`v1/engine/core_client.py`): a PUSH socket into the engine (which binds)
and a PULL socket out of it (which this front binds), on zmq.asyncio, and one task that decodes outputs
and hands each to the request waiting for it. The same task follows the engine's `Status` messages
(state, model facts, tokenizer).

Requests go to the engine in frames of several: a message is queued and the queue is sent, as one list,
once the event loop has run every callback that was ready with it (`loop.call_soon`). Under load the
requests that arrive together share one send, one wake-up of each side's ZeroMQ I/O thread and one
wake-up of the engine's loop, instead of one each; alone, a request waits for nothing (the flush runs
in the loop's next turn). The order of messages (a request, then its abort) is kept. The PUSH socket is a
plain one, never awaited: with no high-water mark a send always queues at once.

The client also decides whether the engine is alive. It watches the engine's process (a pidfd: readable
the moment the process ends) and its heartbeat (a `Status` at least every half second); when the engine
dies, fails or falls silent, every request it held fails at once with 500 (the engine failed while
serving it), every new one is refused with 503, and `dead` says why, so no request hangs on an engine that
will never answer. The client's own tasks are watched the same way: if the task that reads the engine's
outputs (or the heartbeat watch) stops on an error, the front can no longer answer anything, so it counts
as dead too, and `broken` tells the front process to exit non-zero.
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
    FrontMessage,
    GenerateRequest,
    Goodbye,
    LoadAdapter,
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

    def __init__(self, addresses: Addresses, front: int, heartbeat_timeout_s: float = 10.0) -> None:
        self.addresses = addresses
        self.front = front
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.status: Status | None = None
        self.dead: str | None = None
        """Why the engine is gone (None while it runs)."""
        self.broken = asyncio.Event()
        """Set when one of this client's own tasks stopped on an error: the front must exit."""
        self.changed = asyncio.Event()
        """Set on every new engine state (tests and the lifecycle wait on it)."""
        self._codec = Codec.create()
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[EncodeOutput]] = {}
        self._controls: dict[int, asyncio.Future[AdapterDone]] = {}
        self._streams: dict[int, asyncio.Queue[TokenOutput | CarpoolError]] = {}
        self._context: zmq.asyncio.Context | None = None
        self._push: zmq.Socket[bytes] | None = None
        self._outbox: list[FrontMessage] = []
        """Messages for the engine, sent together at the loop's next turn (`_flush`)."""
        self._pull: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._last_heard = time.monotonic()
        self._pidfd: int | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        self._push = zmq.Context.shadow(self._context).socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 2000)
        self._push.connect(self.addresses.input)
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(self.addresses.outputs[self.front])
        self._last_heard = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._receive(), name="carpool-engine-outputs"),
            asyncio.create_task(self._watch_heartbeat(), name="carpool-engine-heartbeat"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._task_ended)

    async def close(self, goodbye: bool = True) -> None:
        """Stop listening; with `goodbye`, tell the engine this front will send nothing more."""
        engine_there = self.dead is None or self.broken.is_set()  # a broken front's engine still runs
        if goodbye and engine_there and self._push is not None:
            self._outbox.append(Goodbye(self.front))
            self._flush()
        for task in self._tasks:
            task.remove_done_callback(self._task_ended)
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._forget_pidfd()
        if self._context is not None:
            for sock in (self._push, self._pull):
                if sock is not None:
                    sock.close()
            self._push = self._pull = None
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
            self._send(request)
            return await future
        except asyncio.CancelledError:
            self.abort([request.rid])
            raise
        finally:
            self._waiting.pop(request.rid, None)

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
        """Withdraw requests (sent after anything queued before, so never ahead of the request)."""
        if self.dead is None and self._push is not None:
            self._post(Abort(rids))

    def _send(self, message: FrontMessage) -> None:
        if self.dead is not None:
            raise NotReady(f"the model engine is not running ({self.dead}); retry on another replica", 1.0)
        assert self._push is not None, "start() first"
        self._post(message)

    def _post(self, message: FrontMessage) -> None:
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(message)

    def _flush(self) -> None:
        """Send the queued messages as one frame. A send that fails (the socket closed under it) fails the
        requests it carried, so none waits for an answer the engine never got."""
        messages, self._outbox = self._outbox, []
        if not messages or self._push is None:
            return
        try:
            self._push.send(self._codec.encoder.encode(messages), zmq.NOBLOCK)
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
            self._last_heard = time.monotonic()
            for message in decoder.decode(frame.buffer):
                if isinstance(message, Status):
                    self._on_status(message)
                elif isinstance(message, TokenOutput):
                    stream = self._streams.get(message.rid)
                    if stream is not None:
                        stream.put_nowait(message)
                elif isinstance(message, EncodeOutput):
                    future = self._waiting.get(message.rid)
                    if future is not None and not future.done():
                        future.set_result(message)
                elif isinstance(message, AdapterDone):
                    control = self._controls.get(message.rid)
                    if control is not None and not control.done():
                        control.set_result(message)
                else:
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
        self.status = status
        if self._pidfd is None and status.pid != os.getpid():
            self._watch_process(status.pid)
        if status.state is EngineState.FAILED:
            self._die(status.failure or "the engine failed")
        if status.state is not before:
            self.changed.set()
            self.changed = asyncio.Event()

    def _watch_process(self, pid: int) -> None:
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:  # already gone, or no pidfd (kernel < 5.3): the heartbeat still tells
            return
        asyncio.get_running_loop().add_reader(self._pidfd, self._die, f"the engine process {pid} exited")

    def _forget_pidfd(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    async def _watch_heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_timeout_s / 4)
            if self.status is None:
                continue  # the engine process is still starting (importing torch can take a while)
            silent = time.monotonic() - self._last_heard
            if silent > self.heartbeat_timeout_s and self.state is not EngineState.STOPPED:
                self._die(f"no word from the engine for {silent:.0f}s")

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
        self._forget_pidfd()
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

    def pending(self) -> dict[str, Any]:
        return {"encode": len(self._waiting), "generate": len(self._streams)}
