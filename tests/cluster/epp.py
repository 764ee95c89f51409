"""The Gateway API Inference Extension's endpoint picker (EPP) on the tier's control plane, deployed the
way carpool's chart deploys it for one pool, from the binary `make cluster-bin` built from its Go module
(tests/cluster/build.py, `sigs.k8s.io/gateway-api-inference-extension`) and the CRDs that module ships
(config/crd/bases), read from the Go module cache.

- CRDs: the InferencePool (inference.networking.k8s.io/v1, which the operator writes) and the
  InferenceObjective (inference.networking.x-k8s.io/v1alpha2, which the picker also watches: without it
  its manager does not start).
- The chart: `helm template` with `endpointPicker` on for the pool; its ServiceAccount, Role,
  RoleBinding, ConfigMap, Service and NetworkPolicy are applied, and the picker runs as a local process
  with the arguments of the chart's Deployment, the ConfigMap's config file and a token of the chart's
  ServiceAccount (never the admin's), so the chart's flags, config and RBAC are what the picker runs
  with. What differs from the Deployment, and why: its ports are free loopback ports instead of 9002,
  9003 and 9090 (one host); `--cert-path` serves ext_proc with a certificate of the tier's CA instead of
  the picker's self-signed one, so the test's gateway verifies it (a real gateway is told to skip the
  check, or given the picker's CA); its own Prometheus gauges are flushed every 200 ms instead of 5 s
  (`--refresh-prometheus-metrics-interval`; the tests wait on them).
"""

from __future__ import annotations

import os
import shutil
import time
import urllib.request
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import build
from tests.cluster.api import Api, run, wait_for
from tests.cluster.controlplane import ControlPlane, Process, StartError, free_port

CRDS = (
    ("inference.networking.k8s.io_inferencepools.yaml", "inferencepools.inference.networking.k8s.io"),
    (
        "inference.networking.x-k8s.io_inferenceobjectives.yaml",
        "inferenceobjectives.inference.networking.x-k8s.io",
    ),
)
HEALTH_SERVICE = "inference-extension"
"""The gRPC health service the chart's probes ask (one replica)."""
PORT_FLAGS = ("--grpc-port=", "--grpc-health-port=", "--metrics-port=", "--config-file=")
CHART = Path(__file__).resolve().parents[2] / "charts" / "carpool"


def install_crds(plane: ControlPlane, api: Api) -> None:
    source = build.upstream_dir(build.EPP) / "config" / "crd" / "bases"
    env = plane.env()
    for file, _ in CRDS:
        run("kubectl", "apply", "--server-side", "-f", str(source / file), env=env)
    for _, name in CRDS:
        wait_for(f"the {name} CRD to be established", partial(_established, api, name), timeout=60)


def _established(api: Api, name: str) -> bool:
    crd = api.get("CustomResourceDefinition", None, name)
    conditions = ((crd or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


def chart_objects(
    plane: ControlPlane, pool: str, namespace: str, values: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The chart's objects for one pool's picker (`helm template`, endpointPicker on, with `values` of
    `endpointPicker` on top)."""
    picker = {"enabled": True, "pools": [{"name": pool, "namespace": namespace}], **(values or {})}
    values_file = plane.folder / f"epp-{pool}-values.yaml"
    values_file.write_text(yaml.safe_dump({"endpointPicker": picker}))
    rendered = run(
        "helm",
        "template",
        "carpool",
        CHART,
        "--namespace",
        "carpool-system",
        "-f",
        values_file,
        "--show-only",
        "templates/endpointpicker/deployment.yaml",
        "--show-only",
        "templates/endpointpicker/rbac.yaml",
        "--show-only",
        "templates/endpointpicker/configmap.yaml",
        "--show-only",
        "templates/endpointpicker/service.yaml",
        "--show-only",
        "templates/endpointpicker/networkpolicy.yaml",
        env=plane.env(),
    ).stdout
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


@dataclass
class EndpointPicker:
    process: Process
    grpc_port: int
    health_port: int
    metrics_port: int
    argv: list[str]
    namespace: str
    pod: str
    """The name it runs under (`POD_NAME`): its Deployment's pod's, were it one."""

    def flag(self, name: str) -> str | None:
        """The value the picker runs with for `--<name>=`, if given."""
        prefix = f"--{name}="
        return next((arg.removeprefix(prefix) for arg in self.argv if arg.startswith(prefix)), None)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """The picker's own Prometheus samples by name (`inference_pool_*`, ...)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as answer:
            text = answer.read().decode()
        found: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                found.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
        return found

    def gauge(self, name: str, **labels: str) -> float | None:
        for sample_labels, value in self.metrics().get(name, []):
            if all(sample_labels.get(k) == v for k, v in labels.items()):
                return value
        return None

    def serving(self) -> bool:
        with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(service=HEALTH_SERVICE), timeout=2)
            except grpc.RpcError:
                return False
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

    def stop(self) -> None:
        self.process.stop()


def start(
    plane: ControlPlane, api: Api, pool: str, namespace: str, values: dict[str, Any] | None = None
) -> tuple[EndpointPicker, float]:
    """Apply the chart's objects for `pool`'s picker (`values`: chart values of `endpointPicker` on top
    of the defaults) and run it as the chart's Deployment would; returns it once its health service says
    SERVING (its InferencePool read), and the seconds that took."""
    started = time.monotonic()
    folder = build.locate(build.EPP)
    if folder is None:
        raise StartError("the endpoint picker is not built: run `make cluster-bin` first")
    objects = chart_objects(plane, pool, namespace, values)
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    env = plane.env()
    for obj in objects:
        if obj["kind"] != "Deployment":  # no image runs here: its pod is this process
            run("kubectl", "apply", "--server-side", "-f", "-", env=env, stdin=yaml.safe_dump(obj))
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    token = run(
        "kubectl", "create", "token", account, "-n", namespace, "--duration=2h", env=env
    ).stdout.strip()
    kubeconfig = plane.write_kubeconfig(f"epp-{pool}", token=token)

    work = plane.folder / f"epp-{pool}"
    certs = work / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    serving = plane.pki.issue_serving(f"epp-{pool}", ("localhost",), ("127.0.0.1",))
    shutil.copy(serving.cert, certs / "tls.crt")
    shutil.copy(serving.key, certs / "tls.key")
    config_map = next(o for o in objects if o["kind"] == "ConfigMap")
    (work / "config.yaml").write_text(config_map["data"]["config.yaml"])

    container = deployment["spec"]["template"]["spec"]["containers"][0]
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    args = [arg for arg in container["args"] if not arg.startswith(PORT_FLAGS)]
    argv = [
        str(folder / build.EPP_COMMAND),
        *args,
        f"--grpc-port={grpc_port}",
        f"--grpc-health-port={health_port}",
        f"--metrics-port={metrics_port}",
        f"--config-file={work / 'config.yaml'}",
        f"--cert-path={certs}",
        "--refresh-prometheus-metrics-interval=200ms",
    ]
    environment = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "NAMESPACE": namespace,
        "POD_NAME": f"{deployment['metadata']['name']}-local",
    }
    process = plane.start_process(f"epp-{pool}", argv, env=environment, log=work / "epp.log")
    picker = EndpointPicker(
        process, grpc_port, health_port, metrics_port, argv, namespace, environment["POD_NAME"]
    )

    def up() -> bool:
        if process.popen.poll() is not None:
            raise StartError(f"the endpoint picker exited with {process.popen.returncode}:\n{process.tail()}")
        return picker.serving()

    wait_for("the endpoint picker's health service to say SERVING", up, timeout=60)
    return picker, time.monotonic() - started
