"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager, kube-scheduler.

The binaries come from `make cluster-bin` (tests/cluster/build.py; built from their Go modules, cached
outside the tree); this module only starts them, as controller-runtime's envtest does, with what a real
cluster has on: client-certificate authentication, `--authorization-mode=RBAC`, the default admission
plugins plus `OwnerReferencesPermissionEnforcement` (on by default in OpenShift), service-account token
signing, the aggregation layer's requestheader settings, and an audit log of every write (the tests count
the operator's writes in it). The controller manager runs the controllers the operator relies on (garbage
collector, namespace, deployment, replicaset, statefulset (a LeaderWorkerSet's groups), service accounts
and their tokens, endpoints and EndpointSlices, disruption budgets, the HPA, and the node-lifecycle and
taint-eviction controllers that act on a Node whose heartbeat stops); the scheduler binds pods to the nodes
that exist. No kubelet runs here: pods are scheduled (or not) and started only where a test runs the kubelet
stand-in (tests/cluster/kubelet.py, the autoscaling test) or hollow nodes (tests/cluster/hollownode.py,
which mark their pods running: the node-loss, drain and scale tests).

`ControlPlane.start()` returns once every component answers its health check; `stop()` ends each process it
started, by PID, whatever state the tests left it in. The fault tests restart kube-apiserver
(`restart_apiserver`, on the same port, certificates and etcd) and compact etcd past every revision
clients have seen (`compact_etcd`, through etcd's v3 JSON gateway).
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from bench.server import free_port as free_port  # the cluster tier's servers take their ports here

from tests.cluster import build
from tests.cluster.pki import Pki, make_pki

SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
ISSUER = "https://kubernetes.default.svc.cluster.local"
START_TIMEOUT_SECONDS = 180.0

CONTROLLERS = (
    "garbage-collector-controller",
    "namespace-controller",
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "endpoints-controller",
    "endpointslice-controller",
    "disruption-controller",
    "horizontal-pod-autoscaler-controller",
    "resourcequota-controller",
    "root-ca-certificate-publisher-controller",
    "clusterrole-aggregation-controller",
    "pod-garbage-collector-controller",
    "node-lifecycle-controller",
    "taint-eviction-controller",
    "persistentvolume-binder-controller",
)
"""What kube-controller-manager runs (`--controllers`): the controllers a BatchedModel's children meet
(the binder for the model cache's claim among them), and those that act on a Node that stops
heart-beating (NotReady, the `unreachable` taints, eviction of the pods that do not tolerate them)."""
NODE_MONITOR_GRACE_PERIOD = "20s"
"""How long a Node may go without a heartbeat (its Lease or its status) before the node-lifecycle
controller marks it NotReady (kube-controller-manager's default 50 s; the kubelets here renew every
2-10 s, so 20 s leaves them twice their period)."""

AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "verbs": ["create", "update", "patch", "delete", "deletecollection"]},
        {"level": "None"},
    ],
}
"""Every write, once (at ResponseComplete), with who made it, on what, and the answer's code."""


def audit_reads_of(*, users: list[str] | None = None, groups: list[str] | None = None) -> dict[str, object]:
    """`AUDIT_POLICY` that records the reads (get, list, watch) of these users or groups as well: the
    scale test's operator (a ServiceAccount of its own) and the benchmark's. Everyone else's reads stay
    out of the log, which the tests read whole and often."""
    rules: list[dict[str, object]] = list(AUDIT_POLICY["rules"])  # type: ignore[arg-type]
    reads: list[dict[str, object]] = []
    if users:
        reads.append({"level": "Metadata", "users": users, "verbs": ["get", "list", "watch"]})
    if groups:
        reads.append({"level": "Metadata", "userGroups": groups, "verbs": ["get", "list", "watch"]})
    return {**AUDIT_POLICY, "rules": [rules[0], *reads, *rules[1:]]}


class StartError(RuntimeError):
    pass


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> None:
        if self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)


def kubeconfig(
    server: str, ca: Path, *, cert: Path | None = None, key: Path | None = None, token: str | None = None
) -> dict[str, object]:
    user: dict[str, str] = {}
    if cert is not None and key is not None:
        user = {"client-certificate": str(cert), "client-key": str(key)}
    if token is not None:
        user = {"token": token}
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "carpool-test", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": "carpool-test", "context": {"cluster": "carpool-test", "user": "user"}}],
        "current-context": "carpool-test",
    }


@dataclass
class ControlPlane:
    folder: Path
    k8s_version: str | None = None
    hpa_sync_period: str = "15s"
    """kube-controller-manager's `--horizontal-pod-autoscaler-sync-period` (a cluster admin's setting)."""
    audit_policy: dict[str, object] = field(default_factory=lambda: dict(AUDIT_POLICY))
    """What the audit log records (every write by default; the operator benchmark records reads too)."""
    pki: Pki = field(init=False)
    server: str = ""
    processes: list[Process] = field(default_factory=list)
    startup_seconds: float = 0.0
    admin_kubeconfig: Path = field(init=False)
    audit_log: Path = field(init=False)
    etcd_url: str = ""
    argv: dict[str, list[str]] = field(default_factory=dict)
    """How each component was started, so a fault test can start it again the same way."""
    health: dict[str, tuple[str, ssl.SSLContext | None]] = field(default_factory=dict)
    """Each component's health URL and the TLS context to read it with."""

    def _binaries(self) -> tuple[Path, Path]:
        kubernetes = build.locate(build.KUBERNETES, self.k8s_version)
        etcd_version = (
            None
            if self.k8s_version is None
            else build.kubernetes_etcd_version(build._normalise(self.k8s_version))
        )
        etcd = build.locate(build.ETCD, etcd_version)
        if kubernetes is None or etcd is None:
            version = f" K8S_VERSION={self.k8s_version}" if self.k8s_version else ""
            raise StartError(f"the control plane is not built: run `make cluster-bin{version}` first")
        return kubernetes, etcd

    def _start(self, name: str, argv: list[str]) -> Process:
        return self.start_process(name, argv)

    def start_process(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, log: Path | None = None
    ) -> Process:
        """Start one more process of the cluster (an add-on's controller); `stop()` ends it first. Its log
        is appended to, so a restarted process keeps its earlier lines."""
        self.argv[name] = argv
        log = log or self.folder / f"{name}.log"
        handle = log.open("ab")
        popen = subprocess.Popen(
            argv, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        handle.close()
        process = Process(name, popen, log)
        self.processes.append(process)
        return process

    def write_kubeconfig(self, name: str, **user: object) -> Path:
        path = self.folder / f"{name}.kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig(self.server, self.pki.ca.cert, **user)))  # type: ignore[arg-type]
        path.chmod(0o600)
        return path

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.pki.ca.cert))
        context.load_cert_chain(str(self.pki.admin.cert), str(self.pki.admin.key))
        return context

    def wait_healthy(
        self, process: Process, url: str, context: ssl.SSLContext | None, deadline: float
    ) -> None:
        """Wait for `url` to answer 200 (raises `StartError` when the process exits or time runs out)."""
        self.health[process.name] = (url, context)
        last = ""
        while time.monotonic() < deadline:
            if process.popen.poll() is not None:
                raise StartError(f"{process.name} exited with {process.popen.returncode}:\n{process.tail()}")
            try:
                with urllib.request.urlopen(url, context=context, timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(0.2)
        raise StartError(f"{process.name} not healthy at {url} in time ({last}):\n{process.tail()}")

    def start(self) -> ControlPlane:
        started = time.monotonic()
        deadline = started + START_TIMEOUT_SECONDS
        kubernetes, etcd_dir = self._binaries()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.pki = make_pki(self.folder / "pki")
        try:
            self._start_all(kubernetes, etcd_dir, deadline)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def _start_all(self, kubernetes: Path, etcd_dir: Path, deadline: float) -> None:
        pki = self.pki
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        etcd = self._start(
            "etcd",
            [
                str(etcd_dir / build.ETCD_COMMAND),
                f"--data-dir={self.folder / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",  # a test cluster: losing etcd's data on a power cut is fine
                "--log-level=warn",
            ],
        )
        self.etcd_url = f"http://127.0.0.1:{etcd_port}"
        self.wait_healthy(etcd, f"{self.etcd_url}/health", None, deadline)

        self.audit_log = self.folder / "audit.log"
        policy = self.folder / "audit-policy.yaml"
        policy.write_text(yaml.safe_dump(self.audit_policy))
        self.server = f"https://127.0.0.1:{api_port}"
        apiserver = self._start(
            "kube-apiserver",
            [
                str(kubernetes / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
                f"--cert-dir={self.folder / 'apiserver-certs'}",
                f"--tls-cert-file={pki.serving.cert}",
                f"--tls-private-key-file={pki.serving.key}",
                f"--client-ca-file={pki.ca.cert}",
                "--authorization-mode=RBAC",
                "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                f"--service-account-issuer={ISSUER}",
                f"--service-account-key-file={pki.service_account_pub}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                f"--requestheader-client-ca-file={pki.front_proxy_ca.cert}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki.front_proxy_client.cert}",
                f"--proxy-client-key-file={pki.front_proxy_client.key}",
                # No kube-proxy here: the aggregator dials an APIService's endpoints, not its ClusterIP.
                "--enable-aggregator-routing=true",
                f"--audit-policy-file={policy}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json",
                "--profiling=false",
                # An HPA may hold minReplicas 0 (alpha since 1.16, off by default; the API server's
                # validation is all it gates): a BatchedModel behind an InferencePool scales from zero
                # on the requests its endpoint picker holds (tests/cluster/test_scale_from_zero.py).
                "--feature-gates=HPAScaleToZero=true",
            ],
        )
        context = self.ssl_context()
        self.wait_healthy(apiserver, f"{self.server}/readyz", context, deadline)
        self.admin_kubeconfig = self.write_kubeconfig("admin", cert=pki.admin.cert, key=pki.admin.key)

        manager_config = self.write_kubeconfig(
            "controller-manager", cert=pki.controller_manager.cert, key=pki.controller_manager.key
        )
        manager_port = free_port()
        manager = self._start(
            "kube-controller-manager",
            [
                str(kubernetes / "kube-controller-manager"),
                f"--kubeconfig={manager_config}",
                f"--authentication-kubeconfig={manager_config}",
                f"--authorization-kubeconfig={manager_config}",
                "--bind-address=127.0.0.1",
                f"--secure-port={manager_port}",
                f"--cert-dir={self.folder / 'controller-manager-certs'}",
                f"--controllers={','.join(CONTROLLERS)}",
                f"--service-account-private-key-file={pki.service_account_key}",
                f"--root-ca-file={pki.ca.cert}",
                "--use-service-account-credentials=true",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                "--leader-elect=false",
                f"--horizontal-pod-autoscaler-sync-period={self.hpa_sync_period}",
                f"--node-monitor-grace-period={NODE_MONITOR_GRACE_PERIOD}",
                "--node-monitor-period=2s",
            ],
        )
        scheduler_config = self.write_kubeconfig("scheduler", cert=pki.scheduler.cert, key=pki.scheduler.key)
        scheduler_port = free_port()
        scheduler = self._start(
            "kube-scheduler",
            [
                str(kubernetes / "kube-scheduler"),
                f"--kubeconfig={scheduler_config}",
                f"--authentication-kubeconfig={scheduler_config}",
                f"--authorization-kubeconfig={scheduler_config}",
                "--bind-address=127.0.0.1",
                f"--secure-port={scheduler_port}",
                f"--cert-dir={self.folder / 'scheduler-certs'}",
                "--leader-elect=false",
            ],
        )
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE  # their self-signed serving certificates; health only
        self.wait_healthy(manager, f"https://127.0.0.1:{manager_port}/healthz", insecure, deadline)
        self.wait_healthy(scheduler, f"https://127.0.0.1:{scheduler_port}/healthz", insecure, deadline)

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()

    def _process(self, name: str) -> Process:
        return next(p for p in reversed(self.processes) if p.name == name)

    def stop_component(self, name: str) -> None:
        """Stop one component (SIGTERM, as a rolling control-plane upgrade does): `kube-apiserver`,
        `kube-controller-manager` (its garbage collector, HPA controller...), `kube-scheduler`."""
        self._process(name).stop()

    def start_component(self, name: str, timeout: float = 60.0) -> None:
        """Start a stopped component again with the flags it first had; return once it is healthy."""
        process = self._start(name, self.argv[name])
        url, context = self.health[name]
        self.wait_healthy(process, url, context, time.monotonic() + timeout)

    def stop_apiserver(self) -> None:
        self.stop_component("kube-apiserver")

    def start_apiserver(self, timeout: float = 60.0) -> None:
        self.start_component("kube-apiserver", timeout)

    def _etcd(self, method: str, body: dict[str, object]) -> dict[str, object]:
        request = urllib.request.Request(
            f"{self.etcd_url}/v3/{method}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            return dict(json.loads(answer.read()))

    def compact_etcd(self) -> int:
        """Compact etcd at its current revision: every older resourceVersion is gone, and a watch
        resumed from one is answered 410 Gone. Returns the revision."""
        header = self._etcd("kv/range", {"key": "Lw==", "limit": 1})["header"]
        revision = int(header["revision"])  # type: ignore[index]
        self._etcd("kv/compaction", {"revision": revision, "physical": True})
        return revision

    def audit_events(self) -> list[dict[str, object]]:
        """Every write the API server answered so far (see `AUDIT_POLICY`)."""
        if not self.audit_log.exists():
            return []
        return [json.loads(line) for line in self.audit_log.read_text().splitlines() if line.strip()]

    def env(self) -> dict[str, str]:
        """Environment for kubectl and helm as the cluster admin."""
        return {**os.environ, "KUBECONFIG": str(self.admin_kubeconfig)}
