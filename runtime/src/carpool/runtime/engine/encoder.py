"""Encoder models (embed, classify) in the engine: dynamic batches of whole requests.

A request's inputs are admitted together or refused together (429), expire together (504), and are
answered together: one `EncodeOutput` whose buffer holds a row per input, or one `ErrorOutput`. A batch
runs through `runner.run_batch` (out-of-memory splits; a failing batch fails only its own requests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from carpool.runtime.batching.former import FormationPolicy, computed_tokens
from carpool.runtime.batching.queue import RequestQueue
from carpool.runtime.batching.request import TextPair, WorkItem
from carpool.runtime.batching.runner import BatchReport, run_batch
from carpool.runtime.batching.saturation import BatchLimits, objective_estimator
from carpool.runtime.batching.scheduler import Scheduler
from carpool.runtime.config import RuntimeConfig, check_token_budget
from carpool.runtime.engine.instances import instance_pool
from carpool.runtime.engine.tasks import EXPIRED, Launch, ModelCore, Output
from carpool.runtime.errors import (
    BatchFailed,
    CarpoolError,
    DeadlineExceeded,
    InvalidInput,
    OutOfMemory,
    QueueFull,
)
from carpool.runtime.metrics import RuntimeMetrics, observe_many
from carpool.runtime.models.base import Engine
from carpool.runtime.warmup import padding_slack, warmup_shapes
from carpool.runtime.wire import (
    EncodeOutput,
    EncodeRequest,
    FrontMessage,
    error_output,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Pending:
    """A request in the engine: its inputs and, as batches finish, their rows."""

    rid: int
    front: int
    items: list[WorkItem]
    rows: list[Any] = field(default_factory=list)
    done: int = 0


class EncoderCore(ModelCore[Engine]):
    """Batches whole requests for an encoder engine."""

    def __init__(
        self,
        engine: Engine,
        config: RuntimeConfig,
        metrics: RuntimeMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_token_budget(config.batching, engine.info.max_input_tokens)
        super().__init__(engine, config, metrics, clock)
        self._pool = instance_pool(engine, config.model.instances)
        plan = self._pool.plan
        self.instances = plan.count
        log.info("%s", plan.describe())
        batching = config.batching
        self.scheduler = Scheduler(
            replace(FormationPolicy.from_config(batching), packed=engine.info.packed),
            RequestQueue(batching.max_queue_size, batching.priority_levels, config.objective.late_after_s),
            max_inflight_batches=plan.count,
        )
        self._requests: dict[int, _Pending] = {}
        self._running_inputs = 0
        """Inputs in the batches the model instances are running."""
        self.vllm_names = metrics.vllm_names()
        self.saturation = objective_estimator(
            config.objective,
            BatchLimits(batching.max_batch_size, batching.max_batch_tokens, plan.count),
            generation=False,
        )
        self._running: dict[int, int] = {}
        """id of each running batch -> the CPU threads it runs on (`InstancePlan.threads_for`)."""

    @property
    def busy(self) -> bool:
        return bool(self._requests)

    # -- requests -------------------------------------------------------------------------------

    def submit(self, message: FrontMessage, now: float) -> list[Output]:
        if not isinstance(message, EncodeRequest):
            return self.refuse(
                message,
                InvalidInput(f"model {self.info.name!r} does {self.info.task.value}, not text generation"),
            )
        pending = _Pending(message.rid, message.front, [])
        inputs: list[list[int]] = message.tokens
        if message.pairs is not None:
            if len(message.pairs) != len(inputs):
                error = InvalidInput(f"{len(message.pairs)} pair boundaries for {len(inputs)} inputs")
                return self.refuse(message, error)
            inputs = [TextPair(ids, second) for ids, second in zip(inputs, message.pairs, strict=True)]
        pending.items = [
            WorkItem(
                tokens=tokens,
                arrival=message.arrival,
                deadline=message.deadline,
                priority=message.priority,
                payload=(pending, index),
            )
            for index, tokens in enumerate(inputs)
        ]
        pending.rows = [None] * len(pending.items)
        try:
            self.scheduler.submit(pending.items, now)
        except QueueFull as exc:
            return [(message.front, error_output(message.rid, exc))]
        except ValueError as exc:
            return [(message.front, error_output(message.rid, InvalidInput(str(exc))))]
        self._requests[message.rid] = pending
        if self.saturation is not None:
            self.saturation.arrive(now, len(pending.items), sum(item.length for item in pending.items))
        return []

    def abort(self, rids: list[int]) -> None:
        for rid in rids:
            pending = self._requests.pop(rid, None)
            if pending is not None:
                for item in pending.items:
                    self.scheduler.cancel(item)

    # -- the loop's step ------------------------------------------------------------------------

    def schedule(self, now: float) -> tuple[list[Output], Launch | None, float | None]:
        outputs: list[Output] = []
        placement = self._pool.plan
        running = list(self._running.values())
        # No batch while every instance runs one, nor beside a batch that holds every thread.
        plan = self.scheduler.schedule(now, placement.may_start(running))
        for item in plan.expired:
            self._fail(item, DeadlineExceeded(EXPIRED), outputs)
        if plan.batch is None:
            return outputs, None, plan.wake_at
        batch = plan.batch
        start = self.clock()
        observe_many(self.metrics.queue_wait, [start - item.arrival for item in batch])  # once a batch
        self.metrics.batch_size.observe(len(batch))
        computed = computed_tokens(batch, self.scheduler.policy.packed)
        if computed:
            self.metrics.padding_ratio.observe(1.0 - sum(i.length for i in batch) / computed)
        engine, pool = self.engine, self._pool
        self._running_inputs += len(batch)
        threads = placement.threads_for(running, self.scheduler.waiting)
        self._running[id(batch)] = threads

        def run() -> BatchReport:
            with pool.slot(threads):
                return run_batch(engine.forward, batch, engine.release_memory)

        def complete(report: BatchReport | None, crash: BaseException | None) -> list[Output]:
            return self._complete(batch, start, report, crash)

        return outputs, Launch(run, complete), None

    def _complete(
        self, batch: list[WorkItem], start: float, report: BatchReport | None, crash: BaseException | None
    ) -> list[Output]:
        outputs: list[Output] = []
        self._running_inputs -= len(batch)
        seconds = self.clock() - start
        self._running.pop(id(batch), None)
        self.metrics.batch_duration.observe(seconds)
        self.scheduler.complete(batch, seconds)
        if report is None:  # run_batch catches model errors: this is a bug in the runner itself
            log.error("batch runner crashed", exc_info=crash)
            for item in batch:
                self._fail(item, BatchFailed(f"the batch runner crashed: {crash}"), outputs)
            return outputs
        if report.oom_splits:
            self.metrics.oom_splits.inc(report.oom_splits)
        if self.saturation is not None:
            self.saturation.batch(sum(item.length for item in batch), seconds)
        for item, outcome in zip(batch, report.outcomes, strict=True):
            if outcome.error is not None:
                self._fail(item, outcome.error, outputs)
                continue
            pending: _Pending
            pending, index = item.payload
            if self._requests.get(pending.rid) is not pending:
                continue  # aborted, or already failed by another of its inputs
            pending.rows[index] = outcome.output
            pending.done += 1
            if pending.done == len(pending.items):
                del self._requests[pending.rid]
                outputs.append((pending.front, _rows(pending)))
        return outputs

    def _fail(self, item: WorkItem, error: CarpoolError, outputs: list[Output]) -> None:
        """Answer the item's request with `error` (once) and withdraw the rest of its inputs."""
        pending, _ = item.payload
        if self._requests.pop(pending.rid, None) is None:
            return
        for other in pending.items:
            if other is not item:
                self.scheduler.cancel(other)
        outputs.append((pending.front, error_output(pending.rid, error)))

    def publish_gauges(self) -> None:
        self.metrics.set_queue(self.scheduler.waiting, self.scheduler.backlog_seconds())
        self.vllm_names.publish(self.scheduler.waiting, self._running_inputs, 0.0)
        self.publish_saturation(self.scheduler.backlog_seconds())

    # -- warm-up --------------------------------------------------------------------------------

    def warm_up(self) -> None:
        engine = self.engine
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
                if self.saturation is not None:
                    self.saturation.warmup_batch(size * length, seconds)
                self.metrics.warmup_batches.inc()
                log.info("warm-up batch %d x %d tokens: %.1f ms", size, length, seconds * 1000)
        if shapes and self.config.batching.padding_slack_tokens is None and not engine.info.packed:
            self._calibrate(shapes[0], shapes[-1])
        total = time.perf_counter() - started
        self.metrics.warmup_seconds.set(total)
        log.info("warm-up finished: %d batches in %.2fs", len(shapes) * self.config.warmup.iterations, total)

    def _calibrate(self, small: tuple[int, int], large: tuple[int, int]) -> None:
        """Time the smallest and largest warm-up batches again (now warm) and set the padding slack from
        the model's fixed cost per batch and cost per token on this device."""
        points: list[tuple[int, float]] = []
        for size, length in (small, large, small, large, small):
            batch = [self.engine.dummy_input(length)] * size
            began = time.perf_counter()
            self.engine.forward(batch)
            points.append((size * length, time.perf_counter() - began))
        slack = padding_slack(points, self.config.batching.max_batch_tokens)
        self.scheduler.policy = replace(self.scheduler.policy, padding_slack_tokens=slack)
        log.info("padding slack measured at %d tokens (fixed cost per batch / cost per token)", slack)


def _rows(pending: _Pending) -> EncodeOutput:
    matrix = np.ascontiguousarray(np.stack(pending.rows), dtype="<f4")
    rows, width = matrix.shape
    return EncodeOutput(pending.rid, "<f4", (rows, width), matrix.tobytes())
