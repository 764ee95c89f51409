"""The Deployment of runtime pods: probes on the runtime's health paths (`probes`), volumes and mounts
(`volumes`), the optional `fetch` init container (`fetch`), a rollout strategy sized for GPU pools
(`rollout`), ports and Secrets that follow `auth` and `tls` (`access`), a drain-aware shutdown, and a
locked-down security context.

Shutdown: preStop sleeps while the endpoint controllers remove the pod from the Service, then SIGTERM
lets the runtime drain for `server.drainTimeoutSeconds`; the grace period covers both plus a margin.
A crash leaves its reason where the operator reads it: `terminationMessagePolicy:
FallbackToLogsOnError` (the runtime writes its fatal start-up error to /dev/termination-log; when it
wrote nothing, the kubelet uses the log tail).
"""

from __future__ import annotations

import math
from typing import Any

from carpool.operator.resources.access import container_ports, metrics_port
from carpool.operator.resources.fetch import fetch_container
from carpool.operator.resources.labels import (
    CONFIG_DIR,
    CONFIG_FILE,
    CONFIG_HASH_ANNOTATION,
    selector_labels,
    standard_labels,
)
from carpool.operator.resources.probes import probes
from carpool.operator.resources.rollout import strategy
from carpool.operator.resources.volumes import cache_env, pod_volumes, runtime_mounts
from carpool.operator.spec import BatchedModelSpec

PRE_STOP_SECONDS = 5
"""Time for endpoint removal to reach the load balancers and kube-proxies before SIGTERM."""

GRACE_MARGIN_SECONDS = 10
RUN_AS = 65532
"""The runtime image's numeric user (Dockerfile `USER 65532:65532`)."""


def termination_grace_seconds(drain_seconds: float) -> int:
    """Endpoint removal, the runtime's drain (`RuntimeConfig.drain_timeout`), then a margin to exit."""
    return PRE_STOP_SECONDS + math.ceil(drain_seconds) + GRACE_MARGIN_SECONDS


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


def _container(spec: BatchedModelSpec) -> dict[str, Any]:
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
    env += [var.model_dump(by_alias=True, exclude_none=True) for var in spec.env]
    container: dict[str, Any] = {
        "name": "runtime",
        "image": spec.effective_image(),
        "command": ["carpool", "serve"],
        "ports": container_ports(spec) + _grpc_port(spec),
        "env": env,
        "resources": resources,
        "volumeMounts": runtime_mounts(spec),
        **probes(spec),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_SECONDS)]}}},
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    return container


def _pod_spec(spec: BatchedModelSpec, name: str, drain_seconds: float) -> dict[str, Any]:
    pod: dict[str, Any] = {}
    if spec.model.fetches():
        pod["initContainers"] = [fetch_container(spec, _container_security())]
    pod |= {
        "containers": [_container(spec)],
        "terminationGracePeriodSeconds": termination_grace_seconds(drain_seconds),
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


def deployment(spec: BatchedModelSpec, name: str, config_hash: str, drain_seconds: float) -> dict[str, Any]:
    """The Deployment. With autoscaling on, `spec.replicas` is left out: the autoscaler owns it.
    `drain_seconds`: how long the runtime drains on SIGTERM (its config's `drain_timeout()`)."""
    annotations = {
        **spec.pod_annotations,
        CONFIG_HASH_ANNOTATION: config_hash,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(metrics_port(spec)),
        "prometheus.io/path": "/metrics",
    }
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
            "template": {
                "metadata": {
                    "labels": {**spec.pod_labels, **standard_labels(name)},
                    "annotations": annotations,
                },
                "spec": _pod_spec(spec, name, drain_seconds),
            },
        },
    }
    if not spec.autoscaling.enabled:
        body["spec"]["replicas"] = spec.replicas
    return body


def initial_replicas(spec: BatchedModelSpec) -> int:
    """Replicas of a newly created Deployment; afterwards the autoscaler (or spec.replicas) decides."""
    return spec.autoscaling.min_replicas if spec.autoscaling.enabled else spec.replicas
