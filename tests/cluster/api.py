"""A small synchronous client for the tests' own reads and writes on the real API server (as the admin),
and the waits the tests need: every wait is bounded and, when it times out, says what it last saw."""

from __future__ import annotations

import ssl
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import httpx

from tests import tools

T = TypeVar("T")

PLURALS = {
    "ConfigMap": ("v1", "configmaps"),
    "Service": ("v1", "services"),
    "Pod": ("v1", "pods"),
    "Event": ("v1", "events"),
    "ServiceAccount": ("v1", "serviceaccounts"),
    "PersistentVolumeClaim": ("v1", "persistentvolumeclaims"),
    "PersistentVolume": ("v1", "persistentvolumes"),
    "Namespace": ("v1", "namespaces"),
    "Node": ("v1", "nodes"),
    "Deployment": ("apps/v1", "deployments"),
    "ReplicaSet": ("apps/v1", "replicasets"),
    "StatefulSet": ("apps/v1", "statefulsets"),
    "LeaderWorkerSet": ("leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    "HorizontalPodAutoscaler": ("autoscaling/v2", "horizontalpodautoscalers"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies"),
    "EndpointSlice": ("discovery.k8s.io/v1", "endpointslices"),
    "BatchedModel": ("carpool.dev/v1alpha1", "batchedmodels"),
    "InferencePool": ("inference.networking.k8s.io/v1", "inferencepools"),
    "CustomResourceDefinition": ("apiextensions.k8s.io/v1", "customresourcedefinitions"),
    "APIService": ("apiregistration.k8s.io/v1", "apiservices"),
    "RuntimeClass": ("node.k8s.io/v1", "runtimeclasses"),
    "ResourceQuota": ("v1", "resourcequotas"),
    "LimitRange": ("v1", "limitranges"),
    "Secret": ("v1", "secrets"),
    "ClusterRoleBinding": ("rbac.authorization.k8s.io/v1", "clusterrolebindings"),
    "Lease": ("coordination.k8s.io/v1", "leases"),
}
CLUSTER_SCOPED = {
    "Namespace",
    "Node",
    "PersistentVolume",
    "CustomResourceDefinition",
    "APIService",
    "RuntimeClass",
    "ClusterRoleBinding",
}


class Timeout(AssertionError):
    pass


def path(kind: str, namespace: str | None = None, name: str | None = None, subresource: str = "") -> str:
    api_version, plural = PLURALS[kind]
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    where = "" if kind in CLUSTER_SCOPED or namespace is None else f"/namespaces/{namespace}"
    tail = f"/{name}" if name else ""
    return f"{root}{where}/{plural}{tail}{'/' + subresource if subresource else ''}"


class Api:
    def __init__(self, server: str, context: ssl.SSLContext) -> None:
        """`context` trusts the cluster CA and carries the client certificate."""
        self._server, self._context = server, context
        self.http = httpx.Client(base_url=server, verify=context, timeout=30)

    def reconnect(self) -> None:
        """A fresh connection pool (after a test restarted the API server under the pooled ones)."""
        self.http.close()
        self.http = httpx.Client(base_url=self._server, verify=self._context, timeout=30)

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        return self.http.request(method, url, **kwargs)

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        answer = self.http.get(path(kind, namespace, name))
        if answer.status_code == 404:
            return None
        answer.raise_for_status()
        return dict(answer.json())

    def list(
        self, kind: str, namespace: str | None = None, selector: str | None = None
    ) -> list[dict[str, Any]]:
        params = {"labelSelector": selector} if selector else None
        answer = self.http.get(path(kind, namespace), params=params)
        answer.raise_for_status()
        return list(answer.json().get("items") or [])

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        kind = manifest["kind"]
        namespace = manifest["metadata"].get("namespace")
        answer = self.http.post(path(kind, namespace), json=dict(manifest))
        if answer.status_code >= 400:
            raise AssertionError(f"create {kind}: {answer.status_code} {answer.text}")
        return dict(answer.json())

    def patch(
        self,
        kind: str,
        namespace: str | None,
        name: str,
        body: Mapping[str, Any],
        *,
        subresource: str = "",
        content_type: str = "application/merge-patch+json",
        params: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        return self.http.patch(
            path(kind, namespace, name, subresource),
            content=httpx.Request("PATCH", "/", json=dict(body)).content,
            headers={"Content-Type": content_type},
            params=params,
        )

    def delete(self, kind: str, namespace: str | None, name: str, propagation: str = "Background") -> int:
        answer = self.http.request(
            "DELETE", path(kind, namespace, name), json={"propagationPolicy": propagation}
        )
        return answer.status_code


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 60.0, every: float = 0.25) -> T:
    """Poll `probe` until it returns something other than None/False; fail naming `what` and what was last
    seen (a probe may raise AssertionError to explain itself)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            found = probe()
            if found is not None and found is not False:
                return found
            last = found
        except AssertionError as exc:
            last = exc
        if time.monotonic() > deadline:
            raise Timeout(f"timed out after {timeout:.0f} s waiting for {what}; last: {last}")
        time.sleep(every)


def run(
    tool: str, *args: str | Path, env: Mapping[str, str], check: bool = True, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """kubectl or helm (the real binaries tests/tools.py unpacks), as the environment's kubeconfig says."""
    binary = tools.kubectl() if tool == "kubectl" else tools.helm()
    done = subprocess.run(
        [str(binary), *map(str, args)],
        env=dict(env),
        capture_output=True,
        text=True,
        input=stdin,
        check=False,
        timeout=120,
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"{tool} {' '.join(map(str, args))} failed ({done.returncode}):\n{done.stderr}{done.stdout}"
        )
    return done


def condition(body: Mapping[str, Any] | None, kind: str) -> dict[str, Any] | None:
    for item in ((body or {}).get("status") or {}).get("conditions") or []:
        if item.get("type") == kind:
            return dict(item)
    return None
