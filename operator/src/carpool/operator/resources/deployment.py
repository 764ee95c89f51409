"""The Deployment of runtime pods: probes on the runtime's health paths (`probes`), volumes and mounts
(`volumes`), the optional `fetch` init container (`fetch`), a rollout strategy sized for GPU pools
(`rollout`), ports and Secrets that follow `auth` and `tls` (`access`), a drain-aware shutdown, and a
locked-down security context.

Shutdown: preStop sleeps (`server.preStopSeconds`) while the endpoint controllers remove the pod from the
Service and kube-proxies and load balancers follow, then SIGTERM lets the runtime drain for
`server.drainTimeoutSeconds`; the grace period covers both plus a margin.
A crash leaves its reason where the operator reads it: `terminationMessagePolicy:
FallbackToLogsOnError` (the runtime writes its fatal start-up error to /dev/termination-log; when it
wrote nothing, the kubelet uses the log tail).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from carpool.operator.resources.access import container_ports, metrics_port
from carpool.operator.resources.fetch import fetch_container
from carpool.operator.resources.labels import (
    CONFIG_DIR,
    CONFIG_FILE,
    CONFIG_HASH_ANNOTATION,
    ROLE_LABEL,
    WORKER,
    selector_labels,
    standard_labels,
)
from carpool.operator.resources.probes import probes
from carpool.operator.resources.rollout import strategy
from carpool.operator.resources.volumes import cache_env, pod_volumes, runtime_mounts
from carpool.operator.spec import BatchedModelSpec

Role = Literal["leader", "worker"] | None
"""A pod's role in a LeaderWorkerSet group; None for the Deployment's pods."""

NODE_RANK_ENV = "CARPOOL_MODEL__NODE_RANK"
"""The runtime's `model.node_rank`, set in every pod of a group (0 for the leader)."""
LWS_WORKER_INDEX_ENV = "LWS_WORKER_INDEX"
"""What the LeaderWorkerSet's pod webhook sets in each pod of a group: its index, 0 for the leader
(with `LWS_LEADER_ADDRESS`, which the runtime reads itself, and `LWS_GROUP_SIZE`)."""

GRACE_MARGIN_SECONDS = 10
RUN_AS = 65532
"""The runtime image's numeric user (Dockerfile `USER 65532:65532`)."""


def termination_grace_seconds(pre_stop_seconds: int, drain_seconds: float) -> int:
    """Endpoint removal, the runtime's drain (`RuntimeConfig.drain_timeout`), then a margin to exit."""
    return pre_stop_seconds + math.ceil(drain_seconds) + GRACE_MARGIN_SECONDS


def _quantities(values: dict[str, int | str]) -> dict[str, str]:
    # Quantities as strings: the API server stores them so, and the drift check compares like with like.
    return {key: str(value) for key, value in values.items()}


def _grpc_port(spec: BatchedModelSpec) -> list[dict[str, Any]]:
    """The runtime's gRPC port (`spec.server.grpcPort`; none when 0)."""
    if not spec.server.grpc_port:
        return []
    return [{"name": spec.server.GRPC_PORT_NAME, "containerPort": spec.server.grpc_port, "protocol": "TCP"}]


def _container_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container(spec: BatchedModelSpec, role: Role = None) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if spec.resources.requests:
        resources["requests"] = _quantities(spec.resources.requests)
    if spec.resources.limits:
        resources["limits"] = _quantities(spec.resources.limits)
    env: list[dict[str, Any]] = [{"name": "CARPOOL_CONFIG", "value": f"{CONFIG_DIR}/{CONFIG_FILE}"}]
    env += cache_env(spec)
    if spec.model.fetches():
        # The fetch init container has put the model in the cache: never download inside the startup
        # budget (a missing file is then an error that says so, not a silent download).
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    if role is not None:
        # The pod's place in its LeaderWorkerSet group (0: the leader). The LWS webhook puts its
        # LWS_* variables first in the list, so the reference resolves.
        env.append({"name": NODE_RANK_ENV, "value": f"$({LWS_WORKER_INDEX_ENV})"})
    env += [var.model_dump(by_alias=True, exclude_none=True) for var in spec.env]
    container: dict[str, Any] = {
        "name": "runtime",
        "image": spec.effective_image(),
        "command": ["carpool", "serve"],
    }
    if role != WORKER:
        container["ports"] = container_ports(spec) + _grpc_port(spec)
    else:  # the worker's health endpoints (`carpool.runtime.vllm.group`), which the probes name
        container["ports"] = container_ports(spec)[:1]
    container |= {
        "env": env,
        "resources": resources,
        "volumeMounts": runtime_mounts(spec),
    }
    # A worker serves no API, but answers the same probes for the group as its leader sees it: ready only
    # while the leader is, live while its ranks run; on SIGTERM it keeps its ranks until the leader has
    # drained (`carpool.runtime.vllm.group`). The same preStop pause: both get SIGTERM together.
    container |= {
        **probes(spec),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(spec.server.pre_stop_seconds)]}}},
    }
    container |= {
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    return container


def _pod_spec(spec: BatchedModelSpec, name: str, drain_seconds: float, role: Role) -> dict[str, Any]:
    pod: dict[str, Any] = {}
    if spec.model.fetches():
        pod["initContainers"] = [fetch_container(spec, _container_security())]
    grace = termination_grace_seconds(spec.server.pre_stop_seconds, drain_seconds)
    pod |= {
        "containers": [_container(spec, role)],
        "terminationGracePeriodSeconds": grace,
        "enableServiceLinks": False,
        "automountServiceAccountToken": spec.service_account_name is not None,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumes": pod_volumes(spec, name),
    }
    optional: dict[str, Any] = {
        "nodeSelector": spec.node_selector or None,
        "tolerations": spec.tolerations or None,
        "affinity": spec.affinity,
        "topologySpreadConstraints": spec.topology_spread_constraints or None,
        "runtimeClassName": spec.runtime_class_name,
        "priorityClassName": spec.priority_class_name,
        "serviceAccountName": spec.service_account_name,
        "imagePullSecrets": [{"name": secret} for secret in spec.image_pull_secrets] or None,
    }
    pod.update({key: value for key, value in optional.items() if value is not None})
    return pod


def pod_template(
    spec: BatchedModelSpec, name: str, config_hash: str, drain_seconds: float, role: Role = None
) -> dict[str, Any]:
    """The runtime pods' template: of the Deployment (`role` None), or of a LeaderWorkerSet group's
    leader or workers (`LEADER`, `WORKER`). Only pods that serve HTTP are scraped."""
    annotations: dict[str, str] = {**spec.pod_annotations, CONFIG_HASH_ANNOTATION: config_hash}
    if role != WORKER:
        annotations |= {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(metrics_port(spec)),
            "prometheus.io/path": "/metrics",
        }
    labels = {**spec.pod_labels, **standard_labels(name)}
    if role is not None:
        labels[ROLE_LABEL] = role
    return {
        "metadata": {"labels": labels, "annotations": annotations},
        "spec": _pod_spec(spec, name, drain_seconds, role),
    }


def deployment(spec: BatchedModelSpec, name: str, config_hash: str, drain_seconds: float) -> dict[str, Any]:
    """The Deployment. With autoscaling on, `spec.replicas` is left out: the autoscaler owns it.
    `drain_seconds`: how long the runtime drains on SIGTERM (its config's `drain_timeout()`)."""
    body: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": standard_labels(name)},
        "spec": {
            "selector": {"matchLabels": selector_labels(name)},
            "revisionHistoryLimit": 3,
            # A rollout is stuck only once a new pod has had its whole startup budget and more.
            "progressDeadlineSeconds": spec.startup_timeout_seconds + 300,
            "strategy": strategy(spec),
            "template": pod_template(spec, name, config_hash, drain_seconds),
        },
    }
    if not spec.autoscaling.enabled:
        body["spec"]["replicas"] = spec.replicas
    return body


def initial_replicas(spec: BatchedModelSpec) -> int:
    """Replicas of a newly created Deployment; afterwards the autoscaler (or spec.replicas) decides."""
    return spec.autoscaling.min_replicas if spec.autoscaling.enabled else spec.replicas
