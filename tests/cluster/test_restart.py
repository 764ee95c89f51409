"""The operator restarted (a node drain, an upgrade): while it is down a spec changes and a Deployment is
deleted; once it runs again (kopf's resume path, against the real server) both converge, and no child is
written twice, counted from the API server's audit log."""

from __future__ import annotations

import time
import urllib.parse
from collections import Counter

from carpool.operator.reconcile import RETRY_DELAY_SECONDS
from tests.cluster.api import Api, wait_for
from tests.cluster.conftest import Operator
from tests.cluster.controlplane import ControlPlane
from tests.cluster.objects import batched_model, kubectl_apply, wait_for_children


def _child_writes(
    control_plane: ControlPlane, operator: Operator, namespace: str, since: int
) -> Counter[str]:
    """The operator's writes of children and Events in `namespace` after audit event `since`, by object and
    field manager (the Deployment's replica hand-over is a second manager's apply, on purpose)."""
    found: Counter[str] = Counter()
    for event in control_plane.audit_events()[since:]:
        ref = dict(event.get("objectRef") or {})  # type: ignore[call-overload]
        user = dict(event.get("user") or {})  # type: ignore[call-overload]
        if user.get("username") != operator.user or ref.get("namespace") != namespace:
            continue
        if ref.get("resource") == "batchedmodels":
            continue
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(str(event.get("requestURI"))).query)
        manager = (query.get("fieldManager") or ["?"])[0]
        found[f"{event['verb']} {ref.get('resource')}/{ref.get('name')} by {manager}"] += 1
    return found


def _config(api: Api, namespace: str) -> str:
    found = api.get("ConfigMap", namespace, "resumed-runtime") or {}
    return str((found.get("data") or {}).get("runtime.yaml", ""))


def test_changes_made_while_the_operator_was_down_converge_once_it_is_back(
    control_plane: ControlPlane, api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    kubectl_apply(admin_env, batched_model("resumed", namespace))
    old = wait_for_children(api, namespace, "resumed")["Deployment"]["metadata"]["uid"]

    operator.stop()
    try:
        kubectl_apply(admin_env, batched_model("resumed", namespace, batching={"maxBatchSize": 5}))
        assert api.delete("Deployment", namespace, "resumed") == 200
        wait_for("the Deployment gone", lambda: api.get("Deployment", namespace, "resumed") is None)
        since = len(control_plane.audit_events())
    finally:
        operator.start()

    wait_for("the spec change applied", lambda: "max_batch_size: 5" in _config(api, namespace), timeout=60)
    deployment = wait_for(
        "the Deployment re-created",
        lambda: (found := api.get("Deployment", namespace, "resumed")) and found["metadata"]["uid"] != old,
        timeout=60,
    )
    assert deployment

    # Nothing written twice, over two retry periods (kopf's and the requeue's retries included).
    deadline = time.monotonic() + 2 * RETRY_DELAY_SECONDS
    while True:
        writes = _child_writes(control_plane, operator, namespace, since)
        twice = {write: count for write, count in writes.items() if count > 1}
        assert not twice, f"written more than once after the restart: {twice} (all: {dict(writes)})"
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)  # a poll interval of the audit log; the window is the deadline
    assert set(writes) == {
        "patch configmaps/resumed-runtime by carpool-operator",
        "patch deployments/resumed by carpool-operator",
        "patch deployments/resumed by carpool-operator-replicas",
        # kopf's one Normal Event for the update it handled ("Updating is processed"); once, like the rest.
        "create events/None by ?",
    }, writes
