"""Autoscaling on queue depth, end to end: the chain a user installs, every link real but the kubelet.

runtime pods (local processes, tests/cluster/kubelet.py) export `carpool_queue_depth` -> Prometheus
(built from its Go module) discovers them from the API server and scrapes them -> prometheus-adapter,
with the rules the chart ships, serves it as the aggregated custom metrics API
(tests/cluster/metrics_api.py) -> the HPA controller in kube-controller-manager reads it and scales the
Deployment the operator made -> the ReplicaSet controller makes pods, the scheduler binds them to the
stand-in's Node -> they load and warm up before their readiness probe passes, and only then does the
EndpointSlice controller list them -> on scale down, their endpoints leave first, the preStop hook
waits, and SIGTERM drains them.

The Node exists only while this module runs (its fixture deletes it), and is tainted: other tests' pods
stay pending, as they expect.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.cluster import kubeproxy, metrics_api
from tests.cluster.api import Api, condition, run, wait_for
from tests.cluster.conftest import Operator
from tests.cluster.controlplane import ControlPlane
from tests.cluster.kubelet import TOLERATION, StandInKubelet
from tests.cluster.kubeproxy import KubeProxy
from tests.cluster.objects import kubectl_apply, wait_for_children, wait_for_condition
from tests.cluster.podnet import POD_RANGE
from tests.cluster.traffic import Endpoints, Traffic
from tests.e2e.pods import PROBE_MARK, cpu_body, first_index

NODE = "carpool-local"
CAPACITY = {"cpu": "16", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": "1"}
NAME = "minilm"
SELECTOR = f"app.kubernetes.io/instance={NAME}"
HEAVY_CLIENTS = 96
"""Closed-loop clients under load: with three pods, still about 16 inputs queued per pod (batches of 16)."""
LIGHT_CLIENTS = 6
LIGHT_THINK_S = 1.0
LIGHT_SESSION_REQUESTS = 1000
"""After the load: a trickle of new clients (6 sessions, a pause of 1 s after each answer: one pod's work,
so that the HPA does not scale up again) that keeps the removed pods' drains honest: each session's one
pooled connection goes where kube-proxy sends it, among the three pods, and stays there for the whole
phase, so the pods removed hold some, in flight or idle between two requests, when their SIGTERM comes
(all six on the pod that stays: a chance of (1/3)^6, 0.14%, and the test then fails saying so)."""
TARGET_QUEUE_DEPTH = 2
BEHAVIOR = {
    "scaleUp": {
        "stabilizationWindowSeconds": 0,
        "selectPolicy": "Max",
        "policies": [{"type": "Pods", "value": 2, "periodSeconds": 15}],
    },
    "scaleDown": {
        "stabilizationWindowSeconds": 20,
        "selectPolicy": "Max",
        "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}],
    },
}
"""Short windows and periods, so that a test run sees both directions in minutes (the operator's default
waits five minutes before scaling down)."""
PRE_STOP_SECONDS = 10
"""The removed pods' preStop pause (`server.preStopSeconds`): longer than kube-proxy took here."""
POD_READY_TIMEOUT_S = 600.0
SCALE_TIMEOUT_S = 300.0


def scaled_model(namespace: str, *, max_replicas: int = 3) -> dict[str, Any]:
    """The e2e tier's CPU MiniLM (tests/e2e/pods.py `cpu_body`): HPA engine from 1 to 3 replicas on a small
    queue-depth target, tolerating the stand-in's Node; no model cache claim (no PersistentVolume here:
    the packaged model loads from the image)."""
    body = cpu_body(max_queue_size=256, target_queue_depth=TARGET_QUEUE_DEPTH)
    body["metadata"] = {"name": NAME, "namespace": namespace}
    spec = body["spec"]
    spec["model"].pop("cache", None)
    spec["batching"]["defaultTimeoutS"] = 60  # a slow shared machine must not turn queueing into 504s
    spec["tolerations"] = [TOLERATION]
    # kube-proxy's rule update once took 6.5 s here (an `iptables-restore` on the loaded 2-core host),
    # past the default pause of 5 s: a pooled client reconnecting then would still reach a draining pod.
    spec["server"] = {"preStopSeconds": PRE_STOP_SECONDS}
    spec["autoscaling"].update({"minReplicas": 1, "maxReplicas": max_replicas, "behavior": BEHAVIOR})
    return body


@pytest.fixture(scope="module")
def kubelet(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StandInKubelet]:
    client = Api(control_plane.server, control_plane.ssl_context())
    stand_in = StandInKubelet(client, NODE, tmp_path_factory.mktemp("kubelet"), CAPACITY)
    try:
        yield stand_in.start()
    finally:
        stand_in.stop()
        client.close()


@pytest.fixture(scope="module")
def kube_proxy(control_plane: ControlPlane, kubelet: StandInKubelet) -> Iterator[KubeProxy]:
    """kube-proxy for the stand-in's Node (registered first: kube-proxy reads its addresses at start)."""
    proxy = kubeproxy.start(control_plane, NODE, str(POD_RANGE))
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture(scope="module")
def metrics(
    control_plane: ControlPlane, api: Api, admin_env: dict[str, str], kubelet: StandInKubelet
) -> Iterator[metrics_api.MetricsApi]:
    stack = metrics_api.start(control_plane, api, admin_env, kubelet.network)
    try:
        yield stack
    finally:
        stack.stop()


@dataclass
class Sample:
    at: float
    deployment: int | None
    ready: int
    desired: int | None
    metric: str
    model_replicas: int | None
    autoscaling: str


@dataclass
class Timeline:
    """Replicas over time, sampled every second: the Deployment's, the ready pods', the HPA's, the
    BatchedModel's status and its Autoscaling condition."""

    api: Api
    namespace: str
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="timeline", daemon=True)

    def _sample(self) -> None:
        deployment = self.api.get("Deployment", self.namespace, NAME) or {}
        hpa = self.api.get("HorizontalPodAutoscaler", self.namespace, NAME) or {}
        model = self.api.get("BatchedModel", self.namespace, NAME) or {}
        pods = self.api.list("Pod", self.namespace, SELECTOR)
        ready = sum(1 for p in pods if (condition(p, "Ready") or {}).get("status") == "True")
        current = [
            m.get("pods", {}).get("current", {}).get("averageValue")
            for m in (hpa.get("status") or {}).get("currentMetrics") or []
        ]
        scaling = condition(model, "Autoscaling")
        self.samples.append(
            Sample(
                at=time.monotonic() - self.started,
                deployment=(deployment.get("spec") or {}).get("replicas"),
                ready=ready,
                desired=(hpa.get("status") or {}).get("desiredReplicas"),
                metric=str(current[0]) if current and current[0] is not None else "-",
                model_replicas=(model.get("status") or {}).get("replicas"),
                autoscaling=f"{scaling['status']} {scaling['reason']}" if scaling else "-",
            )
        )

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self._sample()
            except Exception as exc:  # a missed sample is not a failure
                sys.stderr.write(f"timeline: {exc}\n")

    def start(self) -> Timeline:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def changes(self) -> list[Sample]:
        """The samples where something but the metric changed (the README's table)."""
        kept: list[Sample] = []
        for sample in self.samples:
            key = (sample.deployment, sample.ready, sample.desired, sample.model_replicas, sample.autoscaling)
            if not kept or key != (
                kept[-1].deployment,
                kept[-1].ready,
                kept[-1].desired,
                kept[-1].model_replicas,
                kept[-1].autoscaling,
            ):
                kept.append(sample)
        return kept

    def table(self) -> str:
        lines = [
            "| t (s) | Deployment replicas | ready pods | HPA desired | queue depth (HPA, average) "
            "| BatchedModel replicas | Autoscaling |",
            "|---|---|---|---|---|---|---|",
        ]
        for s in self.changes():
            lines.append(
                f"| {s.at:.0f} | {s.deployment} | {s.ready} | {s.desired} | {s.metric} "
                f"| {s.model_replicas} | {s.autoscaling} |"
            )
        return "\n".join(lines)


def _pods(api: Api, namespace: str) -> list[dict[str, Any]]:
    return api.list("Pod", namespace, SELECTOR)


def _ready_pods(api: Api, namespace: str) -> list[str]:
    return [
        p["metadata"]["name"]
        for p in _pods(api, namespace)
        if (condition(p, "Ready") or {}).get("status") == "True"
    ]


def _kubelet_healthy(kubelet: StandInKubelet) -> None:
    if kubelet.errors:
        raise AssertionError(f"the kubelet stand-in failed: {kubelet.errors[-5:]}")
    for running in kubelet.history:
        prober = running.prober
        if prober is not None and prober.startup_failed:
            raise AssertionError(f"{running.name} failed its startup probe:\n{running.local.log_tail()}")


def _chain(api: Api, metrics: metrics_api.MetricsApi, namespace: str) -> str:
    return "\n".join(metrics_api.chain(api, metrics, namespace, NAME, SELECTOR))


def test_the_hpa_controller_scales_a_batched_model_on_queue_depth_and_back_without_losing_a_request(
    api: Api,
    admin_env: dict[str, str],
    operator: Operator,
    namespace: str,
    kubelet: StandInKubelet,
    metrics: metrics_api.MetricsApi,
    control_plane: ControlPlane,
    kube_proxy: KubeProxy,
) -> None:
    kubectl_apply(admin_env, scaled_model(namespace))
    wait_for_children(api, namespace, NAME, kinds=("Deployment", "Service", "HorizontalPodAutoscaler"))
    timeline = Timeline(api, namespace).start()

    def first_ready() -> list[str] | None:
        _kubelet_healthy(kubelet)
        ready = _ready_pods(api, namespace)
        if len(ready) != 1:
            raise AssertionError(
                f"ready pods {ready}; pods {[p['metadata']['name'] for p in _pods(api, namespace)]}"
            )
        return ready

    (first,) = wait_for(
        "the first replica to load, warm up and turn Ready", first_ready, timeout=POD_READY_TIMEOUT_S, every=1
    )

    # Before any load, every link holds: scraped, in Prometheus, in the custom metrics API, read by the HPA.
    def every_link() -> list[str]:
        lines = metrics_api.chain(api, metrics, namespace, NAME, SELECTOR)
        if any(line.startswith("BROKEN") for line in lines):
            raise AssertionError("\n".join(lines))
        return lines

    wait_for("every link from the pods' queue depth to the HPA controller", every_link, timeout=180, every=2)

    service = api.get("Service", namespace, NAME) or {}
    (port,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == "http"]
    url = f"http://{service['spec']['clusterIP']}:{port}"

    def through_the_cluster_ip() -> bool:
        with httpx.Client(base_url=url, timeout=5) as client:
            answer = client.get("/v2/health/ready")
        if answer.status_code != 200:
            raise AssertionError(f"{url}: {answer.status_code}")
        return True

    # kube-proxy has programmed the Service (the ClusterIP is no address of this host's otherwise).
    wait_for(f"the Service's ClusterIP {url} to answer", through_the_cluster_ip, timeout=60, every=0.5)
    endpoints = Endpoints(
        api=Api(control_plane.server, control_plane.ssl_context()), namespace=namespace, service=NAME
    ).start()
    host = f"{NAME}.{namespace}.svc"
    traffic = Traffic(url, host, HEAVY_CLIENTS).start()
    light: Traffic | None = None
    served: dict[str, int] = {}
    try:

        def scaled_up() -> int | None:
            _kubelet_healthy(kubelet)
            deployment = api.get("Deployment", namespace, NAME) or {}
            replicas = int((deployment.get("spec") or {}).get("replicas") or 0)
            if replicas < 3:
                raise AssertionError(
                    f"Deployment replicas {replicas}; the chain:\n{_chain(api, metrics, namespace)}"
                )
            return replicas

        wait_for(
            "the HPA controller to scale the Deployment to 3 under load",
            scaled_up,
            timeout=SCALE_TIMEOUT_S,
            every=2,
        )

        def all_serving() -> list[str] | None:
            _kubelet_healthy(kubelet)
            ready = _ready_pods(api, namespace)
            # What each pod answered, by its own count: kube-proxy spread the pooled connections.
            served.update({pod: endpoints.answered(pod) or 0 for pod in ready})
            if len(ready) < 3 or any(served[pod] == 0 for pod in ready):
                raise AssertionError(f"ready {ready}, answered per pod {served}")
            return ready

        wait_for(
            "three Ready replicas, each answering requests", all_serving, timeout=POD_READY_TIMEOUT_S, every=1
        )
        bm = run("kubectl", "get", "bm", NAME, "-n", namespace, "-o", "wide", env=admin_env).stdout
        # The heavy clients leave, new ones come.
        light = Traffic(
            url, host, LIGHT_CLIENTS, think_s=LIGHT_THINK_S, session_requests=LIGHT_SESSION_REQUESTS
        ).start()
        traffic.stop()

        def scaled_down() -> bool:
            _kubelet_healthy(kubelet)
            deployment = api.get("Deployment", namespace, NAME) or {}
            replicas = (deployment.get("spec") or {}).get("replicas")
            pods = [p["metadata"]["name"] for p in _pods(api, namespace)]
            if replicas != 1 or len(pods) != 1:
                hpa = api.get("HorizontalPodAutoscaler", namespace, NAME) or {}
                raise AssertionError(
                    f"Deployment replicas {replicas}, pods {pods}, HPA status {hpa.get('status')}"
                )
            return True

        wait_for(
            "the HPA controller to scale back to 1 once the load stopped, and the removed pods to go",
            scaled_down,
            timeout=SCALE_TIMEOUT_S,
            every=2,
        )
    finally:
        traffic.stop()
        if light is not None:
            light.stop()
        endpoints.stop()
        timeline.stop()
        sys.stderr.write(f"\nreplica timeline:\n{timeline.table()}\n")
    bm_after = run("kubectl", "get", "bm", NAME, "-n", namespace, "-o", "wide", env=admin_env).stdout

    # The endpoint follower read every EndpointSlice change it was told of (a failed read would have
    # left the load generator on stale endpoints).
    assert endpoints.errors == [], endpoints.errors[:10]
    # Every request the pooled clients sent through the ClusterIP was answered 200: none lost (no reset,
    # no connection closed under a request), none refused, no 5xx; the removed pods' keep-alive
    # connections were handed over by their drain.
    assert light is not None
    statuses = traffic.statuses() + light.statuses()
    failures = [o for o in traffic.outcomes + light.outcomes if o.status != 200]
    assert set(statuses) == {"200"}, f"{dict(statuses)}; failures {failures[:10]}"
    # And the removed pods did hold pooled connections: their drains ended some, and the sessions went on
    # over new ones (`Traffic.reconnects`).
    handed_over = len(light.reconnects)
    assert handed_over > 0, "no session reconnected during the scale-down: the drain was not exercised"

    # Each new pod: warm-up finished before its readiness probe passed; it answered nothing while its
    # endpoint was not ready (read from the pod while the slices listed it so), then it answered.
    # (A pod the HPA made and removed again before it was ready, on a second scale-up, does not count.)
    new = [
        r
        for r in kubelet.history
        if r.namespace == namespace and r.name != first and r.name in endpoints.first_ready
    ]
    assert len(new) >= 2, [r.name for r in kubelet.history]
    for running in new:
        lines = running.local.messages()
        finished = first_index(lines, lambda line: line.startswith("warm-up finished"))
        marked = first_index(lines, lambda line: line.startswith(PROBE_MARK) and "answered 200" in line)
        assert finished is not None and marked is not None and finished < marked, lines
        assert running.name in endpoints.checked_not_ready, (running.name, endpoints.checked_not_ready)
        assert served.get(running.name, 0) > 0, served
    # The removed pods went by the kubelet's way: preStop, then SIGTERM, then exit 0 after the drain.
    removed = [
        r for r in kubelet.history if r.namespace == namespace and r.name not in _ready_pods(api, namespace)
    ]
    assert len(removed) >= 2
    for running in removed:
        assert running.gone.is_set(), running.name
        marks = [line for line in running.local.messages() if line.startswith(PROBE_MARK)]
        paused = f"preStop ['sleep', '{PRE_STOP_SECONDS}']"
        assert any(paused in m for m in marks) and any("SIGTERM" in m for m in marks), marks
        assert running.local.proc is not None and running.local.proc.returncode == 0, running.local.log_tail()

    # The BatchedModel followed: status.replicas went 1 -> 3 -> 1, the Autoscaling condition was there
    # (the HPA's own reason) in every sample after the HPA first reported, and `kubectl get bm` showed it.
    replicas = [s.model_replicas for s in timeline.samples]
    assert 3 in replicas and replicas[-1] == 1, timeline.table()
    reported = [s.autoscaling for s in timeline.samples if s.autoscaling != "-"]
    assert reported and all(
        a.startswith("True")
        for a in reported[reported.index(next(a for a in reported if a.startswith("True"))) :]
    ), timeline.table()
    header, row = bm.splitlines()[:2]
    assert header.split()[:3] == ["NAME", "READY", "REPLICAS"] and row.split()[2] == "3", bm
    assert bm_after.splitlines()[1].split()[2] == "1", bm_after
    sys.stderr.write(
        f"requests through {url}: {dict(statuses)}; heavy: {traffic.sessions} sessions, "
        f"{traffic.connections} connections; light: {light.sessions} sessions, {light.connections} "
        f"connections, {handed_over} reconnects, {light.closing} answers with Connection: close; "
        f"answered per pod (at 3 ready) {served}\n{bm}{bm_after}"
    )


def test_a_pod_asking_for_more_gpus_than_the_node_has_is_unschedulable_by_the_schedulers_word(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str, kubelet: StandInKubelet
) -> None:
    """The stand-in's Node has one `nvidia.com/gpu`: a BatchedModel asking for two per pod stays pending,
    and its status carries kube-scheduler's own message."""
    body = scaled_model(namespace)
    body["spec"]["resources"]["limits"]["nvidia.com/gpu"] = 2
    kubectl_apply(admin_env, body)
    degraded = wait_for_condition(api, namespace, NAME, "Degraded", reason="Unschedulable", timeout=120)
    assert "Insufficient nvidia.com/gpu" in degraded["message"], degraded
    assert not [r for r in kubelet.history if r.namespace == namespace]


def test_a_runtime_that_cannot_start_shows_its_restarts_and_its_own_error_in_the_status(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str, kubelet: StandInKubelet
) -> None:
    """The runtime refuses a bad setting at start-up and writes why to its termination log; the stand-in
    restarts it with back-off and copies that into `lastState.terminated.message`, as the kubelet does, and
    the operator's Degraded condition says CrashLoopBackOff with the runtime's own words."""
    body = scaled_model(namespace)
    body["spec"]["env"] = [{"name": "CARPOOL_BATCHING__MAX_BATCH_SIZE", "value": "sixteen"}]
    kubectl_apply(admin_env, body)
    degraded = wait_for_condition(
        api, namespace, NAME, "Degraded", reason="CrashLoopBackOff", timeout=POD_READY_TIMEOUT_S
    )
    assert "max_batch_size" in degraded["message"], degraded
    (pod,) = _pods(api, namespace)
    (status,) = pod["status"]["containerStatuses"]
    assert status["restartCount"] >= 1 and not status["ready"], status
    terminated = status["lastState"]["terminated"]
    assert terminated["exitCode"] != 0 and "max_batch_size" in terminated["message"], terminated


def test_the_hpa_controller_reads_a_latency_targets_saturation_through_the_adapter(
    api: Api,
    admin_env: dict[str, str],
    operator: Operator,
    namespace: str,
    kubelet: StandInKubelet,
    metrics: metrics_api.MetricsApi,
) -> None:
    """`autoscaling.target.latency`: the operator's HPA asks for `carpool_slo_saturation`, the pod exports
    it (0: idle), the chart's adapter rule serves it from Prometheus, and the HPA controller reads it and
    holds the idle model at one replica."""
    body = scaled_model(namespace)
    autoscaling = body["spec"]["autoscaling"]
    del autoscaling["targetQueueDepth"]
    autoscaling["target"] = {"latency": {"percentile": 99, "seconds": 0.5}}
    kubectl_apply(admin_env, body)
    wait_for_children(api, namespace, NAME, kinds=("Deployment", "HorizontalPodAutoscaler"))

    def one_ready() -> list[str] | None:
        _kubelet_healthy(kubelet)
        return _ready_pods(api, namespace) or None

    wait_for("the replica to load, warm up and turn Ready", one_ready, timeout=POD_READY_TIMEOUT_S, every=1)

    def every_link() -> list[str]:
        lines = metrics_api.chain(api, metrics, namespace, NAME, SELECTOR)
        if any(line.startswith("BROKEN") for line in lines):
            raise AssertionError("\n".join(lines))
        return lines

    lines = wait_for("every link from the pod's saturation to the HPA", every_link, timeout=180, every=2)
    assert "ok 3 the custom metrics API serves carpool_slo_saturation" in "\n".join(lines), lines
    hpa = api.get("HorizontalPodAutoscaler", namespace, NAME) or {}
    (current,) = hpa["status"]["currentMetrics"]
    assert current["pods"]["metric"]["name"] == "carpool_slo_saturation"
    assert current["pods"]["current"]["averageValue"] == "0", current  # idle: no load, no queue
    assert hpa["status"]["desiredReplicas"] == 1
