"""The real kopf operator against kmock: the NetworkPolicy is a child like the others (created, restored
when deleted, removed when turned off), and TLS reaches the status endpoint."""

from __future__ import annotations

from tests.operator.factories import Cluster, batched_model


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
