"""What the operator *sends* to the API server (kmock records every request): server-side applies
with carpool's field manager of the full desired object, nothing after a status-only change, no
write over an object carpool does not own, deletions of the old autoscaler before the new one,
server-side label selectors on its watches, and pod failures in the status within seconds.

kmock merges dicts and has no field ownership, so what a real server would do with these requests
(remove the fields the manager no longer sends) is not visible in what kmock stores; the requests are.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from carpool.operator import FIELD_MANAGER
from carpool.operator.plan import REPLICAS_MANAGER
from tests.operator.factories import NAMESPACE, Cluster, batched_model

DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments"


def writes(cluster: Cluster, since: int = 0) -> list[Any]:
    """The operator's requests other than reads, in order (its client names itself)."""
    return [
        r
        for r in list(cluster.kmock)[since:]
        if str(r.method) != "method.GET" and r.headers.get("User-Agent") == FIELD_MANAGER
    ]


def child_writes(cluster: Cluster, since: int = 0) -> list[Any]:
    return [r for r in writes(cluster, since) if "batchedmodels" not in r.url.path]


def mark(cluster: Cluster) -> int:
    return len(list(cluster.kmock))


def body_of(request: Any) -> dict[str, Any]:
    data: dict[str, Any] = request.data if isinstance(request.data, dict) else json.loads(request.body)
    return data


FULL = {
    "resources": {"requests": {"cpu": "2"}, "limits": {"memory": "8Gi", "nvidia.com/gpu": 1}},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "nodeSelector": {"pool": "a100"},
    "podAnnotations": {"team": "search"},
    "imagePullSecrets": ["registry"],
    "modelCacheSizeLimit": "20Gi",
    "service": {"annotations": {"lb": "internal"}},
}


async def test_removing_fields_sends_an_apply_of_the_full_object_without_them(cluster: Cluster) -> None:
    await cluster.create(batched_model("m", FULL))
    await cluster.child("Deployment", "m")
    await cluster.wait_for(lambda: cluster.condition("m", "Autoscaling"), what="the first reconcile done")
    since = mark(cluster)
    # JSON merge patch: null removes a key (kmock stores the result as the API server would).
    removed = {k: None for k in FULL if k != "resources"} | {
        "resources": {"limits": {"memory": None}},
    }
    await cluster.patch("BatchedModel", "m", {"metadata": {"generation": 2}, "spec": removed})

    def applied(path: str) -> dict[str, Any] | None:
        for request in child_writes(cluster, since):
            if request.url.path == path and request.params.get("fieldManager") == FIELD_MANAGER:
                body = body_of(request)
                if "tolerations" not in json.dumps(body) and "internal" not in json.dumps(body):
                    return body
        return None

    deployment = await cluster.wait_for(lambda: applied(f"{DEPLOYMENTS}/m"), what="a Deployment apply")
    service = await cluster.wait_for(
        lambda: applied(f"/api/v1/namespaces/{NAMESPACE}/services/m"), what="a Service apply"
    )
    request = next(
        r
        for r in child_writes(cluster, since)
        if r.url.path == f"{DEPLOYMENTS}/m" and r.params["fieldManager"] == FIELD_MANAGER
    )
    assert request.params.get("force") == "true"
    assert request.headers["Content-Type"].startswith("application/apply-patch+yaml")
    pod = deployment["spec"]["template"]["spec"]
    assert "tolerations" not in pod and "nodeSelector" not in pod and "imagePullSecrets" not in pod
    assert "team" not in deployment["spec"]["template"]["metadata"]["annotations"]
    assert next(v for v in pod["volumes"] if v["name"] == "model-cache") == {
        "name": "model-cache",
        "emptyDir": {},
    }
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    # The full object, not a diff: the apply still names everything the operator owns.
    assert deployment["spec"]["selector"] and pod["containers"][0]["startupProbe"]
    assert "lb" not in service["metadata"].get("annotations", {})


async def test_a_status_update_by_the_hpa_sends_nothing_to_the_children(cluster: Cluster) -> None:
    await cluster.create(batched_model("m"))
    await cluster.child("HorizontalPodAutoscaler", "m")
    await cluster.wait_for(lambda: cluster.condition("m", "Autoscaling"), what="a first status")
    since = mark(cluster)
    # The HPA scales (a replica count the operator does not own) and reports.
    await cluster.patch("Deployment", "m", {"spec": {"replicas": 3}, "status": {"replicas": 3}})
    await cluster.patch(
        "HorizontalPodAutoscaler",
        "m",
        {
            "status": {
                "currentReplicas": 3,
                "desiredReplicas": 3,
                "conditions": [
                    {"type": "AbleToScale", "status": "True", "reason": "ReadyForNewScale"},
                    {"type": "ScalingActive", "status": "True", "reason": "ValidMetricFound"},
                ],
            }
        },
    )

    async def seen() -> bool:
        scaling = await cluster.condition("m", "Autoscaling") or {}
        return (
            scaling.get("reason") == "ValidMetricFound" and (await cluster.status("m")).get("replicas") == 3
        )

    await cluster.wait_for(seen, what="the operator reading the HPA's status")
    assert child_writes(cluster, since) == []


async def test_an_object_carpool_does_not_own_is_not_taken_over(cluster: Cluster) -> None:
    foreign = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "m", "namespace": NAMESPACE, "labels": {"app": "shop"}},
        "spec": {"ports": [{"port": 80}]},
    }
    await cluster.create(foreign)
    await cluster.create(batched_model("m"))

    async def conflict() -> dict[str, Any] | None:
        ready = await cluster.condition("m", "Ready")
        return ready if ready and ready["reason"] == "ResourceConflict" else None

    ready = await cluster.wait_for(conflict, what="Ready=False ResourceConflict")
    assert ready["status"] == "False" and f"Service {NAMESPACE}/m" in ready["message"]

    async def event() -> dict[str, Any] | None:
        return next((e for e in await cluster.list("Event") if e.get("reason") == "ResourceConflict"), None)

    posted = await cluster.wait_for(event, what="a Warning Event")
    assert posted["type"] == "Warning" and f"Service {NAMESPACE}/m" in posted["message"]
    services = f"/api/v1/namespaces/{NAMESPACE}/services/m"
    assert not [r for r in writes(cluster) if r.url.path == services]
    assert (await cluster.get("Service", "m") or {})["spec"]["ports"] == [{"port": 80}]
    assert await cluster.get("Deployment", "m") is not None  # the rest is still reconciled


async def test_switching_autoscalers_deletes_the_old_one_before_creating_the_new(cluster: Cluster) -> None:
    await cluster.create(batched_model("m"))
    await cluster.child("HorizontalPodAutoscaler", "m")
    since = mark(cluster)
    spec = {"autoscaling": {"engine": "keda"}}
    await cluster.patch("BatchedModel", "m", {"metadata": {"generation": 2}, "spec": spec})
    deleted = ("method.DELETE", "horizontalpodautoscalers")
    created = ("method.PATCH", "scaledobjects")

    def sent() -> list[tuple[str, str]] | None:
        paths = [(str(r.method), r.url.path.rsplit("/", 2)[-2]) for r in child_writes(cluster, since)]
        return paths if deleted in paths and created in paths else None

    paths = await cluster.wait_for(sent, what="the HPA deleted and the ScaledObject applied")
    assert paths.index(deleted) < paths.index(created)


async def test_turning_autoscaling_on_keeps_the_replica_count(cluster: Cluster) -> None:
    await cluster.create(batched_model("m", {"autoscaling": {"enabled": False}, "replicas": 5}))
    created = await cluster.child("Deployment", "m")
    assert created["spec"]["replicas"] == 5
    since = mark(cluster)
    await cluster.patch(
        "BatchedModel", "m", {"metadata": {"generation": 2}, "spec": {"autoscaling": {"enabled": True}}}
    )
    await cluster.child("HorizontalPodAutoscaler", "m")
    sent = [r for r in child_writes(cluster, since) if r.url.path == f"{DEPLOYMENTS}/m"]
    managers = [r.params["fieldManager"] for r in sent]
    assert managers[:2] == [REPLICAS_MANAGER, FIELD_MANAGER]
    assert body_of(sent[0])["spec"] == {"replicas": 5}
    assert "force" not in sent[0].params  # never takes the count from an autoscaler that has it
    assert "replicas" not in body_of(sent[1])["spec"]


async def test_watches_filter_by_label_at_the_api_server(cluster: Cluster) -> None:
    await cluster.create(batched_model("m"))
    await cluster.child("Deployment", "m")

    def selectors() -> dict[str, str]:
        found = {}
        for request in list(cluster.kmock):
            if request.params.get("watch") == "true" and request.resource is not None:
                found[request.resource.plural] = request.params.get("labelSelector", "")
        return found

    watched = await cluster.wait_for(
        lambda: (s := selectors()) and {"pods", "configmaps", "deployments", "services"} <= set(s) and s,
        what="the watches",
    )
    for plural in ("configmaps", "services", "deployments", "horizontalpodautoscalers", "pods"):
        assert "app.kubernetes.io/managed-by=carpool-operator" in watched[plural], plural
    assert "app.kubernetes.io/name=carpool-runtime" in watched["pods"]


async def test_an_unschedulable_pod_is_in_the_status_and_an_event_within_seconds(cluster: Cluster) -> None:
    await cluster.create(batched_model("m"))
    await cluster.child("Deployment", "m")
    message = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    await cluster.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "m-6d4f-abcde",
                "namespace": NAMESPACE,
                "labels": {
                    "app.kubernetes.io/name": "carpool-runtime",
                    "app.kubernetes.io/instance": "m",
                    "app.kubernetes.io/managed-by": "carpool-operator",
                },
            },
            "spec": {"containers": [{"name": "runtime", "image": "x"}]},
            "status": {
                "phase": "Pending",
                "conditions": [
                    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
                ],
            },
        }
    )

    async def explained() -> dict[str, Any] | None:
        ready = await cluster.condition("m", "Ready")
        return ready if ready and ready["reason"] == "Unschedulable" else None

    ready = await cluster.wait_for(explained, what="Ready=False Unschedulable")
    assert message in ready["message"]
    degraded = await cluster.condition("m", "Degraded") or {}
    assert degraded.get("status") == "True"

    async def event() -> dict[str, Any] | None:
        return next((e for e in await cluster.list("Event") if e.get("reason") == "Unschedulable"), None)

    assert message in (await cluster.wait_for(event, what="an Unschedulable Event"))["message"]


async def test_an_event_started_reconcile_reads_no_child_the_spec_does_not_want(cluster: Cluster) -> None:
    """A child's status change reconciles from the informer: it reads no child the spec does not want
    (the ScaledObject, the LeaderWorkerSet, the cache PVC of this model: absent, and only a spec change,
    whose own reconcile reads them, makes a child unwanted). Before, each cost a GET on every pod and
    child event."""
    await cluster.create(batched_model("m"))
    await cluster.child("HorizontalPodAutoscaler", "m")
    await cluster.wait_for(lambda: cluster.condition("m", "Autoscaling"), what="a first status")

    async def idle() -> bool:
        # kopf may run the create handler once more (before it sees its own annotation), which reads
        # every child from the server as a spec change should: let it finish first.
        before = mark(cluster)
        await asyncio.sleep(0.5)
        return mark(cluster) == before

    await cluster.wait_for(idle, what="the operator idle")
    since = mark(cluster)
    await cluster.patch("Deployment", "m", {"status": {"replicas": 1, "readyReplicas": 1}})

    async def seen() -> bool:
        return bool((await cluster.status("m")).get("readyReplicas") == 1)

    await cluster.wait_for(seen, what="the operator reading the Deployment's status")
    reads = [
        r.url.path
        for r in list(cluster.kmock)[since:]
        if str(r.method) == "method.GET"
        and r.headers.get("User-Agent") == FIELD_MANAGER
        and r.params.get("watch") != "true"
    ]
    assert any("/batchedmodels/m" in path for path in reads), reads
    unwanted = ("scaledobjects", "leaderworkersets", "persistentvolumeclaims")
    assert [path for path in reads if any(f"/{plural}/" in path for plural in unwanted)] == []
