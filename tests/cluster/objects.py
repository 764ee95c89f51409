"""BatchedModels for the cluster tests, and the reads that explain what the operator made of them."""

from __future__ import annotations

from typing import Any

import yaml

from tests.cluster.api import Api, condition, run, wait_for

CHILD_KINDS = (
    "ConfigMap",
    "Deployment",
    "Service",
    "HorizontalPodAutoscaler",
    "PodDisruptionBudget",
    "NetworkPolicy",
)
"""What a default BatchedModel (HPA engine, budget and policy on) owns, all named after it but the
ConfigMap (`<name>-runtime`)."""


def batched_model(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    """A CPU-only BatchedModel. Its pods are created and stay unschedulable (only the autoscaling
    test's pods tolerate the taint of the kubelet stand-in's Node), which is all the operator's tests
    need."""
    base: dict[str, Any] = {
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "2Gi"}},
    }
    return {
        "apiVersion": "carpool.dev/v1alpha1",
        "kind": "BatchedModel",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {**base, **spec},
    }


def kubectl_apply(env: dict[str, str], manifest: dict[str, Any], *args: str, check: bool = True) -> Any:
    return run("kubectl", "apply", "-f", "-", *args, env=env, stdin=yaml.safe_dump(manifest), check=check)


def child_name(kind: str, name: str) -> str:
    return f"{name}-runtime" if kind == "ConfigMap" else name


def wait_for_children(
    api: Api, namespace: str, name: str, kinds: tuple[str, ...] = CHILD_KINDS
) -> dict[str, Any]:
    def all_there() -> dict[str, Any] | None:
        found = {kind: api.get(kind, namespace, child_name(kind, name)) for kind in kinds}
        missing = [kind for kind, body in found.items() if body is None]
        if missing:
            raise AssertionError(f"missing {missing}")
        return found

    return wait_for(f"the children of {namespace}/{name}", all_there)


def wait_for_condition(
    api: Api,
    namespace: str,
    name: str,
    kind: str,
    *,
    reason: str | None = None,
    status: str | None = None,
    timeout: float = 60.0,
) -> dict[str, Any]:
    def matches() -> dict[str, Any] | None:
        found = condition(api.get("BatchedModel", namespace, name), kind)
        if found is None or (reason and found["reason"] != reason) or (status and found["status"] != status):
            raise AssertionError(f"{kind} is {found}")
        return found

    return wait_for(f"{namespace}/{name} condition {kind} reason={reason} status={status}", matches, timeout)


def warnings(api: Api, namespace: str, name: str) -> list[dict[str, Any]]:
    """Warning Events about the BatchedModel."""
    return [
        event
        for event in api.list("Event", namespace)
        if event.get("type") == "Warning" and (event.get("involvedObject") or {}).get("name") == name
    ]
