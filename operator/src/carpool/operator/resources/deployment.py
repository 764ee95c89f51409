"""The Deployment of runtime pods: probes on the runtime's health paths, a drain-aware shutdown, and a
locked-down security context.

Timings, and why:
- startup probe: the runtime answers /v2/health/ready only after loading and warm-up, so the startup
  probe (on /v2/health/live, which answers as soon as the server listens) gets the whole
  `startupTimeoutSeconds` budget (period x failureThreshold) before the kubelet may restart the pod;
- readiness on /v2/health/ready: 503 until warm-up has finished and again while draining;
- shutdown: preStop sleeps while the endpoint controllers remove the pod from the Service, then SIGTERM
  lets the runtime drain for `server.drainTimeoutSeconds`; the grace period covers both plus a margin.
"""

from __future__ import annotations

import math
from typing import Any

from carpool.operator import RUNTIME_PORT
from carpool.operator.resources.access import metrics_port, secure_pod
from carpool.operator.resources.labels import (
    CONFIG_DIR,
    CONFIG_FILE,
    CONFIG_HASH_ANNOTATION,
    config_map_name,
    selector_labels,
    standard_labels,
)
from carpool.operator.spec import BatchedModelSpec

PRE_STOP_SECONDS = 5
"""Time for endpoint removal to reach the load balancers and kube-proxies before SIGTERM."""

GRACE_MARGIN_SECONDS = 10
STARTUP_PERIOD_SECONDS = 5
CACHE_DIR = "/var/cache/carpool"
RUN_AS = 65532
"""The runtime image's numeric user (Dockerfile `USER 65532:65532`)."""


def termination_grace_seconds(spec: BatchedModelSpec) -> int:
    return PRE_STOP_SECONDS + math.ceil(spec.server.drain_timeout_seconds) + GRACE_MARGIN_SECONDS


def _quantities(values: dict[str, int | str]) -> dict[str, str]:
    # Quantities as strings: the API server stores them so, and the drift check compares like with like.
    return {key: str(value) for key, value in values.items()}


def _container(spec: BatchedModelSpec) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if spec.resources.requests:
        resources["requests"] = _quantities(spec.resources.requests)
    if spec.resources.limits:
        resources["limits"] = _quantities(spec.resources.limits)
    env: list[dict[str, Any]] = [
        {"name": "CARPOOL_CONFIG", "value": f"{CONFIG_DIR}/{CONFIG_FILE}"},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        # The root filesystem is read-only: libraries that write under $HOME (compiler caches) use /tmp.
        {"name": "HOME", "value": "/tmp"},
    ]
    env += [var.model_dump(by_alias=True, exclude_none=True) for var in spec.env]
    container: dict[str, Any] = {
        "name": "runtime",
        "image": spec.effective_image(),
        "command": ["carpool", "serve"],
        "ports": [{"name": "http", "containerPort": RUNTIME_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": resources,
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "model-cache", "mountPath": CACHE_DIR},
        ],
        "startupProbe": {
            "httpGet": {"path": "/v2/health/live", "port": "http"},
            "periodSeconds": STARTUP_PERIOD_SECONDS,
            "timeoutSeconds": 3,
            "failureThreshold": math.ceil(spec.startup_timeout_seconds / STARTUP_PERIOD_SECONDS),
        },
        "readinessProbe": {
            "httpGet": {"path": "/v2/health/ready", "port": "http"},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 2,
            "successThreshold": 1,
        },
        "livenessProbe": {
            "httpGet": {"path": "/v2/health/live", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_SECONDS)]}}},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    return container


def _pod_spec(spec: BatchedModelSpec, name: str) -> dict[str, Any]:
    cache: dict[str, Any] = {}
    if spec.model_cache_size_limit is not None:
        cache["sizeLimit"] = str(spec.model_cache_size_limit)
    pod: dict[str, Any] = {
        "containers": [_container(spec)],
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "enableServiceLinks": False,
        "automountServiceAccountToken": spec.service_account_name is not None,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumes": [
            {
                "name": "config",
                "configMap": {
                    "name": config_map_name(name),
                    "items": [{"key": CONFIG_FILE, "path": CONFIG_FILE}],
                },
            },
            {"name": "tmp", "emptyDir": {}},
            {"name": "model-cache", "emptyDir": cache},
        ],
    }
    optional: dict[str, Any] = {
        "nodeSelector": spec.node_selector or None,
        "tolerations": spec.tolerations or None,
        "affinity": spec.affinity,
        "runtimeClassName": spec.runtime_class_name,
        "priorityClassName": spec.priority_class_name,
        "serviceAccountName": spec.service_account_name,
        "imagePullSecrets": [{"name": secret} for secret in spec.image_pull_secrets] or None,
    }
    pod.update({key: value for key, value in optional.items() if value is not None})
    secure_pod(spec, pod)
    return pod


def deployment(spec: BatchedModelSpec, name: str, config_hash: str) -> dict[str, Any]:
    """The Deployment. With autoscaling on, `spec.replicas` is left out: the autoscaler owns it."""
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
            # Keep serving capacity during rollouts: a new pod must be warm before an old one goes.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": standard_labels(name), "annotations": annotations},
                "spec": _pod_spec(spec, name),
            },
        },
    }
    if not spec.autoscaling.enabled:
        body["spec"]["replicas"] = spec.replicas
    return body


def initial_replicas(spec: BatchedModelSpec) -> int:
    """Replicas of a newly created Deployment; afterwards the autoscaler (or spec.replicas) decides."""
    return spec.autoscaling.min_replicas if spec.autoscaling.enabled else spec.replicas
