"""Handlers for the children: an edit, a deletion or a status change reconciles the owner.

A deleted or edited child is restored this way within one watch event, and the owner's status follows
its Deployment's and autoscaler's status. Only objects labelled as managed by carpool are watched.
"""

from __future__ import annotations

from typing import Any

import kopf

from carpool.operator import FIELD_MANAGER
from carpool.operator.handlers.lifecycle import state_of
from carpool.operator.reconcile import reconcile_owner

MANAGED = {"app.kubernetes.io/managed-by": FIELD_MANAGER}

CHILD_RESOURCES = [
    ("", "v1", "configmaps"),
    ("", "v1", "services"),
    ("apps", "v1", "deployments"),
    ("autoscaling", "v2", "horizontalpodautoscalers"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("keda.sh", "v1alpha1", "scaledobjects"),
    ("networking.k8s.io", "v1", "networkpolicies"),
]


async def child_changed(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    await reconcile_owner(state_of(memo), dict(body), logger=logger)


for _group, _version, _plural in CHILD_RESOURCES:
    kopf.on.event(group=_group, version=_version, plural=_plural, labels=MANAGED, id=f"child-{_plural}")(
        child_changed
    )
