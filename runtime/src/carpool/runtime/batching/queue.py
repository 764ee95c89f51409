"""Queue policy: admission, ordering, deadlines and limits. Pure: time comes in as an argument.

Inputs wait in one FIFO per priority level; `candidates` lists them highest level first, so the batch
former sees them in the order they are owed service. Admission is all or nothing per request: a request
whose inputs do not all fit is refused whole, so no caller gets half an answer.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

from carpool.runtime.batching.request import ItemState, WorkItem


class RequestQueue:
    """Bounded priority queue of waiting inputs with deadline expiry."""

    def __init__(self, max_size: int, priority_levels: int) -> None:
        self.max_size = max_size
        self.priority_levels = priority_levels
        # One insertion-ordered dict per level: FIFO iteration, O(1) removal from the middle
        # (length grouping takes inputs out of order).
        self._levels: list[dict[int, WorkItem]] = [{} for _ in range(priority_levels)]
        self._deadlines: list[tuple[float, int, WorkItem]] = []
        self._tokens = 0

    def __len__(self) -> int:
        return sum(len(level) for level in self._levels)

    @property
    def tokens(self) -> int:
        """Tokens waiting (unpadded): the queued work."""
        return self._tokens

    def free_slots(self) -> int:
        return self.max_size - len(self)

    def push(self, items: Iterable[WorkItem]) -> None:
        """Enqueue inputs; the caller has checked `free_slots()` first."""
        for item in items:
            if not 0 <= item.priority < self.priority_levels:
                raise ValueError(f"priority {item.priority} outside 0..{self.priority_levels - 1}")
            item.state = ItemState.WAITING
            self._levels[item.priority][item.seq] = item
            heapq.heappush(self._deadlines, (item.deadline, item.seq, item))
            self._tokens += item.length

    def push_front(self, item: WorkItem) -> None:
        """Put an input back at the head of its level (a preempted sequence keeps its turn)."""
        level = self._levels[item.priority]
        rest = dict(level)
        level.clear()
        self.push([item])
        level.update(rest)

    def remove(self, item: WorkItem) -> bool:
        """Take a waiting input out (it was cancelled or chosen); False if it was not waiting."""
        if self._levels[item.priority].pop(item.seq, None) is None:
            return False
        self._tokens -= item.length
        return True

    def take(self, items: Iterable[WorkItem]) -> None:
        """Move chosen inputs from waiting to running."""
        for item in items:
            if not self.remove(item):
                raise ValueError(f"input {item.seq} is not waiting")
            item.state = ItemState.RUNNING

    def expire(self, now: float) -> list[WorkItem]:
        """Remove and return every waiting input whose deadline has passed."""
        expired: list[WorkItem] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, item = heapq.heappop(self._deadlines)
            if item.state is ItemState.WAITING and item.deadline <= now and self.remove(item):
                item.state = ItemState.EXPIRED
                expired.append(item)
        return expired

    def next_deadline(self) -> float | None:
        """Earliest deadline among waiting inputs (stale heap entries are dropped on the way)."""
        while self._deadlines:
            deadline, _, item = self._deadlines[0]
            fresh = item.deadline == deadline and item.seq in self._levels[item.priority]
            if item.state is ItemState.WAITING and fresh:
                return deadline
            heapq.heappop(self._deadlines)
        return None

    def candidates(self, limit: int) -> list[WorkItem]:
        """Up to `limit` waiting inputs, highest priority first, FIFO within a level."""
        chosen: list[WorkItem] = []
        for item in self._iter_ordered():
            if len(chosen) >= limit:
                break
            chosen.append(item)
        return chosen

    def oldest_arrival(self) -> float | None:
        arrivals = [next(iter(level.values())).arrival for level in self._levels if level]
        return min(arrivals) if arrivals else None

    def _iter_ordered(self) -> Iterator[WorkItem]:
        for level in reversed(self._levels):
            yield from level.values()
