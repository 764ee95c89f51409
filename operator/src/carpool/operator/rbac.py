"""Every Kubernetes API permission the operator needs, declared next to the code that makes the calls.

The Helm chart's ClusterRole/Roles are generated from this module (`python -m charts.generate` writes
`charts/carpool/files/rbac-rules.yaml`), and tests/chart checks that the rendered RBAC grants exactly
these rules, no more and no less. Change this module together with `kube.py` (the children the
operator writes, `CHILD_WRITES`) and the handlers (what kopf watches): tests/chart also checks that every
kind `kube.py` can address is declared here.

Rules come in groups by when they apply:
- `NAMESPACED`: in every namespace the operator serves (a ClusterRole cluster-wide, or a Role per
  watched namespace).
- `CRD_SCANNING`: cluster-scoped reads kopf makes to discover the resources it serves (always).
- `NAMESPACE_SCANNING`: kopf resolving the namespaces it serves (only when not cluster-wide).
- `LEADER_ELECTION`: the Lease replicas elect the active one with (`leader.py`), in the operator's own
  namespace, only when there are several (the chart's Role in its release namespace).
- `PEERING_CLUSTER` / `PEERING_NAMESPACED`: kopf peering between replicas (`carpool operator --peering`,
  no longer what the chart uses: see `leader.py` for why).
"""

from __future__ import annotations

from dataclasses import dataclass

from carpool.operator import GROUP, PLURAL


@dataclass(frozen=True)
class Rule:
    """One RBAC PolicyRule: verbs on resources of one API group ("" is the core group)."""

    api_group: str
    resources: tuple[str, ...]
    verbs: tuple[str, ...]

    def as_policy_rule(self) -> dict[str, list[str]]:
        return {"apiGroups": [self.api_group], "resources": list(self.resources), "verbs": list(self.verbs)}


WATCH = ("get", "list", "watch")
"""kopf lists and watches what it handles; the reconciler also reads single objects."""

CHILD = ("get", "list", "watch", "create", "patch", "delete")
"""Children the operator always wants: read, watched by kopf (drift), server-side applied (PATCH,
which needs `create` too when the object is absent). Never deleted by the operator (garbage collection
does that), but `delete` is needed all the same: the OwnerReferencesPermissionEnforcement admission
plugin lets only who may delete an object change its owner references, which the take-over of a
re-created BatchedModel's children does (tests/cluster/test_recreated.py saw the 403 without it)."""

REMOVABLE_CHILD = CHILD
"""Children the spec can stop asking for (autoscalers, the disruption budget): also deleted."""

NAMESPACED: tuple[Rule, ...] = (
    # The custom resource: kopf watches it and patches finalizers and its progress annotations.
    Rule(GROUP, (PLURAL,), (*WATCH, "patch")),
    # Status is written through the subresource (kube.patch_status, and kopf's own status patches).
    Rule(GROUP, (f"{PLURAL}/status",), ("get", "patch")),
    # Children carry `blockOwnerDeletion: true` (kopf.adopt), so that foreground deletion of a
    # BatchedModel waits for them. The OwnerReferencesPermissionEnforcement admission plugin (on in
    # OpenShift) lets only who may `update` the owner's finalizers set that: without this rule, every
    # child write is 403 there.
    Rule(GROUP, (f"{PLURAL}/finalizers",), ("update",)),
    # The children of a BatchedModel (`kube.ACCESS`).
    Rule("", ("configmaps", "services"), CHILD),
    # The runtime pods' workload; deleted when `model.nodes` goes above 1 (a LeaderWorkerSet replaces it).
    Rule("apps", ("deployments",), REMOVABLE_CHILD),
    Rule("autoscaling", ("horizontalpodautoscalers",), REMOVABLE_CHILD),
    Rule("policy", ("poddisruptionbudgets",), REMOVABLE_CHILD),
    Rule("keda.sh", ("scaledobjects",), REMOVABLE_CHILD),
    # The workload of a model split over several nodes (sigs.k8s.io/lws), instead of the Deployment.
    Rule("leaderworkerset.x-k8s.io", ("leaderworkersets",), REMOVABLE_CHILD),
    # Deleted when `spec.networkPolicy.enabled` turns false.
    Rule("networking.k8s.io", ("networkpolicies",), REMOVABLE_CHILD),
    # The InferencePool of a model routed through the Gateway API Inference Extension; deleted when
    # `spec.routing` goes back to `service`.
    Rule("inference.networking.k8s.io", ("inferencepools",), REMOVABLE_CHILD),
    # The shared model cache the operator creates; not watched (nothing about it changes the status).
    Rule("", ("persistentvolumeclaims",), ("get", "create", "patch", "delete")),
    # The runtime pods: watched by kopf (server-side label selector) and listed to explain the status.
    Rule("", ("pods",), ("list", "watch")),
    # kopf posts Kubernetes Events about the handling of each BatchedModel.
    Rule("", ("events",), ("create",)),
)

CRD_SCANNING: tuple[Rule, ...] = (
    # kopf observes CRDs, to notice BatchedModel's when it is installed after the operator starts.
    Rule("apiextensions.k8s.io", ("customresourcedefinitions",), ("list", "watch")),
)

NAMESPACE_SCANNING: tuple[Rule, ...] = (
    # kopf observes namespaces to resolve the ones it serves (`--namespace`), never when cluster-wide.
    Rule("", ("namespaces",), ("list", "watch")),
)

LEADER_ELECTION: tuple[Rule, ...] = (
    # One Lease (`kube.ACCESS`: created once, then replaced with its resourceVersion).
    Rule("coordination.k8s.io", ("leases",), ("get", "create", "update")),
)

PEERING_CLUSTER: tuple[Rule, ...] = (
    # Peering of cluster-wide replicas: the ClusterKopfPeering's status holds each replica's keep-alive.
    Rule("kopf.dev", ("clusterkopfpeerings",), ("get", "list", "watch", "patch")),
)

PEERING_NAMESPACED: tuple[Rule, ...] = (
    # Peering of namespaced replicas: a KopfPeering in each served namespace.
    Rule("kopf.dev", ("kopfpeerings",), ("get", "list", "watch", "patch")),
)
