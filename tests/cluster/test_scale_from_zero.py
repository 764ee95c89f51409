"""A model at zero replicas behind an InferencePool: a burst of requests held by the endpoint picker's flow
control while the first pod starts, the scale-up driven by the requests the picker holds.

Real: the operator's HPA (`minReplicas: 0`, and the External metric
`inference_extension_flow_control_queue_size` of the pool beside the pods' queue), the API server (with the
HPAScaleToZero gate, tests/cluster/controlplane.py), kube-controller-manager's HPA controller (this tier's 5 s
sync), Prometheus scraping the picker and the pods, prometheus-adapter with the chart's external rule, the
scheduler, the endpoint picker v1.5.0 built from its Go module with the chart's config, flags and RBAC (flow
control turned on, as README says a model at zero needs; here its bound is HELD requests and its TTL
HOLD_TTL_S instead of the chart's 10,000 and 600 s, so that a burst a test can send reaches the bound), and
carpool's runtime (a tiny random Llama on carpool's engine) in the pod the HPA asks for. Stand-ins: the
kubelet (it runs the pod as local processes, tests/cluster/kubelet.py) and the gateway (this test, in Envoy's
ext_proc protocol, tests/cluster/extproc.py, waiting for the picker's answer as long as the hold, as a
gateway's ext_proc `message_timeout` must).

The first test: no pod while the model is idle; a burst of HELD requests, half of them streaming, held while
the model has no pod; one more answered 429 by the picker at once (its bound; v1.5.0 sends no Retry-After with
it); the HPA scales the Deployment from 0 on the External metric (its event names the metric); every held
request answered 200 by the pod once it is Ready, the streams whole. The timeline from the burst to the first
token, phase by phase (the HPA's decision, scheduling, the container's start, the runtime's start, load and
warm-up from its `carpool_startup_duration_seconds`, the picker's dispatch), is written at the end of the
run's report. The second: a request for a pooled model that no autoscaler will start is held for the picker's
TTL, then answered 503, not left hanging.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from carpool.operator.resources.autoscaling import PICKER_QUEUE_METRIC
from carpool.runtime.metrics import STARTUP_PHASES
from tests.cluster import epp, metrics_api
from tests.cluster.api import Api, condition, wait_for
from tests.cluster.conftest import CHART, Operator, summary_line
from tests.cluster.controlplane import ControlPlane
from tests.cluster.epp import EndpointPicker
from tests.cluster.extproc import Decision, Gateway, Refusal
from tests.cluster.kubelet import TOLERATION, StandInKubelet
from tests.cluster.objects import kubectl_apply
from tests.cluster.test_endpoint_picker import _code_under_test, tiny_llama
from tests.cluster.test_hpa_controller import kubelet, metrics  # noqa: F401  (fixtures)

NAME = "zerochat"
SELECTOR = f"app.kubernetes.io/instance={NAME}"
HELD = 6
"""The picker's bound on held requests here (`flowControl.maxRequests`): the burst."""
HOLD_TTL_S = 300
"""The picker's hold (`flowControl.defaultRequestTTL`): far past this pod's start on a slow host."""
MESSAGE_TIMEOUT_S = HOLD_TTL_S + 30
MAX_RUNNING = 4
"""The pod's running-sequence limit, so its HPA's queue target: 6 held requests ask for 2 pods (1 allowed)."""
TOKENS = 16
HELD_QUEUE = PICKER_QUEUE_METRIC


def picker_config(held: int, ttl_s: int) -> dict[str, Any]:
    """The chart's default EndpointPickerConfig with flow control on (`featureGates: [flowControl]`, what
    README says a model at zero needs), this module's bound and hold."""
    config: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())["endpointPicker"]["config"]
    limits = {"maxRequests": str(held), "defaultRequestTTL": f"{ttl_s}s"}
    return {**config, "featureGates": ["flowControl"], "flowControl": limits}


def zero_model(namespace: str, folder: Path) -> dict[str, Any]:
    return {
        "apiVersion": "carpool.dev/v1alpha1",
        "kind": "BatchedModel",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "model": {"source": str(folder / "base"), "task": "generate", "engine": "carpool", "name": NAME},
            "generation": {"maxRunningSequences": MAX_RUNNING, "maxModelLen": 1024, "kvCacheTokens": 4096},
            "routing": "inferencePool",
            "autoscaling": {"minReplicas": 0, "maxReplicas": 1},
            "env": _code_under_test(),
            "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "1", "memory": "3Gi"}},
            "tolerations": [TOLERATION],
        },
    }


@pytest.fixture(scope="module")
def model_folder() -> Iterator[Path]:
    # Not under /tmp: the pods mount an emptyDir there (see test_endpoint_picker's pool).
    cache = Path.home() / ".cache" / "carpool"
    cache.mkdir(parents=True, exist_ok=True)
    folder = tiny_llama(Path(tempfile.mkdtemp(prefix="zero-tiny-llama-", dir=cache)))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@dataclass
class Held:
    """One request of the burst: sent through the gateway at once, answered whenever the picker lets it go."""

    index: int
    streaming: bool
    sent: float = 0.0
    decided: float | None = None
    first_token: float | None = None
    status: int | None = None
    text: str = ""
    lines: list[str] = field(default_factory=list)
    error: str | None = None

    def body(self) -> dict[str, Any]:
        prompt = f"{uuid.uuid4().hex} request {self.index} of a burst at zero replicas"
        return {
            "model": NAME,
            "prompt": prompt,
            "max_tokens": TOKENS,
            "temperature": 0,
            "stream": self.streaming,
        }

    def run(self, gateway: Gateway, http: httpx.Client) -> None:
        self.sent = time.monotonic()
        try:
            decision = gateway.pick(self.body())
            self.decided = time.monotonic()
            if isinstance(decision, Refusal):
                self.status = decision.status
                self.text = decision.body
                return
            self._forward(decision, http)
        except Exception as exc:
            self.error = repr(exc)

    def _forward(self, decision: Decision, http: httpx.Client) -> None:
        if not self.streaming:
            answer = decision.forward(http)
            self.first_token = time.monotonic()
            self.status = answer.status_code
            self.text = answer.text
            return

        def on_line(line: str) -> None:
            if self.first_token is None and line.startswith("data: {"):
                self.first_token = time.monotonic()

        self.status, self.lines = decision.forward_streaming(http, on_line)

    def answered(self) -> str | None:
        """What is wrong with the answer, if anything."""
        if self.error is not None or self.status != 200:
            return f"request {self.index}: {self.status} {self.error or self.text[:300]}"
        if self.streaming:
            events = [line.removeprefix("data: ") for line in self.lines if line.startswith("data: ")]
            if not events or events[-1] != "[DONE]":
                return f"stream {self.index} did not end with [DONE]: {self.lines[-3:]}"
            chunks = [json.loads(event) for event in events[:-1]]
            if not any(chunk["choices"] and chunk["choices"][0]["text"] for chunk in chunks):
                return f"stream {self.index} carried no text: {chunks}"
            return None
        if not json.loads(self.text)["choices"][0]["text"]:
            return f"request {self.index} carried no text: {self.text}"
        return None


def held_now(picker: EndpointPicker) -> float:
    """Requests the picker's flow control holds (its own gauge, every flow)."""
    return sum(value for _, value in picker.metrics().get(HELD_QUEUE, []))


def _stamp(value: str | None) -> float | None:
    """A Kubernetes timestamp as epoch seconds."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() if value else None


def _startup_phases(http: httpx.Client, pod: dict[str, Any]) -> dict[str, float]:
    """The runtime's own account of its start: `carpool_startup_duration_seconds` by phase."""
    answer = http.get(f"http://{pod['status']['podIP']}:8000/metrics")
    answer.raise_for_status()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            if sample.name == "carpool_startup_duration_seconds_sum":
                found[sample.labels["phase"]] = sample.value
    return found


def _phase(api: Api, namespace: str) -> str | None:
    model = api.get("BatchedModel", namespace, NAME) or {}
    phase: str | None = (model.get("status") or {}).get("phase")
    return phase


def _rescales(api: Api, namespace: str) -> list[dict[str, Any]]:
    return [
        event
        for event in api.list("Event", namespace)
        if event["involvedObject"]["kind"] == "HorizontalPodAutoscaler"
        and event["reason"] == "SuccessfulRescale"
    ]


def test_a_burst_at_zero_replicas_is_held_until_the_first_pod_answers_it(
    api: Api,
    admin_env: dict[str, str],
    control_plane: ControlPlane,
    operator: Operator,
    kubelet: StandInKubelet,  # noqa: F811
    metrics: metrics_api.MetricsApi,  # noqa: F811
    model_folder: Path,
) -> None:
    epp.install_crds(control_plane, api)
    namespace = f"zero-{uuid.uuid4().hex[:6]}"
    api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    picker: EndpointPicker | None = None
    gateway: Gateway | None = None
    http = httpx.Client(timeout=httpx.Timeout(60, read=None))
    try:
        kubectl_apply(admin_env, zero_model(namespace, model_folder))
        wait_for("the InferencePool", lambda: api.get("InferencePool", namespace, NAME), timeout=60)
        hpa = wait_for("the HPA", lambda: api.get("HorizontalPodAutoscaler", namespace, NAME), timeout=60)
        assert hpa["spec"]["minReplicas"] == 0
        assert [m["type"] for m in hpa["spec"]["metrics"]] == ["Pods", "External"]
        deployment = wait_for("the Deployment", lambda: api.get("Deployment", namespace, NAME), timeout=60)
        assert deployment["spec"]["replicas"] == 0
        assert api.list("Pod", namespace, SELECTOR) == []
        wait_for("the model's phase Idle", lambda: _phase(api, namespace) == "Idle", timeout=60)

        picker, _ = epp.start(
            control_plane, api, NAME, namespace, values={"config": picker_config(HELD, HOLD_TTL_S)}
        )
        metrics.scrape_picker(picker.metrics_port, namespace, picker.pod)
        gateway = Gateway(picker.target, control_plane.pki.ca.cert, message_timeout_s=MESSAGE_TIMEOUT_S)

        burst = [Held(index, streaming=index % 2 == 0) for index in range(HELD)]
        began = time.monotonic()
        began_wall = time.time()
        threads = [threading.Thread(target=h.run, args=(gateway, http), daemon=True) for h in burst]
        for thread in threads:
            thread.start()
        wait_for(f"the picker to hold the {HELD} requests", lambda: held_now(picker) == HELD, timeout=60)
        assert all(h.status is None and h.error is None for h in burst), [h.answered() for h in burst]
        ready_pods = [
            p
            for p in api.list("Pod", namespace, SELECTOR)
            if (condition(p, "Ready") or {}).get("status") == "True"
        ]
        assert not ready_pods, "a pod was Ready before the burst could be held at zero"

        # Past the bound: refused at once, while the burst is still held.
        over = gateway.pick(Held(HELD, streaming=False).body())
        assert isinstance(over, Refusal), f"the request past the bound was routed: {over}"
        assert over.status == 429, over
        assert held_now(picker) == HELD

        def answered() -> bool:
            for pod in api.list("Pod", namespace, SELECTOR):
                for status in pod["status"].get("containerStatuses") or []:
                    if status["restartCount"]:
                        raise AssertionError(f"the pod {pod['metadata']['name']} restarted: {status}")
            if kubelet.errors:
                raise AssertionError(f"the kubelet stand-in failed: {kubelet.errors[-5:]}")
            return not any(thread.is_alive() for thread in threads)

        wait_for("every held request answered", answered, timeout=MESSAGE_TIMEOUT_S + 60, every=1)
        problems = [problem for h in burst if (problem := h.answered()) is not None]
        assert not problems, problems
        assert all(h.decided is not None for h in burst)

        # The scale-up came from the picker's queue: the HPA's event names the External metric.
        rescales = _rescales(api, namespace)
        assert any(f"external metric {HELD_QUEUE}" in e["message"] for e in rescales), rescales
        pods = api.list("Pod", namespace, SELECTOR)
        assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
        pod = pods[0]

        # The timeline, from the burst to the first token.
        phases = _startup_phases(http, pod)
        assert set(phases) == set(STARTUP_PHASES), phases
        first_decision = min(h.decided for h in burst if h.decided is not None)
        first_token = min(h.first_token for h in burst if h.first_token is not None)
        rescaled = min(_stamp(e.get("lastTimestamp") or e.get("eventTime")) or 0.0 for e in rescales)
        created = _stamp(pod["metadata"]["creationTimestamp"])
        scheduled = _stamp((condition(pod, "PodScheduled") or {}).get("lastTransitionTime"))
        started = _stamp(pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"])
        ready = _stamp((condition(pod, "Ready") or {}).get("lastTransitionTime"))
        marks = {
            "HPA scaled 0->1": rescaled,
            "pod created": created,
            "scheduled": scheduled,
            "container started": started,
            "Ready": ready,
        }
        line = ", ".join(f"{name} +{at - began_wall:.0f} s" for name, at in marks.items() if at is not None)
        summary_line(
            f"scale from zero ({HELD} held, Kubernetes' timestamps in whole seconds): {line}; runtime "
            f"start {phases['start']:.1f} s, load {phases['load']:.1f} s, warm-up {phases['warmup']:.1f} s; "
            f"first request dispatched +{first_decision - began:.1f} s, "
            f"first token +{first_token - began:.1f} s"
        )
    finally:
        if gateway is not None:
            gateway.close()
        if picker is not None:
            picker.stop()
        http.close()
        api.delete("Namespace", None, namespace)


SHORT_TTL_S = 3
"""The hold of the second test's picker: what a request waits for a pod that never comes, then 503."""


def test_a_request_held_past_the_hold_is_answered_503_not_left_hanging(
    api: Api,
    admin_env: dict[str, str],
    control_plane: ControlPlane,
    operator: Operator,
    model_folder: Path,
) -> None:
    """A pooled model with no pod and nothing to start one (autoscaling off at 0 replicas): the picker
    holds a request for its TTL, then answers 503, so a client is never left waiting on a pool that stays
    empty (the chart's TTL is 600 s; here 3 s)."""
    epp.install_crds(control_plane, api)
    namespace = f"zero-ttl-{uuid.uuid4().hex[:6]}"
    api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    picker: EndpointPicker | None = None
    gateway: Gateway | None = None
    try:
        body = zero_model(namespace, model_folder)
        body["spec"]["autoscaling"] = {"enabled": False}
        body["spec"]["replicas"] = 0
        kubectl_apply(admin_env, body)
        wait_for("the InferencePool", lambda: api.get("InferencePool", namespace, NAME), timeout=60)
        picker, _ = epp.start(
            control_plane, api, NAME, namespace, values={"config": picker_config(HELD, SHORT_TTL_S)}
        )
        gateway = Gateway(picker.target, control_plane.pki.ca.cert, message_timeout_s=SHORT_TTL_S + 30)
        sent = time.monotonic()
        answer = gateway.pick(Held(0, streaming=True).body())
        waited = time.monotonic() - sent
        assert isinstance(answer, Refusal), f"routed with no pod in the pool: {answer}"
        assert answer.status == 503 and "timed out in queue" in answer.body, answer
        assert waited >= SHORT_TTL_S, f"answered after {waited:.1f} s, before the hold ran out"
        assert held_now(picker) == 0
        assert api.list("Pod", namespace, SELECTOR) == []
    finally:
        if gateway is not None:
            gateway.close()
        if picker is not None:
            picker.stop()
        api.delete("Namespace", None, namespace)
