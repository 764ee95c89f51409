"""The scheduler: queue policy plus batch formation behind two calls. Pure and clock-injected.

Call order (the engine's busy loop, `engine.encoder`, does this):

    scheduler.submit(items, now)         # admit a request's inputs, or raise QueueFull
    plan = scheduler.schedule(now)       # answer `plan.expired` with 504; run `plan.batch` if any;
                                         # otherwise call again at `plan.wake_at` or on the next event
    scheduler.complete(plan.batch, now, seconds)   # after the batch ran, whatever its outcome

At most `max_inflight_batches` run at once: one per model instance (`model.instances`; on a GPU one, as
a second batch would only queue on the device). Cancelled inputs leave the queue at once and never
reach a batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from carpool.runtime.batching.former import FormationPolicy, form
from carpool.runtime.batching.queue import RequestQueue
from carpool.runtime.batching.request import ItemState, WorkItem
from carpool.runtime.batching.throughput import ArrivalRate, ThroughputMeter
from carpool.runtime.errors import QueueFull


@dataclass
class Plan:
    """What to do now: run `batch` (may be None), answer `expired`, and when to ask again."""

    batch: list[WorkItem] | None = None
    expired: list[WorkItem] = field(default_factory=list)
    wake_at: float | None = None


class Scheduler:
    """Decides admission, expiry and the next batch; holds no threads and reads no clock."""

    def __init__(
        self,
        policy: FormationPolicy,
        queue: RequestQueue,
        max_inflight_batches: int = 1,
        throughput: ThroughputMeter | None = None,
        arrivals: ArrivalRate | None = None,
    ) -> None:
        self.policy = policy
        self.queue = queue
        self.max_inflight_batches = max_inflight_batches
        self.throughput = throughput or ThroughputMeter()
        self.arrivals = arrivals or ArrivalRate()
        self.inflight: list[list[WorkItem]] = []

    # -- admission ------------------------------------------------------------------------------

    def submit(self, items: list[WorkItem], now: float) -> None:
        """Admit all of a request's inputs or none of them."""
        free = self.queue.free_slots()
        if len(items) > free:
            raise QueueFull(
                f"queue full: {len(self.queue)} inputs waiting (limit {self.queue.max_size}), "
                f"this request has {len(items)}; retry later",
                retry_after_s=self.retry_after_s(),
            )
        self.queue.push(items)
        self.arrivals.record(now, len(items))

    def cancel(self, item: WorkItem) -> bool:
        """Withdraw an input whose caller went away. True if it had not started running."""
        if item.state is ItemState.WAITING and self.queue.remove(item):
            item.state = ItemState.CANCELLED
            return True
        if not item.state.is_finished:
            item.state = ItemState.CANCELLED  # running: its result is dropped
        return False

    # -- scheduling -----------------------------------------------------------------------------

    def schedule(self, now: float, may_start: bool = True) -> Plan:
        """Expire, and form the next batch if one may start: fewer than `max_inflight_batches` run and the
        caller's placement allows one beside them (`may_start`; `engine.instances`)."""
        plan = Plan(expired=self.queue.expire(now))
        self.queue.age(now)
        if may_start and len(self.inflight) < self.max_inflight_batches:
            oldest = self.queue.oldest_arrival()
            if oldest is not None:
                formation = form(
                    self.queue.candidates(self.policy.lookahead),
                    self.policy,
                    now,
                    oldest,
                    self.arrivals.rate(now),
                )
                if formation.batch is not None:
                    self.queue.take(formation.batch)
                    self.inflight.append(formation.batch)
                    plan.batch = formation.batch
                else:
                    plan.wake_at = formation.hold_until
        if plan.wake_at is not None:
            self.arrivals.hold(now)
        else:
            self.arrivals.release(now)
        deadline = self.queue.next_deadline()
        if deadline is not None and plan.batch is None:
            plan.wake_at = deadline if plan.wake_at is None else min(plan.wake_at, deadline)
        return plan

    def complete(self, batch: list[WorkItem], seconds: float) -> None:
        """The batch has run (or failed) and took `seconds` of model time."""
        self.inflight = [b for b in self.inflight if b is not batch]
        ran = [item for item in batch if item.state is not ItemState.CANCELLED]
        self.throughput.record(sum(item.length for item in ran), seconds)

    # -- state ----------------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def backlog_seconds(self) -> float:
        """Queued work divided by recent throughput: how long the queue takes to clear. The meter times
        each batch alone; `max_inflight_batches` of them run at once while a backlog lasts."""
        return self.throughput.seconds_for(self.queue.tokens) / self.max_inflight_batches

    def retry_after_s(self) -> float:
        """What to tell a refused caller: the backlog, rounded up, at least one second."""
        return float(max(1, math.ceil(self.backlog_seconds())))
