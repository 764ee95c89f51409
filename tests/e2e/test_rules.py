"""The chart's recording rules and alerts under Prometheus' own rule engine: `promtool check rules` on
the rendered PrometheusRule, and `promtool test rules` with input series for every recording rule and
every alert (firing when it should, silent before its `for` has passed or when it should not fire).

Expected annotations are the rendered rule's templates with the alert's labels and value filled in, so
the test follows the chart's wording while still proving the templates expand.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.e2e import monitoring
from tests.e2e.conftest import record

NS = "ml"
MODEL = "all-minilm-l6-v2"
SERIES = f'namespace="{NS}",model="{MODEL}"'


def _alerts(chart: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    groups = monitoring.rule_groups(chart)["groups"]
    return {rule["alert"]: rule for group in groups for rule in group["rules"] if "alert" in rule}


def _expand(template: str, labels: dict[str, str], value: str) -> str:
    """The two template forms the chart's annotations use: `$labels.<name>` and `$value | humanize`."""
    text = re.sub(r"\{\{\s*\$value\s*\|\s*humanize\s*\}\}", value, template)
    text = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), text)
    assert "{{" not in text, f"unexpanded template in {template!r}"
    return text


def _expected(rule: dict[str, Any], labels: dict[str, str], value: str) -> dict[str, Any]:
    return {
        "exp_labels": {**labels, **rule["labels"]},
        "exp_annotations": {k: _expand(v, labels, value) for k, v in rule["annotations"].items()},
    }


def _unit_tests(chart: list[dict[str, Any]]) -> dict[str, Any]:
    alerts = _alerts(chart)
    pod = {"namespace": NS, "model": MODEL}
    recording = {
        "interval": "1m",
        "input_series": [
            {"series": f'carpool_queue_depth{{{SERIES},pod="a"}}', "values": "10x10"},
            {"series": f'carpool_queue_depth{{{SERIES},pod="b"}}', "values": "5x10"},
            {"series": f'carpool_queue_backlog_seconds{{{SERIES},pod="a"}}', "values": "2x10"},
            {"series": f'carpool_queue_backlog_seconds{{{SERIES},pod="b"}}', "values": "0.5x10"},
            {"series": f'carpool_ready{{{SERIES},pod="a"}}', "values": "1x10"},
            {"series": f'carpool_ready{{{SERIES},pod="b"}}', "values": "0x10"},
            {"series": f'carpool_requests_total{{{SERIES},pod="a",status="200"}}', "values": "0+60x10"},
            {"series": f'carpool_requests_total{{{SERIES},pod="b",status="200"}}', "values": "0+120x10"},
            {"series": f'carpool_requests_total{{{SERIES},pod="a",status="429"}}', "values": "0+30x10"},
            {"series": f'carpool_batch_size_sum{{{SERIES},pod="a"}}', "values": "0+600x10"},
            {"series": f'carpool_batch_size_count{{{SERIES},pod="a"}}', "values": "0+60x10"},
            # 60 requests a minute: half within 100 ms, all within 500 ms.
            {
                "series": f'carpool_request_duration_seconds_bucket{{{SERIES},pod="a",le="0.1"}}',
                "values": "0+30x10",
            },
            {
                "series": f'carpool_request_duration_seconds_bucket{{{SERIES},pod="a",le="0.5"}}',
                "values": "0+60x10",
            },
            {
                "series": f'carpool_request_duration_seconds_bucket{{{SERIES},pod="a",le="+Inf"}}',
                "values": "0+60x10",
            },
        ],
        "promql_expr_test": [
            {
                "expr": "carpool:queue_depth:sum",
                "eval_time": "5m",
                "exp_samples": [{"labels": f"carpool:queue_depth:sum{{{SERIES}}}", "value": 15}],
            },
            {
                "expr": "carpool:queue_backlog_seconds:max",
                "eval_time": "5m",
                "exp_samples": [{"labels": f"carpool:queue_backlog_seconds:max{{{SERIES}}}", "value": 2}],
            },
            {
                "expr": "carpool:ready_replicas:sum",
                "eval_time": "5m",
                "exp_samples": [{"labels": f"carpool:ready_replicas:sum{{{SERIES}}}", "value": 1}],
            },
            {
                "expr": "carpool:requests:rate5m",
                "eval_time": "10m",
                "exp_samples": [
                    {"labels": f'carpool:requests:rate5m{{{SERIES},status="200"}}', "value": 3},
                    {"labels": f'carpool:requests:rate5m{{{SERIES},status="429"}}', "value": 0.5},
                ],
            },
            {
                "expr": "carpool:batch_size:mean5m",
                "eval_time": "10m",
                "exp_samples": [{"labels": f"carpool:batch_size:mean5m{{{SERIES}}}", "value": 10}],
            },
            {
                "expr": "carpool:request_duration_seconds:p50_5m",
                "eval_time": "10m",
                "exp_samples": [
                    {"labels": f"carpool:request_duration_seconds:p50_5m{{{SERIES}}}", "value": 0.1}
                ],
            },
            # Rounded: interpolation within a bucket is not exact in binary floating point.
            {
                "expr": "round(carpool:request_duration_seconds:p95_5m, 0.001)",
                "eval_time": "10m",
                "exp_samples": [{"labels": f"{{{SERIES}}}", "value": 0.46}],
            },
            # Rounded: interpolation within a bucket is not exact in binary floating point.
            {
                "expr": "round(carpool:request_duration_seconds:p99_5m, 0.001)",
                "eval_time": "10m",
                "exp_samples": [{"labels": f"{{{SERIES}}}", "value": 0.492}],
            },
        ],
    }
    growing = alerts["CarpoolQueueGrowing"]
    queue_growing = {
        "interval": "1m",
        # Two more inputs waiting every minute for 30 minutes (above minDepth, 10, from minute 6), then
        # a steady 60: still growing over the last 10 minutes at minute 35, no longer at minute 45.
        "input_series": [
            {"series": f'carpool_queue_depth{{{SERIES},pod="a"}}', "values": "0+2x30 60x20"},
        ],
        "alert_rule_test": [
            {"alertname": "CarpoolQueueGrowing", "eval_time": "10m", "exp_alerts": []},
            {
                "alertname": "CarpoolQueueGrowing",
                "eval_time": "35m",
                "exp_alerts": [_expected(growing, pod, "60")],
            },
            {"alertname": "CarpoolQueueGrowing", "eval_time": "45m", "exp_alerts": []},
        ],
    }
    # A model that served (ready) for ten minutes, then lost its only pod's readiness.
    no_ready = {
        "interval": "1m",
        "input_series": [{"series": f'carpool_ready{{{SERIES},pod="a"}}', "values": "1x10 0x30"}],
        "alert_rule_test": [
            {"alertname": "CarpoolNoReadyReplicas", "eval_time": "10m", "exp_alerts": []},
            {"alertname": "CarpoolNoReadyReplicas", "eval_time": "13m", "exp_alerts": []},
            {
                "alertname": "CarpoolNoReadyReplicas",
                "eval_time": "25m",
                "exp_alerts": [_expected(alerts["CarpoolNoReadyReplicas"], pod, "1")],
            },
        ],
    }
    # Pod b never becomes ready; pod a is ready from the start and never alerts.
    warmup = {
        "interval": "1m",
        "input_series": [
            {"series": f'carpool_ready{{{SERIES},pod="a"}}', "values": "1x30"},
            {"series": f'carpool_ready{{{SERIES},pod="b"}}', "values": "0x30"},
        ],
        "alert_rule_test": [
            {"alertname": "CarpoolWarmupFailing", "eval_time": "10m", "exp_alerts": []},
            {
                "alertname": "CarpoolWarmupFailing",
                "eval_time": "20m",
                "exp_alerts": [_expected(alerts["CarpoolWarmupFailing"], {**pod, "pod": "b"}, "0")],
            },
        ],
    }
    unavailable = alerts["CarpoolAutoscalerMetricUnavailable"]
    hpa = {"namespace": NS, "horizontalpodautoscaler": "minilm"}
    condition = {**hpa, "condition": "ScalingActive", "status": "false"}
    autoscaler = {
        "interval": "1m",
        "input_series": [
            # The HPA on carpool_queue_depth cannot read it; another HPA (on CPU) is as broken but
            # not carpool's business.
            {
                "series": "kube_horizontalpodautoscaler_status_condition{"
                + ",".join(f'{k}="{v}"' for k, v in condition.items())
                + "}",
                "values": "1x20",
            },
            {
                "series": f'kube_horizontalpodautoscaler_spec_target_metric{{namespace="{NS}",'
                'horizontalpodautoscaler="minilm",metric_name="carpool_queue_depth",'
                'metric_target_type="average"}',
                "values": "8x20",
            },
            {
                "series": f'kube_horizontalpodautoscaler_status_condition{{namespace="{NS}",'
                'horizontalpodautoscaler="web",condition="ScalingActive",status="false"}',
                "values": "1x20",
            },
            {
                "series": f'kube_horizontalpodautoscaler_spec_target_metric{{namespace="{NS}",'
                'horizontalpodautoscaler="web",metric_name="cpu",metric_target_type="utilization"}',
                "values": "80x20",
            },
            # KEDA's scaler for BatchedModel `gen` keeps failing while its pods serve.
            {
                "series": f'keda_scaler_detail_errors_total{{namespace="{NS}",scaledObject="gen",'
                'scaler="prometheusScaler"}',
                "values": "0+3x20",
            },
            {
                "series": f'carpool_ready{{namespace="{NS}",model="gen-model",batchedmodel="gen",pod="g"}}',
                "values": "1x20",
            },
        ],
        "alert_rule_test": [
            {"alertname": "CarpoolAutoscalerMetricUnavailable", "eval_time": "3m", "exp_alerts": []},
            {
                "alertname": "CarpoolAutoscalerMetricUnavailable",
                "eval_time": "15m",
                "exp_alerts": [
                    _expected(unavailable, condition, "1"),
                    _expected(unavailable, {"namespace": NS, "scaledObject": "gen"}, "0.05"),
                ],
            },
        ],
    }
    return {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [recording, queue_growing, no_ready, warmup, autoscaler],
    }


def _promtool(promtool: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *map(str, args)], capture_output=True, text=True, check=False, timeout=120
    )


def test_promtool_checks_the_charts_rules(chart: list[dict[str, Any]], promtool: str, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(monitoring.rule_groups(chart)))
    done = _promtool(promtool, "check", "rules", rules)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_promtool_unit_tests_every_recording_rule_and_alert(
    chart: list[dict[str, Any]], promtool: str, tmp_path: Path
) -> None:
    groups = monitoring.rule_groups(chart)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(groups))
    tests = _unit_tests(chart)
    covered_records = {
        re.sub(r"^round\((.*), [0-9.]+\)$", r"\1", t["expr"]) for t in tests["tests"][0]["promql_expr_test"]
    }
    covered_alerts = {a["alertname"] for t in tests["tests"] for a in t.get("alert_rule_test", [])}
    assert covered_records == {r["record"] for g in groups["groups"] for r in g["rules"] if "record" in r}
    assert covered_alerts == set(_alerts(chart))
    (tmp_path / "rules_test.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    done = _promtool(promtool, "test", "rules", tmp_path / "rules_test.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    record("rules", promtool=f"{len(covered_records)} recording rules and {len(covered_alerts)} alerts pass")
