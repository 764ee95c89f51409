"""Recent throughput and arrival rate, from timestamps the caller passes in (pure)."""

from __future__ import annotations

from collections import deque


class ThroughputMeter:
    """Tokens per second of model time over the last `window` batches.

    Model time, not wall time: idle periods do not dilute it, so queued tokens divided by it is how
    long the queue takes to clear (`carpool_queue_backlog_seconds`).
    """

    def __init__(self, window: int = 32) -> None:
        self._batches: deque[tuple[int, float]] = deque(maxlen=window)

    def record(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._batches.append((tokens, seconds))

    def tokens_per_second(self) -> float | None:
        seconds = sum(s for _, s in self._batches)
        if seconds <= 0:
            return None
        return sum(t for t, _ in self._batches) / seconds

    def seconds_for(self, tokens: int) -> float:
        """Time the model needs for `tokens` at the recent pace (0 when nothing is known yet)."""
        rate = self.tokens_per_second()
        if tokens <= 0 or rate is None:
            return 0.0
        return tokens / rate


class ArrivalRate:
    """Inputs per second over the last `horizon_s` seconds."""

    def __init__(self, horizon_s: float = 1.0, capacity: int = 4096) -> None:
        self.horizon_s = horizon_s
        self._times: deque[float] = deque(maxlen=capacity)

    def record(self, now: float, count: int = 1) -> None:
        self._times.extend([now] * count)

    def rate(self, now: float) -> float:
        while self._times and self._times[0] < now - self.horizon_s:
            self._times.popleft()
        return len(self._times) / self.horizon_s
