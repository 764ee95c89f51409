"""The PodDisruptionBudget: node drains evict runtime pods a few at a time, and never deadlock.

`maxUnavailable`, not `minAvailable`: a single-replica or scaled-to-zero model must not block drains
(with `minAvailable: 1` one replica could never be evicted, and `kubectl drain` would wait forever).

A model over several nodes gets one budget over all its groups' pods, leaders and workers (they carry the
model's selector labels), and that budget counts groups: evicting any pod of a group restarts the whole
group (`RecreateGroupOnPodRestart`), whose pods then all count as unavailable until it is ready again, so
with `maxUnavailable: 1` a node drain takes one group at a time, and waits for it to serve again before
the next. One budget per group (selecting `leaderworkerset.sigs.k8s.io/group-index`) would not: each would
allow its own eviction, and a drain could take every group at once.

`unhealthyPodEvictionPolicy: AlwaysAllow` (policy/v1, GA in Kubernetes 1.31): a pod that runs but is
not ready (a runtime still loading its model, one crash-looping, one whose node stopped answering) may
always be evicted. Under the default `IfHealthyBudget` such a pod is evicted only while the budget has
room, and on a full pool the pod that cannot become ready is the very one using up the budget: a drain
of its node would then wait for it to become ready, which it may never do (a GPU pool with no spare
GPU has nowhere else to put it either). Evicting a pod that serves nothing costs no capacity.
"""

from __future__ import annotations

from typing import Any

from carpool.operator.resources.labels import selector_labels, standard_labels
from carpool.operator.spec import BatchedModelSpec

UNHEALTHY_POD_EVICTION_POLICY = "AlwaysAllow"


def disruption_budget(spec: BatchedModelSpec, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "labels": standard_labels(name)},
        "spec": {
            "maxUnavailable": spec.disruption_budget.max_unavailable,
            "selector": {"matchLabels": selector_labels(name)},
            "unhealthyPodEvictionPolicy": UNHEALTHY_POD_EVICTION_POLICY,
        },
    }
