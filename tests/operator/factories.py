"""Factories for BatchedModel bodies and a small kubectl over kmock's HTTP API for the tests."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from carpool.operator import API_VERSION, KIND

NAMESPACE = "ml"
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
KUBERNETES_VERSIONS = ("1.29", "1.35")


def validate_official(manifest: dict[str, Any], version: str) -> None:
    """Validate a child against Kubernetes' official schema of `version`. KEDA's ScaledObject has none
    (test_scaled_object checks it); a LeaderWorkerSet has none either: its pod templates are checked as
    core PodTemplates here, the whole object by the real API server with LWS's own CRD (tests/cluster); an
    InferencePool has none: the real API server checks it with the Inference Extension's CRD
    (tests/cluster/test_endpoint_picker.py)."""
    import kubernetes_validate  # type: ignore[import-untyped]

    if manifest["kind"] in ("ScaledObject", "InferencePool"):
        return
    if manifest["kind"] == "LeaderWorkerSet":
        for role, template in manifest["spec"]["leaderWorkerTemplate"].items():
            if role.endswith("Template"):
                wrapped = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": "t"},
                    "template": template,
                }
                kubernetes_validate.validate(wrapped, version, strict=True)
        return
    kubernetes_validate.validate(manifest, version, strict=True)


def example(path: Path) -> dict[str, Any]:
    """An example file's BatchedModel, with the uid the API server would have given it."""
    body: dict[str, Any] = yaml.safe_load(path.read_text())
    body["metadata"].setdefault("uid", f"uid-{body['metadata']['name']}")
    return body


KINDS: dict[str, dict[str, Any]] = {
    "carpool.dev/v1alpha1/batchedmodels": {
        "kind": "BatchedModel",
        "namespaced": True,
        "shortnames": ["bm"],
        "categories": ["carpool"],
        "subresources": ["status", "scale"],
        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
    },
    # kopf discovers these before it watches anything (namespaces, CRDs); nothing lists them here.
    "v1/namespaces": {"kind": "Namespace", "namespaced": False},
    "apiextensions.k8s.io/v1/customresourcedefinitions": {
        "kind": "CustomResourceDefinition",
        "namespaced": False,
    },
    "v1/configmaps": {"kind": "ConfigMap", "namespaced": True},
    "v1/pods": {"kind": "Pod", "namespaced": True, "subresources": ["status"]},
    "v1/persistentvolumeclaims": {"kind": "PersistentVolumeClaim", "namespaced": True},
    "v1/services": {"kind": "Service", "namespaced": True},
    "v1/events": {"kind": "Event", "namespaced": True},
    "apps/v1/deployments": {"kind": "Deployment", "namespaced": True, "subresources": ["status", "scale"]},
    "autoscaling/v2/horizontalpodautoscalers": {
        "kind": "HorizontalPodAutoscaler",
        "namespaced": True,
        "subresources": ["status"],
    },
    "policy/v1/poddisruptionbudgets": {"kind": "PodDisruptionBudget", "namespaced": True},
    "keda.sh/v1alpha1/scaledobjects": {"kind": "ScaledObject", "namespaced": True},
    "leaderworkerset.x-k8s.io/v1/leaderworkersets": {
        "kind": "LeaderWorkerSet",
        "namespaced": True,
        "subresources": ["status", "scale"],
    },
    "networking.k8s.io/v1/networkpolicies": {"kind": "NetworkPolicy", "namespaced": True},
    "inference.networking.k8s.io/v1/inferencepools": {
        "kind": "InferencePool",
        "namespaced": True,
        "subresources": ["status"],
    },
}
for _info in KINDS.values():
    _info.setdefault("verbs", ["get", "list", "watch", "create", "update", "patch", "delete"])


def serve_kinds(emulator: Any) -> None:
    """Teach kmock's emulator the resources the operator discovers, watches and writes (the handler
    tests' `cluster` fixture and `python -m bench.operator` both start from this)."""
    for path, info in KINDS.items():
        emulator.resources[path] = info


PATHS = {
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "Service": "/api/v1/namespaces/{ns}/services",
    "Event": "/api/v1/namespaces/{ns}/events",
    "Pod": "/api/v1/namespaces/{ns}/pods",
    "PersistentVolumeClaim": "/api/v1/namespaces/{ns}/persistentvolumeclaims",
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
    "HorizontalPodAutoscaler": "/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
    "ScaledObject": "/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects",
    "LeaderWorkerSet": "/apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    "InferencePool": "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
    "BatchedModel": "/apis/carpool.dev/v1alpha1/namespaces/{ns}/batchedmodels",
}


def batched_model(
    name: str = "embedder",
    spec: dict[str, Any] | None = None,
    *,
    namespace: str = NAMESPACE,
    uid: str | None = None,
    generation: int = 1,
) -> dict[str, Any]:
    """A BatchedModel body as the API server would store it (kmock sets no uid or generation)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or f"uid-{name}",
            "generation": generation,
        },
        "spec": copy.deepcopy(spec) if spec is not None else {},
    }


def two_nodes(**extra: Any) -> dict[str, Any]:
    """The spec of a 70B-class model over two nodes of 8 GPUs (a LeaderWorkerSet of groups of two):
    vLLM's tensor parallelism over a node's GPUs, a pipeline stage per node."""
    model = {
        "source": "org/llm",
        "task": "generate",
        "engine": "vllm",
        "tensorParallelSize": 8,
        "pipelineParallelSize": 2,
        "nodes": 2,
    }
    return {
        "model": model,
        "resources": {"requests": {"cpu": "16"}, "limits": {"nvidia.com/gpu": 8}},
        **extra,
    }


class Cluster:
    """kubectl for the tests: create, get, patch, delete and wait, over HTTP against kmock."""

    def __init__(self, kmock: Any) -> None:
        self.kmock = kmock

    def _path(self, kind: str, name: str | None = None, namespace: str = NAMESPACE) -> str:
        base = PATHS[kind].format(ns=namespace)
        return f"{base}/{name}" if name else base

    async def create(self, body: dict[str, Any]) -> None:
        ns = body["metadata"].get("namespace", NAMESPACE)
        async with self.kmock.post(self._path(body["kind"], namespace=ns), json=body) as response:
            assert response.status < 300, await response.text()

    async def get(self, kind: str, name: str, namespace: str = NAMESPACE) -> dict[str, Any] | None:
        async with self.kmock.get(self._path(kind, name, namespace)) as response:
            if response.status == 404:
                return None
            assert response.status == 200, await response.text()
            result: dict[str, Any] = await response.json()
            return result

    async def list(self, kind: str, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
        async with self.kmock.get(self._path(kind, namespace=namespace)) as response:
            assert response.status == 200, await response.text()
            items: list[dict[str, Any]] = (await response.json())["items"]
            return items

    async def patch(self, kind: str, name: str, patch: dict[str, Any], namespace: str = NAMESPACE) -> None:
        headers = {"Content-Type": "application/merge-patch+json"}
        async with self.kmock.patch(
            self._path(kind, name, namespace), json=patch, headers=headers
        ) as response:
            assert response.status < 300, await response.text()

    async def delete(self, kind: str, name: str, namespace: str = NAMESPACE) -> None:
        async with self.kmock.delete(self._path(kind, name, namespace)) as response:
            assert response.status < 300, await response.text()

    async def wait_for(
        self,
        probe: Callable[[], Any],
        *,
        within: float = 5.0,
        what: str = "condition",
    ) -> Any:
        """Poll `probe` (sync or async) until it returns something truthy; fail after `within` s."""
        timeout = within
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = probe()
            if asyncio.iscoroutine(last):
                last = await last
            if last:
                return last
            await asyncio.sleep(0.02)  # a poll interval, not a wait standing in for the condition
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")

    async def child(
        self, kind: str, name: str, namespace: str = NAMESPACE, within: float = 5.0
    ) -> dict[str, Any]:
        found: dict[str, Any] = await self.wait_for(
            lambda: self.get(kind, name, namespace), within=within, what=f"{kind} {name}"
        )
        return found

    async def status(self, name: str, namespace: str = NAMESPACE) -> dict[str, Any]:
        body = await self.get("BatchedModel", name, namespace)
        return (body or {}).get("status") or {}

    async def condition(self, name: str, kind: str, namespace: str = NAMESPACE) -> dict[str, Any] | None:
        for condition in (await self.status(name, namespace)).get("conditions", []):
            if condition["type"] == kind:
                return dict(condition)
        return None
