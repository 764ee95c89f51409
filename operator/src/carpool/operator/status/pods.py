"""Why runtime pods are not ready: a pure mapping from pod objects to a reason and a message.

A Deployment's status says only how many pods are ready; it cannot tell "still loading the model" from
"can never start". The operator lists its pods (by label selector, at the API server) and this module
reads what the scheduler and the kubelet wrote on them, so the BatchedModel's conditions and Events say
what a person must fix:

- `Unschedulable`: the scheduler's own message (`0/4 nodes are available: 4 Insufficient
  nvidia.com/gpu`), from the pod's `PodScheduled=False` condition;
- `ImagePullFailed`: `ErrImagePull`, `ImagePullBackOff`, `InvalidImageName` with the kubelet's message;
- `ContainerConfigError`: a missing Secret or ConfigMap key (`CreateContainerConfigError`);
- `OOMKilled`: the container was killed for exceeding its memory limit (now, or at its last restart
  while it is not ready again);
- `CrashLoopBackOff`: the container keeps exiting; the message carries its termination message, which
  the runtime fills with its fatal start-up error (`terminationMessagePolicy: FallbackToLogsOnError`
  adds the log tail when it wrote none), e.g. a 401 from the model hub;
- `ModelFetchFailed`: the same for the `fetch` init container (download or verification of the model);
- `NodeNotReady`: the pod's node stopped heart-beating and the node-lifecycle controller marked the pod
  not ready (its `Ready` condition False while the kubelet's own `ContainersReady` is still True: the
  kubelet never writes that pair for a pod without readiness gates); it is evicted once its toleration
  of `node.kubernetes.io/unreachable` or `not-ready` runs out (300 s by default);
- `StuckTerminating`: a deleted pod still there past its grace period (its `deletionTimestamp`): the
  kubelet of its node has not confirmed that it stopped, because the node is lost (taint-based eviction
  deleted it there, as its `DisruptionTarget` condition says). Its replacement is created at once (a
  ReplicaSet does not count a terminating pod); the pod object stays until the node comes back, is
  deleted, or is tainted `node.kubernetes.io/out-of-service` (then the pod garbage collector removes it).

Problems are ordered by how surely they block the pod; the reconciler reports the first one and how
many pods share it.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_MESSAGE = 600
"""Longest excerpt of a termination message kept in a condition (the rest is in the pod's status)."""

_PULL = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
_CONFIG = {"CreateContainerConfigError", "CreateContainerError"}
_ORDER = (
    "Unschedulable",
    "ImagePullFailed",
    "ContainerConfigError",
    "ModelFetchFailed",
    "OOMKilled",
    "CrashLoopBackOff",
    "NodeNotReady",
    "StuckTerminating",
)


@dataclass
class PodProblem:
    reason: str
    message: str
    pods: list[str] = field(default_factory=list)

    def summary(self, total: int) -> str:
        count = len(self.pods)
        who = f"pod {self.pods[0]}" if count == 1 else f"{count} of {total} pods (e.g. {self.pods[0]})"
        return f"{who}: {self.message}"


def _excerpt(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE else "..." + text[-MAX_MESSAGE:]


def _terminated(status: Mapping[str, Any]) -> Mapping[str, Any]:
    """The container's termination now, or its last one while it is not ready: the kubelet keeps
    `lastState` until the next termination, so a container that was OOM-killed once and has run ready
    since must not read as OOM-killed."""
    state = status.get("state") or {}
    if state.get("terminated"):
        return dict(state["terminated"])
    if status.get("ready"):
        return {}
    return (status.get("lastState") or {}).get("terminated") or {}


def _container_problem(status: Mapping[str, Any], init: bool) -> tuple[str, str] | None:
    name = status.get("name", "?")
    waiting = (status.get("state") or {}).get("waiting") or {}
    why = waiting.get("reason") or ""
    if why in _PULL:
        return "ImagePullFailed", f"{why}: {waiting.get('message') or status.get('image', '')}"
    if why in _CONFIG:
        return "ContainerConfigError", f"{why}: {waiting.get('message', '')}"
    terminated = _terminated(status)
    if terminated.get("reason") == "OOMKilled":
        return "OOMKilled", (
            f"container {name} was killed for exceeding its memory limit (OOMKilled); raise "
            "resources.limits.memory or lower batching.maxBatchTokens"
        )
    failed = terminated and terminated.get("exitCode", 0) != 0
    if why == "CrashLoopBackOff" or (init and failed):
        detail = terminated.get("message") or terminated.get("reason") or waiting.get("message") or ""
        code = terminated.get("exitCode")
        exit_text = f" (exit code {code})" if code is not None else ""
        if init:
            return "ModelFetchFailed", f"init container {name} failed{exit_text}: {_excerpt(str(detail))}"
        return "CrashLoopBackOff", f"container {name} keeps exiting{exit_text}: {_excerpt(str(detail))}"
    return None


def _parse_time(value: str) -> datetime.datetime | None:
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except (ValueError, AttributeError):
        return None


def _conditions(pod: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {str(c.get("type")): c for c in (pod.get("status") or {}).get("conditions") or []}


def _node_not_ready(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """The node-lifecycle controller's mark (`MarkPodsNotReady`): Ready False, ContainersReady True."""
    if (pod.get("spec") or {}).get("readinessGates"):
        return None  # there Ready False with ContainersReady True is a gate, not the node
    conditions = _conditions(pod)
    ready, containers = conditions.get("Ready") or {}, conditions.get("ContainersReady") or {}
    if ready.get("status") != "False" or containers.get("status") != "True":
        return None
    node = (pod.get("spec") or {}).get("nodeName") or "?"
    return "NodeNotReady", (
        f"node {node} stopped reporting (NotReady), and the node controller marked the pod not ready; "
        "it is evicted and replaced once its toleration of the node's unreachable/not-ready taint runs out"
    )


def stuck_terminating(pod: Mapping[str, Any], now: datetime.datetime) -> tuple[str, str] | None:
    """A deleted pod still there after its grace period ended (`deletionTimestamp` is that moment)."""
    deadline = _parse_time(str((pod.get("metadata") or {}).get("deletionTimestamp") or ""))
    if deadline is None or now < deadline:
        return None
    node = (pod.get("spec") or {}).get("nodeName") or "?"
    ended = deadline.strftime("%Y-%m-%dT%H:%M:%SZ")
    target = _conditions(pod).get("DisruptionTarget") or {}
    why = f" ({target.get('reason')}: {target.get('message')})" if target.get("status") == "True" else ""
    return "StuckTerminating", (
        f"deleted{why} but still terminating after its grace period ended at {ended}: the kubelet of node "
        f"{node} has not confirmed it stopped (the node is lost or unreachable); a replacement is "
        "created meanwhile, and the pod goes once the node returns, is deleted, or is tainted "
        "node.kubernetes.io/out-of-service"
    )


def next_deadline(pods: Iterable[Mapping[str, Any]], now: datetime.datetime) -> datetime.datetime | None:
    """The earliest end of a grace period still to come among deleted pods (when one may be stuck)."""
    ahead = [
        when
        for pod in pods
        if (when := _parse_time(str((pod.get("metadata") or {}).get("deletionTimestamp") or ""))) is not None
        and when > now
    ]
    return min(ahead, default=None)


def pod_problem(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """The reason this pod cannot become ready, or None (running, starting, loading or warming up)."""
    status = pod.get("status") or {}
    for condition in status.get("conditions") or []:
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == "Unschedulable"
        ):
            return "Unschedulable", condition.get("message") or "no node fits the pod"
    found: list[tuple[str, str]] = []
    for container in status.get("initContainerStatuses") or []:
        if (problem := _container_problem(container, init=True)) is not None:
            found.append(problem)
    for container in status.get("containerStatuses") or []:
        if (problem := _container_problem(container, init=False)) is not None:
            found.append(problem)
    if (lost := _node_not_ready(pod)) is not None:
        found.append(lost)
    if not found:
        return None
    return min(found, key=lambda problem: _ORDER.index(problem[0]))


def pod_problems(pods: Iterable[Mapping[str, Any]], now: datetime.datetime | None = None) -> list[PodProblem]:
    """Problems of pods, grouped by reason, the most blocking first. A pod being deleted is a problem
    only once it is stuck (past its grace period, which needs `now`)."""
    grouped: dict[str, PodProblem] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            found = stuck_terminating(pod, now) if now is not None else None
        else:
            found = pod_problem(pod)
        if found is None:
            continue
        reason, message = found
        grouped.setdefault(reason, PodProblem(reason, message)).pods.append(str(meta.get("name", "?")))
    return sorted(grouped.values(), key=lambda problem: _ORDER.index(problem.reason))
