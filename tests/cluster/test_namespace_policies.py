"""What a namespace's own policies do to a BatchedModel's pods, enforced by the real API server and
controllers: Pod Security admission (`restricted`, enforced), a ResourceQuota the model exceeds, a
LimitRange the model's container exceeds. Pods are refused when the ReplicaSet controller creates them
(its FailedCreate Event and the Deployment's ReplicaFailure condition), never when the operator applies
the Deployment, so the BatchedModel's conditions must carry that refusal."""

from __future__ import annotations

from typing import Any

from tests.cluster.api import Api, wait_for
from tests.cluster.conftest import Operator
from tests.cluster.objects import batched_model, kubectl_apply, wait_for_condition

FETCHING_MODEL = {"fetch": True}
"""A model the `fetch` init container downloads first: the init container is admitted too."""


def _label(api: Api, namespace: str, labels: dict[str, str]) -> None:
    answer = api.patch("Namespace", None, namespace, {"metadata": {"labels": labels}})
    assert answer.status_code == 200, answer.text


def _replica_set_events(api: Api, namespace: str) -> list[dict[str, Any]]:
    return [
        e
        for e in api.list("Event", namespace)
        if e.get("reason") == "FailedCreate" and (e.get("involvedObject") or {}).get("kind") == "ReplicaSet"
    ]


def test_the_rendered_pods_are_admitted_under_pod_security_restricted(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    _label(
        api,
        namespace,
        {
            "pod-security.kubernetes.io/enforce": "restricted",
            "pod-security.kubernetes.io/enforce-version": "latest",
        },
    )
    kubectl_apply(admin_env, batched_model("m", namespace, model=FETCHING_MODEL))
    # Admitted means created: the pods exist (they stay Pending; no node takes them here).
    pods = wait_for(
        "the runtime pod admitted",
        lambda: api.list("Pod", namespace, "app.kubernetes.io/instance=m") or None,
        timeout=60,
    )
    spec = pods[0]["spec"]
    assert [c["name"] for c in spec.get("initContainers") or []] == ["fetch"], spec
    assert not _replica_set_events(api, namespace), _replica_set_events(api, namespace)


def test_a_pod_pod_security_refuses_is_named_in_the_conditions(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    """A volume the user passes through (`hostPath`, a restricted volume type): the pods are refused,
    and the conditions quote Pod Security admission's own words."""
    _label(api, namespace, {"pod-security.kubernetes.io/enforce": "restricted"})
    host = {"name": "host-models", "hostPath": {"path": "/srv/models", "type": "Directory"}}
    kubectl_apply(admin_env, batched_model("m", namespace, model=FETCHING_MODEL, volumes=[host]))
    ready = wait_for_condition(api, namespace, "m", "Ready", reason="FailedCreate", timeout=60)
    assert 'violates PodSecurity "restricted' in ready["message"], ready
    assert "hostPath" in ready["message"], ready
    assert ready["status"] == "False"


def test_a_resource_quota_the_model_exceeds_is_named_in_the_conditions(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    api.create(
        {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": "small", "namespace": namespace},
            "spec": {"hard": {"requests.cpu": "500m", "limits.cpu": "500m"}},
        }
    )
    wait_for(
        "the quota's status",
        lambda: ((api.get("ResourceQuota", namespace, "small") or {}).get("status") or {}).get("hard"),
    )
    kubectl_apply(admin_env, batched_model("m", namespace, replicas=1, autoscaling={"enabled": False}))
    ready = wait_for_condition(api, namespace, "m", "Ready", reason="FailedCreate", timeout=60)
    assert ready["status"] == "False"
    assert "exceeded quota: small" in ready["message"], ready
    degraded = wait_for_condition(api, namespace, "m", "Degraded", reason="FailedCreate")
    assert "exceeded quota: small" in degraded["message"], degraded
    assert any("exceeded quota" in e.get("message", "") for e in _replica_set_events(api, namespace))


def test_a_limit_range_the_container_exceeds_is_named_in_the_conditions(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    api.create(
        {
            "apiVersion": "v1",
            "kind": "LimitRange",
            "metadata": {"name": "per-container", "namespace": namespace},
            "spec": {"limits": [{"type": "Container", "max": {"cpu": "500m"}}]},
        }
    )
    kubectl_apply(admin_env, batched_model("m", namespace, replicas=1, autoscaling={"enabled": False}))
    ready = wait_for_condition(api, namespace, "m", "Ready", reason="FailedCreate", timeout=60)
    assert "maximum cpu usage per Container is 500m" in ready["message"], ready
    assert ready["status"] == "False"
