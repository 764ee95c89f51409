"""`carpool render`, `carpool crd` and the operator flags, through the real entry point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from carpool.cli import main
from tests.operator.factories import EXAMPLES, KUBERNETES_VERSIONS, ROOT, validate_official


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_render_prints_valid_manifests_for_every_example(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["render", "-f", str(path)]) == 0
    documents = [doc for doc in yaml.safe_load_all(capsys.readouterr().out) if doc]
    kinds = {doc["kind"] for doc in documents}
    assert {"ConfigMap", "Service", "PodDisruptionBudget"} <= kinds
    assert len(kinds & {"Deployment", "LeaderWorkerSet"}) == 1  # the pods' workload
    assert kinds & {"HorizontalPodAutoscaler", "ScaledObject"} or "cpu-only" in path.name
    for document in documents:
        for version in KUBERNETES_VERSIONS:
            validate_official(document, version)


def test_render_refuses_a_spec_that_cannot_work(tmp_path: Path) -> None:
    model = tmp_path / "bad.yaml"
    model.write_text(
        "apiVersion: carpool.dev/v1alpha1\nkind: BatchedModel\nmetadata: {name: bad}\n"
        "spec: {model: {source: 'gs://bucket/model'}}\n"
    )
    with pytest.raises(SystemExit, match="scheme 'gs'"):
        main(["render", "-f", str(model)])
    model.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    with pytest.raises(SystemExit, match="no BatchedModel"):
        main(["render", "-f", str(model)])


def test_crd_command_prints_the_committed_crd(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == (ROOT / "crds" / "batchedmodel.yaml").read_text()


def test_the_cli_imports_the_operator_only_when_asked() -> None:
    code = (
        "import sys, carpool.cli; "
        "print(sorted(m for m in ('kopf', 'torch', 'carpool.operator') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.strip() == "[]"


def test_operator_help_lists_the_process_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["operator", "--help"])
    text = capsys.readouterr().out
    for flag in (
        "--namespace",
        "--standalone",
        "--peering",
        "--liveness-port",
        "--metrics-port",
        "--log-format",
        "--slow-retry-period",
    ):
        assert flag in text


@pytest.mark.parametrize("period", ["0", "-5", "nan", "soon"])
def test_the_operator_refuses_a_slow_retry_period_that_is_not_above_zero(
    period: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["operator", "--slow-retry-period", period])
    assert "--slow-retry-period" in capsys.readouterr().err
