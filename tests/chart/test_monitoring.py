"""The observability glue speaks the runtime's metric names: every `carpool_*` series the prometheus-
adapter rules, the PrometheusRule and the dashboard query is one the runtime exports (its registry is
the source), and the adapter ConfigMap carries exactly the rules of the published values snippet."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from carpool.operator.resources.autoscaling import PICKER_QUEUE_METRIC
from carpool.runtime.metrics import RuntimeMetrics
from tests.chart.conftest import ALL_FEATURES, CHART, Render, one

DASHBOARD = CHART / "files" / "dashboards" / "carpool.json"
ADAPTER_VALUES = CHART / "files" / "prometheus-adapter-values.yaml"
_SERIES = re.compile(r"\bcarpool_[a-z_]+\b")
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _exported() -> set[str]:
    names: set[str] = set()
    for family in RuntimeMetrics("m").registry.collect():
        if family.name.startswith("carpool_"):
            names.add(family.name)
            names.update(family.name + suffix for suffix in (*_HISTOGRAM_SUFFIXES, "_total"))
    return names


def _series_in(text: str) -> set[str]:
    return {name for name in _SERIES.findall(text) if not name.startswith("carpool_operator_")}


def _dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in board["panels"] for target in panel["targets"]]


def test_every_queried_series_is_exported_by_the_runtime(render: Render) -> None:
    rule = one(render(files=(ALL_FEATURES,)), "PrometheusRule")
    exprs = [item["expr"] for group in rule["spec"]["groups"] for item in group["rules"]]
    text = "\n".join([*exprs, *_dashboard_exprs(), ADAPTER_VALUES.read_text()])
    queried = _series_in(text)
    assert {"carpool_queue_depth", "carpool_ready", "carpool_request_duration_seconds_bucket"} <= queried
    assert sorted(queried - _exported()) == []


def test_the_adapter_configmap_publishes_the_snippets_rules(render: Render) -> None:
    objects = render(files=(ALL_FEATURES,))
    config_map = next(o for o in objects if o["kind"] == "ConfigMap" and "config.yaml" in o.get("data", {}))
    assert config_map["metadata"]["namespace"] == "monitoring"
    published = yaml.safe_load(config_map["data"]["config.yaml"])
    snippet = yaml.safe_load(ADAPTER_VALUES.read_text())
    assert published == {"rules": snippet["rules"]["custom"], "externalRules": snippet["rules"]["external"]}
    # The External metric a pooled model's HPA asks for (the requests its endpoint picker holds), per
    # namespace: the HPA's selector adds the pool.
    (held,) = published["externalRules"]
    assert held["name"]["as"] == PICKER_QUEUE_METRIC
    assert held["resources"]["overrides"] == {"namespace": {"resource": "namespace"}}
    queue = published["rules"][0]
    assert queue["name"]["as"] == "carpool_queue_depth"
    assert queue["resources"]["overrides"] == {
        "namespace": {"resource": "namespace"},
        "pod": {"resource": "pod"},
    }


def test_the_dashboard_covers_what_issue_4_asks_per_model(render: Render) -> None:
    objects = render(files=(ALL_FEATURES,))
    config_map = next(o for o in objects if o["kind"] == "ConfigMap" and "carpool.json" in o.get("data", {}))
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "carpool"}
    board: dict[str, Any] = json.loads(config_map["data"]["carpool.json"])
    assert board == json.loads(DASHBOARD.read_text())
    titles = {panel["title"] for panel in board["panels"]}
    assert {
        "Queue depth",
        "Batch size",
        "Request latency",
        "Throughput",
        "Replicas",
        "Warm-up time",
    } <= titles
    assert {v["name"] for v in board["templating"]["list"]} >= {"datasource", "namespace", "model"}
    for expr in _dashboard_exprs():
        assert '$model"' in expr, f"panel query not filtered by model: {expr}"
    assert sorted({panel["id"] for panel in board["panels"]}) == list(range(1, len(board["panels"]) + 1))


def test_the_alerts_issue_4_asks_for_exist(render: Render) -> None:
    rule = one(render(files=(ALL_FEATURES,)), "PrometheusRule")
    alerts = {
        item["alert"]: item for group in rule["spec"]["groups"] for item in group["rules"] if "alert" in item
    }
    assert set(alerts) == {
        "CarpoolQueueGrowing",
        "CarpoolNoReadyReplicas",
        "CarpoolWarmupFailing",
        "CarpoolAutoscalerMetricUnavailable",
    }
    for alert in alerts.values():
        assert alert["labels"] == {"severity": "critical"}
        assert alert["annotations"]["summary"] and alert["annotations"]["description"]
    assert alerts["CarpoolWarmupFailing"]["for"] == "15m"


def test_promtool_accepts_the_rules(render: Render, tmp_path: Path) -> None:
    """Optional here (Debian's `prometheus` package provides promtool); the e2e tests always run it."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus); the e2e suite checks the rules")
    rule = one(render(files=(ALL_FEATURES,)), "PrometheusRule")
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    done = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
