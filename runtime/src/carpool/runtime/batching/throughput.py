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
    """Inputs per second arriving while the batcher holds a partial batch for more, over the last
    `horizon_s` seconds; where it has held for less than `min_held_s` in that time, all arrivals per second.

    A hold is worth it only if inputs arrive during it. They do from open-loop callers and from clients
    whose requests are in other batches, but not from a closed-loop client whose request is the one held: it
    sends its next request only once this one is answered. The rate of all arrivals, high wherever a batch
    is fast (a lone client sends ~900 requests a second to MiniLM on an H100), then promises arrivals that
    never come, and every request waited out the whole window: +5.6 ms on a 0.6 ms model. Measured during
    holds, that rate is 0, so the next batch goes at once; once a horizon passes without holds, the rate
    of all arrivals decides again, so the batcher tries one hold per horizon at most to learn whether
    arrivals still fail to come.
    """

    def __init__(self, horizon_s: float = 1.0, capacity: int = 4096, min_held_s: float = 0.001) -> None:
        self.horizon_s = horizon_s
        self.min_held_s = min_held_s
        self._times: deque[float] = deque(maxlen=capacity)
        self._held_times: deque[float] = deque(maxlen=capacity)
        """Arrivals during holds."""
        self._holds: deque[tuple[float, float]] = deque()
        """Holds that have ended: (start, end), in order and disjoint."""
        self._held_s = 0.0
        """Their total length (kept as they come and go: thousands of holds a second on a GPU)."""
        self._hold_start: float | None = None

    def record(self, now: float, count: int = 1) -> None:
        self._times.extend([now] * count)
        if self._hold_start is not None:
            self._held_times.extend([now] * count)

    def hold(self, now: float) -> None:
        """The batcher holds a partial batch for more inputs (again, if it already held)."""
        if self._hold_start is None:
            self._hold_start = now

    def release(self, now: float) -> None:
        """The batcher holds nothing (a batch went, nothing waits, or every executor is busy)."""
        if self._hold_start is not None:
            self._holds.append((self._hold_start, now))
            self._held_s += now - self._hold_start
            self._hold_start = None

    def rate(self, now: float) -> float:
        since = now - self.horizon_s
        for times in (self._times, self._held_times):
            while times and times[0] < since:
                times.popleft()
        while self._holds and self._holds[0][1] < since:
            start, end = self._holds.popleft()
            self._held_s -= end - start
        if not self._holds:
            self._held_s = 0.0  # no rounding left behind
        held = self._held_s - (max(0.0, since - self._holds[0][0]) if self._holds else 0.0)
        if self._hold_start is not None:
            held += now - max(self._hold_start, since)
        if held >= self.min_held_s:
            return len(self._held_times) / held
        return len(self._times) / self.horizon_s
