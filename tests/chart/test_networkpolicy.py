"""The operator's NetworkPolicy, and the monitoring namespaces the chart hands the operator for the
runtime pods' NetworkPolicies."""

from __future__ import annotations

from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from tests.chart.conftest import ALL_FEATURES, KUBE_VERSIONS, Render, find, one

NAME_LABEL = "kubernetes.io/metadata.name"


def _args(objects: list[dict[str, Any]]) -> list[str]:
    args: list[str] = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize(
    "values",
    [
        {},
        {"monitoringNamespaces": []},
        {"networkPolicy": {"apiServer": {"cidrs": ["10.0.0.1/32", "fd00::1/128"]}}},
    ],
)
def test_the_policy_passes_the_kubernetes_schemas(
    render: Render, values: dict[str, Any], kube_version: str
) -> None:
    kubernetes_validate.validate(
        one(render(values=values, kube_version=kube_version), "NetworkPolicy"), kube_version, strict=True
    )


def test_the_operator_is_reached_only_by_prometheus_and_reaches_only_dns_and_the_api_server(
    render: Render,
) -> None:
    objects = render(files=(ALL_FEATURES,))
    policy = one(objects, "NetworkPolicy")["spec"]
    pod_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    (ingress,) = policy["ingress"]
    assert ingress == {
        "from": [{"namespaceSelector": {"matchLabels": {NAME_LABEL: "monitoring"}}}],
        "ports": [{"port": 9090, "protocol": "TCP"}],
    }
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
    dns, api = policy["egress"]
    assert dns == {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
    assert api == {"ports": [{"port": 443, "protocol": "TCP"}, {"port": 6443, "protocol": "TCP"}]}


def test_the_api_server_can_be_narrowed_to_its_addresses(render: Render) -> None:
    values = {"networkPolicy": {"apiServer": {"cidrs": ["10.0.0.1/32"], "ports": [6443]}}}
    _, api = one(render(values=values), "NetworkPolicy")["spec"]["egress"]
    assert api == {"ports": [{"port": 6443, "protocol": "TCP"}], "to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}]}


def test_monitoring_namespaces_reach_the_operator_and_the_runtime_pods(render: Render) -> None:
    objects = render(values={"monitoringNamespaces": ["prometheus", "victoria"]})
    (ingress,) = one(objects, "NetworkPolicy")["spec"]["ingress"]
    assert [peer["namespaceSelector"]["matchLabels"][NAME_LABEL] for peer in ingress["from"]] == [
        "prometheus",
        "victoria",
    ]
    assert [a for a in _args(objects) if a.startswith("--metrics-namespace")] == [
        "--metrics-namespace=prometheus",
        "--metrics-namespace=victoria",
    ]
    assert [a for a in _args(render()) if a.startswith("--metrics-namespace")] == [
        "--metrics-namespace=monitoring"
    ]


def test_no_monitoring_namespace_admits_no_scraper(render: Render) -> None:
    objects = render(values={"monitoringNamespaces": []})
    assert "ingress" not in one(objects, "NetworkPolicy")["spec"]  # Ingress listed, no rule: none admitted
    assert "--metrics-namespace=" in _args(objects)  # the operator's "none"


def test_the_policy_can_be_left_out(render: Render) -> None:
    assert not find(render(values={"networkPolicy": {"enabled": False}}), "NetworkPolicy")
