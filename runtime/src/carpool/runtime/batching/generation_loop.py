"""The asyncio driver of continuous batching: one model step at a time in the worker thread, tokens
streamed to each caller as they are sampled.

Between steps it asks the iteration scheduler for the next plan, answers expired sequences, and turns
each sampled token into text for its caller, finishing sequences at end of text, a stop string,
max_tokens or the context limit. A caller that goes away is withdrawn; its cache is freed at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from carpool.runtime.batching.continuous import IterationScheduler, Sequence, StepPlan
from carpool.runtime.batching.driver import Driver
from carpool.runtime.batching.request import ItemState
from carpool.runtime.errors import BatchFailed, CarpoolError, DeadlineExceeded, NotReady, OutOfMemory
from carpool.runtime.metrics import RuntimeMetrics
from carpool.runtime.sampling import SamplingParams, TextTracker

log = logging.getLogger(__name__)


class StepEngine(Protocol):
    eos_ids: set[int]
    max_model_len: int

    def step(self, plan: StepPlan, params: dict[int, SamplingParams]) -> dict[int, int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def forget(self, seq_id: int) -> None: ...


@dataclass
class Delta:
    """A piece of a generation: new text, and at the end the finish reason."""

    text: str
    finish_reason: str | None = None


@dataclass
class Stream:
    """What a caller holds: the sequence and the queue its deltas arrive on."""

    seq: Sequence
    params: SamplingParams
    queue: asyncio.Queue[Delta | CarpoolError] = field(default_factory=asyncio.Queue)
    tracker: TextTracker = field(init=False)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self.tracker = TextTracker(self.params.stop)

    @property
    def prompt_tokens(self) -> int:
        return len(self.seq.tokens)

    @property
    def completion_tokens(self) -> int:
        return len(self.seq.output)


class GenerationLoop(Driver):
    task_name = "carpool-generation-loop"

    def __init__(
        self,
        scheduler: IterationScheduler,
        engine: StepEngine,
        metrics: RuntimeMetrics,
        model_thread: ThreadPoolExecutor,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(metrics, model_thread, clock)
        self.scheduler = scheduler
        self.engine = engine
        self._streams: dict[int, Stream] = {}

    async def stop(self) -> None:
        await super().stop()
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(NotReady("the server stopped"))

    def submit(self, prompt: list[int], params: SamplingParams, priority: int, deadline: float) -> Stream:
        now = self.clock()
        seq = Sequence(
            tokens=prompt, arrival=now, deadline=deadline, priority=priority, max_tokens=params.max_tokens
        )
        self.scheduler.submit(seq, now)
        stream = Stream(seq, params)
        self._streams[seq.seq] = stream
        self._wake.set()
        return stream

    def cancel(self, stream: Stream) -> None:
        self.scheduler.cancel(stream.seq)
        self._drop(stream)
        self._wake.set()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            plan = self.scheduler.schedule(self.clock())
            for seq in plan.expired:
                stream = self._streams.get(seq.seq)
                if stream is not None:
                    stream.queue.put_nowait(
                        DeadlineExceeded(
                            "the request waited past its deadline and was not run; retry, or allow a longer "
                            "timeout (header x-carpool-timeout)"
                        )
                    )
                    self._drop(stream)
            if plan.preempted:
                self.metrics.preemptions.inc(len(plan.preempted))
            if not plan.work:
                deadline = self.scheduler.queue.next_deadline()
                timeout = None if deadline is None else max(0.0, deadline - self.clock())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                continue
            await self._step(plan)

    async def _step(self, plan: StepPlan) -> None:
        params = {w.seq.seq: self._streams[w.seq.seq].params for w in plan.work if w.seq.seq in self._streams}
        started = self.clock()
        loop = asyncio.get_running_loop()
        try:
            sampled = await loop.run_in_executor(self._thread, self.engine.step, plan, params)
        except Exception as exc:
            error: CarpoolError = (
                exc
                if isinstance(exc, OutOfMemory)
                else BatchFailed(f"the model failed on this step: {type(exc).__name__}: {exc}")
            )
            log.error("generation step failed; failing its %d sequences", len(plan.work), exc_info=exc)
            for work in plan.work:
                self._fail(work.seq, error)
            return
        seconds = self.clock() - started
        self.scheduler.complete(plan, sampled, seconds)
        self.metrics.batch_duration.observe(seconds)
        self.metrics.batch_size.observe(len(plan.work))
        now = self.clock()
        for work in plan.work:
            token = sampled.get(work.seq.seq)
            stream = self._streams.get(work.seq.seq)
            if token is None or stream is None or work.seq.state is not ItemState.RUNNING:
                continue
            self._emit(stream, token, now)

    def _emit(self, stream: Stream, token: int, now: float) -> None:
        seq = stream.seq
        self.metrics.generated_tokens.inc()
        if stream.first_token_at is None:
            stream.first_token_at = now
            self.metrics.time_to_first_token.observe(now - seq.arrival)
        elif stream.last_token_at is not None:
            self.metrics.inter_token_latency.observe(now - stream.last_token_at)
        stream.last_token_at = now
        finish: str | None = None
        if token in self.engine.eos_ids:
            seq.output.pop()  # the end-of-text token is not part of the answer
            finish = "stop"
        delta = stream.tracker.update(self.engine.decode(seq.output))
        if stream.tracker.stopped:
            finish = "stop"
        elif finish is None and (len(seq.output) >= seq.max_tokens or seq.total >= self.engine.max_model_len):
            finish = "length"
        if finish is not None:
            delta += stream.tracker.flush()
            stream.finish_reason = finish
            self.scheduler.finish(seq)
            self._drop(stream)
        if delta or finish is not None:
            stream.queue.put_nowait(Delta(delta, finish))

    def _fail(self, seq: Sequence, error: CarpoolError) -> None:
        self.scheduler.finish(seq, ItemState.FAILED)
        stream = self._streams.get(seq.seq)
        if stream is not None:
            stream.queue.put_nowait(error)
            self._drop(stream)

    def _drop(self, stream: Stream) -> None:
        self._streams.pop(stream.seq.seq, None)
        self.engine.forget(stream.seq.seq)


async def deltas(stream: Stream) -> AsyncIterator[Delta]:
    """The caller's side: deltas until the finishing one; raises the error that ended the sequence."""
    while True:
        item = await stream.queue.get()
        if isinstance(item, CarpoolError):
            raise item
        yield item
        if item.finish_reason is not None:
            return
