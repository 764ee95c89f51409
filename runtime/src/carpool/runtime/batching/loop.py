"""The asyncio driver of the scheduler: the one place where batching meets time and threads.

It wakes on every arrival, completion or timer, asks the scheduler for a plan, answers expired inputs,
and hands batches to a single worker thread (torch releases the GIL during the forward pass, so the
event loop keeps accepting and tokenizing requests meanwhile). Every input's future is resolved exactly
once: with an output, or with the error that explains why not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from carpool.runtime.batching.driver import Driver
from carpool.runtime.batching.former import computed_tokens
from carpool.runtime.batching.request import ItemState, WorkItem
from carpool.runtime.batching.runner import BatchReport, run_batch
from carpool.runtime.batching.scheduler import Scheduler
from carpool.runtime.engines.base import Engine
from carpool.runtime.errors import DeadlineExceeded, NotReady
from carpool.runtime.metrics import RuntimeMetrics

log = logging.getLogger(__name__)


class BatchLoop(Driver):
    """Owns the scheduler, the model thread and the futures of waiting inputs."""

    task_name = "carpool-batch-loop"

    def __init__(
        self,
        scheduler: Scheduler,
        engine: Engine,
        metrics: RuntimeMetrics,
        model_thread: ThreadPoolExecutor,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(metrics, model_thread, clock)
        self.scheduler = scheduler
        self.engine = engine

    def submit(self, token_lists: Sequence[list[int]], priority: int, deadline: float) -> list[WorkItem]:
        """Queue a request's inputs; each carries a future in `payload`. Raises QueueFull/NotReady."""
        now = self.clock()
        loop = asyncio.get_running_loop()
        items = [
            WorkItem(
                tokens=tokens, arrival=now, deadline=deadline, priority=priority, payload=loop.create_future()
            )
            for tokens in token_lists
        ]
        self.scheduler.submit(items, now)
        self._wake.set()
        return items

    def cancel(self, items: Sequence[WorkItem]) -> None:
        for item in items:
            self.scheduler.cancel(item)
            future: asyncio.Future[Any] = item.payload
            future.cancel()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            plan = self.scheduler.schedule(self.clock())
            for item in plan.expired:
                self._resolve(
                    item,
                    error=DeadlineExceeded(
                        "the request waited past its deadline and was not run; retry, or allow a longer "
                        "timeout (header x-carpool-timeout)"
                    ),
                )
            if plan.batch is not None:
                self._launch(plan.batch)
                continue
            timeout = None if plan.wake_at is None else max(0.0, plan.wake_at - self.clock())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _launch(self, batch: list[WorkItem]) -> None:
        start = self.clock()
        for item in batch:
            self.metrics.queue_wait.observe(start - item.arrival)
        self.metrics.batch_size.observe(len(batch))
        computed = computed_tokens(batch, self.scheduler.policy.packed)
        if computed:
            self.metrics.padding_ratio.observe(1.0 - sum(i.length for i in batch) / computed)
        engine = self.engine
        future = asyncio.get_running_loop().run_in_executor(
            self._thread, run_batch, engine.forward, batch, engine.release_memory
        )
        future.add_done_callback(lambda f: self._finish(batch, start, f))

    def _finish(self, batch: list[WorkItem], start: float, future: asyncio.Future[BatchReport]) -> None:
        seconds = self.clock() - start
        self.metrics.batch_duration.observe(seconds)
        self.scheduler.complete(batch, seconds)
        exc = (
            NotReady("the server stopped before this batch ran") if future.cancelled() else future.exception()
        )
        if exc is not None:  # run_batch catches model errors; this is a bug in the runner itself
            log.error("batch runner crashed", exc_info=exc)
            for item in batch:
                self._resolve(item, error=exc)
        else:
            report = future.result()
            if report.oom_splits:
                self.metrics.oom_splits.inc(report.oom_splits)
            for item, outcome in zip(batch, report.outcomes, strict=True):
                self._resolve(item, output=outcome.output, error=outcome.error)
        self._wake.set()

    def _resolve(self, item: WorkItem, output: Any = None, error: BaseException | None = None) -> None:
        future: asyncio.Future[Any] = item.payload
        if item.state is not ItemState.CANCELLED and item.state is not ItemState.EXPIRED:
            item.state = ItemState.FAILED if error is not None else ItemState.FINISHED
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(output)
