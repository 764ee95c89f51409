"""Server-side apply as the real API server does it, which kmock's dict merge cannot show: removals,
fields other managers own, entries others add to the operator's lists, and the scale subresource."""

from __future__ import annotations

from typing import Any

from tests.cluster.api import Api, run, wait_for
from tests.cluster.conftest import Operator
from tests.cluster.objects import batched_model, kubectl_apply, wait_for_children

CPU_LIMITS = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "2Gi"}}


def _pod_spec(api: Api, namespace: str, name: str) -> dict[str, Any]:
    deployment = api.get("Deployment", namespace, name)
    assert deployment is not None
    return dict(deployment["spec"]["template"]["spec"])


def test_a_toleration_removed_from_the_spec_is_removed_from_the_deployment(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    kubectl_apply(admin_env, batched_model("m", namespace, tolerations=[toleration]))
    wait_for(
        "the toleration on the pods",
        lambda: _pod_spec(api, namespace, "m").get("tolerations") == [toleration],
    )
    kubectl_apply(admin_env, batched_model("m", namespace))
    wait_for("the toleration gone", lambda: "tolerations" not in _pod_spec(api, namespace, "m"))


def test_fields_other_managers_own_stay_through_the_operators_applies(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    """A label added with kubectl, another controller's annotation and the autoscaler's replica count
    survive an apply the operator makes for a spec change."""
    kubectl_apply(admin_env, batched_model("m", namespace))
    wait_for_children(api, namespace, "m")
    run("kubectl", "label", "deployment", "m", "team=search", "-n", namespace, env=admin_env)
    run(
        "kubectl",
        "annotate",
        "service",
        "m",
        "example.com/load-balancer=internal",
        "-n",
        namespace,
        env=admin_env,
    )
    # What the HPA controller does: write the replica count through the scale subresource.
    run("kubectl", "scale", "deployment", "m", "--replicas=3", "-n", namespace, env=admin_env)
    before = api.get("Deployment", namespace, "m")
    assert before is not None
    kubectl_apply(
        admin_env, batched_model("m", namespace, batching={"maxBatchSize": 8}, service={"port": 9000})
    )

    def applied() -> dict[str, Any] | None:
        found = api.get("Deployment", namespace, "m")
        service = api.get("Service", namespace, "m")
        assert found is not None and service is not None
        rolled = found["metadata"]["generation"] > before["metadata"]["generation"]
        moved = service["spec"]["ports"][0]["port"] == 9000
        return {"deployment": found, "service": service} if rolled and moved else None

    after = wait_for("the operator to apply the new spec", applied)
    assert after["deployment"]["metadata"]["labels"]["team"] == "search"
    assert after["deployment"]["spec"]["replicas"] == 3
    assert after["service"]["metadata"]["annotations"]["example.com/load-balancer"] == "internal"


def test_entries_others_add_to_the_operators_lists_are_removed(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    """A longer live list is drift: an env var and a container added by someone else go away (server-side
    apply alone keeps them, they are not the operator's fields), and so does an extra toleration."""
    toleration = {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}
    kubectl_apply(
        admin_env, batched_model("m", namespace, tolerations=[toleration], env=[{"name": "A", "value": "1"}])
    )
    wait_for_children(api, namespace, "m")
    patch = {
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {"name": "runtime", "env": [{"name": "INJECTED", "value": "1"}]},
                        {"name": "sidecar", "image": "busybox"},
                    ],
                    "tolerations": [toleration, {"key": "other", "operator": "Exists"}],
                }
            }
        }
    }
    answer = api.patch(
        "Deployment", namespace, "m", patch, content_type="application/strategic-merge-patch+json"
    )
    assert answer.status_code == 200, answer.text

    def restored() -> dict[str, Any] | None:
        pod = _pod_spec(api, namespace, "m")
        names = [c["name"] for c in pod["containers"]]
        env = [e["name"] for e in pod["containers"][0].get("env") or []]
        if names == ["runtime"] and "INJECTED" not in env and pod.get("tolerations") == [toleration]:
            return pod
        raise AssertionError(f"containers {names}, env {env}, tolerations {pod.get('tolerations')}")

    pod = wait_for("the operator to restore its lists", restored)
    assert [e["name"] for e in pod["containers"][0]["env"]][-1] == "A"


def test_kubectl_scale_sets_the_replicas_with_autoscaling_off_and_is_refused_with_it_on(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    kubectl_apply(admin_env, batched_model("fixed", namespace, replicas=1, autoscaling={"enabled": False}))
    wait_for_children(api, namespace, "fixed", kinds=("Deployment",))
    run("kubectl", "scale", "bm", "fixed", "--replicas=3", "-n", namespace, env=admin_env)
    wait_for(
        "the Deployment at 3 replicas",
        lambda: (found := api.get("Deployment", namespace, "fixed")) and found["spec"]["replicas"] == 3,
    )
    kubectl_apply(admin_env, batched_model("scaled", namespace))
    wait_for_children(api, namespace, "scaled", kinds=("Deployment",))
    done = run(
        "kubectl", "scale", "bm", "scaled", "--replicas=3", "-n", namespace, env=admin_env, check=False
    )
    assert done.returncode != 0, "kubectl scale of an autoscaled BatchedModel was silently accepted"
    assert "replicas cannot change while autoscaling is on" in done.stderr, done.stderr
