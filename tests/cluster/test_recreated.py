"""A BatchedModel deleted and applied again at once (`kubectl delete --wait=false`, then `kubectl apply`:
what `helm upgrade`, Argo CD and a hurried user do), against the real garbage collector.

With background propagation the old model is gone at once and its children, still naming its uid, wait
for the garbage collector; the new model must take them over first (and re-create any the collector
deletes meanwhile). With foreground propagation the old model lingers, terminating, until the collector
has deleted its children; an apply meanwhile only edits the terminating object, so the user applies
again once it is gone. Either way every child ends owned by the new uid, with no ResourceConflict, well
inside the 30 s a conflict used to wait before its retry.

The collector is quick here (nothing else keeps it busy): with background propagation it often deletes the
old children before the new model's first reconcile, and the new model re-creates them on their DELETE
events. The third case stops kube-controller-manager (the collector with it) for the hand-over, so the
children certainly still name the old uid when the new model first reconciles: the take-over itself.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster.api import PLURALS, Api, condition, run, wait_for
from tests.cluster.conftest import Operator
from tests.cluster.controlplane import ControlPlane
from tests.cluster.objects import CHILD_KINDS, batched_model, child_name, kubectl_apply, warnings

GARBAGE_COLLECTOR = "system:serviceaccount:kube-system:generic-garbage-collector"


def _owners(api: Api, namespace: str, name: str) -> dict[str, Any]:
    found = {kind: api.get(kind, namespace, child_name(kind, name)) for kind in CHILD_KINDS}
    return {
        kind: [ref["uid"] for ref in (body or {}).get("metadata", {}).get("ownerReferences") or []]
        if body
        else None
        for kind, body in found.items()
    }


@pytest.mark.parametrize(
    ("propagation", "collector"),
    [("background", "running"), ("foreground", "running"), ("background", "stopped")],
)
def test_a_model_deleted_and_applied_again_at_once_owns_every_child(
    control_plane: ControlPlane,
    api: Api,
    admin_env: dict[str, str],
    operator: Operator,
    namespace: str,
    propagation: str,
    collector: str,
) -> None:
    model = batched_model("again", namespace)
    kubectl_apply(admin_env, model)
    old = wait_for("the BatchedModel", lambda: api.get("BatchedModel", namespace, "again"))["metadata"]["uid"]
    wait_for("the children", lambda: all(v == [old] for v in _owners(api, namespace, "again").values()))

    if collector == "stopped":
        control_plane.stop_component("kube-controller-manager")
    try:
        _delete_and_apply_again(control_plane, api, admin_env, namespace, model, old, propagation)
    finally:
        if collector == "stopped":
            control_plane.start_component("kube-controller-manager")
    new = (api.get("BatchedModel", namespace, "again") or {})["metadata"]["uid"]
    assert all(value == [new] for value in _owners(api, namespace, "again").values())
    collected = _collected(control_plane, namespace)
    children = {f"{PLURALS[kind][1]}/{child_name(kind, 'again')}" for kind in CHILD_KINDS}
    if collector == "stopped":
        # Taken over while they still named the old uid: the collector, back, finds nothing to delete.
        assert collected == [], collected
    elif propagation == "foreground":
        # The old model waited for the collector to delete every child; the new one re-created them.
        assert children <= set(collected), collected
    else:  # the collector may or may not win the race; it deletes nothing but the old children
        assert set(collected) - _dependents(collected) <= children, collected


def _dependents(collected: list[str]) -> set[str]:
    """What the collector deleted for the children's sake (the Deployment's ReplicaSets and pods)."""
    return {c for c in collected if c.split("/")[0] in ("replicasets", "pods", "endpointslices")}


def _collected(control_plane: ControlPlane, namespace: str) -> list[str]:
    """What the garbage collector deleted in the namespace, as `resource/name`."""
    collected = []
    for event in control_plane.audit_events():
        ref = dict(event.get("objectRef") or {})  # type: ignore[call-overload]
        user = dict(event.get("user") or {})  # type: ignore[call-overload]
        by_collector = event.get("verb") == "delete" and user.get("username") == GARBAGE_COLLECTOR
        if by_collector and ref.get("namespace") == namespace:
            collected.append(f"{ref.get('resource')}/{ref.get('name')}")
    return collected


def _delete_and_apply_again(
    control_plane: ControlPlane,
    api: Api,
    admin_env: dict[str, str],
    namespace: str,
    model: dict[str, Any],
    old: str,
    propagation: str,
) -> None:
    delete = ["delete", "bm", "again", "-n", namespace, f"--cascade={propagation}", "--wait=false"]
    run("kubectl", *delete, env=admin_env)
    kubectl_apply(admin_env, model)

    def renewed() -> str | None:
        found = api.get("BatchedModel", namespace, "again")
        if found is None:  # foreground: the terminating one is gone now; apply again, as a user would
            kubectl_apply(admin_env, model)
            return None
        uid = found["metadata"]["uid"]
        return str(uid) if uid != old else None

    new = wait_for("a new BatchedModel of the same name", renewed, timeout=60)

    def all_owned() -> dict[str, Any] | None:
        owners = _owners(api, namespace, "again")
        if any(value != [new] for value in owners.values()):
            raise AssertionError(f"owners: {owners} (new uid {new})")
        return owners

    # Within one reconcile: far less than the 30 s a ResourceConflict waited before its retry.
    wait_for("every child owned by the new model", all_owned, timeout=20)
    body = api.get("BatchedModel", namespace, "again")
    for kind in ("Ready", "Degraded"):
        found = condition(body, kind) or {}
        assert found.get("reason") != "ResourceConflict", found
    assert not [e for e in warnings(api, namespace, "again") if e["reason"] == "ResourceConflict"]
    # Whatever the collector deleted during the hand-over is back, owned by the new model.
    assert all_owned() is not None
