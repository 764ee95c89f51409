"""A BatchedModel deleted and applied again at once (`kubectl delete --wait=false` then `apply`, `helm
upgrade`, Argo CD): its children still name the old uid. On kmock nothing garbage-collects them, so they
stay until the operator takes them over; tests/cluster/test_recreated.py runs the same against the real
garbage collector."""

from __future__ import annotations

import asyncio
from typing import Any

import kmock
from prometheus_client import REGISTRY

from carpool.operator.plan import REPLICAS_MANAGER
from tests.operator.factories import NAMESPACE, Cluster, batched_model

CHILDREN = [
    ("ConfigMap", "m-runtime"),
    ("Deployment", "m"),
    ("Service", "m"),
    ("HorizontalPodAutoscaler", "m"),
    ("PodDisruptionBudget", "m"),
]


def owner_uid(child: dict[str, Any] | None) -> str | None:
    refs = ((child or {}).get("metadata") or {}).get("ownerReferences") or []
    return next((str(ref["uid"]) for ref in refs if ref.get("controller")), None)


async def owned_by(cluster: Cluster, uid: str) -> dict[str, str | None] | None:
    found = {kind: owner_uid(await cluster.get(kind, name)) for kind, name in CHILDREN}
    return found if all(value == uid for value in found.values()) else None


async def recreate(cluster: Cluster) -> None:
    await cluster.create(batched_model("m", uid="uid-old"))
    await cluster.wait_for(lambda: owned_by(cluster, "uid-old"), what="the first model's children")
    await cluster.delete("BatchedModel", "m")
    await cluster.create(batched_model("m", uid="uid-new"))


async def test_a_re_created_model_takes_over_every_child_without_a_conflict(cluster: Cluster) -> None:
    await recreate(cluster)
    await cluster.wait_for(lambda: owned_by(cluster, "uid-new"), what="every child owned by the new uid")

    async def settled() -> dict[str, Any] | None:
        degraded = await cluster.condition("m", "Degraded")
        return degraded if degraded and degraded["reason"] != "ResourceConflict" else None

    await cluster.wait_for(settled, what="a status without ResourceConflict")
    events = [e for e in await cluster.list("Event") if e.get("reason") == "ResourceConflict"]
    assert events == []


async def test_a_predecessors_child_is_taken_back_on_its_events_and_re_created_when_deleted(
    cluster: Cluster,
) -> None:
    """What the garbage collector does in the hand-over: a child still naming the old uid changes, or
    is deleted. Both events reconcile the model of that name, whatever its uid now."""
    await recreate(cluster)
    await cluster.wait_for(lambda: owned_by(cluster, "uid-new"), what="every child owned by the new uid")
    await settled(cluster)  # no other child's event may reconcile the model for the one under test
    stale = {"ownerReferences": [{**ref, "uid": "uid-old"} for ref in await refs(cluster, "Service")]}
    await cluster.patch("Service", "m", {"metadata": stale})
    await cluster.wait_for(lambda: owned_by(cluster, "uid-new"), what="the Service taken back")
    await settled(cluster)

    await cluster.patch("Deployment", "m", {"metadata": {"ownerReferences": stale["ownerReferences"]}})
    await cluster.delete("Deployment", "m")

    async def re_created() -> dict[str, Any] | None:
        found = await cluster.get("Deployment", "m")
        return found if owner_uid(found) == "uid-new" else None

    await cluster.wait_for(re_created, what="the Deployment re-created for the new model")


async def settled(cluster: Cluster, quiet: float = 1.0) -> None:
    """Wait until the operator sent kmock no request for `quiet` seconds (its reconciles are done)."""
    seen = -1

    async def still() -> bool:
        nonlocal seen
        count = len(list(cluster.kmock))
        if count == seen:
            return True
        seen = count
        await asyncio.sleep(quiet)
        return False

    await cluster.wait_for(still, within=30, what="the operator to settle")


async def refs(cluster: Cluster, kind: str) -> list[dict[str, Any]]:
    child = await cluster.get(kind, "m")
    return list(((child or {}).get("metadata") or {}).get("ownerReferences") or [])


async def test_a_deployment_gone_before_its_replica_hand_over_is_no_api_error(cluster: Cluster) -> None:
    """The garbage collector deleted the predecessor's Deployment between the apply and the replica
    hand-over: the replicas-only body cannot create one (422). Its DELETE event reconciles again; the
    hand-over is no API failure to count and retry."""
    hand_over = cluster.kmock[
        f"patch /apis/apps/v1/namespaces/{NAMESPACE}/deployments/m",
        kmock.params({"fieldManager": REPLICAS_MANAGER}),
    ]
    hand_over[:1] << 422 << {"message": 'Deployment.apps "m" is invalid: spec.selector: Required value'}
    before = REGISTRY.get_sample_value("carpool_operator_reconcile_errors_total", {"reason": "ApiError"}) or 0
    await cluster.create(batched_model("m"))
    await cluster.wait_for(lambda: cluster.condition("m", "Ready"), what="a status")
    await settled(cluster)
    assert len(list(hand_over)) >= 1
    after = REGISTRY.get_sample_value("carpool_operator_reconcile_errors_total", {"reason": "ApiError"}) or 0
    assert after == before
