"""What both asyncio drivers share: the model thread, a wake-up event and one background task."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from carpool.runtime.metrics import RuntimeMetrics


class Driver:
    """Runs `_run` as one task; `stop` cancels it and waits for it to end."""

    task_name = "carpool-driver"

    def __init__(
        self,
        metrics: RuntimeMetrics,
        model_thread: ThreadPoolExecutor,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        self.clock = clock
        self._thread = model_thread
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        raise NotImplementedError
