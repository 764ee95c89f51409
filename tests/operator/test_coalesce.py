"""Event-started reconciles of one BatchedModel coalesce while one waits for its lock, as a work queue
holds a key once: a burst of pod and child status changes costs one reconcile, not one each."""

from __future__ import annotations

import asyncio
from typing import Any

from carpool.operator.kube import ObjectRef
from carpool.operator.reconcile import OperatorState, reconcile_named


class CountingKube:
    """Answers every GET with "gone" and counts them (a reconcile reads its BatchedModel first)."""

    def __init__(self) -> None:
        self.reads: list[ObjectRef] = []

    async def get(self, ref: ObjectRef) -> dict[str, Any] | None:
        self.reads.append(ref)
        return None


async def test_a_burst_of_events_for_one_model_reconciles_it_once_after_the_running_one() -> None:
    kube = CountingKube()
    state = OperatorState(kube=kube)  # type: ignore[arg-type]
    lock = state.lock("ns", "m")
    await lock.acquire()  # a reconcile of m is running
    burst = [asyncio.create_task(reconcile_named(state, "ns", "m", trigger="pod")) for _ in range(5)]
    other = asyncio.create_task(reconcile_named(state, "ns", "other", trigger="pod"))
    await asyncio.sleep(0.05)
    assert state.waiting == {("ns", "m")}
    lock.release()
    await asyncio.gather(*burst, other)
    assert [ref.name for ref in kube.reads].count("m") == 1  # one reconcile covered all five events
    assert [ref.name for ref in kube.reads].count("other") == 1
    assert state.waiting == set()
    # Once that one holds the lock, a new event waits again (it may carry news the running one missed).
    await lock.acquire()
    late = asyncio.create_task(reconcile_named(state, "ns", "m", trigger="pod"))
    await asyncio.sleep(0.05)
    assert state.waiting == {("ns", "m")}
    lock.release()
    await late
    assert [ref.name for ref in kube.reads].count("m") == 2
