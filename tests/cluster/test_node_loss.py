"""A node that dies under a BatchedModel: the real node-lifecycle and taint-eviction controllers act on a
hollow node (tests/cluster/hollownode.py) whose heartbeat stops, and the model's status follows.

The Node's Lease and status stop being renewed -> after `--node-monitor-grace-period` (20 s here) the
node-lifecycle controller sets its Ready condition Unknown, taints it `node.kubernetes.io/unreachable`
(NoSchedule and NoExecute) and marks its pods not ready -> once a pod's toleration of that taint runs
out, the taint-eviction controller deletes it -> the ReplicaSet creates a replacement at once (it does
not count a terminating pod), which the scheduler puts on a node with a free GPU; the deleted pod stays
Terminating, since no kubelet confirms its end.
"""

from __future__ import annotations

from tests.cluster.api import Api, condition, wait_for
from tests.cluster.conftest import Operator
from tests.cluster.firstmonth import Pool, gpu_model, pods_of, pool, ready_on
from tests.cluster.objects import kubectl_apply, wait_for_condition

__all__ = ["pool"]

UNREACHABLE_FOR_S = 15
"""The model's toleration of the unreachable taint (the API server's default is 300 s)."""
SHORT_TOLERATIONS = [
    {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": UNREACHABLE_FOR_S}
    for key in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
]


def _status(api: Api, namespace: str, name: str) -> dict[str, object]:
    body = api.get("BatchedModel", namespace, name)
    return dict((body or {}).get("status") or {})


def test_a_lost_node_s_pods_are_evicted_and_replaced_and_the_status_names_the_node(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str, pool: Pool
) -> None:
    pool.add(3)
    kubectl_apply(admin_env, gpu_model("m", namespace, pool, replicas=2, tolerations=SHORT_TOLERATIONS))
    wait_for_condition(api, namespace, "m", "Ready", reason="ReplicasReady", timeout=90)
    placed = ready_on(api, namespace, "m")
    assert len(set(placed.values())) == 2, placed  # one GPU per node
    victim, lost = sorted(placed.items())[0]
    pool.nodes[lost].lose()

    # The node controller marks the pod not ready: one replica fewer, and Degraded names the node.
    degraded = wait_for_condition(api, namespace, "m", "Degraded", reason="NodeNotReady", timeout=90)
    assert lost in degraded["message"] and victim in degraded["message"], degraded
    ready = condition(api.get("BatchedModel", namespace, "m"), "Ready")
    assert ready is not None and ready["reason"] in ("PartiallyReady", "ReplicasReady"), ready

    # Evicted once the toleration ran out, replaced on the spare node; the evicted pod is stuck.
    def replaced() -> dict[str, str] | None:
        now_ready = ready_on(api, namespace, "m")
        return now_ready if len(now_ready) == 2 and lost not in now_ready.values() else None

    after = wait_for("a replacement ready on another node", replaced, timeout=120)
    assert victim not in after
    stuck = wait_for_condition(api, namespace, "m", "Degraded", reason="StuckTerminating", timeout=60)
    assert lost in stuck["message"] and victim in stuck["message"], stuck
    assert "DeletionByTaintManager" in stuck["message"], stuck
    status = _status(api, namespace, "m")
    assert status["readyReplicas"] == 2, status
    assert (condition(api.get("BatchedModel", namespace, "m"), "Ready") or {}).get(
        "reason"
    ) == "ReplicasReady"
    gone = next(p for p in pods_of(api, namespace, "m") if p["metadata"]["name"] == victim)
    assert gone["metadata"].get("deletionTimestamp"), gone["metadata"]
    assert not pool.errors(), pool.errors()


def test_a_gpu_rollout_with_max_surge_0_finishes_while_a_node_is_lost(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str, pool: Pool
) -> None:
    """maxSurge 0, maxUnavailable 1 (the GPU default), the default 300 s toleration: the rollout does not
    wait for the eviction. The Deployment controller scales the old ReplicaSet down by its unavailable
    pods first (`cleanupUnhealthyReplicas`), the ReplicaSet deletes the not-ready pod of the lost node
    first, and a ReplicaSet does not count a terminating pod, so the new pod takes the spare GPU."""
    pool.add(3)
    kubectl_apply(admin_env, gpu_model("m", namespace, pool, replicas=2))
    wait_for_condition(api, namespace, "m", "Ready", reason="ReplicasReady", timeout=90)
    deployment = api.get("Deployment", namespace, "m")
    assert deployment is not None
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    placed = ready_on(api, namespace, "m")
    victim, lost = sorted(placed.items())[0]
    pool.nodes[lost].lose()
    wait_for_condition(api, namespace, "m", "Degraded", reason="NodeNotReady", timeout=90)

    changed = gpu_model("m", namespace, pool, replicas=2, env=[{"name": "ROLLOUT", "value": "2"}])
    kubectl_apply(admin_env, changed)

    def rolled_out() -> dict[str, object] | None:
        status = _status(api, namespace, "m")
        done = condition({"status": status}, "Progressing")
        if not (status.get("updatedReplicas") == 2 and status.get("readyReplicas") == 2):
            raise AssertionError(f"status {status}")
        if done is None or done["reason"] != "RolloutComplete":
            raise AssertionError(f"Progressing {done}")
        return status

    wait_for("the rollout to complete without the lost node", rolled_out, timeout=120)
    now_ready = ready_on(api, namespace, "m")
    assert lost not in now_ready.values() and victim not in now_ready, now_ready
    stuck = wait_for_condition(api, namespace, "m", "Degraded", reason="StuckTerminating", timeout=60)
    assert lost in stuck["message"], stuck
    assert not pool.errors(), pool.errors()
