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
- `ModelFetchFailed`: the same for the `fetch` init container (download or verification of the model).

Problems are ordered by how surely they block the pod; the reconciler reports the first one and how
many pods share it.
"""

from __future__ import annotations

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
    if not found:
        return None
    return min(found, key=lambda problem: _ORDER.index(problem[0]))


def pod_problems(pods: Iterable[Mapping[str, Any]]) -> list[PodProblem]:
    """Problems of pods that are not being deleted, grouped by reason, the most blocking first."""
    grouped: dict[str, PodProblem] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        found = pod_problem(pod)
        if found is None:
            continue
        reason, message = found
        grouped.setdefault(reason, PodProblem(reason, message)).pods.append(str(meta.get("name", "?")))
    return sorted(grouped.values(), key=lambda problem: _ORDER.index(problem.reason))
