"""`spec.server.grpcPort`: the runtime's KServe v2 gRPC port reaches the config, the container, the Service
(a port named `grpc` with `appProtocol: grpc`) and the NetworkPolicy (the HTTP port's sources); 0 removes
it everywhere; the HTTP and metrics ports cannot be taken (pydantic and the CRD's CEL rule alike)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from carpool.operator.validation import SpecError
from tests.operator.factories import KUBERNETES_VERSIONS
from tests.operator.test_access import children, runtime_config
from tests.operator.test_crd import failed_rules


def ports(kids: dict[str, Any]) -> dict[str, Any]:
    container = kids["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    serving = kids["NetworkPolicy"]["spec"]["ingress"][0]
    return {
        "container": {port["name"]: port["containerPort"] for port in container["ports"]},
        "service": {port["name"]: port for port in kids["Service"]["spec"]["ports"]},
        "policy": [port["port"] for port in serving["ports"]],
        "config": runtime_config(kids).server.grpc_port,
    }


def test_the_grpc_port_is_served_exposed_and_opened_like_the_http_port() -> None:
    found = ports(children({"server": {"grpcPort": 9001}}))
    assert found["container"] == {"http": 8000, "grpc": 9001}
    assert found["service"]["grpc"] == {
        "name": "grpc",
        "port": 9001,
        "targetPort": "grpc",
        "protocol": "TCP",
        "appProtocol": "grpc",
    }
    assert found["policy"] == [8000, 9001]
    assert found["config"] == 9001
    default = ports(children({}))
    assert default["container"]["grpc"] == default["service"]["grpc"]["port"] == default["config"] == 8001


def test_under_tls_the_grpc_port_keeps_its_name_and_the_metrics_port_stays_closed_to_clients() -> None:
    found = ports(children({"tls": {"secretName": "minilm-tls"}}))
    assert found["container"] == {"https": 8000, "metrics": 9090, "grpc": 8001}
    assert set(found["service"]) == {"https", "grpc"}
    assert found["policy"] == [8000, 8001]


def test_grpc_port_zero_turns_grpc_off_everywhere() -> None:
    found = ports(children({"server": {"grpcPort": 0}}))
    assert found["container"] == {"http": 8000}
    assert set(found["service"]) == {"http"}
    assert found["policy"] == [8000]
    assert found["config"] == 0


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_children_with_a_grpc_port_pass_the_official_schema(version: str) -> None:
    for kind, manifest in children({"server": {"grpcPort": 9001}}).items():
        if kind != "ScaledObject":
            kubernetes_validate.validate(manifest, version, strict=True)


@pytest.mark.parametrize("taken", [8000, 9090])
def test_the_http_and_metrics_ports_cannot_be_the_grpc_port(taken: int) -> None:
    with pytest.raises(SpecError, match=f"grpcPort {taken} must differ"):
        children({"server": {"grpcPort": taken}})
    assert any("grpcPort" in rule for rule in failed_rules({"server": {"grpcPort": taken}}))
    assert not failed_rules({"server": {"grpcPort": 8001}})
