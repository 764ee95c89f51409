"""Autoscalers on queue depth: an autoscaling/v2 HPA on the `carpool_queue_depth` pods metric, or a
KEDA ScaledObject with a Prometheus trigger (which can scale to zero)."""

from __future__ import annotations

from typing import Any

from carpool.operator.resources.labels import standard_labels
from carpool.operator.spec import BatchedModelSpec

QUEUE_METRIC = "carpool_queue_depth"

DEFAULT_BEHAVIOR: dict[str, Any] = {
    # Queues fill fast: scale up at once, by whichever policy adds more pods.
    "scaleUp": {
        "stabilizationWindowSeconds": 0,
        "selectPolicy": "Max",
        "policies": [
            {"type": "Percent", "value": 100, "periodSeconds": 30},
            {"type": "Pods", "value": 4, "periodSeconds": 30},
        ],
    },
    # Queue depth is bursty and new pods are slow (load + warm-up): scale down only after five minutes
    # of lower demand, at most half the pods a minute, so the replica count does not flap.
    "scaleDown": {
        "stabilizationWindowSeconds": 300,
        "selectPolicy": "Min",
        "policies": [{"type": "Percent", "value": 50, "periodSeconds": 60}],
    },
}


def _target(value: float) -> str:
    """A quantity string for a target value (`8`, `2.5` -> `2500m`)."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"


def horizontal_pod_autoscaler(spec: BatchedModelSpec, name: str) -> dict[str, Any]:
    scaling = spec.autoscaling
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "labels": standard_labels(name)},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": QUEUE_METRIC},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": _target(scaling.target_queue_depth),
                        },
                    },
                }
            ],
            "behavior": scaling.behavior if scaling.behavior is not None else DEFAULT_BEHAVIOR,
        },
    }


def default_query(served_name: str, namespace: str) -> str:
    return f'sum({QUEUE_METRIC}{{namespace="{namespace}",model="{served_name}"}})'


def scaled_object(spec: BatchedModelSpec, name: str, namespace: str, served_name: str) -> dict[str, Any]:
    scaling = spec.autoscaling
    keda = scaling.keda
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": name, "labels": standard_labels(name)},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "pollingInterval": keda.polling_interval_seconds,
            "cooldownPeriod": keda.cooldown_period_seconds,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": scaling.behavior if scaling.behavior is not None else DEFAULT_BEHAVIOR,
                },
            },
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": keda.server_address,
                        "query": keda.query or default_query(served_name, namespace),
                        # KEDA parses these as plain numbers, not Kubernetes quantities.
                        "threshold": f"{scaling.target_queue_depth:g}",
                        "activationThreshold": f"{keda.activation_threshold:g}",
                    },
                }
            ],
        },
    }
