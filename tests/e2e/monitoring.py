"""The chart's observability glue on real binaries: Helm renders it, Debian's Prometheus runs it.

- `render_chart` is `helm template` of charts/carpool with the monitoring features on;
- `scrape_configs` turns the rendered PodMonitor into the scrape job the Prometheus Operator would
  generate for it (keep the pods its selector matches and the container port it names, add the
  namespace/pod/container/endpoint/job labels, then the PodMonitor's own relabelings). The local pods
  are static targets carrying the `__meta_kubernetes_*` labels Kubernetes service discovery would give
  them, so the same relabelling runs on them;
- `adapter_pods_query` fills a prometheus-adapter rule's `metricsQuery` template the way the adapter does
  for a Pods metric request of the HPA (one namespace, the HPA's pods by name, grouped by pod);
- `hpa_desired_replicas` is the HPA controller's algorithm for a Pods metric with an AverageValue target.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from bench.server import free_port

from tests import tools
from tests.e2e.pods import HOST, ROOT, LocalPod

CHART = ROOT / "charts" / "carpool"
RELEASE_NAMESPACE = "monitoring"
CHART_VALUES: dict[str, Any] = {
    "podMonitor": {"enabled": True, "interval": "2s", "scrapeTimeout": "2s"},
    "prometheusRule": {"enabled": True},
    "prometheusAdapter": {"enabled": True},
}
"""The chart's own values, with a 2 s scrape interval instead of 15 s: the e2e run is short."""

DEFAULT_TOLERANCE = 0.1
"""kube-controller-manager's --horizontal-pod-autoscaler-tolerance default."""


def render_chart(workdir: Path, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    values_file = workdir / "chart-values.yaml"
    values_file.write_text(yaml.safe_dump(values if values is not None else CHART_VALUES))
    helm = str(tools.helm())
    done = subprocess.run(
        [helm, "template", "carpool", str(CHART), "-n", RELEASE_NAMESPACE, "-f", str(values_file)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def rule_groups(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The PrometheusRule's groups as a Prometheus rule file."""
    return {"groups": one(objects, "PrometheusRule")["spec"]["groups"]}


def adapter_rules(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rules the adapter reads: config.yaml of the chart's adapter ConfigMap."""
    config_map = next(o for o in objects if o["kind"] == "ConfigMap" and "config.yaml" in o.get("data", {}))
    rules: list[dict[str, Any]] = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    return rules


def _label_name(key: str) -> str:
    """A Kubernetes label key as Prometheus' Kubernetes SD spells it in `__meta_*` labels."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _relabel(rule: dict[str, Any]) -> dict[str, Any]:
    """A Prometheus Operator RelabelConfig (camelCase) as a Prometheus relabel_config."""
    names = {
        "sourceLabels": "source_labels",
        "targetLabel": "target_label",
        "separator": "separator",
        "regex": "regex",
        "modulus": "modulus",
        "replacement": "replacement",
        "action": "action",
    }
    return {names[key]: value for key, value in rule.items()}


def pod_target(pod: LocalPod, container_port_name: str) -> dict[str, Any]:
    """A pod as Kubernetes SD (role: pod) would describe it: address and `__meta_kubernetes_*` labels."""
    template = pod.template
    labels = {
        "__meta_kubernetes_namespace": template.namespace,
        "__meta_kubernetes_pod_name": pod.name,
        "__meta_kubernetes_pod_container_name": template.container["name"],
        "__meta_kubernetes_pod_container_port_name": container_port_name,
        "__meta_kubernetes_pod_container_port_number": str(template.port(container_port_name)),
        "__meta_kubernetes_pod_ready": "true",
    }
    for key, value in template.labels.items():
        labels[f"__meta_kubernetes_pod_label_{_label_name(key)}"] = value
        labels[f"__meta_kubernetes_pod_labelpresent_{_label_name(key)}"] = "true"
    # The pod IP and container port in a cluster; here the pod's loopback port.
    return {"targets": [f"{HOST}:{pod.port}"], "labels": labels}


def scrape_configs(pod_monitor: dict[str, Any], pods: list[LocalPod]) -> list[dict[str, Any]]:
    """The scrape jobs the Prometheus Operator generates, one per PodMonitor endpoint."""
    return [
        scrape_config(pod_monitor, index, pods)
        for index in range(len(pod_monitor["spec"]["podMetricsEndpoints"]))
    ]


def _has_port(pod: LocalPod, name: str) -> bool:
    return any(port["name"] == name for port in pod.template.container["ports"])


def scrape_config(pod_monitor: dict[str, Any], index: int, pods: list[LocalPod]) -> dict[str, Any]:
    """The scrape job the Prometheus Operator generates for one endpoint of the PodMonitor: Kubernetes
    SD lists a target per named container port, so only pods with the endpoint's port get one."""
    spec = pod_monitor["spec"]
    endpoint = spec["podMetricsEndpoints"][index]
    meta = pod_monitor["metadata"]
    relabels: list[dict[str, Any]] = []
    for key, value in spec["selector"]["matchLabels"].items():
        relabels.append(
            {
                "action": "keep",
                "source_labels": [
                    f"__meta_kubernetes_pod_label_{_label_name(key)}",
                    f"__meta_kubernetes_pod_labelpresent_{_label_name(key)}",
                ],
                "regex": f"({value});true",
            }
        )
    relabels += [
        {
            "action": "keep",
            "source_labels": ["__meta_kubernetes_pod_container_port_name"],
            "regex": endpoint["port"],
        },
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"},
        {"target_label": "endpoint", "replacement": endpoint["port"]},
    ]
    relabels += [_relabel(rule) for rule in endpoint.get("relabelings", [])]
    return {
        "job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/{index}",
        "honor_labels": False,
        "metrics_path": endpoint["path"],
        "scrape_interval": endpoint["interval"],
        "scrape_timeout": endpoint["scrapeTimeout"],
        "static_configs": [
            pod_target(pod, endpoint["port"]) for pod in pods if _has_port(pod, endpoint["port"])
        ],
        "relabel_configs": relabels,
    }


def adapter_pods_query(rule: dict[str, Any], namespace: str, pods: list[str]) -> str:
    """The PromQL the adapter runs for `GET .../namespaces/<ns>/pods/*/<metric>?labelSelector=...`
    (what the HPA asks): `<<.Series>>` is the series name, `<<.LabelMatchers>>` the namespace and the
    pods the selector matched (a regex alternation of their names), `<<.GroupBy>>` the pod label."""
    overrides = rule["resources"]["overrides"]
    namespace_label = next(k for k, v in overrides.items() if v["resource"] == "namespace")
    pod_label = next(k for k, v in overrides.items() if v["resource"] == "pod")
    series = rule["seriesQuery"].split("{", 1)[0]
    matchers = f'{namespace_label}="{namespace}",{pod_label}=~"{"|".join(pods)}"'
    query = (
        rule["metricsQuery"]
        .replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", matchers)
        .replace("<<.GroupBy>>", pod_label)
    )
    assert "<<" not in query, f"template placeholders left in {query}"
    return str(query)


def quantity(value: str | int | float) -> float:
    """A Kubernetes quantity (`8`, `2500m`, `1k`, `2Gi`) as a number."""
    text = str(value)
    suffixes = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9}
    for suffix, factor in suffixes.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


@dataclass(frozen=True)
class HpaDecision:
    current: int
    usage_ratio: float
    """Average metric per pod / target."""
    recommended: int
    """The metric's recommendation, before min/max and behaviour."""
    desired: int
    """After minReplicas/maxReplicas and the scale-up rate limit of `behavior` (one period)."""


def hpa_desired_replicas(hpa: dict[str, Any], current: int, per_pod: dict[str, float]) -> HpaDecision:
    """The HPA controller's decision for one Pods metric with an AverageValue target, every pod
    reporting (kubernetes pkg/controller/podautoscaler: replica_calculator.GetMetricReplicas, then
    normalizeDesiredReplicasWithBehaviors):

    - usage ratio = (sum of the pods' values / number of pods) / target;
    - within the tolerance (|1 - ratio| <= tolerance) the count stays; else ceil(ratio x pods);
    - clamp to [minReplicas, maxReplicas]; scaling up, at most what the scaleUp policies allow in one
      period (selectPolicy Max: the larger). Scaling down, the real controller also holds the highest
      recommendation of the scaleDown stabilization window; the recommendation is what is returned."""
    spec = hpa["spec"]
    (metric,) = spec["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue", metric
    target = quantity(metric["pods"]["target"]["averageValue"])
    assert per_pod, "no pod reported the metric"
    ratio = sum(per_pod.values()) / len(per_pod) / target
    behavior = spec.get("behavior") or {}
    direction = "scaleUp" if ratio > 1 else "scaleDown"
    tolerance = float((behavior.get(direction) or {}).get("tolerance", DEFAULT_TOLERANCE))
    recommended = current if abs(1.0 - ratio) <= tolerance else math.ceil(ratio * len(per_pod))
    desired = max(spec.get("minReplicas", 1), min(spec["maxReplicas"], recommended))
    if desired > current and "scaleUp" in behavior:
        rule = behavior["scaleUp"]
        limits = []
        for policy in rule.get("policies", []):
            if policy["type"] == "Percent":
                limits.append(math.ceil(current * (1 + policy["value"] / 100)))
            else:
                limits.append(current + policy["value"])
        if limits:
            limit = min(limits) if rule.get("selectPolicy") == "Min" else max(limits)
            desired = min(desired, limit)
    return HpaDecision(current, ratio, recommended, desired)


class Prometheus:
    """Debian's `prometheus` binary on a loopback port with its own config and data folder."""

    def __init__(self, binary: str, workdir: Path, config: dict[str, Any], rules: dict[str, Any]) -> None:
        self.dir = workdir / "prometheus"
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "rules.yaml").write_text(yaml.safe_dump(rules))
        config = {**config, "rule_files": [str(self.dir / "rules.yaml")]}
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = self.dir / "prometheus.log"
        self.command = [
            binary,
            f"--config.file={self.dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.dir / 'data'}",
            f"--web.listen-address={HOST}:{self.port}",
            "--storage.tsdb.retention.time=1h",
            "--web.enable-lifecycle",
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = httpx.Client(base_url=self.url, timeout=10, trust_env=False)

    def start(self, timeout_s: float = 60.0) -> None:
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.client.get("/-/ready").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"prometheus not ready after {timeout_s:.0f}s:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def _get(self, path: str, params: dict[str, str]) -> Any:
        answer = self.client.get(path, params=params)
        body = answer.json()
        assert answer.status_code == 200 and body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """An instant query's vector as (labels, value) pairs."""
        data = self._get("/api/v1/query", {"query": expr})
        assert data["resultType"] == "vector", data
        return [(item["metric"], float(item["value"][1])) for item in data["result"]]

    def series(self, match: str) -> list[dict[str, str]]:
        found: list[dict[str, str]] = self._get("/api/v1/series", {"match[]": match})
        return found

    def targets_up(self) -> dict[str, bool]:
        """Pod label -> whether its last scrape succeeded."""
        data = self._get("/api/v1/targets", {"state": "active"})
        return {t["labels"].get("pod", "?"): t["health"] == "up" for t in data["activeTargets"]}

    def stop(self) -> None:
        self.client.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def find_binary(name: str) -> str:
    found = shutil.which(name)
    assert found is not None, (
        f"{name} is not installed: `make e2e` installs Debian's prometheus package "
        "(tests/e2e/ensure-prometheus.sh)"
    )
    return found
