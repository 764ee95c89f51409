"""Every file in examples/ on the real API server: `carpool render` output accepted by a server-side
dry run, then the BatchedModel applied with kubectl, its children owned by it, its status as the README
documents it (no node runs here, so the pods' scheduler message is the Degraded reason)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.cluster.api import Api, condition, run, wait_for
from tests.cluster.conftest import ROOT, Operator
from tests.cluster.objects import kubectl_apply

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
CONDITIONS = {"Ready", "Progressing", "WarmedUp", "Degraded", "Autoscaling"}


@pytest.fixture(scope="module")
def runtime_class(api: Api) -> None:
    """The `nvidia` RuntimeClass a GPU cluster's NVIDIA GPU Operator installs (examples name it): without
    it the RuntimeClass admission plugin refuses the pods, as the status then says (FailedCreate)."""
    if api.get("RuntimeClass", None, "nvidia") is None:
        api.create(
            {
                "apiVersion": "node.k8s.io/v1",
                "kind": "RuntimeClass",
                "metadata": {"name": "nvidia"},
                "handler": "nvidia",
            }
        )


def _load(path: Path, namespace: str) -> dict[str, object]:
    body = yaml.safe_load(path.read_text())
    body["metadata"]["namespace"] = namespace
    return dict(body)


@pytest.mark.parametrize("example", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_each_example_renders_applies_and_reports_its_status(
    api: Api,
    admin_env: dict[str, str],
    operator: Operator,
    namespace: str,
    example: Path,
    runtime_class: None,
) -> None:
    body = _load(example, namespace)
    rendered = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "render", "-f", "-", "-n", namespace],
        input=yaml.safe_dump(body),
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    # KEDA is not installed here, so the server cannot validate a ScaledObject: it is left out of the dry
    # run (and its absence shows in the status, below).
    served = "\n---\n".join(
        yaml.safe_dump(doc) for doc in yaml.safe_load_all(rendered) if doc and doc["kind"] != "ScaledObject"
    )
    dry = run("kubectl", "apply", "--dry-run=server", "-f", "-", env=admin_env, stdin=served, check=False)
    assert dry.returncode == 0, (
        f"the server refused what `carpool render` makes of {example.name}:\n{dry.stderr}"
    )
    rendered_kinds = {(doc["kind"], doc["metadata"]["name"]) for doc in yaml.safe_load_all(rendered) if doc}

    kubectl_apply(admin_env, body)
    name = str(body["metadata"]["name"])  # type: ignore[index]
    owner = wait_for("the BatchedModel", lambda: api.get("BatchedModel", namespace, name))

    def children() -> set[tuple[str, str]] | None:
        found = set()
        for kind, child in rendered_kinds:
            if kind == "ScaledObject":
                continue  # KEDA is not installed here: the status says so (below)
            live = api.get(kind, namespace, child)
            if live is None:
                raise AssertionError(f"{kind} {child} missing")
            refs = live["metadata"].get("ownerReferences") or []
            assert [r["uid"] for r in refs if r.get("controller")] == [owner["metadata"]["uid"]], (kind, refs)
            found.add((kind, child))
        return found

    wait_for(f"every child of {example.name} owned by it", children)

    # The pods' workload: a Deployment, or the LeaderWorkerSet of a model split over several nodes.
    workload = next(
        (kind, child) for kind, child in rendered_kinds if kind in ("Deployment", "LeaderWorkerSet")
    )
    deployment = api.get(workload[0], namespace, workload[1])
    assert deployment is not None
    idle = deployment["spec"]["replicas"] == 0  # KEDA's minReplicas 0: no pod until there is demand

    def documented_status() -> dict[str, object] | None:
        live = api.get("BatchedModel", namespace, name) or {}
        types = {c["type"] for c in (live.get("status") or {}).get("conditions") or []}
        degraded = condition(live, "Degraded")
        expected = "AsExpected" if idle else "Unschedulable"
        if types != CONDITIONS or degraded is None or degraded["reason"] != expected:
            raise AssertionError(f"conditions {types}, Degraded {degraded}")
        return live

    live = wait_for(f"the status of {example.name}", documented_status, timeout=90)
    ready = condition(live, "Ready")
    assert ready is not None and ready["status"] == "False", ready
    if idle:
        assert live["status"]["phase"] == "Idle" and ready["reason"] == "ScaledToZero", live["status"]  # type: ignore[index]
    else:
        degraded = condition(live, "Degraded")
        assert degraded is not None and "no nodes available to schedule pods" in degraded["message"], degraded
        assert live["status"]["phase"] == "Degraded" and ready["reason"] == "Unschedulable", live["status"]  # type: ignore[index]
    if ("ScaledObject", name) in rendered_kinds:
        scaling = condition(live, "Autoscaling")
        assert scaling is not None and scaling["reason"] == "AutoscalerApiMissing", scaling
