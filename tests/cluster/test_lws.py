"""A model split over two nodes on the real control plane, with the real LeaderWorkerSet controller
(tests/cluster/lws.py): the operator's LeaderWorkerSet accepted by LWS's CRD and webhook, each group's
pods created by the LWS and StatefulSet controllers with their leader's address, the Service selecting
the leaders only, a scale of the BatchedModel (its scale subresource, as `kubectl scale bm` does)
reaching the groups, and deleting the BatchedModel collecting all of it (the garbage collector).

No kubelet runs here: the pods are created and stay Pending, which is all that these assertions need.
Whether vLLM starts across them is the runtime's business (its tests run vLLM's CPU build).
"""

from __future__ import annotations

from typing import Any

from tests.cluster.api import Api, condition, path, run, wait_for
from tests.cluster.conftest import Operator
from tests.cluster.controlplane import ControlPlane
from tests.cluster.objects import batched_model, kubectl_apply
from tests.cluster.test_admission import LONGEST_RETRY_SECONDS
from tests.cluster.test_defects import writes_after_a_resync

NAME = "llm"
LWS = f"{NAME}-lws"
INSTANCE = "app.kubernetes.io/instance"


def _pods(api: Api, namespace: str) -> list[dict[str, Any]]:
    return [
        p for p in api.list("Pod", namespace) if (p["metadata"].get("labels") or {}).get(INSTANCE) == NAME
    ]


def _groups(api: Api, namespace: str, count: int) -> list[dict[str, Any]]:
    def created() -> list[dict[str, Any]] | None:
        pods = _pods(api, namespace)
        if len(pods) != 2 * count:
            raise AssertionError(f"{len(pods)} pods: {[p['metadata']['name'] for p in pods]}")
        return pods

    return wait_for(f"{count} groups of 2 pods", created, timeout=60)


def _env(pod: dict[str, Any]) -> dict[str, str]:
    (container,) = pod["spec"]["containers"]
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


def _selects(selector: dict[str, str], pod: dict[str, Any]) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return all(labels.get(key) == value for key, value in selector.items())


def test_a_two_node_model_runs_as_leader_worker_set_groups(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    model = {"source": "org/llm", "task": "generate", "engine": "vllm", "pipelineParallelSize": 2, "nodes": 2}
    # No surge group: these pods never become ready here (no kubelet runs them), so LWS would count a scale
    # during the unfinished first rollout as a rolling update and add its surge group (3 groups for 2). GPU
    # pods default to this rollout anyway (a surge group needs whole nodes of free GPUs).
    rollout = {"maxSurge": 0, "maxUnavailable": 1}
    body = batched_model(
        NAME, namespace, model=model, autoscaling={"enabled": False}, replicas=1, rollout=rollout
    )
    kubectl_apply(admin_env, body)

    lws = wait_for("the LeaderWorkerSet", lambda: api.get("LeaderWorkerSet", namespace, LWS))
    (owner,) = lws["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("BatchedModel", NAME, True)
    # Accepted by LWS's own webhook, which defaults what the operator leaves out.
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["spec"]["networkConfig"]["subdomainPolicy"] == "Shared"

    pods = _groups(api, namespace, 1)
    roles = {p["metadata"]["labels"]["carpool.dev/role"]: p for p in pods}
    leader, worker = roles["leader"], roles["worker"]
    assert leader["metadata"]["name"] == f"{LWS}-0" and worker["metadata"]["name"] == f"{LWS}-0-1"
    for index, pod in enumerate((leader, worker)):
        env = _env(pod)
        # Set by LWS's pod webhook, first in the list, so the operator's $(LWS_WORKER_INDEX) resolves.
        assert env["LWS_LEADER_ADDRESS"] == f"{LWS}-0.{LWS}.{namespace}"
        assert (env["LWS_GROUP_SIZE"], env["LWS_WORKER_INDEX"]) == ("2", str(index))
        assert env["CARPOOL_MODEL__NODE_RANK"] == "$(LWS_WORKER_INDEX)"
        assert list(env).index("LWS_WORKER_INDEX") < list(env).index("CARPOOL_MODEL__NODE_RANK")
    assert "readinessProbe" in leader["spec"]["containers"][0]
    # The worker answers the group's probes itself, ready only with its leader (runtime.vllm.group).
    assert worker["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"

    # The operator applies the Service after the LeaderWorkerSet, and the LWS and StatefulSet controllers
    # may create the pods before that apply lands (CI saw it once): wait for it, as for LWS's headless one.
    service = wait_for("the model's Service", lambda: api.get("Service", namespace, NAME))
    assert service["spec"]["clusterIP"] != "None"  # ours, not LWS's headless one
    selector = service["spec"]["selector"]
    assert _selects(selector, leader) and not _selects(selector, worker)
    headless = wait_for("LWS's headless Service", lambda: api.get("Service", namespace, LWS))
    assert headless["spec"]["clusterIP"] == "None"  # LWS's, for the groups' DNS names

    # `kubectl scale bm` (the BatchedModel's scale subresource) reaches the LeaderWorkerSet: a group more.
    run("kubectl", "scale", "batchedmodel", NAME, "-n", namespace, "--replicas=2", env=admin_env)
    pods = _groups(api, namespace, 2)
    second = next(p for p in pods if p["metadata"]["name"] == f"{LWS}-1")
    assert _env(second)["LWS_LEADER_ADDRESS"] == f"{LWS}-1.{LWS}.{namespace}"
    scale = api.request("GET", path("LeaderWorkerSet", namespace, LWS, "scale"))
    assert scale.json()["spec"]["replicas"] == 2

    api.delete("BatchedModel", namespace, NAME)

    def collected() -> bool:
        left = [p["metadata"]["name"] for p in _pods(api, namespace)]
        sets = [s["metadata"]["name"] for s in api.list("StatefulSet", namespace)]
        if left or sets or api.get("LeaderWorkerSet", namespace, LWS) is not None:
            raise AssertionError(f"pods {left}, StatefulSets {sets}")
        return True

    wait_for("the garbage collector to remove the groups", collected, timeout=90)


def test_the_hpa_controller_scales_the_groups_through_the_leader_worker_sets_scale_subresource(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    """The real HPA controller reads the LeaderWorkerSet's scale subresource (its group count and its
    leaders' selector): it gets that far, and stops only at the missing custom metric (no metrics API
    here; the autoscaling test has one for Deployments)."""
    model = {"source": "org/llm", "task": "generate", "engine": "vllm", "pipelineParallelSize": 2, "nodes": 2}
    kubectl_apply(admin_env, batched_model(NAME, namespace, model=model))
    hpa = wait_for("the HPA", lambda: api.get("HorizontalPodAutoscaler", namespace, NAME))
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": LWS,
    }

    def scale_read() -> dict[str, Any] | None:
        found = api.get("HorizontalPodAutoscaler", namespace, NAME)
        able = condition(found, "AbleToScale")
        if able is None or able["reason"] != "SucceededGetScale":
            raise AssertionError(f"AbleToScale is {able}")
        return found

    found = wait_for("the HPA controller reading the LeaderWorkerSet's scale", scale_read, timeout=90)
    active = condition(found, "ScalingActive")
    assert active is not None and active["reason"] == "FailedGetPodsMetric", active
    # The pods it averages the queue depth over: what the scale subresource selects, the leaders (LWS's
    # hpaPodSelector), one per group.
    scale = api.request("GET", path("LeaderWorkerSet", namespace, LWS, "scale")).json()
    assert "leaderworkerset.sigs.k8s.io/worker-index=0" in scale["status"]["selector"], scale


def test_a_settled_leader_worker_set_is_not_written_again(
    control_plane: ControlPlane, api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    """LWS's webhook defaults fields of the LeaderWorkerSet and its controller writes its status: neither
    may read as drift, or every event would apply it again."""
    model = {"source": "org/llm", "task": "generate", "engine": "vllm", "pipelineParallelSize": 2, "nodes": 2}
    kubectl_apply(admin_env, batched_model(NAME, namespace, model=model, autoscaling={"enabled": False}))
    _groups(api, namespace, 1)
    # LWS's webhooks default and check the LeaderWorkerSet: a write they refuse or rewrite would be tried
    # again only after the operator's longest retry period, so the watch spans two of those.
    writes = writes_after_a_resync(
        control_plane, api, operator, namespace, ("LeaderWorkerSet", LWS), 2.0, 2 * LONGEST_RETRY_SECONDS
    )
    assert writes == [], f"a settled LeaderWorkerSet was written again: {writes}"


def test_a_model_moved_to_several_nodes_takes_its_deployments_replica_sets_and_pods_away(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    """`nodes` 1 -> 2 replaces the Deployment by a LeaderWorkerSet: the operator deletes the Deployment
    with propagation, so the garbage collector takes its ReplicaSets and their pods too; nothing of the
    one-node workload is left to hold GPUs."""
    model = {"source": "org/llm", "task": "generate", "engine": "vllm", "pipelineParallelSize": 2, "nodes": 1}
    body = batched_model(NAME, namespace, model=model, autoscaling={"enabled": False}, replicas=1)
    kubectl_apply(admin_env, body)
    deployment = wait_for("the Deployment", lambda: api.get("Deployment", namespace, NAME))
    uid = deployment["metadata"]["uid"]

    def owned_by(kind: str, owners: set[str]) -> list[dict[str, Any]]:
        return [
            o
            for o in api.list(kind, namespace)
            if any(ref.get("uid") in owners for ref in o["metadata"].get("ownerReferences") or [])
        ]

    sets = wait_for("the Deployment's ReplicaSet", lambda: owned_by("ReplicaSet", {uid}) or None)
    set_uids = {s["metadata"]["uid"] for s in sets}
    wait_for("the ReplicaSet's pod", lambda: owned_by("Pod", set_uids) or None)

    model["nodes"] = 2
    kubectl_apply(
        admin_env, batched_model(NAME, namespace, model=model, autoscaling={"enabled": False}, replicas=1)
    )
    wait_for("the LeaderWorkerSet", lambda: api.get("LeaderWorkerSet", namespace, LWS))

    def gone() -> bool:
        left = {
            "Deployment": [d["metadata"]["name"] for d in api.list("Deployment", namespace)],
            "ReplicaSet": [s["metadata"]["name"] for s in owned_by("ReplicaSet", {uid})],
            "Pod": [p["metadata"]["name"] for p in owned_by("Pod", set_uids)],
        }
        if any(left.values()):
            raise AssertionError(f"left of the one-node workload: {left}")
        return True

    wait_for("the Deployment, its ReplicaSets and pods deleted", gone, timeout=60)
    _groups(api, namespace, 1)  # and the groups run in their place
