"""The custom metrics API a carpool user installs, on the cluster tier's control plane: Prometheus
discovering the pods from the API server, and prometheus-adapter serving what it scrapes as the aggregated
API `v1beta1.custom.metrics.k8s.io`, with the rules the chart ships.

- Prometheus (`make cluster-bin`: built from github.com/prometheus/prometheus with Kubernetes service
  discovery, which Debian's package lacks; run by tests/e2e/monitoring.py `Prometheus`): one scrape job,
  `kubernetes_sd_configs` role pod against the test API server with a ServiceAccount of its own (list and
  watch pods), keeping the pods annotated `prometheus.io/scrape: "true"` and scraping the annotated port
  and path at the pod's IP, with `namespace` and `pod` labels: the annotation-driven job of Prometheus'
  own example configuration, which the operator's pod template is annotated for.
- prometheus-adapter (`make cluster-bin`: built from sigs.k8s.io/prometheus-adapter) as a local process
  with its own ServiceAccount and the RBAC its Helm chart binds (`system:auth-delegator`, the
  `extension-apiserver-authentication-reader` Role, a resource reader), a serving certificate for
  `prometheus-adapter.monitoring.svc` signed by the cluster CA, and `--config` the `rules.custom` and
  `rules.external` of charts/carpool/files/prometheus-adapter-values.yaml (as its Helm chart writes
  them: `rules` and `externalRules`). It serves both APIs, `v1beta1.custom.metrics.k8s.io` and
  `v1beta1.external.metrics.k8s.io` (the requests an endpoint picker holds, for a pooled model's HPA).
  It listens on an address of its own (tests/cluster/podnet.py), published as the Endpoint of a
  selector-less Service: the API server runs with `--enable-aggregator-routing`, so it dials the
  EndpointSlice's address, as it would a pod's.
- Endpoint pickers (tests/cluster/epp.py) run as local processes, not pods, so pod discovery cannot find
  them: a second job reads them from a file (`scrape_picker`), with the `namespace` and `pod` labels the
  pod job would give the chart's picker pod (annotated for it, port 9090).

`chain(...)` walks the links from scrape to HPA and says which one broke.
"""

from __future__ import annotations

import base64
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.cluster import build
from tests.cluster.api import Api, condition, run, wait_for
from tests.cluster.controlplane import ControlPlane, Process, free_port
from tests.cluster.podnet import PodNetwork, published
from tests.e2e.monitoring import Prometheus

ROOT = Path(__file__).resolve().parents[2]
ADAPTER_VALUES = ROOT / "charts" / "carpool" / "files" / "prometheus-adapter-values.yaml"
NAMESPACE = "monitoring"
ADAPTER = "prometheus-adapter"
API_SERVICE = "v1beta1.custom.metrics.k8s.io"
EXTERNAL_API_SERVICE = "v1beta1.external.metrics.k8s.io"
CUSTOM_METRICS = "/apis/custom.metrics.k8s.io/v1beta1"
EXTERNAL_METRICS = "/apis/external.metrics.k8s.io/v1beta1"
PICKERS_JOB = "endpoint-pickers"
SCRAPE_INTERVAL = "2s"
QUEUE_SERIES = "carpool_queue_depth"
"""What the runtime exports and the HPA the operator makes asks for."""
RELIST_INTERVAL = "5s"
"""The adapter's `--metrics-relist-interval` (default 10m): how soon it sees a new series name."""


def adapter_rules() -> list[dict[str, Any]]:
    """The rules the chart ships, as the adapter's `--config` takes them (the Helm chart's `rules.custom`)."""
    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    rules: list[dict[str, Any]] = values["rules"]["custom"]
    return rules


def adapter_external_rules() -> list[dict[str, Any]]:
    """The external rules the chart ships (`rules.external`; the config's `externalRules`)."""
    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    rules: list[dict[str, Any]] = values["rules"]["external"]
    return rules


def pickers_job(targets_file: Path) -> dict[str, Any]:
    """The endpoint pickers' job: targets and labels from `targets_file` (Prometheus' file discovery,
    re-read as it changes)."""
    return {
        "job_name": PICKERS_JOB,
        "scrape_interval": SCRAPE_INTERVAL,
        "scrape_timeout": SCRAPE_INTERVAL,
        "file_sd_configs": [{"files": [str(targets_file)]}],
    }


def scrape_job(server: str, ca: Path, token_file: Path) -> dict[str, Any]:
    """Prometheus' annotation-driven pod job, discovering pods from the API server."""
    return {
        "job_name": "kubernetes-pods",
        "scrape_interval": SCRAPE_INTERVAL,
        "scrape_timeout": SCRAPE_INTERVAL,
        "kubernetes_sd_configs": [
            {
                "role": "pod",
                "api_server": server,
                "tls_config": {"ca_file": str(ca)},
                "authorization": {"credentials_file": str(token_file)},
            }
        ],
        "relabel_configs": [
            {
                "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"],
                "action": "keep",
                "regex": "true",
            },
            {
                "source_labels": ["__meta_kubernetes_pod_phase"],
                "action": "drop",
                "regex": "Pending|Succeeded|Failed",
            },
            {
                "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_path"],
                "action": "replace",
                "target_label": "__metrics_path__",
                "regex": "(.+)",
            },
            {
                "source_labels": ["__address__", "__meta_kubernetes_pod_annotation_prometheus_io_port"],
                "action": "replace",
                "regex": r"([^:]+)(?::\d+)?;(\d+)",
                "replacement": "$1:$2",
                "target_label": "__address__",
            },
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        ],
    }


def rbac(adapter_account: str, prometheus_account: str) -> list[dict[str, Any]]:
    """ServiceAccounts and the bindings prometheus-adapter's Helm chart makes (and Prometheus' pod reader)."""
    account = {"kind": "ServiceAccount", "name": adapter_account, "namespace": NAMESPACE}
    reader: dict[str, Any] = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": f"{ADAPTER}-resource-reader"},
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["namespaces", "pods", "services"],
                "verbs": ["get", "list", "watch"],
            }
        ],
    }
    pods_reader = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "prometheus-pod-discovery"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
    }

    def cluster_binding(name: str, role: str, subject: dict[str, str]) -> dict[str, Any]:
        return {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [subject],
        }

    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": adapter_account, "namespace": NAMESPACE},
        },
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": prometheus_account, "namespace": NAMESPACE},
        },
        reader,
        pods_reader,
        cluster_binding(f"{ADAPTER}:system:auth-delegator", "system:auth-delegator", account),
        cluster_binding(f"{ADAPTER}-resource-reader", reader["metadata"]["name"], account),
        cluster_binding(
            "prometheus-pod-discovery",
            "prometheus-pod-discovery",
            {"kind": "ServiceAccount", "name": prometheus_account, "namespace": NAMESPACE},
        ),
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": f"{ADAPTER}-auth-reader", "namespace": "kube-system"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "extension-apiserver-authentication-reader",
            },
            "subjects": [account],
        },
    ]


def registration(address: str, port: int, ca_bundle: bytes) -> list[dict[str, Any]]:
    """The selector-less Service, its EndpointSlice (the adapter's address) and the two APIServices."""
    return [
        *published(NAMESPACE, ADAPTER, address, port, "tests.cluster.metrics-api"),
        *(
            {
                "apiVersion": "apiregistration.k8s.io/v1",
                "kind": "APIService",
                "metadata": {"name": name},
                "spec": {
                    "service": {"name": ADAPTER, "namespace": NAMESPACE, "port": 443},
                    "group": name.split(".", 1)[1],
                    "version": "v1beta1",
                    "caBundle": base64.b64encode(ca_bundle).decode(),
                    "groupPriorityMinimum": 100,
                    "versionPriority": 100,
                },
            }
            for name in (API_SERVICE, EXTERNAL_API_SERVICE)
        ),
    ]


@dataclass
class MetricsApi:
    api: Api
    prometheus: Prometheus
    adapter: Process
    address: str
    rules_file: Path
    pickers_file: Path

    def scrape_picker(self, metrics_port: int, namespace: str, pod: str) -> None:
        """Scrape an endpoint picker's metrics port, labelled as the pod job labels a pod."""
        entry = {"targets": [f"127.0.0.1:{metrics_port}"], "labels": {"namespace": namespace, "pod": pod}}
        listed = json.loads(self.pickers_file.read_text())
        self.pickers_file.write_text(json.dumps([*listed, entry]))

    def stop(self) -> None:
        """Unregister the APIServices first: an aggregated API that does not answer fails discovery for
        every client after it (helm, kubectl, the namespace controller, the garbage collector)."""
        for name in (API_SERVICE, EXTERNAL_API_SERVICE):
            self.api.delete("APIService", None, name)
        self.adapter.stop()
        self.prometheus.stop()


def prometheus_binary() -> str:
    located = build.locate(build.PROMETHEUS)
    if located is None:
        raise AssertionError("Prometheus is not built: run `make cluster-bin` first")
    return str(located / build.PROMETHEUS_COMMAND)


def _apply(env: dict[str, str], manifests: list[dict[str, Any]]) -> None:
    run("kubectl", "apply", "-f", "-", env=env, stdin=yaml.safe_dump_all(manifests))


def _token(env: dict[str, str], account: str) -> str:
    done = run("kubectl", "create", "token", account, "-n", NAMESPACE, "--duration=24h", env=env)
    return done.stdout.strip()


def start(
    plane: ControlPlane,
    api: Api,
    env: dict[str, str],
    network: PodNetwork,
    rules: list[dict[str, Any]] | None = None,
) -> MetricsApi:
    """Prometheus, then the adapter, then its registration; returns once the APIService is Available."""
    folder = plane.folder / "metrics-api"
    folder.mkdir(parents=True, exist_ok=True)
    located = build.locate(build.PROMETHEUS_ADAPTER)
    if located is None:
        raise AssertionError("prometheus-adapter is not built: run `make cluster-bin` first")
    _apply(env, rbac(ADAPTER, "prometheus"))

    token_file = folder / "prometheus.token"
    token_file.write_text(_token(env, "prometheus"))
    token_file.chmod(0o600)
    pickers_file = folder / "pickers.json"
    pickers_file.write_text("[]")
    config = {
        "global": {"scrape_interval": SCRAPE_INTERVAL},
        "scrape_configs": [
            scrape_job(plane.server, plane.pki.ca.cert, token_file),
            pickers_job(pickers_file),
        ],
    }
    prometheus = Prometheus(prometheus_binary(), folder, config, {"groups": []})
    prometheus.start()

    rules_file = folder / "adapter-config.yaml"
    rules_file.write_text(
        yaml.safe_dump(
            {
                "rules": rules if rules is not None else adapter_rules(),
                "externalRules": adapter_external_rules(),
            }
        )
    )
    kubeconfig = plane.write_kubeconfig("prometheus-adapter", token=_token(env, ADAPTER))
    address = network.claim()
    port = free_port()
    serving = plane.pki.issue_serving(
        "prometheus-adapter",
        (f"{ADAPTER}.{NAMESPACE}.svc", f"{ADAPTER}.{NAMESPACE}.svc.cluster.local"),
        (address,),
    )
    log = folder / "adapter.log"
    with log.open("wb") as handle:
        popen = subprocess.Popen(
            [
                str(located / build.ADAPTER_COMMAND),
                f"--secure-port={port}",
                f"--bind-address={address}",
                f"--tls-cert-file={serving.cert}",
                f"--tls-private-key-file={serving.key}",
                f"--lister-kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                f"--prometheus-url={prometheus.url}/",
                f"--metrics-relist-interval={RELIST_INTERVAL}",
                f"--config={rules_file}",
                f"--cert-dir={folder / 'adapter-certs'}",
                "--v=2",
            ],
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    adapter = Process(ADAPTER, popen, log)
    stack = MetricsApi(api, prometheus, adapter, address, rules_file, pickers_file)
    try:
        _apply(env, registration(address, port, plane.pki.ca.cert.read_bytes()))

        def available() -> bool:
            if popen.poll() is not None:
                raise AssertionError(f"prometheus-adapter exited {popen.returncode}:\n{adapter.tail()}")
            for name in (API_SERVICE, EXTERNAL_API_SERVICE):
                found = condition(api.get("APIService", None, name), "Available")
                if found is None or found["status"] != "True":
                    raise AssertionError(f"APIService {name} Available: {found}")
            return True

        wait_for("the APIServices to be Available", available, timeout=180, every=1)
    except BaseException:
        stack.stop()
        raise
    return stack


# -- which link broke ---------------------------------------------------------------------------------


def _custom_metric(api: Api, namespace: str, metric: str, selector: str) -> httpx.Response:
    return api.request(
        "GET", f"{CUSTOM_METRICS}/namespaces/{namespace}/pods/*/{metric}", params={"labelSelector": selector}
    )


def chain(api: Api, stack: MetricsApi, namespace: str, hpa_name: str, selector: str) -> list[str]:
    """Each link from the runtime pods to the HPA controller, in order; the first `BROKEN` line says which
    link broke and what it showed. (Lines, not an exception: a waiting test puts them in its failure.)"""
    lines: list[str] = []
    pods = [p["metadata"]["name"] for p in api.list("Pod", namespace, selector)]
    try:
        targets = stack.prometheus.targets_up()
    except (httpx.HTTPError, AssertionError) as exc:
        return [f"BROKEN 1 Prometheus: its API did not answer: {exc}\n{stack.prometheus.log_tail()}"]
    mine = {pod: up for pod, up in targets.items() if pod in pods}
    if not mine:
        lines.append(
            f"BROKEN 1 Prometheus discovery (kubernetes_sd_configs role pod): no target for the pods {pods}; "
            f"targets: {targets}"
        )
        return lines
    lines.append(f"ok 1 Prometheus scrapes the pods: {mine}")
    hpa = api.get("HorizontalPodAutoscaler", namespace, hpa_name) or {}
    metrics = (hpa.get("spec") or {}).get("metrics") or []
    asked = [m["pods"]["metric"]["name"] for m in metrics if m.get("type") == "Pods"]
    metric = asked[0] if asked else "?"
    series = stack.prometheus.series(f'{{namespace="{namespace}",pod=~"{"|".join(pods) or "none"}"}}')
    # The series the adapter turns into the HPA's metric: the queue depth, or a latency target's saturation.
    expected = metric if metric.startswith("carpool_") else QUEUE_SERIES
    names = sorted({s["__name__"] for s in series if s["__name__"].startswith(("carpool_queue", expected))})
    rule_inputs = [r["seriesQuery"] for r in yaml.safe_load(stack.rules_file.read_text())["rules"]]
    if not any(s["__name__"] == expected for s in series):
        lines.append(f"BROKEN 2 Prometheus has no {expected} series for the pods; carpool series: {names}")
        return lines
    lines.append(f"ok 2 Prometheus has the series {names}; the adapter rules read {rule_inputs}")
    discovery = api.request("GET", CUSTOM_METRICS)
    resources = (discovery.json().get("resources") or []) if discovery.status_code == 200 else []
    served = sorted({r["name"].split("/", 1)[1] for r in resources if r["name"].startswith("pods/")})
    answer = _custom_metric(api, namespace, metric, selector)
    if answer.status_code != 200 or not answer.json().get("items"):
        if metric not in served and QUEUE_SERIES in served and expected == QUEUE_SERIES:
            why = f"the HPA asks for {metric!r}, which no adapter rule publishes: the HPA's metric is wrong"
        elif expected not in served:
            why = f"no adapter rule publishes {expected!r} from the series Prometheus has: a rule is wrong"
        else:
            why = f"the adapter publishes {metric!r} but has no value for these pods"
        lines.append(
            f"BROKEN 3 custom metrics API: {why}. The adapter serves pods metrics {served}; "
            f"GET {CUSTOM_METRICS}/namespaces/{namespace}/pods/*/{metric} answered {answer.status_code} "
            f"{answer.text[:200]}"
        )
        lines.append(f"adapter log:\n{stack.adapter.tail(10)}")
        return lines
    values = {item["describedObject"]["name"]: item["value"] for item in answer.json()["items"]}
    lines.append(f"ok 3 the custom metrics API serves {metric}: {values}")
    conditions = {
        c["type"]: f"{c['status']} {c.get('reason')}: {c.get('message')}"
        for c in (hpa.get("status") or {}).get("conditions") or []
    }
    active = condition(hpa, "ScalingActive")
    if active is None or active["status"] != "True":
        lines.append(f"BROKEN 4 the HPA controller cannot use it: conditions {json.dumps(conditions)}")
        return lines
    status = hpa.get("status") or {}
    current, desired = status.get("currentMetrics"), status.get("desiredReplicas")
    lines.append(f"ok 4 the HPA reads it: current {current}, desired {desired}")
    return lines
