"""Queue policy: admission, ordering, deadlines and limits. Pure: time comes in as an argument.

Inputs wait in one FIFO per priority level; `candidates` lists them highest level first, so the batch
former sees them in the order they are owed service. Admission is all or nothing per request: a request
whose inputs do not all fit is refused whole, so no caller gets half an answer.

With a latency objective (`late_after_s`, the objective's latency), an input that has waited past it
can no longer meet it, and serving it first only makes the inputs behind it miss too: after an overload
a pod's backlog would otherwise keep every new arrival past the objective until it drains. `age(now)`
moves such inputs behind those of their level that still can (Triton's queue policy `timeout_action:
DELAY`: delayed until every request of the same or a higher level that has not timed out is processed);
they still run before anything of a lower level, keep their deadline (answered 504 at it, as before),
and an input put back at the head (a preempted sequence, owed completion) is never moved. The adaptive
LIFO of Facebook's "Fail at Scale" serves the newest first under a standing queue for the same reason.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

from carpool.runtime.batching.request import ItemState, WorkItem


class RequestQueue:
    """Bounded priority queue of waiting inputs with deadline expiry."""

    def __init__(self, max_size: int, priority_levels: int, late_after_s: float | None = None) -> None:
        self.max_size = max_size
        self.priority_levels = priority_levels
        self.late_after_s = late_after_s
        """An input waiting longer yields to the inputs of its level that have not (None: never)."""
        # One insertion-ordered dict per level: FIFO iteration, O(1) removal from the middle
        # (length grouping takes inputs out of order). `_late` holds, per level, the inputs `age` moved
        # behind it, in the order they became late (their arrival order).
        self._levels: list[dict[int, WorkItem]] = [{} for _ in range(priority_levels)]
        self._late: list[dict[int, WorkItem]] = [{} for _ in range(priority_levels)]
        self._owed: set[int] = set()
        """Inputs put back at the head (`push_front`): never moved behind."""
        self._deadlines: list[tuple[float, int, WorkItem]] = []
        self._tokens = 0

    def __len__(self) -> int:
        return sum(len(level) for level in self._levels) + sum(len(level) for level in self._late)

    @property
    def late(self) -> int:
        """Inputs waiting behind their level for having waited past `late_after_s`."""
        return sum(len(level) for level in self._late)

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
        self._owed.add(item.seq)

    def remove(self, item: WorkItem) -> bool:
        """Take a waiting input out (it was cancelled or chosen); False if it was not waiting."""
        level, late = self._levels[item.priority], self._late[item.priority]
        if level.pop(item.seq, None) is None and late.pop(item.seq, None) is None:
            return False
        self._owed.discard(item.seq)
        self._tokens -= item.length
        return True

    def age(self, now: float) -> int:
        """Move the inputs that have waited past `late_after_s` behind the rest of their level; returns
        how many moved. Each input moves once: the cost is a look at the oldest inputs of each level."""
        if self.late_after_s is None:
            return 0
        cutoff = now - self.late_after_s
        moved = 0
        for level, late in zip(self._levels, self._late, strict=True):
            moving: list[WorkItem] = []
            for item in level.values():
                if item.seq in self._owed:
                    continue  # owed its turn (put back at the head): keeps its place
                if item.arrival > cutoff:
                    break
                moving.append(item)
            for item in moving:
                del level[item.seq]
                item.late = True
                late[item.seq] = item
            moved += len(moving)
        return moved

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
            fresh = item.deadline == deadline and (
                item.seq in self._levels[item.priority] or item.seq in self._late[item.priority]
            )
            if item.state is ItemState.WAITING and fresh:
                return deadline
            heapq.heappop(self._deadlines)
        return None

    def candidates(self, limit: int) -> list[WorkItem]:
        """Up to `limit` waiting inputs, highest priority first, FIFO within a level (those `age` moved
        last in their level)."""
        chosen: list[WorkItem] = []
        for item in self._iter_ordered():
            if len(chosen) >= limit:
                break
            chosen.append(item)
        return chosen

    def oldest_arrival(self) -> float | None:
        arrivals = [next(iter(level.values())).arrival for level in self._levels + self._late if level]
        return min(arrivals) if arrivals else None

    def _iter_ordered(self) -> Iterator[WorkItem]:
        for level, late in zip(reversed(self._levels), reversed(self._late), strict=True):
            yield from level.values()
            yield from late.values()
