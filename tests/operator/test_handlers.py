"""The real kopf operator against kmock's Kubernetes emulator over HTTP.

kmock stores objects as plain JSON and merges patches as dicts: no defaulting, no generation or uid
(the factories set them), no owner-reference garbage collection and no controllers (nobody creates
pods or fills a Deployment's status unless a test does). Each test says where that matters.
"""

from __future__ import annotations

import time

from tests.operator.factories import Cluster, batched_model


async def test_create_makes_every_child_within_two_seconds(cluster: Cluster) -> None:
    started = time.monotonic()
    await cluster.create(batched_model("embedder"))
    for kind, name in [
        ("ConfigMap", "embedder-runtime"),
        ("Deployment", "embedder"),
        ("Service", "embedder"),
        ("HorizontalPodAutoscaler", "embedder"),
        ("PodDisruptionBudget", "embedder"),
    ]:
        child = await cluster.child(kind, name, within=2.0)
        refs = child["metadata"]["ownerReferences"]
        assert refs[0]["kind"] == "BatchedModel" and refs[0]["uid"] == "uid-embedder"
    assert time.monotonic() - started < 2.0
