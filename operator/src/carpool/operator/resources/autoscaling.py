"""Autoscalers: an autoscaling/v2 HPA on a pods metric, or a KEDA ScaledObject with a Prometheus trigger
(which can scale to zero). The metric is `carpool_queue_depth` held at a target per pod, or, for a
latency target, `carpool_slo_saturation` held at 1 per pod: each pod's load over the load at which it
meets the objective (`carpool.runtime.batching.saturation`), so the HPA's `ceil(replicas x average / 1)`
is the replica count that meets it.

A model routed through an InferencePool (`spec.routing: inferencePool`) is scaled on one more signal: the
requests its endpoint picker holds (`inference_extension_flow_control_queue_size` of the pool, the
picker's flow control queue), held at the same per-pod queue target. The picker holds a request while the
pool has no Ready pod or every pod is saturated, so those requests never reach a pod's queue: without
this metric a model at zero replicas would never start, and one whose pods are all saturated would not
grow. It is an External metric for the HPA (prometheus-adapter's `external` rules) and a second trigger
for KEDA; either takes the larger of the two proposals.

Both scale the workload through its scale subresource: the Deployment, or for a model split over several
nodes the LeaderWorkerSet, whose scale subresource counts groups and selects their leaders
(`.status.hpaPodSelector`), so the HPA averages the leaders' queue depth and adds or removes whole
groups."""

from __future__ import annotations

from typing import Any

from carpool.operator.resources.labels import (
    LWS_API_VERSION,
    LWS_KIND,
    leader_worker_set_name,
    standard_labels,
)
from carpool.operator.spec import BatchedModelSpec, Routing
from carpool.runtime.config import DEFAULT_RUNNING_SEQUENCES, Task

QUEUE_METRIC = "carpool_queue_depth"
PICKER_QUEUE_METRIC = "inference_extension_flow_control_queue_size"
"""Requests the endpoint picker's flow control holds, by pool (label `inference_pool`)."""
PICKER_POOL_LABEL = "inference_pool"
SATURATION_METRIC = "carpool_slo_saturation"
SATURATION_TARGET = 0.9
"""A pod at its objective reads 1. The HPA acts only outside a 10% band around its target (its
`tolerance`), so holding 0.9 keeps each pod between 0.81 and 0.99: under the objective, never up to 10%
past it."""

MAX_POLICY_PERIOD_SECONDS = 1800
"""The API server's bound on an HPA scaling policy's periodSeconds."""
MIN_POLICY_PERIOD_SECONDS = 30


def scale_up_period(spec: BatchedModelSpec) -> int:
    """The scale-up policy period: the startup budget, within the HPA's bounds."""
    return max(MIN_POLICY_PERIOD_SECONDS, min(MAX_POLICY_PERIOD_SECONDS, spec.startup_timeout_seconds))


def default_behavior(spec: BatchedModelSpec) -> dict[str, Any]:
    """The HPA behaviour unless `autoscaling.behavior` is set.

    Scale up: at once on the first high reading (no stabilisation window), by whichever adds more,
    100% or 4 pods, but that much only once per `startupTimeoutSeconds`. Why: a pod added now adds
    capacity only after it has loaded the model and warmed up, and until then the queue stays as deep
    as it was. Policies with a 30 s period would read that same queue every period and keep adding
    pods, running to maxReplicas before the first new pod serves. Limiting the pods added per
    startup budget lets each wave of new pods take effect before the next is sized from the queue.
    Scale down: queue depth is bursty and new pods are slow, so only after five minutes of lower
    demand, by at most half the pods a minute, and the replica count does not flap.
    """
    period = scale_up_period(spec)
    return {
        "scaleUp": {
            "stabilizationWindowSeconds": 0,
            "selectPolicy": "Max",
            "policies": [
                {"type": "Percent", "value": 100, "periodSeconds": period},
                {"type": "Pods", "value": 4, "periodSeconds": period},
            ],
        },
        "scaleDown": {
            "stabilizationWindowSeconds": 300,
            "selectPolicy": "Min",
            "policies": [{"type": "Percent", "value": 50, "periodSeconds": 60}],
        },
    }


DEFAULT_QUEUE_TARGET = 8.0
"""`autoscaling.targetQueueDepth` for embed, classify and rerank when unset."""

VLLM_GPU_RUNNING_SEQUENCES = 256
"""vLLM's OpenAI server's `max_num_seqs` on GPUs (`EngineArgs.get_batch_defaults`; 1024 on GPUs of 70 GiB or
more other than A100s, which the operator cannot see): the running-sequence limit of a GPU pod on vLLM
whose spec sets none."""

VLLM_CPU_RUNNING_SEQUENCES = 128
"""vLLM's OpenAI server's `max_num_seqs` on CPU (`EngineArgs.get_batch_defaults`, one rank), which carpool
leaves to vLLM there too (tests/vllm/test_release.py reads it from the tested release)."""


def running_sequences(spec: BatchedModelSpec) -> int:
    """The most sequences one replica decodes at once (task generate), as its engine resolves it."""
    if spec.generation is not None and spec.generation.max_running_sequences is not None:
        return spec.generation.max_running_sequences
    if spec.model.runs_vllm():
        return VLLM_GPU_RUNNING_SEQUENCES if spec.resources.gpus() else VLLM_CPU_RUNNING_SEQUENCES
    return DEFAULT_RUNNING_SEQUENCES


def queue_target(spec: BatchedModelSpec) -> float:
    """Waiting requests per pod the autoscaler aims at: `autoscaling.targetQueueDepth`, else for a
    generative model its running-sequence limit (a whole batch waiting adds a replica; a fixed 32 would
    add an 8-GPU replica while a 256-sequence engine still had room), else 8."""
    if spec.autoscaling.target is not None and spec.autoscaling.target.queue_depth is not None:
        return spec.autoscaling.target.queue_depth
    if spec.autoscaling.target_queue_depth is not None:
        return spec.autoscaling.target_queue_depth
    if spec.model.task is Task.GENERATE:
        return float(running_sequences(spec))
    return DEFAULT_QUEUE_TARGET


def _target(value: float) -> str:
    """A quantity string for a target value (`8`, `2.5` -> `2500m`)."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"


def signal(spec: BatchedModelSpec) -> tuple[str, float]:
    """The metric the autoscaler reads and the average per pod it holds."""
    if spec.autoscaling.latency_target() is not None:
        return SATURATION_METRIC, SATURATION_TARGET
    return QUEUE_METRIC, queue_target(spec)


def scale_target(spec: BatchedModelSpec, name: str) -> dict[str, str]:
    """What the autoscaler scales: the Deployment, or the LeaderWorkerSet of a multi-node model."""
    if spec.model.multi_node():
        return {"apiVersion": LWS_API_VERSION, "kind": LWS_KIND, "name": leader_worker_set_name(name)}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}


def picker_held(spec: BatchedModelSpec) -> bool:
    """Whether an endpoint picker holds this model's requests in front of its pods (scaled on too)."""
    return spec.routing is Routing.INFERENCE_POOL


def horizontal_pod_autoscaler(spec: BatchedModelSpec, name: str) -> dict[str, Any]:
    scaling = spec.autoscaling
    metric, target = signal(spec)
    metrics: list[dict[str, Any]] = [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": metric},
                "target": {"type": "AverageValue", "averageValue": _target(target)},
            },
        }
    ]
    if picker_held(spec):
        metrics.append(
            {
                "type": "External",
                "external": {
                    "metric": {
                        "name": PICKER_QUEUE_METRIC,
                        "selector": {"matchLabels": {PICKER_POOL_LABEL: name}},
                    },
                    "target": {"type": "AverageValue", "averageValue": _target(queue_target(spec))},
                },
            }
        )
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "labels": standard_labels(name)},
        "spec": {
            "scaleTargetRef": scale_target(spec, name),
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": metrics,
            "behavior": scaling.behavior if scaling.behavior is not None else default_behavior(spec),
        },
    }


def default_query(served_name: str, namespace: str, metric: str = QUEUE_METRIC) -> str:
    return f'sum({metric}{{namespace="{namespace}",model="{served_name}"}})'


def picker_query(name: str, namespace: str) -> str:
    """The requests the model's endpoint picker holds (its pool is named after the model)."""
    return f'sum({PICKER_QUEUE_METRIC}{{namespace="{namespace}",{PICKER_POOL_LABEL}="{name}"}})'


def scaled_object(spec: BatchedModelSpec, name: str, namespace: str, served_name: str) -> dict[str, Any]:
    scaling = spec.autoscaling
    keda = scaling.keda
    metric, target = signal(spec)
    triggers = [
        _prometheus_trigger(spec, keda.query or default_query(served_name, namespace, metric), target)
    ]
    if picker_held(spec):
        triggers.append(_prometheus_trigger(spec, picker_query(name, namespace), queue_target(spec)))
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": name, "labels": standard_labels(name)},
        "spec": {
            "scaleTargetRef": scale_target(spec, name),
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "pollingInterval": keda.polling_interval_seconds,
            "cooldownPeriod": keda.cooldown_period_seconds,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": scaling.behavior if scaling.behavior is not None else default_behavior(spec),
                },
            },
            "triggers": triggers,
        },
    }


def _prometheus_trigger(spec: BatchedModelSpec, query: str, target: float) -> dict[str, Any]:
    keda = spec.autoscaling.keda
    return {
        "type": "prometheus",
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": keda.server_address,
            "query": query,
            # KEDA parses these as plain numbers, not Kubernetes quantities.
            "threshold": f"{target:g}",
            "activationThreshold": f"{keda.activation_threshold:g}",
        },
    }
