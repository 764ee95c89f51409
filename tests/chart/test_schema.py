"""values.schema.json makes Helm refuse values of the wrong type or with misspelt keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from charts.values import Values
from pydantic import ValidationError

from tests.chart.conftest import ALL_FEATURES, CHART, run_helm

BAD_VALUES = [
    pytest.param({"operator": {"replicas": "two"}}, "replicas", id="string-for-integer"),
    pytest.param({"operator": {"replica": 2}}, "replica", id="misspelt-key"),
    pytest.param({"watchNamespaces": "team-a"}, "watchNamespaces", id="string-for-list"),
    pytest.param({"podMonitor": {"enabled": "yes"}}, "enabled", id="string-for-boolean"),
    pytest.param({"operator": {"image": {"pullPolicy": "Sometimes"}}}, "pullPolicy", id="not-in-enum"),
    pytest.param({"prometheusRule": {"alerts": {"queueGrowing": {"for": "ten"}}}}, "for", id="bad-duration"),
    pytest.param({"operator": {"livenessPort": 70000}}, "livenessPort", id="port-out-of-range"),
]


@pytest.mark.parametrize(("values", "field"), BAD_VALUES)
def test_helm_rejects_bad_values(helm: Path, tmp_path: Path, values: dict[str, Any], field: str) -> None:
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(yaml.safe_dump(values))
    commands: list[list[str | Path]] = [["lint", CHART], ["template", "carpool", CHART]]
    for command in commands:
        done = run_helm(helm, *command, "-f", bad)
        assert done.returncode != 0, f"helm {command[0]} accepted {values}"
        assert "schema" in (done.stdout + done.stderr) and field in (done.stdout + done.stderr)
    with pytest.raises(ValidationError):
        Values.model_validate(values)


def test_the_model_accepts_the_all_features_values() -> None:
    Values.model_validate(yaml.safe_load(ALL_FEATURES.read_text()))


@pytest.mark.parametrize(
    "timings",
    [
        pytest.param({"leaseDurationSeconds": 10, "renewDeadlineSeconds": 10}, id="renew-not-shorter"),
        pytest.param({"renewDeadlineSeconds": 2, "retryPeriodSeconds": 2}, id="retry-too-long"),
    ],
)
def test_leader_election_timings_out_of_order_are_refused(
    helm: Path, tmp_path: Path, timings: dict[str, Any]
) -> None:
    """client-go's (and the operator's) checks: the chart fails to render rather than the operator at
    start, in a crash loop."""
    values = {"operator": {"replicas": 2, "leaderElection": timings}}
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(yaml.safe_dump(values))
    done = run_helm(helm, "template", "carpool", CHART, "-f", bad)
    assert done.returncode != 0, done.stdout
    assert "operator.leaderElection: leaseDurationSeconds" in done.stderr, done.stderr
    with pytest.raises(ValidationError, match="lease duration > renew deadline"):
        Values.model_validate(values)
