"""A Node's heartbeat Lease in `kube-node-lease`, renewed as the kubelet renews it (every 10 s of a 40 s
duration by default): the node-lifecycle controller reads it, and a Node whose Lease and status both
stop being renewed for `--node-monitor-grace-period` is marked NotReady (`Ready=Unknown`) and tainted."""

from __future__ import annotations

import datetime

from tests.cluster.api import Api

LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_S = 40
"""What the kubelet sets (`nodeLeaseDurationSeconds`)."""


def _micro_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_path(node: str) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{node}"


def renew_node_lease(api: Api, node: str) -> str | None:
    """Renew the Node's Lease (or create it, owned by the Node, as the kubelet does); returns an error's
    text, or None."""
    spec = {"holderIdentity": node, "leaseDurationSeconds": LEASE_DURATION_S, "renewTime": _micro_now()}
    answer = api.request(
        "PATCH",
        lease_path(node),
        json={"spec": spec},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    if answer.status_code == 404:
        found = api.get("Node", None, node)
        owner = (
            [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": found["metadata"]["uid"]}]
            if found
            else []
        )
        answer = api.request(
            "POST",
            f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases",
            json={
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": node, "ownerReferences": owner},
                "spec": spec,
            },
        )
    return None if answer.status_code < 400 else f"lease: {answer.status_code} {answer.text}"


def delete_node_lease(api: Api, node: str) -> None:
    api.request("DELETE", lease_path(node))
