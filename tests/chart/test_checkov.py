"""checkov over everything carpool deploys: the children of every example (as the operator renders them)
and the chart (defaults, and every feature on). No finding may go unexplained: each one either is
fixed, or is listed in `EXPLAINED` with the reason it stays, scoped to the resources it may hit. An
explanation that no longer matches anything fails too, so the list cannot rot.

checkov runs from its own virtual environment (`make checkov`, which `make unit` runs first).
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from carpool.operator.render import render
from tests import tools
from tests.chart.conftest import ALL_FEATURES, CHART, ROOT, run_helm

pytestmark = pytest.mark.slow

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
EXAMPLE_NAMESPACE = "ml-serving"
"""Where an example without a namespace would land (`kubectl apply -n ml-serving`, as the README does)."""


@dataclass(frozen=True)
class Explained:
    reason: str
    resources: str
    """A regex the finding's resource (`Kind.namespace.name`) must match in full."""


RUNTIME = r"Deployment\.(ml|ml-serving|default)\.[-a-z0-9]+"
OPERATOR = r"Deployment\.carpool-system\.carpool-operator"
PICKERS = r"Deployment\.(ml-serving|team-a)\.[-a-z0-9]+-epp"
"""The endpoint pickers of ci/endpoint-picker-values.yaml."""

EXPLAINED: dict[str, Explained] = {
    "CKV_K8S_43": Explained(
        "Image should use digest: pinning is the release pipeline's job. Users pin with "
        "`spec.image: repo@sha256:...` (runtime) and `operator.image.digest` (chart); defaults name tags.",
        f"{RUNTIME}|{OPERATOR}",
    ),
    "CKV_K8S_15": Explained(
        "Image pull policy Always: release tags are immutable, and pulling a multi-gigabyte CUDA image on "
        "every pod start slows scale-up, which is what the autoscaler needs fast. `spec.imagePullPolicy` "
        "and `operator.image.pullPolicy` set it where wanted.",
        f"{RUNTIME}|{OPERATOR}",
    ),
    "CKV_K8S_11": Explained(
        "CPU limits on GPU model servers: a CFS quota throttles tokenization and batching threads in "
        "bursts and adds tail latency while the GPU waits; the pods request their CPU instead. A "
        "BatchedModel that wants a limit sets `resources.limits.cpu` (the CPU-only example does).",
        RUNTIME,
    ),
    "CKV_K8S_21": Explained(
        "The default namespace: examples/cpu-only.yaml names it so that it runs as it is on a laptop "
        "cluster (kind, minikube); the children land in their BatchedModel's namespace, whichever it is.",
        r"(ConfigMap|Deployment|Service|NetworkPolicy|HorizontalPodAutoscaler|PodDisruptionBudget)"
        r"\.default\.sentiment(-runtime)?",
    ),
    "CKV_K8S_38": Explained(
        "Service account token mounted: the operator calls the Kubernetes API with it (its RBAC is "
        "exactly what it uses, tests/chart/test_rbac.py), and so does each endpoint picker (it watches its "
        "InferencePool and pods; its Role reads only those, tests/chart/test_endpoint_picker.py). The "
        "runtime pods mount none.",
        f"{OPERATOR}|{PICKERS}",
    ),
}


def _write_manifests(folder: Path, helm: Path) -> None:
    for path in EXAMPLES:
        model = yaml.safe_load(path.read_text())
        namespace = model["metadata"].get("namespace") or EXAMPLE_NAMESPACE
        (folder / f"example-{path.name}").write_text(render(path.read_text(), namespace=namespace))
    renders: dict[str, list[str | Path]] = {
        "chart-defaults": [],
        "chart-all-features": ["-f", ALL_FEATURES],
        "chart-endpoint-picker": ["-f", CHART / "ci" / "endpoint-picker-values.yaml"],
    }
    for name, args in renders.items():
        done = run_helm(helm, "template", "carpool", CHART, "--namespace", "carpool-system", *args)
        assert done.returncode == 0, done.stderr
        (folder / f"{name}.yaml").write_text(done.stdout)


def _scan(folder: Path) -> dict[str, Any]:
    done = subprocess.run(
        [str(tools.checkov()), "--directory", str(folder), "--framework", "kubernetes", "--output", "json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode in (0, 1), done.stderr  # 1: findings, which are judged below
    report = json.loads(done.stdout)
    result: dict[str, Any] = report[0] if isinstance(report, list) else report
    return result


def test_every_checkov_finding_is_fixed_or_explained(helm: Path, tmp_path: Path) -> None:
    _write_manifests(tmp_path, helm)
    report = _scan(tmp_path)
    summary = report["summary"]
    assert summary["parsing_errors"] == 0 and summary["resource_count"] > 0
    failed = report["results"]["failed_checks"]
    unexplained = []
    used: set[str] = set()
    for finding in failed:
        explained = EXPLAINED.get(finding["check_id"])
        if explained is not None and re.fullmatch(explained.resources, finding["resource"]):
            used.add(finding["check_id"])
        else:
            where = f"{finding['file_path']} {finding['resource']}"
            unexplained.append(f"{finding['check_id']} {finding['check_name']}: {where}")
    assert not unexplained, "checkov findings neither fixed nor explained:\n" + "\n".join(unexplained)
    assert used == set(EXPLAINED), f"explanations matching nothing any more: {set(EXPLAINED) - used}"
    # Every rendered pod is covered by a NetworkPolicy (the finding CKV2_K8S_6).
    passed = {check["check_id"] for check in report["results"]["passed_checks"]}
    assert "CKV2_K8S_6" in passed and not any(f["check_id"] == "CKV2_K8S_6" for f in failed)
    print(f"checkov: {summary['passed']} passed, {summary['failed']} failed (all explained)")
