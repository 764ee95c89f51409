"""The real kopf operator against kmock for a model split over several nodes: the LeaderWorkerSet it
writes, its status from the LeaderWorkerSet's, the scale that reaches the groups, and a cluster without
the LeaderWorkerSet API (kmock does not serve it there), which the status and an Event name.

kmock runs no controllers: the LeaderWorkerSet's status is written by the test, as its controller would
(tests/cluster/test_lws.py runs the real one).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.operator.factories import Cluster, batched_model, two_nodes

LWS_RESOURCE = "leaderworkerset.x-k8s.io/v1/leaderworkersets"


async def test_a_multi_node_model_gets_an_owned_leader_worker_set_and_no_deployment(cluster: Cluster) -> None:
    await cluster.create(batched_model("llama", two_nodes()))
    lws = await cluster.child("LeaderWorkerSet", "llama-lws")
    (owner,) = lws["metadata"]["ownerReferences"]
    assert owner["kind"] == "BatchedModel" and owner["controller"] is True
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["spec"]["replicas"] == 1  # created at the autoscaler's minimum, then handed over
    hpa = await cluster.child("HorizontalPodAutoscaler", "llama")
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"
    service = await cluster.child("Service", "llama")
    assert service["spec"]["selector"]["carpool.dev/role"] == "leader"
    assert await cluster.get("Deployment", "llama") is None


async def test_the_status_follows_the_leader_worker_sets_groups(cluster: Cluster) -> None:
    await cluster.create(batched_model("llama", two_nodes()))
    await cluster.child("LeaderWorkerSet", "llama-lws")
    await cluster.patch(
        "LeaderWorkerSet",
        "llama-lws",
        {"status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}},
    )

    async def ready() -> dict[str, Any] | None:
        condition = await cluster.condition("llama", "Ready")
        return condition if condition and condition["status"] == "True" else None

    condition = await cluster.wait_for(ready, what="Ready from the LeaderWorkerSet's ready groups")
    assert condition["message"] == "1 of 1 replicas ready at http://llama.ml.svc:8000"


async def test_scaling_the_model_scales_the_groups(cluster: Cluster) -> None:
    await cluster.create(batched_model("llama", two_nodes(autoscaling={"enabled": False}, replicas=1)))
    await cluster.child("LeaderWorkerSet", "llama-lws")
    await cluster.patch("BatchedModel", "llama", {"metadata": {"generation": 2}, "spec": {"replicas": 3}})

    async def scaled() -> bool:
        lws = await cluster.get("LeaderWorkerSet", "llama-lws")
        return bool(lws and lws["spec"].get("replicas") == 3)

    await cluster.wait_for(scaled, what="the LeaderWorkerSet at 3 groups")


@pytest.mark.parametrize("missing_apis", [(LWS_RESOURCE,)])
async def test_without_the_leader_worker_set_api_the_status_and_an_event_say_so(cluster: Cluster) -> None:
    await cluster.create(batched_model("llama", two_nodes()))

    async def degraded() -> dict[str, Any] | None:
        condition = await cluster.condition("llama", "Degraded")
        return condition if condition and condition["reason"] == "LeaderWorkerSetApiMissing" else None

    condition = await cluster.wait_for(degraded, what="Degraded naming the missing LeaderWorkerSet API")
    assert condition["status"] == "True" and "sigs.k8s.io/lws" in condition["message"]
    ready = await cluster.condition("llama", "Ready")
    assert ready is not None and (ready["status"], ready["reason"]) == ("False", "LeaderWorkerSetApiMissing")

    async def event() -> dict[str, Any] | None:
        for item in await cluster.list("Event"):
            if item.get("reason") == "LeaderWorkerSetApiMissing":
                return item
        return None

    posted = await cluster.wait_for(event, what="a Warning event")
    assert posted["type"] == "Warning" and posted["involvedObject"]["name"] == "llama"
    # The rest of the model's children are there; only its pods cannot be.
    await cluster.child("Service", "llama")
    assert await cluster.get("Deployment", "llama") is None


async def test_going_to_two_nodes_replaces_the_deployment_with_a_leader_worker_set(cluster: Cluster) -> None:
    await cluster.create(batched_model("llama", {"model": {"source": "org/llm", "task": "generate"}}))
    await cluster.child("Deployment", "llama")
    await cluster.patch("BatchedModel", "llama", {"metadata": {"generation": 2}, "spec": two_nodes()})
    await cluster.child("LeaderWorkerSet", "llama-lws")

    async def deleted() -> bool:
        return await cluster.get("Deployment", "llama") is None

    await cluster.wait_for(deleted, what="the Deployment deleted")
