"""Many BatchedModels at once on the real API server: the models, their convergence, and what the
operator spends on them (its API requests from the audit log, its peak memory from /proc). Used by
tests/cluster/test_scale.py (converge within the chart's memory limit) and bench/operator (the figures).

The models are cheap on purpose: CPU-only, one replica, autoscaling off, tolerating a hollow node
(tests/cluster/hollownode.py) that marks their pods running. What is measured is the operator and the
control plane, not a runtime."""

from __future__ import annotations

import collections
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.api import Api, condition, run
from tests.cluster.hollownode import pool_toleration
from tests.cluster.objects import batched_model

ROOT = Path(__file__).resolve().parents[2]
BIG_NODE = {"cpu": "128", "memory": "512Gi", "pods": "500", "nvidia.com/gpu": "0"}
"""One hollow node that takes every cheap model's pod."""
SCALE_ACCOUNT = "carpool-scale"
"""The scale test's operator's ServiceAccount: granted what the chart's is (`grant_as`), with an identity
of its own so that the tier's audit log records its reads and no one else's
(`controlplane.audit_reads_of`)."""


def account_user(namespace: str, account: str) -> str:
    return f"system:serviceaccount:{namespace}:{account}"


def grant_as(api: Api, namespace: str, source: str, account: str) -> list[tuple[str, str | None, str]]:
    """Create ServiceAccount `account` in `namespace`, bound to every Role and ClusterRole that `source`
    (the chart's ServiceAccount there) is bound to. Returns the bindings made, (kind, namespace, name)."""
    api.create(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account, "namespace": namespace}}
    )
    made: list[tuple[str, str | None, str]] = []
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    for kind, plural in (("ClusterRoleBinding", "clusterrolebindings"), ("RoleBinding", "rolebindings")):
        answer = api.request("GET", f"{rbac}/{plural}")
        answer.raise_for_status()
        for binding in answer.json()["items"]:
            subjects = binding.get("subjects") or []
            if not any(
                s.get("kind") == "ServiceAccount"
                and s.get("name") == source
                and s.get("namespace") == namespace
                for s in subjects
            ):
                continue
            where = binding["metadata"].get("namespace")
            name = f"{binding['metadata']['name']}-{account}"
            body = {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": kind,
                "metadata": {"name": name, **({"namespace": where} if where else {})},
                "roleRef": binding["roleRef"],
                "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
            }
            url = f"{rbac}/namespaces/{where}/{plural}" if where else f"{rbac}/{plural}"
            api.request("POST", url, json=body).raise_for_status()
            made.append((plural, where, name))
    return made


def revoke(api: Api, namespace: str, account: str, bindings: list[tuple[str, str | None, str]]) -> None:
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    for plural, where, name in bindings:
        url = f"{rbac}/namespaces/{where}/{plural}/{name}" if where else f"{rbac}/{plural}/{name}"
        api.request("DELETE", url)
    api.delete("ServiceAccount", namespace, account)


def cheap_model(name: str, namespace: str, pool: str) -> dict[str, Any]:
    return batched_model(
        name,
        namespace,
        resources={"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}},
        replicas=1,
        autoscaling={"enabled": False},
        tolerations=[pool_toleration(pool)],
        server={"preStopSeconds": 0, "drainTimeoutSeconds": 0},
    )


def apply_all(env: dict[str, str], models: list[dict[str, Any]]) -> None:
    """One `kubectl apply` of them all (a List), as a GitOps sync of a folder does."""
    listed = {"apiVersion": "v1", "kind": "List", "items": models}
    run("kubectl", "apply", "--server-side", "-f", "-", env=env, stdin=yaml.safe_dump(listed))


def ready_count(api: Api, namespace: str) -> int:
    return sum(
        1
        for model in api.list("BatchedModel", namespace)
        if (condition(model, "Ready") or {}).get("status") == "True"
        and (model.get("status") or {}).get("readyReplicas") == 1
    )


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM), what a container's memory limit is checked against."""
    text = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^VmHWM:\s+(\d+) kB", text, re.MULTILINE)
    assert found is not None, text
    return int(found.group(1)) * 1024


def cpu_seconds(pid: int) -> float:
    """The process's CPU time so far, user and system (/proc/PID/stat's utime and stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
    assert found is not None, text
    return int(found.group(1)) * 1024


_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}


def quantity_bytes(value: str) -> int:
    for suffix, factor in _UNITS.items():
        if value.endswith(suffix):
            return int(float(value[: -len(suffix)]) * factor)
    return int(value)


def chart_operator_resources() -> dict[str, dict[str, str]]:
    values = yaml.safe_load((ROOT / "charts" / "carpool" / "values.yaml").read_text())
    return dict(values["operator"]["resources"])


def chart_memory_limit_bytes() -> int:
    return quantity_bytes(chart_operator_resources()["limits"]["memory"])


@dataclass(frozen=True)
class Requests:
    """The operator's API requests in a window of the audit log."""

    total: int
    by_verb: dict[str, int]
    by_resource: dict[str, int]

    def line(self) -> str:
        verbs = ", ".join(
            f"{verb} {count}" for verb, count in sorted(self.by_verb.items(), key=lambda x: -x[1])
        )
        return f"{self.total} ({verbs})"


def count_requests(
    events: Iterable[dict[str, Any]],
    user: str,
    since: str = "",
    until: str = "",
    namespace: str | None = None,
) -> Requests:
    """Requests `user` made between two audit timestamps (`stageTimestamp`, RFC 3339 with microseconds,
    which sort as text). Watches are counted once each (their start), as every request is. With
    `namespace`, only requests in it and those in no namespace (cluster-wide watches and lists): the
    operator also acts on models that other tests left in namespaces being deleted."""
    by_verb: collections.Counter[str] = collections.Counter()
    by_resource: collections.Counter[str] = collections.Counter()
    for event in events:
        if (event.get("user") or {}).get("username") != user:
            continue
        if event.get("stage") != ("ResponseStarted" if event.get("verb") == "watch" else "ResponseComplete"):
            continue
        stamp = str(event.get("stageTimestamp") or "")
        if (since and stamp < since) or (until and stamp >= until):
            continue
        ref = event.get("objectRef") or {}
        if namespace is not None and ref.get("namespace") not in (None, namespace):
            continue
        resource = str(ref.get("resource") or "?") + (
            f"/{ref['subresource']}" if ref.get("subresource") else ""
        )
        by_verb[str(event.get("verb"))] += 1
        by_resource[resource] += 1
    return Requests(sum(by_verb.values()), dict(by_verb), dict(by_resource))
