"""Shared by the first-month tests (node loss, drains, admission refusals, scale): hollow node pools
(tests/cluster/hollownode.py) and GPU models that land on them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster.api import Api, condition
from tests.cluster.controlplane import ControlPlane
from tests.cluster.hollownode import HollowNode, pool_toleration
from tests.cluster.objects import batched_model

GPU_NODE = {"cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu": "1"}
"""One GPU per node: a pool with as many GPUs as the model has replicas has no spare capacity."""
FAST_SHUTDOWN = {"preStopSeconds": 0, "drainTimeoutSeconds": 0}
"""A 10 s grace period (the operator's margin only): a deleted pod is overdue soon after."""


class Pool:
    """Hollow nodes of one pool, stopped (and deleted) at the end of the test."""

    def __init__(self, control_plane: ControlPlane) -> None:
        self.control_plane = control_plane
        self.name = f"p{uuid.uuid4().hex[:6]}"
        self.api = Api(control_plane.server, control_plane.ssl_context())
        self.nodes: dict[str, HollowNode] = {}

    def add(self, count: int, capacity: dict[str, str] = GPU_NODE, **options: Any) -> list[HollowNode]:
        added = []
        for _ in range(count):
            name = f"{self.name}-{len(self.nodes)}"
            node = HollowNode(self.api, name, self.name, capacity, **options).start()
            self.nodes[name] = node
            added.append(node)
        return added

    def errors(self) -> list[str]:
        return [error for node in self.nodes.values() for error in node.errors]

    def close(self) -> None:
        for node in self.nodes.values():
            node.stop()
        self.api.close()


@pytest.fixture
def pool(control_plane: ControlPlane) -> Iterator[Pool]:
    made = Pool(control_plane)
    try:
        yield made
    finally:
        made.close()


def gpu_model(name: str, namespace: str, pool: Pool, *, replicas: int, **spec: Any) -> dict[str, Any]:
    """A BatchedModel whose pods each want the one GPU of a hollow node of `pool`."""
    tolerations = [pool_toleration(pool.name), *spec.pop("tolerations", [])]
    return batched_model(
        name,
        namespace,
        resources={
            "requests": {"cpu": "1", "memory": "1Gi"},
            "limits": {"cpu": "1", "memory": "2Gi", "nvidia.com/gpu": "1"},
        },
        replicas=replicas,
        autoscaling={"enabled": False},
        tolerations=tolerations,
        server=FAST_SHUTDOWN,
        **spec,
    )


def pods_of(api: Api, namespace: str, name: str) -> list[dict[str, Any]]:
    return api.list("Pod", namespace, f"app.kubernetes.io/instance={name}")


def ready_on(api: Api, namespace: str, name: str) -> dict[str, str]:
    """Ready pods (not being deleted) of the model: pod name -> node name."""
    return {
        pod["metadata"]["name"]: pod["spec"].get("nodeName", "")
        for pod in pods_of(api, namespace, name)
        if not pod["metadata"].get("deletionTimestamp")
        and (condition(pod, "Ready") or {}).get("status") == "True"
    }
