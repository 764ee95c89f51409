"""Handlers for the children: an edit, a deletion or a status change reconciles the owner.

A deleted or edited child is restored this way within one watch event, and the owner's status follows
its Deployment's and autoscaler's status. Pod events (scheduling failures, image pulls, crash loops)
reconcile the BatchedModel named by the pod's instance label, so its status explains within seconds
why nothing is ready.

The same streams feed kopf's indexes of the children and pods (`informer`): reconciles read them there.

Only objects labelled as managed by carpool are watched, and the filter is a label selector sent to
the API server (`settings.watching.label_selectors`, set in `lifecycle.configure`): kopf's `labels=`
filter alone would stream every ConfigMap, Service and pod of the cluster into the operator and drop
them client-side.
"""

from __future__ import annotations

from typing import Any

import kopf

from carpool.operator import FIELD_MANAGER
from carpool.operator.handlers.lifecycle import state_of
from carpool.operator.informer import CHILD_INDEX_PREFIX, POD_INDEX, child_key, pod_key
from carpool.operator.reconcile import reconcile_owner, reconcile_pod_owner
from carpool.operator.resources.labels import APP_NAME

MANAGED = {"app.kubernetes.io/managed-by": FIELD_MANAGER}
MANAGED_SELECTOR = f"app.kubernetes.io/managed-by={FIELD_MANAGER}"
"""Server-side selector of the children kopf watches."""
POD_SELECTOR = f"{MANAGED_SELECTOR},app.kubernetes.io/name={APP_NAME}"
"""Server-side selector of the runtime pods kopf watches."""

CHILD_RESOURCES = [
    ("", "v1", "configmaps"),
    ("", "v1", "services"),
    ("apps", "v1", "deployments"),
    ("autoscaling", "v2", "horizontalpodautoscalers"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("keda.sh", "v1alpha1", "scaledobjects"),
    ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
    ("networking.k8s.io", "v1", "networkpolicies"),
    ("inference.networking.k8s.io", "v1", "inferencepools"),
]


async def child_changed(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    await reconcile_owner(state_of(memo), dict(body), logger=logger)


async def pod_changed(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    await reconcile_pod_owner(state_of(memo), dict(body), logger=logger)


def index_child(body: kopf.Body, **_: Any) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    """A child as kopf's index keeps it (`informer.Informer` reads it)."""
    return {child_key(body): dict(body)}


def index_pod(body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    key = pod_key(body)
    return {key: dict(body)} if key is not None else {}


POD_RESOURCE = ("", "v1", "pods")
kopf.on.event(group="", version="v1", plural="pods", labels=MANAGED, id="runtime-pods")(pod_changed)
kopf.index(group="", version="v1", plural="pods", labels=MANAGED, id=POD_INDEX)(index_pod)

for _group, _version, _plural in CHILD_RESOURCES:
    kopf.on.event(group=_group, version=_version, plural=_plural, labels=MANAGED, id=f"child-{_plural}")(
        child_changed
    )
    kopf.index(
        group=_group, version=_version, plural=_plural, labels=MANAGED, id=f"{CHILD_INDEX_PREFIX}{_plural}"
    )(index_child)
