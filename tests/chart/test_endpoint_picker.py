"""The chart's endpoint pickers (`endpointPicker`): per pool, what the upstream `inferencepool` chart
renders for its EPP, named and labelled as the operator's InferencePool and NetworkPolicy expect.

The picker running with these objects (its arguments, config and Role) against a real API server and
carpool pods: tests/cluster/test_endpoint_picker.py.
"""

from __future__ import annotations

from typing import Any

import yaml

from carpool.operator.resources.inferencepool import (
    ENDPOINT_PICKER_PORT,
    endpoint_picker_name,
    endpoint_picker_pods,
)
from tests.chart.conftest import CHART, Render, find

PICKERS = CHART / "ci" / "endpoint-picker-values.yaml"
KINDS = ["ConfigMap", "Deployment", "NetworkPolicy", "Role", "RoleBinding", "Service", "ServiceAccount"]


def _of(objects: list[dict[str, Any]], pool: str, namespace: str) -> dict[str, dict[str, Any]]:
    found = {
        o["kind"]: o
        for o in objects
        if o["metadata"]["name"] == endpoint_picker_name(pool) and o["metadata"].get("namespace") == namespace
    }
    assert sorted(found) == KINDS, sorted(found)
    return found


def _args(deployment: dict[str, Any]) -> list[str]:
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def test_off_by_default_and_without_pools(render: Render) -> None:
    assert not find(render(), "Role")
    assert not [o for o in render() if o["metadata"]["name"].endswith("-epp")]
    assert not [
        o for o in render(values={"endpointPicker": {"enabled": True}}) if "epp" in o["metadata"]["name"]
    ]


def test_each_pool_gets_its_picker_in_its_namespace_where_its_inference_pool_points(render: Render) -> None:
    objects = render(files=(PICKERS,))
    for pool, namespace in (("llama", "ml-serving"), ("mistral", "team-a")):
        picker = _of(objects, pool, namespace)
        service = picker["Service"]["spec"]
        (ext_proc,) = [p for p in service["ports"] if p["port"] == ENDPOINT_PICKER_PORT]
        assert ext_proc["targetPort"] == "grpc" and ext_proc["appProtocol"] == "grpc"
        template = picker["Deployment"]["spec"]["template"]
        # The pods the Service selects carry the label the runtime pods' NetworkPolicy admits.
        assert service["selector"] == endpoint_picker_pods(pool)
        assert endpoint_picker_pods(pool).items() <= template["metadata"]["labels"].items()
        assert template["spec"]["serviceAccountName"] == picker["ServiceAccount"]["metadata"]["name"]
        args = _args(picker["Deployment"])
        assert f"--pool-name={pool}" in args and f"--pool-namespace={namespace}" in args
        assert "--grpc-port=9002" in args and "--grpc-health-port=9003" in args


def test_flags_come_from_the_values_and_a_pools_own_win(render: Render) -> None:
    objects = render(files=(PICKERS,))
    llama = _args(_of(objects, "llama", "ml-serving")["Deployment"])
    mistral = _args(_of(objects, "mistral", "team-a")["Deployment"])
    assert "--v=2" in llama and "--v=3" in mistral and "--v=2" not in mistral
    assert "--model-server-metrics-port=9090" in mistral
    assert "--model-server-metrics-port=9090" not in llama
    for args in (llama, mistral):
        assert "--tracing=false" in args
        # Refused by the picker since v1.5.0 (it reads vllm:kv_cache_usage_perc by default).
        assert not any(arg.startswith("--kv-cache-usage-percentage-metric") for arg in args)
        assert "--ha-enable-leader-election" in args  # replicas: 2


def test_the_config_file_is_the_configmaps_and_scores_queue_kv_prefix_and_lora(render: Render) -> None:
    picker = _of(
        render(values={"endpointPicker": {"enabled": True, "pools": [{"name": "m"}]}}), "m", "carpool-system"
    )
    pod = picker["Deployment"]["spec"]["template"]["spec"]
    (mount,) = pod["containers"][0]["volumeMounts"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == picker["ConfigMap"]["metadata"]["name"]
    assert f"--config-file={mount['mountPath']}/config.yaml" in pod["containers"][0]["args"]
    config = yaml.safe_load(picker["ConfigMap"]["data"]["config.yaml"])
    assert config["kind"] == "EndpointPickerConfig"
    (profile,) = config["schedulingProfiles"]
    weights = {p["pluginRef"]: p["weight"] for p in profile["plugins"]}
    assert weights == {
        "queue-scorer": 2,
        "kv-cache-utilization-scorer": 2,
        "prefix-cache-scorer": 3,
        "lora-affinity-scorer": 1,
    }
    # Flow control (holding requests while the pool has no Ready pod: scale from zero) is off as upstream
    # ships it; its bounds are in place for whoever turns it on.
    assert config["featureGates"] == []
    assert config["flowControl"] == {"maxRequests": "10000", "defaultRequestTTL": "600s"}
    assert "--ha-enable-leader-election" not in pod["containers"][0]["args"]  # one replica


def test_the_role_reads_what_the_picker_watches_and_leases_only_with_replicas(render: Render) -> None:
    one = _of(
        render(values={"endpointPicker": {"enabled": True, "pools": [{"name": "m"}]}}), "m", "carpool-system"
    )
    rules = {(r["apiGroups"][0], r["resources"][0]): r["verbs"] for r in one["Role"]["rules"]}
    assert rules == {
        ("inference.networking.k8s.io", "inferencepools"): ["get", "list", "watch"],
        ("inference.networking.x-k8s.io", "inferenceobjectives"): ["get", "list", "watch"],
        ("", "pods"): ["get", "list", "watch"],
    }
    ha = _of(render(files=(PICKERS,)), "llama", "ml-serving")
    assert ("coordination.k8s.io", ["leases"]) in [
        (r["apiGroups"][0], r["resources"]) for r in ha["Role"]["rules"]
    ]
    binding = one["RoleBinding"]
    assert binding["roleRef"]["name"] == one["Role"]["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "m-epp", "namespace": "carpool-system"}]


def test_the_pickers_network_policy_opens_ext_proc_to_the_gateway_and_metrics_to_monitoring(
    render: Render,
) -> None:
    policy = _of(render(files=(PICKERS,)), "llama", "ml-serving")["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"] == endpoint_picker_pods("llama")
    ext_proc, metrics = policy["ingress"]
    assert ext_proc["ports"] == [{"port": 9002, "protocol": "TCP"}]
    assert ext_proc["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway-system"}}}
    ]
    assert metrics["ports"] == [{"port": 9090, "protocol": "TCP"}]
    assert metrics["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
