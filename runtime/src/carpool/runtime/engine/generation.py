"""Text generation in the engine: continuous batching, one model step per loop turn, token ids out.

The engine sends each sequence's new token ids as they are sampled and ends the sequence at end of text,
`max_tokens` or the context limit; the front turns ids into text and ends the sequence early (with an
`Abort`) when a stop string appears, so the engine never decodes text. A failing step fails only the
sequences in it.

Deadlines hold while a sequence runs, too: one still waiting at its deadline is answered 504 and never runs
(the queue's rule); one already running (or preempted and waiting to resume) is stopped there, its cache
blocks freed, and answered `DeadlineExceeded` with the number of tokens it had produced (504 before the
response started; an error event on a stream under way).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from carpool.runtime.batching.continuous import (
    BlockAllocator,
    IterationPolicy,
    IterationScheduler,
    Sequence,
    StepPlan,
)
from carpool.runtime.batching.lora_admission import AdapterAdmission
from carpool.runtime.batching.queue import RequestQueue
from carpool.runtime.batching.request import ItemState, WorkItem
from carpool.runtime.batching.saturation import BatchLimits, objective_estimator
from carpool.runtime.config import ConfigError, RuntimeConfig
from carpool.runtime.engine.lora import EngineAdapters
from carpool.runtime.engine.tasks import EXPIRED, Launch, LoopHandle, ModelCore, Output
from carpool.runtime.errors import (
    BatchFailed,
    CarpoolError,
    DeadlineExceeded,
    InvalidInput,
    ModelNotFound,
    OutOfMemory,
)
from carpool.runtime.metrics import RuntimeMetrics
from carpool.runtime.models.base import AdapterBackend, GenerativeEngine
from carpool.runtime.sampling import SamplingParams
from carpool.runtime.vllm_metrics import CacheFacts
from carpool.runtime.wire import (
    FrontMessage,
    GenerateRequest,
    LoadAdapter,
    TokenLogprobs,
    TokenOutput,
    UnloadAdapter,
    error_output,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Stream:
    rid: int
    front: int
    seq: Sequence
    params: SamplingParams
    deadline: float
    """The request's own deadline (preemption clears the sequence's, so that it is not expired unrun)."""
    last_token_at: float | None = None


def _ran_out(seq: Sequence) -> DeadlineExceeded:
    return DeadlineExceeded(
        f"the request ran past its deadline after generating {len(seq.output)} tokens and was stopped; "
        "allow a longer timeout (header x-carpool-timeout) or ask for fewer tokens (max_tokens)"
    )


class GenerationCore(ModelCore[GenerativeEngine]):
    """Steps a generative engine under the iteration scheduler."""

    def __init__(
        self,
        engine: GenerativeEngine,
        config: RuntimeConfig,
        metrics: RuntimeMetrics,
        clock: Callable[[], float] = time.monotonic,
        loop: LoopHandle | None = None,
    ) -> None:
        generation, batching = config.generation, config.batching
        super().__init__(engine, config, metrics, clock)
        self.adapters: EngineAdapters | None = None
        """LoRA adapters, when the config serves them (see `engine.lora`)."""
        backend: AdapterBackend | None = getattr(engine, "lora", None)
        if config.lora.active:
            if backend is None or loop is None:
                raise ConfigError(f"{type(engine).__name__} cannot serve LoRA adapters (lora.enabled)")
            self.adapters = EngineAdapters(backend, config, metrics, loop, clock)
        self.scheduler = IterationScheduler(
            IterationPolicy(
                generation.running_sequences(), generation.step_tokens(), generation.kv_admit_watermark
            ),
            RequestQueue(batching.max_queue_size, batching.priority_levels, config.objective.late_after_s),
            BlockAllocator(engine.num_blocks, engine.block_size),
            AdapterAdmission(config.lora.max_loras) if self.adapters is not None else None,
        )
        self.vllm_names = metrics.vllm_names()
        self.vllm_names.cache_config(CacheFacts(engine.block_size, engine.num_blocks))
        if self.adapters is not None:
            self.vllm_names.enable_lora(config.lora.max_loras)
        self._streams: dict[int, _Stream] = {}
        """By sequence id (the scheduler's and the engine's key)."""
        self._by_rid: dict[int, _Stream] = {}
        self._stepping = False
        self._forgotten: list[int] = []
        self.saturation = objective_estimator(
            config.objective,
            BatchLimits(generation.running_sequences(), generation.step_tokens()),
            generation=True,
        )

    @property
    def busy(self) -> bool:
        return bool(self._streams) or (self.adapters is not None and self.adapters.busy)

    # -- requests -------------------------------------------------------------------------------

    def submit(self, message: FrontMessage, now: float) -> list[Output]:
        if isinstance(message, LoadAdapter | UnloadAdapter):
            if self.adapters is None:
                error: CarpoolError = InvalidInput(
                    f"model {self.info.name!r} serves no LoRA adapters: start it with lora.enabled"
                )
                return [(message.front, error_output(message.rid, error))]
            return self.adapters.control(message)
        if not isinstance(message, GenerateRequest):
            return self.refuse(
                message,
                InvalidInput(
                    f"model {self.info.name!r} generates text: use /v1/completions or /v1/chat/completions"
                ),
            )
        seq = Sequence(
            tokens=message.prompt,
            arrival=message.arrival,
            deadline=message.deadline,
            priority=message.priority,
            max_tokens=message.params.max_tokens,
        )
        hosted = True
        if message.adapter is not None:
            try:
                if self.adapters is None:
                    raise ModelNotFound(
                        f"model {message.adapter!r} is not served here; this server serves "
                        f"{self.info.name!r} and no LoRA adapters"
                    )
                hosted = self.adapters.acquire(message.adapter)
            except CarpoolError as exc:
                return [(message.front, error_output(message.rid, exc))]
            seq.adapter = message.adapter
        stream = _Stream(message.rid, message.front, seq, message.params, message.deadline)
        self._streams[seq.seq] = stream
        self._by_rid[message.rid] = stream
        if not hosted:
            assert self.adapters is not None and seq.adapter is not None
            self.adapters.park(seq.adapter, lambda error: self._enqueue(stream, error))
            return []
        return self._enqueue(stream)

    def _enqueue(self, stream: _Stream, error: CarpoolError | None = None) -> list[Output]:
        """Queue an accepted sequence (unless it was aborted meanwhile), or answer it with `error`."""
        if self._streams.get(stream.seq.seq) is not stream:
            return []
        if error is None:
            try:
                now = self.clock()
                self.scheduler.submit(stream.seq, now)
                if self.saturation is not None:
                    self.saturation.arrive(now, 1, len(stream.seq.tokens))
                return []
            except CarpoolError as exc:
                error = exc
            except ValueError as exc:
                error = InvalidInput(str(exc))
        self._drop(stream)
        return [(stream.front, error_output(stream.rid, error))]

    def abort(self, rids: list[int]) -> None:
        for rid in rids:
            stream = self._by_rid.get(rid)
            if stream is not None:
                self.scheduler.cancel(stream.seq)  # a running one leaves at the next step
                self._drop(stream)

    # -- the loop's step ------------------------------------------------------------------------

    def schedule(self, now: float) -> tuple[list[Output], Launch | None, float | None]:
        outputs: list[Output] = []
        self._stop_overdue(now, outputs)
        if self._stepping:  # a step is running: only answer what has waited too long
            for seq in self.scheduler.queue.expire(now):
                self._expire(seq, outputs)
            return outputs, None, self.scheduler.queue.next_deadline()
        plan = self.scheduler.schedule(now)
        for seq in plan.expired:
            self._expire(seq, outputs)
        for seq in plan.truncated:
            self._truncated(seq, outputs)
        if plan.preempted:
            self.metrics.preemptions.inc(len(plan.preempted))
        if not plan.work:
            return outputs, None, self.scheduler.queue.next_deadline()
        params = {w.seq.seq: self._streams[w.seq.seq].params for w in plan.work if w.seq.seq in self._streams}
        started = self.clock()
        engine = self.engine
        self._stepping = True
        backend: AdapterBackend | None = None
        if self.adapters is not None:
            backend = self.adapters.backend
            loads, slot_of = self.adapters.place(self.scheduler.running, plan.work)

        def run() -> tuple[dict[int, int], dict[int, TokenLogprobs]]:
            if backend is not None:
                backend.prepare(loads, slot_of)  # the model thread: between steps, never during one
            sampled = engine.step(plan, params)
            return sampled, engine.logprobs

        def complete(
            sampled: tuple[dict[int, int], dict[int, TokenLogprobs]] | None, exc: BaseException | None
        ) -> list[Output]:
            self._stepping = False
            for seq_id in self._forgotten:
                engine.forget(seq_id)
            self._forgotten.clear()
            return self._complete(plan, started, sampled, exc)

        return outputs, Launch(run, complete), None

    def _stop_overdue(self, now: float, outputs: list[Output]) -> None:
        """Stop the sequences that have run (or been preempted after running) past their deadline: they
        leave the running batch at the next step and their cache blocks are freed."""
        for stream in [s for s in self._streams.values() if s.deadline <= now]:
            seq = stream.seq
            if seq.state is ItemState.WAITING and not seq.preemptions:
                continue  # never ran: the queue answers it (504, never run)
            self.scheduler.cancel(seq)
            outputs.append((stream.front, error_output(stream.rid, _ran_out(seq))))
            self._drop(stream)

    def _expire(self, seq: WorkItem, outputs: list[Output]) -> None:
        stream = self._streams.get(seq.seq)
        if stream is not None:
            outputs.append((stream.front, error_output(stream.rid, DeadlineExceeded(EXPIRED))))
            self._drop(stream)

    def _truncated(self, seq: Sequence, outputs: list[Output]) -> None:
        """The sequence outgrew the whole KV cache (the front's admission check is the first line; this is
        the backstop): it ends by length, or is refused if it has produced nothing."""
        stream = self._streams.get(seq.seq)
        if stream is None:
            return
        if not seq.output:
            error = InvalidInput(
                f"the prompt has {len(seq.tokens)} tokens, more than the KV cache "
                f"holds ({self.scheduler.allocator.capacity} tokens)"
            )
            outputs.append((stream.front, error_output(stream.rid, error)))
        else:
            outputs.append((stream.front, TokenOutput(stream.rid, [], "length")))
        self._drop(stream)

    def _complete(
        self,
        plan: StepPlan,
        started: float,
        result: tuple[dict[int, int], dict[int, TokenLogprobs]] | None,
        exc: BaseException | None,
    ) -> list[Output]:
        outputs: list[Output] = []
        if result is None:
            error: CarpoolError = (
                exc
                if isinstance(exc, OutOfMemory)
                else BatchFailed(f"the model failed on this step: {type(exc).__name__}: {exc}")
            )
            log.error("generation step failed; failing its %d sequences", len(plan.work), exc_info=exc)
            for work in plan.work:
                self.scheduler.finish(work.seq, ItemState.FAILED)
                stream = self._streams.get(work.seq.seq)
                if stream is not None:
                    outputs.append((stream.front, error_output(stream.rid, error)))
                    self._drop(stream)
            return outputs
        sampled, logprobs = result
        seconds = self.clock() - started
        self.scheduler.complete(plan, sampled, seconds)
        self.metrics.batch_duration.observe(seconds)
        self.metrics.batch_size.observe(len(plan.work))
        if self.saturation is not None:
            self.saturation.batch(sum(work.count for work in plan.work), seconds)
        now = self.clock()
        for work in plan.work:
            token = sampled.get(work.seq.seq)
            stream = self._streams.get(work.seq.seq)
            if token is None or stream is None or work.seq.state is not ItemState.RUNNING:
                continue
            output = self._emit(stream, token, now)
            if logprobs and output.ids:
                output.logprobs = logprobs.get(work.seq.seq)
            outputs.append((stream.front, output))
        return outputs

    def _emit(self, stream: _Stream, token: int, now: float) -> TokenOutput:
        seq = stream.seq
        self.metrics.generated_tokens.inc()
        if seq.adapter is not None and self.adapters is not None:
            self.adapters.token(seq.adapter)
        if stream.last_token_at is None:
            self.metrics.time_to_first_token.observe(now - seq.arrival)
        else:
            self.metrics.inter_token_latency.observe(now - stream.last_token_at)
        stream.last_token_at = now
        finish: str | None = None
        ids = [token]
        params = stream.params
        # vLLM's check: a stop token ends the sequence once it has min_tokens (the sampler holds stop
        # tokens back until then); with ignore_eos the end-of-text token is an ordinary one.
        if params.ends_at(token, self.engine.eos_ids) and len(seq.output) >= params.min_tokens:
            seq.output.pop()  # the end-of-text (or stop) token is not part of the answer
            ids = []
            finish = "stop"
        elif len(seq.output) >= seq.max_tokens or seq.total >= self.engine.max_model_len:
            finish = "length"
        if finish is not None:
            if self.saturation is not None:
                self.saturation.finished(len(seq.output))
            self.scheduler.finish(seq)
            self._drop(stream)
        return TokenOutput(stream.rid, ids, finish)

    def _drop(self, stream: _Stream) -> None:
        dropped = self._streams.pop(stream.seq.seq, None)
        self._by_rid.pop(stream.rid, None)
        if dropped is not None and stream.seq.adapter is not None and self.adapters is not None:
            self.adapters.release(stream.seq.adapter)  # its adapter may leave the device and host now
        if self._stepping:
            self._forgotten.append(stream.seq.seq)  # the running step may still use its sampler state
        else:
            self.engine.forget(stream.seq.seq)

    def publish_gauges(self) -> None:
        scheduler = self.scheduler
        self.metrics.set_queue(scheduler.waiting, scheduler.backlog_seconds())
        self.metrics.set_generation(len(scheduler.running), scheduler.kv_usage())
        self.vllm_names.publish(scheduler.waiting, len(scheduler.running), scheduler.kv_usage())
        if self.adapters is not None:
            waiting = scheduler.queue.candidates(scheduler.waiting)
            self.vllm_names.lora(
                (s.adapter for s in scheduler.running),
                (s.adapter for s in waiting if isinstance(s, Sequence)),
            )
        self.publish_saturation(scheduler.backlog_seconds())

    # -- warm-up --------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Prefill and decode at the configured batch sizes and prompt lengths, through the real scheduler
        and cache, before the first request."""
        warmup, generation = self.config.warmup, self.config.generation
        if not warmup.enabled:
            return
        engine, scheduler = self.engine, self.scheduler
        sizes = warmup.batch_sizes or sorted({1, generation.running_sequences()})
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
                        for _ in range(min(size, generation.running_sequences()))
                    ]
                    for seq in seqs:
                        scheduler.submit(seq, 0.0)
                    steps = 0
                    while scheduler.running or scheduler.waiting:
                        plan = scheduler.schedule(0.0)
                        step_began = time.perf_counter()
                        sampled = engine.step(plan, {})
                        step_seconds = time.perf_counter() - step_began
                        scheduler.complete(plan, sampled, step_seconds)
                        if self.saturation is not None:
                            self.saturation.warmup_batch(sum(w.count for w in plan.work), step_seconds)
                        steps += 1
                        for seq in list(scheduler.running):
                            if len(seq.output) >= seq.max_tokens:
                                scheduler.finish(seq)
                    for seq in seqs:
                        engine.forget(seq.seq)
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
