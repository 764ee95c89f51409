"""Leader election's decision (`leader.next_spec`), with the clock passed in: who may hold the Lease when.
tests/cluster/test_replicas.py runs two operator processes against a real API server."""

from __future__ import annotations

from carpool.operator.leader import (
    LEASE_DURATION_SECONDS,
    RENEW_DEADLINE_SECONDS,
    RETRY_PERIOD_SECONDS,
    next_spec,
)

NOW = "2026-11-27T14:00:00.000000Z"


def held_by(holder: str, transitions: int = 0) -> dict[str, object]:
    return {
        "holderIdentity": holder,
        "leaseDurationSeconds": LEASE_DURATION_SECONDS,
        "acquireTime": "2026-11-27T13:00:00.000000Z",
        "renewTime": "2026-11-27T13:59:59.000000Z",
        "leaseTransitions": transitions,
    }


def test_controller_runtimes_timing_keeps_two_leaders_apart() -> None:
    assert (LEASE_DURATION_SECONDS, RENEW_DEADLINE_SECONDS, RETRY_PERIOD_SECONDS) == (15, 10.0, 2.0)
    # A leader gives up before a standby may take over.
    assert RENEW_DEADLINE_SECONDS < LEASE_DURATION_SECONDS


def test_a_free_lease_is_taken() -> None:
    spec = next_spec(None, "a", now=NOW, observed_at=0.0, clock=0.0)
    assert spec is not None and spec["holderIdentity"] == "a" and spec["acquireTime"] == NOW
    assert spec["leaseTransitions"] == 0 and spec["leaseDurationSeconds"] == LEASE_DURATION_SECONDS


def test_a_lease_another_replica_renewed_lately_is_left_alone() -> None:
    lease = held_by("b")
    assert (
        next_spec(lease, "a", now=NOW, observed_at=100.0, clock=100.0 + LEASE_DURATION_SECONDS - 0.1) is None
    )


def test_a_lease_not_renewed_for_its_duration_by_this_replicas_clock_is_taken_over() -> None:
    spec = next_spec(held_by("b", 3), "a", now=NOW, observed_at=100.0, clock=100.0 + LEASE_DURATION_SECONDS)
    assert spec is not None
    assert (spec["holderIdentity"], spec["acquireTime"], spec["leaseTransitions"]) == ("a", NOW, 4)


def test_the_holder_renews_keeping_its_acquire_time() -> None:
    lease = held_by("a", 2)
    spec = next_spec(lease, "a", now=NOW, observed_at=100.0, clock=100.5)
    assert spec is not None and spec["renewTime"] == NOW
    assert (spec["acquireTime"], spec["leaseTransitions"]) == (lease["acquireTime"], 2)


def test_a_released_lease_is_taken_at_once() -> None:
    released = {**held_by("b", 1), "holderIdentity": "", "leaseDurationSeconds": 1}
    spec = next_spec(released, "a", now=NOW, observed_at=100.0, clock=100.0)
    assert spec is not None and spec["holderIdentity"] == "a" and spec["leaseTransitions"] == 1


def test_a_standby_takes_over_within_19_s_of_the_last_renewal() -> None:
    """One retry period to see the last renewal, the lease, one retry period to try again."""
    from carpool.operator.leader import TAKE_OVER_SECONDS

    assert TAKE_OVER_SECONDS == 19
