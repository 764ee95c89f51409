"""The engine's busy loop, the model's thread, and the two threads that connect them to the fronts.

    input thread:  PULL socket -> msgspec decode (a front sends its requests in lists) -> input queue
    busy loop:     input queue -> submit/abort -> schedule -> launch a batch or step -> output queue
    main thread:   loads and warms up the model, then runs each launched batch or step; its completion
                   goes back into the input queue (with several model instances, `engine.instances`,
                   more threads run launches beside it)
    output thread: output queue -> msgspec encode (one frame per front per turn) -> that front's PUSH socket

After vLLM's `EngineCoreProc` (`run_busy_loop`, `process_input_sockets`, `process_output_sockets`): the
loop never touches a socket, and the threads only move bytes, so decoding the next requests and encoding
the last outputs overlap the model's forward pass (torch releases the GIL while it computes). The loop
owns every piece of queue state; fronts hold none.

Unlike vLLM, the forward pass does not run inside the loop: while a batch runs, the loop keeps admitting
(and refusing, 429) new requests into the queue the next batch is formed from, answers queued ones whose
deadline passes (504) and withdraws those whose caller left, and the queue-depth gauge shows the waiting
work; a long batch does not freeze the queue.

The model runs in the process's MAIN thread, the same thread that warmed it up, and the loop in a thread
of its own: on CPU, torch's OpenMP/MKL intra-op parallelism run from a second thread left 0.3-0.4 of
2 cores idle during forward passes (MiniLM, batches of 32: ~85 inputs/s from a worker thread against
~110 from the main thread, same process, same batches; see bench/RESULTS.md), so the forward pass stays
where torch was initialised.

The output thread also repeats the engine's `Status` as a heartbeat, so fronts tell a live engine from one
that stopped, with the age of the oldest batch or step still running (`step_age_s`): a step that hangs (a
collective waiting on a rank that will never answer) leaves the heartbeat going but its age grows, and the
fronts fail liveness past `generation.step_timeout_s` (`api.client`). The text spec (the whole tokenizer JSON:
9 MB for Llama 3's) rides only on the first status that carries it, to every front, and again only when it
changes; heartbeats carry none and a front keeps the last one it was sent (`api.client`). That first status
reaches every front however late it binds: the engine's PUSH sockets connect and queue (SNDHWM 0: never
dropped), and a front cannot come back without its engine (the supervisor takes the pod down when either
dies).

On drain (SIGTERM) the engine keeps serving, reports DRAINING, and stops once every front has said
goodbye (it has answered everything it accepted) and nothing is left to run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import msgspec
import zmq

from carpool.runtime import threads
from carpool.runtime.engine.heap import HeapTrimmer
from carpool.runtime.engine.tasks import STARTED, Launch, Output, TaskCore
from carpool.runtime.metrics import RuntimeMetrics
from carpool.runtime.wire import (
    Abort,
    AdapterInfo,
    Addresses,
    Codec,
    EngineMessage,
    EngineState,
    FrontMessage,
    Goodbye,
    Status,
    TextSpec,
)

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.2
"""Longest the loop sleeps without a message: how soon it notices a drain request or a dead parent."""

_LOOP_ENDED = None
"""Put on the launch queue when the busy loop returns or raises: the main thread stops running work."""


class _Wake:
    """Wakes the loop to look at its own state (a socket thread has stopped)."""


@dataclass(eq=False)
class _Completed:
    """A launched batch or step has finished in the model thread."""

    launch: Launch
    result: Any
    error: BaseException | None
    instance: int
    """The model instance (thread) that ran it, free again."""


@dataclass(eq=False)
class _Posted:
    """Work another thread hands to the busy loop (see `tasks.LoopHandle.post`)."""

    work: Callable[[], list[Output]]


_Input = list[FrontMessage] | _Completed | _Wake | _Posted
"""What the loop's input queue holds: a front's messages (one frame), or word from the engine's threads."""


def since_server_start(server_pid: int | None, now: float) -> float:
    """Seconds from the server's start (process `server_pid`, the engine's parent: the container's main
    process) to `now` (monotonic), from the kernel's record of its start (/proc: ticks since boot, as
    /proc/uptime counts); from this engine process's own start where there is no parent or no /proc."""
    if server_pid is not None:
        try:
            with open(f"/proc/{server_pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open("/proc/uptime") as uptime:
                up = float(uptime.read().split()[0])
            started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
            return max(0.0, up - started - (time.monotonic() - now))
        except (OSError, ValueError, IndexError):
            pass
    return now - STARTED


class EngineCore:
    """Loads the model (through `load`), warms it up and serves it until drained."""

    def __init__(
        self,
        addresses: Addresses,
        load: Callable[[], TaskCore],
        metrics: RuntimeMetrics,
        clock: Callable[[], float] = time.monotonic,
        heartbeat_s: float = 0.5,
        parent_pid: int | None = None,
        engine: int = 0,
    ) -> None:
        self.addresses = addresses
        self.engine = engine
        """This process's number among the engine processes (`model.processes`)."""
        self.metrics = metrics
        self.clock = clock
        self.heartbeat_s = heartbeat_s
        self.parent_pid = parent_pid
        """Stop when this process is no longer our parent (the supervisor died)."""
        self.task: TaskCore | None = None
        self._load = load
        self._status = Status(EngineState.LOADING, os.getpid(), engine=engine)
        self._inputs: queue.SimpleQueue[_Input] = queue.SimpleQueue()
        self._launches: list[queue.SimpleQueue[Launch | None]] = []
        """One per model instance, the first the main thread's (made when serving starts)."""
        self._loop_error: BaseException | None = None
        self._loop_stop = threading.Event()
        self._heap = HeapTrimmer(clock)
        self._running_since: dict[int, float] = {}
        """When each model thread (by instance) started the launch it runs now."""
        self._outputs: queue.SimpleQueue[list[Output] | None] = queue.SimpleQueue()
        self._status_changed = threading.Event()
        self._stop = threading.Event()
        self._drain = threading.Event()
        self._goodbyes: set[int] = set()
        self._thread_failure: str | None = None
        """Set by an input or output thread that stopped on an error: the loop then fails the engine."""
        self._context = zmq.Context()
        # The engine binds its input, and connects to each front's output socket: a connecting socket
        # queues messages until the peer is there, so a front that starts late still gets the status
        # (even a failure at load) that was sent before it listened.
        self._in_socket = self._context.socket(zmq.PULL)
        self._in_socket.bind(addresses.engine_input(engine))
        self._out_sockets = []
        # Then vLLM's surface processes, where there are (`Addresses.surfaces`): slots after the fronts'.
        for address in (*addresses.outputs, *addresses.surfaces):
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop an output for lack of buffer
            sock.setsockopt(zmq.LINGER, 5000)  # the last status reaches a front that starts late
            sock.connect(address)
            self._out_sockets.append(sock)
        self._threads = [
            threading.Thread(
                target=self._supervised,
                args=(self._input_thread, threads.INPUT),
                name="carpool-engine-input",
                daemon=True,
            ),
            threading.Thread(
                target=self._supervised,
                args=(self._output_thread, threads.OUTPUT),
                name="carpool-engine-output",
                daemon=True,
            ),
        ]

    @property
    def state(self) -> EngineState:
        return self._status.state

    def post(self, work: Callable[[], list[Output]]) -> None:
        self._inputs.put(_Posted(work))

    def set_adapters(self, adapters: tuple[AdapterInfo, ...]) -> None:
        if adapters != self._status.adapters:
            self._set(self._status.state, adapters=adapters)

    def request_drain(self) -> None:
        """Keep serving, report DRAINING, stop once every front has said goodbye. Signal-safe."""
        self._drain.set()

    def on_signals(self) -> None:
        """SIGTERM and SIGINT (the supervisor passes them on): drain while serving; exit at once (0)
        while loading or warming up, when no request can have been accepted yet. Main thread only."""

        def on_signal(sig: int, frame: FrameType | None) -> None:
            if self.state in (EngineState.LOADING, EngineState.WARMING):
                log.info("received %s while %s: exiting", signal.Signals(sig).name, self.state.value)
                raise SystemExit(0)
            self.request_drain()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def run(self) -> int:
        """Load, warm up and serve; returns the exit code (0 drained, 1 failed)."""
        for thread in self._threads:
            thread.start()
        # Gauges exist from the first scrape (a "most recent" gauge no process has set is left out).
        self.metrics.set_queue(0, 0.0)
        self.metrics.set_ready(False)
        try:
            try:
                began = time.monotonic()
                self.metrics.observe_startup("start", since_server_start(self.parent_pid, began))
                task = self._load()
                self.task = task
                loaded = time.monotonic()
                self.metrics.observe_startup("load", loaded - began)
                self._set(EngineState.WARMING, info=task.info)
                task.warm_up()
                self.metrics.observe_startup("warmup", time.monotonic() - loaded)
                self._set(EngineState.READY, info=task.info, text=task.text_spec())
            except Exception as exc:
                expected = isinstance(exc, ValueError)  # configuration errors explain themselves
                log.error("engine failed: %s", exc, exc_info=not expected)
                failure = str(exc) if expected else f"{type(exc).__name__}: {exc}"
                self._set(EngineState.FAILED, failure=failure)
                return 1
            self.metrics.set_ready(True)
            log.info("ready: serving %s", task.info.name)
            try:
                self._serve(task)
            except Exception as exc:
                # An error of the loop's own (scheduling, completion handling, a socket thread that
                # stopped; the model's errors fail only their batch): the fronts see FAILED, fail what
                # they were waiting for (500) and refuse the rest (503); the process exits 1 and the
                # supervisor takes the pod down, so Kubernetes restarts it.
                log.critical("the engine loop stopped: %s: %s", type(exc).__name__, exc, exc_info=exc)
                self._set(EngineState.FAILED, failure=f"the engine loop stopped: {type(exc).__name__}: {exc}")
                return 1
            self._set(EngineState.STOPPED)
            return 0
        finally:
            self.metrics.set_ready(False)
            self._shutdown()

    # -- the loop -------------------------------------------------------------------------------

    def _serve(self, task: TaskCore) -> None:
        """Run the busy loop in a thread and its launches here, in the main thread, until it ends; with
        several model instances (`task.instances`), in that many threads, this one included (the loop
        launches on the main thread whenever it is free: a batch running alone runs where torch was
        initialised, see the module's docstring)."""
        self._launches = [queue.SimpleQueue() for _ in range(task.instances)]
        loop = threading.Thread(
            target=self._loop_thread, args=(task,), name="carpool-engine-loop", daemon=True
        )
        instances = [
            threading.Thread(
                target=self._run_launches, args=(n,), name=f"carpool-engine-instance-{n}", daemon=True
            )
            for n in range(1, task.instances)
        ]
        loop.start()
        for thread in instances:
            thread.start()
        try:
            self._run_launches(0)
        finally:
            self._loop_stop.set()  # a loop still running (the main thread failed) stops within a poll
            loop.join(timeout=5)
            for thread in instances:
                thread.join(timeout=5)
        if self._loop_error is not None:
            raise self._loop_error

    def _run_launches(self, instance: int) -> None:
        """A model thread: run the work launched on `instance` until the loop ends."""
        launches = self._launches[instance]
        if instance > 0:  # instance 0 is the main thread, named with its process (`engine.process`)
            threads.name_thread(threads.model_thread(instance))
        while True:
            try:
                launch = launches.get(timeout=_IDLE_POLL_S)  # bounded: signal handlers run
            except queue.Empty:
                continue
            if launch is _LOOP_ENDED:
                return
            self._running_since[instance] = self.clock()
            try:
                completed = _run(launch, instance)
            finally:
                del self._running_since[instance]
            self._inputs.put(completed)

    def _loop_thread(self, task: TaskCore) -> None:
        threads.name_thread(threads.LOOP)
        try:
            self._busy_loop(task)
        except BaseException as exc:  # re-raised in the main thread: the engine fails and exits 1
            self._loop_error = exc
        finally:
            for launches in self._launches:
                launches.put(_LOOP_ENDED)

    def _busy_loop(self, task: TaskCore) -> None:
        wake_at: float | None = None
        busy: set[int] = set()  # model instances running a launch
        while not self._loop_stop.is_set():
            until = _IDLE_POLL_S if wake_at is None else wake_at - self.clock()
            outputs: list[Output] = []
            for message in self._take(max(0.0, min(_IDLE_POLL_S, until))):
                if isinstance(message, _Completed):
                    busy.discard(message.instance)
                    self._heap.worked()
                    outputs.extend(message.launch.complete(message.result, message.error))
                elif isinstance(message, _Posted):
                    outputs.extend(message.work())
                elif isinstance(message, Abort):
                    task.abort(message.rids)
                elif isinstance(message, Goodbye):
                    self._goodbyes.add(message.front)
                elif isinstance(message, _Wake):
                    pass
                else:
                    outputs.extend(task.submit(message, self.clock()))
            if self._drain.is_set() and self.state is EngineState.READY:
                log.info("engine draining: serving accepted work until every front has said goodbye")
                self.metrics.set_ready(False)
                self._set(EngineState.DRAINING)
            done = len(self._goodbyes) >= len(self.addresses.outputs)
            if self.state is EngineState.DRAINING and done and not task.busy and not busy:
                return
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                raise RuntimeError("the supervisor process went away")
            if self._thread_failure is not None:
                raise RuntimeError(self._thread_failure)
            scheduled, launch, wake_at = task.schedule(self.clock())
            outputs.extend(scheduled)
            while launch is not None:  # as many as there are idle model instances
                instance = min(set(range(task.instances)) - busy)  # the main thread first
                busy.add(instance)
                self._launches[instance].put(launch)
                if len(busy) >= task.instances:
                    break
                scheduled, launch, wake_at = task.schedule(self.clock())
                outputs.extend(scheduled)
            task.publish_gauges()
            if outputs:
                self._outputs.put(outputs)
            # Housekeeping in this thread, never a model thread's: while nothing runs or waits.
            self._heap.turn(idle=not busy and not task.busy)

    def _take(self, timeout: float) -> list[FrontMessage | _Completed | _Wake | _Posted]:
        """Everything in the input queue, waiting up to `timeout` for the first; a front's list of
        messages is taken apart, in order."""
        messages: list[FrontMessage | _Completed | _Wake | _Posted] = []
        try:
            item = self._inputs.get(timeout=timeout) if timeout > 0 else self._inputs.get_nowait()
        except queue.Empty:
            return messages
        with contextlib.suppress(queue.Empty):
            while True:
                if isinstance(item, list):
                    messages.extend(item)
                else:
                    messages.append(item)
                item = self._inputs.get_nowait()
        return messages

    def _set(self, state: EngineState, **changes: object) -> None:
        self._status = msgspec.structs.replace(self._status, state=state, **changes)
        self._status_changed.set()
        self._outputs.put([])  # wake the output thread

    # -- threads --------------------------------------------------------------------------------

    def _supervised(self, target: Callable[[], None], kernel_name: str) -> None:
        """Run a socket thread; if it stops on an error, the loop learns of it and fails the engine (a
        dead input thread would leave every later request unanswered, a dead output thread every one)."""
        threads.name_thread(kernel_name)
        try:
            target()
        except BaseException as exc:
            name = threading.current_thread().name
            log.critical("%s stopped: %s: %s", name, type(exc).__name__, exc, exc_info=exc)
            self._thread_failure = f"{name} stopped: {type(exc).__name__}: {exc}"
            self._inputs.put(_Wake())

    def _input_thread(self) -> None:
        codec = Codec.create()
        poller = zmq.Poller()
        poller.register(self._in_socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                while True:
                    try:
                        frame = self._in_socket.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        self._inputs.put(codec.front_decoder.decode(frame.buffer))
                    except msgspec.DecodeError:
                        log.error("dropped a malformed message from a front (%d bytes)", len(frame.buffer))
        finally:
            self._in_socket.close(linger=0)

    def step_age(self) -> float:
        """Seconds the oldest launch still running has run; 0.0 when none runs."""
        started = list(self._running_since.values())  # a copy: the model threads change the dict
        return max(0.0, self.clock() - min(started)) if started else 0.0

    def _output_thread(self) -> None:
        codec = Codec.create()
        last_beat = 0.0
        text_sent: TextSpec | None = None  # what every front has been sent; heartbeats leave it out
        try:
            while True:
                try:
                    first = self._outputs.get(timeout=self.heartbeat_s)
                except queue.Empty:
                    first = []
                batches = [first]
                with contextlib.suppress(queue.Empty):
                    while True:
                        batches.append(self._outputs.get_nowait())
                closing = any(batch is None for batch in batches)
                by_front: dict[int, list[EngineMessage]] = {}
                for batch in batches:
                    for front, message in batch or ():
                        by_front.setdefault(front, []).append(message)
                now = time.monotonic()
                if self._status_changed.is_set() or now - last_beat >= self.heartbeat_s or closing:
                    self._status_changed.clear()
                    last_beat = now
                    status = msgspec.structs.replace(self._status, step_age_s=round(self.step_age(), 3))
                    if status.text is not None and status.text is not text_sent:
                        text_sent = status.text  # this once, to every front: the tokenizer goes with it
                    elif status.text is not None:
                        status = msgspec.structs.replace(status, text=None)
                    for front in range(len(self._out_sockets)):
                        by_front.setdefault(front, []).append(status)
                for front, messages in by_front.items():
                    self._out_sockets[front].send(codec.encoder.encode(messages))
                if closing:
                    return
        finally:
            # Once every front has said goodbye nobody reads; otherwise wait a little for the last status.
            linger = 0 if len(self._goodbyes) >= len(self.addresses.outputs) else 5000
            for sock in self._out_sockets:
                sock.close(linger=linger)

    def _shutdown(self) -> None:
        self._outputs.put(None)  # the output thread sends the final status, then closes
        self._threads[1].join(timeout=5)
        self._stop.set()
        self._threads[0].join(timeout=5)
        if any(thread.is_alive() for thread in self._threads):
            self._context.destroy(linger=0)
        else:
            self._context.term()


def _run(launch: Launch, instance: int) -> _Completed:
    """Run launched work; what it returns or raises goes back to the loop."""
    try:
        return _Completed(launch, launch.run(), None, instance)
    except Exception as exc:
        return _Completed(launch, None, exc, instance)
