"""The chart's RBAC grants exactly what the operator uses, in every mode, and what the operator uses is
derived from its code: the kinds `kube.py` addresses and the methods it calls them with, the children
kopf watches (`handlers/children.py`), and the handlers on BatchedModel. A failure lists the
difference both ways.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from carpool.operator import API_VERSION, GROUP, KIND, PLURAL, kube, rbac
from carpool.operator.handlers import children
from tests.chart.conftest import Render, find

Grant = tuple[str, str, str, str]
"""(namespace, or "*" for a ClusterRole; API group; resource; verb)."""


def _grants(rules: tuple[rbac.Rule, ...] | list[dict[str, Any]], where: str) -> set[Grant]:
    out: set[Grant] = set()
    for rule in rules:
        policy = rule.as_policy_rule() if isinstance(rule, rbac.Rule) else rule
        assert set(policy) == {"apiGroups", "resources", "verbs"}, f"unexpected rule fields in {policy}"
        for group in policy["apiGroups"]:
            for resource in policy["resources"]:
                out |= {(where, group, resource, verb) for verb in policy["verbs"]}
    return out


def _rendered(objects: list[dict[str, Any]], service_account: str) -> set[Grant]:
    """Grants bound to the operator's ServiceAccount by the rendered roles and bindings."""
    roles = {("*", o["metadata"]["name"]): o for o in find(objects, "ClusterRole")}
    roles |= {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in find(objects, "Role")}
    out: set[Grant] = set()
    for binding in find(objects, "ClusterRoleBinding") + find(objects, "RoleBinding"):
        assert [s["name"] for s in binding["subjects"]] == [service_account]
        where = binding["metadata"].get("namespace", "*")
        ref = binding["roleRef"]
        role = roles[("*" if ref["kind"] == "ClusterRole" else where, ref["name"])]
        assert not any("resourceNames" in rule or "nonResourceURLs" in rule for rule in role["rules"])
        out |= _grants(role["rules"], where)
    return out


RELEASE_NAMESPACE = "carpool-system"
"""Where the chart tests render the release (tests/chart/conftest.py)."""


def _expected(namespaces: list[str], peered: bool) -> set[Grant]:
    out = _grants(rbac.LEADER_ELECTION, RELEASE_NAMESPACE) if peered else set()
    if not namespaces:
        return out | _grants(rbac.NAMESPACED + rbac.CRD_SCANNING, "*")
    out |= _grants(rbac.CRD_SCANNING + rbac.NAMESPACE_SCANNING, "*")
    for namespace in namespaces:
        out |= _grants(rbac.NAMESPACED, namespace)
    return out


MODES = [
    pytest.param([], 1, id="cluster-wide"),
    pytest.param([], 2, id="cluster-wide-peered"),
    pytest.param(["ml-serving"], 1, id="one-namespace"),
    pytest.param(["ml-serving", "team-a", "team-a"], 3, id="namespaces-peered"),
]


@pytest.mark.parametrize(("namespaces", "replicas"), MODES)
def test_rendered_rbac_is_exactly_what_the_operator_declares(
    render: Render, namespaces: list[str], replicas: int
) -> None:
    objects = render(values={"watchNamespaces": namespaces, "operator": {"replicas": replicas}})
    service_account = find(objects, "ServiceAccount")[0]["metadata"]["name"]
    granted = _rendered(objects, service_account)
    needed = _expected(sorted(set(namespaces)), peered=replicas > 1)
    assert sorted(granted - needed) == [], "granted but never used"
    assert sorted(needed - granted) == [], "used but not granted"


def test_rbac_create_false_renders_no_roles(render: Render) -> None:
    objects = render(values={"rbac": {"create": False}, "watchNamespaces": ["a"]})
    assert not {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"} & {o["kind"] for o in objects}


# --- what the code uses ------------------------------------------------------------------------------

_KUBE_METHOD_VERBS: dict[str, tuple[str, ...]] = {
    "get": ("get",),
    "list": ("list",),
    # Server-side apply is a PATCH, and creates the object when it is absent.
    "apply": ("patch", "create"),
    "delete": ("delete",),
    "create": ("create",),
    "replace": ("update",),
}
"""Kube's public methods on an object and the RBAC verbs of the HTTP call each makes."""

_FRAMEWORK: set[Grant] = {
    # kopf itself, whatever the handlers: Events it posts about handling, CRD and namespace observation
    # (kopf/_core/reactor/observation.py), and peering (kopf/_core/engines/peering.py).
    ("ns", "", "events", "create"),
    ("*", "apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("*", "apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    ("*", "", "namespaces", "list"),
    ("*", "", "namespaces", "watch"),
    *(("*", "kopf.dev", "clusterkopfpeerings", v) for v in ("get", "list", "watch", "patch")),
    *(("ns", "kopf.dev", "kopfpeerings", v) for v in ("get", "list", "watch", "patch")),
}


def _used_by_the_code() -> set[Grant]:
    used: set[Grant] = set()
    methods = {name for name, _ in inspect.getmembers(kube.Kube, inspect.iscoroutinefunction)}
    # json_patch is allowed where apply is (a PATCH too: the verb apply already needs).
    unknown = methods - set(_KUBE_METHOD_VERBS) - {"close", "patch_status", "_call", "_send", "json_patch"}
    assert not unknown, f"kube.Kube gained API methods this test does not map to verbs yet: {unknown}"
    assert set(kube.ACCESS) == set(kube.PLURALS), "every addressable kind declares its calls"
    for (api_version, kind), calls in kube.ACCESS.items():
        group = api_version.rsplit("/", 1)[0] if "/" in api_version else ""
        plural = kube.PLURALS[api_version, kind]
        # The leader-election Lease lives in the operator's own namespace, not in the served ones.
        where = "release" if kind == "Lease" else "ns"
        for call in calls:
            if call == "patch_status":
                continue  # the status subresource, below
            used |= {(where, group, plural, verb) for verb in _KUBE_METHOD_VERBS[call]}
    assert kube.ACCESS[API_VERSION, KIND] == ("get", "patch_status")  # users create and delete it
    used.add(("ns", GROUP, f"{PLURAL}/status", "patch"))  # Kube.patch_status, and kopf's status patches
    used.add(("ns", GROUP, f"{PLURAL}/status", "get"))  # kopf reads the status subresource it patches
    for group, _version, plural in [*children.CHILD_RESOURCES, children.POD_RESOURCE]:
        used |= {("ns", group, plural, verb) for verb in ("list", "watch")}  # kopf.on.event watches
    used |= {("ns", GROUP, PLURAL, verb) for verb in ("list", "watch", "patch")}  # kopf handlers, finalizers
    if _children_block_owner_deletion():
        # The OwnerReferencesPermissionEnforcement admission plugin lets only who may update the owner's
        # finalizers set blockOwnerDeletion (tests/cluster proves it on a real API server).
        used.add(("ns", GROUP, f"{PLURAL}/finalizers", "update"))
    return used | _FRAMEWORK


def _children_block_owner_deletion() -> bool:
    from carpool.operator.resources import build_children

    body = {
        "apiVersion": f"{GROUP}/v1",
        "kind": KIND,
        "metadata": {"name": "m", "namespace": "ns", "uid": "u"},
    }
    manifests = build_children(body).manifests
    return any(
        ref.get("blockOwnerDeletion") for m in manifests for ref in m["metadata"].get("ownerReferences") or []
    )


def test_the_declaration_is_what_the_code_uses() -> None:
    declared = _grants(rbac.NAMESPACED, "ns") | _grants(
        rbac.CRD_SCANNING + rbac.NAMESPACE_SCANNING + rbac.PEERING_CLUSTER, "*"
    )
    declared |= _grants(rbac.PEERING_NAMESPACED, "ns") | _grants(rbac.LEADER_ELECTION, "release")
    used = _used_by_the_code()
    assert sorted(declared - used) == [], "declared in carpool.operator.rbac but not used by the code"
    assert sorted(used - declared) == [], "used by the code but missing from carpool.operator.rbac"


def test_people_get_batchedmodels_through_the_aggregated_default_roles(render: Render) -> None:
    roles = {o["metadata"]["name"]: o for o in find(render(), "ClusterRole")}
    edit = next(r for r in roles.values() if r["metadata"]["name"].endswith("-edit"))
    view = next(r for r in roles.values() if r["metadata"]["name"].endswith("-view"))
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    edit_grants = _grants(edit["rules"], "*")
    assert ("*", GROUP, PLURAL, "create") in edit_grants and (
        "*",
        GROUP,
        f"{PLURAL}/scale",
        "patch",
    ) in edit_grants
    view_verbs = {verb for _, _, _, verb in _grants(view["rules"], "*")}
    assert view_verbs == {"get", "list", "watch"}, "view must stay read-only"
    off = render(values={"rbac": {"aggregateToDefaultRoles": False}})
    assert not [o for o in find(off, "ClusterRole") if o["metadata"]["name"].endswith(("-edit", "-view"))]
