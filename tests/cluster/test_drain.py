"""`kubectl drain` on a full GPU pool, through the eviction API and the PodDisruptionBudget the operator
renders (`maxUnavailable: 1`, `unhealthyPodEvictionPolicy: AlwaysAllow`): the disruption controller
keeps the budget's status, the API server's eviction subresource enforces it, kubectl retries a
refused eviction (429) until its timeout.

Two nodes with one GPU each, two replicas: no spare capacity, so an evicted pod's replacement stays
Pending until a node is uncordoned. What must hold: a drain never waits on a pod that serves nothing (a
not-ready pod is evicted even with the budget used up), and the budget still protects the last ready
replica (that drain waits, then goes on once the replacement is ready elsewhere).
"""

from __future__ import annotations

from tests.cluster.api import Api, condition, run, wait_for
from tests.cluster.conftest import Operator
from tests.cluster.firstmonth import Pool, gpu_model, pods_of, pool, ready_on
from tests.cluster.objects import kubectl_apply, wait_for_condition

__all__ = ["pool"]


def _drain(admin_env: dict[str, str], node: str, timeout_s: int, check: bool = True) -> str:
    done = run(
        "kubectl",
        "drain",
        node,
        "--ignore-daemonsets",
        "--delete-emptydir-data",
        f"--timeout={timeout_s}s",
        env=admin_env,
        check=check,
    )
    return done.stderr + done.stdout


def _budget(api: Api, namespace: str) -> dict[str, object]:
    found = api.get("PodDisruptionBudget", namespace, "m")
    assert found is not None
    return dict(found.get("status") or {})


def test_a_drain_on_a_full_gpu_pool_evicts_a_not_ready_pod_and_waits_for_the_last_ready_one(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str, pool: Pool
) -> None:
    pool.add(2)
    kubectl_apply(admin_env, gpu_model("m", namespace, pool, replicas=2))
    wait_for_condition(api, namespace, "m", "Ready", reason="ReplicasReady", timeout=90)
    budget = api.get("PodDisruptionBudget", namespace, "m")
    assert budget is not None and budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    placed = ready_on(api, namespace, "m")
    (sick, sick_node), (healthy, healthy_node) = sorted(placed.items())

    # Both replicas stop being ready (a bad driver on the pool): the budget is below its minimum, and
    # under the default IfHealthyBudget no pod could be evicted at all, so no node drained.
    pool.nodes[sick_node].set_ready(sick, False)
    pool.nodes[healthy_node].set_ready(healthy, False)
    wait_for(
        "the budget to be broken",
        lambda: (
            _budget(api, namespace).get("disruptionsAllowed") == 0
            and _budget(api, namespace).get("currentHealthy") == 0
        ),
        timeout=60,
    )
    # Draining a not-ready pod's node evicts it all the same: it serves nothing.
    _drain(admin_env, sick_node, timeout_s=60)
    pool.nodes[healthy_node].set_ready(healthy, True)
    wait_for("the other replica ready again", lambda: healthy in ready_on(api, namespace, "m"), timeout=60)
    wait_for(
        "the not-ready pod gone",
        lambda: sick not in {p["metadata"]["name"] for p in pods_of(api, namespace, "m")},
    )
    # Its replacement has nowhere to go; the status says why.
    unschedulable = wait_for_condition(api, namespace, "m", "Degraded", reason="Unschedulable", timeout=60)
    assert "nvidia.com/gpu" in unschedulable["message"] or "unschedulable" in unschedulable["message"], (
        unschedulable
    )

    # The healthy replica is the last one ready: its node's drain waits on the budget...
    refused = _drain(admin_env, healthy_node, timeout_s=8, check=False)
    assert "disruption budget" in refused, refused
    assert healthy in ready_on(api, namespace, "m"), "the budget let the last ready replica go"
    # ...until the other node is back and the replacement is ready there: then the drain goes on.
    run("kubectl", "uncordon", sick_node, env=admin_env)
    wait_for(
        "the replacement ready on the uncordoned node",
        lambda: sick_node in ready_on(api, namespace, "m").values(),
        timeout=90,
    )
    _drain(admin_env, healthy_node, timeout_s=60)
    wait_for(
        "the drained replica gone",
        lambda: healthy not in {p["metadata"]["name"] for p in pods_of(api, namespace, "m")},
    )
    model = api.get("BatchedModel", namespace, "m")
    ready = condition(model, "Ready")
    assert ready is not None and ready["status"] == "True", ready  # one replica served throughout
    assert not pool.errors(), pool.errors()
