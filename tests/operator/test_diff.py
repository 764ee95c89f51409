"""When a child needs applying: decided from the desired state (a hash), plus drift of the fields the
operator sets, with quantities compared as the API server stores them."""

from __future__ import annotations

import copy
from decimal import Decimal
from typing import Any

import pytest

from carpool.operator.diff import (
    HASH_ANNOTATION,
    canonical_quantity,
    changes,
    desired_hash,
    drift,
    foreign_items,
    stamp,
)
from carpool.operator.resources import build_children
from tests.operator.factories import batched_model


def deployment(spec: dict[str, Any] | None = None) -> dict[str, Any]:
    found = build_children(batched_model("m", spec)).find("Deployment")
    assert found is not None
    return found


def served(manifest: dict[str, Any]) -> dict[str, Any]:
    """What the API server hands back: the applied object plus defaults, status and other owners' fields."""
    live = copy.deepcopy(manifest)
    live["metadata"] |= {"resourceVersion": "7", "generation": 3, "managedFields": []}
    live["spec"]["replicas"] = 5  # the autoscaler's
    pod = live["spec"]["template"]["spec"]
    pod["dnsPolicy"] = "ClusterFirst"
    pod["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    live["status"] = {"replicas": 5, "readyReplicas": 4}
    return live


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("500m", Decimal("0.5")),
        ("0.5", Decimal("0.5")),
        (2, Decimal(2)),
        ("1Gi", Decimal(2**30)),
        ("1073741824", Decimal(2**30)),
        ("1e3", Decimal(1000)),
        ("1k", Decimal(1000)),
        ("16M", Decimal(16_000_000)),
    ],
)
def test_quantities_have_one_canonical_value(text: Any, value: Decimal) -> None:
    assert canonical_quantity(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1Gb", "25%", True, None, {"a": 1}])
def test_non_quantities_are_not_quantities(text: Any) -> None:
    assert canonical_quantity(text) is None


def test_the_servers_canonical_quantities_are_not_drift() -> None:
    desired = stamp(deployment({"resources": {"requests": {"cpu": "0.5", "memory": "1Gi"}}}))
    live = served(desired)
    container = live["spec"]["template"]["spec"]["containers"][0]
    container["resources"]["requests"] = {"cpu": "500m", "memory": "1073741824"}
    assert changes(desired, live) == []
    container["resources"]["requests"]["cpu"] = "600m"
    assert changes(desired, live) == [".spec.template.spec.containers[0].resources.requests.cpu"]


def test_quantity_equivalence_is_only_for_quantity_fields() -> None:
    # An annotation is a string: "0.5" and "500m" there are different values.
    assert drift({"metadata": {"annotations": {"a": "0.5"}}}, {"metadata": {"annotations": {"a": "500m"}}})


def test_an_unchanged_spec_against_a_served_object_needs_nothing() -> None:
    desired = stamp(deployment())
    assert changes(desired, served(desired)) == []


@pytest.mark.parametrize(
    "field",
    [
        {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        {"nodeSelector": {"pool": "a100"}},
        {"podAnnotations": {"team": "search"}},
        {"imagePullSecrets": ["registry"]},
        {"modelCacheSizeLimit": "20Gi"},
        {"resources": {"requests": {"cpu": "2"}, "limits": {"memory": "8Gi", "nvidia.com/gpu": 1}}},
    ],
)
def test_removing_a_field_changes_the_desired_hash(field: dict[str, Any]) -> None:
    # A subset comparison cannot see a removal: the smaller desired object is still contained in the
    # live one. The hash of the desired object can.
    base = {"resources": {"requests": {"cpu": "2"}, "limits": {"memory": "8Gi", "nvidia.com/gpu": 1}}}
    if "resources" in field:
        base = {"resources": {"requests": {"cpu": "2"}, "limits": {"nvidia.com/gpu": 1}}}
    before = stamp(deployment({**base, **field}))
    after = stamp(deployment(base))
    live = served(before)
    unstamped = copy.deepcopy(after)
    del unstamped["metadata"]["annotations"][HASH_ANNOTATION]
    assert drift(unstamped, live) == []  # the old subset comparison: nothing to apply
    assert changes(after, live) == ["desired state changed"]


def test_drift_of_an_operator_field_is_restored() -> None:
    desired = stamp(deployment())
    live = served(desired)
    live["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 1
    assert changes(desired, live) == [".spec.template.spec.terminationGracePeriodSeconds"]


def test_the_hash_ignores_key_order_and_its_own_annotation() -> None:
    desired = deployment()
    reordered = dict(reversed(list(desired.items())))
    assert desired_hash(desired) == desired_hash(reordered)
    stamped = stamp(copy.deepcopy(desired))
    assert stamped["metadata"]["annotations"][HASH_ANNOTATION] == desired_hash(desired)
    assert desired_hash(stamped) == desired_hash(desired)


def test_an_object_applied_by_an_older_operator_without_a_hash_is_applied_once() -> None:
    desired = stamp(deployment())
    live = served(desired)
    del live["metadata"]["annotations"][HASH_ANNOTATION]
    assert changes(desired, live) == ["desired state changed"]
    assert changes(desired, None) == ["absent"]


def test_int_or_string_values_compare_across_types() -> None:
    assert drift({"spec": {"port": 8000}}, {"spec": {"port": "8000"}}) == []
    assert drift({"spec": {"flag": True}}, {"spec": {"flag": "True"}}) == [".spec.flag"]
    assert drift({"spec": {"x": None}}, {"spec": {}}) == []
    assert drift({"spec": {"x": "None"}}, {"spec": {}}) == [".spec.x"]


def test_values_the_server_drops_are_not_drift() -> None:
    """An env var's `value: ""` comes back without `value` (omitempty), an HPA's averageValue 1000 as 1k."""
    desired = {
        "env": [{"name": "EMPTY", "value": ""}],
        "target": {"type": "AverageValue", "averageValue": "1000"},
    }
    live = {"env": [{"name": "EMPTY"}], "target": {"type": "AverageValue", "averageValue": "1k"}}
    assert drift(desired, live) == []
    assert drift({"env": [{"name": "E", "value": "x"}]}, {"env": [{"name": "E"}]}) == [".env[0].value"]
    assert drift({"target": {"averageValue": "1000"}}, {"target": {"averageValue": "2k"}}) == [
        ".target.averageValue"
    ]


def test_a_longer_live_list_is_drift() -> None:
    manifest = stamp(deployment({"env": [{"name": "A", "value": "1"}]}))
    live = served(manifest)
    live["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "INJECTED", "value": "1"})
    assert changes(manifest, live) == [".spec.template.spec.containers[0].env"]


def test_foreign_items_removes_what_others_added_to_keyed_lists_only() -> None:
    manifest = stamp(deployment({"env": [{"name": "A", "value": "1"}]}))
    live = served(manifest)
    pod = live["spec"]["template"]["spec"]
    pod["containers"][0]["env"].insert(0, {"name": "FIRST", "value": "x"})
    pod["containers"][0]["env"].append({"name": "LAST", "value": "y"})
    pod["containers"].append({"name": "sidecar", "image": "busybox"})
    pod["tolerations"] = [{"key": "k", "operator": "Exists"}]  # not the operator's field: kept
    live["metadata"]["ownerReferences"].append({"kind": "Other", "name": "o", "uid": "u2"})  # metadata: kept
    env = "/spec/template/spec/containers/0/env"
    last = len(pod["containers"][0]["env"]) - 1
    assert foreign_items(manifest, live) == [
        # Inner lists first, each from its end, so that every index stays valid as the patch goes.
        {"op": "test", "path": f"{env}/{last}/name", "value": "LAST"},
        {"op": "remove", "path": f"{env}/{last}"},
        {"op": "test", "path": f"{env}/0/name", "value": "FIRST"},
        {"op": "remove", "path": f"{env}/0"},
        {"op": "test", "path": "/spec/template/spec/containers/1/name", "value": "sidecar"},
        {"op": "remove", "path": "/spec/template/spec/containers/1"},
    ]
    assert foreign_items(manifest, served(manifest)) == []
