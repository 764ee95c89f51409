"""Defects a real API server shows at once and kmock never did: each test failed before its fix.

(The seventh, `lastState` read after a container recovered, is about what a kubelet writes; these tests'
pods stay pending, since only the autoscaling test's pods tolerate the kubelet stand-in's Node, so its test
is the pure one in tests/operator/test_pods.py.)
"""

from __future__ import annotations

import time
from typing import Any

from carpool.operator.reconcile import RETRY_DELAY_SECONDS
from tests.cluster.api import Api, condition, wait_for
from tests.cluster.conftest import Operator, operator_metric
from tests.cluster.controlplane import ControlPlane
from tests.cluster.objects import (
    CHILD_KINDS,
    batched_model,
    kubectl_apply,
    wait_for_children,
    wait_for_condition,
    warnings,
)


def test_a_name_that_cannot_name_a_service_is_refused_before_any_child(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    """`llama-3.1-8b` is a valid custom resource name but not a Service name (DNS-1035 label)."""
    done = kubectl_apply(admin_env, batched_model("llama-3.1-8b", namespace), check=False)
    assert done.returncode != 0, "the API server accepted a BatchedModel its Service cannot be named after"
    assert "metadata.name must be a DNS-1035 label" in done.stderr, done.stderr
    long = "m" * 64
    done = kubectl_apply(admin_env, batched_model(long, namespace), check=False)
    assert done.returncode != 0 and "at most 63 characters" in done.stderr, done.stderr
    # The boundary: 63 characters and a DNS-1035 label is a name the Service takes.
    longest = "m" * 63
    kubectl_apply(admin_env, batched_model(longest, namespace))
    wait_for_children(api, namespace, longest, kinds=("Service",))


def test_children_are_written_with_the_charts_rbac_under_owner_references_permission_enforcement(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    """Children carry blockOwnerDeletion; the admission plugin allows that only to who may update the
    BatchedModel's finalizers, which the chart's RBAC must grant (it did not: every write was 403)."""
    kubectl_apply(admin_env, batched_model("embedder", namespace))
    owner = wait_for("the BatchedModel", lambda: api.get("BatchedModel", namespace, "embedder"))
    children = wait_for_children(api, namespace, "embedder")
    for kind, child in children.items():
        refs = child["metadata"]["ownerReferences"]
        assert refs == [
            {
                "apiVersion": "carpool.dev/v1alpha1",
                "kind": "BatchedModel",
                "name": "embedder",
                "uid": owner["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ], kind
    wait_for_condition(api, namespace, "embedder", "Ready")


def test_env_named_like_the_operators_or_twice_is_refused_naming_it(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    """Sent twice, server-side apply answered 500 "duplicate entries for key" and the operator retried
    forever; now the API server refuses the BatchedModel and says which variable."""
    clash = batched_model("embedder", namespace, env=[{"name": "HF_HOME", "value": "/models"}])
    done = kubectl_apply(admin_env, clash, check=False)
    assert done.returncode != 0 and "env may not set" in done.stderr and "HF_HOME" in done.stderr, done.stderr
    twice = batched_model(
        "embedder", namespace, env=[{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]
    )
    done = kubectl_apply(admin_env, twice, check=False)
    # 1.29 prints the key as a Go map (`map[string]interface {}{"name":"A"}`), later releases as JSON.
    assert done.returncode != 0 and "spec.env[1]: Duplicate value" in done.stderr, done.stderr
    assert '{"name":"A"}' in done.stderr, done.stderr
    assert api.get("BatchedModel", namespace, "embedder") is None


def test_a_pass_through_field_the_server_refuses_becomes_a_condition_and_an_event(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    """A misspelt toleration field: server-side apply answers 500 ("field not declared in schema"), which
    the operator retried forever without a word; it is a spec problem, and the status names the field."""
    spec = {"tolerations": [{"kye": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}
    kubectl_apply(admin_env, batched_model("typo", namespace, **spec))
    found = wait_for_condition(api, namespace, "typo", "Ready", reason="RejectedByApiServer")
    assert ".spec.template.spec.tolerations[0].kye: field not declared in schema" in found["message"], found
    wait_for(
        "a Warning Event naming the field",
        lambda: any("kye" in e["message"] for e in warnings(api, namespace, "typo")),
    )


def test_a_500_from_the_server_becomes_a_condition_and_an_event(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    """Two volumes of one name: server-side apply answers 500 ("duplicate entries for key"), which the
    operator used to retry forever without a word. Now the status and an Event carry the server's message."""
    volume = {"name": "scratch", "emptyDir": {}}
    kubectl_apply(admin_env, batched_model("dup", namespace, volumes=[volume, volume]))
    found = wait_for_condition(api, namespace, "dup", "Degraded", reason="RejectedByApiServer", status="True")
    assert "duplicate entries for key" in found["message"] and "Deployment" in found["message"], found
    wait_for(
        "a Warning Event with the server's message",
        lambda: any("duplicate entries" in e["message"] for e in warnings(api, namespace, "dup")),
    )


def test_the_hand_over_to_an_hpa_never_leaves_the_deployment_at_zero(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    """The HPA controller never scales a Deployment at 0 replicas ("ScalingDisabled")."""
    kubectl_apply(admin_env, batched_model("idle", namespace, replicas=0, autoscaling={"enabled": False}))
    wait_for(
        "the Deployment at 0 replicas",
        lambda: (found := api.get("Deployment", namespace, "idle")) and found["spec"]["replicas"] == 0,
    )
    kubectl_apply(
        admin_env,
        batched_model("idle", namespace, replicas=0, autoscaling={"enabled": True, "minReplicas": 2}),
    )
    deployment = wait_for(
        "the Deployment handed to the HPA at its minimum",
        lambda: (
            (found := api.get("Deployment", namespace, "idle")) and found["spec"]["replicas"] == 2 and found
        ),
    )
    assert deployment["spec"]["replicas"] == 2

    def hpa_active_condition() -> dict[str, Any] | None:
        return condition(api.get("HorizontalPodAutoscaler", namespace, "idle"), "ScalingActive")

    active = wait_for("the HPA controller's ScalingActive condition", hpa_active_condition)
    assert active["reason"] != "ScalingDisabled", active


def _operator_writes(control_plane: ControlPlane, operator: Operator, namespace: str) -> list[str]:
    """The operator's writes in the namespace the API server audited, Events included (a Warning posted on
    every reconcile is a write loop too)."""
    found = []
    for event in control_plane.audit_events():
        ref: dict[str, Any] = event.get("objectRef") or {}  # type: ignore[assignment]
        user: dict[str, Any] = event.get("user") or {}  # type: ignore[assignment]
        ours = user.get("username") == operator.user and ref.get("namespace") == namespace
        if ours:
            found.append(
                f"{event['verb']} {ref.get('resource')}/{ref.get('name')} {ref.get('subresource', '')}"
            )
    return found


def test_after_a_reconcile_settles_a_resync_writes_nothing(
    control_plane: ControlPlane, api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    """The server drops an env var's `value: ""` and writes an HPA averageValue of 1000 back as `1k`:
    both read as drift, and every event caused another apply, forever."""
    spec = {"env": [{"name": "EMPTY", "value": ""}], "autoscaling": {"targetQueueDepth": 1000}}
    kubectl_apply(admin_env, batched_model("steady", namespace, **spec))
    wait_for_children(api, namespace, "steady")
    hpa = api.get("HorizontalPodAutoscaler", namespace, "steady")
    assert hpa is not None and hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "1k"

    # Settled: no operator write for one HPA sync period and a second (the HPA controller's first
    # statuses, one per sync, each reconcile the owner; pods being scheduled).
    window = float(control_plane.hpa_sync_period.removesuffix("s")) + 1
    # A resync: an event on a child (someone annotates the Service), which reconciles the owner.
    writes = writes_after_a_resync(control_plane, api, operator, namespace, ("Service", "steady"), window)
    assert writes == [], f"a settled BatchedModel was written again: {writes}"


def writes_after_a_resync(
    control_plane: ControlPlane,
    api: Api,
    operator: Operator,
    namespace: str,
    child: tuple[str, str],
    window: float,
    watch_for: float = 2 * RETRY_DELAY_SECONDS,
) -> list[str]:
    """Once the operator has written nothing for `window` seconds, annotate `child` (kind, name): the
    operator reconciles the owner on that event; what it writes then (nothing, unless it reads drift
    where there is none), within `watch_for` seconds (two retry periods; where a webhook may refuse or
    rewrite a child, two of the operator's longest, `LONGEST_RETRY_SECONDS`)."""

    def quiet() -> int | None:
        before = len(_operator_writes(control_plane, operator, namespace))
        time.sleep(window)
        after = len(_operator_writes(control_plane, operator, namespace))
        return after if after == before else None

    settled = wait_for("the operator to settle", quiet, timeout=90)
    reconciles = operator_metric(operator, "carpool_operator_reconciles_total", {"trigger": "child"})
    kind, name = child
    api.patch(kind, namespace, name, {"metadata": {"annotations": {"example.com/touched": "1"}}})
    wait_for(
        "the operator to reconcile after the child event",
        lambda: (
            operator_metric(operator, "carpool_operator_reconciles_total", {"trigger": "child"}) > reconciles
        ),
    )
    # A write loop shows within a reconcile when events drive it, and within a retry period when
    # kopf's or the requeue's retries do: watch the audit log for two retry periods.
    deadline = time.monotonic() + watch_for
    while True:
        writes = _operator_writes(control_plane, operator, namespace)[settled:]
        if writes or time.monotonic() > deadline:
            return writes
        time.sleep(0.5)  # a poll interval of the audit log; the window is the deadline


def test_every_child_kind_is_named_for_the_model(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    """The names the README promises (`kubectl port-forward svc/<name>`), read from what the model owns
    (every object of each kind in the namespace whose owner reference names its uid), not looked up by
    the names under test."""
    kubectl_apply(admin_env, batched_model("named", namespace))
    wait_for_children(api, namespace, "named")
    uid = (api.get("BatchedModel", namespace, "named") or {})["metadata"]["uid"]
    owned = {
        kind: sorted(
            o["metadata"]["name"]
            for o in api.list(kind, namespace)
            if any(ref.get("uid") == uid for ref in o["metadata"].get("ownerReferences") or [])
        )
        for kind in CHILD_KINDS
    }
    assert owned == {
        "ConfigMap": ["named-runtime"],
        "Deployment": ["named"],
        "Service": ["named"],
        "HorizontalPodAutoscaler": ["named"],
        "PodDisruptionBudget": ["named"],
        "NetworkPolicy": ["named"],
    }


def test_a_403_from_the_server_becomes_a_condition_and_an_event_and_the_rest_is_applied(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    """A ResourceQuota that allows no Service: the API server answers the apply with 403 "exceeded
    quota". The operator used to retry that forever without a word."""
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-services", "namespace": namespace},
        "spec": {"hard": {"count/services": "0"}},
    }
    kubectl_apply(admin_env, quota)
    wait_for(
        "the quota controller to count the namespace",
        lambda: (
            "count/services"
            in ((api.get("ResourceQuota", namespace, "no-services") or {}).get("status") or {}).get(
                "used", {}
            )
        ),
    )
    kubectl_apply(admin_env, batched_model("quota", namespace))
    found = wait_for_condition(api, namespace, "quota", "Degraded", reason="Forbidden", status="True")
    assert "403" in found["message"] and "Service quota" in found["message"], found
    assert "exceeded quota: no-services" in found["message"], found
    wait_for(
        "a Warning Event with the server's message",
        lambda: any("exceeded quota" in e["message"] for e in warnings(api, namespace, "quota")),
    )
    assert api.get("Deployment", namespace, "quota") is not None, "the other children were not applied"
