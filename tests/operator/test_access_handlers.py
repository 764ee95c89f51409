"""The real kopf operator against kmock: the NetworkPolicy is a child like the others (created, restored
when deleted, removed when turned off) written through the same apply plan (server-side apply, deleted
before applies, never over a policy carpool does not own), and TLS reaches the status endpoint."""

from __future__ import annotations

from typing import Any

from carpool.operator import FIELD_MANAGER
from tests.operator.factories import NAMESPACE, Cluster, batched_model
from tests.operator.test_requests import child_writes, mark


async def _absent(cluster: Cluster, kind: str, name: str) -> bool:
    return await cluster.get(kind, name) is None


async def test_the_network_policy_is_created_restored_and_removed(cluster: Cluster) -> None:
    await cluster.create(batched_model("embedder"))
    policy = await cluster.child("NetworkPolicy", "embedder")
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-embedder"
    assert policy["spec"]["ingress"][0]["from"] == [{"podSelector": {}}]

    await cluster.delete("NetworkPolicy", "embedder")
    await cluster.child("NetworkPolicy", "embedder")  # restored on the child's deletion event

    await cluster.patch(
        "BatchedModel",
        "embedder",
        {"metadata": {"generation": 2}, "spec": {"networkPolicy": {"enabled": False}}},
    )
    # Generous: every child event before it reconciles the whole model in turn (a loaded CI machine).
    await cluster.wait_for(
        lambda: _absent(cluster, "NetworkPolicy", "embedder"), within=30, what="the policy deleted"
    )


async def test_tls_and_keys_reach_the_pods_and_the_endpoint(cluster: Cluster) -> None:
    spec = {"auth": {"apiKeysSecret": {"name": "keys"}}, "tls": {"secretName": "certs"}}
    await cluster.create(batched_model("secured", spec))
    deployment = await cluster.child("Deployment", "secured")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == "keys"
    assert volumes["tls"]["secret"]["secretName"] == "certs"
    status = await cluster.wait_for(lambda: cluster.status("secured"), what="a status")
    assert status["endpoint"] == "https://secured.ml.svc:8000"


async def test_the_network_policy_goes_through_the_apply_plan(cluster: Cluster) -> None:
    """Server-side applied with carpool's manager before the Deployment (no pod runs unfenced), and
    deleted before anything else is applied when it is turned off in the same change as the pods."""
    await cluster.create(batched_model("m"))
    await cluster.child("Deployment", "m")
    created = [(str(r.method), r.url.path.rsplit("/", 2)[-2]) for r in child_writes(cluster)]
    policy = next(r for r in child_writes(cluster) if "networkpolicies" in r.url.path)
    assert str(policy.method) == "method.PATCH"
    assert policy.params["fieldManager"] == FIELD_MANAGER and policy.params["force"] == "true"
    assert created.index(("method.PATCH", "networkpolicies")) < created.index(("method.PATCH", "deployments"))

    since = mark(cluster)
    spec = {"networkPolicy": {"enabled": False}, "podAnnotations": {"team": "search"}}
    await cluster.patch("BatchedModel", "m", {"metadata": {"generation": 2}, "spec": spec})
    deleted = ("method.DELETE", "networkpolicies")
    applied = ("method.PATCH", "deployments", True)

    def sent() -> list[tuple[str, ...]] | None:
        # The Deployment apply of the new spec is the one carrying the new annotation: writes of a
        # reconcile of the old spec that was still under way when the spec changed may come first.
        paths = [
            (
                str(r.method),
                r.url.path.rsplit("/", 2)[-2],
                *((b"search" in r.body,) if "deploy" in r.url.path else ()),
            )
            for r in child_writes(cluster, since)
        ]
        return paths if deleted in paths and applied in paths else None

    paths = await cluster.wait_for(sent, within=30, what="the policy deleted and the Deployment applied")
    assert paths.index(deleted) < paths.index(applied)


async def test_a_network_policy_carpool_does_not_own_is_left_alone(cluster: Cluster) -> None:
    foreign = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "m", "namespace": NAMESPACE, "labels": {"team": "net"}},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
    }
    await cluster.create(foreign)
    await cluster.create(batched_model("m"))

    async def conflict() -> dict[str, Any] | None:
        ready = await cluster.condition("m", "Ready")
        return ready if ready and ready["reason"] == "ResourceConflict" else None

    ready = await cluster.wait_for(conflict, what="Ready=False ResourceConflict")
    assert f"NetworkPolicy {NAMESPACE}/m" in ready["message"]
    assert not [r for r in child_writes(cluster) if "networkpolicies" in r.url.path]
    assert (await cluster.get("NetworkPolicy", "m") or {})["spec"] == foreign["spec"]
