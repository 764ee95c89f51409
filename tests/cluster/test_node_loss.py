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


def _rolled_out(api: Api, namespace: str, name: str) -> dict[str, object]:
    status = _status(api, namespace, name)
    done = condition({"status": status}, "Progressing")
    if not (status.get("updatedReplicas") == 2 and status.get("readyReplicas") == 2):
        raise AssertionError(f"status {status}")
    if done is None or done["reason"] != "RolloutComplete":
        raise AssertionError(f"Progressing {done}")
    return status


def test_a_lost_node_s_pods_are_replaced_and_the_status_names_the_node(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str, pool: Pool
) -> None:
    """Two models, each on a pool of three one-GPU nodes, each losing the node of one replica at the same
    moment (one wait for the grace period serves both):

    - `evicted` tolerates the unreachable taint for 15 s: the taint-eviction controller deletes its pod,
      the replacement runs on the spare node;
    - `rolled` keeps the default 300 s toleration and gets a spec change meanwhile: maxSurge 0,
      maxUnavailable 1 (the GPU default) does not wait for the eviction. The Deployment controller scales
      the old ReplicaSet down by its unavailable pods first (`cleanupUnhealthyReplicas`), the ReplicaSet
      deletes the not-ready pod of the lost node first, and a ReplicaSet does not count a terminating
      pod, so the new pod takes the spare GPU."""
    second = Pool(pool.control_plane)
    try:
        pool.add(3)
        second.add(3)
        kubectl_apply(
            admin_env, gpu_model("evicted", namespace, pool, replicas=2, tolerations=SHORT_TOLERATIONS)
        )
        kubectl_apply(admin_env, gpu_model("rolled", namespace, second, replicas=2))
        lost: dict[str, tuple[str, str]] = {}
        for name in ("evicted", "rolled"):
            wait_for_condition(api, namespace, name, "Ready", reason="ReplicasReady", timeout=90)
            placed = ready_on(api, namespace, name)
            assert len(set(placed.values())) == 2, placed  # one GPU per node
            lost[name] = sorted(placed.items())[0]
        deployment = api.get("Deployment", namespace, "rolled")
        assert deployment is not None
        assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
        pool.nodes[lost["evicted"][1]].lose()
        second.nodes[lost["rolled"][1]].lose()

        # The node controller marks the pods not ready: one replica fewer, and Degraded names the node.
        for name, (victim, node) in lost.items():
            degraded = wait_for_condition(api, namespace, name, "Degraded", reason="NodeNotReady", timeout=90)
            assert node in degraded["message"] and victim in degraded["message"], degraded
        ready = condition(api.get("BatchedModel", namespace, "evicted"), "Ready")
        assert ready is not None and ready["reason"] in ("PartiallyReady", "ReplicasReady"), ready

        changed = gpu_model("rolled", namespace, second, replicas=2, env=[{"name": "ROLLOUT", "value": "2"}])
        kubectl_apply(admin_env, changed)

        # `evicted`: evicted once the toleration ran out, replaced on the spare node.
        victim, node = lost["evicted"]

        def replaced() -> dict[str, str] | None:
            now_ready = ready_on(api, namespace, "evicted")
            return now_ready if len(now_ready) == 2 and node not in now_ready.values() else None

        assert victim not in wait_for("a replacement ready on another node", replaced, timeout=120)
        stuck = wait_for_condition(
            api, namespace, "evicted", "Degraded", reason="StuckTerminating", timeout=60
        )
        assert node in stuck["message"] and victim in stuck["message"], stuck
        assert "DeletionByTaintManager" in stuck["message"], stuck
        assert _status(api, namespace, "evicted")["readyReplicas"] == 2
        ready = condition(api.get("BatchedModel", namespace, "evicted"), "Ready")
        assert ready is not None and ready["reason"] == "ReplicasReady", ready
        gone = next(p for p in pods_of(api, namespace, "evicted") if p["metadata"]["name"] == victim)
        assert gone["metadata"].get("deletionTimestamp"), gone["metadata"]

        # `rolled`: the rollout finished without the lost node, long before its pod's eviction.
        victim, node = lost["rolled"]
        wait_for(
            "the rollout to complete without the lost node", lambda: _rolled_out(api, namespace, "rolled")
        )
        now_ready = ready_on(api, namespace, "rolled")
        assert node not in now_ready.values() and victim not in now_ready, now_ready
        stuck = wait_for_condition(
            api, namespace, "rolled", "Degraded", reason="StuckTerminating", timeout=60
        )
        assert node in stuck["message"], stuck
        assert not pool.errors() and not second.errors(), pool.errors() + second.errors()
    finally:
        second.close()
