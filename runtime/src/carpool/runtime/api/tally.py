"""A front's request metrics, written once per event-loop turn instead of once per request.

Every request a front answers moves three metrics: `carpool_requests_total{status}`, the request
duration histogram, and the in-flight gauge (up as it is accepted, down as it is answered). In
multiprocess mode (`metrics`) each write goes to a memory-mapped file under a lock, about 2 us, four or
five of them a request: 3-5% of a front's CPU at saturation (bench/RESULTS.md, issue 37). The requests a
loop turn answers are gathered here and written at the end of that turn (`loop.call_soon`, as the engine
client flushes its messages): one increment per status, one histogram update (`observe_many`) and one
gauge value however many requests the turn held. Nothing waits for the flush, and a scrape, which runs
in a later turn, sees every request answered before it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from carpool.runtime.metrics import RuntimeMetrics, observe_many


class TurnTally:
    """Request metrics gathered during one loop turn; `flush` (scheduled on the first) writes them."""

    def __init__(self, metrics: RuntimeMetrics, inflight: Callable[[], int]) -> None:
        self.metrics = metrics
        self._inflight = inflight
        """The front's requests in flight now (the gauge is set to it at each flush)."""
        self._counts: dict[tuple[int, str], int] = {}
        self._durations: dict[str, list[float]] = {}
        self._inflight_changed = False
        self._scheduled = False

    def answered(self, status: int, seconds: float | None = None, protocol: str = "http") -> None:
        """A request answered with `status` (with its duration where it counts, as successes do)."""
        key = (status, protocol)
        self._counts[key] = self._counts.get(key, 0) + 1
        if seconds is not None:
            self._durations.setdefault(protocol, []).append(seconds)
        self._schedule()

    def inflight_changed(self) -> None:
        """A request was accepted or answered: the gauge takes the new count at the turn's end."""
        self._inflight_changed = True
        self._schedule()

    def _schedule(self) -> None:
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside a loop (a synchronous caller): write now
            self.flush()
            return
        self._scheduled = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        metrics = self.metrics
        counts, self._counts = self._counts, {}
        for (status, protocol), count in counts.items():
            metrics.count_request(status, protocol, count)
        durations, self._durations = self._durations, {}
        for protocol, values in durations.items():
            observe_many(metrics.request_durations[protocol], values)
        if self._inflight_changed:
            self._inflight_changed = False
            metrics.inflight.set(self._inflight())
