"""The real kopf operator against kmock's Kubernetes emulator over HTTP.

kmock stores objects as plain JSON and merges patches as dicts: no defaulting, no generation or uid
(the factories set them), no owner-reference garbage collection and no controllers (nobody creates
pods or fills a Deployment's status unless a test does). Each test says where that matters.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.operator.factories import NAMESPACE, Cluster, batched_model


async def test_create_makes_every_child_with_the_owner_reference(cluster: Cluster) -> None:
    await cluster.create(batched_model("embedder"))
    for kind, name in [
        ("ConfigMap", "embedder-runtime"),
        ("Deployment", "embedder"),
        ("Service", "embedder"),
        ("HorizontalPodAutoscaler", "embedder"),
        ("PodDisruptionBudget", "embedder"),
    ]:
        child = await cluster.child(kind, name)
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner["apiVersion"] == "carpool.dev/v1alpha1" and owner["kind"] == "BatchedModel"
        assert owner["name"] == "embedder" and owner["uid"] == "uid-embedder"
        assert owner["controller"] is True and owner["blockOwnerDeletion"] is True


def versions(cluster: Cluster, resource: str, name: str) -> int:
    """How many times kmock stored the object (each create, patch or status write adds one)."""
    return len(cluster.kmock.objects[resource, NAMESPACE, name].history)


async def test_status_reports_the_endpoint_generation_and_conditions(cluster: Cluster) -> None:
    await cluster.create(batched_model("embedder", generation=4))
    status = await cluster.wait_for(lambda: cluster.status("embedder"), what="a status")
    assert status["endpoint"] == "http://embedder.ml.svc:8000"
    assert status["observedGeneration"] == 4
    assert status["selector"] == "app.kubernetes.io/name=carpool-runtime,app.kubernetes.io/instance=embedder"
    types = [c["type"] for c in status["conditions"]]
    assert types == ["Ready", "Progressing", "WarmedUp", "Degraded", "Autoscaling"]


async def test_update_changes_the_config_and_rolls_the_pods_but_not_the_service(cluster: Cluster) -> None:
    await cluster.create(batched_model("embedder", {"batching": {"maxBatchSize": 8}}))
    before = await cluster.child("Deployment", "embedder")
    await cluster.child("HorizontalPodAutoscaler", "embedder")
    services = versions(cluster, "v1/services", "embedder")

    # kmock bumps no generation; the test does what the API server would.
    await cluster.patch(
        "BatchedModel",
        "embedder",
        {"metadata": {"generation": 2}, "spec": {"batching": {"maxBatchSize": 16}}},
    )

    async def config_updated() -> bool:
        config_map = await cluster.get("ConfigMap", "embedder-runtime")
        return "max_batch_size: 16" in (config_map or {}).get("data", {}).get("runtime.yaml", "")

    await cluster.wait_for(config_updated, what="the new runtime config")

    def hash_of(deployment: dict[str, Any] | None) -> str:
        return str(
            (deployment or {})["spec"]["template"]["metadata"]["annotations"]["carpool.dev/config-hash"]
        )

    async def rolled() -> bool:
        return hash_of(await cluster.get("Deployment", "embedder")) != hash_of(before)

    await cluster.wait_for(rolled, what="a new config hash on the pod template")
    assert versions(cluster, "v1/services", "embedder") == services  # nothing to change there


async def test_a_deleted_child_is_restored(cluster: Cluster) -> None:
    await cluster.create(batched_model("embedder"))
    await cluster.child("Service", "embedder")
    await cluster.delete("Service", "embedder")
    restored = await cluster.child("Service", "embedder")
    assert restored["spec"]["ports"][0]["port"] == 8000


async def test_an_edited_child_is_restored(cluster: Cluster) -> None:
    await cluster.create(batched_model("embedder"))
    await cluster.child("Deployment", "embedder")
    await cluster.patch(
        "Deployment", "embedder", {"spec": {"template": {"spec": {"terminationGracePeriodSeconds": 1}}}}
    )

    async def restored() -> bool:
        deployment = await cluster.get("Deployment", "embedder") or {}
        return bool(deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 30)

    await cluster.wait_for(restored, what="the grace period restored")


async def test_the_autoscalers_replica_count_is_never_overwritten(cluster: Cluster) -> None:
    await cluster.create(batched_model("embedder", {"autoscaling": {"minReplicas": 2, "maxReplicas": 9}}))
    created = await cluster.child("Deployment", "embedder")
    assert created["spec"]["replicas"] == 2  # created at the autoscaler's minimum
    # The creating reconcile ends with the replica hand-over (a second apply of 2) and then the status:
    # the autoscaler below acts after it, as a real HPA (which waits for pods and metrics) would. On a
    # real server, a hand-over after the HPA took the field is a 409 and skipped; kmock would merge it.
    await cluster.wait_for(lambda: cluster.status("embedder"), what="the first reconcile's status")

    # The HPA scales up (through the scale subresource on a real server; a plain patch here).
    await cluster.patch("Deployment", "embedder", {"spec": {"replicas": 7}})
    # A spec change re-applies the Deployment: its manifest leaves replicas out. On a real server,
    # server-side apply leaves a field it does not set to its owner (the HPA); kmock's dict merge
    # keeps it too, so this checks the operator never sends a replica count.
    await cluster.patch(
        "BatchedModel", "embedder", {"metadata": {"generation": 2}, "spec": {"batching": {"maxBatchSize": 8}}}
    )

    async def reapplied() -> dict[str, Any] | None:
        config_map = await cluster.get("ConfigMap", "embedder-runtime")
        if "max_batch_size: 8" not in (config_map or {}).get("data", {}).get("runtime.yaml", ""):
            return None
        deployment = await cluster.get("Deployment", "embedder")
        annotations = (deployment or {})["spec"]["template"]["metadata"]["annotations"]
        return deployment if annotations["carpool.dev/config-hash"] != _hash(created) else None

    deployment = await cluster.wait_for(reapplied, what="the Deployment re-applied")
    assert deployment["spec"]["replicas"] == 7


def _hash(deployment: dict[str, Any]) -> str:
    return str(deployment["spec"]["template"]["metadata"]["annotations"]["carpool.dev/config-hash"])


async def test_status_follows_the_deployment_and_the_hpa(cluster: Cluster) -> None:
    await cluster.create(batched_model("embedder"))
    await cluster.child("HorizontalPodAutoscaler", "embedder")
    # No controllers run in kmock: the test plays the Deployment controller and the HPA.
    await cluster.patch(
        "Deployment",
        "embedder",
        {"status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "availableReplicas": 1}},
    )
    await cluster.patch(
        "HorizontalPodAutoscaler",
        "embedder",
        {
            "status": {
                "conditions": [
                    {"type": "AbleToScale", "status": "True", "reason": "SucceededGetScale"},
                    {
                        "type": "ScalingActive",
                        "status": "False",
                        "reason": "FailedGetPodsMetric",
                        "message": "unable to get metric carpool_queue_depth: no metrics returned",
                    },
                ]
            }
        },
    )

    async def reported() -> dict[str, Any] | None:
        ready = await cluster.condition("embedder", "Ready")
        scaling = await cluster.condition("embedder", "Autoscaling")
        if ready and scaling and ready["status"] == "True" and scaling["reason"] == "FailedGetPodsMetric":
            return scaling
        return None

    scaling = await cluster.wait_for(reported, what="Ready and the HPA's reason on the BatchedModel")
    assert "carpool_queue_depth" in scaling["message"]
    assert (await cluster.condition("embedder", "WarmedUp") or {})["status"] == "True"
    assert (await cluster.status("embedder"))["phase"] == "Ready"


async def test_an_invalid_spec_becomes_a_condition_and_an_event_without_retries(cluster: Cluster) -> None:
    await cluster.create(batched_model("broken", {"model": {"source": "s3://models/minilm"}}))

    async def failed() -> dict[str, Any] | None:
        ready = await cluster.condition("broken", "Ready")
        return ready if ready and ready["reason"] == "UnsupportedModelSource" else None

    ready = await cluster.wait_for(failed, what="the UnsupportedModelSource condition")
    assert "s3" in ready["message"] and ready["status"] == "False"
    assert (await cluster.status("broken"))["phase"] == "Failed"

    async def event() -> dict[str, Any] | None:
        for item in await cluster.list("Event"):
            if item.get("reason") == "UnsupportedModelSource":
                return item
        return None

    posted = await cluster.wait_for(event, what="a Warning event")
    assert posted["type"] == "Warning" and "s3" in posted["message"]
    assert posted["involvedObject"]["name"] == "broken"
    assert await cluster.get("Deployment", "broken") is None

    # No hot loop: kopf does not retry a PermanentError, so the object stops changing (kopf's default
    # retry delay is 60 s; a loop would keep writing the status or annotations). On a loaded machine
    # kopf may still handle the object once or twice more before its own annotations settle (kmock
    # merges patches as plain dicts), each run ending in the same PermanentError; then writes stop.
    resource = "carpool.dev/v1alpha1/batchedmodels"
    settled = last = versions(cluster, resource, "broken")
    quiet_since = time.monotonic()
    deadline = quiet_since + 10.0
    while time.monotonic() - quiet_since < 1.5:
        assert time.monotonic() < deadline, f"still changing after 10 s: {last - settled} writes (a hot loop)"
        await asyncio.sleep(0.05)
        if (current := versions(cluster, resource, "broken")) != last:
            last, quiet_since = current, time.monotonic()
    assert last <= settled + 6, f"{last - settled} more writes after the condition was reported"


async def test_switching_to_keda_replaces_the_hpa(cluster: Cluster) -> None:
    await cluster.create(batched_model("chat"))
    await cluster.child("HorizontalPodAutoscaler", "chat")
    await cluster.patch(
        "BatchedModel",
        "chat",
        {
            "metadata": {"generation": 2},
            "spec": {"autoscaling": {"engine": "keda", "minReplicas": 0, "keda": {"query": "sum(up)"}}},
        },
    )
    scaled = await cluster.child("ScaledObject", "chat")
    assert scaled["spec"]["minReplicaCount"] == 0
    await cluster.wait_for(
        lambda: _absent(cluster, "HorizontalPodAutoscaler", "chat"), what="the HPA deleted"
    )


async def _absent(cluster: Cluster, kind: str, name: str) -> bool:
    return await cluster.get(kind, name) is None


async def test_the_children_carry_owner_references_for_garbage_collection(cluster: Cluster) -> None:
    # kmock has no garbage collector: deleting the BatchedModel would leave the children here. What
    # the operator controls is that every child names its owner with controller=true, so the API
    # server's garbage collector deletes them with it.
    await cluster.create(batched_model("embedder"))
    await cluster.child("PodDisruptionBudget", "embedder")
    for kind in ("ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"):
        for child in await cluster.list(kind):
            (owner,) = child["metadata"]["ownerReferences"]
            assert owner["controller"] is True and owner["uid"] == "uid-embedder"
