"""The chart on a real API server: `helm install`, the CRD, `kubectl get bm`, and the README's upgrade."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tests import tools
from tests.cluster.api import Api, condition, run, wait_for
from tests.cluster.conftest import CHART, ROOT, Operator, Release
from tests.cluster.controlplane import ControlPlane
from tests.cluster.objects import batched_model, child_name, kubectl_apply


def test_helm_install_serves_the_crd_and_kubectl_get_bm_shows_its_columns(
    api: Api, admin_env: dict[str, str], release: Release, operator: Operator, namespace: str
) -> None:
    kubectl_apply(admin_env, batched_model("embedder", namespace))
    # Until the ReplicaSet controller has made the (pending) pod, the status says 0 replicas, and kubectl
    # may read a newer status than this one: wait for the one that stays.
    body = wait_for(
        "the operator to write the BatchedModel's status with its one replica",
        lambda: (
            (found := api.get("BatchedModel", namespace, "embedder"))
            and (found.get("status") or {}).get("replicas") == 1
            and found
        ),
    )
    assert body["status"]["endpoint"] == f"http://embedder.{namespace}.svc:8000"

    def columns() -> list[str]:
        # The replica count moves while the ReplicaSet creates the pod: read until kubectl and the
        # status agree.
        table = run("kubectl", "get", "bm", "-n", namespace, env=admin_env).stdout.splitlines()
        assert table[0].split() == ["NAME", "READY", "REPLICAS", "TASK", "ENDPOINT", "AGE"], table
        status = (api.get("BatchedModel", namespace, "embedder") or {}).get("status") or {}
        row = table[1].split()
        expected = [
            "embedder",
            "False",
            str(status.get("replicas")),
            "embed",
            f"http://embedder.{namespace}.svc:8000",
        ]
        assert row[:5] == expected, (table, status.get("replicas"))
        return row

    wait_for("kubectl get bm to show the status", columns)
    wide = run("kubectl", "get", "batchedmodels", "-n", namespace, "-o", "wide", env=admin_env).stdout
    assert "PHASE" in wide.splitlines()[0] and "MODEL" in wide.splitlines()[0], wide
    assert condition(body, "Ready") is not None


def _readme_block(heading: str) -> str:
    """The first ```sh block under a README heading."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"\n{heading}\n", 1)[1]
    match = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    assert match, f"README: no sh block under {heading}"
    return match.group(1)


def test_the_readme_upgrade_commands_run_verbatim_after_a_helm_install(tmp_path: Path) -> None:
    """An upgrade from an older chart: Helm installed the older CRD (as its field manager); the README's
    `kubectl apply --server-side` of the new one must not stop at a conflict with Helm's fields. On a
    control plane of its own, since the CRD is cluster-wide."""
    old_chart = tmp_path / "carpool-old"
    shutil.copytree(CHART, old_chart)
    crd_file = old_chart / "crds" / "batchedmodel.yaml"
    crd = yaml.safe_load(crd_file.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema["description"] = "An older release's description."  # any field the new CRD sets differently
    crd_file.write_text(yaml.safe_dump(crd))
    plane = ControlPlane(tmp_path / "plane").start()
    try:
        env = plane.env()
        run("helm", "install", "carpool", old_chart, "-n", "carpool-system", "--create-namespace", env=env)
        commands = _readme_block("### Upgrade and uninstall")
        assert "kubectl apply --server-side" in commands and "helm upgrade" in commands
        tools_path = os.pathsep.join(str(Path(tool).parent) for tool in (tools.kubectl(), tools.helm()))
        env["PATH"] = f"{tools_path}{os.pathsep}{os.environ['PATH']}"
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", commands], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, f"README upgrade failed:\n{commands}\n{done.stdout}\n{done.stderr}"
        api = Api(plane.server, plane.ssl_context())
        live = api.get("CustomResourceDefinition", None, "batchedmodels.carpool.dev")
        api.close()
        assert live is not None
        new = yaml.safe_load((CHART / "crds" / "batchedmodel.yaml").read_text())
        new_description = new["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["description"]
        assert live["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["description"] == new_description
        status = run("helm", "status", "carpool", "-n", "carpool-system", "-o", "json", env=env).stdout
        assert json.loads(status)["info"]["status"] == "deployed"
    finally:
        plane.stop()


def test_the_api_server_bounds_drain_keep_alive_seconds_and_the_pods_config_carries_it(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    """`server.drainKeepAliveSeconds` past its bound is refused by the API server (the CRD's schema), naming
    the field; within it, the operator puts it in the pods' runtime config."""
    refused = kubectl_apply(
        admin_env, batched_model("held", namespace, server={"drainKeepAliveSeconds": 600}), check=False
    )
    assert refused.returncode != 0, "a drainKeepAliveSeconds of 600 was accepted"
    assert "spec.server.drainKeepAliveSeconds" in refused.stderr and "60" in refused.stderr, refused.stderr
    assert api.get("BatchedModel", namespace, "held") is None

    kubectl_apply(admin_env, batched_model("held", namespace, server={"drainKeepAliveSeconds": 7.5}))

    def carried() -> float | None:
        found = api.get("ConfigMap", namespace, child_name("ConfigMap", "held"))
        if found is None:
            return None
        return float(yaml.safe_load(found["data"]["runtime.yaml"])["server"]["drain_keep_alive_s"])

    assert wait_for("the runtime ConfigMap", carried) == 7.5
