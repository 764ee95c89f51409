"""What admission does to the operator's own apply is not drift (`diff`): a sidecar a mesh injects and an
image pinned to its digest are left alone; an entry another manager added is still drift and pruned; a
value admission rewrites on every apply is left out of the plan for that desired state (and reported by
the reconciler). tests/cluster/test_admission.py runs a real mutating webhook."""

from __future__ import annotations

import copy
from typing import Any

from carpool.operator import FIELD_MANAGER
from carpool.operator.diff import changes, drift, foreign_items, managed_by_others, same_image, stamp

DIGEST = "sha256:" + "ab" * 32


def desired() -> dict[str, Any]:
    return stamp(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "m", "namespace": "ml"},
            "spec": {
                "template": {
                    "spec": {
                        "terminationGracePeriodSeconds": 90,
                        "containers": [{"name": "runtime", "image": "ghcr.io/carpool/runtime:1.0"}],
                    }
                }
            },
        }
    )


def managed(manager: str, *containers: str) -> dict[str, Any]:
    keys: dict[str, Any] = {'k:{"name":"%s"}' % name: {".": {}, "f:image": {}} for name in containers}  # noqa: UP031
    return {
        "manager": manager,
        "operation": "Apply" if manager == FIELD_MANAGER else "Update",
        "fieldsV1": {"f:spec": {"f:template": {"f:spec": {"f:containers": keys}}}},
    }


def admitted(sidecar_owner: str = FIELD_MANAGER) -> dict[str, Any]:
    """The Deployment as the API server answers the operator's apply through a mesh's and a policy
    engine's webhooks: the image pinned, a sidecar injected (owned by whoever `sidecar_owner` says)."""
    live = copy.deepcopy(desired())
    containers = live["spec"]["template"]["spec"]["containers"]
    containers[0]["image"] = f"ghcr.io/carpool/runtime:1.0@{DIGEST}"
    containers.append({"name": "mesh-proxy", "image": "mesh/proxy:2"})
    fields = [managed(FIELD_MANAGER, "runtime")]  # admission's sidecar: owned by no manager
    if sidecar_owner != FIELD_MANAGER:
        fields.append(managed(sidecar_owner, "mesh-proxy"))
    live["metadata"]["managedFields"] = fields
    return live


def test_a_pinned_image_is_the_same_image() -> None:
    assert same_image("repo/x:1.0", f"repo/x:1.0@{DIGEST}")
    assert same_image("repo/x:1.0", f"repo/x@{DIGEST}")
    assert same_image("registry:5000/x:1.0", f"registry:5000/x:1.0@{DIGEST}")
    assert not same_image("repo/x:1.0", f"repo/y:1.0@{DIGEST}")
    assert not same_image("repo/x:1.0", "repo/x:2.0")


def test_what_admission_did_to_the_operators_apply_is_no_change() -> None:
    assert changes(desired(), admitted(), FIELD_MANAGER) == []
    live = admitted()
    assert foreign_items(desired(), live, others=managed_by_others(live, FIELD_MANAGER)) == []


def test_a_container_another_manager_added_is_drift_and_pruned() -> None:
    live = admitted(sidecar_owner="kubectl-edit")
    assert changes(desired(), live, FIELD_MANAGER) == [".spec.template.spec.containers"]
    ops = foreign_items(desired(), live, others=managed_by_others(live, FIELD_MANAGER))
    assert ops == [
        {"op": "test", "path": "/spec/template/spec/containers/1/name", "value": "mesh-proxy"},
        {"op": "remove", "path": "/spec/template/spec/containers/1"},
    ]


def test_a_value_admission_rewrites_is_left_out_only_where_told() -> None:
    live = admitted()
    live["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 5
    path = ".spec.template.spec.terminationGracePeriodSeconds"
    assert drift(desired(), live, others=managed_by_others(live, FIELD_MANAGER)) == [path]
    assert changes(desired(), live, FIELD_MANAGER) == [path]
    assert changes(desired(), live, FIELD_MANAGER, frozenset({path})) == []
