"""`helm lint` and `helm template` with the defaults and with every feature on, every rendered object
validated against the official Kubernetes schemas (kubernetes-validate, strict) for 1.29 and 1.35.

The official schemas do not cover custom resources: the Prometheus Operator's ServiceMonitor, PodMonitor
and PrometheusRule are checked structurally here instead (the fields the
Prometheus Operator requires, the selectors and ports that must match what the operator creates).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from carpool.operator.leader import DEFAULT_TIMING
from carpool.operator.reconcile import SLOW_RETRY_SECONDS
from tests.chart.conftest import ALL_FEATURES, CHART, KUBE_VERSIONS, Render, find, one, run_helm

OFFICIAL_GROUPS = ("", "apps", "rbac.authorization.k8s.io", "apiextensions.k8s.io", "policy", "autoscaling")
CASES = {
    "defaults": (),
    "all-features": (ALL_FEATURES,),
    "endpoint-picker": (CHART / "ci" / "endpoint-picker-values.yaml",),
}


def _group(obj: dict[str, Any]) -> str:
    api_version: str = obj["apiVersion"]
    return api_version.rsplit("/", 1)[0] if "/" in api_version else ""


@pytest.mark.parametrize("files", CASES.values(), ids=CASES.keys())
def test_helm_lint_is_clean(helm: Path, files: tuple[Path, ...]) -> None:
    args: list[str | Path] = ["lint", "--strict", CHART]
    for file in files:
        args += ["-f", file]
    done = run_helm(helm, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[WARNING]" not in done.stdout and "[ERROR]" not in done.stdout


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("files", CASES.values(), ids=CASES.keys())
def test_rendered_objects_pass_the_kubernetes_schemas(
    render: Render, files: tuple[Path, ...], kube_version: str
) -> None:
    objects = render(files=files, kube_version=kube_version)
    checked = 0
    for obj in objects:
        if _group(obj) not in OFFICIAL_GROUPS:
            continue
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{obj['kind']}/{obj['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}"
            )
        checked += 1
    assert checked >= 5


def test_the_crds_in_the_chart_pass_the_kubernetes_schemas() -> None:
    import yaml

    for path in sorted((CHART / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            for version in KUBE_VERSIONS:
                kubernetes_validate.validate(crd, version, strict=True)


def test_defaults_render_only_the_operator_and_its_rbac(render: Render) -> None:
    kinds = sorted(obj["kind"] for obj in render())
    # Three ClusterRoles: the operator's, and the aggregated edit and view roles for people; the
    # operator's own NetworkPolicy is on by default.
    assert kinds == [
        "ClusterRole",
        "ClusterRole",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "NetworkPolicy",
        "Service",
        "ServiceAccount",
    ]


def test_the_operator_runs_standalone_cluster_wide_and_locked_down(render: Render) -> None:
    deployment = one(render(), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/carpool-dev/carpool-operator:0.1.0"
    assert "--standalone" in container["args"]
    assert not any(arg.startswith("--namespace") for arg in container["args"])
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["serviceAccountName"] == one(render(), "ServiceAccount")["metadata"]["name"]
    labels = deployment["metadata"]["labels"]
    assert labels["app.kubernetes.io/managed-by"] == "Helm" and labels["helm.sh/chart"] == "carpool-0.1.0"


def test_all_features_elect_a_leader_with_a_lease_in_the_release_namespace(render: Render) -> None:
    objects = render(files=(ALL_FEATURES,))
    deployment = one(objects, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    namespace = deployment["metadata"]["namespace"]
    assert {"--namespace=ml-serving", "--namespace=team-a", "--leader-elect"} <= set(args)
    assert f"--leader-election-namespace={namespace}" in args
    assert "--standalone" not in args
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"].endswith(
        "@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    )
    assert not find(objects, "KopfPeering") and not find(objects, "ClusterKopfPeering")


def test_several_replicas_name_one_lease_per_release(render: Render) -> None:
    args = one(render(values={"operator": {"replicas": 3}}), "Deployment")["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    (lease,) = [a for a in args if a.startswith("--leader-election-id=")]
    assert lease == "--leader-election-id=carpool"
    named = render(values={"operator": {"replicas": 2, "leaderElection": {"leaseName": "ops"}}})
    assert (
        "--leader-election-id=ops"
        in one(named, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    single = one(render(), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--standalone" in single and "--leader-elect" not in single


def _operator_args(objects: list[dict[str, Any]]) -> list[str]:
    return list(one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"])


def test_the_leader_election_timings_reach_the_operator(render: Render) -> None:
    """controller-runtime's defaults (the operator's own), and what a cluster with a slow API server sets
    instead, passed as the operator's `--leader-elect-*` flags (the cluster tier's replicas take theirs
    from the chart so)."""
    defaults = _operator_args(render(values={"operator": {"replicas": 2}}))
    assert [a for a in defaults if a.startswith("--leader-elect-")] == [
        f"--leader-elect-lease-duration={DEFAULT_TIMING.lease_duration:g}",
        f"--leader-elect-renew-deadline={DEFAULT_TIMING.renew_deadline:g}",
        f"--leader-elect-retry-period={DEFAULT_TIMING.retry_period:g}",
    ]
    timings = {"leaseDurationSeconds": 30, "renewDeadlineSeconds": 20, "retryPeriodSeconds": 2.5}
    args = _operator_args(render(values={"operator": {"replicas": 3, "leaderElection": timings}}))
    assert {
        "--leader-elect-lease-duration=30",
        "--leader-elect-renew-deadline=20",
        "--leader-elect-retry-period=2.5",
    } <= set(args)
    single = _operator_args(render(values={"operator": {"leaderElection": timings}}))
    assert not [a for a in single if a.startswith("--leader-elect")], single


def test_the_slow_retry_period_reaches_the_operator(render: Render) -> None:
    """The operator's own default unless set (a cluster whose quota refusals or missing APIs should be
    looked at again sooner, or later)."""
    (default,) = [a for a in _operator_args(render()) if a.startswith("--slow-retry-period=")]
    assert default == f"--slow-retry-period={SLOW_RETRY_SECONDS:g}"
    args = _operator_args(render(values={"operator": {"slowRetryPeriodSeconds": 20}}))
    assert "--slow-retry-period=20" in args, args


def test_monitors_select_what_the_operator_and_runtime_expose(render: Render) -> None:
    objects = render(files=(ALL_FEATURES,))
    pod_monitor = one(objects, "PodMonitor")
    assert pod_monitor["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "carpool-runtime",
        "app.kubernetes.io/managed-by": "carpool-operator",
    }
    assert pod_monitor["spec"]["namespaceSelector"] == {"matchNames": ["ml-serving", "team-a"]}
    # `http` on plain-HTTP pods; `metrics` where the serving port speaks TLS (spec.tls).
    endpoints = pod_monitor["spec"]["podMetricsEndpoints"]
    assert [(e["port"], e["path"]) for e in endpoints] == [("http", "/metrics"), ("metrics", "/metrics")]
    assert pod_monitor["metadata"]["labels"]["release"] == "prometheus"

    service_monitor = one(objects, "ServiceMonitor")
    service = one(objects, "Service")
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service_monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "metrics" in {port["name"] for port in container["ports"]}
    assert (
        service["spec"]["selector"].items()
        <= one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"].items()
    )

    rule = one(objects, "PrometheusRule")
    for group in rule["spec"]["groups"]:
        for item in group["rules"]:
            assert set(item) <= {"record", "alert", "expr", "for", "labels", "annotations"}
            assert ("record" in item) != ("alert" in item) and item["expr"]


def test_pod_monitor_watches_every_namespace_without_watch_namespaces(render: Render) -> None:
    objects = render(values={"podMonitor": {"enabled": True}})
    assert one(objects, "PodMonitor")["spec"]["namespaceSelector"] == {"any": True}


def test_the_operator_is_told_the_runtime_image_it_derives_every_pods_image_from(render: Render) -> None:
    """The chart's default runtime image is the operator's own default (`DEFAULT_IMAGE`: this release's
    CUDA image, from which `-cpu` and `-vllm` are derived); `runtimeImage` points it elsewhere."""
    from carpool.operator.spec import DEFAULT_IMAGE

    def image_arg(objects: list[dict[str, Any]]) -> list[str]:
        args = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
        return [a for a in args if a.startswith("--runtime-image")]

    assert image_arg(render()) == [f"--runtime-image={DEFAULT_IMAGE}"]
    values = {"runtimeImage": {"repository": "registry.local/carpool-runtime", "tag": "1.2.3"}}
    assert image_arg(render(values=values)) == ["--runtime-image=registry.local/carpool-runtime:1.2.3"]
