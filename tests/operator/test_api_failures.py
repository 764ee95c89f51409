"""What the operator does when the Kubernetes API fails: each kind of failure has a log line and a label
of `carpool_operator_reconcile_errors_total` of its own, a 429's Retry-After is honoured, a 403 shows as a
condition while it lasts, and a reconcile an event triggered is requeued, never dropped.

kmock answers the chosen requests with the failure (a slice: the first N only) and the rest as usual.
An unreachable server (status 0) is not emulated here: tests/cluster/test_faults.py stops the real
kube-apiserver.
"""

from __future__ import annotations

import logging
from typing import Any

import kmock
import pytest
from prometheus_client import REGISTRY

from carpool.operator import FIELD_MANAGER
from carpool.operator.kube import KubeError
from carpool.operator.reconcile import (
    RETRY_DELAY_SECONDS,
    SlowRetries,
    admission_delay,
    api_failure,
    slow_retries,
)
from tests.operator.factories import NAMESPACE, Cluster, batched_model
from tests.operator.test_recreated import settled

DEPLOYMENT = f"get /apis/apps/v1/namespaces/{NAMESPACE}/deployments/m"
OPERATOR: Any = kmock.headers({"User-Agent": FIELD_MANAGER})
"""The operator's own requests (the test's reads go through unharmed)."""


def fail_next(cluster: Cluster, times: int, *payload: Any) -> None:
    """Answer the operator's next `times` reads of the Deployment with `payload` (kmock's slices count
    the requests a view saw from the start)."""
    view = cluster.kmock[DEPLOYMENT, OPERATOR]
    seen = len(list(view))
    reaction = view[seen : seen + times]
    for item in payload:
        reaction = reaction << item


def errors(reason: str) -> float:
    return REGISTRY.get_sample_value("carpool_operator_reconcile_errors_total", {"reason": reason}) or 0.0


@pytest.mark.parametrize(
    ("status", "reason", "line"),
    [
        (0, "ApiUnreachable", "Kubernetes API unreachable"),
        (401, "Unauthorized", "refused the operator's credentials (401"),
        (403, "Forbidden", "forbade a call (403"),
        (429, "TooManyRequests", "throttled the operator (429"),
        (503, "ApiServerError", "server failed (5xx)"),
    ],
)
def test_each_api_failure_has_its_own_log_line_and_metric_label(
    status: int, reason: str, line: str, caplog: pytest.LogCaptureFixture
) -> None:
    before = errors(reason)
    with caplog.at_level(logging.WARNING):
        delay = api_failure(KubeError(status, "boom"), logging.getLogger("test"))
    assert errors(reason) == before + 1
    (record,) = caplog.records
    assert line in record.getMessage() and "boom" in record.getMessage()
    assert delay == RETRY_DELAY_SECONDS


def test_retry_after_sets_the_delay(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        delay = api_failure(KubeError(429, "slow down", retry_after=3), logging.getLogger("test"))
    assert delay == 3
    assert "retrying in 3 s" in caplog.records[0].getMessage()


async def test_a_429_is_retried_when_retry_after_says(cluster: Cluster) -> None:
    """The API server's Retry-After (1 s) replaces the operator's own delay (10 s)."""
    before = errors("TooManyRequests")
    fail_next(cluster, 2, 429, {"Retry-After": "1"}, {"message": "too many requests"})
    await cluster.create(batched_model("m"))
    await cluster.child("Deployment", "m", within=RETRY_DELAY_SECONDS - 2)
    assert errors("TooManyRequests") >= before + 1


async def test_a_403_is_a_condition_while_it_lasts(cluster: Cluster) -> None:
    await cluster.create(batched_model("m"))
    await cluster.child("Deployment", "m")
    await settled(cluster)
    fail_next(cluster, 1, 403, {"message": 'deployments.apps "m" is forbidden'})
    await cluster.delete("Service", "m")  # an event that makes the operator read the Deployment

    async def degraded(reason: str) -> dict[str, Any] | None:
        found = await cluster.condition("m", "Degraded")
        return found if found and found["reason"] == reason else None

    found = await cluster.wait_for(lambda: degraded("Forbidden"), what="Degraded=True Forbidden")
    assert found["status"] == "True" and "forbidden" in found["message"], found
    # The requeued reconcile gets through: the Service is back and the condition is gone.
    await cluster.child("Service", "m", within=RETRY_DELAY_SECONDS + 5)
    await cluster.wait_for(lambda: degraded("AsExpected"), within=5, what="Degraded back to its own reason")


async def test_a_reconcile_a_child_event_triggered_is_requeued_not_dropped(cluster: Cluster) -> None:
    """kopf does not retry event handlers: a deleted Service whose reconcile met a 503 stayed deleted."""
    await cluster.create(batched_model("m"))
    await cluster.child("Service", "m")
    await settled(cluster)
    fail_next(cluster, 1, 503, {"Retry-After": "1"}, {"message": "etcd leader changed"})
    await cluster.delete("Service", "m")
    await cluster.child("Service", "m", within=RETRY_DELAY_SECONDS - 2)


def test_the_slow_retries_follow_their_period() -> None:
    assert slow_retries() == SlowRetries(apply_failed=60, missing_api=60, conflict=30)
    assert slow_retries(10) == SlowRetries(apply_failed=10, missing_api=10, conflict=5)
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="above 0 seconds"):
            slow_retries(bad)


def test_a_denial_that_lasts_is_retried_less_and_less_often() -> None:
    assert [admission_delay(n) for n in range(1, 11)] == [2, 4, 8, 16, 32, 64, 128, 256, 300, 300]


async def test_a_webhook_denial_is_retried_with_back_off_not_a_spec_error(cluster: Cluster) -> None:
    """A policy webhook answers 400 `admission webhook ... denied the request`: a condition and an Event
    while it lasts, then the same spec goes through (kmock answers the first two applies so)."""
    denial = 'admission webhook "deny.example.com" denied the request: images must be signed'
    applies = cluster.kmock[
        f"patch /apis/apps/v1/namespaces/{NAMESPACE}/deployments/m",
        kmock.params({"fieldManager": FIELD_MANAGER}),
    ]
    applies[:2] << 400 << {"message": denial}
    await cluster.create(batched_model("m"))

    async def degraded() -> dict[str, Any] | None:
        found = await cluster.condition("m", "Degraded")
        return found if found and found["reason"] == "AdmissionDenied" else None

    found = await cluster.wait_for(degraded, what="Degraded=True AdmissionDenied")
    assert found["status"] == "True" and "images must be signed" in found["message"], found
    # The Event is posted beside the status patch, not before it: waited for, not read at once (a CI run
    # read the list between the two).

    async def event() -> dict[str, Any] | None:
        return next((e for e in await cluster.list("Event") if e.get("reason") == "AdmissionDenied"), None)

    found_event = await cluster.wait_for(event, what="an AdmissionDenied Event")
    assert "images must be signed" in found_event["message"], found_event
    # Retried after 2 s, then 4 s: the third apply goes through, the spec untouched.
    await cluster.child("Deployment", "m", within=15)

    async def allowed() -> dict[str, Any] | None:
        found = await cluster.condition("m", "Degraded")
        return found if found and found["reason"] != "AdmissionDenied" else None

    await cluster.wait_for(allowed, what="Degraded no longer AdmissionDenied")
