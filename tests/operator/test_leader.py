"""Leader election's decisions (`leader.next_spec`, `lease_valid`, `write_time_left`, `released_spec`)
with the clock passed in, and the elector's loop and write fence against an in-memory Lease store with
the API server's optimistic concurrency (a stand-in for the API here: tests/cluster/test_replicas.py and
test_leader_election.py run operator processes against a real one)."""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any

import kopf
import pytest

from carpool.operator.kube import Kube, KubeError
from carpool.operator.leader import (
    DEFAULT_TIMING,
    Fence,
    LeaderElector,
    LeadershipLost,
    NotLeading,
    Timing,
    guard_kopf_writes,
    lease_valid,
    next_spec,
    released_spec,
    write_time_left,
)

NOW = "2026-11-27T14:00:00.000000Z"
DURATION = DEFAULT_TIMING.lease_duration


def held_by(holder: str, transitions: int = 0) -> dict[str, object]:
    return {
        "holderIdentity": holder,
        "leaseDurationSeconds": int(DURATION),
        "acquireTime": "2026-11-27T13:00:00.000000Z",
        "renewTime": "2026-11-27T13:59:59.000000Z",
        "leaseTransitions": transitions,
    }


def test_controller_runtimes_timing_keeps_two_leaders_apart() -> None:
    timing = Timing()
    assert (timing.lease_duration, timing.renew_deadline, timing.retry_period) == (15, 10, 2)
    assert timing.renew_deadline < timing.lease_duration  # a leader gives up before a standby may start
    assert timing.take_over == 19  # a retry to see the last renewal, the lease, a retry to try again


@pytest.mark.parametrize("values", [(10, 10, 2), (15, 10, 9), (15, 10, 0), (15.5, 10, 2)])
def test_a_timing_that_could_let_two_replicas_lead_is_refused(values: tuple[float, float, float]) -> None:
    with pytest.raises(ValueError, match="lease duration"):
        Timing(*values)


def test_a_free_lease_is_taken() -> None:
    spec = next_spec(None, "a", now=NOW, observed_at=0.0, clock=0.0)
    assert spec is not None and spec["holderIdentity"] == "a" and spec["acquireTime"] == NOW
    assert spec["leaseTransitions"] == 0 and spec["leaseDurationSeconds"] == DURATION


def test_a_lease_another_replica_renewed_lately_is_left_alone() -> None:
    lease = held_by("b")
    assert lease_valid(lease, observed_at=100.0, clock=100.0 + DURATION - 0.1)
    assert next_spec(lease, "a", now=NOW, observed_at=100.0, clock=100.0 + DURATION - 0.1) is None


def test_a_lease_not_renewed_for_its_duration_by_this_replicas_clock_is_taken_over() -> None:
    assert not lease_valid(held_by("b"), observed_at=100.0, clock=100.0 + DURATION)
    spec = next_spec(held_by("b", 3), "a", now=NOW, observed_at=100.0, clock=100.0 + DURATION)
    assert spec is not None
    assert (spec["holderIdentity"], spec["acquireTime"], spec["leaseTransitions"]) == ("a", NOW, 4)


def test_the_holder_renews_keeping_its_acquire_time() -> None:
    lease = held_by("a", 2)
    spec = next_spec(lease, "a", now=NOW, observed_at=100.0, clock=100.5)
    assert spec is not None and spec["renewTime"] == NOW
    assert (spec["acquireTime"], spec["leaseTransitions"]) == (lease["acquireTime"], 2)


def test_a_released_lease_is_taken_at_once() -> None:
    released = released_spec(held_by("b", 1), now=NOW)
    assert (released["holderIdentity"], released["leaseDurationSeconds"], released["renewTime"]) == (
        "",
        1,
        NOW,
    )
    assert released["leaseTransitions"] == 1
    assert not lease_valid(released, observed_at=100.0, clock=100.0)
    spec = next_spec(released, "a", now=NOW, observed_at=100.0, clock=100.0)
    assert spec is not None and spec["holderIdentity"] == "a" and spec["leaseTransitions"] == 2


def test_the_leader_may_write_until_the_renew_deadline_from_its_last_renewal() -> None:
    deadline = DEFAULT_TIMING.renew_deadline
    assert write_time_left(None, renew_deadline=deadline, clock=5.0) == 0  # not leading
    assert write_time_left(100.0, renew_deadline=deadline, clock=103.0) == deadline - 3
    assert write_time_left(100.0, renew_deadline=deadline, clock=100.0 + deadline) == 0
    assert write_time_left(100.0, renew_deadline=deadline, clock=200.0) == 0  # resumed after a stall


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class LeaseStore(Kube):
    """One Lease, with resourceVersions and 409s as the API server keeps them. `hang` makes every call
    wait forever (a black-holed connection); `fail` raises it from every call."""

    def __init__(self) -> None:
        super().__init__()
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.hang = False
        self.fail: BaseException | None = None
        self.calls: list[str] = []

    async def _gate(self, method: str) -> None:
        self.calls.append(method)
        if self.fail is not None:
            raise self.fail
        if self.hang:
            await asyncio.Event().wait()

    async def get(self, ref: Any) -> dict[str, Any] | None:
        await self._gate("GET")
        return copy.deepcopy(self.lease)

    async def create(self, manifest: Any) -> dict[str, Any]:
        await self._gate("POST")
        if self.lease is not None:
            raise KubeError(409, "exists")
        return self._store(manifest)

    async def replace(self, manifest: Any) -> dict[str, Any]:
        await self._gate("PUT")
        assert self.lease is not None
        if manifest["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise KubeError(409, "the object has been modified")
        return self._store(manifest)

    def _store(self, manifest: Any) -> dict[str, Any]:
        self.version += 1
        self.lease = copy.deepcopy(dict(manifest))
        self.lease["metadata"] = {**manifest["metadata"], "resourceVersion": str(self.version)}
        return copy.deepcopy(self.lease)


FAST = Timing(lease_duration=3, renew_deadline=2, retry_period=0.5)


def elector(store: LeaseStore, identity: str, clock: Clock) -> LeaderElector:
    async def sleep(seconds: float) -> None:  # the injected clock moves; the loop yields
        clock.now += seconds
        await asyncio.sleep(0)

    return LeaderElector(store, "ns", identity, timing=FAST, clock=clock, sleep=sleep)


async def test_one_of_two_candidates_leads_and_the_other_waits_for_the_lease_to_expire() -> None:
    store, clock = LeaseStore(), Clock()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    await a.acquire()
    assert a.leading and not await b.try_acquire_or_renew()  # b first sees a's record: valid for 3 s
    clock.now += FAST.lease_duration - 0.1
    assert not await b.try_acquire_or_renew()
    clock.now += 0.1
    assert await b.try_acquire_or_renew()
    assert store.lease is not None and store.lease["spec"]["holderIdentity"] == "b"


async def test_a_409_on_the_lease_is_a_failed_attempt_not_a_lost_lease() -> None:
    store, clock = LeaseStore(), Clock()
    a = elector(store, "a", clock)
    await a.acquire()
    original = store.replace

    async def written_meanwhile(manifest: Any) -> dict[str, Any]:
        store.version += 1  # another client wrote the Lease between this attempt's GET and PUT
        assert store.lease is not None
        store.lease["metadata"]["resourceVersion"] = str(store.version)
        return await original(manifest)

    store.replace = written_meanwhile  # type: ignore[method-assign]
    assert not await a.try_acquire_or_renew()
    assert a.leading
    store.replace = original  # type: ignore[method-assign]
    assert await a.try_acquire_or_renew()


async def test_a_hung_api_server_ends_leadership_at_the_renew_deadline() -> None:
    """Every attempt is cut off at the time left to the renew deadline, so a black-holed connection
    cannot keep the leader going past it (here on the real clock: the attempt must be cut off)."""
    store = LeaseStore()
    timing = Timing(lease_duration=2, renew_deadline=0.6, retry_period=0.2)
    leader = LeaderElector(store, "ns", "a", timing=timing)
    await leader.acquire()
    store.hang = True
    with pytest.raises(LeadershipLost):
        async with asyncio.timeout(timing.lease_duration):  # well before a standby may take over
            await leader.hold()
    assert not leader.leading and leader.fence.left() == 0


@pytest.mark.parametrize("error", [RuntimeError("a bug"), KeyError("spec"), KubeError(500, "etcd")])
async def test_a_renewer_failing_for_any_reason_ends_leadership(error: Exception) -> None:
    store, clock = LeaseStore(), Clock()
    leader = elector(store, "a", clock)
    await leader.acquire()
    store.fail = error
    with pytest.raises(LeadershipLost):
        await leader.hold()
    assert clock.now - 1000.0 <= FAST.renew_deadline + FAST.retry_period
    with pytest.raises(NotLeading):
        async with leader.fence.write("PATCH x"):
            pass


async def test_the_fence_refuses_writes_once_the_renew_deadline_passed_even_before_the_renewer_runs() -> None:
    """A replica resumed after a stall (SIGSTOP): its reconcilers may run before its renewer notices."""
    store, clock = LeaseStore(), Clock()
    leader = elector(store, "a", clock)
    await leader.acquire()
    async with leader.fence.write("PATCH x") as left:
        assert left == FAST.renew_deadline
    clock.now += FAST.renew_deadline
    with pytest.raises(NotLeading, match="does not hold"):
        async with leader.fence.write("PATCH x"):
            pass


async def test_the_fence_cuts_a_write_off_when_the_authority_runs_out() -> None:
    fence = Fence(lambda: 0.05)
    with pytest.raises(NotLeading, match="cut off"):
        async with fence.write("PATCH slow"):
            await asyncio.sleep(1)
    assert await fence.drained(0.1)


async def test_release_clears_the_holder_after_closing_the_fence() -> None:
    store, clock = LeaseStore(), Clock()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    await a.acquire()
    assert not await b.try_acquire_or_renew()
    assert await a.release()
    assert store.lease is not None
    assert (store.lease["spec"]["holderIdentity"], store.lease["spec"]["leaseDurationSeconds"]) == ("", 1)
    with pytest.raises(NotLeading):
        async with a.fence.write("PATCH x"):
            pass
    assert await b.try_acquire_or_renew()  # at once, not after the lease duration


async def test_kube_writes_pass_the_write_guard_and_reads_do_not() -> None:
    from carpool.operator.kube import ObjectRef

    fence = Fence(lambda: 0.0)
    kube = Kube(write_guard=fence.write)
    ref = ObjectRef("v1", "Service", "ns", "svc")
    with pytest.raises(NotLeading):
        await kube.delete(ref)
    with pytest.raises(KubeError, match="not logged in"):  # a read goes on to the (absent) connection
        await kube.get(ref)


async def test_kopfs_own_writes_pass_the_guard() -> None:
    from kopf._cogs.clients import api as kopf_api

    original = kopf_api.request
    seen: list[str] = []
    undo = guard_kopf_writes(Fence(lambda: 0.0).write)
    try:
        assert kopf_api.request is not original
        with pytest.raises(NotLeading):
            await kopf_api.request(
                "PATCH",
                "/api/v1/namespaces/ns/events",
                settings=kopf.OperatorSettings(),
                logger=logging.getLogger(),
            )
        seen.append("refused")
    finally:
        undo()
    assert kopf_api.request is original and seen == ["refused"]
