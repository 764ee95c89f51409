"""Who may reach a BatchedModel's pods: the NetworkPolicy, API keys from a Secret, and TLS. Pure builders,
each child validated against the official Kubernetes schemas."""

from __future__ import annotations

from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from carpool.cli import main
from carpool.operator.resources import ChildRef, build_children
from carpool.runtime.config import RuntimeConfig
from tests.operator.factories import KUBERNETES_VERSIONS, batched_model

AUTH = {"auth": {"apiKeysSecret": {"name": "minilm-keys"}}}
TLS = {"tls": {"secretName": "minilm-tls"}}
SELECTOR = {"app.kubernetes.io/name": "carpool-runtime", "app.kubernetes.io/instance": "m"}

VARIANTS: dict[str, dict[str, Any]] = {
    "auth": AUTH,
    "tls": TLS,
    "auth-and-tls": {**AUTH, **TLS, "service": {"type": "LoadBalancer"}},
    "sources": {
        "networkPolicy": {
            "sameNamespace": False,
            "fromNamespaces": ["web", "batch"],
            "ingressFrom": [
                {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.9.0.0/16"]}},
                {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}},
                    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "ingress-nginx"}},
                },
            ],
        }
    },
    "deny-all": {"networkPolicy": {"sameNamespace": False}},
}


def children(spec: dict[str, Any], metrics_namespaces: tuple[str, ...] = ("monitoring",)) -> dict[str, Any]:
    built = build_children(batched_model("m", spec), metrics_namespaces)
    return {manifest["kind"]: manifest for manifest in built.manifests}


def runtime_config(kids: dict[str, Any]) -> RuntimeConfig:
    """The config the pods read, parsed as the runtime parses it."""
    return RuntimeConfig.model_validate(yaml.safe_load(kids["ConfigMap"]["data"]["runtime.yaml"]))


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_child_passes_the_official_schema(name: str, version: str) -> None:
    for kind, manifest in children(VARIANTS[name]).items():
        if kind != "ScaledObject":
            kubernetes_validate.validate(manifest, version, strict=True)


def test_by_default_the_same_namespace_reaches_the_api_and_monitoring_the_metrics() -> None:
    policy = children({})["NetworkPolicy"]
    assert policy["metadata"]["name"] == "m"
    assert policy["spec"] == {
        "podSelector": {"matchLabels": SELECTOR},
        "policyTypes": ["Ingress"],
        "ingress": [
            {
                "from": [{"podSelector": {}}],
                # The HTTP port and the gRPC port (8001 by default): the same sources reach both.
                "ports": [{"port": 8000, "protocol": "TCP"}, {"port": 8001, "protocol": "TCP"}],
            },
            {
                "from": [
                    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
                ],
                "ports": [{"port": 8000, "protocol": "TCP"}],
            },
        ],
    }
    # The policy selects exactly the Deployment's pods.
    deployment = children({})["Deployment"]
    assert deployment["spec"]["selector"]["matchLabels"] == policy["spec"]["podSelector"]["matchLabels"]


def test_named_sources_replace_the_namespace_and_no_rule_is_ever_open_to_all() -> None:
    rules = children(VARIANTS["sources"], metrics_namespaces=("prometheus", "prometheus"))["NetworkPolicy"]
    serving, metrics = rules["spec"]["ingress"]
    assert serving["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "web"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "batch"}}},
        *VARIANTS["sources"]["networkPolicy"]["ingressFrom"],
    ]
    assert metrics["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "prometheus"}}}
    ]
    # No source at all: the rule is left out (an empty `from` would admit every source); no rule: deny all.
    denied = children(VARIANTS["deny-all"], metrics_namespaces=())["NetworkPolicy"]["spec"]
    assert "ingress" not in denied and denied["policyTypes"] == ["Ingress"]
    only_metrics = children(VARIANTS["deny-all"])["NetworkPolicy"]["spec"]["ingress"]
    assert [rule["from"][0]["namespaceSelector"] for rule in only_metrics] == [
        {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    ]


def test_the_network_policy_can_be_turned_off_and_is_then_removed() -> None:
    built = build_children(batched_model("m", {"networkPolicy": {"enabled": False}}))
    assert "NetworkPolicy" not in {m["kind"] for m in built.manifests}
    assert ChildRef("networking.k8s.io/v1", "NetworkPolicy", "m") in built.absent


def test_api_keys_come_from_a_mounted_secret_never_the_config_map() -> None:
    kids = children({"auth": {"apiKeysSecret": {"name": "minilm-keys", "key": "api-keys.txt"}}})
    pod = kids["Deployment"]["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "api-keys"]
    assert volume["secret"] == {
        "secretName": "minilm-keys",
        "items": [{"key": "api-keys.txt", "path": "api-keys.txt"}],
        "defaultMode": 0o440,
    }
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "api-keys"]
    # A folder mount (no subPath), so the kubelet's updates reach the file and the runtime reloads it.
    assert mount == {"name": "api-keys", "mountPath": "/etc/carpool/auth", "readOnly": True}
    assert runtime_config(kids).server.api_keys_file is not None
    assert str(runtime_config(kids).server.api_keys_file) == "/etc/carpool/auth/api-keys.txt"
    assert "minilm-keys" not in kids["ConfigMap"]["data"]["runtime.yaml"]
    # Without auth, nothing is mounted and the runtime is open.
    assert runtime_config(children({})).server.api_keys_file is None


def test_tls_mounts_the_certificate_and_switches_probes_ports_and_metrics() -> None:
    kids = children(TLS)
    pod = kids["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert {"name": "tls", "secret": {"secretName": "minilm-tls", "defaultMode": 0o440}} in pod["volumes"]
    assert {"name": "tls", "mountPath": "/etc/carpool/tls", "readOnly": True} in container["volumeMounts"]
    assert container["ports"] == [
        {"name": "https", "containerPort": 8000, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 9090, "protocol": "TCP"},
        {"name": "grpc", "containerPort": 8001, "protocol": "TCP"},  # TLS too (the same certificate)
    ]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert (
            container[probe]["httpGet"]["scheme"] == "HTTPS"
            and container[probe]["httpGet"]["port"] == "https"
        )
    server = runtime_config(kids).server
    assert server.tls is not None and str(server.tls.cert_file) == "/etc/carpool/tls/tls.crt"
    assert str(server.tls.key_file) == "/etc/carpool/tls/tls.key" and server.metrics_port == 9090
    assert kids["Service"]["spec"]["ports"] == [
        {"name": "https", "port": 8000, "targetPort": "https", "protocol": "TCP"},
        {"name": "grpc", "port": 8001, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"},
    ]
    assert kids["Deployment"]["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9090"
    # Prometheus is admitted to the plain metrics port only, clients to the TLS port.
    serving, metrics = kids["NetworkPolicy"]["spec"]["ingress"]
    assert serving["ports"] == [{"port": 8000, "protocol": "TCP"}, {"port": 8001, "protocol": "TCP"}]
    assert metrics["ports"] == [{"port": 9090, "protocol": "TCP"}]
    assert build_children(batched_model("m", TLS)).endpoint == "https://m.ml.svc:8000"


def test_plain_http_keeps_the_runtime_contract() -> None:
    container = children({})["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "grpc", "containerPort": 8001, "protocol": "TCP"},
    ]
    assert "scheme" not in container["readinessProbe"]["httpGet"]
    assert runtime_config(children({})).server.metrics_port is None


def test_render_takes_the_metrics_namespaces_as_the_operator_does(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "m.yaml"
    model.write_text(yaml.safe_dump(batched_model("m", {})))

    def scrapers(*flags: str) -> list[Any]:
        assert main(["render", "-f", str(model), *flags]) == 0
        docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d and d["kind"] == "NetworkPolicy"]
        return [rule["from"] for rule in docs[0]["spec"]["ingress"][1:]]

    label = "kubernetes.io/metadata.name"
    assert scrapers() == [[{"namespaceSelector": {"matchLabels": {label: "monitoring"}}}]]
    assert scrapers("--metrics-namespace", "prom", "--metrics-namespace", "obs") == [
        [
            {"namespaceSelector": {"matchLabels": {label: "prom"}}},
            {"namespaceSelector": {"matchLabels": {label: "obs"}}},
        ]
    ]
    assert scrapers("--metrics-namespace=") == []


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"auth": {}}, "apiKeysSecret"),
        ({"auth": {"apiKeysSecret": {"name": "Not_A_Name"}}}, "name"),
        ({"tls": {"secretName": ""}}, "secretName"),
        ({"networkPolicy": {"fromNamespaces": ["UPPER"]}}, "fromNamespaces"),
        ({"networkPolicy": {"form": []}}, "form"),
    ],
)
def test_bad_access_settings_are_refused_with_the_field_named(spec: dict[str, Any], says: str) -> None:
    from carpool.operator.validation import SpecError

    with pytest.raises(SpecError, match=says):
        build_children(batched_model("m", spec))


EVERYTHING = {
    **AUTH,
    **TLS,
    "model": {"source": "org/gated", "cache": {"claimName": "c"}, "credentials": {"secretName": "hub"}},
    "shmSize": "1Gi",
    "volumes": [{"name": "extra", "configMap": {"name": "prompts"}}],
    "volumeMounts": [{"name": "extra", "mountPath": "/prompts"}],
}


def test_the_secrets_join_the_other_volumes_once_and_only_the_runtime_mounts_them() -> None:
    pod = children(EVERYTHING)["Deployment"]["spec"]["template"]["spec"]
    names = [v["name"] for v in pod["volumes"]]
    assert sorted(names) == sorted(
        ["config", "tmp", "model-cache", "dshm", "hub-credentials", "api-keys", "tls", "extra"]
    )
    (runtime,) = pod["containers"]
    mounted = [m["name"] for m in runtime["volumeMounts"]]
    assert len(mounted) == len(set(mounted)) and {"api-keys", "tls", "extra"} <= set(mounted)
    # The fetch init container downloads; it serves nothing, so it never sees the keys or the cert.
    (fetch,) = pod["initContainers"]
    assert not {"api-keys", "tls"} & {m["name"] for m in fetch["volumeMounts"]}


def test_under_tls_the_startup_probe_waits_for_ready_over_https() -> None:
    container = children(TLS)["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["startupProbe"]["httpGet"] == {
        "path": "/v2/health/ready",
        "port": "https",
        "scheme": "HTTPS",
    }
    assert container["livenessProbe"]["httpGet"] == {
        "path": "/v2/health/live",
        "port": "https",
        "scheme": "HTTPS",
    }


@pytest.mark.parametrize("taken", ["api-keys", "tls"])
def test_a_user_volume_may_not_take_the_secrets_names(taken: str) -> None:
    from carpool.operator.validation import SpecError

    with pytest.raises(SpecError, match=taken):
        build_children(batched_model("m", {"volumes": [{"name": taken, "emptyDir": {}}]}))
