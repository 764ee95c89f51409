"""The served model's lifecycle and its one entry point for inference, independent of any protocol.

LOADING -> WARMING -> READY -> DRAINING -> STOPPED (or FAILED from LOADING/WARMING). The model loads in
the background so the process answers liveness at once; it reports ready only after warm-up. On drain
it refuses new requests (503) and finishes every request it had accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncGenerator, Callable
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, cast

from carpool.runtime.batching.continuous import BlockAllocator, IterationPolicy, IterationScheduler, Sequence
from carpool.runtime.batching.former import FormationPolicy
from carpool.runtime.batching.generation_loop import Delta, GenerationLoop, Stream, deltas
from carpool.runtime.batching.loop import BatchLoop
from carpool.runtime.batching.queue import RequestQueue
from carpool.runtime.batching.scheduler import Scheduler
from carpool.runtime.config import RuntimeConfig, Task, check_token_budget
from carpool.runtime.engines.base import AnyEngine, Engine, EngineInfo, GenerativeEngine
from carpool.runtime.errors import CarpoolError, InputTooLong, InvalidInput, NotReady, OutOfMemory
from carpool.runtime.metrics import RuntimeMetrics
from carpool.runtime.sampling import SamplingParams
from carpool.runtime.warmup import padding_slack, warmup_shapes

log = logging.getLogger(__name__)

EngineFactory = Callable[[RuntimeConfig], AnyEngine]

INLINE_TOKENIZE_CHARS = 2048
"""Requests with at most this many characters in all are tokenized on the event loop: a fast tokenizer
takes tens of microseconds for them, less than handing them to the tokenizer thread and back costs. Longer
ones go to the thread so that the loop keeps serving meanwhile."""


def _load_engine(config: RuntimeConfig) -> AnyEngine:
    from carpool.runtime.engines.loader import load_engine  # imports torch: only when a model loads

    return load_engine(config)


class State(enum.StrEnum):
    LOADING = "loading"
    WARMING = "warming"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass
class InferResult:
    outputs: list[Any]
    """One per input, in order (embedding rows, class probabilities)."""
    prompt_tokens: int


class ModelService:
    """Loads, warms up, serves and drains one model."""

    def __init__(
        self,
        config: RuntimeConfig,
        engine_factory: EngineFactory = _load_engine,
        metrics: RuntimeMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.name = config.served_name()
        self.metrics = metrics or RuntimeMetrics(self.name)
        self.clock = clock
        self.state = State.LOADING
        self.failure: BaseException | None = None
        self.engine: Engine | None = None
        self.generator: GenerativeEngine | None = None
        self.iteration: IterationScheduler | None = None
        """The continuous-batching scheduler, for generation models."""
        self._generation_loop: GenerationLoop | None = None
        self._engine_factory = engine_factory
        batching = config.batching
        self.scheduler = Scheduler(
            FormationPolicy.from_config(batching),
            RequestQueue(batching.max_queue_size, batching.priority_levels),
        )
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="carpool-model")
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="carpool-tokenize")
        self._thread_tokenizing = 0
        """Tokenizations handed to the tokenizer thread and not yet awaited back (event loop only)."""
        self._loop: BatchLoop | None = None
        self._startup: asyncio.Task[None] | None = None
        self._inflight = 0
        self._no_inflight = asyncio.Event()
        self._no_inflight.set()
        self.settled = asyncio.Event()
        """Set once start-up has ended, ready or failed."""
        self.metrics.watch(
            queue_depth=lambda: self.iteration.waiting if self.iteration else self.scheduler.waiting,
            backlog_seconds=lambda: (self.iteration or self.scheduler).backlog_seconds(),
            inflight=lambda: self._inflight,
        )

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Begin loading in the background; returns at once."""
        self._startup = asyncio.create_task(self._start(), name="carpool-startup")

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            engine = await loop.run_in_executor(self._model_thread, self._engine_factory, self.config)
            self.state = State.WARMING
            if engine.info.task is Task.GENERATE:
                await self._start_generation(cast(GenerativeEngine, engine))
            else:
                encoder = cast(Engine, engine)
                check_token_budget(self.config.batching, encoder.info.max_input_tokens)
                self.engine = encoder
                self.scheduler.policy = replace(self.scheduler.policy, packed=encoder.info.packed)
                await loop.run_in_executor(self._model_thread, self._warm_up, encoder)
                self._loop = BatchLoop(self.scheduler, encoder, self.metrics, self._model_thread, self.clock)
                self._loop.start()
            if self.state is State.WARMING:
                self.state = State.READY
                self.metrics.ready.set(1)
                log.info("ready: serving %s", self.name)
        except Exception as exc:
            self.state = State.FAILED
            self.failure = exc
            log.error("start-up failed: %s", exc, exc_info=not isinstance(exc, CarpoolError | ValueError))
        finally:
            self.settled.set()

    def _warm_up(self, engine: Engine) -> None:
        shapes = warmup_shapes(self.config.warmup, self.config.batching, engine.info.max_input_tokens)
        started = time.perf_counter()
        for size, length in shapes:
            batch = [engine.dummy_input(length)] * size
            for _ in range(self.config.warmup.iterations):
                began = time.perf_counter()
                try:
                    engine.forward(batch)
                except (OutOfMemory, MemoryError) as exc:
                    raise OutOfMemory(
                        f"warm-up batch of {size} x {length} tokens ran out of memory; lower "
                        "batching.max_batch_tokens or batching.max_batch_size"
                    ) from exc
                seconds = time.perf_counter() - began
                self.scheduler.throughput.record(size * length, seconds)
                self.metrics.warmup_batches.inc()
                log.info("warm-up batch %d x %d tokens: %.1f ms", size, length, seconds * 1000)
        if shapes and self.config.batching.padding_slack_tokens is None and not engine.info.packed:
            self._calibrate(engine, shapes[0], shapes[-1])
        total = time.perf_counter() - started
        self.metrics.warmup_seconds.set(total)
        log.info("warm-up finished: %d batches in %.2fs", len(shapes) * self.config.warmup.iterations, total)

    def _calibrate(self, engine: Engine, small: tuple[int, int], large: tuple[int, int]) -> None:
        """Time the smallest and largest warm-up batches again (now warm) and set the padding slack from
        the model's fixed cost per batch and cost per token on this device."""
        points: list[tuple[int, float]] = []
        for size, length in (small, large, small, large, small):
            batch = [engine.dummy_input(length)] * size
            began = time.perf_counter()
            engine.forward(batch)
            points.append((size * length, time.perf_counter() - began))
        slack = padding_slack(points, self.config.batching.max_batch_tokens)
        self.scheduler.policy = replace(self.scheduler.policy, padding_slack_tokens=slack)
        log.info("padding slack measured at %d tokens (fixed cost per batch / cost per token)", slack)

    async def _start_generation(self, engine: GenerativeEngine) -> None:
        generation, batching = self.config.generation, self.config.batching
        self.generator = engine
        self.iteration = IterationScheduler(
            IterationPolicy(
                generation.max_running_sequences, generation.max_step_tokens, generation.kv_admit_watermark
            ),
            RequestQueue(batching.max_queue_size, batching.priority_levels),
            BlockAllocator(engine.num_blocks, engine.block_size),
        )
        iteration = self.iteration
        self.metrics.watch_generation(running=lambda: len(iteration.running), kv_usage=iteration.kv_usage)
        await asyncio.get_running_loop().run_in_executor(self._model_thread, self._warm_up_generation, engine)
        self._generation_loop = GenerationLoop(
            iteration, engine, self.metrics, self._model_thread, self.clock
        )
        self._generation_loop.start()

    def _warm_up_generation(self, engine: GenerativeEngine) -> None:
        """Prefill and decode at the configured batch sizes and prompt lengths, through the real scheduler
        and cache, before the first request."""
        assert self.iteration is not None
        warmup, generation = self.config.warmup, self.config.generation
        if not warmup.enabled:
            return
        sizes = warmup.batch_sizes or sorted({1, generation.max_running_sequences})
        lengths = warmup.sequence_lengths or [16, min(512, engine.max_model_len // 2)]
        started = time.perf_counter()
        for size in sizes:
            for length in lengths:
                length = max(1, min(length, engine.max_model_len - 8))
                for _ in range(warmup.iterations):
                    began = time.perf_counter()
                    seqs = [
                        Sequence(
                            tokens=engine.dummy_prompt(length),
                            arrival=0.0,
                            deadline=float("inf"),
                            max_tokens=4,
                        )
                        for _ in range(min(size, generation.max_running_sequences))
                    ]
                    for seq in seqs:
                        self.iteration.submit(seq, 0.0)
                    steps = 0
                    while self.iteration.running or self.iteration.waiting:
                        plan = self.iteration.schedule(0.0)
                        step_began = time.perf_counter()
                        sampled = engine.step(plan, {})
                        self.iteration.complete(plan, sampled, time.perf_counter() - step_began)
                        steps += 1
                        for seq in list(self.iteration.running):
                            if len(seq.output) >= seq.max_tokens:
                                self.iteration.finish(seq)
                    self.metrics.warmup_batches.inc()
                    log.info(
                        "warm-up: %d sequences x %d prompt tokens, %d steps: %.1f ms",
                        len(seqs),
                        length,
                        steps,
                        (time.perf_counter() - began) * 1000,
                    )
        total = time.perf_counter() - started
        self.metrics.warmup_seconds.set(total)
        log.info("warm-up finished in %.2fs", total)

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests, finish accepted ones (up to `timeout_s`); True if all finished."""
        if self.state in (State.LOADING, State.WARMING, State.READY):
            self.state = State.DRAINING
        self.metrics.ready.set(0)
        log.info("draining: %d requests in flight, %d inputs queued", self._inflight, self.scheduler.waiting)
        try:
            await asyncio.wait_for(self._no_inflight.wait(), timeout_s)
            finished = True
        except TimeoutError:
            log.warning("drain timed out after %.1fs with %d requests unanswered", timeout_s, self._inflight)
            finished = False
        return finished

    async def close(self) -> None:
        if self._startup is not None and not self._startup.done():
            self._startup.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._startup
        if self._loop is not None:
            await self._loop.stop()
        if self._generation_loop is not None:
            await self._generation_loop.stop()
        if self.state is not State.FAILED:
            self.state = State.STOPPED
        self.metrics.ready.set(0)
        self._model_thread.shutdown(wait=False, cancel_futures=True)
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    @property
    def ready(self) -> bool:
        return self.state is State.READY

    @property
    def info(self) -> EngineInfo:
        self._require_ready()
        engine = self.engine or self.generator
        assert engine is not None
        return engine.info

    def _require_ready(self) -> None:
        if self.state is State.READY:
            return
        if self.state is State.DRAINING or self.state is State.STOPPED:
            raise NotReady("the server is shutting down; send the request to another replica", 1.0)
        if self.state is State.FAILED:
            raise NotReady(f"the model failed to start: {self.failure}", 30.0)
        raise NotReady(f"the model is {self.state.value}; retry shortly", 5.0)

    # -- inference ------------------------------------------------------------------------------

    async def infer(
        self, texts: Seq[str], priority: int | None = None, timeout_s: float | None = None
    ) -> InferResult:
        """Batch `texts` with everyone else's and return one output per text, in order."""
        self._require_ready()
        if self.engine is None or self._loop is None:
            raise InvalidInput(
                f"model {self.name!r} generates text: use /v1/completions or /v1/chat/completions"
            )
        arrival = self.clock()
        batching = self.config.batching
        if not texts:
            raise InvalidInput("input is empty: send at least one text")
        if len(texts) > batching.items_limit:
            raise InvalidInput(
                f"too many inputs: {len(texts)} in one request, the limit is {batching.items_limit}"
            )
        for index, text in enumerate(texts):
            if not text:
                raise InvalidInput(f"input[{index}] is an empty string")
        priority, deadline = self._admission(priority, timeout_s, arrival)

        self._enter()
        items = []
        try:
            tokens = await self._tokenize(texts)
            items = self._loop.submit(tokens, priority, deadline)
            results = await asyncio.gather(*(item.payload for item in items), return_exceptions=True)
        except asyncio.CancelledError:
            self._loop.cancel(items)
            raise
        finally:
            self._leave()
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return InferResult(outputs=list(results), prompt_tokens=sum(len(t) for t in tokens))

    async def _tokenize(self, texts: Seq[str]) -> list[list[int]]:
        assert self.engine is not None
        limit = self.engine.info.max_input_tokens
        # A text far longer than the limit is refused without tokenizing it (cheap guard against
        # megabyte strings); 64 characters per token is beyond any real tokenizer.
        for index, text in enumerate(texts):
            if len(text) > 64 * limit:
                raise InputTooLong(
                    f"input[{index}] has {len(text)} characters, far more than the {limit}-token limit"
                )
        # Inline only while the thread is idle: a transformers tokenizer must not run in two threads at
        # once (it sets its truncation state on every call: "Already borrowed").
        if not self._thread_tokenizing and sum(len(text) for text in texts) <= INLINE_TOKENIZE_CHARS:
            tokens = self.engine.tokenize(texts)  # tens of microseconds: less than a hop to the thread
        else:
            loop = asyncio.get_running_loop()
            job = self._tokenizer_thread.submit(self.engine.tokenize, list(texts))
            self._thread_tokenizing += 1
            # Counted down when the job has really ended, even if this request is cancelled meanwhile.
            job.add_done_callback(lambda _: self._call_soon(loop, self._thread_tokenized))
            tokens = await asyncio.wrap_future(job)
        for index, ids in enumerate(tokens):
            if len(ids) > limit:
                raise InputTooLong(
                    f"input[{index}] has {len(ids)} tokens; this model accepts at most {limit}"
                )
        return tokens

    def _thread_tokenized(self) -> None:
        self._thread_tokenizing -= 1

    @staticmethod
    def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is left to count for
            loop.call_soon_threadsafe(callback)

    # -- generation -----------------------------------------------------------------------------

    async def generate(
        self,
        params: SamplingParams,
        prompt: str | None = None,
        messages: list[dict[str, str]] | None = None,
        priority: int | None = None,
        timeout_s: float | None = None,
        max_tokens_given: bool = True,
    ) -> Generation:
        """Tokenize, check the limits, and queue one sequence; iterate the result for its deltas."""
        self._require_ready()
        engine, loop = self.generator, self._generation_loop
        if engine is None or loop is None:
            raise InvalidInput(f"model {self.name!r} does {self.info.task.value}, not text generation")
        arrival = self.clock()
        priority, deadline = self._admission(priority, timeout_s, arrival)
        executor = asyncio.get_running_loop()
        if messages is not None:
            ids = await executor.run_in_executor(self._tokenizer_thread, engine.encode_chat, messages)
        else:
            ids = await executor.run_in_executor(self._tokenizer_thread, engine.encode, prompt or "")
        if not ids:
            raise InvalidInput("the prompt is empty")
        limit = engine.max_model_len
        room = limit - len(ids)
        max_tokens = params.max_tokens if max_tokens_given else min(params.max_tokens, room)
        if len(ids) + max_tokens > limit:
            raise InvalidInput(
                f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: together "
                f"{len(ids) + max_tokens}, more than the context of {limit} tokens; shorten the prompt or "
                f"lower max_tokens to at most {max(room, 0)}"
            )
        params = replace(params, max_tokens=max_tokens)
        stream = loop.submit(ids, params, priority, deadline)
        self._enter()
        return Generation(stream, self._follow(loop, stream))

    async def _follow(self, loop: GenerationLoop, stream: Stream) -> AsyncGenerator[Delta, None]:
        try:
            async for delta in deltas(stream):
                yield delta
        finally:
            if stream.finish_reason is None:
                loop.cancel(stream)  # the caller left or the sequence failed: free its slot and cache
            self._leave()

    def _admission(self, priority: int | None, timeout_s: float | None, arrival: float) -> tuple[int, float]:
        batching = self.config.batching
        if priority is None:
            priority = batching.default_priority
        if not 0 <= priority < batching.priority_levels:
            raise InvalidInput(f"priority {priority} is outside 0..{batching.priority_levels - 1}")
        if timeout_s is not None and timeout_s <= 0:
            raise InvalidInput(f"timeout must be positive, got {timeout_s}")
        return priority, arrival + min(timeout_s or batching.default_timeout_s, batching.default_timeout_s)

    def _enter(self) -> None:
        self._inflight += 1
        self._no_inflight.clear()

    def _leave(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._no_inflight.set()


@dataclass
class Generation:
    """One queued generation: its stream (for usage counts) and the deltas to iterate."""

    stream: Stream
    deltas: AsyncGenerator[Delta, None]

    @property
    def prompt_tokens(self) -> int:
        return self.stream.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self.stream.completion_tokens
