"""Peering priorities: several operator replicas must leave exactly one of them working.

kopf pauses a replica only for a live peer with a higher priority, and pauses all of them when the
highest priority is shared, so identical replicas (the chart's) each derive a distinct priority.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import kopf
import pytest
from kopf._cogs.aiokits.aiotoggles import Toggle
from kopf._cogs.structs.references import Resource
from kopf._core.engines.peering import Identity, process_peering_event

from carpool.cli import main
from carpool.operator.run import PRIORITY_SPAN, peering_priority

PODS = [f"carpool-operator-5d8f7c9b4-{suffix}" for suffix in ("x2k9p", "q7w4z", "m3n8v", "a1b2c")]


def test_each_replica_derives_a_distinct_negative_priority() -> None:
    priorities = [peering_priority(pod) for pod in PODS]
    assert len(set(priorities)) == len(PODS)
    assert all(-PRIORITY_SPAN <= priority <= -1 for priority in priorities)


def test_a_replica_keeps_its_priority_across_restarts_and_processes() -> None:
    # sha256, not Python's hash() (salted per process): a restarted container, same pod name, same value.
    assert peering_priority(PODS[0]) == peering_priority(PODS[0]) == -824_415_026


def test_the_pod_name_is_the_identity_and_a_process_without_one_still_gets_a_priority(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("POD_ID", PODS[1])
    assert peering_priority() == peering_priority(PODS[1])
    monkeypatch.delenv("POD_ID")
    assert -PRIORITY_SPAN <= peering_priority() <= -1  # hostname and pid


async def paused(identity: str, priorities: dict[str, int]) -> bool:
    """Whether kopf's own peering logic pauses `identity` when these peers are alive."""
    settings = kopf.OperatorSettings()
    settings.peering.name = "carpool"
    settings.peering.priority = priorities[identity]
    now = datetime.datetime.now(datetime.UTC).isoformat()
    status = {pod: {"priority": prio, "lifetime": 60, "lastseen": now} for pod, prio in priorities.items()}
    event: Any = {"type": "MODIFIED", "object": {"metadata": {"name": "carpool"}, "status": status}}
    conflicts, pressure = Toggle(), asyncio.Event()
    pressure.set()  # return at once instead of sleeping until the peers' keep-alives expire
    await process_peering_event(
        raw_event=event,
        namespace=None,
        resource=Resource(group="kopf.dev", version="v1", plural="clusterkopfpeerings"),
        identity=Identity(identity),
        settings=settings,
        stream_pressure=pressure,
        conflicts_found=conflicts,
    )
    return conflicts.is_on()


async def test_with_derived_priorities_exactly_one_replica_works() -> None:
    derived = {pod: peering_priority(pod) for pod in PODS[:3]}
    working = [pod for pod in derived if not await paused(pod, derived)]
    assert working == [max(derived, key=lambda pod: derived[pod])]
    # What the chart's replicas did before: one shared priority pauses every one of them.
    shared = dict.fromkeys(PODS[:3], 0)
    assert [pod for pod in shared if not await paused(pod, shared)] == []
    # A developer's operator with a positive priority pauses the deployed replicas.
    assert await paused(PODS[0], {**derived, "dev@laptop": 666})


@pytest.fixture
def kopf_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """`carpool operator` up to the call into kopf, which records its arguments instead of running."""
    calls: list[dict[str, Any]] = []

    async def operator(**kwargs: Any) -> None:
        calls.append(kwargs)

    monkeypatch.setattr(kopf, "operator", operator)
    monkeypatch.setattr(kopf, "configure", lambda **_: None)  # leave the test process's logging alone
    monkeypatch.setenv("POD_ID", PODS[2])
    return calls


def test_the_operator_command_hands_kopf_the_derived_priority(kopf_calls: list[dict[str, Any]]) -> None:
    flags = ["--liveness-port=0", "--metrics-port=0", "--log-format=plain"]
    assert main(["operator", "--peering=carpool-peering", *flags]) == 0  # as the chart runs it
    assert main(["operator", "--peering=carpool-peering", "--priority=100", *flags]) == 0
    derived, explicit = kopf_calls
    assert derived["peering_name"] == "carpool-peering"
    assert derived["priority"] == peering_priority(PODS[2])
    assert explicit["priority"] == 100
