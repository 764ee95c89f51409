"""The cluster tier: the operator against a real kube-apiserver, etcd, kube-controller-manager and
kube-scheduler (tests/cluster/controlplane.py), installed with the real Helm chart.

Session fixtures, started once: `control_plane` (the processes, an admin kubeconfig),
`leader_worker_sets` (the LeaderWorkerSet controller with its CRD and webhooks), `release` (`helm
install` of charts/carpool: CRDs, RBAC, ServiceAccount; the operator Deployment it renders stays pending,
its pod tolerating no taint of the kubelet stand-in's Node, and no operator image is built here, so...) and
`operator`: `carpool operator` as a local process with the flags of the
chart's Deployment and the credentials of the chart's ServiceAccount (a token from the TokenRequest API),
never the admin's, so every call it makes is checked against the RBAC the chart renders. Each test gets
a namespace of its own (`namespace`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster.api import Api, run, wait_for
from tests.cluster.controlplane import ControlPlane, Process, audit_reads_of, free_port
from tests.cluster.lws import start_leader_worker_sets
from tests.cluster.scale import SCALE_ACCOUNT, account_user

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "carpool"
RELEASE_NAMESPACE = "carpool-system"
OPERATOR_DEPLOYMENT = "carpool-operator"
SLOW_RETRY_SECONDS = 15.0
"""The release's `operator.slowRetryPeriodSeconds` (60 by default): the tests that watch for writes over
two of the operator's longest retry periods (`test_admission.LONGEST_RETRY_SECONDS`) watch 30 s, not 120."""

_startup: dict[str, float] = {}
_summary: list[str] = []


def summary_line(text: str) -> None:
    """A line for the end of the run's report (what a test measured, such as a timeline)."""
    _summary.append(text)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _startup:
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in _startup.items())
        terminalreporter.write_line(f"cluster tier start-up: {parts}")
    for line in _summary:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane(
        tmp_path_factory.mktemp("control-plane"),
        k8s_version=os.environ.get("K8S_VERSION") or None,
        # A cluster admin's setting (default 15 s): the autoscaling test sees both directions sooner.
        hpa_sync_period="5s",
        # The scale test counts its operator's reads as well as its writes (test_scale.py).
        audit_policy=audit_reads_of(users=[account_user(RELEASE_NAMESPACE, SCALE_ACCOUNT)]),
    )
    try:
        plane.start()
        _startup["control plane"] = plane.startup_seconds
        sys.stderr.write(f"\ncontrol plane started in {plane.startup_seconds:.1f} s at {plane.server}\n")
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def admin_env(control_plane: ControlPlane) -> dict[str, str]:
    return control_plane.env()


@pytest.fixture(scope="session")
def api(control_plane: ControlPlane) -> Iterator[Api]:
    client = Api(control_plane.server, control_plane.ssl_context())
    yield client
    client.close()


@pytest.fixture(scope="session")
def leader_worker_sets(control_plane: ControlPlane, api: Api) -> Process:
    """The LeaderWorkerSet controller, its CRD and webhooks (tests/cluster/lws.py), installed before the
    operator starts, as on a cluster prepared for multi-node models."""
    manager, seconds = start_leader_worker_sets(control_plane, api)
    _startup["leaderworkerset"] = seconds
    return manager


@dataclass(frozen=True)
class Release:
    namespace: str
    service_account: str
    operator_kubeconfig: Path
    operator_args: list[str]


def _established(api: Api, name: str) -> bool:
    crd = api.get("CustomResourceDefinition", None, name)
    conditions = ((crd or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


@pytest.fixture(scope="session")
def release(control_plane: ControlPlane, api: Api, admin_env: dict[str, str]) -> Release:
    """`helm install carpool charts/carpool`, as the README says, and the operator's own credentials."""
    started = time.monotonic()
    installed = install_release(control_plane, api, admin_env)
    _startup["helm install"] = time.monotonic() - started
    return installed


def install_release(control_plane: ControlPlane, api: Api, admin_env: dict[str, str]) -> Release:
    """`helm install` of the chart (its defaults but a shorter slow retry period, `SLOW_RETRY_SECONDS`), and
    a 24 h token of the chart's ServiceAccount for the operator."""
    run(
        "helm",
        "install",
        "carpool",
        CHART,
        "--namespace",
        RELEASE_NAMESPACE,
        "--create-namespace",
        "--set",
        f"operator.slowRetryPeriodSeconds={SLOW_RETRY_SECONDS:g}",
        "--wait=false",
        env=admin_env,
    )
    wait_for("the BatchedModel CRD to be established", lambda: _established(api, "batchedmodels.carpool.dev"))
    deployment = api.get("Deployment", RELEASE_NAMESPACE, OPERATOR_DEPLOYMENT)
    assert deployment is not None, "the chart made no operator Deployment"
    pod = deployment["spec"]["template"]["spec"]
    account = pod["serviceAccountName"]
    token = run(
        "kubectl", "create", "token", account, "-n", RELEASE_NAMESPACE, "--duration=24h", env=admin_env
    ).stdout.strip()
    kubeconfig = control_plane.write_kubeconfig("operator", token=token)
    args = list(pod["containers"][0].get("args") or [])
    # The windows of test_admission and test_lws are sound only for an operator that retries this often.
    assert f"--slow-retry-period={SLOW_RETRY_SECONDS:g}" in args, args
    return Release(RELEASE_NAMESPACE, account, kubeconfig, args)


@dataclass
class Operator:
    process: Process
    metrics_port: int
    user: str
    """The API user its requests arrive as (the chart's ServiceAccount)."""
    argv: list[str]
    env: dict[str, str]
    liveness_port: int

    def logs(self, lines: int = 60) -> str:
        return self.process.tail(lines)

    def start(self) -> None:
        """Start the process (again: the log goes on in the same file) and wait until it is live."""
        handle = self.process.log.open("ab")
        popen = subprocess.Popen(
            self.argv, stdout=handle, stderr=subprocess.STDOUT, env=self.env, start_new_session=True, cwd=ROOT
        )
        handle.close()
        self.process = Process(self.process.name, popen, self.process.log)
        wait_for("the operator's liveness endpoint", self._alive, timeout=60)

    def stop(self) -> None:
        """SIGTERM, as a node drain or a rollout does (then SIGKILL after 10 s)."""
        self.process.stop()

    def _alive(self) -> bool:
        popen = self.process.popen
        if popen.poll() is not None:
            raise AssertionError(f"the operator exited with {popen.returncode}:\n{self.process.tail()}")
        import urllib.request

        url = f"http://127.0.0.1:{self.liveness_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False


def _operator_args(chart_args: list[str], metrics_port: int, liveness_port: int) -> list[str]:
    kept = [
        arg
        for arg in chart_args
        if not arg.startswith(("--metrics-port=", "--liveness-port=", "--log-format="))
    ]
    return [
        *kept,
        f"--metrics-port={metrics_port}",
        f"--liveness-port={liveness_port}",
        "--log-format=plain",
        "--verbose",
    ]


def start_operator(
    control_plane: ControlPlane, release: Release, chart_args: list[str], name: str, **env: str
) -> Operator:
    """`carpool operator` with `chart_args` (the chart Deployment's), ports of its own, the chart
    ServiceAccount's token, and its log in the control plane's folder as `<name>.log`."""
    metrics_port, liveness_port = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "carpool.cli",
        "operator",
        *_operator_args(chart_args, metrics_port, liveness_port),
    ]
    environment = {**os.environ, "KUBECONFIG": str(release.operator_kubeconfig), **env}
    log = control_plane.folder / f"{name}.log"
    log.write_bytes(b"")
    user = f"system:serviceaccount:{release.namespace}:{release.service_account}"
    placeholder = Process(name, None, log)  # type: ignore[arg-type]
    running = Operator(placeholder, metrics_port, user, argv, environment, liveness_port)
    STARTED.append(running)
    running.start()
    return running


@pytest.fixture(scope="session")
def operator(
    control_plane: ControlPlane, release: Release, leader_worker_sets: Process
) -> Iterator[Operator]:
    """`carpool operator` with the chart Deployment's flags and the chart ServiceAccount's token, started
    after the LeaderWorkerSet controller (as on a cluster prepared for multi-node models)."""
    running = start_operator(control_plane, release, release.operator_args, "operator")
    try:
        yield running
    finally:
        running.stop()


STARTED: list[Operator] = []
"""Every operator process `start_operator` started in this session (the session's, replicas, namespaced)."""

HANDLER_FAILURE = re.compile(
    r"Handler '[^']+' failed with an exception|Watcher for .* has failed|Task exception was never retrieved"
)
"""What kopf logs (and otherwise swallows) when a handler raises something unexpected or a watcher dies, and
what asyncio logs for a task that died with nobody awaiting it."""


@pytest.fixture(autouse=True)
def operator_handlers_never_fail() -> Iterator[None]:
    """Fail a test during which any operator process logged a handler failure: kopf only logs a handler's
    unexpected exception (and retries or forgets it), so without this a crash never fails a test. Every
    process `start_operator` started counts, from where its log stood when the test began (a process
    started during the test, from its first line)."""
    seen = {id(o): len(o.logs(10**7).splitlines()) for o in STARTED}
    yield
    failures = []
    for running in STARTED:
        new = running.logs(10**7).splitlines()[seen.get(id(running), 0) :]
        failures += [f"{running.process.name}: {line}" for line in new if HANDLER_FAILURE.search(line)]
    assert not failures, "an operator logged handler failures:\n" + "\n".join(failures[:10])


@pytest.fixture
def namespace(api: Api) -> Iterator[str]:
    """A namespace of the test's own (deleted afterwards; the namespace controller empties it)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    wait_for(
        f"the default ServiceAccount in {name}",
        lambda: api.get("ServiceAccount", name, "default"),
        timeout=30,
    )
    yield name
    api.delete("Namespace", None, name)


def operator_metric(operator: Operator, name: str, labels: dict[str, str] | None = None) -> float:
    """A sample of the operator's own Prometheus endpoint (summed over series matching `labels`)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
    return total


def dump(api: Api, namespace: str) -> str:
    """What a failing test wants to see: the BatchedModels and children in the namespace."""
    found = {
        kind: api.list(kind, namespace)
        for kind in ("BatchedModel", "Deployment", "Service", "HorizontalPodAutoscaler", "Event")
    }
    return json.dumps({k: [o.get("metadata", {}).get("name") for o in v] for k, v in found.items()})
